"""Paged KV cache of one layer: PagedAttention (Kwon et al., "Efficient Memory Management for
Large Language Model Serving with PagedAttention", SOSP 2023)."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterable

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.experimental import checkify

from kvattn import _checks
from kvattn.caches import _slots
from kvattn.caches import capabilities
from kvattn.caches import dense as cache_lib
from kvattn.caches import registry
from kvattn.caches._layers import gqa_layers
from kvattn import ops
from kvattn.paging.allocator import NO_PAGE, PageAllocator, pages_for
from kvattn.ops import quant
from kvattn.ops import xla_paged as paged_ops


def check_rows(name: str, tables: Any, lengths: Any, num_pages: int, page_size: int) -> None:
  """Host check of block-table rows `tables: int[B, W]` holding `lengths: int[B]` tokens:
  every entry is a page in `[0, num_pages)` or `NO_PAGE`, and the first
  `ceil(lengths[b] / page_size)` entries of row b are pages.

  Raises:
    ValueError: naming `name[b, j]`, its value and the rule.
  """
  tables = np.asarray(tables)
  host_lengths = np.asarray(lengths).astype(np.int64)
  bad = (tables != NO_PAGE) & ((tables < 0) | (tables >= num_pages))
  if bad.any():
    b, j = (int(x) for x in np.argwhere(bad)[0])
    raise ValueError(f"{name}[{b}, {j}] = {int(tables[b, j])} must be a page in "
                     f"[0, {num_pages}) or NO_PAGE ({NO_PAGE})")
  used = np.arange(tables.shape[1])[None, :] < -(-host_lengths // page_size)[:, None]
  missing = used & (tables == NO_PAGE)
  if missing.any():
    b, j = (int(x) for x in np.argwhere(missing)[0])
    raise ValueError(f"{name}[{b}, {j}] = NO_PAGE, but row {b} holds {int(host_lengths[b])} "
                     f"tokens, which occupy its logical page {j}")


@struct.dataclass
class PagedKVCache(_slots.Slots, _slots.KVHeads, _slots.LengthsRollback, capabilities.Pages,
                   capabilities.TruncateByLengths):
  """Paged KV cache of one attention layer (MHA, GQA or MQA).

  Attributes:
    k_pages: `[K, P, page_size, H]` key page pool (RoPE applied), shared by all sequences of the
      batch.
    v_pages: `[K, P, page_size, H]` value page pool.
    block_tables: `i32[B, pages_per_seq]`: slot s of sequence b is slot `s % page_size` of page
      `block_tables[b, s // page_size]`; entries outside `[0, P)` (`NO_PAGE`) are unassigned.
    lengths: `i32[B]` tokens written per sequence; exceeds what the row's assigned pages hold
      (`assigned_slots`) only after an overflow under jit (see `overflowed`).
    k_scale_pages: `f32[K, P, page_size]` per-slot key scales when the pools are int8/fp8
      (`kvattn.ops.quant`; slot s of a page holds `k_pages[..., s, :] * k_scale_pages[..., s]`),
      written with the values; else None.
    v_scale_pages: `f32[K, P, page_size]` value scales likewise, else None.
  """

  k_pages: jax.Array
  v_pages: jax.Array
  block_tables: jax.Array
  lengths: jax.Array
  k_scale_pages: jax.Array | None = None
  v_scale_pages: jax.Array | None = None

  @classmethod
  def init(cls, batch: int, *, num_pages: int, page_size: int, pages_per_seq: int,
           num_kv_heads: int, head_dim: int, dtype=jnp.float32,
           block_tables: Any = None) -> "PagedKVCache":
    """An empty cache: zero pools, `lengths == 0`.

    Args:
      batch: sequences (slots) B.
      num_pages: pages P in the pool.
      page_size: tokens per page.
      pages_per_seq: block-table width; the per-sequence capacity is `pages_per_seq * page_size`
        tokens.
      num_kv_heads, head_dim: K and H.
      dtype: storage dtype: floating, or int8 / float8_e4m3fn / float8_e5m2 (quantized on write,
        with `f32[K, P, page_size]` scale pools).
      block_tables: optional `int[B, pages_per_seq]` initial table (default all `NO_PAGE`; fill rows
        with `assign_slot` from a `PageAllocator`).

    Raises:
      ValueError: a size that is not a positive int, or a block table of the wrong shape.
      TypeError: a non-floating dtype or non-integer block table.
    """
    batch = _checks.positive_int("batch", batch)
    num_pages = _checks.positive_int("num_pages", num_pages)
    page_size = _checks.positive_int("page_size", page_size)
    pages_per_seq = _checks.positive_int("pages_per_seq", pages_per_seq)
    num_kv_heads = _checks.positive_int("num_kv_heads", num_kv_heads)
    head_dim = _checks.positive_int("head_dim", head_dim)
    dtype = cache_lib.check_storage_dtype(dtype)
    if block_tables is None:
      block_tables = jnp.full((batch, pages_per_seq), NO_PAGE, jnp.int32)
    else:
      block_tables = jnp.asarray(block_tables)
      _checks.integer("block_tables", block_tables)
      if block_tables.shape != (batch, pages_per_seq):
        raise ValueError(
            f"block_tables must have shape [B, pages_per_seq] = ({batch}, {pages_per_seq}); "
            f"got {tuple(block_tables.shape)}")
      block_tables = block_tables.astype(jnp.int32)
    shape = (num_kv_heads, num_pages, page_size, head_dim)
    return cls(k_pages=jnp.zeros(shape, dtype), v_pages=jnp.zeros(shape, dtype),
               block_tables=block_tables, lengths=jnp.zeros((batch,), jnp.int32),
               k_scale_pages=cache_lib.scale_init(shape[:3], dtype),
               v_scale_pages=cache_lib.scale_init(shape[:3], dtype))

  @classmethod
  def contiguous(cls, batch: int, max_len: int, num_kv_heads: int, head_dim: int,
                 dtype=jnp.float32, *, page_size: int = 16) -> "PagedKVCache":
    """A drop-in for `KVCache.init(batch, max_len, ...)`: every sequence owns
    `ceil(max_len / page_size)` pages of its own (sequence b gets pages
    `b * pages_per_seq + j`), so no allocator is needed."""
    max_len = _checks.positive_int("max_len", max_len)
    page_size = _checks.positive_int("page_size", page_size)
    batch = _checks.positive_int("batch", batch)
    pps = pages_for(max_len, page_size)
    tables = np.arange(batch * pps, dtype=np.int32).reshape(batch, pps)
    return cls.init(batch, num_pages=batch * pps, page_size=page_size, pages_per_seq=pps,
                    num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype,
                    block_tables=tables)

  # Sizes, storage, scales: `_slots` (read from this layout); the page pool's own below.
  _SIZES = {"batch": ("block_tables", 0), "num_kv_heads": ("k_pages", 0),
            "head_dim": ("k_pages", 3)}
  _VALUES, _SCALES = ("k_pages", "v_pages"), ("k_scale_pages", "v_scale_pages")
  _SCALE_ARGS = ("k_scale", "v_scale")  # `kvattn.ops.paged_decode_attention`'s names

  @property
  def num_pages(self) -> int:
    return self.k_pages.shape[1]

  @property
  def page_size(self) -> int:
    return self.k_pages.shape[2]

  @property
  def pages_per_seq(self) -> int:
    return self.block_tables.shape[1]

  @property
  def max_len(self) -> int:
    """Per-sequence capacity in tokens: `pages_per_seq * page_size`."""
    return self.pages_per_seq * self.page_size

  capacity = max_len

  @property
  def assigned_slots(self) -> jax.Array:
    """`i32[B]`: tokens each sequence's assigned pages can hold: `page_size`
    times the leading block-table entries in `[0, P)` (at most `max_len`)."""
    return paged_ops.assigned_slots(self.block_tables, self.num_pages, self.page_size)

  @property
  def overflowed(self) -> jax.Array:
    """`bool[B]`: rows whose `lengths` exceed what their assigned pages hold."""
    return self.lengths > self.assigned_slots

  @property
  def storage_slots(self) -> int:
    """Token slots the pools hold: P * page_size (the pool, shared by the batch)."""
    return self.num_pages * self.page_size

  def slot_positions(self) -> jax.Array:
    """`i32[B, max_len]`: logical slot s holds token s below the row's
    readable length (`min(lengths, assigned_slots)`), else -1."""
    return cache_lib.slot_positions(self.readable_lengths, self.max_len)

  def check_state(self, name: str = "cache") -> None:
    """Eager check: `lengths` in `[0, max_len]`, every block-table entry a page of the pool or
    `NO_PAGE`, every logical page a row's tokens occupy assigned. Traced: no check.

    Raises:
      ValueError: naming the leaf and entry, e.g. "layer 0 block_tables[1, 0] = 7 ...".
    """
    _checks.values_in_range(f"{name} lengths", self.lengths, 0, self.max_len)
    if not _checks.is_concrete(self.block_tables):
      return
    check_rows(f"{name} block_tables", self.block_tables, self.lengths, self.num_pages,
               self.page_size)

  @property
  def readable_lengths(self) -> jax.Array:
    """`i32[B]`: tokens attention reads per row, `min(lengths, assigned_slots)`
    (tokens an overflow under jit dropped are not attended)."""
    return jnp.minimum(self.lengths, self.assigned_slots)

  # Pure updates.
  def update(self, k_new: jax.Array, v_new: jax.Array,
             new_lengths: jax.Array | None = None) -> "PagedKVCache":
    """Writes T new tokens per sequence through the block table.

    Args:
      k_new: `[B, T, K, H]` keys (RoPE applied), cast to the cache dtype (quantized, one scale per
        token and head, for int8/fp8 pools).
      v_new: `[B, T, K, H]` values.
      new_lengths: `i32[B]` real tokens per sequence among the T (default T).

    Returns:
      The updated cache.

    Raises:
      ValueError: wrong shapes; `new_lengths` outside [0, T]; and, when the lengths and block table
        are concrete (eager calls), a write past the capacity or onto (or past) a logical page the
        block table does not assign.
      TypeError: non-floating `k_new` / `v_new`.
    """
    return self.update_unchecked(k_new, v_new,
                                 cache_lib.check_new_kv(self, k_new, v_new, new_lengths))

  def update_unchecked(self, k_new: jax.Array, v_new: jax.Array,
                       new_lengths: jax.Array) -> "PagedKVCache":
    """`update` for callers that checked its arguments (the modules, through
    `cache_protocol.update_attend`); the cache's own state is still checked eagerly
    (lengths, overflow, the pages the write needs). Subclasses override this one."""
    num_tokens = k_new.shape[1]
    lengths = cache_lib.advance_lengths(self.lengths, new_lengths, self.max_len)  # raises first
    self._check_pages_assigned(new_lengths)

    page_size, num_pages = self.page_size, self.num_pages
    t = jnp.arange(num_tokens, dtype=jnp.int32)[None, :]
    slots = self.lengths[:, None] + t  # [B, T]
    logical = slots // page_size
    real = t < new_lengths[:, None]
    # Only slots the row's leading assigned pages hold are written (what attention reads).
    fits = slots < self.assigned_slots[:, None]
    checkify.debug_check(jnp.all(fits | ~real),
                         "paged cache: a token was written past the assigned pages")
    page = jnp.take_along_axis(self.block_tables,
                               jnp.clip(logical, 0, self.pages_per_seq - 1), axis=1)
    page = jnp.where(real & fits, page, num_pages)  # num_pages = dropped
    offset = slots % page_size

    def write(pool, new):  # pool[:, page, offset] is [K, B, T, ...]: head-major new tokens
      return quant.set_stored(pool, (slice(None), page, offset), jnp.moveaxis(new, 2, 0),
                              mode="drop")

    return self.replace(lengths=lengths, **self.written((k_new, v_new), write))

  def attend(
      self,
      q: jax.Array,  # [B, T, N, H]
      *,
      q_offsets: jax.Array,  # i32[B]
      sm_scale: float | None = None,
      window: int | None = None,
      soft_cap: float | None = None,
      implementation: str | None = None,
  ) -> jax.Array:
    """`GQACache.attend` (`kvattn.caches.protocol`): `[B, T, N, H]` in q's dtype."""
    opts = dict(sm_scale=sm_scale, window=window, soft_cap=soft_cap)
    if q.shape[1] == 1:
      return ops.paged_decode_attention(
          q[:, 0], self.k_pages, self.v_pages, self.block_tables, self.lengths,
          implementation=implementation, **opts, **self.scale_kwargs())[:, None]
    k, v = self.dense_kv()  # [B, K, max_len, H]
    return ops.attention(q, k, v, q_offsets=q_offsets, kv_lengths=self.readable_lengths,
                         **opts, **self.dense_scale_kwargs())

  def _check_pages_assigned(self, new_lengths) -> None:
    """Eager check: every logical page up to the last one written is assigned."""
    if not all(_checks.is_concrete(x) for x in (self.lengths, new_lengths, self.block_tables)):
      return
    tables = np.asarray(self.block_tables)
    start = np.asarray(self.lengths)
    end = start + np.asarray(new_lengths)
    for b in np.flatnonzero(np.asarray(new_lengths) > 0):
      for j in range(pages_for(end[b], self.page_size)):
        page = int(tables[b, j])
        if not 0 <= page < self.num_pages:
          raise ValueError(
              f"block_tables[{b}, {j}] must be a page in [0, {self.num_pages}) to write tokens "
              f"[{int(start[b])}, {int(end[b])}) of sequence {b}; got {page} (allocate the page "
              "with a PageAllocator first)")

  def assign_slot(self, slot, pages, length=0) -> "PagedKVCache":
    """Gives slot `slot` the block-table row `pages` and length `length`.

    Args:
      slot: slot index (Python int or traced int32 scalar, so a jitted caller does not recompile per
        slot).
      pages: `int[pages_per_seq]` row (pad with `NO_PAGE`).
      length: tokens already in those pages (0 for a sequence about to prefill).

    Raises:
      ValueError: a row of the wrong shape; and, when they are concrete (an eager call), a `slot`
        outside `[0, B)`, a `length` outside `[0, max_len]`, an entry of `pages` that is neither a
        page of the pool nor `NO_PAGE`, or a logical page the `length` tokens occupy left
        unassigned (traced values are not checked).
    """
    pages = jnp.asarray(pages, jnp.int32)
    if pages.shape != (self.pages_per_seq,):
      raise ValueError(
          f"pages must have shape [pages_per_seq] = ({self.pages_per_seq},); got "
          f"{tuple(pages.shape)}")
    _checks.values_in_range("slot", slot, 0, self.batch - 1)
    _checks.values_in_range("length", length, 0, self.max_len)
    if _checks.is_concrete(pages) and _checks.is_concrete(length):
      check_rows("pages", pages[None], jnp.reshape(jnp.asarray(length), (1,)), self.num_pages,
                 self.page_size)
    return self.replace(block_tables=self.block_tables.at[slot].set(pages),
                        lengths=self.lengths.at[slot].set(jnp.asarray(length, jnp.int32)))

  def release_slot(self, slot) -> "PagedKVCache":
    """Marks slot `slot` empty: its row becomes `NO_PAGE` and its length 0."""
    return self.assign_slot(slot, jnp.full((self.pages_per_seq,), NO_PAGE, jnp.int32), 0)

  # Views.
  def dense_kv(self) -> tuple[jax.Array, jax.Array]:
    """`(k, v)`, each `[B, K, pages_per_seq * page_size, H]`, gathered through the block table
    (unassigned pages read an arbitrary page; mask by `min(lengths, assigned_slots)`)."""
    return (paged_ops.gather_pages(self.k_pages, self.block_tables),
            paged_ops.gather_pages(self.v_pages, self.block_tables))

  def dense_scale_kwargs(self) -> dict[str, jax.Array]:
    """The scales gathered like `dense_kv` (`f32[B, K, S]` each, as `k_scale=`,
    `v_scale=` for `kvattn.ops.attention`), or `{}` for float pools."""
    if not self.quantized:
      return {}
    return {name: paged_ops.gather_pages(pool, self.block_tables)
            for name, pool in (("k_scale", self.k_scale_pages),
                               ("v_scale", self.v_scale_pages))}

  def to_dense(self) -> cache_lib.KVCache:
    """The equivalent dense `KVCache` (capacity `pages_per_seq * page_size`),
    unassigned logical pages zeroed (their scales set to 1). For tests and inspection."""
    scales = {}
    if self.quantized:
      scales = {name: paged_ops.gather_pages_zeroed(pool, self.block_tables, fill=1.0)
                for name, pool in (("k_scale", self.k_scale_pages),
                                   ("v_scale", self.v_scale_pages))}
    return cache_lib.KVCache(
        k=paged_ops.gather_pages_zeroed(self.k_pages, self.block_tables),
        v=paged_ops.gather_pages_zeroed(self.v_pages, self.block_tables),
        lengths=self.lengths, **scales)


