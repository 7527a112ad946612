"""Reference attention ops: hand-computed cases, masks, robustness, dispatch."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvattn import ops


def _rand(key, shape, dtype=jnp.float32):
  return jax.random.normal(jax.random.key(key), shape, jnp.float32).astype(dtype)


def _naive(q, k, v, q_offsets, kv_lengths, window=None, sm_scale=None, soft_cap=None):
  """Loop-per-query numpy reference (independent of the vectorised code)."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  B, T, N, H = q.shape
  K = k.shape[1]
  G = N // K
  scale = H ** -0.5 if sm_scale is None else sm_scale
  out = np.zeros((B, T, N, v.shape[-1]))
  for b in range(B):
    for t in range(T):
      p = q_offsets[b] + t
      keys = [s for s in range(k.shape[2]) if s <= p and s < kv_lengths[b]
              and (window is None or s > p - window)]
      if not keys:
        continue
      for n in range(N):
        logits = np.array([q[b, t, n] @ k[b, n // G, s] for s in keys]) * scale
        if soft_cap is not None:
          logits = soft_cap * np.tanh(logits / soft_cap)
        w = np.exp(logits - logits.max())
        w /= w.sum()
        out[b, t, n] = sum(wi * v[b, n // G, s] for wi, s in zip(w, keys))
  return out


def test_single_key_returns_its_value():
  q = jnp.ones((1, 1, 1, 2))
  k = jnp.array([[[[3.0, -1.0]]]])
  v = jnp.array([[[[5.0, 7.0]]]])
  out = ops.attention(q, k, v)
  np.testing.assert_array_equal(np.asarray(out), [[[[5.0, 7.0]]]])


def test_two_keys_hand_computed():
  # logits = [1*1, 1*0] / sqrt(1) -> softmax [e/(e+1), 1/(e+1)].
  q = jnp.array([[[[1.0]], [[1.0]]]])  # [B=1, T=2, N=1, H=1]
  k = jnp.array([[[[1.0], [0.0]]]])  # [B=1, K=1, S=2, H=1]
  v = jnp.array([[[[10.0], [20.0]]]])
  out = np.asarray(ops.attention(q, k, v))
  e = math.e
  np.testing.assert_allclose(out[0, 0, 0, 0], 10.0, rtol=1e-6)  # causal: only key 0
  np.testing.assert_allclose(out[0, 1, 0, 0], (10 * e + 20) / (e + 1), rtol=1e-6)


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (4, 2), (4, 1), (6, 3)])
@pytest.mark.parametrize("window", [None, 1, 3])
@pytest.mark.parametrize("soft_cap", [None, 2.0])
def test_attention_matches_loop_reference(num_heads, num_kv_heads, window, soft_cap):
  B, T, S, H = 3, 4, 9, 8
  q = _rand(0, (B, T, num_heads, H)) * 2
  k = _rand(1, (B, num_kv_heads, S, H))
  v = _rand(2, (B, num_kv_heads, S, 6))  # Hv != H
  q_offsets = np.array([0, 3, 5])
  kv_lengths = np.array([4, 7, 9])
  out = ops.attention(q, k, v, q_offsets=jnp.array(q_offsets), kv_lengths=jnp.array(kv_lengths),
                      window=window, soft_cap=soft_cap)
  ref = _naive(q, k, v, q_offsets, kv_lengths, window=window, soft_cap=soft_cap)
  np.testing.assert_allclose(np.asarray(out), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("garbage", [0.0, 1e30, np.inf, np.nan])
def test_unused_slots_never_leak(garbage):
  B, N, K, S, H = 2, 4, 2, 12, 8
  q = _rand(0, (B, N, H))
  k = _rand(1, (B, K, S, H))
  v = _rand(2, (B, K, S, H))
  lengths = jnp.array([5, 12])
  clean = ops.decode_attention(q, k, v, lengths)
  slots = jnp.arange(S)[None, None, :, None]
  unused = slots >= lengths[:, None, None, None]
  k_bad = jnp.where(unused, garbage, k)
  v_bad = jnp.where(unused, garbage, v)
  dirty = ops.decode_attention(q, k_bad, v_bad, lengths)
  assert np.isfinite(np.asarray(dirty)).all()
  np.testing.assert_array_equal(np.asarray(dirty), np.asarray(clean))


def test_result_independent_of_capacity():
  B, N, K, H = 2, 4, 2, 8
  q = _rand(0, (B, N, H))
  k = _rand(1, (B, K, 32, H))
  v = _rand(2, (B, K, 32, H))
  lengths = jnp.array([3, 10])
  small = ops.decode_attention(q, k[:, :, :10], v[:, :, :10], lengths)
  large = ops.decode_attention(q, k, v, lengths)
  np.testing.assert_allclose(np.asarray(small), np.asarray(large), atol=1e-6)


def test_length_zero_row_is_exact_zeros():
  B, N, K, S, H = 3, 4, 2, 6, 8
  q = _rand(0, (B, N, H))
  k = jnp.full((B, K, S, H), jnp.nan)
  v = jnp.full((B, K, S, H), jnp.nan)
  k = k.at[1].set(_rand(1, (K, S, H)))
  v = v.at[1].set(_rand(2, (K, S, H)))
  out = np.asarray(ops.decode_attention(q, k, v, jnp.array([0, 4, 0])))
  assert np.all(out[0] == 0.0) and np.all(out[2] == 0.0)
  assert np.isfinite(out[1]).all() and np.abs(out[1]).sum() > 0


def test_zero_query_tokens_give_an_empty_output():
  k = _rand(1, (2, 2, 5, 8))
  out = ops.attention(jnp.zeros((2, 0, 4, 8)), k, k, q_offsets=jnp.array([3, 0]),
                      kv_lengths=jnp.array([3, 0]))
  assert out.shape == (2, 0, 4, 8) and out.dtype == jnp.float32


@pytest.mark.parametrize("window", [1, 2, 5])
def test_window_attends_exactly_min_t_plus_1_w_keys(window):
  # With all-zero queries the weights are uniform over attended keys; values
  # that are one-hot per slot reveal exactly which keys each query attends.
  T = 8
  q = jnp.zeros((1, T, 1, 4))
  k = _rand(0, (1, 1, T, 4))
  v = jnp.eye(T)[None, None]  # slot s -> one-hot e_s
  out = np.asarray(ops.attention(q, k, v, window=window))[0, :, 0]  # [T, T]
  for t in range(T):
    attended = np.nonzero(out[t] > 0)[0]
    expected = list(range(max(0, t - window + 1), t + 1))
    assert attended.tolist() == expected
    np.testing.assert_allclose(out[t, attended], 1.0 / len(expected), rtol=1e-6)
    assert len(attended) == min(t + 1, window)


def test_query_head_n_reads_kv_head_n_div_g():
  B, N, K, S = 1, 8, 2, 3
  G = N // K
  q = _rand(0, (B, N, 4))
  k = _rand(1, (B, K, S, 4))
  v = jnp.broadcast_to(jnp.eye(K)[None, :, None, :], (B, K, S, K))  # KV head j -> e_j
  out = np.asarray(ops.decode_attention(q, k, v, jnp.array([S])))[0]  # [N, K]
  for n in range(N):
    np.testing.assert_allclose(out[n], np.eye(K)[n // G], atol=1e-6)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_low_precision_inputs_accumulate_in_f32(dtype):
  B, N, K, S, H = 2, 4, 1, 512, 64
  q = _rand(0, (B, N, H), dtype)
  k = _rand(1, (B, K, S, H), dtype)
  v = _rand(2, (B, K, S, H), dtype) + 1.0
  lengths = jnp.array([S, 300])
  out = ops.decode_attention(q, k, v, lengths)
  assert out.dtype == dtype
  ref = ops.decode_attention(q.astype(jnp.float32), k.astype(jnp.float32),
                             v.astype(jnp.float32), lengths)
  # Error is dominated by rounding the output once, not by accumulating S terms.
  eps = float(jnp.finfo(dtype).eps)
  np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref), rtol=2 * eps, atol=2 * eps)


def test_large_logits_are_finite():
  q = _rand(0, (1, 2, 8)) * 1e4
  k = _rand(1, (1, 1, 16, 8)) * 1e4
  v = _rand(2, (1, 1, 16, 8))
  out = ops.decode_attention(q, k, v, jnp.array([16]))
  assert np.isfinite(np.asarray(out)).all()


def test_validation_messages_name_values():
  q = jnp.zeros((2, 6, 8))
  k = jnp.zeros((2, 4, 5, 8))
  with pytest.raises(ValueError, match="num_heads must be divisible by num_kv_heads; got 6 and 4"):
    ops.decode_attention(q, k, k, jnp.array([1, 1]))
  with pytest.raises(ValueError, match=r"q must have rank 3 \[B, N, H\]; got shape \(2, 1, 6, 8\)"):
    ops.decode_attention(q[:, None], k, k, jnp.array([1, 1]))
  with pytest.raises(TypeError, match="k and v must share one dtype; got k=float32, v=bfloat16"):
    ops.decode_attention(jnp.zeros((2, 4, 8)), k, k.astype(jnp.bfloat16), jnp.array([1, 1]))
  with pytest.raises(TypeError, match="lengths must have an integer dtype; got float32"):
    ops.decode_attention(jnp.zeros((2, 4, 8)), k, k, jnp.array([1.0, 1.0]))
  with pytest.raises(ValueError, match=r"lengths must have shape \[B\] = \(2,\); got \(3,\)"):
    ops.decode_attention(jnp.zeros((2, 4, 8)), k, k, jnp.array([1, 1, 1]))
  with pytest.raises(ValueError, match="window must be a positive int; got 0"):
    ops.decode_attention(jnp.zeros((2, 4, 8)), k, k, jnp.array([1, 1]), window=0)
  with pytest.raises(ValueError, match="implementation must be one of .*; got 'cuda'"):
    ops.decode_attention(jnp.zeros((2, 4, 8)), k, k, jnp.array([1, 1]), implementation="cuda")
  with pytest.raises(ValueError, match=r"q.shape\[2\] \(head dim H, from k\) must be 8"):
    ops.decode_attention(jnp.zeros((2, 4, 7)), k, k, jnp.array([1, 1]))


def test_dispatch_xla_equals_reference_function():
  q = _rand(0, (2, 4, 8))
  k = _rand(1, (2, 2, 10, 8))
  v = _rand(2, (2, 2, 10, 8))
  lengths = jnp.array([4, 10])
  a = ops.decode_attention(q, k, v, lengths, implementation="xla", window=3)
  b = ops.decode_attention_xla(q, k, v, lengths, window=3)
  np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert "xla" in ops.available_implementations()


def test_mla_decode_equals_single_kv_head_attention_over_concatenated_key():
  B, N, C, R, S = 2, 4, 16, 8, 10
  ql, qr = _rand(0, (B, N, C)), _rand(1, (B, N, R))
  c_kv, k_rope = _rand(2, (B, S, C)), _rand(3, (B, S, R))
  lengths = jnp.array([3, 10])
  out = ops.mla_decode_attention(ql, qr, c_kv, k_rope, lengths, sm_scale=0.3)
  dense = ops.decode_attention(jnp.concatenate([ql, qr], -1),
                               jnp.concatenate([c_kv, k_rope], -1)[:, None], c_kv[:, None],
                               lengths, sm_scale=0.3)
  np.testing.assert_allclose(np.asarray(out), np.asarray(dense), atol=1e-6)
  with pytest.raises(ValueError, match="sm_scale is required for MLA"):
    ops.mla_decode_attention(ql, qr, c_kv, k_rope, lengths, sm_scale=None)


@pytest.mark.parametrize("window", [None, 4])
def test_lengths_past_capacity_are_clamped_like_the_kernels(window):
  # After an overflow under jit, lengths may exceed S (the sticky flag of
  # kvattn.caches.dense); the dropped tokens are not attended and every backend
  # treats the row as full: the same result as lengths == S.
  B, N, K, S, H = 2, 4, 2, 32, 16
  q, k, v = _rand(0, (B, N, H)), _rand(1, (B, K, S, H)), _rand(2, (B, K, S, H))
  over = jnp.array([40, 33])
  full = jnp.array([S, S])
  # Only under jit: eager, a length past S is a caller error (tests/kvattn/ops/test_dispatch.py).
  decode = jax.jit(ops.decode_attention, static_argnames=("window", "implementation"))
  for impl in ("xla", "xla_blocked"):
    out = decode(q, k, v, over, window=window, implementation=impl)
    ref = decode(q, k, v, full, window=window, implementation="xla")
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=1e-6)
    assert np.abs(np.asarray(out)).sum() > 0
  # Multi-token form: queries whose slots fell past S sit at the last slot.
  out = ops.attention(q[:, None], k, v, q_offsets=over - 1, kv_lengths=over, window=window)
  ref = ops.attention(q[:, None], k, v, q_offsets=full - 1, kv_lengths=full, window=window)
  np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=1e-6)


@pytest.mark.parametrize("implementation", ["xla", "xla_blocked"])
def test_nan_before_the_window_start_does_not_leak(implementation):
  B, N, K, S, H, W = 2, 4, 2, 32, 8, 5
  q, k, v = _rand(0, (B, N, H)), _rand(1, (B, K, S, H)), _rand(2, (B, K, S, H))
  lengths = jnp.array([20, 9])
  want = ops.decode_attention(q, k, v, lengths, window=W, implementation=implementation)
  # Slots 0..3 lie before both rows' windows ([15, 20) and [4, 9)): attended by neither.
  dirty = dict(k=k.at[:, :, :4].set(jnp.nan), v=v.at[:, :, :4].set(jnp.nan))
  got = ops.decode_attention(q, dirty["k"], dirty["v"], lengths, window=W,
                             implementation=implementation)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  # MLA's decode likewise (the latent is also the value).
  c, r = _rand(3, (B, S, 16)), _rand(4, (B, S, 4))
  ql, qr = _rand(5, (B, N, 16)), _rand(6, (B, N, 4))
  want = ops.mla_decode_attention(ql, qr, c, r, lengths, sm_scale=0.3, window=W,
                                  implementation="xla")
  got = ops.mla_decode_attention(ql, qr, c.at[:, :4].set(jnp.nan), r.at[:, :4].set(jnp.nan),
                                 lengths, sm_scale=0.3, window=W, implementation="xla")
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
