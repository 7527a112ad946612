"""AdaKV under kvpress's context protocol, over any scoring policy: kinds "adakv_<policy>".

Ada-KV (Feng et al. 2024, "Ada-KV: Optimizing KV Cache Eviction by Adaptive Budget Allocation
for Efficient LLM Inference", arXiv 2407.11550) as kvpress 0.5.5's `AdaKVPress(press)`: the
context's keys are scored once, at prefill, by an inner policy (`eviction.POLICY_TABLE[policy]`
-- its registered score function, scoring queries and protected window, as the uniform policy
uses them); each KV head's top `n_safe` candidates are forced in (the safeguard,
`n_safe = max(1, int(n_kept * alpha))` for `n_kept > 0` and `alpha > 0`, kvpress's
`alpha_safeguard`); then the layer keeps its `K * n_kept` best candidates across ALL its KV
heads (kvpress prunes the `K * (n - n_kept)` lowest), `n_kept = max(1, int(n * (1 - ratio)))`
(`_context.kept_count`, kvpress's `compute_n_kept`). Heads whose scores are concentrated give
slots to heads whose scores are spread. The question and the answer are then appended
uncompressed to every head.

kvpress only masks the pruned keys (a fake key whose attention underflows); here the memory is
freed: `AdaKVContextCache` is `AdaKVCache`'s ragged pool of `P = K * capacity` slots per
sequence (`k, v: [B, P, H]`, each slot tagged with its KV head and token, sorted by (head,
token), empty slots last). After the context write a row holds `K * n_kept` slots (a head may
hold more or fewer than `n_kept`), and each later token adds K slots (one per head): with
`capacity = n_kept + tokens after the context` (`_context.slots_needed`, what
`generate(context_lengths=)` and the compression family size), the bytes held are those of
the uniform policy at the same ratio; AdaKV only moves slots between heads. Past the capacity
(a caller that did not size it) the row evicts its context slots of lowest inner score first,
then its oldest appended tokens (documented overflow; nothing is dropped silently).

Scores whose policy protects tokens (`num_sinks`, a recent / observation window) rank those
tokens +inf, as the uniform policy does, below the safeguard (kvpress's SnapKVPress gives its
window the maximum score and the safeguard `finfo.max`: the same kept set unless the window
outgrows `n_kept`). Ties rank the lower (head, token) first. The inner score sees only the chunk's tokens (the pool is empty at
a row's first write), exactly the candidates of the uniform policy's context write. The inner
policy must not read `Candidates.state` (Q-Filter is its own kind).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from kvattn import _checks
from kvattn.caches import _context
from kvattn.caches import dense as cache_lib
from kvattn.caches import eviction
from kvattn.caches import presses  # noqa: F401  (registers keydiff, expected_attention)
from kvattn.caches import registry
from kvattn.caches._bounded import concat, encode_new, new_positions, prelude, scale_kwargs
from kvattn.caches._layers import gqa_layers
from kvattn.caches.adakv import DEFAULT_ALPHA, AdaKVCache, head_major
from kvattn.caches.presses._common import descending_rank, rank_and_carry
from kvattn.ops.positional import positional_attention
from kvattn.ops.rope import apply_rope

PREFIX = "adakv_"
DEFAULT_INNER = ("keydiff", "expected_attention", "knorm", "snapkv")
"""The inner policies registered as kinds `adakv_<policy>` on import (`register` adds others)."""


def check_alpha(alpha: Any, name: str = "alpha") -> float:
  """`alpha` as a float in [0, 1]; ValueError naming `name` otherwise."""
  if isinstance(alpha, bool) or not isinstance(alpha, (int, float, np.integer, np.floating)) \
      or not 0 <= float(alpha) <= 1:
    raise ValueError(f"{name} must be a number in [0, 1] (each head's guaranteed share of the "
                     f"kept count, kvpress's alpha_safeguard); got {alpha!r}")
  return float(alpha)


def safe_count(n_kept: int, alpha: float) -> int:
  """kvpress 0.5.5's safeguard: `int(n_kept * alpha)`, at least 1 when `alpha > 0` and
  `n_kept > 0` (float64, as `AdaKVPress.compress`)."""
  n_safe = int(n_kept * alpha)
  if alpha > 0:
    n_safe = max(1, n_safe) if n_kept > 0 else 0
  return n_safe


def select(priority: jax.Array, valid: jax.Array, kept: jax.Array, safe: jax.Array
           ) -> jax.Array:
  """AdaKV's selection of one layer: `bool[B, K, T]`, the candidates kept.

  Args:
    priority: `f32[B, K, T]` higher is kept (+inf: protected); anything where not `valid`
      (NaN included) is ignored.
    valid: `bool[B, K, T]` candidates holding a token.
    kept: `i32[B]` the mean kept per head, n_kept: row b keeps `K * kept[b]` candidates (all
      of its valid ones when it has fewer).
    safe: `i32[B]` each head's top `safe[b]` valid candidates are kept first (the safeguard).

  Each head's top `safe[b]` are kept first (above the protected ones, as kvpress's
  `finfo.max` is above SnapKV's window score), then the best by priority, until the row has
  `K * kept[b]`; head-major (kvpress's `scores.reshape(bsz, -1)`), ties to the lower index.
  """
  batch, num_kv_heads, num_tokens = priority.shape
  priority = jnp.where(valid, priority, -jnp.inf)
  guard = valid & (descending_rank(priority, valid) < safe[:, None, None])
  flat_valid = valid.reshape(batch, -1)
  tier = jnp.where(flat_valid, jnp.where(guard.reshape(batch, -1), 0, 1), 2)
  idx = jnp.broadcast_to(jnp.arange(num_kv_heads * num_tokens, dtype=jnp.int32), tier.shape)
  _, _, order = jax.lax.sort((tier, -priority.reshape(batch, -1), idx), dimension=1,
                             num_keys=3)
  rank = jnp.argsort(order, axis=1)
  keep = flat_valid & (rank < (num_kv_heads * kept)[:, None])
  return keep.reshape(batch, num_kv_heads, num_tokens)


@struct.dataclass
class AdaKVContextCache(AdaKVCache):
  """`AdaKVCache`'s pool of `P = K * capacity` slots, written by kvpress's protocol (module doc).

  Attributes (besides `AdaKVCache`'s `k, v, head, pos, scores, lengths, k_scale, v_scale,
  num_kv_heads`):
    scores: `f32[B, P]` the inner policy's score of each kept context slot (0 for appended).
    context_lengths: `i32[B]` tokens of each row's context, -1 until the row's first write.
    options: static `((name, value), ...)` of the inner policy (`num_sinks` included).
    policy: static name of the inner policy (`eviction.POLICY_TABLE`).
    alpha: static safeguard fraction.
    compression_ratio: static fraction of the context dropped, or None.
    context_budget: static most context tokens kept per head on average, or None.
  """

  context_lengths: jax.Array | None = None
  policy: str = struct.field(pytree_node=False, default="snapkv")
  alpha: float = struct.field(pytree_node=False, default=DEFAULT_ALPHA)
  compression_ratio: float | None = struct.field(pytree_node=False, default=None)
  context_budget: int | None = struct.field(pytree_node=False, default=None)

  CONTEXT_REPLAYABLE = True
  """`capabilities.context_replayable`: a row's first write attends the whole chunk (the pool
  is empty) and only then chooses what to keep (`experiments.evals.replay`)."""
  ROW_EMPTY = {"pos": -1, "head": -1, "scores": 0.0, "context_lengths": -1}

  @classmethod
  def init(cls, batch: int, capacity: int, num_kv_heads: int, head_dim: int,  # pylint: disable=arguments-renamed
           dtype=jnp.float32, *, policy: str, compression_ratio: float | None = None,
           budget: int | None = None, alpha: float | None = None,
           **policy_options) -> "AdaKVContextCache":
    """An empty pool of `num_kv_heads * capacity` slots per sequence.

    Args:
      batch, num_kv_heads, head_dim: B, K, H.
      capacity: slots per sequence and KV head on average: the kept context plus every token
        after it (`_context.slots_needed`).
      dtype: storage dtype (float, or int8 / fp8 with f32 scales).
      policy: the inner policy, a name of `eviction.POLICY_TABLE`; its options as keywords
        (defaults from `capacity`, as `EvictingKVCache`'s context mode).
      compression_ratio: fraction in [0, 1) of the context dropped (kvpress's).
      budget: the most context tokens kept per head on average (None: no cap).
      alpha: the safeguard in [0, 1] (default 0.2, kvpress's `alpha_safeguard`).

    Raises:
      ValueError: an unknown policy or option, a ratio outside [0, 1), neither a ratio nor a
        budget, alpha outside [0, 1], sizes that are not positive ints -- naming it.
      TypeError: a dtype that is neither floating nor int8 / fp8.
    """
    batch = _checks.positive_int("batch", batch)
    capacity = _checks.positive_int("capacity", capacity)
    num_kv_heads = _checks.positive_int("num_kv_heads", num_kv_heads)
    head_dim = _checks.positive_int("head_dim", head_dim)
    ratio = _context.check_ratio("compression_ratio", compression_ratio)
    if budget is not None:
      budget = _checks.positive_int("budget", budget)
    if ratio is None and budget is None:
      raise ValueError("compression_ratio or budget must be set (how many context tokens each "
                       "sequence keeps per KV head on average)")
    alpha = check_alpha(DEFAULT_ALPHA if alpha is None else alpha)
    options = eviction._policy_options(policy, capacity, policy_options, context=True)  # pylint: disable=protected-access
    dtype = cache_lib.check_storage_dtype(dtype)
    shape = (batch, num_kv_heads * capacity)
    return cls(k=jnp.zeros(shape + (head_dim,), dtype), v=jnp.zeros(shape + (head_dim,), dtype),
               head=jnp.full(shape, -1, jnp.int32), pos=jnp.full(shape, -1, jnp.int32),
               scores=jnp.zeros(shape, jnp.float32), lengths=jnp.zeros((batch,), jnp.int32),
               k_scale=cache_lib.scale_init(shape, dtype), v_scale=cache_lib.scale_init(shape, dtype),
               context_lengths=jnp.full((batch,), -1, jnp.int32), num_kv_heads=num_kv_heads,
               options=options, policy=policy, alpha=alpha, compression_ratio=ratio,
               context_budget=budget)

  def option(self, name: str) -> int:
    """The inner policy's option `name` this cache was built with."""
    return dict(self.options)[name]

  def kept_context(self, num_context: int) -> int:
    """Context tokens per KV head on average a row of `num_context` keeps (the capacity at
    most)."""
    return min(self.capacity, _context.kept_count(num_context, self.compression_ratio,
                                                  self.context_budget))

  def slots_needed(self, context_lengths, total_lengths) -> int:
    """The capacity rows of `total_lengths` tokens whose first `context_lengths` are the
    context need (`_context.slots_needed`)."""
    return _context.slots_needed({"compression_ratio": self.compression_ratio,
                                  "budget": self.context_budget}, context_lengths, total_lengths)

  def check_state(self, name: str = "cache") -> None:
    """Eager check of the bookkeeping (`checkpoint.restore_caches` runs it): `lengths >= 0`,
    `context_lengths` in `[-1, lengths]` (-1 only for an unwritten row); per row, held slots
    `(head, pos)` distinct, `0 <= pos < lengths`, `0 <= head < K`, sorted by (head, pos), empty
    slots (-1, -1) last, `min(K * kept_context(c) + K * (lengths - c), P)` of them for a
    context of c tokens. Traced: no check.

    Raises:
      ValueError: naming the leaf, the row and the slot.
    """
    _checks.values_in_range(f"{name} lengths", self.lengths, 0)
    if not all(_checks.is_concrete(x) for x in (self.lengths, self.pos, self.head,
                                                 self.context_lengths)):
      return
    lengths = np.asarray(self.lengths).astype(np.int64)
    context = np.asarray(self.context_lengths).astype(np.int64)
    pos, head = np.asarray(self.pos).astype(np.int64), np.asarray(self.head).astype(np.int64)
    k = self.num_kv_heads
    for b in range(pos.shape[0]):
      c, n = int(context[b]), int(lengths[b])
      if c < -1 or c > n or (c < 0 and n > 0):
        raise ValueError(f"{name} context_lengths[{b}] = {c} must lie in [0, lengths[{b}] = "
                         f"{n}] (-1 only before the first write)")
      held = pos[b] >= 0
      bad = np.flatnonzero((pos[b] >= n) | (pos[b] < -1) | (held & ((head[b] < 0) | (
          head[b] >= k))) | (~held & (head[b] != -1)))
      if bad.size:
        s = int(bad[0])
        raise ValueError(f"{name} pos[{b}, {s}] = {pos[b, s]}, head[{b}, {s}] = {head[b, s]}: "
                         f"a held slot needs 0 <= pos < lengths[{b}] = {n} and 0 <= head < "
                         f"{k}; an empty one -1, -1")
      want = 0 if c < 0 else min(k * self.kept_context(c) + k * (n - c), self.pool)
      key = np.where(held, head[b] * (n + 1) + pos[b], np.iinfo(np.int64).max)
      if held.sum() != want or (np.diff(key[:want]) <= 0).any() or held[want:].any():
        raise ValueError(f"{name} row {b} must hold {want} distinct slots sorted by (head, "
                         f"pos), empty slots last (a context of {c} of {n} tokens); got pos "
                         f"{pos[b].tolist()}, head {head[b].tolist()}")

  # -- the step ------------------------------------------------------------------------------

  def _select(self, kq, vq, ks, vs, new_lengths, mass, queries=None) -> "AdaKVContextCache":
    """Writes the chunk (`kq, vq: [B, K, T, H]`, scales `[B, K, T]`): a row's first write keeps
    AdaKV's selection of it (`select` on the inner policy's priority), a later one appends;
    `mass: f32[B, K, T]` the chunk's scoring mass on its own tokens or None; `queries` None or
    `(q [B, T, N, H] before RoPE, query_pos i32[B, T], rope)`."""
    batch, pool, num_kv_heads = self.batch, self.pool, self.num_kv_heads
    num_tokens = kq.shape[2]
    policy, options = eviction.POLICY_TABLE[self.policy], dict(self.options)
    new_pos = jnp.broadcast_to(new_positions(self.lengths, new_lengths, num_tokens)[:, None],
                               (batch, num_kv_heads, num_tokens))
    end = (self.lengths + new_lengths)[:, None, None]
    q_raw, q_pos, rope = (None, None, None) if queries is None else queries
    zeros = jnp.zeros(new_pos.shape, jnp.float32)
    rank, stored = rank_and_carry(policy.score(eviction.Candidates(
        pos=new_pos, k=kq, k_scale=ks, carried=zeros, mass=zeros if mass is None else mass,
        end=end, v=vq, v_scale=vs, queries=q_raw, query_pos=q_pos, rope=rope, state=None),
        options))
    recent = options[policy.protected] if policy.protected else 0
    valid = new_pos >= 0
    protect = (new_pos < options["num_sinks"]) | (new_pos > end - 1 - recent)
    priority = jnp.where(protect, jnp.inf, rank)
    table = [_context.kept_count(n, self.compression_ratio, self.context_budget)
             for n in range(num_tokens + 1)]
    lookup = lambda xs: jnp.asarray(np.array(xs, np.int32))[jnp.clip(new_lengths, 0, num_tokens)]
    kept, safe = lookup(table), lookup([safe_count(n, self.alpha) for n in table])
    first = self.context_lengths < 0  # [B]
    keep_new = jnp.where(first[:, None, None], select(priority, valid, kept, safe), valid)
    # Which P of the pool's slots and the new tokens stay: tier 1 the appended tokens (newest
    # first), tier 0 the context (best inner score first), -1 none. Only an overflowing row
    # (more than P) or a first write larger than the pool drops anything.
    in_context = (self.pos >= 0) & (self.pos < self.context_lengths[:, None])
    pool_tier = jnp.where(self.pos < 0, -1, jnp.where(in_context, 0, 1))
    pool_value = jnp.where(in_context, self.scores, self.pos.astype(jnp.float32))
    new_tier = jnp.where(keep_new, jnp.where(first[:, None, None], 0, 1), -1)
    new_value = jnp.where(first[:, None, None], jnp.where(keep_new, priority, 0.0),
                          new_pos.astype(jnp.float32))
    flat = lambda x_pool, x_new: jnp.concatenate(
        [x_pool, x_new.reshape((batch, num_kv_heads * num_tokens) + x_new.shape[3:])], axis=1)
    tier = flat(pool_tier, new_tier)
    value = jnp.where(tier >= 0, flat(pool_value, new_value), 0.0)
    idx = jnp.broadcast_to(jnp.arange(tier.shape[1], dtype=jnp.int32), tier.shape)
    _, _, idx = jax.lax.sort((-tier, -value, idx), dimension=1, num_keys=2)
    idx = idx[:, :pool]  # the P best, best first
    heads_new = jnp.broadcast_to(jnp.arange(num_kv_heads, dtype=jnp.int32)[None, :, None],
                                 new_pos.shape)
    cand_head, cand_pos = flat(self.head, heads_new), flat(self.pos, new_pos)
    held = jnp.take_along_axis(tier, idx, axis=1) >= 0
    idx, held = head_major(idx, held, cand_head, cand_pos)
    take = lambda x: None if x is None else jnp.take_along_axis(
        x, idx.reshape(idx.shape + (1,) * (x.ndim - 2)), axis=1)
    stored = jnp.where(first[:, None, None] & jnp.isfinite(stored), stored, 0.0)
    cand_score = flat(self.scores, stored)
    wrote = (new_lengths > 0)[:, None]
    keep = lambda new, old: None if new is None else jnp.where(
        wrote.reshape((-1,) + (1,) * (new.ndim - 1)), new, old)
    return self.replace(
        k=keep(take(flat(self.k, kq)), self.k), v=keep(take(flat(self.v, vq)), self.v),
        head=keep(jnp.where(held, take(cand_head), -1), self.head),
        pos=keep(jnp.where(held, take(cand_pos), -1), self.pos),
        scores=keep(jnp.where(held, take(cand_score), 0.0), self.scores),
        lengths=self.lengths + new_lengths,
        context_lengths=jnp.where(first, new_lengths, self.context_lengths),
        k_scale=keep(take(None if ks is None else flat(self.k_scale, ks)), self.k_scale),
        v_scale=keep(take(None if vs is None else flat(self.v_scale, vs)), self.v_scale))

  def update_attend_unchecked(self, q, k, v, *, positions, rope_theta, rope_scaling=None,
                              new_lengths, sm_scale=None, window=None, soft_cap=None,
                              implementation=None):
    """`cache_protocol.update_attend` (checked arguments): RoPE at `positions`; the chunk
    (`q: [B, T, N, H]`, `k, v: [B, T, K, H]` before RoPE) attends each head's pool slots plus
    its own tokens (a row's first write: its own tokens only, causally), then is written
    (`_select`). Returns `(out [B, T, N, H], new cache)`."""
    prelude(self, implementation)
    num_tokens = k.shape[1]
    rope = dict(rope_theta=rope_theta, scaling=rope_scaling)
    queries = (q, jnp.where(jnp.arange(num_tokens)[None, :] < new_lengths[:, None], positions,
                            -1), functools.partial(apply_rope, **rope))
    q, k = apply_rope(q, positions, **rope), apply_rope(k, positions, **rope)
    kq, vq, ks, vs = encode_new(self, k, v)
    new_pos = new_positions(self.lengths, new_lengths, num_tokens)
    vk, vv, vks, vvs, view_pos = self._view(kq, vq, ks, vs, new_pos)
    q_pos = self.lengths[:, None] + jnp.arange(num_tokens, dtype=jnp.int32)[None, :]
    out, mass = positional_attention(q, vk, vv, q_pos, view_pos, sm_scale=sm_scale,
                                     window=window, soft_cap=soft_cap,
                                     **eviction.scoring_kwargs(self.policy, self.options,
                                                               new_lengths, num_tokens),
                                     **scale_kwargs(vks, vvs))
    mass = None if mass is None else mass[..., self.pool:]
    return out, self._select(kq, vq, ks, vs, new_lengths, mass, queries)

  def update_unchecked(self, k_new, v_new, new_lengths) -> "AdaKVContextCache":
    """`update` for callers that checked its arguments: the chunk scored with no queries."""
    prelude(self, None)
    return self._select(*encode_new(self, k_new, v_new), new_lengths, None)


def _options(inner: str) -> tuple[str, ...]:
  return ("num_sinks", *eviction.policy_options(inner))


def adakv_kind(inner: str) -> registry.CacheKind:
  """The `CacheKind` of AdaKV over `inner` under the context protocol: options
  `compression_ratio` (default 0.0, kvpress's), `budget` (a cap on the kept context),
  `alpha`, `compress` ("context" only) and the inner policy's options; `max_len` slots per
  head on average (`registry.slots_needed` sizes it)."""
  names = _options(inner)

  def build(model, batch, max_len, dtype, o, tokens_per_seq):
    del tokens_per_seq
    given = {n: o[n] for n in names if o.get(n) is not None}
    return tuple(AdaKVContextCache.init(batch, max_len, a.num_kv_heads, a.head_dim, dtype,
                                        policy=inner, compression_ratio=o["compression_ratio"],
                                        budget=o["budget"], alpha=o["alpha"], **given)
                 for a in gqa_layers(model))

  def check(o: dict[str, Any], where: str) -> None:
    if o.get("compress") != "context":
      raise ValueError(f"{where}.compress must be 'context' for kind {PREFIX + inner!r} (AdaKV "
                       f"over {inner} runs kvpress's protocol only; kind 'adakv' is the fixed "
                       f"budget); got {o.get('compress')!r}")
    _context.check_spec(o, where)
    if o.get("alpha") is not None:
      check_alpha(o["alpha"], f"{where}.alpha")

  return registry.CacheKind(
      build, {**_context.SPEC_OPTIONS, "compress": "context", "compression_ratio": 0.0,
              "alpha": None, **{n: None for n in names}},
      f"AdaKVContextCache(policy={inner!r}): the context compressed to compression_ratio "
      f"with per-head budgets (Ada-KV) in one ragged pool per layer, then grown",
      check=check, slots=_context.kind_slots)


def register(inner: str) -> str:
  """Registers AdaKV over `inner` (a policy of `eviction.POLICY_TABLE`) as cache kind
  `adakv_<inner>` (once); returns the name.

  Raises:
    ValueError: `inner` is not a registered policy.
  """
  eviction.policy_options(inner)  # raises for an unknown policy
  name = PREFIX + inner
  if name not in registry.CACHE_KIND_TABLE:
    registry.register_cache_kind(name, adakv_kind(inner))
  return name


def inner_of(kind: str) -> str | None:
  """The inner policy of kind `adakv_<policy>`, None for any other name."""
  if isinstance(kind, str) and kind.startswith(PREFIX) and kind in registry.CACHE_KIND_TABLE:
    return kind[len(PREFIX):]
  return None


for _inner in DEFAULT_INNER:
  register(_inner)