@dataclasses.dataclass(frozen=True)
class PoolPlan:
  """How a serving loop holds a pageable kind: one pool per layer, rows per request slot.

  Attributes:
    pages_per_seq: block-table width.
    tokens: `n -> ` tokens of a sequence of n the pool holds (what the allocator counts).
    init: `(attn, rows, num_pages, dtype) -> ` one layer's empty pool.
    chunked_prefill: with the prefix cache, prompts prefill a page at a time.
    residual: newest tokens each row keeps outside its pages (a boundary state), or 0.
    refuses: `(option, why)` serving options the kind cannot take.
  """

  pages_per_seq: int
  tokens: Callable[[int], int]
  init: Callable[..., Any]
  chunked_prefill: bool = False
  residual: int = 0
  refuses: tuple[tuple[str, str], ...] = ()


def init_paged_caches(model, tokens_per_seq: Iterable[int], *, page_size: int = 16,
                      max_len: int | None = None, dtype: Any = None, extra_pages: int = 0,
                      seed: int | None = None, cls: type = PagedKVCache
                      ) -> tuple[tuple[PagedKVCache, ...], PageAllocator]:
  """Empty paged caches for every layer of `model`, `ceil(tokens_per_seq[b] / page_size)`
  pages for sequence b from one `PageAllocator` (seq ids 0..B-1); each layer its own pool
  of the sequences' pages plus `extra_pages`, one block table for all.

  Args:
    model: a `kvattn.Transformer` whose layers are all GQA-family attention.
    tokens_per_seq: `int[B]` tokens each sequence will hold.
    page_size: tokens per page.
    max_len: per-sequence capacity (default the largest `tokens_per_seq`).
    dtype: cache dtype (default the model's compute dtype).
    extra_pages: free pages left in the pool.
    seed: shuffles the free list; None = ascending.
    cls: `PagedKVCache` or a subclass with its `init`.

  Returns:
    `(caches, allocator)`.

  Raises:
    ValueError: an MLA layer, a sequence longer than `max_len`, bad sizes.
  """
  attns = gqa_layers(model)
  tokens = [int(t) for t in tokens_per_seq]
  if not tokens or min(tokens) < 0:
    raise ValueError(f"tokens_per_seq must be a non-empty list of ints >= 0; got {tokens}")
  page_size = _checks.positive_int("page_size", page_size)
  max_len = max(max(tokens), 1) if max_len is None else _checks.positive_int("max_len", max_len)
  if max(tokens) > max_len:
    raise ValueError(f"tokens_per_seq must be <= max_len = {max_len}; got {tokens}")
  if isinstance(extra_pages, bool) or not isinstance(extra_pages, int) or extra_pages < 0:
    raise ValueError(f"extra_pages must be an int >= 0; got {extra_pages!r}")
  pps = pages_for(max_len, page_size)
  num_pages = max(1, sum(pages_for(t, page_size) for t in tokens) + extra_pages)
  allocator = PageAllocator(num_pages, page_size, pps, seed=seed)
  for b, t in enumerate(tokens):
    allocator.allocate(b, t)
  tables = allocator.block_tables(range(len(tokens)), pps)
  dtype = getattr(model, "dtype", jnp.float32) if dtype is None else dtype
  caches = tuple(
      cls.init(len(tokens), num_pages=num_pages, page_size=page_size, pages_per_seq=pps,
               num_kv_heads=attn.num_kv_heads, head_dim=attn.head_dim, dtype=dtype,
               block_tables=tables)
      for attn in attns)
  return caches, allocator


