"""What every attention path shares: constants, attended ranges, masks and argument checks.

The one definition of each of these for the whole repository: the kernels
(`pallas_kernels`), kvattn's XLA paths and dispatch points (`kvattn.ops`),
kvattn's modules (`kvattn._checks` re-exports the checks) and the tests import
them from here. Imports only jax and numpy (it is a leaf: `pallas_kernels`
never imports kvattn, and importing anything under `kvattn.` runs all of
kvattn's `__init__`).

Slot convention (DESIGN.md): one decode query per sequence sits at slot
`lengths[b] - 1` and attends `[max(0, lengths[b] - window), lengths[b])`;
lengths past the capacity S (a sticky overflow under jit) are clamped to S.

Every check raises before any compute, with a message that names the
argument, the value it got and what was expected (DESIGN.md, invariant 7).
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

# Running max of an online softmax before any key is seen. Finite (unlike -inf) so that
# `exp(m_prev - m_next)` is 0 or 1, never NaN, even for a block whose every logit is masked;
# a masked logit is -inf and contributes exp(-inf) = 0.
M_INIT = -0.7 * float(np.finfo(np.float32).max)

# Storage formats of a quantized cache (1-byte values, one f32 scale per slot) and the largest
# finite value of each, onto which a token's absmax is mapped (`kvattn.ops.quantize_kv`).
FORMAT_MAX: dict[Any, float] = {
    jnp.dtype(jnp.int8): 127.0,
    jnp.dtype(jnp.float8_e4m3fn): float(jnp.finfo(jnp.float8_e4m3fn).max),  # 448
    jnp.dtype(jnp.float8_e5m2): float(jnp.finfo(jnp.float8_e5m2).max),  # 57344
}
QUANT_DTYPES = tuple(FORMAT_MAX)
QUANT_NAMES = tuple(d.name for d in QUANT_DTYPES)


def is_quantized(dtype: Any) -> bool:
  """True for the storage dtypes that carry scales (int8, float8_e4m3fn, float8_e5m2)."""
  try:
    return jnp.dtype(dtype) in FORMAT_MAX
  except TypeError:
    return False


# ----------------------------------------------------------------------------
# Attended ranges and masks.
# ----------------------------------------------------------------------------


def attended_range(lengths: jax.Array, capacity: int,
                   window: int | None) -> tuple[jax.Array, jax.Array]:
  """`(starts, lengths)`, both `i32[B]`: the slots `[starts[b], lengths[b])` a decode query attends.

  `lengths` is clamped to `[0, capacity]` (never read past the cache) and
  `starts = max(0, lengths - window)` (0 without a window).
  """
  lengths = jnp.clip(jnp.asarray(lengths).astype(jnp.int32), 0, capacity)
  starts = jnp.zeros_like(lengths) if window is None else jnp.maximum(lengths - window, 0)
  return starts, lengths


def decode_mask(lengths: jax.Array, capacity: int, window: int | None) -> jax.Array:
  """`bool[B, S]`: True at the slots `attended_range` gives, False elsewhere."""
  starts, lengths = attended_range(lengths, capacity, window)
  slots = jnp.arange(capacity, dtype=jnp.int32)[None, :]  # [1, S]
  return (slots >= starts[:, None]) & (slots < lengths[:, None])


# ----------------------------------------------------------------------------
# Checks of single arguments.
# ----------------------------------------------------------------------------


def positive_int(name: str, value: Any) -> int:
  """Returns `value` as an int, or raises if it is not a positive integer."""
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
    raise TypeError(f"{name} must be a positive int; got {value!r} of type {type(value).__name__}")
  if value <= 0:
    raise ValueError(f"{name} must be a positive int; got {value}")
  return int(value)


def optional_positive_int(name: str, value: Any) -> int | None:
  """None, or `value` checked by `positive_int`."""
  return None if value is None else positive_int(name, value)


def positive_float(name: str, value: Any) -> float:
  """`value` as a float; TypeError unless a real number, ValueError unless > 0 and finite."""
  if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
    raise TypeError(f"{name} must be a positive float; got {value!r}")
  if not (value > 0 and math.isfinite(value)):
    raise ValueError(f"{name} must be a positive finite float; got {value}")
  return float(value)


def optional_positive_float(name: str, value: Any) -> float | None:
  """None, or `value` checked by `positive_float`."""
  return None if value is None else positive_float(name, value)


def head_layout(num_heads: Any, num_kv_heads: Any) -> tuple[int, int, int]:
  """Validates a GQA head layout and returns (N, K, G) with G = N // K."""
  n = positive_int("num_heads", num_heads)
  k = positive_int("num_kv_heads", num_kv_heads)
  if n % k:
    raise ValueError(f"num_heads must be divisible by num_kv_heads; got {n} and {k}")
  return n, k, n // k


