"""PageCodec moves runs of consecutive pages: page_runs against a numpy reference, and bit-exact
reads / writes of any page list (gaps, one page, the whole pool, reversed, repeated)."""

import functools

import numpy as np
import jax.numpy as jnp
import pytest

from kvattn import PagedKVCache
from kvattn.paging import offload
from kvattn.paging.offload import PageCodec

NUM_PAGES = 9


def _cache(seed, dtype=jnp.float32):
  c = PagedKVCache.init(1, num_pages=NUM_PAGES, page_size=2, pages_per_seq=2, num_kv_heads=2,
                        head_dim=3, dtype=dtype)
  rng = np.random.default_rng(seed)
  fields = {}
  for name in ("k_pages", "v_pages", "k_scale_pages", "v_scale_pages"):
    pool = getattr(c, name)
    if pool is not None:  # random bits: NaNs and infinities included
      raw = rng.integers(0, 256, pool.size * pool.dtype.itemsize, dtype=np.uint8)
      fields[name] = jnp.asarray(raw.view(pool.dtype).reshape(pool.shape))
  return c.replace(**fields)


@functools.lru_cache(maxsize=None)
def _codec(dtype):
  """One codec per dtype: its jitted programs compile once per bucket for the whole module."""
  return PageCodec((_cache(0, dtype), _cache(1, dtype)))


def _pools(caches):
  return [np.asarray(getattr(c, n)).view(np.uint8) for c in caches
          for n in ("k_pages", "v_pages", "k_scale_pages", "v_scale_pages")
          if getattr(c, n) is not None]


def _reference_rows(caches, pages):
  """numpy: row i = every pool's page pages[i] ([K, page_size, ...] bytes), pools in order."""
  return np.stack([np.concatenate([p[:, q].reshape(-1) for p in _pools(caches)])
                   for q in pages]).reshape(len(pages), -1)


def _reference_runs(pages):
  """numpy/Python: every page's (payload row, pool page) pair, from the parts of page_runs."""
  return sorted((i, int(q)) for i, q in enumerate(pages))


PAGE_LISTS = [[4], [0], [NUM_PAGES - 1], [2, 3, 4], [0, 1, 5, 6, 7, 3], [8, 7, 6],
              list(range(NUM_PAGES)), [1, 3, 5, 7], [5, 6, 0, 1, 2, 8]]


@pytest.mark.parametrize("pages", PAGE_LISTS + [[]])
def test_page_runs_cover_every_page_once_in_power_of_two_parts(pages):
  bucket = offload._bucket(max(1, len(pages)))
  rows, starts, counts = offload.page_runs(pages, bucket)
  covered = []
  for c, count in enumerate(counts):
    for j in range(count):
      covered += [(int(rows[c, j]) + t, int(starts[c, j]) + t) for t in range(1 << c)]
  assert sorted(covered) == _reference_runs(pages)
  # One part per set bit of each maximal run's length: runs of 3 pages are 2 + 1.
  runs = np.split(np.asarray(pages), np.flatnonzero(np.diff(pages) != 1) + 1) if pages else []
  assert counts.sum() == sum(bin(len(r)).count("1") for r in runs)


GAPS = [0, 1, 5, 6, 7, 3]
# f32 on one page, the last page, a reversed run, gaps and the whole pool; int8 (scale pools) and
# bf16 / fp8 (moved as bits) on the list with gaps; the rest of the grid in the slow suite.
FAST = ([4], [NUM_PAGES - 1], [8, 7, 6], GAPS, list(range(NUM_PAGES)))
GRID = [pytest.param(p, jnp.float32, marks=() if p in FAST else pytest.mark.slow)
        for p in PAGE_LISTS] + [
    pytest.param(p, d, marks=() if p == GAPS else pytest.mark.slow)
    for d in (jnp.int8, jnp.bfloat16, jnp.float8_e4m3fn) for p in PAGE_LISTS]


@pytest.mark.parametrize("pages, dtype", GRID)
def test_read_then_write_is_bit_exact_for_any_page_list(pages, dtype):
  src = (_cache(0, dtype), _cache(1, dtype))
  codec = _codec(dtype)
  payload = codec.read(src, pages)
  np.testing.assert_array_equal(payload, _reference_rows(src, pages))
  dst_before = (_cache(2, dtype), _cache(3, dtype))
  want = [p.copy() for p in _pools(dst_before)]
  for i, q in enumerate(pages):  # the numpy reference of the write
    row, offset = payload[i], 0
    for w in want:
      size = w[:, q].size
      w[:, q] = row[offset:offset + size].reshape(w[:, q].shape)
      offset += size
  dst = codec.write(dst_before, pages, list(payload))
  for got, w in zip(_pools(dst), want):
    np.testing.assert_array_equal(got, w)  # written pages, and every other page untouched


