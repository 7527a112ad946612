"""KV-cache quantization: int8 and fp8 values with f32 scales.

A quantized cache stores each token's key (and value) of one head as `H`
numbers in a 1-byte format plus one f32 scale, `x ~= values * scale`:

  * symmetric absmax scaling per token per head (as in LLM.int8(), Dettmers
    et al. 2022, and the fp8 KV caches of TensorRT-LLM / vLLM): `scale =
    max_h |x_h| / format_max`, so the largest entry maps onto the format's
    largest finite value (int8: 127, float8_e4m3fn: 448, float8_e5m2: 57344)
    and the format's whole range serves every token whatever its magnitude;
  * or a static per-tensor scale (`scale=`: e.g. calibrated offline, the
    `k_scale`/`v_scale` of fp8 checkpoints); values beyond `scale * max`
    are clamped.

Formats (`QUANT_DTYPES`):
  * int8: `round(x / scale)` (round half to even) in [-127, 127] (symmetric:
    -128 is never used). Error per entry <= scale / 2 = absmax / 254.
  * float8_e4m3fn (3 mantissa bits, max 448, no inf) and float8_e5m2 (2
    mantissa bits, max 57344): `x / scale` clamped to [-max, max] and rounded
    to nearest by the cast. Relative error <= 2^-4 (e4m3) / 2^-3 (e5m2) of
    the entry (half a step of 2^-3 / 2^-2) for entries in the normal range;
    entries below the normal range (< 2^-6 / 2^-14 of `max * scale`) have an
    absolute error of at most half a subnormal step times the scale.

Non-finite inputs: a vector (one token of one head) with any NaN or inf
entry is not representable; it gets scale NaN and values 0, so it
dequantizes to all-NaN and a reader sees NaN where a float cache would have
held NaN/inf (never a plausible finite vector). Other vectors are unaffected.

Guarantees: values are clamped to the format's range before the cast, so
finite inputs never give inf/NaN; an all-zero token gets scale 1 and stays
exactly zero; a token with a tiny absmax (0.05, 1e-30) keeps the format's
full resolution (the scale is never clamped to >= 1); the scale returned is
the one a reader must use (`dequantize_kv(values, scales)` and the decode
paths multiply by exactly it). Scales are f32: 4 bytes per token per head,
counted by `kvattn.memory`.
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
  """Returns `dtype` as a jnp.dtype if it is a quantized KV format.

  Raises:
    TypeError: `dtype` is not a dtype, or not one of `QUANT_NAMES`.
  """
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
  """Quantizes keys/values to a 1-byte format with one scale per vector.

  Args:
    x: `[..., H]` floating keys, values or latents; the last axis (head dim,
      MLA's C or R) shares one scale, every other axis (token, head) gets its
      own. A vector with a NaN or inf entry gets scale NaN and values 0
      (it dequantizes to NaN; see the module doc); no error is raised, so
      this works under jit.
    dtype: `int8`, `float8_e4m3fn` or `float8_e5m2`.
    scale: None for dynamic absmax scaling (`max_h |x_h| / format_max`, 1 for
      an all-zero vector), or a static positive scale -- a scalar (per
      tensor) or an array broadcastable to `x.shape[:-1]` (e.g. per head) --
      with which values beyond `scale * format_max` are clamped.

  Returns:
    `(values, scales)`: `values` in `dtype` with x's shape, `scales`
    `f32[x.shape[:-1]]`, such that `dequantize_kv(values, scales)` ~= x.

  Raises:
    TypeError: `dtype` is not a quantized format, x is not floating, or a
      non-numeric scale.
    ValueError: x has rank 0, or a scale that is not positive and finite or
      does not broadcast to `x.shape[:-1]`.
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
  """`values * scales[..., None]` computed in f32, returned in `dtype` (`[..., H]`).

  `scales` may be any array-like of numbers (a list, numpy array, scalar
  array); it is converted with `jnp.asarray`.

  Raises:
    TypeError: `values` is not a quantized format, `dtype` is not floating,
      or `scales` is not numeric.
    ValueError: `scales` is not `values.shape[:-1]`.
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
