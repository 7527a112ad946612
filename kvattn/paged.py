"""Paged KV cache and its host-side page allocator (PagedAttention).

Kwon et al., "Efficient Memory Management for Large Language Model Serving
with PagedAttention" (SOSP 2023): a contiguous per-request cache must reserve
the maximum length for every request, and the paper measures 60-80% of such
KV memory unused; storing the cache in fixed-size pages handed out on demand
bounds the waste to less than one page per sequence (< 4% in their traces).

Two pieces:
  * `PagedKVCache` — the device pytree of one layer: page pools
    `k_pages, v_pages: [K, P, page_size, H]`, `block_tables: i32[B,
    pages_per_seq]` (logical page j of sequence b is physical page
    `block_tables[b, j]`; -1 = none) and `lengths: i32[B]`. Pure updates:
    `update` writes tokens through the block table, `assign_slot` /
    `release_slot` change one row. Attention goes through
    `kvattn.ops.paged_decode_attention`.
  * `PageAllocator` — host bookkeeping (numpy / Python): which pages each live
    sequence owns, allocation on join, one more page when a sequence crosses a
    page boundary, freeing on retire, used/free/waste statistics. A page is
    never owned by two live sequences; exhaustion raises `OutOfPagesError`
    and leaves every existing allocation untouched.

Slot convention, as for `kvattn.KVCache`: sequence b occupies slots
`[0, lengths[b])`, capacity `pages_per_seq * page_size`; what the rest of its
last page, unassigned table entries and free pages hold never changes a result.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Hashable, Iterable

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.experimental import checkify

from kvattn import _checks
from kvattn import cache as cache_lib
from kvattn.ops import paged as paged_ops

NO_PAGE = -1
"""Block-table entry of a logical page that has no physical page."""


def pages_for(num_tokens: int, page_size: int) -> int:
  """Pages needed to hold `num_tokens` tokens: `ceil(num_tokens / page_size)`."""
  return -(-int(num_tokens) // int(page_size))


@struct.dataclass
class PagedKVCache:
  """Paged KV cache of one attention layer (MHA, GQA or MQA).

  Attributes:
    k_pages: `[K, P, page_size, H]` key page pool (RoPE applied), shared by
      all sequences of the batch.
    v_pages: `[K, P, page_size, H]` value page pool.
    block_tables: `i32[B, pages_per_seq]`: slot s of sequence b is slot
      `s % page_size` of page `block_tables[b, s // page_size]`; entries
      outside `[0, P)` (`NO_PAGE`) are unassigned.
    lengths: `i32[B]` tokens written per sequence; exceeds what the row's
      assigned pages hold (`assigned_slots`) only after an overflow under jit
      (see `overflowed`).
    k_scale_pages: `f32[K, P, page_size]` per-slot key scales when the pools
      are int8/fp8 (`kvattn.ops.quant`; slot s of a page holds `k_pages[...,
      s, :] * k_scale_pages[..., s]`), written with the values; else None.
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
      pages_per_seq: block-table width; the per-sequence capacity is
        `pages_per_seq * page_size` tokens.
      num_kv_heads, head_dim: K and H.
      dtype: storage dtype: floating, or int8 / float8_e4m3fn / float8_e5m2
        (quantized on write, with `f32[K, P, page_size]` scale pools).
      block_tables: optional `int[B, pages_per_seq]` initial table (default
        all `NO_PAGE`; fill rows with `assign_slot` from a `PageAllocator`).

    Raises:
      ValueError: a size that is not a positive int, or a block table of the
        wrong shape.
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

  # Sizes (static: read from array shapes).
  @property
  def batch(self) -> int:
    return self.block_tables.shape[0]

  @property
  def num_kv_heads(self) -> int:
    return self.k_pages.shape[0]

  @property
  def num_pages(self) -> int:
    return self.k_pages.shape[1]

  @property
  def page_size(self) -> int:
    return self.k_pages.shape[2]

  @property
  def head_dim(self) -> int:
    return self.k_pages.shape[3]

  @property
  def pages_per_seq(self) -> int:
    return self.block_tables.shape[1]

  @property
  def max_len(self) -> int:
    """Per-sequence capacity in tokens: `pages_per_seq * page_size`."""
    return self.pages_per_seq * self.page_size

  @property
  def dtype(self) -> jnp.dtype:
    return self.k_pages.dtype

  @property
  def quantized(self) -> bool:
    """True when the pools hold int8/fp8 values with scale pools."""
    return self.k_scale_pages is not None

  @property
  def assigned_slots(self) -> jax.Array:
    """`i32[B]`: tokens each sequence's assigned pages can hold: `page_size`
    times the leading block-table entries in `[0, P)` (at most `max_len`)."""
    return paged_ops.assigned_slots(self.block_tables, self.num_pages, self.page_size)

  @property
  def overflowed(self) -> jax.Array:
    """`bool[B]`: sequences whose `lengths` exceed what their assigned pages
    hold (`lengths > assigned_slots`, which covers `lengths > max_len`).

    Only an update under jit gets there (eagerly it raises): tokens past the
    assigned pages (past `max_len`, or on a logical page the block table does
    not assign) are dropped while `lengths` still advances. Attention
    (`kvattn.ops.paged_decode_attention`) then reads only the assigned pages,
    so the dropped tokens are simply not attended.

    The flag is derived from the current block table and lengths: it stays
    set while the row stays as it is (lengths never decrease), and
    `assign_slot` / `release_slot` reset it with the row. Giving the row more
    pages after tokens were dropped clears it too, although the dropped
    tokens are not restored: grow a row *before* writing into a new page (as
    `kvattn.ContinuousBatcher` does), and check `overflowed` after a jitted
    loop.
    """
    return self.lengths > self.assigned_slots

  @property
  def num_slots(self) -> int:
    """Token slots the pool reserves: P * page_size (for `kvattn.memory`)."""
    return self.num_pages * self.page_size

  def storage_arrays(self) -> tuple[jax.Array, ...]:
    """The arrays whose size grows with the token slots (for `kvattn.memory`),
    scale pools included when quantized."""
    return (self.k_pages, self.v_pages) + (
        (self.k_scale_pages, self.v_scale_pages) if self.quantized else ())

  def scale_kwargs(self) -> dict[str, jax.Array]:
    """`{"k_scale": k_scale_pages, "v_scale": v_scale_pages}` for
    `kvattn.ops.paged_decode_attention`, or `{}` for float pools."""
    if not self.quantized:
      return {}
    return {"k_scale": self.k_scale_pages, "v_scale": self.v_scale_pages}

  # Pure updates.
  def update(self, k_new: jax.Array, v_new: jax.Array,
             new_lengths: jax.Array | None = None) -> "PagedKVCache":
    """Writes T new tokens per sequence through the block table.

    Token t of sequence b (t < new_lengths[b]) goes to slot `s = lengths[b]
    + t`, i.e. to slot `s % page_size` of page `block_tables[b, s //
    page_size]`. Under jit, tokens at or past the slots the row's assigned
    pages hold (`assigned_slots`: past the capacity, or at or after the
    row's first unassigned logical page) are dropped (scatter `mode='drop'`,
    never wrapped onto another page); `lengths` still advances, as for
    `KVCache`, and `overflowed` flags the row.

    Args:
      k_new: `[B, T, K, H]` keys (RoPE applied), cast to the cache dtype
        (quantized, one scale per token and head, for int8/fp8 pools).
      v_new: `[B, T, K, H]` values.
      new_lengths: `i32[B]` real tokens per sequence among the T (default T).

    Returns:
      The updated cache.

    Raises:
      ValueError: wrong shapes; `new_lengths` outside [0, T]; and, when the
        lengths and block table are concrete (eager calls), a write past the
        capacity or onto (or past) a logical page the block table does not
        assign.
      TypeError: non-floating `k_new` / `v_new`.
    """
    expected = (self.batch, None, self.num_kv_heads, self.head_dim)
    for name, x in (("k_new", k_new), ("v_new", v_new)):
      _checks.rank(name, x, 4, "[B, T, K, H]")
      if any(e is not None and e != s for e, s in zip(expected, x.shape)):
        raise ValueError(
            f"{name} must have shape [B, T, K, H] = ({self.batch}, T, {self.num_kv_heads}, "
            f"{self.head_dim}); got {tuple(x.shape)}")
    if k_new.shape != v_new.shape:
      raise ValueError(f"k_new and v_new must have one shape; got {k_new.shape} and {v_new.shape}")
    for name, x in (("k_new", k_new), ("v_new", v_new)):
      _checks.floating(name, x)
    batch, num_tokens = k_new.shape[:2]
    new_lengths = cache_lib.resolve_new_lengths(new_lengths, batch, num_tokens)
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
    (k_new, k_s), (v_new, v_s) = (cache_lib.encode(k_new, self.dtype),
                                  cache_lib.encode(v_new, self.dtype))

    def write(pool, new):  # pool[:, page, offset] is [K, B, T, ...]: head-major new tokens
      return pool.at[:, page, offset].set(jnp.moveaxis(new, 2, 0).astype(pool.dtype),
                                          mode="drop")

    return PagedKVCache(
        k_pages=write(self.k_pages, k_new), v_pages=write(self.v_pages, v_new),
        block_tables=self.block_tables, lengths=lengths,
        k_scale_pages=None if k_s is None else write(self.k_scale_pages, k_s),
        v_scale_pages=None if v_s is None else write(self.v_scale_pages, v_s))

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
      slot: slot index (Python int or traced int32 scalar, so a jitted caller
        does not recompile per slot).
      pages: `int[pages_per_seq]` row (pad with `NO_PAGE`).
      length: tokens already in those pages (0 for a sequence about to prefill).

    Raises:
      ValueError: a row of the wrong shape.
    """
    pages = jnp.asarray(pages, jnp.int32)
    if pages.shape != (self.pages_per_seq,):
      raise ValueError(
          f"pages must have shape [pages_per_seq] = ({self.pages_per_seq},); got "
          f"{tuple(pages.shape)}")
    return self.replace(block_tables=self.block_tables.at[slot].set(pages),
                        lengths=self.lengths.at[slot].set(jnp.asarray(length, jnp.int32)))

  def release_slot(self, slot) -> "PagedKVCache":
    """Marks slot `slot` empty: its row becomes `NO_PAGE` and its length 0.
    The pages' contents are left as they are (free pages may hold anything)."""
    return self.assign_slot(slot, jnp.full((self.pages_per_seq,), NO_PAGE, jnp.int32), 0)

  # Views.
  def dense_kv(self) -> tuple[jax.Array, jax.Array]:
    """`(k, v)`, each `[B, K, pages_per_seq * page_size, H]`, gathered through
    the block table (unassigned pages read an arbitrary page; mask by
    `min(lengths, assigned_slots)`)."""
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


