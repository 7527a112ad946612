"""Byte-level text data: tokenizer, corpora, train/validation split, packed batches.

Tokens: each UTF-8 byte (0..255), `BOS_ID = 256`, `EOS_ID = 257`, `PAD_ID = 258` (never a
target); `VOCAB_SIZE = 259`. The default corpus ships with CPython (the stdlib's `.py`
sources and `pydoc_data.topics`). Documents are split by the hash of their name and packed
as `[BOS, bytes..., EOS]` into rows of `seq_len + 1` tokens, the last row padded.
"""

from __future__ import annotations

import dataclasses
import glob as glob_lib
import hashlib
import os
import sysconfig
from typing import Any, Callable, Iterator, Sequence

import numpy as np
from ml_collections import config_dict

from kvattn.vocab import BOS_ID, EOS_ID, NUM_BYTES, PAD_ID, VOCAB_SIZE  # pylint: disable=unused-import

DEFAULT_MAX_BYTES = 8 * 2**20  # 8 MiB: ~60% of the stdlib sources, read in well under a second.


def data_config(**overrides: Any) -> config_dict.ConfigDict:
  """The default `data` ConfigDict (default corpus, 128-token rows) with overrides.

  Raises:
    ValueError: an override names a key that is not in the schema.
  """
  cfg = config_dict.ConfigDict()
  cfg.path = config_dict.placeholder(str)  # None: the default corpus; else file/dir/glob.
  cfg.max_bytes = DEFAULT_MAX_BYTES  # Cap on bytes of text read (None: no cap).
  cfg.include_tests = False  # Default corpus: also read the stdlib's test directories.
  cfg.validation_fraction = 0.05  # Fraction of documents (by name hash) held out.
  cfg.seq_len = 128  # Tokens per training row (inputs); rows hold seq_len + 1.
  for key, value in overrides.items():
    if key not in cfg:
      raise ValueError(f"data.{key} is not a known key; expected one of {sorted(cfg.keys())}")
    setattr(cfg, key, value)
  return cfg


# ----------------------------------------------------------------------------------------------
# Tokenizer.


def encode(text: str | bytes, *, bos: bool = False, eos: bool = False) -> np.ndarray:
  """Byte-level token ids `i32[n]` of `text` (str is UTF-8 encoded), optional BOS/EOS."""
  if isinstance(text, str):
    text = text.encode("utf-8")
  if not isinstance(text, (bytes, bytearray)):
    raise TypeError(f"text must be str or bytes; got {type(text).__name__}")
  ids = np.frombuffer(bytes(text), dtype=np.uint8).astype(np.int32)
  parts = ([np.array([BOS_ID], np.int32)] if bos else []) + [ids] + (
      [np.array([EOS_ID], np.int32)] if eos else [])
  return np.concatenate(parts)


def decode(ids: Any, *, stop_at_eos: bool = True) -> str:
  """Text of token ids: bytes kept, BOS/PAD dropped, stop at the first EOS (optional).

  Invalid UTF-8 (a model can emit any byte) is decoded with replacement chars.
  """
  ids = np.asarray(ids).reshape(-1)
  if stop_at_eos:
    hits = np.nonzero(ids == EOS_ID)[0]
    if hits.size:
      ids = ids[:hits[0]]
  data = ids[(ids >= 0) & (ids < NUM_BYTES)].astype(np.uint8).tobytes()
  return data.decode("utf-8", errors="replace")


class ByteTokenizer:
  """`encode` / `decode` behind `kvattn.checkpoints.Tokenizer`'s calls (`bos_id`, `eos_id`),
  so code for a pretrained tokenizer runs on byte-level models; `bos` prepends BOS_ID."""

  bos_id, eos_id, chat_template = BOS_ID, EOS_ID, None

  def __init__(self, *, bos: bool = False):
    self.bos = bos

  def encode(self, text: str, **unused: Any) -> list[int]:
    return encode(text, bos=self.bos).tolist()

  def decode(self, ids: Any) -> str:
    return decode(ids)


# ----------------------------------------------------------------------------------------------
# Corpora.


