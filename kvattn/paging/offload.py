"""Offload tiers for cold KV pages: host memory, then disk (vLLM offloading, SGLang HiCache)."""

from __future__ import annotations

import collections
import concurrent.futures
import hashlib
import heapq
import logging
import os
import threading
import weakref
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
  """Pages in host memory: `pinned_host` jax arrays when offered, else numpy rows in an arena.

  Numpy `u8` rows live in row arenas (`RowArena`), one per row size (a page; a page and a
  boundary state's bytes), each preallocated page-aligned chunks `u8[slots, row_bytes]`.
  `take` returns the slot's row itself (a view, no copy), and `PageCodec.write` reads such
  rows where they are (one zero-copy `device_put` of the chunk on a CPU backend, then one
  jitted update): a reload is one copy of the data, not two. A slot is reused only once
  nothing references its row any more (the tier, the caller that took it, a view of it),
  so a row taken out stays valid for as long as it is held. Rows of other dtypes, and of
  sizes past the first `_MAX_ARENAS`, are stored as plain copies.
  """

  name = "host"

  def __init__(self, capacity_bytes: int, *, pinned: bool | None = None,
               arena: bool | None = None):
    """Args:
      capacity_bytes: bytes of page payloads held at most.
      pinned: use the `pinned_host` memory kind (default: when the device offers it).
      arena: keep numpy rows in a `RowArena` (default: unless pinned); False stores each row
        as its own copy.

    Raises:
      ValueError: a negative capacity, `pinned=True` where the device has no pinned_host, or
        `pinned=True` with `arena=True`.
    """
    super().__init__(capacity_bytes)
    available = pinned_host_available()
    if pinned and not available:
      raise ValueError("pinned must be False or None: the device offers no pinned_host memory")
    # On a CPU backend device memory is host memory already: numpy rows cost one copy, while
    # pinned_host arrays add a transfer dispatch per page. Elsewhere pinned pages are DMA'd.
    default = available and jax.local_devices()[0].platform != "cpu"
    self.pinned = default if pinned is None else bool(pinned)
    if self.pinned and arena:
      raise ValueError("arena must be False or None with pinned=True: pinned pages are jax "
                       "arrays, not numpy rows")
    self.arenas: dict[int, RowArena] = {}  # row bytes -> the arena of rows of that size
    self._use_arena = not self.pinned if arena is None else bool(arena)
    if self.pinned:
      device = jax.local_devices()[0]
      self._sharding = jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host")

  def _store(self, block, payload):
    if self.pinned:  # waits for the copy, so the device page may be overwritten at once
      return jax.device_put(payload, self._sharding).block_until_ready()
    if self._use_arena:
      payload = np.asarray(payload)
      if payload.ndim == 1 and payload.dtype == np.uint8:
        arena = self.arenas.get(payload.size)
        if arena is None and len(self.arenas) < _MAX_ARENAS:
          arena = self.arenas[payload.size] = RowArena(payload.size, self.capacity_bytes)
        if arena is not None:
          return arena.store(payload)
    return np.array(payload, copy=True)  # a copy: never a view into a batch or device buffer

  def _load(self, block, stored):
    return stored


class _Slot:
  """Owns one arena slot: the base object of the slot's row (and so, through it, of every view
  of the row). When the last of them is gone, a `weakref.finalize` hands the slot back."""

  __slots__ = ("arena", "chunk", "slot", "data", "address", "__array_interface__",
               "__weakref__")

  def __init__(self, arena: "RowArena", chunk: int, slot: int, data: np.ndarray):
    self.arena, self.chunk, self.slot, self.data = arena, chunk, slot, data  # data: the chunk's row
    self.address = data.ctypes.data
    self.__array_interface__ = {"data": (self.address, False), "shape": data.shape,
                                "typestr": "|u1", "version": 3}


