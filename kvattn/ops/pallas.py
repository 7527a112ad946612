"""The "pallas" backends of `kvattn.ops.dispatch`: adapters to the fused kernels.

Each runs its kernel compiled on GPU (Triton) and TPU (Mosaic) for the shapes the
kernel's `unsupported_reason` accepts and raises `NotImplementedError` elsewhere;
named on CPU (`explicit`) it runs in interpret mode, where the GPU rules apply.
The arguments were checked by the dispatch point (or built by a cache), so the
kernels' `*_unchecked` entry points are called.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import dense_decode
from pallas_kernels import lowbit_decode
from pallas_kernels import lowbit_paged_decode
from pallas_kernels import paged_decode as paged_kernel
from pallas_kernels import rotated_decode

COMPILED_PLATFORMS = ("gpu", "cuda", "rocm", "tpu")


def _mode(explicit: bool, why_not) -> bool:
  """`interpret` for this call; NotImplementedError when the kernel cannot run here.
  `why_not(platform)` is the kernel's reason to refuse these shapes, or None."""
  platform = jax.default_backend()
  interpret = platform not in COMPILED_PLATFORMS
  if interpret and not explicit:
    raise NotImplementedError(
        f"pallas: no compiled kernel on {platform!r} (name implementation='pallas' "
        "to run it in interpret mode)")
  reason = why_not("gpu" if interpret else platform)
  if reason is not None:
    raise NotImplementedError(f"pallas: {reason}")
  return interpret


def decode(q, k, v, lengths, *, explicit, k_new=None, v_new=None, **options):
  """`dispatch.decode_attention` by `dense_decode`."""
  if k_new is not None or v_new is not None:
    raise NotImplementedError("pallas: the kernel reads the newest token from the cache "
                              "(k_new / v_new are for the XLA backends)")
  interpret = _mode(explicit, lambda platform: dense_decode.unsupported_reason(
      q.shape, k.shape, v.shape, k.dtype, platform=platform))
  return dense_decode.decode_attention_unchecked(q, k, v, lengths, interpret=interpret,
                                                 **options)


def mla_decode(q_latent, q_rope, c_kv, k_rope, lengths, *, explicit, **options):
  """`dispatch.mla_decode_attention` by `dense_decode` (C and R checked as head dims)."""
  batch, capacity, latent = c_kv.shape

  def why_not(platform):
    return (dense_decode.unsupported_reason(q_latent.shape, (batch, 1, capacity, latent), None,
                                            c_kv.dtype, platform=platform)
            or dense_decode.unsupported_reason(q_rope.shape,
                                               (batch, 1, capacity, k_rope.shape[-1]), None,
                                               c_kv.dtype, platform=platform))

  return dense_decode.mla_decode_attention_unchecked(
      q_latent, q_rope, c_kv, k_rope, lengths, interpret=_mode(explicit, why_not), **options)


def paged_decode(q, k_pages, v_pages, block_tables, lengths, *, explicit, **options):
  """`dispatch.paged_decode_attention` by `paged_decode`."""
  interpret = _mode(explicit, lambda platform: paged_kernel.unsupported_reason(
      q.shape, k_pages.shape, v_pages.shape, k_pages.dtype, platform=platform))
  return paged_kernel.paged_decode_attention_unchecked(
      q, k_pages, v_pages, block_tables, lengths, interpret=interpret, **options)


def _out_lse(result):
  out, lse = result
  return out.astype(jnp.float32), lse


def kivi_store_decode(q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, starts, lengths,
                      *, explicit, pre_rope=False, **options):
  """`(out f32[B, N, H], lse f32[B, N])` of `q: [B, N, H]` against store slots `[starts,
  lengths)` of a KIVI store (`lowbit_decode`).

  Raises:
    NotImplementedError: keys stored before RoPE (`pre_rope`), no compiled kernel here, or
      shapes the kernel does not take (`lowbit_decode.unsupported_reason`).
  """
  if pre_rope:
    raise NotImplementedError("pallas: keys stored before RoPE (pre_rope=True) are rotated "
                              "at read by the XLA loop only")
  interpret = _mode(explicit, lambda platform: lowbit_decode.unsupported_reason(
      q.shape, k_codes.shape, k_scale.shape, platform=platform))
  return _out_lse(lowbit_decode.kivi_decode_attention_unchecked(
      q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, starts, lengths,
      interpret=interpret, return_lse=True, **options))


def paged_kivi_store_decode(q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero,
                            block_tables, starts, lengths, *, explicit, pre_rope=False,
                            **options):
  """`kivi_store_decode` over page pools (`lowbit_paged_decode`)."""
  if pre_rope:
    raise NotImplementedError("pallas: keys stored before RoPE (pre_rope=True) are rotated "
                              "at read by the XLA loop only")
  interpret = _mode(explicit, lambda platform: lowbit_paged_decode.unsupported_reason(
      k_codes.shape, k_scale.shape, q.shape[-1], platform=platform))
  return _out_lse(lowbit_paged_decode.paged_kivi_decode_attention_unchecked(
      q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, block_tables, starts, lengths,
      interpret=interpret, return_lse=True, **options))


def rotated_store_decode(q, k_codes, k_scale, v_codes, v_scale, starts, lengths, *, explicit,
                         **options):
  """`kivi_store_decode` of a rotated codebook store (`rotated_decode`); q and the output
  are in the store's rotated space."""
  interpret = _mode(explicit, lambda platform: rotated_decode.unsupported_reason(
      q.shape[-1], k_codes.shape[2], platform=platform))
  return _out_lse(rotated_decode.rotated_decode_attention_unchecked(
      q, k_codes, k_scale, v_codes, v_scale, starts, lengths, interpret=interpret,
      return_lse=True, **options))
