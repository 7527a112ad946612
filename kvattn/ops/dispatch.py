"""Dispatch points for decode attention: one public function per operation.

Modelled on openxla/tokamax's attention API: one public function whose
`implementation=` names a backend, or, when None, tries an ordered list of the
backends that imported and fit the device. A backend that cannot handle the
given device, shapes or options raises `NotImplementedError` and the
dispatcher moves on; a caller error raises `ValueError`/`TypeError` before any
backend runs (the public function validates first).

Operations registered here: `"decode_attention"` (dense cache) and
`"mla_decode_attention"` (absorbed MLA against a latent cache). Other modules
add operations and backends with `register_implementation` (e.g. the Pallas
kernels, or the paged cache's gather path).

Quantized caches (int8 / fp8 values, `kvattn.ops.quant`): the public functions
take the per-slot scales as `k_scale=, v_scale=` (dense) and `c_kv_scale=,
k_rope_scale=` (MLA). They are handed to a backend only when given, so a call
without scales reaches every backend exactly as before; a backend that cannot
apply scales raises NotImplementedError when it gets them and the dispatcher
moves on (every backend registered here, "xla", "xla_blocked" and "pallas",
supports them).
"""

from __future__ import annotations

from typing import Any, Callable

import jax

from kvattn.ops import reference as _reference

# An implementation is fn(*args, explicit: bool, **options). `explicit` is True
# when the caller named it; a backend may then run where it would not be picked
# automatically (a Pallas kernel in interpret mode on CPU, say).
Implementation = Callable[..., jax.Array]

_REGISTRY: dict[str, dict[str, Implementation]] = {}
_PREFERENCE: dict[str, list[str]] = {}


def register_implementation(op: str, name: str, fn: Implementation, *,
                            preferred: bool = False) -> None:
  """Adds backend `name` for operation `op`; `preferred` puts it first in line."""
  impls = _REGISTRY.setdefault(op, {})
  order = _PREFERENCE.setdefault(op, [])
  impls[name] = fn
  if name in order:
    order.remove(name)
  order.insert(0, name) if preferred else order.append(name)


def available_implementations(op: str = "decode_attention") -> tuple[str, ...]:
  """Registered implementation names for `op`, in the order `None` tries them."""
  if op not in _REGISTRY:
    raise ValueError(f"op must be one of {sorted(_REGISTRY)}; got {op!r}")
  return tuple(_PREFERENCE[op])


def dispatch(op: str, implementation: str | None, *args: Any, **options: Any) -> jax.Array:
  """Runs `op` with the named implementation, or the first that fits."""
  impls = _REGISTRY[op]
  if implementation is not None:
    if implementation not in impls:
      raise ValueError(
          f"implementation must be one of {sorted(impls)} or None; got {implementation!r}")
    return impls[implementation](*args, explicit=True, **options)
  errors = []
  for name in _PREFERENCE[op]:
    try:
      return impls[name](*args, explicit=False, **options)
    except NotImplementedError as e:
      errors.append(f"{name}: {e}")
  raise NotImplementedError(f"no {op} implementation fits: " + "; ".join(errors))


def _xla_decode(q, k, v, lengths, *, explicit, **options):
  del explicit
  return _reference.decode_attention_xla(q, k, v, lengths, **options)


def _xla_mla_decode(q_latent, q_rope, c_kv, k_rope, lengths, *, explicit, **options):
  del explicit
  return _reference.mla_decode_attention_xla(q_latent, q_rope, c_kv, k_rope, lengths, **options)


register_implementation("decode_attention", "xla", _xla_decode)
register_implementation("mla_decode_attention", "xla", _xla_mla_decode)


