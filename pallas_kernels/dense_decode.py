"""Fused decode attention: one new query token per sequence against a dense KV cache.

One kernel serves MHA, GQA, MQA and MLA's absorbed decode:

* GQA grouping (Ainslie et al. 2023): the G = N // K query heads that share KV
  head k are one `[G, H]` tile, so every K/V block is read once per group.
  The tile is padded to what the hardware needs (a power of two >= 16 for
  Triton dots, a multiple of the sublane count on TPU) and the padding rows
  are zero queries whose outputs are dropped.
* Online softmax over key blocks (FlashAttention-2, Dao 2023, algorithm 1)
  with f32 statistics and accumulator for f32/bf16/f16 inputs.
* Split-K / flash-decoding (Dao, Haziza, Massa, Sizov 2023): the key axis is
  cut into `num_splits` partitions that run in parallel; each writes a
  normalised partial output and its log-sum-exp, merged afterwards with
  `out = sum_j exp(lse_j - lse) * out_j`, `lse = logsumexp_j lse_j`.
* Length-aware: sequence b attends slots `[start_b, length_b)` with
  `start_b = max(0, length_b - window)`. Key blocks outside that range are
  skipped, not masked, so work grows with the real length, not the capacity.
* The key may come in two parts with separate queries, logits
  `q1 . k1 + q2 . k2`, and the value may be `k1` itself. MLA's absorbed decode
  (DeepSeek-V2, appendix C) is then `k1 = c_kv`, `k2 = k_rope`, `v = c_kv`:
  every cache byte is read once and nothing cache-sized is concatenated.
* Garbage in unused slots (NaN, inf, 1e30) never reaches an output: masked
  logits are replaced (not added to), masked probabilities are exact zeros and
  value rows of masked slots are zeroed before the probability-weighted sum
  (0 * NaN would be NaN). A length-0 row gives zeros and log-sum-exp -inf.
* Quantized caches (int8, float8_e4m3fn, float8_e5m2 values with one f32
  scale per slot: `k[s] = k_q[s] * k_scale[s]`): each key/value block is
  dequantized in the kernel right after it is loaded (`k_q.astype(f32) *
  scale`, then cast to the dot's dtype: f32, or q's dtype when q is
  bf16/f16), so the cache is read in its 1-byte form and no dequantized copy
  of it exists outside the kernel. Scales are passed as `[B, K, S, 1]` so a
  block's scales are a `[bk, 1]` column that broadcasts over the block's
  width on every backend. Garbage scales of unused slots are masked like
  garbage values.

Two schedules of the same math, chosen by `schedule=`:

* `"loop"` (GPU, Triton lowering): grid `(B, K, G tiles, splits)`; each
  program runs a `fori_loop` over exactly the key blocks its split needs
  (bounds computed from `lengths`), loading blocks with dynamic slices.
* `"grid"` (TPU, Mosaic): grid `(B, K, G tiles, splits, blocks per split)`
  with `lengths`/window starts scalar-prefetched into SMEM. The K/V index map
  clamps the block index into the needed range, so steps outside it repeat
  the previous block index and the pipeline issues no DMA for them, and
  `pl.when` skips their compute.

Both run on CPU with `interpret=True` (what the tests do). The schedule follows
the platform the call is lowered for (`platform=`, default the JAX default
backend), so a CPU host can also lower the compiled kernel for "cuda" or "tpu"
(tests/pallas_kernels/test_lowering.py).

Layout follows jax/experimental/pallas/ops/gpu/decode_attention.py: kernels
(refs only), then the launcher, then the public jitted wrappers, then the
pure-jnp references. What this kernel shares with the paged one (the
online-softmax math, the schedules' launch configuration) is in `_common.py`;
the attended range, constants and argument checks of every attention path are
in `attention_common.py`.
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
from pallas_kernels.attention_common import QUANT_DTYPES  # noqa: F401  (a public name)

# ----------------------------------------------------------------------------
# Kernels. The online-softmax math, the "loop" block walk and the "grid"
# scratch handling are shared with the paged kernel (`_common`).
# ----------------------------------------------------------------------------


def _split_refs(refs, has_rope: bool, has_v: bool, count: bool, scaled: bool):
  """Splits the kernel's refs; the scale refs are `(s1, s2, sv)` (None when absent)."""
  refs = list(refs)
  q1_ref = refs.pop(0)
  q2_ref = refs.pop(0) if has_rope else None
  k1_ref = refs.pop(0)
  k2_ref = refs.pop(0) if has_rope else None
  v_ref = refs.pop(0) if has_v else None
  s1_ref = refs.pop(0) if scaled else None
  s2_ref = refs.pop(0) if scaled and has_rope else None
  sv_ref = refs.pop(0) if scaled and has_v else None
  o_ref, lse_ref = refs.pop(0), refs.pop(0)
  cnt_ref = refs.pop(0) if count else None
  return (q1_ref, q2_ref, k1_ref, k2_ref, v_ref, (s1_ref, s2_ref, sv_ref), o_ref, lse_ref,
          cnt_ref, refs)


