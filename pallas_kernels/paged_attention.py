"""Fused paged decode attention: one new query token per sequence against a page pool.

PagedAttention (Kwon et al., SOSP 2023, §4.1) keeps every sequence's keys and
values in fixed-size pages of a shared pool, `k_pages, v_pages: [K, P,
page_size, H]`; `block_tables: i32[B, pages_per_seq]` maps logical page j of
sequence b (its slots `[j * page_size, (j + 1) * page_size)`) to a physical
page. This kernel computes the decode step's attention directly from the pool:

* GQA grouping (Ainslie et al. 2023): the G = N // K query heads sharing KV
  head k form one `[G, H]` tile (padded to what the hardware needs, the
  padding rows are zero queries whose outputs are dropped), so each page is
  read once per group.
* Online softmax over key blocks of `pages_per_block` pages (FlashAttention-2,
  Dao 2023, algorithm 1) with f32 statistics and accumulator for f32, bf16
  and f16 inputs.
* Split over pages (flash-decoding, Dao, Haziza, Massa, Sizov 2023): the
  logical pages are cut into `num_splits` partitions run in parallel; each
  writes a normalised partial output and its log-sum-exp, merged afterwards
  (`out = sum_j exp(lse_j - lse) out_j`).
* Length-aware: sequence b attends slots `[start_b, length_b)`, `start_b =
  max(0, length_b - window)`. Only the pages holding such slots are read;
  pages before the window, past the length and unassigned table entries are
  skipped, not masked, so work grows with the real length.
* Garbage never leaks: page ids are clamped into `[0, P)` before any read;
  logits of slots outside the range are replaced by -inf, their probabilities
  are exact zeros and their value rows are zeroed before the weighted sum (0 *
  NaN would be NaN), so NaN/inf/1e30 in the unused tail of a sequence's last
  page or in free pages cannot reach an output. A length-0 row gives zeros.

Two schedules of the same math, chosen by `schedule=`:

* `"loop"` (GPU, Triton lowering): grid `(B, K, G tiles, splits)`; each
  program holds its KV head's page pool as a pointer and runs a `fori_loop`
  over exactly the key blocks its split needs, gathering the block's
  `pages_per_block` pages through the block table (`k_ref[page_ids]`, as in
  jax/experimental/pallas/ops/gpu/paged_attention.py).
* `"grid"` (TPU, Mosaic): grid `(B, K, G tiles, splits, blocks per split)`
  with the starts, lengths and the flattened block table scalar-prefetched
  into SMEM. A key block is `pages_per_block` page operands whose index maps
  read the page id from the block table; the logical page is clamped into the
  needed range, so steps outside it repeat the previous page and the pipeline
  issues no DMA for them, and `pl.when` skips their compute.

Both run on CPU with `interpret=True` (what the tests do). Layout as in
`decode_attention.py`: kernels (refs only), launcher, public wrapper,
pure-jnp reference.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

try:  # The Triton lowering is deprecated in JAX 0.11 and may go away.
  from jax.experimental.pallas import triton as plgpu
except ImportError:  # pragma: no cover - depends on the JAX build.
  plgpu = None
try:
  from jax.experimental.pallas import tpu as pltpu
except ImportError:  # pragma: no cover - depends on the JAX build.
  pltpu = None

# Running max before any key is seen. Finite (unlike -inf) so that
# `exp(m_prev - m_next)` is 0 or 1, never NaN, even for a block whose every
# logit is masked; a masked logit is -inf and contributes exp(-inf) = 0.
_M_INIT = -0.7 * float(np.finfo(np.float32).max)
# TPU vregs are 8 sublanes x 128 lanes: per-row statistics are kept replicated
# over 128 lanes in VMEM scratch (as in Pallas TPU flash attention).
_TPU_LANES = 128
_SCHEDULES = ("loop", "grid")


# ----------------------------------------------------------------------------
# Kernel math shared by both schedules (values, not refs).
# ----------------------------------------------------------------------------


def _dot(a, b, *, trans_b: bool = False, precision=None):
  """f32-accumulated 2-D matmul `a @ b` (or `a @ b.T`); lowers on Triton and Mosaic."""
  dims = (((1,), (1 if trans_b else 0,)), ((), ()))
  return lax.dot_general(a, b, dims, precision=precision, preferred_element_type=jnp.float32)


def _logits(q, k, *, sm_scale: float, soft_cap: float | None, precision):
  """f32 `[Gb, bk]` logits `q . k * sm_scale`, soft-capped when asked."""
  s = _dot(q, k, trans_b=True, precision=precision) * sm_scale
  if soft_cap is not None:
    s = soft_cap * jnp.tanh(s / soft_cap)
  return s


def _online_softmax_step(m_prev, l_prev, acc_prev, s, v, slot0, start, length, precision):
  """One FlashAttention-2 update with a key block at slots `slot0 + [0, bk)`.

  Args:
    m_prev, l_prev: f32[Gb, 1] running max and running sum of exp.
    acc_prev: f32[Gb, Hv] running unnormalised output.
    s: f32[Gb, bk] logits of this block (unmasked).
    v: [bk, Hv] values of this block (may hold garbage outside the range).
    slot0: i32 scalar, logical slot of the block's first key.
    start, length: i32 scalars, the attended slot range `[start, length)`.

  Returns:
    `(m_next, l_next, acc_next)`.
  """
  bk = s.shape[1]
  cols = slot0 + lax.broadcasted_iota(jnp.int32, s.shape, 1)
  s = jnp.where((cols >= start) & (cols < length), s, -jnp.inf)
  m_next = jnp.maximum(m_prev, jnp.max(s, axis=1)[:, None])
  alpha = jnp.exp(m_prev - m_next)
  p = jnp.exp(s - m_next)  # exact 0 where masked
  l_next = alpha * l_prev + jnp.sum(p, axis=1)[:, None]
  rows = slot0 + lax.broadcasted_iota(jnp.int32, (bk, v.shape[1]), 0)
  v = jnp.where((rows >= start) & (rows < length), v, jnp.zeros((), v.dtype))
  pv = _dot(p.astype(v.dtype), v, precision=precision)
  return m_next, l_next, alpha * acc_prev + pv


def _finalize(m, l, acc):
  """Normalised f32 output and log-sum-exp (-inf where nothing was attended)."""
  nonempty = l > 0.0
  out = acc / jnp.where(nonempty, l, 1.0)
  lse = jnp.where(nonempty, m + jnp.log(jnp.where(nonempty, l, 1.0)), -jnp.inf)
  return out, lse


def _page_bounds(start, length, page_size: int):
  """First and one-past-last logical page holding a slot of `[start, length)`."""
  return lax.div(start, page_size), lax.div(length + (page_size - 1), page_size)


def _grid_logical_page(blk, j, lo, hi, pages_per_block: int, pages_padded: int):
  """Logical page that page operand j fetches at key block `blk` ("grid" schedule).

  Operand j holds pages `j, j + ppb, j + 2 ppb, ...` (ppb = pages_per_block).
  Its natural page `blk * ppb + j` is clamped into the needed pages of its own
  residue class inside `[lo, hi)`: steps before them fetch the first, steps
  after them repeat the last, so the pipeline, which skips the copy when an
  operand's block index repeats, reads each needed page once and nothing
  else (an operand with no needed page stays on one page throughout). All
  arithmetic is on non-negative scalars (`lax.rem` truncates), and the result
  stays inside the padded table.
  """
  ppb = pages_per_block
  first = lo + lax.rem(j - lax.rem(lo, ppb) + ppb, ppb)  # smallest page >= lo, = j mod ppb
  top = jnp.maximum(hi - 1, 0)
  last = top - lax.rem(lax.rem(top, ppb) - j + ppb, ppb)  # largest page <= hi - 1, = j mod ppb
  page = jnp.minimum(jnp.maximum(blk * ppb + j, first), jnp.maximum(last, first))
  return jnp.minimum(page, pages_padded - 1)


# ----------------------------------------------------------------------------
# Kernels.
# ----------------------------------------------------------------------------


def _loop_kernel(
    start_ref,   # i32[]              first attended slot of this sequence
    length_ref,  # i32[]              one past the last attended slot
    table_ref,   # i32[pages_padded]  this sequence's block-table row
    q_ref,       # [Gb, H]
    k_ref,       # [P, page_size, H]  the whole key pool of this KV head
    v_ref,       # [P, page_size, Hv]
    o_ref,       # f32[Gb, Hv]
    lse_ref,     # f32[Gb, 1]
    *cnt_ref,    # (i32[Gb, 1]) pages read, with count=True
    sm_scale: float,
    soft_cap: float | None,
    pages_per_block: int,
    blocks_per_split: int,
    precision,
):
  """"loop" schedule: one program per (b, k, G tile, split), fori_loop over key blocks."""
  split = pl.program_id(3)
  num_pages, page_size, head_dim = k_ref.shape
  block_k = pages_per_block * page_size
  start, length = start_ref[()], length_ref[()]
  lo = lax.div(start, block_k)
  hi = lax.div(length + (block_k - 1), block_k)
  first = jnp.maximum(lo, split * blocks_per_split)
  last = jnp.minimum(hi, (split + 1) * blocks_per_split)
  num_blocks = jnp.maximum(last - first, 0)
  q = q_ref[...]
  block_g = q.shape[0]
  hv = o_ref.shape[-1]

  def body(i, carry):
    m, l, acc = carry
    blk = first + i
    ids = table_ref[pl.ds(pl.multiple_of(blk * pages_per_block, pages_per_block),
                          pages_per_block)]
    # Unassigned entries (-1) and anything else out of range read page 0 or
    # P - 1 instead of faulting; those slots are past the length and masked.
    ids = jnp.clip(ids, 0, num_pages - 1)
    k = k_ref[ids].reshape(block_k, head_dim)
    v = v_ref[ids].reshape(block_k, hv)
    s = _logits(q, k, sm_scale=sm_scale, soft_cap=soft_cap, precision=precision)
    return _online_softmax_step(m, l, acc, s, v, blk * block_k, start, length, precision)

  init = (jnp.full((block_g, 1), _M_INIT, jnp.float32),
          jnp.zeros((block_g, 1), jnp.float32),
          jnp.zeros((block_g, hv), jnp.float32))
  m, l, acc = lax.fori_loop(0, num_blocks, body, init)
  out, lse = _finalize(m, l, acc)
  o_ref[...] = out
  lse_ref[...] = lse
  if cnt_ref:
    cnt_ref[0][...] = jnp.full(cnt_ref[0].shape, num_blocks * pages_per_block, jnp.int32)


def _grid_kernel(
    starts_ref,   # i32[B]              (SMEM) first attended slot
    lengths_ref,  # i32[B]              (SMEM) one past the last attended slot
    tables_ref,   # i32[B * pages_padded] (SMEM) block tables, flattened
    q_ref,        # [Gb, H]
    *refs,        # k page j of the block [page_size, H] for j < pages_per_block, then the
                  # v pages [page_size, Hv]; o f32[Gb, Hv], lse f32[Gb, 128],
                  # (count i32[Gb, 128]); scratch m, l f32[Gb, 128], acc f32[Gb, Hv], (count)
    sm_scale: float,
    soft_cap: float | None,
    pages_per_block: int,
    blocks_per_split: int,
    count: bool,
    precision,
):
  """"grid" schedule: key blocks on the last (sequential) grid axis."""
  del tables_ref  # read by the index maps only
  k_refs = refs[:pages_per_block]
  v_refs = refs[pages_per_block:2 * pages_per_block]
  rest = refs[2 * pages_per_block:]
  o_ref, lse_ref = rest[0], rest[1]
  cnt_ref = rest[2] if count else None
  m_sc, l_sc, acc_sc = rest[3:6] if count else rest[2:5]
  cnt_sc = rest[6] if count else None
  page_size = k_refs[0].shape[0]
  b, split, step = pl.program_id(0), pl.program_id(3), pl.program_id(4)
  start, length = starts_ref[b], lengths_ref[b]
  lo, hi = _page_bounds(start, length, page_size)
  blk = split * blocks_per_split + step

  @pl.when(step == 0)
  def _init():
    m_sc[...] = jnp.full(m_sc.shape, _M_INIT, jnp.float32)
    l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
    acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)
    if count:
      cnt_sc[...] = jnp.zeros(cnt_sc.shape, jnp.int32)

  for j in range(pages_per_block):  # static unroll over the block's pages
    page = blk * pages_per_block + j

    @pl.when((page >= lo) & (page < hi))
    def _compute():
      s = _logits(q_ref[...], k_refs[j][...], sm_scale=sm_scale, soft_cap=soft_cap,
                  precision=precision)
      m, l, acc = _online_softmax_step(m_sc[...][:, :1], l_sc[...][:, :1], acc_sc[...], s,
                                       v_refs[j][...], page * page_size, start, length,
                                       precision)
      m_sc[...] = jnp.broadcast_to(m, m_sc.shape)
      l_sc[...] = jnp.broadcast_to(l, l_sc.shape)
      acc_sc[...] = acc
      if count:
        cnt_sc[...] += 1

  @pl.when(step == blocks_per_split - 1)
  def _write():
    out, lse = _finalize(m_sc[...][:, :1], l_sc[...][:, :1], acc_sc[...])
    o_ref[...] = out
    lse_ref[...] = jnp.broadcast_to(lse, lse_ref.shape)
    if count:
      cnt_ref[...] = cnt_sc[...]


# ----------------------------------------------------------------------------
# Launcher.
# ----------------------------------------------------------------------------


def _next_pow2(x: int) -> int:
  return 1 << max(0, (x - 1).bit_length())


def _round_up(x: int, m: int) -> int:
  return -(-x // m) * m


def _is_pow2(x: int) -> bool:
  return x > 0 and not x & (x - 1)


def _platform() -> str:
  return jax.default_backend()


def _sublanes(dtype) -> int:
  """Rows of one TPU vreg for `dtype`: 8 for 32-bit, 16 for 16-bit types."""
  return 8 * max(1, 4 // jnp.dtype(dtype).itemsize)


def _tiles(schedule: str, num_groups: int, page_size: int, pages_per_seq: int, head_dim: int,
           value_dim: int, dtype, pages_per_block: int | None,
           block_g: int | None) -> tuple[int, int, int]:
  """Resolves (pages_per_block, block_g, padded G); ValueError if they do not fit.

  "loop" (Triton): every loaded tile has a power-of-two size and every dot
  dimension is >= 16, so page_size, H and Hv are powers of two, a key block
  (`pages_per_block * page_size` keys) has >= 16 keys and the G tile >= 16 rows.
  "grid" (Mosaic): a page is one (page_size, H) VMEM block, page_size a
  multiple of the dtype's sublane count; the G tile a multiple of it too.
  """
  if schedule == "loop":
    for what, d in (("page_size", page_size), ("head dim H", head_dim),
                    ("value width Hv", value_dim)):
      if not _is_pow2(d):
        raise ValueError(f"{what} must be a power of two for the \"loop\" schedule (Triton "
                         f"tiles); got {d}")
    min_ppb = max(1, 16 // page_size)
    if pages_per_block is None:
      # Aim at ~32 KiB of 16-bit K+V per block (as the dense kernel does): 64
      # keys at H = Hv = 128, 128 keys at 64; never fewer than 16 keys.
      target = max(16, min(128, _next_pow2(16384 // (head_dim + value_dim))))
      # No more pages than the table has (rounded up to a power of two).
      pages_per_block = max(min_ppb, min(target // page_size, _next_pow2(pages_per_seq)))
    elif not _is_pow2(pages_per_block) or pages_per_block < min_ppb:
      raise ValueError(
          f"pages_per_block must be a power of two with pages_per_block * page_size >= 16 "
          f"for the \"loop\" schedule; got {pages_per_block} (page_size {page_size})")
    g_min = max(16, _next_pow2(num_groups))
    if block_g is None:
      # A [Gb, Hv] f32 accumulator of at most 8192 elements (32 KiB) per program.
      block_g = min(g_min, max(16, 8192 // _next_pow2(value_dim)))
    elif block_g < 16 or not _is_pow2(block_g):
      raise ValueError(f"block_g must be a power of two >= 16 for the \"loop\" schedule; "
                       f"got {block_g}")
  else:
    granule = _sublanes(dtype)
    if page_size % granule:
      raise ValueError(
          f"page_size must be a multiple of {granule} for the \"grid\" schedule and dtype "
          f"{jnp.dtype(dtype).name} (TPU sublanes); got {page_size}")
    if pages_per_block is None:
      # ~512 keys per grid step amortise the ~0.35 us per-step overhead on TPU;
      # at most 8 page operands each for K and V.
      pages_per_block = max(1, min(8, 512 // page_size, pages_per_seq))
    if block_g is None:
      block_g = _round_up(num_groups, granule)
    elif block_g % granule:
      raise ValueError(f"block_g must be a multiple of {granule} for the \"grid\" schedule "
                       f"and dtype {jnp.dtype(dtype).name}; got {block_g}")
  return pages_per_block, block_g, _round_up(num_groups, block_g)


def _default_splits(schedule: str, programs: int, num_blocks: int) -> int:
  if schedule == "loop":
    # Aim for ~2 waves of programs on a 132-SM H100/H200 (plenty for fewer SMs).
    return max(1, min(num_blocks, -(-256 // programs)))
  # TPU: splits only help when B * K * G tiles cannot keep both cores busy.
  return max(1, min(num_blocks, 2 if programs < 2 else 1))


def _paged_partials(
    q,             # [B, K, Gp, H]   G padded to a multiple of block_g
    k_pages,       # [K, P, page_size, H]
    v_pages,       # [K, P, page_size, Hv]
    block_tables,  # i32[B, pages_padded]  padded to splits * blocks_per_split * ppb
    starts,        # i32[B]
    lengths,       # i32[B], already clamped to [0, pages_per_seq * page_size]
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
  test hook showing that pages outside the attended range are not read)."""
  batch, num_kv, gp, head_dim = q.shape
  _, num_pages, page_size, hv = v_pages.shape
  pages_padded = block_tables.shape[1]
  bps = pages_padded // (num_splits * pages_per_block)  # key blocks per split
  num_gt = gp // block_g
  precision = lax.Precision.HIGHEST if k_pages.dtype == jnp.float32 else None
  lanes = _TPU_LANES if schedule == "grid" else 1
  out_shape = [jax.ShapeDtypeStruct((batch, num_kv, num_splits, gp, hv), jnp.float32),
               jax.ShapeDtypeStruct((batch, num_kv, num_splits, gp, lanes), jnp.float32)]
  if count:
    out_shape.append(jax.ShapeDtypeStruct((batch, num_kv, num_splits, gp, lanes), jnp.int32))
  name = "kvattn_paged_decode_attention"

  if schedule == "loop":
    scalar = pl.BlockSpec((None,), lambda b, h, g, j: (b,))
    in_specs = [
        scalar, scalar,
        pl.BlockSpec((None, pages_padded), lambda b, h, g, j: (b, 0)),
        pl.BlockSpec((None, None, block_g, head_dim), lambda b, h, g, j: (b, h, g, 0)),
        pl.BlockSpec((None, num_pages, page_size, head_dim), lambda b, h, g, j: (h, 0, 0, 0)),
        pl.BlockSpec((None, num_pages, page_size, hv), lambda b, h, g, j: (h, 0, 0, 0)),
    ]
    row_spec = pl.BlockSpec((None, None, None, block_g, lanes),
                            lambda b, h, g, j: (b, h, j, g, 0))
    out_specs = [pl.BlockSpec((None, None, None, block_g, hv),
                              lambda b, h, g, j: (b, h, j, g, 0)), row_spec]
    out_specs += [row_spec] if count else []
    compiler_params = None
    if not interpret and plgpu is not None:
      compiler_params = plgpu.CompilerParams(num_warps=num_warps or 4,
                                             num_stages=num_stages or 2)
    outs = pl.pallas_call(
        functools.partial(_loop_kernel, sm_scale=sm_scale, soft_cap=soft_cap,
                          pages_per_block=pages_per_block, blocks_per_split=bps,
                          precision=precision),
        grid=(batch, num_kv, num_gt, num_splits),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=compiler_params,
        interpret=interpret,
        name=name,
    )(starts, lengths, block_tables, q, k_pages, v_pages)
  else:
    if pltpu is None:  # pragma: no cover
      raise NotImplementedError("the \"grid\" schedule needs jax.experimental.pallas.tpu")

    def page_spec(j, width):
      def index(b, h, g, sp, st, starts_ref, lengths_ref, tables_ref):
        lo, hi = _page_bounds(starts_ref[b], lengths_ref[b], page_size)
        page = _grid_logical_page(sp * bps + st, j, lo, hi, pages_per_block, pages_padded)
        phys = tables_ref[b * pages_padded + page]
        return h, jnp.minimum(jnp.maximum(phys, 0), num_pages - 1), 0, 0
      return pl.BlockSpec((None, None, page_size, width), index)

    in_specs = [pl.BlockSpec((None, None, block_g, head_dim),
                             lambda b, h, g, sp, st, *_: (b, h, g, 0))]
    in_specs += [page_spec(j, head_dim) for j in range(pages_per_block)]
    in_specs += [page_spec(j, hv) for j in range(pages_per_block)]
    row_spec = pl.BlockSpec((None, None, None, block_g, lanes),
                            lambda b, h, g, sp, st, *_: (b, h, sp, g, 0))
    out_specs = [pl.BlockSpec((None, None, None, block_g, hv),
                              lambda b, h, g, sp, st, *_: (b, h, sp, g, 0)), row_spec]
    out_specs += [row_spec] if count else []
    scratch = [pltpu.VMEM((block_g, _TPU_LANES), jnp.float32),
               pltpu.VMEM((block_g, _TPU_LANES), jnp.float32),
               pltpu.VMEM((block_g, hv), jnp.float32)]
    scratch += [pltpu.VMEM((block_g, _TPU_LANES), jnp.int32)] if count else []
    compiler_params = None
    if not interpret:
      compiler_params = pltpu.CompilerParams(
          dimension_semantics=("parallel", "parallel", "parallel", "parallel", "arbitrary"))
    outs = pl.pallas_call(
        functools.partial(_grid_kernel, sm_scale=sm_scale, soft_cap=soft_cap,
                          pages_per_block=pages_per_block, blocks_per_split=bps, count=count,
                          precision=precision),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=3,
            grid=(batch, num_kv, num_gt, num_splits, bps),
            in_specs=in_specs,
            out_specs=out_specs,
            scratch_shapes=scratch,
        ),
        out_shape=out_shape,
        compiler_params=compiler_params,
        interpret=interpret,
        name=name,
    )(starts, lengths, block_tables.reshape(-1), q,
      *([k_pages] * pages_per_block), *([v_pages] * pages_per_block))
  outs = list(outs)
  outs[1] = outs[1][..., 0]
  if count:
    outs[2] = outs[2][..., 0]
  return tuple(outs)


