"""The XLA paths of kvattn's attention ops, in plain jnp.

Scaled dot-product attention (Vaswani et al. 2017, eq. 1) with GQA (Ainslie et al.
2023), lengths, a window and a soft cap (Gemma 2): `attention` / `mla_attention` for T
tokens and the "xla" decode backends. Masked logits are replaced and only attended
slots' values reach the sum. int8 / fp8 caches: the scales multiply logits and
probabilities, never the cache.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kvattn.ops import prefill
from kvattn import _checks
from pallas_kernels.attention_common import M_INIT, attended_range, decode_mask  # noqa: F401


def attention_mask(q_offsets: jax.Array, kv_lengths: jax.Array, num_tokens: int, capacity: int,
                   window: int | None) -> tuple[jax.Array, jax.Array]:
  """`(bool[B, T, S] attend mask, bool[B, S] valid slots)` for T new tokens per sequence:
  query t at slot `p = q_offsets[b] + t` attends s iff `s <= p`, `s < kv_lengths[b]` and
  `s > p - window`; lengths clamped to S and query slots to S - 1.
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
  """`(probs, denom)`: unnormalised probabilities of f32 `logits`, exactly 0 where
  `mask` is False, and their row sums (a fully masked row's max is taken as 0).
  """
  logits = jnp.where(mask, logits, -jnp.inf)
  row_max = jnp.max(logits, axis=-1, keepdims=True)
  row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
  probs = jnp.where(mask, jnp.exp(logits - row_max), 0.0)
  return probs, jnp.sum(probs, axis=-1, keepdims=True)


def zero_invalid(x: jax.Array, valid: jax.Array, slot_axis: int) -> jax.Array:
  """`x` with slots where `valid` (`bool[B, S]`) is False zeroed."""
  shape = [1] * x.ndim
  shape[0], shape[slot_axis] = valid.shape
  return jnp.where(valid.reshape(shape), x, jnp.zeros((), x.dtype))


def scale_logits(logits: jax.Array, scale: jax.Array | None) -> jax.Array:
  """`logits [B, (K,) ..., S]` times `scale f32[B, (K,) S]` broadcast over the query axes
  (None: unchanged).
  """
  if scale is None:
    return logits
  middle = logits.ndim - scale.ndim
  shape = scale.shape[:-1] + (1,) * middle + scale.shape[-1:]
  return logits * scale.astype(jnp.float32).reshape(shape)


def scale_probs(probs: jax.Array, scale: jax.Array | None, valid: jax.Array) -> jax.Array:
  """`probs * scale` with the scales of invalid slots zeroed first."""
  if scale is None:
    return probs
  shape = [1] * scale.ndim
  shape[0], shape[-1] = valid.shape
  scale = jnp.where(valid.reshape(shape), scale.astype(jnp.float32), 0.0)
  return scale_logits(probs, scale)


def weighted_values(spec: str, probs: jax.Array, values: jax.Array, valid: jax.Array,
                    slot_axis: int) -> jax.Array:
  """`einsum(spec, probs, values)` in f32, bit for bit as if invalid slots were zero:
  the plain einsum first, recomputed from zeroed values only when not finite.
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
  """Masked softmax of f32 `logits`, then the normalised `einsum(spec, probs, values)`;
  `valid` (`bool[B, S]`) marks the slots whose values and scales may reach the output.
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
  """Attention of T new query tokens per sequence against S cache slots (masks:
  `attention_mask`; `q_offsets` default 0, `kv_lengths` default S). Returns `[B, T, N, Hv]`
  in q's dtype, f32-accumulated; rows with nothing to attend are zeros.

  Raises:
    ValueError, TypeError: ranks, shapes, dtypes or options that do not fit.
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
  """`bool[B]`: rows whose query token sits in a cache slot (`1 <= lengths[b] <= S`)."""
  return (lengths >= 1) & (lengths <= capacity)


def new_token_logits(qg: jax.Array, k_new: jax.Array, sm_scale: float,
                     soft_cap: float | None) -> jax.Array:
  """f32 `[B, K, G]` logits of `qg: [B, K, G, H]` against `k_new: [B, K, H]`."""
  logits = jnp.einsum("BKGH,BKH->BKG", qg.astype(jnp.float32), k_new.astype(jnp.float32))
  return _soft_cap(logits * sm_scale, soft_cap)


def decode_attention_xla(q, k, v, lengths, *, sm_scale=None, window=None, soft_cap=None,
                         k_scale=None, v_scale=None, k_new=None, v_new=None) -> jax.Array:
  """The "xla" backend of `dispatch.decode_attention` (unchecked): `attention` at T = 1;
  with `k_new, v_new` slot `lengths[b] - 1` is one more logit column, not read.
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
  """Absorbed MLA attention (DeepSeek-V2, appendix C): logits `(q_latent . c_kv[s] +
  q_rope . k_rope[s]) * sm_scale`, value c_kv, masks as `attention`; `[B, T, N, C]`.

  Raises:
    ValueError, TypeError: ranks, shapes, dtypes or options that do not fit.
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


def mla_decode_attention_xla(q_latent, q_rope, c_kv, k_rope, lengths, *, sm_scale, window=None,
                             c_kv_scale=None, k_rope_scale=None) -> jax.Array:
  """The "xla" backend of `dispatch.mla_decode_attention` (unchecked)."""
  logits = _mla_logits("BNC,BSC->BNS", "BNR,BSR->BNS", q_latent, q_rope, c_kv, k_rope,
                       c_kv_scale, k_rope_scale, sm_scale)
  mask = decode_mask(lengths, c_kv.shape[1], window)  # [B, S]
  out = attend(logits, mask[:, None], "BNS,BSC->BNC", c_kv, c_kv_scale, mask, slot_axis=1)
  return out.astype(q_latent.dtype)
