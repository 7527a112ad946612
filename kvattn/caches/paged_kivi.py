"""KIVI with its quantized store in pages (PagedAttention's layout for a 2/4-bit store).

`PagedKIVICache` is `kivi.KIVICache` (Liu et al. 2024, arXiv 2402.02750: keys per channel over
groups of `group_size` tokens, values per token, the newest `residual` tokens in the compute dtype)
whose quantized store lives in a page pool shared by the batch, as `PagedKVCache`'s tokens do (Kwon
et al. 2023, "PagedAttention"): a sequence holds pages for the tokens it has flushed, not for the
capacity. Registry kinds `paged_kivi2`, `paged_kivi4` (KIVI's options plus `page_size` and `seed`).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from kvattn import _checks
from kvattn.caches import _residual
from kvattn.caches import capabilities
from kvattn.caches import registry
from kvattn.caches._layers import gqa_layers
from kvattn.caches import kivi
from kvattn.caches import paged as paged_lib
from kvattn.paging.allocator import NO_PAGE, PageAllocator, pages_for


def store_tokens(num_tokens: int, *, residual: int, group_size: int) -> int:
  """Tokens in the quantized store when a sequence holds `num_tokens`: `g * max(0, (n -
  residual) // g)` (what its pages must hold)."""
  return group_size * max(0, (num_tokens - residual) // group_size)


@struct.dataclass
class PagedKIVICache(capabilities.Pages, kivi.KIVICache):
  """KIVI cache of one GQA layer with a paged store (module doc).

  Attributes:
    k_codes, v_codes: `u8[K, P, page_size, H * bits / 8]` page pools of packed codes.
    k_scale, k_zero: `[K, P, page_size / group_size, H]`.
    v_scale, v_zero: `[K, P, page_size, H / value_group]`.
    k_res, v_res: `[B, K, Rb, H]` residual rings in the compute dtype.
    lengths: `i32[B]` tokens written.
    block_tables: `i32[B, pages_per_seq]`, `NO_PAGE` = unassigned.
    bits, group_size, residual, max_len, pre_rope, rope_theta, rope_scaling: as `KIVICache`.
  """

  block_tables: jax.Array = None

  FLOAT_ONLY = True

  @classmethod
  def init_paged(cls, batch: int, max_len: int, num_kv_heads: int, head_dim: int,
                 dtype=jnp.float32, *, num_pages: int, page_size: int, block_tables: Any = None,
                 pages_per_seq: int | None = None, **settings) -> "PagedKIVICache":
    """An empty cache over a pool of `num_pages` pages.

    Args:
      batch, max_len, num_kv_heads, head_dim, dtype: as `KIVICache.init`.
      num_pages: P, pages in the pool.
      page_size: store slots per page, a multiple of `group_size`.
      block_tables: `int[B, pages_per_seq]` (default all `NO_PAGE`).
      pages_per_seq: block-table width, at least (the default) `max(1, ceil(Sq /
        page_size))`; wider rows let an allocator counting tokens rather than store tokens
        give a row pages for all its tokens (`ContinuousBatcher` with the prefix cache).
      **settings: `KIVICache.init`'s (`bits`, `group_size`, `residual`, `pre_rope`,
        `scale_dtype`, `rope_theta`, `rope_scaling`).

    Raises:
      ValueError: `KIVICache.init`'s; a `page_size` that is not a multiple of `group_size`;
        a bad `num_pages` or block-table shape or entry.
    """
    # The dense layout's shapes and checked settings, without allocating its store.
    dense = jax.eval_shape(lambda: kivi.KIVICache.init(batch, max_len, num_kv_heads, head_dim,
                                                       dtype, **settings))
    g = dense.group_size
    num_pages = _checks.positive_int("num_pages", num_pages)
    page_size = _checks.positive_int("page_size", page_size)
    if page_size % g:
      raise ValueError(f"page_size must be a multiple of group_size = {g} (a key group never "
                       f"straddles a page); got {page_size}")
    pps = max(1, pages_for(dense.store_capacity, page_size))
    if pages_per_seq is not None:
      if _checks.positive_int("pages_per_seq", pages_per_seq) < pps:
        raise ValueError(f"pages_per_seq must be at least ceil(Sq / page_size) = {pps} (the "
                         f"store's pages); got {pages_per_seq}")
      pps = int(pages_per_seq)
    if block_tables is None:
      block_tables = np.full((batch, pps), NO_PAGE, np.int32)
    block_tables = jnp.asarray(block_tables)
    _checks.integer("block_tables", block_tables)
    if block_tables.shape != (batch, pps):
      raise ValueError(f"block_tables must have shape [B, pages_per_seq] = ({batch}, {pps}); got "
                       f"{tuple(block_tables.shape)}")
    if _checks.is_concrete(block_tables):
      paged_lib.check_rows("block_tables", block_tables, np.zeros(batch), num_pages, page_size)
    pool = lambda x, slots: jnp.zeros((num_kv_heads, num_pages, slots) + x.shape[3:], x.dtype)
    return cls(
        k_codes=pool(dense.k_codes, page_size), v_codes=pool(dense.v_codes, page_size),
        k_scale=pool(dense.k_scale, page_size // g) + 1, k_zero=pool(dense.k_zero, page_size // g),
        v_scale=pool(dense.v_scale, page_size) + 1, v_zero=pool(dense.v_zero, page_size),
        k_res=jnp.zeros(dense.k_res.shape, dense.k_res.dtype),
        v_res=jnp.zeros(dense.v_res.shape, dense.v_res.dtype),
        lengths=jnp.zeros((batch,), jnp.int32),
        block_tables=block_tables.astype(jnp.int32), bits=dense.bits, group_size=g,
        residual=dense.residual, max_len=dense.max_len, pre_rope=dense.pre_rope,
        rope_theta=dense.rope_theta, rope_scaling=dense.rope_scaling)

  # ---------------------------------------------------------------------------- sizes
  @property
  def num_pages(self) -> int:
    return self.k_codes.shape[1]

  @property
  def page_size(self) -> int:
    return self.k_codes.shape[2]

  @property
  def pages_per_seq(self) -> int:
    return self.block_tables.shape[1]

  @property
  def store_capacity(self) -> int:
    """Sq, the logical store slots of one sequence (as the dense layout's)."""
    return kivi.store_slots(self.max_len, self.residual, self.group_size)

  @property
  def storage_slots(self) -> int:
    """P * page_size: the pool's store slots (what `kvattn.memory` divides by)."""
    return self.num_pages * self.page_size

  @property
  def assigned_store_slots(self) -> jax.Array:
    """`i32[B]`: store tokens the row's leading assigned pages can hold."""
    from kvattn.ops import xla_paged  # pylint: disable=g-import-not-at-top
    return jnp.minimum(xla_paged.assigned_slots(self.block_tables, self.num_pages,
                                                self.page_size), self.store_capacity)

  @property
  def readable_quantized(self) -> jax.Array:
    """`i32[B]`: store tokens attention reads, `min(num_quantized, assigned_store_slots)`."""
    return jnp.minimum(self.num_quantized, self.assigned_store_slots)

  @property
  def overflowed(self) -> jax.Array:
    """`bool[B]`: written past `max_len`, or flushed onto pages the row was not given."""
    return (self.lengths > self.max_len) | (self.num_quantized > self.assigned_store_slots)

  def analytic_bytes_per_token(self) -> float:
    """Bytes per pool store slot: the pools (codes, scales, zero points) plus the rings,
    over `P * page_size` (from sizes, not arrays)."""
    h, g, kh = self.head_dim, self.group_size, self.num_kv_heads
    s = jnp.dtype(self.k_scale.dtype).itemsize
    vg = kivi.value_group(g, h)
    per_slot = 2 * h * self.bits / 8 + 2 * h * s / g + 2 * (h // vg) * s
    ring = self.batch * self.ring_capacity * 2 * h * jnp.dtype(self.dtype).itemsize
    return kh * (self.storage_slots * per_slot + ring) / self.storage_slots

  def check_state(self, name: str = "cache") -> None:
    """Eager: `lengths` in `[0, max_len]`; block-table entries pages of the pool or
    `NO_PAGE`, and every logical page the row's store tokens occupy assigned."""
    super().check_state(name)
    if not (_checks.is_concrete(self.block_tables) and _checks.is_concrete(self.lengths)):
      return
    paged_lib.check_rows(f"{name} block_tables", self.block_tables,
                         np.asarray(self.num_quantized), self.num_pages, self.page_size)

  # ---------------------------------------------------------------------------- slots
  POOL_FIELDS = ("k_codes", "v_codes", "k_scale", "k_zero", "v_scale", "v_zero")
  """The fields shared by the batch (page pools); the rest are per row."""

  def assign_slot(self, slot, pages, length=0) -> "PagedKIVICache":
    """Gives row `slot` the block-table row `pages` and `length` tokens (0: a sequence about
    to prefill; a row of length 0 reads nothing from its ring, whatever it holds).

    Args:
      slot: row index (int or traced int32 scalar: a jitted caller does not recompile).
      pages: `int[pages_per_seq]` row of pool pages for its store tokens, `NO_PAGE`-padded.
      length: tokens the row holds; only 0 is exact for a length whose residual tokens the
        ring does not hold (`ContinuousBatcher` always joins at 0).

    Raises:
      ValueError: a row of the wrong shape; when concrete, a `slot` outside `[0, B)`, a
        `length` outside `[0, max_len]`, an entry neither a pool page nor `NO_PAGE`, or a
        logical page the row's store tokens occupy left unassigned.
    """
    pages = jnp.asarray(pages, jnp.int32)
    if pages.shape != (self.pages_per_seq,):
      raise ValueError(f"pages must have shape [pages_per_seq] = ({self.pages_per_seq},); got "
                       f"{tuple(pages.shape)}")
    _checks.values_in_range("slot", slot, 0, self.batch - 1)
    _checks.values_in_range("length", length, 0, self.max_len)
    if _checks.is_concrete(pages) and _checks.is_concrete(length):
      stored = store_tokens(int(length), residual=self.residual, group_size=self.group_size)
      paged_lib.check_rows("pages", pages[None], np.array([stored]), self.num_pages,
                           self.page_size)
    return self.replace(block_tables=self.block_tables.at[slot].set(pages),
                        lengths=self.lengths.at[slot].set(jnp.asarray(length, jnp.int32)))

  def release_slot(self, slot) -> "PagedKIVICache":
    """Row `slot` empty: `NO_PAGE` row, length 0 (pages and ring contents left as they are)."""
    return self.assign_slot(slot, jnp.full((self.pages_per_seq,), NO_PAGE, jnp.int32), 0)

  def slot_view(self, slot) -> "PagedKIVICache":
    """A batch-1 cache of row `slot` (traced or int) over the shared pools: its block-table
    row, length and ring."""
    row = lambda x: jax.lax.dynamic_index_in_dim(x, slot, 0, keepdims=True)
    return self.replace(block_tables=row(self.block_tables), lengths=row(self.lengths),
                        k_res=row(self.k_res), v_res=row(self.v_res))

  def with_slot_view(self, slot, view: "PagedKIVICache") -> "PagedKIVICache":
    """This cache with `view` (a `slot_view(slot)` after writes) put back: its pools, and
    its length and ring in row `slot` (the block-table row is the cache's own)."""
    put = lambda x, r: jax.lax.dynamic_update_index_in_dim(x, r, slot, 0)
    return self.replace(**{f: getattr(view, f) for f in self.POOL_FIELDS},
                        lengths=put(self.lengths, view.lengths), k_res=put(self.k_res, view.k_res),
                        v_res=put(self.v_res, view.v_res))

  # Boundary state (a prefix cache's snapshot: `kvattn.inference.batching.snapshots`): the
  # residual ring's tokens `[end - R, end)`; the store of `[0, end - R)` is in the pages.
  def boundary_layout(self, count: int) -> list[tuple[tuple[int, ...], Any]]:
    del count
    return [((self.num_kv_heads, self.residual, self.head_dim), a.dtype)
            for a in (self.k_res, self.v_res)]

  def boundary_state(self, slot, end, count: int) -> tuple:
    """`(k, v)`: `[K, R, H]` of row `slot`'s last R tokens (zeros for tokens < 0); the row
    must hold exactly `end` tokens."""
    del count
    p, idx = capabilities.tokens_before(end, self.residual, self.ring_capacity)
    return (capabilities.row_tokens(self.k_res, slot, p, idx),
            capabilities.row_tokens(self.v_res, slot, p, idx))

  def with_boundary_state(self, slot, state, end, count: int) -> "PagedKIVICache":
    """Row `slot`'s ring as that of an `end`-token row, from `boundary_state`."""
    del count
    _, idx = capabilities.tokens_before(end, self.residual, self.ring_capacity)
    return self.replace(k_res=capabilities.put_row_tokens(self.k_res, slot, idx, state[0]),
                        v_res=capabilities.put_row_tokens(self.v_res, slot, idx, state[1]),
                        lengths=self.lengths.at[slot].set(end))

  # ---------------------------------------------------------------------------- pages
  def _pages(self, slots: jax.Array) -> jax.Array:
    """`i32[B, n]` the page of logical store slots `slots: i32[B, n] or [n]` (unassigned
    entries clipped into the pool: what they read is masked)."""
    logical = jnp.clip(slots // self.page_size, 0, self.pages_per_seq - 1)
    logical = jnp.broadcast_to(logical, (self.batch,) + logical.shape[-1:])
    return jnp.take_along_axis(self.block_tables, logical, axis=1)

  def read_block(self, offset: jax.Array, size: int) -> tuple[jax.Array, jax.Array]:
    """Store slots `[offset, offset + size)` gathered through the block table and dequantized: f32
    `(k, v)` `[B, K, size, H]`. `offset` and `size` multiples of `group_size`."""
    g, ps = self.group_size, self.page_size
    slots = offset + jnp.arange(size, dtype=jnp.int32)
    page = jnp.clip(self._pages(slots), 0, self.num_pages - 1)  # [B, size]
    off = jnp.broadcast_to(slots % ps, page.shape)
    group_slots = offset + g * jnp.arange(size // g, dtype=jnp.int32)
    gpage = jnp.clip(self._pages(group_slots), 0, self.num_pages - 1)  # [B, size / g]
    goff = jnp.broadcast_to((group_slots % ps) // g, gpage.shape)
    take = lambda pool, p, o: jnp.moveaxis(pool[:, p, o], 0, 1)  # [K, B, n, ...] -> [B, K, ...]
    return self._dequantize(take(self.k_codes, page, off), take(self.k_scale, gpage, goff),
                            take(self.k_zero, gpage, goff), take(self.v_codes, page, off),
                            take(self.v_scale, page, off), take(self.v_zero, page, off))

  def _put_store(self, buf, x, index, per):
    """Scatters `x: [B, K, n, ...]` to the pages of store slots (`per` "token") or key groups
    ("group") `index: i32[B, n]`; the end index, and slots on unassigned pages, are dropped."""
    g, ps = self.group_size, self.page_size
    slots = index if per == "token" else index * g
    page = self._pages(slots)
    ok = (slots < self.store_capacity) & (page >= 0) & (page < self.num_pages)
    page = jnp.where(ok, page, self.num_pages)
    off = slots % ps if per == "token" else (slots % ps) // g
    return buf.at[:, page, off].set(jnp.moveaxis(x, 1, 0), mode="drop")

  def update_unchecked(self, k_new, v_new, new_lengths):
    """`KIVICache.update_unchecked`, after the eager check that every page the write
    flushes a group onto is assigned (ValueError naming the block-table entry)."""
    self._check_pages_assigned(new_lengths)
    return super().update_unchecked(k_new, v_new, new_lengths)

  def update_attend_unchecked(self, q, k, v, *, new_lengths, **options):
    """`KIVICache.update_attend_unchecked` after the eager page check of `update_unchecked`."""
    self._check_pages_assigned(new_lengths)
    return super().update_attend_unchecked(q, k, v, new_lengths=new_lengths, **options)

  def _check_pages_assigned(self, new_lengths) -> None:
    if not all(_checks.is_concrete(x) for x in (self.lengths, new_lengths, self.block_tables)):
      return
    tables = np.asarray(self.block_tables)
    end = np.minimum(np.asarray(self.lengths) + np.asarray(new_lengths), self.max_len)
    for b in range(self.batch):
      nq = store_tokens(int(end[b]), residual=self.residual, group_size=self.group_size)
      for j in range(pages_for(nq, self.page_size)):
        page = int(tables[b, j])
        if not 0 <= page < self.num_pages:
          raise ValueError(
              f"block_tables[{b}, {j}] must be a page in [0, {self.num_pages}) for sequence {b} "
              f"to hold {nq} store tokens; got {page} (allocate the page with a PageAllocator "
              f"first)")

  def _store_decode(self, q, starts, lengths, implementation, **options):
    """The paged store by `kvattn.ops.dispatch`'s "paged_kivi_store_decode"; `lengths`
    capped at the assigned pages' store slots."""
    from kvattn.ops import dispatch  # pylint: disable=g-import-not-at-top
    return dispatch.dispatch(
        "paged_kivi_store_decode", implementation, q, self.k_codes, self.k_scale, self.k_zero,
        self.v_codes, self.v_scale, self.v_zero, self.block_tables, starts,
        jnp.minimum(lengths, self.assigned_store_slots), bits=self.bits,
        pre_rope=self.pre_rope, **options)


def build(bits: int):
  """The registry builder of kind `paged_kivi{bits}`: one `PagedKIVICache` per GQA layer
  sharing one block table; sequence b gets the pages its store tokens need (from
  `tokens_per_seq`, default `max_len`) from a `PageAllocator`."""

  def _build(model, batch, max_len, dtype, options, tokens_per_seq):
    g = _checks.positive_int("group_size", options["group_size"])
    residual = _residual.check_residual(options["residual"], g)
    tokens = [max_len] * batch if tokens_per_seq is None else [int(t) for t in tokens_per_seq]
    if len(tokens) != batch:
      raise ValueError(f"tokens_per_seq must have one entry per sequence ({batch}); got "
                       f"{len(tokens)}")
    page_size = _checks.positive_int("page_size", options["page_size"])
    sq = kivi.store_slots(max_len, residual, g)
    pps = max(1, pages_for(sq, page_size))
    stored = [store_tokens(min(t, max_len), residual=residual, group_size=g) for t in tokens]
    num_pages = max(1, sum(pages_for(n, page_size) for n in stored))
    allocator = PageAllocator(num_pages, page_size, pps, seed=options["seed"])
    for b, n in enumerate(stored):
      allocator.allocate(b, n)
    tables = allocator.block_tables(range(batch), pps)
    return tuple(PagedKIVICache.init_paged(
        batch, max_len, a.num_kv_heads, a.head_dim, dtype, num_pages=num_pages,
        page_size=page_size, block_tables=tables, bits=bits, group_size=g, residual=residual,
        pre_rope=options["pre_rope"], scale_dtype=options["scale_dtype"],
        rope_theta=a.rope_theta, rope_scaling=a.rope_scaling)
                 for a in gqa_layers(model))

  return _build


OPTIONS = {**kivi.OPTIONS, "page_size": 128, "seed": None}
"""The registry options of `paged_kivi2` / `paged_kivi4`: KIVI's plus `page_size` (store
slots per page, a multiple of `group_size`) and `seed` (shuffles the free list)."""


def _pool(bits: int):
  """`CacheKind.pool` of `paged_kivi{bits}`: the allocator counts store tokens; with the prefix
  cache every token (prompts prefill a page at a time, so a hit restores the state exactly)."""

  def pool(options, *, max_len, page_size, prefix_cache):
    g = _checks.positive_int("group_size", options["group_size"])
    residual = _residual.check_residual(options["residual"], g)
    settings = {k: options[k] for k in ("group_size", "residual", "pre_rope", "scale_dtype")}
    if prefix_cache:
      pps, tokens = pages_for(max_len, page_size), lambda n: n
    else:
      pps = max(1, pages_for(kivi.store_slots(max_len, residual, g), page_size))
      tokens = lambda n: store_tokens(n, residual=residual, group_size=g)

    def init(a, rows, num_pages, dtype):
      return PagedKIVICache.init_paged(
          rows, max_len, a.num_kv_heads, a.head_dim, dtype, num_pages=num_pages,
          page_size=page_size, pages_per_seq=pps, bits=bits, rope_theta=a.rope_theta,
          rope_scaling=a.rope_scaling, **settings)

    return paged_lib.PoolPlan(pps, tokens, init, chunked_prefill=prefix_cache,
                              residual=residual if prefix_cache else 0, refuses=(
        ("speculative", "a verify pass may flush a group of drafted tokens into the quantized "
         "store, which rollback by lengths cannot undo"),
        ("local_layers", "rings for local layers are float caches"),
        ("offload", "the tiers move float pages (PageCodec)")))

  return pool


for _bits in (2, 4):
  registry.register_cache_kind(f"paged_kivi{_bits}", registry.CacheKind(
      build(_bits), OPTIONS, f"PagedKIVICache: kivi{_bits} with its quantized store in pages of "
      f"`page_size` slots (a multiple of group_size)", pool=_pool(_bits), float_only=True))
