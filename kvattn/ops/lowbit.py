"""Sub-byte KV storage: asymmetric group quantization, code packing, blocked attention.

The ops behind `kvattn.caches.kivi` (KIVI, Liu et al. 2024, arXiv 2402.02750):
`quantize_groups` (one scale and zero point per slice, KIVI eq. 1), `pack_codes` /
`unpack_codes` (`8 // bits` codes per byte, low bits first; 3-bit codes 8 per 3 bytes),
and `blocked_attention`: queries against a store dequantized block by block inside the
loop, then full-precision segments, in one online softmax (FlashAttention-2). Masked
logits are replaced and unused value rows zeroed, so garbage never leaks.
"""

from __future__ import annotations

from typing import Callable, Sequence

import jax
from jax import lax
import jax.numpy as jnp

from kvattn.ops import xla

BITS = (2, 3, 4)
"""Code widths packed into uint8: 4 or 2 codes per byte, or 8 3-bit codes per 3 bytes."""


def check_bits(bits) -> int:
  """`bits` as an int of `BITS`; ValueError otherwise."""
  if isinstance(bits, bool) or bits not in BITS:
    raise ValueError(f"bits must be one of {BITS}; got {bits!r}")
  return int(bits)


def packed_width(width: int, bits: int) -> int:
  """Bytes holding `width` codes of `bits` bits: `width * bits / 8` (`width` must be a
  multiple of 8 // bits, or of 8 for 3-bit codes)."""
  if check_bits(bits) == 3:
    if width % 8:
      raise ValueError(f"width must be a multiple of 8 to pack 3-bit codes; got {width}")
    return width * 3 // 8
  per_byte = 8 // bits
  if width % per_byte:
    raise ValueError(f"width must be a multiple of 8 // bits = {per_byte} to pack {bits}-bit "
                     f"codes; got {width}")
  return width // per_byte


