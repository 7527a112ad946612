"""PyramidKV (kvattn.caches.pyramid): the schedule against an exact-fraction reference, each
layer's SnapKV selection and attention against numpy, and the bytes each layer holds."""

from __future__ import annotations

import fractions
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kvattn import memory, ops
from kvattn.caches import pyramid, registry
from kvattn.caches import protocol as cache_protocol
from kvattn.caches.eviction import EvictingKVCache
from kvattn.inference.generation import prefill
from kvattn.models import transformer

B, K, N, H = 2, 2, 4, 8
THETA = 10000.0


def _reference_budgets(num_layers, budget, protected, beta, ratio):
  """The paper's schedule in exact fractions: top R / (beta L), bottom 2R / L - top, arithmetic
  between; floors, then the remainder to the largest fractional parts (lowest layer on ties)."""
  beta, ratio = fractions.Fraction(beta), fractions.Fraction(ratio)
  rest = math.floor(ratio * budget * num_layers) - num_layers * protected
  if num_layers == 1:
    shares = [fractions.Fraction(rest)]
  else:
    top = fractions.Fraction(rest) / (beta * num_layers)
    bottom = fractions.Fraction(2 * rest, num_layers) - top
    shares = [bottom - (bottom - top) * i / (num_layers - 1) for i in range(num_layers)]
  floors = [math.floor(s) for s in shares]
  extra = rest - sum(floors)
  order = sorted(range(num_layers), key=lambda i: (-(shares[i] - floors[i]), i))
  for i in order[:extra]:
    floors[i] += 1
  return tuple(protected + f for f in floors)


@pytest.mark.parametrize("num_layers", [1, 2, 3, 7, 30])
@pytest.mark.parametrize("beta,ratio", [(1, 1.0), (2, 1.0), (20, 1.0), (20, 0.5), (7.5, 0.25)])
def test_schedule_equals_the_papers_arithmetic_sequence(num_layers, beta, ratio):
  for budget, protected in [(64, 32), (6, 3), (128, 36), (37, 0), (8, 8)]:
    if math.floor(ratio * budget * num_layers) < num_layers * protected:
      with pytest.raises(ValueError, match="protected"):
        pyramid.layer_budgets(num_layers, budget, protected=protected, beta=beta, ratio=ratio,
                              minimum=0)
      continue
    got = pyramid.layer_budgets(num_layers, budget, protected=protected, beta=beta,
                                ratio=ratio, minimum=0)
    assert got == _reference_budgets(num_layers, budget, protected, beta, ratio)
    assert sum(got) == math.floor(ratio * budget * num_layers)
    assert all(a >= b for a, b in zip(got, got[1:]))  # large below, small above
    if beta == 1:  # beta 1: uniform up to rounding
      assert max(got) - min(got) <= 1


def test_schedule_rejects_bad_options_by_name():
  with pytest.raises(ValueError, match="ratio"):
    pyramid.layer_budgets(4, 64, ratio=0)
  with pytest.raises(ValueError, match="ratio"):
    pyramid.layer_budgets(4, 64, ratio=1.5)
  with pytest.raises(ValueError, match="beta"):
    pyramid.layer_budgets(4, 64, beta=0.5)
  with pytest.raises(ValueError, match="budget"):
    pyramid.layer_budgets(4, 0)
  with pytest.raises(ValueError, match="num_layers"):
    pyramid.layer_budgets(0, 8)
  with pytest.raises(ValueError, match="top layer 0 slots"):  # 2 slots: (2, 0) by the schedule
    pyramid.layer_budgets(2, 1, beta=20)


@pytest.fixture(scope="module")
def model():
  cfg = transformer.model_config(d_model=32, num_layers=4, mlp_dim=64,
                                 attention=dict(num_heads=N, num_kv_heads=K, head_dim=H))
  return transformer.Transformer.from_config(cfg, rngs=nnx.Rngs(0))


def test_kind_options_are_checked_and_named(model):
  build = lambda **o: registry.build_caches(model, B, 32, None, {"kind": "pyramidkv", **o})
  with pytest.raises(ValueError, match="cache.budget must be set"):
    build()
  with pytest.raises(ValueError, match="policy must be one of"):
    build(budget=16, policy="lru")
  with pytest.raises(ValueError, match="unknown option"):
    build(budget=16, policy="h2o", window_size=4)
  with pytest.raises(ValueError, match="beta"):
    build(budget=16, beta=0)
  with pytest.raises(ValueError, match="ratio"):
    build(budget=16, ratio=2.0)
  with pytest.raises(ValueError, match="cache.bogus is not an option"):
    build(budget=16, bogus=1)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.int8])
