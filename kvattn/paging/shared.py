"""One prefix cache for several workers: a content-addressed page store in a directory every
worker sees (the shared disk tier of LMCache / SGLang HiCache; the chained page keys of vLLM's
automatic prefix caching).

Layout. `directory/<namespace>/<k[:2]>/<k>.kvpage`, `k` the hex of a full page's chained key
(`kvattn.paging._blocks.page_digest`: sha256 over the whole token prefix up to the page's end).
The namespace (`namespace`) fingerprints what makes two workers' pages interchangeable: the
model's class, head layout and weights, the cache kind and its options, the dtype and the page
size. Workers of another model, dtype or page size look in another directory and never hit.

File. Little-endian: magic `b"KVATTNPG"`, version u32, page_size u32, payload bytes u64, the
namespace digest (32 bytes), the page key (32 bytes), the page's token ids `i32[page_size]`,
the payload `u8[page_bytes]` (`kvattn.paging.offload.PageCodec`'s row: every pool of the page),
then sha256 of everything before it (32 bytes). A read checks the size, the sha256, the magic,
the version, the namespace, the key and the tokens; any failure is a miss (the caller
recomputes), counted in `counters["corrupt"]`, and the file is removed so a recompute can
publish a good one.

Writers. A page is written to a hidden temporary name in its final directory and
`os.replace`d onto its key's name: a rename within one directory is atomic, so a reader opens
either nothing, an earlier whole file or the new whole file, never a partial one. Two workers
publishing the same key write files of the same content (both verified by the checksum); the
last rename wins. A key already present is not written again (one `stat`). A failed write
(read-only or full disk) is counted (`counters["write_errors"]`), logged once and never fails
the request. A crashed writer can leave a hidden temporary, which `prune` removes.

Index. The directory is the shared index: a page is visible to every worker as soon as its
rename lands, and nothing else is kept across workers that could disagree with it. Each
worker's `PrefixCachingAllocator` stays the authority for the pages in its own pool (its local
index: device pages and the local tiers); on a local miss it asks this store for the next keys
of the prompt (`contains`) and reloads the pages found into its own pool (`take`, then the
allocator's device writer) instead of prefilling them.

When pages are published: write-through at registration (`PrefixCachingAllocator.register`
calls `publish` for the blocks it adds): a prompt's pages become a hit for the other workers
as soon as its prefill is done, not only once it is evicted (which may never happen). The cost
is one host read of the new pages and one file per page, paid once per prefix in the whole
fleet. Evicted blocks need no write: they were published when registered, so a worker's
eviction just forgets them (or hands them to the optional `local` tiers, e.g. a `HostTier`)
and a later lookup finds them in the directory again.

Not shared: pools whose cached prefix also needs a boundary state (rings, residuals:
`kvattn.paging._blocks.BoundaryStates`) neither publish nor hit (their pages alone cannot
resume a sequence).
"""

from __future__ import annotations

import collections
import hashlib
import json
import logging
import os
import struct
import threading
import time
import uuid
from typing import Any, Callable, Sequence

import numpy as np

SHARED_TIER = "shared"
"""`CachedBlock.tier` of a block found in the shared store, not yet in the worker's pool."""

MAGIC = b"KVATTNPG"
VERSION = 1
_HEAD = struct.Struct("<8sIIQ32s32s")  # magic, version, page_size, payload bytes, ns, key
_SUM = 32  # sha256
_SUFFIX = ".kvpage"


def _weights_digest(model: Any) -> str:
  """sha256 over every array of `model`'s nnx state: path, dtype, shape and bytes."""
  import jax  # pylint: disable=g-import-not-at-top
  from flax import nnx  # pylint: disable=g-import-not-at-top
  h = hashlib.sha256()
  for path, leaf in jax.tree_util.tree_leaves_with_path(nnx.state(model)):
    array = np.asarray(leaf)
    h.update(f"{jax.tree_util.keystr(path)}|{array.dtype.str}|{array.shape}|".encode())
    h.update(np.ascontiguousarray(array).reshape(-1).view(np.uint8))
  return h.hexdigest()


