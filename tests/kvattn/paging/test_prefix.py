"""Prefix caching: chained page keys, confirmed hits, refcounts, copy-on-write, LRU eviction."""

import functools

import hypothesis.strategies as st
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from flax import nnx

from kvattn import OutOfPagesError, PagedKVCache

from kvattn.paging import prefix as prefix_cache

from kvattn.models import transformer
from kvattn.inference.batching import ContinuousBatcher
from kvattn.inference.generation import generate
from kvattn.paging.prefix import PrefixCachingAllocator, copy_pages, page_digest

PS = 4


def _cached(alloc, seq_id, tokens):
  """Runs `tokens` as a prompt and retires it: its full pages stay cached."""
  alloc.allocate_prompt(seq_id, tokens)
  alloc.register(seq_id, tokens)
  alloc.free(seq_id)


def test_keys_chain_over_the_parent():
  a, b = np.array([1, 2, 3, 4]), np.array([5, 6, 7, 8])
  assert page_digest(b"", a) == page_digest(b"", a.astype(np.int64))  # int32 LE bytes
  assert page_digest(page_digest(b"", a), b) != page_digest(page_digest(b"", b), b)
  assert len(page_digest(b"", a)) == 32
  alloc = PrefixCachingAllocator(8, PS)
  _cached(alloc, "x", list(range(1, 10)))
  keys = set(alloc._index)  # pylint: disable=protected-access
  assert keys == {page_digest(b"", a), page_digest(page_digest(b"", a), b)}


def test_match_lengths_are_whole_pages_and_an_empty_match_is_a_miss():
  alloc = PrefixCachingAllocator(8, PS)
  _cached(alloc, "x", list(range(1, 9)) + [0])  # pages [1..4], [5..8] cached
  assert alloc.match([1, 2, 3]) == 0
  assert alloc.match(list(range(1, 8))) == 4
  assert alloc.match([1, 2, 3, 4, 5, 6, 9, 9]) == 4
  assert alloc.match(list(range(1, 9))) == 8
  assert alloc.match([2, 2, 3, 4, 5, 6, 7, 8]) == 0
  assert alloc.match([]) == 0
  # A miss allocates fresh pages and reports nothing cached.
  assert alloc.allocate_prompt("miss", [9, 9, 9, 9, 9]) == 0
  alloc.check()


def test_two_prompts_with_two_equal_pages_share_them_and_the_last_token_is_recomputed():
  alloc = PrefixCachingAllocator(16, PS)
  shared = list(range(10, 18))
  assert alloc.allocate_prompt("a", shared + [1, 2]) == 0
  alloc.register("a", shared + [1, 2])
  assert alloc.allocate_prompt("b", shared + [3]) == 8
  assert alloc.pages("a")[:2] == alloc.pages("b")[:2]
  assert alloc.pages("a")[2] != alloc.pages("b")[2]
  assert [alloc.refcount(p) for p in alloc.pages("b")] == [2, 2, 1]
  # A prompt that is exactly the cached pages reuses all but its last page.
  assert alloc.allocate_prompt("c", shared) == 4
  assert alloc.refcount(alloc.pages("a")[0]) == 3 and alloc.refcount(alloc.pages("a")[1]) == 2
  alloc.check()
  for s in "abc":
    alloc.free(s)
  assert alloc.num_used == 0 and alloc.num_cached == 2
  alloc.check()


def test_same_hash_different_tokens_never_share(monkeypatch):
  monkeypatch.setattr(prefix_cache, "page_digest", lambda parent, tokens: b"collide")
  alloc = PrefixCachingAllocator(16, PS)
  _cached(alloc, "a", [1, 2, 3, 4, 5, 6, 7, 8, 0])
  assert alloc.counters["collisions"] == 1  # page 2 of "a" has the key of page 1
  assert alloc.match([5, 6, 7, 8, 1]) == 0
  assert alloc.allocate_prompt("b", [5, 6, 7, 8, 1]) == 0
  assert alloc.match([1, 2, 3, 4, 1, 2, 3, 4]) == 4  # page 2 would chain to page 1's key
  assert alloc.allocate_prompt("c", [1, 2, 3, 4, 9]) == 4
  alloc.check()


