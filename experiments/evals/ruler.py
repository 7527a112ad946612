"""A RULER-style long-context suite, built locally and seeded.

Hsieh et al. 2024, "RULER: What's the Real Context Size of Your Long-Context Language
Models?" (arXiv 2404.06654): needle-in-a-haystack with one needle, several keys, several
values and several queries; variable tracking; common- and frequent-word extraction. The
haystack is Python's own documentation (`pydoc_data.topics`, shipped with Python) instead
of Paul Graham's essays; the question follows the context, as in RULER and kvpress; an
answer is scored by RULER's `string_match_all`: the fraction of the references found in
the greedy output (case-insensitive substring).

    examples = [make(task, tokenizer, length, seed) for task in TASKS]
    ids = encode(tokenizer, example, chat=True)          # list[int], about `length` tokens
    score(example, tokenizer.decode(greedy_ids))          # in [0, 1]
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import hashlib
import re
import string
from typing import Any, Callable, Sequence

import numpy as np

TASKS = ("niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery",
         "variable_tracking", "common_words", "frequent_words")
NUM_NEEDLES = 4  # keys (multikey, multiquery) or values (multivalue) per example
CHAIN_HOPS = 4  # variable tracking: VAR X1 = value, then 4 assignments X_i = X_{i-1}
NUM_COMMON, COMMON_REPEATS, RARE_REPEATS = 10, 30, 3  # RULER's cwe defaults
ZIPF_ALPHA = 2.0  # RULER's fwe default
TEMPLATE_ROOM = 48  # tokens left for a chat template's marks around the user turn
NEEDLE = "One of the special magic numbers for {key} is: {value}."
_ADJECTIVES = ("quiet", "brave", "amber", "lucky", "silent", "rapid", "frozen", "gentle",
               "hollow", "golden", "hidden", "narrow", "purple", "steady", "tidy", "wild")
_NOUNS = ("harbor", "falcon", "lantern", "meadow", "violin", "glacier", "orchard", "comet",
          "pepper", "canyon", "saddle", "marble", "thistle", "beacon", "walnut", "ribbon")


@dataclasses.dataclass(frozen=True)
class Example:
  """One task instance.

  Attributes:
    task: a name of `TASKS`.
    length: the target prompt length in tokens (context, question and answer prefix).
    seed: the seed it was drawn with.
    context: the long input.
    question: asked after the context.
    answer_prefix: the start of the answer, appended after the question (or after the
      chat template's generation prompt), as RULER does for every model.
    answers: the references; `score` is the fraction of them found in the output.
  """

  task: str
  length: int
  seed: int
  context: str
  question: str
  answer_prefix: str
  answers: tuple[str, ...]


@functools.lru_cache(maxsize=1)
def haystack_sentences() -> tuple[str, ...]:
  """Sentences of `pydoc_data.topics` (in sorted topic order) without digits, so no
  number in a haystack can be mistaken for a needle's."""
  from pydoc_data import topics  # pylint: disable=g-import-not-at-top
  out = []
  for name in sorted(topics.topics):
    text = re.sub(r"\s+", " ", topics.topics[name])
    for sentence in re.split(r"(?<=[.!?]) ", text):
      if 40 <= len(sentence) <= 300 and not re.search(r"\d", sentence):
        out.append(sentence.strip())
  return tuple(out)


@functools.lru_cache(maxsize=1)
def vocabulary() -> tuple[str, ...]:
  """Distinct lowercase English words (4 to 10 letters) of the haystack, sorted."""
  words = set()
  for sentence in haystack_sentences():
    words.update(re.findall(r"\b[a-z]{4,10}\b", sentence))
  return tuple(sorted(words))


def _rng(task: str, length: int, seed: int) -> np.random.Generator:
  return np.random.default_rng([TASKS.index(task), length, seed])


def _keys(rng: np.random.Generator, count: int) -> list[str]:
  pairs = rng.choice(len(_ADJECTIVES) * len(_NOUNS), size=count, replace=False)
  return [f"{_ADJECTIVES[p // len(_NOUNS)]}-{_NOUNS[p % len(_NOUNS)]}" for p in pairs]


def _numbers(rng: np.random.Generator, count: int) -> list[str]:
  return [str(v) for v in rng.choice(np.arange(1_000_000, 10_000_000), size=count,
                                     replace=False)]


def _largest(fits: Callable[[int], bool]) -> int:
  """The largest n >= 1 with `fits(n)` (1 if none), for `fits` true up to some n and false
  after: doubling, then bisection."""
  lo, hi = 1, 2
  while fits(hi) and hi < 2**24:
    lo, hi = hi, hi * 2
  while hi - lo > 1:
    mid = (lo + hi) // 2
    lo, hi = (mid, hi) if fits(mid) else (lo, mid)
  return lo


def _fill(units: Sequence[str], inserts: Sequence[str], depths: Sequence[float], n: int) -> str:
  """`n` of `units` (cycled), space-joined, with `inserts` at their relative `depths`."""
  body = [units[i % len(units)] for i in range(n)]
  for depth, insert in sorted(zip(depths, inserts), key=lambda p: p[0], reverse=True):
    body.insert(int(round(depth * n)), insert)
  return " ".join(body)


def _haystack_units(rng: np.random.Generator) -> list[str]:
  sentences = haystack_sentences()
  start = int(rng.integers(len(sentences)))
  return list(sentences[start:]) + list(sentences[:start])


def make(task: str, tokenizer: Any, length: int, seed: int = 0) -> Example:
  """One seeded example of `task` whose prompt is at most `length` tokens of `tokenizer`.

  Args:
    task: a name of `TASKS`.
    tokenizer: anything with `encode(text, add_special_tokens=False) -> list[int]`.
    length: the prompt's token budget (context, question and answer prefix), >= 128.
    seed: the draw; the same `(task, length, seed)` gives the same example.

  Raises:
    ValueError: an unknown task or a length below 128.
  """
  if task not in TASKS:
    raise ValueError(f"task must be one of {TASKS}; got {task!r}")
  if isinstance(length, bool) or not isinstance(length, (int, np.integer)) or length < 128:
    raise ValueError(f"length must be an int >= 128 (tokens); got {length!r}")
  length = int(length)
  rng = _rng(task, length, seed)

  def count(text: str) -> int:
    return len(tokenizer.encode(text, add_special_tokens=False))

  if task.startswith("niah"):
    context, question, prefix, answers = _niah(task, rng)
    units, inserts = _haystack_units(rng), context
  elif task == "variable_tracking":
    names = ["".join(rng.choice(list(string.ascii_uppercase), 5)) for _ in range(CHAIN_HOPS + 1)]
    value = _numbers(rng, 1)[0]
    inserts = [f"VAR {names[0]} = {value}."] + [
        f"VAR {names[i]} = VAR {names[i - 1]}." for i in range(1, CHAIN_HOPS + 1)]
    question = (f"Find all variables that are assigned the value {value} in the text above, "
                "directly or through other variables.")
    prefix = (f"Answer: According to the chain(s) of variable assignment in the text above, "
              f"{CHAIN_HOPS + 1} variables are assigned the value {value}, they are:")
    units, answers = _haystack_units(rng), tuple(names)
  else:
    return _words(task, rng, length, seed, count)
  depths = sorted(rng.uniform(0.05, 0.95, size=len(inserts)))
  tail = count(f"\n\n{question} {prefix}") + TEMPLATE_ROOM
  n = _largest(lambda n: count(_fill(units, inserts, depths, n)) <= length - tail)
  return Example(task, length, seed, _fill(units, inserts, depths, n), question, prefix,
                 answers)


def _niah(task: str, rng: np.random.Generator):
  if task == "niah_multivalue":
    keys = _keys(rng, 1) * NUM_NEEDLES
  else:
    keys = _keys(rng, 1 if task == "niah_single" else NUM_NEEDLES)
  values = _numbers(rng, len(keys))
  needles = [NEEDLE.format(key=k, value=v) for k, v in zip(keys, values)]
  if task == "niah_multiquery":
    asked, answers = ", ".join(keys[:-1]) + f" and {keys[-1]}", tuple(values)
    question = (f"What are all the special magic numbers for {asked} mentioned in the "
                "provided text?")
    prefix = f"The special magic numbers for {asked} mentioned in the provided text are"
  elif task == "niah_multivalue":
    question = (f"What are all the special magic numbers for {keys[0]} mentioned in the "
                "provided text?")
    prefix = f"The special magic numbers for {keys[0]} mentioned in the provided text are"
    answers = tuple(values)
  else:  # single, or multikey where the first key is asked and the others distract
    question = f"What is the special magic number for {keys[0]} mentioned in the provided text?"
    prefix = f"The special magic number for {keys[0]} mentioned in the provided text is"
    answers = (values[0],)
  return needles, question, prefix, answers


def _words(task, rng, length, seed, count) -> Example:
  vocab = np.array(vocabulary())
  if task == "common_words":
    words = [str(w) for w in rng.permutation(vocab)]
    common, rare = words[:NUM_COMMON], words[NUM_COMMON:]
    question = (f"What are the {NUM_COMMON} most common words in the above list?")
    prefix = f"Answer: The top {NUM_COMMON} words that appear most often in the list are:"
    per_entry = count(" ".join(f"{i + 100}. {w}" for i, w in enumerate(common))) / NUM_COMMON
    budget = length - count(f"\n\n{question} {prefix}") - TEMPLATE_ROOM
    repeats = int(np.clip(budget / (2 * NUM_COMMON * per_entry), RARE_REPEATS + 3,
                          COMMON_REPEATS))  # fewer than RULER's 30 where 300 entries overflow

    def draw(n_rare):
      items = common * repeats + [w for w in rare[:n_rare] for _ in range(RARE_REPEATS)]
      order = np.random.default_rng([TASKS.index(task), length, seed, n_rare]).permutation(
          len(items))
      return " ".join(f"{i + 1}. {items[j]}" for i, j in enumerate(order))

    answers = tuple(common)
  else:  # frequent_words: coded words with Zipf frequencies
    codes = ["".join(rng.choice(list(string.ascii_lowercase), 6)) for _ in range(4096)]
    codes = list(dict.fromkeys(codes))
    question = ("What are the three most frequently appeared coded words in the above "
                "coded text?")
    prefix = ("Answer: According to the coded text above, the three most frequently "
              "appeared words are:")

    def draw(n_words):
      ranks = np.random.default_rng([TASKS.index(task), length, seed]).zipf(
          ZIPF_ALPHA, size=n_words)
      ranks = np.minimum(ranks, len(codes)) - 1
      return " ".join(codes[r] for r in ranks)

    answers = tuple(codes[:3])
  tail = count(f"\n\n{question} {prefix}") + TEMPLATE_ROOM
  context = draw(_largest(lambda n: count(draw(n)) <= length - tail))
  if task == "frequent_words":  # the three most frequent, as drawn (ties broken by rank)
    counts = collections.Counter(context.split())
    answers = tuple(sorted(counts, key=lambda w: (-counts[w], codes.index(w)))[:3])
  return Example(task, length, seed, context, question, prefix, answers)


def prompt_text(example: Example) -> str:
  """The user turn: the context, a blank line, the question."""
  return f"{example.context}\n\n{example.question}"


def encode(tokenizer: Any, example: Example, *, chat: bool = False) -> list[int]:
  """Token ids of the prompt: the user turn through the chat template (`chat=True`,
  `tokenizer.apply_chat_template(messages, add_generation_prompt=True) -> str`) or as raw
  text, then the answer prefix."""
  if chat:
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt_text(example)}],
                                         add_generation_prompt=True)
    return tokenizer.encode(text + example.answer_prefix, add_special_tokens=False)
  return tokenizer.encode(f"{prompt_text(example)} {example.answer_prefix}",
                          add_special_tokens=False)


