"""Rotated codebook cache (kvattn/caches/rotated.py): codebooks, rotation, stored state,
attention parity with edges and garbage, calibration, bytes.

The block-by-block attention, the ring and the step are KIVI's (`kvattn.caches._residual`,
tested in test_kivi.py); here the rotated kind's own parts, and one decode step and one
chunk against the reference over the dequantized cache. (The conformance suite,
test_every_kind.py, runs rotated3 / rotated4 through the protocol's invariants.)
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kvattn import memory
from kvattn.caches import rotated
from kvattn.caches.rotated import RotatedCache
from kvattn.models import transformer
from kvattn.ops import lowbit
from tests.kvattn.caches import test_kivi

K, H = test_kivi.K, test_kivi.H
_update = jax.jit(RotatedCache.update)
_dequantized = jax.jit(RotatedCache.dequantized, static_argnums=1)


def _phi(x):
  return math.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)


def _cdf(x):
  return 0.5 * (1 + math.erf(x / math.sqrt(2)))


@pytest.mark.parametrize("bits", [3, 4])
def test_lloyd_max_table_is_the_normal_fixed_point(bits):
  """Each level is the mean of N(0, 1) over its cell (cells cut at the midpoints), to the
  table's rounding: Lloyd-Max's centroid condition, from the closed form."""
  levels = rotated.named_codebook("lloyd-max", bits)
  assert len(levels) == 1 << bits and np.all(np.diff(levels) > 0)
  np.testing.assert_allclose(levels, -np.asarray(levels[::-1]))  # symmetric
  cuts = [-math.inf] + [(a + b) / 2 for a, b in zip(levels, levels[1:])] + [math.inf]
  for level, lo, hi in zip(levels, cuts, cuts[1:]):
    mean = (_phi(lo) - _phi(hi)) / (_cdf(hi) - _cdf(lo))
    assert abs(mean - level) < 2e-3, (level, mean)
  uniform = np.asarray(rotated.named_codebook("uniform", bits))
  np.testing.assert_allclose(np.diff(uniform), np.diff(uniform)[0], atol=1e-9)
  with pytest.raises(ValueError, match="codebook must hold 8 increasing"):
    rotated.resolve_codebook((0.0, 1.0), 3)
  with pytest.raises(ValueError, match="codebook must be one of"):
    rotated.resolve_codebook("nf4", 4)


@pytest.mark.slow  # computing the tables takes seconds; fast: the closed-form check above
@pytest.mark.parametrize("name", rotated.CODEBOOKS)
@pytest.mark.parametrize("bits", [3, 4])
def test_the_table_is_what_compute_codebook_gives(name, bits):
  np.testing.assert_allclose(rotated.named_codebook(name, bits),
                             rotated.compute_codebook(name, bits), atol=2e-3)


def test_three_bit_packing_and_the_rotation():
  codes = jnp.asarray([[1, 2, 3, 4, 5, 6, 7, 0]], jnp.uint8)
  word = sum(c << (3 * i) for i, c in enumerate([1, 2, 3, 4, 5, 6, 7, 0]))
  np.testing.assert_array_equal(lowbit.pack_codes(codes, 3),
                                [[word & 255, (word >> 8) & 255, word >> 16]])
  c = jnp.asarray(np.random.default_rng(0).integers(0, 8, (3, 4, 64)), jnp.uint8)
  np.testing.assert_array_equal(lowbit.unpack_codes(lowbit.pack_codes(c, 3), 3), c)
  m = rotated.rotation(3, 64, 0)
  for k in range(3):
    np.testing.assert_allclose(m[k] @ m[k].T, np.eye(64), atol=1e-6)
  assert not np.allclose(m[0], m[1])  # each KV head its own signs
  with pytest.raises(ValueError, match="head_dim must be a power of two"):
    rotated.rotation(1, 48, 0)


def test_quantize_rotated_hand_computed():
  book = (-1.5, -0.5, 0.5, 1.5)  # a 2-bit book is enough to check the arithmetic
  x = jnp.asarray([[2.0, -2.0, 0.4, -0.1], [0.0, 0.0, 0.0, 0.0], [np.nan, 1.0, 1.0, 1.0]])
  codes, scale = rotated.quantize_rotated(x, book, jnp.float32)
  rms = math.sqrt((4 + 4 + 0.16 + 0.01) / 4)
  np.testing.assert_allclose(scale[:2], [rms, 0.0], rtol=1e-6)
  assert np.isnan(scale[2])
  np.testing.assert_array_equal(codes[0], [3, 0, 2, 1])  # 1.40, -1.40, 0.28, -0.07 (x / rms)
  back = rotated.dequantize_rotated(codes, scale, book)
  np.testing.assert_allclose(back[0], np.asarray([1.5, -1.5, 0.5, -0.5]) * rms, rtol=1e-6)
  np.testing.assert_array_equal(back[1], 0.0)
  assert np.isnan(back[2]).all()


def _reference_state(tokens_k, tokens_v, bits, residual, seed):
  """numpy: tokens `[L, K, H]` of one row; those below `L - residual` rotated, coded with
  the Lloyd-Max book at their f16 RMS and rotated back, the rest exact. `[K, L, H]` each."""
  m = rotated.rotation(K, H, seed).astype(np.float64)
  book = np.asarray(rotated.named_codebook("lloyd-max", bits))
  nq = max(0, tokens_k.shape[0] - residual)
  out = []
  for x in (tokens_k, tokens_v):
    x = x.transpose(1, 0, 2).astype(np.float64).copy()  # [K, L, H]
    y = np.einsum("klh,khj->klj", x[:, :nq], m)
    rms = np.sqrt(np.mean(y * y, axis=-1, keepdims=True)).astype(np.float16).astype(np.float64)
    idx = np.abs((y / np.where(rms > 0, rms, 1))[..., None] - book).argmin(-1)
    x[:, :nq] = np.einsum("klj,khj->klh", book[idx] * rms, m)
    out.append(x)
  return out


@pytest.mark.parametrize("bits,residual", [(3, 4), pytest.param(4, 0, marks=pytest.mark.slow)])
def test_stored_state_equals_the_numpy_reference(bits, residual):
  capacity = 29
  lengths = (0, 1, residual, residual + 1, 13, capacity)
  k, v, chunks = test_kivi._chunks(2, lengths, (5, 1, 30))  # pylint: disable=protected-access
  cache = RotatedCache.init(len(lengths), capacity, K, H, bits=bits, residual=residual, seed=1)
  for ck, cv, nl in chunks:
    cache = _update(cache, ck, cv, nl)
  kd, vd = (np.asarray(x) for x in _dequantized(cache))
  for b, n in enumerate(lengths):
    rk, rv = _reference_state(k[b, :n], v[b, :n], bits, residual, 1)
    np.testing.assert_allclose(kd[b, :, :n], rk, atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(vd[b, :, :n], rv, atol=1e-4, rtol=1e-4)
  assert list(np.asarray(cache.num_quantized)) == [max(0, n - residual) for n in lengths]


def _poison(cache):
  used = jnp.arange(cache.store_capacity)[None, :] < cache.num_quantized[:, None]
  ring_used = cache.ring_tokens() >= 0
  nan = lambda x, u: jnp.where(u[:, None, :] if x.ndim == 3 else u[:, None, :, None], x,
                               jnp.asarray(jnp.nan, x.dtype))
  return cache.replace(
      k_codes=jnp.where(used[:, None, :, None], cache.k_codes, jnp.uint8(255)),
      v_codes=jnp.where(used[:, None, :, None], cache.v_codes, jnp.uint8(255)),
      k_scale=nan(cache.k_scale, used), v_scale=nan(cache.v_scale, used),
      k_res=nan(cache.k_res, ring_used), v_res=nan(cache.v_res, ring_used))


@pytest.mark.parametrize("t", [1, pytest.param(4, marks=pytest.mark.slow)])  # chunks: test_kivi
def test_attention_equals_the_reference_over_the_dequantized_cache(monkeypatch, t):
  """A decode step (T = 1, window) and a ragged chunk (T = 4) over a store of several blocks:
  the rotation folded into q and undone on the output gives attention over the dequantized
  (rotated back) cache; garbage in unused slots changes nothing."""
  monkeypatch.setattr(test_kivi._residual, "BLOCK_TOKENS", 8)  # pylint: disable=protected-access
  lengths = (0, 1, 4, 5, 19, 27)
  _, _, whole = test_kivi._chunks(4, lengths, (28,))  # pylint: disable=protected-access
  cache = _update(RotatedCache.init(len(lengths), 31, K, H, bits=3, residual=4), *whole[0])
  assert cache.store_capacity == 27
  q, k, v = test_kivi._qkv(len(lengths), t)  # pylint: disable=protected-access
  new_lengths = jnp.asarray([t, 1, 0, t, t, 1][:len(lengths)], jnp.int32)
  options = {"window": 7} if t == 1 else {}
  step = jax.jit(lambda c: test_kivi._step(c, q, k, v, new_lengths, **options))  # pylint: disable=protected-access
  out, _ = step(cache)
  want = test_kivi._reference_step(cache, q, k, v, new_lengths, **options)  # pylint: disable=protected-access
  real = (jnp.arange(t)[None] < new_lengths[:, None])[..., None, None]
  np.testing.assert_allclose(np.asarray(jnp.where(real, out, 0)),
                             np.asarray(jnp.where(real, want, 0)), atol=3e-5, rtol=3e-5)
  np.testing.assert_array_equal(np.asarray(step(_poison(cache))[0]), np.asarray(out))


def test_calibrated_codebook_round_trips_through_a_spec():
  cfg = transformer.model_config(d_model=32, num_layers=2, mlp_dim=64, vocab_size=64,
                                 attention=dict(kind="gqa", num_heads=4, num_kv_heads=2,
                                                head_dim=8))
  model = transformer.Transformer.from_config(cfg, rngs=nnx.Rngs(0))
  tokens = np.random.default_rng(0).integers(0, 64, (2, 24))
  book = rotated.calibrate_codebook(model, tokens, 3, iters=20)
  assert len(book) == 8 and np.all(np.diff(book) > 0)
  assert book != rotated.named_codebook("lloyd-max", 3)
  caches = model.init_caches(1, 16, cache={"kind": "rotated3", "codebook": book})
  assert caches[0].codebook == book


def test_bytes_per_token_at_4k_at_smollm2_shapes():
  """K = 3, H = 64, 4096 tokens, no residual, f16 scales: codes + one scale per token per
  head for K and V, (2 * 64 * bits / 8 + 2 * 2) bytes per head: 4-bit 0.133x, 3-bit 0.102x
  of f32."""
  f32 = memory.gqa_bytes_per_token(3, 64, jnp.float32)
  for bits, ratio in ((4, 68 / 512), (3, 52 / 512)):
    cache = RotatedCache.init(1, 4096, 3, 64, jnp.float32, bits=bits)
    measured = memory.measured_bytes_per_token(cache)
    assert measured == pytest.approx(cache.analytic_bytes_per_token())
    assert measured / f32 == pytest.approx(ratio, rel=3e-3)  # + 1 f32 ring slot / 4096
