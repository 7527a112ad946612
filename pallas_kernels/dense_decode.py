"""Fused decode attention: one new query token per sequence against a dense KV cache.

One kernel serves MHA, GQA (Ainslie et al. 2023: the G = N // K heads of KV head k are
one `[G, H]` tile), MQA and MLA's absorbed decode (DeepSeek-V2, appendix C: the key in
two parts `q1 . k1 + q2 . k2` with `k1 = c_kv` also the value, read once). Online softmax
over key blocks (FlashAttention-2, Dao 2023, algorithm 1) split into partitions merged by
log-sum-exp (flash-decoding, Dao et al. 2023); sequence b attends `[start_b, length_b)`
and blocks outside it are skipped. Masked logits are replaced and masked value rows
zeroed, so garbage in unused slots never reaches an output. int8 / fp8 caches (one f32
scale per slot, passed as `[B, K, S, 1]` columns) are dequantized per block after the load.

Schedules: "loop" (GPU, Triton; grid `(B, K, G tiles, splits)`, a `fori_loop` over the
split's blocks) and "grid" (TPU, Mosaic; key blocks on the last grid axis, lengths
scalar-prefetched, the clamped index map `_common.kv_block_index` issues no DMA outside
the range). Both run on CPU with `interpret=True`; `platform=` lowers for a device.
Layout: kernels, launcher, public wrappers, references.
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
    step: _common.Step,
):
  """"loop" schedule: one program per (b, k, G tile, split), fori_loop over blocks.

  Widths that are not powers of two arrive padded in q (and in the output); their
  K/V blocks are loaded at the padded width with zero lanes (`_common.load_rows`).
  """
  sm_scale, soft_cap, block_k, blocks_per_split, precision = step
  (q1_ref, q2_ref, k1_ref, k2_ref, v_ref, (s1_ref, s2_ref, sv_ref), o_ref, lse_ref, cnt_ref,
   _) = _split_refs(refs, has_rope, has_v, count, scaled)
  start, length, first, num_blocks = _common.loop_range(start_ref, length_ref, block_k,
                                                        blocks_per_split)
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

  _common.loop_blocks(num_blocks, body, o_ref, lse_ref, cnt_ref)


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
    step: _common.Step,
):
  """"grid" schedule: key blocks on the last (sequential) grid axis."""
  sm_scale, soft_cap, block_k, blocks_per_split, precision = step
  (q1_ref, q2_ref, k1_ref, k2_ref, v_ref, (s1_ref, s2_ref, sv_ref), o_ref, lse_ref, cnt_ref,
   scratch) = _split_refs(refs, has_rope, has_v, count, scaled)

  def block(*_):
    q1 = q1_ref[...]

    def load(ref, scale_ref):  # [bk, X] block, dequantized when the cache is quantized
      return _common.dequant(ref[...], None if scale_ref is None else scale_ref[...], q1.dtype)

    k1 = load(k1_ref, s1_ref)
    k2 = load(k2_ref, s2_ref) if has_rope else None
    v = load(v_ref, sv_ref) if has_v else k1
    q2 = q2_ref[...] if has_rope else None
    return _common.logits(q1, k1, q2, k2, sm_scale=sm_scale, soft_cap=soft_cap,
                          precision=precision), v

  outs = (o_ref, lse_ref) + ((cnt_ref,) if count else ()) + tuple(scratch)
  _common.grid_body(starts_ref, lengths_ref, outs, block, count=count, block_size=block_k,
                    blocks_per_split=blocks_per_split, precision=precision)


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
                   step=_common.Step(sm_scale, soft_cap, block_k, bps, precision))
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
    k_scale: jax.Array | None = None,  # f32[B, K, S]
    v_scale: jax.Array | None = None,  # f32[B, K, S]
    sm_scale: float | None = None, window: int | None = None, soft_cap: float | None = None,
    **tunables: Any,
):
  """Fused decode attention of one new token per sequence against a dense cache.

  softmax(q k^T * sm_scale) v (Vaswani et al. 2017, eq. 1) for the query at slot
  `lengths[b] - 1` over slots `[max(0, lengths[b] - window), lengths[b])` (lengths
  clamped to `[0, S]`); query head n reads KV head `n // (N // K)`. k, v float, or int8 /
  float8_e4m3fn / float8_e5m2 with their per-slot scales. `soft_cap`: `cap * tanh(s /
  cap)`. Tunables: `decode_attention_unchecked`.

  Returns:
    `[B, N, Hv]` in q's dtype (f32 accumulation), length-0 rows zeros; with
    `return_lse`, `(out, f32[B, N] lse)`; with `count_blocks`, `(result, i32[B, K])`.

  Raises:
    ValueError: shapes that do not fit, S not divisible into the schedule's blocks, a
      bad tunable, `interpret=False` off GPU/TPU, an unknown `platform`.
    TypeError: non-float q, k/v dtype mismatch, non-integer lengths, scales missing or
      given for a float cache.
  """
  lengths = common.check_decode_args(q, k, v, lengths, window, soft_cap, sm_scale, k_scale,
                                     v_scale)
  return decode_attention_unchecked(q, k, v, lengths, sm_scale=sm_scale, window=window,
                                    soft_cap=soft_cap, k_scale=k_scale, v_scale=v_scale,
                                    **tunables)


def decode_attention_unchecked(q, k, v, lengths, *, sm_scale=None, window=None, soft_cap=None,
                               k_scale=None, v_scale=None, interpret=False, block_k=None,
                               block_g=None, num_splits=None, schedule=None, platform=None,
                               num_warps=None, num_stages=None, return_lse=False,
                               count_blocks=False):
  """`decode_attention` without the argument checks (kvattn's dispatch point ran them).

  Tunables (static; every kernel takes them):
    interpret: run with the Pallas interpreter (CPU).
    block_k, block_g: keys per block (default "loop" <= 128 dividing S, "grid" 512) and
      query heads per tile (G is padded to a multiple of it).
    num_splits: key-axis partitions (default fills the device); results do not depend on it.
    schedule: "loop" (Triton) or "grid" (Mosaic); default by `platform` (the platform
      lowered for, default the JAX backend), so a CPU host can lower for "cuda" / "tpu".
    num_warps, num_stages: Triton options. return_lse: also the `f32[B, N]` log-sum-exp.
    count_blocks: test hook, also `i32[B, K]` key blocks processed.
  """
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
    c_kv_scale: jax.Array | None = None,  # f32[B, S]
    k_rope_scale: jax.Array | None = None,  # f32[B, S]
    sm_scale: float, window: int | None = None,
    **tunables: Any,
):
  """Absorbed MLA decode (DeepSeek-V2, appendix C): logits `(q_latent . c_kv[s] + q_rope .
  k_rope[s]) * sm_scale`, value `c_kv[s]`, the cache read in place (no `[c_kv | k_rope]`
  copy). `sm_scale` is required; tunables as `decode_attention_unchecked`.

  Returns:
    `[B, N, C]` in q_latent's dtype (apply W_UV afterwards); length-0 rows are zeros.

  Raises:
    ValueError, TypeError: as `decode_attention`, naming the argument.
  """
  lengths = common.check_mla_decode_args(q_latent, q_rope, c_kv, k_rope, lengths, sm_scale,
                                         window, c_kv_scale, k_rope_scale)
  return mla_decode_attention_unchecked(
      q_latent, q_rope, c_kv, k_rope, lengths, sm_scale=sm_scale, window=window,
      c_kv_scale=c_kv_scale, k_rope_scale=k_rope_scale, **tunables)


def mla_decode_attention_unchecked(q_latent, q_rope, c_kv, k_rope, lengths, *, sm_scale,
                                   window=None, c_kv_scale=None, k_rope_scale=None,
                                   interpret=False, block_k=None, block_g=None, num_splits=None,
                                   schedule=None, platform=None, num_warps=None,
                                   num_stages=None, return_lse=False, count_blocks=False):
  """`mla_decode_attention` without the argument checks (kvattn's dispatch point)."""
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


def decode_attention_reference(q, k, v, lengths, *, sm_scale=None, window=None, soft_cap=None,
                               k_scale=None, v_scale=None, return_lse=False,
                               **unused_tunables: Any):
  """Plain-jnp f32 `decode_attention` (tunables ignored): `[B, N, S]` logits, masked by
  replacement, masked value rows zeroed; a quantized cache dequantized up front."""
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


def mla_decode_attention_reference(q_latent, q_rope, c_kv, k_rope, lengths, *, sm_scale,
                                   window=None, c_kv_scale=None, k_rope_scale=None,
                                   return_lse=False, **unused_tunables: Any):
  """Plain-jnp f32 `mla_decode_attention` (tunables ignored)."""
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