def context_tokens(tokenizer: Any, example: Example, *, chat: bool = False) -> int:
  """Tokens of the prompt up to the end of the context (the chat template's start and
  `example.context`): the part kvpress's pipeline compresses, the question after it not."""
  if chat:
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt_text(example)}],
                                         add_generation_prompt=True)
    text = text[:text.index(example.context) + len(example.context)]
  else:
    text = example.context
  return len(tokenizer.encode(text, add_special_tokens=False))


def prompt_sha1(example: Example) -> str:
  """A hex digest of the example's text (context, question, answer prefix): equal wherever
  two systems were given the same prompt."""
  text = "\x00".join((example.context, example.question, example.answer_prefix))
  return hashlib.sha1(text.encode()).hexdigest()


def score(example: Example, output: str) -> float:
  """RULER's `string_match_all`: the fraction of `example.answers` found in `output`
  (case-insensitive substrings)."""
  found = sum(a.lower() in output.lower() for a in example.answers)
  return found / len(example.answers)


MAX_NEW_TOKENS = {"niah_single": 24, "niah_multikey": 24, "niah_multivalue": 64,
                  "niah_multiquery": 64, "variable_tracking": 40, "common_words": 96,
                  "frequent_words": 40}
"""Greedy tokens per answer: room for the references and their separators."""


