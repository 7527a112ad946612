"""Offload tiers for cold KV pages: host memory, then disk (vLLM offloading, SGLang HiCache)."""

from __future__ import annotations

import collections
import concurrent.futures
import hashlib
import logging
import os
import threading
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

TIER_KINDS = ("host", "disk")
PREFIX_CACHE_MODES = ("off", "device", "host", "disk")
"""Experiment modes: no prefix cache; cached pages on the device only; plus a
host tier; plus host and disk tiers (`make_store`)."""


def _capacity(name: str, value: Any) -> int:
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
    raise ValueError(f"{name} must be an int number of bytes >= 0; got {value!r}")
  return int(value)


def pinned_host_available(device: Any = None) -> bool:
  """True if `device` (default the first) can address the `pinned_host` memory kind."""
  device = jax.local_devices()[0] if device is None else device
  try:
    return any(m.kind == "pinned_host" for m in device.addressable_memories())
  except (AttributeError, NotImplementedError):
    return False


class _LruTier:
  """Bytes-bounded LRU map block -> stored page; subclasses store and load."""

  name = "tier"

  def __init__(self, capacity_bytes: int):
    self.capacity_bytes = _capacity("capacity_bytes", capacity_bytes)
    self._items: collections.OrderedDict[Any, tuple[Any, int]] = collections.OrderedDict()
    self.used_bytes = 0

  def __contains__(self, block) -> bool:
    return block in self._items

  def __len__(self) -> int:
    return len(self._items)

  def size_of(self, block) -> int:
    """Bytes of `block`'s payload (the tier must hold it)."""
    return self._items[block][1]

  def put(self, block, payload) -> list[tuple[Any, Any]]:
    """Stores `payload` (`u8[page_bytes]`); returns what no longer fits, least recently stored
    first, as `(block, payload)` (the new page itself when it alone exceeds the capacity)."""
    size = int(np.prod(np.shape(payload)))
    if size > self.capacity_bytes:
      return [(block, payload)]
    stored = self._store(block, payload)  # first: a store that raises changes nothing
    out = []
    while self.used_bytes + size > self.capacity_bytes:
      old, _ = next(iter(self._items.items()))
      out.append((old, self.take(old)))
    self._items[block] = (stored, size)
    self.used_bytes += size
    return out

  def take(self, block):
    """Removes `block`; returns its payload, or None if it is gone or corrupt."""
    stored, size = self._items.pop(block)
    self.used_bytes -= size
    return self._load(block, stored)

  def discard(self, block) -> None:
    if block in self._items:
      stored, size = self._items.pop(block)
      self.used_bytes -= size
      self._remove(stored)

  def _store(self, block, payload):
    raise NotImplementedError

  def _load(self, block, stored):
    raise NotImplementedError

  def _remove(self, stored) -> None:
    del stored


class HostTier(_LruTier):
  """Pages in host memory: `pinned_host` jax arrays when offered, else numpy."""

  name = "host"

  def __init__(self, capacity_bytes: int, *, pinned: bool | None = None):
    """Args:
      capacity_bytes: bytes of page payloads held at most.
      pinned: use the `pinned_host` memory kind (default: when the device offers it).

    Raises:
      ValueError: a negative capacity, or `pinned=True` where the device has no pinned_host.
    """
    super().__init__(capacity_bytes)
    available = pinned_host_available()
    if pinned and not available:
      raise ValueError("pinned must be False or None: the device offers no pinned_host memory")
    # On a CPU backend device memory is host memory already: numpy rows cost one copy, while
    # pinned_host arrays add a transfer dispatch per page. Elsewhere pinned pages are DMA'd.
    default = available and jax.local_devices()[0].platform != "cpu"
    self.pinned = default if pinned is None else bool(pinned)
    if self.pinned:
      device = jax.local_devices()[0]
      self._sharding = jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host")

  def _store(self, block, payload):
    if self.pinned:  # waits for the copy, so the device page may be overwritten at once
      return jax.device_put(payload, self._sharding).block_until_ready()
    return np.array(payload, copy=True)  # a copy: never a view into a batch or device buffer

  def _load(self, block, stored):
    return stored


