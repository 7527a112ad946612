"""kvattn.ops.quantize_kv / dequantize_kv and the quantized KVCache / LatentCache storage."""

import hypothesis
import hypothesis.extra.numpy as hnp
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvattn import KVCache, LatentCache, memory, ops
from kvattn.ops import quant
from tests.pallas_kernels import _helpers

FORMATS = {name: dtype for name, (dtype, _) in _helpers.FORMATS.items()}  # short name -> dtype
MAX = {"int8": 127.0, "e4m3": 448.0, "e5m2": 57344.0}
# Round to nearest: half a step. int8: the step is the scale (absmax / 127). fp8: half the
# relative step (2^-3 for e4m3's 3 mantissa bits, 2^-2 for e5m2's 2) above the normal range,
# half a subnormal step (2^-9 / 2^-16 of the scale) below it.
REL = {"int8": 0.0, "e4m3": 2.0**-4, "e5m2": 2.0**-3}
SUBNORMAL_HALF_STEP = {"int8": 0.5, "e4m3": 2.0**-10, "e5m2": 2.0**-17}


def _bound(name, x, scale):
  """Largest |dequantize(quantize(x)) - x| allowed per entry (f32 slack included)."""
  x = np.abs(np.asarray(x, np.float64))
  s = np.asarray(scale, np.float64)[..., None]
  return REL[name] * x + SUBNORMAL_HALF_STEP[name] * s + 1e-6 * x + 1e-45


def _tokens():
  """[8, 3, 32]: magnitudes from 1e-30 to 1e4, a token of absmax 0.05, all-zero tokens."""
  rng = np.random.default_rng(0)
  x = rng.standard_normal((8, 3, 32))
  x *= np.array([1e4, 3e3, 1.0, 0.05, 1e-3, 1e-30, 1.0, 250.0])[:, None, None]
  x[2, 1] = 0.0  # an all-zero token
  x[3, 0] = x[3, 0] / np.abs(x[3, 0]).max() * 0.05  # absmax exactly 0.05
  x[6, 2, :] = 0.0
  x[6, 2, 5] = -1e4  # one large entry, the rest zero
  return jnp.asarray(x, jnp.float32)


@pytest.mark.parametrize("name", FORMATS)
def test_round_trip_error_within_the_format_step(name):
  dtype = FORMATS[name]
  x = _tokens()
  values, scales = ops.quantize_kv(x, dtype)
  assert values.dtype == dtype and values.shape == x.shape
  assert scales.dtype == jnp.float32 and scales.shape == x.shape[:-1]
  back = ops.dequantize_kv(values, scales)
  assert np.all(np.isfinite(np.asarray(back)))
  err = np.abs(np.asarray(back, np.float64) - np.asarray(x, np.float64))
  assert np.all(err <= _bound(name, x, scales)), float((err / _bound(name, x, scales)).max())
  absmax = np.abs(np.asarray(x)).max(-1)
  nonzero = absmax > 0
  # One scale per token per head: absmax / format max (not clamped to >= 1: full resolution
  # for the 0.05 and 1e-30 tokens), and 1 for all-zero tokens.
  np.testing.assert_allclose(np.asarray(scales)[nonzero], absmax[nonzero] / MAX[name],
                             rtol=1e-6)
  np.testing.assert_array_equal(np.asarray(scales)[~nonzero], 1.0)
  if name == "int8":  # the bound: absmax / 254 per token
    assert np.all(err.max(-1) <= absmax / 254 * (1 + 1e-6) + 1e-45)
    assert np.abs(np.asarray(values, np.int32)).max() <= 127  # symmetric: -128 unused
  # The largest entry of each token lands on the format's max (full range used).
  top = np.abs(np.asarray(values.astype(jnp.float32))).max(-1)
  np.testing.assert_array_equal(top[nonzero], MAX[name])


@pytest.mark.parametrize("name", FORMATS)
def test_special_tokens_stay_finite_and_correctly_scaled(name):
  dtype = FORMATS[name]
  x = _tokens()
  values, scales = ops.quantize_kv(x, dtype)
  back = np.asarray(ops.dequantize_kv(values, scales))
  np.testing.assert_array_equal(back[2, 1], 0.0)  # all-zero token: exactly zero
  np.testing.assert_array_equal(np.asarray(values[2, 1].astype(jnp.float32)), 0.0)
  assert float(scales[2, 1]) == 1.0
  assert float(scales[3, 0]) == pytest.approx(0.05 / MAX[name], rel=1e-6)
  assert np.abs(back[3, 0] - np.asarray(x[3, 0])).max() <= 0.05 * max(
      1 / 254 if name == "int8" else REL[name], 0) + 1e-9
  # 1e-30 tokens keep their relative resolution (a scale clamped to >= 1 would zero them).
  tiny = np.asarray(x[5])
  assert np.abs(back[5] - tiny).max() <= np.abs(tiny).max() * (1 / 254 if name == "int8" else
                                                               2 * REL[name])
  np.testing.assert_allclose(back[6, 2, 5], -1e4, rtol=1e-6)  # absmax: exact up to f32 rounding
  np.testing.assert_array_equal(np.delete(back[6, 2], 5), 0.0)


