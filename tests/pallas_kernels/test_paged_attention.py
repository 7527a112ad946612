"""Tests for pallas_kernels.paged_decode (fused paged GQA decode kernel).

`TestPagedAttention` runs the kernel compiled and is skipped on CPU;
`TestPagedAttentionInterpret` runs every case with `interpret=True` (both
schedules: "loop" is the Triton GPU kernel, "grid" the Mosaic TPU kernel).
On a GPU, `pytest -k "not Interpret"` runs the compiled cases only.

Every case builds a page pool in which the sequences' pages are a random
permutation, and everything no sequence attends (the tail of each last page,
pages before the window, free pages) holds NaN, so kernel == reference ==
XLA path also shows that garbage never leaks. Each case loops over several
`lengths` vectors (traced values: no recompile); the full grid is
`@pytest.mark.slow`. Interpreted, the default selection keeps one case per
edge class and marks the repeats `slow_when_interpreted`
(tests/pallas_kernels/conftest.py); compiled, every default case runs.
"""

from __future__ import annotations

import itertools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import _paging
from pallas_kernels import paged_decode as pa
from pallas_kernels.attention_common import attended_range
from tests.pallas_kernels._helpers import (DTYPES, FORMATS, KernelTest, assert_errors, close,
                                           close_lse, fast_when_interpreted, jitted, junk,
                                           lengths_sets, quantize)

try:  # The XLA-path comparisons need kvattn (and so flax); a bare GPU image may lack it.
  import kvattn.ops as kvattn_ops
except ImportError:  # pragma: no cover - depends on the machine
  kvattn_ops = None

_reference = jitted(pa.paged_decode_attention_reference)
if kvattn_ops is not None:
  _xla = jitted(kvattn_ops.paged_decode_attention)

PAGE = 16  # page_size: a multiple of the TPU sublane count for f32 and 16-bit types
PAGES_PER_SEQ = 4
S = PAGE * PAGES_PER_SEQ  # per-sequence capacity
FREE_PAGES = 3  # pages no sequence owns
EDGES = (0, 1, PAGE - 1, PAGE, PAGE + 1, S)  # PAGE + 1: one token into a fresh page


def _inputs(batch, num_heads, num_kv, head_dim, v_dim, dtype, pages_per_seq=PAGES_PER_SEQ,
            seed=0, page_size=PAGE):
  """Random q, pools and a block table giving each sequence its own random pages.

  The pools are f32 numpy arrays, so every pool made from them (as is, or through
  `_dirty`, which works in f32) is rounded once, f32 -> dtype, and holds the same
  values in the same slots. Cast from f64 they would not: ml_dtypes rounds f64 ->
  bf16 directly, and f64 -> f32 -> bf16 can land on a bf16 tie and round the
  other way (one ulp; docs/benchmarks.md, "bf16 garbage-slot difference").
  """
  rng = np.random.RandomState(seed)
  num_pages = batch * pages_per_seq + FREE_PAGES
  q = jnp.asarray(rng.randn(batch, num_heads, head_dim), dtype)
  k = rng.randn(num_kv, num_pages, page_size, head_dim).astype(np.float32)
  v = rng.randn(num_kv, num_pages, page_size, v_dim).astype(np.float32)
  tables = rng.permutation(num_pages)[:batch * pages_per_seq].reshape(batch, pages_per_seq)
  return q, k, v, tables.astype(np.int32)


