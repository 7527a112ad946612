"""Blocked (flash-style) XLA attention for long prefills: no `[T, S]` logits.

`blocked_attention` computes `kvattn.ops.attention`'s result walking query blocks of
`block_q` and key blocks of `block_k` with an online softmax (FlashAttention-2, Dao 2023,
algorithm 1), visiting only the key blocks some query may attend. The last key block is
cut at `S - block_k` and its slots already seen masked. With `q_offsets` None (a causal
pass from slot 0) the loops are static and reverse-differentiable; with traced offsets
the trip count is dynamic (forward only).
"""

from __future__ import annotations

import jax
from jax import lax
import jax.numpy as jnp

from kvattn.ops import quant

# Defaults measured on the 2-core CPU with SmolLM2's shapes (docs/benchmarks.md, "bench_real").
BLOCK_Q = 256
BLOCK_K = 512
# ops.attention switches to this path from this many logits per (sequence, query head).
MIN_LOGITS = 1 << 20


def _cap(logits: jax.Array, soft_cap: float | None) -> jax.Array:
  return logits if soft_cap is None else soft_cap * jnp.tanh(logits / soft_cap)


def blocked_attention(q, k, v, *, q_offsets, kv_lengths, sm_scale, window=None, soft_cap=None,
                      k_scale=None, v_scale=None, block_q=None, block_k=None) -> jax.Array:
  """`kvattn.ops.attention`'s result for `q: [B, T, N, H]`, blocked (arguments already
  checked; `q_offsets` None means zeros, static). Returns `[B, T, N, Hv]` in q's dtype.

  Raises:
    ValueError: `block_q` or `block_k` not positive.
  """
  block_q = BLOCK_Q if block_q is None else block_q
  block_k = BLOCK_K if block_k is None else block_k
  if block_q < 1 or block_k < 1:
    raise ValueError(f"block_q and block_k must be positive; got {block_q} and {block_k}")
  batch, num_tokens, num_heads, head_dim = q.shape
  _, num_kv_heads, capacity, _ = k.shape
  groups, value_dim = num_heads // num_kv_heads, v.shape[-1]
  if num_tokens == 0 or capacity == 0:
    return jnp.zeros((batch, num_tokens, num_heads, value_dim), q.dtype)
  bq, bk = min(block_q, num_tokens), min(block_k, capacity)
  num_q_blocks = -(-num_tokens // bq)
  num_k_blocks = -(-capacity // bk)
  padded = num_q_blocks * bq
  qf = q.astype(jnp.float32) * sm_scale
  qf = jnp.pad(qf, ((0, 0), (0, padded - num_tokens), (0, 0), (0, 0)))
  # [B, K, G, Tp, H]: head-major so each block's products are batched over (B, K).
  qg = jnp.moveaxis(qf.reshape(batch, padded, num_kv_heads, groups, head_dim), 1, 3)
  static = q_offsets is None
  offsets = jnp.zeros((batch,), jnp.int32) if static else q_offsets.astype(jnp.int32)
  kv_lengths = kv_lengths.astype(jnp.int32)
  # Narrow floats are sliced as their bits (`quant.as_bits`: XLA:CPU would slice them from an
  # f32 copy of the whole cache), bitcast once out here rather than per block.
  k_bits, v_bits = quant.as_bits(k), quant.as_bits(v)

  def key_block(j, q_blk, pos, carry):
    """One online-softmax step of query block `q_blk` ([B, K, G, bq, H]) over key block j."""
    m, l, acc = carry
    start = jnp.minimum(j * bk, capacity - bk)
    slots = start + jnp.arange(bk, dtype=jnp.int32)  # [bk]
    cut = lambda x: lax.dynamic_slice_in_dim(x, start, bk, axis=2)
    kb, vb = quant.from_bits(cut(k_bits), k.dtype), quant.from_bits(cut(v_bits), v.dtype)
    # Slots of this block no query may read: before the block's nominal start (the overlap
    # of a clamped last block) or at/after the sequence's length.
    valid = (slots[None] >= j * bk) & (slots[None] < kv_lengths[:, None])  # [B, bk]
    mask = valid[:, None, :] & (slots[None, None, :] <= pos[:, :, None])  # [B, bq, bk]
    if window is not None:
      mask &= slots[None, None, :] > pos[:, :, None] - window
    mask = mask[:, None, None]  # [B, 1, 1, bq, bk]
    logits = jnp.einsum("BKGTH,BKSH->BKGTS", q_blk, kb.astype(jnp.float32))
    if k_scale is not None:
      logits = logits * cut(k_scale).astype(jnp.float32)[:, :, None, None, :]
    logits = jnp.where(mask, _cap(logits, soft_cap), -jnp.inf)
    m_new = jnp.maximum(m, jnp.max(logits, axis=-1, keepdims=True))
    m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
    alpha = jnp.exp(m - m_safe)  # m = -inf (nothing seen yet) gives 0
    p = jnp.where(mask, jnp.exp(logits - m_safe), 0.0)
    l = l * alpha + jnp.sum(p, axis=-1, keepdims=True)
    if v_scale is not None:
      p = p * jnp.where(valid[:, None, :], cut(v_scale).astype(jnp.float32), 0.0)[:, :, None,
                                                                                  None, :]
    vb = jnp.where(valid[:, None, :, None], vb.astype(jnp.float32), 0.0)
    acc = acc * alpha + jnp.einsum("BKGTS,BKSV->BKGTV", p, vb)
    return m_new, l, acc

  def query_block(i, lo, hi):
    """`[B, K, G, bq, Hv]` of query block i over key blocks [lo, hi)."""
    q_blk = lax.dynamic_slice_in_dim(qg, i * bq, bq, axis=3)
    pos = offsets[:, None] + i * bq + jnp.arange(bq, dtype=jnp.int32)[None]  # [B, bq]
    shape = (batch, num_kv_heads, groups, bq)
    init = (jnp.full(shape + (1,), -jnp.inf, jnp.float32), jnp.zeros(shape + (1,), jnp.float32),
            jnp.zeros(shape + (value_dim,), jnp.float32))
    _, l, acc = lax.fori_loop(lo, hi, lambda j, c: key_block(j, q_blk, pos, c), init)
    return acc / jnp.where(l > 0, l, 1.0)

  if static:
    blocks = []
    for i in range(num_q_blocks):
      last = min(capacity, (i + 1) * bq)  # slots < last may be attended (causal from 0)
      first = 0 if window is None else max(0, i * bq - window + 1)
      blocks.append(query_block(i, first // bk, -(-last // bk)))
    out = jnp.concatenate(blocks, axis=3)
  else:
    def body(i, out):
      first_pos = jnp.min(offsets) + i * bq
      last_pos = jnp.max(jnp.minimum(offsets + (i + 1) * bq, kv_lengths))  # exclusive
      lo = 0 if window is None else jnp.maximum(first_pos - window + 1, 0) // bk
      hi = jnp.clip(-(-last_pos // bk), 0, num_k_blocks)
      return lax.dynamic_update_slice_in_dim(out, query_block(i, lo, hi), i * bq, axis=3)

    out = lax.fori_loop(0, num_q_blocks, body,
                        jnp.zeros((batch, num_kv_heads, groups, padded, value_dim), jnp.float32))
  out = jnp.moveaxis(out, 3, 1)[:, :num_tokens]  # [B, T, K, G, Hv]
  return out.reshape(batch, num_tokens, num_heads, value_dim).astype(q.dtype)
