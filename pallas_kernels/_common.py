"""The skeleton every fused decode kernel shares (`dense_decode`, `paged_decode`,
`lowbit_decode`, `lowbit_paged_decode`, `rotated_decode`).

GQA-grouped online softmax over key blocks (FlashAttention-2, Dao 2023, algorithm 1),
split into partitions merged by log-sum-exp (flash-decoding, Dao et al. 2023), with
optional per-key / per-value scales. In kernel-file order: kernel math (values), the
schedules' kernel bodies (refs), launcher helpers (tiles, splits, pages, BlockSpecs,
`launch`), wrapper helpers (query grouping, the merge) and schedule/platform checks.
Imports only jax.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import attention_common
from pallas_kernels.attention_common import M_INIT, QUANT_DTYPES

try:  # The Triton lowering is deprecated in JAX 0.11 and may go away.
  from jax.experimental.pallas import triton as plgpu
except ImportError:  # pragma: no cover - depends on the JAX build.
  plgpu = None
try:
  from jax.experimental.pallas import tpu as pltpu
except ImportError:  # pragma: no cover - depends on the JAX build.
  pltpu = None

# TPU vregs are 8 sublanes x 128 lanes; per-row statistics live replicated
# over one vreg row of 128 lanes in VMEM scratch, as in Pallas TPU flash
# attention.
TPU_LANES = 128
SCHEDULES = ("loop", "grid")
GPU_PLATFORMS = ("gpu", "cuda", "rocm")
PLATFORMS = ("cpu", "tpu") + GPU_PLATFORMS

# Cache dtypes each compiled backend takes (Triton needs sm_89+ for fp8 loads; Mosaic has no
# fp8 -> f32 conversion on the TPU generations we target, so int8 only there).
_GPU_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)) + (
    QUANT_DTYPES)
_TPU_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.int8))


@dataclasses.dataclass(frozen=True)
class Step:
  """Static parameters of every kernel body: logit scale and soft cap, the key block
  (`block_k` slots, or `pages_per_block` pages), key blocks per split, dot precision."""
  sm_scale: float
  soft_cap: float | None
  block: int
  blocks_per_split: int
  precision: Any

  def __iter__(self):
    return iter(dataclasses.astuple(self))


# ----------------------------------------------------------------------------
# Kernel math shared by both schedules (values, not refs).
# ----------------------------------------------------------------------------


def load_rows(ref, rows, width: int):
  """Rows `rows` (a `pl.ds` of bk slots) of a `[S, X]` ref as a `[bk, width]` block.

  `width == X` is a plain load. A wider `width` (a head dim padded to a power of
  two for Triton) is a masked load whose lanes past X are zeros, so dots with
  zero-padded queries are unchanged (Triton's tensors must have power-of-two sizes).
  """
  if width == ref.shape[-1]:
    return ref[rows, :]
  if plgpu is None:  # pragma: no cover - depends on the JAX build.
    raise NotImplementedError("padded head dims need jax.experimental.pallas.triton.load")
  lanes = lax.broadcasted_iota(jnp.int32, (rows.size, width), 1)
  # `other` in the ref's dtype: Triton's lowering casts it to the pointee type and
  # cannot cast an i32 constant to fp8.
  return plgpu.load(ref.at[rows, pl.ds(0, width)], mask=lanes < ref.shape[-1],
                    other=jnp.zeros((), ref.dtype))


def dequant(x, scale, dtype):
  """A loaded block `[bk, X]`, dequantized with its `[bk, 1]` scales into `dtype`
  when `scale` is given (quantized cache: `x.astype(f32) * scale`), else `x` as it is."""
  if scale is None:
    return x
  return (x.astype(jnp.float32) * scale).astype(dtype)


def block_bounds(start, length, block: int):
  """First and one-past-last block of `block` slots holding a slot of `[start, length)`."""
  return lax.div(start, block), lax.div(length + (block - 1), block)


def split_blocks(split, start, length, block_k: int, blocks_per_split: int):
  """("loop" schedule) First key block of `split` and how many it processes: the
  blocks of `[split * bps, (split + 1) * bps)` that overlap `[start, length)`."""
  lo, hi = block_bounds(start, length, block_k)
  first = jnp.maximum(lo, split * blocks_per_split)
  last = jnp.minimum(hi, (split + 1) * blocks_per_split)
  return first, jnp.maximum(last - first, 0)


def loop_range(start_ref, length_ref, block_k: int, blocks_per_split: int):
  """("loop" schedule) `(start, length, first block, number of blocks)` of this program's
  split (grid axis 3) over the sequence's attended range."""
  start, length = start_ref[()], length_ref[()]
  first, num_blocks = split_blocks(pl.program_id(3), start, length, block_k, blocks_per_split)
  return start, length, first, num_blocks


def dot(a, b, *, trans_b: bool = False, precision=None):
  """f32 `a @ b` (or `a @ b.T`) of 2-D tiles.

  A plain dot_general with f32 accumulation: Triton lowers the transposed
  operand with `tt.trans`, Mosaic supports the NT form natively. `precision`
  HIGHEST makes Triton use IEEE f32 instead of TF32 for f32 inputs.
  """
  dims = (((1,), (1 if trans_b else 0,)), ((), ()))
  return lax.dot_general(a, b, dims, precision=precision, preferred_element_type=jnp.float32)


def logits(q1, k1, q2=None, k2=None, *, sm_scale: float, soft_cap: float | None = None,
           precision, k_scale=None):
  """f32 `[Gb, bk]` logits `(q1 . k1 + q2 . k2) * sm_scale` (second part optional; times
  the per-key `k_scale [1, bk]` when given), soft-capped (`cap * tanh(s / cap)`) when asked."""
  s = dot(q1, k1, trans_b=True, precision=precision)
  if q2 is not None:
    s = s + dot(q2, k2, trans_b=True, precision=precision)
  s = s * (sm_scale if k_scale is None else k_scale.astype(jnp.float32) * sm_scale)
  if soft_cap is not None:
    s = soft_cap * jnp.tanh(s / soft_cap)
  return s


def online_softmax_step(m_prev, l_prev, acc_prev, s, v, slot0, start, length, precision,
                        v_scale=None):
  """One FlashAttention-2 update with a key block at slots `slot0 + [0, bk)`.

  Masked logits are replaced (not added to) and masked value rows zeroed, so garbage
  outside `[start, length)` never reaches the result (0 * NaN would be NaN).

  Args:
    m_prev, l_prev: f32[Gb, 1] running max and sum of exp; acc_prev: f32[Gb, Hv].
    s: f32[Gb, bk] logits of this block (unmasked).
    v: [bk, Hv] values of this block.
    slot0, start, length: i32 scalars: the block's first slot, the attended range.
    v_scale: optional per-token value scales `[1, bk]`, applied to the probabilities
      (zeroed where masked) rather than to the `[bk, Hv]` values.

  Returns:
    `(m_next, l_next, acc_next)`.
  """
  bk = s.shape[1]
  cols = slot0 + lax.broadcasted_iota(jnp.int32, s.shape, 1)
  valid = (cols >= start) & (cols < length)
  s = jnp.where(valid, s, -jnp.inf)
  m_next = jnp.maximum(m_prev, jnp.max(s, axis=1)[:, None])
  alpha = jnp.exp(m_prev - m_next)
  p = jnp.exp(s - m_next)  # exact 0 where masked
  l_next = alpha * l_prev + jnp.sum(p, axis=1)[:, None]
  if v_scale is not None:
    p = jnp.where(valid, p * v_scale.astype(jnp.float32), 0.0)
  rows = slot0 + lax.broadcasted_iota(jnp.int32, (bk, v.shape[1]), 0)
  v = jnp.where((rows >= start) & (rows < length), v, jnp.zeros((), v.dtype))
  pv = dot(p.astype(v.dtype), v, precision=precision)
  return m_next, l_next, alpha * acc_prev + pv


def finalize(m, l, acc):
  """Normalised f32 output and log-sum-exp (-inf where nothing was attended)."""
  nonempty = l > 0.0
  out = acc / jnp.where(nonempty, l, 1.0)
  lse = jnp.where(nonempty, m + jnp.log(jnp.where(nonempty, l, 1.0)), -jnp.inf)
  return out, lse


# ----------------------------------------------------------------------------
# Kernel bodies shared by both kernels (refs).
# ----------------------------------------------------------------------------


def loop_blocks(num_blocks, body, o_ref, lse_ref, cnt_ref=None, per_block: int = 1):
  """"loop" schedule: `fori_loop(0, num_blocks, body)` over the online-softmax state
  `(m, l, acc)` from empty, then writes the normalised `o_ref [Gb, Hv]` and `lse_ref
  [Gb, 1]` (and `num_blocks * per_block`, blocks or pages read, into `cnt_ref`)."""
  block_g, hv = o_ref.shape
  init = (jnp.full((block_g, 1), M_INIT, jnp.float32),
          jnp.zeros((block_g, 1), jnp.float32),
          jnp.zeros((block_g, hv), jnp.float32))
  m, l, acc = lax.fori_loop(0, num_blocks, body, init)
  out, lse = finalize(m, l, acc)
  o_ref[...] = out
  lse_ref[...] = lse
  if cnt_ref is not None:
    cnt_ref[...] = jnp.full(cnt_ref.shape, num_blocks * per_block, jnp.int32)


def grid_init(step, m_sc, l_sc, acc_sc, cnt_sc):
  """"grid" schedule: resets the scratch state at the first block step of a split."""

  @pl.when(step == 0)
  def _init():
    m_sc[...] = jnp.full(m_sc.shape, M_INIT, jnp.float32)
    l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
    acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)
    if cnt_sc is not None:
      cnt_sc[...] = jnp.zeros(cnt_sc.shape, jnp.int32)