def pack_codes(codes: jax.Array, bits: int) -> jax.Array:
  """`u8[..., W * bits / 8]`: codes `[..., W]` (ints in `[0, 2^bits)`) packed along the last
  axis, `8 // bits` per byte, code `i` of a byte at bits `[i * bits, (i + 1) * bits)`; 3-bit
  codes 8 per 3 bytes (a little-endian 24-bit word, code `i` at bits `[3 i, 3 i + 3)`)."""
  width = packed_width(codes.shape[-1], bits)
  if bits == 3:
    c = codes.astype(jnp.uint32).reshape(codes.shape[:-1] + (codes.shape[-1] // 8, 8))
    word = jnp.sum(c << (jnp.arange(8, dtype=jnp.uint32) * 3), axis=-1, dtype=jnp.uint32)
    out = (word[..., None] >> (jnp.arange(3, dtype=jnp.uint32) * 8)) & 0xFF
    return out.astype(jnp.uint8).reshape(codes.shape[:-1] + (width,))
  per_byte = 8 // bits
  c = codes.astype(jnp.uint8).reshape(codes.shape[:-1] + (width, per_byte))
  shifts = (jnp.arange(per_byte, dtype=jnp.uint8) * bits).astype(jnp.uint8)
  # The codes occupy disjoint bits, so the sum is the bitwise or.
  return jnp.sum(c << shifts, axis=-1, dtype=jnp.uint8)


def unpack_codes(packed: jax.Array, bits: int) -> jax.Array:
  """`u8[..., W]`: the codes `pack_codes` packed into `u8[..., W * bits / 8]`."""
  if bits == 3:
    b = packed.astype(jnp.uint32).reshape(packed.shape[:-1] + (packed.shape[-1] // 3, 3))
    word = jnp.sum(b << (jnp.arange(3, dtype=jnp.uint32) * 8), axis=-1, dtype=jnp.uint32)
    c = (word[..., None] >> (jnp.arange(8, dtype=jnp.uint32) * 3)) & 7
    return c.astype(jnp.uint8).reshape(packed.shape[:-1] + (packed.shape[-1] // 3 * 8,))
  per_byte = 8 // bits
  shifts = (jnp.arange(per_byte, dtype=jnp.uint8) * bits).astype(jnp.uint8)
  mask = jnp.uint8((1 << bits) - 1)
  c = (packed[..., None] >> shifts) & mask
  return c.reshape(packed.shape[:-1] + (packed.shape[-1] * per_byte,))


def quantize_groups(x: jax.Array, bits: int, axis: int,
                    scale_dtype=jnp.float16) -> tuple[jax.Array, jax.Array, jax.Array]:
  """`(codes u8, scale, zero)`: `x ~= codes * scale + zero` with one `(scale, zero)` per
  slice along `axis` (`zero = min`, `scale = (max - min) / (2^bits - 1)`, rounded to
  `scale_dtype` before the codes are computed). A constant slice gets scale 0; a slice
  with NaN / inf gets NaN scale and zero.
  """
  top = (1 << check_bits(bits)) - 1
  xf = x.astype(jnp.float32)
  lo, hi = jnp.min(xf, axis=axis), jnp.max(xf, axis=axis)
  zero = lo.astype(scale_dtype)
  # The top code must reach `hi` from the rounded zero point.
  scale = ((hi - zero.astype(jnp.float32)) / top).astype(scale_dtype)
  zf, sf = (jnp.expand_dims(a.astype(jnp.float32), axis) for a in (zero, scale))
  codes = jnp.where(sf > 0, jnp.round((xf - zf) / jnp.where(sf > 0, sf, 1.0)), 0.0)
  codes = jnp.clip(jnp.nan_to_num(codes), 0, top).astype(jnp.uint8)
  finite = jnp.all(jnp.isfinite(xf), axis=axis)
  nan = jnp.asarray(jnp.nan, scale_dtype)
  return codes, jnp.where(finite, scale, nan), jnp.where(finite, zero, nan)


def dequantize_groups(codes: jax.Array, scale: jax.Array, zero: jax.Array,
                      axis: int) -> jax.Array:
  """f32 `codes * scale + zero`, the scale and zero point broadcast along `axis`."""
  s, z = (jnp.expand_dims(a.astype(jnp.float32), axis) for a in (scale, zero))
  return codes.astype(jnp.float32) * s + z


Segment = tuple[jax.Array, jax.Array, jax.Array]
"""`(k f32[B, K, S', H], v f32[B, K, S', Hv], key_tokens i32[B, S'])`: full-precision keys
and values and the token index each slot holds (-1: none)."""

ReadBlock = Callable[[jax.Array, int], tuple[jax.Array, jax.Array]]
"""`(offset i32, block_size) -> (k f32[B, K, bk, H], v f32[B, K, bk, Hv])`: slots
`[offset, offset + bk)` of the quantized store, dequantized (RoPE'd keys)."""


def _visible(key_tokens, q_tokens, window):
  """`bool[B, T, S']`: key token visible from query token (causal, window)."""
  k, q = key_tokens[:, None, :], q_tokens[:, :, None]
  ok = (k >= 0) & (k <= q)
  if window is not None:
    ok &= k > q - window
  return ok


def blocked_attention(
    q: jax.Array,  # [B, T, N, H] (RoPE'd)
    q_tokens: jax.Array,  # i32[B, T] token index of each query
    *,
    num_quantized: jax.Array,  # i32[B] tokens [0, nq_b) are in the quantized store
    store_capacity: int,  # slots of the quantized store (a multiple of block alignment)
    read_block: ReadBlock | None,
    block_size: int,
    segments: Sequence[Segment] = (),
    sm_scale: float | None = None,
    window: int | None = None,
    soft_cap: float | None = None,
    initial: tuple[jax.Array, jax.Array, jax.Array] | None = None,
) -> jax.Array:
  """f32 `[B, T, N, Hv]`: queries `q: [B, T, N, H]` at tokens `q_tokens: i32[B, T]`
  against the store (`num_quantized: i32[B]` tokens, read by `read_block` in blocks of
  `block_size` slots) and then `segments`; causal, with `window` and `soft_cap`.

  `initial`: the online-softmax state `(m, l, acc)` of keys attended elsewhere
  (`state_from_lse`), or None. A query with nothing to attend gives zeros.
  """
  batch, num_tokens, num_heads, head_dim = q.shape
  num_kv = segments[0][0].shape[1] if segments else None
  scale = head_dim ** -0.5 if sm_scale is None else sm_scale
  if read_block is not None and store_capacity > 0:
    probe_k, probe_v = jax.eval_shape(lambda o: read_block(o, block_size), jnp.int32(0))
    num_kv, hv = probe_k.shape[1], probe_v.shape[-1]
  else:
    hv = segments[0][1].shape[-1]
  groups = num_heads // num_kv
  qg = jnp.moveaxis(q.astype(jnp.float32).reshape(batch, num_tokens, num_kv, groups, head_dim),
                    1, 3) * scale  # [B, K, G, T, H]

  def update(carry, k, v, key_tokens, usable):
    """One block: `k [B, K, S', H]`, `key_tokens i32[B, S']`, `usable bool[B, S']`."""
    m, l, acc = carry
    s = jnp.einsum("BKGTH,BKSH->BKGTS", qg, k)
    if soft_cap is not None:
      s = soft_cap * jnp.tanh(s / soft_cap)
    ok = _visible(jnp.where(usable, key_tokens, -1), q_tokens, window)  # [B, T, S']
    s = jnp.where(ok[:, None, None], s, -jnp.inf)
    m_next = jnp.maximum(m, jnp.max(s, axis=-1))
    alpha = jnp.exp(m - m_next)
    p = jnp.exp(s - m_next[..., None])  # exact 0 where masked
    v = jnp.where(usable[:, None, :, None], v, 0.0)  # garbage rows never reach the sum
    pv = jnp.einsum("BKGTS,BKSV->BKGTV", p, v)
    return m_next, alpha * l + jnp.sum(p, axis=-1), alpha[..., None] * acc + pv

  carry = initial if initial is not None else (
      jnp.full((batch, num_kv, groups, num_tokens), xla.M_INIT, jnp.float32),
      jnp.zeros((batch, num_kv, groups, num_tokens), jnp.float32),
      jnp.zeros((batch, num_kv, groups, num_tokens, hv), jnp.float32))
  if read_block is not None and store_capacity > 0:
    bk = block_size
    first = jnp.int32(0)
    if window is not None:  # blocks wholly before every query's window are skipped
      first = jnp.maximum(jnp.min(q_tokens) - window + 1, 0) // bk
    last = (jnp.minimum(jnp.max(num_quantized), store_capacity) + bk - 1) // bk

    def body(i, carry):
      lo = i * bk
      offset = jnp.minimum(lo, store_capacity - bk)
      k, v = read_block(offset, bk)
      tokens = offset + jnp.arange(bk, dtype=jnp.int32)
      usable = (tokens[None] >= lo) & (tokens[None] < num_quantized[:, None])  # [B, bk]
      return update(carry, k, v, jnp.broadcast_to(tokens, usable.shape), usable)

    carry = lax.fori_loop(first, jnp.maximum(last, first), body, carry)
  for k, v, key_tokens in segments:
    carry = update(carry, k.astype(jnp.float32), v.astype(jnp.float32), key_tokens,
                   key_tokens >= 0)
  _, l, acc = carry
  out = acc / jnp.where(l > 0, l, 1.0)[..., None]  # [B, K, G, T, Hv]
  return jnp.moveaxis(out, 3, 1).reshape(batch, num_tokens, num_heads, hv)


def state_from_lse(out: jax.Array, lse: jax.Array,
                   num_kv_heads: int) -> tuple[jax.Array, jax.Array, jax.Array]:
  """The online-softmax state `(m = lse, l = 1, acc = out)` that a kernel's `out f32[B, N,
  Hv]` and `lse f32[B, N]` stand for (empty where lse is -inf).
  """
  batch, num_heads, hv = out.shape
  shape = (batch, num_kv_heads, num_heads // num_kv_heads, 1)
  lse = lse.astype(jnp.float32).reshape(shape)
  seen = jnp.isfinite(lse)
  acc = jnp.where(seen[..., None], out.astype(jnp.float32).reshape(shape + (hv,)), 0.0)
  return jnp.where(seen, lse, xla.M_INIT), seen.astype(jnp.float32), acc


def blocked_attention_reference(
    q: jax.Array,  # [B, T, N, H]
    q_tokens: jax.Array,  # i32[B, T]
    k: jax.Array,  # [B, K, S, H] f32, token s in slot s
    v: jax.Array,  # [B, K, S, Hv]
    lengths: jax.Array,  # i32[B] slots [0, lengths) hold tokens
    *,
    sm_scale: float | None = None,
    window: int | None = None,
    soft_cap: float | None = None,
) -> jax.Array:
  """Plain f32 attention over dense keys and values in token order (the reference of
  `blocked_attention`): one `[T, S]` softmax per row and head. Returns f32 `[B, T, N, Hv]`."""
  batch, num_tokens, num_heads, head_dim = q.shape
  num_kv, capacity = k.shape[1], k.shape[2]
  groups = num_heads // num_kv
  scale = head_dim ** -0.5 if sm_scale is None else sm_scale
  qg = q.astype(jnp.float32).reshape(batch, num_tokens, num_kv, groups, head_dim)
  s = jnp.einsum("BTKGH,BKSH->BKGTS", qg, k.astype(jnp.float32)) * scale
  if soft_cap is not None:
    s = soft_cap * jnp.tanh(s / soft_cap)
  slots = jnp.arange(capacity, dtype=jnp.int32)[None, :]
  tokens = jnp.where(slots < lengths[:, None], slots, -1)
  ok = _visible(tokens, q_tokens, window)[:, None, None]
  s = jnp.where(ok, s, -jnp.inf)
  m = jnp.max(s, axis=-1, keepdims=True)
  p = jnp.where(ok, jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0)), 0.0)
  vz = jnp.where((tokens >= 0)[:, None, :, None], v.astype(jnp.float32), 0.0)
  out = jnp.einsum("BKGTS,BKSV->BKGTV", p, vz)
  denom = jnp.sum(p, axis=-1)[..., None]
  out = out / jnp.where(denom > 0, denom, 1.0)
  return jnp.moveaxis(out, 3, 1).reshape(batch, num_tokens, num_heads, v.shape[-1])
