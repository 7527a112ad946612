"""kvattn.ops.context_parallel against the single-device decode ops (one device, pure jnp).

The keys are cut into shards along S, each shard's partial attention and log-sum-exp
computed with `partial_attention` / `partial_mla_attention`, and `combine_partials` (the
reference of the in-mesh `merge_partials`, checked on 8 devices in test_sharding.py) must
give the single-device result, with NaN planted in every unused slot and with empty shards.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvattn import ops
from kvattn.ops import context_parallel as cp

S, SHARDS = 32, 4
SLOT_LEN = S // SHARDS
# Lengths at the edges: empty row, 1, shard boundary -1 / = / +1, capacity.
LENGTHS = [0, 1, SLOT_LEN - 1, SLOT_LEN, SLOT_LEN + 1, S]


def _poison(x, lengths, slot_axis):
  """NaN in every slot at or past the row's length."""
  slots = jnp.arange(x.shape[slot_axis])
  shape = [1] * x.ndim
  shape[0], shape[slot_axis] = len(lengths), x.shape[slot_axis]
  unused = (slots[None, :] >= jnp.asarray(lengths)[:, None]).reshape(shape)
  return jnp.where(unused, jnp.nan, x)


def _split(x, axis, i):
  return jax.lax.slice_in_dim(x, i * SLOT_LEN, (i + 1) * SLOT_LEN, axis=axis)


def _key_pos(batch, i):
  return jnp.broadcast_to(i * SLOT_LEN + jnp.arange(SLOT_LEN, dtype=jnp.int32), (batch, SLOT_LEN))


@pytest.mark.parametrize("num_kv_heads,window,soft_cap", [
    pytest.param(1, None, None, marks=pytest.mark.slow),  # MQA, no window: slow grid only
    (2, 5, 30.0),
])
def test_gqa_partials_merge_to_decode_attention(num_kv_heads, window, soft_cap):
  batch, num_heads, head_dim = len(LENGTHS), 4, 8
  kq, kk, kv = jax.random.split(jax.random.key(0), 3)
  q = jax.random.normal(kq, (batch, num_heads, head_dim))
  k = jax.random.normal(kk, (batch, num_kv_heads, S, head_dim))
  v = jax.random.normal(kv, (batch, num_kv_heads, S, head_dim))
  lengths = jnp.array(LENGTHS, jnp.int32)
  want = ops.decode_attention(q, k, v, lengths, window=window, soft_cap=soft_cap,
                              implementation="xla")
  k, v = _poison(k, LENGTHS, 2), _poison(v, LENGTHS, 2)
  partial = jax.jit(cp.partial_attention, static_argnames=("window", "soft_cap"))
  parts = [partial(q[:, None], _split(k, 2, i), _split(v, 2, i), _key_pos(batch, i),
                                (lengths - 1)[:, None], lengths, window=window,
                                soft_cap=soft_cap) for i in range(SHARDS)]
  o = jnp.stack([p[0] for p in parts])
  lse = jnp.stack([p[1] for p in parts])
  assert bool(jnp.all(jnp.isfinite(o)))
  # A shard with no visible key reports lse -inf (row 1 holds one token, in shard 0).
  assert bool(jnp.all(jnp.isneginf(lse[1:, 1]))) and bool(jnp.all(jnp.isneginf(lse[:, 0])))
  got = cp.combine_partials(o, lse)[:, 0]
  np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
  np.testing.assert_array_equal(got[0], 0.0)  # the empty row gives zeros


@pytest.mark.slow  # the fast suite checks the MLA merge on 8 devices (test_sharding.py)
def test_mla_partials_merge_to_mla_decode_attention():
  batch, num_heads, c, r = len(LENGTHS), 4, 16, 8
  keys = jax.random.split(jax.random.key(1), 4)
  q_lat = jax.random.normal(keys[0], (batch, num_heads, c))
  q_rope = jax.random.normal(keys[1], (batch, num_heads, r))
  c_kv = jax.random.normal(keys[2], (batch, S, c))
  k_rope = jax.random.normal(keys[3], (batch, S, r))
  lengths = jnp.array(LENGTHS, jnp.int32)
  want = ops.mla_decode_attention(q_lat, q_rope, c_kv, k_rope, lengths, sm_scale=0.2,
                                  implementation="xla")
  c_kv, k_rope = _poison(c_kv, LENGTHS, 1), _poison(k_rope, LENGTHS, 1)
  partial = jax.jit(cp.partial_mla_attention, static_argnames=("sm_scale",))
  parts = [partial(q_lat[:, None], q_rope[:, None], _split(c_kv, 1, i),
                                    _split(k_rope, 1, i), _key_pos(batch, i),
                                    (lengths - 1)[:, None], lengths, sm_scale=0.2)
           for i in range(SHARDS)]
  got = cp.combine_partials(jnp.stack([p[0] for p in parts]), jnp.stack([p[1] for p in parts]))
  np.testing.assert_allclose(got[:, 0], want, atol=1e-5, rtol=1e-5)


def test_combine_partials_all_empty_and_hand_case():
  # Two shards, one query: lse log(2) and log(6) -> weights 1/4 and 3/4.
  o = jnp.array([[[1.0, 0.0]], [[0.0, 2.0]]])
  lse = jnp.log(jnp.array([[2.0], [6.0]]))
  np.testing.assert_allclose(cp.combine_partials(o, lse), [[0.25, 1.5]], rtol=1e-6)
  empty = cp.combine_partials(jnp.zeros((3, 1, 2)), jnp.full((3, 1), -jnp.inf))
  np.testing.assert_array_equal(empty, 0.0)