@pytest.mark.parametrize("name", FORMATS)
def test_jit_eager_and_bf16_input_agree(name):
  dtype = FORMATS[name]
  x = _tokens()
  eager = ops.quantize_kv(x, dtype)
  jitted = jax.jit(ops.quantize_kv, static_argnums=1)(x, dtype)
  for a, b in zip(eager, jitted):
    np.testing.assert_array_equal(np.asarray(a.astype(jnp.float32)),
                                  np.asarray(b.astype(jnp.float32)))
  xb = x.astype(jnp.bfloat16)
  values, scales = ops.quantize_kv(xb, dtype)
  err = np.abs(np.asarray(ops.dequantize_kv(values, scales), np.float64) -
               np.asarray(xb.astype(jnp.float32), np.float64))
  assert np.all(err <= _bound(name, xb.astype(jnp.float32), scales))


@hypothesis.settings(max_examples=40, deadline=None)
@hypothesis.given(x=hnp.arrays(np.float32, (3, 7), elements=st.floats(
    -1e4, 1e4, allow_nan=False, allow_infinity=False, width=32)))
def test_round_trip_bound_holds_for_any_finite_input(x):
  for name, dtype in FORMATS.items():
    values, scales = ops.quantize_kv(x, dtype)
    back = np.asarray(ops.dequantize_kv(values, scales), np.float64)
    assert np.all(np.isfinite(back))
    err = np.abs(back - x.astype(np.float64))
    assert np.all(err <= _bound(name, x, scales)), name


def test_static_scale_clamps_to_the_format_range():
  x = jnp.array([[1e4, -1e4, 3.0, 0.0]], jnp.float32)
  values, scales = ops.quantize_kv(x, jnp.float8_e4m3fn, scale=1.0)
  np.testing.assert_array_equal(np.asarray(values.astype(jnp.float32)), [[448, -448, 3, 0]])
  np.testing.assert_array_equal(np.asarray(scales), [1.0])  # the scale a reader must use
  values, scales = ops.quantize_kv(x, jnp.float8_e5m2, scale=0.01)
  np.testing.assert_array_equal(np.asarray(values.astype(jnp.float32))[0, :2], [57344, -57344])
  values, scales = ops.quantize_kv(x, jnp.int8, scale=0.5)
  np.testing.assert_array_equal(np.asarray(values), [[127, -127, 6, 0]])
  # A per-head static scale broadcasts over the tokens: [T, K, H] with scale [K].
  y = jnp.ones((5, 2, 4)) * jnp.array([1.0, 10.0])[None, :, None]
  values, scales = ops.quantize_kv(y, jnp.int8, scale=jnp.array([1 / 127, 10 / 127]))
  np.testing.assert_array_equal(np.asarray(values), 127)
  np.testing.assert_allclose(np.asarray(ops.dequantize_kv(values, scales)), np.asarray(y),
                             rtol=1e-6)


def test_errors_name_the_argument():
  x = jnp.ones((2, 4))
  with pytest.raises(TypeError, match=r"dtype must be one of the quantized KV formats "
                     r"\('int8', 'float8_e4m3fn', 'float8_e5m2'\); got int16"):
    ops.quantize_kv(x, jnp.int16)
  with pytest.raises(TypeError, match="dtype must be one of the quantized KV formats.*bfloat16"):
    ops.quantize_kv(x, jnp.bfloat16)
  with pytest.raises(TypeError, match="x must have a floating dtype; got int32"):
    ops.quantize_kv(jnp.ones((2, 4), jnp.int32), jnp.int8)
  with pytest.raises(ValueError, match=r"scale must be positive and finite; got \[0.0\]"):
    ops.quantize_kv(x, jnp.int8, scale=0.0)
  with pytest.raises(ValueError, match="scale must be positive and finite"):
    ops.quantize_kv(x, jnp.int8, scale=float("nan"))
  with pytest.raises(ValueError, match=r"scale must broadcast to x.shape\[:-1\] = \(2,\); got "
                     r"shape \(3,\)"):
    ops.quantize_kv(x, jnp.int8, scale=jnp.ones(3))
  values, scales = ops.quantize_kv(x, jnp.int8)
  with pytest.raises(ValueError, match=r"scales must have shape values.shape\[:-1\] = \(2,\)"):
    ops.dequantize_kv(values, scales[:1])
  with pytest.raises(TypeError, match="values.dtype must be one of the quantized KV formats"):
    ops.dequantize_kv(x, scales)
  with pytest.raises(TypeError, match="scales must be an array of numbers"):
    ops.dequantize_kv(values, [None, None])