@dataclasses.dataclass(frozen=True)
class Document:
  """One corpus document: its name and its UTF-8 bytes."""
  name: str  # a path, or "pydoc_data.topics:<topic>"
  data: bytes  # UTF-8 text


def _name_hash(name: str) -> float:
  """A stable number in [0, 1) from a document name (sha256, independent of PYTHONHASHSEED)."""
  digest = hashlib.sha256(name.encode("utf-8")).digest()
  return int.from_bytes(digest[:8], "little") / 2.0**64


def stdlib_dir() -> str:
  """The running CPython's standard-library directory (`sysconfig` 'stdlib')."""
  return sysconfig.get_paths()["stdlib"]


def _stdlib_files(include_tests: bool) -> list[str]:
  root = stdlib_dir()
  skip = {"site-packages", "dist-packages", "__pycache__"}
  if not include_tests:
    skip |= {"test", "tests", "idle_test"}
  files = []
  for dirpath, dirnames, filenames in os.walk(root):
    dirnames[:] = sorted(d for d in dirnames if d not in skip)
    files.extend(os.path.join(dirpath, f) for f in sorted(filenames) if f.endswith(".py"))
  return files


def _path_files(path: str) -> list[str]:
  if os.path.isfile(path):
    return [path]
  if os.path.isdir(path):
    return sorted(os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs)
  return sorted(p for p in glob_lib.glob(path, recursive=True) if os.path.isfile(p))


def _read_text(path: str) -> bytes | None:
  """The file's bytes if they are valid UTF-8 text (no NUL), else None."""
  try:
    with open(path, "rb") as f:
      data = f.read()
  except OSError:
    return None
  if b"\x00" in data:
    return None
  try:
    data.decode("utf-8")
  except UnicodeDecodeError:
    return None
  return data


def load_corpus(path: str | None = None, *, max_bytes: int | None = DEFAULT_MAX_BYTES,
                include_tests: bool = False) -> list[Document]:
  """Loads a corpus's documents in a deterministic order (by name hash).

  Args:
    path: None (the default corpus), or a UTF-8 file, a directory or a glob (`**`);
      files that are not UTF-8 text are skipped.
    max_bytes: stop after this many bytes (None: no cap); the crossing document is kept.
    include_tests: default corpus only: also the stdlib's test directories.

  Raises:
    ValueError: `path` matches no readable UTF-8 text, or a bad `max_bytes`.
  """
  if max_bytes is not None and (isinstance(max_bytes, bool) or not isinstance(max_bytes, int)
                                or max_bytes <= 0):
    raise ValueError(f"max_bytes must be a positive int or None; got {max_bytes!r}")
  if path is None:
    names = _stdlib_files(include_tests)
    from pydoc_data import topics  # pylint: disable=g-import-not-at-top
    topic_docs = {f"pydoc_data.topics:{k}": v.encode("utf-8") for k, v in topics.topics.items()}
    names += list(topic_docs)
  else:
    if not isinstance(path, (str, os.PathLike)):
      raise TypeError(f"path must be a str path, directory or glob, or None; got {path!r}")
    path = os.fspath(path)
    names = _path_files(path)
    topic_docs = {}
  names.sort(key=lambda n: (_name_hash(n), n))
  docs, total = [], 0
  for name in names:
    if max_bytes is not None and total >= max_bytes:
      break
    data = topic_docs[name] if name in topic_docs else _read_text(name)
    if data:
      docs.append(Document(name, data))
      total += len(data)
  if not docs:
    raise ValueError(f"path must name UTF-8 text files; {path!r} matched none")
  return docs