def rank(name: str, x: Any, expected: int, shape_doc: str) -> None:
  """Raises TypeError unless `x` is an array, ValueError unless it has rank `expected`."""
  if not hasattr(x, "ndim"):
    raise TypeError(f"{name} must be an array {shape_doc}; got {type(x).__name__}")
  if x.ndim != expected:
    raise ValueError(f"{name} must have rank {expected} {shape_doc}; got shape {tuple(x.shape)}")


def floating(name: str, x: Any) -> None:
  """Raises TypeError unless `x` has a floating dtype."""
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise TypeError(f"{name} must have a floating dtype; got {x.dtype}")


def integer(name: str, x: Any) -> None:
  """Raises TypeError unless `x` has an integer dtype."""
  if not jnp.issubdtype(x.dtype, jnp.integer):
    raise TypeError(f"{name} must have an integer dtype; got {x.dtype}")


def same_dtype(names: Sequence[str], arrays: Sequence[Any]) -> None:
  """Raises TypeError naming every array unless all `arrays` share one dtype."""
  dtypes = [a.dtype for a in arrays]
  if any(d != dtypes[0] for d in dtypes):
    listing = ", ".join(f"{n}={d}" for n, d in zip(names, dtypes))
    raise TypeError(f"{' and '.join(names)} must share one dtype; got {listing}")


def dim(name: str, x: Any, axis: int, expected: int, what: str) -> None:
  """Raises ValueError unless `x.shape[axis] == expected` (`what` names the axis)."""
  if x.shape[axis] != expected:
    raise ValueError(
        f"{name}.shape[{axis}] ({what}) must be {expected}; got shape {tuple(x.shape)}")


def lengths_arg(name: str, x: Any, batch: int, default: int) -> jax.Array:
  """An `i32[B]` lengths-like argument (host sequences accepted; None -> all `default`)."""
  if x is None:
    return jnp.full((batch,), default, jnp.int32)
  x = jnp.asarray(x)
  integer(name, x)
  if x.shape != (batch,):
    raise ValueError(f"{name} must have shape [B] = ({batch},); got {tuple(x.shape)}")
  return x.astype(jnp.int32)


def cache_dtype(name: str, x: Any) -> None:
  """A cache operand is floating or a quantized format (its scales are checked by `scales`)."""
  if not (jnp.issubdtype(x.dtype, jnp.floating) or is_quantized(x.dtype)):
    raise TypeError(f"{name} must have a floating dtype or a quantized KV format "
                    f"{QUANT_NAMES}; got {x.dtype}")


def scales(names: tuple[str, str], values: Any, scale: Any, slot_shape: tuple[int, ...],
           doc: str) -> None:
  """A (values, scales) pair: quantized values need f32 scales of `slot_shape`; float
  values come without scales.

  Raises:
    TypeError: a quantized cache without scales, scales for a float cache,
      non-float scales.
    ValueError: scales of the wrong shape.
  """
  vname, sname = names
  if scale is None:
    if is_quantized(values.dtype):
      raise TypeError(f"{vname} has the quantized dtype {values.dtype.name}: pass its per-slot "
                      f"scales {sname} {doc}")
    return
  if not hasattr(scale, "shape"):
    raise TypeError(f"{sname} must be an array {doc}; got {type(scale).__name__}")
  if not is_quantized(values.dtype):
    raise TypeError(f"{sname} is only for quantized caches {QUANT_NAMES}; {vname} has dtype "
                    f"{values.dtype.name}")
  if not jnp.issubdtype(scale.dtype, jnp.floating):
    raise TypeError(f"{sname} must have a floating dtype (f32); got {scale.dtype}")
  if tuple(scale.shape) != tuple(slot_shape):
    raise ValueError(f"{sname} must have shape {doc} = {tuple(slot_shape)}; got "
                     f"{tuple(scale.shape)}")


