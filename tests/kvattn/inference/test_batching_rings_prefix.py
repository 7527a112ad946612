"""The batcher's prefix cache and offload with the per-layer layout (`local_layers="ring"`):
a hit restores each local layer's ring from the snapshot kept with the cached prefix
(`kvattn.inference.batching.RingSnapshots`), so tokens equal `generate`'s and the batcher's
without the prefix cache, while the hits really happen (cached tokens counted).

A small random Gemma-3-like model: local, local, global (window 4), so the second ring's
keys depend on what the first ring's attention saw.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx

import kvattn
from kvattn.models import transformer
from kvattn.paging.offload import HostTier, TieredStore

V, W = 61, 4
LOCAL = {"window": W, "rope_theta": 10000.0}
GLOBAL = {"rope_theta": 1e6}
GEMMA = dict(vocab_size=V, d_model=32, num_layers=3, mlp_dim=48, mlp_activation="gelu_tanh",
             scale_embeddings=True, post_norms=True,
             attention=dict(num_heads=4, num_kv_heads=1, head_dim=16, qk_norm=True),
             layers=(LOCAL, LOCAL, GLOBAL))
NEW = 5
OPTS = dict(num_slots=2, num_pages=24, max_len=20, max_prompt_len=16)


def _model(**overrides):
  return kvattn.Transformer.from_config(transformer.model_config(**{**GEMMA, **overrides}),
                                        rngs=nnx.Rngs(0))


def _prompt(*parts):
  return np.concatenate([np.asarray(p, np.int32) for p in parts])


SYSTEM = np.random.default_rng(0).integers(0, V, 9).astype(np.int32)


def _generate(model, prompts):
  """Greedy tokens of each prompt alone (dense caches, the full layout)."""
  lengths = np.asarray([len(p) for p in prompts], np.int32)
  padded = np.zeros((len(prompts), lengths.max()), np.int32)
  for b, p in enumerate(prompts):
    padded[b, :len(p)] = p
  out, _ = kvattn.generate(model, padded, lengths, NEW)
  return [np.asarray(o).tolist() for o in out]


def _ring_window(batcher, slot, layer, n):
  """`{token: (k, v)}` of the last W tokens before `n` in slot `slot`'s ring of `layer`."""
  ring = batcher.caches[layer]
  pos = np.asarray(ring.pos[slot])
  out = {}
  for s, p in enumerate(pos):
    if n - W <= p < n:
      out[int(p)] = (np.asarray(ring.k[slot, :, s]), np.asarray(ring.v[slot, :, s]))
  return out


