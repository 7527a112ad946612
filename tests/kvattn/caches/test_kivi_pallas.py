"""The KIVI cache read by its Pallas kernel (pallas_kernels/lowbit_decode.py, interpret mode).

A decode step with `implementation="pallas"` reads the packed store through the kernel and
merges the residual ring and the new token by log-sum-exp; it must equal the XLA loop
(`implementation="xla"`) over store edges (empty store, one group, several blocks, full
capacity), with a window and soft cap, with garbage in every unused slot, for `update_attend`
and for `attend` after `update`; a model decoding through it generates the XLA loop's tokens.
Keys stored before RoPE have no kernel: "pallas" alone raises, ("pallas", "xla") falls back.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvattn.caches.kivi import KIVICache
from tests.kvattn.caches import _store_kernel as store_kernel
from tests.kvattn.caches.test_kivi import _poison  # garbage in every unused slot

K, H, N, G = 2, 16, 8, 16  # H and the group: the smallest the kernel's GPU schedule takes
CAPACITY, RESIDUAL = 96, 16  # Sq = 80 store slots, ring 31
# Before the step: stores of 0, 0, 0, 16, 16, 64 tokens (rows 2 / 3: one token short of /
# exactly flushing a group in this step); the last row full after it.
LENGTHS = (0, 1, 31, 32, 33, CAPACITY - 1)


def _filled(bits, pre_rope=False, seed=0):
  rng = np.random.default_rng(seed)
  batch = len(LENGTHS)
  cache = KIVICache.init(batch, CAPACITY, K, H, bits=bits, group_size=G, residual=RESIDUAL,
                         pre_rope=pre_rope)
  k, v = (jnp.asarray(rng.standard_normal((batch, CAPACITY, K, H)), jnp.float32)
          for _ in range(2))
  return jax.jit(KIVICache.update)(cache, k, v, jnp.asarray(LENGTHS, jnp.int32))


def _qkv():
  return store_kernel.qkv(len(LENGTHS), N, K, H)


_step = store_kernel.step


@pytest.mark.parametrize("bits,options", [
    (2, {"window": 20, "soft_cap": 3.0}),  # the window starts inside the store for row 5
    # Fast: one case (the kernel's own tests cover both widths); each compiles 3 programs.
    pytest.param(4, {}, marks=pytest.mark.slow),
    pytest.param(4, {"window": 20}, marks=pytest.mark.slow),
    pytest.param(2, {}, marks=pytest.mark.slow),
])
def test_decode_through_the_kernel_equals_the_xla_loop(bits, options):
  cache = _filled(bits)
  assert cache.store_capacity == 80
  np.testing.assert_array_equal(cache.num_quantized, [0, 0, 0, 16, 16, 64])
  store_kernel.check_kernel_equals_loop(cache, _poison(cache), *_qkv(), options)


def test_pre_rope_keys_have_no_kernel():
  cache = _filled(4, pre_rope=True)
  q, k, v = _qkv()
  with pytest.raises(NotImplementedError, match=r"pre_rope=True.*XLA loop only"):
    _step("pallas")(cache, q, k, v)
  with pytest.raises(NotImplementedError, match="implementation must be None, 'pallas' or"):
    _step("xla_blocked")(cache, q, k, v)


@pytest.mark.slow  # two more compiled programs; fast: the refusal above
def test_pre_rope_keys_fall_back_to_the_xla_loop():
  cache = _filled(4, pre_rope=True)
  q, k, v = _qkv()
  got = _step(("pallas", "xla"))(cache, q, k, v)[0]
  np.testing.assert_array_equal(np.asarray(got), np.asarray(_step("xla")(cache, q, k, v)[0]))


@pytest.mark.slow  # ~15 s of interpret-mode compilation; fast: the step parity above
def test_generate_through_the_kernel_equals_the_xla_loop():
  store_kernel.check_generate_equals_loop({"kind": "kivi4", "group_size": 16, "residual": 16})