def _loop_kernel(
    start_ref,   # i32[]    first attended slot of this sequence
    length_ref,  # i32[]    one past the last attended slot
    *refs,       # q1 [Gb, H1], (q2 [Gb, H2]), k1 [S, H1], (k2 [S, H2]), (v [S, Hv]),
                 # (scales f32[S, 1] of k1, (k2), (v)),
                 # o f32[Gb, Hv], lse f32[Gb, 1], (count i32[Gb, 1])
    has_rope: bool,
    has_v: bool,
    count: bool,
    scaled: bool,
    sm_scale: float,
    soft_cap: float | None,
    block_k: int,
    blocks_per_split: int,
    precision,
):
  """"loop" schedule: one program per (b, k, G tile, split), fori_loop over blocks.

  Widths that are not powers of two arrive padded in q (and in the output); their
  K/V blocks are loaded at the padded width with zero lanes (`_common.load_rows`).
  """
  (q1_ref, q2_ref, k1_ref, k2_ref, v_ref, (s1_ref, s2_ref, sv_ref), o_ref, lse_ref, cnt_ref,
   _) = _split_refs(refs, has_rope, has_v, count, scaled)
  split = pl.program_id(3)
  start, length = start_ref[()], length_ref[()]
  first, num_blocks = _common.split_blocks(split, start, length, block_k, blocks_per_split)
  q1 = q1_ref[...]
  q2 = q2_ref[...] if has_rope else None

  def load(ref, scale_ref, rows, width):  # [bk, width] block, dequantized when quantized
    return _common.dequant(_common.load_rows(ref, rows, width),
                           None if scale_ref is None else scale_ref[rows, :], q1.dtype)

  def body(i, carry):
    m, l, acc = carry
    slot0 = pl.multiple_of((first + i) * block_k, block_k)
    rows = pl.ds(slot0, block_k)
    k1 = load(k1_ref, s1_ref, rows, q1.shape[-1])
    k2 = load(k2_ref, s2_ref, rows, q2.shape[-1]) if has_rope else None
    v = load(v_ref, sv_ref, rows, o_ref.shape[-1]) if has_v else k1
    s = _common.logits(q1, k1, q2, k2, sm_scale=sm_scale, soft_cap=soft_cap,
                       precision=precision)
    return _common.online_softmax_step(m, l, acc, s, v, slot0, start, length, precision)

  _common.loop_blocks(num_blocks, body, o_ref, lse_ref)
  if count:
    cnt_ref[...] = jnp.full(cnt_ref.shape, num_blocks, jnp.int32)


def _grid_kernel(
    starts_ref,   # i32[B] (SMEM, scalar-prefetched) first attended slot
    lengths_ref,  # i32[B] (SMEM, scalar-prefetched) one past the last attended slot
    *refs,        # q1 [Gb, H1], (q2 [Gb, H2]), k1 [bk, H1], (k2 [bk, H2]), (v [bk, Hv]),
                  # (scales f32[bk, 1] of k1, (k2), (v)),
                  # o f32[Gb, Hv], lse f32[Gb, 128], (count i32[Gb, 128]),
                  # scratch: m f32[Gb, 128], l f32[Gb, 128], acc f32[Gb, Hv], (count)
    has_rope: bool,
    has_v: bool,
    count: bool,
    scaled: bool,
    sm_scale: float,
    soft_cap: float | None,
    block_k: int,
    blocks_per_split: int,
    precision,
):
  """"grid" schedule: key blocks on the last (sequential) grid axis."""
  (q1_ref, q2_ref, k1_ref, k2_ref, v_ref, (s1_ref, s2_ref, sv_ref), o_ref, lse_ref, cnt_ref,
   scratch) = _split_refs(refs, has_rope, has_v, count, scaled)
  m_sc, l_sc, acc_sc = scratch[:3]
  cnt_sc = scratch[3] if count else None
  b, split, step = pl.program_id(0), pl.program_id(3), pl.program_id(4)
  start, length = starts_ref[b], lengths_ref[b]
  lo, hi = _common.block_bounds(start, length, block_k)
  blk = split * blocks_per_split + step
  _common.grid_init(step, m_sc, l_sc, acc_sc, cnt_sc)

  @pl.when((blk >= lo) & (blk < hi))
  def _compute():
    q1 = q1_ref[...]

    def load(ref, scale_ref):  # [bk, X] block, dequantized when the cache is quantized
      return _common.dequant(ref[...], None if scale_ref is None else scale_ref[...], q1.dtype)

    k1 = load(k1_ref, s1_ref)
    k2 = load(k2_ref, s2_ref) if has_rope else None
    v = load(v_ref, sv_ref) if has_v else k1
    q2 = q2_ref[...] if has_rope else None
    s = _common.logits(q1, k1, q2, k2, sm_scale=sm_scale, soft_cap=soft_cap,
                       precision=precision)
    _common.grid_update(m_sc, l_sc, acc_sc, cnt_sc, s, v, blk, block_k, start, length,
                        precision)

  _common.grid_write(step, blocks_per_split, m_sc, l_sc, acc_sc, cnt_sc, o_ref, lse_ref,
                     cnt_ref)


