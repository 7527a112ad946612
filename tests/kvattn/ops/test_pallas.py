"""The "pallas" backend of kvattn's decode dispatch points (kvattn/ops/pallas.py).

On CPU, `implementation=None` must fall through to XLA (the backend raises
NotImplementedError) and `implementation="pallas"` runs the kernel in
interpret mode. Platform selection on GPU/TPU is checked by faking the
platform and recording what the backend would launch.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import kvattn
from kvattn import ops
from kvattn.ops import pallas as pallas_backend

ON_CPU = jax.default_backend() == "cpu"


def _dense(batch=3, num_heads=8, num_kv=2, capacity=32, head_dim=16, v_dim=16, seed=0):
  rng = np.random.RandomState(seed)
  return (jnp.asarray(rng.randn(batch, num_heads, head_dim), jnp.float32),
          jnp.asarray(rng.randn(batch, num_kv, capacity, head_dim), jnp.float32),
          jnp.asarray(rng.randn(batch, num_kv, capacity, v_dim), jnp.float32))


def _latent(batch=2, num_heads=4, capacity=32, latent=32, rope=16, seed=1):
  rng = np.random.RandomState(seed)
  return tuple(jnp.asarray(rng.randn(*s), jnp.float32) for s in (
      (batch, num_heads, latent), (batch, num_heads, rope), (batch, capacity, latent),
      (batch, capacity, rope)))


def test_pallas_is_registered_first_for_both_ops():
  for op in ("decode_attention", "mla_decode_attention"):
    impls = ops.available_implementations(op)
    assert impls[0] == "pallas" and "xla" in impls


@pytest.mark.skipif(not ON_CPU, reason="CPU fallback behaviour")
def test_auto_falls_back_to_xla_on_cpu():
  q, k, v = _dense()
  lengths = jnp.array([0, 5, 32])
  with pytest.raises(NotImplementedError, match="no compiled kernel on 'cpu'"):
    pallas_backend.decode(q, k, v, lengths, explicit=False)
  auto = ops.decode_attention(q, k, v, lengths, window=7)
  xla = ops.decode_attention(q, k, v, lengths, window=7, implementation="xla")
  np.testing.assert_array_equal(auto, xla)
  q_latent, q_rope, c_kv, k_rope = _latent()
  args = (q_latent, q_rope, c_kv, k_rope, jnp.array([3, 32]))
  np.testing.assert_array_equal(
      ops.mla_decode_attention(*args, sm_scale=0.3),
      ops.mla_decode_attention(*args, sm_scale=0.3, implementation="xla"))


@pytest.mark.skipif(not ON_CPU, reason="interpret mode is the CPU path")
def test_explicit_pallas_runs_interpreted_and_matches_xla():
  q, k, v = _dense(v_dim=32)
  lengths = jnp.array([0, 17, 40])  # 40 > S: clamped like the XLA path's overflow contract
  decode = jax.jit(ops.decode_attention, static_argnames=("window", "implementation"))
  for window in (None, 9):  # jitted: eager, a length past S is refused before any backend
    pallas = decode(q, k, v, lengths, window=window, implementation="pallas")
    xla = ops.decode_attention(q, k, v, jnp.minimum(lengths, 32), window=window,
                               implementation="xla")
    np.testing.assert_allclose(pallas, xla, atol=2e-5, rtol=2e-5)
  q_latent, q_rope, c_kv, k_rope = _latent()
  lengths = jnp.array([3, 32])
  step = jax.jit(lambda *a: ops.mla_decode_attention(*a, sm_scale=0.3, window=20,
                                                     implementation="pallas"))
  pallas = step(q_latent, q_rope, c_kv, k_rope, lengths)
  xla = ops.mla_decode_attention(q_latent, q_rope, c_kv, k_rope, lengths, sm_scale=0.3,
                                 window=20, implementation="xla")
  np.testing.assert_allclose(pallas, xla, atol=2e-5, rtol=2e-5)


def test_unsupported_options_and_shapes_fall_back():
  q, k, v = _dense(capacity=40)  # S = 40: no power-of-two block of >= 16 keys divides it
  lengths = jnp.array([1, 20, 40])
  with pytest.raises(NotImplementedError, match="S=40"):
    ops.decode_attention(q, k, v, lengths, implementation="pallas")
  np.testing.assert_array_equal(
      ops.decode_attention(q, k, v, lengths),
      ops.decode_attention(q, k, v, lengths, implementation="xla"))
  q, k, v = _dense(head_dim=24)  # soft cap and a padded head dim run in the kernel now
  decode = jax.jit(ops.decode_attention, static_argnames=("soft_cap", "implementation"))
  np.testing.assert_allclose(  # jitted: row 2 (40 > S = 32) is an overflowed row, clamped
      decode(q, k, v, lengths, soft_cap=3.0, implementation="pallas"),
      decode(q, k, v, lengths, soft_cap=3.0, implementation="xla"),
      atol=2e-5, rtol=2e-5)
  q_latent, q_rope, c_kv, k_rope = _latent(rope=8)  # R = 8 < 16: padded to a Triton width
  np.testing.assert_allclose(
      ops.mla_decode_attention(q_latent, q_rope, c_kv, k_rope, jnp.array([1, 2]), sm_scale=0.3,
                               implementation="pallas"),
      ops.mla_decode_attention(q_latent, q_rope, c_kv, k_rope, jnp.array([1, 2]), sm_scale=0.3,
                               implementation="xla"), atol=2e-5, rtol=2e-5)


def test_caller_errors_are_value_errors_not_fallbacks():
  q, k, v = _dense()
  with pytest.raises(ValueError, match="window must be a positive int; got 0"):
    ops.decode_attention(q, k, v, jnp.array([1, 2, 3]), window=0, implementation="pallas")
  with pytest.raises(ValueError, match="implementation must be one of"):
    ops.decode_attention(q, k, v, jnp.array([1, 2, 3]), implementation="triton")


@pytest.mark.parametrize("platform", ["gpu", "tpu"])
def test_auto_picks_the_compiled_kernel_on_accelerators(monkeypatch, platform):
  # Fake the platform and record the launch: the backend must ask for a
  # compiled (interpret=False) kernel for supported shapes, and decline the rest.
  calls = []
  monkeypatch.setattr(pallas_backend.jax, "default_backend", lambda: platform)
  monkeypatch.setattr(pallas_backend.dense_decode, "decode_attention_unchecked",
                      lambda *a, **kw: calls.append(kw) or jnp.zeros(()))
  monkeypatch.setattr(pallas_backend.dense_decode, "mla_decode_attention_unchecked",
                      lambda *a, **kw: calls.append(kw) or jnp.zeros(()))
  q, k, v = _dense(capacity=64, head_dim=64, v_dim=128)
  pallas_backend.decode(q, k, v, jnp.array([1, 2, 3]), explicit=False, window=4)
  assert calls[-1]["interpret"] is False and calls[-1]["window"] == 4
  q_latent, q_rope, c_kv, k_rope = _latent(capacity=64, latent=128, rope=64)
  pallas_backend.mla_decode(q_latent, q_rope, c_kv, k_rope, jnp.array([1, 2]),
                             explicit=False, sm_scale=0.1)
  assert calls[-1]["interpret"] is False and calls[-1]["sm_scale"] == 0.1
  q, k, v = _dense(capacity=64, head_dim=48)  # 48: padded to 64 on GPU; not a TPU width
  if platform == "gpu":
    pallas_backend.decode(q, k, v, jnp.array([1, 2, 3]), explicit=False, soft_cap=20.0)
    assert calls[-1]["soft_cap"] == 20.0 and len(calls) == 3
  else:
    with pytest.raises(NotImplementedError, match="head dim H=48"):
      pallas_backend.decode(q, k, v, jnp.array([1, 2, 3]), explicit=False)
    assert len(calls) == 2


@pytest.mark.skipif(not ON_CPU, reason="interpret mode is the CPU path")
@pytest.mark.parametrize("module", [  # MLA's kernel: test_every_backend.py
    "gqa", pytest.param("mla", marks=pytest.mark.slow)])
def test_modules_decode_through_the_pallas_backend(module):
  # A module built with decode_implementation="pallas" decodes through the
  # dispatch point into the kernel and agrees with the XLA path.
  batch, prompt, capacity = 2, 5, 32
  x = jax.random.normal(jax.random.key(0), (batch, prompt + 1, 32))
  outs = {}
  for impl in ("xla", "pallas"):
    if module == "gqa":
      attn = kvattn.GroupedQueryAttention(d_model=32, num_heads=4, num_kv_heads=2, head_dim=16,
                                          decode_implementation=impl, rngs=nnx.Rngs(0))
      cache = kvattn.KVCache.init(batch, capacity, 2, 16)
    else:
      attn = kvattn.MultiHeadLatentAttention(
          d_model=32, num_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16,
          v_head_dim=16, decode_implementation=impl, rngs=nnx.Rngs(0))
      cache = kvattn.LatentCache.init(batch, capacity, 32, 16)
    _, cache = attn(x[:, :prompt], cache=cache)
    outs[impl], _ = attn(x[:, prompt:], cache=cache)
  np.testing.assert_allclose(outs["pallas"], outs["xla"], atol=3e-5, rtol=3e-5)
