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
* Quantized pools (int8, float8_e4m3fn, float8_e5m2 values with scale pools
  `k_scale, v_scale: f32[K, P, page_size]`, `k[s] = k_q[s] * k_scale[s]`, as
  `PagedKVCache` stores them): the scale pages travel with the value pages
  (same gather, same index maps) and each block is dequantized in the kernel
  right after it is loaded, exactly as in `dense_decode.py` (`k_q.astype(f32)
  * scale`, cast to the dot's dtype: f32, or q's dtype when q is bf16/f16).
  The pool is read in its 1-byte form; garbage scales of unused slots and free
  pages are masked like garbage values.

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

Both run on CPU with `interpret=True` (what the tests do); as in
`dense_decode.py`, the schedule follows the platform the call is lowered for
(`platform=`), so a CPU host can lower the compiled kernel for "cuda" or "tpu".
Layout as in `dense_decode.py`: kernels (refs only), launcher, public wrapper,
pure-jnp reference; the math both kernels share is in `_common.py`, the
attended range and argument checks in `attention_common.py`.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import _common
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
    sm_scale: float,
    soft_cap: float | None,
    pages_per_block: int,
    blocks_per_split: int,
    precision,
):
  """"loop" schedule: one program per (b, k, G tile, split), fori_loop over key blocks."""
  ks_ref, vs_ref = refs[:2] if scaled else (None, None)
  o_ref, lse_ref, *cnt_ref = refs[2:] if scaled else refs
  split = pl.program_id(3)
  num_pages, page_size, _ = k_ref.shape
  block_k = pages_per_block * page_size
  start, length = start_ref[()], length_ref[()]
  first, num_blocks = _common.split_blocks(split, start, length, block_k, blocks_per_split)
  q = q_ref[...]

  def gather(ref, scale_ref, ids):  # [block_k, X], dequantized when quantized
    x = _common.gather_pages(ref, ids, block_k)
    if scale_ref is None:
      return x
    return _common.dequant(x, _common.gather_pages(scale_ref, ids, block_k), q.dtype)

  def body(i, carry):
    m, l, acc = carry
    blk = first + i
    ids = _common.page_ids(table_ref, blk, pages_per_block, num_pages)
    s = _common.logits(q, gather(k_ref, ks_ref, ids), sm_scale=sm_scale, soft_cap=soft_cap,
                       precision=precision)
    return _common.online_softmax_step(m, l, acc, s, gather(v_ref, vs_ref, ids),
                                       blk * block_k, start, length, precision)

  _common.loop_blocks(num_blocks, body, o_ref, lse_ref)
  if count:
    cnt_ref[0][...] = jnp.full(cnt_ref[0].shape, num_blocks * pages_per_block, jnp.int32)


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
    sm_scale: float,
    soft_cap: float | None,
    pages_per_block: int,
    blocks_per_split: int,
    precision,
):
  """"grid" schedule: key blocks on the last (sequential) grid axis."""
  del tables_ref  # read by the index maps only
  ppb = pages_per_block
  k_refs, v_refs = refs[:ppb], refs[ppb:2 * ppb]
  ks_refs, vs_refs = ((refs[2 * ppb:3 * ppb], refs[3 * ppb:4 * ppb]) if scaled
                      else ((None,) * ppb, (None,) * ppb))
  o_ref, lse_ref, cnt_ref, m_sc, l_sc, acc_sc, cnt_sc = _common.grid_refs(
      refs[(4 if scaled else 2) * ppb:], count)
  page_size = k_refs[0].shape[0]
  b, split, step = pl.program_id(0), pl.program_id(3), pl.program_id(4)
  start, length = starts_ref[b], lengths_ref[b]
  lo, hi = _common.block_bounds(start, length, page_size)
  _common.grid_init(step, m_sc, l_sc, acc_sc, cnt_sc)

  def compute(j, page):
    q = q_ref[...]

    def load(ref, scale_ref):  # [page_size, X] page, dequantized when quantized
      return _common.dequant(ref[...], None if scale_ref is None else scale_ref[...], q.dtype)

    s = _common.logits(q, load(k_refs[j], ks_refs[j]), sm_scale=sm_scale, soft_cap=soft_cap,
                       precision=precision)
    _common.grid_update(m_sc, l_sc, acc_sc, cnt_sc, s, load(v_refs[j], vs_refs[j]), page,
                        page_size, start, length, precision)

  _common.grid_pages(ppb, split * blocks_per_split + step, lo, hi, compute)
  _common.grid_write(step, blocks_per_split, m_sc, l_sc, acc_sc, cnt_sc, o_ref, lse_ref,
                     cnt_ref)


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
  kernel_kw = dict(scaled=scaled, count=count, sm_scale=sm_scale, soft_cap=soft_cap,
                   pages_per_block=pages_per_block, blocks_per_split=bps, precision=precision)

  if schedule == "loop":
    scalar = pl.BlockSpec((None,), lambda b, h, g, j: (b,))
    in_specs = [
        scalar, scalar,
        pl.BlockSpec((None, pages_padded), lambda b, h, g, j: (b, 0)),
        pl.BlockSpec((None, None, block_g, head_dim), lambda b, h, g, j: (b, h, g, 0)),
    ] + [_common.pool_spec(num_pages, (page_size, w)) for w in [head_dim, hv] + [1] * len(
        scale_pools)]
    kernel, grid = _loop_kernel, (batch, num_kv, num_gt, num_splits)
    operands = [starts, lengths, block_tables, q, k_pages, v_pages] + scale_pools
  else:
    in_specs = [pl.BlockSpec((None, None, block_g, head_dim),
                             lambda b, h, g, sp, st, *_: (b, h, g, 0))]
    for width in [head_dim, hv] + [1 for _ in scale_pools]:
      in_specs += [_common.page_spec(j, (page_size, width), num_pages=num_pages,
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
  tables, num_splits, _ = _common.page_splits(block_tables, schedule,
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
    sm_scale: float | None = None,
    window: int | None = None,
    soft_cap: float | None = None,
    k_scale: jax.Array | None = None,  # f32[K, P, page_size]
    v_scale: jax.Array | None = None,  # f32[K, P, page_size]
    interpret: Any = False,
    pages_per_block: int | None = None,
    block_g: int | None = None,
    num_splits: int | None = None,
    schedule: str | None = None,
    platform: str | None = None,
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
    q: `[B, N, H]` queries (cast to the pages' dtype for the dot products; for
      a quantized pool kept in bf16/f16, or f32 otherwise).
    k_pages: `[K, P, page_size, H]` key page pool; slots outside a sequence's
      attended range and pages no sequence uses may hold anything. Float, or
      int8 / float8_e4m3fn / float8_e5m2 with `k_scale`.
    v_pages: `[K, P, page_size, Hv]` value page pool, same dtype as k_pages.
    block_tables: `i32[B, pages_per_seq]`; entries outside `[0, P)` (e.g. -1
      for "no page") are allowed at logical pages a sequence does not use.
    lengths: `i32[B]` valid slots per sequence, clamped to
      `[0, pages_per_seq * page_size]` (a sticky overflow under jit may exceed it).
    sm_scale: logit scale, default `1/sqrt(H)`.
    window: sliding-window size W in tokens, or None.
    soft_cap: logit soft cap (`cap * tanh(s / cap)`), or None.
    k_scale, v_scale: `f32[K, P, page_size]` scale pools of quantized page
      pools (`k_pages[h, p, s] * k_scale[h, p, s]`; `PagedKVCache.k_scale_pages`,
      `v_scale_pages`); each page is dequantized in the kernel after it is
      loaded. None for float pools.
    interpret: run with the Pallas interpreter (True, or a
      `pltpu.InterpretParams` for TPU-faithful interpretation of "grid").
    pages_per_block: pages per key block (static). Default: "loop" ~64-128
      keys per block; "grid" min(8, 512 // page_size).
    block_g: query heads per tile (static); G is padded to a multiple of it.
    num_splits: page-axis partitions run in parallel (static); default fills
      the device for small B*K. Results do not depend on it.
    schedule: `"loop"` (Triton GPU) or `"grid"` (Mosaic TPU); default by
      `platform` ("loop" on CPU). Compiled runs need the platform's schedule.
    platform: the platform the call is lowered for (static): "cuda"/"gpu",
      "rocm", "tpu" or "cpu"; default the JAX default backend. It picks the
      default schedule and the compiled one `interpret=False` needs, so a CPU
      host can lower the compiled kernel for a device it does not have
      (`jax.jit(f).trace(...).lower(lowering_platforms=("cuda",))`, as
      tests/pallas_kernels/test_lowering.py does) but not run it.
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
      schedule cannot tile; `interpret=False` for a `platform` that is
      not a GPU/TPU, or an unknown `platform`.
    TypeError: non-float q/pages, k/v dtype mismatch, non-integer tables/lengths,
      a quantized pool without its scales or scales for a float pool.
  """
  lengths = common.check_paged_args(q, k_pages, v_pages, block_tables, lengths, window=window,
                                    soft_cap=soft_cap, sm_scale=sm_scale, k_scale=k_scale,
                                    v_scale=v_scale)
  return paged_decode_attention_unchecked(
      q, k_pages, v_pages, block_tables, lengths, sm_scale=sm_scale, window=window,
      soft_cap=soft_cap, k_scale=k_scale, v_scale=v_scale, interpret=interpret,
      pages_per_block=pages_per_block, block_g=block_g, num_splits=num_splits,
      schedule=schedule, platform=platform, num_warps=num_warps, num_stages=num_stages,
      return_lse=return_lse, count_pages=count_pages)


def paged_decode_attention_unchecked(q, k_pages, v_pages, block_tables, lengths, *,
                                     sm_scale=None, window=None, soft_cap=None, k_scale=None,
                                     v_scale=None, interpret=False, pages_per_block=None,
                                     block_g=None, num_splits=None, schedule=None,
                                     platform=None, num_warps=None, num_stages=None,
                                     return_lse=False, count_pages=False):
  """`paged_decode_attention` without the argument checks, for callers that ran them
  (`attention_common.check_paged_args`; kvattn's dispatch point). The tunables are
  still checked: they are resolved here."""
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
    k_scale: jax.Array | None = None,  # f32[K, P, page_size]
    v_scale: jax.Array | None = None,  # f32[K, P, page_size]
    return_lse: bool = False,
    **unused_tunables: Any,
):
  """Plain-jnp f32 `paged_decode_attention` (same signature; tunables ignored).

  Gathers every sequence's pages (and, for a quantized pool, its scale pages)
  into a dense `[B, K, S, H]` view (S = pages_per_seq * page_size, page ids
  clamped into `[0, P)`), dequantizes it up front (`k * k_scale[..., None]`
  in f32), materialises the `[B, N, S]` logits, masks slots outside
  `[max(0, L - W), L)` by replacement and zeroes masked value rows, so
  garbage cannot leak. Returns `[B, N, Hv]` in q's dtype (and `f32[B, N]`
  lse with `return_lse`).
  """
  del unused_tunables
  ids = jnp.clip(block_tables, 0, k_pages.shape[1] - 1)

  def dense(pool):  # [K, P, page_size, ...] -> [B, K, S, ...]
    x = jnp.moveaxis(jnp.take(pool, ids, axis=1), 0, 1)  # [B, K, pages_per_seq, ps, ...]
    return x.reshape(x.shape[:2] + (-1,) + x.shape[4:])

  return dense_decode.decode_attention_reference(
      q, dense(k_pages), dense(v_pages), lengths, sm_scale=sm_scale, window=window,
      soft_cap=soft_cap, k_scale=None if k_scale is None else dense(k_scale),
      v_scale=None if v_scale is None else dense(v_scale), return_lse=return_lse)
