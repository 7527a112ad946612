"""Functional KV caches: registered pytrees with pure update functions."""

from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.experimental import checkify

from kvattn import _checks
from kvattn import ops
from kvattn.caches import _slots
from kvattn.caches import capabilities
from kvattn.caches import registry
from kvattn.caches.protocol import Expand
from kvattn.ops import quant


def check_storage_dtype(dtype) -> jnp.dtype:
  """A cache storage dtype: floating, or a quantized format (int8, float8_e4m3fn,
  float8_e5m2) that is stored with scales.

  Raises:
    TypeError: anything else, naming `dtype`.
  """
  try:
    dtype = jnp.dtype(dtype)
  except TypeError as e:
    raise TypeError(f"dtype must be a JAX dtype; got {dtype!r}") from e
  if not (jnp.issubdtype(dtype, jnp.floating) or quant.is_quantized(dtype)):
    raise TypeError(f"dtype must be a floating dtype or a quantized KV format "
                    f"{quant.QUANT_NAMES}; got {dtype}")
  return dtype


def scale_init(shape: tuple[int, ...], dtype) -> jax.Array | None:
  """Initial scales of a cache in `dtype`: f32 ones of `shape` if quantized, else None."""
  return jnp.ones(shape, quant.SCALE_DTYPE) if quant.is_quantized(dtype) else None


encode = _slots.encode  # `(values, scales)` of tokens stored in a cache of `dtype`


def resolve_new_lengths(new_lengths, batch: int, num_tokens: int) -> jax.Array:
  """Validates `new_lengths` (`i32[B]`, default T) and returns it as int32."""
  if new_lengths is None:
    return jnp.full((batch,), num_tokens, jnp.int32)
  new_lengths = jnp.asarray(new_lengths)
  _checks.integer("new_lengths", new_lengths)
  if new_lengths.shape != (batch,):
    raise ValueError(
        f"new_lengths must have shape [B] = ({batch},); got {tuple(new_lengths.shape)}")
  if _checks.is_concrete(new_lengths):
    host = np.asarray(new_lengths)
    if host.min(initial=0) < 0 or host.max(initial=0) > num_tokens:
      raise ValueError(
          f"new_lengths must lie in [0, T] = [0, {num_tokens}]; got {host.tolist()}")
  return new_lengths.astype(jnp.int32)


def check_new_kv(cache: Any, k_new: Any, v_new: Any, new_lengths: Any) -> jax.Array:
  """The arguments of a GQA cache's `update`: `k_new, v_new: [B, T, K, H]` floating, with the
  cache's B, K, H, and `new_lengths` (`resolve_new_lengths`); returns `new_lengths` as `i32[B]`.

  Raises:
    ValueError, TypeError: naming the argument.
  """
  expected = (cache.batch, None, cache.num_kv_heads, cache.head_dim)
  for name, x in (("k_new", k_new), ("v_new", v_new)):
    _checks.rank(name, x, 4, "[B, T, K, H]")
    if any(e is not None and e != s for e, s in zip(expected, x.shape)):
      raise ValueError(
          f"{name} must have shape [B, T, K, H] = ({cache.batch}, T, {cache.num_kv_heads}, "
          f"{cache.head_dim}); got {tuple(x.shape)}")
  if k_new.shape != v_new.shape:
    raise ValueError(f"k_new and v_new must have one shape; got {k_new.shape} and {v_new.shape}")
  for name, x in (("k_new", k_new), ("v_new", v_new)):
    _checks.floating(name, x)  # an int key would be cast silently
  return resolve_new_lengths(new_lengths, cache.batch, k_new.shape[1])


def write_tokens(
    buffer: jax.Array,  # [B, ..., S, ...] with the slot axis at `slot_axis`
    new: jax.Array,  # [B, T, ...] the per-token values, in buffer's layout minus S
    lengths: jax.Array,  # i32[B]
    new_lengths: jax.Array,  # i32[B]
    *,
    slot_axis: int,
) -> jax.Array:
  """Scatters T new tokens per sequence into slots `lengths[b] + t`."""
  batch, num_tokens = new.shape[:2]
  capacity = buffer.shape[slot_axis]
  t = jnp.arange(num_tokens, dtype=jnp.int32)[None, :]
  slots = lengths[:, None] + t
  # capacity = dropped; a negative slot (a sequence shard's offset, kvattn.sharding) too.
  slots = jnp.where((t < new_lengths[:, None]) & (slots >= 0), slots, capacity)
  rows = jnp.broadcast_to(jnp.arange(batch, dtype=jnp.int32)[:, None], slots.shape)
  index = (rows,) + (slice(None),) * (slot_axis - 1) + (slots,)
  return quant.set_stored(buffer, index, new, mode="drop")


