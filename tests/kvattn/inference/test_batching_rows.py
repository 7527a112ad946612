"""The batcher serves kinds of fixed rows (ring, sink, eviction policies, a policy from a
module outside kvattn): each sequence gets the tokens `generate` gives it alone with the same
cache spec, whatever joins or leaves around it."""

import functools

import numpy as np
import pytest
from flax import nnx

from kvattn.caches import registry
from kvattn.inference.batching import ContinuousBatcher
from kvattn.inference.generation import generate
from kvattn.models import transformer
from tests.experiments import user_policy

MAX_PROMPT, MAX_NEW = 12, 8
REQUESTS = [("a", 0, 11, 8), ("b", 1, 5, 3), ("c", 2, 9, 6)]


@functools.lru_cache(maxsize=None)
def _model():
  cfg = transformer.model_config(d_model=32, num_layers=2, mlp_dim=64,
                                 attention=dict(num_heads=4, num_kv_heads=2, head_dim=8))
  return transformer.Transformer.from_config(cfg, rngs=nnx.Rngs(0))


def _prompt(seed, n):
  return np.random.default_rng(seed).integers(0, 256, n).astype(np.int32)


def _alone(spec, seed, n):
  padded = np.zeros((1, MAX_PROMPT), np.int32)
  padded[0, :n] = _prompt(seed, n)
  factory = registry.cache_factory_from_config(_model(), spec)
  tokens, _ = generate(_model(), padded, np.array([n], np.int32), MAX_NEW, cache_factory=factory)
  return np.asarray(tokens)[0]


def serve_each_alone(spec) -> ContinuousBatcher:
  """Serves `REQUESTS` through a 2-slot batcher of cache `spec` and asserts each request gets
  the tokens `generate` gives it alone; returns the batcher (the kinds' own tests use it)."""
  batcher = ContinuousBatcher(_model(), num_slots=2, num_pages=1, page_size=4,
                              max_len=MAX_PROMPT + MAX_NEW, max_prompt_len=MAX_PROMPT,
                              cache=spec)
  done = batcher.run([(rid, _prompt(seed, n), new) for rid, seed, n, new in REQUESTS])
  for rid, seed, n, new in REQUESTS:
    np.testing.assert_array_equal(done[rid].tokens, _alone(spec, seed, n)[:new], err_msg=rid)
  return batcher


@pytest.mark.parametrize("spec", [
    {"kind": "h2o", "budget": 6},
    # The same machinery (rows reset, viewed and written back by the cache's own ops): -m slow.
    pytest.param({"kind": "knorm", "budget": 7}, marks=pytest.mark.slow),
    pytest.param({"kind": "sink", "num_sinks": 2, "window": 4}, marks=pytest.mark.slow),
    pytest.param({"kind": user_policy.NAME, "budget": 6}, marks=pytest.mark.slow),
], ids=lambda s: s["kind"])
def test_fixed_rows_give_each_sequence_its_tokens_alone(spec):
  batcher = serve_each_alone(spec)
  assert all(registry.CACHE_KIND_TABLE[spec["kind"]].bounded for _ in batcher.caches)
  assert batcher.traces["join"] == batcher.traces["step"] == 1  # rows reset, nothing retraced


def test_fixed_rows_refuse_the_prefix_cache():
  with pytest.raises(ValueError, match="prefix_cache is not supported with cache kind 'h2o'"):
    ContinuousBatcher(_model(), num_slots=2, num_pages=1, page_size=4, max_len=20,
                      max_prompt_len=MAX_PROMPT, cache={"kind": "h2o", "budget": 6},
                      prefix_cache=True)
