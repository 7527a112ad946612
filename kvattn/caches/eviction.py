"""Score-based eviction: a fixed budget of slots per sequence and KV head.

`EvictingKVCache` keeps, per sequence and KV head, `budget` tokens chosen by an eviction policy;
keys keep the RoPE of their original position (as in H2O and SnapKV). A policy is one entry of
`POLICY_TABLE`, an `EvictionPolicy`: its score function (higher is kept), which queries' attention
feeds it, and its options (kvpress's `ScorerPress.score` is the model: the cache does the top-k, the
gather and the protected windows once). Policies:
  - "h2o" (Zhang et al. 2023, arXiv 2306.14048): attention mass accumulated per
    slot over every query since the token arrived; keep the heavy hitters plus
    the `recent_size` most recent tokens;
  - "snapkv" (Li et al. 2024, arXiv 2404.14469): mass from an observation window
    of the last `window_size` queries of each chunk, average-pooled over
    `kernel_size` neighbouring slots, accumulated; keep the top slots plus the
    observation window;
  - "tova" (Oren et al. 2024, arXiv 2401.06104): keep the slots the newest query attends
    most, its attention averaged over the layer's heads: one kept set per layer, as the paper
    and kvpress's TOVAPress; "tova_per_head" scores each KV head by its own query group;
  - baselines "recent", "random", "knorm" (keep the smallest key L2 norms,
    kvpress's KnormPress).
Scores of a KV head are the sum over its G query heads (the cache is never expanded to N heads).
Every policy may protect `num_sinks` first tokens. Candidates are the kept slots plus the new chunk:
each chunk attends all of them (exact for that chunk), then the budget is chosen among them, so no
`[S, S]` matrix is built.

`compress="context"` runs any policy as kvpress's protocol instead (`caches/_context.py`): a row's
first write (its context) keeps `max(1, int(n * (1 - compression_ratio)))` tokens (or at most
`budget`),
scored by that write's own queries, and later writes are appended until the capacity is full.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from kvattn import _checks
from kvattn.caches import _context
from kvattn.caches import registry
from kvattn.caches._layers import gqa_layers
from kvattn.caches import dense as cache_lib
from kvattn.caches._bounded import (BoundedCache, check_implementation, check_lengths, concat,
                                    empty_storage, encode_new, float_keys, new_positions, prelude,
                                    scale_kwargs)
from kvattn.ops.positional import positional_attention
from kvattn.ops.rope import apply_rope


class Candidates(NamedTuple):
  """What a score function sees: the kept slots followed by the new chunk (S + T).

  Attributes:
    pos: `i32[B, K, S + T]` original token index, -1 for none.
    k: `[B, K, S + T, H]` stored keys (quantized values when the cache is).
    k_scale: `f32[B, K, S + T]` key scales of an int8 / fp8 cache, else None.
    carried: `f32[B, K, S + T]` the scores kept so far (0 for new tokens).
    mass: `f32[B, K, S + T]` attention mass the chunk's scoring queries gave each slot
      (0 when the policy scores with no queries).
    end: `i32[B, 1, 1]` tokens of each sequence after the chunk.
    v: `[B, K, S + T, H]` stored values (quantized when the cache is).
    v_scale: `f32[B, K, S + T]` value scales of an int8 / fp8 cache, else None.
    queries: `[B, T, N, H]` the chunk's queries BEFORE RoPE, or None (a write through
      `update`, which has no queries).
    query_pos: `i32[B, T]` each query's token index, -1 for padding (None without queries).
    rope: `(x [B, T, ..., H], positions i32[B, T]) -> x` rotated by the module's RoPE (its
      theta and scaling), None without queries.
    state: what the cache kind holds for its policy (`policy_state()`: the Q-Filter kind's
      filters), None for `EvictingKVCache`.
  """

  pos: jax.Array
  k: jax.Array
  k_scale: jax.Array | None
  carried: jax.Array
  mass: jax.Array
  end: jax.Array
  # Added for the presses (kvattn/caches/presses/): values, the chunk's queries, kind state.
  v: jax.Array | None = None
  v_scale: jax.Array | None = None
  queries: jax.Array | None = None
  query_pos: jax.Array | None = None
  rope: Callable[[jax.Array, jax.Array], jax.Array] | None = None
  state: Any = None


@dataclasses.dataclass(frozen=True)
class EvictionPolicy:
  """One eviction policy.

  Attributes:
    score: `(Candidates, options) -> f32[B, K, S + T]`, higher is kept; the result is
      stored as the kept slots' `scores`. It may return `(rank, carry)` instead: `rank`
      orders the candidates, `carry` is stored (what `carried` holds next time).
    options: option name -> `(default(budget), minimum)`; every policy also takes
      `num_sinks` (default 0).
    score_queries: `(t i32[1, T], new_lengths i32[B, 1], options) -> bool[B, T]`, the
      queries whose attention mass scores the slots; None: the policy uses no mass.
    protected: the option naming how many most recent tokens are always kept, or None.
    query_window: `(options) -> W`: the scoring queries are among each chunk's last W real
      tokens (SnapKV's `window_size`, TOVA's 1), so a write computes their attention for W
      queries per row, not for the chunk; None: no such bound (H2O scores with every query).
  """

  score: Callable[[Candidates, dict[str, int]], jax.Array]
  options: dict[str, tuple[Callable[[int], int], int]]
  score_queries: Callable[..., jax.Array] | None = None
  protected: str | None = None
  query_window: Callable[[dict[str, int]], int] | None = None


def _avg_pool(x: jax.Array, size: int) -> jax.Array:
  """Average pooling of `f32[B, K, S]` over S, stride 1, zero-padded to keep S (SnapKV)."""
  if size == 1:
    return x
  left = size // 2
  summed = jax.lax.reduce_window(x, 0.0, jax.lax.add, (1, 1, size), (1, 1, 1),
                                 [(0, 0), (0, 0), (left, size - 1 - left)])
  return summed / size


def _random_score(c: Candidates, o: dict[str, int]) -> jax.Array:
  """Uniform scores, one per (sequence length, KV head, token): a row's evictions depend
  neither on the other rows of its batch nor on the cache's capacity or the chunk's padded
  width (which a draw over the candidate axis would)."""
  base = jax.random.key(o["seed"])

  def row(end, pos):  # pos: i32[K, S + T]
    key = jax.random.fold_in(base, end)
    draw = lambda h, p: jax.random.uniform(jax.random.fold_in(jax.random.fold_in(key, h), p))
    heads = jnp.arange(pos.shape[0], dtype=jnp.int32)
    return jax.vmap(lambda h, ps: jax.vmap(lambda p: draw(h, p))(ps))(heads, pos)

  return jax.vmap(row)(c.end[:, 0, 0], c.pos)


def _knorm_score(c: Candidates, o: dict[str, int]) -> jax.Array:
  del o
  norms = jnp.linalg.norm(float_keys(c.k), axis=-1)
  return -(norms if c.k_scale is None else norms * jnp.abs(c.k_scale))


def _tova_score(c: Candidates, o: dict[str, int]) -> jax.Array:
  """The newest query's mass averaged over the KV heads (each already the sum over its G
  query heads), the same for every head. Every head keeps the same tokens in the same slots,
  so slot j is one token across heads and the average is per token."""
  del o
  return jnp.broadcast_to(jnp.mean(c.mass, axis=1, keepdims=True), c.mass.shape)


_ZERO = (lambda budget: 0, 0)
POLICY_TABLE: dict[str, EvictionPolicy] = {
    "h2o": EvictionPolicy(
        score=lambda c, o: c.carried + c.mass,
        options={"recent_size": (lambda budget: budget // 2, 0)},
        score_queries=lambda t, n, o: t < n, protected="recent_size"),
    "snapkv": EvictionPolicy(
        score=lambda c, o: c.carried + _avg_pool(c.mass, o["kernel_size"]),
        options={"window_size": (lambda budget: min(32, budget // 2), 1),
                 "kernel_size": (lambda budget: 5, 1)},
        score_queries=lambda t, n, o: (t < n) & (t >= n - o["window_size"]),
        protected="window_size", query_window=lambda o: o["window_size"]),
    "tova": EvictionPolicy(
        score=_tova_score, options={"recent_size": _ZERO},
        score_queries=lambda t, n, o: t == n - 1, protected="recent_size",
        query_window=lambda o: 1),
    "tova_per_head": EvictionPolicy(
        score=lambda c, o: c.mass, options={"recent_size": _ZERO},
        score_queries=lambda t, n, o: t == n - 1, protected="recent_size",
        query_window=lambda o: 1),
    "recent": EvictionPolicy(score=lambda c, o: c.pos.astype(jnp.float32), options={}),
    "random": EvictionPolicy(score=_random_score, options={"seed": _ZERO}),
    "knorm": EvictionPolicy(score=_knorm_score, options={"recent_size": _ZERO},
                            protected="recent_size"),
}
"""Policy name -> `EvictionPolicy`. A new policy is a score function and one entry
(`register_eviction_policy` also makes it a cache kind)."""

POLICIES = tuple(POLICY_TABLE)
"""The eviction policies when this module was imported (the table may grow)."""

POLICY_OPTIONS = {name: tuple(p.options) for name, p in POLICY_TABLE.items()}
"""The options each built-in policy takes besides `num_sinks` (which all take)."""


def policy_options(policy: str) -> tuple[str, ...]:
  """The options `policy` takes besides `num_sinks`; ValueError for an unknown policy."""
  if not isinstance(policy, str) or policy not in POLICY_TABLE:
    raise ValueError(f"policy must be one of {tuple(POLICY_TABLE)}; got {policy!r}")
  return tuple(POLICY_TABLE[policy].options)


def _policy_options(policy: str, budget: int, options: dict[str, Any], *,
                    context: bool = False) -> tuple:
  """Validated options of `policy` as a sorted tuple of (name, value) (static, hashable).
  `context` (compress="context", `budget` = the capacity): a default below its option's
  minimum is raised to it, and the protected tokens need not fit (kept first; past the kept
  count or the capacity, the oldest of them)."""
  spec_options = {"num_sinks": _ZERO, **POLICY_TABLE[policy].options} if isinstance(
      policy, str) and policy in POLICY_TABLE else None
  if spec_options is None:
    raise ValueError(f"policy must be one of {tuple(POLICY_TABLE)}; got {policy!r}")
  allowed = tuple(spec_options)
  unknown = sorted(set(options) - set(allowed))
  if unknown:
    raise ValueError(f"unknown option(s) {unknown} for policy {policy!r}; it takes {allowed}")
  resolved = {name: options.get(name, max(default(budget), low) if context
                                else default(budget))
              for name, (default, low) in spec_options.items()}
  for name, value in resolved.items():
    minimum = spec_options[name][1]
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
      raise ValueError(f"{name} must be an int >= {minimum}; got {value!r}")
  if context:
    return tuple(sorted((name, int(value)) for name, value in resolved.items()))
  if budget < resolved["num_sinks"] + 1:
    raise ValueError(f"budget must be >= num_sinks + 1 = {resolved['num_sinks'] + 1} (one slot "
                     f"for the newest token); got {budget}")
  protected_name = POLICY_TABLE[policy].protected
  protected = resolved["num_sinks"] + (resolved[protected_name] if protected_name else 0)
  if protected > budget:
    raise ValueError(f"num_sinks + the recent/observation window ({protected}) must fit the "
                     f"budget {budget}")
  return tuple(sorted((name, int(value)) for name, value in resolved.items()))


@struct.dataclass
class EvictingKVCache(BoundedCache):
  """A fixed budget of slots per sequence and KV head, filled by an eviction policy.

  `compress="fixed"`: every write keeps `capacity` (= `budget`) of the kept slots plus its new
  tokens. `compress="context"` (kvpress's protocol, `ScorerPress.compress`): the cache's first
  write to a row is the row's context; it keeps `kept = max(1, int(n * (1 - compression_ratio)))`
  of its n >= 1 tokens (float64, exactly kvpress 0.5.5's `compute_n_kept`; at most `budget` when
  set), chosen by the policy's
  score from that write's own queries (SnapKV's observation window = the context's last
  tokens), and every later write (question, answer) is appended, evicting nothing while the
  row holds at most `capacity` tokens; past that it evicts by the policy as the fixed mode does
  (documented overflow: nothing is dropped silently, the policy chooses). Size `capacity` to
  `kept + tokens after the context` (`_context.slots_needed`; `generate(context_lengths=)`
  does) and write the context in one call (a context written in several calls compresses
  only the first).

  Attributes:
    k: `[B, K, budget, H]` keys, RoPE'd at their original positions.
    v: `[B, K, budget, H]` values.
    pos: `i32[B, K, budget]` original token index per slot, -1 for none.
    scores: `f32[B, K, budget]` the policy's score of each kept slot (accumulated attention mass for
      h2o / snapkv, the newest query's mass for tova).
    lengths: `i32[B]` tokens written per sequence (grows past the budget).
    k_scale, v_scale: `f32[B, K, budget]` scales of an int8/fp8 cache, else None.
    context_lengths: `i32[B]` (compress="context" only, else None): tokens of each row's
      context, -1 until the row's first write.
    policy: static policy name.
    options: static `((name, value), ...)` of the policy's options.
    compress: static "fixed" or "context".
    compression_ratio: static fraction of the context dropped (context mode), or None.
    context_budget: static most context tokens kept (context mode), or None.
  """

  k: jax.Array
  v: jax.Array
  pos: jax.Array
  scores: jax.Array
  lengths: jax.Array
  k_scale: jax.Array | None = None
  v_scale: jax.Array | None = None
  context_lengths: jax.Array | None = None
  policy: str = struct.field(pytree_node=False, default="h2o")
  options: tuple = struct.field(pytree_node=False, default=())
  compress: str = struct.field(pytree_node=False, default="fixed")
  compression_ratio: float | None = struct.field(pytree_node=False, default=None)
  context_budget: int | None = struct.field(pytree_node=False, default=None)

  ROW_EMPTY = {"pos": -1, "scores": 0.0, "k": 0, "v": 0, "k_scale": 1.0, "v_scale": 1.0,
               "context_lengths": -1}

  @classmethod
  def init(cls, batch: int, budget: int | None, num_kv_heads: int, head_dim: int,
           dtype=jnp.float32, *, policy: str, compress: str = "fixed",
           compression_ratio: float | None = None, capacity: int | None = None,
           **policy_options) -> "EvictingKVCache":
    """An empty cache.

    Args:
      batch, num_kv_heads, head_dim: B, K, H.
      budget: compress="fixed": slots per sequence and KV head (the capacity). "context": the
        most context tokens a row keeps (None: no cap).
      dtype: storage dtype (float, or int8 / fp8 with f32 scales).
      policy: a name of `POLICY_TABLE`; its options as keywords.
      compress: "fixed" or "context" (kvpress's protocol, see the class).
      compression_ratio: "context": fraction in [0, 1) of the context's tokens dropped.
      capacity: "context": slots per sequence and KV head (kept context + everything after);
        "fixed": None or equal to `budget`.

    The policy's option defaults (e.g. h2o's `recent_size = budget // 2`) are computed from the
    capacity, at least their minimum in context mode (where the protected sinks and windows
    need not fit the kept count or the capacity: the oldest of them are kept then).

    Raises:
      ValueError: an unknown policy, option or mode; "fixed": budget < num_sinks + 1,
        protected windows larger than the budget; a ratio outside [0, 1), "fixed" with a ratio or a
        capacity other than the budget, "context" with neither budget nor ratio, or a
        budget larger than the capacity; sizes that are not positive ints.
      TypeError: a dtype that is neither floating nor int8 / fp8.
    """
    compress = _context.check_mode("compress", compress)
    ratio = _context.check_ratio("compression_ratio", compression_ratio)
    if compress == "fixed":
      budget = _checks.positive_int("budget", budget)
      if ratio is not None:
        raise ValueError(f"compression_ratio needs compress='context'; got {ratio!r}")
      if capacity is not None and capacity != budget:
        raise ValueError(f"capacity must be None or the budget {budget} for compress='fixed'; "
                         f"got {capacity!r}")
      capacity, context = budget, None
    else:
      capacity = _context.positive_capacity(capacity)
      if budget is None and ratio is None:
        raise ValueError("budget or compression_ratio must be set for compress='context'")
      if budget is not None and _checks.positive_int("budget", budget) > capacity:
        raise ValueError(f"budget must be <= capacity = {capacity} (the context tokens kept "
                         f"must fit); got {budget}")
      context = jnp.full((_checks.positive_int("batch", batch),), -1, jnp.int32)
    options = _policy_options(policy, capacity, policy_options, context=context is not None)
    storage = empty_storage(batch, capacity, num_kv_heads, head_dim, dtype)
    shape = storage["k"].shape[:3]
    return cls(pos=jnp.full(shape, -1, jnp.int32), scores=jnp.zeros(shape, jnp.float32),
               policy=policy, options=options, context_lengths=context, compress=compress,
               compression_ratio=ratio, context_budget=None if context is None else budget,
               **storage)

  @property
  def CONTEXT_REPLAYABLE(self) -> bool:  # pylint: disable=invalid-name
    """`capabilities.context_replayable`: in context mode the first write attends the whole
    chunk and only then chooses what to keep; a fixed budget evicts inside the write."""
    return self.compress == "context"

  @property
  def budget(self) -> int:
    """compress="fixed": the slots per sequence and KV head (the capacity)."""
    return self.capacity

  def slots_needed(self, context_lengths, total_lengths) -> int | None:
    """compress="context": the capacity rows of `total_lengths` tokens whose first
    `context_lengths` are the context need (`_context.slots_needed`); "fixed": None."""
    if self.context_lengths is None:
      return None
    return _context.slots_needed({"compression_ratio": self.compression_ratio,
                                  "budget": self.context_budget}, context_lengths, total_lengths)

  def kept_context(self, num_context: int) -> int:
    """Context tokens a row of `num_context` keeps (compress="context"; `capacity` at most)."""
    return min(self.capacity, _context.kept_count(num_context, self.compression_ratio,
                                                  self.context_budget))

  def option(self, name: str) -> int:
    """The policy option `name` (e.g. `recent_size`) this cache was built with."""
    return dict(self.options)[name]

  def slot_positions(self) -> jax.Array:
    """`i32[B, K, budget]`: each KV head keeps its own tokens (-1 for none)."""
    return self.pos

  def check_state(self, name: str = "cache") -> None:
    """Eager check of the bookkeeping (`kvattn.caches.checkpoint.restore_caches` runs it):
    `lengths >= 0`; per sequence and KV head, `pos` keeps `min(lengths, budget)` tokens
    (compress="context": `min(kept_context(c) + lengths - c, capacity)` for a context of c
    tokens, none before the first write, `context_lengths` in `[-1, lengths]`), distinct,
    below `lengths`, sorted, empty slots (-1) last, the first `num_sinks` tokens among them
    (fixed mode); `scores` finite. Traced: no check.

    Raises:
      ValueError: naming the leaf and slot, e.g. "layer 0 pos[1, 0, 3] = 12 ...".
    """
    _checks.values_in_range(f"{name} lengths", self.lengths, 0)
    if not all(_checks.is_concrete(x) for x in (self.lengths, self.pos, self.scores)):
      return
    lengths, pos = np.asarray(self.lengths).astype(np.int64), np.asarray(self.pos)
    limit = lengths[:, None, None]
    outside = (pos < -1) | (pos >= limit)
    if outside.any():
      b, k, s = (int(x) for x in np.argwhere(outside)[0])
      raise ValueError(f"{name} pos[{b}, {k}, {s}] = {int(pos[b, k, s])} must be a token below "
                       f"lengths[{b}] = {int(lengths[b])}, or -1 (none)")
    kept = pos >= 0
    count = kept.sum(axis=-1)
    if self.context_lengths is None:
      want = np.minimum(lengths, self.budget)[:, None]
      rule = f"a budget of {self.budget} after"
    else:
      want = self._check_context(name, lengths)[:, None]
      rule = f"context compression into {self.capacity} slots after"
    if (count != want).any():
      b, k = (int(x) for x in np.argwhere(count != want)[0])
      raise ValueError(f"{name} pos[{b}, {k}] keeps {int(count[b, k])} tokens, but {rule} "
                       f"{int(lengths[b])} tokens keeps {int(want[b, 0])}")
    key = np.where(kept, pos, np.iinfo(np.int64).max)
    unsorted = (key[..., 1:] <= key[..., :-1]) & kept[..., 1:]
    if unsorted.any():
      b, k, s = (int(x) for x in np.argwhere(unsorted)[0])
      raise ValueError(f"{name} pos[{b}, {k}, {s + 1}] = {int(pos[b, k, s + 1])} must be "
                       f"larger than the slot before it ({int(pos[b, k, s])}): kept tokens are "
                       "distinct and sorted, empty slots (-1) last")
    sinks = np.arange(self.option("num_sinks") if self.context_lengths is None else 0)
    sinks = sinks[None, None, :]  # context mode: a small kept count may drop sinks
    lost = (sinks < limit) & (pos[..., :sinks.shape[-1]] != sinks)
    if lost.any():
      b, k, s = (int(x) for x in np.argwhere(lost)[0])
      raise ValueError(f"{name} pos[{b}, {k}, {s}] = {int(pos[b, k, s])}, but the sink token "
                       f"{s} is always kept there")
    if not np.isfinite(np.asarray(self.scores)).all():
      b, k, s = (int(x) for x in np.argwhere(~np.isfinite(np.asarray(self.scores)))[0])
      raise ValueError(f"{name} scores[{b}, {k}, {s}] must be finite; got "
                       f"{float(np.asarray(self.scores)[b, k, s])}")

  def _check_context(self, name: str, lengths: np.ndarray) -> np.ndarray:
    """Context mode: checks `context_lengths` against `lengths` (host) and returns the kept
    token count each row must hold."""
    context = np.asarray(self.context_lengths).astype(np.int64)
    if context.shape != lengths.shape:
      raise ValueError(f"{name} context_lengths must have shape {lengths.shape}; got "
                       f"{context.shape}")
    bad = (context < -1) | (context > lengths) | ((context < 0) & (lengths > 0))
    if bad.any():
      b = int(np.argwhere(bad)[0][0])
      raise ValueError(f"{name} context_lengths[{b}] = {int(context[b])} must lie in [0, "
                       f"lengths[{b}] = {int(lengths[b])}] (-1 only before the first write)")
    return np.array([0 if c < 0 else min(self.kept_context(int(c)) + int(n) - int(c),
                                         self.capacity) for c, n in zip(context, lengths)])

  def policy_state(self) -> Any:
    """`Candidates.state`: arrays a subclass holds for its policy (None here)."""
    return None

  def _select(self, k, v, ks, vs, new_lengths, mass, queries=None,
              keep_best=None) -> "EvictingKVCache":
    """Chooses `capacity` of the kept slots + the new tokens (`[B, K, T, ...]`) per
    sequence and KV head; `mass` is the chunk's `f32[B, K, S + T]` score mass or None;
    `queries` None or `(q [B, T, N, H] before RoPE, query_pos i32[B, T], rope)`; `keep_best`
    None or `i32[B]`: only the best `keep_best[b]` of them stay, the other slots are emptied
    (context mode: a row's first write keeps at most `kept_context` of them)."""
    num_tokens = k.shape[2]
    new_pos = jnp.broadcast_to(new_positions(self.lengths, new_lengths, num_tokens)[:, None],
                               (self.batch, self.num_kv_heads, num_tokens))
    cand_pos = concat(self.pos, new_pos)
    cand_k = concat(self.k, k)
    cand_ks = concat(self.k_scale, ks)
    end = (self.lengths + new_lengths)[:, None, None]
    mass = jnp.zeros(cand_pos.shape, jnp.float32) if mass is None else mass
    carried = concat(self.scores, jnp.zeros(new_pos.shape, jnp.float32))
    options = dict(self.options)
    cand_v, cand_vs = concat(self.v, v), concat(self.v_scale, vs)
    q_raw, q_pos, rope = (None, None, None) if queries is None else queries
    score = POLICY_TABLE[self.policy].score(
        Candidates(pos=cand_pos, k=cand_k, k_scale=cand_ks, carried=carried, mass=mass, end=end,
                   v=cand_v, v_scale=cand_vs, queries=q_raw, query_pos=q_pos, rope=rope,
                   state=self.policy_state()),
        options)
    score, stored = score if isinstance(score, tuple) else (score, score)
    recent = options[POLICY_TABLE[self.policy].protected] if POLICY_TABLE[self.policy].protected \
        else 0
    protect = (cand_pos < options["num_sinks"]) | (cand_pos > end - 1 - recent)
    priority = jnp.where(protect, jnp.inf, score)
    priority = jnp.where(cand_pos < 0, -jnp.inf, priority)
    _, idx = jax.lax.top_k(priority, self.capacity)  # [B, K, capacity], ties: lower index
    kept_pos = jnp.take_along_axis(cand_pos, idx, axis=2)
    context = self.context_lengths
    if context is not None:  # a row's first write keeps its kept count, the best first
      first = context < 0
      kept = _context.kept_counts(new_lengths, num_tokens, self.compression_ratio,
                                  self.context_budget)
      limit = jnp.where(first, kept, self.capacity)
      keep_best = limit if keep_best is None else jnp.minimum(keep_best, limit)
      context = jnp.where(first, new_lengths, context)
    if keep_best is not None:  # top_k ranks best first
      kept_pos = jnp.where(jnp.arange(self.capacity) < keep_best[:, None, None], kept_pos, -1)
    order = jnp.argsort(jnp.where(kept_pos < 0, jnp.iinfo(jnp.int32).max, kept_pos), axis=2)
    idx = jnp.take_along_axis(idx, order, axis=2)
    kept_pos = jnp.take_along_axis(kept_pos, order, axis=2)
    take = lambda x: None if x is None else jnp.take_along_axis(
        x, idx.reshape(idx.shape + (1,) * (x.ndim - 3)), axis=2)
    # A row that writes no token keeps its state bit for bit (a finished row; the rows of
    # a draft's replay past their accepted tokens, kvattn.caches.transaction).
    wrote = new_lengths > 0
    keep = lambda new, old: None if new is None else jnp.where(
        wrote.reshape((-1,) + (1,) * (new.ndim - 1)), new, old)
    return self.replace(k=keep(take(cand_k), self.k), v=keep(take(cand_v), self.v),
                        pos=keep(kept_pos, self.pos), context_lengths=context,
                        scores=keep(take(jnp.where(jnp.isfinite(stored), stored, 0.0)),
                                    self.scores),
                        lengths=self.lengths + new_lengths,
                        k_scale=keep(take(cand_ks), self.k_scale),
                        v_scale=keep(take(cand_vs), self.v_scale))

  def update(self, k_new: jax.Array, v_new: jax.Array,
             new_lengths: jax.Array | None = None) -> "EvictingKVCache":
    """Writes `k_new, v_new: [B, T, K, H]` (keys RoPE'd) for `t < new_lengths[b]`, evicting by
    the policy with no query scores for the new tokens (`update_attend` supplies them)."""
    return self.update_unchecked(k_new, v_new,
                                 cache_lib.check_new_kv(self, k_new, v_new, new_lengths))

  def update_unchecked(self, k_new: jax.Array, v_new: jax.Array,
                       new_lengths: jax.Array) -> "EvictingKVCache":
    """`update` for callers that checked its arguments; checks the cache's `lengths`."""
    check_lengths(self)
    return self._select(*encode_new(self, k_new, v_new), new_lengths, None)

  def attend(self, q: jax.Array, *, q_offsets: jax.Array, sm_scale: float | None = None,
             window: int | None = None, soft_cap: float | None = None,
             implementation: str | None = None) -> jax.Array:
    """Queries at tokens `q_offsets[b] + t` (RoPE'd) against the kept slots, masked by
    original position."""
    check_implementation(self, implementation)
    q_pos = q_offsets[:, None] + jnp.arange(q.shape[1], dtype=jnp.int32)[None, :]
    out, _ = positional_attention(q, self.k, self.v, q_pos, self.pos, sm_scale=sm_scale,
                                  window=window, soft_cap=soft_cap,
                                  **scale_kwargs(self.k_scale, self.v_scale))
    return out

  def update_attend_unchecked(self, q, k, v, *, positions, rope_theta, rope_scaling=None,
                              new_lengths, sm_scale=None, window=None, soft_cap=None,
                              implementation=None):
    """`cache_protocol.update_attend` (checked arguments; `update_attend` checks them): RoPE
    at `positions`; the chunk attends the kept slots plus its own tokens (returning the
    per-slot mass its scoring queries gave), then the budget is chosen among them.
    Returns `(out [B, T, N, H], new cache)`."""
    prelude(self, implementation)
    num_tokens = k.shape[1]
    rope = dict(rope_theta=rope_theta, scaling=rope_scaling)
    queries = (q, jnp.where(jnp.arange(num_tokens)[None, :] < new_lengths[:, None], positions, -1),
               functools.partial(apply_rope, **rope))
    q, k = apply_rope(q, positions, **rope), apply_rope(k, positions, **rope)
    kq, vq, ks, vs = encode_new(self, k, v)
    new_pos = new_positions(self.lengths, new_lengths, num_tokens)
    cand_pos = concat(self.pos, jnp.broadcast_to(new_pos[:, None], kq.shape[:3]))
    q_pos = self.lengths[:, None] + jnp.arange(num_tokens, dtype=jnp.int32)[None, :]
    out, mass = positional_attention(
        q, concat(self.k, kq), concat(self.v, vq), q_pos, cand_pos, sm_scale=sm_scale,
        window=window, soft_cap=soft_cap,
        **scoring_kwargs(self.policy, self.options, new_lengths, num_tokens),
        **scale_kwargs(concat(self.k_scale, ks), concat(self.v_scale, vs)))
    return out, self._select(kq, vq, ks, vs, new_lengths, mass, queries)


def scoring_queries(policy: str, options: tuple, new_lengths: jax.Array,
                    num_tokens: int) -> jax.Array | None:
  """`bool[B, T]`: the queries of a chunk of `num_tokens` (`new_lengths: i32[B]` real) whose
  attention mass `policy` (a name of `POLICY_TABLE`, its static `options`) reads; None if none."""
  score_queries = POLICY_TABLE[policy].score_queries
  if score_queries is None:
    return None
  t = jnp.arange(num_tokens, dtype=jnp.int32)[None, :]
  return score_queries(t, new_lengths[:, None], dict(options))


def scoring_kwargs(policy: str, options: tuple, new_lengths: jax.Array,
                   num_tokens: int) -> dict[str, Any]:
  """`positional_attention`'s `score_queries` (`scoring_queries`) and `score_window` (the
  policy's `query_window` with its `options`, None for no bound) for a chunk."""
  query_window = POLICY_TABLE[policy].query_window
  return {"score_queries": scoring_queries(policy, options, new_lengths, num_tokens),
          "score_window": None if query_window is None else int(query_window(dict(options)))}


def eviction_kind(policy: str) -> registry.CacheKind:
  """The `CacheKind` of `EvictingKVCache(policy=policy)`: `budget` slots per KV head
  (compress="fixed"), or a context compressed to `compression_ratio` / `budget` then grown in
  `max_len` slots (compress="context"; `registry.slots_needed` sizes `max_len`)."""

  def build(model, batch, max_len, dtype, o, tokens_per_seq):
    del tokens_per_seq  # fixed: the capacity is the budget; context: max_len slots
    budget, mode, options = _context.split_options(o, max_len)
    return tuple(EvictingKVCache.init(batch, budget, a.num_kv_heads, a.head_dim, dtype,
                                      policy=policy, **mode, **options)
                 for a in gqa_layers(model))

  return registry.CacheKind(
      build, {**_context.SPEC_OPTIONS, "num_sinks": None,
              **{o: None for o in policy_options(policy)}},
      f"EvictingKVCache(policy={policy!r}): `budget` slots per KV head, or with "
      f"compress='context' a context compressed to compression_ratio / budget, then grown",
      at_budget=lambda budget, num_sinks: {"budget": budget}, check=_context.check_spec,
      slots=_context.kind_slots)


def register_eviction_policy(name: str, policy: EvictionPolicy) -> None:
  """Adds an eviction policy to `POLICY_TABLE` and its cache kind `name` to the registry.

  Raises:
    ValueError: `name` empty or taken (as a policy or a cache kind).
    TypeError: `policy` is not an `EvictionPolicy`.
  """
  if not isinstance(name, str) or not name or name in POLICY_TABLE:
    raise ValueError(f"policy name must be a new non-empty string; got {name!r} (taken: "
                     f"{tuple(POLICY_TABLE)})")
  if not isinstance(policy, EvictionPolicy):
    raise TypeError(f"policy must be an EvictionPolicy; got {type(policy).__name__}")
  if name in registry.CACHE_KIND_TABLE:
    raise ValueError(f"cache kind {name!r} is taken")
  POLICY_TABLE[name] = policy
  registry.register_cache_kind(name, eviction_kind(name))


for _name in POLICIES:
  registry.register_cache_kind(_name, eviction_kind(_name))