def test_a_block_whose_parent_was_evicted_is_never_reached_through_a_new_parent(monkeypatch):
  alloc = PrefixCachingAllocator(3, PS)
  _cached(alloc, "a", list(range(8)) + [0])
  alloc.allocate("fill", 12)  # evicts both cached pages (tail first), then a fresh one
  alloc.free("fill")
  assert alloc.match(list(range(8))) == 0
  alloc.check()


def test_copy_on_write_of_a_shared_partial_last_page():
  alloc = PrefixCachingAllocator(8, PS)
  alloc.allocate("a", 6)  # pages p0 (full), p1 (2 of 4 slots)
  alloc.fork("a", "b")
  p0, p1 = alloc.pages("a")
  assert alloc.pages("b") == (p0, p1) and alloc.refcount(p1) == 2
  copies = alloc.prepare_write("b", 6)
  assert len(copies) == 1 and copies[0][0] == p1
  new = copies[0][1]
  assert alloc.pages("b") == (p0, new) and alloc.refcount(p1) == 1 and alloc.refcount(new) == 1
  assert alloc.prepare_write("a", 6) == []  # "a" is the only holder of p1 now
  alloc.check()
  # The device side: page p1's contents are copied to the new page, others untouched.
  cache = PagedKVCache.init(2, num_pages=8, page_size=PS, pages_per_seq=2, num_kv_heads=1,
                            head_dim=2, dtype=jnp.int8)
  rng = np.random.default_rng(0)
  cache = cache.replace(k_pages=jnp.asarray(rng.integers(-9, 9, cache.k_pages.shape), jnp.int8),
                        k_scale_pages=jnp.asarray(rng.random(cache.k_scale_pages.shape),
                                                  jnp.float32))
  (out,) = copy_pages([cache], copies)
  np.testing.assert_array_equal(out.k_pages[:, new], cache.k_pages[:, p1])
  np.testing.assert_array_equal(out.k_scale_pages[:, new], cache.k_scale_pages[:, p1])
  others = [p for p in range(8) if p != new]
  np.testing.assert_array_equal(out.k_pages[:, others], cache.k_pages[:, others])


def test_unreferenced_cached_pages_are_evicted_lru_tail_first():
  alloc = PrefixCachingAllocator(6, PS)
  a, b = list(range(100, 108)), list(range(200, 208))
  _cached(alloc, "a", a + [0])  # a's 2 pages cached, then b's 2: a is older
  _cached(alloc, "b", b + [0])
  assert alloc.num_free == 6 and alloc.num_cached == 4
  alloc.allocate("x", 12)  # 2 truly free pages, then a's tail page
  assert alloc.counters["evictions"] == 1
  assert alloc.match(a) == 4 and alloc.match(b) == 8
  alloc.grow("x", 16)  # a's head goes next
  assert alloc.match(a) == 0 and alloc.match(b) == 8
  with pytest.raises(OutOfPagesError):
    alloc.allocate("y", 12)  # only b's 2 pages are reclaimable
  assert alloc.match(b) == 8  # the failed allocation changed nothing
  alloc.check()


def test_referenced_pages_are_never_evicted():
  alloc = PrefixCachingAllocator(4, PS)
  shared = list(range(8))
  alloc.allocate_prompt("a", shared + [1])
  alloc.register("a", shared + [1])
  assert alloc.allocate_prompt("b", shared + [2]) == 8
  with pytest.raises(OutOfPagesError):
    alloc.allocate("c", 4)  # 4 pages, all referenced
  alloc.check()