class OutOfPagesError(RuntimeError):
  """The pool has fewer free pages than a request needs.

  Raised by `PageAllocator.allocate`/`grow` before anything changes, so every
  existing allocation (and the cache contents behind it) is intact. A
  scheduler can read `needed` and `available` and retry after retiring a
  sequence, or check `PageAllocator.can_allocate` beforehand.
  """

  def __init__(self, seq_id: Hashable, needed: int, available: int):
    self.seq_id, self.needed, self.available = seq_id, needed, available
    super().__init__(
        f"out of KV pages: sequence {seq_id!r} needs {needed} more page(s) but only "
        f"{available} are free; retire a sequence or build a larger pool")


@dataclasses.dataclass(frozen=True)
class PoolStats:
  """A snapshot of a `PageAllocator`.

  Attributes:
    num_pages: pages in the pool.
    page_size: tokens per page.
    used_pages / free_pages: pages owned by live sequences / on the free list.
    live_sequences: sequences holding pages (or registered with 0 tokens).
    tokens: tokens the live sequences hold.
    reserved_slots: `used_pages * page_size`.
    internal_waste_slots: `reserved_slots - tokens`: the unused tail of each
      sequence's last page (internal fragmentation; < page_size per sequence).
    waste_fraction: `internal_waste_slots / reserved_slots` (0 when nothing is
      reserved). There is no external fragmentation: any free page serves any
      sequence, so a request fails only when fewer pages than it needs are free.
  """

  num_pages: int
  page_size: int
  used_pages: int
  free_pages: int
  live_sequences: int
  tokens: int
  reserved_slots: int
  internal_waste_slots: int
  waste_fraction: float


