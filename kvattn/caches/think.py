"""ThinK: query-driven pruning of key channels.

ThinK (Xu et al. 2024, "ThinK: Thinner Key Cache by Query-Driven Pruning", arXiv 2407.21018,
§3.2): many key channels barely contribute to `q . k`, so each KV head keeps only
`keep_channels` of its `head_dim` key channels, chosen by the paper's criterion: channel c of
KV head h scores `|Q_obs[:, c]| * |K[:, c]|`, the Frobenius norm of that channel's part of the
attention logits `Q_obs[:, c] K[:, c]^T` (the norm of an outer product is the product of the
norms), with `Q_obs` the last `window_size` queries of the prefill (SnapKV's observation window)
of the head's G query heads, and K the prefill's keys. Values are untouched.

`ThinKCache` stores the keys really pruned: `k: [B, K, S, keep_channels]` plus the channels of
each sequence and KV head, `channels: i32[B, K, keep_channels]` (sorted), chosen at the
sequence's first chunk (its prefill). Queries are gathered to those channels before the dot; the
logits keep the model's `1 / sqrt(head_dim)` scale (the pruned channels contribute nothing, they
do not shrink the scale).

RoPE: keys are stored after RoPE and pruned after it, as the paper and kvpress's ThinKPress
score post-RoPE queries and keys; a rotated pair of channels may be split (RoPE mixes channels
c and c + H/2 per position, and the dot of rotated vectors is what is pruned), which is exactly
the paper's approximation.

The chunk being written attends its own tokens' keys at full width (the paper's
`softmax([q' K_pruned^T, q K_new^T])`: the prefill itself is exact) and the stored keys pruned.
Departure from the paper, for exact bytes: the paper also keeps the most recent prompt keys and
every generated key unpruned in a second buffer; here every stored key, later tokens included,
is stored with the prefill's channels.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from kvattn import _checks
from kvattn.caches import _slots
from kvattn.caches import capabilities
from kvattn.caches import dense as cache_lib
from kvattn.caches import registry
from kvattn.caches._bounded import CheckedStep, check_implementation
from kvattn.caches._layers import gqa_layers
from kvattn.ops import quant
from kvattn.ops.rope import apply_rope

QUERY_BLOCK = 256
"""Queries per block of a long chunk (the `[T, S]` logits are built a block at a time)."""


def channel_scores(q, k, new_lengths, window_size: int) -> jax.Array:
  """`f32[B, K, H]`: ThinK's score of each key channel, `|Q_obs[:, c]| * |K[:, c]|` over the last
  `window_size` real queries of `q: [B, T, N, H]` (all G heads of the KV head) and the real keys
  of `k: [B, T, K, H]` (both RoPE'd), `new_lengths: i32[B]` real tokens."""
  batch, num_tokens, num_heads, head_dim = q.shape
  num_kv_heads = k.shape[2]
  t = jnp.arange(num_tokens)[None, :]
  real = t < new_lengths[:, None]
  obs = real & (t >= new_lengths[:, None] - window_size)
  qg = q.astype(jnp.float32).reshape(batch, num_tokens, num_kv_heads,
                                     num_heads // num_kv_heads, head_dim)
  q_norm = jnp.sqrt(jnp.einsum("BTKGH,BT->BKH", qg * qg, obs.astype(jnp.float32)))
  kf = k.astype(jnp.float32)
  k_norm = jnp.sqrt(jnp.einsum("BTKH,BT->BKH", kf * kf, real.astype(jnp.float32)))
  return q_norm * k_norm


def select_channels(scores: jax.Array, keep_channels: int) -> jax.Array:
  """`i32[B, K, keep_channels]`: the top channels of `scores: f32[B, K, H]`, sorted ascending
  (ties: the lower channel)."""
  _, idx = jax.lax.top_k(scores, keep_channels)
  return jnp.sort(idx, axis=-1).astype(jnp.int32)


def gather_queries(q: jax.Array, channels: jax.Array) -> jax.Array:
  """`[B, T, N, C]`: each query head's channels of its KV head (`channels: i32[B, K, C]`)."""
  batch, num_tokens, num_heads, _ = q.shape
  groups = num_heads // channels.shape[1]
  per_head = jnp.repeat(channels, groups, axis=1)  # [B, N, C]
  return jnp.take_along_axis(q, per_head[:, None], axis=-1)


def _attend_block(q_sel, q, k, v, k_scale, v_scale, k_new, v_new, q_pos, stored_len, new_pos,
                  *, sm_scale, window, soft_cap):
  """Queries `[B, T, N, ·]` at tokens `q_pos` against the stored slots `[0, stored_len)` (keys
  pruned, `q_sel`) and the new tokens (full width, `new_pos` -1 for padding): one softmax."""
  batch, num_tokens, num_heads, head_dim = q.shape
  num_kv_heads = k.shape[1]
  groups = num_heads // num_kv_heads
  split = lambda x: x.reshape(batch, num_tokens, num_kv_heads, groups, x.shape[-1])
  stored = jnp.einsum("BTKGC,BKSC->BKGTS", split(q_sel).astype(jnp.float32),
                      k.astype(jnp.float32))
  if k_scale is not None:
    stored = stored * k_scale[:, :, None, None, :]
  fresh = jnp.einsum("BTKGH,BUKH->BKGTU", split(q).astype(jnp.float32),
                     k_new.astype(jnp.float32))
  logits = jnp.concatenate([stored, fresh], axis=-1) * sm_scale
  if soft_cap is not None:
    logits = soft_cap * jnp.tanh(logits / soft_cap)
  slots = jnp.arange(k.shape[2], dtype=jnp.int32)[None, :]
  kv_pos = jnp.concatenate([jnp.where(slots < stored_len[:, None], slots, -1), new_pos], axis=1)
  qp, kp = q_pos[:, None, None, :, None], kv_pos[:, None, None, None, :]
  mask = (kp >= 0) & (kp <= qp)
  if window is not None:
    mask &= kp > qp - window
  logits = jnp.where(mask, logits, -jnp.inf)
  top = jnp.max(logits, axis=-1, keepdims=True)
  probs = jnp.where(mask, jnp.exp(logits - jnp.where(jnp.isfinite(top), top, 0.0)), 0.0)
  probs = probs / jnp.maximum(jnp.sum(probs, axis=-1, keepdims=True), jnp.finfo(jnp.float32).tiny)
  size = k.shape[2]
  p_stored, p_new = probs[..., :size], probs[..., size:]
  if v_scale is not None:
    p_stored = p_stored * v_scale[:, :, None, None, :]
  seen = jnp.any(mask[..., :size], axis=(2, 3))[..., None]  # unused slots never reach the output
  values = jnp.where(seen, v.astype(jnp.float32), 0.0)
  out = jnp.einsum("BKGTS,BKSH->BTKGH", p_stored, values) + jnp.einsum(
      "BKGTU,BUKH->BTKGH", p_new, v_new.astype(jnp.float32))
  return out.reshape(batch, num_tokens, num_heads, v.shape[-1])


@struct.dataclass
class ThinKCache(CheckedStep, _slots.TokenSlots, _slots.KVHeads, capabilities.Rows):
  """One layer: keys pruned to `keep_channels` channels per KV head, values whole.

  Attributes:
    k: `[B, K, S, C]` keys (RoPE'd) at the `channels` of their KV head, C = keep_channels.
    v: `[B, K, S, H]` values.
    channels: `i32[B, K, C]` the key channels kept, sorted; chosen at each row's first chunk.
    lengths: `i32[B]` tokens per sequence, token t in slot t (overflows as the dense cache).
    k_scale, v_scale: `f32[B, K, S]` scales of an int8 / fp8 cache, else None.
    window_size: static, the observation window of queries that scores the channels.
  """

  k: jax.Array
  v: jax.Array
  channels: jax.Array
  lengths: jax.Array
  k_scale: jax.Array | None = None
  v_scale: jax.Array | None = None
  window_size: int = struct.field(pytree_node=False, default=32)

  _SIZES = {"batch": ("v", 0), "num_kv_heads": ("v", 1), "capacity": ("v", 2),
            "head_dim": ("v", 3)}
  _VALUES, _SCALES = ("k", "v"), ("k_scale", "v_scale")
  ROW_EMPTY = {}

  @classmethod
  def init(cls, batch: int, max_len: int, num_kv_heads: int, head_dim: int, dtype=jnp.float32,
           *, keep_channels: int, window_size: int = 32) -> "ThinKCache":
    """An empty cache of `max_len` slots keeping `keep_channels` key channels per KV head.

    Raises:
      ValueError: a size that is not a positive int; `keep_channels > head_dim`.
      TypeError: a dtype neither floating nor int8 / fp8.
    """
    batch, max_len = _checks.positive_int("batch", batch), _checks.positive_int("max_len", max_len)
    num_kv_heads = _checks.positive_int("num_kv_heads", num_kv_heads)
    head_dim = _checks.positive_int("head_dim", head_dim)
    keep = _checks.positive_int("keep_channels", keep_channels)
    if keep > head_dim:
      raise ValueError(f"keep_channels must be <= head_dim = {head_dim}; got {keep}")
    window_size = _checks.positive_int("window_size", window_size)
    dtype = cache_lib.check_storage_dtype(dtype)
    shape = (batch, num_kv_heads, max_len)
    return cls(k=jnp.zeros(shape + (keep,), dtype), v=jnp.zeros(shape + (head_dim,), dtype),
               channels=jnp.broadcast_to(jnp.arange(keep, dtype=jnp.int32), shape[:2] + (keep,)),
               lengths=jnp.zeros((batch,), jnp.int32), k_scale=cache_lib.scale_init(shape, dtype),
               v_scale=cache_lib.scale_init(shape, dtype), window_size=window_size)

  @property
  def keep_channels(self) -> int:
    return self.k.shape[3]

  def analytic_bytes_per_token(self) -> float:
    """`K (C + H) itemsize` (+ `2 K` f32 scales when quantized): pruned keys, whole values."""
    scales = 2 * quant.SCALE_DTYPE.itemsize if self.quantized else 0
    return self.num_kv_heads * ((self.keep_channels + self.head_dim) * self.dtype.itemsize
                                + scales)

  def _write(self, k, v, new_lengths, channels):
    """RoPE'd `k, v: [B, T, K, H]` for `t < new_lengths[b]`: keys pruned to `channels`."""
    pruned = jnp.take_along_axis(k, channels[:, None], axis=-1)  # [B, T, K, C]
    lengths = cache_lib.advance_lengths(self.lengths, new_lengths, self.capacity)
    out = {}
    for field, scale_field, tokens in (("k", "k_scale", pruned), ("v", "v_scale", v)):
      values, scales = cache_lib.encode(tokens, self.dtype)
      out[field] = cache_lib.write_tokens(getattr(self, field), values.astype(self.dtype),
                                          self.lengths, new_lengths, slot_axis=2)
      if scales is not None:
        out[scale_field] = cache_lib.write_tokens(getattr(self, scale_field), scales,
                                                  self.lengths, new_lengths, slot_axis=2)
    return self.replace(channels=channels, lengths=lengths, **out)

  def _channels_after(self, q, k, new_lengths):
    """The channels each row keeps after this chunk: chosen now for a row's first chunk."""
    chosen = select_channels(channel_scores(q, k, new_lengths, self.window_size),
                             self.keep_channels)
    first = ((self.lengths == 0) & (new_lengths > 0))[:, None, None]
    return jnp.where(first, chosen, self.channels)

  def update_attend_unchecked(self, q, k, v, *, positions, rope_theta, rope_scaling=None,
                              new_lengths, sm_scale=None, window=None, soft_cap=None,
                              implementation=None):
    """RoPE at `positions`; the chunk (`q: [B, T, N, H]`, `k, v: [B, T, K, H]`) attends the
    stored keys through its queries' kept channels and its own keys at full width, then is
    written pruned (channels chosen now for a row's first chunk). Returns `(out, cache)`."""
    check_implementation(self, implementation)
    _checks.values_in_range("cache lengths", self.lengths, 0, self.capacity)
    rope = dict(rope_theta=rope_theta, scaling=rope_scaling)
    q, k = apply_rope(q, positions, **rope), apply_rope(k, positions, **rope)
    num_tokens = k.shape[1]
    t = jnp.arange(num_tokens, dtype=jnp.int32)[None, :]
    new_pos = jnp.where(t < new_lengths[:, None], self.lengths[:, None] + t, -1)
    out = self._attend(q, k, v, self.lengths[:, None] + t, self.lengths, new_pos, sm_scale,
                       window, soft_cap)
    return out, self._write(k, v, new_lengths, self._channels_after(q, k, new_lengths))

  def _attend(self, q, k_new, v_new, q_pos, stored_len, new_pos, sm_scale, window, soft_cap):
    sm_scale = self.head_dim ** -0.5 if sm_scale is None else sm_scale
    q_sel = gather_queries(q, self.channels)
    opts = dict(sm_scale=sm_scale, window=window, soft_cap=soft_cap)
    parts = (self.k, self.v, self.k_scale, self.v_scale, k_new, v_new)
    num_tokens = q.shape[1]
    if num_tokens <= QUERY_BLOCK:
      return _attend_block(q_sel, q, *parts, q_pos, stored_len, new_pos, **opts).astype(q.dtype)
    pad = -num_tokens % QUERY_BLOCK
    blocks = (num_tokens + pad) // QUERY_BLOCK
    split = lambda x: jnp.moveaxis(jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
                                   .reshape((x.shape[0], blocks, QUERY_BLOCK) + x.shape[2:]), 1, 0)
    outs = jax.lax.map(lambda xs: _attend_block(xs[0], xs[1], *parts, xs[2], stored_len, new_pos,
                                                **opts), (split(q_sel), split(q), split(q_pos)))
    out = jnp.moveaxis(outs, 0, 1).reshape((q.shape[0], blocks * QUERY_BLOCK) + q.shape[2:])
    return out[:, :num_tokens].astype(q.dtype)

  def update(self, k_new, v_new, new_lengths=None) -> "ThinKCache":
    """Writes `k_new, v_new: [B, T, K, H]` (RoPE'd) pruned; with no queries, a row's first
    chunk keeps the channels of largest key norm."""
    return self.update_unchecked(k_new, v_new,
                                 cache_lib.check_new_kv(self, k_new, v_new, new_lengths))

  def update_unchecked(self, k_new, v_new, new_lengths) -> "ThinKCache":
    _checks.values_in_range("cache lengths", self.lengths, 0, self.capacity)
    ones = jnp.ones(k_new.shape[:2] + (k_new.shape[2], k_new.shape[3]), jnp.float32)
    return self._write(k_new, v_new, new_lengths, self._channels_after(ones, k_new, new_lengths))

  def attend(self, q, *, q_offsets, sm_scale=None, window=None, soft_cap=None,
             implementation=None) -> jax.Array:
    """Queries `q: [B, T, N, H]` (RoPE'd) at tokens `q_offsets[b] + t` against the stored
    pruned keys (after `update`)."""
    check_implementation(self, implementation)
    batch, num_tokens = q.shape[:2]
    q_pos = q_offsets[:, None] + jnp.arange(num_tokens, dtype=jnp.int32)[None, :]
    none = jnp.zeros((batch, 0, self.num_kv_heads, self.head_dim), q.dtype)
    return self._attend(q, none, none, q_pos, self.lengths, jnp.zeros((batch, 0), jnp.int32),
                        sm_scale, window, soft_cap)


def build(model, batch, max_len, dtype, o, tokens_per_seq) -> tuple[ThinKCache, ...]:
  """The "think" kind's builder: one `ThinKCache` of `max_len` slots per GQA layer."""
  del tokens_per_seq
  window = 32 if o.get("window_size") is None else o["window_size"]
  return tuple(ThinKCache.init(batch, max_len, a.num_kv_heads, a.head_dim, dtype,
                               keep_channels=(a.head_dim // 2 if o.get("keep_channels") is None
                                              else o["keep_channels"]), window_size=window)
               for a in gqa_layers(model))


registry.register_cache_kind("think", registry.CacheKind(
    build, {"keep_channels": None, "window_size": None},
    "ThinKCache: keys pruned to keep_channels (default head_dim // 2, the paper's 50% pruning) "
    "channels per KV head, query-driven; values whole"))