def grid_update(m_sc, l_sc, acc_sc, cnt_sc, s, v, block, block_size: int, start, length,
                precision, v_scale=None):
  """"grid" schedule: one `online_softmax_step` on the scratch state (statistics
  lane-replicated `[Gb, 128]`) with the key block `block` of `block_size` slots
  (first slot `block * block_size`), counting it when `cnt_sc` is given."""
  m_prev, l_prev = m_sc[...], l_sc[...]
  m, l, acc = online_softmax_step(m_prev[:, :1], l_prev[:, :1], acc_sc[...], s, v,
                                  block * block_size, start, length, precision, v_scale)
  m_sc[...] = jnp.broadcast_to(m, m_sc.shape)
  l_sc[...] = jnp.broadcast_to(l, l_sc.shape)
  acc_sc[...] = acc
  if cnt_sc is not None:
    cnt_sc[...] += 1


def grid_refs(rest, count: bool):
  """"grid" schedule: the kernel's trailing refs (after the inputs) as `(o, lse, count,
  m, l, acc, count scratch)`; the count refs are None without `count`."""
  o_ref, lse_ref, *rest = rest
  cnt_ref = rest.pop(0) if count else None
  m_sc, l_sc, acc_sc = rest[:3]
  return o_ref, lse_ref, cnt_ref, m_sc, l_sc, acc_sc, rest[3] if count else None


