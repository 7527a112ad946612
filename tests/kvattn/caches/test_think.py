"""ThinK (kvattn.caches.think): the channel criterion and every step's attention against numpy,
the edges, and the bytes of pruned keys."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvattn import memory, ops
from kvattn.caches import think
from kvattn.caches.think import ThinKCache

B, K, N, H = 2, 2, 4, 8
G = N // K
THETA = 10000.0


def _channels_reference(q, k, n, window, keep):
  """One sequence: `|Q_obs[:, c]| * |K[:, c]|` per KV head over its G heads' last `window` of
  the `n` real queries and the `n` real keys; the top `keep`, sorted (ties: lower channel)."""
  obs = q[max(0, n - window):n]  # [w, N, H]
  out = []
  for h in range(K):
    score = np.linalg.norm(obs[:, h * G:(h + 1) * G].reshape(-1, H), axis=0) * np.linalg.norm(
        k[:n, h], axis=0)
    out.append(np.sort(np.argsort(-score, kind="stable")[:keep]))
  return np.array(out)


class Reference:
  """ThinK in numpy, one sequence: keys stored at the channels chosen on its first chunk; a
  chunk attends the stored keys through its queries' channels and its own keys whole."""

  def __init__(self, keep, window):
    self.keep, self.window = keep, window
    self.keys, self.values, self.channels = [], [], None

  def step(self, q, k, v, n):
    if n and self.channels is None:
      self.channels = _channels_reference(q, k, n, self.window, self.keep)
    start = len(self.keys)
    out = np.zeros((n, N, H))
    for t in range(n):
      for head in range(N):
        h = head // G
        logits = [q[t, head, self.channels[h]] @ key[h] for key in self.keys]
        logits += [q[t, head] @ k[u, h] for u in range(t + 1)]
        logits = np.array(logits) / np.sqrt(H)
        w = np.exp(logits - logits.max())
        vals = np.array([val[h] for val in self.values] + [v[u, h] for u in range(t + 1)])
        out[t, head] = (w / w.sum()) @ vals
    for u in range(n):
      self.keys.append(np.stack([k[u, h, self.channels[h]] for h in range(K)]))
      self.values.append(v[u])
    del start
    return out


_select = jax.jit(lambda q, k, n: think.select_channels(think.channel_scores(q, k, n, 4), 3))
_rope = jax.jit(lambda x, pos: ops.apply_rope(x, pos, rope_theta=THETA))


@jax.jit
def _step(cache, q, k, v, new_lengths):
  pos = cache.lengths[:, None] + jnp.arange(q.shape[1], dtype=jnp.int32)[None]
  return cache.update_attend(q, k, v, positions=pos, rope_theta=THETA, new_lengths=new_lengths)


@pytest.mark.parametrize("keep,window", [(3, 2), pytest.param(1, 1, marks=pytest.mark.slow),
                                         pytest.param(8, 4, marks=pytest.mark.slow)])
def test_every_step_equals_the_numpy_reference(keep, window):
  max_len = 20
  cache = ThinKCache.init(B, max_len, K, H, keep_channels=keep, window_size=window)
  refs = [Reference(keep, window) for _ in range(B)]
  rng = np.random.default_rng(keep)
  # row 1 starts at the second step with one token: its channels come from that one query
  for num_tokens, new in [(9, [9, 0]), (1, [1, 1]), (4, [4, 3]), (1, [1, 0]), (1, [1, 1])]:
    q, k, v = (rng.normal(size=s).astype(np.float32) for s in
               [(B, num_tokens, N, H), (B, num_tokens, K, H), (B, num_tokens, K, H)])
    pos = jnp.asarray(np.asarray(cache.lengths)[:, None] + np.arange(num_tokens)[None], jnp.int32)
    qr, kr = np.asarray(_rope(q, pos)), np.asarray(_rope(k, pos))
    out, cache = _step(cache, q, k, v, jnp.asarray(new, jnp.int32))
    for b in range(B):
      want = refs[b].step(qr[b], kr[b], v[b], new[b])
      np.testing.assert_allclose(np.asarray(out)[b, :new[b]], want, atol=1e-5)
      if refs[b].channels is not None:
        np.testing.assert_array_equal(np.asarray(cache.channels)[b], refs[b].channels)
        n = len(refs[b].keys)
        np.testing.assert_allclose(np.asarray(cache.k)[b, :, :n],
                                   np.stack(refs[b].keys, axis=1), atol=1e-6)


