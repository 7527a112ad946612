"""The XLA paths of kvattn's attention ops, in plain jnp.

Scaled dot-product attention (Vaswani et al. 2017, eq. 1) with grouped KV
heads (Ainslie et al. 2023, GQA: query head n reads KV head n // G),
per-sequence lengths, causality inside the new block, an optional sliding
window and an optional logit soft cap (Gemma 2: cap * tanh(s / cap)):
`attention` / `mla_attention` for T new tokens (prefill, training), and the
`"xla"` backends of the decode dispatch points, `decode_attention_xla` and
`mla_decode_attention_xla`, for one new token per sequence.

Masking is robust to garbage in unused slots: masked logits are replaced (not
added to), the probabilities of masked keys are zeroed, and only attended
slots' values can reach the weighted sum (`weighted_values`), so a NaN or inf
stored elsewhere never reaches the output (0 * NaN would). A query with
nothing to attend to returns exact zeros.

Quantized caches (int8 / fp8 values with f32 per-slot scales, `kvattn.ops.quant`)
are read without a scaled copy: with `k[s] = k_q[s] * k_scale[s]` and
`v[s] = v_q[s] * v_scale[s]`,

  logit[s] = (q . k_q[s]) * k_scale[s] * sm_scale
  out      = sum_s (p[s] * v_scale[s]) v_q[s] / sum_s p[s],

so the scales multiply `[.., S]` logits and probabilities, never the
`[.., S, H]` cache (scales of unattended slots are zeroed first, so garbage
there cannot leak either).

The plain f32 references every path is tested against are the kernels'
`*_reference` functions (`pallas_kernels`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kvattn.ops import prefill
from kvattn import _checks
from pallas_kernels.attention_common import M_INIT, attended_range, decode_mask  # noqa: F401


def attention_mask(q_offsets: jax.Array, kv_lengths: jax.Array, num_tokens: int, capacity: int,
                   window: int | None) -> tuple[jax.Array, jax.Array]:
  """`(bool[B, T, S] attend mask, bool[B, S] valid-slot mask)` for T new tokens per sequence.

  Query t of sequence b sits at slot `p = q_offsets[b] + t` and attends slot s
  iff `s <= p`, `s < kv_lengths[b]` and (with a window W) `s > p - W`. After an
  overflow (`kv_lengths > S`) lengths are clamped to S and query slots to
  S - 1, as in `attended_range`. With T = 1 and `q_offsets = lengths - 1` the
  mask is `decode_mask`.
  """
  slots = jnp.arange(capacity, dtype=jnp.int32)  # [S]
  q_slots = q_offsets[:, None] + jnp.arange(num_tokens, dtype=jnp.int32)  # [B, T]
  q_slots = jnp.minimum(q_slots, capacity - 1)
  valid = slots[None, :] < jnp.minimum(kv_lengths, capacity)[:, None]  # [B, S]
  mask = valid[:, None, :] & (slots[None, None, :] <= q_slots[:, :, None])  # [B, T, S]
  if window is not None:
    mask &= slots[None, None, :] > q_slots[:, :, None] - window
  return mask, valid


def masked_softmax(logits: jax.Array, mask: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Unnormalised probabilities and their row sums for f32 `logits`.

  Masked entries are replaced by -inf, the row max of a fully masked row is
  taken as 0, and masked probabilities are set to exactly 0 (never exp of
  garbage). Returns `(probs, denom)`; divide by `where(denom > 0, denom, 1)`.
  """
  logits = jnp.where(mask, logits, -jnp.inf)
  row_max = jnp.max(logits, axis=-1, keepdims=True)
  row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
  probs = jnp.where(mask, jnp.exp(logits - row_max), 0.0)
  return probs, jnp.sum(probs, axis=-1, keepdims=True)


def zero_invalid(x: jax.Array, valid: jax.Array, slot_axis: int) -> jax.Array:
  """Zeroes slots where `valid` (`bool[B, S]`) is False, so 0 * NaN cannot occur."""
  shape = [1] * x.ndim
  shape[0], shape[slot_axis] = valid.shape
  return jnp.where(valid.reshape(shape), x, jnp.zeros((), x.dtype))


