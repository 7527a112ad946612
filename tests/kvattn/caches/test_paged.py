"""PagedKVCache and the XLA paged path: paged == dense through any page order.

Every comparison turns the paged cache back into dense arrays (or runs the
dense reference on the same tokens): page order, the unused tail of a
sequence's last page, unassigned table entries and free pages (filled with NaN
here) must never change a value (DESIGN.md, invariant 2).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvattn
from kvattn import KVCache, PagedKVCache, memory, ops
from kvattn.caches import registry as cache_factories
from kvattn.ops import xla_paged as paged_ops

PAGE = 4
CAPACITY = 5 * PAGE  # pages_per_seq = 5 in most tests

# Jitted once per shape: eager op-by-op dispatch would compile every primitive
# for every case. The eager (concrete-value) checks have their own tests.
_update = jax.jit(lambda cache, k, v, n: cache.update(k, v, n))
_dense_kv = jax.jit(lambda cache: cache.dense_kv())
_paged_decode = jax.jit(ops.paged_decode_attention, static_argnames=("window", "implementation"))
_dense_decode = jax.jit(ops.decode_attention_xla, static_argnames=("window",))


def _tokens(seed, B, T, K=2, H=8):
  return jnp.asarray(np.random.default_rng(seed).standard_normal((B, T, K, H)), jnp.float32)


def _random_tables(rng, batch, pages_per_seq, num_pages, pages_used):
  """Block tables giving sequence b `pages_used[b]` distinct random pages."""
  perm = rng.permutation(num_pages)
  tables = np.full((batch, pages_per_seq), -1, np.int32)
  at = 0
  for b, n in enumerate(pages_used):
    tables[b, :n] = perm[at:at + n]
    at += n
  return tables


def _nan_pools(cache):
  return cache.replace(k_pages=jnp.full_like(cache.k_pages, jnp.nan),
                       v_pages=jnp.full_like(cache.v_pages, jnp.nan))


@functools.partial(jax.jit, static_argnames=("num_pages",))
def _build(tables, k, v, lengths, *, num_pages):
  """NaN-filled paged cache and zero dense cache, both after one prefill."""
  batch, capacity, num_kv, head_dim = k.shape
  paged = _nan_pools(PagedKVCache.init(batch, num_pages=num_pages, page_size=PAGE,
                                       pages_per_seq=tables.shape[1], num_kv_heads=num_kv,
                                       head_dim=head_dim, block_tables=tables))
  dense = KVCache.init(batch, capacity, num_kv, head_dim)
  return paged.update(k, v, lengths), dense.update(k, v, lengths)


def _paged_and_dense(seed, lengths, *, pages_per_seq=5, K=2, H=8, extra_pages=3, perm_seed=None):
  """A paged cache (NaN everywhere but the written tokens, random page order
  drawn from `perm_seed`, default `seed`) and the dense cache holding the same
  tokens, both filled by one prefill. The pool has room for every sequence's
  whole table plus `extra_pages` pages that stay free."""
  rng = np.random.default_rng(seed if perm_seed is None else perm_seed)
  batch = len(lengths)
  num_pages = batch * pages_per_seq + extra_pages
  tables = _random_tables(rng, batch, pages_per_seq, num_pages, [-(-n // PAGE) for n in lengths])
  T = pages_per_seq * PAGE
  k, v = _tokens(seed, batch, T, K, H), _tokens(seed + 1, batch, T, K, H)
  return _build(tables, k, v, np.asarray(lengths, np.int32), num_pages=num_pages)


def _assert_same_tokens(paged, dense):
  """The first lengths[b] slots of every sequence agree exactly."""
  np.testing.assert_array_equal(np.asarray(paged.lengths), np.asarray(dense.lengths))
  pk, pv = (np.asarray(x) for x in _dense_kv(paged))
  for b, n in enumerate(np.asarray(dense.lengths)):
    np.testing.assert_array_equal(pk[b, :, :n], np.asarray(dense.k)[b, :, :n])
    np.testing.assert_array_equal(pv[b, :, :n], np.asarray(dense.v)[b, :, :n])


def test_init_shapes_and_pytree():
  c = PagedKVCache.init(3, num_pages=10, page_size=PAGE, pages_per_seq=4, num_kv_heads=2,
                        head_dim=8, dtype=jnp.bfloat16)
  assert c.k_pages.shape == c.v_pages.shape == (2, 10, PAGE, 8)
  assert c.block_tables.shape == (3, 4) and c.block_tables.dtype == jnp.int32
  assert np.all(np.asarray(c.block_tables) == kvattn.caches.paged.NO_PAGE)
  assert (c.batch, c.num_kv_heads, c.num_pages, c.page_size, c.head_dim, c.max_len) == (
      3, 2, 10, PAGE, 8, 16)
  leaves, treedef = jax.tree_util.tree_flatten(c)
  assert len(leaves) == 4
  assert isinstance(jax.tree_util.tree_unflatten(treedef, leaves), PagedKVCache)
  # The pool is what grows with token slots: 2 (k, v) * K * H * itemsize per slot.
  assert memory.measured_bytes_per_token(c) == memory.gqa_bytes_per_token(2, 8, jnp.bfloat16)


def test_init_rejects_bad_arguments():
  with pytest.raises(ValueError, match="num_pages must be a positive int; got 0"):
    PagedKVCache.init(1, num_pages=0, page_size=4, pages_per_seq=1, num_kv_heads=1, head_dim=4)
  with pytest.raises(ValueError, match=r"block_tables must have shape \[B, pages_per_seq\] = "
                     r"\(2, 3\); got \(2, 4\)"):
    PagedKVCache.init(2, num_pages=8, page_size=4, pages_per_seq=3, num_kv_heads=1, head_dim=4,
                      block_tables=np.zeros((2, 4), np.int32))
  with pytest.raises(TypeError, match="dtype must be a floating dtype"):
    PagedKVCache.init(1, num_pages=1, page_size=4, pages_per_seq=1, num_kv_heads=1, head_dim=4,
                      dtype=jnp.int32)
  cache = PagedKVCache.init(1, num_pages=1, page_size=4, pages_per_seq=1, num_kv_heads=1,
                            head_dim=4)
  with pytest.raises(TypeError, match="v_new must have a floating dtype; got int8"):
    cache.update(jnp.zeros((1, 1, 1, 4)), jnp.ones((1, 1, 1, 4), jnp.int8))


# The fast cases share one batch size (one compilation of `_build`); a length-0 sequence is
# test_padded_tokens_are_not_written_and_free_pages_untouched's. Other batch sizes: slow suite.
@pytest.mark.parametrize("lengths", [
    pytest.param([0, 0], marks=pytest.mark.slow),  # nothing written
    [PAGE, 2 * PAGE, 5 * PAGE],  # exact page multiples, up to capacity
    [1, PAGE + 1, PAGE - 1],  # one token into a fresh page; a not-quite-full page
    pytest.param([7, 13, 0, 20], marks=pytest.mark.slow),
])
def test_prefill_through_random_pages_equals_dense(lengths):
  paged, dense = _paged_and_dense(0, lengths)
  _assert_same_tokens(paged, dense)


def test_decode_steps_cross_page_boundaries_like_dense():
  # Start at lengths that put the next token at a page's last slot, at its
  # first slot (a fresh page), and mid-page; decode 6 steps one token at a time.
  paged, dense = _paged_and_dense(3, [PAGE - 1, PAGE, 2 * PAGE + 2], pages_per_seq=5)
  rng = np.random.default_rng(3)
  # Give every sequence enough pages for 6 more tokens (fresh pages after the used ones).
  tables = np.asarray(paged.block_tables).copy()
  free = sorted(set(range(paged.num_pages)) - set(tables[tables >= 0].tolist()))
  extra = iter(rng.permutation(free).tolist() + list(range(paged.num_pages, 10 ** 6)))
  num_pages = paged.num_pages
  for b, n in enumerate(np.asarray(paged.lengths)):
    for j in range(-(-int(n) // PAGE), -(-(int(n) + 6) // PAGE)):
      tables[b, j] = next(extra)
  assert tables.max() < num_pages + 3  # fits after growing the pool below
  grow = max(0, int(tables.max()) + 1 - num_pages)
  pad = jnp.full((2, grow, PAGE, 8), jnp.nan)
  paged = paged.replace(k_pages=jnp.concatenate([paged.k_pages, pad], 1),
                        v_pages=jnp.concatenate([paged.v_pages, pad], 1),
                        block_tables=jnp.asarray(tables))
  for step in range(6):
    k = _tokens(100 + step, 3, 1)
    paged, dense = _update(paged, k, -k, None), _update(dense, k, -k, None)
  _assert_same_tokens(paged, dense)


def test_padded_tokens_are_not_written_and_free_pages_untouched():
  paged, _ = _paged_and_dense(1, [3, 0])
  owned = set(np.asarray(paged.block_tables)[0, :1].tolist())
  k = np.asarray(paged.k_pages)
  for p in range(paged.num_pages):
    if p not in owned:
      assert np.all(np.isnan(k[:, p])), p  # free pages and seq 1's (no) pages untouched
  page = int(np.asarray(paged.block_tables)[0, 0])
  assert np.all(np.isnan(k[:, page, 3:]))  # the unused tail of the last page


def test_to_dense_zeroes_unassigned_pages():
  paged, dense = _paged_and_dense(2, [5, 1], pages_per_seq=3)
  d = paged.to_dense()
  assert isinstance(d, KVCache) and d.k.shape == (2, 2, 3 * PAGE, 8)
  k = np.asarray(d.k)
  assert np.all(k[0, :, 2 * PAGE:] == 0) and np.all(k[1, :, PAGE:] == 0)
  np.testing.assert_array_equal(k[0, :, :5], np.asarray(dense.k)[0, :, :5])


def test_eager_write_to_unassigned_page_raises_before_writing():
  paged, _ = _paged_and_dense(4, [PAGE, 2], pages_per_seq=3)
  with pytest.raises(ValueError, match=r"block_tables\[0, 1\] must be a page in \[0, \d+\) to "
                     r"write tokens \[4, 5\) of sequence 0; got -1"):
    paged.update(_tokens(5, 2, 1), _tokens(5, 2, 1))


def test_eager_overflow_raises():
  paged, _ = _paged_and_dense(4, [3 * PAGE, 2], pages_per_seq=3)
  with pytest.raises(ValueError, match="cache overflow"):
    paged.update(_tokens(5, 2, 1), _tokens(5, 2, 1))


def test_jit_write_to_unassigned_page_is_dropped_nothing_else_changes():
  paged, _ = _paged_and_dense(6, [PAGE, 2], pages_per_seq=3)
  before = np.asarray(paged.k_pages)
  new = jax.jit(lambda c, x: c.update(x, x))(paged, _tokens(7, 2, 1))
  after = np.asarray(new.k_pages)
  np.testing.assert_array_equal(np.asarray(new.lengths), [PAGE + 1, 3])
  # Only sequence 1's slot 2 changed; sequence 0's token had no page and was dropped.
  page1 = int(np.asarray(paged.block_tables)[1, 0])
  changed = ~((before == after) | (np.isnan(before) & np.isnan(after)))
  assert changed.any(axis=(0, 2, 3)).nonzero()[0].tolist() == [page1]
  np.testing.assert_array_equal(after[:, page1, 2], np.asarray(_tokens(7, 2, 1))[1, 0])


def test_assign_and_release_slot_under_jit_do_not_recompile():
  c = PagedKVCache.init(3, num_pages=12, page_size=PAGE, pages_per_seq=4, num_kv_heads=1,
                        head_dim=4)
  traces = []

  @jax.jit
  def assign(cache, slot, row, length):
    traces.append(1)
    return cache.assign_slot(slot, row, length)

  c = assign(c, 0, np.array([5, 2, -1, -1], np.int32), 7)
  c = assign(c, 2, np.array([1, -1, -1, -1], np.int32), 3)
  np.testing.assert_array_equal(np.asarray(c.lengths), [7, 0, 3])
  np.testing.assert_array_equal(np.asarray(c.block_tables)[0], [5, 2, -1, -1])
  assert len(traces) == 1
  c = jax.jit(lambda cache, slot: cache.release_slot(slot))(c, 0)
  np.testing.assert_array_equal(np.asarray(c.block_tables)[0], [-1] * 4)
  np.testing.assert_array_equal(np.asarray(c.lengths), [0, 0, 3])
  with pytest.raises(ValueError, match=r"pages must have shape \[pages_per_seq\] = \(4,\)"):
    c.assign_slot(0, np.zeros(3, np.int32))


@pytest.mark.parametrize("args,match", [
    ((3, [5, 2, -1, -1], 7), r"slot = 3 must lie in \[0, 2\]"),
    ((0, [5, 2, -1, -1], -1), r"length = -1 must lie in \[0, 16\]"),
    ((0, [5, 2, 3, 4], 17), r"length = 17 must lie in \[0, 16\]"),
    ((0, [5, 12, -1, -1], 7), r"pages\[0, 1\] = 12 must be a page in \[0, 12\) or NO_PAGE"),
    ((0, [5, -1, -1, -1], 7), r"pages\[0, 1\] = NO_PAGE, but row 0 holds 7 tokens"),
])
def test_eager_assign_slot_checks_the_slot_length_and_pages(args, match):
  c = PagedKVCache.init(3, num_pages=12, page_size=PAGE, pages_per_seq=4, num_kv_heads=1,
                        head_dim=4)
  slot, pages, length = args
  with pytest.raises(ValueError, match=match):
    c.assign_slot(slot, np.array(pages, np.int32), length)
  assert int(c.assign_slot(1, np.array([5, 2, -1, -1], np.int32), 7).lengths[1]) == 7


def test_contiguous_is_a_dense_drop_in():
  c = PagedKVCache.contiguous(2, 10, 2, 8, page_size=PAGE)
  assert c.max_len == 12 and c.num_pages == 6
  np.testing.assert_array_equal(np.asarray(c.block_tables), [[0, 1, 2], [3, 4, 5]])
  k = _tokens(0, 2, 10)
  paged, dense = c.update(k, k), KVCache.init(2, 12, 2, 8).update(k, k)
  _assert_same_tokens(paged, dense)


# The XLA paged decode path == dense decode on the same tokens.

# One batch size for every case, so the jitted functions compile once per head layout.
EDGES = [0, 1, PAGE - 1, PAGE, PAGE + 1, CAPACITY]  # capacity = 5 whole pages
CASES = [
    # (lengths, window)
    (EDGES, None),
    (EDGES, 3),
    ([7, 13, 20, 2, 9, 0], PAGE),
    ([2, 19, 11, 0, 16, 5], 100),
]


# Every window case on GQA (4, 2); MHA and MQA on the edge lengths without a window (the
# other windows compile once more per head layout: slow suite).
@pytest.mark.parametrize("lengths,window,num_heads,num_kv_heads", [
    (lengths, window, n, k) if (n, k) == (4, 2) or i == 0 else
    pytest.param(lengths, window, n, k, marks=pytest.mark.slow)
    for n, k in [(4, 4), (4, 2), (6, 1)] for i, (lengths, window) in enumerate(CASES)])
def test_xla_paged_decode_equals_dense(lengths, window, num_heads, num_kv_heads):
  for seed in range(2):  # two random page permutations
    paged, dense = _paged_and_dense(seed, lengths, K=num_kv_heads)
    q = jax.random.normal(jax.random.key(50 + seed), (len(lengths), num_heads, 8))
    want = _dense_decode(q, dense.k, dense.v, dense.lengths, window=window)
    for impl in ("xla", "xla_pool"):  # gather through the tables; scan the pool in place
      got = _paged_decode(q, paged.k_pages, paged.v_pages, paged.block_tables, paged.lengths,
                          window=window, implementation=impl)
      assert not np.isnan(np.asarray(got)).any(), impl
      np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6,
                                 err_msg=impl)
      for b, n in enumerate(lengths):
        if n == 0:
          assert np.all(np.asarray(got)[b] == 0)  # length-0 rows are exact zeros


def test_decode_result_independent_of_page_order_and_garbage():
  # The same tokens under two page permutations; NaN vs +-1e30 everywhere else.
  a, _ = _paged_and_dense(10, [9, 4, 17, 0, 1, 20], perm_seed=1)
  b, _ = _paged_and_dense(10, [9, 4, 17, 0, 1, 20], perm_seed=2)
  assert not np.array_equal(np.asarray(a.block_tables), np.asarray(b.block_tables))
  b = b.replace(k_pages=jnp.where(jnp.isnan(b.k_pages), 1e30, b.k_pages),
                v_pages=jnp.where(jnp.isnan(b.v_pages), -1e30, b.v_pages))
  q = jax.random.normal(jax.random.key(0), (6, 4, 8))
  out_a = _paged_decode(q, a.k_pages, a.v_pages, a.block_tables, a.lengths)
  out_b = _paged_decode(q, b.k_pages, b.v_pages, b.block_tables, b.lengths)
  np.testing.assert_allclose(np.asarray(out_a), np.asarray(out_b), rtol=1e-6, atol=1e-6)


def test_xla_path_under_jit_with_overflowed_lengths_stays_in_bounds():
  paged, dense = _paged_and_dense(0, EDGES)
  q = jax.random.normal(jax.random.key(1), (6, 4, 8))
  over = jnp.array(EDGES[:-1] + [CAPACITY + 3], jnp.int32)  # past capacity after an overflow
  want = _dense_decode(q, dense.k, dense.v, over)
  for impl in ("xla", "xla_pool"):
    got = _paged_decode(q, paged.k_pages, paged.v_pages, paged.block_tables, over,
                        implementation=impl)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6,
                               err_msg=impl)


def test_jit_overflow_into_an_unassigned_page_is_flagged_and_no_backend_reads_other_pages():
  # Sequence 0 owns page 1 only (2 slots), sequence 1 owns page 0 and holds 100s. A jitted
  # update writes 3 tokens of ones into sequence 0: the third has no page and is dropped.
  c = PagedKVCache.init(2, num_pages=4, page_size=2, pages_per_seq=3, num_kv_heads=1,
                        head_dim=16, block_tables=np.array([[1, -1, -1], [0, -1, -1]], np.int32))
  hundreds = jnp.zeros((2, 1, 1, 16)).at[1].set(100.0)
  c = c.update(hundreds, hundreds, jnp.array([0, 1]))
  c2 = jax.jit(lambda c, k: c.update(k, k, jnp.array([3, 0])))(c, jnp.ones((2, 3, 1, 16)))
  np.testing.assert_array_equal(np.asarray(c2.lengths), [3, 1])
  np.testing.assert_array_equal(np.asarray(c2.assigned_slots), [2, 2])
  np.testing.assert_array_equal(np.asarray(c2.overflowed), [True, False])  # tokens were dropped
  assert not np.asarray(c.overflowed).any()
  # Every backend reads only sequence 0's own page (the dropped token is not attended): all
  # ones, never sequence 1's 100s; sequence 1 is unaffected.
  q = jnp.ones((2, 1, 16))
  args = (q, c2.k_pages, c2.v_pages, c2.block_tables, c2.lengths)
  for impl in ("xla", "xla_pool", "pallas"):
    out = np.asarray(_paged_decode(*args, implementation=impl))
    np.testing.assert_array_equal(out[0], 1.0, err_msg=impl)
    np.testing.assert_array_equal(out[1], 100.0, err_msg=impl)
  # Eagerly the same lengths are an error, not a silent clamp.
  with pytest.raises(ValueError, match=r"block_tables\[0, 1\] must be a page in \[0, 4\) since "
                     r"sequence 0 has 3 tokens; got -1"):
    ops.paged_decode_attention(*args)
  # Past the capacity, too: flagged under jit, an error eagerly.
  full = c.replace(block_tables=jnp.array([[1, 2, 3], [0, -1, -1]], jnp.int32))
  over = jax.jit(lambda c, k: c.update(k, k, jnp.array([7, 0])))(full, jnp.ones((2, 7, 1, 16)))
  np.testing.assert_array_equal(np.asarray(over.overflowed), [True, False])
  with pytest.raises(ValueError, match=r"lengths must lie in \[0, pages_per_seq \* page_size\] = "
                     r"\[0, 6\]; got lengths\[0\] = 7"):
    ops.paged_decode_attention(q, over.k_pages, over.v_pages, over.block_tables, over.lengths)
  with pytest.raises(ValueError, match=r"lengths must lie in .* got lengths\[1\] = -1"):
    ops.paged_decode_attention(q, c.k_pages, c.v_pages, c.block_tables, jnp.array([0, -1]))


def test_jit_update_writes_nothing_past_the_first_unassigned_page():
  # Row [0, -1, 2]: only page 0's slots count; the token that would land on page 2 (after the
  # gap) is dropped too, so what attention reads (the leading pages) is all that is written.
  c = PagedKVCache.init(1, num_pages=3, page_size=2, pages_per_seq=3, num_kv_heads=1,
                        head_dim=4, block_tables=np.array([[0, -1, 2]], np.int32))
  new = jax.jit(lambda c, k: c.update(k, k))(c, jnp.ones((1, 6, 1, 4)))
  k = np.asarray(new.k_pages)
  assert np.all(k[:, 0] == 1) and np.all(k[:, 1:] == 0)
  assert bool(new.overflowed[0]) and int(new.assigned_slots[0]) == 2
  with pytest.raises(ValueError, match=r"block_tables\[0, 1\] must be a page in \[0, 3\) to write "
                     r"tokens \[0, 6\) of sequence 0; got -1"):
    c.update(jnp.ones((1, 6, 1, 4)), jnp.ones((1, 6, 1, 4)))


def test_gqa_prefill_after_a_dropped_write_never_reads_another_sequences_page():
  # Sequence 0 owns one page (4 slots) but prefills 6 tokens under jit; sequence 1 owns page 0,
  # which an unassigned entry would be clamped to. Sequence 0's outputs must not depend on
  # sequence 1's tokens (invariant 2: batch composition).
  from flax import nnx
  layer = kvattn.GroupedQueryAttention(d_model=16, num_heads=4, num_kv_heads=2, head_dim=8,
                                       rngs=nnx.Rngs(0))
  cache = PagedKVCache.init(2, num_pages=2, page_size=PAGE, pages_per_seq=2, num_kv_heads=2,
                            head_dim=8, block_tables=np.array([[1, -1], [0, -1]], np.int32))
  run = jax.jit(lambda x: layer(x, cache=cache, new_lengths=jnp.array([6, 4]))[0])
  x = jnp.asarray(np.random.default_rng(0).standard_normal((2, 6, 16)), jnp.float32)
  a = np.asarray(run(x))
  b = np.asarray(run(x.at[1].multiply(-50.0)))
  np.testing.assert_array_equal(a[0], b[0])


def test_pool_scan_is_picked_only_for_a_pool_smaller_than_the_gathered_view():
  # Right-sized pool (only the pages in use, shuffled): None picks "xla_pool" on CPU.
  lengths = np.array([9, 0, 20, 1], np.int32)
  alloc = kvattn.PageAllocator(9, PAGE, 5, seed=4)
  for b, n in enumerate(lengths):
    alloc.allocate(b, int(n))
  assert alloc.num_free == 0
  k_pages = jnp.asarray(np.random.default_rng(0).standard_normal((2, 9, PAGE, 8)), jnp.float32)
  tables = jnp.asarray(alloc.block_tables(range(4), 5))
  q = jnp.asarray(np.random.default_rng(1).standard_normal((4, 4, 8)), jnp.float32)
  args = (q, k_pages, -k_pages, tables, jnp.asarray(lengths))
  gathered = _paged_decode(*args, implementation="xla")
  picked = _paged_decode(*args)  # None: "pallas" declines on CPU, "xla_pool" takes it
  np.testing.assert_allclose(np.asarray(picked), np.asarray(gathered), rtol=1e-6, atol=1e-6)
  big = jnp.concatenate([k_pages, k_pages, k_pages], axis=1)  # 27 pages >= 4 x 5
  with pytest.raises(NotImplementedError, match="xla_pool: the pool \\(27 pages\\) is not smaller"):
    paged_ops.pool_decode(q, big, big, tables, jnp.asarray(lengths), explicit=False)


def test_dispatch_validates_before_compute():
  q = jnp.zeros((2, 4, 8))
  kp = jnp.zeros((2, 6, PAGE, 8))
  bt = jnp.zeros((2, 3), jnp.int32)
  ln = jnp.zeros((2,), jnp.int32)
  f = ops.paged_decode_attention
  with pytest.raises(ValueError, match="implementation must be one of"):
    f(q, kp, kp, bt, ln, implementation="cuda")
  with pytest.raises(ValueError, match="num_heads must be divisible by num_kv_heads; got 4 and 3"):
    f(q, jnp.zeros((3, 6, PAGE, 8)), jnp.zeros((3, 6, PAGE, 8)), bt, ln)
  with pytest.raises(ValueError, match=r"block_tables.shape\[0\] \(batch B, from q\) must be 2"):
    f(q, kp, kp, jnp.zeros((3, 3), jnp.int32), ln)
  with pytest.raises(TypeError, match="block_tables must have an integer dtype"):
    f(q, kp, kp, bt.astype(jnp.float32), ln)
  with pytest.raises(TypeError, match="k_pages and v_pages must share one dtype"):
    f(q, kp, kp.astype(jnp.bfloat16), bt, ln)
  with pytest.raises(ValueError, match=r"q.shape\[2\] \(head dim H, from k_pages\) must be 8"):
    f(jnp.zeros((2, 4, 6)), kp, kp, bt, ln)
  with pytest.raises(ValueError, match="window must be a positive int; got 0"):
    f(q, kp, kp, bt, ln, window=0)
  assert ops.available_implementations("paged_decode_attention") == ("pallas", "xla_pool", "xla")


def test_check_block_tables():
  paged_ops.check_block_tables(np.array([[0, 1], [2, -1]]), np.array([5, 2]), 3, PAGE)
  with pytest.raises(ValueError, match=r"block_tables\[1, 0\] must be a page in \[0, 3\) since "
                     r"sequence 1 has 2 tokens; got -1"):
    paged_ops.check_block_tables(np.array([[0, 1], [-1, -1]]), np.array([5, 2]), 3, PAGE)
  with pytest.raises(ValueError, match=r"must not give page 1 to two live slots; got it at "
                     r"\(0, 1\) and \(1, 0\)"):
    paged_ops.check_block_tables(np.array([[0, 1], [1, -1]]), np.array([5, 2]), 3, PAGE)
  with pytest.raises(ValueError, match=r"lengths must lie in \[0, pages_per_seq \* page_size\] = "
                     r"\[0, 8\]; got lengths\[0\] = 9"):
    paged_ops.check_block_tables(np.array([[0, 1], [2, -1]]), np.array([9, 2]), 3, PAGE)
  np.testing.assert_array_equal(
      np.asarray(paged_ops.assigned_slots(jnp.array([[0, 1], [2, -1], [-1, 1], [0, 3]]), 3, PAGE)),
      [8, 4, 0, 4])


# Model level: the GQA module and generate with paged caches.


def _tiny_model(layers=({}, {"window": 5})):
  from flax import nnx
  from kvattn.models import transformer
  cfg = transformer.model_config(d_model=32, num_layers=2, mlp_dim=64, layers=layers,
                                 attention=dict(num_heads=4, num_kv_heads=2, head_dim=8))
  return transformer.Transformer.from_config(cfg, rngs=nnx.Rngs(0))


def test_gqa_layer_through_paged_cache_equals_dense():
  from flax import nnx
  layer = kvattn.GroupedQueryAttention(d_model=16, num_heads=4, num_kv_heads=2, head_dim=8,
                                       window=6, rngs=nnx.Rngs(0))
  x = jnp.asarray(np.random.default_rng(0).standard_normal((3, 12, 16)), jnp.float32)
  prompt_lengths = jnp.array([5, 1, 8], jnp.int32)
  rng = np.random.default_rng(1)
  tables = _random_tables(rng, 3, 4, 13, [4, 4, 4])  # capacity 16 each, random pages
  paged = _nan_pools(PagedKVCache.init(3, num_pages=13, page_size=PAGE, pages_per_seq=4,
                                       num_kv_heads=2, head_dim=8, block_tables=tables))
  dense = layer.init_cache(3, 16)

  @jax.jit
  def run(cache):
    y0, cache = layer(x[:, :8], cache=cache, new_lengths=prompt_lengths)  # prefill (T = 8)
    ys = []
    for t in range(2):  # decode (T = 1): token prompt_lengths[b] + t of each stream
      xt = jnp.take_along_axis(x, (prompt_lengths + t)[:, None, None], axis=1)
      yt, cache = layer(xt, cache=cache)
      ys.append(yt[:, 0])
    return y0, jnp.stack(ys, 1), cache.lengths

  yp0, yp, lp = run(paged)
  yd0, yd, ld = run(dense)
  np.testing.assert_array_equal(np.asarray(lp), np.asarray(ld))
  np.testing.assert_allclose(np.asarray(yp), np.asarray(yd), rtol=1e-5, atol=1e-5)
  real = np.arange(8)[None, :] < np.asarray(prompt_lengths)[:, None]  # padded outputs unspecified
  np.testing.assert_allclose(np.asarray(yp0)[real], np.asarray(yd0)[real], rtol=1e-5, atol=1e-5)
  with pytest.raises(TypeError, match="cache must be a kvattn.KVCache, kvattn.PagedKVCache or "
                     "None; got dict"):
    layer(x[:, :1], cache={})


def test_generate_cache_kind_switch_gives_identical_tokens():
  from ml_collections import config_dict
  from kvattn.inference.generation import generate
  model = _tiny_model()
  rng = np.random.default_rng(0)
  prompts = rng.integers(0, 256, (3, 9)).astype(np.int32)
  lengths = np.array([9, 1, 4], np.int32)
  new = 10
  dense_tokens, dense_lengths = generate(
      model, prompts, lengths, new,
      cache_factory=cache_factories.cache_factory_from_config(
          model, config_dict.ConfigDict(dict(kind="dense", page_size=None))))
  # Paged: each sequence gets only the pages it needs, from a shuffled free list.
  cfg = config_dict.ConfigDict(dict(kind="paged", page_size=4, seed=3))
  paged_tokens, paged_lengths = generate(
      model, prompts, lengths, new,
      cache_factory=cache_factories.cache_factory_from_config(
          model, cfg, tokens_per_seq=lengths + new - 1))
  np.testing.assert_array_equal(np.asarray(paged_tokens), np.asarray(dense_tokens))
  np.testing.assert_array_equal(np.asarray(paged_lengths), np.asarray(dense_lengths))


def test_init_paged_caches_allocates_per_sequence():
  model = _tiny_model()
  caches, alloc = cache_factories.init_paged_caches(model, [9, 1, 0, 17], page_size=4,
                                                    seed=0, extra_pages=2)
  assert len(caches) == 2
  c = caches[0]
  # 3 + 1 + 0 + 5 pages for the sequences, 2 spare: the pool is what they need.
  assert c.num_pages == 11 and c.pages_per_seq == 5 and alloc.num_free == 2
  tables = np.asarray(c.block_tables)
  assert [(row >= 0).sum() for row in tables] == [3, 1, 0, 5]
  np.testing.assert_array_equal(tables, np.asarray(caches[1].block_tables))
  paged_ops.check_block_tables(tables, np.array([9, 1, 0, 17]), c.num_pages, 4)
  with pytest.raises(ValueError, match="cache.kind must be one of"):
    cache_factories.cache_factory_from_config(model, {"kind": "lru"})
  mla = _tiny_model(layers=({}, {"kind": "mla"}))
  with pytest.raises(ValueError, match="layer 1 is MultiHeadLatentAttention"):
    cache_factories.init_paged_caches(mla, [4], page_size=4)