def _merge_splits(out, lse):
  """Flash-decoding merge of partials over axis 2.

  Args:
    out: f32[B, K, splits, Gp, Hv] normalised partial outputs (zeros when empty).
    lse: f32[B, K, splits, Gp] their log-sum-exp (-inf when empty).

  Returns:
    `(f32[B, K, Gp, Hv], f32[B, K, Gp])`; rows with nothing attended give
    zeros and -inf.
  """
  top = jnp.max(lse, axis=2, keepdims=True)
  top = jnp.where(jnp.isfinite(top), top, 0.0)
  w = jnp.exp(lse - top)  # 0 for empty partials, also when all are empty
  denom = jnp.sum(w, axis=2)
  merged = jnp.sum(w[..., None] * out, axis=2) / jnp.where(denom > 0, denom, 1.0)[..., None]
  total = jnp.where(denom > 0, top[:, :, 0] + jnp.log(jnp.where(denom > 0, denom, 1.0)),
                    -jnp.inf)
  return merged, total


# ----------------------------------------------------------------------------
# Argument checks (kept here: pallas_kernels imports only jax).
# ----------------------------------------------------------------------------


def _check_rank(name, x, rank, doc):
  if not hasattr(x, "ndim"):
    raise TypeError(f"{name} must be an array {doc}; got {type(x).__name__}")
  if x.ndim != rank:
    raise ValueError(f"{name} must have rank {rank} {doc}; got shape {tuple(x.shape)}")


