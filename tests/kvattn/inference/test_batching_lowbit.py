"""ContinuousBatcher over 2/4-bit KIVI page pools (`cache="paged_kivi4"`): the tokens of
`generate` with the same cache kind, pages counted in store tokens, prefix hits (with and
without a residual) bit-equal to cold prefills, refusals named."""

import functools

import jax
import numpy as np
import pytest
from flax import nnx

from kvattn import sharding
from kvattn.caches import registry
from kvattn.caches.paged_kivi import PagedKIVICache
from kvattn.inference.batching import ContinuousBatcher
from kvattn.inference.generation import generate
from kvattn.inference.speculative import PromptLookup
from tests.kvattn.inference import _tiny

PAGE = 4  # store slots per page: one key group
MAX_PROMPT = 12
MAX_NEW = 10
KIVI = dict(group_size=4, residual=4)  # small enough that prompts flush groups into pages


_model, _prompt = _tiny.model, _tiny.prompt


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


@pytest.mark.slow  # ~20 CPU-seconds: the chunked join, the step and a reference program
def test_prefix_hits_restore_the_state_a_cold_prefill_writes_bit_for_bit():
  # residual 0: the packed store is all a prefix leaves; prompts are prefilled a page at a time
  # (module docstring of batching), so a hit is the state a cold prefill reaches there.
  spec = {"kind": "paged_kivi4", "group_size": 4, "residual": 0}
  batcher = _batcher(cache=spec, prefix_cache=True, num_slots=2)
  prompt = _prompt(7, 11)
  cold = batcher.add("cold", prompt, 6)  # registers its 2 full prompt pages at join
  assert batcher.prefill_tokens == 11
  hit = batcher.add("hit", np.concatenate([prompt[:8], prompt[8:]]), 6)
  assert batcher.prefill_tokens == 11 + 3  # 8 tokens came from the cached pages
  shared = batcher.allocator.pages("cold")[:2]
  assert batcher.allocator.pages("hit")[:2] == shared
  assert batcher.allocator.pages("hit")[2] != batcher.allocator.pages("cold")[2]
  # The whole state of the row (store read through its table, ring, length): bit-equal...
  for layer, c in enumerate(batcher.caches):
    for x, y in zip(c.slot_view(hit).dequantized(), c.slot_view(cold).dequantized()):
      np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=f"layer {layer}")
  # ... and the state of the dense kind (`kivi4`) fed the prompt a page at a time (another
  # program: equal up to f32 rounding, no code flipped).
  graphdef, state = nnx.split(_model())

  @jax.jit
  def by_pages(state):
    model = nnx.merge(graphdef, state)
    caches = registry.build_caches(model, 1, MAX_PROMPT + MAX_NEW, None, dict(spec, kind="kivi4"))
    for i in range(0, len(prompt), PAGE):
      chunk = np.zeros((1, PAGE), np.int32)
      chunk[0, :len(prompt[i:i + PAGE])] = prompt[i:i + PAGE]
      _, caches = model.hidden(chunk, caches, new_lengths=np.array([len(prompt[i:i + PAGE])]))
    return caches

  dense = by_pages(state)
  for layer, (c, d) in enumerate(zip(batcher.caches, dense)):
    for x, y in zip(c.slot_view(hit).dequantized(), d.dequantized()):
      np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-6,
                                 err_msg=f"layer {layer}")
  got = {}
  while batcher.active:
    for f in batcher.step():
      got[f.request_id] = f.tokens
  np.testing.assert_array_equal(got["hit"], got["cold"])
  assert batcher.traces["join"] == 1  # one width: whole pages
  batcher.allocator.check()


# Residual 4 > 0, group 2, pages of 8: a hit at m restores the ring's tokens [m - 4, m) from
# the block's boundary state (`ResidualSnapshots`); the store's [0, m - 4) is in the pages.
RESIDUAL = {"kind": "paged_kivi4", "group_size": 2, "residual": 4}
RES_PAGE = 8


def _residual_batcher(spec=RESIDUAL, **kw):
  args = dict(num_slots=2, num_pages=12, page_size=RES_PAGE, max_len=32, max_prompt_len=24,
              seed=0, cache=spec, prefix_cache=True)
  args.update(kw)
  return ContinuousBatcher(_model(), **args)


def _row_state(batcher, slot):
  """Everything attention reads of row `slot`: its length and, per layer, the store read
  through its table and the ring's tokens put in place (host copies)."""
  return [(int(c.lengths[slot]),) + tuple(np.asarray(x) for x in c.slot_view(slot).dequantized())
          for c in batcher.caches]


def _drain(batcher):
  got = {}
  while batcher.active:
    for f in batcher.step():
      got[f.request_id] = f.tokens
  return got


def _snapshot_bytes(batcher, spec):
  c = batcher.caches[0]
  return len(batcher.caches) * 2 * c.num_kv_heads * spec["residual"] * c.head_dim * 4  # f32