# ----------------------------------------------------------------------------
# Launcher.
# ----------------------------------------------------------------------------


def _pick_block_k(capacity: int, target: int, granule: int) -> int | None:
  """Largest power-of-two multiple of `granule` <= target that divides S."""
  bk = _common.next_pow2(target) if target & (target - 1) else target
  while bk >= granule:
    if capacity % bk == 0:
      return bk
    bk //= 2
  return None


def _tiles(schedule: str, num_groups: int, capacity: int, read_width: int, value_width: int,
           dtype, block_k: int | None, block_g: int | None) -> tuple[int, int, int]:
  """Resolves (block_k, block_g, padded G) and checks them; ValueError if unfit.

  `read_width` is the elements read per slot (H + Hv; MLA C + R), and
  `value_width` the accumulator width (Hv; MLA C).
  "loop" (Triton): tiles are powers of two and every dot dimension >= 16.
  "grid" (Mosaic): the key block is a multiple of the sublane count (or all
  of S) and the G tile a multiple of it (`_common.g_tile`).
  """
  if schedule == "loop":
    granule = 16
    if block_k is None:
      block_k = _pick_block_k(capacity, _common.loop_block_target(read_width), granule)
      if block_k is None:
        raise ValueError(
            f"S (cache slots) must be a multiple of {granule} for the Triton decode "
            f"kernel; got S={capacity}")
    elif block_k < granule or block_k & (block_k - 1) or capacity % block_k:
      raise ValueError(
          f"block_k must be a power of two >= {granule} dividing S={capacity} for the "
          f"\"loop\" schedule; got {block_k}")
  else:
    granule = _common.sublanes(dtype)
    if block_k is None:
      # 512 keys per step amortise the ~0.35 us per-grid-step overhead on TPU.
      block_k = _pick_block_k(capacity, 512, granule) or capacity
    elif capacity % block_k or (block_k % granule and block_k != capacity):
      raise ValueError(
          f"block_k must divide S={capacity} and be a multiple of {granule} (or S) for "
          f"the \"grid\" schedule and dtype {jnp.dtype(dtype).name}; got {block_k}")
  block_g = _common.g_tile(schedule, num_groups, value_width, dtype, block_g)
  return block_k, block_g, _common.round_up(num_groups, block_g)


