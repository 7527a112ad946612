"""One attention module for MHA (Vaswani et al. 2017), MQA (Shazeer 2019) and GQA (Ainslie et
al. 2023, arXiv 2305.13245): K KV heads, K = N for MHA, 1 for MQA; query head n reads KV head
n // G, G = N // K (contiguous groups, as Llama-family checkpoints)."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from kvattn import _checks
from kvattn.caches import dense as cache_lib
from kvattn.caches import transaction
from kvattn import ops
from kvattn.caches.protocol import GQACache, type_error, update_attend
from kvattn.models import int8 as int8_lib


DECODE_OPS = ("decode_attention", "paged_decode_attention")
"""The `kvattn.ops` dispatch points a GQA layer decodes through (dense, paged cache)."""


def decode_implementations() -> tuple[str, ...]:
  """Backend names `decode_implementation` may take: those registered for a dense
  or a paged cache (`kvattn.ops.available_implementations`), sorted."""
  return tuple(sorted({name for op in DECODE_OPS for name in ops.available_implementations(op)}))


def _init(in_axis, out_axis):
  return nnx.initializers.variance_scaling(
      1.0, "fan_in", "truncated_normal", in_axis=in_axis, out_axis=out_axis)


def default_positions(lengths: jax.Array | None, batch: int, num_tokens: int) -> jax.Array:
  """`i32[B, T]`: each sequence's cache length + arange(T) (0-based without a cache)."""
  t = jnp.arange(num_tokens, dtype=jnp.int32)[None, :]
  if lengths is None:
    return jnp.broadcast_to(t, (batch, num_tokens))
  return lengths[:, None].astype(jnp.int32) + t


def check_positions(positions: Any, batch: int, num_tokens: int) -> jax.Array:
  """`positions` as `i32[B, T]`; ValueError/TypeError naming it on a bad shape or dtype."""
  positions = jnp.asarray(positions)
  _checks.integer("positions", positions)
  if positions.shape != (batch, num_tokens):
    raise ValueError(
        f"positions must have shape [B, T] = ({batch}, {num_tokens}); got {tuple(positions.shape)}")
  return positions.astype(jnp.int32)


def resolve_positions(positions: Any, cache: Any, batch: int, num_tokens: int) -> jax.Array:
  """`positions` checked as `i32[B, T]`, or when None the default: the cache's
  lengths + arange(T) (arange(T) without a cache)."""
  if positions is None:
    return default_positions(None if cache is None else cache.lengths, batch, num_tokens)
  return check_positions(positions, batch, num_tokens)


def check_input(x: Any, d_model: int) -> None:
  """Raises ValueError/TypeError unless `x` is a floating `[B, T, d_model]` array."""
  _checks.rank("x", x, 3, "[B, T, D]")
  _checks.floating("x", x)
  if x.shape[-1] != d_model:
    raise ValueError(f"x.shape[-1] must be d_model = {d_model}; got shape {tuple(x.shape)}")


class SharedKV(NamedTuple):
  """A K/V owner's pass, handed to the layers that read it (cross-layer KV sharing); a pytree.

  Attributes:
    k, v: `[B, T, K, H]` keys before RoPE and values of the pass.
    k_rope, v_heads: `[B, K, T, H]` rotated keys and values, head-major (cacheless; else None).
    cache_before, cache_after: the owner's cache around its write (None without a cache).
  """

  k: jax.Array
  v: jax.Array
  k_rope: jax.Array | None = None
  v_heads: jax.Array | None = None
  cache_before: Any = None
  cache_after: Any = None


def _attends_after_update(cache: Any) -> bool:
  """True when `cache.attend` after its `update` is the cache's whole attention step: kinds
  without a step of their own (the protocol's RoPE, update, attend) and `KVCache` (whose step
  is that, or an equal decode step). Ring, sinks, eviction and the low-bit kinds attend a chunk
  differently (before it overwrites a window; with the chunk in full precision). A kind says
so with the class attribute `ATTENDS_AFTER_UPDATE`."""
  cache = getattr(cache, "cache", cache) if isinstance(cache, transaction.Draft) else cache
  if getattr(type(cache), "ATTENDS_AFTER_UPDATE", False):  # a kind's declaration
    return True
  return getattr(cache, "update_attend_unchecked", None) is None and \
      getattr(cache, "update_attend", None) is None