def test_a_page_listed_twice_gets_its_last_row_and_empty_lists_change_nothing():
  src = (_cache(0), _cache(1))
  codec = _codec(jnp.float32)
  rows = codec.read(src, [1, 2])
  assert codec.read(src, []).shape == (0, codec.page_bytes)
  dst = codec.write((_cache(5), _cache(6)), [3, 3], rows)
  np.testing.assert_array_equal(_reference_rows(dst, [3])[0], rows[1])
  same = codec.write((_cache(5), _cache(6)), [], np.zeros((0, codec.page_bytes), np.uint8))
  for a, b in zip(_pools(same), _pools((_cache(5), _cache(6)))):
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("call, match", [
    (lambda c, s: c.read(s, [NUM_PAGES]), rf"pages must lie in \[0, {NUM_PAGES}\); got \[9\]"),
    (lambda c, s: c.write(s, [-1], np.zeros((1, c.page_bytes), np.uint8)), r"got \[-1\]"),
    (lambda c, s: c.write(s, [0, 1], np.zeros((1, c.page_bytes), np.uint8)),
     r"payload must have shape \[len\(pages\), page_bytes\] = \(2, "),
    (lambda c, s: c.write(s, [0], [np.zeros(3, np.uint8)]), r"payload must be 1 rows of"),
])
def test_bad_pages_or_payloads_are_refused(call, match):
  src = (_cache(0), _cache(1))
  with pytest.raises(ValueError, match=match):
    call(_codec(jnp.float32), src)


def test_a_staged_payload_writes_what_the_direct_write_does():
  """`stage` (the copy and transfer, on any thread, before the caches are free) then `write`
  gives the same pools as one `write`; a staged payload of other pages is refused."""
  src = (_cache(0), _cache(1))
  codec = _codec(jnp.float32)
  payload = codec.read(src, GAPS)
  staged = codec.stage(GAPS, list(payload), NUM_PAGES)
  direct = codec.write((_cache(7), _cache(8)), GAPS, payload)
  for a, b in zip(_pools(codec.write((_cache(7), _cache(8)), GAPS, staged)), _pools(direct)):
    np.testing.assert_array_equal(a, b)
  with pytest.raises(ValueError, match=r"pages must be the pages staged"):
    codec.write((_cache(7), _cache(8)), [0], staged)
  with pytest.raises(ValueError, match=rf"pages must lie in \[0, {NUM_PAGES}\)"):
    codec.stage([NUM_PAGES], payload[:1], NUM_PAGES)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_the_device_read_equals_the_host_read(dtype, monkeypatch):
  """Pools off the host (an accelerator, a mesh) are read by the jitted run gather; on this
  CPU it is forced, and must give the host path's bytes (bf16 moved as bits: NaNs kept)."""
  src = (_cache(0, dtype), _cache(1, dtype))
  codec = _codec(dtype)
  want = codec.read(src, GAPS)
  monkeypatch.setattr(offload, "_on_host", lambda pool: False)
  np.testing.assert_array_equal(codec.read(src, GAPS), want)
  np.testing.assert_array_equal(want, _reference_rows(src, GAPS))


def test_page_runs_follow_the_payload_rows_given():
  """A run needs consecutive pages in consecutive rows: rows [4, 5, 0] for pages [2, 3, 4]
  is one run of 2 (rows 4-5 -> pages 2-3) and one page (row 0 -> page 4)."""
  rows, starts, counts = offload.page_runs([2, 3, 4], 8, rows=[4, 5, 0])
  assert counts.tolist() == [1, 1, 0, 0]
  assert (rows[0, 0], starts[0, 0], rows[1, 0], starts[1, 0]) == (0, 4, 4, 2)
  with pytest.raises(ValueError, match=r"rows must give one payload row per page \(3\); got 2"):
    offload.page_runs([2, 3, 4], 8, rows=[0, 1])


@pytest.mark.parametrize("pages", [[4], [8, 7, 6], GAPS, list(range(NUM_PAGES)), [3, 5, 3],
                                   list(range(1, 9))])  # 8 pages: one part of a full bucket
def test_prefetched_rows_write_what_the_direct_write_does(pages):
  """Rows from `prefetch` (copied and moved on the worker thread) are written from the staging
  block where they are, in any order and subset; a released block is reused by the next
  prefetch; repeated writes through the reused scratch block stay exact."""
  src = (_cache(0), _cache(1))
  codec = _codec(jnp.float32)
  payload = codec.read(src, pages)
  order = list(reversed(range(len(pages))))  # the handle's rows in reverse page order
  handle = codec.prefetch([payload[i] for i in order])
  rows = [handle.row(order.index(i)) for i in range(len(pages))]
  direct = codec.write((_cache(7), _cache(8)), pages, payload)
  scratch = codec._scratch
  got = codec.write((_cache(7), _cache(8)), pages, rows)
  for a, b in zip(_pools(got), _pools(direct)):
    np.testing.assert_array_equal(a, b)
  again = codec.write((_cache(7), _cache(8)), pages, list(payload))
  assert codec._scratch is scratch  # the staging block of the first write, reused
  for a, b in zip(_pools(again), _pools(direct)):
    np.testing.assert_array_equal(a, b)
  codec.release(handle)
  codec.release(handle)  # twice: nothing
  assert handle.device is None and not codec._prefetched
  assert any(b is handle._block for b in codec._free_blocks)
  free = list(codec._free_blocks)
  other = codec.prefetch([payload[0]])
  assert any(other._block is b for b in free)  # reused, not a fresh allocation
  np.testing.assert_array_equal(other.row(0), payload[0])
  with pytest.raises(ValueError, match=r"i must lie in \[0, 1\); got 1"):
    other.row(1)
  codec.release(other)
  with pytest.raises(ValueError, match="payload must be rows of page_bytes"):
    codec.prefetch([np.zeros(3, np.uint8)])
