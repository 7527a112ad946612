"""One base test per decode backend: every backend of `kvattn.ops.dispatch.IMPLEMENTATIONS`
runs the same cases against the pure-jnp reference (tokamax's `test_base` is the model).

A backend registered for an op is picked up here with no other edit. The cases hold the
edges: lengths 0, 1, block - 1, block, block + 1 and capacity in one batch (block = 32 slots,
the Pallas kernel's key block on CPU), NaN in every unused slot or free page, G = 1 and
G = 8 query heads per KV head, and a window. Named explicitly, "pallas" runs interpreted on
CPU; a backend that declines the case must say why (NotImplementedError), never return
something else.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from kvattn import ops
from kvattn.ops import dispatch
import pallas_kernels

LENGTHS = np.array([0, 1, 31, 32, 33, 64], np.int32)  # capacity S = 64
CAPACITY, HEAD_DIM, PAGE = 64, 16, 16


def _backends(op):
  return [pytest.param(name, id=name) for name in dispatch.IMPLEMENTATIONS[op]]


def _run(fn, *args, **kwargs):
  try:
    return fn(*args, **kwargs)
  except NotImplementedError as e:
    assert str(e), "a backend that declines must say why"
    pytest.skip(f"declined: {e}")


def _poisoned(x, lengths, slot_axis):
  """`x` with NaN in every slot at or past each row's length (axis 0 is the batch)."""
  slots = np.arange(x.shape[slot_axis])
  shape = [1] * x.ndim
  shape[0], shape[slot_axis] = len(lengths), x.shape[slot_axis]
  unused = (slots[None, :] >= lengths[:, None]).reshape(shape)
  return jnp.where(unused, jnp.nan, x)


@pytest.mark.parametrize("window,num_heads,num_kv_heads", [  # G = 1, G = 8; the mixed cases slow
    (None, 2, 2), (20, 16, 2), pytest.param(None, 16, 2, marks=pytest.mark.slow),
    pytest.param(20, 2, 2, marks=pytest.mark.slow)])
@pytest.mark.parametrize("implementation", _backends("decode_attention"))
def test_dense_decode(implementation, window, num_heads, num_kv_heads):
  rng = np.random.default_rng(0)
  batch = len(LENGTHS)
  q = jnp.asarray(rng.normal(size=(batch, num_heads, HEAD_DIM)), jnp.float32)
  k, v = (jnp.asarray(rng.normal(size=(batch, num_kv_heads, CAPACITY, HEAD_DIM)), jnp.float32)
          for _ in range(2))
  lengths = jnp.asarray(LENGTHS)
  want = pallas_kernels.decode_attention_reference(q, k, v, lengths, window=window)
  got = _run(ops.decode_attention, q, _poisoned(k, LENGTHS, 2), _poisoned(v, LENGTHS, 2),
             lengths, window=window, implementation=implementation)
  np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)
  np.testing.assert_array_equal(np.asarray(got)[0], 0.0)  # a length-0 row gives zeros


@pytest.mark.parametrize("implementation", _backends("mla_decode_attention"))
def test_mla_decode(implementation):
  rng = np.random.default_rng(1)
  batch, num_heads, latent, rope = len(LENGTHS), 4, 32, 16
  q_latent = jnp.asarray(rng.normal(size=(batch, num_heads, latent)), jnp.float32)
  q_rope = jnp.asarray(rng.normal(size=(batch, num_heads, rope)), jnp.float32)
  c_kv = jnp.asarray(rng.normal(size=(batch, CAPACITY, latent)), jnp.float32)
  k_rope = jnp.asarray(rng.normal(size=(batch, CAPACITY, rope)), jnp.float32)
  lengths, scale = jnp.asarray(LENGTHS), 0.125
  want = pallas_kernels.mla_decode_attention_reference(q_latent, q_rope, c_kv, k_rope, lengths,
                                                       sm_scale=scale)
  got = _run(ops.mla_decode_attention, q_latent, q_rope, _poisoned(c_kv, LENGTHS, 1),
             _poisoned(k_rope, LENGTHS, 1), lengths, sm_scale=scale,
             implementation=implementation)
  np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)
  np.testing.assert_array_equal(np.asarray(got)[0], 0.0)


@pytest.mark.parametrize("implementation", _backends("paged_decode_attention"))
def test_paged_decode(implementation):
  rng = np.random.default_rng(2)
  batch, num_heads, num_kv_heads = len(LENGTHS), 4, 2
  pages_per_seq = CAPACITY // PAGE
  need = [int(-(-n // PAGE)) for n in LENGTHS]
  num_pages = sum(need) + 3  # 3 free pages
  order = rng.permutation(num_pages)  # pages out of order
  tables = np.zeros((batch, pages_per_seq), np.int32)
  used = np.zeros((num_pages, PAGE), bool)
  nxt = 0
  for b, n in enumerate(need):
    for j in range(n):
      tables[b, j] = order[nxt]
      used[order[nxt], :min(PAGE, LENGTHS[b] - j * PAGE)] = True
      nxt += 1
  q = jnp.asarray(rng.normal(size=(batch, num_heads, HEAD_DIM)), jnp.float32)
  k_pages, v_pages = (jnp.asarray(rng.normal(size=(num_kv_heads, num_pages, PAGE, HEAD_DIM)),
                                  jnp.float32) for _ in range(2))
  garbage = jnp.asarray(~used)[None, :, :, None]  # unused slots and free pages
  lengths, tables = jnp.asarray(LENGTHS), jnp.asarray(tables)
  want = pallas_kernels.paged_decode_attention_reference(q, k_pages, v_pages, tables, lengths)
  got = _run(ops.paged_decode_attention, q, jnp.where(garbage, jnp.nan, k_pages),
             jnp.where(garbage, jnp.nan, v_pages), tables, lengths,
             implementation=implementation)
  np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)
  np.testing.assert_array_equal(np.asarray(got)[0], 0.0)


def test_every_backend_is_in_the_base_test():
  # The parametrization reads the table, so a registered backend cannot skip these cases.
  assert {op: tuple(dispatch.IMPLEMENTATIONS[op]) for op in dispatch.IMPLEMENTATIONS} == {
      op: ops.available_implementations(op) for op in dispatch.IMPLEMENTATIONS}
