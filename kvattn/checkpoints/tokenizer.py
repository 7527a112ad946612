"""Text tokenizers of pretrained checkpoints (HF `tokenizers`) and their chat templates.

`Tokenizer.from_file("dir/tokenizer.json")` (with `tokenizer_config.json`'s template and
special tokens when present) or `Tokenizer.from_gguf_metadata(metadata)` (byte-level BPE and
Gemma's SentencePiece, built as transformers' GGUF converter builds them, so ids equal
`AutoTokenizer`'s). Chat templates render through `kvattn.checkpoints.chat_template`.
"""

from __future__ import annotations

import functools
import json
import pathlib
from typing import Any, Mapping, Sequence

import tokenizers
from tokenizers import decoders, models, normalizers, pre_tokenizers

from kvattn.checkpoints import chat_template, families
# Re-exported: the render budgets and their error live with the renderer.
from kvattn.checkpoints.chat_template import (  # noqa: F401
    TEMPLATE_MAX_CHARS, TEMPLATE_MAX_DIGITS, TEMPLATE_MAX_STEPS, TEMPLATE_WORK_FACTOR,
    ChatTemplateBudgetError)

# llama.cpp's token types (`tokenizer.ggml.token_type`).
_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4


@functools.cache
def _byte_alphabet() -> dict[int, str]:
  """GPT-2's byte -> printable character table (Radford et al. 2019, `bytes_to_unicode`).

  Printable Latin-1 bytes map to themselves; the other 68 bytes map, in order, to
  the code points 256, 257, ... so every byte has a visible, non-space character.
  """
  keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
  table = {b: chr(b) for b in keep}
  extra = 0
  for b in range(256):
    if b not in table:
      table[b] = chr(256 + extra)
      extra += 1
  return table