def _dirty(pages, tables, lengths, window, value):
  """`pages` (a `[K, P, page_size, ...]` pool, values or scales) with `value` in
  every slot no sequence attends (pages before the window, the tail of each
  last page, free pages), as f32 (cast to the pool's dtype later).

  Also returns the block table with -1 (unassigned) past each sequence's last
  used page, as an allocator would leave it.
  """
  pages = np.array(pages, np.float32)
  page_size = pages.shape[2]
  keep = np.zeros(pages.shape[1:3], bool)  # [P, page_size]
  tables = np.array(tables)
  starts, _ = attended_range(np.asarray(lengths), tables.shape[1] * page_size, window)
  for b, length in enumerate(lengths):
    for slot in range(int(starts[b]), int(length)):
      keep[tables[b, slot // page_size], slot % page_size] = True
    tables[b, -(-int(length) // page_size):] = -1
  pages[:, ~keep] = value
  return pages, tables


# Default cases: (B, N, K, H, Hv, dtype, window, schedule). Together they cover
# B in {1, 3}, (N, K) in {(8, 8), (8, 2), (8, 1), (48, 2)} (G = 1 and G = 24,
# larger than a 16-row G tile), H in {64, 128}, Hv != H, every dtype, windows
# and both schedules.
CASES = [
    (3, 8, 2, 64, 64, "f32", None, "loop"),
    (3, 8, 8, 128, 128, "bf16", None, "grid"),
    (1, 8, 1, 64, 64, "f16", PAGE + 3, "loop"),
    (3, 48, 2, 64, 32, "bf16", 5, "loop"),
    (3, 8, 1, 128, 64, "f32", PAGE, "grid"),
]
# The full grid: every (N, K), dtype, window and schedule; B, H and Hv vary with them.
SLOW_CASES = [
    (1 if (n, k) == (8, 1) else 3, n, k, h, h // 2 if w else h, dt, w, sch)
    for (n, k), dt, w, sch in itertools.product(
        ((8, 8), (8, 2), (8, 1), (48, 2)), ("f32", "bf16", "f16"), (None, PAGE + 3),
        ("loop", "grid"))
    for h in ((128,) if dt == "bf16" else (64,))
]

# Quantized pools: int8 / fp8 values with f32[K, P, page_size] scale pools.
QPAGE = 32  # a multiple of the "grid" schedule's 1-byte sublane granule (32)
QEDGES = (0, 1, QPAGE - 1, QPAGE, QPAGE + 1, QPAGE * PAGES_PER_SEQ)  # one row each: B = 6
# (format, schedule, N, K, window, q dtype): every format on "loop" (compiled on a GPU),
# int8 on "grid" (compiled on a TPU), G in {1, 4, 8}, windows, f32 and bf16 queries.
QUANT_CASES = [
    ("int8", "loop", 8, 2, None, "f32"),
    ("int8", "grid", 8, 1, QPAGE + 3, "bf16"),
    ("e4m3", "loop", 8, 8, QPAGE + 3, "bf16"),
    ("e5m2", "loop", 8, 2, None, "f32"),
    ("e5m2", "grid", 8, 2, 2 * QPAGE + 1, "f32"),
]
QUANT_SLOW_CASES = [
    (name, sch, n, k, w, qd)
    for name, sch, (n, k), w, qd in itertools.product(
        FORMATS, ("loop", "grid"), ((8, 8), (8, 2), (8, 1), (48, 2)), (None, QPAGE + 3),
        ("f32", "bf16"))
    if (name, sch, n, k, w, qd) not in QUANT_CASES
]


class TestPagedAttention(KernelTest):
  """Compiled kernel (GPU/TPU); the Interpret subclass runs it on CPU."""

  def _kernel(self, *args, **kwargs):
    kwargs["schedule"] = self._schedule(kwargs.get("schedule", "loop"))
    return pa.paged_decode_attention(*args, interpret=self.INTERPRET, **kwargs)

  def _check_case(self, batch, num_heads, num_kv, head_dim, v_dim, dtype_name, window,
                  schedule, num_splits=2, pages_per_block=2):
    dtype = DTYPES[dtype_name]
    q, k, v, tables = _inputs(batch, num_heads, num_kv, head_dim, v_dim, dtype)
    for lengths in lengths_sets(batch, EDGES):
      dk, dtables = _dirty(k, tables, lengths, window, np.nan)
      dv, _ = _dirty(v, tables, lengths, window, np.nan)
      dk, dv = jnp.asarray(dk, dtype), jnp.asarray(dv, dtype)
      out, lse = self._kernel(q, dk, dv, dtables, lengths, window=window, schedule=schedule,
                              num_splits=num_splits, pages_per_block=pages_per_block,
                              return_lse=True)
      # The reference sees the clean pools and the full table.
      ref, ref_lse = _reference(q, jnp.asarray(k, dtype), jnp.asarray(v, dtype), tables, lengths,
                                window=window, return_lse=True)
      chex.assert_shape(out, (batch, num_heads, v_dim))
      assert out.dtype == q.dtype and lse.dtype == jnp.float32
      what = f"lengths={lengths.tolist()}"
      close(out, ref, dtype, what)
      if kvattn_ops is not None:
        xla = _xla(q, dk, dv, jnp.asarray(dtables), jnp.asarray(lengths), window=window,
                   implementation="xla")
        close(xla, ref, dtype, "xla path " + what)
      close_lse(lse, ref_lse, dtype)
      np.testing.assert_array_equal(np.asarray(out, np.float32)[lengths == 0], 0.0)

  # Interpreted by default: G = 24 > the 16-row G tile ("loop") and G = 1 ("grid"); both
  # cover every length edge (EDGES).
  @pytest.mark.parametrize("case", fast_when_interpreted(CASES, (
      (3, 48, 2, 64, 32, "bf16", 5, "loop"), (3, 8, 8, 128, 128, "bf16", None, "grid"))),
                           ids=str)
  def test_matches_reference_and_xla(self, case):
    self._check_case(*case)

  @pytest.mark.slow
  @pytest.mark.parametrize("case", SLOW_CASES, ids=str)
  def test_matches_reference_full_grid(self, case):
    self._check_case(*case)

  @pytest.mark.parametrize("schedule", fast_when_interpreted(["loop", "grid"], ["loop"]))
  def test_independent_of_pages_per_block_splits_and_tiles(self, schedule):
    # G = 48 > any G tile below: several tiles per KV head.
    q, k, v, tables = _inputs(2, 48, 1, 64, 64, jnp.float32, pages_per_seq=8, seed=3)
    k, v = jnp.asarray(k, jnp.float32), jnp.asarray(v, jnp.float32)
    lengths = np.array([77, 128], np.int32)
    base, base_lse = self._kernel(q, k, v, tables, lengths, window=70, schedule=schedule,
                                  pages_per_block=8, num_splits=1, return_lse=True)
    tiles = ([(1, 3, 16), (4, 8, 64)] if schedule == "loop" else [(1, 3, 8), (3, 8, 48)])
    for ppb, splits, block_g in tiles:
      out, lse = self._kernel(q, k, v, tables, lengths, window=70, schedule=schedule,
                              pages_per_block=ppb, num_splits=splits, block_g=block_g,
                              return_lse=True)
      what = f"pages_per_block={ppb} num_splits={splits} block_g={block_g}"
      np.testing.assert_allclose(out, base, atol=2e-6, rtol=2e-6, err_msg=what)
      np.testing.assert_allclose(lse, base_lse, atol=2e-6, rtol=2e-6, err_msg=what)

  @pytest.mark.parametrize("schedule,dtype_name,window", [
      ("loop", "f32", None), ("grid", "bf16", 2 * PAGE + 1)])
  def test_garbage_in_unused_slots_and_free_pages_does_not_leak(self, schedule, dtype_name,
                                                                window):
    dtype = DTYPES[dtype_name]
    q, k, v, tables = _inputs(3, 8, 2, 64, 64, dtype, seed=5)
    lengths = np.array([0, PAGE + 1, S - 3], np.int32)
    k, v = jnp.asarray(k, dtype), jnp.asarray(v, dtype)
    clean = self._kernel(q, k, v, tables, lengths, window=window, schedule=schedule)
    assert np.isfinite(np.asarray(clean, np.float32)).all()
    for value in (np.nan, 1e30, -np.inf):
      # From the pools the clean run saw (dtype -> f32 -> dtype is exact).
      dk, dtables = _dirty(k, tables, lengths, window, value)
      dv, _ = _dirty(v, tables, lengths, window, value)
      out = self._kernel(q, jnp.asarray(dk, dtype), jnp.asarray(dv, dtype), dtables, lengths,
                         window=window, schedule=schedule)
      # Same pages, same valid values, garbage replaced: bitwise equal.
      np.testing.assert_array_equal(np.asarray(out, np.float32),
                                    np.asarray(clean, np.float32), err_msg=str(value))

  @pytest.mark.parametrize("schedule", fast_when_interpreted(["loop", "grid"], ["grid"]))
  def test_result_independent_of_page_order(self, schedule):
    q, k, v, tables = _inputs(3, 8, 2, 64, 64, jnp.float32, seed=9)
    lengths = np.array([PAGE, 1, S - 5], np.int32)
    out = self._kernel(q, jnp.asarray(k), jnp.asarray(v), tables, lengths, schedule=schedule)
    # Move every page to a new physical position and renumber the table.
    perm = np.random.RandomState(1).permutation(k.shape[1])  # new position of page p
    inv = np.argsort(perm)
    moved = self._kernel(q, jnp.asarray(k[:, inv]), jnp.asarray(v[:, inv]), perm[tables],
                         lengths, schedule=schedule)
    np.testing.assert_array_equal(np.asarray(moved), np.asarray(out))

  @pytest.mark.parametrize("schedule", fast_when_interpreted(["loop", "grid"], ["loop"]))
  def test_work_grows_with_the_real_length(self, schedule):
    # count_pages reports the pages each program read; it must follow the
    # attended range [max(0, L - W), L), whatever the table width.
    for pages_per_seq, window in ((PAGES_PER_SEQ, None), (4 * PAGES_PER_SEQ, None),
                                  (4 * PAGES_PER_SEQ, PAGE + 3)):
      q, k, v, tables = _inputs(4, 8, 2, 64, 64, jnp.float32, pages_per_seq=pages_per_seq)
      lengths = np.array([0, 1, PAGE + 1, S], np.int32)
      _, counts = self._kernel(q, jnp.asarray(k), jnp.asarray(v), tables, lengths,
                               window=window, schedule=schedule, num_splits=3,
                               pages_per_block=1, count_pages=True)
      starts = np.asarray(attended_range(lengths, pages_per_seq * PAGE, window)[0])
      expected = -(-lengths // PAGE) - starts // PAGE
      np.testing.assert_array_equal(np.asarray(counts), np.repeat(expected[:, None], 2, 1),
                                    err_msg=f"pages_per_seq={pages_per_seq} window={window}")

  def test_lengths_past_capacity_are_clamped(self):
    q, k, v, tables = _inputs(2, 8, 2, 64, 64, jnp.float32)
    k, v = jnp.asarray(k), jnp.asarray(v)
    at_s = self._kernel(q, k, v, tables, np.array([S, 3], np.int32))
    over = self._kernel(q, k, v, tables, np.array([S + 9, 3], np.int32))
    np.testing.assert_array_equal(over, at_s)

  def test_soft_cap_matches_reference(self):
    q, k, v, tables = _inputs(2, 8, 2, 64, 64, jnp.float32, seed=4)
    q = 4.0 * q  # large logits, so the cap matters
    lengths = np.array([S, PAGE + 1], np.int32)
    out = self._kernel(q, jnp.asarray(k), jnp.asarray(v), tables, lengths, soft_cap=2.0)
    ref = _reference(q, jnp.asarray(k), jnp.asarray(v), tables, lengths, soft_cap=2.0)
    uncapped = _reference(q, jnp.asarray(k), jnp.asarray(v), tables, lengths)
    close(out, ref, jnp.float32)
    assert np.abs(np.asarray(ref) - np.asarray(uncapped)).max() > 1e-2

  def test_jitted_step_compiles_once(self):
    q, k, v, tables = _inputs(2, 8, 2, 64, 64, jnp.float32)
    k, v = jnp.asarray(k), jnp.asarray(v)

    @jax.jit
    @chex.assert_max_traces(n=1)
    def step(q, k, v, tables, lengths):
      return self._kernel(q, k, v, tables, lengths)

    first = step(q, k, v, tables, jnp.array([3, S], jnp.int32))
    second = step(q[::-1], k, v, tables[::-1], jnp.array([S, 3], jnp.int32))
    np.testing.assert_allclose(first[0], second[1], atol=1e-6)

  def _check_quantized(self, name, schedule, num_heads, num_kv, window, q_dtype_name):
    """Quantized pools: kernel == reference (which dequantizes up front) == XLA path,
    with the sequences' pages in random order; garbage in the values AND scales of
    every slot nothing attends (pages before the window, the tail of each last page,
    free pages) and moving every page to another position change nothing, bit for bit."""
    dtype, _ = FORMATS[name]
    q_dtype = DTYPES[q_dtype_name]
    self._require(pa.unsupported_reason(None, (num_kv, 1, QPAGE, 64), (num_kv, 1, QPAGE, 64),
                                        dtype))
    batch = len(QEDGES)
    q, k, v, tables = _inputs(batch, num_heads, num_kv, 64, 64, q_dtype, seed=12,
                              page_size=QPAGE)
    (kq, ks), (vq, vs) = (quantize(jnp.asarray(x, jnp.float32), name) for x in (k, v))
    lengths = np.array(QEDGES, np.int32)

    def kernel(kq, vq, tables, ks, vs):  # one compile: every call has the same shapes
      return self._kernel(q, kq, vq, tables, lengths, k_scale=ks, v_scale=vs, window=window,
                          schedule=schedule, num_splits=2, pages_per_block=2, return_lse=True)

    out, lse = kernel(kq, vq, tables, ks, vs)
    ref, ref_lse = _reference(q, kq, vq, tables, lengths, window=window, k_scale=ks, v_scale=vs,
                              return_lse=True)
    chex.assert_shape(out, (batch, num_heads, 64))
    assert out.dtype == q_dtype and lse.dtype == jnp.float32
    close(out, ref, q_dtype)
    close_lse(lse, ref_lse, q_dtype)
    np.testing.assert_array_equal(np.asarray(out[0], np.float32), 0.0)  # length 0
    dirty = []
    for pool, value in ((kq, float(junk(dtype))), (vq, float(junk(dtype))), (ks, np.nan),
                        (vs, np.nan)):
      pool_dirty, dtables = _dirty(pool, tables, lengths, window, value)
      dirty.append(jnp.asarray(pool_dirty, pool.dtype))
    dkq, dvq, dks, dvs = dirty
    dout, _ = kernel(dkq, dvq, dtables, dks, dvs)
    np.testing.assert_array_equal(np.asarray(dout, np.float32), np.asarray(out, np.float32))
    if kvattn_ops is not None:
      xla = _xla(q, dkq, dvq, jnp.asarray(dtables), jnp.asarray(lengths), window=window,
                 k_scale=dks, v_scale=dvs, implementation="xla")
      close(xla, ref, q_dtype, "xla path")
    perm = np.random.RandomState(1).permutation(kq.shape[1])  # new position of page p
    inv = np.argsort(perm)
    moved, _ = kernel(kq[:, inv], vq[:, inv], perm[tables], ks[:, inv], vs[:, inv])
    np.testing.assert_array_equal(np.asarray(moved, np.float32), np.asarray(out, np.float32))

  @pytest.mark.parametrize("case", fast_when_interpreted(QUANT_CASES, (
      ("int8", "grid", 8, 1, QPAGE + 3, "bf16"), ("e4m3", "loop", 8, 8, QPAGE + 3, "bf16"))),
                           ids=str)
  def test_quantized_pools_match_reference_and_xla(self, case):
    self._check_quantized(*case)

  @pytest.mark.slow
  @pytest.mark.parametrize("case", QUANT_SLOW_CASES, ids=str)
  def test_quantized_pools_full_grid(self, case):
    self._check_quantized(*case)


class TestPagedAttentionInterpret(TestPagedAttention):
  INTERPRET = True

  @pytest.mark.parametrize("name", [None, "int8"])
  def test_grid_schedule_under_tpu_interpreter(self, name):
    # pltpu.InterpretParams interprets with TPU semantics (VMEM/SMEM, DMAs,
    # scalar prefetch, block shapes), closer to Mosaic than the generic
    # interpreter; int8: the page pools with their [page_size, 1] scale pages.
    from jax.experimental.pallas import tpu as pltpu
    page = PAGE if name is None else QPAGE
    q, k, v, tables = _inputs(2, 8, 2, 64, 64, jnp.float32, seed=6, page_size=page)
    lengths = np.array([page + 1, page * PAGES_PER_SEQ], np.int32)
    pools = [jnp.asarray(k, jnp.float32), jnp.asarray(v, jnp.float32)]
    scales = {}
    if name is not None:
      (kq, ks), (vq, vs) = (quantize(x, name) for x in pools)
      pools, scales = [kq, vq], {"k_scale": ks, "v_scale": vs}
    dirty = {}
    for key, x in [("k", pools[0]), ("v", pools[1])] + list(scales.items()):
      value = np.nan if x.dtype != jnp.int8 else float(junk(jnp.int8))
      x_dirty, dtables = _dirty(x, tables, lengths, None, value)
      dirty[key] = jnp.asarray(x_dirty, x.dtype)
    out = pa.paged_decode_attention(
        q, dirty.pop("k"), dirty.pop("v"), dtables, lengths, schedule="grid", pages_per_block=2,
        interpret=pltpu.InterpretParams(), **dirty)
    ref = _reference(q, *pools, tables, lengths, **scales)
    close(out, ref, jnp.float32)


# ----------------------------------------------------------------------------
# Interpret-only and backend-independent checks.
# ----------------------------------------------------------------------------


def test_reference_on_hand_computed_case():
  # One head, H = 1, page_size 2. Sequence 0 owns pages [3, 1]: slot 0 -> page
  # 3 slot 0 (key 0, value [4, 0]), slot 1 -> page 3 slot 1 (key log 3, value
  # [8, 4]), slot 2 -> page 1 slot 0 (NaN, unused). Weights 1/4 and 3/4.
  k = np.full((1, 4, 2, 1), np.nan)
  v = np.full((1, 4, 2, 2), np.nan)
  k[0, 3, :, 0] = [0.0, np.log(3.0)]
  v[0, 3] = [[4.0, 0.0], [8.0, 4.0]]
  tables = np.array([[3, 1], [0, -1]], np.int32)
  q = jnp.ones((2, 1, 1))
  out, lse = pa.paged_decode_attention_reference(q, k, v, tables, np.array([2, 0]),
                                                 sm_scale=1.0, return_lse=True)
  np.testing.assert_allclose(out[0, 0], [7.0, 3.0], rtol=1e-6)
  np.testing.assert_array_equal(out[1], 0.0)
  np.testing.assert_allclose(lse[0, 0], np.log(4.0), rtol=1e-6)
  assert np.isneginf(lse[1, 0])
  out = pa.paged_decode_attention_reference(q, k, v, tables, np.array([2, 0]), sm_scale=1.0,
                                            window=1)
  np.testing.assert_allclose(out[0, 0], [8.0, 4.0], rtol=1e-6)


@pytest.mark.parametrize("pages_per_block,num_blocks", [(1, 8), (2, 4), (3, 3), (4, 5)])
def test_grid_index_map_fetches_only_needed_pages(pages_per_block, num_blocks):
  # Walk each page operand's index map (the function its BlockSpec uses) in
  # grid order: the pipeline copies a page only when the operand's index
  # differs from the previous step's, so count index changes.
  ppb, padded = pages_per_block, pages_per_block * num_blocks
  for lo, hi in [(0, 0), (0, 1), (0, padded), (2, 5), (3, 4), (padded - 1, padded)]:
    for j in range(ppb):
      visited = [int(_paging.grid_logical_page(jnp.int32(blk), j, jnp.int32(lo), jnp.int32(hi),
                                           ppb, padded)) for blk in range(num_blocks)]
      needed = [p for p in range(lo, hi) if p % ppb == j]
      copies = 1 + sum(a != b for a, b in zip(visited, visited[1:]))
      assert copies == max(len(needed), 1), (lo, hi, j, visited)
      assert all(0 <= p < padded for p in visited)
      if needed:
        assert set(visited) == set(needed), (lo, hi, j, visited)


def test_dispatch_runs_pallas_by_name_and_xla_by_default_on_cpu():
  if jax.default_backend() != "cpu" or kvattn_ops is None:
    pytest.skip("CPU dispatch policy (needs kvattn)")
  q, k, v, tables = _inputs(2, 8, 2, 64, 64, jnp.float32, seed=8)
  k, v = jnp.asarray(k), jnp.asarray(v)
  lengths = jnp.array([S - 1, PAGE], jnp.int32)
  ref = pa.paged_decode_attention_reference(q, k, v, tables, lengths)
  for impl in (None, "xla", "pallas"):
    out = kvattn_ops.paged_decode_attention(q, k, v, jnp.asarray(tables), lengths,
                                            implementation=impl)
    close(out, ref, jnp.float32, str(impl))
  assert kvattn_ops.available_implementations("paged_decode_attention")[0] == "pallas"
  # Shapes the GPU kernel cannot tile: named "pallas" refuses, None falls back to XLA.
  small_q = q[..., :12]
  small = jnp.zeros((2, k.shape[1], PAGE, 12))
  with pytest.raises(NotImplementedError, match="head dim H=12 is not a power of two"):
    kvattn_ops.paged_decode_attention(small_q, small, small, jnp.asarray(tables), lengths,
                                      implementation="pallas")
  out = kvattn_ops.paged_decode_attention(small_q, small, small, jnp.asarray(tables), lengths)
  np.testing.assert_array_equal(np.asarray(out), 0.0)


def test_validation_errors_name_the_argument():
  q, k, v, tables = _inputs(2, 8, 2, 64, 32, jnp.float32)
  k, v = jnp.asarray(k), jnp.asarray(v)
  lengths = np.array([1, 2], np.int32)
  kq, vq = jnp.zeros(k.shape, jnp.int8), jnp.zeros(v.shape, jnp.int8)
  scales = jnp.ones(k.shape[:3], jnp.float32)
  call = lambda *a, **kw: pa.paged_decode_attention(*a, **{"interpret": True, **kw})
  cases = [
      (ValueError, "q must have rank 3", (q[0], k, v, tables, lengths), {}),
      (ValueError, "num_heads must be divisible by num_kv_heads; got 8 and 3",
       (q, jnp.zeros((3,) + k.shape[1:]), jnp.zeros((3,) + v.shape[1:]), tables, lengths), {}),
      (TypeError, "k_pages and v_pages must share one dtype",
       (q, k, v.astype(jnp.bfloat16), tables, lengths), {}),
      (TypeError, "lengths must have an integer dtype", (q, k, v, tables, lengths * 1.0), {}),
      (TypeError, "block_tables must have an integer dtype",
       (q, k, v, tables * 1.0, lengths), {}),
      (ValueError, r"block_tables.shape\[0\] \(batch B, from q\) must be 2",
       (q, k, v, tables[:1], lengths), {}),
      (ValueError, r"v_pages.shape\[2\] \(page_size, from k_pages\) must be 16",
       (q, k, v[:, :, :8], tables, lengths), {}),
      (ValueError, "page_size must be a power of two for the \"loop\" schedule .*; got 12",
       (q, k[:, :, :12], v[:, :, :12], tables, lengths), {}),
      (ValueError, "page_size must be a multiple of 16 for the \"grid\" schedule and dtype "
       "bfloat16", (q, k[:, :, :8].astype(jnp.bfloat16), v[:, :, :8].astype(jnp.bfloat16),
                    tables, lengths), {"schedule": "grid"}),
      (ValueError, "pages_per_block must be a power of two", (q, k, v, tables, lengths),
       {"pages_per_block": 3}),
      (ValueError, "block_g must be a power of two >= 16", (q, k, v, tables, lengths),
       {"block_g": 8}),
      (ValueError, "schedule must be one of", (q, k, v, tables, lengths), {"schedule": "x"}),
      (ValueError, "window must be a positive int; got 0", (q, k, v, tables, lengths),
       {"window": 0}),
      (ValueError, "soft_cap must be a positive finite float", (q, k, v, tables, lengths),
       {"soft_cap": -1.0}),
      (ValueError, "num_splits must be a positive int", (q, k, v, tables, lengths),
       {"num_splits": 0}),
      (TypeError, r"k_pages has the quantized dtype int8: pass its per-slot scales k_scale "
       r"f32\[K, P, page_size\]", (q, kq, vq, tables, lengths), {}),
      (TypeError, "v_pages has the quantized dtype int8: pass its per-slot scales v_scale",
       (q, kq, vq, tables, lengths), {"k_scale": scales}),
      (TypeError, "k_scale is only for quantized caches", (q, k, v, tables, lengths),
       {"k_scale": scales, "v_scale": scales}),
      (ValueError, r"v_scale must have shape f32\[K, P, page_size\] = \(2, 11, 16\); got "
       r"\(2, 11, 8\)", (q, kq, vq, tables, lengths),
       {"k_scale": scales, "v_scale": scales[..., :8]}),
  ]
  assert_errors(call, cases, (q, k, v, tables, lengths))


def test_unsupported_reason_names_what_a_compiled_backend_cannot_take():
  pool = (2, 9, QPAGE, 64)
  for dtype in (jnp.int8, jnp.float8_e4m3fn, jnp.float8_e5m2, jnp.bfloat16):
    assert pa.unsupported_reason(None, pool, pool, dtype, platform="gpu") is None, dtype
  assert pa.unsupported_reason(None, pool, pool, jnp.int8, platform="tpu") is None
  assert "not f32/bf16/int8 on TPU" in pa.unsupported_reason(
      None, pool, pool, jnp.float8_e5m2, platform="tpu")
  assert "page_size=16 is not a multiple of 32" in pa.unsupported_reason(
      None, (2, 9, 16, 64), (2, 9, 16, 64), jnp.int8, platform="tpu")
  assert "page_size=24 is not a power of two" in pa.unsupported_reason(
      None, (2, 9, 24, 64), (2, 9, 24, 64), jnp.float32, platform="gpu")
  assert "value width Hv=8 is not a power of two >= 16" in pa.unsupported_reason(
      None, pool, (2, 9, QPAGE, 8), jnp.float32, platform="gpu")
  assert "no compiled Pallas backend on 'cpu'" in pa.unsupported_reason(
      None, pool, pool, jnp.float32, platform="cpu")
