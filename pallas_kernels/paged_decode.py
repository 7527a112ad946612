"""Fused paged decode attention: one new query token per sequence against a page pool.

PagedAttention (Kwon et al., SOSP 2023, §4.1): keys and values live in pages of a
shared pool `[K, P, page_size, H]`; `block_tables: i32[B, pages_per_seq]` maps logical
page j of sequence b to a physical page. The math is `dense_decode`'s (`_common`: GQA
tiles, online softmax, splits merged by log-sum-exp); a key block is `pages_per_block`
pages, only pages holding attended slots are read, page ids are clamped into `[0, P)`
and slots outside the range masked, so free pages and unused tails never leak. int8 /
fp8 pools carry scale pools `f32[K, P, page_size]` whose pages travel with the values.

Schedules: "loop" (GPU, Triton; each program gathers its block's pages through the
table, `k_ref[page_ids]`, as jax/experimental/pallas/ops/gpu/paged_attention.py) and
"grid" (TPU, Mosaic; tables scalar-prefetched, one VMEM block per page whose index map
reads the page id, `_paging.page_spec`). Both run on CPU with `interpret=True`.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import _common
from pallas_kernels import _paging
from pallas_kernels import attention_common as common
from pallas_kernels import dense_decode

# ----------------------------------------------------------------------------
# Kernels. The online-softmax math, the "loop" block walk and the "grid"
# scratch handling are shared with the dense kernel (`_common`).
# ----------------------------------------------------------------------------


def _loop_kernel(
    start_ref,   # i32[]              first attended slot of this sequence
    length_ref,  # i32[]              one past the last attended slot
    table_ref,   # i32[pages_padded]  this sequence's block-table row
    q_ref,       # [Gb, H]
    k_ref,       # [P, page_size, H]  the whole key pool of this KV head
    v_ref,       # [P, page_size, Hv]
    *refs,       # (k_scale, v_scale f32[P, page_size, 1] with scaled=True),
                 # o f32[Gb, Hv], lse f32[Gb, 1], (count i32[Gb, 1]) pages read
    scaled: bool,
    count: bool,
    step: _common.Step,
):
  """"loop" schedule: one program per (b, k, G tile, split), fori_loop over key blocks."""
  sm_scale, soft_cap, pages_per_block, blocks_per_split, precision = step
  ks_ref, vs_ref = refs[:2] if scaled else (None, None)
  o_ref, lse_ref, *cnt_ref = refs[2:] if scaled else refs
  num_pages, page_size, _ = k_ref.shape
  block_k = pages_per_block * page_size
  start, length, first, num_blocks = _common.loop_range(start_ref, length_ref, block_k,
                                                        blocks_per_split)
  q = q_ref[...]

  def gather(ref, scale_ref, ids):  # [block_k, X], dequantized when quantized
    x = _paging.gather_pages(ref, ids, block_k)
    if scale_ref is None:
      return x
    return _common.dequant(x, _paging.gather_pages(scale_ref, ids, block_k), q.dtype)

  def body(i, carry):
    m, l, acc = carry
    blk = first + i
    ids = _paging.page_ids(table_ref, blk, pages_per_block, num_pages)
    s = _common.logits(q, gather(k_ref, ks_ref, ids), sm_scale=sm_scale, soft_cap=soft_cap,
                       precision=precision)
    return _common.online_softmax_step(m, l, acc, s, gather(v_ref, vs_ref, ids),
                                       blk * block_k, start, length, precision)

  _common.loop_blocks(num_blocks, body, o_ref, lse_ref, *cnt_ref, per_block=pages_per_block)


def _grid_kernel(
    starts_ref,   # i32[B]              (SMEM) first attended slot
    lengths_ref,  # i32[B]              (SMEM) one past the last attended slot
    tables_ref,   # i32[B * pages_padded] (SMEM) block tables, flattened
    q_ref,        # [Gb, H]
    *refs,        # k page j of the block [page_size, H] for j < pages_per_block, then the
                  # v pages [page_size, Hv], (then the k and v scale pages f32[page_size, 1]
                  # with scaled=True); o f32[Gb, Hv], lse f32[Gb, 128], (count i32[Gb, 128]);
                  # scratch m, l f32[Gb, 128], acc f32[Gb, Hv], (count)
    scaled: bool,
    count: bool,
    step: _common.Step,
):
  """"grid" schedule: key blocks on the last (sequential) grid axis."""
  sm_scale, soft_cap, pages_per_block, blocks_per_split, precision = step
  del tables_ref  # read by the index maps only
  ppb = pages_per_block
  k_refs, v_refs = refs[:ppb], refs[ppb:2 * ppb]
  ks_refs, vs_refs = ((refs[2 * ppb:3 * ppb], refs[3 * ppb:4 * ppb]) if scaled
                      else ((None,) * ppb, (None,) * ppb))

  def block(j, _):  # page j: logits and values, dequantized when the pool is quantized
    q = q_ref[...]

    def load(ref, scale_ref):
      return _common.dequant(ref[...], None if scale_ref is None else scale_ref[...], q.dtype)

    s = _common.logits(q, load(k_refs[j], ks_refs[j]), sm_scale=sm_scale, soft_cap=soft_cap,
                       precision=precision)
    return s, load(v_refs[j], vs_refs[j])

  _common.grid_body(starts_ref, lengths_ref, refs[(4 if scaled else 2) * ppb:], block,
                    count=count, block_size=k_refs[0].shape[0],
                    blocks_per_split=blocks_per_split, precision=precision,
                    pages_per_block=ppb)


# ----------------------------------------------------------------------------
# Launcher.
# ----------------------------------------------------------------------------


def _tiles(schedule: str, num_groups: int, page_size: int, pages_per_seq: int, head_dim: int,
           value_dim: int, dtype, pages_per_block: int | None,
           block_g: int | None) -> tuple[int, int, int]:
  """Resolves (pages_per_block, block_g, padded G); ValueError if they do not fit.

  "loop" (Triton): every loaded tile has a power-of-two size and every dot
  dimension is >= 16, so page_size, H and Hv are powers of two, a key block
  (`pages_per_block * page_size` keys) has >= 16 keys and the G tile >= 16 rows.
  "grid" (Mosaic): a page is one (page_size, H) VMEM block, page_size a
  multiple of the dtype's sublane count; the G tile a multiple of it too
  (`_common.g_tile`).
  """
  if schedule == "loop":
    for what, d in (("page_size", page_size), ("head dim H", head_dim),
                    ("value width Hv", value_dim)):
      if not _common.is_pow2(d):
        raise ValueError(f"{what} must be a power of two for the \"loop\" schedule (Triton "
                         f"tiles); got {d}")
    min_ppb = max(1, 16 // page_size)
    if pages_per_block is None:
      # The dense kernel's key block (~32 KiB of 16-bit K+V), but no more
      # pages than the table has (rounded up to a power of two).
      target = _common.loop_block_target(head_dim + value_dim)
      pages_per_block = max(min_ppb, min(target // page_size, _common.next_pow2(pages_per_seq)))
    elif not _common.is_pow2(pages_per_block) or pages_per_block < min_ppb:
      raise ValueError(
          f"pages_per_block must be a power of two with pages_per_block * page_size >= 16 "
          f"for the \"loop\" schedule; got {pages_per_block} (page_size {page_size})")
  else:
    granule = _common.sublanes(dtype)
    if page_size % granule:
      raise ValueError(
          f"page_size must be a multiple of {granule} for the \"grid\" schedule and dtype "
          f"{jnp.dtype(dtype).name} (TPU sublanes); got {page_size}")
    if pages_per_block is None:
      # ~512 keys per grid step amortise the ~0.35 us per-step overhead on TPU;
      # at most 8 page operands each for K and V.
      pages_per_block = max(1, min(8, 512 // page_size, pages_per_seq))
  block_g = _common.g_tile(schedule, num_groups, value_dim, dtype, block_g)
  return pages_per_block, block_g, _common.round_up(num_groups, block_g)


def _paged_partials(
    q,             # [B, K, Gp, H]   G padded to a multiple of block_g, in the dot dtype
    k_pages,       # [K, P, page_size, H]
    v_pages,       # [K, P, page_size, Hv]
    block_tables,  # i32[B, pages_padded]  padded to splits * blocks_per_split * ppb
    starts,        # i32[B]
    lengths,       # i32[B], already clamped to [0, pages_per_seq * page_size]
    k_scale=None,  # f32[K, P, page_size, 1] scale pool of a quantized k_pages, or None
    v_scale=None,  # f32[K, P, page_size, 1] (given with k_scale)
    *,
    sm_scale: float,
    soft_cap: float | None,
    pages_per_block: int,
    block_g: int,
    num_splits: int,
    schedule: str,
    interpret: Any,
    count: bool = False,
    num_warps: int | None = None,
    num_stages: int | None = None,
):
  """Runs the kernel; returns per-split `(out f32[B,K,splits,Gp,Hv], lse f32[B,K,splits,Gp])`
  and, with `count=True`, `i32[B, K, splits, Gp]` pages read per program (a
  test hook showing that pages outside the attended range are not read). With
  scale pools (a quantized cache) every page is dequantized into q's dtype as
  it is loaded."""
  batch, num_kv, gp, head_dim = q.shape
  _, num_pages, page_size, hv = v_pages.shape
  pages_padded = block_tables.shape[1]
  bps = pages_padded // (num_splits * pages_per_block)  # key blocks per split
  num_gt = gp // block_g
  scaled = k_scale is not None
  scale_pools = [k_scale, v_scale] if scaled else []
  precision = lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
  kernel_kw = dict(scaled=scaled, count=count,
                   step=_common.Step(sm_scale, soft_cap, pages_per_block, bps, precision))

  if schedule == "loop":
    scalar = pl.BlockSpec((None,), lambda b, h, g, j: (b,))
    in_specs = [
        scalar, scalar,
        pl.BlockSpec((None, pages_padded), lambda b, h, g, j: (b, 0)),
        pl.BlockSpec((None, None, block_g, head_dim), lambda b, h, g, j: (b, h, g, 0)),
    ] + [_paging.pool_spec(num_pages, (page_size, w)) for w in [head_dim, hv] + [1] * len(
        scale_pools)]
    kernel, grid = _loop_kernel, (batch, num_kv, num_gt, num_splits)
    operands = [starts, lengths, block_tables, q, k_pages, v_pages] + scale_pools
  else:
    in_specs = [pl.BlockSpec((None, None, block_g, head_dim),
                             lambda b, h, g, sp, st, *_: (b, h, g, 0))]
    for width in [head_dim, hv] + [1 for _ in scale_pools]:
      in_specs += [_paging.page_spec(j, (page_size, width), num_pages=num_pages,
                                     page_size=page_size, pages_per_block=pages_per_block,
                                     blocks_per_split=bps, pages_padded=pages_padded)
                   for j in range(pages_per_block)]
    kernel, grid = _grid_kernel, (batch, num_kv, num_gt, num_splits, bps)
    # Page operand j of each pool is the whole pool; its index map picks the page.
    operands = [starts, lengths, block_tables.reshape(-1), q] + [
        x for x in [k_pages, v_pages] + scale_pools for _ in range(pages_per_block)]
  return _common.launch(
      functools.partial(kernel, **kernel_kw), operands, schedule=schedule, grid=grid,
      in_specs=in_specs, block_g=block_g, hv=hv, count=count, num_scalar_prefetch=3,
      interpret=interpret, num_warps=num_warps, num_stages=num_stages,
      name="kvattn_paged_decode_attention")


# ----------------------------------------------------------------------------
# Public wrapper.
# ----------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=(
    "sm_scale", "window", "soft_cap", "interpret", "pages_per_block", "block_g", "num_splits",
    "schedule", "return_lse", "count_pages", "num_warps", "num_stages"))
def _paged_impl(q, k_pages, v_pages, block_tables, lengths, k_scale, v_scale, *, sm_scale,
                window, soft_cap, interpret, pages_per_block, block_g, num_splits, schedule,
                return_lse, count_pages, num_warps, num_stages):
  batch, num_heads, head_dim = q.shape
  num_kv, _, page_size, hv = v_pages.shape
  pages_per_seq = block_tables.shape[1]
  groups = num_heads // num_kv
  pages_per_block, block_g, gp = _tiles(schedule, groups, page_size, pages_per_seq, head_dim,
                                        hv, k_pages.dtype, pages_per_block, block_g)
  tables, num_splits, _ = _paging.page_splits(block_tables, schedule,
                                              batch * num_kv * (gp // block_g),
                                              pages_per_block, num_splits)
  starts, lengths = common.attended_range(lengths, pages_per_seq * page_size, window)
  qg = _common.group_queries(q, num_kv, gp, _common.dot_dtype(q.dtype, k_pages.dtype))
  scale_pools = () if k_scale is None else _common.scale_columns((k_scale, v_scale))
  outs = _paged_partials(
      qg, k_pages, v_pages, tables, starts, lengths, *scale_pools, sm_scale=sm_scale,
      soft_cap=soft_cap, pages_per_block=pages_per_block, block_g=block_g,
      num_splits=num_splits, schedule=schedule, interpret=interpret, count=count_pages,
      num_warps=num_warps, num_stages=num_stages)
  return _common.finish(outs, num_heads, groups, q.dtype, return_lse, count_pages)


def paged_decode_attention(
    q: jax.Array,             # [B, N, H]
    k_pages: jax.Array,       # [K, P, page_size, H]
    v_pages: jax.Array,       # [K, P, page_size, Hv]
    block_tables: jax.Array,  # i32[B, pages_per_seq]
    lengths: jax.Array,       # i32[B]
    *,
    k_scale: jax.Array | None = None,  # f32[K, P, page_size]
    v_scale: jax.Array | None = None,  # f32[K, P, page_size]
    sm_scale: float | None = None, window: int | None = None, soft_cap: float | None = None,
    **tunables: Any,
):
  """`dense_decode.decode_attention` against a page pool (PagedAttention, Kwon et al.
  2023): slot s of sequence b is slot `s % page_size` of page `block_tables[b, s //
  page_size]`; entries outside `[0, P)` are allowed at pages a sequence does not use.
  Pages outside the attended range are neither read nor computed. Tunables as
  `dense_decode.decode_attention_unchecked`, with `pages_per_block` for `block_k` and
  `count_pages` (pages read) for `count_blocks`.

  Returns:
    `[B, N, Hv]` in q's dtype; with `return_lse` / `count_pages` as `decode_attention`.

  Raises:
    ValueError: shapes that do not fit; a page size, head dim or tunable the schedule
      cannot tile; `interpret=False` off GPU/TPU.
    TypeError: non-float q, k/v dtype mismatch, non-integer tables or lengths, scales
      missing or given for a float pool.
  """
  lengths = common.check_paged_args(q, k_pages, v_pages, block_tables, lengths, window=window,
                                    soft_cap=soft_cap, sm_scale=sm_scale, k_scale=k_scale,
                                    v_scale=v_scale)
  return paged_decode_attention_unchecked(
      q, k_pages, v_pages, block_tables, lengths, sm_scale=sm_scale, window=window,
      soft_cap=soft_cap, k_scale=k_scale, v_scale=v_scale, **tunables)


def paged_decode_attention_unchecked(q, k_pages, v_pages, block_tables, lengths, *,
                                     sm_scale=None, window=None, soft_cap=None, k_scale=None,
                                     v_scale=None, interpret=False, pages_per_block=None,
                                     block_g=None, num_splits=None, schedule=None,
                                     platform=None, num_warps=None, num_stages=None,
                                     return_lse=False, count_pages=False):
  """`paged_decode_attention` without the argument checks (kvattn's dispatch point)."""
  schedule = _common.check_schedule(schedule, interpret, (
      ("pages_per_block", pages_per_block), ("block_g", block_g), ("num_splits", num_splits)),
      platform)
  head_dim = q.shape[2]
  # Resolve tiles now so an unfit page size or tunable raises before tracing.
  _tiles(schedule, q.shape[1] // k_pages.shape[0], k_pages.shape[2], block_tables.shape[1],
         head_dim, v_pages.shape[3], k_pages.dtype, pages_per_block, block_g)
  sm_scale = float(head_dim ** -0.5 if sm_scale is None else sm_scale)
  soft_cap = None if soft_cap is None else float(soft_cap)
  return _paged_impl(q, k_pages, v_pages, block_tables, lengths, k_scale, v_scale,
                     sm_scale=sm_scale, window=window, soft_cap=soft_cap, interpret=interpret,
                     pages_per_block=pages_per_block, block_g=block_g, num_splits=num_splits,
                     schedule=schedule, return_lse=return_lse, count_pages=count_pages,
                     num_warps=num_warps, num_stages=num_stages)


def unsupported_reason(q_shape, k_pages_shape, v_pages_shape, dtype, *,
                       platform: str | None = None) -> str | None:
  """Why the compiled kernel cannot run these shapes, or None if it can.

  Used by kvattn's dispatch to fall back to the XLA path.
  `k_pages_shape` is `[K, P, page_size, H]`, `v_pages_shape` `[K, P,
  page_size, Hv]`; `dtype` the pools' dtype. Quantized pools are accepted on
  GPU (int8 and both fp8 formats; Triton needs sm_89+ for fp8) and, int8
  only, on TPU (page_size a multiple of 32 there). What it accepts of the
  grid in tests/pallas_kernels/test_lowering.py (each dtype, head dims
  64-256, window, soft cap) lowers for "cuda" and "tpu"; nothing has been
  compiled on a device yet.
  """
  del q_shape
  platform = platform or _common.platform()
  page_size, head_dim = k_pages_shape[2], k_pages_shape[3]
  hv = v_pages_shape[3]
  if platform in _common.GPU_PLATFORMS and not _common.is_pow2(page_size):
    return f"page_size={page_size} is not a power of two (Triton tiles)"
  reason = _common.compiled_reason(platform, dtype,
                                   (("head dim H", head_dim), ("value width Hv", hv)))
  if reason is not None:
    return reason
  if platform == "tpu" and page_size % _common.sublanes(dtype):
    return f"page_size={page_size} is not a multiple of {_common.sublanes(dtype)}"
  return None


# ----------------------------------------------------------------------------
# Reference (plain jnp, f32).
# ----------------------------------------------------------------------------


def paged_decode_attention_reference(q, k_pages, v_pages, block_tables, lengths, *,
                                     k_scale=None, v_scale=None, **options: Any):
  """Plain-jnp f32 `paged_decode_attention`: every sequence's pages (and scale pages)
  gathered into a dense view, then `dense_decode.decode_attention_reference`."""
  ids = jnp.clip(block_tables, 0, k_pages.shape[1] - 1)

  def dense(pool):  # [K, P, page_size, ...] -> [B, K, S, ...]
    x = jnp.moveaxis(jnp.take(pool, ids, axis=1), 0, 1)  # [B, K, pages_per_seq, ps, ...]
    return x.reshape(x.shape[:2] + (-1,) + x.shape[4:])

  return dense_decode.decode_attention_reference(
      q, dense(k_pages), dense(v_pages), lengths,
      k_scale=None if k_scale is None else dense(k_scale),
      v_scale=None if v_scale is None else dense(v_scale), **options)
