"""Continuous batching: joins and retirements mid-run change nobody's tokens, never recompile."""

import functools

import jax.numpy as jnp
import numpy as np
import pytest

from kvattn import OutOfPagesError

from kvattn.inference.batching import ContinuousBatcher, Finished, NoFreeSlotError
from kvattn.inference.generation import generate
from tests.kvattn.inference import _tiny

PAGE = 4
MAX_PROMPT = 12
MAX_NEW = 10  # the references decode this many; shorter requests compare a prefix


_model, _prompt = _tiny.model, _tiny.prompt


@functools.lru_cache(maxsize=None)
def _alone(seed, n, eos_id=None):
  """Greedy tokens of the prompt decoded alone by kvattn.generate (dense cache).

  Every reference uses one padded width and one max_new_tokens, so generate
  compiles once for all of them; greedy decoding is prefix-consistent.
  """
  padded = np.zeros((1, MAX_PROMPT), np.int32)
  padded[0, :n] = _prompt(seed, n)
  tokens, length = generate(_model(), padded, np.array([n], np.int32), MAX_NEW, eos_id=eos_id)
  return np.asarray(tokens)[0, :int(np.asarray(length)[0])]


def _batcher(**kw):
  args = dict(num_slots=3, num_pages=24, page_size=PAGE, max_len=MAX_PROMPT + MAX_NEW,
              max_prompt_len=MAX_PROMPT, seed=0)
  args.update(kw)
  return ContinuousBatcher(_model(), **args)


# (id, prompt seed, prompt length, max_new_tokens): more requests than slots,
# lengths crossing page boundaries at different steps.
REQUESTS = [("a", 0, 5, 10), ("b", 1, 12, 3), ("c", 2, 1, 7), ("d", 3, 8, 10), ("e", 4, 4, 1),
            ("f", 5, 3, 6)]


def test_sequences_joining_and_leaving_get_what_they_get_alone():
  batcher = _batcher()
  results = batcher.run([(rid, _prompt(seed, n), new) for rid, seed, n, new in REQUESTS])
  assert set(results) == {r[0] for r in REQUESTS}
  for rid, seed, n, new in REQUESTS:
    f = results[rid]
    assert f.reason == "length" and len(f.tokens) == new
    np.testing.assert_array_equal(f.tokens, _alone(seed, n)[:new], err_msg=rid)
  # The schedule really was continuous: some joined while others were mid-run,
  # and slots were reused after their sequences left.
  assert max(f.joined_step for f in results.values()) > 0
  assert len({f.slot for f in results.values()}) <= 3 < len(results)
  # Static shapes: every program traced exactly once over all joins, steps, page
  # growths and retirements.
  assert batcher.traces == {"join": 1, "step": 1, "set_row": 1, "release": 1}
  # Every page came back.
  assert batcher.allocator.num_free == 24 and batcher.free_slots == [0, 1, 2]
  batcher.allocator.check()


@pytest.mark.slow  # ~10 CPU-seconds: compiles the batcher and generate for int8
def test_int8_pools_give_the_int8_dense_cache_tokens():
  """A quantized pool: the one-slot prefill writes the scale pages too (it once dropped them
  and failed), and greedy tokens equal generate's through an int8 dense cache."""
  model = _model()
  requests = [("b", 1, 12, 4)]  # a 12-token prompt over 3 pages, then a 4th page
  results = _batcher(dtype=jnp.int8).run([(r, _prompt(s, n), new) for r, s, n, new in requests])
  factory = lambda b, s, dtype=None: model.init_caches(b, s, jnp.int8)
  for rid, seed, n, new in requests:
    padded = np.zeros((1, MAX_PROMPT), np.int32)
    padded[0, :n] = _prompt(seed, n)
    want, _ = generate(model, padded, np.array([n], np.int32), new, cache_factory=factory)
    np.testing.assert_array_equal(results[rid].tokens, np.asarray(want)[0])


