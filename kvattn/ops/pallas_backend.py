"""The "pallas" backend of the decode dispatch points (fused Pallas kernels).

Registers `pallas_kernels.decode_attention` for `"decode_attention"`,
`pallas_kernels.mla_decode_attention` for `"mla_decode_attention"` and
`pallas_kernels.paged_decode_attention` for `"paged_decode_attention"`, first
in line. With `implementation=None` a kernel runs compiled on GPU (Triton
lowering) and TPU (Mosaic) for the shapes it supports and raises
`NotImplementedError` everywhere else (CPU, soft caps for the dense kernel,
unsupported shapes or dtypes), so the dispatcher falls through to XLA. Named
explicitly (`implementation="pallas"`) on CPU it runs in interpret mode, which
is exact but slow (for tests and debugging). Quantized caches (int8/fp8 with
per-slot scales, dense or paged) go to the kernels, which dequantize each block
after loading it; where they compile for them is each kernel module's
`supported`.
"""

from __future__ import annotations

import importlib

import jax

from kvattn.ops import dispatch

# The module, not the package-level function of the same name.
_kernels = importlib.import_module("pallas_kernels.decode_attention")
_paged_kernel = importlib.import_module("pallas_kernels.paged_attention")

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
            k_scale=None, v_scale=None):
  if soft_cap is not None:
    raise NotImplementedError("pallas: soft_cap is not supported by the decode kernel")
  interpret = _mode(explicit, lambda platform: _kernels.supported(
      q.shape, k.shape, v.shape, k.dtype, platform=platform))
  return _kernels.decode_attention(q, k, v, lengths, sm_scale=sm_scale, window=window,
                                   k_scale=k_scale, v_scale=v_scale, interpret=interpret)


def _mla_decode(q_latent, q_rope, c_kv, k_rope, lengths, *, explicit, sm_scale,
                window=None, c_kv_scale=None, k_rope_scale=None):
  batch, capacity, latent = c_kv.shape
  # The kernel's dot widths are C and R separately; check both as head dims.
  def why_not(platform):
    return (_kernels.supported(q_latent.shape, (batch, 1, capacity, latent), None,
                               c_kv.dtype, platform=platform)
            or _kernels.supported(q_rope.shape, (batch, 1, capacity, k_rope.shape[-1]), None,
                                  c_kv.dtype, platform=platform))

  interpret = _mode(explicit, why_not)
  return _kernels.mla_decode_attention(q_latent, q_rope, c_kv, k_rope, lengths,
                                       sm_scale=sm_scale, window=window, c_kv_scale=c_kv_scale,
                                       k_rope_scale=k_rope_scale, interpret=interpret)


def _paged_decode(q, k_pages, v_pages, block_tables, lengths, *, explicit, sm_scale=None,
                  window=None, soft_cap=None, k_scale=None, v_scale=None):
  interpret = _mode(explicit, lambda platform: _paged_kernel.supported(
      q.shape, k_pages.shape, v_pages.shape, k_pages.dtype, platform=platform))
  return _paged_kernel.paged_decode_attention(
      q, k_pages, v_pages, block_tables, lengths, sm_scale=sm_scale, window=window,
      soft_cap=soft_cap, k_scale=k_scale, v_scale=v_scale, interpret=interpret)


dispatch.register_implementation("decode_attention", "pallas", _decode, preferred=True)
dispatch.register_implementation("mla_decode_attention", "pallas", _mla_decode,
                                 preferred=True)
dispatch.register_implementation("paged_decode_attention", "pallas", _paged_decode,
                                 preferred=True)