def test_prefix_hits_with_rings_restore_the_windows_exactly_through_the_offload_tier():
  # page_size 2, window 4: hits of 8 tokens (longer than the window), of 2 (shorter), and a
  # second turn hitting the whole first conversation (the retirement's snapshot); the last
  # two come back from the host tier (pages and snapshots).
  model = _model()
  store = TieredStore([HostTier(10**7)])
  batcher = kvattn.ContinuousBatcher(model, page_size=2, local_layers="ring",
                                     prefix_cache=True, offload=store, max_ring_snapshots=16,
                                     **OPTS)
  assert [type(c).__name__ for c in batcher.caches] == ["RingKVCache"] * 2 + ["PagedKVCache"]
  assert batcher.caches[0].capacity == W + 1  # W + page_size - 1
  alloc = batcher.allocator
  got, cached, prompts = {}, {}, {}

  def serve(rid, prompt):
    prompts[rid] = prompt
    before = alloc.counters["cached_tokens"]
    got.update(batcher.run([(rid, prompt, NEW)]))
    cached[rid] = alloc.counters["cached_tokens"] - before

  serve("a", _prompt(SYSTEM, [5, 6]))        # miss; snapshots at 10 (prompt), 14 (retired)
  serve("b", _prompt(SYSTEM, [7, 8, 9]))     # shares 8 cached tokens without a snapshot: miss,
  serve("c", _prompt(SYSTEM, [3]))           # ... split there, so this one hits 8 > W
  serve("d", _prompt(SYSTEM[:2], [40, 41, 42]))  # 2 shared: split at 2
  # Every cold page leaves for the host tier with the snapshot of its block (if any).
  kept = {id(b): b.state for b in alloc._index.values() if b.state is not None}  # pylint: disable=protected-access
  moved = alloc.offload_cached()
  assert moved > 0 and alloc.num_states == 0 and alloc.state_bytes == 0
  page_bytes = 2 * 2 * 1 * 16 * 4  # the global layer's K and V of one page: 2 tokens, f32
  snapshot_bytes = batcher._snapshots.nbytes  # pylint: disable=protected-access
  assert snapshot_bytes == 2 * 2 * W * 16 * 4  # two rings' W keys and values
  assert store.used_bytes()["host"] == moved * page_bytes + len(kept) * snapshot_bytes
  # The same slot (0) served every request; after this join (a hit of 2 < W from the tier)
  # its rings must hold exactly the windows a fresh prefill gives: checked against a batcher
  # without the prefix cache.
  e = _prompt(SYSTEM[:2], [50, 51])
  prompts["e"] = e
  before = alloc.counters["cached_tokens"]
  slot = batcher.add("e", e, NEW)
  cached["e"] = alloc.counters["cached_tokens"] - before
  assert alloc.counters["pages_reloaded"] == 1
  for block in alloc._index.values():  # pylint: disable=protected-access
    if id(block) in kept and block.state is not None:  # reloaded: bit-exact
      for x, y in zip(jax.tree.leaves(block.state), jax.tree.leaves(kept[id(block)])):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  plain = kvattn.ContinuousBatcher(model, page_size=2, local_layers="ring", **OPTS)
  assert plain.add("e", e, NEW) == slot == 0
  for layer in (0, 1):
    want, have = _ring_window(plain, 0, layer, len(e)), _ring_window(batcher, 0, layer, len(e))
    assert sorted(have) == sorted(want) == list(range(len(e) - W, len(e)))
    for p in want:
      np.testing.assert_allclose(have[p][0], want[p][0], rtol=1e-5, atol=1e-5)
      np.testing.assert_allclose(have[p][1], want[p][1], rtol=1e-5, atol=1e-5)
  while batcher.active:
    for f in batcher.step():
      got[f.request_id] = f
  while plain.active:
    for f in plain.step():
      assert f.tokens.tolist() == got["e"].tokens.tolist()  # the batcher without the cache
  # A second turn: the first conversation (prompt + tokens fed back) and a new message.
  held = list(prompts["a"]) + got["a"].tokens.tolist()[:-1]
  serve("f", _prompt(held, [11]))
  assert cached == {"a": 0, "b": 0, "c": 8, "d": 0, "e": 2, "f": len(held) // 2 * 2}
  assert alloc.counters["pages_reloaded"] == len(held) // 2  # its first page came back with e

  want = _generate(model, [prompts[r] for r in "abcdef"])
  for rid, w in zip("abcdef", want):
    assert got[rid].tokens.tolist() == w, rid
  stats = batcher.stats()
  assert stats["ring_snapshot_bytes"] == stats["ring_snapshots"] * snapshot_bytes > 0
  alloc.check()


@pytest.mark.slow  # the default test above covers pages shorter than the window
def test_prefix_cache_with_rings_page_longer_than_the_window_and_max_snapshots():
  # page_size 8 > W: the ring holds W + 7 slots; one snapshot kept at most.
  model = _model()
  batcher = kvattn.ContinuousBatcher(model, page_size=8, local_layers="ring", prefix_cache=True,
                                     max_ring_snapshots=1, **OPTS)
  assert batcher.caches[0].capacity == W + 7
  reqs = [("a", _prompt(SYSTEM, [1, 2, 3]), NEW), ("b", _prompt(SYSTEM, [4]), NEW),
          ("c", _prompt(SYSTEM, [9, 9]), NEW)]
  got = {}
  for r in reqs:
    got.update(batcher.run([r]))
  # a: snapshots at 8 (prompt) then 16 (retired, dropping the first: max 1); b shares 8
  # tokens without a snapshot: split, snapshot at 8 (dropping 16); c hits 8.
  assert batcher.allocator.counters["cached_tokens"] == 8
  assert batcher.allocator.counters["states_dropped"] == 2
  assert batcher.stats()["ring_snapshots"] == 1
  want = _generate(model, [p for _, p, _ in reqs])
  for (rid, *_), w in zip(reqs, want):
    assert got[rid].tokens.tolist() == w, rid
  batcher.allocator.check()


def test_prefix_cache_with_rings_refuses_a_mesh():
  model = _model()
  mesh = kvattn.sharding.make_mesh((1, 1, 1))
  with pytest.raises(ValueError, match="prefix_cache=True with local_layers='ring' runs on one "
                                       "device: mesh must be None"):
    kvattn.ContinuousBatcher(model, page_size=2, local_layers="ring", prefix_cache=True,
                             mesh=mesh, **OPTS)
  with pytest.raises(ValueError, match="max_ring_snapshots"):
    kvattn.ContinuousBatcher(model, page_size=2, local_layers="ring", prefix_cache=True,
                             max_ring_snapshots=0, **OPTS)


@pytest.mark.slow  # the default test covers f32 rings; this adds scales (int8) and bf16 bits
@pytest.mark.parametrize("dtype", ["int8", "bfloat16"])
def test_quantized_and_bf16_rings_with_prefix_cache_and_offload_equal_the_plain_batcher(dtype):
  model = _model()
  reqs = [("a", _prompt(SYSTEM, [5, 6]), NEW), ("b", _prompt(SYSTEM, [7]), NEW),
          ("c", _prompt(SYSTEM, [3, 4]), NEW)]
  store = TieredStore([HostTier(10**7)])
  batcher = kvattn.ContinuousBatcher(model, page_size=2, local_layers="ring", prefix_cache=True,
                                     offload=store, dtype=dtype, **OPTS)
  assert (batcher.caches[0].k_scale is not None) == (dtype == "int8")
  got = {}
  for r in reqs:
    got.update(batcher.run([r]))
    batcher.allocator.offload_cached()  # every hit comes back from the tier
  assert batcher.allocator.counters["cached_tokens"] == 8  # c hits b's snapshot at 8
  assert batcher.allocator.counters["pages_reloaded"] == 4
  plain = kvattn.ContinuousBatcher(model, page_size=2, local_layers="ring", dtype=dtype, **OPTS)
  want = plain.run(reqs)
  for rid, *_ in reqs:
    assert got[rid].tokens.tolist() == want[rid].tokens.tolist(), rid
  batcher.allocator.check()