def grid_write(step, blocks_per_split: int, m_sc, l_sc, acc_sc, cnt_sc, o_ref, lse_ref,
               cnt_ref):
  """"grid" schedule: writes the split's normalised output, lse (and block count)
  at its last block step."""

  @pl.when(step == blocks_per_split - 1)
  def _write():
    out, lse = finalize(m_sc[...][:, :1], l_sc[...][:, :1], acc_sc[...])
    o_ref[...] = out
    lse_ref[...] = jnp.broadcast_to(lse, lse_ref.shape)
    if cnt_ref is not None:
      cnt_ref[...] = cnt_sc[...]


def grid_body(starts_ref, lengths_ref, rest, block, *, count: bool, block_size: int,
              blocks_per_split: int, precision, pages_per_block: int = 0):
  """"grid" schedule's kernel body. `rest` are the refs after the inputs (`grid_refs`);
  `block(j, index)` gives `(s, v)` or `(s, v, v_scale)` of key block `index` (j None), or
  of page operand j (page `index`) when `pages_per_block`; only blocks inside `[start,
  length)` are computed. The split's output is written at its last step."""
  o_ref, lse_ref, cnt_ref, m_sc, l_sc, acc_sc, cnt_sc = grid_refs(rest, count)
  b, split, step = pl.program_id(0), pl.program_id(3), pl.program_id(4)
  start, length = starts_ref[b], lengths_ref[b]
  lo, hi = block_bounds(start, length, block_size)
  blk = split * blocks_per_split + step
  grid_init(step, m_sc, l_sc, acc_sc, cnt_sc)

  def compute(j, index):
    s, v, *v_scale = block(j, index)
    grid_update(m_sc, l_sc, acc_sc, cnt_sc, s, v, index, block_size, start, length, precision,
                *v_scale)

  if pages_per_block:
    for j in range(pages_per_block):  # static unroll over the block's pages
      page = blk * pages_per_block + j
      pl.when((page >= lo) & (page < hi))(functools.partial(compute, j, page))
  else:
    pl.when((blk >= lo) & (blk < hi))(functools.partial(compute, None, blk))
  grid_write(step, blocks_per_split, m_sc, l_sc, acc_sc, cnt_sc, o_ref, lse_ref, cnt_ref)


