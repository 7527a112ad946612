"""Bounded KV caches for long contexts: a sliding-window ring, attention sinks, eviction.

Three cache kinds of `kvattn.caches.protocol.GQACache` whose capacity stays
fixed however long the sequence grows. Each is a `flax.struct` pytree whose
storage is allocated at its capacity (`storage_arrays()` / `storage_slots`, so
`kvattn.memory` reports capacity x bytes per token), and whose slots carry
the original token index they hold (`pos`, -1 for none): attention masks by
original position (causality, windows), through
`kvattn.ops.positional.positional_attention`.

  * `RingKVCache` (sliding window, as Mistral and Gemma's local layers see it):
    W slots; token p goes to slot p % W, so writes wrap. Output equals full
    attention with window W exactly, for any chunking of the input.
  * `SinkKVCache` (StreamingLLM, Xiao et al. 2023, arXiv 2309.17453): the
    first `num_sinks` tokens plus a ring of the W most recent. Keys are stored
    BEFORE RoPE and rotated at read at the position the method assigns:
    positions inside the cache (a token's rank among the kept ones), so no
    position exceeds the cache size; the decode query sits at the position
    just after the kept tokens (`query_position()`).
  * `EvictingKVCache` (a fixed budget per sequence and per KV head; keys keep
    their original rotation, as in H2O and SnapKV): policies
      - "h2o" (Zhang et al. 2023, arXiv 2306.14048): attention mass
        accumulated per slot over every query since the token arrived; keep
        the heavy hitters plus the `recent_size` most recent tokens;
      - "snapkv" (Li et al. 2024, arXiv 2404.14469): mass from an observation
        window of the last `window_size` queries of each chunk, average-pooled
        over `kernel_size` neighbouring slots, accumulated; keep the top slots
        plus the observation window;
      - "tova" (Oren et al. 2024, arXiv 2401.06104): keep the slots the
        newest query attends most (evict the lowest current attention);
      - baselines "recent" (the most recent), "random", "knorm" (keep the
        smallest key L2 norms, kvpress's KnormPress).
    Scores of a KV head are the sum over its G query heads (the cache is
    never expanded to N heads). Every policy may protect `num_sinks` first
    tokens. Candidates are the kept slots plus the new chunk: each chunk
    attends all of them (exact for that chunk), then the budget is chosen
    among them, so a long prompt fed in chunks is scored chunk by chunk and no
    `[S, S]` matrix is built (queries are processed in blocks, too).

Protocol use: the attention module calls `update_attend` (the optional member
of `kvattn.caches.protocol`, see `cache_protocol.update_attend`) with queries
and keys *before* RoPE, so each kind rotates as its method requires, sees the
queries that score the slots, and attends the chunk's own keys before any of
them is evicted or overwritten. The plain `update` + `attend` pair works too
(keys RoPE'd at their original positions for the ring and the evicting
cache; raw keys and queries for the sink cache): for a single token it equals
`update_attend`; for a chunk it attends only what the cache kept.

The decode path is XLA (`implementation` None or "xla"); it returns the
per-slot probability mass it computes (`positional_decode_attention`).

Quantized storage (int8 / fp8, one f32 scale per token per KV head,
`kvattn.ops.quantize_kv`) works for every kind and policy: values are
quantized on write and the scales applied on read; "knorm" scores the
dequantized key norms.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from kvattn import _checks
from kvattn.caches import dense as cache_lib
from kvattn.ops import quant
from kvattn.ops.positional import positional_attention
from kvattn.ops.rope import apply_rope

POLICIES = ("h2o", "snapkv", "tova", "recent", "random", "knorm")
"""Eviction policies of `EvictingKVCache`."""

POLICY_OPTIONS = {
    "h2o": ("recent_size",),
    "snapkv": ("window_size", "kernel_size"),
    "tova": ("recent_size",),
    "recent": (),
    "random": ("seed",),
    "knorm": ("recent_size",),
}
"""The options each eviction policy takes besides `num_sinks` (which all take)."""


# ----------------------------------------------------------------------------------------------
# Shared pieces.


def _check_new_kv(cache, k_new, v_new) -> None:
  """Shapes and dtypes of `k_new, v_new: [B, T, K, H]` against the cache's sizes."""
  want = (cache.batch, cache.num_kv_heads, cache.head_dim)
  for name, x in (("k_new", k_new), ("v_new", v_new)):
    _checks.rank(name, x, 4, "[B, T, K, H]")
    _checks.floating(name, x)
    if (x.shape[0], x.shape[2], x.shape[3]) != want:
      raise ValueError(f"{name} must have shape [B, T, K, H] with B, K, H = {want}; got "
                       f"{tuple(x.shape)}")
  if k_new.shape != v_new.shape:
    raise ValueError(f"k_new and v_new must have one shape; got {k_new.shape} and {v_new.shape}")


