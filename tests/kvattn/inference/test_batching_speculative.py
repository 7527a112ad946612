"""Speculative decoding in the continuous batcher: per-slot acceptance, token for token the
batcher without speculation; rejected drafts' pages go back; shared prefix pages unwritten."""

import functools
import pathlib

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import kvattn
from kvattn.caches import registry
from kvattn.inference.batching import ContinuousBatcher
from kvattn.inference.speculative import DraftModel, PromptLookup
from kvattn.models import transformer
from kvattn.paging.allocator import pages_for
from tests.kvattn.inference import _tiny

PAGE = 4
MAX_PROMPT = 12
MAX_NEW = 14


_model, _prompt = _tiny.model, _tiny.prompt


def _batcher(**kw):
  args = dict(num_slots=3, num_pages=30, page_size=PAGE, max_len=MAX_PROMPT + MAX_NEW,
              max_prompt_len=MAX_PROMPT, seed=0)
  args.update(kw)
  return ContinuousBatcher(_model(), **args)


# (id, prompt, max_new_tokens): more requests than slots, so sequences join and leave while
# others are mid-run; budgets not multiples of k + 1 cut a pass short.
REQUESTS = [("a", _prompt(0, 5), 14), ("b", _prompt(1, 12), 3), ("c", _prompt(2, 1), 9),
            ("d", _prompt(3, 8), 14), ("e", _prompt(4, 4), 1), ("f", _prompt(5, 3), 7)]


def _serve(batcher, requests):
  """`batcher.run(requests)`, checking after every step that each live sequence holds
  exactly the pages of the tokens in its cache (rejected drafts' pages went back)."""
  queue, done = list(requests), {}
  while queue or batcher.active:
    while queue and batcher.can_add(len(queue[0][1])):
      rid, prompt, new = queue.pop(0)
      result = batcher.add(rid, prompt, new)
      if not isinstance(result, int):
        done[rid] = result
    for f in batcher.step():
      done[f.request_id] = f
    for alloc in batcher.allocators:
      alloc.check()
    for live in batcher._slots:  # pylint: disable=protected-access
      if live is not None:
        pages = batcher.allocator.pages(live.request_id)
        assert len(pages) == pages_for(live.cache_len, PAGE), live.request_id
  return done


@functools.lru_cache(maxsize=None)
def _plain(dtype=None, eos_id=None):
  """The batcher without speculation on REQUESTS (the reference; one run per setting)."""
  return _batcher(dtype=dtype, eos_id=eos_id).run(REQUESTS)


def _check_same(spec, plain, requests):
  for rid, _, new in requests:
    assert spec[rid].reason == plain[rid].reason, rid
    np.testing.assert_array_equal(spec[rid].tokens, plain[rid].tokens, err_msg=rid)


@pytest.mark.parametrize("dtype", [None, pytest.param(jnp.int8, marks=pytest.mark.slow)])
def test_speculative_batcher_equals_plain_batcher(dtype):
  plain = _plain(dtype)
  batcher = _batcher(dtype=dtype, speculative=PromptLookup(3, max_ngram_size=2))
  spec = _serve(batcher, REQUESTS)
  _check_same(spec, plain, REQUESTS)
  stats = batcher.spec_stats
  # Per-slot acceptance really happened both ways: drafts accepted and drafts rejected.
  assert 0 < stats["accepted"] < stats["drafted"], stats
  assert stats["pages_returned"] > 0  # pages only rejected drafts used went back
  # Fewer passes than tokens: a pass emitted several tokens for some sequence.
  assert batcher.steps < sum(len(f.tokens) - 1 for f in spec.values())
  assert batcher.traces["spec_step"] == 1 and batcher.traces["step"] == 0
  assert batcher.allocator.num_free == 30 and batcher.free_slots == [0, 1, 2]


def test_shared_prefix_pages_are_never_written_by_rejected_drafts():
  """Three requests share two cached prompt pages; speculative steps (rejecting drafts)
  leave those pages' bytes as they were, and the tokens equal the plain batcher's."""
  prefix = _prompt(7, 8)  # two full pages
  requests = [(f"r{i}", np.concatenate([prefix, _prompt(10 + i, 3)]), 12) for i in range(3)]
  plain = _batcher().run(requests)
  batcher = _batcher(prefix_cache=True, speculative=PromptLookup(3, max_ngram_size=2))
  first = batcher.add(*requests[0])
  shared = batcher.allocator.pages(requests[0][0])[:2]
  snapshot = [(np.asarray(c.k_pages[:, list(shared)]), np.asarray(c.v_pages[:, list(shared)]))
              for c in batcher.caches]
  done = {}
  for rid, prompt, new in requests[1:]:
    assert batcher.add(rid, prompt, new) in (1, 2)
    assert batcher.allocator.pages(rid)[:2] == shared  # really shared
  assert first == 0 and batcher.prefill_tokens == 11 + 3 + 3
  while batcher.active:
    for f in batcher.step():
      done[f.request_id] = f
    for c, (k, v) in zip(batcher.caches, snapshot):
      np.testing.assert_array_equal(np.asarray(c.k_pages[:, list(shared)]), k)
      np.testing.assert_array_equal(np.asarray(c.v_pages[:, list(shared)]), v)
  assert 0 < batcher.spec_stats["accepted"] < batcher.spec_stats["drafted"]
  _check_same(done, plain, requests)
  batcher.allocator.check()