@pytest.mark.slow  # the fast suite: the KIVI pools give generate's tokens through the batcher
def test_prefix_hits_with_a_residual_restore_the_ring_bit_for_bit():
  # Prompts of whole pages: neither the cold row nor the reference splits its prefill, so
  # the only restore of a non-empty snapshot is the hit's.
  batcher = _residual_batcher()
  text = _prompt(7, 24)
  cold = batcher.add("cold", text[:16], 6)
  assert batcher.prefill_tokens == 16
  stats = batcher.stats()  # the rings at 16, taken after the prefill
  assert stats["ring_snapshots"] == 1
  assert stats["ring_snapshot_bytes"] == _snapshot_bytes(batcher, RESIDUAL) == 1024
  hit = batcher.add("hit", text, 6)
  assert hit != cold and batcher.prefill_tokens == 16 + 8  # 16 tokens came from the cache
  assert batcher.allocator.pages("hit")[:2] == batcher.allocator.pages("cold")[:2]
  assert batcher.stats()["ring_snapshots"] == 2  # and the hit's own at 24
  reference = _residual_batcher(num_slots=1)  # a cold prefill of the same prompt
  assert reference.add("hit", text, 6) == 0 and reference.prefill_tokens == 24
  # The hit row's whole state (length, store through its table, ring) is the cold one's.
  for layer, (x, y) in enumerate(zip(_row_state(batcher, hit), _row_state(reference, 0))):
    assert x[0] == y[0] == 24
    for a, b in zip(x[1:], y[1:]):
      np.testing.assert_array_equal(a, b, err_msg=f"layer {layer}")
  np.testing.assert_array_equal(_drain(batcher)["hit"], _drain(reference)["hit"])
  assert batcher.traces["join"] == 1
  batcher.allocator.check()


@pytest.mark.slow  # ~30 CPU-seconds each: seven batchers' programs
@pytest.mark.parametrize("bits,residual", [(4, 4), (2, 4), (4, 12)])  # 12: more than a page
def test_residual_hits_decode_the_tokens_of_cold_runs(bits, residual):
  spec = dict(RESIDUAL, kind=f"paged_kivi{bits}", residual=residual)
  text, other = _prompt(8, 24), _prompt(11, 19)
  prompts = {"a": text[:11], "b": text[:19], "c": np.concatenate([text[:8], _prompt(9, 9)]),
             "d": np.concatenate([text[:16], _prompt(10, 4)]),
             "e": np.concatenate([other[:8], _prompt(12, 6)]),
             "f": np.concatenate([other[:8], _prompt(13, 3)])}
  batcher = _residual_batcher(spec)
  # "a" (11 tokens: state at 8), then "b" hits at 8 while "a" decodes: both flush the
  # prefix's ring tokens [4, 8) into the shared page (the same bytes); b's state at 16.
  batcher.add("a", prompts["a"], 8)
  batcher.add("b", prompts["b"], 8)
  assert batcher.prefill_tokens == 11 + 11
  assert batcher.allocator.pages("b")[0] == batcher.allocator.pages("a")[0]
  got = _drain(batcher)
  batcher.add("c", prompts["c"], 8)  # hits at 8, splits at 16 (a state on its own chain)
  batcher.add("d", prompts["d"], 8)  # hits at 16 on b's chain
  assert batcher.prefill_tokens == 22 + 9 + 4
  got.update(_drain(batcher))
  # "other" leaves a state at 16 only; "e" shares its first page, which holds none: its
  # prefill splits there and snapshots it, so "f" hits at 8.
  batcher.add("other", other, 8)
  got.update(_drain(batcher))
  batcher.add("e", prompts["e"], 8)
  batcher.add("f", prompts["f"], 8)
  assert batcher.prefill_tokens == 35 + 19 + 14 + 3
  assert batcher.stats()["ring_snapshots"] == batcher.allocator.num_states == 5
  assert batcher.stats()["ring_snapshot_bytes"] == 5 * _snapshot_bytes(batcher, spec)
  got.update(_drain(batcher))
  batcher.allocator.check()
  for rid, prompt in prompts.items():
    alone = _residual_batcher(spec)  # a cold prefill, page by page, of the same prompt
    alone.add(rid, prompt, 8)
    np.testing.assert_array_equal(got[rid], _drain(alone)[rid], err_msg=rid)


def test_options_that_cannot_work_with_low_bit_pools_are_refused():
  with pytest.raises(ValueError, match=r"prefix_cache=True with cache kind 'paged_kivi4' and a "
                     r"residual runs on one device: mesh must be None.*cache.residual = 4"):
    _batcher(prefix_cache=True, mesh=sharding.make_mesh((1, 1, 1)))
  with pytest.raises(ValueError, match="speculative is not supported with cache kind"):
    _batcher(speculative=PromptLookup(2))
  with pytest.raises(ValueError, match="local_layers is not supported with cache kind"):
    _batcher(local_layers="ring")
  # Any registered kind is served (kivi4: fixed rows; test_batching_rows.py); an unknown one
  # is refused.
  with pytest.raises(ValueError, match=r"cache.kind must be one of \('dense', 'paged', .*got 'kivi5'"):
    _batcher(cache="kivi5")
  with pytest.raises(ValueError, match=r"cache.page_size must be unset or the batcher's "
                     r"page_size = 4"):
    _batcher(cache={"kind": "paged_kivi4", "page_size": 8, **KIVI})
  with pytest.raises(ValueError, match="page_size must be a multiple of group_size = 8"):
    _batcher(cache={"kind": "paged_kivi4", "group_size": 8, "residual": 8})
  with pytest.raises(ValueError, match=r"cache.bits is not an option"):
    _batcher(cache={"kind": "paged_kivi4", "bits": 3})
