"""kvattn/ops/xla_blocked.py: the length-aware blocked XLA decode path (the CPU default)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvattn import ops
from kvattn.ops import xla_blocked
from pallas_kernels import attention_common
from pallas_kernels import dense_decode

# Jitted once per static configuration; lengths are traced (no recompiles).
_blocked = jax.jit(xla_blocked.decode_attention_blocked,
                   static_argnames=("sm_scale", "window", "soft_cap", "block_k"))
_plain = jax.jit(ops.decode_attention_xla, static_argnames=("sm_scale", "window", "soft_cap"))

BLOCK = 16
S = 4 * BLOCK
LENGTHS = [np.array(x, np.int32) for x in ((0, 1, BLOCK - 1), (BLOCK, BLOCK + 1, S),
                                            (S + 7, 2, 0))]  # S + 7: clamped overflow


def _dense(num_heads, num_kv, head_dim, v_dim, dtype, capacity=S, seed=0, batch=3):
  rng = np.random.RandomState(seed)
  return tuple(jnp.asarray(rng.randn(*s), dtype) for s in (
      (batch, num_heads, head_dim), (batch, num_kv, capacity, head_dim),
      (batch, num_kv, capacity, v_dim)))


@pytest.mark.parametrize("num_heads,num_kv,window,soft_cap,dtype", [
    (8, 8, None, None, jnp.float32), (8, 2, BLOCK + 3, None, jnp.float32),
    (8, 1, 5, 20.0, jnp.float32), (48, 2, None, None, jnp.bfloat16)])
def test_matches_plain_xla_path(num_heads, num_kv, window, soft_cap, dtype):
  q, k, v = _dense(num_heads, num_kv, 32, 16, dtype)
  tol = 1e-5 if dtype == jnp.float32 else 2e-2
  for lengths in LENGTHS:
    expected = _plain(q, k, v, jnp.minimum(lengths, S), window=window, soft_cap=soft_cap)
    for block_k in (BLOCK, 24):  # 24 does not divide S: the last block is shifted back
      out = _blocked(q, k, v, lengths, window=window, soft_cap=soft_cap, block_k=block_k)
      np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(expected, np.float32),
                                 atol=tol, rtol=tol, err_msg=f"{lengths} block_k={block_k}")
    assert not np.asarray(out[lengths == 0], np.float32).any()


def test_garbage_in_unused_slots_does_not_leak():
  q, k, v = _dense(8, 2, 32, 32, jnp.float32, seed=1)
  lengths, window = np.array([0, BLOCK + 1, S - 2], np.int32), BLOCK
  clean = _blocked(q, k, v, lengths, window=window, block_k=BLOCK)
  unused = ~np.asarray(attention_common.decode_mask(lengths, S, window))  # [B, S]
  for value in (np.nan, 1e30, np.inf):
    dirty = jnp.where(unused[:, None, :, None], value, k), jnp.where(
        unused[:, None, :, None], value, v)
    out = _blocked(q, *dirty, lengths, window=window, block_k=BLOCK)
    np.testing.assert_array_equal(out, clean)


def test_mla_matches_plain_xla_path():
  rng = np.random.RandomState(2)
  q_latent, q_rope, c_kv, k_rope = (jnp.asarray(rng.randn(*s), jnp.float32) for s in (
      (3, 4, 32), (3, 4, 16), (3, S, 32), (3, S, 16)))
  for lengths in LENGTHS[:2]:
    expected = ops.mla_decode_attention_xla(q_latent, q_rope, c_kv, k_rope, lengths,
                                            sm_scale=0.2, window=20)
    out = xla_blocked.mla_decode_attention_blocked(q_latent, q_rope, c_kv, k_rope, lengths,
                                                   sm_scale=0.2, window=20, block_k=BLOCK)
    np.testing.assert_allclose(out, expected, atol=1e-5, rtol=1e-5)


def test_block_sizes_and_tiers():
  # B * K = 8, H + Hv = 128: 8 MiB of f32 is 2048 slots per block.
  single, loop = xla_blocked.block_sizes(16384, 8, 128)
  assert single == (64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048) and loop == 1024
  assert all(b / a <= 1.5 for a, b in zip(single, single[1:]))
  assert xla_blocked.block_sizes(1000, 8, 128) == ((64, 96, 128, 192, 256, 384, 512, 768,
                                                    1000), None)
  assert xla_blocked.block_sizes(40, 1, 16) == ((40,), None)
  # The smallest single size holding the span, else the loop (index len(single)).
  spans = jnp.array([0, 1, 64, 65, 96, 97, 2048, 2049, 16384])
  tiers = jax.vmap(lambda s: xla_blocked.tier(s, single))(spans)
  np.testing.assert_array_equal(tiers, [0, 0, 0, 1, 1, 2, 10, 11, 11])
  with pytest.raises(ValueError, match=r"block_k must be an int in \[1, S=64\] or None; got 65"):
    xla_blocked.decode_attention_blocked(*_dense(8, 2, 16, 16, jnp.float32),
                                         jnp.array([1, 2, 3]), block_k=65)


@pytest.fixture
def small_tiers(monkeypatch):
  """Default sizes of a toy scale: single blocks 16, 24, 32, 48, then a loop of 16."""
  monkeypatch.setattr(xla_blocked, "MIN_BLOCK", 16)
  monkeypatch.setattr(xla_blocked, "MIN_CAPACITY", 32)
  monkeypatch.setattr(xla_blocked, "_MAX_BLOCK_BYTES", 48 * 4 * 64 * 4)  # rows * width = 4 * 64
  assert xla_blocked.block_sizes(100, 4, 64) == ((16, 24, 32, 48), 16)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="CPU dispatch rules")
@pytest.mark.parametrize("num_heads,num_kv", [
    pytest.param(4, 2, marks=pytest.mark.slow), (2, 2), (64, 2)])  # G = 2, 1, 32 > block
def test_default_path_equals_the_reference_over_edges(small_tiers, num_heads, num_kv):
  del small_tiers
  cap = 100  # not a multiple of any block size
  q, k, v = _dense(num_heads, num_kv, 32, 32, jnp.float32, capacity=cap, seed=4, batch=2)
  default = jax.jit(ops.decode_attention, static_argnames=("window", "soft_cap"))
  # Edges of the smallest block (16), of a single-block size (48) and of the loop's blocks;
  # rows of one call differ (mixed lengths), capacity included.
  cases = [(0, 0), (1, 0), (15, 16), (17, 1), (47, 48), (49, 3), (64, 65), (cap, 7),
           (cap, cap)]
  for window, soft_cap in ((20, 5.0),):  # no window: test_default_path_compiles_once...
    programs = None
    for lengths in cases:
      lengths = jnp.array(lengths, jnp.int32)
      want = dense_decode.decode_attention_reference(q, k, v, lengths, window=window,
                                                     soft_cap=soft_cap)
      mask = np.asarray(attention_common.decode_mask(lengths, cap, window))[:, None, :, None]
      out = default(q, k, v, lengths, window=window, soft_cap=soft_cap)
      np.testing.assert_allclose(out, want, atol=2e-6, rtol=2e-5, err_msg=f"{lengths}")
      dirty = default(q, jnp.where(mask, k, jnp.nan), jnp.where(mask, v, jnp.nan), lengths,
                      window=window, soft_cap=soft_cap)
      np.testing.assert_array_equal(dirty, out)
      programs = programs or default._cache_size()
    assert default._cache_size() == programs  # none compiled per length


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="CPU dispatch rules")
def test_default_path_compiles_once_as_lengths_grow():
  # A default-size cache (B * K = 2, H + Hv = 64: single blocks 64 ... 256, then S = 320)
  # read at lengths from 0 to S through one jitted program: one trace, one backend compile.
  q, k, v = _dense(4, 2, 32, 32, jnp.float32, capacity=320, seed=5, batch=1)
  assert xla_blocked.block_sizes(320, 2, 64) == ((64, 96, 128, 192, 256, 320), None)
  lengths = [jnp.array([n], jnp.int32) for n in (0, 1, 63, 64, 65, 97, 257, 319, 320)]
  wants = [ops.decode_attention(q, k, v, n, implementation="xla") for n in lengths]
  traces, compiles = [], []

  def step(q, k, v, n):
    traces.append(n)
    return ops.decode_attention(q, k, v, n)

  step = jax.jit(step)
  jax.monitoring.register_event_duration_secs_listener(
      lambda name, *_, **__: compiles.append(name) if name.endswith("backend_compile_duration")
      else None)
  try:
    for n, want in zip(lengths, wants):
      np.testing.assert_allclose(step(q, k, v, n), want, atol=2e-6, rtol=2e-5)
  finally:
    jax.monitoring.clear_event_listeners()
  assert len(traces) == 1 and len(compiles) == 1


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="CPU dispatch rules")
def test_dispatch_picks_it_on_cpu_above_min_capacity():
  assert ops.available_implementations()[:3] == ("pallas", "xla_blocked", "xla")
  q, k, v = _dense(8, 2, 32, 32, jnp.bfloat16, capacity=320, seed=3)
  lengths = jnp.array([0, 70, 300])
  default = jax.jit(lambda *a: ops.decode_attention(*a, window=100))
  named = jax.jit(lambda *a: ops.decode_attention(*a, window=100, implementation="xla_blocked"))
  np.testing.assert_array_equal(default(q, k, v, lengths), named(q, k, v, lengths))
  with pytest.raises(NotImplementedError, match="S=256 <= 256 slots"):
    xla_blocked.decode(q, k[:, :, :256], v[:, :, :256], lengths, explicit=False)