class Tokenizer:
  """A checkpoint's tokenizer: `backend` (`tokenizers.Tokenizer`), `bos_id`, `eos_id` (or
  None), `chat_template` (jinja2 source or None), `add_bos` (whether `encode` prepends
  BOS), `source` (the file chat-template errors name)."""

  def __init__(self, backend: tokenizers.Tokenizer, *, bos_id: int | None = None,
               eos_id: int | None = None, chat_template: str | None = None,
               add_bos: bool = False, source: str | None = None):
    if not isinstance(backend, tokenizers.Tokenizer):
      raise TypeError(f"backend must be a tokenizers.Tokenizer; got {type(backend).__name__}")
    vocab_size = backend.get_vocab_size(with_added_tokens=True)
    for name, value in (("bos_id", bos_id), ("eos_id", eos_id)):
      if value is not None and not 0 <= value < vocab_size:
        raise ValueError(f"{name} must be in [0, {vocab_size}); got {value}")
    if add_bos and bos_id is None:
      raise ValueError("add_bos=True needs a bos_id; got bos_id=None")
    self.backend = backend
    self.bos_id = bos_id
    self.eos_id = eos_id
    self.chat_template = chat_template
    self.add_bos = add_bos
    self.source = source

  @property
  def vocab_size(self) -> int:
    """Number of ids, added tokens included."""
    return self.backend.get_vocab_size(with_added_tokens=True)

  def __repr__(self) -> str:
    return (f"Tokenizer(vocab_size={self.vocab_size}, bos_id={self.bos_id}, "
            f"eos_id={self.eos_id}, chat_template={self.chat_template is not None})")

  # --------------------------------------------------------------------------------------------
  # Construction.

  @classmethod
  def from_file(cls, path: str | pathlib.Path) -> "Tokenizer":
    """Loads a HF `tokenizer.json` and, when present, `tokenizer_config.json` beside it.

    Raises:
      FileNotFoundError: `path` does not exist.
      ValueError: invalid JSON, or a special token not in the vocabulary.
    """
    path = pathlib.Path(path)
    if not path.is_file():
      raise FileNotFoundError(f"tokenizer file {str(path)!r} does not exist")
    try:
      backend = tokenizers.Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises a bare Exception on bad JSON.
      raise ValueError(f"{path}: not a readable tokenizer.json: {e}") from e
    config_path = path.with_name("tokenizer_config.json")
    config: dict[str, Any] = {}
    if config_path.is_file():
      try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
      except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{config_path}: not valid JSON: {e}") from e
      if not isinstance(config, dict):
        raise ValueError(f"{config_path}: expected a JSON object; got {type(config).__name__}")
    ids = {}
    for key in ("bos_token", "eos_token"):
      token = config.get(key)
      if isinstance(token, dict):
        token = token.get("content")
      if token is None:
        ids[key] = None
        continue
      token_id = backend.token_to_id(token)
      if token_id is None:
        raise ValueError(f"{config_path}: {key} {token!r} is not in the vocabulary of {path}")
      ids[key] = token_id
    template = config.get("chat_template")
    if isinstance(template, list):  # [{"name": ..., "template": ...}, ...]
      named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
      template = named.get("default")
    # A tokenizer.json whose post-processor already adds BOS needs no second one.
    add_bos = (bool(config.get("add_bos_token", False)) and ids["bos_token"] is not None
               and ids["bos_token"] not in backend.encode("", add_special_tokens=True).ids)
    return cls(backend, bos_id=ids["bos_token"], eos_id=ids["eos_token"],
               chat_template=template, add_bos=add_bos,
               source=str(config_path if template is not None else path))

  @classmethod
  def from_gguf_metadata(cls, metadata: Mapping[str, Any], *,
                         source: str | None = None) -> "Tokenizer":
    """Builds the tokenizer a GGUF file's `tokenizer.ggml.*` metadata describes (as
    transformers' converter: control tokens special, user-defined ones added, the split
    regex a family registers for `tokenizer.ggml.pre`, else GPT-2's).

    Raises:
      NotImplementedError: `tokenizer.ggml.model` is not "gpt2".
      ValueError: a key is missing or malformed (naming it).
    """
    kind = metadata.get("tokenizer.ggml.model")
    arch = metadata.get("general.architecture")
    sentencepiece = kind == "llama" and arch in families.sentencepiece_architectures()
    if kind != "gpt2" and not sentencepiece:
      raise NotImplementedError(
          f"tokenizer.ggml.model={kind!r} is not supported for general.architecture={arch!r}; "
          f"expected 'gpt2' (byte-level BPE), or 'llama' (SentencePiece) for one of "
          f"{families.sentencepiece_architectures()}")
    tokens = _string_list(metadata, "tokenizer.ggml.tokens")
    token_types = metadata.get("tokenizer.ggml.token_type")
    if token_types is not None and len(token_types) != len(tokens):
      raise ValueError(f"tokenizer.ggml.token_type has {len(token_types)} entries; expected one "
                       f"per token ({len(tokens)})")
    if sentencepiece:
      backend = _gemma_sentencepiece(tokens, token_types)
    else:
      backend = _byte_level_bpe(metadata, tokens, token_types)
    ids = {}
    for key in ("bos_token_id", "eos_token_id"):
      value = metadata.get(f"tokenizer.ggml.{key}")
      if value is not None and not (isinstance(value, int) and 0 <= value < len(tokens)):
        raise ValueError(f"tokenizer.ggml.{key} must be a token id in [0, {len(tokens)}); "
                         f"got {value!r}")
      ids[key] = value
    template = metadata.get("tokenizer.chat_template")
    if template is not None and not isinstance(template, str):
      raise ValueError(f"tokenizer.chat_template must be a string; got {type(template).__name__}")
    # llama.cpp adds BOS to a SentencePiece vocabulary that does not say otherwise.
    add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", sentencepiece))
    return cls(backend, bos_id=ids["bos_token_id"], eos_id=ids["eos_token_id"],
               chat_template=template, add_bos=add_bos and ids["bos_token_id"] is not None,
               source=source)

  # --------------------------------------------------------------------------------------------
  # Use.

  def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
    """Token ids of `text` (with `add_special_tokens`, the post-processor's specials and
    `bos_id` when `add_bos`; special tokens in the text map to their ids).

    Raises:
      TypeError: `text` is not a str.
    """
    if not isinstance(text, str):
      raise TypeError(f"text must be a str; got {type(text).__name__}")
    ids = self.backend.encode(text, add_special_tokens=add_special_tokens).ids
    if add_special_tokens and self.add_bos:
      ids = [self.bos_id, *ids]
    return ids

  def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
    """The text of `ids` (special tokens kept unless `skip_special_tokens`).

    Raises:
      ValueError: an id is outside [0, vocab_size).
    """
    ids = [int(i) for i in ids]
    bad = [i for i in ids if not 0 <= i < self.vocab_size]
    if bad:
      raise ValueError(f"ids must be in [0, {self.vocab_size}); got {bad[:5]}")
    return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

  def token(self, token_id: int) -> str | None:
    """The vocabulary entry of `token_id` (None if there is none)."""
    return self.backend.id_to_token(int(token_id))

  def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], *,
                          add_generation_prompt: bool = True, **kwargs: Any) -> str:
    """Renders `messages` ([{"role": ..., "content": ...}, ...]) with the chat template, as
    transformers' `apply_chat_template(..., tokenize=False)`, within
    `kvattn.checkpoints.chat_template`'s budgets.

    Raises:
      ValueError: no chat template, or `messages` not a list of mappings with a "role".
      ChatTemplateBudgetError: (a ValueError) a budget or the recursion limit exceeded.
      jinja2.TemplateError: the template rejects the messages.
    """
    if self.chat_template is None:
      raise ValueError("this tokenizer has no chat template; format the prompt yourself")
    if isinstance(messages, (str, bytes)) or not all(
        isinstance(m, Mapping) and "role" in m for m in messages):
      raise ValueError("messages must be a sequence of mappings with a 'role' key; got "
                       f"{messages!r:.200}")
    return chat_template.render(
        self.chat_template, self.source or "a Tokenizer without a source file",
        messages=[dict(m) for m in messages], add_generation_prompt=add_generation_prompt,
        **{"bos_token": self._text(self.bos_id), "eos_token": self._text(self.eos_id), **kwargs})

  def _text(self, token_id: int | None) -> str | None:
    return None if token_id is None else self.backend.id_to_token(token_id)