def _check_q(cache, q, num_tokens: int) -> None:
  _checks.rank("q", q, 4, "[B, T, N, H]")
  _checks.floating("q", q)
  if q.shape[0] != cache.batch or q.shape[1] != num_tokens or q.shape[3] != cache.head_dim:
    raise ValueError(f"q must have shape [B, T, N, H] = ({cache.batch}, {num_tokens}, N, "
                     f"{cache.head_dim}); got {tuple(q.shape)}")
  _checks.head_layout(q.shape[2], cache.num_kv_heads)


def _check_implementation(cache, implementation) -> None:
  if implementation not in (None, "xla"):
    raise ValueError(f"implementation must be None or 'xla' for a {type(cache).__name__} (its "
                     f"attention is the XLA positional path); got {implementation!r}")


def _prelude(cache, q, k, v, new_lengths, implementation) -> jax.Array:
  """The checks every `update_attend` starts with; returns `new_lengths` as `i32[B]`."""
  _check_new_kv(cache, k, v)
  _check_q(cache, q, k.shape[1])
  _check_implementation(cache, implementation)
  return cache_lib.resolve_new_lengths(new_lengths, cache.batch, k.shape[1])


def _new_positions(lengths: jax.Array, new_lengths: jax.Array, num_tokens: int) -> jax.Array:
  """`i32[B, T]`: token index `lengths[b] + t` of each new token, -1 for padding."""
  t = jnp.arange(num_tokens, dtype=jnp.int32)[None, :]
  return jnp.where(t < new_lengths[:, None], lengths[:, None] + t, -1)


def _heads_first(x: jax.Array) -> jax.Array:
  """`[B, T, K, ...]` -> `[B, K, T, ...]`."""
  return jnp.swapaxes(x, 1, 2)


def _encode(cache, k_new, v_new):
  """New keys and values in storage layout `[B, K, T, H]` and dtype, with scales `[B, K, T]`."""
  (k, ks), (v, vs) = cache_lib.encode(k_new, cache.dtype), cache_lib.encode(v_new, cache.dtype)
  k, v = _heads_first(k).astype(cache.dtype), _heads_first(v).astype(cache.dtype)
  return k, v, (None if ks is None else _heads_first(ks)), (None if vs is None else
                                                           _heads_first(vs))


def _concat(stored, new, axis: int = 2):
  return None if stored is None else jnp.concatenate([stored, new], axis=axis)


def _scatter_slots(buffer: jax.Array, new: jax.Array, slots: jax.Array) -> jax.Array:
  """`buffer[b, :, slots[b, t]] = new[b, :, t]` for `[B, K, S, ...]` buffers and
  `[B, K, T, ...]` new values; slots >= S are dropped."""
  rows = jnp.broadcast_to(jnp.arange(slots.shape[0], dtype=jnp.int32)[:, None], slots.shape)
  return buffer.at[rows, :, slots].set(jnp.swapaxes(new, 1, 2).astype(buffer.dtype),
                                       mode="drop")


def _scale_kwargs(k_scale, v_scale) -> dict[str, Any]:
  return {} if k_scale is None else {"k_scale": k_scale, "v_scale": v_scale}


def _min_window(a: int | None, b: int | None) -> int | None:
  return b if a is None else (a if b is None else min(a, b))


