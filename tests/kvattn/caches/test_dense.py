"""KVCache: pytree structure, per-sequence writes, right padding, overflow."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify

import kvattn
from kvattn import KVCache, memory


def _tokens(key, B, T, K=2, H=4):
  return jax.random.normal(jax.random.key(key), (B, T, K, H))


def test_init_shapes_and_pytree():
  c = KVCache.init(3, 16, 2, 8, jnp.bfloat16)
  assert c.k.shape == c.v.shape == (3, 2, 16, 8)
  assert c.k.dtype == jnp.bfloat16 and c.lengths.dtype == jnp.int32
  assert (c.batch, c.num_kv_heads, c.max_len, c.head_dim) == (3, 2, 16, 8)
  leaves, treedef = jax.tree_util.tree_flatten(c)
  assert len(leaves) == 3
  assert isinstance(jax.tree_util.tree_unflatten(treedef, leaves), KVCache)


def test_update_writes_each_sequence_at_its_own_offset():
  c = KVCache.init(2, 8, 2, 4)
  first = _tokens(0, 2, 3)
  c = c.update(first, first, new_lengths=jnp.array([3, 1]))
  np.testing.assert_array_equal(np.asarray(c.lengths), [3, 1])
  second = _tokens(1, 2, 2)
  c = c.update(second, -second)
  np.testing.assert_array_equal(np.asarray(c.lengths), [5, 3])
  k = np.asarray(c.k)
  np.testing.assert_array_equal(k[0, :, 0:3], np.asarray(first[0]).transpose(1, 0, 2))
  np.testing.assert_array_equal(k[0, :, 3:5], np.asarray(second[0]).transpose(1, 0, 2))
  np.testing.assert_array_equal(k[1, :, 0:1], np.asarray(first[1, :1]).transpose(1, 0, 2))
  np.testing.assert_array_equal(k[1, :, 1:3], np.asarray(second[1]).transpose(1, 0, 2))
  np.testing.assert_array_equal(np.asarray(c.v)[1, :, 1:3], -np.asarray(second[1]).transpose(1, 0, 2))


def test_padded_tokens_are_not_written():
  c = KVCache.init(2, 6, 2, 4)
  c = c.replace(k=jnp.full_like(c.k, 7.0), v=jnp.full_like(c.v, 7.0))
  new = _tokens(0, 2, 4)
  c = c.update(new, new, new_lengths=jnp.array([2, 0]))
  k = np.asarray(c.k)
  assert np.all(k[0, :, 2:] == 7.0)  # slots past the 2 real tokens untouched
  assert np.all(k[1] == 7.0)  # a zero-length update writes nothing
  np.testing.assert_array_equal(np.asarray(c.lengths), [2, 0])


def test_update_casts_to_cache_dtype():
  c = KVCache.init(1, 4, 2, 4, jnp.bfloat16)
  c = c.update(_tokens(0, 1, 2), _tokens(1, 1, 2))
  assert c.k.dtype == jnp.bfloat16


def test_eager_overflow_raises_before_writing():
  c = KVCache.init(2, 4, 2, 4).update(_tokens(0, 2, 3), _tokens(0, 2, 3),
                                       new_lengths=jnp.array([3, 1]))
  with pytest.raises(ValueError, match=r"cache overflow: lengths \+ new_lengths = \[5, 3\] "
                     r"exceeds max_len 4 for sequences \[0\]"):
    c.update(_tokens(1, 2, 2), _tokens(1, 2, 2))


def test_jit_overflow_drops_tokens_and_sets_sticky_flag():
  c = KVCache.init(2, 4, 2, 4)
  first = _tokens(0, 2, 3)
  c = c.update(first, first, new_lengths=jnp.array([3, 1]))
  before = np.asarray(c.k)
  update = jax.jit(lambda cache, x: cache.update(x, x))
  c2 = update(c, _tokens(1, 2, 2))
  np.testing.assert_array_equal(np.asarray(c2.overflowed), [True, False])
  np.testing.assert_array_equal(np.asarray(c2.lengths), [5, 3])
  k = np.asarray(c2.k)
  # Sequence 0: slot 3 was written, the token for slot 4 dropped; slots 0-2
  # (the earlier tokens) are intact — nothing wrapped around or clamped.
  np.testing.assert_array_equal(k[0, :, :3], before[0, :, :3])
  np.testing.assert_array_equal(k[0, :, 3], np.asarray(_tokens(1, 2, 2))[0, 0])
  # The flag is sticky: a later in-bounds-looking update keeps it set.
  c3 = update(c2, _tokens(2, 2, 0))
  np.testing.assert_array_equal(np.asarray(c3.overflowed), [True, False])


def test_jit_overflow_is_a_checkify_error():
  c = KVCache.init(1, 2, 1, 4)
  x = jnp.ones((1, 3, 1, 4))
  checked = checkify.checkify(jax.jit(lambda cache, x: cache.update(x, x)),
                              errors=checkify.user_checks)
  err, _ = checked(c, x)
  with pytest.raises(checkify.JaxRuntimeError, match="cache overflow"):
    err.throw()
  err, _ = checked(KVCache.init(1, 4, 1, 4), x)
  err.throw()  # fits: no error


def _kinds_holding(lengths):
  """kvattn's own kinds with a crafted `lengths` state (as `.replace` or a file makes one)."""
  B, K, H = len(lengths), 2, 4
  lengths = jnp.asarray(lengths, jnp.int32)
  caches = {
      "dense": KVCache.init(B, 8, K, H),
      "latent": kvattn.LatentCache.init(B, 8, 6, 4),
      "paged": kvattn.PagedKVCache.contiguous(B, 8, K, H, page_size=4),
      "ring": kvattn.RingKVCache.init(B, 4, K, H),
      "sink": kvattn.SinkKVCache.init(B, 1, 4, K, H),
      "h2o": kvattn.EvictingKVCache.init(B, 4, K, H, policy="h2o"),
      "length_switch": kvattn.LengthSwitchKVCache.init(B, 8, K, H, switch_length=4,
                                                       num_kv_heads_after=1),
  }
  return {name: c.replace(lengths=lengths) for name, c in caches.items()}


