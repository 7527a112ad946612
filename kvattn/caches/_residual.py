"""What the sub-byte caches with a full-precision residual window share (`kivi.py`, `rotated.py`).

A `ResidualStoreCache` holds one GQA layer's tokens in two places (KIVI's layout, Liu et al.
2024, arXiv 2402.02750, algorithm 1):
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from kvattn import _checks
from kvattn.caches import _slots
from kvattn.caches import capabilities
from kvattn.caches import dense as dense_lib
from kvattn.ops import lowbit
from kvattn.ops.rope import apply_rope

BLOCK_TOKENS = 512
"""Store slots per attention block (rounded down to whole groups): a few MiB of f32 per
block at B = 4, K = 3, H = 64, and few enough loop iterations at 4k tokens for XLA:CPU's
per-iteration cost to stay small."""


def store_slots(max_len: int, residual: int, group_size: int) -> int:
  """Slots of the quantized store, `group_size * max(0, (max_len - residual) // group_size)`."""
  return group_size * max(0, (max_len - residual) // group_size)


def ring_slots(max_len: int, residual: int, group_size: int) -> int:
  """Slots of the residual ring, `min(residual + group_size - 1, max_len)` (at least 1)."""
  return max(1, min(residual + group_size - 1, max_len))


def check_residual(residual: Any, group_size: int) -> int:
  """`residual` as an int >= 0 and a multiple of `group_size`; ValueError otherwise."""
  if isinstance(residual, bool) or not isinstance(residual, (int, np.integer)) or (
      residual < 0 or residual % group_size):
    raise ValueError(f"residual must be an int >= 0 and a multiple of group_size = "
                     f"{group_size}; got {residual!r}")
  return int(residual)


def check_float_dtype(dtype: Any) -> jnp.dtype:
  """The residual's dtype: floating (int8 / fp8 do not apply: these kinds quantize)."""
  from kvattn.ops import quant  # pylint: disable=g-import-not-at-top
  try:
    dtype = jnp.dtype(dtype)
  except TypeError as e:
    raise TypeError(f"dtype must be a JAX dtype; got {dtype!r}") from e
  if not jnp.issubdtype(dtype, jnp.floating) or quant.is_quantized(dtype):
    raise TypeError(f"dtype must be a float dtype (the residual's; this cache kind quantizes "
                    f"itself, so int8 / fp8 do not apply); got {dtype.name}")
  return dtype