def _float_keys(k: jax.Array) -> jax.Array:
  """Stored keys as f32 values (a quantized cache's scales stay separate)."""
  return k.astype(jnp.float32)


class _Common:
  """Members the three kinds share (sizes, storage, the protocol's bookkeeping)."""

  @property
  def batch(self) -> int:
    return self.k.shape[0]

  @property
  def num_kv_heads(self) -> int:
    return self.k.shape[1]

  @property
  def capacity(self) -> int:
    """Token slots per sequence: the window / budget the cache was built with."""
    return self.k.shape[2]

  @property
  def head_dim(self) -> int:
    return self.k.shape[3]

  @property
  def dtype(self) -> jnp.dtype:
    return self.k.dtype

  @property
  def quantized(self) -> bool:
    return self.k_scale is not None

  @property
  def storage_slots(self) -> int:
    """Token slots of the storage arrays: B * capacity (capacity IS the budget)."""
    return self.batch * self.capacity

  def storage_arrays(self) -> tuple[jax.Array, ...]:
    """Keys and values (and their scales when quantized). `pos` (and the eviction
    `scores`) are bookkeeping, like `lengths`."""
    return (self.k, self.v) + ((self.k_scale, self.v_scale) if self.quantized else ())

  def slot_positions(self) -> jax.Array:
    """`i32[B, capacity]`: the original token index held by each slot, -1 for none."""
    return self.pos

  def dequantized(self, dtype=jnp.float32) -> tuple[jax.Array, jax.Array]:
    """`(k, v)` `[B, K, S, H]` as stored, in `dtype` (scales applied): for tests."""
    if not self.quantized:
      return self.k.astype(dtype), self.v.astype(dtype)
    return (quant.dequantize_kv(self.k, self.k_scale, dtype),
            quant.dequantize_kv(self.v, self.v_scale, dtype))


class _Wrapping(_Common):
  """Ring and sinks: new tokens overwrite slots chosen by `_slots`; no scoring."""

  def _write(self, k, v, ks, vs, new_lengths):
    """Scatters encoded new tokens (`[B, K, T, ...]`) into their `_slots`."""
    num_tokens = k.shape[2]
    slots = self._slots(new_lengths, num_tokens)
    new_pos = _new_positions(self.lengths, new_lengths, num_tokens)
    scatter = lambda buf, new: None if buf is None else _scatter_slots(buf, new, slots)
    rows = jnp.broadcast_to(jnp.arange(self.batch, dtype=jnp.int32)[:, None], slots.shape)
    return self.replace(k=scatter(self.k, k), v=scatter(self.v, v),
                        pos=self.pos.at[rows, slots].set(new_pos, mode="drop"),
                        lengths=self.lengths + new_lengths,
                        k_scale=scatter(self.k_scale, ks), v_scale=scatter(self.v_scale, vs))

  def update(self, k_new: jax.Array, v_new: jax.Array, new_lengths: jax.Array | None = None):
    """Writes `k_new, v_new: [B, T, K, H]` for `t < new_lengths[b]` into the slots the
    kind assigns (only the tokens no later token of the chunk overwrites)."""
    _check_new_kv(self, k_new, v_new)
    new_lengths = cache_lib.resolve_new_lengths(new_lengths, self.batch, k_new.shape[1])
    return self._write(*_encode(self, k_new, v_new), new_lengths)

  def attend(self, q: jax.Array, *, q_offsets: jax.Array, sm_scale: float | None = None,
             window: int | None = None, soft_cap: float | None = None,
             implementation: str | None = None) -> jax.Array:
    """Queries at tokens `q_offsets[b] + t` against the stored slots: exact for T == 1
    after `update`; a chunk's queries see only what the cache still holds (the module
    goes through `update_attend`, which is exact for chunks)."""
    _check_implementation(self, implementation)
    q_pos = q_offsets[:, None] + jnp.arange(q.shape[1], dtype=jnp.int32)[None, :]
    return self._attend(q, self.k, self.v, self.k_scale, self.v_scale, self.pos, q_pos,
                        self.lengths, sm_scale=sm_scale, window=window, soft_cap=soft_cap)

  def _step(self, q, k, v, new_lengths, opts):
    """One token: write, then attend the stored slots. A chunk: attend the stored slots
    plus the chunk's own tokens, then write (the chunk may overwrite its own window)."""
    num_tokens = k.shape[1]
    if num_tokens == 1:
      new = self.update(k, v, new_lengths)
      return new.attend(q, q_offsets=self.lengths, **opts), new
    kq, vq, ks, vs = _encode(self, k, v)
    q_pos = self.lengths[:, None] + jnp.arange(num_tokens, dtype=jnp.int32)[None, :]
    cand_pos = jnp.concatenate([self.pos, _new_positions(self.lengths, new_lengths,
                                                         num_tokens)], axis=1)
    out = self._attend(q, _concat(self.k, kq), _concat(self.v, vq), _concat(self.k_scale, ks),
                       _concat(self.v_scale, vs), cand_pos, q_pos, self.lengths + new_lengths,
                       sm_scale=opts["sm_scale"], window=opts["window"],
                       soft_cap=opts["soft_cap"])
    return out, self._write(kq, vq, ks, vs, new_lengths)


