"""The rotated codebook cache read by its Pallas kernel (pallas_kernels/rotated_decode.py,
interpret mode).

A decode step with `implementation="pallas"` reads the packed store through the kernel (q in
the rotated space, the output merged with the residual ring and the new token by log-sum-exp
and turned back afterwards); it must equal the XLA loop (`implementation="xla"`) over store
edges (empty store, one token, a store of no whole number of blocks, full capacity), with a
window and soft cap, with garbage in every unused slot, for `update_attend` and for `attend`
after `update`; a model decoding through it generates the XLA loop's tokens.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvattn.caches.rotated import RotatedCache
from tests.kvattn.caches import _store_kernel as store_kernel
from tests.kvattn.caches.test_rotated import _poison  # garbage in every unused slot

K, H, N = 2, 16, 8  # H: the smallest the kernel's GPU schedule takes
CAPACITY, RESIDUAL = 56, 4  # Sq = 52 store slots: one 32-slot block and a shifted one
# Before the step: stores of 0, 0, 1, 28, 48, 51 tokens (row 2: its first store token in
# this step; the last row full after it).
LENGTHS = (0, 1, 5, 32, 52, CAPACITY - 1)


def _filled(bits, seed=0):
  rng = np.random.default_rng(seed)
  batch = len(LENGTHS)
  cache = RotatedCache.init(batch, CAPACITY, K, H, bits=bits, residual=RESIDUAL, seed=seed)
  k, v = (jnp.asarray(rng.standard_normal((batch, CAPACITY, K, H)), jnp.float32)
          for _ in range(2))
  return jax.jit(RotatedCache.update)(cache, k, v, jnp.asarray(LENGTHS, jnp.int32))


@pytest.mark.parametrize("bits,options", [
    (3, {"window": 20, "soft_cap": 3.0}),  # the window starts inside the store (rows 3-5)
    # Fast: one case (the kernel's own tests cover both widths); each compiles 3 programs.
    pytest.param(4, {}, marks=pytest.mark.slow),
    pytest.param(4, {"window": 40}, marks=pytest.mark.slow),
])
def test_decode_through_the_kernel_equals_the_xla_loop(bits, options):
  cache = _filled(bits)
  assert cache.store_capacity == 52
  np.testing.assert_array_equal(cache.num_quantized, [0, 0, 1, 28, 48, 51])
  store_kernel.check_kernel_equals_loop(cache, _poison(cache),
                                        *store_kernel.qkv(len(LENGTHS), N, K, H), options)


def test_a_store_under_one_block_has_no_kernel():
  # Sq = 8 < 16 slots: the "loop" (Triton) schedule cannot tile it; "pallas" alone says
  # why, ("pallas", "xla") and the default (None) use the XLA loop (the
  # program of "xla").
  cache = RotatedCache.init(2, 12, K, H, bits=4, residual=4)
  q = jnp.ones((2, 1, N, H))
  kv = jnp.ones((2, 1, K, H))
  def step(implementation):
    return jax.jit(lambda c: c.update_attend(
        q, kv, kv, positions=c.lengths[:, None], rope_theta=1e4, new_lengths=None,
        implementation=implementation)[0]).trace(cache)  # traced only: no compilation

  with pytest.raises(NotImplementedError, match="under one 16-slot block"):
    step("pallas")
  loops = lambda implementation: step(implementation).lower().as_text().count("stablehlo.while")
  for implementation in (("pallas", "xla"), None):  # no interpreted kernel's grid loops
    assert loops(implementation) == loops("xla")


@pytest.mark.slow  # ~15 s of interpret-mode compilation; fast: the step parity above
def test_generate_through_the_kernel_equals_the_xla_loop():
  store_kernel.check_generate_equals_loop({"kind": "rotated4", "residual": 4})