def _rms_norm(x: jax.Array, scale: nnx.Param, eps: float) -> jax.Array:  # [..., H]
  """RMSNorm over the last axis in f32 (the qk-norm), cast back to `x`'s dtype."""
  xf = x.astype(jnp.float32)
  y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
  return (y * scale[...].astype(jnp.float32)).astype(x.dtype)


class GroupedQueryAttention(nnx.Module):
  """Causal self-attention with K KV heads shared by groups of G query heads.

  Cache: any `kvattn.caches.protocol.GQACache`, reached through
  `protocol.update_attend`. `kvattn.KVCache`: `k, v: [B, K, S, H]` (keys after RoPE),
  `lengths: i32[B]`, int8 / fp8 also `k_scale, v_scale: f32[B, K, S]`.

  Call: `y, cache = attn(x, cache=None, positions=None, new_lengths=None)`: `x: [B, T, D]`;
  without a cache causal over T (returns None); with one, token t of row b goes to slot
  `lengths[b] + t` and attends `[0, lengths[b] + t]` (the last `window`); `positions:
  i32[B, T]` drive RoPE only (default lengths + arange(T)); `new_lengths: i32[B]` real
  tokens per row (right padding: padded tokens are not written, their outputs unspecified).

  Cross-layer KV sharing (CLA, Brandon et al. 2024, arXiv 2405.12981): with `kv_source=j`
  the layer has no K/V projections or cache and is called with `shared_kv=` (layer j's
  `SharedKV`), attending its queries to what layer j attended.

  Parameters: `q_proj [D, N, H]`, `k_proj, v_proj [D, K, H]`, `o_proj [N, H, D]`; with
  `qkv_bias` `q_bias [N, H]`, `k_bias, v_bias [K, H]` (Qwen2); with `qk_norm` `q_norm,
  k_norm [H]` before RoPE (Qwen3, Gemma 3). Accumulation in f32.
  """

  def __init__(
      self,
      *,
      d_model: int,
      num_heads: int,
      num_kv_heads: int,
      head_dim: int,
      rope_theta: float = 10000.0,
      window: int | None = None,
      soft_cap: float | None = None,
      dtype: Any = None,
      param_dtype: Any = jnp.float32,
      decode_implementation: str | None = None,
      qkv_bias: bool = False,
      rope_scaling: ops.RopeScaling | None = None,
      qk_norm: bool = False,
      norm_eps: float = 1e-6,
      sm_scale: float | None = None,
      kv_source: int | None = None,
      rngs: nnx.Rngs,
  ):
    """Builds the projections.

    Args:
      d_model, num_heads, num_kv_heads, head_dim: D, N, K (dividing N) and H (even).
      rope_theta, rope_scaling: RoPE base and `kvattn.ops.RopeScaling` (or None).
      window: sliding window in tokens, or None. soft_cap: logit soft cap (Gemma 2), or None.
      dtype: compute dtype (None: the input's); param_dtype: float, or int8 (W8A8).
      decode_implementation: backend of the T == 1 dispatch point, or None (best available).
      qkv_bias: learn q/k/v biases. qk_norm, norm_eps: per-head RMSNorm of q and k.
      sm_scale: softmax scale; None = 1 / sqrt(H).
      kv_source: None, or the layer whose K/V this one reads (no K/V parameters).
      rngs: `nnx.Rngs` with a `params` stream.

    Raises:
      ValueError: non-positive sizes, K not dividing N, odd H, a non-positive window /
        rope_theta / soft_cap, an unknown decode_implementation.
      TypeError: a bad option type, or a non-float dtype.
    """
    self.d_model = _checks.positive_int("d_model", d_model)
    self.num_heads, self.num_kv_heads, self.num_groups = _checks.head_layout(num_heads, num_kv_heads)
    self.head_dim = _checks.positive_int("head_dim", head_dim)
    if self.head_dim % 2:
      raise ValueError(f"head_dim must be even for RoPE; got {head_dim}")
    self.rope_theta = _checks.positive_float("rope_theta", rope_theta)
    self.rope_scaling = ops.rope.check_scaling(rope_scaling)
    self.window = _checks.optional_positive_int("window", window)
    self.sm_scale = _checks.optional_positive_float("sm_scale", sm_scale)
    self.soft_cap = _checks.optional_positive_float("soft_cap", soft_cap)
    self.dtype = None if dtype is None else _checks.float_dtype("dtype", dtype)
    quantized = int8_lib.is_int8(param_dtype)
    param_dtype = jnp.float32 if quantized else _checks.float_dtype("param_dtype", param_dtype)
    self.decode_implementation = _checks.implementation(
        "decode_implementation", decode_implementation, decode_implementations())
    if kv_source is not None and (isinstance(kv_source, bool) or not isinstance(kv_source, int)
                                  or kv_source < 0):
      raise ValueError(f"kv_source must be None or a layer index >= 0; got {kv_source!r}")
    self.kv_source = kv_source
    owns = kv_source is None  # a layer reading another's K/V has no K/V parameters
    D, N, K, H = self.d_model, self.num_heads, self.num_kv_heads, self.head_dim
    key = rngs.params
    self.q_proj = nnx.Param(_init(0, (1, 2))(key(), (D, N, H), param_dtype))
    if owns:
      self.k_proj = nnx.Param(_init(0, (1, 2))(key(), (D, K, H), param_dtype))
      self.v_proj = nnx.Param(_init(0, (1, 2))(key(), (D, K, H), param_dtype))
    self.o_proj = nnx.Param(_init((0, 1), 2)(key(), (N, H, D), param_dtype))
    if not isinstance(qkv_bias, bool):
      raise TypeError(f"qkv_bias must be a bool; got {qkv_bias!r}")
    self.qkv_bias = qkv_bias
    if qkv_bias:
      self.q_bias = nnx.Param(jnp.zeros((N, H), param_dtype))
      if owns:
        self.k_bias = nnx.Param(jnp.zeros((K, H), param_dtype))
        self.v_bias = nnx.Param(jnp.zeros((K, H), param_dtype))
    if not isinstance(qk_norm, bool):
      raise TypeError(f"qk_norm must be a bool; got {qk_norm!r}")
    self.qk_norm = qk_norm
    self.norm_eps = _checks.positive_float("norm_eps", norm_eps)
    if qk_norm:
      self.q_norm = nnx.Param(jnp.ones((H,), param_dtype))
      if owns:
        self.k_norm = nnx.Param(jnp.ones((H,), param_dtype))
    if quantized:
      int8_lib.quantize_module(self)

  def init_cache(self, batch: int, max_len: int, dtype: Any = jnp.float32) -> cache_lib.KVCache:
    """An empty `KVCache` shaped for this layer (any other `GQACache` works too).

    Raises:
      ValueError: the layer reads another layer's cache (`kv_source`).
    """
    if self.kv_source is not None:
      raise ValueError(f"this layer reads layer {self.kv_source}'s cache (kv_source) and has "
                       f"none of its own")
    return cache_lib.KVCache.init(batch, max_len, self.num_kv_heads, self.head_dim, dtype)

  def _project(self, x, spec, name, bias=None):
    dtype = self.dtype or x.dtype
    out = int8_lib.project(spec, x, getattr(self, name), getattr(self, name + "_scale", None), dtype)
    if bias is not None:
      out = out + bias[...].astype(jnp.float32)
    return out.astype(dtype)

  def _q(self, x):
    """`q [B, T, N, H]` of `x` (bias, qk-norm), before RoPE: a layer with a `kv_source`."""
    q = self._project(x, "BTD,DNH->BTNH", "q_proj", self.q_bias if self.qkv_bias else None)
    return _rms_norm(q, self.q_norm, self.norm_eps) if self.qk_norm else q

  def qkv(self, x):
    """`q [B, T, N, H]`, `k, v [B, T, K, H]` of the normed input `x [B, T, D]` (biases added
    when `qkv_bias`, q and k normed when `qk_norm`), before RoPE."""
    biases = (self.q_bias, self.k_bias, self.v_bias) if self.qkv_bias else (None,) * 3
    if hasattr(self, "q_proj_scale"):  # W8A8: one int8 product for q, k and v
      q, k, v = self._qkv_int8(x, biases)
    else:
      q = self._project(x, "BTD,DNH->BTNH", "q_proj", biases[0])
      k = self._project(x, "BTD,DKH->BTKH", "k_proj", biases[1])
      v = self._project(x, "BTD,DKH->BTKH", "v_proj", biases[2])
    if self.qk_norm:
      q, k = _rms_norm(q, self.q_norm, self.norm_eps), _rms_norm(k, self.k_norm, self.norm_eps)
    return q, k, v

  def _qkv_int8(self, x, biases):
    """`qkv` of an int8 layer: q, k and v from one quantization of `x` (`int8.int8_dots`)."""
    dtype = self.dtype or x.dtype
    names = ("q_proj", "k_proj", "v_proj")
    weights = [(getattr(self, n)[...], getattr(self, n + "_scale")[...]) for n in names]
    outs = int8_lib.int8_dots(x, weights)  # f32[B, T, N, H], [B, T, K, H], [B, T, K, H]
    heads = []
    for out, bias in zip(outs, biases):
      if bias is not None:
        out = out + bias[...].astype(jnp.float32)
      heads.append(out.astype(dtype))
    return tuple(heads)

  def __call__(
      self,
      x: jax.Array,  # [B, T, D]
      cache: GQACache | None = None,
      positions: jax.Array | None = None,  # i32[B, T]
      new_lengths: jax.Array | None = None,  # i32[B]
      *,
      shared_kv: SharedKV | None = None,
  ) -> tuple[jax.Array, GQACache | None]:
    """`(y [B, T, D], new_cache)`; a `kv_source` layer takes `shared_kv` and returns `(y, None)`.

    Raises:
      ValueError: `shared_kv` missing or misplaced; bad shapes or lengths.
    """
    if self.kv_source is not None or shared_kv is not None:
      return self._call_shared(x, cache, positions, new_lengths, shared_kv), None
    y, new_cache, _ = self.call_sharing_kv(x, cache, positions, new_lengths)
    return y, new_cache

  def _call_shared(self, x, cache, positions, new_lengths, kv):
    if self.kv_source is None:
      raise ValueError("shared_kv is for a layer that reads another layer's K/V (kv_source); "
                       "this layer computes its own")
    if kv is None or cache is not None:
      raise ValueError(f"this layer reads layer {self.kv_source}'s keys and values: call it "
                       f"with shared_kv= (that layer's SharedKV) and cache=None; got "
                       f"shared_kv={type(kv).__name__}, cache={type(cache).__name__}")
    check_input(x, self.d_model)
    batch, num_tokens, _ = x.shape
    want = (batch, num_tokens, self.num_kv_heads, self.head_dim)
    if tuple(kv.k.shape) != want:
      raise ValueError(f"shared_kv.k must have shape [B, T, K, H] = {want}; got "
                       f"{tuple(kv.k.shape)}")
    positions = resolve_positions(positions, kv.cache_before, batch, num_tokens)
    new_lengths = cache_lib.resolve_new_lengths(new_lengths, batch, num_tokens)
    q = self._q(x)
    opts = dict(sm_scale=self.sm_scale, window=self.window, soft_cap=self.soft_cap)
    rope = dict(rope_theta=self.rope_theta, scaling=self.rope_scaling)
    if kv.cache_before is None:
      out = ops.attention(ops.apply_rope(q, positions, **rope), kv.k_rope, kv.v_heads,
                          kv_lengths=new_lengths, **opts)
    elif _attends_after_update(kv.cache_before):
      out = kv.cache_after.attend(ops.apply_rope(q, positions, **rope),
                                  q_offsets=kv.cache_before.lengths,
                                  implementation=self.decode_implementation, **opts)
    else:  # the kind's own step on the owner's cache before its write; that write is dropped
      out, _ = update_attend(kv.cache_before, q, kv.k, kv.v, positions=positions,
                             rope_theta=self.rope_theta, rope_scaling=self.rope_scaling,
                             new_lengths=new_lengths,
                             implementation=self.decode_implementation, **opts)
    return self._project(out, "BTNH,NHD->BTD", "o_proj")

  def cache_step(self, cache: GQACache, q: jax.Array, k: jax.Array, v: jax.Array,
                 positions: jax.Array, new_lengths: jax.Array) -> tuple[jax.Array, GQACache]:
    """`(out [B, T, N, H], new_cache)`: `q [B, T, N, H]`, `k, v [B, T, K, H]` (`qkv`, before
    RoPE) written to `cache` and attended with this layer's RoPE, `sm_scale`, `window`,
    `soft_cap` and decode implementation: RoPE, update, attend, or the cache's own
    `update_attend` (`protocol.update_attend`). Unchecked: `__call__` checks."""
    return update_attend(cache, q, k, v, positions=positions, rope_theta=self.rope_theta,
                         rope_scaling=self.rope_scaling, new_lengths=new_lengths,
                         implementation=self.decode_implementation, sm_scale=self.sm_scale,
                         window=self.window, soft_cap=self.soft_cap)

  def call_sharing_kv(
      self,
      x: jax.Array,  # [B, T, D]
      cache: GQACache | None = None,
      positions: jax.Array | None = None,  # i32[B, T]
      new_lengths: jax.Array | None = None,  # i32[B]
  ) -> tuple[jax.Array, GQACache | None, SharedKV]:
    """`__call__` of a layer that owns its K/V, plus the `SharedKV` the layers reading it
    (`kv_source`) take: `(y, new_cache, shared_kv)`. Raises as `__call__`."""
    if self.kv_source is not None:
      raise ValueError(f"this layer reads layer {self.kv_source}'s keys and values (kv_source) "
                       f"and has none to share")
    check_input(x, self.d_model)
    batch, num_tokens, _ = x.shape
    if cache is not None:
      if not isinstance(cache, GQACache):
        raise type_error("GroupedQueryAttention", GQACache,
                         "kvattn.KVCache, kvattn.PagedKVCache", cache)
      got = (cache.batch, cache.num_kv_heads, cache.head_dim)
      want = (batch, self.num_kv_heads, self.head_dim)
      if got != want:
        raise ValueError(f"cache must have batch, num_kv_heads, head_dim = {want}; got {got}")
    positions = resolve_positions(positions, cache, batch, num_tokens)
    new_lengths = cache_lib.resolve_new_lengths(new_lengths, batch, num_tokens)

    q, k, v = self.qkv(x)
    opts = dict(sm_scale=self.sm_scale, window=self.window, soft_cap=self.soft_cap)
    if cache is None:
      rope = dict(rope_theta=self.rope_theta, scaling=self.rope_scaling)
      q, k_rot = ops.apply_rope(q, positions, **rope), ops.apply_rope(k, positions, **rope)
      k_heads, v_heads = k_rot.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # [B, K, T, H]
      out = ops.attention(q, k_heads, v_heads, kv_lengths=new_lengths, **opts)
      new_cache = None
      shared = SharedKV(k, v, k_rope=k_heads, v_heads=v_heads)
    else:
      out, new_cache = self.cache_step(cache, q, k, v, positions, new_lengths)
      shared = SharedKV(k, v, cache_before=cache, cache_after=new_cache)
    y = self._project(out, "BTNH,NHD->BTD", "o_proj")
    return y, new_cache, shared
