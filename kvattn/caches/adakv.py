"""AdaKV: per-head budgets inside one flat pool per layer.

Ada-KV (Feng et al. 2024, "Ada-KV: Optimizing KV Cache Eviction by Adaptive Budget Allocation
for Efficient LLM Inference", arXiv 2407.11550; its Ada-SnapKV variant): a layer keeps its
`K * budget` best candidates across ALL its KV heads instead of `budget` per head, so heads whose
attention is concentrated give slots to heads whose attention is spread. Scores are SnapKV's
(Li et al. 2024, arXiv 2404.14469): the softmax probability mass the last `window_size` queries
of each chunk give a token, summed over the KV head's G query heads, average-pooled over
`kernel_size` neighbouring tokens of the same head in position order, accumulated over chunks.
Each head's mass is its own softmax over its own tokens (every head spends the same total, the
number of scoring queries times G), which is what makes scores of different heads comparable,
as in the paper. The safeguard (the paper's alpha, kvpress's `alpha_safeguard`): each head keeps
at least its top `floor(alpha * budget)` candidates. The first `num_sinks` tokens and the
observation window are kept in every head.

Storage really shrinks to the pool: `AdaKVCache` holds, per sequence, P = K * budget slots
`k, v: [B, P, H]`, each tagged with its KV head (`head: i32[B, P]`) and token (`pos: i32[B, P]`),
kept sorted by (head, token) with empty slots (-1) last -- so a head's share is ragged, and the
bytes are exactly those of `budget` tokens of every head. Attention runs per KV head over a mask of
the pool (a query head of group k sees the slots with `head == k` whose token it may attend);
that costs K times the pool's reads, never its storage.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from kvattn import _checks
from kvattn.caches import _slots
from kvattn.caches import capabilities
from kvattn.caches import dense as cache_lib
from kvattn.caches import registry
from kvattn.caches._bounded import (CheckedStep, check_implementation, check_lengths, concat,
                                    encode_new, new_positions, scale_kwargs)
from kvattn.caches._layers import gqa_layers
from kvattn.ops.positional import positional_attention
from kvattn.ops.rope import apply_rope

DEFAULT_ALPHA = 0.2
"""The safeguard fraction of Ada-KV's code (`floor_alpha`) and kvpress's `alpha_safeguard`."""


def resolve_options(budget: int, *, window_size=None, kernel_size=None, num_sinks=None,
                    alpha=None) -> tuple:
  """The checked options as a static `((name, value), ...)`: `window_size` (default
  `min(32, budget // 2)`, >= 1), `kernel_size` (5), `num_sinks` (0), `floor` = the per-head
  guarantee `int(alpha * budget)` (alpha default 0.2, in [0, 1]).

  Raises:
    ValueError: naming the option: a negative or non-int size, alpha outside [0, 1],
      `num_sinks + window_size > budget`, `budget < num_sinks + 1`.
  """
  budget = _checks.positive_int("budget", budget)
  resolved = {"window_size": min(32, budget // 2) if window_size is None else window_size,
              "kernel_size": 5 if kernel_size is None else kernel_size,
              "num_sinks": 0 if num_sinks is None else num_sinks}
  for name, minimum in (("window_size", 1), ("kernel_size", 1), ("num_sinks", 0)):
    value = resolved[name]
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
      raise ValueError(f"{name} must be an int >= {minimum}; got {value!r}")
  alpha = DEFAULT_ALPHA if alpha is None else alpha
  if isinstance(alpha, bool) or not isinstance(alpha, (int, float, np.integer, np.floating)) \
      or not 0 <= float(alpha) <= 1:
    raise ValueError(f"alpha must be a number in [0, 1] (each head's guaranteed share of the "
                     f"budget); got {alpha!r}")
  if budget < resolved["num_sinks"] + 1:
    raise ValueError(f"budget must be >= num_sinks + 1 = {resolved['num_sinks'] + 1}; got "
                     f"{budget}")
  if resolved["num_sinks"] + resolved["window_size"] > budget:
    raise ValueError(f"num_sinks + window_size ({resolved['num_sinks']} + "
                     f"{resolved['window_size']}) must fit the budget {budget}")
  resolved["floor"] = int(float(alpha) * budget)
  return tuple(sorted((k, int(v)) for k, v in resolved.items()))


def avg_pool_by_position(score: jax.Array, pos: jax.Array, size: int) -> jax.Array:
  """SnapKV's average pooling of `score: f32[B, K, C]` over `size` neighbouring candidates of
  the same row in token order (`pos: i32[B, K, C]`, -1 for none, sorted last), zero-padded;
  returns the pooled scores in the candidates' own order."""
  if size == 1:
    return score
  big = jnp.iinfo(jnp.int32).max
  order = jnp.argsort(jnp.where(pos >= 0, pos, big), axis=-1, stable=True)
  ranked = jnp.take_along_axis(jnp.where(pos >= 0, score, 0.0), order, axis=-1)
  left = size // 2
  summed = jax.lax.reduce_window(ranked, 0.0, jax.lax.add, (1, 1, size), (1, 1, 1),
                                 [(0, 0), (0, 0), (left, size - 1 - left)])
  back = jnp.argsort(order, axis=-1)
  return jnp.take_along_axis(summed / size, back, axis=-1)


