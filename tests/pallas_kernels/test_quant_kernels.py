"""The fused decode kernel over quantized (int8 / fp8) caches, in interpret mode.

Both schedules ("loop" = Triton GPU, "grid" = Mosaic TPU) against the kernel's
own f32 reference (which dequantizes up front), over length edges, windows,
splits, a bf16 query and garbage in unused slots; MLA's two-part key with a
scale per part. Only jax is needed (quantization is written out in _helpers.py).
"""

from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import dense_decode as da
from tests.pallas_kernels._helpers import FORMATS, TOL, jitted, poison, quantize
_reference = jitted(da.decode_attention_reference)
_mla_reference = jitted(da.mla_decode_attention_reference)

BLOCK = 32  # a multiple of the "grid" schedule's 1-byte sublane granule (32)
S = 4 * BLOCK
EDGES = (0, 1, BLOCK - 1, BLOCK, BLOCK + 1, S)


def _dense(num_heads, num_kv, head_dim, seed=0):
  rng = np.random.default_rng(seed)
  b = len(EDGES)
  return tuple(jnp.asarray(rng.standard_normal(s), jnp.float32) for s in (
      (b, num_heads, head_dim), (b, num_kv, S, head_dim), (b, num_kv, S, head_dim)))


CASES = [  # (format, schedule, N, K, window, q dtype)
    ("int8", "loop", 8, 2, None, jnp.float32),
    ("int8", "grid", 8, 1, 40, jnp.float32),
    ("e4m3", "loop", 8, 8, 40, jnp.bfloat16),
    ("e4m3", "grid", 8, 2, None, jnp.float32),
    ("e5m2", "loop", 4, 1, None, jnp.float32),
    ("e5m2", "grid", 8, 2, None, jnp.bfloat16),
]


# Interpreted by default: one case per format (the rest, and the full grid, are slow).
@pytest.mark.parametrize("name,schedule,num_heads,num_kv,window,q_dtype", [
    case if case[:2] in (("int8", "grid"), ("e4m3", "loop"), ("e5m2", "loop"))
    else pytest.param(*case, marks=pytest.mark.slow) for case in CASES])
def test_dense_kernel_matches_reference_over_edges(name, schedule, num_heads, num_kv, window,
                                                   q_dtype):
  q, k, v = _dense(num_heads, num_kv, 16)
  q = q.astype(q_dtype)
  kq, ks = quantize(k, name)
  vq, vs = quantize(v, name)
  lengths = jnp.asarray(EDGES, jnp.int32)
  out, lse = da.decode_attention(q, kq, vq, lengths, k_scale=ks, v_scale=vs, window=window,
                                 interpret=True, schedule=schedule, block_k=BLOCK,
                                 num_splits=2, return_lse=True)
  ref, ref_lse = _reference(q, kq, vq, lengths, k_scale=ks, v_scale=vs, window=window,
                            return_lse=True)
  assert out.dtype == q_dtype
  np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32),
                             atol=TOL[q_dtype], rtol=TOL[q_dtype])
  finite = np.isfinite(np.asarray(ref_lse))
  np.testing.assert_allclose(np.asarray(lse)[finite], np.asarray(ref_lse)[finite],
                             atol=10 * TOL[q_dtype], rtol=TOL[q_dtype])
  np.testing.assert_array_equal(np.asarray(out[0], np.float32), 0.0)  # length 0
  # Garbage outside the attended range changes nothing.
  kp, ksp = poison(kq, ks, lengths, window, 2)
  vp, vsp = poison(vq, vs, lengths, window, 2)
  dirty = da.decode_attention(q, kp, vp, lengths, k_scale=ksp, v_scale=vsp, window=window,
                              interpret=True, schedule=schedule, block_k=BLOCK, num_splits=2)
  np.testing.assert_array_equal(np.asarray(dirty, np.float32), np.asarray(out, np.float32))


@pytest.mark.slow
@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("schedule", ["loop", "grid"])
@pytest.mark.parametrize("num_heads,num_kv", [(8, 8), (8, 2), (8, 1), (48, 2)])
@pytest.mark.parametrize("window", [None, 40])
@pytest.mark.parametrize("q_dtype", [jnp.float32, jnp.bfloat16])
def test_dense_kernel_full_grid(name, schedule, num_heads, num_kv, window, q_dtype):
  test_dense_kernel_matches_reference_over_edges(name, schedule, num_heads, num_kv, window,
                                                 q_dtype)


def test_reference_dequantizes_with_the_scales():
  q, k, v = _dense(2, 1, 16)
  kq, ks = quantize(k, "int8")
  vq, vs = quantize(v, "int8")
  lengths = jnp.asarray(EDGES, jnp.int32)
  ref = da.decode_attention_reference(q, kq, vq, lengths, k_scale=ks, v_scale=vs)
  by_hand = da.decode_attention_reference(q, kq.astype(jnp.float32) * ks[..., None],
                                          vq.astype(jnp.float32) * vs[..., None], lengths)
  np.testing.assert_array_equal(ref, by_hand)
  # And it is the f32 result up to int8's error (unit-normal data, H = 16).
  exact = da.decode_attention_reference(q, k, v, lengths)
  assert 0 < float(jnp.abs(ref - exact).max()) < 0.03