def _empty_storage(batch, capacity, num_kv_heads, head_dim, dtype):
  """Zeros `[B, K, S, H]` keys and values, their scales (quantized dtypes) and
  `pos = -1`, `lengths = 0`."""
  batch = _checks.positive_int("batch", batch)
  num_kv_heads = _checks.positive_int("num_kv_heads", num_kv_heads)
  head_dim = _checks.positive_int("head_dim", head_dim)
  dtype = cache_lib.check_storage_dtype(dtype)
  shape = (batch, num_kv_heads, capacity, head_dim)
  return dict(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype),
              lengths=jnp.zeros((batch,), jnp.int32),
              k_scale=cache_lib.scale_init(shape[:3], dtype),
              v_scale=cache_lib.scale_init(shape[:3], dtype))


# ----------------------------------------------------------------------------------------------
# Sliding-window ring.


@struct.dataclass
class RingKVCache(_Wrapping):
  """Sliding-window cache: W slots, token p in slot p % W (writes wrap).

  Attributes:
    k: `[B, K, W, H]` keys, RoPE'd at their original positions.
    v: `[B, K, W, H]` values.
    pos: `i32[B, W]` token index held by each slot, -1 for none.
    lengths: `i32[B]` tokens written per sequence (grows past W: a ring does
      not overflow, it overwrites the oldest token by design).
    k_scale, v_scale: `f32[B, K, W]` scales of an int8/fp8 cache, else None.

  Attention sees, for the query at token p, the tokens `(p - W, p]`: full
  attention with window W (and the module's own window, if smaller).
  """

  k: jax.Array
  v: jax.Array
  pos: jax.Array
  lengths: jax.Array
  k_scale: jax.Array | None = None
  v_scale: jax.Array | None = None

  @classmethod
  def init(cls, batch: int, window: int, num_kv_heads: int, head_dim: int,
           dtype=jnp.float32) -> "RingKVCache":
    """An empty ring of `window` slots per sequence.

    Raises:
      ValueError: a size (window included) that is not a positive int.
      TypeError: a dtype that is neither floating nor int8 / fp8.
    """
    window = _checks.positive_int("window", window)
    storage = _empty_storage(batch, window, num_kv_heads, head_dim, dtype)
    return cls(pos=jnp.full((storage["k"].shape[0], window), -1, jnp.int32), **storage)

  @property
  def window(self) -> int:
    return self.capacity

  def _slots(self, new_lengths: jax.Array, num_tokens: int) -> jax.Array:
    """`i32[B, T]` slot of each new token; W (dropped) for padding and for the tokens
    a later token of the same chunk overwrites."""
    t = jnp.arange(num_tokens, dtype=jnp.int32)[None, :]
    keep = (t < new_lengths[:, None]) & (t >= new_lengths[:, None] - self.window)
    return jnp.where(keep, (self.lengths[:, None] + t) % self.window, self.window)

  def _attend(self, q, k, v, ks, vs, kv_pos, q_pos, lengths, *, sm_scale, window, soft_cap):
    """RoPE'd queries at tokens `q_pos` against keys at tokens `kv_pos`, window
    `min(W, window)`."""
    del lengths  # the ring's positions are the tokens' own
    out, _ = positional_attention(q, k, v, q_pos, kv_pos, sm_scale=sm_scale,
                                  window=_min_window(window, self.window), soft_cap=soft_cap,
                                  **_scale_kwargs(ks, vs))
    return out

  def update_attend(self, q, k, v, *, positions, rope_theta, rope_scaling=None,
                    new_lengths=None, sm_scale=None, window=None, soft_cap=None,
                    implementation=None):
    """`cache_protocol.update_attend`: RoPE at `positions`, then the chunk attends the
    ring as it was plus its own tokens (exact window-W attention for any T), and is
    written (keys RoPE'd). Returns `(out [B, T, N, H], new cache)`."""
    new_lengths = _prelude(self, q, k, v, new_lengths, implementation)
    rope = dict(rope_theta=rope_theta, scaling=rope_scaling)
    q, k = apply_rope(q, positions, **rope), apply_rope(k, positions, **rope)
    return self._step(q, k, v, new_lengths,
                      dict(sm_scale=sm_scale, window=window, soft_cap=soft_cap))


