"""Blocked XLA decode attention: the flash-decoding recurrence as an XLA loop.

The "xla_blocked" backend of `dispatch.decode_attention` / `mla_decode_attention`
(picked by None on CPU for caches of more than `MIN_CAPACITY` slots). An online softmax
(FlashAttention-2, Dao 2023, algorithm 1) over the span some row attends, `[min_b
start_b, max_b length_b)`, read as one block of a few static sizes or a loop over big
blocks, so work follows the live length. Semantics are `decode_attention_xla`'s; a
block's weighted sum is recomputed from zeroed values when not finite, so clean and
dirty caches give bit-identical results. int8 keys are read as stored: the query is
quantized per row and the logits are one s8 x s8 -> s32 dot per block (llama.cpp's q8_0
K.Q product). A last block past S is shifted back to end at S.
"""

from __future__ import annotations

import functools
from typing import Sequence

import jax
from jax import lax
import jax.numpy as jnp

from kvattn.ops import quant
from kvattn.ops import xla

# Block sizes. XLA:CPU pays a fixed cost per loop iteration (tens of microseconds for the ~15
# small ops of the body, more than a short block's work), so a call reads the attended span
# as ONE block whenever that block stays small: `block_sizes` offers single-block sizes
# 64, 96, 128, 192, ... (each at most 1.5x the one before, so a span is read with at most
# 1.5x its slots) up to `_MAX_BLOCK_BYTES` of f32 K/V; longer spans loop over blocks of half
# that size (at most 1.5x their slots again, in >= 3 iterations whose fixed cost the big
# blocks amortise). Measured on the 2-core CPU: docs/benchmarks.md, "Decode cost follows
# the live length".
MIN_BLOCK, MAX_BLOCK = 64, 8192
_MAX_BLOCK_BYTES = 8 << 20
# `implementation=None` reads caches of at most this many slots whole (`xla.py`): their
# plain read costs about the blocked path's fixed cost.
MIN_CAPACITY = 256


