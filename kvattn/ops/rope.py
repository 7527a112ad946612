"""Rotary position embeddings (RoPE) from explicit integer positions.

Su et al., "RoFormer: Enhanced Transformer with Rotary Position Embedding"
(arXiv 2104.09864), eq. 34, in the *rotate-half* layout used by Llama-family
checkpoints (HF `LlamaRotaryEmbedding`): the head dim is split into two halves
(x1, x2) and pair i is (x1[i], x2[i]) rotated by angle pos * theta^(-2i/H).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kvattn import _checks


def rope_frequencies(head_dim: int, rope_theta: float = 10000.0) -> jax.Array:
  """Inverse frequencies `f32[H // 2]`: theta^(-2i / H) for i in [0, H/2).

  Raises:
    ValueError: if `head_dim` is not a positive even int or `rope_theta` <= 0.
  """
  head_dim = _checks.positive_int("head_dim", head_dim)
  if head_dim % 2:
    raise ValueError(f"head_dim must be even for RoPE; got {head_dim}")
  rope_theta = _checks.positive_float("rope_theta", rope_theta)
  exponents = jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim
  return 1.0 / (rope_theta ** exponents)


def apply_rope(x: jax.Array, positions: jax.Array, *, rope_theta: float = 10000.0) -> jax.Array:
  """Rotates `x` by RoPE at integer `positions` (rotate-half convention).

  Args:
    x: `[B, T, ..., H]` floating array (e.g. `[B, T, N, H]` queries or
      `[B, T, R]` MLA rope keys). H must be even.
    positions: `i32[B, T]` absolute token positions.
    rope_theta: base of the geometric frequency progression.

  Returns:
    Array of `x`'s shape and dtype; the rotation is computed in f32.

  Raises:
    ValueError/TypeError: on a non-float `x`, non-integer `positions`, or
      positions whose shape is not `x.shape[:2]`.
  """
  _checks.floating("x", x)
  _checks.integer("positions", positions)
  if x.ndim < 3 or positions.shape != x.shape[:2]:
    raise ValueError(
        "positions must have shape x.shape[:2] = [B, T]; got positions "
        f"{tuple(positions.shape)} for x {tuple(x.shape)}")
  head_dim = x.shape[-1]
  inv_freq = rope_frequencies(head_dim, rope_theta)  # [H/2]
  angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, H/2]
  angles = angles.reshape(angles.shape[:2] + (1,) * (x.ndim - 3) + angles.shape[-1:])
  cos, sin = jnp.cos(angles), jnp.sin(angles)
  xf = x.astype(jnp.float32)
  x1, x2 = jnp.split(xf, 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x.dtype)
