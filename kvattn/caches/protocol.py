"""The cache protocol: what an attention module asks of a KV cache."""

from __future__ import annotations

from typing import Any, Callable, Protocol, runtime_checkable

import jax
import jax.numpy as jnp

from kvattn.ops.rope import apply_rope


@runtime_checkable
class Cache(Protocol):
  """Members every cache kind has, whatever its attention variant."""

  lengths: jax.Array
  """`i32[B]` tokens written per sequence (may exceed `capacity` only after an
  overflow under jit)."""

  @property
  def batch(self) -> int:
    """Sequences B."""

  @property
  def capacity(self) -> int:
    """Tokens one sequence can hold (`max_len` of the dense and paged caches)."""

  @property
  def storage_slots(self) -> int:
    """Token slots the storage arrays hold in all (what `kvattn.memory` divides
    their bytes by): `B * S` for a dense cache, `P * page_size` for a page pool."""

  def storage_arrays(self) -> tuple[jax.Array, ...]:
    """The arrays whose size grows with the token slots (values, and scales
    when quantized); bookkeeping such as `lengths` is not storage."""

  def slot_positions(self) -> jax.Array:
    """`i32[B, capacity]`: the token index held by slot s of sequence b (its s-th slot in storage
    order; through the block table for a paged cache), or -1 where the slot holds no token."""


@runtime_checkable
class GQACache(Cache, Protocol):
  """A cache of per-KV-head keys and values, read by `GroupedQueryAttention`."""

  @property
  def num_kv_heads(self) -> int:
    """KV heads K."""

  @property
  def head_dim(self) -> int:
    """Head width H."""

  def update(self, k_new: jax.Array, v_new: jax.Array,
             new_lengths: jax.Array | None = None) -> "GQACache":
    """Writes `k_new, v_new: [B, T, K, H]` (keys RoPE'd) for tokens
    `t < new_lengths[b]` (`i32[B]`, default T); returns the new cache."""

  def attend(self, q: jax.Array, *, q_offsets: jax.Array, sm_scale: float | None = None,
             window: int | None = None, soft_cap: float | None = None,
             implementation: str | None = None) -> jax.Array:
    """Causal attention of `q: [B, T, N, H]` (RoPE'd) against this cache, called after `update`
    wrote the same T tokens."""


def update_attend(cache: GQACache, q: jax.Array, k: jax.Array, v: jax.Array, *,
                  positions: jax.Array, rope_theta: float, rope_scaling: Any = None,
                  new_lengths: jax.Array, **options: Any) -> tuple[jax.Array, GQACache]:
  """One attention step of a GQA module against `cache`; returns `(out, new_cache)`."""
  new_lengths = _all_tokens(k, new_lengths)
  step = getattr(cache, "update_attend_unchecked", None) or getattr(cache, "update_attend", None)
  if step is not None:
    return step(q, k, v, positions=positions, rope_theta=rope_theta, rope_scaling=rope_scaling,
                new_lengths=new_lengths, **options)
  rope = dict(rope_theta=rope_theta, scaling=rope_scaling)
  q, k = apply_rope(q, positions, **rope), apply_rope(k, positions, **rope)
  new_cache = write(cache, k, v, new_lengths=new_lengths)
  return new_cache.attend(q, q_offsets=cache.lengths, **options), new_cache


def write(cache: "Cache", *new: jax.Array, new_lengths: jax.Array | None) -> "Cache":
  """`cache.update(*new, new_lengths)` for a module that has checked the arguments."""
  update = getattr(cache, "update_unchecked", None) or cache.update
  return update(*new, _all_tokens(new[0], new_lengths))


def _all_tokens(new: jax.Array, new_lengths: jax.Array | None) -> jax.Array:
  """`new_lengths`, or for None every one of the T tokens of `new: [B, T, ...]` (a
  default needs no check)."""
  if new_lengths is not None:
    return new_lengths
  return jnp.full(new.shape[:1], new.shape[1], jnp.int32)


Expand = Callable[[jax.Array, jax.Array], tuple[jax.Array, jax.Array]]
"""`(c_kv [B, S, C], k_rope [B, S, R]) -> (k [B, N, S, Hk], v [B, N, S, Hv])`:
an MLA layer's expansion of latents into per-head keys and values."""


@runtime_checkable
class MLACache(Cache, Protocol):
  """A cache of MLA latents and shared RoPE keys, read by `MultiHeadLatentAttention`."""

  @property
  def kv_lora_rank(self) -> int:
    """Latent width C."""

  @property
  def qk_rope_head_dim(self) -> int:
    """Shared RoPE key width R."""

  def update(self, c_kv_new: jax.Array, k_rope_new: jax.Array,
             new_lengths: jax.Array | None = None) -> "MLACache":
    """Writes `c_kv_new: [B, T, C]` (normalised) and `k_rope_new: [B, T, R]`
    (RoPE'd) for tokens `t < new_lengths[b]`; returns the new cache."""

  def attend(self, q_latent: jax.Array, q_rope: jax.Array, *, q_offsets: jax.Array,
             sm_scale: float, window: int | None = None,
             implementation: str | None = None) -> jax.Array:
    """Absorbed MLA attention (DeepSeek-V2 appendix C) of `q_latent: [B, T, N, C]` and `q_rope:
    [B, T, N, R]` against the latents, after `update`; positions as in `GQACache.attend`."""

  def attend_expanded(self, q: jax.Array, expand: Expand, *, dtype: Any,
                      q_offsets: jax.Array, sm_scale: float,
                      window: int | None = None) -> jax.Array:
    """Attention of `q: [B, T, N, Hk]` against the per-head keys and values `expand` makes from
    the latents read in `dtype` (dequantized when the cache is quantized), through
    `kvattn.ops.attention`; positions as in `attend`."""


def type_error(module: str, protocol: type, kinds: str, cache: Any) -> TypeError:
  """The TypeError a module raises for a `cache` argument that does not implement `protocol`."""
  return TypeError(f"cache must be a {kinds} or None; got {type(cache).__name__} ({module} reads "
                   f"caches that implement kvattn.caches.protocol.{protocol.__name__})")
