"""The presses' scores against numpy references (tests/kvattn/caches/presses/reference.py).

Each policy's jitted cache is driven through `update_attend` over a ragged schedule (a row of
length 0, then 1; chunks and single tokens; a row writing nothing) at budgets around the
prefill length, and the kept positions of every row and KV head must equal those of the numpy
simulation scoring with the reference; the same run from a cache whose every slot holds NaN keeps
the same positions. Bad options raise ValueError naming them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvattn.caches import eviction
from kvattn.caches.presses import chunkkv, composed, criticalkv, decoding, qfilter
from tests.kvattn.caches.presses import reference as ref

B, K, N, H = 2, 2, 4, 8
G = N // K
SCHEDULE = [(5, [5, 0]), (1, [1, 1]), (3, [2, 3]), (1, [1, 0]), (1, [1, 1])]
"""(chunk T, new_lengths): row 1 stays empty through the prefill, then holds 1 token."""
PREFILL = 5


def _inputs(seed):
  rng = np.random.default_rng(seed)
  out = []
  for num_tokens, new in SCHEDULE:
    q = rng.normal(size=(B, num_tokens, N, H))
    k = rng.normal(size=(B, num_tokens, K, H)) + 0.5  # a shared direction: cosines differ
    v = rng.normal(size=(B, num_tokens, K, H))
    out.append((q, k, v, np.array(new, np.int32)))
  return out


@jax.jit
def _step(cache, q, k, v, new_lengths):
  positions = cache.lengths[:, None] + jnp.arange(q.shape[1], dtype=jnp.int32)[None, :]
  return cache.update_attend(q, k, v, positions=positions, rope_theta=ref.THETA,
                             new_lengths=new_lengths)[1]


def _poisoned(cache):
  return cache.replace(k=jnp.full_like(cache.k, jnp.nan), v=jnp.full_like(cache.v, jnp.nan))


def _kept(cache):
  pos = np.asarray(cache.pos)
  return [[sorted(p[p >= 0].tolist()) for p in row] for row in pos]


def _check(cache, sim, score_fn, inputs, keep_fn=None):
  caches = {"clean": cache, "nan": _poisoned(cache)}
  for q, k, v, new in inputs:
    sim.step(q, k, v, new, score_fn, keep_fn)
    caches = {name: _step(c, *(jnp.asarray(x, jnp.float32) for x in (q, k, v)),
                          jnp.asarray(new)) for name, c in caches.items()}
    for name, c in caches.items():
      assert _kept(c) == sim.positions(), (name, new)
      assert np.isfinite(np.asarray(c.scores)).all(), name
  return caches["clean"]


def _per_head(fn):
  """A score_fn from a reference of one head's candidates (rank = carry)."""
  def score_fn(b, cands, chunk):
    rank = np.stack([np.where(c["pos"] >= 0, fn(c, h, chunk), -np.inf)
                     for h, c in enumerate(cands)])
    return rank, rank
  return score_fn


def _snapkv(window_size, kernel_size):
  def fn(c, h, chunk):
    n, num_tokens = chunk["n"], len(chunk["q_pos"])
    t = np.arange(num_tokens)
    scoring = (t < n) & (t >= n - window_size)
    q_rot = ref.rope(chunk["q"][:, h * G:(h + 1) * G], chunk["q_pos"][:, None])
    live = c["pos"] >= 0
    mass = ref.attention_mass(q_rot, chunk["q_pos"], np.where(live[:, None], c["k"], 0.0),
                              np.where(live, c["pos"], np.iinfo(np.int64).max), scoring)
    return c["carried"] + ref.avg_pool(mass, kernel_size)
  return fn


def _live(fn):
  """A per-head reference over the live candidates' keys only (empty ones: -inf)."""
  def apply(c, h, chunk):
    live = c["pos"] >= 0
    out = np.full(len(live), -np.inf)
    out[live] = fn(c["k"][live], h)
    return out
  return apply


BUDGETS = [PREFILL - 1, pytest.param(PREFILL, marks=pytest.mark.slow),
           pytest.param(PREFILL + 1, marks=pytest.mark.slow)]
"""Budget - 1, budget, budget + 1 around the prefill; the fast suite runs the one that evicts
at the prefill (the others: -m slow)."""


@pytest.mark.parametrize("budget", BUDGETS)
def test_keydiff_keeps_the_keys_least_like_the_mean_key(budget):
  cache = eviction.EvictingKVCache.init(B, budget, K, H, policy="keydiff")
  _check(cache, ref.Simulation(B, K, budget), _per_head(_live(lambda k, h: ref.keydiff(k))),
         _inputs(0))


