"""Text for evaluations: the default corpus as token ids and the passkey prompts.

`corpus_tokens` and `held_out_tokens` join the documents of `kvattn.training.data`'s
default corpus (all of them, or the validation split) with blank lines and tokenize the
text once; `document_tokens` tokenizes document by document without special tokens (the
benchmarks' prompts). `passkey_prompt` is the one passkey builder (Mohtashami and Jaggi
2023's retrieval task: a 5-digit key in repeated filler, then the question).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvattn.training import data as data_lib

FILLER = ("The grass is green. The sky is blue. The sun is yellow. Here we go. "
          "There and back again. ")
QUESTION = "What is the pass key? The pass key is"

def corpus_tokens(tokenizer, count: int) -> np.ndarray:
  """The first `count` tokens of the default corpus of `kvattn.training.data` (documents joined)."""
  ids: list[int] = []
  budget = 4096
  while len(ids) < count:
    budget *= 4
    docs = data_lib.load_corpus(max_bytes=budget)
    text = "\n\n".join(d.data.decode("utf-8") for d in docs)
    ids = tokenizer.encode(text)
  return np.asarray(ids[:count], np.int32)


def passkey_prompt(tokenizer, context: int, depth: float, key: int) -> list[int]:
  """Token ids of a passkey prompt of about `context` tokens, the needle at `depth`."""
  needle = f" The pass key is {key}. Remember it. {key} is the pass key. "
  fixed = len(tokenizer.encode(needle + QUESTION))
  per = len(tokenizer.encode(FILLER * 8)) / 8
  reps = max(1, int((context - fixed) / per))
  before = int(round(depth * reps))
  return tokenizer.encode(FILLER * before + needle + FILLER * (reps - before) + QUESTION)


def held_out_tokens(tokenizer, count: int) -> np.ndarray:
  """The first `count` tokens of the validation documents of kvattn.training.data's default corpus.

  Raises:
    ValueError: the corpus holds fewer than `count` held-out tokens.
  """
  budget, ids = 2**20, []
  while len(ids) < count:
    docs = data_lib.load_corpus(max_bytes=budget)
    _, val = data_lib.split_documents(docs)
    ids = tokenizer.encode("\n\n".join(d.data.decode("utf-8") for d in val))
    if budget >= 2**26:
      raise ValueError(f"the default corpus holds {len(ids)} held-out tokens; asked {count}")
    budget *= 4
  return np.asarray(ids[:count], np.int32)


def document_tokens(tok, num_tokens: int, *, skip_tokens: int = 0) -> np.ndarray:
  """`i32[num_tokens]` ids of the default corpus's text from token `skip_tokens` on.

  `tok` is the model's tokenizer, or None for byte-level ids (`kvattn.training.data.encode`).
  """
  ids: list[int] = []
  for doc in data_lib.load_corpus(None, max_bytes=4 * 2**20):
    text = doc.data.decode("utf-8", errors="replace")
    ids.extend(tok.encode(text, add_special_tokens=False) if tok is not None
               else data_lib.encode(text).tolist())
    if len(ids) >= skip_tokens + num_tokens:
      return np.asarray(ids[skip_tokens:skip_tokens + num_tokens], np.int32)
  raise ValueError(f"the default corpus holds {len(ids)} tokens; need "
                   f"{skip_tokens + num_tokens}")


def passkey_prompts(tokenizer: Any, context: int, samples: int, seed: int
                    ) -> tuple[np.ndarray, np.ndarray, list[str]]:
  """`(prompts i32[samples, T] right-padded, lengths i32[samples], keys)`: `samples` prompts of
  `passkey_prompt` with random 5-digit keys at random depths (`seed`)."""
  rng = np.random.default_rng(seed)
  rows, keys = [], []
  for _ in range(samples):
    key = int(rng.integers(10000, 100000))
    rows.append(passkey_prompt(tokenizer, context, float(rng.uniform()), key))
    keys.append(str(key))
  lengths = np.array([len(r) for r in rows], np.int32)
  prompts = np.zeros((samples, lengths.max()), np.int32)
  for b, r in enumerate(rows):
    prompts[b, :len(r)] = r
  return prompts, lengths, keys
