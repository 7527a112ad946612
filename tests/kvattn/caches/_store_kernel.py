"""What test_kivi_pallas.py and test_rotated_pallas.py share: a low-bit cache's decode step
and generation through its Pallas kernel ("pallas", interpret mode) against the XLA loop."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kvattn import generate
from kvattn.caches import registry
from kvattn.models import transformer


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3))
def qkv(batch, num_heads, num_kv, head_dim):
  """Random `q [B, 1, N, H]`, `k, v [B, 1, K, H]` of one decode step."""
  keys = jax.random.split(jax.random.key(1), 3)
  return (jax.random.normal(keys[0], (batch, 1, num_heads, head_dim)),
          jax.random.normal(keys[1], (batch, 1, num_kv, head_dim)),
          jax.random.normal(keys[2], (batch, 1, num_kv, head_dim)))


@functools.lru_cache(maxsize=None)  # one compiled program per backend and options
def step(implementation, options=()):
  """The jitted step `(out, new cache, new.attend(q))` of `update_attend` then `attend`."""
  options = dict(options)

  def run(cache, q, k, v):
    out, new = cache.update_attend(q, k, v, positions=cache.lengths[:, None], rope_theta=1e4,
                                   new_lengths=None, implementation=implementation, **options)
    return out, new, new.attend(q, q_offsets=cache.lengths, implementation=implementation,
                                **options)
  return jax.jit(run)


def check_kernel_equals_loop(cache, poisoned, q, k, v, options):
  """"pallas" equals "xla" (the write bit for bit), and garbage in `poisoned`'s unused
  slots changes nothing."""
  options = tuple(sorted(options.items()))
  want, want_cache, want_attend = step("xla", options)(cache, q, k, v)
  got, got_cache, got_attend = step("pallas", options)(cache, q, k, v)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=2e-5)
  np.testing.assert_allclose(np.asarray(got_attend), np.asarray(want_attend), atol=2e-5,
                             rtol=2e-5)
  for a, b in zip(jax.tree.leaves(got_cache), jax.tree.leaves(want_cache)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))  # the write is the same
  dirty, _, dirty_attend = step("pallas", options)(poisoned, q, k, v)
  np.testing.assert_array_equal(np.asarray(dirty), np.asarray(got))
  np.testing.assert_array_equal(np.asarray(dirty_attend), np.asarray(got_attend))


def check_generate_equals_loop(spec):
  """A small model generates the same tokens with cache `spec` through "pallas" and "xla"."""
  cfg = transformer.model_config(d_model=32, num_layers=2, mlp_dim=64, vocab_size=64,
                                 attention=dict(kind="gqa", num_heads=4, num_kv_heads=2,
                                                head_dim=16))
  model = transformer.Transformer.from_config(cfg, rngs=nnx.Rngs(0))
  prompts = jax.random.randint(jax.random.key(0), (2, 40), 0, 64)
  lengths = jnp.asarray([40, 23], jnp.int32)
  runs = {}
  for implementation in ("xla", "pallas"):
    for layer in model.layers:
      layer.attn.decode_implementation = implementation
    runs[implementation] = generate(
        model, prompts, lengths, 12,
        cache_factory=registry.cache_factory_from_config(model, spec))[0]
  np.testing.assert_array_equal(runs["pallas"], runs["xla"])
