"""`Transformer.init_caches` and `generate` give a model with local layers the per-layer
layout by default (issue 38 item 7a): a ring of the window on each local layer."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import kvattn
from kvattn import memory
from kvattn.caches import window
from kvattn.models import transformer


def _gemma_like():  # Gemma 3's pattern in small: local layers of window 4, then a global one
  cfg = transformer.model_config(d_model=32, num_layers=4, mlp_dim=64, vocab_size=64,
                                 attention=dict(num_heads=4, num_kv_heads=1, head_dim=8),
                                 layers=({"window": 4}, {}) * 2)
  return transformer.Transformer.from_config(cfg, rngs=nnx.Rngs(0))


def test_default_layout_rings_the_local_layers_and_keeps_greedy_tokens():
  model = _gemma_like()
  default = model.init_caches(2, 24)
  full = model.init_caches(2, 24, local_layers="full")
  assert [type(c) is window.RingKVCache for c in default] == [True, False, True, False]
  assert [int(c.capacity) for c in default] == [4, 24, 4, 24]
  assert not any(isinstance(c, window.RingKVCache) for c in full)
  assert memory.tree_bytes(default) < memory.tree_bytes(full)

  prompts = jnp.asarray(np.random.default_rng(0).integers(0, 64, (2, 9)), jnp.int32)
  lengths = jnp.array([9, 6], jnp.int32)
  got, got_len = kvattn.generate(model, prompts, lengths, 6)  # default factory: rings
  want, want_len = kvattn.generate(
      model, prompts, lengths, 6,
      cache_factory=lambda b, s, d: model.init_caches(b, s, d, local_layers="full"))
  np.testing.assert_array_equal(got, want)
  np.testing.assert_array_equal(got_len, want_len)


def test_generate_sizes_its_memory_check_by_the_rings(monkeypatch):
  model = _gemma_like()
  full = memory.tree_bytes(model.init_caches(1, 4000, local_layers="full"))
  rings = memory.tree_bytes(model.init_caches(1, 4000))
  assert rings < full
  prompts, lengths = jnp.ones((1, 4), jnp.int32), jnp.array([4], jnp.int32)
  # Room for the rings and the output tokens, not for full-length caches on every layer.
  monkeypatch.setattr(memory, "available_bytes", lambda: (rings + full) // 2)
  kvattn.generate(model, prompts, lengths, 1, max_len=4000)
  monkeypatch.setattr(memory, "available_bytes", lambda: rings // 2)
  with pytest.raises(ValueError, match="max_len = 4000 needs about"):
    kvattn.generate(model, prompts, lengths, 1, max_len=4000)


@pytest.mark.slow  # the suite-time budget; the default layout itself is tested above
def test_a_draft_model_with_local_layers_keeps_full_caches():
  # Draft caches roll back by lengths, which rings cannot: the draft keeps full-length caches.
  from kvattn.inference import speculative  # pylint: disable=g-import-not-at-top
  model = _gemma_like()
  prompts = jnp.asarray(np.random.default_rng(1).integers(0, 64, (1, 7)), jnp.int32)
  lengths = jnp.array([7], jnp.int32)
  want, _ = kvattn.generate(model, prompts, lengths, 6)
  got, _ = kvattn.generate(model, prompts, lengths, 6,
                           speculative=speculative.DraftModel(model.truncated(2), 2))
  np.testing.assert_array_equal(got, want)
