"""AdaKV (kvattn.caches.adakv): every step against a numpy reference of Ada-SnapKV over a ragged
per-head pool (selection, scores and the attention), the edges, and the bytes held."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvattn import memory, ops
from kvattn.caches.adakv import AdaKVCache
from kvattn.caches.eviction import EvictingKVCache

B, K, N, H = 2, 2, 4, 8
G = N // K
THETA = 10000.0


class Reference:
  """Ada-SnapKV in numpy, one sequence: per KV head a list of kept `(pos, key, value, score)`;
  a step attends each head's kept tokens plus the chunk's (dense softmax per query head), scores
  them, and keeps the `K * budget` best across heads (the protected window, sinks and each head's
  top `floor` first)."""

  def __init__(self, budget, window_size, kernel_size, num_sinks, floor):
    self.budget, self.w, self.kernel, self.sinks, self.floor = (budget, window_size,
                                                                kernel_size, num_sinks, floor)
    self.kept = [[] for _ in range(K)]
    self.length = 0

  def step(self, q, k, v, n):
    """`q: [T, N, H]`, `k, v: [T, K, H]` (RoPE'd); the first `n` tokens are real. Returns the
    outputs `[n, N, H]`."""
    start, end = self.length, self.length + n
    out = np.zeros((n, N, H))
    flat = []  # (priority, head, pos, key, value, score) in the cache's flat order
    guarded = []
    for h in range(K):
      cands = list(self.kept[h]) + [(start + t, k[t, h], v[t, h], 0.0) for t in range(n)]
      pos = np.array([c[0] for c in cands], np.int64)
      keys = np.array([c[1] for c in cands]).reshape(-1, H)
      vals = np.array([c[2] for c in cands]).reshape(-1, H)
      mass = np.zeros(len(cands))
      for t in range(n):
        for n_ in range(h * G, (h + 1) * G):
          logits = np.where(pos <= start + t, keys @ q[t, n_] / np.sqrt(H), -np.inf)
          p = np.exp(logits - logits.max())
          p /= p.sum()
          out[t, n_] = p @ vals
          if t >= n - self.w:
            mass += p
      order = np.argsort(pos, kind="stable")
      left = self.kernel // 2
      padded = np.pad(mass[order], (left, self.kernel - 1 - left))
      pooled = np.zeros(len(cands))
      pooled[order] = np.convolve(padded, np.ones(self.kernel), "valid") / self.kernel
      score = np.array([c[3] for c in cands]) + pooled
      protect = (pos < self.sinks) | (pos > end - 1 - self.w)
      priority = np.where(protect, np.inf, score)
      top = np.argsort(-priority, kind="stable")[:self.floor]
      priority[top] = np.inf
      rows = [(priority[i], h, pos[i], keys[i], vals[i], score[i]) for i in range(len(cands))]
      flat.append(rows[:len(self.kept[h])])
      guarded.append(rows[len(self.kept[h]):])
    cands = [r for rows in flat for r in rows] + [r for rows in guarded for r in rows]
    best = np.argsort(-np.array([c[0] for c in cands]), kind="stable")[:K * self.budget]
    if n:
      self.kept = [sorted([(cands[i][2], cands[i][3], cands[i][4], cands[i][5]) for i in best
                           if cands[i][1] == h], key=lambda c: c[0]) for h in range(K)]
      self.length = end
    return out

  def held(self):
    return [[int(c[0]) for c in head] for head in self.kept]


def _held(cache, b):
  pos, head = np.asarray(cache.pos)[b], np.asarray(cache.head)[b]
  return [pos[(head == h) & (pos >= 0)].tolist() for h in range(K)]


def _step(cache, q, k, v, new_lengths):
  pos = cache.lengths[:, None] + jnp.arange(q.shape[1], dtype=jnp.int32)[None]
  return cache.update_attend(q, k, v, positions=pos, rope_theta=THETA, new_lengths=new_lengths)


_jit_step = jax.jit(_step)
_rope = jax.jit(lambda x, pos: ops.apply_rope(x, pos, rope_theta=THETA))

SCHEDULE = [(9, [9, 6]), (1, [1, 1]), (1, [1, 0]), (4, [4, 2]), (1, [1, 1]), (3, [0, 3])]
"""(chunk T, new_lengths per row): a prefill, decode steps, a ragged chunk, a row writing
nothing."""


@pytest.mark.parametrize("budget,w,kernel,sinks,alpha", [
    (4, 2, 3, 1, 0.5),
    *[pytest.param(*c, marks=pytest.mark.slow) for c in
      [(4, 2, 3, 0, 0.2), (3, 1, 1, 1, 0.0), (6, 2, 5, 1, 0.5), (1, 1, 1, 0, 1.0)]]])
def test_every_step_equals_the_numpy_reference(budget, w, kernel, sinks, alpha):
  cache = AdaKVCache.init(B, budget, K, H, window_size=w, kernel_size=kernel, num_sinks=sinks,
                          alpha=alpha)
  refs = [Reference(budget, w, kernel, sinks, int(alpha * budget)) for _ in range(B)]
  rng = np.random.default_rng(budget)
  for num_tokens, new in SCHEDULE:
    q, k, v = (rng.normal(size=s).astype(np.float32) for s in
               [(B, num_tokens, N, H), (B, num_tokens, K, H), (B, num_tokens, K, H)])
    pos = np.asarray(cache.lengths)[:, None] + np.arange(num_tokens)[None]
    qr, kr = (np.asarray(_rope(x, jnp.asarray(pos, jnp.int32))) for x in (q, k))
    out, cache = _jit_step(cache, q, k, v, jnp.asarray(new, jnp.int32))
    cache.check_state()
    for b in range(B):
      want = refs[b].step(qr[b], kr[b], v[b], new[b])
      np.testing.assert_allclose(np.asarray(out)[b, :new[b]], want, atol=1e-5)
      assert _held(cache, b) == refs[b].held()
      np.testing.assert_array_equal(
          np.asarray(cache.head_counts())[b], [len(h) for h in refs[b].held()])
      assert sum(len(h) for h in refs[b].held()) == K * min(int(cache.lengths[b]), budget)


def _concentrated_case():
  """KV head 0's queries all point at one key; head 1's attention is flat: AdaKV gives head 1
  the slots head 0 does not need."""
  num_tokens = 12
  rng = np.random.default_rng(0)
  k = rng.normal(size=(1, num_tokens, K, H)).astype(np.float32) * 0.01
  q = np.zeros((1, num_tokens, N, H), np.float32)
  k[0, 3, 0] = 0.0
  k[0, 3, 0, 0] = 1.0
  q[:, :, :G, 0] = 40.0  # head 0's group: all mass on token 3 (key channel 0)
  v = rng.normal(size=(1, num_tokens, K, H)).astype(np.float32)
  return q, k, v


def test_heads_get_different_counts_and_the_floor_holds():
  q, k, v = _concentrated_case()
  for alpha, floor in ((0.5, 2),):  # alpha 0: the same without the floor (its count is 2)
    cache = AdaKVCache.init(1, 4, K, H, window_size=1, kernel_size=1, alpha=alpha,
                            num_sinks=0)
    # No RoPE rotation at position 0 matters here: all tokens share position-independent keys
    # up to RoPE, so score with positions 0 (RoPE of position 0 is the identity).
    _, cache = jax.jit(lambda c: c.update_attend(
        q, k, v, positions=jnp.zeros((1, 12), jnp.int32), rope_theta=THETA))(cache)
    counts = np.asarray(cache.head_counts())[0]
    assert counts.sum() == K * 4
    assert counts[1] > counts[0] >= max(floor, 2)  # token 3 and the window token 11
    assert 3 in _held(cache, 0)[0]


@pytest.mark.slow  # the conformance suite runs adakv's garbage and ragged-row checks fast
def test_garbage_in_unused_slots_changes_nothing_and_rows_equal_rows_alone():
  rng = np.random.default_rng(5)
  q, k, v = (rng.normal(size=s).astype(np.float32) for s in
             [(B, 7, N, H), (B, 7, K, H), (B, 7, K, H)])
  new = jnp.array([7, 3], jnp.int32)
  clean = AdaKVCache.init(B, 5, K, H, window_size=2)
  out, clean = _jit_step(clean, q, k, v, new)
  empty = clean.pos < 0
  dirty = clean.replace(k=jnp.where(empty[..., None], jnp.nan, clean.k),
                        v=jnp.where(empty[..., None], jnp.nan, clean.v),
                        scores=jnp.where(empty, jnp.nan, clean.scores))
  assert bool(empty[1].any())
  qd, kd, vd = (rng.normal(size=s).astype(np.float32) for s in
                [(B, 1, N, H), (B, 1, K, H), (B, 1, K, H)])
  ones = jnp.ones(B, jnp.int32)
  out_clean, after_clean = _jit_step(clean, qd, kd, vd, ones)
  out_dirty, after_dirty = _jit_step(dirty, qd, kd, vd, ones)
  np.testing.assert_array_equal(np.asarray(out_dirty), np.asarray(out_clean))
  np.testing.assert_array_equal(np.asarray(after_dirty.pos), np.asarray(after_clean.pos))
  # Row 1 alone (batch 1) equals row 1 of the ragged batch.
  alone = AdaKVCache.init(1, 5, K, H, window_size=2)
  out_alone, alone = _jit_step(alone, q[1:, :3], k[1:, :3], v[1:, :3], jnp.array([3], jnp.int32))
  np.testing.assert_allclose(np.asarray(out_alone)[0], np.asarray(out)[1, :3], atol=1e-6)
  np.testing.assert_array_equal(np.asarray(alone.pos)[0], np.asarray(clean.pos)[1])


def test_an_empty_row_attends_to_zeros():
  cache = AdaKVCache.init(B, 3, K, H)
  q = jnp.ones((B, 1, N, H), jnp.float32)
  out = jax.jit(lambda c: c.attend(q, q_offsets=jnp.zeros((B,), jnp.int32)))(cache)
  np.testing.assert_array_equal(np.asarray(out), 0.0)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.int8])
def test_the_pool_holds_budget_tokens_of_every_head_and_no_more(dtype):
  budget = 6
  cache = AdaKVCache.init(B, budget, K, H, dtype)
  per_token = memory.gqa_bytes_per_token(K, H, dtype)
  assert cache.k.shape == (B, K * budget, H) and cache.storage_slots == B * budget
  assert sum(a.nbytes for a in cache.storage_arrays()) == B * budget * per_token
  assert memory.measured_bytes_per_token(cache) == per_token
  same = EvictingKVCache.init(B, budget, K, H, dtype, policy="snapkv")
  assert sum(a.nbytes for a in same.storage_arrays()) == sum(
      a.nbytes for a in cache.storage_arrays())


def test_bad_options_raise_value_errors_naming_them():
  for options, name in [({"alpha": 1.5}, "alpha"), ({"alpha": -0.1}, "alpha"),
                        ({"window_size": 0}, "window_size"), ({"kernel_size": 0}, "kernel_size"),
                        ({"num_sinks": -1}, "num_sinks"), ({"window_size": 5}, "window_size"),
                        ({"num_sinks": 4}, "budget")]:
    with pytest.raises(ValueError, match=name):
      AdaKVCache.init(B, 4, K, H, **options)
  with pytest.raises(ValueError, match="budget"):
    AdaKVCache.init(B, 0, K, H)
  with pytest.raises(TypeError, match="dtype"):
    AdaKVCache.init(B, 4, K, H, jnp.int32)


@pytest.mark.slow  # compiles the batcher (tests/kvattn/inference/test_batching_rows.py's setup)
def test_the_batcher_gives_each_sequence_its_tokens_alone():
  from tests.kvattn.inference import test_batching_rows as rows  # pylint: disable=g-import-not-at-top
  spec = {"kind": "adakv", "budget": 6}
  rows.serve_each_alone(spec)