@pytest.mark.parametrize("budget", BUDGETS)
def test_expected_attention_is_kvpress_expected_softmax_times_value_norm(budget):
  options = dict(n_future_positions=3, num_sinks=1)
  cache = eviction.EvictingKVCache.init(B, budget, K, H, policy="expected_attention", **options)

  def fn(c, h, chunk):
    live = c["pos"] >= 0
    out = np.full(len(live), -np.inf)
    out[live] = ref.expected_attention(
        c["k"][live], c["v"][live], c["pos"][live], chunk["q"][:, h * G:(h + 1) * G],
        chunk["q_pos"], chunk["end"], num_sinks=1, n_future=3)
    return out

  _check(cache, ref.Simulation(B, K, budget, num_sinks=1), _per_head(fn), _inputs(1))


@pytest.mark.parametrize("budget", BUDGETS)
def test_qfilter_keeps_the_largest_projections_on_the_filter(budget):
  filters = np.random.default_rng(7).normal(size=(K, H))
  filters /= np.linalg.norm(filters, axis=-1, keepdims=True)
  cache = qfilter.QFilterKVCache.init(B, budget, K, H, filters=filters, recent_size=1)
  assert cache.filters.shape == (B, K, H)
  _check(cache, ref.Simulation(B, K, budget, recent=1),
         _per_head(_live(lambda k, h: ref.qfilter(k, filters[h]))), _inputs(2))


@pytest.mark.parametrize("budget", BUDGETS)
def test_chunkkv_keeps_whole_chunks_by_their_mean_snapkv_score(budget):
  window, kernel, size = 2, 3, 2
  cache = eviction.EvictingKVCache.init(B, budget, K, H, policy="chunkkv", window_size=window,
                                        kernel_size=kernel, chunk_size=size)
  snap = _snapkv(window, kernel)

  def score_fn(b, cands, chunk):
    carry = np.stack([snap(c, h, chunk) for h, c in enumerate(cands)])
    live = cands[0]["pos"] >= 0
    per_token = np.where(live, carry, 0.0).sum(axis=0)
    rank = np.where(live, ref.chunk_means(per_token, cands[0]["pos"], size), -np.inf)
    return np.broadcast_to(rank, carry.shape), carry

  final = _check(cache, ref.Simulation(B, K, budget, recent=window), score_fn, _inputs(3))
  kept = _kept(final)
  assert all(row[0] == row[1] for row in kept)  # one set per layer


@pytest.mark.parametrize("budget", BUDGETS)
def test_composition_narrows_by_snapkv_then_chooses_by_key_norm(budget):
  name = composed.compose("snapkv", "knorm")
  first_keep = budget + 1
  cache = eviction.EvictingKVCache.init(B, budget, K, H, policy=name, window_size=1,
                                        kernel_size=1, first_keep=first_keep)
  snap = _snapkv(1, 1)

  def score_fn(b, cands, chunk):
    ranks, carries = [], []
    for h, c in enumerate(cands):
      live = c["pos"] >= 0
      a = np.where(live, snap(c, h, chunk), -np.inf)
      second = np.where(live, ref.knorm(c["k"]), -np.inf)
      survivor = ref.descending_rank(a) < first_keep
      num = len(live)
      ranks.append(np.where(survivor, num, 0) + (num - 1 - ref.descending_rank(second)))
      carries.append(a)
    return np.stack(ranks).astype(np.float64), np.stack(carries)

  _check(cache, ref.Simulation(B, K, budget, recent=1), score_fn, _inputs(4))


@pytest.mark.parametrize("budget", BUDGETS)
def test_criticalkv_keeps_snapkvs_best_then_score_times_value_norm(budget):
  first_keep = 2
  cache = eviction.EvictingKVCache.init(B, budget, K, H, policy="criticalkv", window_size=1,
                                        kernel_size=1, first_keep=first_keep)
  snap = _snapkv(1, 1)

  def score_fn(b, cands, chunk):
    ranks, carries = [], []
    for h, c in enumerate(cands):
      live = c["pos"] >= 0
      s = np.where(live, snap(c, h, chunk), 0.0)
      second = np.where(live, (s + 1e-4) * np.linalg.norm(c["v"], axis=-1), -np.inf)
      s = np.where(live, s, -np.inf)
      num = len(live)
      ranks.append(np.where(ref.descending_rank(s) < first_keep, num, 0)
                   + (num - 1 - ref.descending_rank(second)))
      carries.append(s)
    return np.stack(ranks).astype(np.float64), np.stack(carries)

  _check(cache, ref.Simulation(B, K, budget, recent=1), score_fn, _inputs(6))