def _byte_level_bpe(metadata: Mapping[str, Any], tokens: list[str],
                    token_types: Sequence[int] | None) -> tokenizers.Tokenizer:
  """The byte-level BPE backend of a `tokenizer.ggml.model == "gpt2"` vocabulary
  (see `Tokenizer.from_gguf_metadata`)."""
  merges = _string_list(metadata, "tokenizer.ggml.merges")
  spelling = _byte_alphabet()
  alphabet = set(spelling.values())
  vocab = {}
  for index, token in enumerate(tokens):
    if not set(token) <= alphabet:
      token = "".join(spelling[b] for b in token.encode("utf-8"))
    vocab[token] = index
  pairs = []
  for merge in merges:
    parts = merge.split(" ")
    if len(parts) != 2:
      raise ValueError(f"tokenizer.ggml.merges entry {merge!r} is not two tokens separated "
                       "by one space")
    pairs.append((parts[0], parts[1]))
  try:
    backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False))
  except Exception as e:  # tokenizers raises a bare Exception for a merge of unknown tokens.
    raise ValueError(f"tokenizer.ggml.merges do not fit tokenizer.ggml.tokens: {e}") from e
  split = families.pre_tokenizer_split(metadata.get("tokenizer.ggml.pre"))
  if split is None:
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
  else:
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(tokenizers.Regex(split), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
  backend.decoder = decoders.ByteLevel()
  if token_types is not None:
    control = [t for t, kind in zip(tokens, token_types)
               if kind == _TOKEN_TYPE_CONTROL and set(t) <= alphabet]
    backend.add_special_tokens(
        [tokenizers.AddedToken(t, normalized=False, special=True) for t in control])
    user = [t for t, kind in zip(tokens, token_types)
            if kind == _TOKEN_TYPE_USER_DEFINED and t in vocab]
    backend.add_tokens([tokenizers.AddedToken(t, normalized=False, special=False)
                        for t in user])
  return backend


def _gemma_sentencepiece(tokens: list[str], token_types: Sequence[int] | None
                         ) -> tokenizers.Tokenizer:
  """Gemma's SentencePiece vocabulary as transformers 5's GGUF converter builds it: BPE with
  byte fallback, merges recovered from the vocabulary in file order, spaces as "\u2581"."""
  tokens = ["\u2581" * len(t) if " " in t and not t.strip() else t for t in tokens]
  vocab = {token: index for index, token in enumerate(tokens)}
  scores = {token: -index for index, token in enumerate(tokens)}
  merges = []  # transformers' generate_merges(vocab, scores), in the same order
  for merge, score in scores.items():
    local = [(merge[:i], merge[i:], score) for i in range(1, len(merge))
             if merge[:i] in vocab and merge[i:] in vocab]
    local.sort(key=lambda x: (vocab[x[0]], vocab[x[1]]))
    merges.extend(local)
  merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
  backend = tokenizers.Tokenizer(models.BPE(
      vocab=vocab, merges=[(a, b) for a, b, _ in merges], fuse_unk=True,
      unk_token="<unk>" if "<unk>" in vocab else None, byte_fallback=True))
  backend.normalizer = normalizers.Replace(" ", "\u2581")
  backend.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
  backend.decoder = decoders.Sequence(
      [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
  if token_types is not None:
    backend.add_special_tokens(
        [tokenizers.AddedToken(t, normalized=False, special=True)
         for t, kind in zip(tokens, token_types) if kind == _TOKEN_TYPE_CONTROL])
    backend.add_tokens([tokenizers.AddedToken(t, normalized=False, special=False)
                        for t, kind in zip(tokens, token_types)
                        if kind == _TOKEN_TYPE_USER_DEFINED])
  return backend

def _string_list(metadata: Mapping[str, Any], key: str) -> list[str]:
  value = metadata.get(key)
  if not isinstance(value, (list, tuple)) or not all(isinstance(s, str) for s in value):
    raise ValueError(f"{key} must be a list of strings; got "
                     f"{type(value).__name__ if value is not None else 'nothing'}")
  return list(value)