def test_each_layer_holds_its_schedules_bytes(model, dtype):
  caches = registry.build_caches(model, B, 4096, dtype, {"kind": "pyramidkv", "budget": 16})
  budgets = pyramid.layer_budgets(4, 16, protected=8, minimum=1)  # snapkv: window 16 // 2
  assert tuple(c.budget for c in caches) == budgets and budgets[0] > budgets[-1]
  per_token = memory.gqa_bytes_per_token(K, H, dtype)
  for cache, budget in zip(caches, budgets):
    assert sum(a.nbytes for a in cache.storage_arrays()) == B * budget * per_token
  uniform = registry.build_caches(model, B, 4096, dtype, {"kind": "snapkv", "budget": 16})
  held = lambda cs: sum(a.nbytes for c in cs for a in c.storage_arrays())
  assert held(caches) == held(uniform)  # the same total as the uniform budget
  half = registry.build_caches(model, B, 4096, dtype,
                               {"kind": "pyramidkv", "budget": 16, "ratio": 0.5})
  assert held(half) == held(uniform) // 2


def _snapkv_reference(q, k, budget, window, kernel):
  """SnapKV's kept tokens after one prefill chunk of T tokens, per sequence and KV head (numpy):
  the probability mass of the last `window` queries summed over the G query heads, averaged
  over `kernel` neighbours (zero padding), the window itself always kept."""
  batch, num_tokens = q.shape[:2]
  g = N // K
  logits = np.einsum("btkgh,bskh->bkgts", q.reshape(batch, num_tokens, K, g, H), k) / np.sqrt(H)
  causal = np.arange(num_tokens)[None, :] <= np.arange(num_tokens)[:, None]
  logits = np.where(causal, logits, -np.inf)
  probs = np.exp(logits - logits.max(-1, keepdims=True))
  probs /= probs.sum(-1, keepdims=True)
  mass = probs[:, :, :, num_tokens - window:].sum(axis=(2, 3))  # [B, K, T]
  left = kernel // 2
  padded = np.pad(mass, [(0, 0), (0, 0), (left, kernel - 1 - left)])
  pooled = np.stack([padded[..., i:i + num_tokens] for i in range(kernel)]).sum(0) / kernel
  priority = np.where(np.arange(num_tokens) >= num_tokens - window, np.inf, pooled)
  return np.sort(np.argsort(-priority, axis=-1, kind="stable")[..., :budget], axis=-1)


@jax.jit
def _prefill_step(cache, q, k, v, pos):
  return cache.update_attend(q, k, v, positions=pos, rope_theta=THETA)


@functools.partial(jax.jit, static_argnums=0)
def _forward(graphdef, state, caches, tokens, lengths):
  return nnx.merge(graphdef, state)(tokens, caches, new_lengths=lengths)


