"""The "pallas" backend of the decode dispatch points (fused Pallas kernels).

Adapters from `kvattn.ops.dispatch` to `pallas_kernels.dense_decode` (dense
and MLA) and `pallas_kernels.paged_decode`, and from the KIVI cache
(`kvattn.caches.kivi`, which has no dispatch point: its store is its own layout)
to `pallas_kernels.lowbit_decode` (`kivi_store_decode`), and from the rotated codebook
cache (`kvattn.caches.rotated`) to `pallas_kernels.rotated_decode` (`rotated_store_decode`). The dispatch point has checked the
arguments, so they call the kernels' `*_unchecked` entry points. With
`implementation=None` a kernel runs compiled on GPU (Triton lowering) and TPU
(Mosaic) for the shapes its `unsupported_reason` accepts, and raises
`NotImplementedError` everywhere else (CPU, unsupported shapes or dtypes), so the dispatcher moves on. Named explicitly on
CPU it runs in interpret mode (exact but slow; for tests and debugging), where
the GPU constraints apply.
"""

from __future__ import annotations

import jax

from pallas_kernels import dense_decode as _kernels
from pallas_kernels import lowbit_decode as _lowbit_kernel
from pallas_kernels import paged_decode as _paged_kernel
from pallas_kernels import rotated_decode as _rotated_kernel

_COMPILED_PLATFORMS = ("gpu", "cuda", "rocm", "tpu")


def _mode(explicit: bool, why_not) -> bool:
  """Returns `interpret` for this call, or raises NotImplementedError.

  `why_not(platform)` gives the reason the kernel cannot run these shapes on
  `platform`, or None. Interpret mode emulates the GPU ("loop") schedule, so
  on CPU the GPU constraints apply.
  """
  platform = jax.default_backend()
  interpret = platform not in _COMPILED_PLATFORMS
  if interpret and not explicit:
    raise NotImplementedError(
        f"pallas: no compiled kernel on {platform!r} (name implementation='pallas' "
        "to run it in interpret mode)")
  reason = why_not("gpu" if interpret else platform)
  if reason is not None:
    raise NotImplementedError(f"pallas: {reason}")
  return interpret


def _decode(q, k, v, lengths, *, explicit, sm_scale=None, window=None, soft_cap=None,
            k_scale=None, v_scale=None, k_new=None, v_new=None):
  if k_new is not None or v_new is not None:
    raise NotImplementedError("pallas: the kernel reads the newest token from the cache "
                              "(k_new / v_new are for the XLA backends)")
  interpret = _mode(explicit, lambda platform: _kernels.unsupported_reason(
      q.shape, k.shape, v.shape, k.dtype, platform=platform))
  return _kernels.decode_attention_unchecked(q, k, v, lengths, sm_scale=sm_scale, window=window,
                                             soft_cap=soft_cap, k_scale=k_scale,
                                             v_scale=v_scale, interpret=interpret)


def _mla_decode(q_latent, q_rope, c_kv, k_rope, lengths, *, explicit, sm_scale,
                window=None, c_kv_scale=None, k_rope_scale=None):
  batch, capacity, latent = c_kv.shape
  # The kernel's dot widths are C and R separately; check both as head dims.
  def why_not(platform):
    return (_kernels.unsupported_reason(q_latent.shape, (batch, 1, capacity, latent), None,
                                        c_kv.dtype, platform=platform)
            or _kernels.unsupported_reason(q_rope.shape, (batch, 1, capacity, k_rope.shape[-1]),
                                           None, c_kv.dtype, platform=platform))

  interpret = _mode(explicit, why_not)
  return _kernels.mla_decode_attention_unchecked(
      q_latent, q_rope, c_kv, k_rope, lengths, sm_scale=sm_scale, window=window,
      c_kv_scale=c_kv_scale, k_rope_scale=k_rope_scale, interpret=interpret)


def _paged_decode(q, k_pages, v_pages, block_tables, lengths, *, explicit, sm_scale=None,
                  window=None, soft_cap=None, k_scale=None, v_scale=None):
  interpret = _mode(explicit, lambda platform: _paged_kernel.unsupported_reason(
      q.shape, k_pages.shape, v_pages.shape, k_pages.dtype, platform=platform))
  return _paged_kernel.paged_decode_attention_unchecked(
      q, k_pages, v_pages, block_tables, lengths, sm_scale=sm_scale, window=window,
      soft_cap=soft_cap, k_scale=k_scale, v_scale=v_scale, interpret=interpret)


def kivi_store_decode(q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, starts, lengths, *,
                      bits, explicit, sm_scale, soft_cap=None):
  """`(out f32[B, N, H], lse f32[B, N])`: decode queries `q: [B, N, H]` against slots
  `[starts, lengths)` of a packed KIVI store (`pallas_kernels.lowbit_decode`), compiled on
  GPU / TPU, interpreted on CPU when `explicit` (the caller named "pallas").

  Raises:
    NotImplementedError: no compiled kernel here (CPU, not `explicit`), or shapes the
      compiled kernel does not take (`lowbit_decode.unsupported_reason`).
  """
  interpret = _mode(explicit, lambda platform: _lowbit_kernel.unsupported_reason(
      q.shape, k_codes.shape, k_scale.shape, platform=platform))
  out, lse = _lowbit_kernel.kivi_decode_attention_unchecked(
      q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, starts, lengths, bits=bits,
      sm_scale=sm_scale, soft_cap=soft_cap, interpret=interpret, return_lse=True)
  return out.astype(jax.numpy.float32), lse


def paged_kivi_store_decode(q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, block_tables,
                            starts, lengths, *, bits, explicit, sm_scale, soft_cap=None):
  """`kivi_store_decode` over a paged KIVI store (`lowbit_decode.paged_kivi_decode_attention`;
  compiled: "loop" on GPU, "grid" on TPU).

  Raises:
    NotImplementedError: as `kivi_store_decode` (`lowbit_decode.paged_unsupported_reason`).
  """
  interpret = _mode(explicit, lambda platform: _lowbit_kernel.paged_unsupported_reason(
      k_codes.shape, k_scale.shape, q.shape[-1], platform=platform))
  out, lse = _lowbit_kernel.paged_kivi_decode_attention_unchecked(
      q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, block_tables, starts, lengths,
      bits=bits, sm_scale=sm_scale, soft_cap=soft_cap, interpret=interpret, return_lse=True)
  return out.astype(jax.numpy.float32), lse


def rotated_store_decode(q, k_codes, k_scale, v_codes, v_scale, starts, lengths, *, bits,
                         codebook, explicit, sm_scale, soft_cap=None):
  """`(out f32[B, N, H], lse f32[B, N])`: decode queries `q: [B, N, H]` (in the store's
  rotated space) against slots `[starts, lengths)` of a rotated codebook store
  (`pallas_kernels.rotated_decode`; the output stays in the rotated space), compiled on
  GPU / TPU, interpreted on CPU when `explicit`.

  Raises:
    NotImplementedError: no compiled kernel here (CPU, not `explicit`), or a store the
      compiled kernel does not take (`rotated_decode.unsupported_reason`).
  """
  interpret = _mode(explicit, lambda platform: _rotated_kernel.unsupported_reason(
      q.shape[-1], k_codes.shape[2], platform=platform))
  out, lse = _rotated_kernel.rotated_decode_attention_unchecked(
      q, k_codes, k_scale, v_codes, v_scale, starts, lengths, bits=bits, codebook=codebook,
      sm_scale=sm_scale, soft_cap=soft_cap, interpret=interpret, return_lse=True)
  return out.astype(jax.numpy.float32), lse
