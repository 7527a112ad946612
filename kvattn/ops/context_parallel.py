"""Context-parallel attention: partial attention over one shard of the keys, merged by LSE.

With a cache split on its sequence axis (decode context parallelism, flash-decoding of
Dao et al. 2023), each shard reports its normalised output `o_i` and log-sum-exp
`lse_i`; the result is `sum_i exp(lse_i - m) o_i / sum_i exp(lse_i - m)`, `m = max_i
lse_i` (online softmax, Milakov & Gimelshein 2018). An empty shard reports `lse = -inf`,
`o = 0`. Keys are masked by the token each slot holds (`key_pos`, -1 for none).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp


def visible_keys(
    key_pos: jax.Array,  # i32[B, S]: token held by each slot, -1 for none
    q_pos: jax.Array,  # i32[B, T]: token of each query
    kv_lengths: jax.Array,  # i32[B]
    window: int | None,
) -> jax.Array:
  """`bool[B, T, S]`: slot s holds a token `0 <= p < kv_lengths[b]`, `p <= q_pos[b, t]`
  and `p > q_pos[b, t] - window`.
  """
  p = key_pos[:, None, :]
  q = q_pos[:, :, None]
  ok = (p >= 0) & (p < kv_lengths[:, None, None]) & (p <= q)
  if window is not None:
    ok &= p > q - window
  return ok


def _softmax_stats(s: jax.Array, ok: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
  """`(p, l, lse)` of masked scores `s: f32[..., T, S]` (lse -inf where nothing is visible)."""
  s = jnp.where(ok, s, -jnp.inf)
  m = jnp.max(s, axis=-1)
  m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
  p = jnp.exp(s - m_safe[..., None])  # exp(-inf) = 0 for masked keys, NaN scores included
  l = jnp.sum(p, axis=-1)
  lse = jnp.where(l > 0, m_safe + jnp.log(jnp.where(l > 0, l, 1.0)), -jnp.inf)
  return p, l, lse


def _dequant(x: jax.Array, scale: jax.Array | None) -> jax.Array:
  x = x.astype(jnp.float32)
  return x if scale is None else x * scale[..., None]


def partial_attention(
    q: jax.Array,  # [B, T, N, H]
    k: jax.Array,  # [B, K, S, H]
    v: jax.Array,  # [B, K, S, H]
    key_pos: jax.Array,  # i32[B, S]
    q_pos: jax.Array,  # i32[B, T]
    kv_lengths: jax.Array,  # i32[B]
    *,
    sm_scale: float | None = None,
    window: int | None = None,
    soft_cap: float | None = None,
    k_scale: jax.Array | None = None,  # f32[B, K, S]
    v_scale: jax.Array | None = None,  # f32[B, K, S]
) -> tuple[jax.Array, jax.Array]:
  """`(o f32[B, T, N, H], lse f32[B, T, N])` of GQA queries over one shard's keys."""
  batch, num_tokens, num_heads, head_dim = q.shape
  num_kv_heads = k.shape[1]
  groups = num_heads // num_kv_heads
  sm_scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else sm_scale
  qf = q.astype(jnp.float32).reshape(batch, num_tokens, num_kv_heads, groups, head_dim)
  s = jnp.einsum("BTKGH,BKSH->BKGTS", qf, _dequant(k, k_scale)) * sm_scale
  if soft_cap is not None:
    s = soft_cap * jnp.tanh(s / soft_cap)
  ok = visible_keys(key_pos, q_pos, kv_lengths, window)  # [B, T, S]
  p, l, lse = _softmax_stats(s, ok[:, None, None])
  held = (key_pos >= 0) & (key_pos < kv_lengths[:, None])  # [B, S]
  vf = jnp.where(held[:, None, :, None], _dequant(v, v_scale), 0.0)
  o = jnp.einsum("BKGTS,BKSH->BTKGH", p, vf)
  o = o / jnp.where(l > 0, l, 1.0).transpose(0, 3, 1, 2)[..., None]
  return (o.reshape(batch, num_tokens, num_heads, head_dim),
          lse.transpose(0, 3, 1, 2).reshape(batch, num_tokens, num_heads))


def partial_mla_attention(
    q_latent: jax.Array,  # [B, T, N, C]
    q_rope: jax.Array,  # [B, T, N, R]
    c_kv: jax.Array,  # [B, S, C]
    k_rope: jax.Array,  # [B, S, R]
    key_pos: jax.Array,  # i32[B, S]
    q_pos: jax.Array,  # i32[B, T]
    kv_lengths: jax.Array,  # i32[B]
    *,
    sm_scale: float,
    window: int | None = None,
    c_kv_scale: jax.Array | None = None,  # f32[B, S]
    k_rope_scale: jax.Array | None = None,  # f32[B, S]
) -> tuple[jax.Array, jax.Array]:
  """`(o f32[B, T, N, C], lse f32[B, T, N])` of absorbed MLA over one shard's latents."""
  c = _dequant(c_kv, c_kv_scale)
  s = (jnp.einsum("BTNC,BSC->BNTS", q_latent.astype(jnp.float32), c)
       + jnp.einsum("BTNR,BSR->BNTS", q_rope.astype(jnp.float32),
                    _dequant(k_rope, k_rope_scale))) * sm_scale
  ok = visible_keys(key_pos, q_pos, kv_lengths, window)
  p, l, lse = _softmax_stats(s, ok[:, None])
  held = (key_pos >= 0) & (key_pos < kv_lengths[:, None])
  o = jnp.einsum("BNTS,BSC->BTNC", p, jnp.where(held[..., None], c, 0.0))
  o = o / jnp.where(l > 0, l, 1.0).transpose(0, 2, 1)[..., None]
  return o, lse.transpose(0, 2, 1)


def _weights(lse: jax.Array, m: jax.Array) -> jax.Array:
  """`exp(lse - m)` with `m = -inf` (every shard empty) giving 0, not NaN."""
  return jnp.exp(lse - jnp.where(jnp.isfinite(m), m, 0.0))


def merge_partials(o: jax.Array, lse: jax.Array, axis_name) -> jax.Array:
  """`f32[..., W]`: shard partials `o f32[..., W]`, `lse f32[...]` merged across mesh axis
  `axis_name` (inside `jax.shard_map`); 0 where no shard has a key.
  """
  w = _weights(lse, jax.lax.pmax(lse, axis_name))
  num = jax.lax.psum(w[..., None] * o, axis_name)
  den = jax.lax.psum(w, axis_name)
  return num / jnp.where(den > 0, den, 1.0)[..., None]


def combine_partials(o: jax.Array, lse: jax.Array) -> jax.Array:
  """Pure-jnp reference of `merge_partials`: `o f32[shards, ..., W]`, `lse
  f32[shards, ...]` stacked on a leading shard axis -> `f32[..., W]`."""
  w = _weights(lse, jnp.max(lse, axis=0))
  den = jnp.sum(w, axis=0)
  return jnp.sum(w[..., None] * o, axis=0) / jnp.where(den > 0, den, 1.0)[..., None]
