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

Quantized caches (int8 / fp8 values with f32 per-slot scales, `kvattn.ops.quant`)
are read without a scaled copy: with `k[s] = k_q[s] * k_scale[s]` and
`v[s] = v_q[s] * v_scale[s]`,

  logit[s] = (q . k_q[s]) * k_scale[s] * sm_scale
  out      = sum_s (p[s] * v_scale[s]) v_q[s] / sum_s p[s],

so the scales multiply `[.., S]` logits and probabilities, never the
`[.., S, H]` cache (scales of unused slots are zeroed first, so garbage there
cannot leak either). The 1-byte values are converted to the dot's dtype as
XLA sees fit: on CPU it materialises the converted operand (as it does for a
bf16 cache read by f32 queries), which is why the dispatcher prefers the
blocked path (`xla_blocked`) for quantized caches there.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kvattn import _checks
from kvattn.ops import quant


def _cache_dtype(name: str, x) -> None:
  """A cache operand is floating or a quantized format (scales are checked separately)."""
  if not (jnp.issubdtype(x.dtype, jnp.floating) or quant.is_quantized(x.dtype)):
    raise TypeError(f"{name} must have a floating dtype or a quantized KV format "
                    f"{quant.QUANT_NAMES}; got {x.dtype}")


def validate_args(q, k, v, num_q_axes: int, window, soft_cap, sm_scale, k_scale=None,
                  v_scale=None):
  """Checks dense-attention arguments; raises ValueError/TypeError naming them.

  A quantized `k`/`v` (int8, fp8) needs `k_scale`/`v_scale` `f32[B, K, S]`;
  float caches must come without scales.
  """
  q_doc = "[B, T, N, H]" if num_q_axes == 2 else "[B, N, H]"
  _checks.rank("q", q, 2 + num_q_axes, q_doc)
  _checks.rank("k", k, 4, "[B, K, S, H]")
  _checks.rank("v", v, 4, "[B, K, S, Hv]")
  _checks.floating("q", q)
  _cache_dtype("k", k)
  _cache_dtype("v", v)
  _checks.same_dtype(("k", "v"), (k, v))
  quant.check_scales(("k", "k_scale"), k, k_scale, k.shape[:3], "f32[B, K, S]")
  quant.check_scales(("v", "v_scale"), v, v_scale, k.shape[:3], "f32[B, K, S]")
  batch, num_kv_heads, capacity, head_dim = k.shape
  num_heads = q.shape[-2]
  _checks.dim("q", q, 0, batch, "batch B, from k")
  _checks.dim("q", q, q.ndim - 1, head_dim, "head dim H, from k")
  _checks.dim("v", v, 0, batch, "batch B, from k")
  _checks.dim("v", v, 1, num_kv_heads, "KV heads K, from k")
  _checks.dim("v", v, 2, capacity, "slots S, from k")
  _checks.head_layout(num_heads, num_kv_heads)
  check_options(window, soft_cap, sm_scale)


def validate_decode_args(q, k, v, lengths, window, soft_cap, sm_scale, k_scale=None,
                         v_scale=None) -> jax.Array:
  """`validate_args` for one decode query per sequence (`q: [B, N, H]`) and its
  `lengths: i32[B]`; returns the lengths as i32 (not clamped)."""
  validate_args(q, k, v, 1, window, soft_cap, sm_scale, k_scale, v_scale)
  return check_lengths("lengths", lengths, k.shape[0], k.shape[2])


def check_options(window, soft_cap, sm_scale):
  """ValueError unless `window` is a positive int and `soft_cap` / `sm_scale` positive
  numbers (each may be None)."""
  _checks.optional_positive_int("window", window)
  _checks.optional_positive_float("soft_cap", soft_cap)
  _checks.optional_positive_float("sm_scale", sm_scale)


def check_lengths(name: str, x, batch: int, default: int) -> jax.Array:
  """Validates an `i32[B]` lengths-like argument (None -> `default`)."""
  if x is None:
    return jnp.full((batch,), default, jnp.int32)
  x = jnp.asarray(x)
  _checks.integer(name, x)
  if x.shape != (batch,):
    raise ValueError(f"{name} must have shape [B] = ({batch},); got {tuple(x.shape)}")
  return x.astype(jnp.int32)