class PageAllocator:
  """Host-side allocator of the pages of a `PagedKVCache` pool.

  Every live sequence (any hashable id, e.g. a request id) owns an ordered
  list of pages: its logical page j is `pages(seq_id)[j]`. Pages come from a
  free list; a page is on the free list or owned by exactly one sequence.
  All operations are atomic: on any error nothing changes.

  Example:
    alloc = PageAllocator(num_pages=64, page_size=16, max_pages_per_seq=8)
    alloc.allocate("a", 20)           # 2 pages
    alloc.grow("a", 33)               # crosses into a 3rd page: 1 new page
    row = alloc.block_table_row("a")  # i32[8], padded with NO_PAGE
    alloc.free("a")                   # all 3 pages back on the free list
  """

  def __init__(self, num_pages: int, page_size: int, max_pages_per_seq: int | None = None, *,
               seed: int | None = None):
    """Builds an allocator whose pool is entirely free.

    Args:
      num_pages: pages P in the pool.
      page_size: tokens per page.
      max_pages_per_seq: block-table width (default P): a sequence may own at
        most this many pages.
      seed: if given, the free list starts in a random order (pages are then
        handed out non-contiguously, which exercises page-order independence);
        default ascending page ids.

    Raises:
      ValueError/TypeError: a size that is not a positive int.
    """
    self.num_pages = _checks.positive_int("num_pages", num_pages)
    self.page_size = _checks.positive_int("page_size", page_size)
    self.max_pages_per_seq = (self.num_pages if max_pages_per_seq is None else
                              _checks.positive_int("max_pages_per_seq", max_pages_per_seq))
    order = np.arange(self.num_pages)
    if seed is not None:
      order = np.random.default_rng(seed).permutation(self.num_pages)
    # A stack: pop() from the end hands out order[0] first.
    self._free: list[int] = [int(p) for p in order[::-1]]
    self._pages: dict[Hashable, list[int]] = {}
    self._tokens: dict[Hashable, int] = {}

  # Queries.
  @property
  def num_free(self) -> int:
    return len(self._free)

  @property
  def num_used(self) -> int:
    return self.num_pages - len(self._free)

  @property
  def live(self) -> tuple[Hashable, ...]:
    """Ids of the live sequences, in allocation order."""
    return tuple(self._pages)

  @property
  def max_tokens_per_seq(self) -> int:
    return self.max_pages_per_seq * self.page_size

  def __contains__(self, seq_id: Hashable) -> bool:
    return seq_id in self._pages

  def pages(self, seq_id: Hashable) -> tuple[int, ...]:
    """Physical pages of `seq_id`, in logical order."""
    return tuple(self._owned(seq_id))

  def num_tokens(self, seq_id: Hashable) -> int:
    """Tokens written for live sequence `seq_id` (ValueError if it is not live)."""
    self._owned(seq_id)
    return self._tokens[seq_id]

  def pages_needed(self, num_tokens: int, seq_id: Hashable | None = None) -> int:
    """Extra pages `seq_id` (or a new sequence, when None) needs to hold
    `num_tokens` tokens in total."""
    have = 0 if seq_id is None else len(self._owned(seq_id))
    return max(0, pages_for(num_tokens, self.page_size) - have)

  def can_allocate(self, num_tokens: int, seq_id: Hashable | None = None) -> bool:
    """True if `allocate` (seq_id None) or `grow` to `num_tokens` would succeed
    as far as free pages go."""
    return self.pages_needed(num_tokens, seq_id) <= self.num_free

  def block_table_row(self, seq_id: Hashable, width: int | None = None) -> np.ndarray:
    """`i32[width]` block-table row of `seq_id` (default width
    `max_pages_per_seq`), padded with `NO_PAGE`."""
    width = self.max_pages_per_seq if width is None else width
    pages = self._owned(seq_id)
    if len(pages) > width:
      raise ValueError(f"width must be at least the {len(pages)} pages of {seq_id!r}; got {width}")
    row = np.full((width,), NO_PAGE, np.int32)
    row[:len(pages)] = pages
    return row

  def block_tables(self, seq_ids: Iterable[Hashable | None],
                   width: int | None = None) -> np.ndarray:
    """`i32[len(seq_ids), width]`: one row per id; None gives an empty row."""
    width = self.max_pages_per_seq if width is None else width
    rows = [np.full((width,), NO_PAGE, np.int32) if s is None else self.block_table_row(s, width)
            for s in seq_ids]
    return np.stack(rows) if rows else np.zeros((0, width), np.int32)

  def stats(self) -> PoolStats:
    """Used/free pages and internal fragmentation of the live sequences."""
    used = self.num_used
    tokens = sum(self._tokens.values())
    reserved = used * self.page_size
    waste = reserved - tokens
    return PoolStats(num_pages=self.num_pages, page_size=self.page_size, used_pages=used,
                     free_pages=self.num_free, live_sequences=len(self._pages), tokens=tokens,
                     reserved_slots=reserved, internal_waste_slots=waste,
                     waste_fraction=waste / reserved if reserved else 0.0)

  # Mutations (atomic).
  def allocate(self, seq_id: Hashable, num_tokens: int) -> tuple[int, ...]:
    """Registers a new sequence holding `num_tokens` tokens and gives it
    `ceil(num_tokens / page_size)` pages.

    Returns:
      The pages given, in logical order.

    Raises:
      ValueError: `seq_id` already live; `num_tokens` negative or more than
        `max_pages_per_seq * page_size`.
      OutOfPagesError: fewer free pages than needed (nothing changes).
    """
    if seq_id in self._pages:
      raise ValueError(f"seq_id must not be live already; got {seq_id!r}")
    num_tokens = self._check_tokens(num_tokens)
    pages = self._take(seq_id, pages_for(num_tokens, self.page_size))
    self._pages[seq_id] = pages
    self._tokens[seq_id] = num_tokens
    return tuple(pages)

  def grow(self, seq_id: Hashable, num_tokens: int) -> tuple[int, ...]:
    """Makes room for `num_tokens` tokens in total in `seq_id`; a sequence that
    crosses a page boundary gets one more page (several for a long jump).

    Returns:
      The pages added (empty when the last page still has room).

    Raises:
      ValueError: unknown `seq_id`; `num_tokens` below the sequence's current
        count or past `max_pages_per_seq * page_size`.
      OutOfPagesError: fewer free pages than needed (nothing changes).
    """
    pages = self._owned(seq_id)
    num_tokens = self._check_tokens(num_tokens)
    if num_tokens < self._tokens[seq_id]:
      raise ValueError(
          f"num_tokens must not shrink sequence {seq_id!r} below its {self._tokens[seq_id]} "
          f"tokens; got {num_tokens}")
    added = self._take(seq_id, pages_for(num_tokens, self.page_size) - len(pages))
    pages.extend(added)
    self._tokens[seq_id] = num_tokens
    return tuple(added)

  def free(self, seq_id: Hashable) -> tuple[int, ...]:
    """Retires `seq_id`: all its pages go back on the free list.

    Returns:
      The pages freed.

    Raises:
      ValueError: `seq_id` is not live (freed twice, or never allocated).
    """
    pages = self._owned(seq_id)
    del self._pages[seq_id], self._tokens[seq_id]
    self._free.extend(reversed(pages))  # reused first (warm pages), in their old order
    return tuple(pages)

  def check(self) -> None:
    """Verifies the allocator's invariants (for tests and debugging).

    Raises:
      RuntimeError: a page owned twice, a page both owned and free, a page
        lost (neither owned nor free), or a token count its pages cannot hold.
    """
    owned = [p for pages in self._pages.values() for p in pages]
    if len(set(owned)) != len(owned):
      raise RuntimeError("a page is owned by two sequences (or twice by one)")
    if len(set(self._free)) != len(self._free):
      raise RuntimeError("a page is on the free list twice")
    if set(owned) & set(self._free):
      raise RuntimeError("a page is both owned and free")
    if len(owned) + len(self._free) != self.num_pages or any(
        not 0 <= p < self.num_pages for p in owned + self._free):
      raise RuntimeError("pages were lost or invented")
    for seq_id, pages in self._pages.items():
      if len(pages) != pages_for(self._tokens[seq_id], self.page_size):
        raise RuntimeError(f"sequence {seq_id!r} holds {len(pages)} pages for "
                           f"{self._tokens[seq_id]} tokens")

  # Helpers.
  def _owned(self, seq_id: Hashable) -> list[int]:
    try:
      return self._pages[seq_id]
    except KeyError:
      raise ValueError(f"seq_id must be a live sequence; got {seq_id!r}") from None

  def _check_tokens(self, num_tokens: Any) -> int:
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, (int, np.integer)):
      raise TypeError(f"num_tokens must be an int; got {num_tokens!r}")
    if not 0 <= num_tokens <= self.max_tokens_per_seq:
      raise ValueError(
          f"num_tokens must lie in [0, max_pages_per_seq * page_size] = "
          f"[0, {self.max_tokens_per_seq}]; got {num_tokens}")
    return int(num_tokens)

  def _take(self, seq_id: Hashable, count: int) -> list[int]:
    if count > len(self._free):
      raise OutOfPagesError(seq_id, count, len(self._free))
    return [self._free.pop() for _ in range(count)]


