"""Tests for pallas_kernels.dense_decode (fused GQA/MLA decode kernel).

`TestDecodeAttention` runs the kernel compiled and is skipped on CPU;
`TestDecodeAttentionInterpret` runs every case with `interpret=True` (both
schedules: "loop" is the Triton GPU kernel, "grid" the Mosaic TPU kernel).
On a GPU, `pytest -k "not Interpret"` runs the compiled cases only.

Every call compiles a kernel, which dominates the runtime in interpret mode,
so each case loops over many `lengths` vectors (traced values: no recompile)
and the default grid is a subset chosen so each edge appears at least once;
the full product is `@pytest.mark.slow`. Interpreted, the default selection
keeps one case per edge class (every length edge, G = 1 and G > the G tile,
garbage in unused slots, block skipping) and marks the repeats
`slow_when_interpreted` (tests/pallas_kernels/conftest.py); compiled, every
default case runs.
"""

from __future__ import annotations

import itertools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import _common
from pallas_kernels import dense_decode as da
from pallas_kernels.attention_common import attended_range, decode_mask
from tests.pallas_kernels._helpers import (DTYPES, KernelTest, assert_errors, close, close_lse,
                                           fast_when_interpreted, jitted, lengths_sets)


try:  # The XLA-path comparisons need kvattn (and so flax); a bare GPU image may lack it.
  import kvattn.ops as kvattn_ops
except ImportError:  # pragma: no cover - depends on the machine
  kvattn_ops = None

_reference = jitted(da.decode_attention_reference)
_mla_reference = jitted(da.mla_decode_attention_reference)
if kvattn_ops is not None:
  _xla = jitted(kvattn_ops.decode_attention)
  _mla_xla = jitted(kvattn_ops.mla_decode_attention)

BLOCK = 16  # block_k used by the grids below; S = 4 blocks.
S = 4 * BLOCK
EDGES = (0, 1, BLOCK - 1, BLOCK, BLOCK + 1, S)


def _inputs(batch, num_heads, num_kv, head_dim, v_dim, dtype, capacity=S, seed=0):
  rng = np.random.RandomState(seed)
  q = rng.randn(batch, num_heads, head_dim)
  k = rng.randn(batch, num_kv, capacity, head_dim)
  v = rng.randn(batch, num_kv, capacity, v_dim)
  return tuple(jnp.asarray(x, dtype) for x in (q, k, v))


def _fill_unused(x, lengths, window, value, slot_axis=2):
  """Copy of `x` with `value` in every slot outside `[max(0, L - W), L)` of each row."""
  unused = ~np.asarray(decode_mask(lengths, x.shape[slot_axis], window))  # [B, S]
  shape = [1] * x.ndim
  shape[0], shape[slot_axis] = unused.shape
  dtype = x.dtype
  with np.errstate(over="ignore"):  # 1e30 becomes inf in f16, as it would in a real cache
    return jnp.asarray(np.where(unused.reshape(shape), value,
                                np.asarray(x.astype(jnp.float32))).astype(dtype))