class RowArena:
  """Rows of one size in preallocated, page-aligned chunks (`HostTier`'s numpy rows).

  A chunk is `u8[slots, row_bytes]` from `_aligned_empty` (so a CPU backend's `device_put`
  aliases it); it holds twice the tier's capacity in slots (rows taken out but still held
  keep their slots, so the tier may need more slots than its capacity), capped at
  `_ARENA_CHUNK_BYTES`. Another chunk of that size is added when every slot is held, and
  dropped again once entirely free (never the first). A store takes the lowest free slot of
  the lowest chunk, so pages spilled together get consecutive slots: a reload of them is
  one run. Untouched slots cost address space only. Thread-safe (slots come back from
  whichever thread drops the last reference).

  Attributes:
    row_bytes: bytes of each row.
    slots_per_chunk: rows of each chunk.
    chunks: the chunks, `u8[slots_per_chunk, row_bytes]` (None where one was dropped).
  """

  def __init__(self, row_bytes: int, capacity_bytes: int):
    """Raises:
      ValueError: row_bytes < 1.
    """
    if row_bytes < 1:
      raise ValueError(f"row_bytes must be >= 1; got {row_bytes}")
    self.row_bytes = int(row_bytes)
    self.slots_per_chunk = max(1, min(2 * capacity_bytes, _ARENA_CHUNK_BYTES) // self.row_bytes)
    self.chunks: list[np.ndarray | None] = []
    self._free: list[list[int]] = []  # per chunk, a heap of free slots
    self._lock = threading.Lock()

  def store(self, payload: np.ndarray) -> np.ndarray:
    """A copy of `payload` (`u8[row_bytes]`) in a free slot: the slot's row, whose base
    object owns the slot (class doc)."""
    with self._lock:
      chunk = next((c for c, free in enumerate(self._free) if free), None)
      if chunk is None:
        chunk = next((c for c, a in enumerate(self.chunks) if a is None), len(self.chunks))
        if chunk == len(self.chunks):
          self.chunks.append(None)
          self._free.append([])
        self.chunks[chunk] = _aligned_empty((self.slots_per_chunk, self.row_bytes))
        self._free[chunk] = list(range(self.slots_per_chunk))  # sorted: a heap
      slot = heapq.heappop(self._free[chunk])
      data = self.chunks[chunk][slot]
    np.copyto(data, payload)
    owner = _Slot(self, chunk, slot, data)
    weakref.finalize(owner, self._release, chunk, slot).atexit = False
    return np.asarray(owner)

  def _release(self, chunk: int, slot: int) -> None:
    with self._lock:
      free = self._free[chunk]
      heapq.heappush(free, slot)
      if chunk and len(free) == self.slots_per_chunk:  # an added chunk, entirely free
        self.chunks[chunk], self._free[chunk] = None, []

  @property
  def num_held(self) -> int:
    """Slots whose rows are referenced (stored in a tier, or taken and still held)."""
    with self._lock:
      return sum(self.slots_per_chunk - len(f) for a, f in zip(self.chunks, self._free)
                 if a is not None)


def _arena_slot(row: Any) -> tuple[RowArena, int, int] | None:
  """`(arena, chunk, slot)` if `row` is a 1-D contiguous `u8` array starting at the first byte
  of an arena slot (a row `RowArena.store` returned, or a leading slice of one), else None."""
  if not isinstance(row, np.ndarray) or row.dtype != np.uint8 or row.ndim != 1:
    return None
  owner = row.base
  while isinstance(owner, np.ndarray):
    owner = owner.base
  if not isinstance(owner, _Slot) or not row.flags.c_contiguous:
    return None
  # `np.asarray(owner)` (what `store` returns) starts at the slot; a view of it may not.
  if row.base is not owner and row.ctypes.data != owner.address:
    return None
  return owner.arena, owner.chunk, owner.slot


_ARENA_CHUNK_BYTES = 1 << 30
"""Largest arena chunk (1 GiB of address space; see `RowArena`)."""

_MAX_ARENAS = 4
"""Row sizes a `HostTier` keeps in arenas (a page, a page with a boundary state: a model has
one or two); rows of further sizes are plain copies, so the address space stays bounded."""


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
    its payload object, which `PageCodec.write` recognises and writes from the staged block.
    Blocks in no tier, prefetched already, or whose payload is not exactly one page (a
    boundary state rides along) are skipped; a corrupt disk page is dropped (`on_drop`) as
    `take` would find it.
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
      self.put(block, handle.row(i))  # the payload taken from the tier (a tier copies it)
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
    bucket: the padded page count (>= len(pages)); parts have sizes 2^c <= bucket.
    rows: the payload row of each page (ints >= 0: rows of a staging block, or slots of a
      `RowArena` chunk), or None for 0, 1, 2, ...

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


def _from_units(x, shape, dtype):
  """Staged units `x` (u8/u16/u32, as many bytes as `shape` of `dtype`) as `dtype[shape]`: a
  reshape, then a bitcast (same width: no copy) or, for a wider dtype, one over a trailing axis
  of `itemsize / unit`."""
  ratio = jnp.dtype(dtype).itemsize // x.dtype.itemsize
  x = x.reshape(tuple(shape) + ((ratio,) if ratio > 1 else ()))
  return x if x.dtype == dtype else jax.lax.bitcast_convert_type(x, dtype)


_ALIGN = 4096  # a page of host memory: a CPU backend's device_put aliases such a buffer


def _aligned_empty(shape: tuple[int, ...]) -> np.ndarray:
  """`u8[shape]`, uninitialised, its first byte on an `_ALIGN`-byte boundary."""
  size = int(np.prod(shape))
  raw = np.empty(size + _ALIGN, np.uint8)
  start = -raw.ctypes.data % _ALIGN
  return raw[start:start + size].reshape(shape)


def _device_of(pools) -> Any:
  """The one device holding every pool, or None (no pools, several devices)."""
  try:
    devices = {d for p in pools for d in p.sharding.device_set}
  except AttributeError:
    return None
  return next(iter(devices)) if len(devices) == 1 else None


def _on_host(pool) -> bool:
  """True for a jax array on one CPU device (its `np.asarray` is a view, not a copy)."""
  try:
    devices = pool.sharding.device_set
  except AttributeError:
    return False
  return len(devices) == 1 and next(iter(devices)).platform == "cpu"


def _period(layouts: Sequence[Any]) -> int:
  """The fewest leading pools whose layouts repeat through the whole list (the pools of one
  layer: 2 for K and V, 6 for KIVI's codes, scales and zeros); 1 for no pools."""
  count = len(layouts)
  for p in range(1, count + 1):
    if count % p == 0 and all(layouts[j] == layouts[j % p] for j in range(count)):
      return p
  return 1


class PageCodec:
  """Page payloads of a model's paged caches: the bytes of one page in every pool (each
  cache's `POOL_FIELDS`, `kvattn.caches.capabilities`).

  A payload row is one page: every pool's `[K, page_size, ...]` block in pool order, as bytes
  (the format of the tiers and of `kvattn.paging.shared`'s page files). Reads and writes move
  whole runs of consecutive pages (`page_runs`). A read gathers them on the host (pools in
  host memory) or with one jitted program. A write first copies the rows on the host into a
  *pool-major* staging block -- pool j's pages as `[K, bucket + 1, bytes per head]`, the pools
  in order (`_fill`, `_block_bytes`) -- so the `[n, K, ...] -> [K, n, ...]` reorder happens in
  that copy (numpy, near memcpy speed); the block crosses to the device as one array
  (`jax.device_put`; aliased, not copied, on a CPU backend), and one jitted program does one
  static-shape `dynamic_update_slice` per run part and pool, a plain copy with no transpose
  (the caches donated: in place).

  Rows that a `HostTier` keeps in its `RowArena` skip the staging copy: the arena's chunk
  crosses to the device as it is (`device_put` aliases it on a CPU backend) and a second
  jitted program reads each run part at its slots, `[length, K, bytes per head]`, and writes
  it transposed into the pool in the same fusion as the in-place update. A reload from the
  host tier is then one copy of the data (the staging path is two: rows -> block -> pools).
  """

  def __init__(self, caches: Sequence[Any]):
    pools = self._pools(caches)
    self.layouts = [(p.shape[:1] + p.shape[2:], p.dtype) for p in pools]
    self.sizes = [int(np.prod(s)) * jnp.dtype(d).itemsize for s, d in self.layouts]
    self.page_bytes = sum(self.sizes)
    layouts, sizes = self.layouts, self.sizes
    offsets = np.cumsum([0] + sizes[:-1]).tolist()
    self._offsets = offsets
    # The staging block's element: the narrowest pool item, at most 4 bytes (no u64 without
    # x64). Pools of that width are bitcast as they are; wider ones gain a trailing axis.
    unit = min([jnp.dtype(d).itemsize for _, d in layouts] + [4])
    self._unit = unit
    self._period = _period(layouts)

    def part(pool, start, length):  # pool pages [start, start + length) as u8[length, size]
      x = jax.lax.dynamic_slice_in_dim(pool, start, length, axis=1)
      return _as_bytes(jnp.moveaxis(x, 1, 0)).reshape(length, -1)

    def read(caches, rows, starts, counts, bucket):
      pools = [_stored(p) for p in self._pools(caches)]
      out = jnp.zeros((bucket, self.page_bytes), jnp.uint8)
      for c in range(rows.shape[0]):
        if pools and 1 << c > pools[0].shape[1]:
          break  # no run is longer than the pool (a 16-page bucket over 13 pages)
        def body(j, out, c=c):
          for pool, offset in zip(pools, offsets):
            out = jax.lax.dynamic_update_slice(out, part(pool, starts[c, j], 1 << c),
                                               (rows[c, j], offset))
          return out
        out = jax.lax.fori_loop(0, counts[c], body, out)
      return out

    def write(caches, rows, starts, counts, block):
      # block: the pool-major staging block (`_fill`) as uint[slots * page_bytes / unit].
      slots = block.shape[0] * unit // max(self.page_bytes, 1)
      pools = [_stored(p) for p in self._pools(caches)]
      for c in range(rows.shape[0]):
        length = 1 << c
        if pools and length > pools[0].shape[1]:
          break  # no run is longer than the pool (a 16-page bucket over 13 pages)
        def body(j, pools, c=c, length=length):
          out = []
          for pool, offset, size, (shape, _) in zip(pools, offsets, sizes, layouts):
            # Pool j's staged pages, [K, slots, bytes per head / unit], sliced here in the
            # body: XLA fuses it into the update (sliced outside, it is copied into the loop).
            slab = block[slots * offset // unit:slots * (offset + size) // unit]
            slab = slab.reshape(shape[0], slots, size // shape[0] // unit)
            staged = jax.lax.dynamic_slice_in_dim(slab, rows[c, j], length, axis=1)
            new = _from_units(staged, (shape[0], length) + shape[1:], pool.dtype)
            index = (0, starts[c, j]) + (0,) * (pool.ndim - 2)
            out.append(jax.lax.dynamic_update_slice(pool, new, index))
          return out
        pools = jax.lax.fori_loop(0, counts[c], body, pools)
      return self._replace_pools(caches, pools)

    def write_rows(caches, rows, starts, counts, arena):
      # arena: a `RowArena` chunk as uint[slots, row_bytes / unit], rows where the tier keeps
      # them (row-major): each run part of each pool reads `[length, K, bytes per head]` at
      # its slot and writes it transposed, in one fusion with the in-place update.
      pools = [_stored(p) for p in self._pools(caches)]
      for c in range(rows.shape[0]):
        length = 1 << c
        if pools and length > min(pools[0].shape[1], arena.shape[0]):
          break  # no run is longer than the pool or the chunk
        def body(j, pools, c=c, length=length):
          out = []
          for pool, offset, size, (shape, _) in zip(pools, offsets, sizes, layouts):
            x = jax.lax.dynamic_slice(arena, (rows[c, j], offset // unit), (length, size // unit))
            x = x.reshape(length, shape[0], size // shape[0] // unit).transpose(1, 0, 2)
            new = _from_units(x, (shape[0], length) + shape[1:], pool.dtype)
            index = (0, starts[c, j]) + (0,) * (pool.ndim - 2)
            out.append(jax.lax.dynamic_update_slice(pool, new, index))
          return out
        pools = jax.lax.fori_loop(0, counts[c], body, pools)
      return self._replace_pools(caches, pools)

    self._read = jax.jit(read, static_argnums=(4,))
    self._write = jax.jit(write, donate_argnums=(0,))
    self._write_rows = jax.jit(write_rows, donate_argnums=(0,))
    self._arena_aliases = True  # False once a CPU device_put of an arena chunk copied it
    self._scratch: np.ndarray | None = None  # the staging block of `write`, grown and reused
    self._lock = threading.Lock()  # guards the prefetch bookkeeping below
    self._free_blocks: list[np.ndarray] = []  # staging blocks of released prefetches
    self._prefetched: dict[int, PrefetchedPages] = {}  # id(handle) -> live prefetch
    self._worker: concurrent.futures.ThreadPoolExecutor | None = None
    self._helper: concurrent.futures.ThreadPoolExecutor | None = None  # `_fill(split=True)`

  @staticmethod
  def _pools(caches):
    return [p for c in caches for name in getattr(c, "POOL_FIELDS", ())
            if (p := getattr(c, name)) is not None]

  @staticmethod
  def _replace_pools(caches, pools):
    """`caches` with their pools (`_pools` order) replaced by `pools` (as stored: `_stored`)."""
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

  def _rows(self, payload: Any, n: int) -> list[Any] | np.ndarray:
    """`payload` checked: n rows of `u8[page_bytes]` (a list), or `[n, page_bytes]`.

    Raises:
      ValueError: another count or size.
    """
    if isinstance(payload, (list, tuple)):
      if len(payload) != n or any(np.shape(p) != (self.page_bytes,) for p in payload):
        raise ValueError(f"payload must be {n} rows of page_bytes = {self.page_bytes} bytes; "
                         f"got {[np.shape(p) for p in payload]}")
      return list(payload)
    payload = np.asarray(payload)
    if payload.shape != (n, self.page_bytes):
      raise ValueError(f"payload must have shape [len(pages), page_bytes] = ({n}, "
                       f"{self.page_bytes}); got {tuple(payload.shape)}")
    return payload

  def _fill(self, block: np.ndarray, rows: list[Any] | np.ndarray, bucket: int, *,
            split: bool = False) -> np.ndarray:
    """Copies `rows` (checked by `_rows`, at most `bucket`) into `block` (flat u8, at least
    `_block_bytes(bucket)`) pool-major: with S = bucket + 1 slots, pool j's row i,
    `[K, bytes per head]`, goes to `block[S * offset_j:][:K * S * c].reshape(K, S, c)[:, i]`
    (c bytes per head). One strided copy per row and pool of a layer (`_period`): the pools
    of one position in every layer form one strided view on both sides. Returns the block's
    first `_block_bytes(bucket)` bytes as the staging dtype (what `_write` takes). With
    `split`, rows of at least `_SPLIT_BYTES` in all are copied by two threads."""
    slots = bucket + 1  # the block's rows per pool (_block_bytes)
    flat = block[:self._block_bytes(bucket)]
    units = flat.view(f"u{self._unit}")
    n = len(rows)
    if not n or not self.layouts:
      return units
    period = self._period
    layers = len(self.layouts) // period
    layer_bytes = sum(self.sizes[:period])
    dst = flat.reshape(layers, slots * layer_bytes)
    targets = []
    for p in range(period):
      k, offset, size = self.layouts[p][0][0], self._offsets[p], self.sizes[p]
      view = dst[:, slots * offset:slots * (offset + size)].reshape(
          layers, k, slots, size // k, copy=False)
      targets.append((view, offset, k, size))
    def copy(lo, hi):  # rows [lo, hi)
      if isinstance(rows, np.ndarray):  # [n, page_bytes]: one copy per position, every row
        src = rows[lo:hi].reshape(hi - lo, layers, layer_bytes)
        for view, offset, k, size in targets:
          part = src[:, :, offset:offset + size].reshape(hi - lo, layers, k, size // k)
          np.copyto(view[:, :, lo:hi], part.transpose(1, 2, 0, 3), casting="unsafe")
        return
      for i in range(lo, hi):
        src = np.asarray(rows[i], np.uint8).reshape(layers, layer_bytes)
        for view, offset, k, size in targets:
          np.copyto(view[:, :, i], src[:, offset:offset + size].reshape(layers, k, size // k))

    if not split or n < 2 or n * self.page_bytes < _SPLIT_BYTES:
      copy(0, n)
      return units
    # Two threads, half the rows each: numpy releases the GIL while it copies.
    with self._lock:
      if self._helper is None:
        self._helper = concurrent.futures.ThreadPoolExecutor(1, "kvattn-stage")
      first = self._helper.submit(copy, 0, n // 2)
    copy(n // 2, n)
    first.result()
    return units

  def _block_bytes(self, bucket: int) -> int:
    """Bytes of a staging block for `bucket` rows: bucket + 1 slots per pool. The spare slot
    keeps every run part a true slice: a part as long as the slab (64 pages of a 64-row
    block) makes XLA turn the dynamic slice into the slab and copy it out of the loop (5x
    slower, measured)."""
    return (bucket + 1) * self.page_bytes

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
    rows = self._rows(payload, n)
    # One host copy into the padded pool-major block; its padding rows are never read
    # (`page_runs`). Aligned, so a CPU backend's device_put takes it without a second copy.
    units = self._fill(_aligned_empty((self._block_bytes(bucket),)), rows, bucket)
    pages, keep = self._last_rows(pages)
    return StagedPages(pages, page_runs(pages, bucket, keep),
                       jax.device_put(units) if n else None)

  def prefetch(self, payload: Sequence[Any]) -> "PrefetchedPages":
    """Starts moving page rows to the device for pool pages chosen later: on a worker thread,
    one copy of the rows into a pool-major staging block reused across prefetches (class
    doc), then its transfer (`jax.device_put`; a CPU backend aliases the block). A decode step
    may compute meanwhile (its jitted program releases the GIL). `handle.row(i)` is the i-th
    row given (the same object, held until `release`); `write(caches, pages,
    [handle.row(i) ...])` recognises those objects and only updates the pools from the
    staged block. The rows must not change while prefetched. `release(handle)` returns the
    block.

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
    need = self._block_bytes(bucket)
    with self._lock:
      fits = [i for i, b in enumerate(self._free_blocks) if b.size >= need]
      if fits:  # the smallest block that fits
        block = self._free_blocks.pop(min(fits, key=lambda i: self._free_blocks[i].size))
      else:
        block = _aligned_empty((need,))
      if self._worker is None:
        self._worker = concurrent.futures.ThreadPoolExecutor(1, "kvattn-prefetch")
      handle = PrefetchedPages(self, rows, bucket, block)
      self._prefetched[id(handle)] = handle

    def move():
      return jax.block_until_ready(jax.device_put(self._fill(block, rows, bucket)))

    handle._future = self._worker.submit(move)  # pylint: disable=protected-access
    return handle

  def release(self, handle: "PrefetchedPages") -> None:
    """Returns `handle`'s staging block for reuse (after its transfer, and any `write` from
    it, finished). Releasing twice does nothing."""
    with self._lock:
      if self._prefetched.pop(id(handle), None) is not handle:
        return
    handle.wait()
    handle.device = None
    with self._lock:
      if len(self._free_blocks) < _FREE_BLOCKS:
        self._free_blocks.append(handle._block)  # pylint: disable=protected-access

  def _prefetched_rows(self, payload: Any, n: int):
    """`(handle, i64[n] rows)` if `payload` is n row objects of one live prefetch, else None."""
    if not n or not isinstance(payload, (list, tuple)) or len(payload) != n:
      return None
    with self._lock:
      handles = list(self._prefetched.values())
    for handle in handles:
      rows = [handle._index.get(id(p)) for p in payload]  # pylint: disable=protected-access
      if all(i is not None and handle.rows[i] is p for i, p in zip(rows, payload)):
        return handle, np.asarray(rows, np.int64)
    return None

  def write(self, caches: Sequence[Any], pages: Sequence[int], payload: Any) -> tuple[Any, ...]:
    """`caches` with `pages` overwritten by `payload` (`u8[len(pages), page_bytes]`, a list
    of `u8[page_bytes]` rows -- rows of a live `prefetch` are written from its staged block,
    rows a `RowArena` holds (a `HostTier`'s) are read where they are when every pool is on
    one CPU device -- or what `stage` returned for these pages); `caches` are donated. Runs
    of consecutive pages are written as whole blocks (class doc); a page listed twice gets
    its last row. Except for a staged payload, returns once the pools are updated: the rows
    went through a staging block reused by the next write, or an arena chunk the tier may
    write into again.

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
      runs = page_runs(pages, handle.bucket, rows if keep is None else rows[keep])
      return jax.block_until_ready(self._write(tuple(caches), *runs, handle.device))
    rows = self._rows(payload, n)
    if not n:
      return tuple(caches)
    pages, keep = self._last_rows(pages)
    if keep is not None:
      rows = [rows[i] for i in keep]
    caches = tuple(caches)
    # The pools' device, named: device_put(x, device) is 4x faster than device_put(x) (0.1
    # against 0.4 ms, measured) and lands where the update runs.
    device = _device_of(pools)
    rest = np.arange(len(pages))
    for arena, chunk, mine, slots in self._arena_groups(device, rows):
      caches = self._write_from_arena(caches, pages[mine], arena, chunk, slots, device)
      rest = rest[~np.isin(rest, mine)]
    if len(rest) < len(pages):  # the rest (if any) staged
      pages, rows = pages[rest], [rows[i] for i in rest]
    if len(pages):
      bucket = _bucket(len(pages))
      need = self._block_bytes(bucket)
      if self._scratch is None or self._scratch.size < need:
        self._scratch = _aligned_empty((need,))  # grown, then reused
      units = self._fill(self._scratch, rows, bucket, split=True)
      # The device array may alias the block: wait for the update before the next write
      # refills it.
      caches = self._write(caches, *page_runs(pages, bucket), jax.device_put(units, device))
    return jax.block_until_ready(caches)

  def _arena_groups(self, device, rows) -> list[tuple[RowArena, int, np.ndarray, np.ndarray]]:
    """The rows of the list `rows` that are page-sized leading slices of `RowArena` slots, as
    `(arena, chunk, i64[m] their indices in rows, i64[m] their slots)` per arena chunk; none
    unless a `device_put` can alias a chunk (`device`, holding every pool, is a CPU)."""
    if (not isinstance(rows, list) or not self._arena_aliases or device is None
        or device.platform != "cpu"):
      return []
    groups: dict[tuple[int, int], tuple[RowArena, list[int], list[int]]] = {}
    for i, row in enumerate(rows):
      where = _arena_slot(row)
      if where is None or row.size != self.page_bytes or where[0].row_bytes % self._unit:
        continue
      arena, chunk, slot = where
      group = groups.setdefault((id(arena), chunk), (arena, [], []))
      group[1].append(i)
      group[2].append(slot)
    return [(arena, chunk, np.array(mine, np.int64), np.array(slots, np.int64))
            for (_, chunk), (arena, mine, slots) in groups.items()]

  def _write_from_arena(self, caches, pages: np.ndarray, arena: RowArena, chunk: int,
                        slots: np.ndarray, device: Any) -> tuple[Any, ...]:
    """`pages` written from `slots` of `arena`'s chunk (`_arena_groups`): the chunk's
    zero-copy `device_put` and one jitted update reading the rows at their slots (runs of
    consecutive pages in consecutive slots: `page_runs`). The caller waits for the result
    before the tier may write into the chunk again."""
    units = arena.chunks[chunk].view(f"u{self._unit}")
    block = jax.device_put(units, device)
    if block.unsafe_buffer_pointer() != units.ctypes.data:
      self._arena_aliases = False  # copied (this once): later writes stage instead
    return self._write_rows(caches, *page_runs(pages, _bucket(len(pages)), slots), block)


_SPLIT_BYTES = 1 << 22
"""Rows a synchronous `PageCodec.write` copies with two threads from this many bytes on (4 MiB,
about 0.5 ms of memcpy: well above the cost of handing half to the helper thread)."""

_FREE_BLOCKS = 4
"""Staging blocks of released prefetches a codec keeps for reuse."""


class PrefetchedPages:
  """Page rows on their way to the device for pages chosen later (`PageCodec.prefetch`).

  Attributes:
    rows: the `u8[page_bytes]` rows given to `prefetch` (the objects themselves).
    num_rows: rows staged.
    bucket: rows the staging block is laid out for (`_bucket(num_rows)`).
    host: `u8[bucket * page_bytes]` the pool-major staging block (`PageCodec._fill`).
    device: the block as a jax array once moved (None before, and after `release`).
  """

  def __init__(self, codec: PageCodec, rows: list[Any], bucket: int, block: np.ndarray):
    self.codec, self.rows, self.num_rows, self.bucket = codec, rows, len(rows), bucket
    self.host = block[:codec._block_bytes(bucket)]  # pylint: disable=protected-access
    self.device: Any = None
    self._block = block  # the whole staging block, returned to the codec by `release`
    self._index = {id(p): i for i, p in enumerate(rows)}
    self._future: concurrent.futures.Future | None = None

  def wait(self) -> None:
    """Blocks until the rows are in the block and on the device (re-raises the worker's
    error)."""
    if self._future is not None:
      self.device = self._future.result()
      self._future = None

  def done(self) -> bool:
    return self._future is None or self._future.done()

  def row(self, i: int) -> Any:
    """The i-th row given to `prefetch` (the object itself: `PageCodec.write` knows it).

    Raises:
      ValueError: i outside [0, num_rows).
    """
    if not 0 <= i < self.num_rows:
      raise ValueError(f"i must lie in [0, {self.num_rows}); got {i}")
    return self.rows[i]


class StagedPages(NamedTuple):
  """A payload on its way to the device (`PageCodec.stage`)."""

  pages: np.ndarray
  """`i64[n]` the pool pages, each once, in payload order."""
  runs: tuple[np.ndarray, np.ndarray, np.ndarray]
  """`page_runs(pages, bucket)`."""
  device: Any
  """`uint[bucket * page_bytes / unit]` the pool-major staging block as a jax array (rows
  past n unused), or None for no pages."""
