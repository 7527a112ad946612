"""The decode-attention dispatch points: one public function per operation and its backend table.

Modelled on openxla/tokamax's attention API. `IMPLEMENTATIONS` states, for
each operation, every backend and -- by its order -- the order in which
`implementation=None` tries them:

| operation                  | backends, in the default order                   |
|----------------------------|--------------------------------------------------|
| `decode_attention`         | `"pallas"`, `"xla_blocked"`, `"xla"`             |
| `paged_decode_attention`   | `"pallas"`, `"xla_pool"`, `"xla"`                |
| `mla_decode_attention`     | `"pallas"`, `"xla_blocked"`, `"xla"`             |

* `"pallas"` (`pallas_backend`): the fused kernels, compiled on GPU/TPU for
  the shapes they support; on CPU only when named (interpret mode).
* `"xla_blocked"` (`xla_blocked`): flash-decoding in XLA whose work follows the
  live length, not the capacity; picked on CPU for every cache of more than
  256 slots (float, 16-bit or int8/fp8).
* `"xla_pool"` (`paged`): scans the page pool in place; picked when the pool
  is smaller than the gathered view (P < B * pages_per_seq).
* `"xla"` (`xla`, `paged`): the plain XLA path; runs everywhere.

The public function checks its arguments once
(`pallas_kernels.attention_common`) and raises `ValueError`/`TypeError` before
any backend runs; backends trust them. `implementation=` is a backend name, a
sequence of names to try in that order, or None for the default order. A
backend that cannot handle the device, shapes or options raises
`NotImplementedError` and the next one is tried; when none is left, the
`NotImplementedError` says why each declined (a single name: its own error).

A backend is `fn(*args, explicit: bool, **options)` with the operation's
arguments; `explicit` is True when the caller named it, and a backend may then
run where it would not be picked by default (a Pallas kernel in interpret mode
on CPU). Options with value None (no quantization scales) are not passed.

The newest token apart: `decode_attention(..., k_new=, v_new=)` runs only the
backends of `APPENDS_NEWEST` (the XLA ones), and `appends_newest(implementation)`
tells a caller beforehand whether its request will run one of them (a dense
cache's decode step then attends the cache from before the token's write; else it
writes first). The cache asks; the table and the platform rules stay here.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp

from kvattn import _checks
from kvattn.ops import xla_paged
from kvattn.ops import pallas
from kvattn.ops import xla
from kvattn.ops import xla_blocked
from pallas_kernels import attention_common as common

Implementation = Callable[..., jax.Array]


def _runs_anywhere(fn: Callable[..., jax.Array]) -> Implementation:
  """A backend for `fn`, which takes every device, shape and option."""

  def backend(*args, explicit: bool, **options):
    del explicit
    return fn(*args, **options)

  backend.__name__ = backend.__qualname__ = fn.__name__
  return backend


IMPLEMENTATIONS: dict[str, dict[str, Implementation]] = {
    "decode_attention": {
        "pallas": pallas._decode,  # pylint: disable=protected-access
        "xla_blocked": xla_blocked._decode,  # pylint: disable=protected-access
        "xla": _runs_anywhere(xla.decode_attention_xla),
    },
    "paged_decode_attention": {
        "pallas": pallas._paged_decode,  # pylint: disable=protected-access
        "xla_pool": xla_paged._xla_pool,  # pylint: disable=protected-access
        "xla": _runs_anywhere(xla_paged.paged_decode_attention_xla),
    },
    "mla_decode_attention": {
        "pallas": pallas._mla_decode,  # pylint: disable=protected-access
        "xla_blocked": xla_blocked._mla_decode,  # pylint: disable=protected-access
        "xla": _runs_anywhere(xla.mla_decode_attention_xla),
    },
}


APPENDS_NEWEST: dict[str, set[str]] = {"decode_attention": {"xla_blocked", "xla"}}
"""Per operation, the backends that take the newest token apart from the cache (`k_new=`,
`v_new=` of `decode_attention`); the others read it from the cache (written first)."""

DEFAULT_PLATFORMS: dict[str, tuple[str, ...]] = {
    "pallas": pallas._COMPILED_PLATFORMS,  # pylint: disable=protected-access
}
"""Backends that `implementation=None` runs only on these platforms (`jax.default_backend()`;
elsewhere they decline unless named). A backend not listed may run anywhere."""


def _backends(op: str) -> dict[str, Implementation]:
  if op not in IMPLEMENTATIONS:
    raise ValueError(f"op must be one of {sorted(IMPLEMENTATIONS)}; got {op!r}")
  return IMPLEMENTATIONS[op]


def available_implementations(op: str = "decode_attention") -> tuple[str, ...]:
  """Backend names of `op`, in the order `implementation=None` tries them."""
  return tuple(_backends(op))


def register_implementation(op: str, name: str, fn: Implementation, *,
                            preferred: bool = False, appends_newest: bool = False) -> None:
  """Adds (or replaces) backend `name` of operation `op` in `IMPLEMENTATIONS`.

  For backends outside kvattn (kvattn's own are declared in the table). `fn`
  follows the backend contract of the module doc. The new backend goes first
  in the default order with `preferred=True`, else last (where None reaches
  it only if every other backend declines). `appends_newest=True` declares
  that it takes `k_new=` / `v_new=` (`decode_attention`; `APPENDS_NEWEST`).

  Raises:
    ValueError: `op` is not one of the operations above.
  """
  impls = {k: v for k, v in _backends(op).items() if k != name}
  IMPLEMENTATIONS[op] = {name: fn, **impls} if preferred else {**impls, name: fn}
  appending = APPENDS_NEWEST.setdefault(op, set())
  if appends_newest:
    appending.add(name)
  else:
    appending.discard(name)


def appends_newest(implementation: str | Sequence[str] | None = None, *,
                   op: str = "decode_attention") -> bool:
  """Whether `op` with `implementation` runs a backend that takes the newest token apart.

  The dispatcher's answer for a caller that can give its request either way (a
  cache's decode step, `KVCache.update_attend`): True when every backend the
  request may run is in `APPENDS_NEWEST`, so the caller passes the cache from
  before the token's write and the token as `k_new=` / `v_new=`; False when one
  of them reads the token from the cache, so the caller writes first. The
  backends the request may run: the named ones, or for None those of the default
  order that run on this platform (`DEFAULT_PLATFORMS`: `"pallas"` on GPU and TPU).
  Given `k_new`, `decode_attention` itself tries only the backends that take it.

  Raises:
    ValueError: an unknown `op` or `implementation`.
  """
  names = _names(op, implementation)
  if names is None:
    platform = jax.default_backend()
    names = tuple(n for n in _backends(op) if platform in DEFAULT_PLATFORMS.get(n, (platform,)))
  return all(n in APPENDS_NEWEST.get(op, ()) for n in names)


def _names(op: str, implementation: Any) -> tuple[str, ...] | None:
  """Checks `implementation` (None, a name, or a sequence of names) against `op`'s table."""
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
             **options: Any) -> jax.Array:
  """Runs `op` with the named backend(s), or the first in the default order that fits.

  Arguments are not checked here (the public functions do that first).
  """
  impls = _backends(op)
  names = _names(op, implementation)
  newest = options.get("k_new") is not None  # only backends that take it apart can run
  if isinstance(implementation, str):
    _takes_newest(op, implementation, newest)
    return impls[implementation](*args, explicit=True, **options)
  explicit = names is not None
  errors = []
  for name in names or impls:
    try:
      _takes_newest(op, name, newest)
      return impls[name](*args, explicit=explicit, **options)
    except NotImplementedError as e:
      errors.append(f"{name}: {e}")
  raise NotImplementedError(f"no {op} implementation fits: " + "; ".join(errors))


