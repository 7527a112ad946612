"""KeyDiff: keep the keys least similar to the head's mean key direction.

Park et al. 2025, "KeyDiff: Key Similarity-Based KV Cache Eviction for Long-Context LLM
Inference in Resource-Constrained Environments", arXiv 2504.15364. The score of candidate j of
a KV head is `-cos(k_j, a)` with the anchor `a` the mean of the head's unit keys (every live
candidate: the kept slots and the new chunk), as kvpress's `KeyDiffPress`; the paper's block-wise
scoring during decoding is the cache's own per-chunk eviction here. Keys are scored after RoPE,
as stored; an int8 / fp8 key's positive scale does not change its direction.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kvattn.caches import eviction
from kvattn.caches.presses._common import TINY, dequantized, live

NAME = "keydiff"


def score(c: eviction.Candidates, options: dict[str, int]) -> jax.Array:
  """`f32[B, K, S + T]`: minus each key's cosine similarity to the mean unit key."""
  del options
  mask = live(c)
  k = dequantized(c.k, c.k_scale, mask)
  unit = k / jnp.maximum(jnp.linalg.norm(k, axis=-1, keepdims=True), TINY)
  count = jnp.maximum(mask.sum(axis=-1), 1)[..., None, None]
  anchor = unit.sum(axis=2, keepdims=True) / count  # [B, K, 1, H]
  anchor = anchor / jnp.maximum(jnp.linalg.norm(anchor, axis=-1, keepdims=True), TINY)
  return -jnp.einsum("BKSH,BKSH->BKS", unit, jnp.broadcast_to(anchor, unit.shape))


POLICY = eviction.EvictionPolicy(score=score, options={"recent_size": (lambda budget: 0, 0)},
                                 protected="recent_size")
eviction.register_eviction_policy(NAME, POLICY)
