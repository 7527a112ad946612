"""Sliding-window caches: a ring of the last W tokens, and StreamingLLM's sinks + ring.

  * `RingKVCache` (sliding window, as Mistral and Gemma's local layers see it):
    W slots; token p goes to slot p % W, so writes wrap. Output equals full
    attention with window W exactly, for any chunking of the input.
  * `SinkKVCache` (StreamingLLM, Xiao et al. 2023, arXiv 2309.17453): the
    first `num_sinks` tokens plus a ring of the W most recent. Keys are stored
    BEFORE RoPE and rotated at read at the position the method assigns:
    positions inside the cache (a token's rank among the kept ones), so no
    position exceeds the cache size; the decode query sits at the position
    just after the kept tokens (`query_position()`).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from kvattn import _checks
from kvattn.caches import capabilities
from kvattn.caches import registry
from kvattn.caches._layers import gqa_layers
from kvattn.ops.positional import positional_attention
from kvattn.ops.rope import apply_rope, check_scaling

from kvattn.caches._bounded import (WrappingCache, empty_storage, float_keys, min_window, prelude,
                                    scale_kwargs)


def _newest_in_ring(lengths: np.ndarray, first: int, window: int) -> np.ndarray:
  """`int[B, window]` (host): slot j of a ring of tokens `p >= first` (token p in slot
  `(p - first) % window`) after `lengths[b]` tokens: the newest such p, or -1."""
  written = lengths[:, None] - first  # ring tokens written per row (negative: none)
  j = np.arange(window)[None, :]
  newest = written - 1 - ((written - 1 - j) % window)  # largest i < written, i % window == j
  return np.where(newest >= 0, first + newest, -1)


# ----------------------------------------------------------------------------------------------
# Sliding-window ring.


@struct.dataclass
class RingKVCache(WrappingCache):
  """Sliding-window cache: W slots, token p in slot p % W (writes wrap).

  Attributes:
    k: `[B, K, W, H]` keys, RoPE'd at their original positions.
    v: `[B, K, W, H]` values.
    pos: `i32[B, W]` token index held by each slot, -1 for none.
    lengths: `i32[B]` tokens written per sequence (grows past W: a ring does
      not overflow, it overwrites the oldest token by design).
    k_scale, v_scale: `f32[B, K, W]` scales of an int8/fp8 cache, else None.
  """

  k: jax.Array
  v: jax.Array
  pos: jax.Array
  lengths: jax.Array
  k_scale: jax.Array | None = None
  v_scale: jax.Array | None = None

  CONTEXT_REPLAYABLE = True  # capabilities.context_replayable: the chunk attends its window

  @classmethod
  def init(cls, batch: int, window: int, num_kv_heads: int, head_dim: int,
           dtype=jnp.float32) -> "RingKVCache":
    """An empty ring of `window` slots per sequence.

    Raises:
      ValueError: a size (window included) that is not a positive int.
      TypeError: a dtype that is neither floating nor int8 / fp8.
    """
    window = _checks.positive_int("window", window)
    storage = empty_storage(batch, window, num_kv_heads, head_dim, dtype)
    return cls(pos=jnp.full((storage["k"].shape[0], window), -1, jnp.int32), **storage)

  @property
  def window(self) -> int:
    return self.capacity

  def expected_pos(self, lengths: np.ndarray) -> np.ndarray:
    """`int[B, W]` (host): the token a ring holding `lengths` tokens keeps in each slot:
    the newest p < lengths[b] with p % W == s, -1 for none."""
    return _newest_in_ring(lengths, 0, self.window)

  def can_truncate(self, length) -> np.ndarray:
    """`bool[B]` (host): whether row b can be cut back to its first `length[b]` tokens
    (`int` or `int[B]`). Token m - 1 attends tokens `(m - W, m)`; a ring that has wrapped
    (lengths > W) overwrote some of them unless nothing is cut (m >= lengths) or
    everything is (m == 0). A ring that never wrapped holds every token."""
    lengths = np.asarray(self.lengths).astype(np.int64)
    m = np.broadcast_to(np.asarray(length, np.int64), lengths.shape)
    return (m >= lengths) | (lengths <= self.window) | (m == 0)

  def truncate(self, length) -> "RingKVCache":
    """The ring holding only the first `length` tokens of each row (`int` or `i32[B]`):
    `lengths` lowered, slots of later tokens emptied (`pos` -1); what a ring of the
    shorter sequence holds (`expected_pos`). Used by `kvattn.inference.reuse.truncate`.

    Raises:
      ValueError: (concrete values) a negative length, or a row whose ring has wrapped
        and would need tokens it overwrote (`can_truncate`): recompute that prompt.
    """
    n = jnp.broadcast_to(jnp.asarray(length, jnp.int32), self.lengths.shape)
    if _checks.is_concrete(n) and _checks.is_concrete(self.lengths):
      _checks.values_in_range("length", n, 0)
      bad = np.flatnonzero(~self.can_truncate(np.asarray(n)))
      if bad.size:
        b = int(bad[0])
        raise ValueError(
            f"length[{b}] = {int(n[b])}: row {b} of this RingKVCache holds {int(self.lengths[b])}"
            f" tokens in {self.window} slots and has overwritten tokens before "
            f"{int(self.lengths[b]) - self.window}, which token {int(n[b]) - 1} attends; "
            f"it can keep 0 or all of its tokens")
    lengths = jnp.minimum(self.lengths, n)
    return self.replace(lengths=lengths, pos=jnp.where(self.pos >= lengths[:, None], -1,
                                                       self.pos))

  def _slots(self, new_lengths: jax.Array, num_tokens: int) -> jax.Array:
    """`i32[B, T]` slot of each new token; W (dropped) for padding and for the tokens
    a later token of the same chunk overwrites."""
    t = jnp.arange(num_tokens, dtype=jnp.int32)[None, :]
    keep = (t < new_lengths[:, None]) & (t >= new_lengths[:, None] - self.window)
    return jnp.where(keep, (self.lengths[:, None] + t) % self.window, self.window)

  def _attend(self, q, k, v, ks, vs, kv_pos, q_pos, lengths, *, sm_scale, window, soft_cap):
    """RoPE'd queries at tokens `q_pos` against keys at tokens `kv_pos`, window `min(W, window)`."""
    del lengths  # the ring's positions are the tokens' own
    out, _ = positional_attention(q, k, v, q_pos, kv_pos, sm_scale=sm_scale,
                                  window=min_window(window, self.window), soft_cap=soft_cap,
                                  **scale_kwargs(ks, vs))
    return out

  def update_attend_unchecked(self, q, k, v, *, positions, rope_theta, rope_scaling=None,
                              new_lengths, sm_scale=None, window=None, soft_cap=None,
                              implementation=None):
    """`cache_protocol.update_attend` (checked arguments; `update_attend` checks them): RoPE at
    `positions`, then the chunk attends the ring as it was plus its own tokens (exact window-W
    attention for any T), and is written (keys RoPE'd). Returns `(out [B, T, N, H], new cache)`."""
    prelude(self, implementation)
    rope = dict(rope_theta=rope_theta, scaling=rope_scaling)
    q, k = apply_rope(q, positions, **rope), apply_rope(k, positions, **rope)
    return self._step(q, k, v, new_lengths,
                      dict(sm_scale=sm_scale, window=window, soft_cap=soft_cap))

  # Boundary state (a prefix cache's snapshot: `kvattn.inference.batching.snapshots`).
  def boundary_layout(self, count: int) -> list[tuple[tuple[int, ...], Any]]:
    """`(shape, dtype)` of each array of a boundary state of `count` tokens."""
    k_heads, _, head_dim = self.k.shape[1:]
    out = [((k_heads, count, head_dim), a.dtype) for a in (self.k, self.v)]
    return out + [((k_heads, count), a.dtype) for a in (self.k_scale, self.v_scale)
                  if a is not None]

  def boundary_state(self, slot, end, count: int) -> tuple:
    """`(k, v, k_scale, v_scale)` of row `slot`'s tokens `[end - count, end)` in token order
    (`[K, count, ...]`; zeros for tokens < 0; None for a float ring's scales)."""
    p, idx = capabilities.tokens_before(end, count, self.capacity)
    return tuple(capabilities.row_tokens(a, slot, p, idx)
                 for a in (self.k, self.v, self.k_scale, self.v_scale))

  def with_boundary_state(self, slot, state, end, count: int) -> "RingKVCache":
    """Row `slot` as the ring of an `end`-token sequence, from `boundary_state` (traceable)."""
    p, idx = capabilities.tokens_before(end, count, self.capacity)
    pos = jnp.full((self.capacity,), -1, jnp.int32).at[idx].set(jnp.where(p >= 0, p, -1))
    put = lambda a, new: capabilities.put_row_tokens(a, slot, idx, new)
    return self.replace(k=put(self.k, state[0]), v=put(self.v, state[1]),
                        k_scale=put(self.k_scale, state[2]), v_scale=put(self.v_scale, state[3]),
                        pos=self.pos.at[slot].set(pos), lengths=self.lengths.at[slot].set(end))


