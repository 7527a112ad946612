"""What the presses share: dequantized candidates, live masks and ranks."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kvattn.caches import eviction
from kvattn.caches.eviction import Candidates

TINY = 1e-12
"""Floor of a norm before dividing by it (a zero key has no direction)."""


def live(c: Candidates) -> jax.Array:
  """`bool[B, K, S + T]`: candidates holding a token."""
  return c.pos >= 0


def dequantized(x: jax.Array, scale: jax.Array | None, mask: jax.Array) -> jax.Array:
  """`f32[B, K, S + T, H]` values of stored `x` (times the per-token `scale` when quantized),
  zero where `mask` is False (so NaN in unused slots never reaches a sum)."""
  x = x.astype(jnp.float32)
  if scale is not None:
    x = x * scale.astype(jnp.float32)[..., None]
  return jnp.where(mask[..., None], x, 0.0)


def descending_rank(x: jax.Array, mask: jax.Array) -> jax.Array:
  """`i32[..., S]`: 0 for the largest of `x` along the last axis among `mask`, then 1, ...
  (ties: the lower index first); masked entries rank last."""
  order = jnp.argsort(jnp.where(mask, -x, jnp.inf), axis=-1, stable=True)
  return jnp.argsort(order, axis=-1, stable=True).astype(jnp.int32)


def inner_policy(name: str, where: str) -> eviction.EvictionPolicy:
  """The registered policy `name` a press wraps or composes.

  Raises:
    ValueError: `name` is not a policy of `eviction.POLICY_TABLE` (naming `where`).
  """
  if not isinstance(name, str) or name not in eviction.POLICY_TABLE:
    raise ValueError(f"{where} must be one of {tuple(eviction.POLICY_TABLE)}; got {name!r}")
  return eviction.POLICY_TABLE[name]


def rank_and_carry(score):
  """`(rank, carry)` of a score function's result (a plain score is both)."""
  return score if isinstance(score, tuple) else (score, score)