class AllocatorMachine(RuleBasedStateMachine):
  """Random joins (prompts from a small alphabet, so prefixes repeat), growth, forks,
  copy-on-write, retirements and evictions: no page is leaked or double-freed."""

  def __init__(self):
    super().__init__()
    self.alloc = PrefixCachingAllocator(10, 2)
    self.live = {}
    self.next_id = 0

  @rule(prompt=st.lists(st.integers(0, 2), min_size=1, max_size=7))
  def join(self, prompt):
    try:
      cached = self.alloc.allocate_prompt(self.next_id, prompt)
    except OutOfPagesError:
      return
    assert cached % 2 == 0 and cached < len(prompt)
    self.alloc.register(self.next_id, prompt)
    self.live[self.next_id] = list(prompt)
    self.next_id += 1

  @precondition(lambda self: self.live)
  @rule(data=st.data(), token=st.integers(0, 2))
  def grow(self, data, token):
    seq = data.draw(st.sampled_from(sorted(self.live)))
    tokens = self.live[seq]
    try:
      self.alloc.grow(seq, len(tokens) + 1)
      self.alloc.prepare_write(seq, len(tokens))
    except (OutOfPagesError, ValueError):
      return
    tokens.append(token)

  @precondition(lambda self: self.live)
  @rule(data=st.data())
  def fork(self, data):
    src = data.draw(st.sampled_from(sorted(self.live)))
    self.alloc.fork(src, self.next_id)
    self.live[self.next_id] = list(self.live[src])
    self.next_id += 1

  @precondition(lambda self: self.live)
  @rule(data=st.data(), register=st.booleans())
  def finish(self, data, register):
    seq = data.draw(st.sampled_from(sorted(self.live)))
    tokens = self.live.pop(seq)
    self.alloc.free(seq, tokens=tokens if register else None)

  @rule()
  def evict(self):
    cached = self.alloc.num_cached
    assert self.alloc.offload_cached() == cached  # no store: the cached pages are forgotten
    assert self.alloc.num_cached == 0

  @invariant()
  def consistent(self):
    self.alloc.check()
    assert self.alloc.num_used + self.alloc.num_free == self.alloc.num_pages


TestAllocatorMachine = AllocatorMachine.TestCase
TestAllocatorMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)


# The batcher with a prefix cache: same tokens, fewer prefill tokens.

MAX_PROMPT, MAX_NEW = 16, 6


@functools.lru_cache(maxsize=None)
def _model():
  cfg = transformer.model_config(d_model=32, num_layers=2, mlp_dim=64, layers=({}, {"window": 6}),
                                 attention=dict(num_heads=4, num_kv_heads=2, head_dim=8))
  return transformer.Transformer.from_config(cfg, rngs=nnx.Rngs(0))


def _alone(prompt):
  padded = np.zeros((1, MAX_PROMPT), np.int32)
  padded[0, :len(prompt)] = prompt
  tokens, _ = generate(_model(), padded, np.array([len(prompt)], np.int32), MAX_NEW)
  return np.asarray(tokens)[0]


SYSTEM = np.random.default_rng(7).integers(0, 256, 9).astype(np.int32)


def _requests():
  rng = np.random.default_rng(8)
  reqs = [(f"q{i}", np.concatenate([SYSTEM, rng.integers(0, 256, n).astype(np.int32)]), MAX_NEW)
          for i, n in enumerate([3, 1, 5, 7, 2])]
  reqs.append(("other", rng.integers(0, 256, 6).astype(np.int32), MAX_NEW))
  reqs.append(("exact", SYSTEM[:8].copy(), MAX_NEW))  # all whole pages cached: last one redone
  return reqs


def _run(**kw):
  batcher = ContinuousBatcher(_model(), num_slots=2, num_pages=20, page_size=PS,
                              max_len=MAX_PROMPT + MAX_NEW, max_prompt_len=MAX_PROMPT, seed=0, **kw)
  return batcher, batcher.run(_requests())


def test_batcher_with_prefix_cache_gives_the_same_tokens_and_prefills_fewer():
  plain, out_plain = _run()
  cached, out_cached = _run(prefix_cache=True)
  for rid, prompt, _ in _requests():
    np.testing.assert_array_equal(out_cached[rid].tokens, _alone(prompt), err_msg=rid)
    np.testing.assert_array_equal(out_plain[rid].tokens, out_cached[rid].tokens)
  total = sum(len(p) for _, p, _ in _requests())
  assert plain.stats()["prefill_tokens"] == total
  # q1.. and "exact" skip the system prompt's 2 whole pages (8 tokens; "exact" only 1 page).
  assert cached.stats()["prefill_tokens"] == total - 4 * 8 - 4
  cached.allocator.check()
  assert cached.allocator.num_used == 0


