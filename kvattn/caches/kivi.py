"""KIVI: a 2- or 4-bit KV cache with a full-precision residual window (arXiv 2402.02750).

Liu et al. 2024, "KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV Cache": keys are
quantized per channel (one scale and zero point per channel over a group of `group_size`
consecutive tokens: key outliers live in a few channels), values per token (one scale and
zero point per token over groups of `group_size` channels), both asymmetric (min / max);
the newest tokens stay in the compute dtype and are flushed into the quantized store one
group of `group_size` tokens at a time (KIVI's algorithm 1; the paper's R is `residual`).

`KIVICache` is a `GQACache` (`kvattn.caches.protocol`); the registry names it `kivi2` and
`kivi4` (options `group_size` = 32, `residual` = 128, `pre_rope` = False, `scale_dtype` =
"float16"). Layout of one layer (B sequences, K KV heads, head width H, capacity S):

  * quantized store of `Sq = group_size * max(0, (S - residual) // group_size)` token slots
    (the most tokens ever flushed when at most S are held); token s in slot s:
      `k_codes, v_codes: u8[B, K, Sq, H * bits / 8]` (codes packed along H, `8 // bits` per
      byte, `kvattn.ops.lowbit.pack_codes`),
      `k_scale, k_zero: [B, K, Sq / group_size, H]` (per channel per token group),
      `v_scale, v_zero: [B, K, Sq, H / value_group]` (per token, `value_group =
      min(group_size, H)` channels each), all in `scale_dtype`;
  * residual ring `k_res, v_res: [B, K, Rb, H]` in the compute dtype, `Rb = min(residual +
    group_size - 1, S)` slots: token t in slot `t % Rb`. It holds tokens `[nq, n)` where n
    = `min(lengths, S)` and `nq = group_size * max(0, (n - residual) // group_size)`: the
    newest `residual` tokens plus the partly filled group.

Bytes per token (`analytic_bytes_per_token`, what `kvattn.memory.measured_bytes_per_token`
reads from the arrays): `(Sq * (2 H bits / 8 + 2 H s / group_size + 2 (H / value_group) s) +
Rb * 2 H itemsize) / S` per KV head, with s the scale dtype's bytes.

Writing (`update`): the tokens that complete a group beyond the residual are quantized and
scattered into the store (a static number of candidate groups, `ceil(T / group_size)`, the
unused ones dropped), the rest written into the ring; a chunk's tokens are gathered from
the old ring and the chunk, so nothing is read after it is overwritten. Attention
(`update_attend`, the module's step): the queries attend the cache from before the write --
the store read block by block (`kvattn.ops.lowbit.blocked_attention`: each block's codes
are unpacked and dequantized in f32 inside the loop, no dequantized copy of the store) and
the ring -- plus the chunk's own keys and values in full precision (as KIVI does for the
prompt), then the chunk is written. `attend` (after `update`) reads the store and the ring.

Keys before RoPE (KVQuant, Hooper et al. 2024, arXiv 2401.18079): with `pre_rope=True` the
store holds keys before RoPE and each dequantized block is rotated at its tokens' positions
inside the loop (the queries at theirs). Key positions are the token indices, so this mode
assumes the default positions (token t at position t, what `Transformer` and `generate`
use); `update_attend` checks that eagerly. `update` then takes keys BEFORE RoPE.

Overflow: as the dense cache (eager ValueError; under jit tokens past S are dropped,
`lengths` advances and `overflowed` flags the row; attention reads `min(lengths, S)`).
Not supported: MLA latents, paged layout, the Pallas kernels (the XLA loop runs
everywhere), `implementation=` other than None / "xla".
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from kvattn import _checks
from kvattn.caches import _slots
from kvattn.caches import dense as dense_lib
from kvattn.ops import lowbit
from kvattn.ops import quant
from kvattn.ops.rope import apply_rope

SCALE_DTYPES = ("float16", "bfloat16", "float32")
BLOCK_TOKENS = 512
"""Store slots per attention block (rounded down to whole groups): a few MiB of f32 per
block at B = 4, K = 3, H = 64, and few enough loop iterations at 4k tokens for XLA:CPU's
per-iteration cost to stay small."""


def store_slots(max_len: int, residual: int, group_size: int) -> int:
  """Slots of the quantized store, `group_size * max(0, (max_len - residual) // group_size)`."""
  return group_size * max(0, (max_len - residual) // group_size)


def ring_slots(max_len: int, residual: int, group_size: int) -> int:
  """Slots of the residual ring, `min(residual + group_size - 1, max_len)`."""
  return min(residual + group_size - 1, max_len)


def value_group(group_size: int, head_dim: int) -> int:
  """Channels per value scale: `min(group_size, head_dim)`."""
  return min(group_size, head_dim)


def analytic_bytes_per_token(*, max_len: int, num_kv_heads: int, head_dim: int, bits: int,
                             group_size: int, residual: int, dtype: Any,
                             scale_dtype: Any = "float16") -> float:
  """Bytes per token slot of one layer's KIVI cache of capacity `max_len` (module doc):
  packed codes, scales and zero points of the store plus the residual ring, divided by
  `max_len`."""
  h, s = head_dim, jnp.dtype(scale_dtype).itemsize
  sq, rb = store_slots(max_len, residual, group_size), ring_slots(max_len, residual, group_size)
  per_store_slot = 2 * h * bits / 8 + 2 * h * s / group_size + 2 * (h // value_group(
      group_size, h)) * s
  return num_kv_heads * (sq * per_store_slot + rb * 2 * h * jnp.dtype(dtype).itemsize) / max_len


def _num_quantized(stored: jax.Array, residual: int, group_size: int) -> jax.Array:
  """`i32[B]` tokens in the store when `stored` tokens are held."""
  return group_size * jnp.maximum(0, (stored - residual) // group_size)


def _ring_tokens(stored: jax.Array, nq: jax.Array, ring: int) -> jax.Array:
  """`i32[B, Rb]`: the token ring slot r holds (`t % Rb == r`, `nq <= t < stored`), or -1."""
  r = jnp.arange(ring, dtype=jnp.int32)[None, :]
  t = nq[:, None] + (r - nq[:, None]) % ring
  return jnp.where(t < stored[:, None], t, -1)


@struct.dataclass
class KIVICache:
  """KIVI cache of one GQA layer (module doc: layout, writing, attention).

  Attributes:
    k_codes, v_codes: `u8[B, K, Sq, H * bits / 8]` packed codes of the store.
    k_scale, k_zero: `[B, K, Sq / group_size, H]` per channel per token group.
    v_scale, v_zero: `[B, K, Sq, H / value_group]` per token per channel group.
    k_res, v_res: `[B, K, Rb, H]` the residual ring in the compute dtype.
    lengths: `i32[B]` tokens written (past `max_len` only after an overflow under jit).
    bits, group_size, residual, max_len, pre_rope: static settings.
    rope_theta, rope_scaling: the layer's RoPE (read only when `pre_rope`).
  """

  k_codes: jax.Array
  v_codes: jax.Array
  k_scale: jax.Array
  k_zero: jax.Array
  v_scale: jax.Array
  v_zero: jax.Array
  k_res: jax.Array
  v_res: jax.Array
  lengths: jax.Array
  bits: int = struct.field(pytree_node=False, default=4)
  group_size: int = struct.field(pytree_node=False, default=32)
  residual: int = struct.field(pytree_node=False, default=128)
  max_len: int = struct.field(pytree_node=False, default=0)
  pre_rope: bool = struct.field(pytree_node=False, default=False)
  rope_theta: float = struct.field(pytree_node=False, default=10000.0)
  rope_scaling: Any = struct.field(pytree_node=False, default=None)

  @classmethod
  def init(cls, batch: int, max_len: int, num_kv_heads: int, head_dim: int,
           dtype=jnp.float32, *, bits: int = 4, group_size: int = 32, residual: int = 128,
           pre_rope: bool = False, scale_dtype: Any = "float16", rope_theta: float = 10000.0,
           rope_scaling: Any = None) -> "KIVICache":
    """An empty cache (`lengths == 0`).

    Args:
      batch, max_len, num_kv_heads, head_dim: B, S, K, H.
      dtype: the residual's (compute) dtype, a float dtype.
      bits: 2 or 4.
      group_size: tokens per key group and channels per value group (capped at H); H must
        be a multiple of `min(group_size, H)`.
      residual: R, tokens kept in `dtype` (a multiple of `group_size`, >= 0).
      pre_rope: store keys before RoPE (module doc).
      scale_dtype: "float16", "bfloat16" or "float32".
      rope_theta, rope_scaling: the layer's RoPE (used when `pre_rope`).

    Raises:
      ValueError: a size that is not a positive int, `bits` not 2 / 4, `residual` not a
        multiple of `group_size`, H not a multiple of the value group or of `8 // bits`.
      TypeError: a `dtype` that is not floating (int8 / fp8: this kind quantizes itself).
    """
    batch = _checks.positive_int("batch", batch)
    max_len = _checks.positive_int("max_len", max_len)
    num_kv_heads = _checks.positive_int("num_kv_heads", num_kv_heads)
    head_dim = _checks.positive_int("head_dim", head_dim)
    bits = lowbit.check_bits(bits)
    group_size = _checks.positive_int("group_size", group_size)
    if isinstance(residual, bool) or not isinstance(residual, (int, np.integer)) or (
        residual < 0 or residual % group_size):
      raise ValueError(f"residual must be an int >= 0 and a multiple of group_size = "
                       f"{group_size}; got {residual!r}")
    vg = value_group(group_size, head_dim)
    if head_dim % vg:
      raise ValueError(f"head_dim must be a multiple of min(group_size, head_dim) = {vg}; got "
                       f"{head_dim}")
    width = lowbit.packed_width(head_dim, bits)
    try:
      dtype = jnp.dtype(dtype)
    except TypeError as e:
      raise TypeError(f"dtype must be a JAX dtype; got {dtype!r}") from e
    if not jnp.issubdtype(dtype, jnp.floating) or quant.is_quantized(dtype):
      raise TypeError(f"dtype must be a float dtype (the residual's; a KIVI cache quantizes "
                      f"itself, so int8 / fp8 do not apply); got {dtype.name}")
    if str(scale_dtype) not in SCALE_DTYPES and jnp.dtype(scale_dtype).name not in SCALE_DTYPES:
      raise ValueError(f"scale_dtype must be one of {SCALE_DTYPES}; got {scale_dtype!r}")
    sdt = jnp.dtype(scale_dtype)
    sq, rb = store_slots(max_len, residual, group_size), ring_slots(max_len, residual, group_size)
    bk = (batch, num_kv_heads)
    return cls(
        k_codes=jnp.zeros(bk + (sq, width), jnp.uint8),
        v_codes=jnp.zeros(bk + (sq, width), jnp.uint8),
        k_scale=jnp.ones(bk + (sq // group_size, head_dim), sdt),
        k_zero=jnp.zeros(bk + (sq // group_size, head_dim), sdt),
        v_scale=jnp.ones(bk + (sq, head_dim // vg), sdt),
        v_zero=jnp.zeros(bk + (sq, head_dim // vg), sdt),
        k_res=jnp.zeros(bk + (rb, head_dim), dtype), v_res=jnp.zeros(bk + (rb, head_dim), dtype),
        lengths=jnp.zeros((batch,), jnp.int32), bits=bits, group_size=group_size,
        residual=int(residual), max_len=max_len, pre_rope=bool(pre_rope),
        rope_theta=float(rope_theta), rope_scaling=rope_scaling)

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

  def storage_arrays(self) -> tuple[jax.Array, ...]:
    """Codes, scales, zero points and the residual ring (`lengths` is bookkeeping)."""
    return (self.k_codes, self.v_codes, self.k_scale, self.k_zero, self.v_scale, self.v_zero,
            self.k_res, self.v_res)

  def analytic_bytes_per_token(self) -> float:
    """`analytic_bytes_per_token` of this cache's settings (from sizes, not arrays)."""
    return analytic_bytes_per_token(
        max_len=self.max_len, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
        bits=self.bits, group_size=self.group_size, residual=self.residual, dtype=self.dtype,
        scale_dtype=self.k_scale.dtype)

  # ---------------------------------------------------------------------------- slots
  def _stored(self) -> jax.Array:
    return jnp.clip(self.lengths, 0, self.max_len)

  @property
  def num_quantized(self) -> jax.Array:
    """`i32[B]` tokens in the quantized store."""
    return _num_quantized(self._stored(), self.residual, self.group_size)

  @property
  def overflowed(self) -> jax.Array:
    """`bool[B]`: written past `max_len` under jit."""
    return self.lengths > self.max_len

  def slot_positions(self) -> jax.Array:
    """`i32[B, S]`, the logical view: token s at slot s below `min(lengths, S)`, else -1.
    (The store holds token s in its slot s; the ring holds the newest tokens at `t % Rb`,
    `ring_tokens()` says which.)"""
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

  def read_block(self, offset: jax.Array, size: int) -> tuple[jax.Array, jax.Array]:
    """Store slots `[offset, offset + size)` dequantized: f32 `(k, v)` `[B, K, size, H]`
    (keys RoPE'd at their tokens in pre-RoPE mode). `offset` and `size` must be multiples
    of `group_size`."""
    g, h = self.group_size, self.head_dim
    sl = lambda x, o, n: jax.lax.dynamic_slice_in_dim(x, o, n, axis=2)
    kc = lowbit.unpack_codes(sl(self.k_codes, offset, size), self.bits)
    vc = lowbit.unpack_codes(sl(self.v_codes, offset, size), self.bits)
    b, kh = kc.shape[:2]
    kc = kc.reshape(b, kh, size // g, g, h)
    k = lowbit.dequantize_groups(kc, sl(self.k_scale, offset // g, size // g),
                                 sl(self.k_zero, offset // g, size // g), axis=3)
    k = k.reshape(b, kh, size, h)
    vg = value_group(g, h)
    vc = vc.reshape(b, kh, size, h // vg, vg)
    v = lowbit.dequantize_groups(vc, sl(self.v_scale, offset, size), sl(self.v_zero, offset, size),
                                 axis=4).reshape(b, kh, size, h)
    if self.pre_rope:
      tokens = offset + jnp.arange(size, dtype=jnp.int32)
      k = self._rope_keys(k, jnp.broadcast_to(tokens, (b, size)))
    return k, v

  def _block_size(self) -> int:
    g = self.group_size
    return max(g, min(self.store_capacity, (BLOCK_TOKENS // g) * g))

  def _attend(self, q, q_tokens, *, extra: Sequence[lowbit.Segment] = (), sm_scale=None,
              window=None, soft_cap=None) -> jax.Array:
    """f32 `[B, T, N, H]`: `q` (RoPE'd) against the store, the ring and `extra`."""
    stored, nq = self._stored(), self.num_quantized
    ring_tokens = _ring_tokens(stored, nq, self.ring_capacity)
    k_res = self.k_res.astype(jnp.float32)
    if self.pre_rope:
      k_res = self._rope_keys(k_res, ring_tokens)
    segments = [(k_res, self.v_res, ring_tokens), *extra]
    return lowbit.blocked_attention(
        q, q_tokens, num_quantized=nq, store_capacity=self.store_capacity,
        read_block=self.read_block if self.store_capacity else None,
        block_size=self._block_size(), segments=segments, sm_scale=sm_scale, window=window,
        soft_cap=soft_cap)

  def attend(self, q: jax.Array, *, q_offsets: jax.Array, sm_scale: float | None = None,
             window: int | None = None, soft_cap: float | None = None,
             implementation: str | None = None) -> jax.Array:
    """`GQACache.attend` after `update`: `q: [B, T, N, H]` (RoPE'd at the token positions)
    against the store (block by block) and the ring; `[B, T, N, H]` in q's dtype.

    Raises:
      NotImplementedError: an `implementation` other than None / "xla" (one XLA loop).
    """
    _check_implementation(implementation)
    q_tokens = q_offsets[:, None] + jnp.arange(q.shape[1], dtype=jnp.int32)[None, :]
    return self._attend(q, q_tokens, sm_scale=sm_scale, window=window,
                        soft_cap=soft_cap).astype(q.dtype)

  def dequantized(self, dtype=jnp.float32) -> tuple[jax.Array, jax.Array]:
    """`(k, v)`: `[B, K, S, H]` in token order (token s in slot s, zeros where no token),
    the store dequantized and the ring's tokens put back in place; keys as stored (before
    RoPE in pre-RoPE mode). Materialises a copy: for tests and references, not decode."""
    b, kh, h, s = self.batch, self.num_kv_heads, self.head_dim, self.max_len
    out = []
    stored, nq = self._stored(), self.num_quantized
    ring_tokens = _ring_tokens(stored, nq, self.ring_capacity)
    plain = self.replace(pre_rope=False)  # keys as stored
    if self.store_capacity:
      kq, vq = plain.read_block(jnp.int32(0), self.store_capacity)
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
             new_lengths: jax.Array | None = None) -> "KIVICache":
    """Writes `k_new, v_new: [B, T, K, H]` (keys RoPE'd; before RoPE in pre-RoPE mode) for
    tokens `t < new_lengths[b]`: complete groups beyond the residual into the store, the
    rest into the ring.

    Raises:
      ValueError, TypeError: as `KVCache.update` (shapes, dtypes, `new_lengths`, an eager
        overflow).
    """
    return self.update_unchecked(k_new, v_new,
                                 dense_lib.check_new_kv(self, k_new, v_new, new_lengths))

  def update_unchecked(self, k_new: jax.Array, v_new: jax.Array,
                       new_lengths: jax.Array) -> "KIVICache":
    """`update` for callers that checked the arguments (the cache's state is checked)."""
    lengths = dense_lib.advance_lengths(self.lengths, new_lengths, self.max_len)
    return self._write(k_new, v_new, new_lengths, lengths)

  def _write(self, k_new, v_new, new_lengths, lengths) -> "KIVICache":
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
      b, kh, _, h = gk.shape
      sdt = self.k_scale.dtype
      kc, ks, kz = lowbit.quantize_groups(gk.reshape(b, kh, num_groups, g, h), self.bits,
                                          axis=3, scale_dtype=sdt)
      vg = value_group(g, h)
      vc, vs, vz = lowbit.quantize_groups(gv.reshape(b, kh, num_groups * g, h // vg, vg),
                                          self.bits, axis=4, scale_dtype=sdt)
      kc = lowbit.pack_codes(kc.reshape(b, kh, num_groups * g, h), self.bits)
      vc = lowbit.pack_codes(vc.reshape(b, kh, num_groups * g, h), self.bits)
      # Group j is flushed iff old_nq + (j + 1) g <= new_nq; others go to slot Sq (dropped).
      flushed = token < new_nq[:, None]  # [B, n g]
      slot = jnp.where(flushed, token, sq)
      gidx = jnp.arange(num_groups, dtype=jnp.int32)[None, :]
      gtoken = old_nq[:, None] + gidx * g
      gslot = jnp.where(gtoken < new_nq[:, None], gtoken // g, sq // g)
      put = lambda buf, x, idx: buf.at[rows, :, idx].set(jnp.moveaxis(x, 2, 1), mode="drop")
      out.update(k_codes=put(self.k_codes, kc, slot), v_codes=put(self.v_codes, vc, slot),
                 k_scale=put(self.k_scale, ks, gslot), k_zero=put(self.k_zero, kz, gslot),
                 v_scale=put(self.v_scale, vs, slot), v_zero=put(self.v_zero, vz, slot))
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

  # ---------------------------------------------------------------------------- the step
  def update_attend(self, q: jax.Array, k: jax.Array, v: jax.Array, *, positions: jax.Array,
                    rope_theta: float, rope_scaling: Any = None, new_lengths: jax.Array,
                    sm_scale: float | None = None, window: int | None = None,
                    soft_cap: float | None = None,
                    implementation: str | Sequence[str] | None = None
                    ) -> tuple[jax.Array, "KIVICache"]:
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
                              implementation=None) -> tuple[jax.Array, "KIVICache"]:
    """`(out [B, T, N, H], new_cache)`: the queries attend this cache (from before the
    write) plus the chunk's own tokens in full precision, then the chunk is written."""
    _check_implementation(implementation)
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
                         "KIVI cache with pre_rope=True (its keys are rotated at their token "
                         "indices)")
    chunk_tokens = jnp.where(jnp.arange(num_tokens)[None, :] < new_lengths[:, None], q_tokens, -1)
    chunk = (jnp.swapaxes(k_rot, 1, 2), jnp.swapaxes(v, 1, 2), chunk_tokens)
    out = self._attend(q_rot, q_tokens, extra=[chunk], sm_scale=sm_scale, window=window,
                       soft_cap=soft_cap).astype(q.dtype)
    # The written chunk depends on the output (an exact + 0), so the write is ordered after
    # every read of the old buffers (as `KVCache.update_attend_unchecked`).
    tie = jnp.nan_to_num(out[0, 0, 0, 0].astype(jnp.float32) * 0.0)
    stored_k = k if self.pre_rope else k_rot
    return out, self._write(stored_k + tie.astype(stored_k.dtype), v + tie.astype(v.dtype),
                            new_lengths, lengths)


def _check_implementation(implementation) -> None:
  if implementation not in (None, "xla") and tuple(np.atleast_1d(implementation)) != ("xla",):
    raise NotImplementedError(
        f"a KIVI cache is read by one XLA loop (kvattn.ops.lowbit); implementation must be None "
        f"or 'xla', got {implementation!r}")


def build(bits: int):
  """The registry builder of kind `kivi{bits}`: one `KIVICache` per GQA layer."""

  def _build(model, batch, max_len, dtype, options, tokens_per_seq):
    del tokens_per_seq
    from kvattn.caches import registry  # pylint: disable=g-import-not-at-top  (imports this)
    return tuple(KIVICache.init(
        batch, max_len, a.num_kv_heads, a.head_dim, dtype, bits=bits,
        group_size=options["group_size"], residual=options["residual"],
        pre_rope=options["pre_rope"], scale_dtype=options["scale_dtype"],
        rope_theta=a.rope_theta, rope_scaling=a.rope_scaling)
                 for a in registry.gqa_layers(model))

  return _build


OPTIONS = {"group_size": 32, "residual": 128, "pre_rope": False, "scale_dtype": "float16"}
"""The registry options of `kivi2` / `kivi4` and their defaults (KIVI's G = 32, R = 128)."""