def test_every_layer_keeps_snapkvs_selection_at_its_own_budget_and_attends_it():
  budgets = pyramid.layer_budgets(4, 12, protected=4, minimum=1, beta=4)
  assert len(set(budgets)) > 1
  num_tokens = 20
  rng = np.random.default_rng(3)
  q, k, v = (jnp.asarray(rng.normal(size=s), jnp.float32) for s in
             [(B, num_tokens, N, H), (B, num_tokens, K, H), (B, num_tokens, K, H)])
  pos = jnp.broadcast_to(jnp.arange(num_tokens, dtype=jnp.int32), (B, num_tokens))
  qr, kr = (np.asarray(ops.apply_rope(x, pos, rope_theta=THETA)) for x in (q, k))
  for budget in (budgets[0], budgets[-1]):  # the bottom and the top layer
    cache = EvictingKVCache.init(B, budget, K, H, policy="snapkv", window_size=4, kernel_size=3)
    _, cache = _prefill_step(cache, q, k, v, pos)
    kept = np.asarray(cache.slot_positions())
    want = _snapkv_reference(qr, kr, budget, 4, 3)
    np.testing.assert_array_equal(kept, want)
    # A query at token 20 attends exactly the kept tokens (dense softmax over them).
    query = rng.normal(size=(B, 1, N, H)).astype(np.float32)
    got = jax.jit(lambda c, x: c.attend(x, q_offsets=jnp.full((B,), num_tokens, jnp.int32)))(
        cache, jnp.asarray(query))
    ref = np.zeros((B, N, H), np.float32)
    for b in range(B):
      for n in range(N):
        idx = want[b, n // (N // K)]
        logits = kr[b, idx, n // (N // K)] @ query[b, 0, n] / np.sqrt(H)
        p = np.exp(logits - logits.max())
        ref[b, n] = (p / p.sum()) @ np.asarray(v)[b, idx, n // (N // K)]
    np.testing.assert_allclose(np.asarray(got)[:, 0], ref, atol=1e-5)


def test_a_prompt_at_the_top_budget_evicts_nothing_and_one_more_evicts_only_there(model):
  spec = {"kind": "pyramidkv", "budget": 8, "window_size": 2}
  budgets = tuple(c.budget for c in registry.build_caches(model, B, 64, None, spec))
  top = budgets[-1]
  assert budgets[0] > top + 1
  rng = np.random.default_rng(0)
  graphdef, state = nnx.split(model)
  prompts = jnp.asarray(rng.integers(1, 256, (B, top + 1), dtype=np.int32))
  dense = model.init_caches(B, 64)
  for length in (0, 1, top - 1, top, top + 1):
    lengths = jnp.array([length, min(length, 1)], jnp.int32)  # row 1: length 0 or 1
    caches = registry.build_caches(model, B, 64, None, spec)
    logits, caches = _forward(graphdef, state, caches, prompts, lengths)
    if length == 0:  # a row of no tokens keeps nothing and its state stays empty
      assert all((np.asarray(c.pos) == -1).all() for c in caches)
      continue
    dense_logits, _ = _forward(graphdef, state, dense, prompts, lengths)
    held = [(np.asarray(c.pos)[0] >= 0).sum(-1) for c in caches]  # row 0, per KV head
    for budget, count in zip(budgets, held):
      np.testing.assert_array_equal(count, min(length, budget))
    if length <= top:  # nothing evicted: the dense cache's logits
      np.testing.assert_allclose(np.asarray(logits)[0, :length],
                                 np.asarray(dense_logits)[0, :length], atol=1e-5)


@pytest.mark.slow  # the builder is EvictingKVCache.init per layer; this runs it through prefill
def test_layers_equal_evicting_caches_built_alone_at_their_budgets(model):
  spec = {"kind": "pyramidkv", "budget": 6, "beta": 3}
  caches = registry.build_caches(model, B, 32, None, spec)
  alone = tuple(EvictingKVCache.init(B, c.budget, K, H, policy="snapkv", **dict(c.options))
                for c in caches)
  prompts = np.random.default_rng(1).integers(1, 256, (B, 15), dtype=np.int32)
  lengths = np.array([15, 9], np.int32)
  first, caches, _ = prefill(model, prompts, lengths, caches)
  first_alone, alone, _ = prefill(model, prompts, lengths, alone)
  np.testing.assert_array_equal(np.asarray(first), np.asarray(first_alone))
  for a, b in zip(caches, alone):
    np.testing.assert_array_equal(np.asarray(a.pos), np.asarray(b.pos))


@pytest.mark.slow  # compiles the batcher (tests/kvattn/inference/test_batching_rows.py's setup)
def test_the_batcher_gives_each_sequence_its_tokens_alone():
  from tests.kvattn.inference import test_batching_rows as rows  # pylint: disable=g-import-not-at-top
  spec = {"kind": "pyramidkv", "budget": 6}
  rows.serve_each_alone(spec)


def _kvpress_layer_budget(num_layers, layer, n, ratio, window, beta):
  """kvpress 0.5.5's PyramidKVPress.get_layer_budget, transcribed line by line."""
  max_capacity_prompt = window + n * (1 - ratio)
  min_num = (max_capacity_prompt - window) / beta
  max_num = (max_capacity_prompt - window) * 2 - min_num
  if max_num >= n - window:
    max_num = n - window
    min_num = (max_capacity_prompt - window) * 2 - max_num
  if not n >= max_num >= min_num >= window:
    return max(1, round(n * (1 - ratio)))
  steps = (max_num - min_num) / (num_layers - 1) if num_layers > 1 else 0.0
  return round(max_num - layer * steps)


@pytest.mark.parametrize("num_layers", [1, 2, 30])
@pytest.mark.parametrize("n", [100, 953, 4096])
@pytest.mark.parametrize("ratio", [0.0, 0.25, 0.5, 0.75, 0.9])
@pytest.mark.parametrize("beta", [1, 20])
def test_context_schedule_equals_kvpress(num_layers, n, ratio, beta):
  got = pyramid.context_layer_budgets(num_layers, n, ratio, window_size=64, beta=beta)
  want = tuple(_kvpress_layer_budget(num_layers, l, n, ratio, 64, beta)
               for l in range(num_layers))
  assert got == want


def test_context_schedule_on_smollm2s_context():
  # SmolLM2's 953-token context at 0.5: the bottom layer keeps all but the window, the top the
  # window; at 0.75 the top would fall below the window and every layer keeps 238 (SnapKV).
  assert pyramid.context_layer_budgets(30, 953, 0.5, window_size=64)[::29] == (889, 64)
  assert set(pyramid.context_layer_budgets(30, 953, 0.75, window_size=64)) == {238}


def test_context_mode_options_are_checked(model):
  build = lambda **o: registry.build_caches(model, B, 32, None, {"kind": "pyramidkv", **o})
  with pytest.raises(ValueError, match="cache.context_tokens must be set"):
    build(compress="context", compression_ratio=0.5)
  with pytest.raises(ValueError, match="cache.budget is for compress='fixed'"):
    build(compress="context", compression_ratio=0.5, context_tokens=20, budget=8)
  with pytest.raises(ValueError, match="cache.compression_ratio needs compress='context'"):
    build(budget=8, compression_ratio=0.5)
  with pytest.raises(ValueError, match="compression_ratio must be a float in"):
    pyramid.context_layer_budgets(4, 20, 1.0, window_size=2)


_CONTEXT_SPEC = {"kind": "pyramidkv", "compress": "context", "compression_ratio": 0.25,
                 "context_tokens": 20, "window_size": 2, "kernel_size": 3, "beta": 3}
_CONTEXT_KEPT = (18, 16, 14, 12)  # 4 layers, a 20-token context at 0.25, window 2, beta 3


def test_context_mode_sizes_each_layer_by_its_count(model):
  # The slots are the bottom layer's count plus the rest of the longest row; a layer's storage
  # is as much smaller as its count, so the bytes follow the schedule.
  assert pyramid.context_layer_budgets(4, 20, 0.25, window_size=2, beta=3) == _CONTEXT_KEPT
  slots = registry.slots_needed(_CONTEXT_SPEC, np.array([20, 20]), np.array([26, 23]))
  assert slots == 18 + 6
  caches = registry.build_caches(model, B, slots, None, _CONTEXT_SPEC)
  assert tuple(c.capacity for c in caches) == tuple(b + 6 for b in _CONTEXT_KEPT)
  small = registry.build_caches(model, B, 1, None, _CONTEXT_SPEC)  # as factories validate
  assert {(c.capacity, c.context_budget) for c in small} == {(1, 1)}
  per_token = memory.gqa_bytes_per_token(K, H, jnp.float32)
  assert sum(a.nbytes for c in caches for a in c.storage_arrays()) == \
      B * sum(b + 6 for b in _CONTEXT_KEPT) * per_token


@pytest.mark.slow  # a prefill through the model (the counts are checked without one above)
def test_context_mode_layers_equal_evicting_caches_alone_at_their_counts(model):
  kept = _CONTEXT_KEPT
  caches = registry.build_caches(model, B, 24, None, _CONTEXT_SPEC)
  alone = tuple(EvictingKVCache.init(B, b, K, H, policy="snapkv", compress="context",
                                     capacity=b + 6, window_size=2, kernel_size=3)
                for b in kept)
  prompts = np.random.default_rng(2).integers(1, 256, (B, 20), dtype=np.int32)
  lengths = np.array([20, 20], np.int32)
  first, caches, _ = prefill(model, prompts, lengths, caches)
  first_alone, alone, _ = prefill(model, prompts, lengths, alone)
  np.testing.assert_array_equal(np.asarray(first), np.asarray(first_alone))
  for b, a, c in zip(kept, alone, caches):
    np.testing.assert_array_equal(np.asarray(c.pos), np.asarray(a.pos))
    np.testing.assert_array_equal((np.asarray(c.pos) >= 0).sum(-1), b)  # each KV head