def split_documents(docs: Sequence[Document], validation_fraction: float = 0.05
                    ) -> tuple[list[Document], list[Document]]:
  """Deterministic train/validation split by document (hash of the name).

  Raises:
    ValueError: `validation_fraction` outside (0, 1), or an empty side.
  """
  if not 0.0 < validation_fraction < 1.0:
    raise ValueError(f"validation_fraction must lie in (0, 1); got {validation_fraction!r}")
  # A second hash (salted) so the split is independent of the loading order, which uses the
  # unsalted hash: a byte cap then still yields the requested fraction.
  train, val = [], []
  for d in docs:
    (val if _name_hash("split:" + d.name) < validation_fraction else train).append(d)
  if not train or not val:
    raise ValueError(
        f"validation_fraction = {validation_fraction} split {len(docs)} documents into "
        f"{len(train)} train and {len(val)} validation; use more documents or another fraction")
  return train, val


def pack(docs: Sequence[Document], seq_len: int) -> np.ndarray:
  """Packs documents into rows `i32[num_rows, seq_len + 1]` (see the module doc).

  Raises:
    ValueError: `seq_len` not a positive int, or no documents.
  """
  if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len <= 0:
    raise ValueError(f"seq_len must be a positive int; got {seq_len!r}")
  if not docs:
    raise ValueError("docs must hold at least one document; got none")
  stream = np.concatenate([encode(d.data, bos=True, eos=True) for d in docs])
  row = seq_len + 1
  num_rows = -(-stream.size // row)
  out = np.full((num_rows * row,), PAD_ID, np.int32)
  out[:stream.size] = stream
  return out.reshape(num_rows, row)


def pack_token_ids(docs: Sequence[Document], seq_len: int, encode: Callable[[str], Sequence[int]],
                   *, eos_id: int | None = None) -> np.ndarray:
  """Rows `i32[num_rows, seq_len + 1]` of `encode(text)` + `eos_id` per document, cut into
  full rows (the last partial row dropped: no padding id needed).

  Raises:
    ValueError: `seq_len` not a positive int, no documents, or too few tokens for a row.
  """
  if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len <= 0:
    raise ValueError(f"seq_len must be a positive int; got {seq_len!r}")
  if not docs:
    raise ValueError("docs must hold at least one document; got none")
  tail = [] if eos_id is None else [eos_id]
  stream = np.concatenate([np.asarray(list(encode(d.data.decode("utf-8", "replace"))) + tail,
                                      np.int32) for d in docs])
  row = seq_len + 1
  if stream.size < row:
    raise ValueError(f"docs must hold at least seq_len + 1 = {row} tokens; got {stream.size}")
  return stream[:stream.size // row * row].reshape(-1, row)


class BatchIterator:
  """Seeded, resumable iterator over `i32[batch_size, seq_len + 1]` batches: each epoch a
  permutation from `np.random.default_rng([seed, epoch])`, a batch never spanning epochs;
  the whole state is `(epoch, index)` (`state()` / `restore()`)."""

  def __init__(self, rows: np.ndarray, batch_size: int, *, seed: int = 0, shuffle: bool = True):
    if rows.ndim != 2:
      raise ValueError(f"rows must have shape [num_rows, seq_len + 1]; got {rows.shape}")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size <= 0:
      raise ValueError(f"batch_size must be a positive int; got {batch_size!r}")
    if batch_size > rows.shape[0]:
      raise ValueError(
          f"batch_size must be at most the number of rows ({rows.shape[0]}); got {batch_size}")
    self.rows = rows
    self.batch_size = batch_size
    self.seed = int(seed)
    self.shuffle = shuffle
    self.epoch = 0
    self.index = 0
    self._order = self._permutation(0)

  def _permutation(self, epoch: int) -> np.ndarray:
    if not self.shuffle:
      return np.arange(self.rows.shape[0])
    return np.random.default_rng([self.seed, epoch]).permutation(self.rows.shape[0])

  @property
  def batches_per_epoch(self) -> int:
    return self.rows.shape[0] // self.batch_size

  def state(self) -> dict[str, int]:
    """JSON-serialisable position: `{"epoch", "index", "seed"}`."""
    return {"epoch": self.epoch, "index": self.index, "seed": self.seed}

  def restore(self, state: dict[str, int]) -> None:
    """Moves to a position returned by `state()`.

    Raises:
      ValueError: a state from a different seed or out of range.
    """
    if int(state["seed"]) != self.seed:
      raise ValueError(
          f"state['seed'] must be this iterator's seed {self.seed}; got {state['seed']}")
    index = int(state["index"])
    if not 0 <= index <= self.batches_per_epoch:
      raise ValueError(f"state['index'] must lie in [0, {self.batches_per_epoch}]; got {index}")
    self.epoch, self.index = int(state["epoch"]), index
    self._order = self._permutation(self.epoch)

  def __iter__(self) -> Iterator[np.ndarray]:
    return self

  def __next__(self) -> np.ndarray:
    if self.index >= self.batches_per_epoch:
      self.epoch += 1
      self.index = 0
      self._order = self._permutation(self.epoch)
    start = self.index * self.batch_size
    batch = self.rows[self._order[start:start + self.batch_size]]
    self.index += 1
    return batch


def eval_batches(rows: np.ndarray, batch_size: int, max_batches: int | None = None
                 ) -> Iterator[np.ndarray]:
  """Rows in order, in batches; the last batch is filled up with PAD rows (masked out)."""
  num = rows.shape[0]
  stop = num if max_batches is None else min(num, max_batches * batch_size)
  for start in range(0, stop, batch_size):
    batch = rows[start:min(start + batch_size, stop)]
    if batch.shape[0] < batch_size:
      pad = np.full((batch_size - batch.shape[0], rows.shape[1]), PAD_ID, rows.dtype)
      batch = np.concatenate([batch, pad])
    yield batch


@dataclasses.dataclass
class Dataset:
  """Packed train and validation rows of one corpus."""

  train_rows: np.ndarray  # i32[num_train_rows, seq_len + 1]
  validation_rows: np.ndarray  # i32[num_validation_rows, seq_len + 1]
  num_train_documents: int
  num_validation_documents: int

  def train_iterator(self, batch_size: int, seed: int = 0) -> BatchIterator:
    """A seeded iterator over `i32[batch_size, L + 1]` batches of the training rows."""
    return BatchIterator(self.train_rows, batch_size, seed=seed)


def load_dataset(path: str | None = None, *, seq_len: int, validation_fraction: float = 0.05,
                 max_bytes: int | None = DEFAULT_MAX_BYTES, include_tests: bool = False) -> Dataset:
  """Corpus -> split -> packed rows (`load_corpus`, `split_documents`, `pack`)."""
  docs = load_corpus(path, max_bytes=max_bytes, include_tests=include_tests)
  train, val = split_documents(docs, validation_fraction)
  return Dataset(pack(train, seq_len), pack(val, seq_len), len(train), len(val))


def dataset_from_config(cfg: Any) -> Dataset:
  """`load_dataset` from a `data` config section (see `data_config`).

  Raises:
    ValueError: an unknown key (named) or an invalid value.
  """
  d = cfg.to_dict() if hasattr(cfg, "to_dict") else dict(cfg)
  known = set(data_config().keys())
  unknown = sorted(set(d) - known)
  if unknown:
    raise ValueError(f"data.{unknown[0]} is not a known key; expected one of {sorted(known)}")
  d = {**data_config().to_dict(), **d}
  return load_dataset(d["path"], seq_len=d["seq_len"], validation_fraction=d["validation_fraction"],
                      max_bytes=d["max_bytes"], include_tests=d["include_tests"])


def load_token_dataset(encode: Callable[[str], Sequence[int]], *, seq_len: int,
                       eos_id: int | None = None, path: str | None = None,
                       validation_fraction: float = 0.05,
                       max_bytes: int | None = DEFAULT_MAX_BYTES,
                       include_tests: bool = False) -> Dataset:
  """`load_dataset` for a subword tokenizer (`encode`, `eos_id`, e.g. a pretrained model's):
  corpus -> split -> `pack_token_ids` rows."""
  docs = load_corpus(path, max_bytes=max_bytes, include_tests=include_tests)
  train, val = split_documents(docs, validation_fraction)
  return Dataset(pack_token_ids(train, seq_len, encode, eos_id=eos_id),
                 pack_token_ids(val, seq_len, encode, eos_id=eos_id), len(train), len(val))