def kv_pair(names: tuple[str, str], k, v, k_scale, v_scale, doc: str, scale_doc: str) -> None:
  """A key / value cache pair: rank 4 (`doc` with H / Hv), floating or a quantized format
  with scales `scale_doc` of their first three axes, one dtype."""
  rank(names[0], k, 4, doc.format("H"))
  rank(names[1], v, 4, doc.format("Hv"))
  cache_dtype(names[0], k)
  cache_dtype(names[1], v)
  same_dtype(names, (k, v))
  scales((names[0], "k_scale"), k, k_scale, k.shape[:3], scale_doc)
  scales((names[1], "v_scale"), v, v_scale, k.shape[:3], scale_doc)


def options(window: Any, soft_cap: Any, sm_scale: Any) -> None:
  """ValueError/TypeError unless `window` is a positive int and `soft_cap` / `sm_scale`
  positive finite numbers (each may be None)."""
  optional_positive_int("window", window)
  optional_positive_float("soft_cap", soft_cap)
  optional_positive_float("sm_scale", sm_scale)


# ----------------------------------------------------------------------------
# Checks of a whole attention call (the public entry points run exactly one of these).
# ----------------------------------------------------------------------------


def check_dense_args(q, k, v, num_q_axes: int, window, soft_cap, sm_scale, k_scale=None,
                     v_scale=None) -> None:
  """Arguments of attention against a dense cache, `q: [B, T, N, H]` (`num_q_axes`
  2) or `[B, N, H]` (1), `k: [B, K, S, H]`, `v: [B, K, S, Hv]`.

  A quantized `k`/`v` (int8, fp8) needs `k_scale`/`v_scale` `f32[B, K, S]`;
  float caches come without scales.
  """
  q_doc = "[B, T, N, H]" if num_q_axes == 2 else "[B, N, H]"
  rank("q", q, 2 + num_q_axes, q_doc)
  kv_pair(("k", "v"), k, v, k_scale, v_scale, "[B, K, S, {}]", "f32[B, K, S]")
  floating("q", q)
  batch, num_kv_heads, capacity, head_dim = k.shape
  dim("q", q, 0, batch, "batch B, from k")
  dim("q", q, q.ndim - 1, head_dim, "head dim H, from k")
  dim("v", v, 0, batch, "batch B, from k")
  dim("v", v, 1, num_kv_heads, "KV heads K, from k")
  dim("v", v, 2, capacity, "slots S, from k")
  head_layout(q.shape[-2], num_kv_heads)
  options(window, soft_cap, sm_scale)


def check_decode_args(q, k, v, lengths, window, soft_cap, sm_scale, k_scale=None,
                      v_scale=None) -> jax.Array:
  """`check_dense_args` for one decode query per sequence (`q: [B, N, H]`) and its
  `lengths: i32[B]`; returns the lengths as an i32 array (not clamped)."""
  check_dense_args(q, k, v, 1, window, soft_cap, sm_scale, k_scale, v_scale)
  return lengths_arg("lengths", lengths, k.shape[0], k.shape[2])