# ----------------------------------------------------------------------------------------------
# Attention sinks (StreamingLLM).


@struct.dataclass
class SinkKVCache(_Wrapping):
  """StreamingLLM cache: `num_sinks` first tokens plus a ring of the W most recent.

  Slots `[0, num_sinks)` hold tokens `0..num_sinks-1`; token p >= num_sinks
  goes to slot `num_sinks + (p - num_sinks) % W`. Keys are stored before
  RoPE and rotated at read at the positions the method assigns inside the
  cache (`cache_positions()`): a kept token's rank among the kept tokens
  (sinks keep 0..num_sinks-1; once the cache is full the ring tokens take
  `num_sinks..capacity-1`, oldest first). The decode query takes the next
  position (`query_position()`), so no position reaches the capacity.

  Attributes:
    k: `[B, K, S, H]` keys before RoPE, S = num_sinks + W.
    v: `[B, K, S, H]` values.
    pos: `i32[B, S]` original token index per slot, -1 for none.
    lengths: `i32[B]` tokens written per sequence (grows past S).
    k_scale, v_scale: `f32[B, K, S]` scales of an int8/fp8 cache, else None.
    num_sinks: static, the sink tokens kept.
    rope_theta, rope_scaling: static, the RoPE used at read (base and
      `kvattn.ops.RopeScaling` or None); `update_attend` checks that the
      module's are the same.
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
    storage = _empty_storage(batch, capacity, num_kv_heads, head_dim, dtype)
    return cls(pos=jnp.full((storage["k"].shape[0], capacity), -1, jnp.int32),
               num_sinks=int(num_sinks), rope_theta=rope_theta,
               rope_scaling=_checks.rope_scaling(rope_scaling), **storage)

  @property
  def _rope(self) -> dict[str, Any]:
    return dict(rope_theta=self.rope_theta, scaling=self.rope_scaling)

  @property
  def window(self) -> int:
    """W: the recent tokens kept besides the sinks."""
    return self.capacity - self.num_sinks

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
    keys = jnp.swapaxes(_float_keys(self.k), 1, 2)  # [B, S, K, H]
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
    keys = apply_rope(jnp.swapaxes(_float_keys(k), 1, 2), k_at, **self._rope)
    q_recent = apply_rope(q, q_pos - shift, **self._rope)
    q_sinks = None
    if q.shape[1] > 1:  # each query's own shift against the sinks (equal for one query)
      own = q_pos - jnp.maximum(q_pos + 1 - self.capacity, 0)
      q_sinks = apply_rope(q, own, **self._rope)
    out, _ = positional_attention(
        q_recent, jnp.swapaxes(keys, 1, 2), v, q_pos, kv_pos, sm_scale=sm_scale,
        window=_min_window(window, self.window), soft_cap=soft_cap, always_visible=is_sink,
        q_always_visible=q_sinks, **_scale_kwargs(ks, vs))
    return out

  def update_attend(self, q, k, v, *, positions, rope_theta, rope_scaling=None,
                    new_lengths=None, sm_scale=None, window=None, soft_cap=None,
                    implementation=None):
    """`cache_protocol.update_attend`: the module's `positions` are not used (the cache
    assigns RoPE positions); `rope_theta` must be the cache's. A chunk attends the cache
    as it was plus its own tokens, then is written."""
    del positions  # StreamingLLM: positions inside the cache, not in the text
    new_lengths = _prelude(self, q, k, v, new_lengths, implementation)
    if (float(rope_theta), rope_scaling) != (self.rope_theta, self.rope_scaling):
      raise ValueError(f"rope_theta, rope_scaling must be the cache's {self.rope_theta}, "
                       f"{self.rope_scaling} (SinkKVCache.init(rope_theta=, rope_scaling=)); got "
                       f"{rope_theta}, {rope_scaling}")
    return self._step(q, k, v, new_lengths,
                      dict(sm_scale=sm_scale, window=window, soft_cap=soft_cap))


# ----------------------------------------------------------------------------------------------
# Score-based eviction.


def _policy_options(policy: str, budget: int, options: dict[str, Any]) -> tuple:
  """Validated options of `policy` as a sorted tuple of (name, value) (static, hashable)."""
  if not isinstance(policy, str) or policy not in POLICIES:
    raise ValueError(f"policy must be one of {POLICIES}; got {policy!r}")
  allowed = POLICY_OPTIONS[policy] + ("num_sinks",)
  unknown = sorted(set(options) - set(allowed))
  if unknown:
    raise ValueError(f"unknown option(s) {unknown} for policy {policy!r}; it takes {allowed}")
  defaults = {"num_sinks": 0, "recent_size": budget // 2 if policy == "h2o" else 0,
              "window_size": min(32, budget // 2), "kernel_size": 5, "seed": 0}
  resolved = {name: options.get(name, defaults[name]) for name in allowed}
  for name, value in resolved.items():
    minimum = 1 if name in ("kernel_size", "window_size") else 0
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
      raise ValueError(f"{name} must be an int >= {minimum}; got {value!r}")
  if budget < resolved["num_sinks"] + 1:
    raise ValueError(f"budget must be >= num_sinks + 1 = {resolved['num_sinks'] + 1} (one slot "
                     f"for the newest token); got {budget}")
  protected = resolved["num_sinks"] + resolved.get("recent_size", resolved.get("window_size", 0))
  if protected > budget:
    raise ValueError(f"num_sinks + the recent/observation window ({protected}) must fit the "
                     f"budget {budget}")
  return tuple(sorted((name, int(value)) for name, value in resolved.items()))


def _avg_pool(x: jax.Array, size: int) -> jax.Array:
  """Average pooling of `f32[B, K, S]` over S, stride 1, zero-padded to keep S (SnapKV)."""
  if size == 1:
    return x
  left = size // 2
  summed = jax.lax.reduce_window(x, 0.0, jax.lax.add, (1, 1, size), (1, 1, 1),
                                 [(0, 0), (0, 0), (left, size - 1 - left)])
  return summed / size


@struct.dataclass
class EvictingKVCache(_Common):
  """A fixed budget of slots per sequence and KV head, filled by an eviction policy.

  Each KV head of each sequence keeps its own `budget` tokens (policies in the
  module doc), stored sorted by original position; keys keep the RoPE of
  their original position, and attention masks by it (causality, windows).

  Attributes:
    k: `[B, K, budget, H]` keys, RoPE'd at their original positions.
    v: `[B, K, budget, H]` values.
    pos: `i32[B, K, budget]` original token index per slot, -1 for none.
    scores: `f32[B, K, budget]` the policy's score of each kept slot
      (accumulated attention mass for h2o / snapkv, the newest query's mass
      for tova).
    lengths: `i32[B]` tokens written per sequence (grows past the budget).
    k_scale, v_scale: `f32[B, K, budget]` scales of an int8/fp8 cache, else None.
    policy: static policy name.
    options: static `((name, value), ...)` of the policy's options.
  """

  k: jax.Array
  v: jax.Array
  pos: jax.Array
  scores: jax.Array
  lengths: jax.Array
  k_scale: jax.Array | None = None
  v_scale: jax.Array | None = None
  policy: str = struct.field(pytree_node=False, default="h2o")
  options: tuple = struct.field(pytree_node=False, default=())

  @classmethod
  def init(cls, batch: int, budget: int, num_kv_heads: int, head_dim: int, dtype=jnp.float32,
           *, policy: str, **policy_options) -> "EvictingKVCache":
    """An empty cache of `budget` slots per sequence and KV head.

    Options (module doc): `num_sinks` (all policies, default 0), `recent_size`
    (h2o: default budget // 2; tova, knorm: default 0), `window_size` and
    `kernel_size` (snapkv: default min(32, budget // 2) and 5), `seed` (random).

    Raises:
      ValueError: an unknown policy or option, budget < num_sinks + 1, protected
        windows larger than the budget, sizes that are not positive ints.
      TypeError: a dtype that is neither floating nor int8 / fp8.
    """
    budget = _checks.positive_int("budget", budget)
    options = _policy_options(policy, budget, policy_options)
    storage = _empty_storage(batch, budget, num_kv_heads, head_dim, dtype)
    shape = storage["k"].shape[:3]
    return cls(pos=jnp.full(shape, -1, jnp.int32), scores=jnp.zeros(shape, jnp.float32),
               policy=policy, options=options, **storage)

  @property
  def budget(self) -> int:
    return self.capacity

  def option(self, name: str) -> int:
    """The policy option `name` (e.g. `recent_size`) this cache was built with."""
    return dict(self.options)[name]

  def slot_positions(self) -> jax.Array:
    """`i32[B, K, budget]`: each KV head keeps its own tokens (-1 for none)."""
    return self.pos

  def _score_queries(self, new_lengths: jax.Array, num_tokens: int) -> jax.Array | None:
    """`bool[B, T]`: the queries whose attention scores the slots, None if none do."""
    t = jnp.arange(num_tokens, dtype=jnp.int32)[None, :]
    real = t < new_lengths[:, None]
    if self.policy == "h2o":
      return real
    if self.policy == "snapkv":
      return real & (t >= new_lengths[:, None] - self.option("window_size"))
    if self.policy == "tova":
      return t == new_lengths[:, None] - 1
    return None

  def _select(self, k, v, ks, vs, new_lengths, mass) -> "EvictingKVCache":
    """Chooses `budget` of the kept slots + the new tokens (`[B, K, T, ...]`) per
    sequence and KV head; `mass` is the chunk's `f32[B, K, S + T]` score mass or None."""
    num_tokens = k.shape[2]
    new_pos = jnp.broadcast_to(_new_positions(self.lengths, new_lengths, num_tokens)[:, None],
                               (self.batch, self.num_kv_heads, num_tokens))
    cand_pos = _concat(self.pos, new_pos)
    cand_k = _concat(self.k, k)
    cand_ks = _concat(self.k_scale, ks)
    end = (self.lengths + new_lengths)[:, None, None]
    mass = jnp.zeros(cand_pos.shape, jnp.float32) if mass is None else mass
    carried = _concat(self.scores, jnp.zeros(new_pos.shape, jnp.float32))
    if self.policy == "h2o":
      score = carried + mass
    elif self.policy == "snapkv":
      score = carried + _avg_pool(mass, self.option("kernel_size"))
    elif self.policy == "tova":
      score = mass
    elif self.policy == "recent":
      score = cand_pos.astype(jnp.float32)
    elif self.policy == "random":
      key = jax.random.fold_in(jax.random.key(self.option("seed")), jnp.sum(end))
      score = jax.random.uniform(key, cand_pos.shape)
    else:  # knorm: keep the smallest key norms
      keys = _float_keys(cand_k)
      norms = jnp.linalg.norm(keys, axis=-1)
      score = -(norms if cand_ks is None else norms * jnp.abs(cand_ks))
    recent = self.option("window_size") if self.policy == "snapkv" else \
        dict(self.options).get("recent_size", 0)
    protect = (cand_pos < self.option("num_sinks")) | (cand_pos > end - 1 - recent)
    priority = jnp.where(protect, jnp.inf, score)
    priority = jnp.where(cand_pos < 0, -jnp.inf, priority)
    _, idx = jax.lax.top_k(priority, self.budget)  # [B, K, budget]
    kept_pos = jnp.take_along_axis(cand_pos, idx, axis=2)
    order = jnp.argsort(jnp.where(kept_pos < 0, jnp.iinfo(jnp.int32).max, kept_pos), axis=2)
    idx = jnp.take_along_axis(idx, order, axis=2)
    take = lambda x: None if x is None else jnp.take_along_axis(
        x, idx.reshape(idx.shape + (1,) * (x.ndim - 3)), axis=2)
    return self.replace(k=take(cand_k), v=take(_concat(self.v, v)), pos=take(cand_pos),
                        scores=take(jnp.where(jnp.isfinite(score), score, 0.0)),
                        lengths=self.lengths + new_lengths, k_scale=take(cand_ks),
                        v_scale=take(_concat(self.v_scale, vs)))

  def update(self, k_new: jax.Array, v_new: jax.Array,
             new_lengths: jax.Array | None = None) -> "EvictingKVCache":
    """Writes `k_new, v_new: [B, T, K, H]` (keys RoPE'd) for `t < new_lengths[b]`,
    evicting by the policy with no query scores for the new tokens (`update_attend`
    supplies them)."""
    _check_new_kv(self, k_new, v_new)
    new_lengths = cache_lib.resolve_new_lengths(new_lengths, self.batch, k_new.shape[1])
    return self._select(*_encode(self, k_new, v_new), new_lengths, None)

  def attend(self, q: jax.Array, *, q_offsets: jax.Array, sm_scale: float | None = None,
             window: int | None = None, soft_cap: float | None = None,
             implementation: str | None = None) -> jax.Array:
    """Queries at tokens `q_offsets[b] + t` (RoPE'd) against the kept slots, masked by
    original position."""
    _check_implementation(self, implementation)
    q_pos = q_offsets[:, None] + jnp.arange(q.shape[1], dtype=jnp.int32)[None, :]
    out, _ = positional_attention(q, self.k, self.v, q_pos, self.pos, sm_scale=sm_scale,
                                  window=window, soft_cap=soft_cap,
                                  **_scale_kwargs(self.k_scale, self.v_scale))
    return out

  def update_attend(self, q, k, v, *, positions, rope_theta, rope_scaling=None,
                    new_lengths=None, sm_scale=None, window=None, soft_cap=None,
                    implementation=None):
    """`cache_protocol.update_attend`: RoPE at `positions`; the chunk attends the kept
    slots plus its own tokens (returning the per-slot mass its scoring queries gave),
    then the budget is chosen among them. Returns `(out [B, T, N, H], new cache)`."""
    new_lengths = _prelude(self, q, k, v, new_lengths, implementation)
    num_tokens = k.shape[1]
    rope = dict(rope_theta=rope_theta, scaling=rope_scaling)
    q, k = apply_rope(q, positions, **rope), apply_rope(k, positions, **rope)
    kq, vq, ks, vs = _encode(self, k, v)
    new_pos = _new_positions(self.lengths, new_lengths, num_tokens)
    cand_pos = _concat(self.pos, jnp.broadcast_to(new_pos[:, None], kq.shape[:3]))
    q_pos = self.lengths[:, None] + jnp.arange(num_tokens, dtype=jnp.int32)[None, :]
    out, mass = positional_attention(
        q, _concat(self.k, kq), _concat(self.v, vq), q_pos, cand_pos, sm_scale=sm_scale,
        window=window, soft_cap=soft_cap, score_queries=self._score_queries(new_lengths,
                                                                            num_tokens),
        **_scale_kwargs(_concat(self.k_scale, ks), _concat(self.v_scale, vs)))
    return out, self._select(kq, vq, ks, vs, new_lengths, mass)
