"""Fused decode attention over a paged KIVI store: `lowbit_decode`'s kernel reading pages.

The store of `kvattn.caches.paged_kivi` (KIVI, Liu et al. 2024, arXiv 2402.02750) is
`lowbit_decode`'s layout cut into pages of `page_size` slots in six pools (key codes,
scales, zeros; value codes, scales, zeros), `[K, P, page_rows, X]`; logical store slot s
of sequence b is slot `s % page_size` of page `block_tables[b, s // page_size]`. Each
key block is `pages_per_block` pages, dequantized in registers as in `lowbit_decode`.
Schedules as `paged_decode`: "loop" (GPU, Triton; pages gathered with `ref[page_ids]`)
and "grid" (TPU, Mosaic; tables scalar-prefetched, one VMEM block per page). CPU runs
either with `interpret=True`. Layout: kernels, launcher, public wrapper, reference.
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
from pallas_kernels import lowbit_decode
from pallas_kernels.lowbit_decode import dequant_keys, dequant_values


def _loop_kernel(
    start_ref,   # i32[]              first attended slot of this sequence
    length_ref,  # i32[]              one past the last attended slot
    table_ref,   # i32[pages_padded]  this sequence's block-table row
    q_ref,       # [Gb, H]
    kc_ref,      # u8[P, page_size, W]       the whole pools of this KV head
    ks_ref,      # [P, page_size / g, H]
    kz_ref,      # [P, page_size / g, H]
    vc_ref,      # u8[P, page_size, W]
    vs_ref,      # [P, page_size, H / vg]
    vz_ref,      # [P, page_size, H / vg]
    o_ref,       # f32[Gb, H]
    lse_ref,     # f32[Gb, 1]
    *rest,       # (count i32[Gb, 1])
    bits: int,
    group_size: int,
    step: _common.Step,
):
  """"loop" schedule: each key block is `pages_per_block` pages gathered through the table."""
  sm_scale, soft_cap, pages_per_block, blocks_per_split, precision = step
  num_pages, page_size, _ = kc_ref.shape
  block_k = pages_per_block * page_size
  start, length, first, num_blocks = _common.loop_range(start_ref, length_ref, block_k,
                                                        blocks_per_split)
  q = q_ref[...]
  gather = _paging.gather_pages

  def body(i, carry):
    m, l, acc = carry
    blk = first + i
    ids = _paging.page_ids(table_ref, blk, pages_per_block, num_pages)
    rows = block_k // group_size
    k = dequant_keys(gather(kc_ref, ids, block_k), gather(ks_ref, ids, rows),
                     gather(kz_ref, ids, rows), bits, group_size).astype(q.dtype)
    v = dequant_values(gather(vc_ref, ids, block_k), gather(vs_ref, ids, block_k),
                       gather(vz_ref, ids, block_k), bits).astype(q.dtype)
    s = _common.logits(q, k, sm_scale=sm_scale, soft_cap=soft_cap, precision=precision)
    return _common.online_softmax_step(m, l, acc, s, v, blk * block_k, start, length,
                                       precision)

  _common.loop_blocks(num_blocks, body, o_ref, lse_ref, *rest, per_block=pages_per_block)


def _grid_kernel(
    starts_ref,   # i32[B]                 (SMEM) first attended slot
    lengths_ref,  # i32[B]                 (SMEM) one past the last attended slot
    tables_ref,   # i32[B * pages_padded]  (SMEM) block tables, flattened
    q_ref,        # [Gb, H]
    *refs,        # per pool (k codes, scale, zero, v codes, scale, zero) its pages_per_block
                  # page operands; o f32[Gb, H], lse f32[Gb, 128], (count i32[Gb, 128]);
                  # scratch m, l f32[Gb, 128], acc f32[Gb, H], (count)
    bits: int,
    group_size: int,
    count: bool,
    step: _common.Step,
):
  """"grid" schedule: page operands fetched by their index maps (`_paging.page_spec`)."""
  sm_scale, soft_cap, pages_per_block, blocks_per_split, precision = step
  del tables_ref  # read by the index maps only
  ppb = pages_per_block
  pools = [refs[i * ppb:(i + 1) * ppb] for i in range(6)]

  def block(j, _):  # page j, dequantized
    q = q_ref[...]
    kc, ks, kz, vc, vs, vz = (pool[j][...] for pool in pools)
    k = dequant_keys(kc, ks, kz, bits, group_size).astype(q.dtype)
    v = dequant_values(vc, vs, vz, bits).astype(q.dtype)
    return _common.logits(q, k, sm_scale=sm_scale, soft_cap=soft_cap, precision=precision), v

  _common.grid_body(starts_ref, lengths_ref, refs[6 * ppb:], block, count=count,
                    block_size=pools[0][0].shape[0], blocks_per_split=blocks_per_split,
                    precision=precision, pages_per_block=ppb)


def _pages_per_block(schedule: str, page_size: int, pages_per_seq: int, head_dim: int,
                     pages_per_block: int | None) -> int:
  """Resolves the pages of one key block; ValueError if unfit. "loop": a power of two
  with a block of >= 16 slots, by default the dense kernel's target (no more pages than
  the table has). "grid": any, by default ~512 slots, at most 8 page operands per pool."""
  if schedule == "loop":
    if pages_per_block is None:
      return max(1, min(_common.loop_block_target(2 * head_dim) // page_size,
                        _common.next_pow2(pages_per_seq)), 16 // page_size)
    if not _common.is_pow2(pages_per_block) or pages_per_block * page_size < 16:
      raise ValueError(f"pages_per_block must be a power of two with pages_per_block * "
                       f"page_size >= 16 for the \"loop\" schedule; got {pages_per_block} "
                       f"(page_size {page_size})")
    return pages_per_block
  if pages_per_block is None:
    return max(1, min(8, 512 // page_size, pages_per_seq))
  return pages_per_block


@functools.partial(jax.jit, static_argnames=(
    "bits", "sm_scale", "soft_cap", "interpret", "pages_per_block", "block_g", "num_splits",
    "schedule", "return_lse", "count_blocks", "num_warps", "num_stages"))
def _paged_impl(q, pools, block_tables, starts, lengths, *, bits, sm_scale, soft_cap, interpret,
                pages_per_block, block_g, num_splits, schedule, return_lse, count_blocks,
                num_warps, num_stages):
  batch, num_heads, head_dim = q.shape
  num_kv, num_pages, page_size, width = pools[0].shape
  group_size = page_size // pools[1].shape[2]
  vgroups = pools[4].shape[-1]
  pps = block_tables.shape[1]
  groups = num_heads // num_kv
  ppb = _pages_per_block(schedule, page_size, pps, head_dim, pages_per_block)
  dot_dtype = _common.dot_dtype(q.dtype, jnp.int8)
  block_g = _common.g_tile(schedule, groups, head_dim, dot_dtype, block_g)
  gp = _common.round_up(groups, block_g)
  tables, num_splits, bps = _paging.page_splits(block_tables, schedule,
                                                batch * num_kv * (gp // block_g), ppb,
                                                num_splits)
  padded = tables.shape[1]
  capacity = pps * page_size
  starts = jnp.clip(starts.astype(jnp.int32), 0, capacity)
  lengths = jnp.clip(lengths.astype(jnp.int32), 0, capacity)
  qg = _common.group_queries(q, num_kv, gp, dot_dtype)
  precision = lax.Precision.HIGHEST if dot_dtype == jnp.float32 else None
  kernel_kw = dict(bits=bits, group_size=group_size,
                   step=_common.Step(sm_scale, soft_cap, ppb, bps, precision))
  shapes = [(page_size, width), (page_size // group_size, head_dim),
            (page_size // group_size, head_dim), (page_size, width), (page_size, vgroups),
            (page_size, vgroups)]
  if schedule == "loop":
    scalar = pl.BlockSpec((None,), lambda b, h, g, j: (b,))
    in_specs = [scalar, scalar, pl.BlockSpec((None, padded), lambda b, h, g, j: (b, 0)),
                pl.BlockSpec((None, None, block_g, head_dim), lambda b, h, g, j: (b, h, g, 0))]
    in_specs += [_paging.pool_spec(num_pages, shape) for shape in shapes]
    kernel = functools.partial(_loop_kernel, **kernel_kw)
    operands = [starts, lengths, tables, qg] + list(pools)
  else:
    in_specs = [pl.BlockSpec((None, None, block_g, head_dim),
                             lambda b, h, g, sp, st, *_: (b, h, g, 0))]
    for shape in shapes:
      in_specs += [_paging.page_spec(j, shape, num_pages=num_pages, page_size=page_size,
                                     pages_per_block=ppb, blocks_per_split=bps,
                                     pages_padded=padded) for j in range(ppb)]
    kernel = functools.partial(_grid_kernel, count=count_blocks, **kernel_kw)
    # Page operand j of each pool is the whole pool; its index map picks the page.
    operands = [starts, lengths, tables.reshape(-1), qg] + [x for x in pools
                                                            for _ in range(ppb)]
  outs = _common.launch(kernel, operands, schedule=schedule,
                        grid=(batch, num_kv, gp // block_g, num_splits) + (
                            () if schedule == "loop" else (bps,)),
                        in_specs=in_specs, block_g=block_g, hv=head_dim, count=count_blocks,
                        num_scalar_prefetch=3, interpret=interpret, num_warps=num_warps,
                        num_stages=num_stages, name="kvattn_paged_kivi_decode_attention")
  return _common.finish(outs, num_heads, groups, q.dtype, return_lse, count_blocks, head_dim)


def paged_kivi_decode_attention(
    q: jax.Array,             # [B, N, H]
    k_codes: jax.Array,       # u8[K, P, page_size, H * bits / 8]
    k_scale: jax.Array,       # [K, P, page_size / g, H]
    k_zero: jax.Array,        # [K, P, page_size / g, H]
    v_codes: jax.Array,       # u8[K, P, page_size, H * bits / 8]
    v_scale: jax.Array,       # [K, P, page_size, H / vg]
    v_zero: jax.Array,        # [K, P, page_size, H / vg]
    block_tables: jax.Array,  # i32[B, pages_per_seq]
    starts: jax.Array,        # i32[B]
    lengths: jax.Array,       # i32[B]
    *,
    bits: int,
    pages_per_block: int | None = None,
    **options: Any,
):
  """`lowbit_decode.kivi_decode_attention` over a paged store (module doc); entries of
  `block_tables` outside `[0, P)` are unassigned (their slots must lie outside `[starts,
  lengths)`). `pages_per_block`: pages per key block (static); the other options as
  `kivi_decode_attention` (`count_blocks` counts pages read per row and KV head).

  Raises:
    ValueError, TypeError: shapes or dtypes that do not fit (naming the argument), an
      unfit schedule / platform / tunable.
  """
  if q.ndim != 3 or k_codes.ndim != 4 or block_tables.ndim != 2:
    raise ValueError(f"q must be [B, N, H], k_codes [K, P, page_size, W], block_tables [B, "
                     f"pages_per_seq]; got shapes {q.shape}, {k_codes.shape}, "
                     f"{block_tables.shape}")
  if block_tables.shape[0] != q.shape[0]:
    raise ValueError(f"block_tables must have one row per sequence ({q.shape[0]}); got "
                     f"{block_tables.shape[0]}")
  if not jnp.issubdtype(block_tables.dtype, jnp.integer):
    raise TypeError(f"block_tables must be integers; got {block_tables.dtype}")
  # The pools are checked as a dense store of P rows of one page each (same shape rules).
  probe = [jax.ShapeDtypeStruct((x.shape[1], x.shape[0]) + tuple(x.shape[2:]), x.dtype)
           if x.ndim == 4 else x for x in (k_codes, k_scale, k_zero, v_codes, v_scale, v_zero)]
  lowbit_decode.check_args(
      jax.ShapeDtypeStruct((k_codes.shape[1],) + q.shape[1:], q.dtype), *probe,
      jax.ShapeDtypeStruct((k_codes.shape[1],), starts.dtype),
      jax.ShapeDtypeStruct((k_codes.shape[1],), lengths.dtype), bits,
      options.get("sm_scale"), options.get("soft_cap"))
  for name, x in (("starts", starts), ("lengths", lengths)):
    if x.shape != (q.shape[0],):
      raise ValueError(f"{name} must be i32[B] with B = {q.shape[0]}; got shape {x.shape}")
  return paged_kivi_decode_attention_unchecked(
      q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, block_tables, starts, lengths,
      bits=bits, pages_per_block=pages_per_block, **options)


def paged_kivi_decode_attention_unchecked(q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero,
                                          block_tables, starts, lengths, *, bits, sm_scale=None,
                                          soft_cap=None, interpret=False, pages_per_block=None,
                                          block_g=None, num_splits=None, schedule=None,
                                          platform=None, num_warps=None, num_stages=None,
                                          return_lse=False, count_blocks=False):
  """`paged_kivi_decode_attention` without the argument checks (kvattn's paged KIVI
  cache); the schedule and tunables are still checked here."""
  schedule = _common.check_schedule(schedule, interpret, (
      ("pages_per_block", pages_per_block), ("block_g", block_g), ("num_splits", num_splits)),
      platform)
  page_size, head_dim = k_codes.shape[2], q.shape[-1]
  if schedule == "loop":
    reason = unsupported_reason(k_codes.shape, k_scale.shape, head_dim, platform="gpu")
    if reason is not None:
      raise ValueError(f"the paged KIVI kernel's \"loop\" schedule cannot take these shapes: "
                       f"{reason}")
  _pages_per_block(schedule, page_size, block_tables.shape[1], head_dim, pages_per_block)
  sm_scale = float(head_dim ** -0.5 if sm_scale is None else sm_scale)
  soft_cap = None if soft_cap is None else float(soft_cap)
  return _paged_impl(q, (k_codes, k_scale, k_zero, v_codes, v_scale, v_zero), block_tables,
                     starts, lengths, bits=bits, sm_scale=sm_scale, soft_cap=soft_cap,
                     interpret=interpret, pages_per_block=pages_per_block, block_g=block_g,
                     num_splits=num_splits, schedule=schedule, return_lse=return_lse,
                     count_blocks=count_blocks, num_warps=num_warps, num_stages=num_stages)


def unsupported_reason(k_codes_shape, k_scale_shape, head_dim: int, *,
                       platform: str | None = None) -> str | None:
  """Why the compiled kernel cannot run these pools, or None: `lowbit_decode`'s rules,
  and on GPU page_size a power of two."""
  page_size = k_codes_shape[2]
  return lowbit_decode.store_reason(platform, head_dim, page_size // max(1, k_scale_shape[2]),
                                    page_size)


def paged_kivi_decode_attention_reference(q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero,
                                          block_tables, starts, lengths, **options: Any):
  """Plain-jnp f32 `paged_kivi_decode_attention`: the pools gathered through the table
  into a dense store (unassigned pages read page 0, outside the range), then
  `lowbit_decode.kivi_decode_attention_reference`."""
  tables = jnp.clip(block_tables, 0, k_codes.shape[1] - 1)

  def dense(pool):  # [K, P, rows, X] -> [B, K, pages_per_seq * rows, X]
    x = pool[:, tables]  # [K, B, pps, rows, X]
    k, b, pps, rows, width = x.shape
    return jnp.moveaxis(x, 0, 1).reshape(b, k, pps * rows, width)

  return lowbit_decode.kivi_decode_attention_reference(
      q, *(dense(x) for x in (k_codes, k_scale, k_zero, v_codes, v_scale, v_zero)), starts,
      lengths, **options)
