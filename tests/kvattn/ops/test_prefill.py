"""Blocked prefill attention (`kvattn.ops.prefill`) against the plain XLA path."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvattn import ops
from kvattn.ops import prefill
from kvattn.ops import xla

BQ, BK = 4, 8
S = 3 * BK + 3  # not a multiple of the key block: the last block is clamped and overlaps


def _inputs(seed, batch, num_tokens, num_heads, num_kv_heads, head_dim=8, capacity=S):
  ks = jax.random.split(jax.random.key(seed), 3)
  q = jax.random.normal(ks[0], (batch, num_tokens, num_heads, head_dim))
  k = jax.random.normal(ks[1], (batch, num_kv_heads, capacity, head_dim))
  v = jax.random.normal(ks[2], (batch, num_kv_heads, capacity, head_dim))
  return q, k, v


def _poison(x, lengths):
  """NaN in every slot at or past each sequence's length."""
  slots = jnp.arange(x.shape[2])[None, None, :, None]
  return jnp.where(slots < lengths[:, None, None, None], x, jnp.nan)


@pytest.mark.parametrize("num_heads,num_kv_heads,window,soft_cap", [
    (2, 2, None, None), (6, 1, 5, 3.0),  # G = 1; G = 6 > BQ with window and soft cap
    pytest.param(2, 2, 5, 3.0, marks=pytest.mark.slow),
    pytest.param(6, 1, None, None, marks=pytest.mark.slow)])
def test_blocked_equals_plain_with_cache_offsets(num_heads, num_kv_heads, window, soft_cap):
  # Prefill T tokens after `offsets` cached ones; lengths 0, 1, BK - 1, BK + 1 and capacity.
  num_tokens = 2 * BQ + 1
  offsets = jnp.array([0, 0, 0, 3, S - num_tokens])
  new = jnp.array([0, 1, BK - 1, num_tokens, num_tokens])
  lengths = offsets + new
  q, k, v = _inputs(0, 5, num_tokens, num_heads, num_kv_heads)
  k, v = _poison(k, lengths), _poison(v, lengths)
  opts = dict(q_offsets=offsets, kv_lengths=lengths, sm_scale=0.3, window=window,
              soft_cap=soft_cap)
  want = jax.jit(lambda *a: xla.attention(*a, **opts))(q, k, v)
  got = jax.jit(lambda *a: prefill.blocked_attention(*a, block_q=BQ, block_k=BK, **opts))(q, k, v)
  assert np.isfinite(np.asarray(got)).all()
  np.testing.assert_allclose(got, want, atol=2e-6, rtol=2e-5)
  np.testing.assert_array_equal(np.asarray(got)[0], 0.0)  # length 0: nothing to attend


def test_blocked_quantized_scales_equal_plain():
  q, k, v = _inputs(1, 2, 2 * BQ, 4, 2)
  k8, ks = ops.quantize_kv(k, jnp.int8)
  v8, vs = ops.quantize_kv(v, jnp.int8)
  lengths = jnp.array([S, BK + 1])
  offsets = lengths - 2 * BQ
  vs = jnp.where(jnp.arange(S)[None, None] < lengths[:, None, None], vs, jnp.nan)  # unused slots
  opts = dict(q_offsets=offsets, kv_lengths=lengths, sm_scale=0.5, k_scale=ks, v_scale=vs)
  want = jax.jit(lambda *a: xla.attention(*a, **opts))(q, k8, v8)
  got = jax.jit(lambda *a: prefill.blocked_attention(*a, block_q=BQ, block_k=BK, **opts))(
      q, k8, v8)
  np.testing.assert_allclose(got, want, atol=2e-6, rtol=2e-5)


@pytest.mark.parametrize("num_tokens", [pytest.param(1, marks=pytest.mark.slow), S])
def test_blocked_causal_from_zero_values_and_grads(num_tokens):
  # Training-style call (no offsets): static loops, so reverse-mode works and matches.
  q, k, v = _inputs(2, 2, num_tokens, 4, 2, capacity=num_tokens)
  lengths = jnp.array([num_tokens, max(num_tokens - 2, 0)])

  def loss(fn, q, k, v):
    return jnp.sum(jnp.sin(fn(q, k, v, kv_lengths=lengths, sm_scale=0.4)))

  plain = lambda q, k, v, **o: xla.attention(q, k, v, **o)
  blocked = lambda q, k, v, **o: prefill.blocked_attention(q, k, v, q_offsets=None, block_q=BQ,
                                                           block_k=BK, **o)
  def both(fn):
    return jax.jit(jax.value_and_grad(lambda *a: loss(fn, *a), argnums=(0, 1, 2)))(q, k, v)

  (l_got, g_got), (l_want, g_want) = both(blocked), both(plain)
  np.testing.assert_allclose(l_got, l_want, rtol=1e-5)
  for got, want in zip(g_got, g_want):
    np.testing.assert_allclose(got, want, atol=1e-5)


def test_attention_switches_to_blocked_for_long_prefills(monkeypatch):
  q, k, v = _inputs(3, 1, 2 * BQ, 2, 1)
  lengths = jnp.array([S])
  want = xla.attention(q, k, v, q_offsets=lengths - 2 * BQ, kv_lengths=lengths)
  calls = []
  real = prefill.blocked_attention
  monkeypatch.setattr(prefill, "MIN_LOGITS", 2 * BQ * S)
  monkeypatch.setattr(prefill, "blocked_attention",
                      lambda *a, **o: calls.append(1) or real(*a, **o))
  got = ops.attention(q, k, v, q_offsets=lengths - 2 * BQ, kv_lengths=lengths)
  assert calls == [1]
  np.testing.assert_allclose(got, want, atol=2e-6)


def test_blocked_rejects_bad_blocks():
  q, k, v = _inputs(4, 1, 2, 2, 1)
  with pytest.raises(ValueError, match="block_q and block_k must be positive; got 0"):
    prefill.blocked_attention(q, k, v, q_offsets=None, kv_lengths=jnp.array([S]), sm_scale=1.0,
                              block_q=0)


def test_model_logits_unchanged_by_the_blocked_prefill(monkeypatch):
  # A whole model's prefill through a cache: blocked (threshold lowered) == plain, f32.
  from flax import nnx
  from kvattn.models import transformer as transformer_lib
  cfg = transformer_lib.model_config(vocab_size=40, d_model=16, num_layers=2, mlp_dim=32,
                                     attention=dict(num_heads=4, num_kv_heads=2, head_dim=4))
  model = transformer_lib.Transformer.from_config(cfg, rngs=nnx.Rngs(0))
  tokens = jnp.arange(2 * 19).reshape(2, 19) % 40
  new_lengths = jnp.array([19, 11])

  graphdef, state = nnx.split(model)

  def logits():  # a new function each time: traced again after the patch
    def run(state):
      m = nnx.merge(graphdef, state)
      return m(tokens, m.init_caches(2, 24), new_lengths=new_lengths)[0]
    return jax.jit(run)(state)

  want = logits()
  monkeypatch.setattr(prefill, "MIN_LOGITS", 1)
  monkeypatch.setattr(prefill, "BLOCK_Q", BQ)
  monkeypatch.setattr(prefill, "BLOCK_K", BK)
  got = logits()
  np.testing.assert_allclose(got[0], want[0], atol=1e-5)
  np.testing.assert_allclose(got[1, :11], want[1, :11], atol=1e-5)  # padding rows unspecified
