"""int8 weights and activations (W8A8) through XLA's s8 x s8 -> s32 dots.

A linear layer `y = x @ W` with `W: f32[*in, *out]` is quantized to

  * `w_q: int8[*in, *out]`, `round(W / w_scale)` in [-127, 127] (stored
    packed: `pack_weight`, below), and
  * `w_scale: f32[*out]`, one scale per output channel: `max |W[..., o]| / 127`
    over the input axes (symmetric absmax, as in LLM.int8(), Dettmers et al.
    2022, and SmoothQuant's W8A8 baseline, Xiao et al. 2023).

At run time each activation row (one token) is quantized on the fly with its
own scale `x_scale = max |x_row| / 127` (per-token dynamic quantization), the
int8 rows and the int8 weights are multiplied with int32 accumulation, and
the product is rescaled: `y ~= (x_q @ w_q) * x_scale[:, None] * w_scale[None, :]`
(`int8_dot`). The accumulation is exact (|sum| <= K * 127^2 < 2^31 for
K < 133,000), so the only errors are the two roundings.

Why this form: XLA:CPU hands a `lax.dot_general(s8[M, K], s8[K, N],
preferred_element_type=s32)` of 2-D operands without batch dimensions to its
fast integer GEMM (YNNPACK), which reads the weights at 4x fewer bytes than f32
(docs/benchmarks.md, issue 31). With a single row (M = 1: batch-1 decode) XLA
takes a slow path (~10x slower than f32 on SmolLM2's shapes), so `int8_dot`
pads one row to `MIN_ROWS` = 2. Every product flattens the activation to 2-D
`[M, K]` and the weight to 2-D.

Stored form (`pack_weight`): YNNPACK repacks the right operand of an s8 x s8
dot (interleaving 4 rows of K for its kernels) on every call, and at decode's
2 rows that repacking is ~85% of the dot's time (a perf profile:
`ynn::interleave4_x8_avx512` against `ynn::dot_int8_int8_int32_2x64x4`).
It reads a left operand in place. So the model stores each weight output-major,
as `uint8[*out, *in] = w_q + 128`, and multiplies it as the left operand of a
u8 x s8 -> s32 dot (`u8s8_dot`, which XLA:CPU runs with YNNPACK's AVX512-VNNI
u8 x s8 kernels, no packing of the weight), subtracting `128 * sum_k x_q`:
the same int32 accumulator, so the same values bit for bit. (Prefill's many
rows amortize the packing; there the left-operand form is ~1.2x slower than the
s8 x s8 one, a cost taken for one exact code path: docs/benchmarks.md.)

`google/qwix` 0.1.8 (the JAX quantization library) emits the same dots but was
not used: its PTQ wraps each weight in a `WithAux` object that only its
intercepted `einsum`/`dot_general` understands, so the model's own code
(`jnp.take` of the tied embedding, `w.astype(...)` before the einsum) fails on
it, and it does not pad the one-row case out of XLA's slow path.

Quantized weights (`quantize_model`; stored packed, `pack_weight`): the
attention projections (GQA q/k/v/o; MLA's q, q_down, q_up, kv_down and o --
its absorbed `k_up`/`v_up` products contract over a non-leading axis and stay
f32), the SwiGLU gate/up/down and the LM head. A tied embedding is stored once
(packed `uint8[V, D]`, its layout kept) with one scale per token row: the LM
head is `int8_dot` against its rows and the input embedding stays a gather (of
its rows minus the offset, times their scales). Norm scales and biases stay
f32. Compute (activations, attention, caches) is unchanged.

Non-finite activations: a row with NaN or inf gets scale NaN, so its output
row is NaN (never a plausible finite value); other rows are unaffected (rows
are quantized independently, so right padding cannot disturb real tokens).
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.extend import core as jax_core
from jax.extend.mlir import ir
from jax.extend.mlir.dialects import stablehlo
from jax.interpreters import mlir

INT8_MAX = 127
MIN_ROWS = 2
"""Activation rows `int8_dot` pads a one-row product to (XLA:CPU's fast s8 GEMM path)."""

INT8 = jnp.dtype(jnp.int8)
UINT8 = jnp.dtype(jnp.uint8)
WEIGHT_OFFSET = 128
"""A stored (packed) weight holds `w_q + WEIGHT_OFFSET` as uint8 (`pack_weight`)."""


def is_int8(dtype: Any) -> bool:
  """True when `dtype` names int8 (the W8A8 `param_dtype`)."""
  try:
    return jnp.dtype(dtype) == INT8
  except TypeError:
    return False


def quantize_weight(w: jax.Array, num_in: int) -> tuple[jax.Array, jax.Array]:
  """`(w_q int8[*in, *out], w_scale f32[*out])` of `w: float[*in, *out]` (module doc).

  Args:
    w: the float weight; its first `num_in` axes are the input (contracted) axes.
    num_in: number of leading input axes (>= 1, < w.ndim).

  An all-zero output channel gets scale 1 (and stays exactly 0).

  Raises:
    ValueError: `num_in` out of range, or a non-finite weight (names the count).
  """
  if not 1 <= num_in < w.ndim:
    raise ValueError(f"num_in must lie in [1, {w.ndim - 1}] for a weight of shape "
                     f"{tuple(w.shape)}; got {num_in}")
  w = jnp.asarray(w, jnp.float32)
  absmax = jnp.max(jnp.abs(w), axis=tuple(range(num_in)))
  scale = jnp.where(absmax > 0, absmax / INT8_MAX, 1.0).astype(jnp.float32)
  if not bool(jnp.all(jnp.isfinite(absmax))):
    bad = int(jnp.sum(~jnp.isfinite(absmax)))
    raise ValueError(f"w must be finite to quantize; {bad} output channels hold NaN or inf")
  w_q = jnp.clip(jnp.round(w / scale), -INT8_MAX, INT8_MAX).astype(jnp.int8)
  return w_q, scale


def quantize_rows(x: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Per-row dynamic quantization: `(x_q int8[M, K], x_scale f32[M])` of `x: float[M, K]`.

  `x_scale = max |x_row| / 127` (1 for an all-zero row; NaN for a row with a
  NaN or inf, whose values are then 0).
  """
  x = x.astype(jnp.float32)
  absmax = jnp.max(jnp.abs(x), axis=-1)
  finite = jnp.isfinite(absmax)
  scale = jnp.where(absmax > 0, absmax / INT8_MAX, 1.0)
  q = jnp.where(finite[:, None], jnp.round(x / jnp.where(finite, scale, 1.0)[:, None]), 0)
  q = jnp.clip(q, -INT8_MAX, INT8_MAX).astype(jnp.int8)
  return q, jnp.where(finite, scale, jnp.nan).astype(jnp.float32)


def _rows(x: jax.Array, num_in_axes: int) -> tuple[jax.Array, tuple[int, ...]]:
  lead, features = x.shape[:x.ndim - num_in_axes], x.shape[x.ndim - num_in_axes:]
  return x.reshape((int(np.prod(lead, dtype=np.int64)), int(np.prod(features)))), lead


def int8_dot(x: jax.Array, w_q: jax.Array, w_scale: jax.Array, *,
             transposed: bool = False) -> jax.Array:
  """`f32[*lead, *out] ~= x @ W` for a weight quantized by `quantize_weight`.

  Args:
    x: `float[*lead, *in]` activations (any float dtype).
    w_q: the weight in one of three forms: `int8[*in, *out]` (`quantize_weight`'s);
      with `transposed` `int8[*out, *in]` (an unpacked tied embedding table `[V, D]`);
      or, as the model stores it, `uint8[*out, *in]` (`pack_weight`: output channels
      first, `w_q + 128`), which takes the fast form below (`transposed` is ignored:
      a packed weight is always output-major).
    w_scale: `f32[*out]` per-output-channel scales.
    transposed: an int8 weight's input axes are its trailing ones.

  The rows of `x` are flattened to `[M, K]`, quantized per row
  (`quantize_rows`) and padded to `MIN_ROWS` rows when M = 1. An int8 weight
  is multiplied as the right operand of one 2-D s8 x s8 -> s32
  `lax.dot_general`; a packed weight as the left operand of a u8 x s8 -> s32
  dot (`u8s8_dot`, `uint8[N, K] . int8[M, K]^T`), minus `128 * sum_k x_q`
  per row, which is the same int32 accumulator. Then
  `acc * x_scale[:, None] * w_scale[None, :]` in f32. All forms give the same
  values bit for bit.

  Raises:
    ValueError: x's trailing axes do not hold the weight's input features.
  """
  if jnp.dtype(w_q.dtype) == UINT8:
    return _packed_dot(x, w_q, w_scale)
  out_shape = w_scale.shape
  num_in = w_q.ndim - w_scale.ndim
  k = int(np.prod(w_q.shape[len(out_shape):] if transposed else w_q.shape[:num_in]))
  x2, lead = _rows(x, num_in)
  _check_features(x, x2, k, w_q)
  w2 = w_q.reshape((-1, k) if transposed else (k, -1))
  x_q, x_scale = quantize_rows(x2)
  m = x_q.shape[0]
  if m == 1:
    x_q = jnp.pad(x_q, ((0, MIN_ROWS - 1), (0, 0)))
  dims = (((1,), (1,)), ((), ())) if transposed else (((1,), (0,)), ((), ()))
  acc = jax.lax.dot_general(x_q, w2, dims, preferred_element_type=jnp.int32)[:m]
  y = acc.astype(jnp.float32) * x_scale[:, None] * w_scale.reshape(1, -1)
  return y.reshape(lead + out_shape)


def _check_features(x, x2, k, w):
  if x2.shape[1] != k:
    raise ValueError(f"x's trailing axes must hold the weight's {k} input features; got x of "
                     f"shape {tuple(x.shape)} for a weight of shape {tuple(w.shape)}")


def _packed_dot(x: jax.Array, w_p: jax.Array, w_scale: jax.Array) -> jax.Array:
  """`int8_dot` of a packed `uint8[*out, *in]` weight (`pack_weight`)."""
  return _packed_dots(x, ((w_p, w_scale),))[0]


def int8_dots(x: jax.Array, weights: Sequence[tuple[jax.Array, jax.Array]]
              ) -> list[jax.Array]:
  """`[int8_dot(x, w_q, w_scale) for w_q, w_scale in weights]` for weights that share their
  input axes (q/k/v; gate/up). When every weight is packed (`uint8[*out, *in]`,
  `pack_weight`, as the model stores them) `x` is quantized once and each weight is its
  own u8 x s8 dot, read where it is stored; each result equals `int8_dot`'s bit for bit.

  One dot per weight, not one dot of the weights concatenated: XLA:CPU did not hoist
  the concatenation of q/k/v out of the decode loop (2.3 MB written per layer and step
  at SmolLM2's shapes), and hoisted gate/up only to copy them on every call
  (docs/benchmarks.md, "Decode step cost").

  Raises:
    ValueError: x's trailing axes do not hold a weight's input features.
  """
  if all(jnp.dtype(w.dtype) == UINT8 for w, _ in weights):
    return _packed_dots(x, weights)
  return [int8_dot(x, w, s) for w, s in weights]


def _packed_dots(x: jax.Array, weights: Sequence[tuple[jax.Array, jax.Array]]
                 ) -> list[jax.Array]:
  """`int8_dots` of packed weights: one quantization of `x`, one u8 x s8 dot per weight."""
  w0, s0 = weights[0]
  num_out = s0.ndim
  k = int(np.prod(w0.shape[num_out:]))
  x2, lead = _rows(x, w0.ndim - num_out)
  for w_p, w_scale in weights:
    _check_features(x, x2, int(np.prod(w_p.shape[w_scale.ndim:])), w_p)
  x_q, x_scale = quantize_rows(x2)
  m = x_q.shape[0]
  if m == 1:
    x_q = jnp.pad(x_q, ((0, MIN_ROWS - 1), (0, 0)))
  # The offset's share, subtracted before the transpose: XLA would otherwise turn the
  # transpose of the dot into the swapped product s8 x u8, which XLA:CPU cannot run.
  offset = WEIGHT_OFFSET * jnp.sum(x_q.astype(jnp.int32), axis=1)[None, :]
  out = []
  for w_p, w_scale in weights:
    acc = u8s8_dot(w_p.reshape(-1, k), x_q) - offset  # s32[N, M']: sum_k w_q x_q
    y = acc.T[:m].astype(jnp.float32) * x_scale[:, None] * w_scale.reshape(1, -1)
    out.append(y.reshape(lead + w_scale.shape))
  return out


# ----------------------------------------------------------------------------------------------
# The u8 x s8 -> s32 product (XLA:CPU's VNNI kernels, weights read in place).

_u8s8_dot_p = jax_core.Primitive("kvattn_u8s8_dot")


def u8s8_dot(a: jax.Array, b: jax.Array) -> jax.Array:
  """`s32[N, M] = a @ b^T` of `a: uint8[N, K]` and `b: int8[M, K]`, exact.

  JAX's own `lax.dot_general` converts mixed integer operands to a common type, so this
  primitive emits the mixed `stablehlo.dot_general` itself; XLA:CPU hands it to
  YNNPACK's u8 x s8 (AVX512-VNNI) kernels with `a` as the left operand, read as
  stored (no per-call packing of the weights, which the s8 x s8 form with the weights
  on the right pays on every call: docs/benchmarks.md, issue 31). Other platforms
  (and eager calls) lower it to an int32 `dot_general`. No autodiff or vmap rules
  (the int8 model is not trained).

  Raises:
    TypeError: operands that are not uint8[N, K] and int8[M, K].
  """
  if (jnp.dtype(a.dtype) != UINT8 or jnp.dtype(b.dtype) != INT8 or a.ndim != 2 or b.ndim != 2
      or a.shape[1] != b.shape[1]):
    raise TypeError(f"u8s8_dot takes uint8[N, K] and int8[M, K]; got {a.dtype}{list(a.shape)} "
                    f"and {b.dtype}{list(b.shape)}")
  return _u8s8_dot_p.bind(a, b)


def _u8s8_reference(a, b):
  return jax.lax.dot_general(a.astype(jnp.int32), b.astype(jnp.int32), (((1,), (1,)), ((), ())))


def _u8s8_abstract(a, b):
  return jax.core.ShapedArray((a.shape[0], b.shape[0]), jnp.int32)


def _u8s8_lower_cpu(ctx, a, b):
  (out,) = ctx.avals_out
  dims = stablehlo.DotDimensionNumbers.get(
      lhs_batching_dimensions=[], rhs_batching_dimensions=[], lhs_contracting_dimensions=[1],
      rhs_contracting_dimensions=[1])
  result = ir.RankedTensorType.get(out.shape, ir.IntegerType.get_signless(32))
  return [stablehlo.DotGeneralOp(result, a, b, dims).result]


_u8s8_dot_p.def_abstract_eval(_u8s8_abstract)
_u8s8_dot_p.def_impl(lambda a, b: jax.jit(_u8s8_reference)(a, b))
mlir.register_lowering(_u8s8_dot_p, mlir.lower_fun(_u8s8_reference, multiple_results=False))
mlir.register_lowering(_u8s8_dot_p, _u8s8_lower_cpu, platform="cpu")


def pack_weight(w_q: jax.Array, num_in: int) -> jax.Array:
  """The stored form of `w_q: int8[*in, *out]` (its first `num_in` axes the input axes):
  `uint8[*out, *in]`, `w_q + WEIGHT_OFFSET`, output channels first (what `int8_dot`'s
  fast form reads in place). `unpack_weight` inverts it."""
  axes = tuple(range(num_in, w_q.ndim)) + tuple(range(num_in))
  return (jnp.transpose(w_q, axes).astype(jnp.int16) + WEIGHT_OFFSET).astype(jnp.uint8)


def unpack_weight(w_p: jax.Array, num_out: int) -> jax.Array:
  """`pack_weight`'s inverse: `int8[*in, *out]` of `w_p: uint8[*out, *in]`."""
  axes = tuple(range(num_out, w_p.ndim)) + tuple(range(num_out))
  return (jnp.transpose(w_p, axes).astype(jnp.int16) - WEIGHT_OFFSET).astype(jnp.int8)


def unpacked_model(model: nnx.Module) -> nnx.Module:
  """A copy of a W8A8 model with every stored weight back in the plain int8 form
  (`int8[*in, *out]`; the tied table `int8[V, D]`), which `int8_dot` runs as s8 x s8 dots
  instead of the packed form's u8 x s8: the same integer products (tests compare the two;
  experiments/benchmarks/int8_layout.py times them). The model is not changed."""
  out = nnx.clone(model)
  for _, module in nnx.iter_graph(out):
    if not isinstance(module, nnx.Module):
      continue
    for name, _ in QUANTIZED_WEIGHTS.get(type(module).__name__, ()):
      w, s = getattr(module, name, None), getattr(module, name + "_scale", None)
      if w is not None and s is not None:
        setattr(module, name, nnx.Param(unpack_weight(w[...], s[...].ndim)))
  out.embedding = nnx.Param(unpack_weight(out.embedding[...], 1).T)
  return out


def int8_dot_reference(x: jax.Array, w_q: jax.Array, w_scale: jax.Array, *,
                       transposed: bool = False) -> jax.Array:
  """Pure-jnp reference of `int8_dot`: the same quantization, the product as an int32
  `jnp.matmul` (no s8 dot, no padding), the same rescaling -- equal to `int8_dot` exactly
  (a packed `uint8[*out, *in]` weight is used as `w_p - WEIGHT_OFFSET`, output-major)."""
  num_in = w_q.ndim - w_scale.ndim
  x2, lead = _rows(x, num_in)
  k = x2.shape[1]
  if jnp.dtype(w_q.dtype) == UINT8:
    w_q, transposed = w_q.astype(jnp.int32) - WEIGHT_OFFSET, True
  w2 = w_q.reshape((-1, k) if transposed else (k, -1)).astype(jnp.int32)
  x_q, x_scale = quantize_rows(x2)
  acc = jnp.matmul(x_q.astype(jnp.int32), w2.T if transposed else w2)
  y = acc.astype(jnp.float32) * x_scale[:, None] * w_scale.reshape(1, -1)
  return y.reshape(lead + w_scale.shape)


def dequantize_weight(w_q: jax.Array, w_scale: jax.Array, *, transposed: bool = False
                      ) -> jax.Array:
  """`f32` weight `w_q * w_scale` (the scale broadcast over the input axes), in w_q's layout
  (a packed `uint8[*out, *in]` weight: minus its offset, output-major)."""
  if jnp.dtype(w_q.dtype) == UINT8:
    w_q, transposed = w_q.astype(jnp.int32) - WEIGHT_OFFSET, True
  if transposed:
    return w_q.astype(jnp.float32) * w_scale.reshape(w_scale.shape + (1,) * (
        w_q.ndim - w_scale.ndim))
  return w_q.astype(jnp.float32) * w_scale


# ----------------------------------------------------------------------------------------------
# Modules: which weights are quantized, and the projection helper the modules call.


def project(spec: str, x: jax.Array, w: Any, w_scale: Any, dtype: Any) -> jax.Array:
  """`einsum(spec, x, w)` in f32, through `int8_dot` when the weight is int8 (`w_scale` set).

  `spec` contracts x's trailing axes with w's leading axes (e.g.
  "BTD,DNH->BTNH"); `w` / `w_scale` are nnx Variables or arrays.
  """
  w = w[...] if isinstance(w, nnx.Variable) else w
  if w_scale is None:
    return jnp.einsum(spec, x.astype(dtype), w.astype(dtype),
                      preferred_element_type=jnp.float32)
  w_scale = w_scale[...] if isinstance(w_scale, nnx.Variable) else w_scale
  return int8_dot(x, w, w_scale)


def quantize_param(module: nnx.Module, name: str, num_in: int) -> None:
  """Replaces float Param `module.<name>` (`[*in, *out]`) by its packed int8 values
  (`pack_weight`: `uint8[*out, *in]`) and sets `module.<name>_scale: f32[*out]`."""
  w_q, scale = quantize_weight(getattr(module, name)[...], num_in)
  setattr(module, name, nnx.Param(pack_weight(w_q, num_in)))
  setattr(module, name + "_scale", nnx.Param(scale))


QUANTIZED_WEIGHTS = {
    "GroupedQueryAttention": (("q_proj", 1), ("k_proj", 1), ("v_proj", 1), ("o_proj", 2)),
    "MultiHeadLatentAttention": (("q_proj", 1), ("q_down_proj", 1), ("q_up_proj", 1),
                                 ("kv_down_proj", 1), ("o_proj", 2)),
    "SwiGLU": (("gate", 1), ("up", 1), ("down", 1)),
}
"""Module class name -> (weight attribute, number of leading input axes) quantized by
`quantize_model`."""


def quantize_module(module: nnx.Module) -> None:
  """Quantizes (in place) the weights `QUANTIZED_WEIGHTS` lists for `module`'s class."""
  for name, num_in in QUANTIZED_WEIGHTS.get(type(module).__name__, ()):
    if getattr(module, name, None) is not None:
      quantize_param(module, name, num_in)
