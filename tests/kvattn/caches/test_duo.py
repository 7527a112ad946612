"""DuoAttention-style head split (kvattn.caches.duo): each head's attention against numpy over the
whole history (full causal for retrieval heads, sinks + window for streaming ones), the
calibration's loss and selection against numpy, the edges, and the bytes per streaming share."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kvattn import memory, ops
from kvattn.caches import duo, registry
from kvattn.caches.duo import DuoKVCache
from kvattn.models import transformer

B, K, N, H = 2, 3, 6, 8
G = N // K
THETA = 10000.0


def _reference(q, k, v, streaming, num_sinks, window):
  """Outputs `[T, N, H]` of one sequence's queries (token t at t, RoPE'd inputs): head n of a
  retrieval KV head attends tokens `<= t`, of a streaming one tokens `< num_sinks` or in
  `(t - window, t]`."""
  num_tokens = q.shape[0]
  out = np.zeros((num_tokens, N, H))
  p = np.arange(num_tokens)
  for t in range(num_tokens):
    for n in range(N):
      h = n // G
      seen = p <= t
      if streaming[h]:
        seen &= (p < num_sinks) | (p > t - window)
      logits = np.where(seen, k[:, h] @ q[t, n] / np.sqrt(H), -np.inf)
      w = np.exp(logits - logits.max())
      out[t, n] = (w / w.sum()) @ v[:, h]
  return out


@functools.partial(jax.jit, static_argnums=5)
def _step(cache, q, k, v, new_lengths, _unused=None):
  pos = cache.lengths[:, None] + jnp.arange(q.shape[1], dtype=jnp.int32)[None]
  return cache.update_attend(q, k, v, positions=pos, rope_theta=THETA, new_lengths=new_lengths)


_rope = jax.jit(lambda x, pos: ops.apply_rope(x, pos, rope_theta=THETA))


@pytest.mark.parametrize("streaming,num_sinks,window", [
    ((False, True, True), 2, 3),
    pytest.param((True, True, True), 0, 1, marks=pytest.mark.slow),
    pytest.param((False, False, False), 1, 2, marks=pytest.mark.slow),
    pytest.param((True, False, True), 1, 40, marks=pytest.mark.slow)])  # the ring never wraps
def test_every_head_attends_what_duoattention_gives_it(streaming, num_sinks, window):
  max_len = 24
  cache = DuoKVCache.init(B, max_len, streaming, H, num_sinks=num_sinks, window=window)
  rng = np.random.default_rng(0)
  total = rng.normal(size=(3, B, max_len, N, H)).astype(np.float32)
  q_all, k_all, v_all = total[0], total[1][:, :, :K], total[2][:, :, :K]
  pos = jnp.broadcast_to(jnp.arange(max_len, dtype=jnp.int32), (B, max_len))
  qr, kr = np.asarray(_rope(q_all, pos)), np.asarray(_rope(k_all, pos))
  want = [_reference(qr[b], kr[b], v_all[b], streaming, num_sinks, window) for b in range(B)]
  written = np.zeros(B, int)
  # a prefill wrapping the ring inside itself, decode steps, a ragged chunk, a row writing nothing
  for num_tokens, new in [(9, [9, 5]), (1, [1, 1]), (1, [1, 0]), (6, [6, 2]), (1, [1, 1]),
                          (6, [0, 5])]:
    take = lambda x: np.stack([np.pad(x[b, written[b]:written[b] + num_tokens],
                                      [(0, max(0, written[b] + num_tokens - max_len))] +
                                      [(0, 0)] * (x.ndim - 2)) for b in range(B)])
    out, cache = _step(cache, take(q_all), take(k_all), take(v_all), jnp.asarray(new, jnp.int32))
    cache.check_state()
    for b in range(B):
      np.testing.assert_allclose(np.asarray(out)[b, :new[b]],
                                 want[b][written[b]:written[b] + new[b]], atol=1e-5)
    written += new
  np.testing.assert_array_equal(np.asarray(cache.lengths), written)


def test_garbage_in_unused_slots_and_an_empty_row():
  cache = DuoKVCache.init(B, 12, (False, True, True), H, num_sinks=1, window=2)
  rng = np.random.default_rng(1)
  q, k, v = (rng.normal(size=s).astype(np.float32) for s in
             [(B, 5, N, H), (B, 5, K, H), (B, 5, K, H)])
  out, clean = _step(cache, q, k, v, jnp.array([5, 0], jnp.int32))
  np.testing.assert_array_equal(np.asarray(clean.pos)[1], -1)  # row 1 wrote nothing
  nan = lambda x: jnp.full_like(x, jnp.nan)
  full_empty = jnp.arange(12)[None, None, :, None] >= clean.lengths[:, None, None, None]
  ring_empty = (clean.pos < 0)[:, None, :, None]
  dirty = clean.replace(k_full=jnp.where(full_empty, nan(clean.k_full), clean.k_full),
                        v_full=jnp.where(full_empty, nan(clean.v_full), clean.v_full),
                        k_ring=jnp.where(ring_empty, nan(clean.k_ring), clean.k_ring),
                        v_ring=jnp.where(ring_empty, nan(clean.v_ring), clean.v_ring))
  step = [x[:, :1] for x in (q, k, v)]
  got, _ = _step(dirty, *step, jnp.array([1, 0], jnp.int32))
  want, _ = _step(clean, *step, jnp.array([1, 0], jnp.int32))
  np.testing.assert_array_equal(np.asarray(got)[0], np.asarray(want)[0])
  empty = jax.jit(lambda c, x: c.attend(x, q_offsets=jnp.zeros((B,), jnp.int32)))(clean, q[:, :1])
  np.testing.assert_array_equal(np.asarray(empty)[1], 0.0)  # length 0: zeros, never NaN


def test_writing_past_the_capacity_raises_naming_it():
  cache = DuoKVCache.init(1, 4, (False, True, True), H, num_sinks=1, window=2)
  x = jnp.zeros((1, 5, K, H))
  with pytest.raises(ValueError, match="overflow"):
    cache.update(x, x)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.int8])
def test_bytes_fall_with_the_streaming_share(dtype):
  max_len, num_sinks, window = 256, 4, 28
  per_head = memory.gqa_bytes_per_token(1, H, dtype)  # one KV head's K and V per token
  held = []
  for count in range(K + 1):
    streaming = tuple(i < count for i in range(K))
    cache = DuoKVCache.init(B, max_len, streaming, H, dtype, num_sinks=num_sinks, window=window)
    want = B * ((K - count) * max_len + count * (num_sinks + window)) * per_head
    assert sum(a.nbytes for a in cache.storage_arrays()) == want
    assert memory.measured_bytes_per_token(cache) == cache.analytic_bytes_per_token()
    held.append(want)
  assert held == sorted(held, reverse=True) and held[-1] * 8 == held[0]  # 256 / (4 + 28)


def _probe_reference(q, k, num_sinks, window):
  """`f32[K]`: per KV head the mass outside sinks + window, over queries t >= sinks + window."""
  num_tokens = q.shape[0]
  lost, count = np.zeros(K), 0
  for t in range(num_sinks + window, num_tokens):
    count += 1
    for n in range(N):
      logits = k[:t + 1, n // G] @ q[t, n] / np.sqrt(H)
      p = np.exp(logits - logits.max())
      p /= p.sum()
      s = np.arange(t + 1)
      lost[n // G] += p[(s >= num_sinks) & (s <= t - window)].sum()
  return lost / (count * G)


def test_the_calibration_loss_is_the_mass_outside_sinks_and_window():
  rng = np.random.default_rng(2)
  num_tokens = 16
  q = rng.normal(size=(1, num_tokens, N, H)).astype(np.float32)
  k = rng.normal(size=(1, num_tokens, K, H)).astype(np.float32)
  k[0, 3, 1] = 0.0
  q[0, :, G:2 * G] = 0.0
  q[0, :, G:2 * G, 0] = k[0, 3, 1, 0] = 30.0  # KV head 1 looks back at token 3
  probe = duo._Probe(k=jnp.zeros((1, K, num_tokens, H)), lengths=jnp.zeros((1,), jnp.int32),  # pylint: disable=protected-access
                     loss=jnp.zeros((1, K)), num_sinks=1, window=4)
  pos = jnp.arange(num_tokens, dtype=jnp.int32)[None]
  _, probe = jax.jit(lambda p: p.update_attend_unchecked(
      q, k, k, positions=pos, rope_theta=THETA, new_lengths=jnp.full((1,), num_tokens)))(probe)
  qr, kr = np.asarray(_rope(q, pos))[0], np.asarray(_rope(k, pos))[0]
  want = _probe_reference(qr, kr, 1, 4)
  np.testing.assert_allclose(np.asarray(probe.loss)[0], want, rtol=1e-5, atol=1e-6)
  assert want[1] > 0.5 and want[1] == want.max()
  assert duo.streaming_pattern(want[None], 2 / 3) == (tuple(bool(x) for x in want != want.max()),)


def test_streaming_pattern_takes_the_smallest_losses_globally():
  losses = np.array([[0.3, 0.1, 0.3], [0.05, 0.9, 0.3]])
  # 0.05, 0.1, then the first of three ties at 0.3 by (layer, head)
  assert duo.streaming_pattern(losses, 0.5) == ((True, True, False), (True, False, False))
  assert duo.streaming_pattern(losses, 0) == ((False,) * 3,) * 2
  assert duo.streaming_pattern(losses, 1) == ((True,) * 3,) * 2
  with pytest.raises(ValueError, match="streaming_fraction"):
    duo.streaming_pattern(losses, 1.5)


@pytest.fixture(scope="module")
def model():
  cfg = transformer.model_config(d_model=32, num_layers=2, mlp_dim=64,
                                 attention=dict(num_heads=N, num_kv_heads=K, head_dim=H))
  return transformer.Transformer.from_config(cfg, rngs=nnx.Rngs(0))


def test_the_builder_uses_the_models_calibration_and_checks_its_options(model):
  roles = duo.calibrate(model, num_sinks=2, window=8, streaming_fraction=0.5)
  assert sum(map(sum, roles)) == 3  # round(0.5 * 6)
  spec = {"kind": "duo", "num_sinks": 2, "window": 8}
  caches = registry.build_caches(model, B, 32, None, spec)
  assert tuple(c.streaming for c in caches) == roles
  fixed = registry.build_caches(model, B, 32, None, {**spec, "pattern": "SSR,RRR"})
  assert tuple(c.streaming for c in fixed) == ((True, True, False), (False,) * 3)
  for options, name in [({"pattern": "SXR,RRR"}, "pattern"), ({"pattern": "SSR"}, "pattern"),
                        ({"pattern": "SR,RR"}, "pattern"), ({"window": 0}, "window"),
                        ({"num_sinks": -1}, "num_sinks"),
                        ({"streaming_fraction": 2.0}, "streaming_fraction")]:
    with pytest.raises(ValueError, match=name):
      registry.build_caches(model, B, 32, None, {**spec, **options})
  with pytest.raises(ValueError, match="tokens must be longer"):
    duo.calibrate(model, np.zeros((1, 10), np.int32), num_sinks=2, window=8)


@pytest.mark.slow  # compiles the batcher (tests/kvattn/inference/test_batching_rows.py's setup)
def test_the_batcher_gives_each_sequence_its_tokens_alone():
  from tests.kvattn.inference import test_batching_rows as rows  # pylint: disable=g-import-not-at-top
  spec = {"kind": "duo", "num_sinks": 1, "window": 3, "pattern": "RS,SR"}
  rows.serve_each_alone(spec)