def advance_lengths(lengths: jax.Array, new_lengths: jax.Array, capacity: int) -> jax.Array:
  """Returns `lengths + new_lengths`, enforcing the overflow contract above."""
  _checks.values_in_range("cache lengths", lengths, 0, capacity)
  if _checks.is_concrete(lengths) and _checks.is_concrete(new_lengths):
    end = np.asarray(lengths) + np.asarray(new_lengths)
    if end.max(initial=0) > capacity:
      bad = np.nonzero(end > capacity)[0].tolist()
      raise ValueError(
          f"cache overflow: lengths + new_lengths = {end.tolist()} exceeds max_len "
          f"{capacity} for sequences {bad}; build the cache with a larger max_len")
  end = lengths + new_lengths
  checkify.debug_check(jnp.all(end <= capacity),
                       "cache overflow: lengths + new_lengths exceeds max_len")
  return end


slot_positions = _slots.slot_positions  # token t in slot t (used by the paged kinds too)


@struct.dataclass
class KVCache(_slots.TokenSlots, _slots.KVHeads, _slots.LengthsRollback, capabilities.Rows,
              capabilities.TruncateByLengths):
  """Dense KV cache of one attention layer (MHA, GQA or MQA).

  Attributes:
    k: `[B, K, S, H]` keys, head-major (each (b, k) sequence is contiguous), RoPE already applied.
    v: `[B, K, S, H]` values.
    lengths: `i32[B]` valid tokens per sequence; may exceed S only after an overflow under jit (see
      `overflowed`).
    k_scale: `f32[B, K, S]` per-token per-head key scales when `k` is int8 or fp8 (key `k[b, h, s] *
      k_scale[b, h, s]`), else None.
    v_scale: `f32[B, K, S]` value scales likewise, else None.
  """

  k: jax.Array
  v: jax.Array
  lengths: jax.Array
  k_scale: jax.Array | None = None
  v_scale: jax.Array | None = None

  ATTENDS_AFTER_UPDATE = True  # its one-token step equals `update` then `attend`
  CONTEXT_REPLAYABLE = True  # capabilities.context_replayable: keeps every token

  @property
  def chunk_equals_steps(self) -> bool:
    """False for int8 storage: its one-token step reads keys through a quantized query (s8
    logits, `ops.xla_blocked`) and a chunk does not, so a speculative verify pass steps."""
    return self.k.dtype != jnp.int8

  @classmethod
  def init(cls, batch: int, max_len: int, num_kv_heads: int, head_dim: int,
           dtype=jnp.float32) -> "KVCache":
    """An empty cache: zeros, `lengths == 0`.

    Raises:
      ValueError: a size that is not a positive int.
      TypeError: a dtype that is neither floating nor a quantized format.
    """
    batch = _checks.positive_int("batch", batch)
    max_len = _checks.positive_int("max_len", max_len)
    num_kv_heads = _checks.positive_int("num_kv_heads", num_kv_heads)
    head_dim = _checks.positive_int("head_dim", head_dim)
    dtype = check_storage_dtype(dtype)
    shape = (batch, num_kv_heads, max_len, head_dim)
    return cls(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype),
               lengths=jnp.zeros((batch,), jnp.int32),
               k_scale=scale_init(shape[:3], dtype), v_scale=scale_init(shape[:3], dtype))

  # Sizes, storage, scales, slots: `_slots` (read from this layout).
  _SIZES = {"batch": ("k", 0), "num_kv_heads": ("k", 1), "capacity": ("k", 2),
            "head_dim": ("k", 3)}
  _VALUES, _SCALES = ("k", "v"), ("k_scale", "v_scale")
  max_len = _slots.Slots.capacity  # S

  def update(self, k_new: jax.Array, v_new: jax.Array,
             new_lengths: jax.Array | None = None) -> "KVCache":
    """Writes T new tokens per sequence at each sequence's own offset.

    Args:
      k_new: `[B, T, K, H]` keys (RoPE applied), any float dtype (cast to the cache dtype; quantized
        with one scale per token and head for an int8/fp8 cache).
      v_new: `[B, T, K, H]` values.
      new_lengths: `i32[B]` real tokens per sequence among the T (default T).

    Returns:
      The updated cache; `lengths` grows by `new_lengths`.

    Raises:
      ValueError: wrong shapes, `new_lengths` outside [0, T], or (when lengths are concrete) cache
        `lengths` outside [0, max_len] or a write past `max_len`. Under jit: see the module doc
        (dropped tokens, `overflowed`).
      TypeError: non-floating `k_new` / `v_new`.
    """
    return self.update_unchecked(k_new, v_new, check_new_kv(self, k_new, v_new, new_lengths))

  def update_unchecked(self, k_new: jax.Array, v_new: jax.Array,
                       new_lengths: jax.Array) -> "KVCache":
    """`update` for callers that checked its arguments (`k_new, v_new: [B, T, K, H]` floating
    of this cache's sizes, `new_lengths: i32[B]` in [0, T]): kvattn's modules, through
    `cache_protocol.update_attend`."""
    lengths = advance_lengths(self.lengths, new_lengths, self.max_len)  # raises first
    return self._write(k_new, v_new, new_lengths, lengths)

  def _write(self, k_new, v_new, new_lengths, lengths) -> "KVCache":
    """Scatters the (encoded) tokens at `self.lengths` and sets `lengths` (advanced)."""

    def write(buffer, new):  # [B, K, S, ...] <- [B, T, K, ...]
      return write_tokens(buffer, new, self.lengths, new_lengths, slot_axis=2)

    return self.replace(lengths=lengths, **self.written((k_new, v_new), write))

  def attend(
      self,
      q: jax.Array,  # [B, T, N, H]
      *,
      q_offsets: jax.Array,  # i32[B]
      sm_scale: float | None = None,
      window: int | None = None,
      soft_cap: float | None = None,
      implementation: str | None = None,
  ) -> jax.Array:
    """`GQACache.attend` (`kvattn.caches.protocol`): `[B, T, N, H]` in q's dtype."""
    opts = dict(sm_scale=sm_scale, window=window, soft_cap=soft_cap, **self.scale_kwargs())
    if q.shape[1] == 1:
      return ops.decode_attention(q[:, 0], self.k, self.v, self.lengths,
                                  implementation=implementation, **opts)[:, None]
    return ops.attention(q, self.k, self.v, q_offsets=q_offsets, kv_lengths=self.lengths, **opts)

  def update_attend(
      self,
      q: jax.Array,  # [B, T, N, H]
      k: jax.Array,  # [B, T, K, H]
      v: jax.Array,  # [B, T, K, H]
      *,
      positions: jax.Array,  # i32[B, T]
      rope_theta: float,
      rope_scaling: Any = None,
      new_lengths: jax.Array,  # i32[B]
      sm_scale: float | None = None,
      window: int | None = None,
      soft_cap: float | None = None,
      implementation: str | Sequence[str] | None = None,
  ) -> tuple[jax.Array, "KVCache"]:
    """One attention step (`cache_protocol.update_attend`): `(out [B, T, N, H], new_cache)`.

    Raises:
      ValueError, TypeError: as `update` and `ops.decode_attention` (shapes,
        dtypes, `new_lengths`, an eager overflow, an unknown `implementation`).
    """
    new_lengths = check_new_kv(self, k, v, new_lengths)
    return self.update_attend_unchecked(
        q, k, v, positions=positions, rope_theta=rope_theta, rope_scaling=rope_scaling,
        new_lengths=new_lengths, sm_scale=sm_scale, window=window, soft_cap=soft_cap,
        implementation=implementation)

  def update_attend_unchecked(
      self,
      q: jax.Array,  # [B, T, N, H]
      k: jax.Array,  # [B, T, K, H]
      v: jax.Array,  # [B, T, K, H]
      *,
      positions: jax.Array,  # i32[B, T]
      rope_theta: float,
      rope_scaling: Any = None,
      new_lengths: jax.Array,  # i32[B], checked
      sm_scale: float | None = None,
      window: int | None = None,
      soft_cap: float | None = None,
      implementation: str | Sequence[str] | None = None,
  ) -> tuple[jax.Array, "KVCache"]:
    """`update_attend` for callers that checked `k`, `v`, `new_lengths` (the modules)."""
    rope = dict(rope_theta=rope_theta, scaling=rope_scaling)
    q, k = ops.apply_rope(q, positions, **rope), ops.apply_rope(k, positions, **rope)
    opts = dict(sm_scale=sm_scale, window=window, soft_cap=soft_cap)
    cls = type(self)
    if (q.shape[1] != 1 or cls.update_unchecked is not KVCache.update_unchecked
        or cls.attend is not KVCache.attend or not ops.dispatch.appends_newest(implementation)):
      new_cache = self.update_unchecked(k, v, new_lengths)
      return new_cache.attend(q, q_offsets=self.lengths, implementation=implementation,
                              **opts), new_cache
    lengths = advance_lengths(self.lengths, new_lengths, self.max_len)  # raises first (eager)
    k_new, v_new = (self.stored_token(x[:, 0]) for x in (k, v))
    out = ops.decode_attention(q[:, 0], self.k, self.v, lengths, k_new=k_new, v_new=v_new,
                               implementation=implementation, **opts, **self.scale_kwargs())
    # The written token depends on the output (plus an exact 0 XLA cannot fold away), so the
    # write is ordered after every read of the old buffer; without that XLA:CPU cannot prove
    # the reads done and copies the buffer (an optimization_barrier is removed before that).
    tie = jnp.nan_to_num(out[0, 0, 0].astype(jnp.float32) * 0.0)
    return out[:, None], self._write(k + tie.astype(k.dtype), v + tie.astype(v.dtype),
                                     new_lengths, lengths)

  def stored_token(self, x: jax.Array) -> jax.Array:
    """`x: [B, K, H]` as this cache stores and reads it back: cast to its dtype, or
    quantized and dequantized to f32 (`encode`, then values * scales)."""
    values, scales = encode(x, self.dtype)
    if scales is None:
      return values.astype(self.dtype)
    return values.astype(jnp.float32) * scales[..., None]