def kind(cls: type = PagedKVCache, doc: str | None = None) -> registry.CacheKind:
  """The `CacheKind` of a paged class (`PagedKVCache` or a subclass with its `init`)."""

  def build(model, batch, max_len, dtype, o, tokens_per_seq):
    tokens = [max_len] * batch if tokens_per_seq is None else list(tokens_per_seq)
    if len(tokens) != batch:
      raise ValueError(f"tokens_per_seq must have one entry per sequence ({batch}); got "
                       f"{len(tokens)}")
    return init_paged_caches(model, tokens, page_size=o["page_size"], max_len=max_len,
                             dtype=dtype, seed=o["seed"], cls=cls)[0]

  def pool(options, *, max_len, page_size, prefix_cache):
    del options, prefix_cache
    pps = pages_for(max_len, page_size)
    return PoolPlan(pps, lambda n: n, lambda a, rows, num_pages, dtype: cls.init(
        rows, num_pages=num_pages, page_size=page_size, pages_per_seq=pps,
        num_kv_heads=a.num_kv_heads, head_dim=a.head_dim, dtype=dtype))

  return registry.CacheKind(build, {"page_size": 16, "seed": None},
                            doc or f"{cls.__name__}, pages per sequence", pool=pool)


registry.register_cache_kind("paged", kind(doc="PagedKVCache, pages per sequence "
                                               "(init_paged_caches)"))