def block_sizes(capacity: int, rows: int, width: int) -> tuple[tuple[int, ...], int | None]:
  """`(single, loop)`: ascending one-block sizes (64, 96, 128, ..., each <= 1.5x the
  previous, up to `_MAX_BLOCK_BYTES` of f32 and `MAX_BLOCK` slots; the last is S when S
  fits) and the loop's block (half the largest single size), or None when S fits.
  `rows` is B * K (MLA: B), `width` the elements read per slot.
  """
  cap = min(MAX_BLOCK, max(MIN_BLOCK, _MAX_BLOCK_BYTES // (rows * width * 4)))
  single, size = [], MIN_BLOCK
  while size < capacity and size <= cap:
    single.append(size)
    size = size * 3 // 2 if size & (size - 1) == 0 else size * 4 // 3  # 64 96 128 192 256
  if capacity <= cap:
    return tuple(single) + (capacity,), None
  loop = 1 << (single[-1].bit_length() - 2) if single[-1] > 1 else 1
  return tuple(single), loop


def is_int8(keys: jax.Array, scale: jax.Array | None) -> bool:
  """True for an int8 cache part with its per-slot scales (read through s8 dots)."""
  return scale is not None and jnp.dtype(keys.dtype) == jnp.dtype(jnp.int8)


def tier(span: jax.Array, single: tuple[int, ...]) -> jax.Array:
  """Index of the smallest size in `single` (ascending) holding `span` slots, or
  `len(single)` (the loop) when none does."""
  return sum((span > bk).astype(jnp.int32) for bk in single) + jnp.int32(0)


def blocked_decode(
    q1: jax.Array,        # [B, K, G, H1] f32, already scaled by sm_scale
    q2: jax.Array | None,  # [B, K, G, H2] f32 (scaled) or None
    k1: jax.Array,        # [B, K, S, H1], or [B, S, H1] meaning K = 1
    k2: jax.Array | None,  # like k1 with width H2, or None
    v: jax.Array | None,  # like k1 with width Hv, or None: the value is k1
    lengths: jax.Array,   # i32[B]
    *,
    window: int | None,
    soft_cap: float | None,
    block_k: int | tuple[tuple[int, ...], int | None],
    scales: tuple[jax.Array | None, jax.Array | None, jax.Array | None] = (None, None, None),
    new: tuple[jax.Array, jax.Array] | None = None,
) -> jax.Array:
  """f32 `[B, K, G, Hv]`: attention over slots `[max(0, L - W), L)`, block by block.

  `block_k` is one block size (a loop over the span) or `block_sizes`' `(single, loop)`
  (`lax.switch` on `tier`). `scales = (s1, s2, sv)`: per-slot scales of a quantized k1,
  k2, v, or None. `new = (s_new f32[B, K, G], v_new [B, K, Hv])`: the newest token's
  scaled logits and value, slot `L - 1` then not read from the cache.
  """
  slot_axis = k1.ndim - 2
  batch, capacity = k1.shape[0], k1.shape[slot_axis]
  num_kv = k1.shape[1] if k1.ndim == 4 else 1
  has_new = None if new is None else xla.newest_token(lengths, capacity)
  starts, lengths = xla.attended_range(lengths, capacity, window)
  if has_new is not None:  # the cache's part ends before the newest token
    lengths = lengths - has_new.astype(jnp.int32)
  base = jnp.min(starts)
  span = jnp.maximum(jnp.max(lengths) - base, 0)
  values = k1 if v is None else v
  groups, hv = q1.shape[2], values.shape[-1]
  s1, s2, sv = scales
  if v is None:
    sv = s1

  # int8 keys: the query quantized per row, the logits one s8 x s8 -> s32 dot per block.
  q1_int8 = quant.quantize_kv(q1, jnp.int8) if is_int8(k1, s1) else None
  q2_int8 = quant.quantize_kv(q2, jnp.int8) if k2 is not None and is_int8(k2, s2) else None

  # Narrow floats are sliced as integers (`quant.as_bits`), bitcast once out here: inside the
  # switch's branches XLA:CPU copies the whole cache for the bitcast.
  stored = {name: None if x is None else (quant.as_bits(x), x.dtype)
            for name, x in (("k1", k1), ("k2", k2), ("v", v))}

  def run(block_k: int, loop: bool) -> jax.Array:
    def raw(name, offset):  # [B, K, bk, X] as stored
      bits, dtype = stored[name]
      x = quant.from_bits(lax.dynamic_slice_in_dim(bits, offset, block_k, axis=slot_axis), dtype)
      return x if x.ndim == 4 else x[:, None]

    def block(x, offset):  # [B, K, bk, X] f32
      return raw(x, offset).astype(jnp.float32)

    def scale_block(x, offset):  # [B, K, 1, bk] f32 (broadcasts over G)
      x = lax.dynamic_slice_in_dim(x, offset, block_k, axis=x.ndim - 1).astype(jnp.float32)
      return (x if x.ndim == 3 else x[:, None])[:, :, None, :]

    def logits(q, q_int8, keys, scale, offset):  # [B, K, G, bk]
      if q_int8 is not None:  # int8 keys read as stored
        values, q_scale = q_int8
        s = jnp.einsum("BKGH,BKSH->BKGS", values, raw(keys, offset),
                       preferred_element_type=jnp.int32)
        s = s.astype(jnp.float32) * q_scale[..., None]
      else:
        # Keys as the left operand, then a transpose of the small logits (as in
        # `xla.decode_attention_xla`; faster on XLA:CPU for G > 1).
        s = jnp.swapaxes(jnp.einsum("BKSH,BKGH->BKSG", block(keys, offset), q), -1, -2)
      return s if scale is None else s * scale_block(scale, offset)

    def body(i, carry):
      m, l, acc = carry
      lo = base + i * block_k
      offset = jnp.minimum(lo, capacity - block_k)
      s = logits(q1, q1_int8, "k1", s1, offset)
      if k2 is not None:
        s = s + logits(q2, q2_int8, "k2", s2, offset)
      if soft_cap is not None:
        s = soft_cap * jnp.tanh(s / soft_cap)
      # Slots below `lo` belong to the previous block (a block shifted back to end at S).
      slots = offset + jnp.arange(block_k, dtype=jnp.int32)
      valid = ((slots[None] >= jnp.maximum(starts, lo)[:, None])
               & (slots[None] < lengths[:, None]))  # [B, bk]
      s = jnp.where(valid[:, None, None], s, -jnp.inf)
      m_next = jnp.maximum(m, jnp.max(s, axis=-1))
      alpha = jnp.exp(m - m_next)
      p = jnp.exp(s - m_next[..., None])  # exact 0 where masked
      p_v = p if sv is None else p * jnp.where(valid[:, None, None, :],
                                               scale_block(sv, offset), 0.0)
      vb = block("k1" if v is None else "v", offset)

      def weighted(x):  # the barrier keeps both products compiled alike (bit-identical)
        return jnp.einsum("BKGS,BKSV->BKGV", p_v, lax.optimization_barrier(x))

      pv = weighted(vb)
      # 0 * finite garbage is 0, so only NaN/inf in masked rows changes pv: recompute then.
      pv = lax.cond(jnp.all(jnp.isfinite(pv)), lambda: pv,
                    lambda: weighted(jnp.where(valid[:, None, :, None], vb, 0.0)))
      return m_next, alpha * l + jnp.sum(p, axis=-1), alpha[..., None] * acc + pv

    init = (jnp.full((batch, num_kv, groups), xla.M_INIT, jnp.float32),
            jnp.zeros((batch, num_kv, groups), jnp.float32),
            jnp.zeros((batch, num_kv, groups, hv), jnp.float32))
    if new is not None:  # the newest token alone: max its logit, sum exp(0) = 1, acc its value
      s_new, v_new = new
      row = has_new[:, None, None]
      init = (jnp.where(row, s_new, init[0]), jnp.where(row, 1.0, init[1]),
              jnp.where(row[..., None], v_new.astype(jnp.float32)[:, :, None, :], init[2]))
    if loop:
      _, l, acc = lax.fori_loop(0, (span + block_k - 1) // block_k, body, init)
    else:  # the span fits in one block (an empty span reads one block, all masked)
      _, l, acc = body(0, init)
    return acc / jnp.where(l > 0, l, 1.0)[..., None]

  if isinstance(block_k, int):
    return run(block_k, loop=True)
  single, loop = block_k
  branches = [functools.partial(run, bk, False) for bk in single]
  if loop is not None:
    branches.append(functools.partial(run, loop, True))
  if len(branches) == 1:
    return branches[0]()
  return lax.switch(jnp.minimum(tier(span, single), len(branches) - 1), branches)


def _fits(capacity: int) -> None:
  """NotImplementedError where None should not pick this path: off CPU, or S <=
  `MIN_CAPACITY`.
  """
  if jax.default_backend() != "cpu":
    raise NotImplementedError("xla_blocked: tuned for XLA:CPU only")
  if capacity <= MIN_CAPACITY:
    raise NotImplementedError(
        f"xla_blocked: S={capacity} <= {MIN_CAPACITY} slots (the plain path reads them all "
        "for about the loop's fixed cost)")


def _block_arg(block_k: int | None, capacity: int, rows: int, width: int
               ) -> int | tuple[tuple[int, ...], int | None]:
  """`block_k` checked against S, or the default sizes `block_sizes(S, rows, width)`."""
  if block_k is None:
    return block_sizes(capacity, rows, width)
  if not isinstance(block_k, int) or isinstance(block_k, bool) or not 1 <= block_k <= capacity:
    raise ValueError(f"block_k must be an int in [1, S={capacity}] or None; got {block_k!r}")
  return block_k


def decode_attention_blocked(q, k, v, lengths, *, sm_scale=None, window=None, soft_cap=None,
                             block_k=None, k_scale=None, v_scale=None, k_new=None,
                             v_new=None) -> jax.Array:
  """`decode_attention_xla` block by block; `block_k` in `[1, S]` or None (`block_sizes`).

  Raises:
    ValueError: `block_k` outside `[1, S]`.
  """
  batch, num_kv, capacity, head_dim = k.shape
  block_k = _block_arg(block_k, capacity, batch * num_kv, head_dim + v.shape[-1])
  scale = head_dim ** -0.5 if sm_scale is None else sm_scale
  qg = q.astype(jnp.float32).reshape(batch, num_kv, -1, head_dim) * scale
  new = None
  if k_new is not None:  # qg is already scaled
    new = xla.new_token_logits(qg, k_new, 1.0, soft_cap), v_new
  out = blocked_decode(qg, None, k, None, v, lengths, window=window, soft_cap=soft_cap,
                       block_k=block_k, scales=(k_scale, None, v_scale), new=new)
  return out.reshape(batch, q.shape[1], v.shape[-1]).astype(q.dtype)


def mla_decode_attention_blocked(q_latent, q_rope, c_kv, k_rope, lengths, *, sm_scale,
                                 window=None, block_k=None, c_kv_scale=None,
                                 k_rope_scale=None) -> jax.Array:
  """`mla_decode_attention_xla` block by block (key parts read in place).

  Raises:
    ValueError: `block_k` outside `[1, S]`.
  """
  batch, capacity, latent = c_kv.shape
  block_k = _block_arg(block_k, capacity, batch, latent + k_rope.shape[-1])
  f32 = jnp.float32
  out = blocked_decode((q_latent.astype(f32) * sm_scale)[:, None],
                       (q_rope.astype(f32) * sm_scale)[:, None], c_kv, k_rope, None,
                       lengths, window=window, soft_cap=None,
                       block_k=block_k, scales=(c_kv_scale, k_rope_scale, None))
  return out[:, 0].astype(q_latent.dtype)


def decode(q, k, v, lengths, *, explicit, **options):
  """The "xla_blocked" backend of `dispatch.decode_attention`."""
  if not explicit:
    _fits(k.shape[2])
  return decode_attention_blocked(q, k, v, lengths, **options)


def mla_decode(q_latent, q_rope, c_kv, k_rope, lengths, *, explicit, **options):
  """The "xla_blocked" backend of `dispatch.mla_decode_attention`."""
  if not explicit:
    _fits(c_kv.shape[1])
  return mla_decode_attention_blocked(q_latent, q_rope, c_kv, k_rope, lengths, **options)