def _takes_newest(op: str, name: str, newest: bool) -> None:
  if newest and name not in APPENDS_NEWEST.get(op, ()):
    raise NotImplementedError(f"{name} reads the newest token from the cache (k_new / v_new "
                              f"are for {sorted(APPENDS_NEWEST.get(op, ()))})")


def _given(**options: Any) -> dict[str, Any]:
  """The scale options that were given (a float cache passes none to a backend)."""
  return {k: v for k, v in options.items() if v is not None}


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
  """Attention of one new token per sequence against a dense KV cache.

  Sequence b's query sits at slot `lengths[b] - 1` (the new token has already
  been written) and attends slots `[max(0, lengths[b] - window), lengths[b])`;
  query head n reads KV head `n // (N // K)`.

  Args:
    q: `[B, N, H]` queries.
    k: `[B, K, S, H]` keys; slots at or past `lengths[b]` may hold anything.
      Float, or int8 / float8_e4m3fn / float8_e5m2 with `k_scale`.
    v: `[B, K, S, Hv]` values (same dtype as k).
    lengths: `i32[B]` valid slots per sequence, in `[0, S]`: checked when
      concrete (an eager call); under jit a length past S reads the S slots
      (an overflowed cache) and a negative one reads nothing (zeros).
    sm_scale: logit scale, default `1/sqrt(H)`.
    window: sliding-window size in tokens, or None.
    soft_cap: logit soft cap, or None.
    k_scale, v_scale: `f32[B, K, S]` per-slot scales of a quantized cache
      (key `k[b, h, s] * k_scale[b, h, s]`), applied inside the attention
      computation (no dequantized copy of the cache); None for float caches.
    k_new, v_new: the newest token's key `[B, K, H]` and value `[B, K, Hv]`
      (float; dequantized for a quantized cache), given apart from the cache:
      slot `lengths[b] - 1` of k / v is then not read and may hold anything,
      so a caller can pass the cache from before the token's write (XLA:CPU
      then need not copy the written buffer; `KVCache.update_attend`). Under
      jit a row with `lengths[b] > S` (overflowed: its token was dropped)
      attends the cache alone. Both or neither; only the backends of
      `APPENDS_NEWEST` take them (the others are skipped: `appends_newest()`
      tells a caller beforehand whether one of them runs).
    implementation: `"pallas"` (the fused kernel; picked by None on GPU/TPU
      for the shapes it supports, interpreted on CPU when named),
      `"xla_blocked"` (flash-decoding in XLA reading only the attended
      span; picked by None on CPU for caches of more than 256 slots),
      `"xla"` (the plain XLA path, reading every slot), a
      sequence of these to try in order, or None to take the first in
      `available_implementations()` that supports the device, dtypes and
      shapes.

  Returns:
    `[B, N, Hv]` in q's dtype, accumulated in f32; length-0 rows are zeros.

  Raises:
    ValueError: unknown `implementation`; shapes/options that do not fit; a
      concrete (eager) length outside `[0, S]`, naming it (`lengths[1] = -2`).
    TypeError: non-float inputs, k/v dtype mismatch, non-integer lengths, a
      quantized cache without scales (or scales for a float cache).
    NotImplementedError: the named implementation(s) cannot run these shapes.
  """
  lengths = common.check_decode_args(q, k, v, lengths, window, soft_cap, sm_scale, k_scale,
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
      common.floating(name, x)
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
  """Attention of one new token per sequence against a paged KV cache.

  PagedAttention (Kwon et al., SOSP 2023, §4.1): sequence b's slot s lives in
  slot `s % page_size` of page `block_tables[b, s // page_size]`. The query
  sits at slot `lengths[b] - 1` (its token already written) and attends slots
  `[max(0, lengths[b] - window), lengths[b])` with scaled dot-product
  attention (Vaswani et al. 2017, eq. 1); query head n reads KV head
  `n // (N // K)`.

  Args:
    q: `[B, N, H]` queries.
    k_pages: `[K, P, page_size, H]` key page pool.
    v_pages: `[K, P, page_size, Hv]` value page pool (same dtype as k_pages).
    block_tables: `i32[B, pages_per_seq]` physical page of each logical page;
      entries outside `[0, P)` mean "no page" (only allowed at or past
      `ceil(lengths[b] / page_size)`).
    lengths: `i32[B]` valid tokens per sequence.
    sm_scale: logit scale, default `1/sqrt(H)`.
    window: sliding-window size in tokens, or None.
    soft_cap: logit soft cap (`cap * tanh(s / cap)`), or None.
    k_scale, v_scale: `f32[K, P, page_size]` scale pools of int8/fp8 page
      pools (`PagedKVCache.scale_kwargs()`), applied inside the attention
      computation; None for float pools.
    implementation: `"pallas"`, `"xla_pool"`, `"xla"`, a sequence of them, or
      None (the first backend that fits the device: the Pallas kernel on
      GPU/TPU; on CPU the pool scan when the pool is smaller than the
      gathered view, else the XLA gather path).

  Lengths the block table does not cover: every row's length is clamped to
  `[0, paged.assigned_slots(block_tables, P, page_size)[b]]` (the leading assigned
  pages) before any backend runs, so no backend ever reads a page the row
  does not own (an unassigned entry is never resolved to another sequence's
  page) and all backends agree. This only matters under jit after an update
  past the assigned pages dropped tokens: those tokens are not attended, and
  `PagedKVCache.overflowed` tells which rows lost some. With concrete
  (eager) lengths and block tables such inputs raise instead.

  Returns:
    `[B, N, Hv]` in q's dtype, f32-accumulated; length-0 rows are zeros.

  Raises:
    ValueError: unknown `implementation`; shapes or options that do not fit;
      and, when `lengths` and `block_tables` are concrete, a length outside
      `[0, pages_per_seq * page_size]`, a page a sequence uses that the table
      does not assign, or one page used twice (`check_block_tables`).
    TypeError: non-float q/pages, k/v dtype mismatch, non-integer tables/lengths.
    NotImplementedError: the named implementation cannot run these shapes here.
  """
  lengths = common.check_paged_args(q, k_pages, v_pages, block_tables, lengths, window=window,
                                    soft_cap=soft_cap, sm_scale=sm_scale, k_scale=k_scale,
                                    v_scale=v_scale)
  num_pages, page_size = k_pages.shape[1], k_pages.shape[2]
  xla_paged.check_block_tables(block_tables, lengths, num_pages, page_size)
  # Under jit the lengths may run past the assigned pages (dropped tokens): read only those.
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
  """Absorbed MLA decode (DeepSeek-V2 appendix C) against a latent cache.

  Single-KV-head attention with key `[c_kv | k_rope]` (width C + R) and value
  `c_kv` (width C): logits `(q_latent . c_kv + q_rope . k_rope) * sm_scale`.
  The query sits at slot `lengths[b] - 1`.

  Args:
    q_latent: `[B, N, C]` query with W_UK absorbed.
    q_rope: `[B, N, R]` RoPE part of the query.
    c_kv: `[B, S, C]` latent cache; `k_rope: [B, S, R]` shared RoPE keys
      (same dtype as c_kv). Slots at or past `lengths[b]` may hold anything.
    lengths: `i32[B]` valid slots per sequence, in `[0, S]` (checked when
      concrete; under jit clamped to it, as in `decode_attention`).
    sm_scale: required, `1/sqrt(qk_nope_head_dim + qk_rope_head_dim)`.
    window: sliding-window size in tokens, or None.
    c_kv_scale, k_rope_scale: `f32[B, S]` per-token scales of a quantized
      (int8/fp8) latent cache, applied inside the computation; None for float.
    implementation: `"pallas"`, `"xla_blocked"`, `"xla"`, a sequence of
      them or None, as in `decode_attention`.

  Returns:
    `[B, N, C]` attention-weighted latent in q_latent's dtype (apply W_UV
    afterwards); length-0 rows are zeros.

  Raises:
    ValueError/TypeError: as `decode_attention`, naming the argument (a concrete
      length outside `[0, S]` included).
    NotImplementedError: the named implementation(s) cannot run these shapes.
  """
  lengths = common.check_mla_decode_args(q_latent, q_rope, c_kv, k_rope, lengths, sm_scale,
                                         window, c_kv_scale, k_rope_scale)
  _checks.values_in_range("lengths", lengths, 0, c_kv.shape[1])
  return dispatch("mla_decode_attention", implementation, q_latent, q_rope, c_kv, k_rope,
                  lengths, sm_scale=sm_scale, window=window,
                  **_given(c_kv_scale=c_kv_scale, k_rope_scale=k_rope_scale))
