"""KV-cache quantization: int8 and fp8 values with one f32 scale per vector.

Symmetric absmax scaling per token per head (LLM.int8(), Dettmers et al. 2022; the fp8
KV caches of TensorRT-LLM / vLLM): `scale = max_h |x_h| / format_max`, or a static
scale. A vector with NaN / inf gets scale NaN and values 0; an all-zero one scale 1.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kvattn import _checks
from pallas_kernels.attention_common import (FORMAT_MAX, QUANT_DTYPES,  # noqa: F401
                                             QUANT_NAMES, is_quantized)

SCALE_DTYPE = jnp.dtype(jnp.float32)


def _as_dtype(name: str, dtype: Any) -> jnp.dtype:
  try:
    return jnp.dtype(dtype)
  except TypeError as e:
    raise TypeError(f"{name} must be a JAX dtype; got {dtype!r}") from e


def check_quant_dtype(dtype: Any, name: str = "dtype") -> jnp.dtype:
  """`dtype` as a jnp.dtype; TypeError unless one of `QUANT_NAMES`."""
  dtype = _as_dtype(name, dtype)
  if dtype not in FORMAT_MAX:
    raise TypeError(f"{name} must be one of the quantized KV formats {QUANT_NAMES}; got "
                    f"{dtype.name}")
  return dtype


def format_max(dtype: Any) -> float:
  """Largest finite value of a quantized format: 127, 448 or 57344."""
  return FORMAT_MAX[check_quant_dtype(dtype)]


def _check_static_scale(scale: Any, batch_shape: tuple[int, ...]) -> jax.Array:
  if isinstance(scale, bool):
    raise TypeError(f"scale must be a positive float or array; got {scale!r}")
  try:
    scale = jnp.asarray(scale)
  except TypeError:
    raise TypeError(f"scale must be a positive float or array; got {scale!r}") from None
  if not (jnp.issubdtype(scale.dtype, jnp.floating) or jnp.issubdtype(scale.dtype, jnp.integer)):
    raise TypeError(f"scale must be a positive float or array; got dtype {scale.dtype}")
  try:
    fits = np.broadcast_shapes(scale.shape, batch_shape) == tuple(batch_shape)
  except ValueError:
    fits = False
  if not fits:
    raise ValueError(f"scale must broadcast to x.shape[:-1] = {batch_shape}; got shape "
                     f"{tuple(scale.shape)}")
  if _checks.is_concrete(scale):
    host = np.asarray(scale, np.float64)
    if not (np.all(host > 0) and np.all(np.isfinite(host))):
      raise ValueError(f"scale must be positive and finite; got {host.ravel()[:8].tolist()}")
  return jnp.broadcast_to(scale.astype(SCALE_DTYPE), batch_shape)


def quantize_kv(
    x: jax.Array,  # [..., H]
    dtype: Any,
    *,
    scale: Any = None,  # f32 scalar or broadcastable to x.shape[:-1]
) -> tuple[jax.Array, jax.Array]:
  """`(values, scales)`: `x: [..., H]` float in `dtype` with `scales f32[x.shape[:-1]]`,
  `dequantize_kv(values, scales) ~= x`.

  `scale`: None for absmax scaling, or a static positive scale broadcastable to
  `x.shape[:-1]` (values beyond `scale * format_max` clamped).

  Raises:
    TypeError: `dtype` not a quantized format, x not floating, a non-numeric scale.
    ValueError: x of rank 0, a scale not positive and finite or not broadcastable.
  """
  dtype = check_quant_dtype(dtype)
  if not hasattr(x, "ndim"):
    x = jnp.asarray(x)
  if x.ndim < 1:
    raise ValueError(f"x must have rank >= 1 [..., H]; got shape {tuple(x.shape)}")
  _checks.floating("x", x)
  top = FORMAT_MAX[dtype]
  xf = x.astype(jnp.float32)
  if scale is None:
    absmax = jnp.max(jnp.abs(xf), axis=-1)
    scales = absmax / top
    # An all-zero vector (or one whose scale underflows f32) would divide by 0: scale 1 keeps
    # it exactly zero (0 / 1 = 0). Tiny nonzero scales are kept as they are (full resolution).
    scales = jnp.where(scales > 0, scales, 1.0).astype(SCALE_DTYPE)
  else:
    scales = _check_static_scale(scale, tuple(x.shape[:-1]))
  scaled = jnp.clip(xf / scales[..., None], -top, top)  # never beyond the format: no inf/NaN
  if dtype == jnp.int8:
    scaled = jnp.round(scaled)
  # Non-finite vectors: values 0 and scale NaN (dequantize to NaN, whatever the cast of NaN).
  finite = jnp.all(jnp.isfinite(xf), axis=-1)
  scaled = jnp.where(finite[..., None], scaled, 0.0)
  scales = jnp.where(finite, scales, jnp.nan).astype(SCALE_DTYPE)
  return scaled.astype(dtype), scales


def dequantize_kv(
    values: jax.Array,  # [..., H] int8 / fp8
    scales: jax.Array,  # f32[...]
    dtype: Any = jnp.float32,
) -> jax.Array:
  """`values * scales[..., None]` in f32, returned in `dtype` (`[..., H]`).

  Raises:
    TypeError: `values` not a quantized format, `dtype` not floating, non-numeric scales.
    ValueError: `scales` not of shape `values.shape[:-1]`.
  """
  if not hasattr(values, "dtype"):
    raise TypeError(f"values must be an array; got {type(values).__name__}")
  check_quant_dtype(values.dtype, "values.dtype")
  if not hasattr(scales, "shape") or not hasattr(scales, "dtype"):
    try:
      scales = jnp.asarray(scales)
    except (TypeError, ValueError):
      raise TypeError(f"scales must be an array of numbers [values.shape[:-1]]; got "
                      f"{type(scales).__name__} {scales!r:.60}") from None
  if not (jnp.issubdtype(scales.dtype, jnp.floating) or jnp.issubdtype(scales.dtype, jnp.integer)):
    raise TypeError(f"scales must be an array of numbers; got dtype {scales.dtype}")
  dtype = _as_dtype("dtype", dtype)
  if not jnp.issubdtype(dtype, jnp.floating):
    raise TypeError(f"dtype must be a floating dtype; got {dtype.name}")
  if tuple(scales.shape) != tuple(values.shape[:-1]):
    raise ValueError(f"scales must have shape values.shape[:-1] = {tuple(values.shape[:-1])}; "
                     f"got {tuple(scales.shape)}")
  return (values.astype(jnp.float32) * scales.astype(jnp.float32)[..., None]).astype(dtype)


# ----------------------------------------------------------------------------------------------
# Moving stored values: narrow floats as integers.
#
# XLA:CPU has no bf16/f16/fp8 slice, update, scatter or gather: its float normalization runs
# them in f32, converting the WHOLE operand -- a converted copy of each layer's cache, and
# another back, on every decode step (2x the step of an f32 cache at B=4 x 4000 for bf16;
# docs/benchmarks.md, "Decode step cost"). Moving the same bits as unsigned integers is exact
# on every backend and free elsewhere (a bitcast), so every path that slices or writes stored
# keys and values goes through these.


def as_bits(x: jax.Array) -> jax.Array:
  """`x` bitcast to the unsigned int of its width when it is a float narrower than 32 bits
  (bf16, f16, fp8: `u16[...]` / `u8[...]`), else `x` unchanged."""
  dtype = jnp.dtype(x.dtype)
  if jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize < 4:
    return jax.lax.bitcast_convert_type(x, jnp.dtype(f"uint{8 * dtype.itemsize}"))
  return x


def from_bits(x: jax.Array, dtype: Any) -> jax.Array:
  """The inverse of `as_bits` for values stored as `dtype`."""
  return x if x.dtype == jnp.dtype(dtype) else jax.lax.bitcast_convert_type(x, dtype)


def read_stored(take: Any, x: jax.Array) -> jax.Array:
  """`take(x)` for an index-only `take` (slice, gather), run on `as_bits(x)`."""
  return from_bits(take(as_bits(x)), x.dtype)


def set_stored(buffer: jax.Array, index: Any, new: jax.Array, **kwargs: Any) -> jax.Array:
  """`buffer.at[index].set(new.astype(buffer.dtype), **kwargs)`, moved as `as_bits`."""
  dtype = buffer.dtype
  out = as_bits(buffer).at[index].set(as_bits(new.astype(dtype)), **kwargs)
  return from_bits(out, dtype)


def tree_as_bits(tree: Any) -> Any:
  """`as_bits` on every array leaf of `tree` (caches carried through a loop: the bitcasts at
  its ends then cancel those of the slices and writes inside)."""
  return jax.tree.map(lambda x: as_bits(x) if hasattr(x, "dtype") else x, tree)


def tree_from_bits(tree: Any, like: Any) -> Any:
  """The inverse of `tree_as_bits`, with `like` (the tree before it, or its shapes) giving
  each leaf's stored dtype."""
  return jax.tree.map(lambda x, ref: from_bits(x, ref.dtype) if hasattr(x, "dtype") else x,
                      tree, like)
