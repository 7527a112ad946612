"""ContinuousBatcher over 2/4-bit KIVI page pools (`cache="paged_kivi4"`): the tokens of
`generate` with the same cache kind, pages counted in store tokens, refusals named."""

import functools

import numpy as np
import pytest
from flax import nnx

from kvattn.caches import registry
from kvattn.caches.paged_kivi import PagedKIVICache
from kvattn.inference.batching import ContinuousBatcher
from kvattn.inference.generation import generate
from kvattn.inference.speculative import PromptLookup
from kvattn.models import transformer

PAGE = 4  # store slots per page: one key group
MAX_PROMPT = 12
MAX_NEW = 10
KIVI = dict(group_size=4, residual=4)  # small enough that prompts flush groups into pages


@functools.lru_cache(maxsize=None)
def _model():
  cfg = transformer.model_config(d_model=32, num_layers=2, mlp_dim=64, layers=({}, {"window": 6}),
                                 attention=dict(num_heads=4, num_kv_heads=2, head_dim=8))
  return transformer.Transformer.from_config(cfg, rngs=nnx.Rngs(0))


def _prompt(seed, n):
  return np.random.default_rng(seed).integers(0, 256, n).astype(np.int32)


@functools.lru_cache(maxsize=None)
def _alone(kind, seed, n):
  """Greedy tokens of the prompt decoded alone by `generate` through cache kind `kind`."""
  padded = np.zeros((1, MAX_PROMPT), np.int32)
  padded[0, :n] = _prompt(seed, n)
  factory = registry.cache_factory_from_config(_model(), {"kind": kind, **KIVI})
  tokens, _ = generate(_model(), padded, np.array([n], np.int32), MAX_NEW, cache_factory=factory)
  return np.asarray(tokens)[0]


def _batcher(kind="paged_kivi4", **kw):
  args = dict(num_slots=3, num_pages=12, page_size=PAGE, max_len=MAX_PROMPT + MAX_NEW,
              max_prompt_len=MAX_PROMPT, seed=0, cache={"kind": kind, **KIVI})
  args.update(kw)
  return ContinuousBatcher(_model(), **args)


# Prompts of 1..12 tokens: some flush no group at join (n - residual < group), some two;
# every sequence flushes more groups while it decodes (its pages grow in store tokens).
REQUESTS = [("a", 0, 5, 10), ("b", 1, 12, 3), ("c", 2, 1, 7), ("d", 3, 8, 10), ("e", 4, 4, 1),
            ("f", 5, 3, 6)]


@pytest.mark.parametrize("bits", [4, pytest.param(2, marks=pytest.mark.slow)])
def test_kivi_pools_give_the_tokens_of_generate_with_the_kind(bits):
  batcher = _batcher(f"paged_kivi{bits}")
  assert all(isinstance(c, PagedKIVICache) for c in batcher.caches)
  # Pages follow the store tokens: group 4, residual 4 put 4 * max(0, (n - 4) // 4) of n
  # tokens in the store. 11 prompt tokens: 4 stored, one page.
  assert batcher.add("g", _prompt(6, 11), 6) == 0
  assert len(batcher.allocator.pages("g")) == 1
  cache = batcher.caches[0]
  assert int(cache.num_quantized[0]) == 4 and int(cache.lengths[0]) == 11
  row = np.asarray(cache.block_tables[0])
  assert row[0] == batcher.allocator.pages("g")[0] and (row[1:] < 0).all()
  assert batcher.step() == []  # the 12th token: 12 - 4 = 8 stored, a 2nd page given first
  assert len(batcher.allocator.pages("g")) == 2 and int(batcher.caches[0].num_quantized[0]) == 8
  assert not np.asarray(batcher.caches[0].overflowed).any()
  results = batcher.run([(rid, _prompt(seed, n), new) for rid, seed, n, new in REQUESTS])
  for rid, seed, n, new in REQUESTS + [("g", 6, 11, 6)]:
    f = results[rid]
    assert f.reason == "length" and len(f.tokens) == new
    # The dense KIVI store and the paged one give the same tokens (bit-equal stores).
    np.testing.assert_array_equal(f.tokens, _alone(f"kivi{bits}", seed, n)[:new], err_msg=rid)
  assert max(f.joined_step for f in results.values()) > 0  # joined mid-run
  assert batcher.traces == {"join": 1, "step": 1, "set_row": 1, "release": 1}
  assert batcher.allocator.num_free == 12 and batcher.free_slots == [0, 1, 2]
  batcher.allocator.check()
  # A prompt shorter than the residual needs no page at all.
  assert batcher.add("short", _prompt(1, 3), 2) == 0 and batcher.allocator.num_used == 0


def test_options_that_cannot_work_with_low_bit_pools_are_refused():
  with pytest.raises(ValueError, match=r"prefix_cache is not supported with cache kind "
                     r"'paged_kivi4'.*residual"):
    _batcher(prefix_cache=True)
  with pytest.raises(ValueError, match="speculative is not supported with cache kind"):
    _batcher(speculative=PromptLookup(2))
  with pytest.raises(ValueError, match="local_layers is not supported with cache kind"):
    _batcher(local_layers="ring")
  with pytest.raises(ValueError, match=r"cache.kind must be one of \('paged', 'paged_kivi2', "
                     r"'paged_kivi4'\).*got 'kivi4'"):
    _batcher(cache="kivi4")
  with pytest.raises(ValueError, match=r"cache.page_size must be unset or the batcher's "
                     r"page_size = 4"):
    _batcher(cache={"kind": "paged_kivi4", "page_size": 8, **KIVI})
  with pytest.raises(ValueError, match="page_size must be a multiple of group_size = 8"):
    _batcher(cache={"kind": "paged_kivi4", "group_size": 8, "residual": 8})
  with pytest.raises(ValueError, match=r"cache.bits is not an option"):
    _batcher(cache={"kind": "paged_kivi4", "bits": 3})