@struct.dataclass
class LatentCache(_slots.TokenSlots, _slots.LengthsRollback, capabilities.Rows,
                  capabilities.TruncateByLengths):
  """Latent cache of one MLA layer (DeepSeek-V2, arXiv 2405.04434, §2.1.2-2.1.3).

  Attributes:
    c_kv: `[B, S, C]` normalised KV latents.
    k_rope: `[B, S, R]` shared RoPE keys, same dtype as `c_kv`.
    lengths: `i32[B]` valid tokens per sequence; may exceed S only after an
      overflow under jit (see `overflowed`).
    c_kv_scale: `f32[B, S]` when the cache is int8/fp8: one scale per token
      for its latent (absmax over C), else None.
    k_rope_scale: `f32[B, S]` likewise for the RoPE key (absmax over R; the
      two parts have different magnitudes, so each gets its own scale).
  """

  c_kv: jax.Array
  k_rope: jax.Array
  lengths: jax.Array
  c_kv_scale: jax.Array | None = None
  k_rope_scale: jax.Array | None = None

  def logical_axes(self):
    """Rows `[B, S, ...]`: batch, then the slots."""
    return {n: (capabilities.BATCH, capabilities.SEQ)[:a.ndim] + (None,) * (a.ndim - 2)
            for n, a in capabilities._arrays(self).items()}  # pylint: disable=protected-access

  @classmethod
  def init(cls, batch: int, max_len: int, kv_lora_rank: int, qk_rope_head_dim: int,
           dtype=jnp.float32) -> "LatentCache":
    """An empty cache: zeros, `lengths == 0`.

    Raises:
      ValueError: a size that is not a positive int.
      TypeError: a dtype that is neither floating nor a quantized format.
    """
    batch = _checks.positive_int("batch", batch)
    max_len = _checks.positive_int("max_len", max_len)
    kv_lora_rank = _checks.positive_int("kv_lora_rank", kv_lora_rank)
    qk_rope_head_dim = _checks.positive_int("qk_rope_head_dim", qk_rope_head_dim)
    dtype = check_storage_dtype(dtype)
    return cls(c_kv=jnp.zeros((batch, max_len, kv_lora_rank), dtype),
               k_rope=jnp.zeros((batch, max_len, qk_rope_head_dim), dtype),
               lengths=jnp.zeros((batch,), jnp.int32),
               c_kv_scale=scale_init((batch, max_len), dtype),
               k_rope_scale=scale_init((batch, max_len), dtype))

  # Sizes, storage, scales, slots: `_slots` (read from this layout).
  _SIZES = {"batch": ("c_kv", 0), "capacity": ("c_kv", 1)}
  _VALUES, _SCALES = ("c_kv", "k_rope"), ("c_kv_scale", "k_rope_scale")
  max_len = _slots.Slots.capacity  # S

  @property
  def kv_lora_rank(self) -> int:
    return self.c_kv.shape[2]

  @property
  def qk_rope_head_dim(self) -> int:
    return self.k_rope.shape[2]

  def update(self, c_kv_new: jax.Array, k_rope_new: jax.Array,
             new_lengths: jax.Array | None = None) -> "LatentCache":
    """Writes T new tokens per sequence at each sequence's own offset.

    Args:
      c_kv_new: `[B, T, C]` normalised latents, any float dtype (cast to the
        cache dtype; quantized with one scale per token for an int8/fp8 cache).
      k_rope_new: `[B, T, R]` shared RoPE keys (RoPE applied).
      new_lengths: `i32[B]` real tokens per sequence among the T (default T).

    Returns:
      The updated cache; `lengths` grows by `new_lengths`.

    Raises:
      ValueError: wrong shapes, `new_lengths` outside [0, T], or (when lengths
        are concrete) cache `lengths` outside [0, max_len] or a write past
        `max_len`. Under jit: see the module doc (dropped tokens, `overflowed`).
      TypeError: non-floating inputs.
    """
    for name, x, width, letter in (("c_kv_new", c_kv_new, self.kv_lora_rank, "C"),
                                   ("k_rope_new", k_rope_new, self.qk_rope_head_dim, "R")):
      _checks.rank(name, x, 3, f"[B, T, {letter}]")
      _checks.floating(name, x)
      if x.shape[0] != self.batch or x.shape[2] != width:
        raise ValueError(
            f"{name} must have shape [B, T, {letter}] = ({self.batch}, T, {width}); "
            f"got {tuple(x.shape)}")
    if c_kv_new.shape[1] != k_rope_new.shape[1]:
      raise ValueError(
          "c_kv_new and k_rope_new must have the same T; got "
          f"{tuple(c_kv_new.shape)} and {tuple(k_rope_new.shape)}")
    new_lengths = resolve_new_lengths(new_lengths, self.batch, c_kv_new.shape[1])
    return self.update_unchecked(c_kv_new, k_rope_new, new_lengths)

  def update_unchecked(self, c_kv_new: jax.Array, k_rope_new: jax.Array,
                       new_lengths: jax.Array) -> "LatentCache":
    """`update` for callers that checked its arguments (the MLA module, through
    `cache_protocol.write`); the cache's own state is still checked (eager
    `lengths` and overflow). Subclasses override this one."""
    lengths = advance_lengths(self.lengths, new_lengths, self.max_len)  # raises first

    def write(buffer, new):  # [B, S, ...] <- [B, T, ...]
      return write_tokens(buffer, new, self.lengths, new_lengths, slot_axis=1)

    return self.replace(lengths=lengths, **self.written((c_kv_new, k_rope_new), write))

  def attend(
      self,
      q_latent: jax.Array,  # [B, T, N, C]
      q_rope: jax.Array,  # [B, T, N, R]
      *,
      q_offsets: jax.Array,  # i32[B]
      sm_scale: float,
      window: int | None = None,
      implementation: str | None = None,
  ) -> jax.Array:
    """`MLACache.attend` (`kvattn.caches.protocol`), absorbed: `[B, T, N, C]`."""
    opts = dict(sm_scale=sm_scale, window=window, **self.scale_kwargs())
    if q_latent.shape[1] == 1:
      return ops.mla_decode_attention(q_latent[:, 0], q_rope[:, 0], self.c_kv, self.k_rope,
                                      self.lengths, implementation=implementation,
                                      **opts)[:, None]
    return ops.mla_attention(q_latent, q_rope, self.c_kv, self.k_rope, q_offsets=q_offsets,
                             kv_lengths=self.lengths, **opts)

  def attend_expanded(
      self,
      q: jax.Array,  # [B, T, N, Hk]
      expand: Expand,
      *,
      dtype,
      q_offsets: jax.Array,  # i32[B]
      sm_scale: float,
      window: int | None = None,
  ) -> jax.Array:
    """`MLACache.attend_expanded` (`kvattn.caches.protocol`): `[B, T, N, Hv]`
    through `kvattn.ops.attention`. A quantized cache's latents are
    dequantized to `dtype` before `expand`; a float cache's go as stored."""
    c_kv, k_rope = self.dequantized(dtype) if self.quantized else (self.c_kv, self.k_rope)
    k, v = expand(c_kv, k_rope)
    return ops.attention(q, k, v, q_offsets=q_offsets, kv_lengths=self.lengths,
                         sm_scale=sm_scale, window=window)


def _build(model, batch, max_len, dtype, options, tokens_per_seq):
  del options, tokens_per_seq
  return tuple(layer.attn.init_cache(batch, max_len, dtype) for layer in model.layers)


registry.register_cache_kind("dense", registry.CacheKind(
    _build, {}, "KVCache / LatentCache of max_len (layer.attn.init_cache)"))
