"""Pure-jnp reference attention against a (possibly partially filled) cache.

This is the XLA path of kvattn and the reference every kernel is checked
against. It implements scaled dot-product attention (Vaswani et al. 2017,
eq. 1) with grouped KV heads (Ainslie et al. 2023, GQA: query head n reads KV
head n // G), per-sequence lengths, causality inside the new block, an optional
sliding window and an optional logit soft cap (Gemma 2: cap * tanh(s / cap)).

Masking is robust to garbage in unused slots: masked logits are replaced (not
added to), the probabilities of masked keys are zeroed, and values in slots
past a sequence's length are zeroed before the weighted sum, so a NaN or inf
stored there never reaches the output (0 * NaN would). A query with nothing to
attend to returns exact zeros.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kvattn import _checks


def validate_args(q, k, v, num_q_axes: int, window, soft_cap, sm_scale):
  q_doc = "[B, T, N, H]" if num_q_axes == 2 else "[B, N, H]"
  _checks.rank("q", q, 2 + num_q_axes, q_doc)
  _checks.rank("k", k, 4, "[B, K, S, H]")
  _checks.rank("v", v, 4, "[B, K, S, Hv]")
  for name, x in (("q", q), ("k", k), ("v", v)):
    _checks.floating(name, x)
  _checks.same_dtype(("k", "v"), (k, v))
  batch, num_kv_heads, capacity, head_dim = k.shape
  num_heads = q.shape[-2]
  _checks.dim("q", q, 0, batch, "batch B, from k")
  _checks.dim("q", q, q.ndim - 1, head_dim, "head dim H, from k")
  _checks.dim("v", v, 0, batch, "batch B, from k")
  _checks.dim("v", v, 1, num_kv_heads, "KV heads K, from k")
  _checks.dim("v", v, 2, capacity, "slots S, from k")
  _checks.head_layout(num_heads, num_kv_heads)
  _checks.optional_positive_int("window", window)
  _checks.optional_positive_float("soft_cap", soft_cap)
  _checks.optional_positive_float("sm_scale", sm_scale)


def check_lengths(name: str, x, batch: int, default: int) -> jax.Array:
  if x is None:
    return jnp.full((batch,), default, jnp.int32)
  x = jnp.asarray(x)
  _checks.integer(name, x)
  if x.shape != (batch,):
    raise ValueError(f"{name} must have shape [B] = ({batch},); got {tuple(x.shape)}")
  return x.astype(jnp.int32)


def attention(
    q: jax.Array,  # [B, T, N, H]
    k: jax.Array,  # [B, K, S, H]
    v: jax.Array,  # [B, K, S, Hv]
    *,
    q_offsets: jax.Array | None = None,  # i32[B]
    kv_lengths: jax.Array | None = None,  # i32[B]
    sm_scale: float | None = None,
    window: int | None = None,
    soft_cap: float | None = None,
) -> jax.Array:
  """Attention of T new query tokens per sequence against S cache slots.

  Query token t of sequence b sits at slot `p = q_offsets[b] + t` and attends
  slot s iff `s <= p`, `s < kv_lengths[b]` and, with a window W, `s > p - W`
  (exactly the W most recent keys including itself).

  Args:
    q: `[B, T, N, H]` queries (any float dtype).
    k: `[B, K, S, H]` keys, head-major; N must be a multiple of K.
    v: `[B, K, S, Hv]` values, same dtype as `k`; Hv may differ from H.
    q_offsets: `i32[B]` slot of query token 0 (default 0: a causal forward
      pass over T == S tokens).
    kv_lengths: `i32[B]` number of valid slots (default S). Slots at or past
      it may hold anything, NaN included.
    sm_scale: logit scale (default 1/sqrt(H)).
    window: sliding-window size W in tokens, or None for full attention.
    soft_cap: if set, logits become `soft_cap * tanh(logits / soft_cap)`.

  Returns:
    `[B, T, N, Hv]` in q's dtype; computed with f32 logits, softmax and
    accumulation. Rows with no attendable key are exact zeros.

  Raises:
    ValueError/TypeError: on ranks, shapes, dtypes or options that do not fit.
  """
  validate_args(q, k, v, 2, window, soft_cap, sm_scale)
  batch, num_kv_heads, capacity, head_dim = k.shape
  _, num_tokens, num_heads, _ = q.shape
  groups = num_heads // num_kv_heads
  q_offsets = check_lengths("q_offsets", q_offsets, batch, 0)
  kv_lengths = check_lengths("kv_lengths", kv_lengths, batch, capacity)
  if sm_scale is None:
    sm_scale = head_dim ** -0.5

  qg = q.reshape(batch, num_tokens, num_kv_heads, groups, head_dim)
  logits = jnp.einsum("BTKGH,BKSH->BKGTS", qg, k,
                      preferred_element_type=jnp.float32) * sm_scale
  if soft_cap is not None:
    logits = soft_cap * jnp.tanh(logits / soft_cap)

  slots = jnp.arange(capacity, dtype=jnp.int32)  # [S]
  q_slots = q_offsets[:, None] + jnp.arange(num_tokens, dtype=jnp.int32)  # [B, T]
  valid = slots[None, :] < kv_lengths[:, None]  # [B, S]
  mask = valid[:, None, :] & (slots[None, None, :] <= q_slots[:, :, None])  # [B, T, S]
  if window is not None:
    mask &= slots[None, None, :] > q_slots[:, :, None] - window
  mask = mask[:, None, None]  # [B, 1, 1, T, S]

  logits = jnp.where(mask, logits, -jnp.inf)
  row_max = jnp.max(logits, axis=-1, keepdims=True)
  row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
  probs = jnp.where(mask, jnp.exp(logits - row_max), 0.0)
  denom = jnp.sum(probs, axis=-1, keepdims=True)  # [B, K, G, T, 1]
  # Zero values in invalid slots so 0 * NaN never happens in the weighted sum.
  v = jnp.where(valid[:, None, :, None], v, jnp.zeros((), v.dtype))
  out = jnp.einsum("BKGTS,BKSV->BTKGV", probs, v, preferred_element_type=jnp.float32)
  denom = jnp.moveaxis(denom, 3, 1)  # [B, T, K, G, 1]
  out = out / jnp.where(denom > 0, denom, 1.0)
  return out.reshape(batch, num_tokens, num_heads, v.shape[-1]).astype(q.dtype)


def decode_attention_xla(
    q: jax.Array,  # [B, N, H]
    k: jax.Array,  # [B, K, S, H]
    v: jax.Array,  # [B, K, S, Hv]
    lengths: jax.Array,  # i32[B]
    *,
    sm_scale: float | None = None,
    window: int | None = None,
    soft_cap: float | None = None,
) -> jax.Array:
  """One new token per sequence: the query sits at slot `lengths[b] - 1`.

  The XLA implementation behind `kvattn.ops.decode_attention`; sequence b
  attends slots `[max(0, lengths[b] - window), lengths[b])`. Length-0 rows
  return zeros. Returns `[B, N, Hv]` in q's dtype.
  """
  _checks.rank("q", q, 3, "[B, N, H]")
  _checks.rank("k", k, 4, "[B, K, S, H]")
  lengths = check_lengths("lengths", lengths, k.shape[0], k.shape[2])
  out = attention(q[:, None], k, v, q_offsets=lengths - 1, kv_lengths=lengths,
                  sm_scale=sm_scale, window=window, soft_cap=soft_cap)
  return out[:, 0]