@pytest.mark.slow  # ~7 CPU-seconds each: two batchers compiled
@pytest.mark.parametrize("dtype", [jnp.float8_e4m3fn, jnp.float8_e5m2, jnp.bfloat16])
def test_speculative_batcher_equals_plain_batcher_more_pools(dtype):
  plain = _plain(dtype)
  batcher = _batcher(dtype=dtype, speculative=PromptLookup(4))
  _check_same(_serve(batcher, REQUESTS), plain, REQUESTS)
  assert 0 < batcher.spec_stats["accepted"] < batcher.spec_stats["drafted"]


@pytest.mark.slow
def test_speculative_batcher_stops_at_eos_like_the_plain_batcher():
  # an EOS "a" emits mid-run (not as its first token)
  eos = int(_plain()["a"].tokens[5])
  plain = _plain(eos_id=eos)
  batcher = _batcher(eos_id=eos, speculative=PromptLookup(3))
  spec = _serve(batcher, REQUESTS)
  _check_same(spec, plain, REQUESTS)
  assert spec["a"].reason == "eos"


def _truncated(num_layers):
  """The test model's first `num_layers` layers as a draft model (shared weights)."""
  return _model().truncated(num_layers)


@pytest.mark.slow  # the draft model's own path: test_speculative.py (generate) in the fast suite
def test_draft_model_batcher_equals_plain_batcher():
  """A 1-layer draft of the 2-layer model: per-slot draft caches prefilled at join, caught up
  and rolled back by lengths each pass; tokens equal the plain batcher's."""
  plain = _plain()
  batcher = _batcher(speculative=DraftModel(_truncated(1), 3))
  spec = _serve(batcher, REQUESTS)
  _check_same(spec, plain, REQUESTS)
  assert 0 < batcher.spec_stats["accepted"] < batcher.spec_stats["drafted"], batcher.spec_stats
  assert batcher.traces["spec_step"] == 1 and batcher.traces["draft_join"] == 1


def test_speculative_batcher_bad_arguments():
  with pytest.raises(TypeError, match="speculative must be"):
    _batcher(speculative="ngram")
  with pytest.raises(ValueError, match="temperature must be 0"):
    _batcher(speculative=PromptLookup(2), temperature=0.7)
  cfg = transformer.model_config(d_model=32, num_layers=1, mlp_dim=64, vocab_size=100,
                                 attention=dict(num_heads=4, num_kv_heads=2, head_dim=8))
  other = transformer.Transformer.from_config(cfg, rngs=nnx.Rngs(1))
  with pytest.raises(ValueError, match="share the target's vocabulary"):
    _batcher(speculative=DraftModel(other, 2))


# Rings (`local_layers="ring"`) on the tiny Gemma 3 fixture: a local layer of window 4, then a
# global layer. With k = 4 a verify pass writes 5 tokens into a ring of 4 slots, so every pass
# wraps the ring inside itself (and the 6- to 11-token prompts wrapped it already); the
# transaction restores the slots rejected drafts overwrote from its undo log.

GEMMA3 = pathlib.Path(__file__).resolve().parents[2] / "fixtures" / "hf" / "gemma3"


@functools.lru_cache(maxsize=None)
def _gemma3():
  model, _ = kvattn.from_pretrained(GEMMA3)
  arrays = np.load(GEMMA3 / "expected.npz")
  fixture = [arrays[f"tokens_{i}"] for i in range(2)]
  rng = np.random.default_rng(1)
  drawn = [rng.integers(3, 128, 11).astype(np.int32) for _ in range(8)]
  # (id, prompt, max_new_tokens): "b" turns from one repeated token to another mid-pass
  # (partial acceptance), the others repeat (full acceptance); budgets cut passes short.
  requests = [("a", fixture[0][:11], 14), ("b", drawn[7], 14), ("c", fixture[1][:6], 9),
              ("d", drawn[7][:9], 12), ("e", drawn[6], 11)]
  return model, requests


def _ring_batcher(model, **kw):
  return ContinuousBatcher(model, num_slots=2, num_pages=40, page_size=PAGE, max_len=11 + 14,
                           max_prompt_len=11, local_layers="ring", seed=0, **kw)