def _decode_partials(
    q1,       # [B, K, Gp, H1]  G padded to a multiple of block_g, in the dot dtype
    q2,       # [B, K, Gp, H2] or None
    k1,       # [B, K, S, H1]
    k2,       # [B, K, S, H2] or None
    v,        # [B, K, S, Hv] or None (the value is k1)
    starts,   # i32[B]
    lengths,  # i32[B], already clamped to [0, S]
    scales=None,  # (f32[B, K, S, 1] of k1, of k2 or None, of v or None), or None
    *,
    sm_scale: float,
    soft_cap: float | None = None,
    block_k: int,
    block_g: int,
    num_splits: int,
    schedule: str,
    interpret: bool,
    count: bool = False,
    num_warps: int | None = None,
    num_stages: int | None = None,
):
  """Runs the kernel; returns per-split `(out f32[B,K,P,Gp,Hv], lse f32[B,K,P,Gp])`.

  With `count=True` also returns `i32[B, K, P, Gp]`: how many key blocks each
  program actually processed (a test hook showing that skipped blocks are not
  computed). With `scales` (a quantized cache) every block is dequantized into
  q1's dtype as it is loaded.
  """
  batch, num_kv, gp, h1 = q1.shape
  capacity = k1.shape[2]
  has_rope, has_v = q2 is not None, v is not None
  hv = _common.padded_width(v.shape[-1], schedule) if has_v else h1
  num_blocks = capacity // block_k
  bps = -(-num_blocks // num_splits)  # key blocks per split
  num_gt = gp // block_g
  scaled = scales is not None
  precision = (lax.Precision.HIGHEST if q1.dtype == jnp.float32 else None)
  kernel_kw = dict(has_rope=has_rope, has_v=has_v, count=count, scaled=scaled,
                   sm_scale=sm_scale, soft_cap=soft_cap, block_k=block_k, blocks_per_split=bps,
                   precision=precision)
  operands = [q1] + ([q2] if has_rope else []) + [k1] + ([k2] if has_rope else []) + (
      [v] if has_v else [])
  scale_ops = [] if not scaled else [x for x in scales if x is not None]
  operands += scale_ops

  if schedule == "loop":
    def q_spec(width):
      return pl.BlockSpec((None, None, block_g, width), lambda b, h, g, j: (b, h, g, 0))

    def kv_spec(width):
      return pl.BlockSpec((None, None, capacity, width), lambda b, h, g, j: (b, h, 0, 0))

    scalar = pl.BlockSpec((None,), lambda b, h, g, j: (b,))
    in_specs = [scalar, scalar, q_spec(h1)] + ([q_spec(q2.shape[-1])] if has_rope else [])
    kernel, grid = _loop_kernel, (batch, num_kv, num_gt, num_splits)
  else:
    def q_spec(width):
      return pl.BlockSpec((None, None, block_g, width),
                          lambda b, h, g, j, i, st, ln: (b, h, g, 0))

    def kv_spec(width):
      def index(b, h, g, j, i, st, ln):
        lo, hi = _common.block_bounds(st[b], ln[b], block_k)
        return b, h, _common.kv_block_index(j, i, lo, hi, bps), 0
      return pl.BlockSpec((None, None, block_k, width), index)

    in_specs = [q_spec(h1)] + ([q_spec(q2.shape[-1])] if has_rope else [])
    kernel, grid = _grid_kernel, (batch, num_kv, num_gt, num_splits, bps)
  in_specs += [kv_spec(k1.shape[-1])] + ([kv_spec(k2.shape[-1])] if has_rope else [])
  in_specs += [kv_spec(v.shape[-1])] if has_v else []
  in_specs += [kv_spec(1) for _ in scale_ops]
  return _common.launch(
      functools.partial(kernel, **kernel_kw), [starts, lengths] + operands, schedule=schedule,
      grid=grid, in_specs=in_specs, block_g=block_g, hv=hv, count=count, num_scalar_prefetch=2,
      interpret=interpret, num_warps=num_warps, num_stages=num_stages,
      name="kvattn_decode_attention")


# ----------------------------------------------------------------------------
# Public wrappers.
# ----------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=(
    "sm_scale", "window", "soft_cap", "interpret", "block_k", "block_g", "num_splits",
    "schedule", "return_lse", "count_blocks", "num_warps", "num_stages"))