def test_exhaustion_on_join_changes_nothing_and_running_sequences_continue():
  # 5 pages of 4 tokens: "a" (8 prompt tokens + 6 to decode) owns 2, then grows to 4.
  batcher = _batcher(num_pages=5)
  assert batcher.add("a", _prompt(0, 8), 7) == 0
  for _ in range(2):
    assert batcher.step() == []
  before = batcher.stats()
  tables = np.asarray(batcher.caches[0].block_tables).copy()
  with pytest.raises(OutOfPagesError, match="needs 3 more page"):
    batcher.add("big", _prompt(1, 12), 2)
  assert batcher.stats() == before and batcher.active == {"a": 0}
  np.testing.assert_array_equal(np.asarray(batcher.caches[0].block_tables), tables)
  assert not batcher.can_add(12) and batcher.can_add(4)
  finished = []
  while batcher.active:
    finished += batcher.step()
  (f,) = finished
  np.testing.assert_array_equal(f.tokens, _alone(0, 8)[:7])
  # max_new_tokens = 1: the prefill's token is all it gets; the slot is free again at once.
  one = batcher.add("one", _prompt(4, 4), 1)
  assert isinstance(one, Finished) and one.reason == "length"
  np.testing.assert_array_equal(one.tokens, _alone(4, 4)[:1])
  assert batcher.active == {} and batcher.allocator.num_free == 5
  assert batcher.traces["join"] == 1 and batcher.traces["step"] == 1


def test_growth_exhaustion_retires_one_sequence_and_spares_the_others():
  # 4 pages: "a" and "b" hold one full page each (4-token prompts), "c" two
  # (5 tokens). At the first step "a" (slot 0, grown first) finds no free page
  # and leaves with reason "out_of_pages"; "b" grows into the page "a" freed,
  # and later into those "c" frees. Everybody else's tokens are untouched.
  batcher = _batcher(num_pages=4)
  for rid, seed, n, new in (("a", 0, 4, 6), ("b", 1, 4, 6), ("c", 2, 5, 3)):
    batcher.add(rid, _prompt(seed, n), new)
  assert batcher.allocator.num_free == 0
  results = {}
  while batcher.active:
    for f in batcher.step():
      results[f.request_id] = f
  assert results["a"].reason == "out_of_pages" and results["a"].finished_step == 0
  np.testing.assert_array_equal(results["a"].tokens, _alone(0, 4)[:1])
  for rid, seed, n, new in (("b", 1, 4, 6), ("c", 2, 5, 3)):
    assert results[rid].reason == "length"
    np.testing.assert_array_equal(results[rid].tokens, _alone(seed, n)[:new], err_msg=rid)
  assert batcher.allocator.num_free == 4


def test_eos_retires_a_sequence_like_generate():
  reference = {rid: _alone(seed, n) for rid, seed, n in (("d", 3, 8), ("a", 0, 5))}
  eos = int(reference["d"][3])  # a token "d" emits mid-run
  batcher = _batcher(eos_id=eos)
  results = batcher.run([("d", _prompt(3, 8), 10), ("a", _prompt(0, 5), 10)])
  for rid, ref in reference.items():
    hits = [i for i, t in enumerate(ref) if t == eos]
    stop = hits[0] + 1 if hits else len(ref)
    assert results[rid].reason == ("eos" if hits else "length")
    np.testing.assert_array_equal(results[rid].tokens, ref[:stop], err_msg=rid)
  assert results["d"].reason == "eos" and len(results["d"].tokens) == 4


def test_bad_requests_raise_before_anything_changes():
  batcher = _batcher(num_slots=1)
  batcher.add("a", _prompt(0, 3), 5)
  with pytest.raises(NoFreeSlotError, match="all 1 are busy"):
    batcher.add("b", _prompt(1, 3), 5)
  with pytest.raises(ValueError, match=r"prompt length must lie in \[1, max_prompt_len\] = "
                     r"\[1, 12\]; got 13"):
    batcher.add("c", _prompt(1, 13), 2)
  with pytest.raises(ValueError, match="would overflow the cache"):
    batcher.add("c", _prompt(1, 12), 12)
  with pytest.raises(ValueError, match="request_id must not be live already"):
    batcher.add("a", _prompt(1, 3), 1)
  with pytest.raises(ValueError, match=r"prompt must hold token ids in \[0, 259\)"):
    batcher.add("c", np.array([1, 300]), 1)
  with pytest.raises(ValueError, match="prompt of 'e' must hold at least one token"):
    batcher.add("e", [], 1)
  assert batcher.active == {"a": 0} and batcher.traces["join"] == 1
  with pytest.raises(ValueError, match="max_prompt_len must be <= max_len"):
    _batcher(max_len=4)
  with pytest.raises(OutOfPagesError, match="needs 3 more page"):  # bigger than the pool
    _batcher(num_pages=2).run([("huge", _prompt(2, 12), 1)])
