"""CriticalKV: an inner policy's best candidates first, the rest by score times value norm.

Feng et al. 2025, "Identify Critical KV Cache in LLM Inference from an Output Perturbation
Perspective", arXiv 2502.03805 (kvpress's `CriticalKVPress`). Two stages over an inner policy's
score s (SnapKV by default): the best `first_keep` candidates by s are kept first (kvpress:
`first_stage_ratio` = 0.5 of the budget, the default here `budget // 2`); the rest of the budget
goes to the highest `(s + epsilon) * ||W_o v||`. The cache does not hold the layer's output
projection W_o, so the projected norm is approximated by the value's own L2 norm `||v||` (exact up
to a factor when each head's block of W_o is a multiple of an orthogonal map; kvpress takes the L1
norm of `W_o v`, averaged over the G query heads). The inner policy's score is what the cache
carries.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kvattn.caches import eviction
from kvattn.caches.presses._common import (dequantized, descending_rank, inner_policy, live,
                                            rank_and_carry)

NAME = "criticalkv"
EPSILON = 1e-4
"""kvpress's `epsilon`: keeps a zero score from erasing the value norm's order."""


def critical(inner: str) -> eviction.EvictionPolicy:
  """CriticalKV over `inner` (a name of `eviction.POLICY_TABLE`): its options plus `first_keep`.

  Raises:
    ValueError: `inner` is not a registered policy.
  """
  base = inner_policy(inner, "inner")

  def score(c: eviction.Candidates, options: dict[str, int]):
    s, carry = rank_and_carry(base.score(c, options))
    mask = live(c)
    first = descending_rank(s, mask) < options["first_keep"]
    second = (s + EPSILON) * jnp.linalg.norm(dequantized(c.v, c.v_scale, mask), axis=-1)
    num = c.pos.shape[-1]
    # Lexicographic (first stage, second score) as exact small integers in f32 (num <= 2^23).
    order = (num - 1 - descending_rank(second, mask)).astype(jnp.float32)
    return jnp.where(first, num, 0.0) + order, carry

  return eviction.EvictionPolicy(
      score=score, options={**base.options, "first_keep": (lambda budget: budget // 2, 0)},
      score_queries=base.score_queries, protected=base.protected,
      query_window=base.query_window)


def register(inner: str) -> str:
  """Registers CriticalKV over `inner` as policy and cache kind `criticalkv_<inner>` (once);
  returns the name (`criticalkv` itself is SnapKV's)."""
  name = f"{NAME}_{inner}"
  if name not in eviction.POLICY_TABLE:
    eviction.register_eviction_policy(name, critical(inner))
  return name


eviction.register_eviction_policy(NAME, critical("snapkv"))