class DiskTier(_LruTier):
  """Pages in files under `directory`, checked by sha256 on load; disabled when it cannot write.

  Attributes:
    error: None, or why the tier was disabled (the first `OSError` creating the
      directory or writing a page: read-only, full, not a directory). A
      disabled tier stores nothing new (`put` hands every page back) and says
      so once (`logging.warning`); the pages it already holds stay readable.
  """

  name = "disk"

  def __init__(self, directory: str | os.PathLike, capacity_bytes: int):
    super().__init__(capacity_bytes)
    self.directory = os.fspath(directory)
    self.error: str | None = None
    self._serial = 0
    try:
      os.makedirs(self.directory, exist_ok=True)
    except OSError as e:
      self._disable(e)

  def path_of(self, block) -> str | None:
    """The file holding `block`, or None."""
    item = self._items.get(block)
    return None if item is None else item[0][0]

  def put(self, block, payload) -> list[tuple[Any, Any]]:
    """`_LruTier.put`; once a write has failed, hands every page back (see the class doc)."""
    if self.error is not None:
      return [(block, payload)]
    try:
      return super().put(block, payload)
    except OSError as e:  # raised by _store before anything changed
      self._disable(e)
      return [(block, payload)]

  def _disable(self, error: OSError) -> None:
    self.error = f"{type(error).__name__}: {error}"
    logging.getLogger(__name__).warning(
        "disk tier %s cannot write (%s); offloading goes on without it: pages it would hold "
        "pass on to the next tier or are dropped (recomputed when needed)", self.directory,
        self.error)

  def _store(self, block, payload):
    data = np.asarray(payload, np.uint8).reshape(-1)
    self._serial += 1
    path = os.path.join(self.directory, f"page_{self._serial:08d}.kv")
    try:
      _write_file(path, data.tobytes())
    except OSError:
      self._remove((path,))  # a partial file of a full disk
      raise
    return path, data.shape, hashlib.sha256(data.tobytes()).digest()

  def _load(self, block, stored):
    path, shape, digest = stored
    try:
      if os.path.getsize(path) != int(np.prod(shape)):
        return None
      data = np.array(np.memmap(path, np.uint8, "r", shape=shape))
    except (OSError, ValueError):
      return None
    finally:
      self._remove(stored)
    if hashlib.sha256(data.tobytes()).digest() != digest:
      return None
    return data

  def _remove(self, stored) -> None:
    try:
      os.remove(stored[0])
    except OSError:  # gone already, or the directory is no longer usable
      pass


def _write_file(path: str, data: bytes) -> None:
  """Writes `data` to a new file at `path` (plain writes: a full disk raises OSError ENOSPC,
  where stores into a writable memmap fault with SIGBUS)."""
  with open(path, "wb") as f:
    f.write(data)