@pytest.mark.parametrize("num_tokens,new", [(1, [1, 1]), (6, [6, 2]), (6, [3, 6])])
def test_channel_scores_equal_the_papers_criterion(num_tokens, new):
  rng = np.random.default_rng(num_tokens)
  q = rng.normal(size=(B, num_tokens, N, H)).astype(np.float32)
  k = rng.normal(size=(B, num_tokens, K, H)).astype(np.float32)
  got = _select(q, k, jnp.asarray(new))
  for b in range(B):
    np.testing.assert_array_equal(np.asarray(got)[b], _channels_reference(q[b], k[b], new[b], 4, 3))


def test_all_channels_kept_is_exact_and_garbage_and_empty_rows_change_nothing():
  rng = np.random.default_rng(7)
  q, k, v = (rng.normal(size=s).astype(np.float32) for s in
             [(B, 6, N, H), (B, 6, K, H), (B, 6, K, H)])
  new = jnp.array([6, 0], jnp.int32)
  _, cache = _step(ThinKCache.init(B, 10, K, H, keep_channels=H), q, k, v, new)
  np.testing.assert_array_equal(np.asarray(cache.channels)[0], np.tile(np.arange(H), (K, 1)))
  step = [x[:, :1] for x in (q, k, v)]
  one = jnp.ones(B, jnp.int32)
  out, _ = _step(cache, *step, one)
  pos = jnp.full((B, 1), 6, jnp.int32)
  keys = jnp.concatenate([_rope(k[:, :6], jnp.broadcast_to(jnp.arange(6), (B, 6))),
                          _rope(step[1], pos)], axis=1)
  dense = jax.jit(lambda q, k, v: ops.attention(q, k, v, q_offsets=jnp.array([6, 6], jnp.int32)))(
      _rope(step[0], pos), jnp.swapaxes(keys, 1, 2),
      jnp.swapaxes(jnp.concatenate([v[:, :6], step[2]], axis=1), 1, 2))
  np.testing.assert_allclose(np.asarray(out)[0], np.asarray(dense)[0], atol=1e-5)
  slots = jnp.arange(10)[None, None, :, None] >= cache.lengths[:, None, None, None]
  dirty = cache.replace(k=jnp.where(slots, jnp.nan, cache.k), v=jnp.where(slots, jnp.nan, cache.v))
  got, _ = _step(dirty, *step, one)
  want, _ = _step(cache, *step, one)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  empty = jax.jit(lambda c, x: c.attend(x, q_offsets=jnp.zeros((B,), jnp.int32)))(cache, q[:, :1])
  np.testing.assert_array_equal(np.asarray(empty)[1], 0.0)  # row 1 holds nothing: zeros


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.int8])
def test_keys_really_hold_keep_channels(dtype):
  cache = ThinKCache.init(B, 64, K, H, dtype, keep_channels=2)
  assert cache.k.shape == (B, K, 64, 2) and cache.v.shape == (B, K, 64, H)
  scales = 2 * 4 if dtype == jnp.int8 else 0
  per_token = K * ((2 + H) * jnp.dtype(dtype).itemsize + scales)
  assert cache.analytic_bytes_per_token() == per_token
  assert memory.measured_bytes_per_token(cache) == per_token
  assert per_token < memory.gqa_bytes_per_token(K, H, dtype)


def test_bad_options_and_overflow_raise_naming_them():
  for options, name in [({"keep_channels": 0}, "keep_channels"),
                        ({"keep_channels": H + 1}, "keep_channels"),
                        ({"keep_channels": 2, "window_size": 0}, "window_size")]:
    with pytest.raises(ValueError, match=name):
      ThinKCache.init(B, 8, K, H, **options)
  cache = ThinKCache.init(1, 4, K, H, keep_channels=2)
  x = jnp.zeros((1, 5, K, H))
  with pytest.raises(ValueError, match="overflow"):
    cache.update(x, x)


@pytest.mark.slow  # compiles the batcher (tests/kvattn/inference/test_batching_rows.py's setup)
def test_the_batcher_gives_each_sequence_its_tokens_alone():
  from tests.kvattn.inference import test_batching_rows as rows  # pylint: disable=g-import-not-at-top
  spec = {"kind": "think", "keep_channels": 3}
  rows.serve_each_alone(spec)