# ----------------------------------------------------------------------------
# Launcher helpers.
# ----------------------------------------------------------------------------


def padded_width(width: int, schedule: str) -> int:
  """A dot width as the kernel computes it: "loop" (Triton) pads to a power of two
  >= 16 (zero lanes); "grid" (Mosaic) keeps it."""
  return max(16, next_pow2(width)) if schedule == "loop" else width


def next_pow2(x: int) -> int:
  """The smallest power of two >= `x` (1 for x <= 1)."""
  return 1 << max(0, (x - 1).bit_length())


def round_up(x: int, m: int) -> int:
  """`x` rounded up to a multiple of `m`."""
  return -(-x // m) * m


def is_pow2(x: int) -> bool:
  """True when `x` is a positive power of two."""
  return x > 0 and not x & (x - 1)


def platform() -> str:
  """The default JAX backend name ("cpu", "gpu", "tpu")."""
  return jax.default_backend()


def target_platform(platform_name: str | None) -> str:
  """The platform a call is lowered for: `platform_name`, or the default backend when None.

  Raises ValueError for a name that is not a JAX platform ("cpu", "gpu", "cuda",
  "rocm", "tpu")."""
  if platform_name is None:
    return platform()
  if platform_name not in PLATFORMS:
    raise ValueError(f"platform must be one of {PLATFORMS} or None; got {platform_name!r}")
  return platform_name


def default_schedule(platform_name: str | None = None) -> str:
  """"grid" for TPU, "loop" elsewhere (GPU, and the interpreter on CPU); the platform
  defaults to the default backend."""
  return "grid" if target_platform(platform_name) == "tpu" else "loop"


def sublanes(dtype) -> int:
  """Rows of one TPU vreg for `dtype`: 8 for 32-bit, 16 for 16-bit, 32 for 8-bit types."""
  return 8 * max(1, 4 // jnp.dtype(dtype).itemsize)


def loop_block_target(read_width: int) -> int:
  """"loop" schedule: keys per block so that one K block plus one V block is
  around 32 KiB of 16-bit data (a 4-warp program then has registers/shared
  memory to double-buffer them): 64 keys at H = Hv = 128, 128 at 64; a power
  of two in [16, 128]. `read_width` is the elements read per slot (H + Hv)."""
  return max(16, min(128, next_pow2(max(1, 16384 // read_width))))


def g_tile(schedule: str, num_groups: int, value_width: int, dtype, block_g: int | None) -> int:
  """Resolves and checks the G tile (query heads per program); ValueError if unfit.

  "loop" (Triton): a power of two >= 16 (every dot dimension >= 16), by
  default G rounded up to one, capped so the `[Gb, Hv]` f32 accumulator stays
  within 8192 elements (32 KiB). "grid" (Mosaic): a multiple of the sublane
  count of `dtype` (the cache dtype), by default G rounded up to one.
  """
  if schedule == "loop":
    if block_g is None:
      return min(max(16, next_pow2(num_groups)), max(16, 8192 // next_pow2(value_width)))
    if block_g < 16 or not is_pow2(block_g):
      raise ValueError(f"block_g must be a power of two >= 16 for the \"loop\" schedule; "
                       f"got {block_g}")
    return block_g
  granule = sublanes(dtype)
  if block_g is None:
    return round_up(num_groups, granule)
  if block_g % granule:
    raise ValueError(f"block_g must be a multiple of {granule} for the \"grid\" schedule "
                     f"and dtype {jnp.dtype(dtype).name}; got {block_g}")
  return block_g


def default_splits(schedule: str, programs: int, num_blocks: int) -> int:
  """Key-axis partitions when `num_splits` is not given (results do not depend on it)."""
  if schedule == "loop":
    # Aim for ~2 waves of programs on a 132-SM H100/H200 (and plenty for fewer SMs).
    return max(1, min(num_blocks, -(-256 // programs)))
  # TPU: splits only help when B * K * G tiles cannot keep both megacore cores busy.
  return max(1, min(num_blocks, 2 if programs < 2 else 1))


def launch(kernel, operands, *, schedule: str, grid, in_specs, block_g: int, hv: int,
           count: bool, num_scalar_prefetch: int, interpret, num_warps: int | None,
           num_stages: int | None, name: str):
  """Runs `kernel` over `grid` with the schedule's launch configuration.

  `grid` is `(B, K, G tiles, splits)` ("loop") or `(B, K, G tiles, splits,
  blocks per split)` ("grid"; the last axis sequential). "loop" passes every
  operand through `in_specs` (scalars included) and takes Triton options;
  "grid" scalar-prefetches the first `num_scalar_prefetch` operands into SMEM
  (`in_specs` cover the rest) and keeps the running statistics in VMEM scratch.

  Returns the per-split partials: `out f32[B, K, splits, Gp, Hv]`, `lse
  f32[B, K, splits, Gp]` and, with `count`, `i32[B, K, splits, Gp]` (blocks or
  pages processed); on "grid" the lse and count rows are written
  lane-replicated (`[Gb, 128]`, as Mosaic stores them) and the lanes dropped
  here. The output index maps take the grid indices `(b, h, g, split, ...)`
  and ignore the rest (block step, scalar-prefetch refs).
  """
  batch, num_kv, num_gt, num_splits = grid[:4]
  gp = num_gt * block_g
  lanes = TPU_LANES if schedule == "grid" else 1
  out_shape = [jax.ShapeDtypeStruct((batch, num_kv, num_splits, gp, hv), jnp.float32),
               jax.ShapeDtypeStruct((batch, num_kv, num_splits, gp, lanes), jnp.float32)]
  if count:
    out_shape.append(jax.ShapeDtypeStruct((batch, num_kv, num_splits, gp, lanes), jnp.int32))
  row_spec = pl.BlockSpec((None, None, None, block_g, lanes),
                          lambda b, h, g, j, *_: (b, h, j, g, 0))
  out_specs = [pl.BlockSpec((None, None, None, block_g, hv),
                            lambda b, h, g, j, *_: (b, h, j, g, 0)), row_spec]
  out_specs += [row_spec] if count else []
  if schedule == "loop":
    compiler_params = None
    if not interpret and plgpu is not None:
      compiler_params = plgpu.CompilerParams(num_warps=num_warps or 4,
                                             num_stages=num_stages or 2)
    grid_kw = dict(grid=grid, in_specs=in_specs, out_specs=out_specs)
  else:
    if pltpu is None:  # pragma: no cover
      raise NotImplementedError("the \"grid\" schedule needs jax.experimental.pallas.tpu")
    scratch = [pltpu.VMEM((block_g, TPU_LANES), jnp.float32),
               pltpu.VMEM((block_g, TPU_LANES), jnp.float32),
               pltpu.VMEM((block_g, hv), jnp.float32)]
    scratch += [pltpu.VMEM((block_g, TPU_LANES), jnp.int32)] if count else []
    compiler_params = None
    if not interpret:
      compiler_params = pltpu.CompilerParams(
          dimension_semantics=("parallel", "parallel", "parallel", "parallel", "arbitrary"))
    grid_kw = dict(grid_spec=pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=num_scalar_prefetch, grid=grid, in_specs=in_specs,
        out_specs=out_specs, scratch_shapes=scratch))
  outs = pl.pallas_call(kernel, out_shape=out_shape, compiler_params=compiler_params,
                        interpret=interpret, name=name, **grid_kw)(*operands)
  outs = list(outs)
  outs[1] = outs[1][..., 0]
  if count:
    outs[2] = outs[2][..., 0]
  return tuple(outs)


def kv_block_index(split, step, lo, hi, blocks_per_split: int):
  """Key block fetched at grid step (split, step) of the "grid" schedule.

  The natural block `split * blocks_per_split + step` is clamped into the
  needed range `[lo, hi)`. Steps before the range fetch block `lo` (which the
  first needed step then reuses), steps after it repeat block `hi - 1` (which
  the last needed step already fetched), so the pipeline, which skips the copy
  when consecutive steps name the same block, reads each needed block once and
  nothing else. A length-0 row (`hi == lo == 0`) names block 0 throughout.
  """
  blk = split * blocks_per_split + step
  return jnp.minimum(jnp.maximum(blk, lo), jnp.maximum(hi - 1, lo))


def merge_splits(out, lse):
  """Flash-decoding merge of `P` partials over axis 2:
  `out = sum_j exp(lse_j - lse) out_j`, `lse = logsumexp_j lse_j`.

  Args:
    out: f32[B, K, P, Gp, Hv] normalised partial outputs (zeros when empty).
    lse: f32[B, K, P, Gp] their log-sum-exp (-inf when empty).

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
# Wrapper helpers (inside the jitted implementations).
# ----------------------------------------------------------------------------


def dot_dtype(q_dtype, cache_dtype):
  """The dtype of the kernel's dots: the cache dtype for a float cache (q is cast to
  it); for a quantized cache, q's dtype when it is bf16/f16, else f32."""
  if jnp.dtype(cache_dtype) not in QUANT_DTYPES:
    return jnp.dtype(cache_dtype)
  q_dtype = jnp.dtype(q_dtype)
  return q_dtype if q_dtype in (jnp.bfloat16, jnp.float16) else jnp.dtype(jnp.float32)


def group_queries(q, num_kv: int, gp: int, dtype, schedule: str = "grid"):
  """`[B, N, X]` -> `[B, K, Gp, X']` in `dtype`, G zero-padded to the tile multiple Gp
  and X to `padded_width(X, schedule)` (zero lanes)."""
  batch, num_heads, width = q.shape
  groups = num_heads // num_kv
  q = q.astype(dtype).reshape(batch, num_kv, groups, width)
  return jnp.pad(q, ((0, 0), (0, 0), (0, gp - groups),
                     (0, padded_width(width, schedule) - width)))


def scale_columns(scales):
  """Per-slot scales `f32[..., S]` (None entries kept) as `f32[..., S, 1]`, so a
  loaded block's scales are a `[bk, 1]` column broadcasting over its width."""
  return tuple(None if x is None else x.astype(jnp.float32)[..., None] for x in scales)


def finish(outs, num_heads: int, groups: int, out_dtype, return_lse: bool, count: bool,
           value_width: int | None = None):
  """Merges the per-split partials into `[B, N, Hv]` (and `f32[B, N]` lse), dropping
  the G padding rows and the value lanes past `value_width` (a padded head dim);
  with `count`, also the `i32[B, K]` blocks processed (summed over splits, from G
  tile 0)."""
  out, lse = merge_splits(outs[0], outs[1])
  batch = out.shape[0]
  out = out[:, :, :groups, :value_width]
  out = out.reshape(batch, num_heads, out.shape[-1]).astype(out_dtype)
  lse = lse[:, :, :groups].reshape(batch, num_heads)
  result = (out, lse) if return_lse else out
  if count:
    return result, jnp.sum(outs[2][:, :, :, 0], axis=2)
  return result


# ----------------------------------------------------------------------------
# Schedule and platform checks (the argument checks are in `attention_common`).
# ----------------------------------------------------------------------------


def check_schedule(schedule, interpret, tunables=(), platform_name=None):
  """Checks `schedule` and the positive-int `tunables` (`(name, value)` pairs) and
  returns the schedule to run: the given one, or the default of `platform_name`.

  `platform_name` is the platform the call is lowered for (None: the default
  backend), not necessarily the host's: a CPU host can lower for "cuda" or "tpu"
  (`jax.jit(f).trace(...).lower(lowering_platforms=(...))`) but not run it.
  Compiled runs (`interpret=False`) need a GPU ("loop", Triton) or TPU ("grid",
  Mosaic) target.
  """
  if schedule is not None and schedule not in SCHEDULES:
    raise ValueError(f"schedule must be one of {SCHEDULES} or None; got {schedule!r}")
  for name, value in tunables:
    attention_common.optional_positive_int(name, value)
  where = target_platform(platform_name)
  schedule = schedule or default_schedule(where)
  if not interpret:
    wanted = dict.fromkeys(GPU_PLATFORMS, "loop") | {"tpu": "grid"}
    if where not in wanted:
      raise ValueError(f"interpret=False needs a GPU or TPU; the target platform is "
                       f"{where!r} (pass interpret=True to run on CPU, or platform='cuda' "
                       f"or 'tpu' to lower for one)")
    if schedule != wanted[where]:
      raise ValueError(f"schedule {schedule!r} does not compile on {where}; use "
                       f"{wanted[where]!r} (or interpret=True)")
  return schedule


def compiled_reason(platform_name: str, dtype, widths, *, pads_widths: bool = False
                    ) -> str | None:
  """Why a compiled kernel cannot take this cache dtype and these dot widths
  (`(what, size)` pairs), or None: GPU (Triton) needs powers of two >= 16 (any width
  when the kernel pads them, `pads_widths`) and f32/bf16/f16/int8/fp8; TPU (Mosaic)
  multiples of 64 (lanes) and f32/bf16/int8."""
  dtype = jnp.dtype(dtype)
  if platform_name in GPU_PLATFORMS:
    for what, d in () if pads_widths else widths:
      if d < 16 or not is_pow2(d):
        return f"{what}={d} is not a power of two >= 16 (Triton dot)"
    if dtype not in _GPU_DTYPES:
      return f"dtype {dtype} is not f32/bf16/f16 or a quantized format (int8/fp8)"
    return None
  if platform_name == "tpu":
    if dtype not in _TPU_DTYPES:
      return f"dtype {dtype} is not f32/bf16/int8 on TPU"
    for what, d in widths:
      if d % 64:
        return f"{what}={d} is not a multiple of 64 (TPU lanes)"
    return None
  return f"no compiled Pallas backend on {platform_name!r}"