def test_result_independent_of_blocks_and_splits():
  q, k, v = _dense(8, 2, 16, seed=3)
  kq, ks = quantize(k, "e4m3")
  vq, vs = quantize(v, "e4m3")
  lengths = jnp.asarray(EDGES, jnp.int32)
  outs = [da.decode_attention(q, kq, vq, lengths, k_scale=ks, v_scale=vs, interpret=True,
                              block_k=bk, num_splits=ns)
          for bk, ns in ((16, 1), (32, 3))]
  for out in outs[1:]:
    np.testing.assert_allclose(out, outs[0], atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("name,schedule", [
    pytest.param("int8", "grid", marks=pytest.mark.slow), ("e4m3", "loop"),
    pytest.param("e5m2", "loop", marks=pytest.mark.slow)])
def test_mla_kernel_scales_each_part(name, schedule):
  rng = np.random.default_rng(5)
  b = len(EDGES)
  q_lat, q_rope, c_kv, k_rope = (jnp.asarray(rng.standard_normal(s), jnp.float32) for s in (
      (b, 4, 32), (b, 4, 16), (b, S, 32), (b, S, 16)))
  k_rope = k_rope * 50.0  # another magnitude than c_kv: one scale each
  cq, cs = quantize(c_kv, name)
  rq, rs = quantize(k_rope, name)
  lengths = jnp.asarray(EDGES, jnp.int32)
  out = da.mla_decode_attention(q_lat, q_rope, cq, rq, lengths, sm_scale=0.02, c_kv_scale=cs,
                                k_rope_scale=rs, interpret=True, schedule=schedule,
                                block_k=BLOCK, num_splits=2)
  ref = _mla_reference(q_lat, q_rope, cq, rq, lengths, sm_scale=0.02, c_kv_scale=cs,
                       k_rope_scale=rs)
  np.testing.assert_allclose(out, ref, atol=2e-5, rtol=2e-5)
  cp, csp = poison(cq, cs, lengths, None, 1)
  rp, rsp = poison(rq, rs, lengths, None, 1)
  dirty = da.mla_decode_attention(q_lat, q_rope, cp, rp, lengths, sm_scale=0.02,
                                  c_kv_scale=csp, k_rope_scale=rsp, interpret=True,
                                  schedule=schedule, block_k=BLOCK, num_splits=2)
  np.testing.assert_array_equal(dirty, out)


def test_validation_names_the_scales():
  q, k, v = _dense(2, 1, 16)
  kq, ks = quantize(k, "int8")
  lengths = jnp.asarray(EDGES, jnp.int32)
  with pytest.raises(TypeError, match="k has the quantized dtype int8: pass its per-slot scales "
                     "k_scale"):
    da.decode_attention(q, kq, kq, lengths, interpret=True)
  with pytest.raises(TypeError, match="k_scale is only for quantized caches"):
    da.decode_attention(q, k, v, lengths, k_scale=ks, v_scale=ks, interpret=True)
  with pytest.raises(ValueError, match=r"v_scale must have shape f32\[B, K, S\]"):
    da.decode_attention(q, kq, kq, lengths, k_scale=ks, v_scale=ks[:, :, :5], interpret=True)
  assert da.unsupported_reason((1, 8, 64), (1, 2, 128, 64), None, jnp.int8,
                               platform="gpu") is None
  assert da.unsupported_reason((1, 8, 64), (1, 2, 128, 64), None, jnp.float8_e4m3fn,
                               platform="gpu") is None
  assert "not f32/bf16/int8 on TPU" in da.unsupported_reason(
      (1, 8, 64), (1, 2, 128, 64), None, jnp.float8_e5m2, platform="tpu")


@pytest.mark.skipif(jax.default_backend() not in ("gpu", "cuda", "rocm", "tpu"),
                    reason="compiled Pallas kernels need a GPU or TPU")
@pytest.mark.parametrize("name", ["int8", "e4m3", "e5m2"])
def test_compiled_kernel_matches_reference(name):
  """The compiled kernel (GPU: Triton; TPU: Mosaic, int8 only) on the same edges."""
  reason = da.unsupported_reason((1, 8, 64), (1, 2, S, 64), None, FORMATS[name][0])
  if reason is not None:
    pytest.skip(reason)
  q, k, v = _dense(8, 2, 64)
  kq, ks = quantize(k, name)
  vq, vs = quantize(v, name)
  lengths = jnp.asarray(EDGES, jnp.int32)
  out = da.decode_attention(q, kq, vq, lengths, k_scale=ks, v_scale=vs)
  ref = _reference(q, kq, vq, lengths, k_scale=ks, v_scale=vs)
  np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=2e-4, rtol=2e-4)
