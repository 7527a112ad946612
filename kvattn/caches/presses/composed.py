"""Composition of two policies: the first narrows the candidates, the second chooses among them.

kvpress's `ComposedPress` applies presses in sequence, each compressing what the previous one
kept (its ratio is the product of theirs). With one budget per cache the same reads: the first
policy keeps its best `first_keep` candidates (default twice the budget), the second ranks the
candidates and the cache keeps the budget from the first policy's survivors, in the second
policy's order (lexicographic: survivor, then the second score). `first_keep` plays the part of
the first press's ratio; `first_keep <= budget` leaves the rest of the budget to the second
policy's best non-survivors.

Where it differs from kvpress: both stages see the same attention mass, that of the union of
their scoring queries; the cache carries the first policy's score (an accumulating first policy,
h2o or snapkv, keeps accumulating), and the second policy is scored afresh each step with no
carried scores (an accumulating second policy sees only the current chunk's mass). The protected
window is the first policy's (else the second's); candidates the cache protects are kept
whatever the stages say.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kvattn.caches import eviction
from kvattn.caches.presses._common import descending_rank, inner_policy, live, rank_and_carry


def composed(first: str, second: str) -> eviction.EvictionPolicy:
  """The policy applying `first`, then `second` (names of `eviction.POLICY_TABLE`); options:
  both policies' (a shared name is one option) and `first_keep`.

  Raises:
    ValueError: an unregistered policy name, or one taking `first_keep` itself.
  """
  a, b = inner_policy(first, "first"), inner_policy(second, "second")
  for where, name, p in (("first", first, a), ("second", second, b)):
    if "first_keep" in p.options:
      raise ValueError(f"{where} must not take an option first_keep (the composition's own); "
                       f"got {name!r}")

  def score(c: eviction.Candidates, options: dict[str, int]):
    mask = live(c)
    rank_a, carry_a = rank_and_carry(a.score(c, options))
    rank_b, _ = rank_and_carry(b.score(c._replace(carried=jnp.zeros_like(c.carried)), options))
    survivor = descending_rank(rank_a, mask) < options["first_keep"]
    num = c.pos.shape[-1]
    # Lexicographic (survivor, second score) as exact small integers in f32 (num <= 2^23).
    order_b = (num - 1 - descending_rank(rank_b, mask)).astype(jnp.float32)
    return jnp.where(survivor, num, 0.0) + order_b, carry_a

  queries = [p.score_queries for p in (a, b) if p.score_queries is not None]

  def score_queries(t, n, o):
    return queries[0](t, n, o) | queries[-1](t, n, o)

  # The union's queries lie among the last max(W_a, W_b) tokens; unbounded if either is.
  windows = [p.query_window for p in (a, b) if p.score_queries is not None]

  def query_window(o):
    return max(w(o) for w in windows)

  return eviction.EvictionPolicy(
      score=score,
      options={**b.options, **a.options, "first_keep": (lambda budget: 2 * budget, 1)},
      score_queries=score_queries if queries else None, protected=a.protected or b.protected,
      query_window=query_window if queries and None not in windows else None)


def compose(first: str, second: str) -> str:
  """Registers `composed(first, second)` as policy and cache kind `<first>+<second>` (once;
  a second call returns the name); returns the name.

  Raises:
    ValueError: an unregistered policy name, or one taking `first_keep` itself.
  """
  name = f"{first}+{second}"
  if name not in eviction.POLICY_TABLE:
    eviction.register_eviction_policy(name, composed(first, second))
  return name


compose("snapkv", "knorm")