def test_batcher_with_colliding_hashes_still_gives_the_same_tokens(monkeypatch):
  monkeypatch.setattr(prefix_cache, "page_digest", lambda parent, tokens: b"collide")
  batcher, out = _run(prefix_cache=True)
  for rid, prompt, _ in _requests():
    np.testing.assert_array_equal(out[rid].tokens, _alone(prompt), err_msg=rid)
  batcher.allocator.check()


def test_shrink_keeps_registered_pages_cached_and_cuts_the_chain():
  alloc = PrefixCachingAllocator(8, 4, 4)
  tokens = np.arange(12)
  alloc.allocate("a", 12)
  assert alloc.register("a", tokens) == 3
  alloc.shrink("a", 5)  # the third registered page is dropped: it stays cached
  assert len(alloc.pages("a")) == 2 and alloc.num_cached == 1
  alloc.check()
  alloc.grow("a", 12)
  assert alloc.register("a", tokens) == 3  # the chain resumes at page 2
  alloc.free("a")
  alloc.check()


class _Codec:
  """A state codec for the allocator tests: a state is an int8 numpy row."""

  @staticmethod
  def encode(state):
    return np.asarray(state, np.int8).view(np.uint8)

  @staticmethod
  def decode(data):
    return np.asarray(data, np.uint8).view(np.int8)


def test_boundary_states_end_matches_are_bounded_and_travel_with_offloaded_blocks():
  """`boundary_states=True` (the batcher's rings): a match ends at the deepest matched block
  holding a state; at most `max_states` are kept; an offloaded block's state follows its page
  in the tier payload and comes back with it."""
  from kvattn.paging.offload import HostTier, TieredStore  # pylint: disable=g-import-not-at-top
  store = TieredStore([HostTier(10**6)])
  alloc = PrefixCachingAllocator(8, PS, boundary_states=True, max_states=2, offload=store)
  pages = {}  # page -> bytes of its "device contents"
  alloc.bind_device(lambda ps: np.stack([pages.get(p, np.zeros(3, np.uint8)) for p in ps]),
                    lambda ps, rows: pages.update(zip(ps, [np.asarray(r) for r in rows])),
                    state_codec=_Codec)
  tokens = list(range(1, 14))  # three full pages and one token
  alloc.allocate_prompt("a", tokens)
  for p in alloc._pages["a"]:  # pylint: disable=protected-access
    pages[p] = np.full(3, p, np.uint8)
  alloc.register("a", tokens)
  assert alloc.match(tokens) == 0 and alloc.match(tokens, with_state=False) == 12
  assert not alloc.needs_state("a", 8) and alloc.needs_state("a", 12)
  assert alloc.set_state("a", 12, np.arange(5, dtype=np.int8), 5)
  assert not alloc.set_state("a", 12, np.arange(5, dtype=np.int8), 5)  # has one already
  assert alloc.match(tokens) == 12 and alloc.match(tokens[:11]) == 0  # no state at 8
  assert alloc.state_bytes == 5 and alloc.num_states == 1
  alloc.free("a")
  # Two more chains with states: the first state (least recently used) is dropped.
  for rid, first in (("b", 50), ("c", 60)):
    alloc.allocate_prompt(rid, [first] * 5)
    alloc.register(rid, [first] * 5)
    assert alloc.set_state(rid, 4, np.full(2, first, np.int8), 2)
    alloc.free(rid)
  assert alloc.num_states == 2 and alloc.match(tokens) == 0
  assert alloc.counters["states_dropped"] == 1
  alloc.check()
  # Offload everything: "b"'s state rides in its page's payload (3 + 2 bytes).
  moved = alloc.offload_cached()
  assert alloc.num_states == 0 and alloc.state_bytes == 0
  assert store.used_bytes()["host"] == moved * 3 + 2 * 2
  assert alloc.match([50] * 5) == 4
  assert alloc.allocate_prompt("d", [50] * 5) == 4
  np.testing.assert_array_equal(alloc.state_of("d"), np.full(2, 50, np.int8))
  assert alloc.num_states == 1 and alloc.state_bytes == 2
  alloc.free("d")
  alloc.check()
  with pytest.raises(ValueError, match="max_states must be an int >= 1 or None; got 0"):
    PrefixCachingAllocator(8, PS, boundary_states=True, max_states=0)