def evaluate(model: Any, tokenizer: Any, examples: Sequence[Example], *, chat: bool = True,
             batch: int = 4, generate_kwargs: dict[str, Any] | None = None
             ) -> tuple[list[float], list[str]]:
  """Greedy answers of `model` to `examples` through `kvattn.generate`, and their scores.

  Examples of one task run `batch` at a time, right-padded, for `MAX_NEW_TOKENS[task]`
  tokens (stopping at the tokenizer's EOS, if it has one).

  Args:
    model: a `kvattn.Transformer`.
    tokenizer: its tokenizer (`encode`, `decode`, `apply_chat_template` when `chat`).
    examples: from `make`.
    chat: wrap each prompt in the chat template (`encode`).
    batch: sequences per `generate` call.
    generate_kwargs: passed on to `kvattn.generate` (e.g. `cache_factory=`).

  Returns:
    `(scores, outputs)`: one float in [0, 1] and one decoded answer per example, in order.
  """
  import kvattn  # pylint: disable=g-import-not-at-top

  scores, outputs = [0.0] * len(examples), [""] * len(examples)
  eos = getattr(tokenizer, "eos_id", None)
  for task in dict.fromkeys(e.task for e in examples):
    index = [i for i, e in enumerate(examples) if e.task == task]
    for start in range(0, len(index), batch):
      rows = index[start:start + batch]
      ids = [encode(tokenizer, examples[i], chat=chat) for i in rows]
      lengths = np.array([len(r) for r in ids], np.int32)
      prompts = np.zeros((len(rows), lengths.max()), np.int32)
      for b, r in enumerate(ids):
        prompts[b, :len(r)] = r
      tokens, counts = kvattn.generate(model, prompts, lengths, MAX_NEW_TOKENS[task],
                                       eos_id=eos, **(generate_kwargs or {}))
      tokens, counts = np.asarray(tokens), np.asarray(counts)
      for b, i in enumerate(rows):
        outputs[i] = tokenizer.decode(tokens[b, :counts[b]].tolist(), skip_special_tokens=True)
        scores[i] = score(examples[i], outputs[i])
  return scores, outputs
