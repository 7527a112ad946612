"""The test-only pageable kind of toy_paged_kind.py (one file, no edit to kvattn) through
`generate`, the `ContinuousBatcher` with the prefix cache, and save / restore."""

import functools

import jax
import numpy as np
from flax import nnx

from kvattn.caches import checkpoint
from kvattn.caches import registry
from kvattn.inference.batching import ContinuousBatcher
from kvattn.inference.generation import generate, prefill
from kvattn.models import transformer
from tests.kvattn.caches import toy_paged_kind

SPEC = {"kind": "toy_paged", "page_size": 4}
PROMPT, NEW = 12, 6


@functools.lru_cache(maxsize=None)
def _model():
  cfg = transformer.model_config(d_model=32, num_layers=2, mlp_dim=64,
                                 attention=dict(num_heads=4, num_kv_heads=2, head_dim=8))
  return transformer.Transformer.from_config(cfg, rngs=nnx.Rngs(0))


def _prompts():
  rng = np.random.default_rng(3)
  shared = rng.integers(0, 256, 8)
  return [np.concatenate([shared, rng.integers(0, 256, n)]).astype(np.int32) for n in (3, 4)]


def _alone(prompt, cache_factory=None):
  padded = np.zeros((1, PROMPT), np.int32)
  padded[0, :len(prompt)] = prompt
  tokens, _ = generate(_model(), padded, np.array([len(prompt)], np.int32), NEW,
                       cache_factory=cache_factory)
  return np.asarray(tokens)[0]


def test_generate_with_the_toy_kind_equals_the_dense_cache():
  factory = registry.cache_factory_from_config(_model(), SPEC)
  assert all(type(c) is toy_paged_kind.ToyPagedKVCache for c in factory(1, 8))
  prompt = _prompts()[0]
  np.testing.assert_array_equal(_alone(prompt, factory), _alone(prompt))


def test_batcher_serves_the_toy_kind_with_the_prefix_cache():
  batcher = ContinuousBatcher(_model(), num_slots=2, num_pages=16, page_size=4,
                              max_len=PROMPT + NEW, max_prompt_len=PROMPT, cache="toy_paged",
                              prefix_cache=True)
  assert all(type(c) is toy_paged_kind.ToyPagedKVCache for c in batcher.caches)
  first, second = _prompts()
  done = batcher.run([("a", first, NEW)])
  done.update(batcher.run([("b", second, NEW)]))
  for rid, prompt in (("a", first), ("b", second)):
    np.testing.assert_array_equal(done[rid].tokens, _alone(prompt))
  # "b" took the 8 shared tokens (two pages) from the cache.
  assert batcher.prefill_tokens == len(first) + len(second) - 8


def test_save_and_restore_the_toy_kind(tmp_path):
  model = _model()
  caches = registry.build_caches(model, 2, 16, None, SPEC, tokens_per_seq=[16, 16])
  prompts = np.random.default_rng(0).integers(0, 256, (2, 7)).astype(np.int32)
  _, caches, _ = prefill(model, prompts, np.array([7, 5], np.int32), caches)
  checkpoint.save_caches(tmp_path / "ckpt", caches)
  like = registry.build_caches(model, 2, 16, None, SPEC, tokens_per_seq=[16, 16])
  restored, _, _ = checkpoint.restore_caches(tmp_path / "ckpt", like)
  assert [type(c) for c in restored] == [toy_paged_kind.ToyPagedKVCache] * 2
  for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(caches)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
