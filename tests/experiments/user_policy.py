"""A researcher's own eviction policy, outside kvattn: KeyDiff-like, registered on import.

Keeps the keys least like the mean key (cosine similarity, higher evicted first: KeyDiff,
Park et al. 2025, arXiv 2504.15364, without its block-wise scoring). Loaded with
`--import=tests/experiments/user_policy.py` (or `--import=tests.experiments.user_policy`);
nothing in kvattn or experiments names it.
"""

import jax.numpy as jnp

from kvattn.caches import eviction
from kvattn.caches import registry

NAME = "keydiff-lite"


def score(c: eviction.Candidates, options) -> jnp.ndarray:
  """`f32[B, K, S + T]`: minus each key's cosine similarity to the mean of the live keys."""
  del options
  k = c.k.astype(jnp.float32)
  if c.k_scale is not None:
    k = k * c.k_scale[..., None]
  live = (c.pos >= 0)[..., None]
  k = jnp.where(live, k, 0.0)
  unit = k / (jnp.linalg.norm(k, axis=-1, keepdims=True) + 1e-6)
  mean = unit.sum(axis=2, keepdims=True) / jnp.maximum(live.sum(axis=2, keepdims=True), 1)
  return -(unit * mean).sum(axis=-1)


registry.register_eviction_policy(NAME, eviction.EvictionPolicy(score=score, options={}))