def _check_dim(name, x, axis, expected, what):
  if x.shape[axis] != expected:
    raise ValueError(
        f"{name}.shape[{axis}] ({what}) must be {expected}; got shape {tuple(x.shape)}")


def _check_positive_int(name, value):
  if value is None:
    return
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
    raise TypeError(f"{name} must be a positive int; got {value!r}")
  if value <= 0:
    raise ValueError(f"{name} must be a positive int; got {value}")


def _check_positive_float(name, value):
  if value is None:
    return
  if isinstance(value, bool) or not isinstance(value, (int, float, np.number)):
    raise TypeError(f"{name} must be a positive float; got {value!r}")
  if not (value > 0 and math.isfinite(value)):
    raise ValueError(f"{name} must be a positive finite float; got {value}")


def _check_args(q, k_pages, v_pages, block_tables, lengths):
  _check_rank("q", q, 3, "[B, N, H]")
  _check_rank("k_pages", k_pages, 4, "[K, P, page_size, H]")
  _check_rank("v_pages", v_pages, 4, "[K, P, page_size, Hv]")
  _check_rank("block_tables", block_tables, 2, "[B, pages_per_seq]")
  _check_rank("lengths", lengths, 1, "[B]")
  for name, x in (("q", q), ("k_pages", k_pages), ("v_pages", v_pages)):
    if not jnp.issubdtype(x.dtype, jnp.floating):
      raise TypeError(f"{name} must have a floating dtype; got {x.dtype}")
  for name, x in (("block_tables", block_tables), ("lengths", lengths)):
    if not jnp.issubdtype(x.dtype, jnp.integer):
      raise TypeError(f"{name} must have an integer dtype; got {x.dtype}")
  if k_pages.dtype != v_pages.dtype:
    raise TypeError(f"k_pages and v_pages must share one dtype; got k_pages={k_pages.dtype}, "
                    f"v_pages={v_pages.dtype}")
  batch, num_heads, _ = q.shape
  num_kv = k_pages.shape[0]
  _check_dim("q", q, 2, k_pages.shape[3], "head dim H, from k_pages")
  for axis, what in ((0, "KV heads K"), (1, "pages P"), (2, "page_size")):
    _check_dim("v_pages", v_pages, axis, k_pages.shape[axis], f"{what}, from k_pages")
  _check_dim("block_tables", block_tables, 0, batch, "batch B, from q")
  _check_dim("lengths", lengths, 0, batch, "batch B, from q")
  if num_heads % num_kv:
    raise ValueError(f"num_heads must be divisible by num_kv_heads; got {num_heads} and "
                     f"{num_kv}")


