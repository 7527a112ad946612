"""Dispatch points of decode attention and the low-bit store reads (as openxla/tokamax).

`implementation=` names a backend, a sequence to try in order, or None for the order of
`IMPLEMENTATIONS`. A backend `fn(*args, explicit, **options)` that cannot run raises
`NotImplementedError` and the next is tried; caller errors raise before any backend
runs. `explicit`: the caller named it (a Pallas kernel then runs interpreted on CPU).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp

from kvattn import _checks
from kvattn.ops import pallas
from kvattn.ops import xla
from kvattn.ops import xla_blocked
from kvattn.ops import xla_paged

Implementation = Callable[..., Any]


def _runs_anywhere(fn: Callable[..., Any]) -> Implementation:
  """A backend for `fn`, which takes every device, shape and option."""

  def backend(*args, explicit: bool, **options):
    del explicit
    return fn(*args, **options)

  backend.__name__ = backend.__qualname__ = fn.__name__
  return backend


def _in_callers_loop(*args, explicit: bool, **options) -> None:
  """"xla" of the store ops: None, so the cache's XLA loop reads the store with its ring."""
  del args, explicit, options


STORE_OPS = ("kivi_store_decode", "paged_kivi_store_decode", "rotated_store_decode")

IMPLEMENTATIONS: dict[str, dict[str, Implementation]] = {
    "decode_attention": {
        "pallas": pallas.decode,
        "xla_blocked": xla_blocked.decode,
        "xla": _runs_anywhere(xla.decode_attention_xla),
    },
    "paged_decode_attention": {
        "pallas": pallas.paged_decode,
        "xla_pool": xla_paged.pool_decode,
        "xla": _runs_anywhere(xla_paged.paged_decode_attention_xla),
    },
    "mla_decode_attention": {
        "pallas": pallas.mla_decode,
        "xla_blocked": xla_blocked.mla_decode,
        "xla": _runs_anywhere(xla.mla_decode_attention_xla),
    },
    # `(out f32[B, N, H], lse f32[B, N])` of a low-bit store, or None ("xla").
    "kivi_store_decode": {"pallas": pallas.kivi_store_decode, "xla": _in_callers_loop},
    "paged_kivi_store_decode": {"pallas": pallas.paged_kivi_store_decode,
                                "xla": _in_callers_loop},
    "rotated_store_decode": {"pallas": pallas.rotated_store_decode, "xla": _in_callers_loop},
}

# Per operation, the backends that take the newest token apart (`k_new=`, `v_new=`).
APPENDS_NEWEST: dict[str, set[str]] = {"decode_attention": {"xla_blocked", "xla"}}

# Backends that `implementation=None` runs only on these platforms (elsewhere only when named).
DEFAULT_PLATFORMS: dict[str, tuple[str, ...]] = {"pallas": pallas.COMPILED_PLATFORMS}


def _backends(op: str) -> dict[str, Implementation]:
  if op not in IMPLEMENTATIONS:
    raise ValueError(f"op must be one of {sorted(IMPLEMENTATIONS)}; got {op!r}")
  return IMPLEMENTATIONS[op]


def available_implementations(op: str = "decode_attention") -> tuple[str, ...]:
  """Backend names of `op`, in the order `implementation=None` tries them."""
  return tuple(_backends(op))


def register_implementation(op: str, name: str, fn: Implementation, *,
                            preferred: bool = False, appends_newest: bool = False) -> None:
  """Adds (or replaces) backend `name` of `op`, first with `preferred`; ValueError for
  an unknown op."""
  impls = {k: v for k, v in _backends(op).items() if k != name}
  IMPLEMENTATIONS[op] = {name: fn, **impls} if preferred else {**impls, name: fn}
  appending = APPENDS_NEWEST.setdefault(op, set())
  if appends_newest:
    appending.add(name)
  else:
    appending.discard(name)


def appends_newest(implementation: str | Sequence[str] | None = None, *,
                   op: str = "decode_attention") -> bool:
  """Whether every backend `implementation` may run here takes `k_new` / `v_new`."""
  names = check_implementation(op, implementation)
  if names is None:
    platform = jax.default_backend()
    names = tuple(n for n in _backends(op) if platform in DEFAULT_PLATFORMS.get(n, (platform,)))
  return all(n in APPENDS_NEWEST.get(op, ()) for n in names)


def check_implementation(op: str, implementation: Any) -> tuple[str, ...] | None:
  """The names `implementation` gives (None: the default order); ValueError if unknown."""
  impls = _backends(op)
  if implementation is None:
    return None
  names = ((implementation,) if isinstance(implementation, str) or
           not isinstance(implementation, Sequence) else tuple(implementation))
  if not names or any(not isinstance(n, str) or n not in impls for n in names):
    raise ValueError(f"implementation must be one of {sorted(impls)}, a sequence of them, or "
                     f"None; got {implementation!r}")
  return names


def dispatch(op: str, implementation: str | Sequence[str] | None, *args: Any,
             **options: Any) -> Any:
  """Runs `op` by the named backend(s), or the first of the default order that fits.

  Raises:
    NotImplementedError: no backend fits (naming why each declined).
  """
  impls = _backends(op)
  names = check_implementation(op, implementation)
  newest = options.get("k_new") is not None  # only backends that take it apart can run
  if isinstance(implementation, str):
    _takes_newest(op, implementation, newest)
    return impls[implementation](*args, explicit=True, **options)
  errors = []
  for name in names or impls:
    try:
      _takes_newest(op, name, newest)
      return impls[name](*args, explicit=names is not None, **options)
    except NotImplementedError as e:
      errors.append(f"{name}: {e}")
  raise NotImplementedError(f"no {op} implementation fits: " + "; ".join(errors))