# Default cases: (B, N, K, H, Hv, dtype, window, schedule). Together they cover
# B in {1, 3}, (N, K) in {(8, 8), (8, 2), (8, 1), (48, 2)}, H in {64, 128},
# Hv != H both ways, every dtype, windows and both schedules.
CASES = [
    (3, 8, 2, 64, 64, "f32", None, "loop"),
    (3, 8, 8, 128, 64, "bf16", None, "grid"),
    (1, 8, 1, 64, 128, "f16", BLOCK + 3, "loop"),
    (3, 48, 2, 64, 64, "bf16", 5, "loop"),
    (3, 8, 1, 128, 128, "f32", BLOCK, "grid"),
    (1, 48, 2, 128, 64, "f16", 2 * BLOCK, "grid"),
]
SLOW_CASES = [
    (b, n, k, h, hv, dt, w, sch)
    for b, (n, k), h, dt, w, sch in itertools.product(
        (1, 3), ((8, 8), (8, 2), (8, 1), (48, 2)), (64, 128), ("f32", "bf16", "f16"),
        (None, BLOCK + 3), ("loop", "grid"))
    for hv in (h, h // 2)
    if (b, n, k, h, hv, dt, w, sch) not in CASES
]


class TestDecodeAttention(KernelTest):
  """Compiled kernel (GPU/TPU); the Interpret subclass runs it on CPU."""

  def _kernel(self, *args, **kwargs):
    kwargs.setdefault("block_k", BLOCK)
    kwargs["schedule"] = self._schedule(kwargs.get("schedule", "loop"))
    return da.decode_attention(*args, interpret=self.INTERPRET, **kwargs)

  def _check_case(self, batch, num_heads, num_kv, head_dim, v_dim, dtype_name, window,
                  schedule, num_splits=2):
    dtype = DTYPES[dtype_name]
    q, k, v = _inputs(batch, num_heads, num_kv, head_dim, v_dim, dtype)
    for lengths in lengths_sets(batch, EDGES):
      out, lse = self._kernel(q, k, v, lengths, window=window, schedule=schedule,
                              num_splits=num_splits, return_lse=True)
      ref, ref_lse = _reference(q, k, v, lengths, window=window, return_lse=True)
      chex.assert_shape(out, (batch, num_heads, v_dim))
      assert out.dtype == q.dtype and lse.dtype == jnp.float32
      what = f"lengths={lengths.tolist()}"
      close(out, ref, dtype, what)
      if kvattn_ops is not None:
        xla = _xla(q, k, v, jnp.asarray(lengths), window=window, implementation="xla")
        close(xla, ref, dtype, "xla path " + what)
      close_lse(lse, ref_lse, dtype)
      empty = lengths == 0
      np.testing.assert_array_equal(np.asarray(out, np.float32)[empty], 0.0)

  # Interpreted by default: G = 24 > the 16-row G tile ("loop") and G = 1 ("grid"); both
  # cover every length edge (EDGES).
  @pytest.mark.parametrize("case", fast_when_interpreted(CASES, (
      (3, 48, 2, 64, 64, "bf16", 5, "loop"), (3, 8, 8, 128, 64, "bf16", None, "grid"))), ids=str)
  def test_matches_reference_and_xla(self, case):
    self._check_case(*case)

  @pytest.mark.slow
  @pytest.mark.parametrize("case", SLOW_CASES, ids=str)
  def test_matches_reference_full_grid(self, case):
    self._check_case(*case)

  @pytest.mark.parametrize("schedule", fast_when_interpreted(["loop", "grid"], ["loop"]))
  def test_independent_of_blocks_splits_and_tiles(self, schedule):
    # G = 48 > any G tile below: several tiles per KV head.
    q, k, v = _inputs(2, 48, 1, 64, 64, jnp.float32, capacity=128, seed=3)
    lengths = np.array([77, 128], np.int32)
    base, base_lse = self._kernel(q, k, v, lengths, window=70, schedule=schedule,
                                  block_k=128, num_splits=1, return_lse=True)
    tiles = ([(16, 3, 16), (32, 8, 64), (64, 2, 32)] if schedule == "loop"
             else [(16, 3, 8), (32, 8, 48), (8, 5, 16)])
    for block_k, splits, block_g in tiles:
      out, lse = self._kernel(q, k, v, lengths, window=70, schedule=schedule,
                              block_k=block_k, num_splits=splits, block_g=block_g,
                              return_lse=True)
      what = f"block_k={block_k} num_splits={splits} block_g={block_g}"
      np.testing.assert_allclose(out, base, atol=2e-6, rtol=2e-6, err_msg=what)
      np.testing.assert_allclose(lse, base_lse, atol=2e-6, rtol=2e-6, err_msg=what)

  @pytest.mark.parametrize("schedule,dtype_name,window", [
      ("loop", "f32", None), ("grid", "bf16", 2 * BLOCK + 1),
      pytest.param("loop", "f16", BLOCK, marks=pytest.mark.slow_when_interpreted)])
  def test_garbage_in_unused_slots_does_not_leak(self, schedule, dtype_name, window):
    dtype = DTYPES[dtype_name]
    q, k, v = _inputs(3, 8, 2, 64, 64, dtype, seed=5)
    lengths = np.array([0, BLOCK + 1, S - 3], np.int32)
    clean = self._kernel(q, k, v, lengths, window=window, schedule=schedule)
    assert np.isfinite(np.asarray(clean, np.float32)).all()
    for value in (np.nan, 1e30, -np.inf):
      dirty_k = _fill_unused(k, lengths, window, value)
      dirty_v = _fill_unused(v, lengths, window, value)
      out = self._kernel(q, dirty_k, dirty_v, lengths, window=window, schedule=schedule)
      # Same blocks, same valid values, garbage replaced: bitwise equal.
      np.testing.assert_array_equal(np.asarray(out, np.float32),
                                    np.asarray(clean, np.float32), err_msg=str(value))

  @pytest.mark.parametrize("schedule", fast_when_interpreted(["loop", "grid"], ["loop"]))
  def test_lse_is_logsumexp_of_scaled_logits(self, schedule):
    q, k, v = _inputs(3, 8, 2, 64, 32, jnp.float32, seed=7)
    lengths = np.array([0, 1, 50], np.int32)
    _, lse = self._kernel(q, k, v, lengths, sm_scale=0.3, schedule=schedule,
                          return_lse=True)
    logits = 0.3 * np.einsum("bkgh,bksh->bkgs", np.asarray(q).reshape(3, 2, 4, 64),
                             np.asarray(k)).reshape(3, 8, S)
    for b, length in enumerate(lengths):
      expected = (np.full(8, -np.inf) if length == 0 else
                  np.log(np.sum(np.exp(logits[b, :, :length].astype(np.float64)), -1)))
      np.testing.assert_allclose(np.asarray(lse[b]), expected, rtol=1e-5, atol=1e-5)

  @pytest.mark.parametrize("schedule", fast_when_interpreted(["loop", "grid"], ["loop"]))
  def test_work_grows_with_the_real_length(self, schedule):
    # count_blocks reports how many key blocks each program actually ran its
    # body on; it must be the blocks overlapping [max(0, L - W), L), whatever S.
    for capacity, window in ((S, None), (4 * S, BLOCK + 3), (4 * S, None)):
      q, k, v = _inputs(4, 8, 2, 64, 64, jnp.float32, capacity=capacity)
      for lengths in (np.array([0, 1, BLOCK + 1, S], np.int32),
                      np.array([BLOCK - 1, BLOCK, 2 * BLOCK + 5, capacity], np.int32)):
        _, counts = self._kernel(q, k, v, lengths, window=window, schedule=schedule,
                                 num_splits=3, count_blocks=True)
        starts = np.asarray(attended_range(lengths, capacity, window)[0])
        expected = -(-lengths // BLOCK) - starts // BLOCK
        np.testing.assert_array_equal(np.asarray(counts), np.repeat(expected[:, None], 2, 1),
                                      err_msg=f"S={capacity} window={window} L={lengths}")

  def test_lengths_past_capacity_are_clamped(self):
    q, k, v = _inputs(2, 8, 2, 64, 64, jnp.float32)
    at_s = self._kernel(q, k, v, np.array([S, 3], np.int32))
    over = self._kernel(q, k, v, np.array([S + 9, 3], np.int32))
    np.testing.assert_array_equal(over, at_s)

  @pytest.mark.parametrize("schedule,dtype_name,window", [
      ("loop", "f32", None),
      pytest.param("grid", "bf16", BLOCK + 2, marks=pytest.mark.slow_when_interpreted)])
  def test_mla_matches_reference_and_xla(self, schedule, dtype_name, window):
    dtype = DTYPES[dtype_name]
    rng = np.random.RandomState(11)
    batch, num_heads, latent, rope = 3, 16, 128, 64
    q_latent, q_rope = (jnp.asarray(0.2 * rng.randn(batch, num_heads, d), dtype)
                        for d in (latent, rope))
    c_kv = jnp.asarray(rng.randn(batch, S, latent), dtype)
    k_rope = jnp.asarray(rng.randn(batch, S, rope), dtype)
    for lengths in lengths_sets(batch, EDGES):
      dirty_c = _fill_unused(c_kv, lengths, window, np.nan, 1)
      dirty_r = _fill_unused(k_rope, lengths, window, 1e30, 1)
      out, lse = da.mla_decode_attention(
          q_latent, q_rope, dirty_c, dirty_r, lengths, sm_scale=0.125, window=window,
          interpret=self.INTERPRET, schedule=self._schedule(schedule), block_k=BLOCK,
          num_splits=3, return_lse=True)
      ref, ref_lse = _mla_reference(
          q_latent, q_rope, c_kv, k_rope, lengths, sm_scale=0.125, window=window,
          return_lse=True)
      chex.assert_shape(out, (batch, num_heads, latent))
      close(out, ref, dtype, f"lengths={lengths.tolist()}")
      if kvattn_ops is not None:
        xla = _mla_xla(q_latent, q_rope, c_kv, k_rope, jnp.asarray(lengths), sm_scale=0.125,
                       window=window, implementation="xla")
        close(xla, ref, dtype)
      close_lse(lse, ref_lse, dtype)

  # Released models' head dims: the "loop" (Triton) kernel pads non-powers of two to the next
  # power of two (zero lanes) and slices the output back. Interpreted by default: 80 (padded
  # to 128, with a soft cap) and 112 with Hv = 96 (both padded); the rest is slow.
  @pytest.mark.parametrize("case", fast_when_interpreted(
      [(64, 64, None), (80, 80, 30.0), (96, 96, None), (112, 96, 2.0), (128, 128, 50.0),
       (256, 256, None)], [(80, 80, 30.0), (112, 96, 2.0)]), ids=str)
  def test_any_head_dim_and_soft_cap_match_reference(self, case):
    head_dim, v_dim, soft_cap = case
    q, k, v = _inputs(3, 8, 2, head_dim, v_dim, jnp.float32, seed=head_dim)
    q = q * 3.0  # logits of a few units, so the soft cap bends them
    for lengths in (np.array([0, BLOCK + 1, S], np.int32), np.array([1, BLOCK - 1, BLOCK])):
      ref = _reference(q, k, v, lengths, soft_cap=soft_cap)
      dirty = (_fill_unused(k, lengths, None, np.nan), _fill_unused(v, lengths, None, np.nan))
      out = self._kernel(q, *dirty, lengths, soft_cap=soft_cap, num_splits=2)
      chex.assert_shape(out, (3, 8, v_dim))
      close(out, ref, jnp.float32, f"H={head_dim} Hv={v_dim} lengths={lengths.tolist()}")
    if soft_cap is not None:  # the cap changed the result
      assert not np.allclose(ref, _reference(q, k, v, lengths), atol=1e-3)
    assert da.unsupported_reason(q.shape, k.shape, v.shape, k.dtype, platform="gpu") is None

  def test_jitted_step_compiles_once(self):
    q, k, v = (jnp.concatenate([x, x]) for x in _inputs(1, 8, 2, 64, 64, jnp.float32))

    @jax.jit
    @chex.assert_max_traces(n=1)
    def step(q, k, v, lengths):
      return self._kernel(q, k, v, lengths)

    first = step(q, k, v, jnp.array([3, S], jnp.int32))
    second = step(q, k, v, jnp.array([S, 3], jnp.int32))
    # Rows are identical, so swapping lengths swaps the outputs.
    np.testing.assert_allclose(first[::-1], second, atol=1e-6)
    assert not np.allclose(first[0], first[1])


class TestDecodeAttentionInterpret(TestDecodeAttention):
  INTERPRET = True


# ----------------------------------------------------------------------------
# Backend-independent checks (no kernel compile, or the reference only).
# ----------------------------------------------------------------------------


def test_reference_on_hand_computed_case():
  # One head, H = 1, keys 0 and log(3): weights 1/4 and 3/4 with sm_scale 1.
  q = jnp.ones((2, 1, 1))
  k = jnp.array([0.0, np.log(3.0), 7.0]).reshape(1, 1, 3, 1).repeat(2, 0)
  v = jnp.array([[4.0, 0.0], [8.0, 4.0], [np.nan, np.nan]]).reshape(1, 1, 3, 2).repeat(2, 0)
  out, lse = da.decode_attention_reference(q, k, v, np.array([2, 0]), sm_scale=1.0,
                                           return_lse=True)
  np.testing.assert_allclose(out[0, 0], [7.0, 3.0], rtol=1e-6)
  np.testing.assert_array_equal(out[1], 0.0)
  np.testing.assert_allclose(lse[0, 0], np.log(4.0), rtol=1e-6)
  assert np.isneginf(lse[1, 0])
  # Window 1: only the newest key (slot 1) is attended.
  out = da.decode_attention_reference(q, k, v, np.array([2, 1]), sm_scale=1.0, window=1)
  np.testing.assert_allclose(out[:, 0], [[8.0, 4.0], [4.0, 0.0]], rtol=1e-6)


def test_mla_reference_is_decode_reference_with_split_key():
  rng = np.random.RandomState(2)
  q_latent, q_rope, c_kv, k_rope = (rng.randn(*s).astype(np.float32) for s in (
      (2, 4, 16), (2, 4, 8), (2, 24, 16), (2, 24, 8)))
  lengths = np.array([5, 24])
  out = da.mla_decode_attention_reference(q_latent, q_rope, c_kv, k_rope, lengths,
                                          sm_scale=0.2, window=7)
  key = np.concatenate([c_kv, k_rope], -1)[:, None]
  expected = da.decode_attention_reference(np.concatenate([q_latent, q_rope], -1), key,
                                           c_kv[:, None], lengths, sm_scale=0.2, window=7)
  np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-6)


def test_mla_wrapper_does_not_concatenate_the_cache():
  c_kv = jax.ShapeDtypeStruct((2, 1024, 128), jnp.bfloat16)
  k_rope = jax.ShapeDtypeStruct((2, 1024, 64), jnp.bfloat16)
  q_latent = jax.ShapeDtypeStruct((2, 16, 128), jnp.bfloat16)
  q_rope = jax.ShapeDtypeStruct((2, 16, 64), jnp.bfloat16)
  lengths = jax.ShapeDtypeStruct((2,), jnp.int32)
  jaxpr = jax.make_jaxpr(lambda *a: da.mla_decode_attention(
      *a, sm_scale=0.1, interpret=True, schedule="loop"))(q_latent, q_rope, c_kv, k_rope,
                                                          lengths)

  def eqns(jaxpr):
    for eqn in jaxpr.eqns:
      yield eqn
      for param in eqn.params.values():
        inner = getattr(param, "jaxpr", param)
        if eqn.primitive.name != "pallas_call" and hasattr(inner, "eqns"):
          yield from eqns(inner)

  # The kernel body (inside pallas_call) reads refs block by block. Outside
  # it, nothing may build a cache-sized array other than a view (a reshape
  # adding unit axes: same element count as its operand, a bitcast in XLA).
  cache_elems = 2 * 1024 * 64
  views = ("reshape", "broadcast_in_dim", "expand_dims", "squeeze")
  seen_kernel = False
  for eqn in eqns(jaxpr.jaxpr):
    assert eqn.primitive.name != "concatenate", eqn
    seen_kernel |= eqn.primitive.name == "pallas_call"
    for out in eqn.outvars:
      if eqn.primitive.name == "pallas_call" or np.prod(out.aval.shape) < cache_elems:
        continue
      sizes = [np.prod(x.aval.shape) for x in eqn.invars if hasattr(x, "aval")]
      assert eqn.primitive.name in views and np.prod(out.aval.shape) in sizes, (
          f"{eqn.primitive.name} materialises {out.aval.shape} {out.aval.dtype}")
  assert seen_kernel


@pytest.mark.parametrize("blocks_per_split,num_splits", [(4, 1), (2, 2), (1, 5), (3, 2)])
def test_grid_schedule_fetches_only_needed_blocks(blocks_per_split, num_splits):
  # The "grid" schedule's K/V index map (the function its BlockSpecs use),
  # walked in grid order: the pipeline copies a block only when the index
  # differs from the previous step's, so count index changes.
  num_blocks = blocks_per_split * num_splits
  for start, length in [(0, 0), (0, 1), (0, 16 * num_blocks), (20, 37), (33, 33 + 16)]:
    lo, hi = (int(x) for x in _common.block_bounds(jnp.int32(start), jnp.int32(length), 16))
    hi = min(hi, num_blocks)
    visited = [int(_common.kv_block_index(j, i, lo, hi, blocks_per_split))
               for j in range(num_splits) for i in range(blocks_per_split)]
    copies = 1 + sum(a != b for a, b in zip(visited, visited[1:]))
    assert copies == max(hi - lo, 1), (start, length, visited)
    assert set(visited) == (set(range(lo, hi)) or {lo})


def test_validation_errors_name_the_argument():
  q, k, v = (jnp.zeros(s) for s in ((2, 8, 64), (2, 2, S, 64), (2, 2, S, 32)))
  lengths = np.array([1, 2], np.int32)
  call = lambda *a, **kw: da.decode_attention(*a, **{"interpret": True, **kw})
  cases = [
      (ValueError, "q must have rank 3", (q[0], k, v, lengths), {}),
      (ValueError, "num_heads must be divisible by num_kv_heads; got 8 and 3",
       (q, jnp.zeros((2, 3, S, 64)), jnp.zeros((2, 3, S, 32)), lengths), {}),
      (TypeError, "k and v must share one dtype", (q, k, v.astype(jnp.bfloat16), lengths), {}),
      (TypeError, "lengths must have an integer dtype", (q, k, v, lengths * 1.0), {}),
      (ValueError, r"lengths must have shape \[B\] = \(2,\)", (q, k, v, lengths[:1]), {}),
      (ValueError, "v.shape\\[2\\]", (q, k, v[:, :, :8], lengths), {}),
      (ValueError, "block_k must be a power of two >= 16 dividing S=64",
       (q, k, v, lengths), {"block_k": 24}),
      (ValueError, "block_k must divide S=64", (q, k, v, lengths),
       {"block_k": 24, "schedule": "grid"}),
      (ValueError, "S \\(cache slots\\) must be a multiple of 16 .*; got S=40",
       (q, k[:, :, :40], v[:, :, :40], lengths), {}),
      (ValueError, "schedule must be one of", (q, k, v, lengths), {"schedule": "fast"}),
      (ValueError, "window must be a positive int; got 0", (q, k, v, lengths), {"window": 0}),
      (ValueError, "sm_scale must be a positive finite float", (q, k, v, lengths),
       {"sm_scale": -1.0}),
      (ValueError, "num_splits must be a positive int", (q, k, v, lengths), {"num_splits": 0}),
  ]
  assert_errors(call, cases, (q, k, v, lengths))
  with pytest.raises(ValueError, match="sm_scale is required for MLA"):
    da.mla_decode_attention(q, q[..., :8], k[:, 0], k[:, 0, :, :8], lengths, sm_scale=None,
                            interpret=True)
  with pytest.raises(ValueError, match=r"q_rope.shape\[2\] \(rope dim R, from k_rope\)"):
    da.mla_decode_attention(q, q[..., :8], k[:, 0], k[:, 0, :, :16], lengths, sm_scale=0.1,
                            interpret=True)