# ----------------------------------------------------------------------------------------------
# Attention sinks (StreamingLLM).


@struct.dataclass
class SinkKVCache(WrappingCache):
  """StreamingLLM cache: `num_sinks` first tokens plus a ring of the W most recent.

  Attributes:
    k: `[B, K, S, H]` keys before RoPE, S = num_sinks + W.
    v: `[B, K, S, H]` values.
    pos: `i32[B, S]` original token index per slot, -1 for none.
    lengths: `i32[B]` tokens written per sequence (grows past S).
    k_scale, v_scale: `f32[B, K, S]` scales of an int8/fp8 cache, else None.
    num_sinks: static, the sink tokens kept.
    rope_theta, rope_scaling: static, the RoPE used at read (base and `kvattn.ops.RopeScaling` or
      None); `update_attend` checks that the module's are the same.
  """

  k: jax.Array
  v: jax.Array
  pos: jax.Array
  lengths: jax.Array
  k_scale: jax.Array | None = None
  v_scale: jax.Array | None = None
  num_sinks: int = struct.field(pytree_node=False, default=4)
  rope_theta: float = struct.field(pytree_node=False, default=10000.0)
  rope_scaling: Any = struct.field(pytree_node=False, default=None)

  @classmethod
  def init(cls, batch: int, num_sinks: int, window: int, num_kv_heads: int, head_dim: int,
           dtype=jnp.float32, *, rope_theta: float = 10000.0,
           rope_scaling: Any = None) -> "SinkKVCache":
    """An empty sink cache of `num_sinks + window` slots per sequence.

    Raises:
      ValueError: `num_sinks` not an int >= 0, `window` not a positive int
        (the budget `num_sinks + window` must leave at least one recent slot),
        other sizes not positive, a non-positive `rope_theta`.
      TypeError: a dtype that is neither floating nor int8 / fp8.
    """
    if isinstance(num_sinks, bool) or not isinstance(num_sinks, (int, np.integer)) or \
        num_sinks < 0:
      raise ValueError(f"num_sinks must be an int >= 0; got {num_sinks!r}")
    window = _checks.positive_int("window", window)
    rope_theta = _checks.positive_float("rope_theta", rope_theta)
    if head_dim % 2:
      raise ValueError(f"head_dim must be even for RoPE; got {head_dim}")
    capacity = int(num_sinks) + window
    storage = empty_storage(batch, capacity, num_kv_heads, head_dim, dtype)
    return cls(pos=jnp.full((storage["k"].shape[0], capacity), -1, jnp.int32),
               num_sinks=int(num_sinks), rope_theta=rope_theta,
               rope_scaling=check_scaling(rope_scaling), **storage)

  @property
  def _rope(self) -> dict[str, Any]:
    return dict(rope_theta=self.rope_theta, scaling=self.rope_scaling)

  @property
  def window(self) -> int:
    """W: the recent tokens kept besides the sinks."""
    return self.capacity - self.num_sinks

  def expected_pos(self, lengths: np.ndarray) -> np.ndarray:
    """`int[B, S]` (host): sinks `0..num_sinks-1` in the first slots (while written), then
    the ring of the W newest later tokens, token p in slot `num_sinks + (p - num_sinks) % W`."""
    s = np.arange(self.num_sinks)[None, :]
    sinks = np.where(s < lengths[:, None], s, -1)
    return np.concatenate([sinks, _newest_in_ring(lengths, self.num_sinks, self.window)], axis=1)

  def _shift(self, lengths: jax.Array) -> jax.Array:
    """`i32[B]`: tokens evicted from the ring when `lengths` tokens were written."""
    return jnp.maximum(lengths - self.capacity, 0)

  def cache_positions(self) -> jax.Array:
    """`i32[B, S]`: the RoPE position each slot's key is read at (its rank among the
    kept tokens), -1 for an empty slot."""
    shift = self._shift(self.lengths)[:, None]
    return jnp.where(self.pos < 0, -1,
                     jnp.where(self.pos < self.num_sinks, self.pos, self.pos - shift))

  def query_position(self) -> jax.Array:
    """`i32[B]`: the RoPE position of the next decode query: the tokens the cache holds
    besides it, `min(lengths, capacity - 1)`."""
    return jnp.minimum(self.lengths, self.capacity - 1)

  def rotated_keys(self) -> jax.Array:
    """`f32[B, K, S, H]`: the keys as attention reads them, RoPE'd at `cache_positions()`
    (scales not applied; an empty slot is rotated at 0)."""
    keys = jnp.swapaxes(float_keys(self.k), 1, 2)  # [B, S, K, H]
    rotated = apply_rope(keys, jnp.maximum(self.cache_positions(), 0), **self._rope)
    return jnp.swapaxes(rotated, 1, 2)

  def _slots(self, new_lengths: jax.Array, num_tokens: int) -> jax.Array:
    t = jnp.arange(num_tokens, dtype=jnp.int32)[None, :]
    p = self.lengths[:, None] + t
    end = (self.lengths + new_lengths)[:, None]
    sink = p < self.num_sinks
    keep = (t < new_lengths[:, None]) & (sink | (p >= end - self.window))
    ring = self.num_sinks + (p - self.num_sinks) % self.window
    return jnp.where(keep, jnp.where(sink, p, ring), self.capacity)

  def _attend(self, q, k, v, ks, vs, kv_pos, q_pos, lengths, *, sm_scale, window, soft_cap):
    """Raw queries at tokens `q_pos [B, T]` against raw candidate keys `[B, K, S', H]`
    at tokens `kv_pos [B, S']`, `lengths` tokens written once the chunk is in."""
    shift = self._shift(lengths)[:, None]  # the chunk's last query's shift
    is_sink = (kv_pos >= 0) & (kv_pos < self.num_sinks)
    k_at = jnp.where(is_sink, kv_pos, kv_pos - shift)
    keys = apply_rope(jnp.swapaxes(float_keys(k), 1, 2), k_at, **self._rope)
    q_recent = apply_rope(q, q_pos - shift, **self._rope)
    q_sinks = None
    if q.shape[1] > 1:  # each query's own shift against the sinks (equal for one query)
      own = q_pos - jnp.maximum(q_pos + 1 - self.capacity, 0)
      q_sinks = apply_rope(q, own, **self._rope)
    out, _ = positional_attention(
        q_recent, jnp.swapaxes(keys, 1, 2), v, q_pos, kv_pos, sm_scale=sm_scale,
        window=min_window(window, self.window), soft_cap=soft_cap, always_visible=is_sink,
        q_always_visible=q_sinks, **scale_kwargs(ks, vs))
    return out

  def update_attend_unchecked(self, q, k, v, *, positions, rope_theta, rope_scaling=None,
                              new_lengths, sm_scale=None, window=None, soft_cap=None,
                              implementation=None):
    """`cache_protocol.update_attend` (checked arguments; `update_attend` checks them): the module's
    `positions` are not used (the cache assigns RoPE positions); `rope_theta` must be the cache's. A
    chunk attends the cache as it was plus its own tokens, then is written."""
    del positions  # StreamingLLM: positions inside the cache, not in the text
    prelude(self, implementation)
    if (float(rope_theta), rope_scaling) != (self.rope_theta, self.rope_scaling):
      raise ValueError(f"rope_theta, rope_scaling must be the cache's {self.rope_theta}, "
                       f"{self.rope_scaling} (SinkKVCache.init(rope_theta=, rope_scaling=)); got "
                       f"{rope_theta}, {rope_scaling}")
    return self._step(q, k, v, new_lengths,
                      dict(sm_scale=sm_scale, window=window, soft_cap=soft_cap))