def namespace(model: Any, *, page_size: int, dtype: Any, cache: Any = None,
              weights_id: str | None = None) -> str:
  """The fingerprint of what makes two workers' pages interchangeable (32 hex digits).

  Covers: the model's class, vocabulary size and per-layer attention (class, heads, KV heads,
  head_dim, window), its weights (sha256 over every array of its nnx state, read on the
  host: one pass over the weights; or `weights_id`), the cache kind spec, the cache dtype
  and the page size.

  Args:
    model: a `kvattn.Transformer` (anything with `.layers[i].attn` and an nnx state).
    page_size: tokens per page (int >= 1).
    dtype: the cache dtype (anything `numpy.dtype` or `jax.numpy.dtype` names).
    cache: the batcher's cache kind spec (None: "paged"); any JSON-able value.
    weights_id: a string naming the weights (a checkpoint's own digest) instead of hashing them.

  Raises:
    ValueError: a bad page size, or a model without `.layers`.
  """
  page_size = _positive("page_size", page_size)
  layers = getattr(model, "layers", None)
  if layers is None:
    raise ValueError(f"model must have .layers (a kvattn.Transformer); got {type(model).__name__}")
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  heads = []
  for layer in layers:
    attn = getattr(layer, "attn", None)
    heads.append([type(attn).__name__] + [
        getattr(attn, name, None) for name in ("num_heads", "num_kv_heads", "head_dim",
                                               "window")])
  spec = {
      "model": f"{type(model).__module__}.{type(model).__qualname__}",
      "vocab_size": getattr(model, "vocab_size", None),
      "layers": heads,
      "weights": weights_id if weights_id is not None else _weights_digest(model),
      "cache": "paged" if cache is None else cache,
      "dtype": jnp.dtype(dtype).name,
      "page_size": page_size,
  }
  text = json.dumps(spec, sort_keys=True, default=repr)
  return hashlib.sha256(text.encode()).hexdigest()[:32]


def _positive(name: str, value: Any) -> int:
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
    raise ValueError(f"{name} must be an int >= 1; got {value!r}")
  return int(value)


def encode_page(ns: bytes, key: bytes, tokens: np.ndarray, payload: np.ndarray) -> bytes:
  """The file bytes of one page (module docstring). `tokens`: `i32[page_size]`; `payload`:
  `u8[page_bytes]`."""
  tokens = np.asarray(tokens, "<i4").reshape(-1)
  payload = np.asarray(payload, np.uint8).reshape(-1)
  head = _HEAD.pack(MAGIC, VERSION, tokens.size, payload.size, ns, key)
  h = hashlib.sha256(head)
  h.update(tokens.tobytes())
  h.update(payload)
  return b"".join([head, tokens.tobytes(), payload.tobytes(), h.digest()])


def decode_page(data: bytes, ns: bytes, key: bytes, tokens: np.ndarray) -> np.ndarray | None:
  """The payload `u8[page_bytes]` of a page file's bytes, or None unless every check passes
  (size, sha256, magic, version, namespace `ns`, `key`, `tokens`)."""
  tokens = np.asarray(tokens, "<i4").reshape(-1)
  if len(data) < _HEAD.size + _SUM:
    return None
  magic, version, page_size, nbytes, file_ns, file_key = _HEAD.unpack_from(data)
  if (magic != MAGIC or version != VERSION or page_size != tokens.size
      or len(data) != _HEAD.size + 4 * page_size + nbytes + _SUM):
    return None
  view = memoryview(data)
  if hashlib.sha256(view[:-_SUM]).digest() != bytes(view[-_SUM:]):
    return None
  if file_ns != ns or file_key != key:
    return None
  start = _HEAD.size + 4 * page_size
  if not np.array_equal(np.frombuffer(data, "<i4", page_size, _HEAD.size), tokens):
    return None
  return np.frombuffer(data, np.uint8, nbytes, start)