def attention_mask(q_offsets, kv_lengths, num_tokens: int, capacity: int, window):
  """Returns (`bool[B, T, S]` attend mask, `bool[B, S]` valid-slot mask).

  Query t of sequence b sits at slot `p = q_offsets[b] + t` and attends slot s
  iff `s <= p`, `s < kv_lengths[b]` and (with a window W) `s > p - W`.

  After an overflow under jit (`kv_lengths > S`, see `kvattn.cache`) the
  tokens past S were dropped: lengths are clamped to S and query slots to
  S - 1, as every kernel does, so all backends agree on what is attended.
  """
  slots = jnp.arange(capacity, dtype=jnp.int32)  # [S]
  q_slots = q_offsets[:, None] + jnp.arange(num_tokens, dtype=jnp.int32)  # [B, T]
  q_slots = jnp.minimum(q_slots, capacity - 1)
  kv_lengths = jnp.minimum(kv_lengths, capacity)
  valid = slots[None, :] < kv_lengths[:, None]  # [B, S]
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
  first (no copy of `values`: on CPU zeroing a whole cache per decode step cost
  as much as the attention itself); only when its result is not finite is it
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
  validate_args(q, k, v, 2, window, soft_cap, sm_scale, k_scale, v_scale)
  batch, num_kv_heads, capacity, head_dim = k.shape
  _, num_tokens, num_heads, _ = q.shape
  groups = num_heads // num_kv_heads
  q_offsets = check_lengths("q_offsets", q_offsets, batch, 0)
  kv_lengths = check_lengths("kv_lengths", kv_lengths, batch, capacity)
  if sm_scale is None:
    sm_scale = head_dim ** -0.5

  # Head-major query (a small transpose) so the big [B, K, G, T, S] logits/probs and the
  # [B, K, G, T, V] output stay in the row-major layouts of plain batched products; with
  # the output produced as BTKGV, XLA:CPU transposed the probabilities (and, for G > 1,
  # the values) through memory, ~35% of a 512-token prefill on the 2-core CPU.
  qg = jnp.moveaxis(q.reshape(batch, num_tokens, num_kv_heads, groups, head_dim), 1, 3)
  logits = jnp.einsum("BKGTH,BKSH->BKGTS", qg, k, preferred_element_type=jnp.float32) * sm_scale
  logits = scale_logits(logits, k_scale)
  if soft_cap is not None:
    logits = soft_cap * jnp.tanh(logits / soft_cap)
  mask, valid = attention_mask(q_offsets, kv_lengths, num_tokens, capacity, window)
  probs, denom = masked_softmax(logits, mask[:, None, None])  # [B, K, G, T, S]
  out = weighted_values("BKGTS,BKSV->BKGTV", scale_probs(probs, v_scale, valid), v, valid,
                        slot_axis=2)
  out = out / jnp.where(denom > 0, denom, 1.0)
  out = jnp.moveaxis(out, 3, 1)  # [B, T, K, G, V]
  return out.reshape(batch, num_tokens, num_heads, v.shape[-1]).astype(q.dtype)