def test_scales_as_a_list_equal_scales_as_an_array():
  x = jnp.array([[1.0, -2.0], [0.5, 0.25]])
  values, scales = ops.quantize_kv(x, jnp.int8)
  from_list = ops.dequantize_kv(values, [float(s) for s in np.asarray(scales)])
  np.testing.assert_array_equal(np.asarray(from_list), np.asarray(ops.dequantize_kv(values, scales)))


@pytest.mark.parametrize("name", FORMATS)
def test_a_non_finite_token_reads_back_as_nan_and_leaves_the_others_alone(name):
  x = jnp.array([[1.0, 2.0], [jnp.nan, 1.0], [jnp.inf, 0.0], [-3.0, 0.5]])
  values, scales = ops.quantize_kv(x, FORMATS[name])
  back = np.asarray(ops.dequantize_kv(values, scales))
  assert np.isnan(back[1:3]).all()  # never a plausible finite vector
  assert np.isnan(np.asarray(scales)[1:3]).all()
  clean_values, clean_scales = ops.quantize_kv(x[jnp.array([0, 3])], FORMATS[name])
  np.testing.assert_array_equal(back[[0, 3]],
                                np.asarray(ops.dequantize_kv(clean_values, clean_scales)))


# ----------------------------------------------------------------------------------------------
# Caches.


@pytest.mark.parametrize("name", FORMATS)
def test_kv_cache_quantizes_on_write_with_the_scale_it_reads(name):
  dtype = FORMATS[name]
  c = KVCache.init(2, 8, 2, 4, dtype)
  assert c.quantized and c.k.dtype == dtype and c.k_scale.shape == (2, 2, 8)
  assert len(jax.tree_util.tree_leaves(c)) == 5
  assert len(jax.tree_util.tree_leaves(KVCache.init(2, 8, 2, 4))) == 3  # float: unchanged
  x = jax.random.normal(jax.random.key(0), (2, 3, 2, 4)) * 300.0
  c = c.update(x, -x, new_lengths=jnp.array([3, 1]))
  c = jax.jit(lambda c, y: c.update(y, 2 * y))(c, x[:, :2])
  np.testing.assert_array_equal(np.asarray(c.lengths), [5, 3])
  k_vals, k_scales = ops.quantize_kv(x, dtype)  # [B, T, K, H], [B, T, K]
  # Sequence 0: tokens 0..2 at slots 0..2; sequence 1: token 0 at slot 0 (padding not written).
  np.testing.assert_array_equal(np.asarray(c.k_scale[0, :, :3]), np.asarray(k_scales[0]).T)
  np.testing.assert_array_equal(np.asarray(c.k[0, :, :3].astype(jnp.float32)),
                                np.asarray(k_vals[0].astype(jnp.float32)).transpose(1, 0, 2))
  np.testing.assert_array_equal(np.asarray(c.k_scale[1, :, 1:3]), np.asarray(k_scales[1, :2]).T)
  np.testing.assert_array_equal(np.asarray(c.v_scale[1, :, 0]), np.asarray(k_scales[1, 0]))
  assert np.all(np.asarray(c.k_scale[1, :, 3:]) == 1.0)  # untouched slots keep the init scale
  k, v = c.dequantized()
  np.testing.assert_array_equal(np.asarray(k[0, :, :3]), np.asarray(
      ops.dequantize_kv(k_vals, k_scales)[0]).transpose(1, 0, 2))
  np.testing.assert_allclose(np.asarray(v[0, :, 3:5]), np.asarray(
      ops.dequantize_kv(*ops.quantize_kv(2 * x[0, :2], dtype))).transpose(1, 0, 2), rtol=1e-6)


def test_quantized_cache_overflow_under_jit_drops_values_and_scales():
  c = KVCache.init(1, 2, 1, 4, jnp.int8)
  x = jnp.ones((1, 3, 1, 4)) * jnp.arange(1.0, 4.0)[None, :, None, None]
  c = jax.jit(lambda c, x: c.update(x, x))(c, x)
  assert bool(c.overflowed[0]) and int(c.lengths[0]) == 3
  np.testing.assert_allclose(np.asarray(c.k_scale[0, 0]), [1 / 127, 2 / 127], rtol=1e-6)