def check_mla_args(q_latent, q_rope, c_kv, k_rope, num_q_axes: int, sm_scale, c_kv_scale=None,
                   k_rope_scale=None, window=None) -> None:
  """Arguments of absorbed MLA attention: `q_latent: [B, (T,) N, C]`, `q_rope: [B, (T,) N,
  R]`, `c_kv: [B, S, C]`, `k_rope: [B, S, R]`.

  A quantized latent cache (int8/fp8 `c_kv`, `k_rope`) needs `c_kv_scale` and
  `k_rope_scale`, each `f32[B, S]`; `sm_scale` is required, `window` optional.
  """
  q_doc = "[B, T, N, {}]" if num_q_axes == 2 else "[B, N, {}]"
  rank("q_latent", q_latent, 2 + num_q_axes, q_doc.format("C"))
  rank("q_rope", q_rope, 2 + num_q_axes, q_doc.format("R"))
  rank("c_kv", c_kv, 3, "[B, S, C]")
  rank("k_rope", k_rope, 3, "[B, S, R]")
  floating("q_latent", q_latent)
  floating("q_rope", q_rope)
  cache_dtype("c_kv", c_kv)
  cache_dtype("k_rope", k_rope)
  same_dtype(("c_kv", "k_rope"), (c_kv, k_rope))
  batch, capacity, latent = c_kv.shape
  scales(("c_kv", "c_kv_scale"), c_kv, c_kv_scale, (batch, capacity), "f32[B, S]")
  scales(("k_rope", "k_rope_scale"), k_rope, k_rope_scale, (batch, capacity), "f32[B, S]")
  dim("k_rope", k_rope, 0, batch, "batch B, from c_kv")
  dim("k_rope", k_rope, 1, capacity, "slots S, from c_kv")
  dim("q_latent", q_latent, 0, batch, "batch B, from c_kv")
  dim("q_latent", q_latent, q_latent.ndim - 1, latent, "latent C, from c_kv")
  if q_rope.shape[:-1] != q_latent.shape[:-1]:
    raise ValueError(
        f"q_rope must match q_latent in all but the last axis; got {tuple(q_rope.shape)} "
        f"and {tuple(q_latent.shape)}")
  dim("q_rope", q_rope, q_rope.ndim - 1, k_rope.shape[-1], "rope dim R, from k_rope")
  if sm_scale is None:
    raise ValueError("sm_scale is required for MLA: 1/sqrt(qk_nope_head_dim + qk_rope_head_dim)")
  positive_float("sm_scale", sm_scale)
  optional_positive_int("window", window)


def check_mla_decode_args(q_latent, q_rope, c_kv, k_rope, lengths, sm_scale, window,
                          c_kv_scale=None, k_rope_scale=None) -> jax.Array:
  """`check_mla_args` for one decode query per sequence (`q_latent: [B, N, C]`) and its
  `lengths: i32[B]`; returns the lengths as an i32 array (not clamped)."""
  check_mla_args(q_latent, q_rope, c_kv, k_rope, 1, sm_scale, c_kv_scale, k_rope_scale, window)
  return lengths_arg("lengths", lengths, c_kv.shape[0], c_kv.shape[1])


def check_paged_args(q, k_pages, v_pages, block_tables, lengths, *, window=None,
                     soft_cap=None, sm_scale=None, k_scale=None, v_scale=None) -> jax.Array:
  """Arguments of paged decode attention: `q: [B, N, H]`, `k_pages: [K, P, page_size, H]`,
  `v_pages: [K, P, page_size, Hv]`, `block_tables: i32[B, pages_per_seq]`,
  `lengths: i32[B]`; int8/fp8 pools need `k_scale`, `v_scale: f32[K, P, page_size]`.
  Returns the lengths as an i32 array (not clamped).

  Raises:
    ValueError: wrong ranks, mismatched sizes, N not a multiple of K,
      non-positive window / soft_cap / sm_scale.
    TypeError: non-float q or pools (quantized pools without scales), k_pages
      and v_pages of different dtypes, non-integer block_tables or lengths.
  """
  rank("q", q, 3, "[B, N, H]")
  kv_pair(("k_pages", "v_pages"), k_pages, v_pages, k_scale, v_scale,
          "[K, P, page_size, {}]", "f32[K, P, page_size]")
  rank("block_tables", block_tables, 2, "[B, pages_per_seq]")
  rank("lengths", lengths, 1, "[B]")
  floating("q", q)
  integer("block_tables", block_tables)
  integer("lengths", lengths)
  batch, num_heads, _ = q.shape
  num_kv_heads, num_pages, page_size, _ = k_pages.shape
  dim("q", q, 2, k_pages.shape[3], "head dim H, from k_pages")
  dim("v_pages", v_pages, 0, num_kv_heads, "KV heads K, from k_pages")
  dim("v_pages", v_pages, 1, num_pages, "pages P, from k_pages")
  dim("v_pages", v_pages, 2, page_size, "page_size, from k_pages")
  dim("block_tables", block_tables, 0, batch, "batch B, from q")
  dim("lengths", lengths, 0, batch, "batch B, from q")
  head_layout(num_heads, num_kv_heads)
  options(window, soft_cap, sm_scale)
  return jnp.asarray(lengths).astype(jnp.int32)