class SharedPrefixStore:
  """The offload store of a `PrefixCachingAllocator` whose pages are shared with other workers
  through `directory` (module docstring), optionally over local tiers (`local`, a
  `kvattn.paging.offload.TieredStore`, e.g. one `HostTier`) for the worker's own evictions.

  Pass it as `ContinuousBatcher(..., prefix_cache=True, offload=store)` (or
  `PrefixCachingAllocator(..., offload=store)` and `bind_device`).

  Attributes:
    root: `directory/<namespace>`, where this namespace's pages live.
    counters: "published" pages written, "present" pages found already written, "hits" pages
      read and verified, "missing" pages gone between lookup and read, "corrupt" pages that
      failed a check (removed), "write_errors".
  """

  def __init__(self, directory: str | os.PathLike, ns: str, *, local: Any = None):
    """Args:
      directory: the directory every worker sees (created if missing).
      ns: the namespace, `namespace(...)` (a non-empty string of letters, digits, '-', '_').
      local: None, or a `TieredStore` for evicted pages before they are forgotten.

    Raises:
      ValueError: an empty or unsafe namespace, a `local` without `put` / `take`.
      OSError: the directory cannot be created.
    """
    if not isinstance(ns, str) or not ns or not all(c.isalnum() or c in "-_" for c in ns):
      raise ValueError(f"ns must be a non-empty string of letters, digits, '-' or '_' (see "
                       f"namespace()); got {ns!r}")
    if local is not None and not all(hasattr(local, a) for a in ("put", "take", "discard")):
      raise ValueError(f"local must be a kvattn.paging.offload.TieredStore or None; got "
                       f"{type(local).__name__}")
    self.directory = os.fspath(directory)
    self.namespace = ns
    self._ns = hashlib.sha256(ns.encode()).digest()
    self.root = os.path.join(self.directory, ns)
    os.makedirs(self.root, exist_ok=True)
    self.local = local
    self.counters: collections.Counter = collections.Counter()
    self._on_drop: Callable[[Any], None] = lambda block: None
    self._warned = False
    self._lock = threading.Lock()  # counters, when threads share a store

  # The TieredStore face the allocator uses.
  @property
  def on_drop(self) -> Callable[[Any], None]:
    return self._on_drop

  @on_drop.setter
  def on_drop(self, fn: Callable[[Any], None]) -> None:
    self._on_drop = fn
    if self.local is not None:
      self.local.on_drop = fn

  @property
  def tiers(self) -> list[Any]:
    """The local tiers (the shared directory is not one of them)."""
    return [] if self.local is None else list(self.local.tiers)

  @property
  def moves(self) -> collections.Counter:
    return collections.Counter() if self.local is None else self.local.moves

  @property
  def keeps_evictions(self) -> bool:
    """Whether `put` stores an evicted page (a local tier); without one the allocator skips
    reading the page (it is in the shared directory already, or recomputed)."""
    return self.local is not None

  def put(self, block, payload) -> None:
    """An evicted block: to the local tiers, else dropped (`on_drop`)."""
    if self.local is not None:
      self.local.put(block, payload)
      return
    block.tier = "dropped"
    self._on_drop(block)

  def rows(self, payloads: Any) -> Sequence[Any]:
    return self.local.rows(payloads) if self.local is not None else list(np.asarray(payloads))

  def take(self, block):
    """The payload of `block` (`u8[page_bytes]`): from the shared directory for a block of
    tier `SHARED_TIER`, else from the local tiers; None when gone or corrupt."""
    if block.tier == SHARED_TIER:
      return self.read(block.key, block.tokens)
    return self.local.take(block) if self.local is not None else None

  def discard(self, block) -> None:
    """Forgets `block` in the local tiers (shared files belong to every worker: kept)."""
    if self.local is not None:
      self.local.discard(block)

  def used_bytes(self) -> dict[str, int]:
    return {} if self.local is None else self.local.used_bytes()

  # The shared directory.
  def path_of(self, key: bytes) -> str:
    """The file of page key `key` (32 bytes)."""
    name = key.hex()
    return os.path.join(self.root, name[:2], name + _SUFFIX)

  def contains(self, key: bytes) -> bool:
    """True if a page of key `key` is in the directory (not yet verified: `read` checks)."""
    return os.path.exists(self.path_of(key))

  def read(self, key: bytes, tokens: np.ndarray) -> np.ndarray | None:
    """The verified payload of page `key` holding `tokens` (`i32[page_size]`), or None (gone,
    or corrupt: counted, and the file removed)."""
    path = self.path_of(key)
    try:
      with open(path, "rb") as f:
        data = f.read()
    except OSError:
      self._count("missing")
      return None
    payload = decode_page(data, self._ns, key, tokens)
    if payload is None:
      self._count("corrupt")
      logging.getLogger(__name__).warning("shared prefix page %s failed its checks; removed "
                                          "(the prefix is recomputed)", path)
      try:
        os.remove(path)
      except OSError:
        pass
      return None
    self._count("hits")
    return payload

  def write(self, key: bytes, tokens: np.ndarray, payload: np.ndarray) -> bool:
    """Publishes one page (temporary file, then `os.replace`). Returns whether it was written
    (False: an `OSError`, counted and logged once)."""
    path = self.path_of(key)
    tmp = os.path.join(os.path.dirname(path),
                       f".{key.hex()[:16]}.{os.getpid()}.{uuid.uuid4().hex[:12]}.tmp")
    try:
      os.makedirs(os.path.dirname(path), exist_ok=True)
      with open(tmp, "wb") as f:
        f.write(encode_page(self._ns, key, tokens, payload))
      os.replace(tmp, path)
    except OSError as e:
      self._count("write_errors")
      try:
        os.remove(tmp)
      except OSError:
        pass
      if not self._warned:
        self._warned = True
        logging.getLogger(__name__).warning(
            "shared prefix store %s cannot write (%s: %s); pages are not shared, requests go on",
            self.root, type(e).__name__, e)
      return False
    self._count("published")
    return True

  def publish(self, blocks: Sequence[Any], read: Callable[[Sequence[int]], Any]) -> int:
    """Writes the blocks (`CachedBlock`s on the device) whose keys are not in the directory
    yet: their pages read by `read(pages) -> u8[n, page_bytes]` in one call.

    Returns:
      Pages written.
    """
    todo = [b for b in blocks if not self.contains(b.key)]
    self._count("present", len(blocks) - len(todo))
    if not todo:
      return 0
    rows = np.asarray(read([b.page for b in todo]))
    return sum(self.write(b.key, b.tokens, row) for b, row in zip(todo, rows))

  def files(self) -> list[str]:
    """Paths of the page files of this namespace (temporaries excluded)."""
    out = []
    for sub in sorted(os.listdir(self.root)):
      folder = os.path.join(self.root, sub)
      if os.path.isdir(folder):
        out.extend(os.path.join(folder, n) for n in sorted(os.listdir(folder))
                   if n.endswith(_SUFFIX) and not n.startswith("."))
    return out

  def verify(self, path: str) -> bool:
    """True if the page file at `path` passes every check for its own key and tokens (the
    tokens are taken from the file; the checksum covers them)."""
    try:
      with open(path, "rb") as f:
        data = f.read()
      _, _, page_size, _, _, key = _HEAD.unpack_from(data)
      tokens = np.frombuffer(data, "<i4", page_size, _HEAD.size)
    except (OSError, struct.error, ValueError):
      return False
    return (os.path.basename(path) == key.hex() + _SUFFIX
            and decode_page(data, self._ns, key, tokens) is not None)

  def prune(self, max_bytes: int, *, stale_s: float = 3600.0) -> int:
    """Removes the least recently written page files until this namespace holds at most
    `max_bytes`, and temporaries older than `stale_s` seconds (a crashed writer's). Safe while
    other workers run: a page removed under a reader is a miss, recomputed.

    Returns:
      Files removed.

    Raises:
      ValueError: a negative `max_bytes`.
    """
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, (int, np.integer)) or max_bytes < 0:
      raise ValueError(f"max_bytes must be an int >= 0; got {max_bytes!r}")
    removed, now, pages = 0, time.time(), []
    for sub in os.listdir(self.root):
      folder = os.path.join(self.root, sub)
      if not os.path.isdir(folder):
        continue
      for name in os.listdir(folder):
        path = os.path.join(folder, name)
        try:
          st = os.stat(path)
        except OSError:
          continue
        if name.startswith(".") and name.endswith(".tmp"):
          if now - st.st_mtime > stale_s:
            removed += _remove(path)
        elif name.endswith(_SUFFIX):
          pages.append((st.st_mtime, st.st_size, path))
    total = sum(size for _, size, _ in pages)
    for _, size, path in sorted(pages):
      if total <= max_bytes:
        break
      removed += _remove(path)
      total -= size
    return removed

  def _count(self, name: str, n: int = 1) -> None:
    with self._lock:
      self.counters[name] += n


def _remove(path: str) -> int:
  try:
    os.remove(path)
    return 1
  except OSError:
    return 0