class TieredStore:
  """Offload tiers in order (fastest first): where evicted cached pages go."""

  def __init__(self, tiers: Sequence[_LruTier]):
    tiers = list(tiers)
    if not tiers:
      raise ValueError("tiers must hold at least one HostTier or DiskTier; got []")
    names = [t.name for t in tiers]
    if len(set(names)) != len(names):
      raise ValueError(f"tiers must have distinct names; got {names}")
    self.tiers = tiers
    self.on_drop: Callable[[Any], None] = lambda block: None
    self.moves: collections.Counter = collections.Counter()
    # Blocks whose payloads a prefetch holds: id(block) -> (block, handle, row of the handle).
    self._staged: dict[int, tuple[Any, PrefetchedPages, int]] = {}

  def put(self, block, payload) -> None:
    """Stores an evicted page in the first tier, cascading what overflows."""
    pending = [(block, payload)]
    for tier in self.tiers:
      spill = []
      for b, p in pending:
        if p is None:  # a corrupt disk copy pushed out of a middle tier
          spill.append((b, p))
          continue
        b.tier = tier.name
        spill.extend(tier.put(b, p))
      for b, _ in spill:
        self.moves[(tier.name, "next")] += 1
      pending = spill
    for b, _ in pending:
      self.moves[("last", "drop")] += 1
      b.tier = "dropped"
      self.on_drop(b)

  def rows(self, payloads: Any) -> Sequence[Any]:
    """Splits a batch of page payloads (`u8[n, page_bytes]`) into what `put` takes."""
    return list(np.asarray(payloads))

  def take(self, block):
    """Removes `block` from its tier (or a prefetch); returns its payload, or None (then the
    caller forgets it)."""
    staged = self._staged.pop(id(block), None)
    if staged is not None:
      self.moves[("prefetch", "device")] += 1
      return staged[1].row(staged[2])
    for tier in self.tiers:
      if block in tier:
        payload = tier.take(block)
        self.moves[(tier.name, "device")] += 1
        return payload
    return None

  def discard(self, block) -> None:
    self._staged.pop(id(block), None)
    for tier in self.tiers:
      tier.discard(block)

  def prefetch(self, blocks: Sequence[Any], codec: "PageCodec") -> "PrefetchedPages":
    """Takes the page payloads of `blocks` out of their tiers and starts moving them to the
    device (`PageCodec.prefetch`, on its worker thread); `take` of such a block then returns
    its row of the staging block, which `PageCodec.write` uses in place. Blocks in no tier,
    prefetched already, or whose payload is not exactly one page (a boundary state rides
    along) are skipped; a corrupt disk page is dropped (`on_drop`) as `take` would find it.
    Call `release(handle)` once the request joined or will not come.

    Args:
      blocks: cached blocks (`kvattn.paging.prefix`), in the order of the prompt.
      codec: the `PageCodec` of the pools the pages will be written to.
    """
    taken = []
    for block in blocks:
      if id(block) in self._staged:
        continue
      tier = next((t for t in self.tiers if block in t), None)
      if tier is None or tier.size_of(block) != codec.page_bytes:
        continue
      payload = tier.take(block)
      self.moves[(tier.name, "prefetch")] += 1
      if payload is None:
        block.tier = "dropped"
        self.on_drop(block)
        continue
      taken.append((block, payload))
    handle = codec.prefetch([p for _, p in taken])
    for i, (block, _) in enumerate(taken):
      self._staged[id(block)] = (block, handle, i)
    return handle

  def release(self, handle: "PrefetchedPages") -> None:
    """Puts what no `take` collected from `handle` back in the tiers (first tier first, as
    `put`), then returns its staging block to the codec. Nothing is lost or left held."""
    left = [(b, i) for b, h, i in self._staged.values() if h is handle]
    for block, i in left:
      del self._staged[id(block)]
      self.put(block, np.array(handle.row(i), copy=True))
    handle.codec.release(handle)

  @property
  def num_prefetched(self) -> int:
    """Blocks whose payloads a prefetch holds (not yet taken or released)."""
    return len(self._staged)

  def used_bytes(self) -> dict[str, int]:
    return {t.name: t.used_bytes for t in self.tiers}


def make_store(mode: str, *, host_bytes: int = 0, disk_bytes: int = 0,
               directory: str | os.PathLike | None = None) -> TieredStore | None:
  """The offload store of a prefix-cache mode (`PREFIX_CACHE_MODES`).

  Raises:
    ValueError: an unknown mode, a negative capacity, "disk" without `directory`.
  """
  if mode not in PREFIX_CACHE_MODES:
    raise ValueError(f"prefix_cache must be one of {PREFIX_CACHE_MODES}; got {mode!r}")
  host_bytes = _capacity("host_bytes", host_bytes)
  disk_bytes = _capacity("disk_bytes", disk_bytes)
  if mode in ("off", "device"):
    return None
  tiers: list[_LruTier] = [HostTier(host_bytes)]
  if mode == "disk":
    if directory is None:
      raise ValueError("directory must be given for prefix_cache 'disk'; got None")
    tiers.append(DiskTier(directory, disk_bytes))
  return TieredStore(tiers)


