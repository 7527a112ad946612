"""The fused decode kernel over a rotated codebook store (3/4-bit codes), in interpret mode.

Both schedules ("loop" = Triton GPU, "grid" = Mosaic TPU) against the kernel's own f32
reference (which unpacks with integer division and decodes the store up front), over
slot-range edges (length 0, 1, block - 1, block, block + 1, Sq), a store whose size is no
multiple of the block (the "loop" schedule's last block shifted back, the "grid" schedule's
running past Sq), ranges starting inside the store, G = 1 and G > the G tile, splits, a
soft cap, bf16 queries, the rotation applied around the kernel, and garbage (random codes,
NaN scales) in every slot outside the attended range. Only jax and numpy are needed: the
store is coded here with numpy; tests/kvattn/caches/test_rotated_pallas.py checks the kernel
through the cache, whose quantizer is kvattn's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import rotated_decode as rd
from tests.pallas_kernels._helpers import TOL, KernelTest, check_store_kernel, jitted

_reference = jitted(rd.rotated_decode_attention_reference)

# Max 1960's Lloyd-Max levels of N(0, 1) (3 bits); 4 bits: a deliberately asymmetric
# table (a calibrated codebook need not be symmetric).
CODEBOOKS = {3: (-2.152, -1.344, -0.756, -0.245, 0.245, 0.756, 1.344, 2.152),
             4: tuple(np.round(np.linspace(-2.6, 2.9, 16) ** 3 / 4 + np.linspace(-1, 1, 16),
                               4).tolist())}
# (key block, Sq): neither store a multiple of its block.
SIZES = {"loop": (32, 3 * 32 + 8), "grid": (128, 128 + 8)}


def _edges(schedule):
  bk, sq = SIZES[schedule]
  return (0, 1, bk - 1, bk, bk + 1, sq)


def _pack(codes, bits):
  """numpy `u8[..., H * bits / 8]` (module doc of rotated_decode)."""
  if bits == 4:
    c = codes.reshape(codes.shape[:-1] + (-1, 2)).astype(np.uint8)
    return c[..., 0] | (c[..., 1] << 4)
  c = codes.reshape(codes.shape[:-1] + (-1, 8)).astype(np.uint32)
  word = np.sum(c << (np.arange(8, dtype=np.uint32) * 3), axis=-1)
  out = (word[..., None] >> (np.arange(3, dtype=np.uint32) * 8)) & 0xFF
  return out.astype(np.uint8).reshape(codes.shape[:-1] + (-1,))


def _code(x, bits):
  """numpy per-token RMS scale (f16) and nearest-level codes of `x [..., H]`."""
  levels = np.asarray(CODEBOOKS[bits], np.float32)
  scale = np.sqrt(np.mean(x * x, axis=-1)).astype(np.float16)
  y = x / scale.astype(np.float32)[..., None]
  codes = np.searchsorted((levels[1:] + levels[:-1]) / 2, y)
  return _pack(codes, bits), scale


def _store(batch, num_kv, head_dim, bits, sq, seed=0):
  """`(k_codes, k_scale, v_codes, v_scale)` of `batch` rows of Sq random tokens."""
  rng = np.random.default_rng(seed)
  k = rng.standard_normal((batch, num_kv, sq, head_dim)).astype(np.float32) * 1.5
  v = rng.standard_normal((batch, num_kv, sq, head_dim)).astype(np.float32)
  kc, ks = _code(k, bits)
  vc, vs = _code(v, bits)
  return [jnp.asarray(a) for a in (kc, ks, vc, vs)]


def _poison(store, starts, lengths, seed=1):
  """Random codes and NaN scales in every slot outside `[starts, lengths)`."""
  rng = np.random.default_rng(seed)
  kc, ks, vc, vs = (np.array(a) for a in store)
  slots = np.arange(kc.shape[2])[None, :]
  unused = (slots < np.asarray(starts)[:, None]) | (slots >= np.asarray(lengths)[:, None])
  for b in range(len(unused)):
    for codes in (kc, vc):
      codes[b][:, unused[b]] = rng.integers(0, 256, codes[b][:, unused[b]].shape)
    for scale in (ks, vs):
      scale[b][:, unused[b]] = np.nan
  return [jnp.asarray(a) for a in (kc, ks, vc, vs)]


def _rotation(num_kv, head_dim, seed=3):
  """`f32[K, H, H]` random orthogonal matrices (QR of Gaussians)."""
  rng = np.random.default_rng(seed)
  return jnp.asarray(np.stack([np.linalg.qr(rng.standard_normal((head_dim, head_dim)))[0]
                               for _ in range(num_kv)]), jnp.float32)


CASES = [  # (bits, schedule, N, K, H, block_g, starts, soft_cap, rotation, q dtype)
    (3, "loop", 4, 4, 64, None, "zero", None, False, jnp.float32),     # G = 1
    (4, "grid", 16, 1, 64, 8, "inside", 20.0, True, jnp.float32),      # G = 16 > tile 8
    (4, "loop", 32, 1, 16, 16, "inside", None, True, jnp.bfloat16),    # G = 32 > tile 16
    (3, "grid", 4, 4, 64, None, "inside", None, False, jnp.bfloat16),  # G = 1, bf16 -> 16
    (4, "loop", 8, 2, 32, None, "zero", 20.0, False, jnp.float32),
    (3, "grid", 8, 2, 128, None, "zero", None, True, jnp.float32),
]
# The "grid" schedule, G > tile, soft cap, rotation; 3 bits and the "loop" schedule (its
# shifted last block): test_blocks_outside_the_range_are_not_processed; the "loop" schedule
# over edges, window and soft cap: tests/kvattn/caches/test_rotated_pallas.py.
FAST = {1}


def _starts(kind, lengths):
  if kind == "zero":
    return jnp.zeros_like(lengths)
  return jnp.maximum(lengths - 21, 0)  # 21: not a multiple of the block


@pytest.mark.parametrize(
    "bits,schedule,num_heads,num_kv,head_dim,block_g,starts,soft_cap,rotate,q_dtype", [
        case if i in FAST else pytest.param(*case, marks=pytest.mark.slow)
        for i, case in enumerate(CASES)])
def test_kernel_matches_reference_over_edges_and_ignores_garbage(
    bits, schedule, num_heads, num_kv, head_dim, block_g, starts, soft_cap, rotate, q_dtype):
  _check_case(bits, schedule, num_heads, num_kv, head_dim, block_g, starts, soft_cap, rotate,
              q_dtype, interpret=True)


class TestCompiled(KernelTest):
  """Every case compiled on a GPU (its "loop" cases) or TPU ("grid"); skipped on CPU.
  experiments/gpu_check.sh runs this class."""

  @pytest.mark.parametrize("case", CASES)
  def test_kernel_matches_reference(self, case):
    bits, schedule, *rest = case
    self._schedule(schedule)
    self._require(rd.unsupported_reason(case[4], SIZES[schedule][1]))
    _check_case(bits, schedule, *rest, interpret=False)


def _check_case(bits, schedule, num_heads, num_kv, head_dim, block_g, starts, soft_cap, rotate,
                q_dtype, *, interpret):
  edges = _edges(schedule)
  block_k, sq = SIZES[schedule]
  batch = len(edges)
  store = _store(batch, num_kv, head_dim, bits, sq)
  q = jax.random.normal(jax.random.key(2), (batch, num_heads, head_dim)).astype(q_dtype)
  lengths = jnp.asarray(edges, jnp.int32)
  starts = _starts(starts, lengths)
  rotation = _rotation(num_kv, head_dim) if rotate else None
  kw = dict(bits=bits, codebook=CODEBOOKS[bits], rotation=rotation, soft_cap=soft_cap,
            return_lse=True)
  run = lambda s: rd.rotated_decode_attention(
      q, *s, starts, lengths, interpret=interpret, schedule=schedule, block_k=block_k,
      block_g=block_g, num_splits=2, **kw)
  ref, ref_lse = _reference(q, *store, starts, lengths, **kw)
  check_store_kernel(run, store, _poison(store, starts, lengths), ref, ref_lse, q_dtype,
                     (batch, num_heads, head_dim), TOL[q_dtype])


def test_blocks_outside_the_range_are_not_processed():
  block_k, sq = SIZES["loop"]  # 4 blocks of 32, the last shifted back to [72, 104)
  lengths = jnp.asarray([0, 1, block_k, block_k + 1, sq, sq], jnp.int32)
  starts = jnp.asarray([0, 0, block_k - 1, 2 * block_k, 0, sq - 1], jnp.int32)
  store = _store(6, 1, 16, 3, sq)
  q = jax.random.normal(jax.random.key(3), (6, 1, 16))
  (out, lse), counts = rd.rotated_decode_attention(
      q, *store, starts, lengths, bits=3, codebook=CODEBOOKS[3], interpret=True,
      schedule="loop", block_k=block_k, num_splits=1, count_blocks=True, return_lse=True)
  # [starts, lengths) touches blocks none; 0; 0; none (start 64 > length 33); 0-3; 3.
  np.testing.assert_array_equal(np.asarray(counts)[:, 0], [0, 1, 1, 0, 4, 1])
  # The last row attends only slot Sq - 1 (read by the shifted block): its output is that
  # slot's value, its lse the one logit.
  k = rd.dequantize_reference(store[0], store[1], 3, CODEBOOKS[3])
  np.testing.assert_allclose(np.asarray(lse[5, 0]), np.asarray(q[5, 0] @ k[5, 0, sq - 1]) / 4,
                             rtol=1e-5, atol=1e-5)
  v = rd.dequantize_reference(store[2], store[3], 3, CODEBOOKS[3])
  np.testing.assert_allclose(np.asarray(out[5, 0]), np.asarray(v[5, 0, sq - 1]), rtol=1e-5,
                             atol=1e-5)


def test_reference_unpacks_and_decodes_a_hand_computed_store():
  codes = [1, 2, 3, 4, 5, 6, 7, 0]
  word = sum(c << (3 * i) for i, c in enumerate(codes))
  packed = jnp.asarray([[word & 255, (word >> 8) & 255, word >> 16]], jnp.uint8)
  assert rd.unpack_reference(packed, 3)[0].tolist() == codes
  assert rd.unpack_reference(jnp.asarray([[0x5A]], jnp.uint8), 4).tolist() == [[0xA, 0x5]]
  np.testing.assert_array_equal(np.asarray(_pack(np.asarray([codes]), 3)), packed)
  x = rd.dequantize_reference(packed, jnp.asarray([2.0]), 3, CODEBOOKS[3])
  np.testing.assert_allclose(x[0], [2 * CODEBOOKS[3][c] for c in codes], rtol=1e-6)
  # The unpack matrix puts channel c's word in lane c: word 8 j + i of bytes 3 j .. 3 j + 2.
  e = rd.unpack_matrix(16, 3)
  assert e.shape == (6, 16) and e[3:, 8].tolist() == [1.0, 256.0, 65536.0]
  assert e[:3, 8].tolist() == [0, 0, 0] and rd.unpack_matrix(8, 4)[2].tolist() == [0, 0, 0, 0,
                                                                                   1, 1, 0, 0]


def _args():
  return dict(q=jnp.zeros((2, 4, 16)), k_codes=jnp.zeros((2, 2, 32, 8), jnp.uint8),
              k_scale=jnp.zeros((2, 2, 32), jnp.float16),
              v_codes=jnp.zeros((2, 2, 32, 8), jnp.uint8),
              v_scale=jnp.zeros((2, 2, 32), jnp.float16),
              starts=jnp.zeros((2,), jnp.int32), lengths=jnp.zeros((2,), jnp.int32))


@pytest.mark.parametrize("change,error,match", [
    ({"bits": 2}, ValueError, "bits must be one of"),
    ({"codebook": (0.0, 1.0)}, ValueError, "codebook must hold 16 increasing"),
    ({"codebook": tuple(range(16))[::-1]}, ValueError, "codebook must hold 16 increasing"),
    ({"k_codes": jnp.zeros((2, 2, 32, 8), jnp.int8)}, TypeError, "k_codes must be uint8"),
    ({"v_codes": jnp.zeros((2, 2, 32, 4), jnp.uint8)}, ValueError, "v_codes must have shape"),
    ({"k_scale": jnp.zeros((2, 2, 31), jnp.float16)}, ValueError, "k_scale must have shape"),
    ({"v_scale": jnp.zeros((2, 2, 32), jnp.int32)}, TypeError, "v_scale must be floating"),
    ({"rotation": jnp.zeros((2, 16, 8))}, ValueError, "rotation must have shape"),
    ({"lengths": jnp.zeros((3,), jnp.int32)}, ValueError, "lengths must be i32"),
    ({"starts": jnp.zeros((2,), jnp.float32)}, TypeError, "starts must be integers"),
    ({"q": jnp.zeros((2, 3, 16))}, ValueError, "num_heads must be divisible by"),
    ({"q": jnp.zeros((2, 4, 12)), "bits": 3, "codebook": CODEBOOKS[3]}, ValueError, "head_dim must be a multiple of 8"),
    ({"soft_cap": -1.0}, ValueError, "soft_cap"),
    ({"block_k": 24}, ValueError, "block_k must be a power of two >= 16"),
    ({"block_k": 64}, ValueError, r"block_k must be a power of two >= 16 and <= Sq = 32"),
    ({"schedule": "grid", "block_k": 16}, ValueError, "block_k must be a multiple of 128"),
])
def test_bad_arguments_raise(change, error, match):
  args = _args()
  kwargs = dict(bits=4, codebook=CODEBOOKS[4], interpret=True)
  for name, value in change.items():
    (args if name in args else kwargs)[name] = value
  with pytest.raises(error, match=match):
    rd.rotated_decode_attention(*args.values(), **kwargs)


def test_unsupported_reason():
  assert rd.unsupported_reason(64, 256, platform="cuda") is None
  assert rd.unsupported_reason(64, 256, platform="tpu") is None
  assert "power of two" in rd.unsupported_reason(48, 256, platform="cuda")
  assert "16-slot block" in rd.unsupported_reason(64, 8, platform="cuda")
  assert "multiple of 64" in rd.unsupported_reason(32, 256, platform="tpu")
  assert "no compiled Pallas backend" in rd.unsupported_reason(64, 256, platform="cpu")
