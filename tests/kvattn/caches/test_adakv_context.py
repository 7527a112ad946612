"""AdaKV under kvpress's context protocol (kvattn.caches.adakv_context): the selection against a
numpy reference over a grid with its edges and against kvpress's `AdaKVPress.compress`
(reimplemented in numpy), the cache's kept set and bytes, the append and the overflow, and
alpha = 1 giving back the uniform policy through the model."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kvattn import memory
from kvattn.caches import _context
from kvattn.caches import capabilities
from kvattn.caches import registry
from kvattn.caches.adakv_context import (AdaKVContextCache, inner_of, safe_count, select)
from kvattn.caches.eviction import EvictingKVCache
from kvattn.inference.generation import prefill
from kvattn.models import transformer

H = 4


def select_reference(priority, valid, kept, safe):
  """numpy `select`: per row, each head's top `safe` valid candidates first, then the rest by
  priority, `K * kept` of the row over all heads, head-major, ties to the lower index."""
  batch, heads, _ = priority.shape
  out = np.zeros(priority.shape, bool)
  for b in range(batch):
    p = np.where(valid[b], priority[b], -np.inf).astype(np.float64)
    guard = np.zeros(p.shape, bool)
    for h in range(heads):
      guard[h, [i for i in np.argsort(-p[h], kind="stable") if valid[b, h, i]][:safe[b]]] = True
    cands = [i for i in range(p.size) if valid[b].reshape(-1)[i]]
    cands.sort(key=lambda i: (not guard.reshape(-1)[i], -p.reshape(-1)[i], i))
    out[b].reshape(-1)[cands[:heads * kept[b]]] = True
  return out


def kvpress_kept(scores, ratio, alpha):
  """kvpress 0.5.5's `AdaKVPress.compress` on `scores: [K, n]` of one sequence, in numpy:
  returns the kept mask (the complement of its `masked_key_indices`)."""
  heads, n = scores.shape
  if ratio == 0:
    return np.ones(scores.shape, bool)
  n_kept = max(1, int(n * (1 - ratio)))  # compute_n_kept
  n_safe = int(n_kept * alpha)
  if alpha > 0:
    n_safe = max(1, n_safe) if n_kept > 0 else 0
  s = scores.astype(np.float32).copy()
  for h in range(heads):  # torch.topk(scores, n_safe).indices, scatter finfo.max
    s[h, np.argsort(-s[h])[:n_safe]] = np.finfo(np.float32).max
  n_pruned = heads * (n - n_kept)
  pruned = np.argsort(s.reshape(-1))[:n_pruned]  # torch.topk(-scores.reshape(bsz, -1), n_pruned)
  kept = np.ones(heads * n, bool)
  kept[pruned] = False
  return kept.reshape(heads, n)


def _counts(lengths, ratio, alpha, budget=None):
  kept = np.array([_context.kept_count(int(n), ratio, budget) for n in lengths], np.int32)
  return kept, np.array([safe_count(int(k), alpha) for k in kept], np.int32)


@pytest.mark.parametrize("heads", [1, 3])
def test_select_equals_the_numpy_reference_over_ragged_rows(heads):
  # Rows: every (ratio, alpha, length) of the grid, one call: length 0 and 1, a full row,
  # ragged rows, ratio 0, protected (+inf) tokens, a tie, NaN in unused slots.
  grid = list(itertools.product([0.0, 0.3, 0.75, 0.95], [0.0, 0.2, 1.0], [0, 1, 2, 7, 11]))
  width = 11
  lengths = np.array([n for _, _, n in grid], np.int32)
  rng = np.random.default_rng(heads)
  priority = rng.normal(size=(len(grid), heads, width)).astype(np.float32)
  priority[:, :, ::4] = np.inf
  priority[:, :, 1] = priority[:, :, 2]
  valid = np.broadcast_to(np.arange(width) < lengths[:, None, None], priority.shape)
  priority = np.where(valid, priority, np.nan)
  counts = [_counts([n], r, a) for r, a, n in grid]
  kept = np.array([k[0] for k, _ in counts], np.int32)
  safe = np.array([s[0] for _, s in counts], np.int32)
  got = np.asarray(jax.jit(select)(priority, valid, kept, safe))
  np.testing.assert_array_equal(got, select_reference(priority, valid, kept, safe))
  np.testing.assert_array_equal(got.sum(axis=(1, 2)), heads * np.minimum(kept, lengths))
  for b, n in enumerate(lengths):  # every head keeps at least its safeguard
    assert (got[b].sum(-1) >= min(safe[b], n)).all()


@pytest.mark.parametrize("heads", [1, 2, 3])
def test_the_kept_set_is_kvpress_adakvpress(heads):
  grid = list(itertools.product([1, 2, 7, 50], [0.0, 0.1, 0.5, 0.9], [0.0, 0.2, 1.0]))
  width = 50
  scores = np.full((len(grid), heads, width), np.nan, np.float32)
  for row, (n, _, _) in enumerate(grid):  # distinct scores: no ties for torch.topk to break
    scores[row, :, :n] = np.random.default_rng(row).permutation(heads * n).reshape(heads, n) / n
  lengths = np.array([n for n, _, _ in grid])
  valid = np.broadcast_to(np.arange(width) < lengths[:, None, None], scores.shape)
  counts = [_counts([n], r, a) for n, r, a in grid]
  kept = np.array([k[0] for k, _ in counts], np.int32)
  safe = np.array([s[0] for _, s in counts], np.int32)
  got = np.asarray(jax.jit(select)(scores, valid, kept, safe))
  for row, (n, ratio, alpha) in enumerate(grid):
    np.testing.assert_array_equal(got[row, :, :n], kvpress_kept(scores[row, :, :n], ratio, alpha),
                                  err_msg=str((n, ratio, alpha)))
    assert not got[row, :, n:].any()


def _update(cache, k, lengths):
  return jax.jit(lambda c, k, n: c.update(k, k, n))(cache, k, jnp.asarray(lengths, jnp.int32))


def _held(cache, b):
  pos, head = np.asarray(cache.pos)[b], np.asarray(cache.head)[b]
  return [sorted(pos[(head == h) & (pos >= 0)].tolist()) for h in range(cache.num_kv_heads)]


@pytest.mark.parametrize("heads", [pytest.param(1, marks=pytest.mark.slow), 3])
def test_the_context_write_keeps_adakv_of_knorm_then_appends(heads):
  ratio, alpha, width = 0.5, 0.2, 9
  lengths = np.array([9, 0, 1, 5], np.int32)
  capacity = 9
  cache = AdaKVContextCache.init(4, capacity, heads, H, policy="knorm", compression_ratio=ratio,
                                 alpha=alpha)
  rng = np.random.default_rng(heads)
  k = rng.normal(size=(4, width, heads, H)).astype(np.float32) * rng.uniform(
      0.1, 3, size=(4, width, heads, 1)).astype(np.float32)
  k = np.where(np.arange(width)[None, :, None, None] < lengths[:, None, None, None], k, np.nan)
  cache = _update(cache, k, lengths)
  cache.check_state()
  valid = np.broadcast_to(np.arange(width) < lengths[:, None, None], (4, heads, width))
  score = -np.linalg.norm(np.nan_to_num(np.swapaxes(k, 1, 2)), axis=-1)  # knorm, [B, K, T]
  kept, safe = _counts(lengths, ratio, alpha)
  want = select_reference(score, valid, kept, safe)
  for b in range(4):
    assert _held(cache, b) == [np.flatnonzero(want[b, h]).tolist() for h in range(heads)]
  np.testing.assert_array_equal(np.asarray(cache.context_lengths), lengths)
  # The held keys are the written ones (keys and values alike, RoPE'd as given).
  pos, head = np.asarray(cache.pos), np.asarray(cache.head)
  for b, s in zip(*np.nonzero(pos >= 0)):
    np.testing.assert_array_equal(np.asarray(cache.k)[b, s], k[b, pos[b, s], head[b, s]])
  # Later writes append to every head, uncompressed (row 1's first write was its 0 tokens).
  more = rng.normal(size=(4, 2, heads, H)).astype(np.float32)
  after = _update(cache, more, np.array([2, 1, 0, 2], np.int32))
  after.check_state()
  for b, n in enumerate([2, 1, 0, 2]):
    new = list(range(int(lengths[b]), int(lengths[b]) + n))
    assert _held(after, b) == [sorted(h + new) for h in _held(cache, b)]
  np.testing.assert_array_equal(np.asarray(after.pos)[2], np.asarray(cache.pos)[2])  # wrote none
  # NaN in the empty slots of the pool changes nothing (the same program: no recompilation).
  empty = np.asarray(cache.pos) < 0
  dirty = cache.replace(k=jnp.where(empty[..., None], jnp.nan, cache.k),
                        v=jnp.where(empty[..., None], jnp.nan, cache.v),
                        scores=jnp.where(empty, jnp.nan, cache.scores))
  dirty = _update(dirty, more, np.array([2, 1, 0, 2], np.int32))
  held = (np.asarray(after.pos) >= 0)[..., None]
  np.testing.assert_array_equal(np.asarray(dirty.pos), np.asarray(after.pos))
  np.testing.assert_array_equal(np.where(held, np.asarray(dirty.k), 0),
                                np.where(held, np.asarray(after.k), 0))


def test_overflow_drops_the_lowest_context_scores_then_the_oldest_appended():
  cache = AdaKVContextCache.init(1, 3, 2, H, policy="knorm", compression_ratio=0.5, alpha=0.0)
  scale = np.array([5, 1, 4, 2], np.float32)  # knorm keeps the small norms: tokens 1 and 3
  k = np.ones((1, 4, 2, H), np.float32) * scale[None, :, None, None]
  k[0, :, 1] *= 10  # head 1's norms all larger: AdaKV gives head 0 every slot
  cache = _update(cache, k, [4])
  assert _held(cache, 0) == [[0, 1, 2, 3], []]  # K * n_kept = 4 slots, all to head 0
  after = _update(cache, np.ones((1, 1, 2, H), np.float32), [1])  # 4 + 2 slots: fits P = 6
  assert _held(after, 0) == [[0, 1, 2, 3, 4], [4]]
  full = _update(after, np.ones((1, 1, 2, H), np.float32), [1])  # 8 > P: two context slots go
  held = _held(full, 0)
  assert held == [[1, 3, 4, 5], [4, 5]]  # head 0's largest norms (tokens 0, 2) dropped
  full.check_state()


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.int8])
def test_the_pool_holds_capacity_tokens_of_every_head(dtype):
  cache = AdaKVContextCache.init(2, 10, 3, H, dtype, policy="keydiff", compression_ratio=0.5)
  same = EvictingKVCache.init(2, None, 3, H, dtype, policy="keydiff", compress="context",
                              compression_ratio=0.5, capacity=10)
  assert cache.k.shape == (2, 30, H) and cache.capacity == 10
  assert sum(a.nbytes for a in cache.storage_arrays()) == sum(
      a.nbytes for a in same.storage_arrays())
  assert memory.measured_bytes_per_token(cache) == memory.gqa_bytes_per_token(3, H, dtype)
  assert capabilities.context_replayable(cache)
  assert cache.slots_needed([100, 7], [120, 10]) == 70


def test_bad_options_raise_value_errors_naming_them():
  for kwargs, name in [({"compression_ratio": 1.0}, "compression_ratio"),
                       ({"compression_ratio": 0.5, "alpha": 2}, "alpha"),
                       ({}, "compression_ratio or budget"),
                       ({"compression_ratio": 0.5, "window_size": 0}, "window_size"),
                       ({"compression_ratio": 0.5, "chunk": 2}, "unknown option")]:
    with pytest.raises(ValueError, match=name):
      AdaKVContextCache.init(1, 8, 2, H, policy="snapkv", **kwargs)
  with pytest.raises(ValueError, match="policy must be one of"):
    AdaKVContextCache.init(1, 8, 2, H, policy="nope", compression_ratio=0.5)
  with pytest.raises(ValueError, match="cache.compress must be 'context'"):
    registry.cache_options({"kind": "adakv_keydiff", "compress": "fixed", "budget": 4})
  with pytest.raises(ValueError, match="cache.alpha"):
    registry.cache_options({"kind": "adakv_keydiff", "alpha": -1})
  assert inner_of("adakv_expected_attention") == "expected_attention"
  assert inner_of("adakv") is None and inner_of("keydiff") is None


# ----------------------------------------------------------------------------------------------
# Through the model: with alpha = 1 every head's safeguard is its whole kept count, so AdaKV
# keeps exactly the uniform policy's tokens (its registered score, queries and windows).

PROMPTS_LENGTHS = np.array([12, 7], np.int32)
CONTEXTS = np.array([10, 4], np.int32)


@pytest.fixture(scope="module")
def model():
  cfg = transformer.model_config(d_model=32, num_layers=2, mlp_dim=64,
                                 attention=dict(num_heads=6, num_kv_heads=3, head_dim=8))
  return transformer.Transformer.from_config(cfg, rngs=nnx.Rngs(0))


@pytest.mark.slow  # ~3 CPU-s per policy; the conformance suite runs adakv_keydiff fast
@pytest.mark.parametrize("inner", ["keydiff", "expected_attention", "knorm", "snapkv"])
def test_alpha_one_keeps_the_uniform_policys_tokens(model, inner):
  options = {"snapkv": {"window_size": 2, "kernel_size": 3},
             "expected_attention": {"num_sinks": 1, "n_future_positions": 4}}.get(inner, {})
  prompts = np.random.default_rng(2).integers(0, 256, (2, 12)).astype(np.int32)
  prompts[1, 7:] = 0
  spec = {"compress": "context", "compression_ratio": 0.5, **options}
  runs = {}
  for kind, extra in ((f"adakv_{inner}", {"alpha": 1.0}), (inner, {})):
    factory = registry.cache_factory_from_config(model, {"kind": kind, **spec, **extra})
    runs[kind] = prefill(model, prompts, PROMPTS_LENGTHS, factory(2, 16),
                         context_lengths=CONTEXTS)[:2]
  (ada_first, ada), (uni_first, uni) = runs[f"adakv_{inner}"], runs[inner]
  np.testing.assert_array_equal(np.asarray(ada_first), np.asarray(uni_first))
  for a, u in zip(ada, uni):
    a.check_state()
    upos = np.asarray(u.pos)
    for b in range(2):
      assert _held(a, b) == [sorted(p for p in upos[b, h] if p >= 0) for h in range(3)]


@pytest.mark.slow  # ~10 CPU-s: generate and the replay compile
def test_a_replayed_context_gives_generates_tokens():
  # The compression family replays adakv points (CONTEXT_REPLAYABLE): the recorded context
  # written per layer, then the question and answer, equal generate(context_lengths=).
  import kvattn  # pylint: disable=g-import-not-at-top
  from experiments.evals import models, replay  # pylint: disable=g-import-not-at-top
  tiny = models.tiny_model(local_window=4)
  rng = np.random.default_rng(0)
  lengths = np.array([40, 19, 33], np.int32)
  prompts = np.zeros((3, 40), np.int32)
  for b, n in enumerate(lengths):
    prompts[b, :n] = rng.integers(1, 256, n)
  contexts = np.array([31, 1, 32], np.int32)
  spec = {"kind": "adakv_snapkv", "compression_ratio": 0.5, "window_size": 4, "kernel_size": 3}
  factory = registry.cache_factory_from_config(tiny, spec)
  slots = registry.slots_needed(spec, contexts, lengths + 4)
  want = kvattn.generate(tiny, prompts, lengths, 5, cache_factory=factory, max_len=slots,
                         context_lengths=contexts)
  context, rest, rest_lengths = replay.split_prompts(prompts, lengths, contexts)
  inputs = replay.record(tiny, context, contexts)
  assert replay.replayable(tiny, factory(3, slots))
  got = replay.generate_after(tiny, inputs, contexts, factory(3, slots), rest, rest_lengths, 5,
                              capacity=int(lengths.max()) + 4)
  np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
  np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