def _one_token(cache):
  if isinstance(cache, kvattn.LatentCache):
    return jnp.ones((cache.batch, 1, 6)), jnp.ones((cache.batch, 1, 4))
  return (jnp.ones((cache.batch, 1, 2, 4)),) * 2


@pytest.mark.parametrize("kind", sorted(_kinds_holding([0, 0])))
def test_eager_update_of_a_cache_with_a_negative_length_raises(kind):
  cache = _kinds_holding([1, -2])[kind]
  with pytest.raises(ValueError,
                     match=r"cache lengths\[1\] = -2 must (lie in \[0, 8\]|be >= 0)"):
    cache.update(*_one_token(cache))
  with pytest.raises(ValueError, match=r"cache lengths\[1\] = -2"):
    cache.check_state()
  cache.replace(lengths=jnp.array([0, 0], jnp.int32)).check_state()  # empty: valid
  # Under jit nothing is checked (lengths are traced): a negative length writes nothing.
  after = jax.jit(lambda c, *new: c.update(*new))(cache, *_one_token(cache))
  np.testing.assert_array_equal(np.asarray(after.lengths), [2, -1])


@pytest.mark.parametrize("kind", ["dense", "latent", "paged", "length_switch"])
def test_eager_update_of_a_cache_past_its_capacity_raises(kind):
  cache = _kinds_holding([9, 0])[kind]
  with pytest.raises(ValueError, match=r"cache lengths\[0\] = 9 must lie in \[0, 8\]"):
    cache.update(*_one_token(cache))


def test_validation():
  with pytest.raises(ValueError, match="max_len must be a positive int; got 0"):
    KVCache.init(1, 0, 1, 4)
  with pytest.raises(TypeError,
                     match=r"dtype must be a floating dtype or a quantized KV format .*; got int32"):
    KVCache.init(1, 4, 1, 4, jnp.int32)
  c = KVCache.init(2, 4, 2, 4)
  with pytest.raises(ValueError, match=r"k_new must have shape \[B, T, K, H\] = \(2, T, 2, 4\); "
                     r"got \(2, 1, 3, 4\)"):
    c.update(jnp.zeros((2, 1, 3, 4)), jnp.zeros((2, 1, 3, 4)))
  with pytest.raises(ValueError, match=r"new_lengths must lie in \[0, T\] = \[0, 1\]; got \[2, 0\]"):
    c.update(jnp.zeros((2, 1, 2, 4)), jnp.zeros((2, 1, 2, 4)), new_lengths=jnp.array([2, 0]))
  with pytest.raises(TypeError, match="k_new must have a floating dtype; got int32"):
    c.update(jnp.ones((2, 1, 2, 4), jnp.int32), jnp.zeros((2, 1, 2, 4)))  # not cast silently


def test_memory_measured_equals_analytic():
  for dtype in (jnp.float32, jnp.bfloat16):
    c = KVCache.init(3, 10, 2, 16, dtype)
    assert memory.measured_bytes_per_token(c) == memory.gqa_bytes_per_token(2, 16, dtype)
    assert memory.tree_bytes(c) == 2 * 3 * 2 * 10 * 16 * jnp.dtype(dtype).itemsize + 3 * 4
  assert memory.mha_bytes_per_token(8, 64, jnp.bfloat16) == 2 * 8 * 64 * 2
  assert memory.mla_bytes_per_token(512, 64, jnp.bfloat16) == (512 + 64) * 2
  with pytest.raises(TypeError, match="cache must be a kvattn cache"):
    memory.measured_bytes_per_token({"k": jnp.zeros(3)})
