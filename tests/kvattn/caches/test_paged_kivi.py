"""Paged KIVI (kvattn/caches/paged_kivi.py): the dense KIVI store, in pages.

  * over shuffled pages of 3 key groups, the paged cache's stored tokens (dequantized) equal
    the dense `KIVICache`'s bit for bit, its attention outputs to f32 rounding -- a prefill chunk, then decode
    steps across page boundaries, rows at store lengths 0, 1 group, page - 1 group, a page,
    page + 1 group and capacity, a window on the decode steps;
  * garbage (codes 255, NaN scales) in every free page and unused slot changes nothing;
  * the registry builder gives each row only the pages its store tokens need;
  * overflow: an eager flush onto an unassigned page raises; under jit it is dropped and
    flagged; no Pallas kernel for the paged store.
(The conformance suite, tests/kvattn/caches/test_every_kind.py, runs paged_kivi2 / 4 under
`-m slow`: dense parity with room, donation, save / restore, bytes, rollback, speculation.)
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kvattn import memory
from kvattn.caches import registry
from kvattn.caches.kivi import KIVICache
from kvattn.caches.paged_kivi import PagedKIVICache, store_tokens
from kvattn.models import transformer
from kvattn.paging.allocator import NO_PAGE, PageAllocator

K, H, N, G, RES, PAGE = 2, 8, 4, 2, 4, 6  # pages of 3 key groups
CAPACITY = 40  # Sq = 36 store slots: 6 pages per row
# Tokens per row after the prefill chunk; the decode steps then cross group / page edges.
PREFILL = (0, 4 + G, 4 + PAGE - G, 4 + PAGE, 4 + PAGE + G, CAPACITY - 3)
STEPS = 3


def _caches(bits=4, seed=1, **settings):
  batch = len(PREFILL)
  dense = KIVICache.init(batch, CAPACITY, K, H, bits=bits, group_size=G, residual=RES,
                         **settings)
  pps = -(-dense.store_capacity // PAGE)
  pool = batch * pps + 3  # spare pages stay free (and hold garbage in `_poison`)
  alloc = PageAllocator(pool, PAGE, pps, seed=seed)
  for b in range(batch):
    alloc.allocate(b, dense.store_capacity)
  paged = PagedKIVICache.init_paged(batch, CAPACITY, K, H, num_pages=pool, page_size=PAGE,
                                    block_tables=alloc.block_tables(range(batch), pps),
                                    bits=bits, group_size=G, residual=RES, **settings)
  return dense, paged


def _poison(cache, owned_pages):
  """Codes 255 and NaN scales in every page no row owns."""
  free = ~np.isin(np.arange(cache.num_pages), owned_pages)
  free = jnp.asarray(free)[None, :, None, None]
  return cache.replace(**{
      f: jnp.where(free, jnp.asarray(255 if f.endswith("codes") else jnp.nan,
                                     getattr(cache, f).dtype), getattr(cache, f))
      for f in ("k_codes", "v_codes", "k_scale", "k_zero", "v_scale", "v_zero")})


@jax.jit
def _run(cache, q, k, v, new_lengths):
  """The prefill chunk, then STEPS decode steps (one compiled step in a scan, window 9)."""
  n = q.shape[1] - STEPS
  positions = cache.lengths[:, None] + jnp.arange(n)[None, :]
  out, cache = cache.update_attend(q[:, :n], k[:, :n], v[:, :n], positions=positions,
                                   rope_theta=1e4, new_lengths=new_lengths)
  out = jnp.where((jnp.arange(n)[None] < new_lengths[:, None])[..., None, None], out, 0)

  def step(c, x):
    qt, kt, vt = (a[:, None] for a in x)
    o, c = c.update_attend(qt, kt, vt, positions=c.lengths[:, None], rope_theta=1e4,
                           new_lengths=None, window=9)
    return c, o[:, 0]

  cache, steps = jax.lax.scan(step, cache, tuple(jnp.moveaxis(a[:, n:], 1, 0) for a in (q, k, v)))
  return jnp.concatenate([out, jnp.moveaxis(steps, 0, 1)], axis=1), cache


@pytest.mark.parametrize("bits", [4, pytest.param(2, marks=pytest.mark.slow)])  # fast: one
def test_paged_equals_dense_and_ignores_garbage(bits):
  dense, paged = _caches(bits)
  batch, t = len(PREFILL), max(PREFILL) + STEPS
  keys = jax.random.split(jax.random.key(0), 3)
  q = jax.random.normal(keys[0], (batch, t, N, H))
  k, v = (jax.random.normal(x, (batch, t, K, H)) for x in keys[1:])
  new_lengths = jnp.asarray(PREFILL, jnp.int32)
  want, dense = _run(dense, q, k, v, new_lengths)
  got, paged_after = _run(paged, q, k, v, new_lengths)
  np.testing.assert_array_equal(np.asarray(paged_after.num_quantized),
                                [0, 4, 6, 8, 10, 36])  # 0, a group, a page, + a group, full
  # The stores are equal bit for bit; the outputs to f32 rounding: paged and dense attention
  # are two programs whose reductions XLA compiles apart (an ulp apart with the suite's
  # elemental emitters, tests/conftest.py).
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)
  for a, b in zip(paged_after.dequantized(), dense.dequantized()):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  owned = np.asarray(paged.block_tables)[np.asarray(paged.block_tables) != NO_PAGE]
  dirty, _ = _run(_poison(paged, owned), q, k, v, new_lengths)
  np.testing.assert_array_equal(np.asarray(dirty), np.asarray(got))


def _model():
  cfg = transformer.model_config(d_model=32, num_layers=2, mlp_dim=64, vocab_size=64,
                                 attention=dict(kind="gqa", num_heads=N, num_kv_heads=K,
                                                head_dim=H))
  return transformer.Transformer.from_config(cfg, rngs=nnx.Rngs(0))


def test_the_builder_gives_rows_only_the_pages_their_store_tokens_need():
  spec = {"kind": "paged_kivi2", "group_size": 4, "residual": 8, "page_size": 8}
  tokens = [5, 20, 64]  # store tokens 0, 12, 56 -> 0, 2, 7 pages
  caches = registry.build_caches(_model(), 3, 64, None, spec, tokens_per_seq=tokens)
  assert [store_tokens(t, residual=8, group_size=4) for t in tokens] == [0, 12, 56]
  cache = caches[0]
  assert cache.num_pages == 9 and cache.pages_per_seq == 7
  tables = np.asarray(cache.block_tables)
  np.testing.assert_array_equal((tables != NO_PAGE).sum(axis=1), [0, 2, 7])
  assert len(set(tables[tables != NO_PAGE].tolist())) == 9  # no page given twice
  assert memory.measured_bytes_per_token(cache) == cache.analytic_bytes_per_token()
  # Against the dense KIVI store of the same batch: 9 pages instead of 3 rows of 56 slots.
  dense = registry.build_caches(_model(), 3, 64, None,
                                {"kind": "kivi2", "group_size": 4, "residual": 8})[0]
  pool_bytes = sum(a.nbytes for a in cache.storage_arrays()[:6])
  assert pool_bytes * 3 * 56 == sum(a.nbytes for a in dense.storage_arrays()[:6]) * 9 * 8


def test_overflow_onto_an_unassigned_page():
  _, paged = _caches()
  row = np.asarray(paged.block_tables[1]).copy()
  row[1:] = NO_PAGE  # row 1 holds one page: 6 store tokens, so 10 tokens in all
  paged = paged.replace(block_tables=paged.block_tables.at[1].set(row))
  k = jnp.ones((len(PREFILL), 12, K, H))
  lengths = jnp.asarray([0, 12, 0, 0, 0, 0], jnp.int32)
  with pytest.raises(ValueError, match=r"block_tables\[1, 1\] must be a page .* 8 store tokens"):
    paged.update(k, k, lengths)
  update = jax.jit(PagedKIVICache.update)
  ok = update(paged, k, k, jnp.minimum(lengths, 10))
  assert not np.asarray(ok.overflowed).any()
  over = update(paged, k, k, lengths)
  np.testing.assert_array_equal(np.asarray(over.overflowed), [0, 1, 0, 0, 0, 0])
  np.testing.assert_array_equal(np.asarray(over.readable_quantized), [0, 6, 0, 0, 0, 0])
  with pytest.raises(ValueError, match=r"block_tables\[1, 1\] = NO_PAGE"):
    over.check_state()
  q = jnp.ones((len(PREFILL), 1, N, H))
  # H = 8 and groups of 2: the kernel (GPU shapes in interpret mode too) says why not.
  with pytest.raises(NotImplementedError, match=r"pallas: head dim H=8 is not a power of two "
                                                r">= 16"):
    jax.jit(lambda c: c.attend(q, q_offsets=c.lengths - 1, implementation="pallas"))(ok)


@pytest.mark.slow  # ~20 s of interpret-mode compilation; fast: the kernel's own paged test
def test_decode_through_the_paged_kernel_equals_the_xla_loop():
  from tests.kvattn.caches import test_kivi_pallas as dense_case  # H = 16, groups of 16
  cache = dense_case._filled(4)
  pps = -(-cache.store_capacity // 32)
  alloc = PageAllocator(len(dense_case.LENGTHS) * pps + 2, 32, pps, seed=3)
  for b in range(cache.batch):
    alloc.allocate(b, cache.store_capacity)
  paged = PagedKIVICache.init_paged(
      cache.batch, cache.max_len, dense_case.K, dense_case.H, num_pages=alloc.num_pages,
      page_size=32, block_tables=alloc.block_tables(range(cache.batch), pps), bits=4,
      group_size=dense_case.G, residual=dense_case.RESIDUAL)
  rng = np.random.default_rng(0)
  k, v = (jnp.asarray(rng.standard_normal((cache.batch, cache.max_len, dense_case.K,
                                           dense_case.H)), jnp.float32) for _ in range(2))
  paged = jax.jit(PagedKIVICache.update)(paged, k, v, jnp.asarray(dense_case.LENGTHS))
  q, kn, vn = dense_case._qkv()
  options = {"window": 20, "soft_cap": 3.0}
  want = dense_case._step("xla", options)(paged, q, kn, vn)
  got = dense_case._step("pallas", options)(paged, q, kn, vn)
  for a, b in ((got[0], want[0]), (got[2], want[2])):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5, rtol=2e-5)
