"""int8 weights and activations (W8A8) through XLA's integer dots.

Weights: `w_q = round(W / w_scale)`, `w_scale: f32[*out]` the absmax / 127 per output channel
(LLM.int8(), Dettmers et al. 2022; SmoothQuant's W8A8 baseline, Xiao et al. 2023), stored as
`uint8[*out, *in] = w_q + 128` (`pack_weight`). Each activation row is quantized by its own
absmax / 127; `y ~= (x_q @ w_q) * x_scale * w_scale` with exact int32 accumulation
(`int8_dot`); a row with NaN or inf comes out NaN. Why this form: docs/models.md.
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
  """`(w_q int8[*in, *out], w_scale f32[*out])` of `w: float[*in, *out]` whose first `num_in`
  axes are the input axes. An all-zero output channel gets scale 1.

  Raises:
    ValueError: `num_in` out of `[1, w.ndim)`, or a non-finite weight (names the count).
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
  """`(x_q int8[M, K], x_scale f32[M])` of `x: float[M, K]`, `x_scale = max |x_row| / 127`
  (1 for a zero row, NaN for a non-finite one)."""
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
    x: `float[*lead, *in]` activations.
    w_q: `int8[*in, *out]`; with `transposed`, `int8[*out, *in]`; or packed
      `uint8[*out, *in]` (`pack_weight`; `transposed` ignored). All give the same values.
    w_scale: `f32[*out]` per-output-channel scales.
    transposed: an int8 weight's input axes are its trailing ones.

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
  """`[int8_dot(x, w_q, w_scale) for w_q, w_scale in weights]` for weights sharing their
  input axes (q/k/v; gate/up), quantizing `x` once when every weight is packed; bit for bit
  `int8_dot`'s.

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
  """`s32[N, M] = a @ b^T` of `a: uint8[N, K]` and `b: int8[M, K]`, exact; a primitive
  emitting the mixed-type `stablehlo.dot_general` (int32 elsewhere and eagerly). No autodiff.

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
  """A copy of a W8A8 model with every weight in the plain `int8[*in, *out]` form (s8 x s8
  dots; the same integer products). The model is not changed."""
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
