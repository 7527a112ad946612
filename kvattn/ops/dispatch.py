"""The one dispatch point for single-token decode attention.

Modelled on openxla/tokamax's attention API: one public function whose
`implementation=` names a backend, or, when None, tries an ordered list of the
backends that imported and fit the device. A backend that cannot handle the
given shapes/options raises `NotImplementedError` and the dispatcher moves on;
a caller error raises `ValueError`/`TypeError` before any backend runs.
"""

from __future__ import annotations

from typing import Callable

import jax

from kvattn.ops import reference as _reference

DecodeFn = Callable[..., jax.Array]

# name -> fn(q, k, v, lengths, *, sm_scale, window, soft_cap, explicit).
# `explicit` is True when the caller named this implementation; a backend may
# then run where it would not be picked automatically (a Pallas kernel in
# interpret mode on CPU, say).
_REGISTRY: dict[str, DecodeFn] = {}
# Tried in this order when implementation is None.
_PREFERENCE: list[str] = []


def register_decode_implementation(name: str, fn: DecodeFn, *, preferred: bool = False) -> None:
  """Adds a backend to `decode_attention` (used by kvattn's own modules)."""
  _REGISTRY[name] = fn
  if name in _PREFERENCE:
    _PREFERENCE.remove(name)
  if preferred:
    _PREFERENCE.insert(0, name)
  else:
    _PREFERENCE.append(name)


def available_implementations() -> tuple[str, ...]:
  """Registered implementation names, in the order `None` tries them."""
  return tuple(_PREFERENCE)


def _xla(q, k, v, lengths, *, sm_scale, window, soft_cap, explicit):
  del explicit
  return _reference.decode_attention_xla(
      q, k, v, lengths, sm_scale=sm_scale, window=window, soft_cap=soft_cap)


register_decode_implementation("xla", _xla)


def decode_attention(
    q: jax.Array,  # [B, N, H]
    k: jax.Array,  # [B, K, S, H]
    v: jax.Array,  # [B, K, S, Hv]
    lengths: jax.Array,  # i32[B]
    *,
    sm_scale: float | None = None,
    window: int | None = None,
    soft_cap: float | None = None,
    implementation: str | None = None,
) -> jax.Array:
  """Attention of one new token per sequence against a dense KV cache.

  Sequence b's query sits at slot `lengths[b] - 1` (the new token has already
  been written) and attends slots `[max(0, lengths[b] - window), lengths[b])`;
  query head n reads KV head `n // (N // K)`.

  Args:
    q: `[B, N, H]` queries.
    k: `[B, K, S, H]` keys; slots at or past `lengths[b]` may hold anything.
    v: `[B, K, S, Hv]` values (same dtype as k).
    lengths: `i32[B]` valid slots per sequence, in `[0, S]`.
    sm_scale: logit scale, default `1/sqrt(H)`.
    window: sliding-window size in tokens, or None.
    soft_cap: logit soft cap, or None.
    implementation: `"xla"`, `"pallas"` (when registered) or None to pick the
      first registered backend that supports the device and shapes.

  Returns:
    `[B, N, Hv]` in q's dtype, accumulated in f32; length-0 rows are zeros.

  Raises:
    ValueError: unknown `implementation`, or shapes/options that do not fit.
    TypeError: non-float inputs, k/v dtype mismatch, non-integer lengths.
    NotImplementedError: the named implementation cannot run these shapes.
  """
  _reference.validate_args(q, k, v, 1, window, soft_cap, sm_scale)
  _reference.check_lengths("lengths", lengths, k.shape[0], k.shape[2])
  kwargs = dict(sm_scale=sm_scale, window=window, soft_cap=soft_cap)
  if implementation is not None:
    if implementation not in _REGISTRY:
      raise ValueError(
          f"implementation must be one of {sorted(_REGISTRY)} or None; got {implementation!r}")
    return _REGISTRY[implementation](q, k, v, lengths, explicit=True, **kwargs)
  errors = []
  for name in _PREFERENCE:
    try:
      return _REGISTRY[name](q, k, v, lengths, explicit=False, **kwargs)
    except NotImplementedError as e:
      errors.append(f"{name}: {e}")
  raise NotImplementedError("no decode_attention implementation fits: " + "; ".join(errors))