def _bucket(n: int) -> int:
  """The next of 1, 2, 3, 4, 6, 8, 12, 16, 24, ... at or above `n` (powers of two and their
  halfway points: at most a third wasted), so the jitted reads and writes compile once per
  bucket, not once per page count."""
  size = 1 << max(0, n - 1).bit_length()
  if size >= 4 and n <= size * 3 // 4:
    size = size * 3 // 4
  return size


def page_runs(pages: Sequence[int], bucket: int, rows: Sequence[int] | None = None
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """The copies that move `pages` as runs of consecutive pages, each split in power-of-two parts.

  Pool page `pages[i]` comes from (or goes to) payload row `rows[i]` (default `i`). A run is
  a maximal stretch where the next page is the next pool page in the next payload row; a run
  of length r is copied as the parts of r's binary form, so a part of size 2^c is one
  static-shape slice at a dynamic offset.

  Args:
    pages: pool pages (ints >= 0), one per payload row used.
    bucket: the padded page count (>= len(pages), > every row); parts have sizes 2^c <= bucket.
    rows: the payload row of each page (ints in [0, bucket)), or None for 0, 1, 2, ...

  Returns:
    `(rows i32[C, bucket], starts i32[C, bucket], counts i32[C])` with C = bucket's bit
    length: class c's first `counts[c]` parts start at payload row `rows[c, j]` and pool page
    `starts[c, j]` and span 2^c pages; the rest of each row is zero padding.

  Raises:
    ValueError: `rows` of another length than `pages`.
  """
  pages = np.asarray(pages, np.int64).reshape(-1)
  index = (np.arange(len(pages)) if rows is None else np.asarray(rows, np.int64).reshape(-1))
  if len(index) != len(pages):
    raise ValueError(f"rows must give one payload row per page ({len(pages)}); got "
                     f"{len(index)}")
  classes = max(1, int(bucket).bit_length())
  out_rows = np.zeros((classes, bucket), np.int32)
  starts = np.zeros((classes, bucket), np.int32)
  counts = np.zeros((classes,), np.int32)
  breaks = np.flatnonzero((np.diff(pages) != 1) | (np.diff(index) != 1)) + 1
  for run in np.split(np.arange(len(pages)), breaks):
    if not len(run):
      continue
    i, left = int(run[0]), len(run)
    for c in reversed(range(classes)):
      while left >= 1 << c:
        out_rows[c, counts[c]], starts[c, counts[c]] = index[i], pages[i]
        counts[c] += 1
        i, left = i + (1 << c), left - (1 << c)
  return out_rows, starts, counts


def _uint(width: int):
  return {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}[width]


def _stored(pool):
  """`pool` as moved: floats narrower than 32 bits as unsigned ints of their width (XLA:CPU
  computes bf16/fp8 in f32 and would quiet signalling NaNs, even in a slice), the rest as
  they are."""
  if jnp.issubdtype(pool.dtype, jnp.floating) and pool.dtype.itemsize < 4:
    return jax.lax.bitcast_convert_type(pool, _uint(pool.dtype.itemsize))
  return pool


def _as_bytes(x):
  """`x` (any dtype) as u8 with one more trailing axis of its item size."""
  if x.dtype.itemsize == 1:
    return jax.lax.bitcast_convert_type(x, jnp.uint8)[..., None]
  return jax.lax.bitcast_convert_type(x, jnp.uint8)


def _from_bytes(raw, dtype):
  """Inverse of `_as_bytes`: u8 `[..., itemsize]` as `dtype` `[...]`."""
  if jnp.dtype(dtype).itemsize == 1:
    return jax.lax.bitcast_convert_type(raw[..., 0], dtype)
  return jax.lax.bitcast_convert_type(raw, dtype)


_ALIGN = 4096  # a page of host memory: a CPU backend's device_put aliases such a buffer


def _aligned_empty(shape: tuple[int, int]) -> np.ndarray:
  """`u8[shape]`, uninitialised, its first byte on an `_ALIGN`-byte boundary."""
  size = int(np.prod(shape))
  raw = np.empty(size + _ALIGN, np.uint8)
  start = -raw.ctypes.data % _ALIGN
  return raw[start:start + size].reshape(shape)


def _on_host(pool) -> bool:
  """True for a jax array on one CPU device (its `np.asarray` is a view, not a copy)."""
  try:
    devices = pool.sharding.device_set
  except AttributeError:
    return False
  return len(devices) == 1 and next(iter(devices)).platform == "cpu"


class PageCodec:
  """Page payloads of a model's paged caches: the bytes of one page in every pool (each
  cache's `POOL_FIELDS`, `kvattn.caches.capabilities`).

  A payload row is one page: every pool's `[K, page_size, ...]` block in pool order, as bytes.
  Reads and writes move whole runs of consecutive pages (`page_runs`): one dynamic slice or
  dynamic update of static shape per run part and pool inside one jitted program (the caches
  donated on write, so the pools are updated in place), the payload crossing between host and
  device as one `u8[n, page_bytes]` array (`jax.device_put`; a read comes back without a copy
  on a CPU backend).
  """

  def __init__(self, caches: Sequence[Any]):
    pools = self._pools(caches)
    self.layouts = [(p.shape[:1] + p.shape[2:], p.dtype) for p in pools]
    self.sizes = [int(np.prod(s)) * jnp.dtype(d).itemsize for s, d in self.layouts]
    self.page_bytes = sum(self.sizes)
    layouts, sizes = self.layouts, self.sizes
    offsets = np.cumsum([0] + sizes[:-1]).tolist()

    def part(pool, start, length):  # pool pages [start, start + length) as u8[length, size]
      x = jax.lax.dynamic_slice_in_dim(pool, start, length, axis=1)
      return _as_bytes(jnp.moveaxis(x, 1, 0)).reshape(length, -1)

    def read(caches, rows, starts, counts, bucket):
      pools = [_stored(p) for p in self._pools(caches)]
      out = jnp.zeros((bucket, self.page_bytes), jnp.uint8)
      for c in range(rows.shape[0]):
        def body(j, out, c=c):
          for pool, offset in zip(pools, offsets):
            out = jax.lax.dynamic_update_slice(out, part(pool, starts[c, j], 1 << c),
                                               (rows[c, j], offset))
          return out
        out = jax.lax.fori_loop(0, counts[c], body, out)
      return out

    def write(caches, rows, starts, counts, payload):
      pools = [_stored(p) for p in self._pools(caches)]
      for c in range(rows.shape[0]):
        length = 1 << c
        def body(j, pools, c=c, length=length):
          block = jax.lax.dynamic_slice_in_dim(payload, rows[c, j], length, axis=0)
          out = []
          for pool, offset, size, (shape, _) in zip(pools, offsets, sizes, layouts):
            raw = block[:, offset:offset + size].reshape((length,) + shape +
                                                         (pool.dtype.itemsize,))
            new = jnp.moveaxis(_from_bytes(raw, pool.dtype), 0, 1)
            index = (0, starts[c, j]) + (0,) * (pool.ndim - 2)
            out.append(jax.lax.dynamic_update_slice(pool, new, index))
          return out
        pools = jax.lax.fori_loop(0, counts[c], body, pools)
      it = iter(pools)
      out = []
      for cache in caches:
        fields = {}
        for name in getattr(cache, "POOL_FIELDS", ()):
          pool = getattr(cache, name)
          if pool is not None:
            fields[name] = jax.lax.bitcast_convert_type(next(it), pool.dtype)
        out.append(cache.replace(**fields) if fields else cache)
      return tuple(out)

    self._read = jax.jit(read, static_argnums=(4,))
    self._write = jax.jit(write, donate_argnums=(0,))
    self._scratch: np.ndarray | None = None  # the staging block of `write`, grown and reused
    self._lock = threading.Lock()  # guards the prefetch bookkeeping below
    self._free_blocks: list[np.ndarray] = []  # staging blocks of released prefetches
    self._prefetched: dict[int, PrefetchedPages] = {}  # id(block's memory) -> live prefetch
    self._worker: concurrent.futures.ThreadPoolExecutor | None = None

  @staticmethod
  def _pools(caches):
    return [p for c in caches for name in getattr(c, "POOL_FIELDS", ())
            if (p := getattr(c, name)) is not None]

  def _pages(self, caches: Sequence[Any], pages: Sequence[int]) -> np.ndarray:
    pages = np.asarray(pages, np.int64).reshape(-1)
    pools = self._pools(caches)
    if len(pages) and pools:
      num_pages = pools[0].shape[1]
      if pages.min() < 0 or pages.max() >= num_pages:
        raise ValueError(f"pages must lie in [0, {num_pages}); got {pages.tolist()}")
    return pages

  def read(self, caches: Sequence[Any], pages: Sequence[int]) -> np.ndarray:
    """`u8[len(pages), page_bytes]` (host) the contents of `pages` in every pool, moved as
    runs of consecutive pages (class doc). Pools in host memory already (one CPU device,
    where `np.asarray` is a view) are copied from directly, one strided copy per run and
    pool; others are gathered on the device by one jitted program and fetched in one
    transfer.

    Raises:
      ValueError: a page outside the pool.
    """
    pages = self._pages(caches, pages)
    n = len(pages)
    if not n:
      return np.zeros((0, self.page_bytes), np.uint8)
    pools = self._pools(caches)
    if all(_on_host(p) for p in pools):
      return self._read_host(pools, pages)
    bucket = _bucket(n)
    rows, starts, counts = page_runs(pages, bucket)
    out = self._read(tuple(caches), rows, starts, counts, bucket)
    return np.asarray(out)[:n]

  def _read_host(self, pools, pages: np.ndarray) -> np.ndarray:
    out = _aligned_empty((len(pages), self.page_bytes))
    breaks = np.flatnonzero(np.diff(pages) != 1) + 1
    runs = [(int(r[0]), int(pages[r[0]]), len(r))
            for r in np.split(np.arange(len(pages)), breaks)]
    offset = 0
    for pool, size in zip(pools, self.sizes):
      k = pool.shape[0]
      # [K, P, bytes per head and page]: a view of the device buffer, read as bytes.
      view = np.asarray(pool).reshape(k, pool.shape[1], -1).view(np.uint8)
      for row, page, length in runs:
        dst = out[row:row + length, offset:offset + size].reshape(length, k, -1)
        np.copyto(dst, view[:, page:page + length].transpose(1, 0, 2))
      offset += size
    return out

  def _checked(self, pages: Sequence[int], num_pages: int) -> np.ndarray:
    pages = np.asarray(pages, np.int64).reshape(-1)
    if len(pages) and (pages.min() < 0 or pages.max() >= num_pages):
      raise ValueError(f"pages must lie in [0, {num_pages}); got {pages.tolist()}")
    return pages

  def _fill(self, buf: np.ndarray, payload: Any, n: int) -> None:
    """Copies `payload` (n rows) into `buf[:n]`: one copy per row, no temporary."""
    if isinstance(payload, (list, tuple)):
      if len(payload) != n or any(np.shape(p) != (self.page_bytes,) for p in payload):
        raise ValueError(f"payload must be {n} rows of page_bytes = {self.page_bytes} bytes; "
                         f"got {[np.shape(p) for p in payload]}")
      if n:
        np.stack([np.asarray(p, np.uint8) for p in payload], out=buf[:n])
    else:
      payload = np.asarray(payload)
      if payload.shape != (n, self.page_bytes):
        raise ValueError(f"payload must have shape [len(pages), page_bytes] = ({n}, "
                         f"{self.page_bytes}); got {tuple(payload.shape)}")
      np.copyto(buf[:n], payload, casting="unsafe")

  @staticmethod
  def _last_rows(pages: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
    """A page listed twice gets its last row, as with a scatter: `(pages each once, their
    payload rows)`, or `(pages, None)` when every page is listed once."""
    last = {int(p): i for i, p in enumerate(pages)}
    if len(last) == len(pages):
      return pages, None
    keep = np.array(sorted(last.values()))
    return pages[keep], keep

  def stage(self, pages: Sequence[int], payload: Any, num_pages: int) -> "StagedPages":
    """Starts moving `payload` for `pages` to the device, without touching any cache: the
    host copy and the transfer can run (on another thread) while a decode step computes;
    `write(caches, pages, staged)` then only updates the pools. The block is a new one
    (a CPU backend's array aliases it for as long as it lives); `prefetch` reuses blocks.

    Args:
      pages: pool pages, payload order.
      payload: `u8[len(pages), page_bytes]`, or a list of `u8[page_bytes]` rows.
      num_pages: pages in each pool (the pages are checked against it).

    Raises:
      ValueError: a payload of the wrong shape, or a page outside [0, num_pages).
    """
    pages = self._checked(pages, num_pages)
    n = len(pages)
    bucket = _bucket(max(n, 1))
    # One host copy into the padded block; its padding rows are never read (`page_runs`).
    # Aligned, so a CPU backend's device_put takes it without a second copy.
    buf = _aligned_empty((bucket, self.page_bytes))
    self._fill(buf, payload, n)
    pages, rows = self._last_rows(pages)
    return StagedPages(pages, page_runs(pages, bucket, rows), jax.device_put(buf) if n else None)

  def prefetch(self, payload: Sequence[Any]) -> "PrefetchedPages":
    """Starts moving page rows to the device for pool pages chosen later: on a worker thread,
    one copy of the rows into a staging block reused across prefetches, then its transfer
    (`jax.device_put`; a CPU backend aliases the block). A decode step may compute meanwhile
    (its jitted program releases the GIL). `write(caches, pages, [handle.row(i) ...])` then
    only updates the pools; `release(handle)` returns the block.

    Args:
      payload: `u8[page_bytes]` rows (any length, the order of `handle.row(i)`).

    Raises:
      ValueError: a row of another size than page_bytes.
    """
    rows = list(payload)
    if any(np.shape(p) != (self.page_bytes,) for p in rows):
      raise ValueError(f"payload must be rows of page_bytes = {self.page_bytes} bytes; got "
                       f"{[np.shape(p) for p in rows]}")
    bucket = _bucket(max(len(rows), 1))
    with self._lock:
      fits = [i for i, b in enumerate(self._free_blocks) if b.shape[0] >= bucket]
      if fits:  # the smallest block that fits
        block = self._free_blocks.pop(min(fits, key=lambda i: len(self._free_blocks[i])))
      else:
        block = _aligned_empty((bucket, self.page_bytes))
      if self._worker is None:
        self._worker = concurrent.futures.ThreadPoolExecutor(1, "kvattn-prefetch")
      handle = PrefetchedPages(self, block[:bucket], len(rows))
      handle._block = block  # pylint: disable=protected-access
      self._prefetched[id(block.base)] = handle

    def move():
      if rows:
        np.stack([np.asarray(p, np.uint8) for p in rows], out=handle.host[:len(rows)])
      return jax.block_until_ready(jax.device_put(handle.host))

    handle._future = self._worker.submit(move)  # pylint: disable=protected-access
    return handle

  def release(self, handle: "PrefetchedPages") -> None:
    """Returns `handle`'s staging block for reuse (after its transfer, and any `write` from
    it, finished). Its rows must not be used after. Releasing twice does nothing."""
    with self._lock:
      if self._prefetched.pop(id(handle.host.base), None) is not handle:
        return
    handle.wait()
    handle.device = None
    with self._lock:
      if len(self._free_blocks) < _FREE_BLOCKS:
        self._free_blocks.append(handle._block)  # pylint: disable=protected-access

  def _prefetched_rows(self, payload: Any, n: int):
    """`(handle, i64[n] rows)` if `payload` is n rows of one live prefetch's block, else None."""
    if not n or not isinstance(payload, (list, tuple)) or len(payload) != n:
      return None
    first = payload[0]
    if not isinstance(first, np.ndarray) or first.base is None:
      return None
    handle = self._prefetched.get(id(first.base))
    if handle is None:
      return None
    origin, rows = handle.host.ctypes.data, []
    for p in payload:
      if (not isinstance(p, np.ndarray) or p.base is not handle.host.base
          or p.shape != (self.page_bytes,) or not p.flags.c_contiguous):
        return None
      row, rest = divmod(p.ctypes.data - origin, self.page_bytes)
      if rest or not 0 <= row < handle.num_rows:
        return None
      rows.append(row)
    return handle, np.asarray(rows, np.int64)

  def write(self, caches: Sequence[Any], pages: Sequence[int], payload: Any) -> tuple[Any, ...]:
    """`caches` with `pages` overwritten by `payload` (`u8[len(pages), page_bytes]`, a list
    of `u8[page_bytes]` rows -- rows of a `prefetch` are used where they already are -- or
    what `stage` returned for these pages); `caches` are donated. Runs of consecutive pages
    are written as whole blocks (class doc); a page listed twice gets its last row. Except
    for a staged payload, returns once the pools are updated: the rows went through a
    staging block reused by the next write.

    Raises:
      ValueError: a payload of the wrong shape, a page outside the pool, or a staged payload
        of other pages.
    """
    pools = self._pools(caches)
    num_pages = pools[0].shape[1] if pools else 0
    if isinstance(payload, StagedPages):
      if not np.array_equal(np.unique(np.asarray(pages, np.int64)), np.unique(payload.pages)):
        raise ValueError(f"pages must be the pages staged ({payload.pages.tolist()}); got "
                         f"{np.asarray(pages).tolist()}")
      if payload.device is None:
        return tuple(caches)
      return self._write(tuple(caches), *payload.runs, payload.device)
    pages = self._checked(pages, num_pages)
    n = len(pages)
    prefetched = self._prefetched_rows(payload, n)
    if prefetched is not None:
      handle, rows = prefetched
      handle.wait()
      pages, keep = self._last_rows(pages)
      runs = page_runs(pages, handle.host.shape[0], rows if keep is None else rows[keep])
      return jax.block_until_ready(self._write(tuple(caches), *runs, handle.device))
    bucket = _bucket(max(n, 1))
    if self._scratch is None or self._scratch.shape[0] < bucket:
      self._scratch = _aligned_empty((bucket, self.page_bytes))  # grown, then reused
    buf = self._scratch[:bucket]
    self._fill(buf, payload, n)
    if not n:
      return tuple(caches)
    pages, keep = self._last_rows(pages)
    # The device array may alias `buf`: wait for the update before the next write refills it.
    return jax.block_until_ready(self._write(tuple(caches), *page_runs(pages, bucket, keep),
                                             jax.device_put(buf)))


_FREE_BLOCKS = 4
"""Staging blocks of released prefetches a codec keeps for reuse."""


class PrefetchedPages:
  """Page rows on their way to the device for pages chosen later (`PageCodec.prefetch`).

  Attributes:
    host: `u8[bucket, page_bytes]` the staging block (rows past `num_rows` unused).
    num_rows: rows staged.
    device: the block as a jax array once moved (None before, and after `release`).
  """

  def __init__(self, codec: PageCodec, host: np.ndarray, num_rows: int):
    self.codec, self.host, self.num_rows = codec, host, num_rows
    self.device: Any = None
    self._block = host  # the whole staging block `host` begins (set by `prefetch`)
    self._future: concurrent.futures.Future | None = None

  def wait(self) -> None:
    """Blocks until the rows are in the block and on the device (re-raises the worker's
    error)."""
    if self._future is not None:
      self.device = self._future.result()
      self._future = None

  def done(self) -> bool:
    return self._future is None or self._future.done()

  def row(self, i: int) -> np.ndarray:
    """`u8[page_bytes]` row i (a view of the block; waits for the copy)."""
    if not 0 <= i < self.num_rows:
      raise ValueError(f"i must lie in [0, {self.num_rows}); got {i}")
    self.wait()
    return self.host[i]


class StagedPages(NamedTuple):
  """A payload on its way to the device (`PageCodec.stage`)."""

  pages: np.ndarray
  """`i64[n]` the pool pages, each once, in payload order."""
  runs: tuple[np.ndarray, np.ndarray, np.ndarray]
  """`page_runs(pages, bucket)`."""
  device: Any
  """`u8[bucket, page_bytes]` jax array (rows past n unused), or None for no pages."""