def _ring(model, batch, max_len, dtype, o, tokens_per_seq):
  del max_len, tokens_per_seq  # bounded: the capacity is the window
  return tuple(RingKVCache.init(batch, o["window"], a.num_kv_heads, a.head_dim, dtype)
               for a in gqa_layers(model))


def _sink(model, batch, max_len, dtype, o, tokens_per_seq):
  del max_len, tokens_per_seq
  return tuple(SinkKVCache.init(batch, o["num_sinks"], o["window"], a.num_kv_heads,
                                a.head_dim, dtype, rope_theta=a.rope_theta,
                                rope_scaling=a.rope_scaling)
               for a in gqa_layers(model))


def _sink_at_budget(budget: int, num_sinks: int) -> dict:
  if budget <= num_sinks:
    raise ValueError(f"budget must be > num_sinks = {num_sinks} for kind 'sink'; got {budget}")
  return {"num_sinks": num_sinks, "window": budget - num_sinks}


registry.register_cache_kind("ring", registry.CacheKind(
    _ring, {"window": registry.REQUIRED},
    "RingKVCache: the last `window` tokens (sliding-window attention)",
    at_budget=lambda budget, num_sinks: {"window": budget}))
registry.register_cache_kind("sink", registry.CacheKind(
    _sink, {"num_sinks": 4, "window": registry.REQUIRED},
    "SinkKVCache: StreamingLLM, `num_sinks` first tokens + a ring of `window`",
    at_budget=_sink_at_budget))