def scale_logits(logits: jax.Array, scale: jax.Array | None) -> jax.Array:
  """`logits * scale` broadcast over the query axes; `scale` is `f32[B, (K,) S]`.

  `logits` is `[B, (K,) ..., S]`; `scale`'s axes are the leading batch (and
  KV-head) axes and the trailing slot axis. None returns `logits` unchanged.
  """
  if scale is None:
    return logits
  middle = logits.ndim - scale.ndim
  shape = scale.shape[:-1] + (1,) * middle + scale.shape[-1:]
  return logits * scale.astype(jnp.float32).reshape(shape)


def scale_probs(probs: jax.Array, scale: jax.Array | None, valid: jax.Array) -> jax.Array:
  """`probs * scale` with the scales of invalid slots (`bool[B, S]`) zeroed first,
  so `probs` stays exactly 0 there whatever the scale array holds."""
  if scale is None:
    return probs
  shape = [1] * scale.ndim
  shape[0], shape[-1] = valid.shape
  scale = jnp.where(valid.reshape(shape), scale.astype(jnp.float32), 0.0)
  return scale_logits(probs, scale)


def weighted_values(spec: str, probs: jax.Array, values: jax.Array, valid: jax.Array,
                    slot_axis: int) -> jax.Array:
  """`einsum(spec, probs, values)` in f32, as if invalid slots of `values` were zero.

  `probs` must be exactly 0 wherever `valid` (`bool[B, S]`) is False (as
  `masked_softmax` makes them). A finite garbage value v then contributes
  `0 * v = 0` exactly, so only NaN/inf in invalid slots could change the
  result -- and they would make it non-finite. The plain einsum therefore runs
  first, on the cache in place; only when its result is not finite is it
  recomputed from zeroed values (`lax.cond`). The result equals
  `einsum(spec, probs, zero_invalid(values, valid, slot_axis))` bit for bit.
  """
  # Barriers on both operands keep XLA from rewriting either dot (fusing the zeroing into it,
  # or reassociating it with the einsum that produced `values`), so both dots compile alike
  # and clean and dirty caches give bit-identical results.
  out = jnp.einsum(spec, probs, jax.lax.optimization_barrier(values),
                   preferred_element_type=jnp.float32)

  def recompute():
    zeroed = jax.lax.optimization_barrier(zero_invalid(values, valid, slot_axis))
    return jnp.einsum(spec, probs, zeroed, preferred_element_type=jnp.float32)

  return jax.lax.cond(jnp.all(jnp.isfinite(out)), lambda: out, recompute)


def attend(logits: jax.Array, mask: jax.Array, spec: str, values: jax.Array,
           value_scale: jax.Array | None, valid: jax.Array, slot_axis: int) -> jax.Array:
  """The ending every XLA path shares: masked softmax of f32 `logits`, then the
  probability-weighted sum `einsum(spec, probs, values)`, normalised, in f32.

  `mask` broadcasts against `logits` (True where a query attends a slot);
  `valid` (`bool[B, S]`) is True at every slot some query of the row attends,
  the only slots whose values and value scales may reach the output
  (`scale_probs`, `weighted_values`). Rows with nothing attended give zeros.
  """
  probs, denom = masked_softmax(logits, mask)
  out = weighted_values(spec, scale_probs(probs, value_scale, valid), values, valid, slot_axis)
  return out / jnp.where(denom > 0, denom, 1.0)