def decode_mask(lengths: jax.Array, capacity: int, window) -> jax.Array:
  """`bool[B, S]`: the slots one decode query per sequence attends.

  The query sits at slot `lengths[b] - 1` and attends `[max(0, lengths[b] - W), lengths[b])`:
  `attention_mask` with T = 1 and `q_offsets = lengths - 1`, without the T axis;
  lengths past S (an overflow under jit) are clamped to S, as in every kernel.
  """
  lengths = jnp.minimum(lengths, capacity)
  slots = jnp.arange(capacity, dtype=jnp.int32)[None, :]  # [1, S]
  mask = slots < lengths[:, None]  # [B, S]
  return mask if window is None else mask & (slots >= lengths[:, None] - window)


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
) -> jax.Array:
  """One new token per sequence: the query sits at slot `lengths[b] - 1`.

  The XLA implementation behind `kvattn.ops.decode_attention`; sequence b
  attends slots `[max(0, lengths[b] - window), lengths[b])`. Length-0 rows
  return zeros. Returns `[B, N, Hv]` in q's dtype.

  Same math as `attention` with T = 1 and `q_offsets = lengths - 1`, written
  without the T axis: the einsums are then plain batched matrix products
  (`BKGH,BKSH->BKGS`, `BKGS,BKSV->BKGV`) that XLA:CPU runs on the cache in
  place. Through `attention`'s `BTKGV` output order, XLA chose a transposed
  layout for the PV product and copied the whole V cache every decode step
  when G > 1.

  A quantized cache (int8/fp8 k, v with `k_scale, v_scale: f32[B, K, S]`)
  is read with the scales applied to logits and probabilities (module doc).
  """
  lengths = validate_decode_args(q, k, v, lengths, window, soft_cap, sm_scale, k_scale, v_scale)
  batch, num_kv_heads, capacity, head_dim = k.shape
  num_heads = q.shape[1]
  groups = num_heads // num_kv_heads
  if sm_scale is None:
    sm_scale = head_dim ** -0.5
  qg = q.reshape(batch, num_kv_heads, groups, head_dim)
  # Keys as the left operand (BKSH,BKGH->BKSG), then a transpose of the small logits: with
  # G > 1, XLA:CPU's library dot ran this orientation markedly faster (measured on the
  # bench_generate model: 17% of a K = 1 and 16% of a K = 2 decode step; no change at
  # G = 1). The barrier stops XLA from folding the transpose back into the product.
  logits_t = jnp.einsum("BKSH,BKGH->BKSG", k, qg, preferred_element_type=jnp.float32)
  logits = jnp.swapaxes(jax.lax.optimization_barrier(logits_t), -1, -2) * sm_scale
  logits = scale_logits(logits, k_scale)
  if soft_cap is not None:
    logits = soft_cap * jnp.tanh(logits / soft_cap)
  # One query per row: the attended slots (`mask`, window applied) are the only ones whose
  # values and scales may reach the output, so a NaN before the window start cannot either.
  mask = decode_mask(lengths, capacity, window)
  probs, denom = masked_softmax(logits, mask[:, None, None])  # [B, K, G, S]
  out = weighted_values("BKGS,BKSV->BKGV", scale_probs(probs, v_scale, mask), v, mask,
                        slot_axis=2)
  out = out / jnp.where(denom > 0, denom, 1.0)
  return out.reshape(batch, num_heads, v.shape[-1]).astype(q.dtype)


def validate_mla_args(q_latent, q_rope, c_kv, k_rope, num_q_axes: int, sm_scale,
                      c_kv_scale=None, k_rope_scale=None, window=None):
  """Checks absorbed-MLA attention arguments (see `mla_attention`).

  A quantized latent cache (int8/fp8 `c_kv`, `k_rope`) needs `c_kv_scale` and
  `k_rope_scale`, each `f32[B, S]`; `sm_scale` is required, `window` optional.
  """
  q_doc = "[B, T, N, {}]" if num_q_axes == 2 else "[B, N, {}]"
  _checks.rank("q_latent", q_latent, 2 + num_q_axes, q_doc.format("C"))
  _checks.rank("q_rope", q_rope, 2 + num_q_axes, q_doc.format("R"))
  _checks.rank("c_kv", c_kv, 3, "[B, S, C]")
  _checks.rank("k_rope", k_rope, 3, "[B, S, R]")
  for name, x in (("q_latent", q_latent), ("q_rope", q_rope)):
    _checks.floating(name, x)
  _cache_dtype("c_kv", c_kv)
  _cache_dtype("k_rope", k_rope)
  _checks.same_dtype(("c_kv", "k_rope"), (c_kv, k_rope))
  batch, capacity, latent = c_kv.shape
  quant.check_scales(("c_kv", "c_kv_scale"), c_kv, c_kv_scale, (batch, capacity), "f32[B, S]")
  quant.check_scales(("k_rope", "k_rope_scale"), k_rope, k_rope_scale, (batch, capacity),
                     "f32[B, S]")
  _checks.dim("k_rope", k_rope, 0, batch, "batch B, from c_kv")
  _checks.dim("k_rope", k_rope, 1, capacity, "slots S, from c_kv")
  _checks.dim("q_latent", q_latent, 0, batch, "batch B, from c_kv")
  _checks.dim("q_latent", q_latent, q_latent.ndim - 1, latent, "latent C, from c_kv")
  if q_rope.shape[:-1] != q_latent.shape[:-1]:
    raise ValueError(
        f"q_rope must match q_latent in all but the last axis; got {tuple(q_rope.shape)} "
        f"and {tuple(q_latent.shape)}")
  _checks.dim("q_rope", q_rope, q_rope.ndim - 1, k_rope.shape[-1], "rope dim R, from k_rope")
  if sm_scale is None:
    raise ValueError("sm_scale is required for MLA: 1/sqrt(qk_nope_head_dim + qk_rope_head_dim)")
  _checks.positive_float("sm_scale", sm_scale)
  _checks.optional_positive_int("window", window)


