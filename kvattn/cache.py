"""Functional KV caches: registered pytrees with pure update functions.

Every cache here is a `flax.struct.dataclass`: its arrays are pytree leaves and
its sizes and dtypes are read from those arrays, so a cache passes through
`jax.jit`, `lax.scan` and `lax.while_loop` as data, and a jitted step that
donates the old cache lets XLA write the new one in place.

Slot convention (DESIGN.md): sequence b occupies slots `[0, lengths[b])`;
slots past that may hold anything (zeros, 1e30, NaN) and never change a
result. An update writes token t of sequence b to slot `lengths[b] + t` for
`t < new_lengths[b]` (right padding: tokens at `t >= new_lengths[b]` are not
written and do not advance `lengths`).

Overflow (a write past `max_len`) never wraps and never clamps onto other
slots:
  * when `lengths` and `new_lengths` are concrete (eager calls), `update`
    raises `ValueError` before writing;
  * under `jit`, tokens that do not fit are dropped (scatter `mode='drop'`)
    and `lengths` still advances past `max_len`, so `cache.overflowed` (`lengths
    > max_len`) is a sticky per-sequence flag: lengths never decrease. The
    same condition is a `checkify.debug_check`, so a function transformed by
    `jax.experimental.checkify.checkify` reports it as an error.
    `kvattn.generate` validates prompt length + new tokens against `max_len`
    up front, so generation never overflows.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.experimental import checkify

from kvattn import _checks


def _check_dtype(dtype) -> jnp.dtype:
  try:
    dtype = jnp.dtype(dtype)
  except TypeError as e:
    raise TypeError(f"dtype must be a JAX dtype; got {dtype!r}") from e
  if not jnp.issubdtype(dtype, jnp.floating):
    raise TypeError(f"dtype must be a floating dtype; got {dtype}")
  return dtype


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


def write_tokens(
    buffer: jax.Array,  # [B, ..., S, ...] with the slot axis at `slot_axis`
    new: jax.Array,  # [B, T, ...] the per-token values, in buffer's layout minus S
    lengths: jax.Array,  # i32[B]
    new_lengths: jax.Array,  # i32[B]
    *,
    slot_axis: int,
) -> jax.Array:
  """Scatters T new tokens per sequence into slots `lengths[b] + t`.

  Tokens with `t >= new_lengths[b]` and tokens whose slot is `>= S` are
  dropped (never wrapped or clamped). `new` is `[B, T, *rest]` where `rest` is
  buffer's shape without the batch and slot axes. The cast to buffer's dtype
  happens here.
  """
  batch, num_tokens = new.shape[:2]
  capacity = buffer.shape[slot_axis]
  t = jnp.arange(num_tokens, dtype=jnp.int32)[None, :]
  slots = lengths[:, None] + t
  slots = jnp.where(t < new_lengths[:, None], slots, capacity)  # capacity = dropped
  rows = jnp.broadcast_to(jnp.arange(batch, dtype=jnp.int32)[:, None], slots.shape)
  index = (rows,) + (slice(None),) * (slot_axis - 1) + (slots,)
  return buffer.at[index].set(new.astype(buffer.dtype), mode="drop")


def advance_lengths(lengths: jax.Array, new_lengths: jax.Array, capacity: int) -> jax.Array:
  """Returns `lengths + new_lengths`, enforcing the overflow contract above."""
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


@struct.dataclass
class KVCache:
  """Dense KV cache of one attention layer (MHA, GQA or MQA).

  Attributes:
    k: `[B, K, S, H]` keys, head-major (each (b, k) sequence is contiguous),
      RoPE already applied.
    v: `[B, K, S, H]` values.
    lengths: `i32[B]` valid tokens per sequence; may exceed S only after an
      overflow under jit (see `overflowed`).
  """

  k: jax.Array
  v: jax.Array
  lengths: jax.Array

  @classmethod
  def init(cls, batch: int, max_len: int, num_kv_heads: int, head_dim: int,
           dtype=jnp.float32) -> "KVCache":
    """An empty cache: zeros, `lengths == 0`.

    Raises:
      ValueError: a size that is not a positive int.
      TypeError: a non-floating dtype.
    """
    batch = _checks.positive_int("batch", batch)
    max_len = _checks.positive_int("max_len", max_len)
    num_kv_heads = _checks.positive_int("num_kv_heads", num_kv_heads)
    head_dim = _checks.positive_int("head_dim", head_dim)
    dtype = _check_dtype(dtype)
    shape = (batch, num_kv_heads, max_len, head_dim)
    return cls(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype),
               lengths=jnp.zeros((batch,), jnp.int32))

  @property
  def batch(self) -> int:
    return self.k.shape[0]

  @property
  def num_kv_heads(self) -> int:
    return self.k.shape[1]

  @property
  def max_len(self) -> int:
    return self.k.shape[2]

  @property
  def head_dim(self) -> int:
    return self.k.shape[3]

  @property
  def dtype(self) -> jnp.dtype:
    return self.k.dtype

  @property
  def overflowed(self) -> jax.Array:
    """`bool[B]`: True for sequences that were written past `max_len` under jit."""
    return self.lengths > self.max_len

  @property
  def num_slots(self) -> int:
    """Token slots the cache reserves: B * S."""
    return self.batch * self.max_len

  def storage_arrays(self) -> tuple[jax.Array, ...]:
    """The arrays whose size grows with the token slots (for `kvattn.memory`)."""
    return (self.k, self.v)

  def update(self, k_new: jax.Array, v_new: jax.Array,
             new_lengths: jax.Array | None = None) -> "KVCache":
    """Writes T new tokens per sequence at each sequence's own offset.

    Args:
      k_new: `[B, T, K, H]` keys (RoPE applied), any float dtype (cast to the
        cache dtype).
      v_new: `[B, T, K, H]` values.
      new_lengths: `i32[B]` real tokens per sequence among the T (default T).

    Returns:
      The updated cache; `lengths` grows by `new_lengths`.

    Raises:
      ValueError: wrong shapes, `new_lengths` outside [0, T], or (when lengths
        are concrete) a write past `max_len`.
    """
    expected = (self.batch, None, self.num_kv_heads, self.head_dim)
    for name, x in (("k_new", k_new), ("v_new", v_new)):
      _checks.rank(name, x, 4, "[B, T, K, H]")
      if any(e is not None and e != s for e, s in zip(expected, x.shape)):
        raise ValueError(
            f"{name} must have shape [B, T, K, H] = ({self.batch}, T, {self.num_kv_heads}, "
            f"{self.head_dim}); got {tuple(x.shape)}")
    if k_new.shape != v_new.shape:
      raise ValueError(f"k_new and v_new must have one shape; got {k_new.shape} and {v_new.shape}")
    new_lengths = resolve_new_lengths(new_lengths, self.batch, k_new.shape[1])
    lengths = advance_lengths(self.lengths, new_lengths, self.max_len)  # raises first
    return KVCache(
        k=write_tokens(self.k, k_new, self.lengths, new_lengths, slot_axis=2),
        v=write_tokens(self.v, v_new, self.lengths, new_lengths, slot_axis=2),
        lengths=lengths,
    )


@struct.dataclass
class LatentCache:
  """Latent cache of one MLA layer (DeepSeek-V2, arXiv 2405.04434, §2.1.2-2.1.3).

  Instead of per-head keys and values, MLA caches per token one compressed
  latent `c_kv` (width C = `kv_lora_rank`, RMSNorm already applied) and one
  decoupled RoPE key `k_rope` (width R = `qk_rope_head_dim`, RoPE already
  applied) shared by every head: `(C + R) * itemsize` bytes per token per
  layer. Update semantics (slots, `new_lengths`, overflow) are those of
  `KVCache`; see the module docstring.

  Attributes:
    c_kv: `[B, S, C]` normalised KV latents.
    k_rope: `[B, S, R]` shared RoPE keys, same dtype as `c_kv`.
    lengths: `i32[B]` valid tokens per sequence; may exceed S only after an
      overflow under jit (see `overflowed`).
  """

  c_kv: jax.Array
  k_rope: jax.Array
  lengths: jax.Array

  @classmethod
  def init(cls, batch: int, max_len: int, kv_lora_rank: int, qk_rope_head_dim: int,
           dtype=jnp.float32) -> "LatentCache":
    """An empty cache: zeros, `lengths == 0`.

    Raises:
      ValueError: a size that is not a positive int.
      TypeError: a non-floating dtype.
    """
    batch = _checks.positive_int("batch", batch)
    max_len = _checks.positive_int("max_len", max_len)
    kv_lora_rank = _checks.positive_int("kv_lora_rank", kv_lora_rank)
    qk_rope_head_dim = _checks.positive_int("qk_rope_head_dim", qk_rope_head_dim)
    dtype = _check_dtype(dtype)
    return cls(c_kv=jnp.zeros((batch, max_len, kv_lora_rank), dtype),
               k_rope=jnp.zeros((batch, max_len, qk_rope_head_dim), dtype),
               lengths=jnp.zeros((batch,), jnp.int32))

  @property
  def batch(self) -> int:
    return self.c_kv.shape[0]

  @property
  def max_len(self) -> int:
    return self.c_kv.shape[1]

  @property
  def kv_lora_rank(self) -> int:
    return self.c_kv.shape[2]

  @property
  def qk_rope_head_dim(self) -> int:
    return self.k_rope.shape[2]

  @property
  def dtype(self) -> jnp.dtype:
    return self.c_kv.dtype

  @property
  def overflowed(self) -> jax.Array:
    """`bool[B]`: True for sequences that were written past `max_len` under jit."""
    return self.lengths > self.max_len

  @property
  def num_slots(self) -> int:
    """Token slots the cache reserves: B * S."""
    return self.batch * self.max_len

  def storage_arrays(self) -> tuple[jax.Array, ...]:
    """The arrays whose size grows with the token slots (for `kvattn.memory`)."""
    return (self.c_kv, self.k_rope)

  def update(self, c_kv_new: jax.Array, k_rope_new: jax.Array,
             new_lengths: jax.Array | None = None) -> "LatentCache":
    """Writes T new tokens per sequence at each sequence's own offset.

    Args:
      c_kv_new: `[B, T, C]` normalised latents, any float dtype (cast to the
        cache dtype).
      k_rope_new: `[B, T, R]` shared RoPE keys (RoPE applied).
      new_lengths: `i32[B]` real tokens per sequence among the T (default T).

    Returns:
      The updated cache; `lengths` grows by `new_lengths`.

    Raises:
      ValueError: wrong shapes, `new_lengths` outside [0, T], or (when lengths
        are concrete) a write past `max_len`.
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
    lengths = advance_lengths(self.lengths, new_lengths, self.max_len)  # raises first
    return LatentCache(
        c_kv=write_tokens(self.c_kv, c_kv_new, self.lengths, new_lengths, slot_axis=1),
        k_rope=write_tokens(self.k_rope, k_rope_new, self.lengths, new_lengths, slot_axis=1),
        lengths=lengths,
    )
