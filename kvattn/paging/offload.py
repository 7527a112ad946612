"""Offload tiers for cold KV pages: host memory, then disk (vLLM offloading, SGLang HiCache)."""

from __future__ import annotations

import collections
import hashlib
import logging
import os
from typing import Any, Callable, Sequence

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
    """Removes `block` from its tier; returns its payload, or None (then the caller forgets it)."""
    for tier in self.tiers:
      if block in tier:
        payload = tier.take(block)
        self.moves[(tier.name, "device")] += 1
        return payload
    return None

  def discard(self, block) -> None:
    for tier in self.tiers:
      tier.discard(block)

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


def _pad_bucket(pages: np.ndarray) -> np.ndarray:
  """`pages` padded by repeating its last entry to the next of 1, 2, 3, 4, 6, 8, 12, 16,
  24, ... (powers of two and their halfway points: at most a third wasted), so the jitted
  reads and writes compile once per bucket, not once per page count."""
  n = len(pages)
  size = 1 << max(0, n - 1).bit_length()
  if size >= 4 and n <= size * 3 // 4:
    size = size * 3 // 4
  return np.concatenate([pages, np.full((size - len(pages),), pages[-1], pages.dtype)])


def _uint(width: int):
  return {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}[width]


class PageCodec:
  """Page payloads of a model's paged caches: the bytes of one page in every pool (each
  cache's `POOL_FIELDS`, `kvattn.caches.capabilities`).
  """

  def __init__(self, caches: Sequence[Any]):
    pools = self._pools(caches)
    self.layouts = [(p.shape[:1] + p.shape[2:], p.dtype) for p in pools]
    self.sizes = [int(np.prod(s)) * jnp.dtype(d).itemsize for s, d in self.layouts]
    self.page_bytes = sum(self.sizes)
    layouts, sizes = self.layouts, self.sizes

    def read(caches, pages):  # the pages of every pool, native dtype: [K, n, page_size, ...]
      return [pool[:, pages] for pool in self._pools(caches)]

    def write(caches, pages, parts):
      # parts: per pool, [K, n, page_size, ...] as unsigned ints of the pool's width. Floats
      # narrower than 32 bits are scattered as those ints (XLA:CPU computes bf16/fp8 in f32
      # and would quiet signalling NaNs); wider ones and ints are bitcast first and scattered
      # in their own dtype (a plain data move, and in place under donation).
      it = iter(parts)
      out = []
      for c in caches:
        if not getattr(c, "POOL_FIELDS", ()):  # a layer without pages (a ring): no page bytes
          out.append(c)
          continue
        fields = {}
        for name in c.POOL_FIELDS:
          pool = getattr(c, name)
          if pool is None:
            continue
          new = next(it)
          if jnp.issubdtype(pool.dtype, jnp.floating) and pool.dtype.itemsize < 4:
            bits = jax.lax.bitcast_convert_type(pool, new.dtype)
            fields[name] = jax.lax.bitcast_convert_type(bits.at[:, pages].set(new), pool.dtype)
          else:
            fields[name] = pool.at[:, pages].set(jax.lax.bitcast_convert_type(new, pool.dtype))
        out.append(c.replace(**fields))
      return tuple(out)

    self._read = jax.jit(read)
    self._write = jax.jit(write, donate_argnums=(0,))

  @staticmethod
  def _pools(caches):
    return [p for c in caches for name in getattr(c, "POOL_FIELDS", ())
            if (p := getattr(c, name)) is not None]

  def read(self, caches: Sequence[Any], pages: Sequence[int]) -> np.ndarray:
    """`u8[len(pages), page_bytes]` (host) the contents of `pages` in every pool: one
    gather per pool on the device, the bytes packed on the host."""
    n = len(pages)
    padded = _pad_bucket(np.asarray(pages, np.int32).reshape(-1))
    parts = self._read(tuple(caches), jnp.asarray(padded))
    rows = [np.moveaxis(np.asarray(p)[:, :n], 1, 0).reshape(n, -1).view(np.uint8)
            for p in parts]
    return np.concatenate(rows, axis=1)

  def write(self, caches: Sequence[Any], pages: Sequence[int], payload: Any) -> tuple[Any, ...]:
    """`caches` with `pages` overwritten by `payload` (`u8[len(pages), page_bytes]`, or
    a list of `u8[page_bytes]` rows); `caches` are donated.

    Raises:
      ValueError: a payload of the wrong shape.
    """
    if isinstance(payload, (list, tuple)):
      payload = np.stack([np.asarray(p) for p in payload])
    payload = np.asarray(payload, np.uint8)
    pages = np.asarray(pages, np.int32).reshape(-1)
    if payload.shape != (len(pages), self.page_bytes):
      raise ValueError(f"payload must have shape [len(pages), page_bytes] = ({len(pages)}, "
                       f"{self.page_bytes}); got {tuple(payload.shape)}")
    # Padding repeats the last page and its payload: a duplicate write of equal bits.
    padded = _pad_bucket(pages)
    payload = np.concatenate([payload, np.repeat(payload[-1:], len(padded) - len(pages), 0)])
    parts, offset = [], 0
    for (shape, dtype), size in zip(self.layouts, self.sizes):
      width = jnp.dtype(dtype).itemsize
      raw = np.ascontiguousarray(payload[:, offset:offset + size]).view(f"u{width}")
      parts.append(np.moveaxis(raw.reshape((len(padded),) + shape), 0, 1))
      offset += size
    return self._write(tuple(caches), jnp.asarray(padded), parts)