# ----------------------------------------------------------------------------
# Paged caches for a whole model (the `cache.kind = "paged"` switch).

CACHE_KINDS = ("dense", "paged")


def _gqa_layers(model) -> list[Any]:
  """The attention modules of `model.layers[i].attn`; ValueError for non-GQA layers."""
  layers = getattr(model, "layers", None)
  if layers is None:
    raise TypeError(f"model must have .layers with an .attn each (a kvattn.Transformer); got "
                    f"{type(model).__name__}")
  attns = []
  for i, layer in enumerate(layers):
    attn = layer.attn
    if not (hasattr(attn, "num_kv_heads") and hasattr(attn, "head_dim")):
      raise ValueError(
          f"paged caches hold K-head keys and values (MHA/GQA/MQA); layer {i} is "
          f"{type(attn).__name__}: use cache kind 'dense' for it")
    attns.append(attn)
  return attns


def init_paged_caches(model, tokens_per_seq: Iterable[int], *, page_size: int = 16,
                      max_len: int | None = None, dtype: Any = None, extra_pages: int = 0,
                      seed: int | None = None) -> tuple[tuple[PagedKVCache, ...], PageAllocator]:
  """Empty paged caches for every layer of `model`, pages allocated per sequence.

  Sequence b gets `ceil(tokens_per_seq[b] / page_size)` pages from a
  `PageAllocator` (seq ids 0..B-1), not the worst case of the batch: this is
  where paging saves memory. All layers share the page ids (one block table),
  each has its own pool of `P = sum of pages + extra_pages` pages.

  Args:
    model: a `kvattn.Transformer` whose layers are all GQA-family attention.
    tokens_per_seq: tokens each sequence will hold (e.g. prompt length +
      max_new_tokens - 1 in `generate`).
    page_size: tokens per page.
    max_len: per-sequence capacity (block-table width * page_size, rounded up
      to whole pages); default the largest `tokens_per_seq`.
    dtype: cache dtype (default the model's compute dtype).
    extra_pages: free pages left in the pool (for growth, e.g. in batching).
    seed: shuffles the free list (non-contiguous pages); None = ascending.

  Returns:
    `(caches, allocator)`: one `PagedKVCache` per layer (lengths 0) and the
    allocator that owns their pages.

  Raises:
    ValueError: an MLA layer, a sequence longer than `max_len`, bad sizes.
  """
  attns = _gqa_layers(model)
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
      PagedKVCache.init(len(tokens), num_pages=num_pages, page_size=page_size,
                        pages_per_seq=pps, num_kv_heads=attn.num_kv_heads,
                        head_dim=attn.head_dim, dtype=dtype, block_tables=tables)
      for attn in attns)
  return caches, allocator