def head_major(idx: jax.Array, held: jax.Array, cand_head: jax.Array, cand_pos: jax.Array
               ) -> tuple[jax.Array, jax.Array]:
  """The pool's order of chosen candidates: `idx: i32[B, P]` (indices into the candidates,
  `held: bool[B, P]` those holding a token) reordered by (KV head, token) from
  `cand_head, cand_pos: i32[B, C]`, the empty ones last; returns `(idx, held)` in that order."""
  big = jnp.iinfo(jnp.int32).max
  head_key = jnp.where(held, jnp.take_along_axis(cand_head, idx, axis=1), big)
  pos_key = jnp.where(held, jnp.take_along_axis(cand_pos, idx, axis=1), big)
  _, _, idx = jax.lax.sort((head_key, pos_key, idx), dimension=1, num_keys=2)
  return idx, jnp.sort(held, axis=1, descending=True)  # the held slots first after the sort


@struct.dataclass
class AdaKVCache(CheckedStep, _slots.Slots, capabilities.Rows):
  """One layer's pool of `P = K * budget` slots per sequence shared by its K KV heads.

  Attributes:
    k: `[B, P, H]` keys, RoPE'd at their original positions.
    v: `[B, P, H]` values.
    head: `i32[B, P]` the KV head each slot belongs to, -1 for none.
    pos: `i32[B, P]` the token each slot holds, -1 for none.
    scores: `f32[B, P]` the accumulated SnapKV score of each kept slot.
    lengths: `i32[B]` tokens written per sequence (grows past the budget).
    k_scale, v_scale: `f32[B, P]` scales of an int8 / fp8 cache, else None.
    num_kv_heads: static K.
    options: static `((name, value), ...)`: floor, kernel_size, num_sinks, window_size.
  """

  k: jax.Array
  v: jax.Array
  head: jax.Array
  pos: jax.Array
  scores: jax.Array
  lengths: jax.Array
  k_scale: jax.Array | None = None
  v_scale: jax.Array | None = None
  num_kv_heads: int = struct.field(pytree_node=False, default=1)
  options: tuple = struct.field(pytree_node=False, default=())

  BOUNDED = True
  _SIZES = {"batch": ("k", 0), "pool": ("k", 1), "head_dim": ("k", 2)}
  _VALUES, _SCALES = ("k", "v"), ("k_scale", "v_scale")
  ROW_EMPTY = {"pos": -1, "head": -1, "scores": 0.0}

  @classmethod
  def init(cls, batch: int, budget: int, num_kv_heads: int, head_dim: int, dtype=jnp.float32,
           **options) -> "AdaKVCache":
    """An empty pool of `num_kv_heads * budget` slots per sequence.

    Args:
      options: `window_size`, `kernel_size`, `num_sinks`, `alpha` (`resolve_options`).

    Raises:
      ValueError: a bad size or option, naming it. TypeError: a dtype that is neither
        floating nor int8 / fp8.
    """
    batch = _checks.positive_int("batch", batch)
    num_kv_heads = _checks.positive_int("num_kv_heads", num_kv_heads)
    head_dim = _checks.positive_int("head_dim", head_dim)
    resolved = resolve_options(budget, **options)
    dtype = cache_lib.check_storage_dtype(dtype)
    shape = (batch, num_kv_heads * budget)
    return cls(k=jnp.zeros(shape + (head_dim,), dtype), v=jnp.zeros(shape + (head_dim,), dtype),
               head=jnp.full(shape, -1, jnp.int32), pos=jnp.full(shape, -1, jnp.int32),
               scores=jnp.zeros(shape, jnp.float32), lengths=jnp.zeros((batch,), jnp.int32),
               k_scale=cache_lib.scale_init(shape, dtype), v_scale=cache_lib.scale_init(shape, dtype),
               num_kv_heads=num_kv_heads, options=resolved)

  @property
  def head_dim(self) -> int:
    return self.k.shape[2]

  @property
  def pool(self) -> int:
    """P = K * budget slots per sequence."""
    return self.k.shape[1]

  @property
  def budget(self) -> int:
    """The mean slots per KV head, `P / K`."""
    return self.pool // self.num_kv_heads

  @property
  def capacity(self) -> int:
    """Tokens of every head one sequence holds: the budget (a head may hold more or fewer)."""
    return self.budget

  @property
  def storage_slots(self) -> int:
    """Token slots of all K heads: `B * budget` (`kvattn.memory` then gives
    `2 K H itemsize` bytes per token, the pool's bytes over `B * budget`)."""
    return self.batch * self.budget

  def option(self, name: str) -> int:
    return dict(self.options)[name]

  def logical_axes(self) -> dict[str, tuple[str | None, ...]]:
    """Rows over `cache_batch`; the pool axis mixes heads, so it is never split by head."""
    return {n: (capabilities.BATCH,) + (None,) * (a.ndim - 1)
            for n, a in capabilities._arrays(self).items()}  # pylint: disable=protected-access

  def slot_positions(self) -> jax.Array:
    """`i32[B, K, P]`: per KV head, the token of each pool slot it owns, -1 elsewhere."""
    own = self.head[:, None, :] == jnp.arange(self.num_kv_heads, dtype=jnp.int32)[None, :, None]
    return jnp.where(own, self.pos[:, None, :], -1)

  def head_counts(self) -> jax.Array:
    """`i32[B, K]`: tokens each KV head holds (they differ by head and sum to at most P)."""
    return jnp.sum(self.slot_positions() >= 0, axis=-1, dtype=jnp.int32)

  def check_state(self, name: str = "cache") -> None:
    """Eager check of the bookkeeping (`checkpoint.restore_caches` runs it): `lengths >= 0`;
    per row, held slots `(head, pos)` distinct, `0 <= pos < lengths`, `0 <= head < K`, sorted
    by (head, pos), empty slots (-1, -1) last, `K * min(lengths, budget)` of them. Traced: no
    check.

    Raises:
      ValueError: naming the leaf and slot.
    """
    _checks.values_in_range(f"{name} lengths", self.lengths, 0)
    if not all(_checks.is_concrete(x) for x in (self.lengths, self.pos, self.head)):
      return
    lengths = np.asarray(self.lengths).astype(np.int64)
    pos, head = np.asarray(self.pos).astype(np.int64), np.asarray(self.head).astype(np.int64)
    for b in range(pos.shape[0]):
      held = pos[b] >= 0
      bad = np.flatnonzero((pos[b] >= lengths[b]) | (pos[b] < -1) | (held & ((head[b] < 0) | (
          head[b] >= self.num_kv_heads))) | (~held & (head[b] != -1)))
      if bad.size:
        s = int(bad[0])
        raise ValueError(f"{name} pos[{b}, {s}] = {pos[b, s]}, head[{b}, {s}] = {head[b, s]}: "
                         f"a held slot needs 0 <= pos < lengths[{b}] = {lengths[b]} and 0 <= "
                         f"head < {self.num_kv_heads}; an empty one -1, -1")
      want = self.num_kv_heads * min(int(lengths[b]), self.budget)
      key = np.where(held, head[b] * (int(lengths[b]) + 1) + pos[b], np.iinfo(np.int64).max)
      if held.sum() != want or (np.diff(key[:want]) <= 0).any() or held[want:].any():
        raise ValueError(f"{name} row {b} must hold {want} distinct slots sorted by (head, "
                         f"pos), empty slots last; got pos {pos[b].tolist()}, head "
                         f"{head[b].tolist()}")

  # -- the step ------------------------------------------------------------------------------

  def _view(self, kq=None, vq=None, ks=None, vs=None, new_pos=None):
    """The pool as K per-head rows `[B, K, P (+ T), ...]` (slots of other heads at pos -1),
    followed by the new tokens of each head."""
    batch, num_kv_heads = self.batch, self.num_kv_heads
    own = self.head[:, None, :] == jnp.arange(num_kv_heads, dtype=jnp.int32)[None, :, None]
    wide = lambda x: None if x is None else jnp.broadcast_to(
        x[:, None], (batch, num_kv_heads) + x.shape[1:])
    pos = jnp.where(own, self.pos[:, None, :], -1)
    k, v, k_scale, v_scale = wide(self.k), wide(self.v), wide(self.k_scale), wide(self.v_scale)
    if kq is None:
      return k, v, k_scale, v_scale, pos
    new_pos = jnp.broadcast_to(new_pos[:, None], (batch, num_kv_heads, new_pos.shape[1]))
    return (concat(k, kq), concat(v, vq), concat(k_scale, ks), concat(v_scale, vs),
            concat(pos, new_pos))

  def _select(self, kq, vq, ks, vs, new_lengths, mass, view_pos):
    """Keeps the pool's P best of its slots plus the new tokens of every head
    (`kq, vq: [B, K, T, H]`); `mass: f32[B, K, P + T]` is the chunk's mass per head row."""
    batch, pool, num_kv_heads = self.batch, self.pool, self.num_kv_heads
    num_tokens = kq.shape[2]
    o = dict(self.options)
    end = (self.lengths + new_lengths)[:, None, None]
    own = view_pos[..., :pool] >= 0
    carried = concat(jnp.where(own, self.scores[:, None, :], 0.0),
                     jnp.zeros((batch, num_kv_heads, num_tokens), jnp.float32))
    score = carried + avg_pool_by_position(mass, view_pos, o["kernel_size"])  # [B, K, P + T]
    valid = view_pos >= 0
    protect = valid & ((view_pos < o["num_sinks"]) | (view_pos > end - 1 - o["window_size"]))
    priority = jnp.where(valid, jnp.where(protect, jnp.inf, score), -jnp.inf)
    if o["floor"]:  # the safeguard: each head's top `floor` candidates are kept
      _, top = jax.lax.top_k(priority, min(o["floor"], priority.shape[-1]))
      guard = jnp.zeros(priority.shape, bool).at[
          jnp.arange(batch)[:, None, None], jnp.arange(num_kv_heads)[None, :, None], top].set(True)
      priority = jnp.where(guard & valid, jnp.inf, priority)
    # Flat candidates: the pool's slots (each read in its own head's row), then every head's
    # new tokens head-major.
    in_row = lambda x: jnp.take_along_axis(
        x[..., :pool], jnp.maximum(self.head, 0)[:, None, :], axis=1)[:, 0]
    flat = lambda x_pool, x_new: jnp.concatenate(
        [x_pool, x_new.reshape((batch, num_kv_heads * num_tokens) + x_new.shape[3:])], axis=1)
    cand_priority = jnp.concatenate(
        [jnp.where(self.pos >= 0, in_row(priority), -jnp.inf),
         priority[..., pool:].reshape(batch, -1)], axis=1)
    cand_score = jnp.concatenate([in_row(score), score[..., pool:].reshape(batch, -1)], axis=1)
    heads_new = jnp.broadcast_to(jnp.arange(num_kv_heads, dtype=jnp.int32)[None, :, None],
                                 (batch, num_kv_heads, num_tokens))
    cand_head = flat(self.head, heads_new)
    cand_pos = flat(self.pos, view_pos[..., pool:])
    _, idx = jax.lax.top_k(cand_priority, pool)  # [B, P]
    kept = jnp.take_along_axis(cand_priority, idx, axis=1) > -jnp.inf
    idx, kept = head_major(idx, kept, cand_head, cand_pos)
    take = lambda x: None if x is None else jnp.take_along_axis(
        x, idx.reshape(idx.shape + (1,) * (x.ndim - 2)), axis=1)
    wrote = (new_lengths > 0)[:, None]
    keep = lambda new, old: None if new is None else jnp.where(
        wrote.reshape((-1,) + (1,) * (new.ndim - 1)), new, old)
    return self.replace(
        k=keep(take(flat(self.k, kq)), self.k), v=keep(take(flat(self.v, vq)), self.v),
        head=keep(jnp.where(kept, take(cand_head), -1), self.head),
        pos=keep(jnp.where(kept, take(cand_pos), -1), self.pos),
        scores=keep(jnp.where(kept & jnp.isfinite(take(cand_score)), take(cand_score), 0.0),
                    self.scores),
        lengths=self.lengths + new_lengths,
        k_scale=keep(take(None if ks is None else flat(self.k_scale, ks)), self.k_scale),
        v_scale=keep(take(None if vs is None else flat(self.v_scale, vs)), self.v_scale))

  def update_attend_unchecked(self, q, k, v, *, positions, rope_theta, rope_scaling=None,
                              new_lengths, sm_scale=None, window=None, soft_cap=None,
                              implementation=None):
    """RoPE at `positions`; the chunk (`q: [B, T, N, H]`, `k, v: [B, T, K, H]` before RoPE)
    attends each head's pool slots plus its own tokens, then the pool keeps its P best.
    Returns `(out [B, T, N, H], new cache)`."""
    check_implementation(self, implementation)
    check_lengths(self)
    num_tokens = k.shape[1]
    rope = dict(rope_theta=rope_theta, scaling=rope_scaling)
    q, k = apply_rope(q, positions, **rope), apply_rope(k, positions, **rope)
    kq, vq, ks, vs = encode_new(self, k, v)
    new_pos = new_positions(self.lengths, new_lengths, num_tokens)
    vk, vv, vks, vvs, view_pos = self._view(kq, vq, ks, vs, new_pos)
    t = jnp.arange(num_tokens, dtype=jnp.int32)[None, :]
    q_pos = self.lengths[:, None] + t
    scoring = (t < new_lengths[:, None]) & (t >= new_lengths[:, None] - self.option("window_size"))
    out, mass = positional_attention(q, vk, vv, q_pos, view_pos, sm_scale=sm_scale,
                                     window=window, soft_cap=soft_cap, score_queries=scoring,
                                     **scale_kwargs(vks, vvs))
    return out, self._select(kq, vq, ks, vs, new_lengths, mass, view_pos)

  def update(self, k_new, v_new, new_lengths=None) -> "AdaKVCache":
    """Writes `k_new, v_new: [B, T, K, H]` (RoPE'd) with no query scores for them."""
    return self.update_unchecked(k_new, v_new,
                                 cache_lib.check_new_kv(self, k_new, v_new, new_lengths))

  def update_unchecked(self, k_new, v_new, new_lengths) -> "AdaKVCache":
    check_lengths(self)
    kq, vq, ks, vs = encode_new(self, k_new, v_new)
    new_pos = new_positions(self.lengths, new_lengths, k_new.shape[1])
    view_pos = self._view(kq, vq, ks, vs, new_pos)[-1]
    return self._select(kq, vq, ks, vs, new_lengths, jnp.zeros(view_pos.shape, jnp.float32),
                        view_pos)

  def attend(self, q: jax.Array, *, q_offsets: jax.Array, sm_scale: float | None = None,
             window: int | None = None, soft_cap: float | None = None,
             implementation: str | None = None) -> jax.Array:
    """Queries `q: [B, T, N, H]` (RoPE'd) at tokens `q_offsets[b] + t` against each head's
    slots of the pool, masked by original position."""
    check_implementation(self, implementation)
    k, v, k_scale, v_scale, pos = self._view()
    q_pos = q_offsets[:, None] + jnp.arange(q.shape[1], dtype=jnp.int32)[None, :]
    out, _ = positional_attention(q, k, v, q_pos, pos, sm_scale=sm_scale, window=window,
                                  soft_cap=soft_cap, **scale_kwargs(k_scale, v_scale))
    return out


_OPTIONS = ("window_size", "kernel_size", "num_sinks", "alpha")


def build(model, batch, max_len, dtype, o, tokens_per_seq) -> tuple[AdaKVCache, ...]:
  """The "adakv" kind's builder: one pool of `K * budget` slots per GQA layer."""
  del max_len, tokens_per_seq  # bounded
  options = {name: o[name] for name in _OPTIONS if o.get(name) is not None}
  return tuple(AdaKVCache.init(batch, o["budget"], a.num_kv_heads, a.head_dim, dtype, **options)
               for a in gqa_layers(model))


registry.register_cache_kind("adakv", registry.CacheKind(
    build, {"budget": registry.REQUIRED, **{name: None for name in _OPTIONS}},
    "AdaKVCache: one pool of K * budget slots per layer, shared by its KV heads (Ada-SnapKV)",
    at_budget=lambda budget, num_sinks: {"budget": budget}))