def _num_quantized(stored: jax.Array, residual: int, group_size: int) -> jax.Array:
  """`i32[B]` tokens in the store when `stored` tokens are held."""
  return group_size * jnp.maximum(0, (stored - residual) // group_size)


def _ring_tokens(stored: jax.Array, nq: jax.Array, ring: int) -> jax.Array:
  """`i32[B, Rb]`: the token ring slot r holds (`t % Rb == r`, `nq <= t < stored`), or -1."""
  r = jnp.arange(ring, dtype=jnp.int32)[None, :]
  t = nq[:, None] + (r - nq[:, None]) % ring
  return jnp.where(t < stored[:, None], t, -1)


def check_implementation(implementation) -> None:
  """NotImplementedError unless `implementation` names only backends of the store ops
  (`kvattn.ops.dispatch.STORE_OPS`: "pallas", "xla", or None)."""
  from kvattn.ops import dispatch  # pylint: disable=g-import-not-at-top
  try:
    dispatch.check_implementation(dispatch.STORE_OPS[0], implementation)
  except ValueError:
    raise NotImplementedError(
        f"a quantized-store cache is read by the XLA loop (kvattn.ops.lowbit) or its kind's "
        f"Pallas kernel; implementation must be None, 'pallas' or 'xla' (or a sequence of "
        f"them), got {implementation!r}") from None


SCALE_DTYPES = ("float16", "bfloat16", "float32")


class ResidualStoreCache(capabilities.Rows):
  """The shared members (module doc); subclasses are `flax.struct.dataclass`es."""

  FLOAT_ONLY = True

  # ---------------------------------------------------------------------------- hooks
  def _to_space(self, x: jax.Array) -> jax.Array:
    """f32 keys or values `[B, K, S', H]` into the attention space (identity)."""
    return x.astype(jnp.float32)

  def _from_space(self, x: jax.Array) -> jax.Array:
    """Inverse of `_to_space` (identity)."""
    return x

  def _q_to_space(self, q: jax.Array) -> jax.Array:
    """Queries `[B, T, N, H]` into the attention space (identity)."""
    return q

  def _out_from_space(self, out: jax.Array) -> jax.Array:
    """Attention output `[B, T, N, H]` f32 back from the attention space (identity)."""
    return out

  def _store_decode(self, q, starts, lengths, implementation, **options):
    """`(out f32[B, N, H], lse f32[B, N])` of decode queries `q: [B, N, H]` (in the
    attention space) against store slots `[starts, lengths)` by the kind's store op in
    `kvattn.ops.dispatch`, or None where its "xla" backend (the XLA loop) is picked."""
    del q, starts, lengths, options
    if implementation not in (None, "xla"):
      raise NotImplementedError(f"pallas: no kernel reads a {type(self).__name__} store")
    return None

  # ---------------------------------------------------------------------------- sizes
  @property
  def batch(self) -> int:
    return self.k_res.shape[0]

  @property
  def num_kv_heads(self) -> int:
    return self.k_res.shape[1]

  @property
  def head_dim(self) -> int:
    return self.k_res.shape[3]

  @property
  def capacity(self) -> int:
    """Tokens one sequence can hold (S)."""
    return self.max_len

  @property
  def dtype(self) -> jnp.dtype:
    """The residual's (compute) dtype."""
    return self.k_res.dtype

  @property
  def store_capacity(self) -> int:
    """Sq, slots of the quantized store."""
    return self.k_codes.shape[2]

  @property
  def ring_capacity(self) -> int:
    """Rb, slots of the residual ring."""
    return self.k_res.shape[2]

  @property
  def storage_slots(self) -> int:
    """B * S: the token slots the storage serves (what `kvattn.memory` divides by)."""
    return self.batch * self.max_len

  # ---------------------------------------------------------------------------- slots
  def _stored(self) -> jax.Array:
    return jnp.clip(self.lengths, 0, self.max_len)

  @property
  def num_quantized(self) -> jax.Array:
    """`i32[B]` tokens in the quantized store."""
    return _num_quantized(self._stored(), self.residual, self.group_size)

  @property
  def readable_quantized(self) -> jax.Array:
    """`i32[B]` store tokens attention reads: `num_quantized` (a paged store: those its
    assigned pages hold)."""
    return self.num_quantized

  @property
  def overflowed(self) -> jax.Array:
    """`bool[B]`: written past `max_len` under jit."""
    return self.lengths > self.max_len

  def slot_positions(self) -> jax.Array:
    """`i32[B, S]`, the logical view: token s at slot s below `min(lengths, S)`, else -1."""
    return _slots.slot_positions(self._stored(), self.max_len)

  def ring_tokens(self) -> jax.Array:
    """`i32[B, Rb]`: the token each ring slot holds, or -1."""
    return _ring_tokens(self._stored(), self.num_quantized, self.ring_capacity)

  def check_state(self, name: str = "cache") -> None:
    """Eager: `lengths` in `[0, max_len]` (ValueError naming the row)."""
    _checks.values_in_range(f"{name} lengths", self.lengths, 0, self.max_len)

  # ---------------------------------------------------------------------------- reading
  def _rope_keys(self, k: jax.Array, tokens: jax.Array) -> jax.Array:
    """`k: [B, K, S', H]` rotated at positions `tokens` (`i32[B, S']`; pre-RoPE mode)."""
    rotated = apply_rope(jnp.swapaxes(k, 1, 2), jnp.maximum(tokens, 0), rope_theta=self.rope_theta,
                         scaling=self.rope_scaling)
    return jnp.swapaxes(rotated, 1, 2)

  def _read(self, offset: jax.Array, size: int) -> tuple[jax.Array, jax.Array]:
    """`read_block` with the keys RoPE'd at their tokens in pre-RoPE mode."""
    k, v = self.read_block(offset, size)
    if self.pre_rope:
      tokens = offset + jnp.arange(size, dtype=jnp.int32)
      k = self._rope_keys(k, jnp.broadcast_to(tokens, k.shape[:1] + (size,)))
    return k, v

  def _block_size(self) -> int:
    g = self.group_size
    return max(g, min(self.store_capacity, (BLOCK_TOKENS // g) * g))

  def _attend(self, q, q_tokens, *, extra: Sequence[lowbit.Segment] = (), sm_scale=None,
              window=None, soft_cap=None, implementation=None) -> jax.Array:
    """f32 `[B, T, N, H]`: `q` (RoPE'd) against the store, the ring and `extra`; a decode
    step reads the store through the kind's store op of `kvattn.ops.dispatch`."""
    nq = self.readable_quantized
    ring_tokens = self.ring_tokens()
    k_res = self.k_res.astype(jnp.float32)
    if self.pre_rope:
      k_res = self._rope_keys(k_res, ring_tokens)
    segments = [(self._to_space(k_res), self._to_space(self.v_res.astype(jnp.float32)),
                 ring_tokens)]
    segments += [(self._to_space(k), self._to_space(v), t) for k, v, t in extra]
    q_space = self._q_to_space(q)
    scale = q.shape[-1] ** -0.5 if sm_scale is None else float(sm_scale)
    initial = self._store_by_kernel(q_space, q_tokens, nq, implementation, sm_scale=scale,
                                    window=window, soft_cap=soft_cap)
    by_kernel = initial is not None
    out = lowbit.blocked_attention(
        q_space, q_tokens, num_quantized=nq,
        store_capacity=0 if by_kernel else self.store_capacity,
        read_block=self._read if self.store_capacity and not by_kernel else None,
        block_size=self._block_size(), segments=segments, sm_scale=scale, window=window,
        soft_cap=soft_cap, initial=initial)
    return self._out_from_space(out)

  def _store_by_kernel(self, q, q_tokens, nq, implementation, *, sm_scale, window, soft_cap):
    """The online-softmax state `(m, l, acc)` (`lowbit.blocked_attention`'s `initial`) of
    the store read by the Pallas kernel, or None when the XLA loop reads it (T > 1, an
    empty store, "xla" first, or None where the kernel cannot run)."""
    if q.shape[1] != 1 or not self.store_capacity:
      return None
    token = q_tokens[:, 0]
    starts = jnp.zeros_like(token) if window is None else jnp.maximum(token - window + 1, 0)
    found = self._store_decode(q[:, 0], starts, jnp.minimum(nq, token + 1), implementation,
                               sm_scale=sm_scale, soft_cap=soft_cap)
    return None if found is None else lowbit.state_from_lse(*found, self.num_kv_heads)

  def attend(self, q: jax.Array, *, q_offsets: jax.Array, sm_scale: float | None = None,
             window: int | None = None, soft_cap: float | None = None,
             implementation: str | None = None) -> jax.Array:
    """`GQACache.attend` after `update`: `q: [B, T, N, H]` (RoPE'd at the token positions)
    against the store (block by block) and the ring; `[B, T, N, H]` in q's dtype.

    Raises:
      NotImplementedError: an `implementation` naming a backend other than None / "pallas" /
        "xla", or only "pallas" where the kind has no kernel (module doc).
    """
    check_implementation(implementation)
    q_tokens = q_offsets[:, None] + jnp.arange(q.shape[1], dtype=jnp.int32)[None, :]
    return self._attend(q, q_tokens, sm_scale=sm_scale, window=window, soft_cap=soft_cap,
                        implementation=implementation).astype(q.dtype)

  def dequantized(self, dtype=jnp.float32) -> tuple[jax.Array, jax.Array]:
    """`(k, v)`: `[B, K, S, H]` in token order (token s in slot s, zeros where no token),
    the store dequantized and the ring's tokens put back in place; keys as stored (before
    RoPE in pre-RoPE mode). Materialises a copy: for tests and references, not decode."""
    b, kh, h, s = self.batch, self.num_kv_heads, self.head_dim, self.max_len
    out = []
    nq = self.readable_quantized
    ring_tokens = self.ring_tokens()
    if self.store_capacity:
      kq, vq = (self._from_space(x) for x in self.read_block(jnp.int32(0), self.store_capacity))
    for i, res in enumerate((self.k_res, self.v_res)):
      full = jnp.zeros((b, kh, s, h), jnp.float32)
      if self.store_capacity:
        part = (kq, vq)[i]
        used = (jnp.arange(self.store_capacity)[None, :] < nq[:, None])[:, None, :, None]
        full = full.at[:, :, :self.store_capacity].set(jnp.where(used, part, 0.0))
      rows = jnp.broadcast_to(jnp.arange(b)[:, None], ring_tokens.shape)
      dest = jnp.where(ring_tokens >= 0, ring_tokens, s)
      full = full.at[rows, :, dest].set(jnp.moveaxis(res.astype(jnp.float32), 2, 1),
                                        mode="drop")
      out.append(full.astype(dtype))
    return tuple(out)

  # ---------------------------------------------------------------------------- writing
  def update(self, k_new: jax.Array, v_new: jax.Array,
             new_lengths: jax.Array | None = None) -> "ResidualStoreCache":
    """Writes `k_new, v_new: [B, T, K, H]` (keys RoPE'd; before RoPE in pre-RoPE mode) for tokens `t
    < new_lengths[b]`: complete groups beyond the residual into the store, the rest into the ring.

    Raises:
      ValueError, TypeError: as `KVCache.update` (shapes, dtypes, `new_lengths`, an eager overflow).
    """
    return self.update_unchecked(k_new, v_new,
                                 dense_lib.check_new_kv(self, k_new, v_new, new_lengths))

  def update_unchecked(self, k_new: jax.Array, v_new: jax.Array,
                       new_lengths: jax.Array) -> "ResidualStoreCache":
    """`update` for callers that checked the arguments (the cache's state is checked)."""
    lengths = dense_lib.advance_lengths(self.lengths, new_lengths, self.max_len)
    return self._write(k_new, v_new, new_lengths, lengths)

  def _write(self, k_new, v_new, new_lengths, lengths) -> "ResidualStoreCache":
    g, s, rb, sq = self.group_size, self.max_len, self.ring_capacity, self.store_capacity
    batch, num_tokens = k_new.shape[:2]
    old_stored = self._stored()
    old_nq = self.num_quantized
    new_stored = jnp.clip(self.lengths + new_lengths, 0, s)
    new_nq = _num_quantized(new_stored, self.residual, g)
    rows = jnp.arange(batch, dtype=jnp.int32)[:, None]
    chunk_k = jnp.swapaxes(k_new, 1, 2).astype(jnp.float32)  # [B, K, T, H]
    chunk_v = jnp.swapaxes(v_new, 1, 2).astype(jnp.float32)
    out = {}
    num_groups = min(math.ceil(num_tokens / g), (rb + num_tokens) // g) if sq else 0
    if num_groups:
      # Tokens [old_nq, old_nq + num_groups * g), from the old ring or the chunk.
      i = jnp.arange(num_groups * g, dtype=jnp.int32)[None, :]
      token = old_nq[:, None] + i
      from_ring = token < old_stored[:, None]
      src = jnp.where(from_ring, token % rb, rb + jnp.clip(token - self.lengths[:, None], 0,
                                                           num_tokens - 1))
      both_k = jnp.concatenate([self.k_res.astype(jnp.float32), chunk_k], axis=2)
      both_v = jnp.concatenate([self.v_res.astype(jnp.float32), chunk_v], axis=2)
      take = lambda x: jnp.take_along_axis(x, src[:, None, :, None], axis=2)
      gk, gv = take(both_k), take(both_v)  # [B, K, num_groups * g, H]
      # Group j is flushed iff old_nq + (j + 1) g <= new_nq; others go to slot Sq (dropped).
      flushed = token < new_nq[:, None]  # [B, n g]
      slot = jnp.where(flushed, token, sq)
      gidx = jnp.arange(num_groups, dtype=jnp.int32)[None, :]
      gtoken = old_nq[:, None] + gidx * g
      gslot = jnp.where(gtoken < new_nq[:, None], gtoken // g, sq // g)
      for field, (x, per) in self._encode(gk, gv, num_groups).items():
        out[field] = self._put_store(getattr(self, field), x, slot if per == "token" else gslot,
                                     per)
    # The ring keeps the chunk's tokens that stay residual: [max(old_stored, new_nq),
    # new_stored), distinct ring slots (at most Rb of them).
    t = jnp.arange(num_tokens, dtype=jnp.int32)[None, :]
    token = self.lengths[:, None] + t
    keep = (t < new_lengths[:, None]) & (token >= new_nq[:, None]) & (token < new_stored[:, None])
    slot = jnp.where(keep, token % rb, rb)
    ring_put = lambda buf, x: buf.at[rows, :, slot].set(
        jnp.moveaxis(x, 2, 1).astype(buf.dtype), mode="drop")
    out.update(k_res=ring_put(self.k_res, chunk_k), v_res=ring_put(self.v_res, chunk_v))
    return self.replace(lengths=lengths, **out)

  def _put_store(self, buf: jax.Array, x: jax.Array, index: jax.Array, per: str) -> jax.Array:
    """`buf` (a store field) with `x: [B, K, n, ...]` written at `index: i32[B, n]`: store
    slots (`per` "token") or key groups ("group"); an index at the store's end (`Sq`, `Sq /
    group_size`) is dropped. Dense store: `buf[b, :, index[b, i]] = x[b, :, i]`."""
    del per
    rows = jnp.arange(buf.shape[0], dtype=jnp.int32)[:, None]
    return buf.at[rows, :, index].set(jnp.moveaxis(x, 2, 1), mode="drop")

  # ---------------------------------------------------------------------------- the step
  def update_attend(self, q: jax.Array, k: jax.Array, v: jax.Array, *, positions: jax.Array,
                    rope_theta: float, rope_scaling: Any = None, new_lengths: jax.Array,
                    sm_scale: float | None = None, window: int | None = None,
                    soft_cap: float | None = None,
                    implementation: str | Sequence[str] | None = None
                    ) -> tuple[jax.Array, "ResidualStoreCache"]:
    """One attention step (`cache_protocol.update_attend`), checked: `q, k, v` before RoPE.

    Raises:
      ValueError, TypeError: as `update`; in pre-RoPE mode, concrete `positions` other than
        the token indices, or a RoPE other than the cache's.
    """
    new_lengths = dense_lib.check_new_kv(self, k, v, new_lengths)
    return self.update_attend_unchecked(
        q, k, v, positions=positions, rope_theta=rope_theta, rope_scaling=rope_scaling,
        new_lengths=new_lengths, sm_scale=sm_scale, window=window, soft_cap=soft_cap,
        implementation=implementation)

  def update_attend_unchecked(self, q, k, v, *, positions, rope_theta, rope_scaling=None,
                              new_lengths, sm_scale=None, window=None, soft_cap=None,
                              implementation=None) -> tuple[jax.Array, "ResidualStoreCache"]:
    """`(out [B, T, N, H], new_cache)`: the queries attend this cache (from before the
    write) plus the chunk's own tokens in full precision, then the chunk is written."""
    check_implementation(implementation)
    lengths = dense_lib.advance_lengths(self.lengths, new_lengths, self.max_len)  # raises first
    rope = dict(rope_theta=rope_theta, scaling=rope_scaling)
    num_tokens = q.shape[1]
    q_tokens = self.lengths[:, None] + jnp.arange(num_tokens, dtype=jnp.int32)[None, :]
    q_rot, k_rot = apply_rope(q, positions, **rope), apply_rope(k, positions, **rope)
    if self.pre_rope:
      if rope_theta != self.rope_theta or rope_scaling != self.rope_scaling:
        raise ValueError(f"rope_theta / rope_scaling must be the cache's ({self.rope_theta}, "
                         f"{self.rope_scaling}) in pre-RoPE mode; got {rope_theta}, "
                         f"{rope_scaling}")
      if _checks.is_concrete(positions) and _checks.is_concrete(self.lengths) and not np.array_equal(
          np.asarray(positions), np.asarray(q_tokens)):
        raise ValueError("positions must be the token indices (lengths + arange(T)) for a "
                         "cache with pre_rope=True (its keys are rotated at their token "
                         "indices)")
    chunk_tokens = jnp.where(jnp.arange(num_tokens)[None, :] < new_lengths[:, None], q_tokens, -1)
    chunk = (jnp.swapaxes(k_rot, 1, 2), jnp.swapaxes(v, 1, 2), chunk_tokens)
    out = self._attend(q_rot, q_tokens, extra=[chunk], sm_scale=sm_scale, window=window,
                       soft_cap=soft_cap, implementation=implementation).astype(q.dtype)
    # The written chunk depends on the output (an exact + 0), so the write is ordered after
    # every read of the old buffers (as `KVCache.update_attend_unchecked`).
    tie = jnp.nan_to_num(out[0, 0, 0, 0].astype(jnp.float32) * 0.0)
    stored_k = k if self.pre_rope else k_rot
    return out, self._write(stored_k + tie.astype(stored_k.dtype), v + tie.astype(v.dtype),
                            new_lengths, lengths)