def _decode_impl(q1, q2, k1, k2, v, lengths, scales, *, sm_scale, window, soft_cap, interpret,
                 block_k, block_g, num_splits, schedule, return_lse, count_blocks, num_warps,
                 num_stages):
  batch, num_heads, h1 = q1.shape
  _, num_kv, capacity, _ = k1.shape
  groups = num_heads // num_kv
  hv = h1 if v is None else v.shape[-1]
  read_width = h1 + (0 if q2 is None else q2.shape[-1]) + (0 if v is None else hv)
  block_k, block_g, gp = _tiles(schedule, groups, capacity, read_width,
                                _common.padded_width(hv, schedule), k1.dtype, block_k, block_g)
  num_blocks = capacity // block_k
  if num_splits is None:
    num_splits = _common.default_splits(schedule, batch * num_kv * (gp // block_g), num_blocks)
  num_splits = min(num_splits, num_blocks)
  starts, lengths = common.attended_range(lengths, capacity, window)
  dot_dtype = _common.dot_dtype(q1.dtype, k1.dtype)
  if scales is not None:
    scales = _common.scale_columns(scales)
  # "loop" (Triton) widths are padded to powers of two >= 16: zero query lanes meet the
  # zero lanes of the padded K blocks (q . k unchanged), zero V lanes give output lanes
  # that are sliced off.
  outs = _decode_partials(
      _common.group_queries(q1, num_kv, gp, dot_dtype, schedule),
      None if q2 is None else _common.group_queries(q2, num_kv, gp, dot_dtype, schedule),
      k1, k2, v, starts, lengths, scales, sm_scale=sm_scale, soft_cap=soft_cap,
      block_k=block_k, block_g=block_g, num_splits=num_splits, schedule=schedule,
      interpret=interpret, count=count_blocks, num_warps=num_warps, num_stages=num_stages)
  return _common.finish(outs, num_heads, groups, q1.dtype, return_lse, count_blocks, hv)


def decode_attention(
    q: jax.Array,        # [B, N, H]
    k: jax.Array,        # [B, K, S, H]
    v: jax.Array,        # [B, K, S, Hv]
    lengths: jax.Array,  # i32[B]
    *,
    sm_scale: float | None = None,
    window: int | None = None,
    soft_cap: float | None = None,
    k_scale: jax.Array | None = None,  # f32[B, K, S]
    v_scale: jax.Array | None = None,  # f32[B, K, S]
    interpret: bool = False,
    block_k: int | None = None,
    block_g: int | None = None,
    num_splits: int | None = None,
    schedule: str | None = None,
    platform: str | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    return_lse: bool = False,
    count_blocks: bool = False,
):
  """Fused decode attention of one new token per sequence against a dense cache.

  Sequence b's query sits at slot `lengths[b] - 1` (its key is already
  written) and attends slots `[max(0, lengths[b] - window), lengths[b])`;
  query head n reads KV head `n // (N // K)`. Computes softmax(q k^T *
  sm_scale) v (Vaswani et al. 2017, eq. 1) with an online softmax over key
  blocks (FlashAttention-2) split into parallel partitions merged by their
  log-sum-exp (flash-decoding). Key blocks outside the attended range are not
  read or computed.

  Args:
    q: `[B, N, H]` queries (cast to k's dtype for the dot products; for a
      quantized cache kept in bf16/f16, or f32 otherwise).
    k: `[B, K, S, H]` keys; slots outside the attended range may hold anything.
      Float, or int8 / float8_e4m3fn / float8_e5m2 with `k_scale`.
    v: `[B, K, S, Hv]` values, same dtype as k; Hv may differ from H.
    lengths: `i32[B]` valid slots per sequence; values are clamped to `[0, S]`
      (a sticky overflow under jit may exceed S).
    sm_scale: logit scale, default `1/sqrt(H)`.
    window: sliding-window size W in tokens (the W most recent keys), or None.
    soft_cap: logit soft cap (Gemma 2: `cap * tanh(s / cap)` of the scaled logits),
      or None.
    k_scale, v_scale: `f32[B, K, S]` per-slot scales of a quantized cache
      (`k[b, h, s] * k_scale[b, h, s]`); each block is dequantized in the
      kernel after it is loaded. None for float caches.
    interpret: run the kernel with the Pallas interpreter (CPU).
    block_k: keys per block (static). Default: "loop" a power of two <= 128
      dividing S; "grid" 512 or the largest power-of-two divisor of S.
    block_g: query heads per tile (static); G is padded to a multiple of it.
    num_splits: key-axis partitions run in parallel (static); default fills
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
    count_blocks: test hook; also return `i32[B, K]`, the number of key blocks
      the kernel processed per sequence and KV head.

  Returns:
    `[B, N, Hv]` in q's dtype (f32 accumulation); length-0 rows are zeros.
    With `return_lse`, `(out, lse)`; with `count_blocks`, `(result, counts)`.

  Raises:
    ValueError: shapes that do not fit, S not divisible into blocks the
      schedule supports, a bad tunable, or `interpret=False` for a `platform` that is
      not a GPU/TPU, or an unknown `platform`.
    TypeError: non-float q/k/v, k/v dtype mismatch, non-integer lengths.
  """
  lengths = common.check_decode_args(q, k, v, lengths, window, soft_cap, sm_scale, k_scale,
                                     v_scale)
  return decode_attention_unchecked(
      q, k, v, lengths, sm_scale=sm_scale, window=window, soft_cap=soft_cap, k_scale=k_scale,
      v_scale=v_scale,
      interpret=interpret, block_k=block_k, block_g=block_g, num_splits=num_splits,
      schedule=schedule, platform=platform, num_warps=num_warps, num_stages=num_stages,
      return_lse=return_lse, count_blocks=count_blocks)


def decode_attention_unchecked(q, k, v, lengths, *, sm_scale=None, window=None, soft_cap=None,
                               k_scale=None, v_scale=None, interpret=False, block_k=None,
                               block_g=None, num_splits=None, schedule=None, platform=None,
                               num_warps=None, num_stages=None, return_lse=False,
                               count_blocks=False):
  """`decode_attention` without the argument checks, for callers that ran them
  (`attention_common.check_decode_args`; kvattn's dispatch point). The tunables
  are still checked: they are resolved here."""
  _, num_kv, capacity, head_dim = k.shape
  schedule = _common.check_schedule(schedule, interpret, (
      ("block_k", block_k), ("block_g", block_g), ("num_splits", num_splits)), platform)
  sm_scale = float(head_dim ** -0.5 if sm_scale is None else sm_scale)
  # Resolve tiles now so an unfit S or tunable raises here, before tracing.
  _tiles(schedule, q.shape[1] // num_kv, capacity, head_dim + v.shape[-1], v.shape[-1],
         k.dtype, block_k, block_g)
  scales = None if k_scale is None else (k_scale, None, v_scale)
  soft_cap = None if soft_cap is None else float(soft_cap)
  return _decode_impl(q, None, k, None, v, lengths, scales, sm_scale=sm_scale, window=window,
                      soft_cap=soft_cap, interpret=interpret, block_k=block_k, block_g=block_g,
                      num_splits=num_splits, schedule=schedule, return_lse=return_lse,
                      count_blocks=count_blocks, num_warps=num_warps, num_stages=num_stages)


def mla_decode_attention(
    q_latent: jax.Array,  # [B, N, C]
    q_rope: jax.Array,    # [B, N, R]
    c_kv: jax.Array,      # [B, S, C]
    k_rope: jax.Array,    # [B, S, R]
    lengths: jax.Array,   # i32[B]
    *,
    sm_scale: float,
    window: int | None = None,
    c_kv_scale: jax.Array | None = None,  # f32[B, S]
    k_rope_scale: jax.Array | None = None,  # f32[B, S]
    interpret: bool = False,
    block_k: int | None = None,
    block_g: int | None = None,
    num_splits: int | None = None,
    schedule: str | None = None,
    platform: str | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    return_lse: bool = False,
    count_blocks: bool = False,
):
  """Absorbed MLA decode (DeepSeek-V2, appendix C) through the fused kernel.

  Single-KV-head attention with logits `(q_latent . c_kv[s] + q_rope .
  k_rope[s]) * sm_scale` and value `c_kv[s]`. The kernel takes the key as two
  parts, so the cache is read in place (c_kv once, serving as key and value;
  k_rope once) and no `[c_kv | k_rope]` copy is made.

  Args:
    q_latent: `[B, N, C]` query with W_UK absorbed.
    q_rope: `[B, N, R]` RoPE part of the query.
    c_kv: `[B, S, C]` latent cache; `k_rope: [B, S, R]` shared RoPE keys
      (same dtype). Slots outside the attended range may hold anything.
    lengths: `i32[B]` valid slots per sequence, clamped to `[0, S]`.
    sm_scale: required, `1/sqrt(qk_nope_head_dim + qk_rope_head_dim)`.
    c_kv_scale, k_rope_scale: `f32[B, S]` per-token scales of a quantized
      (int8/fp8) latent cache, one per part; blocks are dequantized in the
      kernel. None for float caches.
    window, interpret, block_k, block_g, num_splits, schedule, platform,
      num_warps, num_stages, return_lse, count_blocks: as in `decode_attention`.

  Returns:
    `[B, N, C]` in q_latent's dtype (apply W_UV afterwards); length-0 rows are
    zeros. With `return_lse`, `(out, f32[B, N] lse)`.

  Raises:
    ValueError/TypeError: as `decode_attention`, naming the argument.
  """
  lengths = common.check_mla_decode_args(q_latent, q_rope, c_kv, k_rope, lengths, sm_scale,
                                         window, c_kv_scale, k_rope_scale)
  return mla_decode_attention_unchecked(
      q_latent, q_rope, c_kv, k_rope, lengths, sm_scale=sm_scale, window=window,
      c_kv_scale=c_kv_scale, k_rope_scale=k_rope_scale, interpret=interpret, block_k=block_k,
      block_g=block_g, num_splits=num_splits, schedule=schedule, platform=platform,
      num_warps=num_warps, num_stages=num_stages, return_lse=return_lse,
      count_blocks=count_blocks)


def mla_decode_attention_unchecked(q_latent, q_rope, c_kv, k_rope, lengths, *, sm_scale,
                                   window=None, c_kv_scale=None, k_rope_scale=None,
                                   interpret=False, block_k=None, block_g=None, num_splits=None,
                                   schedule=None, platform=None, num_warps=None,
                                   num_stages=None, return_lse=False, count_blocks=False):
  """`mla_decode_attention` without the argument checks, for callers that ran them
  (`attention_common.check_mla_decode_args`; kvattn's dispatch point)."""
  capacity, latent = c_kv.shape[1], c_kv.shape[2]
  schedule = _common.check_schedule(schedule, interpret, (
      ("block_k", block_k), ("block_g", block_g), ("num_splits", num_splits)), platform)
  _tiles(schedule, q_latent.shape[1], capacity, latent + k_rope.shape[-1], latent,
         c_kv.dtype, block_k, block_g)
  # [B, S, X] -> [B, 1, S, X] is a free reshape (no copy).
  scales = (None if c_kv_scale is None else
            (c_kv_scale[:, None], k_rope_scale[:, None], None))
  return _decode_impl(q_latent, q_rope, c_kv[:, None], k_rope[:, None], None, lengths, scales,
                      sm_scale=float(sm_scale), window=window, soft_cap=None,
                      interpret=interpret,
                      block_k=block_k, block_g=block_g, num_splits=num_splits,
                      schedule=schedule, return_lse=return_lse, count_blocks=count_blocks,
                      num_warps=num_warps, num_stages=num_stages)


def unsupported_reason(q_shape, k_shape, v_shape, dtype, *,
                       platform: str | None = None) -> str | None:
  """Why the compiled kernel cannot run these shapes, or None if it can.

  Used by kvattn's dispatch to fall back to XLA. `k_shape` is
  `[B, K, S, H]`, `v_shape` `[B, K, S, Hv]` or None when the value is the key
  (MLA: check `c_kv` and `k_rope` each as a `[B, 1, S, width]` key).
  `platform` defaults to the JAX default backend. On GPU any head dim runs
  (padded to a power of two >= 16 in the kernel; soft caps too); TPU needs
  widths that are multiples of 64. Quantized caches are
  accepted on GPU (int8 and both fp8 formats; Triton needs sm_89+ for fp8)
  and, int8 only, on TPU. What it accepts of the grid in
  tests/pallas_kernels/test_lowering.py (each dtype, head dims 64-256,
  window, soft cap) lowers for "cuda" and "tpu"; nothing has been compiled
  on a device yet.
  """
  del q_shape  # q's shape follows from k's (checked by the wrappers).
  platform = platform or _common.platform()
  capacity, head_dim = k_shape[2], k_shape[3]
  hv = v_shape[3] if v_shape is not None else head_dim
  reason = _common.compiled_reason(platform, dtype,
                                   (("head dim H", head_dim), ("value width Hv", hv)),
                                   pads_widths=True)
  if reason is not None:
    return reason
  # Key blocks: multiples of 16 slots (Triton dots), of the sublane count (Mosaic).
  granule = 16 if platform in _common.GPU_PLATFORMS else _common.sublanes(dtype)
  if capacity % granule:
    return f"S={capacity} is not a multiple of {granule}"
  return None


# ----------------------------------------------------------------------------
# References (plain jnp, f32).
# ----------------------------------------------------------------------------


def _reference_softmax(logits, lengths, window):
  """Masked softmax of f32 `logits [B, N, S]` over the attended slots (`decode_mask`).

  Masked logits are replaced by -inf and their probabilities are exact zeros.
  Returns `(probs [B, N, S] normalised, mask bool[B, S], lse f32[B, N])`
  (lse -inf and probabilities 0 where nothing is attended).
  """
  mask = common.decode_mask(lengths, logits.shape[-1], window)
  logits = jnp.where(mask[:, None], logits, -jnp.inf)
  top = jnp.max(logits, axis=-1, keepdims=True)
  top = jnp.where(jnp.isfinite(top), top, 0.0)
  probs = jnp.where(mask[:, None], jnp.exp(logits - top), 0.0)
  denom = jnp.sum(probs, axis=-1)
  lse = jnp.where(denom > 0, top[..., 0] + jnp.log(jnp.where(denom > 0, denom, 1.0)),
                  -jnp.inf)
  return probs / jnp.where(denom > 0, denom, 1.0)[..., None], mask, lse


def _dequant_reference(x, scale):
  """f32 `x * scale[..., None]` for a quantized operand, else `x` unchanged."""
  if scale is None:
    return x
  return x.astype(jnp.float32) * scale.astype(jnp.float32)[..., None]


def decode_attention_reference(
    q: jax.Array,        # [B, N, H]
    k: jax.Array,        # [B, K, S, H]
    v: jax.Array,        # [B, K, S, Hv]
    lengths: jax.Array,  # i32[B]
    *,
    sm_scale: float | None = None,
    window: int | None = None,
    soft_cap: float | None = None,
    k_scale: jax.Array | None = None,  # f32[B, K, S]
    v_scale: jax.Array | None = None,  # f32[B, K, S]
    return_lse: bool = False,
    **unused_tunables: Any,
):
  """Plain-jnp f32 `decode_attention` (same signature; tunables are ignored).

  Materialises the `[B, N, S]` logits (soft-capped, `cap * tanh(s / cap)`, when
  `soft_cap` is given: the paged reference uses that), masks slots outside
  `[max(0, L - W), L)` by replacement and zeroes masked value rows, so garbage
  cannot leak. A quantized cache is dequantized up front (`k * k_scale[...,
  None]` in f32). Query head n reads KV head `n // (N // K)`. Returns `[B, N,
  Hv]` in q's dtype (and the `f32[B, N]` log-sum-exp of the scaled logits with
  `return_lse`).
  """
  del unused_tunables
  sm_scale = k.shape[-1] ** -0.5 if sm_scale is None else sm_scale
  k, v = _dequant_reference(k, k_scale), _dequant_reference(v, v_scale)
  num_kv, num_heads = k.shape[1], q.shape[1]
  kh = jnp.repeat(k.astype(jnp.float32), num_heads // num_kv, axis=1)  # [B, N, S, H]
  vh = jnp.repeat(v.astype(jnp.float32), num_heads // num_kv, axis=1)
  logits = jnp.einsum("BNH,BNSH->BNS", q.astype(jnp.float32), kh,
                      precision=lax.Precision.HIGHEST) * sm_scale
  if soft_cap is not None:
    logits = soft_cap * jnp.tanh(logits / soft_cap)
  probs, mask, lse = _reference_softmax(logits, lengths, window)
  vh = jnp.where(mask[:, None, :, None], vh, 0.0)
  out = jnp.einsum("BNS,BNSV->BNV", probs, vh, precision=lax.Precision.HIGHEST)
  out = out.astype(q.dtype)
  return (out, lse) if return_lse else out


def mla_decode_attention_reference(
    q_latent: jax.Array,  # [B, N, C]
    q_rope: jax.Array,    # [B, N, R]
    c_kv: jax.Array,      # [B, S, C]
    k_rope: jax.Array,    # [B, S, R]
    lengths: jax.Array,   # i32[B]
    *,
    sm_scale: float,
    window: int | None = None,
    c_kv_scale: jax.Array | None = None,  # f32[B, S]
    k_rope_scale: jax.Array | None = None,  # f32[B, S]
    return_lse: bool = False,
    **unused_tunables: Any,
):
  """Plain-jnp f32 `mla_decode_attention` (tunables are ignored).

  Logits `(q_latent . c_kv + q_rope . k_rope) * sm_scale`, value `c_kv`; a
  quantized cache is dequantized up front. Returns `[B, N, C]` in q_latent's
  dtype (and `f32[B, N]` lse).
  """
  del unused_tunables
  c_kv = _dequant_reference(c_kv, c_kv_scale)
  k_rope = _dequant_reference(k_rope, k_rope_scale)
  f32 = jnp.float32
  hi = lax.Precision.HIGHEST
  logits = (jnp.einsum("BNC,BSC->BNS", q_latent.astype(f32), c_kv.astype(f32), precision=hi)
            + jnp.einsum("BNR,BSR->BNS", q_rope.astype(f32), k_rope.astype(f32),
                         precision=hi)) * sm_scale
  probs, mask, lse = _reference_softmax(logits, lengths, window)
  values = jnp.where(mask[:, :, None], c_kv.astype(f32), 0.0)
  out = jnp.einsum("BNS,BSC->BNC", probs, values, precision=hi).astype(q_latent.dtype)
  return (out, lse) if return_lse else out