def paged_cache_factory(model, *, page_size: int = 16, tokens_per_seq: Iterable[int] | None = None,
                        seed: int | None = None):
  """A `cache_factory(batch, max_len, dtype)` for `kvattn.generate` that builds
  paged caches (`init_paged_caches`).

  With `tokens_per_seq` each sequence gets only its own pages; without it
  every sequence gets `ceil(max_len / page_size)` pages.
  """
  page_size = _checks.positive_int("page_size", page_size)
  wanted = None if tokens_per_seq is None else [int(t) for t in tokens_per_seq]

  def factory(batch: int, max_len: int, dtype: Any = None) -> tuple[PagedKVCache, ...]:
    tokens = [max_len] * batch if wanted is None else wanted
    if len(tokens) != batch:
      raise ValueError(f"tokens_per_seq must have one entry per sequence ({batch}); got "
                       f"{len(tokens)}")
    return init_paged_caches(model, tokens, page_size=page_size, max_len=max_len, dtype=dtype,
                             seed=seed)[0]

  return factory


def cache_factory_from_config(model, cache_config, *, tokens_per_seq: Iterable[int] | None = None):
  """The cache-kind switch: `cache_config.kind` "dense" -> None (generate's
  default dense caches), "paged" -> `paged_cache_factory(model,
  page_size=cache_config.page_size, seed=cache_config.get("seed"))`.

  Usage: `kvattn.generate(model, prompts, lengths, n,
  cache_factory=cache_factory_from_config(model, config.cache))`.

  Raises:
    ValueError: an unknown kind.
  """
  kind = cache_config.kind if hasattr(cache_config, "kind") else cache_config["kind"]
  if kind not in CACHE_KINDS:
    raise ValueError(f"cache.kind must be one of {CACHE_KINDS}; got {kind!r}")
  if kind == "dense":
    return None
  get = cache_config.get if hasattr(cache_config, "get") else (lambda k, d=None: d)
  return paged_cache_factory(model, page_size=get("page_size", 16),
                             tokens_per_seq=tokens_per_seq, seed=get("seed", None))
