"""GroupedQueryAttention: cached decode == full forward, robustness, compile-once."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import kvattn

D, N, H = 32, 8, 8


def _layer(num_kv_heads, window=None, seed=0):
  return kvattn.GroupedQueryAttention(d_model=D, num_heads=N, num_kv_heads=num_kv_heads,
                                      head_dim=H, window=window, rngs=nnx.Rngs(seed))


def _x(B, T, seed=1):
  return jax.random.normal(jax.random.key(seed), (B, T, D))


@pytest.mark.parametrize("num_kv_heads", [8, 2, 1], ids=["MHA", "GQA", "MQA"])
@pytest.mark.parametrize("window", [None, 3])
def test_prefill_then_decode_equals_full_forward(num_kv_heads, window):
  layer = _layer(num_kv_heads, window)
  B, T, p = 2, 9, 4
  x = _x(B, T)
  full, no_cache = layer(x)
  assert no_cache is None
  cache = layer.init_cache(B, 16)
  y, cache = layer(x[:, :p], cache=cache)
  outs = [y]
  for t in range(p, T):
    y, cache = layer(x[:, t:t + 1], cache=cache)
    outs.append(y)
  np.testing.assert_allclose(np.asarray(jnp.concatenate(outs, 1)), np.asarray(full), atol=1e-5)
  np.testing.assert_array_equal(np.asarray(cache.lengths), [T, T])


@pytest.mark.parametrize("num_kv_heads", [  # fast suite: GQA (G = 4); MHA and MQA slow
    pytest.param(8, id="MHA", marks=pytest.mark.slow), pytest.param(2, id="GQA"),
    pytest.param(1, id="MQA", marks=pytest.mark.slow)])
def test_ragged_batch_prefilled_in_one_call(num_kv_heads):
  layer = _layer(num_kv_heads)
  prompt_lengths = np.array([5, 1, 3])
  B, T_pad, steps = 3, 5, 4
  streams = _x(B, T_pad + steps, seed=2)
  cache = layer.init_cache(B, 12)
  _, cache = layer(streams[:, :T_pad], cache=cache, new_lengths=jnp.asarray(prompt_lengths))
  np.testing.assert_array_equal(np.asarray(cache.lengths), prompt_lengths)
  decoded = []
  for t in range(steps):
    idx = jnp.asarray(prompt_lengths + t)[:, None, None]
    y, cache = layer(jnp.take_along_axis(streams, idx, axis=1), cache=cache)
    decoded.append(y[:, 0])
  decoded = np.asarray(jnp.stack(decoded, 1))
  for b in range(B):
    n = prompt_lengths[b] + steps
    full, _ = layer(streams[b:b + 1, :n])
    np.testing.assert_allclose(decoded[b], np.asarray(full[0, n - steps:]), atol=1e-5)


@pytest.mark.parametrize("garbage", [0.0, 1e30, np.nan])
def test_unused_slots_and_capacity_do_not_change_output(garbage):
  layer = _layer(2)
  x = _x(2, 6)
  outs = []
  for max_len in (6, 20):
    cache = layer.init_cache(2, max_len)
    cache = cache.replace(k=jnp.full_like(cache.k, garbage), v=jnp.full_like(cache.v, garbage))
    y, cache = layer(x[:, :4], cache=cache, new_lengths=jnp.array([4, 2]))
    y2, cache = layer(x[:, 4:5], cache=cache)
    assert np.isfinite(np.asarray(y2)).all()
    outs.append(np.asarray(y2))
  reference = layer.init_cache(2, 8)
  _, reference = layer(x[:, :4], cache=reference, new_lengths=jnp.array([4, 2]))
  y_ref, _ = layer(x[:, 4:5], cache=reference)
  for out in outs:
    np.testing.assert_allclose(out, np.asarray(y_ref), atol=1e-6)


def test_length_zero_sequence_gives_finite_output_and_others_unaffected():
  layer = _layer(2)
  x = _x(2, 3)
  cache = layer.init_cache(2, 8)
  cache = cache.replace(k=jnp.full_like(cache.k, jnp.nan), v=jnp.full_like(cache.v, jnp.nan))
  _, cache = layer(x, cache=cache, new_lengths=jnp.array([3, 0]))
  np.testing.assert_array_equal(np.asarray(cache.lengths), [3, 0])
  assert np.isnan(np.asarray(cache.k)[1]).all()  # nothing written for the empty row


def test_jitted_decode_step_compiles_once_and_consumes_donated_cache():
  layer = _layer(2)
  graphdef, state = nnx.split(layer)
  B = 2

  @chex.assert_max_traces(n=1)
  def step(state, cache, x):
    y, cache = nnx.merge(graphdef, state)(x, cache=cache)
    return y, cache

  step_jit = jax.jit(step, donate_argnums=(1,))
  cache = layer.init_cache(B, 32)
  _, cache = layer(_x(B, 4), cache=cache)
  for t in range(20):
    old = cache
    y, cache = step_jit(state, cache, _x(B, 1, seed=10 + t))
    assert old.k.is_deleted() and old.v.is_deleted()  # donated buffers consumed
    assert np.isfinite(np.asarray(y)).all()
  np.testing.assert_array_equal(np.asarray(cache.lengths), [24, 24])


def test_bf16_layer_is_finite_and_close_to_f32():
  layer = _layer(2)
  x = _x(2, 5) * 3
  y32, _ = layer(x)
  layer_bf16 = kvattn.GroupedQueryAttention(d_model=D, num_heads=N, num_kv_heads=2, head_dim=H,
                                            dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
  y16, _ = layer_bf16(x.astype(jnp.bfloat16))
  assert y16.dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(y16, np.float32), np.asarray(y32), atol=0.1, rtol=0.05)


def test_construction_and_call_validation():
  with pytest.raises(ValueError, match="num_heads must be divisible by num_kv_heads; got 6 and 4"):
    kvattn.GroupedQueryAttention(d_model=8, num_heads=6, num_kv_heads=4, head_dim=8,
                                 rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="head_dim must be even for RoPE; got 7"):
    kvattn.GroupedQueryAttention(d_model=8, num_heads=2, num_kv_heads=1, head_dim=7,
                                 rngs=nnx.Rngs(0))
  with pytest.raises(TypeError, match="num_kv_heads must be a positive int; got 2.0"):
    kvattn.GroupedQueryAttention(d_model=8, num_heads=2, num_kv_heads=2.0, head_dim=8,
                                 rngs=nnx.Rngs(0))
  # The decode backend is checked at construction, not at the first decode step.
  with pytest.raises(ValueError, match=r"decode_implementation must be one of \['pallas', 'xla', "
                     r"'xla_blocked', 'xla_pool'\] or None; got 'bogus'"):
    kvattn.GroupedQueryAttention(d_model=8, num_heads=2, num_kv_heads=1, head_dim=8,
                                 decode_implementation="bogus", rngs=nnx.Rngs(0))
  with pytest.raises(TypeError, match="decode_implementation must be a str or None; got 3"):
    kvattn.GroupedQueryAttention(d_model=8, num_heads=2, num_kv_heads=1, head_dim=8,
                                 decode_implementation=3, rngs=nnx.Rngs(0))
  assert kvattn.models.gqa.decode_implementations() == ("pallas", "xla", "xla_blocked", "xla_pool")
  with pytest.raises(TypeError, match="dtype must be a floating dtype .*; got int32"):
    kvattn.GroupedQueryAttention(d_model=8, num_heads=2, num_kv_heads=1, head_dim=8,
                                 dtype=jnp.int32, rngs=nnx.Rngs(0))
  with pytest.raises(TypeError, match="param_dtype must be a floating dtype .*; got 'f32'"):
    kvattn.GroupedQueryAttention(d_model=8, num_heads=2, num_kv_heads=1, head_dim=8,
                                 param_dtype="f32", rngs=nnx.Rngs(0))
  layer = _layer(2)
  with pytest.raises(ValueError, match=r"x must have rank 3 \[B, T, D\]; got shape \(4, 32\)"):
    layer(jnp.zeros((4, D)))
  with pytest.raises(ValueError, match=r"x.shape\[-1\] must be d_model = 32; got shape \(1, 2, 16\)"):
    layer(jnp.zeros((1, 2, 16)))
  with pytest.raises(TypeError, match="x must have a floating dtype; got int32"):
    layer(jnp.zeros((1, 2, D), jnp.int32))
  with pytest.raises(ValueError, match=r"cache must have batch, num_kv_heads, head_dim = "
                     r"\(1, 2, 8\); got \(1, 4, 8\)"):
    layer(jnp.zeros((1, 2, D)), cache=kvattn.KVCache.init(1, 4, 4, 8))
  with pytest.raises(ValueError, match=r"positions must have shape \[B, T\] = \(1, 2\)"):
    layer(jnp.zeros((1, 2, D)), positions=jnp.zeros((1, 3), jnp.int32))