def _check_schedule(schedule, interpret):
  if schedule is not None and schedule not in _SCHEDULES:
    raise ValueError(f"schedule must be one of {_SCHEDULES} or None; got {schedule!r}")
  schedule = schedule or ("grid" if _platform() == "tpu" else "loop")
  if not interpret:
    platform = _platform()
    wanted = {"gpu": "loop", "cuda": "loop", "rocm": "loop", "tpu": "grid"}.get(platform)
    if wanted is None:
      raise ValueError(f"interpret=False needs a GPU or TPU; the default backend is "
                       f"{platform!r} (pass interpret=True to run on CPU)")
    if schedule != wanted:
      raise ValueError(f"schedule {schedule!r} does not compile on {platform}; use "
                       f"{wanted!r} (or interpret=True)")
  return schedule


# ----------------------------------------------------------------------------
# Public wrappers.
# ----------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=(
    "sm_scale", "window", "soft_cap", "interpret", "pages_per_block", "block_g", "num_splits",
    "schedule", "return_lse", "count_pages", "num_warps", "num_stages"))
def _paged_impl(q, k_pages, v_pages, block_tables, lengths, *, sm_scale, window, soft_cap,
                interpret, pages_per_block, block_g, num_splits, schedule, return_lse,
                count_pages, num_warps, num_stages):
  batch, num_heads, head_dim = q.shape
  num_kv, _, page_size, hv = v_pages.shape
  pages_per_seq = block_tables.shape[1]
  groups = num_heads // num_kv
  pages_per_block, block_g, gp = _tiles(schedule, groups, page_size, pages_per_seq, head_dim,
                                        hv, k_pages.dtype, pages_per_block, block_g)
  num_blocks = -(-pages_per_seq // pages_per_block)
  if num_splits is None:
    num_splits = _default_splits(schedule, batch * num_kv * (gp // block_g), num_blocks)
  num_splits = min(num_splits, num_blocks)
  blocks_per_split = -(-num_blocks // num_splits)
  pages_padded = num_splits * blocks_per_split * pages_per_block
  # Padding entries are never inside [start, length): they are only ever read
  # (clamped) by a block straddling the end of the table, and masked.
  tables = jnp.pad(block_tables.astype(jnp.int32), ((0, 0), (0, pages_padded - pages_per_seq)),
                   constant_values=-1)
  # A sticky overflow under jit may leave lengths > capacity: clamp, never
  # read past the table.
  lengths = jnp.clip(lengths.astype(jnp.int32), 0, pages_per_seq * page_size)
  starts = jnp.zeros_like(lengths) if window is None else jnp.maximum(lengths - window, 0)
  qg = q.astype(k_pages.dtype).reshape(batch, num_kv, groups, head_dim)
  qg = jnp.pad(qg, ((0, 0), (0, 0), (0, gp - groups), (0, 0)))
  outs = _paged_partials(
      qg, k_pages, v_pages, tables, starts, lengths, sm_scale=sm_scale, soft_cap=soft_cap,
      pages_per_block=pages_per_block, block_g=block_g, num_splits=num_splits,
      schedule=schedule, interpret=interpret, count=count_pages, num_warps=num_warps,
      num_stages=num_stages)
  out, lse = _merge_splits(outs[0], outs[1])
  out = out[:, :, :groups].reshape(batch, num_heads, hv).astype(q.dtype)
  lse = lse[:, :, :groups].reshape(batch, num_heads)
  result = (out, lse) if return_lse else out
  if count_pages:
    return result, jnp.sum(outs[2][:, :, :, 0], axis=2)  # [B, K], from G tile 0
  return result


def paged_decode_attention(
    q: jax.Array,             # [B, N, H]
    k_pages: jax.Array,       # [K, P, page_size, H]
    v_pages: jax.Array,       # [K, P, page_size, Hv]
    block_tables: jax.Array,  # i32[B, pages_per_seq]
    lengths: jax.Array,       # i32[B]
    *,
    sm_scale: float | None = None,
    window: int | None = None,
    soft_cap: float | None = None,
    interpret: Any = False,
    pages_per_block: int | None = None,
    block_g: int | None = None,
    num_splits: int | None = None,
    schedule: str | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    return_lse: bool = False,
    count_pages: bool = False,
):
  """Fused decode attention of one new token per sequence against a paged cache.

  Sequence b's slot s lives in slot `s % page_size` of page
  `block_tables[b, s // page_size]`. Its query sits at slot `lengths[b] - 1`
  (its key already written) and attends slots `[max(0, lengths[b] - window),
  lengths[b])`; query head n reads KV head `n // (N // K)`. Computes
  softmax(q k^T * sm_scale) v (Vaswani et al. 2017, eq. 1) page by page
  (PagedAttention, Kwon et al. 2023) with an online softmax
  (FlashAttention-2) over blocks of pages split into parallel partitions
  merged by their log-sum-exp (flash-decoding). Pages outside the attended
  range are neither read nor computed.

  Args:
    q: `[B, N, H]` queries (cast to the pages' dtype for the dot products).
    k_pages: `[K, P, page_size, H]` key page pool; slots outside a sequence's
      attended range and pages no sequence uses may hold anything.
    v_pages: `[K, P, page_size, Hv]` value page pool, same dtype as k_pages.
    block_tables: `i32[B, pages_per_seq]`; entries outside `[0, P)` (e.g. -1
      for "no page") are allowed at logical pages a sequence does not use.
    lengths: `i32[B]` valid slots per sequence, clamped to
      `[0, pages_per_seq * page_size]` (a sticky overflow under jit may exceed it).
    sm_scale: logit scale, default `1/sqrt(H)`.
    window: sliding-window size W in tokens, or None.
    soft_cap: logit soft cap (`cap * tanh(s / cap)`), or None.
    interpret: run with the Pallas interpreter (True, or a
      `pltpu.InterpretParams` for TPU-faithful interpretation of "grid").
    pages_per_block: pages per key block (static). Default: "loop" ~64-128
      keys per block; "grid" min(8, 512 // page_size).
    block_g: query heads per tile (static); G is padded to a multiple of it.
    num_splits: page-axis partitions run in parallel (static); default fills
      the device for small B*K. Results do not depend on it.
    schedule: `"loop"` (Triton GPU) or `"grid"` (Mosaic TPU); default by
      backend ("loop" on CPU). Compiled runs need the backend's schedule.
    num_warps, num_stages: Triton compiler options ("loop", compiled only).
    return_lse: also return the `f32[B, N]` log-sum-exp of the scaled logits
      (natural log; -inf for length-0 rows).
    count_pages: test hook; also return `i32[B, K]`, the pages the kernel read
      per sequence and KV head ("loop" reads whole blocks, "grid" single pages).

  Returns:
    `[B, N, Hv]` in q's dtype (f32 accumulation); length-0 rows are zeros.
    With `return_lse`, `(out, lse)`; with `count_pages`, `(result, counts)`.

  Raises:
    ValueError: shapes that do not fit; a page size, head dim or tunable the
      schedule cannot tile; `interpret=False` without a GPU/TPU.
    TypeError: non-float q/pages, k/v dtype mismatch, non-integer tables/lengths.
  """
  _check_args(q, k_pages, v_pages, block_tables, lengths)
  _check_positive_float("sm_scale", sm_scale)
  _check_positive_float("soft_cap", soft_cap)
  for name, value in (("window", window), ("pages_per_block", pages_per_block),
                      ("block_g", block_g), ("num_splits", num_splits)):
    _check_positive_int(name, value)
  schedule = _check_schedule(schedule, interpret)
  head_dim = q.shape[2]
  # Resolve tiles now so an unfit page size or tunable raises before tracing.
  _tiles(schedule, q.shape[1] // k_pages.shape[0], k_pages.shape[2], block_tables.shape[1],
         head_dim, v_pages.shape[3], k_pages.dtype, pages_per_block, block_g)
  sm_scale = float(head_dim ** -0.5 if sm_scale is None else sm_scale)
  soft_cap = None if soft_cap is None else float(soft_cap)
  return _paged_impl(q, k_pages, v_pages, block_tables, lengths, sm_scale=sm_scale,
                     window=window, soft_cap=soft_cap, interpret=interpret,
                     pages_per_block=pages_per_block, block_g=block_g, num_splits=num_splits,
                     schedule=schedule, return_lse=return_lse, count_pages=count_pages,
                     num_warps=num_warps, num_stages=num_stages)


def supported(q_shape, k_pages_shape, v_pages_shape, dtype, *,
              platform: str | None = None) -> str | None:
  """Why the compiled kernel cannot run these shapes, or None if it can.

  Used by kvattn's dispatcher to fall back to the XLA path.
  `k_pages_shape` is `[K, P, page_size, H]`, `v_pages_shape` `[K, P,
  page_size, Hv]`.
  """
  del q_shape
  platform = platform or _platform()
  dtype = jnp.dtype(dtype)
  page_size, head_dim = k_pages_shape[2], k_pages_shape[3]
  hv = v_pages_shape[3]
  if platform in ("gpu", "cuda", "rocm"):
    for what, d in (("page_size", page_size), ("head dim H", head_dim), ("value width Hv", hv)):
      if not _is_pow2(d):
        return f"{what}={d} is not a power of two (Triton tiles)"
    for what, d in (("head dim H", head_dim), ("value width Hv", hv)):
      if d < 16:
        return f"{what}={d} is below 16 (Triton dot)"
    if dtype not in (jnp.float32, jnp.bfloat16, jnp.float16):
      return f"dtype {dtype} is not f32/bf16/f16"
    return None
  if platform == "tpu":
    if dtype not in (jnp.float32, jnp.bfloat16):
      return f"dtype {dtype} is not f32/bf16 on TPU"
    for what, d in (("head dim H", head_dim), ("value width Hv", hv)):
      if d % 64:
        return f"{what}={d} is not a multiple of 64 (TPU lanes)"
    if page_size % _sublanes(dtype):
      return f"page_size={page_size} is not a multiple of {_sublanes(dtype)}"
    return None
  return f"no compiled Pallas backend on {platform!r}"


# ----------------------------------------------------------------------------
# Reference (plain jnp, f32).
# ----------------------------------------------------------------------------


def paged_decode_attention_reference(
    q: jax.Array,             # [B, N, H]
    k_pages: jax.Array,       # [K, P, page_size, H]
    v_pages: jax.Array,       # [K, P, page_size, Hv]
    block_tables: jax.Array,  # i32[B, pages_per_seq]
    lengths: jax.Array,       # i32[B]
    *,
    sm_scale: float | None = None,
    window: int | None = None,
    soft_cap: float | None = None,
    return_lse: bool = False,
    **unused_tunables: Any,
):
  """Plain-jnp f32 `paged_decode_attention` (same signature; tunables ignored).

  Gathers every sequence's pages into a dense `[B, K, S, H]` view
  (S = pages_per_seq * page_size, page ids clamped into `[0, P)`),
  materialises the `[B, N, S]` logits, masks slots outside `[max(0, L - W),
  L)` by replacement and zeroes masked value rows, so garbage cannot leak.
  Returns `[B, N, Hv]` in q's dtype (and `f32[B, N]` lse with `return_lse`).
  """
  del unused_tunables
  f32, hi = jnp.float32, lax.Precision.HIGHEST
  batch, num_heads, head_dim = q.shape
  num_kv, num_pages, page_size, hv = v_pages.shape
  pages_per_seq = block_tables.shape[1]
  capacity = pages_per_seq * page_size
  sm_scale = head_dim ** -0.5 if sm_scale is None else sm_scale
  ids = jnp.clip(block_tables, 0, num_pages - 1)

  def dense(pages):  # [K, P, ps, X] -> f32[B, N, S, X], KV heads repeated per group
    x = jnp.take(pages, ids, axis=1).astype(f32)  # [K, B, pages_per_seq, ps, X]
    x = jnp.moveaxis(x, 0, 1).reshape(batch, num_kv, capacity, pages.shape[-1])
    return jnp.repeat(x, num_heads // num_kv, axis=1)

  kh, vh = dense(k_pages), dense(v_pages)
  logits = jnp.einsum("BNH,BNSH->BNS", q.astype(f32), kh, precision=hi) * sm_scale
  if soft_cap is not None:
    logits = soft_cap * jnp.tanh(logits / soft_cap)
  lengths = jnp.clip(jnp.asarray(lengths).astype(jnp.int32), 0, capacity)
  starts = jnp.zeros_like(lengths) if window is None else jnp.maximum(lengths - window, 0)
  slots = jnp.arange(capacity)
  mask = (slots[None] >= starts[:, None]) & (slots[None] < lengths[:, None])  # [B, S]
  logits = jnp.where(mask[:, None], logits, -jnp.inf)
  top = jnp.max(logits, axis=-1, keepdims=True)
  top = jnp.where(jnp.isfinite(top), top, 0.0)
  probs = jnp.where(mask[:, None], jnp.exp(logits - top), 0.0)
  denom = jnp.sum(probs, axis=-1)
  vh = jnp.where(mask[:, None, :, None], vh, 0.0)
  out = jnp.einsum("BNS,BNSV->BNV", probs, vh, precision=hi)
  out = out / jnp.where(denom > 0, denom, 1.0)[..., None]
  lse = jnp.where(denom > 0, top[..., 0] + jnp.log(jnp.where(denom > 0, denom, 1.0)), -jnp.inf)
  out = out.astype(q.dtype)
  return (out, lse) if return_lse else out