@pytest.mark.parametrize("budget", BUDGETS)
def test_decoding_evicts_only_when_full_back_to_the_target(budget):
  interval = 2
  cache = decoding.DecodingKVCache.init(B, budget, K, H, policy="knorm",
                                        compression_interval=interval)
  assert cache.target == budget - interval
  keep_fn = lambda b, held, new: budget if held + new <= budget else budget - interval
  final = _check(cache, ref.Simulation(B, K, budget),
                 _per_head(_live(lambda k, h: ref.knorm(k))), _inputs(5), keep_fn)
  final.check_state()
  counts = (np.asarray(final.pos) >= 0).sum(-1)
  assert (counts <= budget).all() and counts.min() >= min(budget - interval, 1)


def test_bad_options_raise_value_errors_naming_them():
  with pytest.raises(ValueError, match="chunk_size"):
    eviction.EvictingKVCache.init(B, 6, K, H, policy="chunkkv", chunk_size=0)
  with pytest.raises(ValueError, match="n_future_positions"):
    eviction.EvictingKVCache.init(B, 6, K, H, policy="expected_attention", n_future_positions=0)
  with pytest.raises(ValueError, match="first_keep"):
    eviction.EvictingKVCache.init(B, 6, K, H, policy="snapkv+knorm", first_keep=0)
  with pytest.raises(ValueError, match="unknown option"):
    eviction.EvictingKVCache.init(B, 6, K, H, policy="keydiff", window_size=2)
  with pytest.raises(ValueError, match="second"):
    composed.compose("snapkv", "lru")
  with pytest.raises(ValueError, match="first_keep"):
    composed.compose("criticalkv", "knorm")
  with pytest.raises(ValueError, match="inner"):
    chunkkv.chunked("lru")
  with pytest.raises(ValueError, match="inner"):
    criticalkv.critical("lru")
  with pytest.raises(ValueError, match="first_keep"):
    eviction.EvictingKVCache.init(B, 6, K, H, policy="criticalkv", first_keep=-1)
  with pytest.raises(ValueError, match="compression_interval"):
    decoding.DecodingKVCache.init(B, 6, K, H, policy="knorm", compression_interval=6)
  with pytest.raises(ValueError, match="target"):
    decoding.DecodingKVCache.init(B, 6, K, H, policy="knorm", compression_interval=5,
                                  recent_size=2)
  with pytest.raises(ValueError, match="filters"):
    qfilter.QFilterKVCache.init(B, 6, K, H, filters=np.ones((K, H + 1)))
  with pytest.raises(ValueError, match="filters"):
    qfilter.QFilterKVCache.init(B, 6, K, H, filters=np.full((K, H), np.nan))


def test_each_declared_query_window_holds_every_scoring_query():
  # `query_window` lets a write attend with only a chunk's last W queries: every policy that
  # declares it must score with no query outside them, at any chunk width and real length.
  composed.compose("snapkv", "tova")
  composed.compose("h2o", "knorm")
  declared = 0
  for name, policy in eviction.POLICY_TABLE.items():
    if policy.score_queries is None:
      assert policy.query_window is None, name
      continue
    for budget in (1, 8, 64):
      options = eviction._policy_options(name, budget, {}, context=True)  # pylint: disable=protected-access
      kwargs = eviction.scoring_kwargs(name, options, jnp.array([0, 1, 5, 70, 100]), 100)
      rows = np.asarray(kwargs["score_queries"])
      if kwargs["score_window"] is None:
        continue
      declared += 1
      t, n = np.arange(100)[None], np.array([0, 1, 5, 70, 100])[:, None]
      assert not (rows & ((t >= n) | (t < n - kwargs["score_window"]))).any(), (name, budget)
  assert eviction.POLICY_TABLE["h2o+knorm"].query_window is None  # H2O scores with all
  assert eviction.scoring_kwargs("snapkv+tova", (("first_keep", 2), ("kernel_size", 5),
                                                 ("num_sinks", 0), ("recent_size", 0),
                                                 ("window_size", 6)),
                                 jnp.array([9]), 9)["score_window"] == 6
  assert declared >= 3 * 5  # snapkv, tova, tova_per_head, chunkkv, criticalkv at 3 budgets