def _soft_cap(logits: jax.Array, soft_cap: float | None) -> jax.Array:
  return logits if soft_cap is None else soft_cap * jnp.tanh(logits / soft_cap)


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
    k_scale: jax.Array | None = None,  # f32[B, K, S]
    v_scale: jax.Array | None = None,  # f32[B, K, S]
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
    k_scale, v_scale: `f32[B, K, S]` per-slot scales when k/v are int8/fp8
      (a quantized `KVCache`); applied to logits and probabilities (module
      doc), the cache is not dequantized.

  Returns:
    `[B, T, N, Hv]` in q's dtype; computed with f32 logits, softmax and
    accumulation. Rows with no attendable key are exact zeros.

  Raises:
    ValueError/TypeError: on ranks, shapes, dtypes or options that do not fit.
  """
  _checks.check_dense_args(q, k, v, 2, window, soft_cap, sm_scale, k_scale, v_scale)
  batch, num_kv_heads, capacity, head_dim = k.shape
  _, num_tokens, num_heads, _ = q.shape
  groups = num_heads // num_kv_heads
  causal_from_zero = q_offsets is None
  q_offsets = _checks.lengths_arg("q_offsets", q_offsets, batch, 0)
  kv_lengths = _checks.lengths_arg("kv_lengths", kv_lengths, batch, capacity)
  if sm_scale is None:
    sm_scale = head_dim ** -0.5
  if num_tokens > 1 and num_tokens * capacity >= prefill.MIN_LOGITS:  # a long prefill
    return prefill.blocked_attention(
        q, k, v, q_offsets=None if causal_from_zero else q_offsets, kv_lengths=kv_lengths,
        sm_scale=sm_scale, window=window, soft_cap=soft_cap, k_scale=k_scale, v_scale=v_scale)
  # Head-major query (a small transpose), so logits, probabilities and output are
  # [B, K, G, T, .] products of the cache in place (docs/benchmarks.md, design notes).
  qg = jnp.moveaxis(q.reshape(batch, num_tokens, num_kv_heads, groups, head_dim), 1, 3)
  logits = jnp.einsum("BKGTH,BKSH->BKGTS", qg, k, preferred_element_type=jnp.float32) * sm_scale
  logits = _soft_cap(scale_logits(logits, k_scale), soft_cap)
  mask, valid = attention_mask(q_offsets, kv_lengths, num_tokens, capacity, window)
  out = attend(logits, mask[:, None, None], "BKGTS,BKSV->BKGTV", v, v_scale, valid, slot_axis=2)
  out = jnp.moveaxis(out, 3, 1)  # [B, T, K, G, V]
  return out.reshape(batch, num_tokens, num_heads, v.shape[-1]).astype(q.dtype)


def newest_token(lengths: jax.Array, capacity: int) -> jax.Array:
  """`bool[B]`: rows whose query token sits in a cache slot (`1 <= lengths[b] <= S`), the
  slot `lengths[b] - 1` that `k_new` / `v_new` stand for in the decode backends. An
  overflowed row (`lengths[b] > S`) had its token dropped and attends the cache alone."""
  return (lengths >= 1) & (lengths <= capacity)


def new_token_logits(qg: jax.Array, k_new: jax.Array, sm_scale: float,
                     soft_cap: float | None) -> jax.Array:
  """f32 `[B, K, G]` logits of the grouped queries `qg: [B, K, G, H]` against the newest
  token's keys `k_new: [B, K, H]`, scaled and soft-capped like the cache's logits."""
  logits = jnp.einsum("BKGH,BKH->BKG", qg.astype(jnp.float32), k_new.astype(jnp.float32))
  return _soft_cap(logits * sm_scale, soft_cap)


def decode_attention_xla(
    q: jax.Array,  # [B, N, H]
    k: jax.Array,  # [B, K, S, H]
    v: jax.Array,  # [B, K, S, Hv]
    lengths: jax.Array,  # i32[B]
    *,
    sm_scale: float | None = None,
    window: int | None = None,
    soft_cap: float | None = None,
    k_scale: jax.Array | None = None,  # f32[B, K, S]
    v_scale: jax.Array | None = None,  # f32[B, K, S]
    k_new: jax.Array | None = None,  # [B, K, H]
    v_new: jax.Array | None = None,  # [B, K, Hv]
) -> jax.Array:
  """The `"xla"` backend of `kvattn.ops.decode_attention` (same arguments, unchecked).

  One new token per sequence: the query sits at slot `lengths[b] - 1` and
  attends slots `[max(0, lengths[b] - window), lengths[b])`; `attention` with
  T = 1 and `q_offsets = lengths - 1`, written without the T axis so both
  einsums are plain batched products of the cache in place. Length-0 rows
  return zeros. Returns `[B, N, Hv]` in q's dtype.

  With `k_new, v_new` (the newest token's key and value, dequantized) slot
  `lengths[b] - 1` is not read from the cache (`newest_token`): the token is one
  more logit column of the same softmax and its value is added to the
  probability-weighted sum. The cache may then be the one from before the
  token's write, so nothing reads the buffer the write updates in place.

  The arguments are not checked here: call `kvattn.ops.decode_attention(...,
  implementation="xla")` for the checked entry point.
  """
  batch, num_kv_heads, capacity, head_dim = k.shape
  num_heads = q.shape[1]
  groups = num_heads // num_kv_heads
  if sm_scale is None:
    sm_scale = head_dim ** -0.5
  qg = q.reshape(batch, num_kv_heads, groups, head_dim)
  # Keys as the left operand, then a transpose of the small logits (faster on XLA:CPU for
  # G > 1; docs/benchmarks.md, design notes); the barrier keeps XLA from folding it back.
  logits_t = jnp.einsum("BKSH,BKGH->BKSG", k, qg, preferred_element_type=jnp.float32)
  logits = jnp.swapaxes(jax.lax.optimization_barrier(logits_t), -1, -2) * sm_scale
  logits = _soft_cap(scale_logits(logits, k_scale), soft_cap)
  mask = decode_mask(lengths, capacity, window)  # [B, S]
  if k_new is None:
    out = attend(logits, mask[:, None, None], "BKGS,BKSV->BKGV", v, v_scale, mask, slot_axis=2)
    return out.reshape(batch, num_heads, v.shape[-1]).astype(q.dtype)
  has_new = newest_token(lengths, capacity)  # [B]
  slots = jnp.arange(capacity, dtype=jnp.int32)[None, :]
  mask &= ~(has_new[:, None] & (slots == lengths[:, None] - 1))  # the cache's part
  logits = jnp.concatenate(
      [logits, new_token_logits(qg, k_new, sm_scale, soft_cap)[..., None]], axis=-1)
  full_mask = jnp.concatenate([mask, has_new[:, None]], axis=-1)[:, None, None]
  probs, denom = masked_softmax(logits, full_mask)  # [B, K, G, S + 1]
  out = weighted_values("BKGS,BKSV->BKGV", scale_probs(probs[..., :-1], v_scale, mask), v,
                        mask, slot_axis=2)
  out = out + probs[..., -1:] * v_new.astype(jnp.float32)[:, :, None, :]
  out = out / jnp.where(denom > 0, denom, 1.0)
  return out.reshape(batch, num_heads, v.shape[-1]).astype(q.dtype)


def _mla_logits(spec_c: str, spec_r: str, q_latent, q_rope, c_kv, k_rope, c_kv_scale,
                k_rope_scale, sm_scale) -> jax.Array:
  """f32 `(q_latent . c_kv * c_kv_scale + q_rope . k_rope * k_rope_scale) * sm_scale`."""
  return (scale_logits(jnp.einsum(spec_c, q_latent, c_kv, preferred_element_type=jnp.float32),
                       c_kv_scale)
          + scale_logits(jnp.einsum(spec_r, q_rope, k_rope, preferred_element_type=jnp.float32),
                         k_rope_scale)) * sm_scale


def mla_attention(
    q_latent: jax.Array,  # [B, T, N, C]
    q_rope: jax.Array,  # [B, T, N, R]
    c_kv: jax.Array,  # [B, S, C]
    k_rope: jax.Array,  # [B, S, R]
    *,
    sm_scale: float,
    q_offsets: jax.Array | None = None,  # i32[B]
    kv_lengths: jax.Array | None = None,  # i32[B]
    window: int | None = None,
    c_kv_scale: jax.Array | None = None,  # f32[B, S]
    k_rope_scale: jax.Array | None = None,  # f32[B, S]
) -> jax.Array:
  """Absorbed MLA attention against a latent cache (DeepSeek-V2, appendix C).

  With W_UK folded into the query (`q_latent = q_nope @ W_UK^T`) every head
  attends the shared latent directly: logits `(q_latent . c_kv[s] + q_rope .
  k_rope[s]) * sm_scale`, output the probability-weighted latent (W_UV is
  applied by the caller). This is single-KV-head attention with key width
  C + R and value width C, computed without concatenating the cache.

  Args:
    q_latent: `[B, T, N, C]` absorbed no-RoPE query.
    q_rope: `[B, T, N, R]` RoPE part of the query (RoPE applied).
    c_kv: `[B, S, C]` latent cache; `k_rope: [B, S, R]` shared RoPE keys.
    sm_scale: required; DeepSeek-V2 uses `1/sqrt(qk_nope_head_dim +
      qk_rope_head_dim)`, never `1/sqrt(C + R)`.
    q_offsets, kv_lengths, window: as in `attention`.
    c_kv_scale, k_rope_scale: `f32[B, S]` per-token scales of a quantized
      (int8/fp8) latent cache, applied to the logits of each part and to the
      probabilities (c_kv is also the value), as in `attention`.

  Returns:
    `[B, T, N, C]` in q_latent's dtype, f32-accumulated; empty rows are zeros.

  Raises:
    ValueError/TypeError: on ranks, shapes, dtypes or options that do not fit.
  """
  _checks.check_mla_args(q_latent, q_rope, c_kv, k_rope, 2, sm_scale, c_kv_scale, k_rope_scale,
                        window)
  batch, capacity, _ = c_kv.shape
  num_tokens = q_latent.shape[1]
  q_offsets = _checks.lengths_arg("q_offsets", q_offsets, batch, 0)
  kv_lengths = _checks.lengths_arg("kv_lengths", kv_lengths, batch, capacity)
  logits = _mla_logits("BTNC,BSC->BNTS", "BTNR,BSR->BNTS", q_latent, q_rope, c_kv, k_rope,
                       c_kv_scale, k_rope_scale, sm_scale)
  mask, valid = attention_mask(q_offsets, kv_lengths, num_tokens, capacity, window)
  out = attend(logits, mask[:, None], "BNTS,BSC->BNTC", c_kv, c_kv_scale, valid, slot_axis=1)
  return jnp.moveaxis(out, 1, 2).astype(q_latent.dtype)  # [B, T, N, C]


def mla_decode_attention_xla(
    q_latent: jax.Array,  # [B, N, C]
    q_rope: jax.Array,  # [B, N, R]
    c_kv: jax.Array,  # [B, S, C]
    k_rope: jax.Array,  # [B, S, R]
    lengths: jax.Array,  # i32[B]
    *,
    sm_scale: float,
    window: int | None = None,
    c_kv_scale: jax.Array | None = None,  # f32[B, S]
    k_rope_scale: jax.Array | None = None,  # f32[B, S]
) -> jax.Array:
  """The `"xla"` backend of `kvattn.ops.mla_decode_attention` (same arguments, unchecked).

  `mla_attention` for one new token per sequence at slot `lengths[b] - 1`,
  written without the T axis (as `decode_attention_xla`). Returns `[B, N, C]`
  in q_latent's dtype. Call `kvattn.ops.mla_decode_attention(...,
  implementation="xla")` for the checked entry point.
  """
  logits = _mla_logits("BNC,BSC->BNS", "BNR,BSR->BNS", q_latent, q_rope, c_kv, k_rope,
                       c_kv_scale, k_rope_scale, sm_scale)
  mask = decode_mask(lengths, c_kv.shape[1], window)  # [B, S]
  out = attend(logits, mask[:, None], "BNS,BSC->BNC", c_kv, c_kv_scale, mask, slot_axis=1)
  return out.astype(q_latent.dtype)
