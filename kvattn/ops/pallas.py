"""The "pallas" backend of the decode dispatch points (fused Pallas kernels).

Adapters from `kvattn.ops.dispatch` to `pallas_kernels.dense_decode` (dense
and MLA) and `pallas_kernels.paged_decode`. The dispatch point has checked the
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
from pallas_kernels import paged_decode as _paged_kernel

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