def _given(**arrays: Any) -> dict[str, Any]:
  """The optional arrays that were given (a float cache passes no scales to a backend)."""
  return {k: v for k, v in arrays.items() if v is not None}


def _takes_newest(op: str, name: str, newest: bool) -> None:
  if newest and name not in APPENDS_NEWEST.get(op, ()):
    raise NotImplementedError(f"{name} reads the newest token from the cache (k_new / v_new "
                              f"are for {sorted(APPENDS_NEWEST.get(op, ()))})")


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
    k_new: jax.Array | None = None,  # [B, K, H]
    v_new: jax.Array | None = None,  # [B, K, Hv]
    implementation: str | Sequence[str] | None = None,
) -> jax.Array:
  """Attention of one new token per sequence against a dense KV cache (Vaswani et al.
  2017, eq. 1; GQA: query head n reads KV head `n // (N // K)`).

  The query at slot `lengths[b] - 1` attends `[max(0, lengths[b] - window), lengths[b])`.
  `k_new, v_new`: the newest token apart from the cache (`APPENDS_NEWEST` backends).
  Returns `[B, N, Hv]` in q's dtype; length-0 rows are zeros.

  Raises:
    ValueError: shapes or options that do not fit, an unknown `implementation`, a
      concrete length outside `[0, S]` (`lengths[1] = -2`).
    TypeError: non-float q, k/v dtype mismatch, non-integer lengths, scales missing or
      given for a float cache.
    NotImplementedError: no named backend can run these shapes here.
  """
  lengths = _checks.check_decode_args(q, k, v, lengths, window, soft_cap, sm_scale, k_scale,
                                     v_scale)
  _checks.values_in_range("lengths", lengths, 0, k.shape[2])
  if (k_new is None) != (v_new is None):
    raise ValueError("k_new and v_new must be given together; got "
                     f"k_new={'None' if k_new is None else 'an array'} and "
                     f"v_new={'None' if v_new is None else 'an array'}")
  if k_new is not None:
    batch, num_kv, _, head_dim = k.shape
    for name, x, want in (("k_new", k_new, (batch, num_kv, head_dim)),
                          ("v_new", v_new, (batch, num_kv, v.shape[-1]))):
      _checks.floating(name, x)
      if tuple(x.shape) != want:
        raise ValueError(f"{name} must have shape [B, K, {name[0].upper()}] = {want}; "
                         f"got {tuple(x.shape)}")
  return dispatch("decode_attention", implementation, q, k, v, lengths, sm_scale=sm_scale,
                  window=window, soft_cap=soft_cap,
                  **_given(k_scale=k_scale, v_scale=v_scale, k_new=k_new, v_new=v_new))


def paged_decode_attention(
    q: jax.Array,  # [B, N, H]
    k_pages: jax.Array,  # [K, P, page_size, H]
    v_pages: jax.Array,  # [K, P, page_size, Hv]
    block_tables: jax.Array,  # i32[B, pages_per_seq]
    lengths: jax.Array,  # i32[B]
    *,
    sm_scale: float | None = None,
    window: int | None = None,
    soft_cap: float | None = None,
    k_scale: jax.Array | None = None,  # f32[K, P, page_size]
    v_scale: jax.Array | None = None,  # f32[K, P, page_size]
    implementation: str | Sequence[str] | None = None,
) -> jax.Array:
  """`decode_attention` against a page pool (PagedAttention, Kwon et al. 2023, §4.1);
  lengths are clamped to the row's leading assigned pages before any backend runs.

  Raises:
    ValueError: as `decode_attention`; concrete tables with a page unassigned or shared.
    TypeError, NotImplementedError: as `decode_attention`.
  """
  lengths = _checks.check_paged_args(q, k_pages, v_pages, block_tables, lengths, window=window,
                                    soft_cap=soft_cap, sm_scale=sm_scale, k_scale=k_scale,
                                    v_scale=v_scale)
  num_pages, page_size = k_pages.shape[1], k_pages.shape[2]
  xla_paged.check_block_tables(block_tables, lengths, num_pages, page_size)
  lengths = jnp.clip(lengths, 0, xla_paged.assigned_slots(block_tables, num_pages, page_size))
  return dispatch("paged_decode_attention", implementation, q, k_pages, v_pages, block_tables,
                  lengths, sm_scale=sm_scale, window=window, soft_cap=soft_cap,
                  **_given(k_scale=k_scale, v_scale=v_scale))


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
    implementation: str | Sequence[str] | None = None,
) -> jax.Array:
  """Absorbed MLA decode (DeepSeek-V2, appendix C): logits `(q_latent . c_kv + q_rope .
  k_rope) * sm_scale`, value c_kv; returns `[B, N, C]` (apply W_UV afterwards).

  Raises:
    ValueError, TypeError, NotImplementedError: as `decode_attention`.
  """
  lengths = _checks.check_mla_decode_args(q_latent, q_rope, c_kv, k_rope, lengths, sm_scale,
                                         window, c_kv_scale, k_rope_scale)
  _checks.values_in_range("lengths", lengths, 0, c_kv.shape[1])
  return dispatch("mla_decode_attention", implementation, q_latent, q_rope, c_kv, k_rope,
                  lengths, sm_scale=sm_scale, window=window,
                  **_given(c_kv_scale=c_kv_scale, k_rope_scale=k_rope_scale))