def decode_attention(
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
    implementation: str | None = None,
) -> jax.Array:
  """Attention of one new token per sequence against a dense KV cache.

  Sequence b's query sits at slot `lengths[b] - 1` (the new token has already
  been written) and attends slots `[max(0, lengths[b] - window), lengths[b])`;
  query head n reads KV head `n // (N // K)`.

  Args:
    q: `[B, N, H]` queries.
    k: `[B, K, S, H]` keys; slots at or past `lengths[b]` may hold anything.
      Float, or int8 / float8_e4m3fn / float8_e5m2 with `k_scale`.
    v: `[B, K, S, Hv]` values (same dtype as k).
    lengths: `i32[B]` valid slots per sequence, in `[0, S]`.
    sm_scale: logit scale, default `1/sqrt(H)`.
    window: sliding-window size in tokens, or None.
    soft_cap: logit soft cap, or None.
    k_scale, v_scale: `f32[B, K, S]` per-slot scales of a quantized cache
      (key `k[b, h, s] * k_scale[b, h, s]`), applied inside the attention
      computation (no dequantized copy of the cache); None for float caches.
    implementation: `"pallas"` (the fused kernel; picked by None on GPU/TPU
      for the shapes it supports, interpreted on CPU when named),
      `"xla_blocked"` (flash-decoding as an XLA loop; picked by None on CPU
      for large int8/fp8 caches only), `"xla"` (the plain reference path),
      or None to take the first of these that supports the device, dtypes
      and shapes (`available_implementations()` gives the order).

  Returns:
    `[B, N, Hv]` in q's dtype, accumulated in f32; length-0 rows are zeros.

  Raises:
    ValueError: unknown `implementation`, or shapes/options that do not fit.
    TypeError: non-float inputs, k/v dtype mismatch, non-integer lengths, a
      quantized cache without scales (or scales for a float cache).
    NotImplementedError: the named implementation cannot run these shapes.
  """
  _reference.validate_decode_args(q, k, v, lengths, window, soft_cap, sm_scale, k_scale, v_scale)
  scales = {} if k_scale is None else {"k_scale": k_scale, "v_scale": v_scale}
  return dispatch("decode_attention", implementation, q, k, v, lengths,
                  sm_scale=sm_scale, window=window, soft_cap=soft_cap, **scales)


def mla_decode_attention(
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
    implementation: str | None = None,
) -> jax.Array:
  """Absorbed MLA decode (DeepSeek-V2 appendix C) against a latent cache.

  Single-KV-head attention with key `[c_kv | k_rope]` (width C + R) and value
  `c_kv` (width C): logits `(q_latent . c_kv + q_rope . k_rope) * sm_scale`.
  The query sits at slot `lengths[b] - 1`.

  Args:
    q_latent: `[B, N, C]` query with W_UK absorbed.
    q_rope: `[B, N, R]` RoPE part of the query.
    c_kv: `[B, S, C]` latent cache; `k_rope: [B, S, R]` shared RoPE keys
      (same dtype as c_kv). Slots at or past `lengths[b]` may hold anything.
    lengths: `i32[B]` valid slots per sequence.
    sm_scale: required, `1/sqrt(qk_nope_head_dim + qk_rope_head_dim)`.
    window: sliding-window size in tokens, or None.
    c_kv_scale, k_rope_scale: `f32[B, S]` per-token scales of a quantized
      (int8/fp8) latent cache, applied inside the computation; None for float.
    implementation: `"pallas"`, `"xla_blocked"`, `"xla"` or None, as in
      `decode_attention`.

  Returns:
    `[B, N, C]` attention-weighted latent in q_latent's dtype (apply W_UV
    afterwards); length-0 rows are zeros.

  Raises:
    ValueError/TypeError: as `decode_attention`, naming the argument.
  """
  _reference.validate_mla_decode_args(q_latent, q_rope, c_kv, k_rope, lengths, sm_scale, window,
                                      c_kv_scale, k_rope_scale)
  scales = ({} if c_kv_scale is None else
            {"c_kv_scale": c_kv_scale, "k_rope_scale": k_rope_scale})
  return dispatch("mla_decode_attention", implementation, q_latent, q_rope, c_kv, k_rope,
                  lengths, sm_scale=sm_scale, window=window, **scales)
