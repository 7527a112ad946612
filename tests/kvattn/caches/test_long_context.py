"""Long-context caches (kvattn.caches.window / eviction): ring, attention sinks, eviction.

Each kind is checked against an independent reference: the ring against full
attention with a window over an unbounded cache, the sinks against RoPE at
the positions StreamingLLM assigns (a kept token's rank), eviction against
hand-computed group sums, and every kind against the dense cache wherever
nothing is evicted.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import kvattn
from kvattn import memory, ops
from kvattn.caches import registry as cache_factories
from kvattn.caches import protocol as cache_protocol
from kvattn.caches import eviction
from kvattn.models import transformer
from kvattn.ops.positional import positional_attention, positional_decode_attention

B, K, N, H = 2, 2, 4, 8
THETA = 10000.0


def _qkv(seed, num_tokens, batch=B):
  rng = np.random.default_rng(seed)
  q = jnp.asarray(rng.normal(size=(batch, num_tokens, N, H)), jnp.float32)
  k = jnp.asarray(rng.normal(size=(batch, num_tokens, K, H)), jnp.float32)
  v = jnp.asarray(rng.normal(size=(batch, num_tokens, K, H)), jnp.float32)
  return q, k, v


def _positions(num_tokens, batch=B):
  return jnp.broadcast_to(jnp.arange(num_tokens, dtype=jnp.int32)[None], (batch, num_tokens))


def _window_reference(q, k, v, window):
  """Full causal attention with `window` over all tokens (RoPE at original positions)."""
  pos = _positions(q.shape[1], q.shape[0])
  qr, kr = ops.apply_rope(q, pos), ops.apply_rope(k, pos)
  return ops.attention(qr, kr.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), window=window)


def _run_chunks(cache, q, k, v, chunk, new_lengths=None):
  """Feeds q, k, v through `cache_protocol.update_attend` in chunks; returns (out, caches)."""
  outs, caches = [], []
  for start in range(0, q.shape[1], chunk):
    end = min(q.shape[1], start + chunk)
    pos = cache.lengths[:, None] + jnp.arange(end - start, dtype=jnp.int32)[None]
    out, cache = cache_protocol.update_attend(
        cache, q[:, start:end], k[:, start:end], v[:, start:end], positions=pos,
        rope_theta=THETA, new_lengths=new_lengths)
    outs.append(out)
    caches.append(cache)
  return jnp.concatenate(outs, axis=1), caches


# ----------------------------------------------------------------------------------------------
# Positional attention (the op under all three kinds).


def test_positional_attention_equals_dense_attention_on_permuted_slots():
  q, k, v = _qkv(0, 6)
  kt, vt = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
  want = ops.attention(q, kt, vt, window=3)
  perm = np.array([4, 0, 5, 2, 1, 3])
  kv_pos = jnp.broadcast_to(jnp.asarray(perm, jnp.int32)[None], (B, 6))
  got, _ = positional_attention(q, kt[:, :, perm], vt[:, :, perm], _positions(6), kv_pos,
                                window=3, query_chunk=4)  # two blocks of queries
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-6)


def _mass_reference(q, kt, q_pos, kv_pos, rows, window=None):
  """numpy: `f32[B, K, S]`, the probabilities the scoring `rows` gave each slot, summed over
  the G query heads of each KV head."""
  q, kt = np.asarray(q, np.float64), np.asarray(kt, np.float64)
  groups = q.shape[2] // kt.shape[1]
  logits = np.einsum("btnh,bnsh->bnts", q, np.repeat(kt, groups, axis=1)) * q.shape[-1] ** -0.5
  qp, kp = np.asarray(q_pos)[:, None, :, None], np.asarray(kv_pos)[:, None, None, :]
  mask = (kp >= 0) & (kp <= qp) & (True if window is None else kp > qp - window)
  logits = np.where(mask, np.nan_to_num(logits), -np.inf)
  top = np.where(mask.any(-1, keepdims=True), logits.max(-1, keepdims=True), 0.0)
  probs = np.where(mask, np.exp(logits - top), 0.0)
  probs /= np.maximum(probs.sum(-1, keepdims=True), 1e-300)
  probs *= np.asarray(rows)[:, None, :, None]
  return probs.reshape(q.shape[0], kt.shape[1], groups, q.shape[1], -1).sum(axis=(2, 3))


@pytest.mark.parametrize("score_window,query_chunk,window", [
    (1, 256, None), (3, 256, None), (3, 4, None), (3, 4, 4), (9, 4, None), (20, 256, None)])
def test_score_window_gives_the_mass_of_every_scoring_query(score_window, query_chunk, window):
  # Rows of 0, 1, W - 1, W, W + 1 and all 9 tokens; their scoring queries are their last
  # min(n, 3) (SnapKV's observation window) or, for W = 1, the newest (TOVA).
  num_tokens, lengths = 9, np.array([0, 1, 2, 3, 4, 9])
  batch = len(lengths)
  rng = np.random.default_rng(7)
  q = jnp.asarray(rng.normal(size=(batch, num_tokens, N, H)), jnp.float32)
  kt = rng.normal(size=(batch, K, num_tokens + 2, H)).astype(np.float32)
  kt[:, :, -2:] = np.nan  # two unused slots (-1) holding garbage
  vt = jnp.asarray(np.nan_to_num(kt))
  kv_pos = np.concatenate([np.tile(np.arange(num_tokens), (batch, 1)),
                           np.full((batch, 2), -1)], axis=1).astype(np.int32)
  t = np.arange(num_tokens)[None]
  rows = (t < lengths[:, None]) & (t >= lengths[:, None] - min(score_window, 3))
  q_pos = np.where(t < lengths[:, None], t, -1).astype(np.int32)
  got_out, got = positional_attention(q, jnp.asarray(kt), vt, jnp.asarray(q_pos),
                                      jnp.asarray(kv_pos), window=window,
                                      score_queries=jnp.asarray(rows),
                                      score_window=score_window, query_chunk=query_chunk)
  want_out, want = positional_attention(q, jnp.asarray(kt), vt, jnp.asarray(q_pos),
                                        jnp.asarray(kv_pos), window=window,
                                        score_queries=jnp.asarray(rows), query_chunk=query_chunk)
  np.testing.assert_allclose(np.asarray(got), _mass_reference(q, kt, q_pos, kv_pos, rows, window),
                             atol=1e-5)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5)
  np.testing.assert_array_equal(np.asarray(got_out), np.asarray(want_out))
  np.testing.assert_array_equal(np.asarray(got)[0], 0.0)  # no scoring query, no mass
  np.testing.assert_allclose(np.asarray(got).sum(axis=-1), np.broadcast_to(
      (N // K) * rows.sum(1)[:, None], (batch, K)),
                             rtol=1e-5)  # each scoring query's G heads sum to G


def test_empty_and_garbage_slots_never_reach_the_output():
  q, k, v = _qkv(1, 1)
  kt = jnp.concatenate([k.transpose(0, 2, 1, 3), jnp.full((B, K, 3, H), jnp.nan)], axis=2)
  vt = jnp.concatenate([v.transpose(0, 2, 1, 3), jnp.full((B, K, 3, H), jnp.inf)], axis=2)
  kv_pos = jnp.array([[0, -1, -1, -1], [0, 5, -1, 7]], jnp.int32)  # 5, 7: future tokens
  out, probs = positional_decode_attention(q[:, 0], kt, vt, jnp.zeros((B,), jnp.int32), kv_pos)
  assert np.isfinite(np.asarray(out)).all()
  np.testing.assert_allclose(np.asarray(out), np.asarray(
      jnp.repeat(v[:, 0], N // K, axis=1)), atol=1e-6)
  np.testing.assert_allclose(np.asarray(probs), [[[2, 0, 0, 0]] * K] * B)  # G = 2 heads each
  nothing, _ = positional_decode_attention(q[:, 0], kt, vt, jnp.zeros((B,), jnp.int32),
                                           jnp.full((B, 4), -1, jnp.int32))
  np.testing.assert_array_equal(np.asarray(nothing), 0.0)


def test_decode_probs_are_the_group_sums_of_the_per_head_probabilities():
  q, k, v = _qkv(2, 5)
  kt, vt = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
  kv_pos = _positions(5)
  _, probs = positional_decode_attention(q[:, 4], kt, vt, jnp.full((B,), 4, jnp.int32), kv_pos)
  assert probs.shape == (B, K, 5)
  logits = np.einsum("bnh,bnsh->bns", np.asarray(q[:, 4]),
                     np.repeat(np.asarray(kt), N // K, axis=1)) * H ** -0.5
  per_head = np.exp(logits - logits.max(-1, keepdims=True))
  per_head /= per_head.sum(-1, keepdims=True)  # [B, N, S]
  want = per_head.reshape(B, K, N // K, 5).sum(2)  # query head n reads KV head n // G
  np.testing.assert_allclose(np.asarray(probs), want, rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------------------------
# Ring.


def test_ring_unrolled_oldest_to_newest_is_the_last_w_keys_at_every_step():
  window = 4
  ring = kvattn.RingKVCache.init(B, window, K, H)
  dense = kvattn.KVCache.init(B, 40, K, H)
  rng = np.random.default_rng(3)
  # prefill shorter than W, decode past several wraps, a chunk longer than W, ragged rows
  for chunk, new in [(3, [3, 2]), (1, [1, 1])] * 1 + [(1, [1, 1])] * 9 + [(6, [6, 4]),
                                                                          (2, [2, 0])]:
    k_new = jnp.asarray(rng.normal(size=(B, chunk, K, H)), jnp.float32)
    new = jnp.array(new, jnp.int32)
    ring = ring.update(k_new, k_new + 1, new)
    dense = dense.update(k_new, k_new + 1, new)
    for b in range(B):
      n = int(dense.lengths[b])
      assert int(ring.lengths[b]) == n
      pos = np.asarray(ring.slot_positions()[b])
      held = np.sort(pos[pos >= 0])
      np.testing.assert_array_equal(held, np.arange(max(0, n - window), n))
      order = np.argsort(np.where(pos < 0, 10**9, pos))[:len(held)]  # oldest -> newest
      np.testing.assert_array_equal(np.asarray(ring.k[b][:, order]),
                                    np.asarray(dense.k[b][:, max(0, n - window):n]))
      np.testing.assert_array_equal(np.asarray(ring.v[b][:, order]),
                                    np.asarray(dense.v[b][:, max(0, n - window):n]))


@pytest.mark.parametrize("chunk", [1, pytest.param(2, marks=pytest.mark.slow), 3, 5,
                                   pytest.param(13, marks=pytest.mark.slow)])
def test_ring_equals_full_attention_with_window_w_for_any_chunking(chunk):
  window = 5
  q, k, v = _qkv(4, 13)
  out, caches = _run_chunks(kvattn.RingKVCache.init(B, window, K, H), q, k, v, chunk)
  np.testing.assert_allclose(np.asarray(out), np.asarray(_window_reference(q, k, v, window)),
                             atol=1e-5)
  assert caches[-1].k.shape == (B, K, window, H)


def test_ring_int8_with_room_for_everything_equals_the_dense_int8_cache():
  q, k, v = _qkv(5, 6)
  out, _ = _run_chunks(kvattn.RingKVCache.init(B, 6, K, H, jnp.int8), q, k, v, 2)
  want, _ = _run_chunks(kvattn.KVCache.init(B, 6, K, H, jnp.int8), q, k, v, 2)
  np.testing.assert_allclose(np.asarray(out), np.asarray(want), atol=1e-5)


# ----------------------------------------------------------------------------------------------
# Sinks.


def test_sink_keys_are_rope_of_the_raw_key_at_its_rank_and_the_query_at_the_cache_length():
  num_sinks, window = 2, 3
  cache = kvattn.SinkKVCache.init(B, num_sinks, window, K, H)
  raw = {}
  rng = np.random.default_rng(6)
  for chunk in [1, 2, 1, 1, 4, 1, 1, 1, 2]:
    length_before = np.asarray(cache.lengths)
    held_before = np.asarray((cache.slot_positions() >= 0).sum(-1))
    np.testing.assert_array_equal(np.asarray(cache.query_position()),
                                  np.minimum(held_before, cache.capacity - 1))
    k_new = jnp.asarray(rng.normal(size=(B, chunk, K, H)), jnp.float32)
    for b in range(B):
      for t in range(chunk):
        raw[b, int(length_before[b]) + t] = np.asarray(k_new[b, t])
    cache = cache.update(k_new, k_new, None)
    rotated = np.asarray(cache.rotated_keys())
    for b in range(B):
      pos = np.asarray(cache.slot_positions()[b])
      kept = np.sort(pos[pos >= 0])
      n = int(cache.lengths[b])
      want_kept = sorted(set(range(min(n, num_sinks))) | set(range(max(num_sinks, n - window),
                                                                   n)))
      np.testing.assert_array_equal(kept, want_kept)
      for s, p in enumerate(pos):
        if p < 0:
          continue
        rank = int(np.searchsorted(kept, p))  # the position StreamingLLM assigns
        assert int(cache.cache_positions()[b, s]) == rank < cache.capacity
        want = ops.apply_rope(jnp.asarray(raw[b, p])[None, None], jnp.array([[rank]]))[0, 0]
        np.testing.assert_allclose(rotated[b, :, s], np.asarray(want), atol=1e-5)


def test_sink_decode_attends_at_the_cache_positions():
  num_sinks, window = 2, 3
  q, k, v = _qkv(7, 9, batch=1)
  out, caches = _run_chunks(kvattn.SinkKVCache.init(1, num_sinks, window, K, H), q, k, v, 1)
  # the last query (token 8) sees tokens 0, 1 (sinks) and 6, 7, 8 at positions 0..4
  kept = [0, 1, 6, 7, 8]
  kr = ops.apply_rope(k[:, kept], jnp.arange(5, dtype=jnp.int32)[None])
  qr = ops.apply_rope(q[:, 8:9], jnp.array([[4]], jnp.int32))
  want = ops.attention(qr, kr.transpose(0, 2, 1, 3), v[:, kept].transpose(0, 2, 1, 3),
                       q_offsets=jnp.array([4]))
  np.testing.assert_allclose(np.asarray(out[:, 8:9]), np.asarray(want), atol=1e-5)
  assert int(caches[-2].query_position()[0]) == 4


@pytest.mark.parametrize("chunk", [2, pytest.param(3, marks=pytest.mark.slow), 9])
def test_sink_chunks_equal_token_by_token(chunk):
  q, k, v = _qkv(8, 9)
  one, _ = _run_chunks(kvattn.SinkKVCache.init(B, 2, 3, K, H), q, k, v, 1)
  got, _ = _run_chunks(kvattn.SinkKVCache.init(B, 2, 3, K, H), q, k, v, chunk)
  np.testing.assert_allclose(np.asarray(got), np.asarray(one), atol=1e-5)


@pytest.mark.parametrize("chunk", [1, pytest.param(4, marks=pytest.mark.slow)])
def test_zero_sinks_reduce_to_the_window(chunk):
  q, k, v = _qkv(9, 11)
  sink, _ = _run_chunks(kvattn.SinkKVCache.init(B, 0, 4, K, H), q, k, v, chunk)
  np.testing.assert_allclose(np.asarray(sink), np.asarray(_window_reference(q, k, v, 4)),
                             atol=1e-5)


# ----------------------------------------------------------------------------------------------
# Eviction.


def _two_group_case():
  """KV head 0's queries attend token 1, KV head 1's token 3 (signal in the slowly
  rotating RoPE pair, so rotation at positions < 5 barely moves it)."""
  num_tokens = 5
  q = np.zeros((1, num_tokens, N, 4), np.float32)
  k = np.zeros((1, num_tokens, K, 4), np.float32)
  q[..., 1] = 6.0  # every query head
  k[0, 1, 0, 1] = 6.0  # KV head 0: token 1 stands out
  k[0, 3, 1, 1] = 6.0  # KV head 1: token 3 stands out
  v = np.random.default_rng(10).normal(size=(1, num_tokens, K, 4)).astype(np.float32)
  return jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)


@pytest.mark.parametrize("policy", ["h2o", "tova_per_head", "snapkv"])
def test_kv_heads_whose_groups_attend_different_slots_keep_different_slots(policy):
  q, k, v = _two_group_case()
  options = {"recent_size": 0} if policy != "snapkv" else {"window_size": 1, "kernel_size": 1}
  cache = kvattn.EvictingKVCache.init(1, 2, K, 4, policy=policy, **options)
  pos = _positions(5, 1)
  _, cache = cache.update_attend(q, k, v, positions=pos, rope_theta=THETA)
  kept = np.asarray(cache.slot_positions())[0]  # [K, budget]
  assert 1 in kept[0] and 3 not in kept[0]
  assert 3 in kept[1] and 1 not in kept[1]


def test_tova_keeps_one_set_per_layer_the_head_averaged_newest_attention():
  # TOVA (Oren et al. 2024): the last query's softmax averaged over every head of the layer.
  q, k, v = _two_group_case()
  rng = np.random.default_rng(12)
  q = q + jnp.asarray(rng.normal(size=q.shape), jnp.float32)  # heads disagree by degrees
  k = k + jnp.asarray(rng.normal(size=k.shape), jnp.float32)
  cache = kvattn.EvictingKVCache.init(1, 2, K, 4, policy="tova")
  pos = _positions(5, 1)
  _, cache = cache.update_attend(q, k, v, positions=pos, rope_theta=THETA)
  kept = np.asarray(cache.slot_positions())[0]  # [K, budget]
  np.testing.assert_array_equal(kept[0], kept[1])  # one set, in the same slots
  qr = np.asarray(ops.apply_rope(q, pos, rope_theta=THETA))[0, -1]  # [N, H], the newest query
  kr = np.asarray(ops.apply_rope(k, pos, rope_theta=THETA))[0]  # [T, K, H]
  logits = np.einsum("nh,tnh->nt", qr, np.repeat(kr, N // K, axis=1)) / np.sqrt(4)
  probs = np.exp(logits - logits.max(-1, keepdims=True))
  probs /= probs.sum(-1, keepdims=True)
  want = np.argsort(-probs.mean(0))[:2]
  assert set(kept[0].tolist()) == set(want.tolist())


@pytest.mark.parametrize("policy", eviction.POLICIES)
def test_budget_never_exceeded_and_never_off_by_one(policy):
  budget = 4
  cache = kvattn.EvictingKVCache.init(B, budget, K, H, policy=policy)
  rng = np.random.default_rng(11)
  # a 1-token prompt (row 0) then decode steps; row 1 a longer prompt, then a ragged chunk
  for chunk, new in [(3, [1, 3]), (1, [1, 1]), (1, [1, 1]), (1, [1, 0]), (1, [1, 1]),
                     (5, [5, 2]), (1, [1, 1])]:
    q, k, v = (jnp.asarray(rng.normal(size=s), jnp.float32) for s in
               [(B, chunk, N, H), (B, chunk, K, H), (B, chunk, K, H)])
    pos = cache.lengths[:, None] + jnp.arange(chunk, dtype=jnp.int32)[None]
    _, cache = cache.update_attend(q, k, v, positions=pos, rope_theta=THETA,
                                   new_lengths=jnp.array(new, jnp.int32))
    assert cache.k.shape == (B, K, budget, H)
    kept = np.asarray(cache.slot_positions())
    for b in range(B):
      n = int(cache.lengths[b])
      for h in range(K):
        held = kept[b, h][kept[b, h] >= 0]
        assert len(held) == min(n, budget)
        assert len(set(held.tolist())) == len(held) and held.max() < n and held.min() >= 0
        if policy in ("h2o", "snapkv", "recent"):  # these protect a recent window
          assert held.max() == n - 1
        if policy == "recent":
          np.testing.assert_array_equal(np.sort(held), np.arange(max(0, n - budget), n))


def test_causality_by_original_position_after_eviction():
  budget = 4
  q, k, v = _qkv(12, 10)
  _, caches = _run_chunks(kvattn.EvictingKVCache.init(B, budget, K, H, policy="recent"),
                          q, k, v, 3)
  cache = caches[-1]  # keeps tokens 6..9
  np.testing.assert_array_equal(np.asarray(cache.slot_positions())[0, 0], [6, 7, 8, 9])
  qr = ops.apply_rope(q[:, 7:8], jnp.full((B, 1), 7, jnp.int32))
  got = cache.attend(qr, q_offsets=jnp.full((B,), 7, jnp.int32))  # a query at token 7
  kr = ops.apply_rope(k[:, 6:8], jnp.array([[6, 7]] * B, jnp.int32))
  want = ops.attention(qr, kr.transpose(0, 2, 1, 3), v[:, 6:8].transpose(0, 2, 1, 3),
                       q_offsets=jnp.ones((B,), jnp.int32))  # sees 6 and 7, never 8 or 9
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.int8])
def test_memory_is_the_budget(dtype):
  budget = 6
  caches = [kvattn.RingKVCache.init(B, budget, K, H, dtype),
            kvattn.SinkKVCache.init(B, 2, budget - 2, K, H, dtype),
            kvattn.EvictingKVCache.init(B, budget, K, H, dtype, policy="h2o")]
  per_token = memory.gqa_bytes_per_token(K, H, dtype)  # scales included when quantized
  for cache in caches:
    assert cache.capacity == budget and cache.storage_slots == B * budget
    assert memory.measured_bytes_per_token(cache) == per_token
    assert sum(a.nbytes for a in cache.storage_arrays()) == B * budget * per_token


def test_bad_input_raises_value_error():
  with pytest.raises(ValueError, match="budget"):
    kvattn.EvictingKVCache.init(B, 2, K, H, policy="h2o", num_sinks=2)
  with pytest.raises(ValueError, match="policy"):
    kvattn.EvictingKVCache.init(B, 8, K, H, policy="lru")
  with pytest.raises(ValueError, match="unknown option"):
    kvattn.EvictingKVCache.init(B, 8, K, H, policy="tova", window_size=2)
  with pytest.raises(ValueError, match="window"):
    kvattn.RingKVCache.init(B, 0, K, H)
  with pytest.raises(ValueError, match="window"):
    kvattn.SinkKVCache.init(B, 4, 0, K, H)
  with pytest.raises(ValueError, match="num_sinks"):
    kvattn.SinkKVCache.init(B, -1, 4, K, H)
  with pytest.raises(ValueError, match="implementation"):
    kvattn.RingKVCache.init(B, 4, K, H).attend(jnp.zeros((B, 1, N, H)),
                                               q_offsets=jnp.zeros((B,), jnp.int32),
                                               implementation="pallas")


def test_every_kind_implements_the_gqa_protocol():
  for cache in (kvattn.RingKVCache.init(1, 4, K, H), kvattn.SinkKVCache.init(1, 1, 3, K, H),
                kvattn.EvictingKVCache.init(1, 4, K, H, policy="knorm")):
    assert isinstance(cache, cache_protocol.GQACache)
    assert not isinstance(cache, cache_protocol.MLACache)


# ----------------------------------------------------------------------------------------------
# Through the model and generate (GQA: K < N; batched rows of different lengths).


def _model(window=None, num_layers=2):
  layer = {} if window is None else {"window": window}
  cfg = transformer.model_config(d_model=32, num_layers=num_layers, mlp_dim=64,
                                 layers=(layer,) * num_layers,
                                 attention=dict(num_heads=4, num_kv_heads=2, head_dim=8))
  return transformer.Transformer.from_config(cfg, rngs=nnx.Rngs(0))


ALL_POLICIES = [{"kind": "sink", "num_sinks": 2, "window": 30}, {"kind": "ring", "window": 32}
                ] + [{"kind": p, "budget": 32} for p in eviction.POLICIES]


@pytest.mark.slow  # fast suite: test_every_kind.py's easy settings equal the dense cache
def test_every_kind_with_room_for_everything_gives_the_dense_logits():
  model = _model(num_layers=1)
  tokens = jax.random.randint(jax.random.key(2), (B, 20), 0, 256)

  def run(caches):  # eager: cheaper than compiling the four calls once per kind
    outs = []
    for start, end, new in [(0, 9, [9, 5]), (9, 10, [1, 1]), (10, 17, [7, 7]), (17, 18, [1, 0])]:
      logits, caches = model(tokens[:, start:end], caches, new_lengths=jnp.array(new))
      outs.append(logits)
    return outs

  dense = run(model.init_caches(B, 32))
  for policy in ALL_POLICIES:
    got = run(model.init_caches(B, 32, cache=policy))
    for g, d, rows in zip(got, dense, [(0,), (0, 1), (0, 1), (0,)]):
      for b in rows:
        width = 5 if (b == 1 and g.shape[1] == 9) else g.shape[1]
        np.testing.assert_allclose(np.asarray(g[b, :width]), np.asarray(d[b, :width]),
                                   atol=1e-5, err_msg=str(policy))


PROMPTS = np.random.default_rng(13).integers(0, 256, (3, 7)).astype(np.int32)
PROMPT_LENGTHS = np.array([7, 1, 4], np.int32)  # ragged rows; a 1-token prompt


def _generate_tight(model, policies):
  """Tight budgets run batched (14 tokens through 4 slots) and stay in the vocabulary."""
  for policy in policies:
    factory = cache_factories.cache_factory_from_config(model, policy)
    got, got_len = kvattn.generate(model, PROMPTS, PROMPT_LENGTHS, 8, cache_factory=factory)
    assert got.shape == (3, 8) and np.all((np.asarray(got) >= 0) & (np.asarray(got) < 256))
    np.testing.assert_array_equal(np.asarray(got_len), 8)


@pytest.mark.slow  # fast suite: test_every_kind.py runs generate with every kind, ragged
def test_generate_with_each_kind_batched():
  model = _model()
  prompts, lengths = PROMPTS, PROMPT_LENGTHS
  dense, dense_len = kvattn.generate(model, prompts, lengths, 8)
  for policy in ALL_POLICIES[:3]:  # room for everything: the dense tokens exactly
    factory = cache_factories.cache_factory_from_config(model, policy)
    got, got_len = kvattn.generate(model, prompts, lengths, 8, cache_factory=factory)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(dense), err_msg=str(policy))
    np.testing.assert_array_equal(np.asarray(got_len), np.asarray(dense_len))
  # A ring of W on a model without a window gives the tokens of the model with window W.
  ring = cache_factories.cache_factory_from_config(model, {"kind": "ring", "window": 3})
  got, _ = kvattn.generate(model, prompts, lengths, 8, cache_factory=ring)
  want, _ = kvattn.generate(_model(window=3), prompts, lengths, 8)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.slow
def test_generate_every_policy_batched():
  model = _model()
  dense, _ = kvattn.generate(model, PROMPTS, PROMPT_LENGTHS, 8)
  for policy in ALL_POLICIES[3:]:
    factory = cache_factories.cache_factory_from_config(model, policy)
    got, _ = kvattn.generate(model, PROMPTS, PROMPT_LENGTHS, 8, cache_factory=factory)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(dense), err_msg=str(policy))
  _generate_tight(model, [{"kind": "sink", "num_sinks": 1, "window": 3}]
                  + [{"kind": p, "budget": 4} for p in eviction.POLICIES])


def test_init_caches_policy_builds_the_kind_and_rejects_bad_dicts():
  model = _model()
  caches = model.init_caches(B, 64, cache={"kind": "sink", "num_sinks": 4, "window": 12})
  assert all(isinstance(c, kvattn.SinkKVCache) and c.capacity == 16 for c in caches)
  caches = model.init_caches(B, 64, jnp.int8, cache={"kind": "snapkv", "budget": 8,
                                                      "window_size": 2})
  assert all(isinstance(c, kvattn.EvictingKVCache) and c.quantized for c in caches)
  with pytest.raises(ValueError, match="kind"):
    model.init_caches(B, 64, cache={"kind": "lru", "budget": 8})
  with pytest.raises(ValueError, match="cache.budget is not an option of cache.kind = 'ring'"):
    model.init_caches(B, 64, cache={"kind": "ring", "window": 8, "budget": 8})
  with pytest.raises(TypeError, match="cache must be a dict"):
    model.init_caches(B, 64, cache="h2o")


def test_cache_kind_switch_selects_each_kind_from_a_config_and_names_bad_keys():
  from ml_collections import config_dict  # pylint: disable=g-import-not-at-top
  model = _model()
  configs = {
      "ring": (dict(window=8), kvattn.RingKVCache, 8),
      "sink": (dict(num_sinks=2, window=6), kvattn.SinkKVCache, 8),
      **{p: (dict(budget=8), kvattn.EvictingKVCache, 8) for p in eviction.POLICIES},
  }
  assert set(configs) | {"dense", "paged"} <= set(cache_factories.CACHE_KIND_TABLE)
  for kind, (options, cls, capacity) in configs.items():
    # A flat config section: keys of other kinds are None (unset).
    cfg = config_dict.ConfigDict(dict(kind=kind, page_size=None, max_len=64, **options))
    caches = cache_factories.cache_factory_from_config(model, cfg)(B, 64, None)
    assert len(caches) == 2 and all(isinstance(c, cls) and c.capacity == capacity
                                    for c in caches), kind
  h2o = cache_factories.cache_factory_from_config(
      model, {"kind": "h2o", "budget": 8, "recent_size": 2, "num_sinks": 1})(B, 64, None)[0]
  assert h2o.policy == "h2o" and dict(h2o.options) == {"num_sinks": 1, "recent_size": 2}
  dense = cache_factories.cache_factory_from_config(model, {"kind": "dense"})(B, 64, None)
  assert all(isinstance(c, kvattn.KVCache) and c.capacity == 64 for c in dense)
  for cfg, message in [
      ({"kind": "lru"}, r"cache.kind must be one of \('dense', 'paged', 'ring'"),
      ({"kind": "ring"}, r"cache.window must be set for cache.kind = 'ring'"),
      ({"kind": "ring", "window": 8, "budget": 8}, r"cache.budget is not an option of "
                                                   r"cache.kind = 'ring'"),
      ({"kind": "dense", "page_size": 4}, r"cache.page_size is not an option"),
      ({"kind": "tova", "budget": 8, "window_size": 2}, r"cache.window_size is not an option"),
      ({"kind": "ring", "window": 0}, r"cache \(kind 'ring'.*window"),
      ({"kind": "sink", "num_sinks": 4, "window": -1}, r"cache \(kind 'sink'.*window"),
      ({"kind": "h2o", "budget": 8, "num_sinks": 8}, r"cache \(kind 'h2o'.*budget must be >= "
                                                     r"num_sinks \+ 1"),
  ]:
    with pytest.raises(ValueError, match=message):
      cache_factories.cache_factory_from_config(model, cfg)
  with pytest.raises(ValueError, match="taken"):
    cache_factories.register_cache_kind("ring", cache_factories.CACHE_KIND_TABLE["ring"])
