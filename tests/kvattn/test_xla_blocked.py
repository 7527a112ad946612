"""kvattn/ops/xla_blocked.py: the blocked (flash-decoding) XLA decode path."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvattn import ops
from kvattn.ops import xla_blocked
from pallas_kernels import attention_common

# Jitted once per static configuration; lengths are traced (no recompiles).
_blocked = jax.jit(xla_blocked.decode_attention_blocked,
                   static_argnames=("sm_scale", "window", "soft_cap", "block_k"))
_plain = jax.jit(ops.decode_attention_xla, static_argnames=("sm_scale", "window", "soft_cap"))

BLOCK = 16
S = 4 * BLOCK
LENGTHS = [np.array(x, np.int32) for x in ((0, 1, BLOCK - 1), (BLOCK, BLOCK + 1, S),
                                            (S + 7, 2, 0))]  # S + 7: clamped overflow


def _dense(num_heads, num_kv, head_dim, v_dim, dtype, capacity=S, seed=0):
  rng = np.random.RandomState(seed)
  return tuple(jnp.asarray(rng.randn(*s), dtype) for s in (
      (3, num_heads, head_dim), (3, num_kv, capacity, head_dim), (3, num_kv, capacity, v_dim)))


@pytest.mark.parametrize("num_heads,num_kv,window,soft_cap,dtype", [
    (8, 8, None, None, jnp.float32), (8, 2, BLOCK + 3, None, jnp.float32),
    (8, 1, 5, 20.0, jnp.float32), (48, 2, None, None, jnp.bfloat16)])
def test_matches_plain_xla_path(num_heads, num_kv, window, soft_cap, dtype):
  q, k, v = _dense(num_heads, num_kv, 32, 16, dtype)
  tol = 1e-5 if dtype == jnp.float32 else 2e-2
  for lengths in LENGTHS:
    expected = _plain(q, k, v, jnp.minimum(lengths, S), window=window, soft_cap=soft_cap)
    for block_k in (BLOCK, S):
      out = _blocked(q, k, v, lengths, window=window, soft_cap=soft_cap, block_k=block_k)
      np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(expected, np.float32),
                                 atol=tol, rtol=tol, err_msg=f"{lengths} block_k={block_k}")
    assert not np.asarray(out[lengths == 0], np.float32).any()


def test_garbage_in_unused_slots_does_not_leak():
  q, k, v = _dense(8, 2, 32, 32, jnp.float32, seed=1)
  lengths, window = np.array([0, BLOCK + 1, S - 2], np.int32), BLOCK
  clean = _blocked(q, k, v, lengths, window=window, block_k=BLOCK)
  unused = ~np.asarray(attention_common.decode_mask(lengths, S, window))  # [B, S]
  for value in (np.nan, 1e30, np.inf):
    dirty = jnp.where(unused[:, None, :, None], value, k), jnp.where(
        unused[:, None, :, None], value, v)
    out = _blocked(q, *dirty, lengths, window=window, block_k=BLOCK)
    np.testing.assert_array_equal(out, clean)


def test_mla_matches_plain_xla_path():
  rng = np.random.RandomState(2)
  q_latent, q_rope, c_kv, k_rope = (jnp.asarray(rng.randn(*s), jnp.float32) for s in (
      (3, 4, 32), (3, 4, 16), (3, S, 32), (3, S, 16)))
  for lengths in LENGTHS[:2]:
    expected = ops.mla_decode_attention_xla(q_latent, q_rope, c_kv, k_rope, lengths,
                                            sm_scale=0.2, window=20)
    out = xla_blocked.mla_decode_attention_blocked(q_latent, q_rope, c_kv, k_rope, lengths,
                                                   sm_scale=0.2, window=20, block_k=BLOCK)
    np.testing.assert_allclose(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="CPU-only backend")
def test_dispatch_picks_it_for_float_caches_only_when_named():
  # Inside the compiled generate loop the plain path is faster for float
  # caches (docs/benchmarks.md), so None never picks it for them.
  assert ops.available_implementations()[:3] == ("pallas", "xla_blocked", "xla")
  q, k, v = _dense(8, 2, 32, 32, jnp.float32, capacity=4096, seed=3)
  lengths = jnp.array([0, 700, 2048])
  auto = ops.decode_attention(q, k, v, lengths, window=1000)
  np.testing.assert_array_equal(
      auto, ops.decode_attention(q, k, v, lengths, window=1000, implementation="xla"))
  np.testing.assert_allclose(
      auto, ops.decode_attention(q, k, v, lengths, window=1000, implementation="xla_blocked"),
      atol=1e-5, rtol=1e-5)
  for dtype in (jnp.float32, jnp.bfloat16):
    with pytest.raises(NotImplementedError, match="not picked automatically"):
      xla_blocked._decode(q, k.astype(dtype), v.astype(dtype), lengths, explicit=False)