def validate_mla_decode_args(q_latent, q_rope, c_kv, k_rope, lengths, sm_scale, window,
                             c_kv_scale=None, k_rope_scale=None) -> jax.Array:
  """`validate_mla_args` for one decode query per sequence (`q_latent: [B, N, C]`)
  and its `lengths: i32[B]`; returns the lengths as i32 (not clamped)."""
  validate_mla_args(q_latent, q_rope, c_kv, k_rope, 1, sm_scale, c_kv_scale, k_rope_scale,
                    window)
  return check_lengths("lengths", lengths, c_kv.shape[0], c_kv.shape[1])


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
  """
  validate_mla_args(q_latent, q_rope, c_kv, k_rope, 2, sm_scale, c_kv_scale, k_rope_scale,
                    window)
  batch, capacity, _ = c_kv.shape
  num_tokens = q_latent.shape[1]
  q_offsets = check_lengths("q_offsets", q_offsets, batch, 0)
  kv_lengths = check_lengths("kv_lengths", kv_lengths, batch, capacity)
  logits = (scale_logits(jnp.einsum("BTNC,BSC->BNTS", q_latent, c_kv,
                                    preferred_element_type=jnp.float32), c_kv_scale)
            + scale_logits(jnp.einsum("BTNR,BSR->BNTS", q_rope, k_rope,
                                      preferred_element_type=jnp.float32), k_rope_scale))
  logits = logits * sm_scale
  mask, valid = attention_mask(q_offsets, kv_lengths, num_tokens, capacity, window)
  probs, denom = masked_softmax(logits, mask[:, None])  # [B, N, T, S]
  out = weighted_values("BNTS,BSC->BNTC", scale_probs(probs, c_kv_scale, valid), c_kv, valid,
                        slot_axis=1)
  out = out / jnp.where(denom > 0, denom, 1.0)
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
  """`mla_attention` for one new token per sequence at slot `lengths[b] - 1`.

  Written without the T axis (as `decode_attention_xla`), so the latent cache
  is read in place by plain batched matrix products; a quantized cache's
  scales multiply logits and probabilities (module doc).
  """
  lengths = validate_mla_decode_args(q_latent, q_rope, c_kv, k_rope, lengths, sm_scale, window,
                                     c_kv_scale, k_rope_scale)
  capacity = c_kv.shape[1]
  logits = (scale_logits(jnp.einsum("BNC,BSC->BNS", q_latent, c_kv,
                                    preferred_element_type=jnp.float32), c_kv_scale)
            + scale_logits(jnp.einsum("BNR,BSR->BNS", q_rope, k_rope,
                                      preferred_element_type=jnp.float32), k_rope_scale))
  logits = logits * sm_scale
  mask = decode_mask(lengths, capacity, window)  # attended slots only (as decode_attention_xla)
  probs, denom = masked_softmax(logits, mask[:, None])  # [B, N, S]
  out = weighted_values("BNS,BSC->BNC", scale_probs(probs, c_kv_scale, mask), c_kv, mask,
                        slot_axis=1)
  out = out / jnp.where(denom > 0, denom, 1.0)
  return out.astype(q_latent.dtype)