@pytest.mark.parametrize("name", FORMATS)
def test_latent_cache_scales_each_part_per_token(name):
  dtype = FORMATS[name]
  c = LatentCache.init(2, 6, 8, 4, dtype)
  assert c.c_kv_scale.shape == c.k_rope_scale.shape == (2, 6)
  c_new = jax.random.normal(jax.random.key(1), (2, 2, 8))
  r_new = jax.random.normal(jax.random.key(2), (2, 2, 4)) * 1e3  # another magnitude
  c = c.update(c_new, r_new, new_lengths=jnp.array([2, 1]))
  np.testing.assert_array_equal(np.asarray(c.c_kv_scale[0, :2]),
                                np.asarray(ops.quantize_kv(c_new, dtype)[1][0]))
  np.testing.assert_array_equal(np.asarray(c.k_rope_scale[0, :2]),
                                np.asarray(ops.quantize_kv(r_new, dtype)[1][0]))
  c_back, r_back = c.dequantized()
  assert np.all(np.abs(np.asarray(r_back[0, :2] - r_new[0])) <= _bound(
      name, r_new[0], ops.quantize_kv(r_new, dtype)[1][0]))
  assert np.all(np.abs(np.asarray(c_back[1, :1] - c_new[1, :1])) <= _bound(
      name, c_new[1, :1], ops.quantize_kv(c_new, dtype)[1][1, :1]))


def test_cache_dtype_validation():
  for bad in (jnp.int32, jnp.uint8, jnp.int16):
    with pytest.raises(TypeError, match=r"dtype must be a floating dtype or a quantized KV "
                       r"format \('int8', 'float8_e4m3fn', 'float8_e5m2'\)"):
      KVCache.init(1, 4, 1, 4, bad)
    with pytest.raises(TypeError, match="dtype must be a floating dtype or a quantized"):
      LatentCache.init(1, 4, 4, 2, bad)
  c = KVCache.init(1, 4, 1, 4, jnp.int8)
  with pytest.raises(TypeError, match="k_new must have a floating dtype; got int8"):
    c.update(jnp.ones((1, 1, 1, 4), jnp.int8), jnp.ones((1, 1, 1, 4)))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, *FORMATS.values()])
def test_memory_counts_the_scale_bytes(dtype):
  itemsize = jnp.dtype(dtype).itemsize
  scale = 4 if quant.is_quantized(dtype) else 0
  c = KVCache.init(3, 10, 2, 16, dtype)
  assert memory.gqa_bytes_per_token(2, 16, dtype) == 2 * 2 * (16 * itemsize + scale)
  assert memory.measured_bytes_per_token(c) == memory.gqa_bytes_per_token(2, 16, dtype)
  assert memory.tree_bytes(c) == 3 * 10 * memory.gqa_bytes_per_token(2, 16, dtype) + 3 * 4
  latent = LatentCache.init(3, 10, 64, 8, dtype)
  assert memory.mla_bytes_per_token(64, 8, dtype) == 72 * itemsize + 2 * scale
  assert memory.measured_bytes_per_token(latent) == memory.mla_bytes_per_token(64, 8, dtype)
  assert memory.scale_bytes(dtype) == scale


@pytest.mark.parametrize("dtype, bits", [(jnp.bfloat16, jnp.uint16), (jnp.float16, jnp.uint16),
                                         (jnp.float8_e4m3fn, jnp.uint8),
                                         (jnp.float8_e5m2, jnp.uint8),
                                         (jnp.float32, jnp.float32), (jnp.int8, jnp.int8)])
def test_narrow_floats_move_as_their_bits(dtype, bits):
  """as_bits / read_stored / set_stored: narrow floats as unsigned ints of their width, other
  dtypes as they are; every bit pattern (NaN payloads, -0.0) comes back as it was."""
  width = jnp.dtype(dtype).itemsize * 8
  rng = np.random.default_rng(0)
  stored = rng.integers(0, 2**width, (4, 6, 8), dtype=np.dtype(f"uint{width}"))
  x = jax.lax.bitcast_convert_type(jnp.asarray(stored), dtype)
  view = lambda a: np.asarray(jax.lax.bitcast_convert_type(a, np.dtype(f"uint{width}")))
  assert quant.as_bits(x).dtype == jnp.dtype(bits)
  assert np.array_equal(view(quant.from_bits(quant.as_bits(x), x.dtype)), stored)
  got = quant.read_stored(lambda a: jax.lax.dynamic_slice_in_dim(a, 2, 3, axis=1), x)
  assert got.dtype == x.dtype and np.array_equal(view(got), stored[:, 2:5])
  new = jnp.asarray(rng.standard_normal((4, 2, 8)), jnp.float32)
  index = (slice(None), jnp.asarray([1, 5]))
  got = jax.jit(lambda b, n: quant.set_stored(b, index, n, mode="drop"))(x, new)
  want = stored.copy()
  want[:, [1, 5]] = view(new.astype(dtype))
  assert got.dtype == x.dtype and np.array_equal(view(got), want)
  tree = {"k": x, "lengths": jnp.arange(4)}
  back = quant.tree_from_bits(quant.tree_as_bits(tree), tree)
  assert np.array_equal(view(back["k"]), stored) and back["lengths"].dtype == jnp.int32