def _serve_rings(batcher, requests):
  """`batcher.run(requests)`, returning also, per step, the tokens each live sequence
  gained, and, per (request, tokens in its cache), its ring row after a step: `pos` and the
  keys and values of the slots holding a token. Checks each row holds exactly what a ring
  of its length keeps (`expected_pos`; with the prefix cache, of the tokens its window of
  4 still sees): no rejected draft's position is left behind."""
  queue, done, gained, rings = list(requests), {}, [], {}
  while queue or batcher.active:
    while queue and batcher.can_add(len(queue[0][1])):
      rid, prompt, new = queue.pop(0)
      result = batcher.add(rid, prompt, new)
      if not isinstance(result, int):
        done[rid] = result
    before = {s.request_id: len(s.tokens) for s in batcher._slots if s is not None}  # pylint: disable=protected-access
    ring = batcher.caches[0]
    assert ring.lengths.tolist() == [0 if s is None else s.cache_len for s in batcher._slots]  # pylint: disable=protected-access
    pos, lengths = np.asarray(ring.pos), np.asarray(ring.lengths)
    want = ring.expected_pos(lengths)
    # A row restored from a prefix snapshot holds only the last W = 4 tokens (W + page_size
    # - 1 slots): slots of older tokens, which no query attends, may be empty.
    unseen = (pos == -1) & (want < lengths[:, None] - 4)
    np.testing.assert_array_equal(np.where(unseen, want, pos), want)
    for slot, live in enumerate(batcher._slots):  # pylint: disable=protected-access
      if live is not None:
        held = pos[slot] >= 0
        rings[live.request_id, live.cache_len] = (
            pos[slot], np.asarray(ring.k[slot])[:, held], np.asarray(ring.v[slot])[:, held])
    for f in batcher.step():
      done[f.request_id] = f
    gained.append({rid: len((done[rid] if rid in done else
                             batcher._slots[batcher.active[rid]]).tokens) - n  # pylint: disable=protected-access
                   for rid, n in before.items()})
  return done, gained, rings


def test_speculative_batcher_with_rings_equals_plain_batcher_and_generate():
  model, requests = _gemma3()
  plain, _, plain_rings = _serve_rings(_ring_batcher(model), requests)
  batcher = _ring_batcher(model, speculative=PromptLookup(4))
  spec, gained, rings = _serve_rings(batcher, requests)
  _check_same(spec, plain, requests)
  # generate (dense global layer, ring local layer) gives the same tokens.
  prompts = np.zeros((len(requests), 11), np.int32)
  for b, (_, prompt, _) in enumerate(requests):
    prompts[b, :len(prompt)] = prompt
  factory = registry.cache_factory_from_config(model, {"kind": "dense"}, local_layers="ring")
  out, _ = kvattn.generate(model, prompts, np.asarray([len(p) for _, p, _ in requests]), 14,
                           cache_factory=factory)
  for b, (rid, _, new) in enumerate(requests):
    assert np.asarray(out[b])[:new].tolist() == spec[rid].tokens.tolist(), rid
  # Acceptance both ways: full passes (k + 1 tokens) and a partial one (the pass of "b"
  # that keeps 35, 35 and corrects the third draft to 11), not cut by the budget.
  emitted = [n for step in gained for n in step.values()]
  assert emitted.count(5) >= 5 and gained[0] == {"a": 5, "b": 3}, gained
  assert spec["b"].tokens.tolist()[:4] == [35, 35, 35, 11]
  assert 0 < batcher.spec_stats["accepted"] < batcher.spec_stats["drafted"]
  # After every verify pass each ring row is the plain batcher's ring at the same length:
  # the slots rejected drafts overwrote hold their old tokens again.
  assert len(rings) > 8 and set(rings) <= set(plain_rings)
  for key, (pos, k, v) in rings.items():
    want_pos, want_k, want_v = plain_rings[key]
    np.testing.assert_array_equal(pos, want_pos, err_msg=str(key))
    np.testing.assert_allclose(k, want_k, rtol=1e-5, atol=1e-5, err_msg=str(key))
    np.testing.assert_allclose(v, want_v, rtol=1e-5, atol=1e-5, err_msg=str(key))
  assert batcher.traces["spec_step"] == 1 and batcher.free_slots == [0, 1]
  assert np.asarray(batcher.caches[0].pos).max() == -1  # retired rows are empty again


@pytest.mark.slow  # ~8 CPU-seconds: three batchers compiled
def test_speculative_batcher_with_rings_and_prefix_cache_or_a_draft_model():
  """Rings of W + page_size - 1 slots (the prefix cache's, snapshotted at page boundaries)
  and a draft model's own caches: the same tokens as the plain batcher with rings."""
  model, requests = _gemma3()
  plain, _, _ = _serve_rings(_ring_batcher(model), requests)
  cached = _ring_batcher(model, prefix_cache=True, speculative=PromptLookup(4))
  assert cached.caches[0].capacity == 4 + PAGE - 1
  spec, gained, _ = _serve_rings(cached, requests)
  _check_same(spec, plain, requests)
  # "d" is a prefix of "b": it hits b's cached pages and the ring snapshot at their end.
  assert cached.prefill_tokens < sum(len(p) for _, p, _ in requests)
  assert 0 < cached.spec_stats["accepted"] < cached.spec_stats["drafted"]
  assert 5 in [n for step in gained for n in step.values()]
  drafted = _ring_batcher(model, speculative=DraftModel(model.truncated(1), 3))
  spec, _, _ = _serve_rings(drafted, requests)
  _check_same(spec, plain, requests)
  assert 0 < drafted.spec_stats["accepted"], drafted.spec_stats
