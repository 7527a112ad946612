"""PageCodec reads a reload's rows where the host tier's `RowArena` keeps them (the jitted
update reads each run at its slots and writes it transposed), or stages them pool-major
(numpy reorders the rows while it copies them into the staging block; the jitted update
copies without a transpose): reload after spill must give bit-identical pools for every
pool layout -- f32, bf16, int8 with scale pools, the KIVI pools
(codes, f16 scales and zeros: pools of different sizes in one layer), caches of mixed dtypes
-- on one page, a run crossing a bucket size, and the whole pool, by every write path."""

import functools

import jax.numpy as jnp
import numpy as np
import pytest

from kvattn import PagedKVCache
from kvattn.caches.paged_kivi import PagedKIVICache
from kvattn.paging import offload
from kvattn.paging.offload import HostTier, PageCodec

NUM_PAGES = 13
# One page; 9 consecutive pages (bucket 12: parts of 8 and 1, past bucket 8); a run of 4 pages
# then gaps and a page listed twice (its last row wins); the whole pool (bucket 16: 8 + 4 + 1).
PAGE_LISTS = {"one": [6], "run9": list(range(2, 11)), "gaps": [12, 0, 1, 2, 3, 7, 9, 7],
              "whole": list(range(NUM_PAGES))}


def _paged(dtype, head_dim=3):
  return PagedKVCache.init(1, num_pages=NUM_PAGES, page_size=2, pages_per_seq=2, num_kv_heads=2,
                           head_dim=head_dim, dtype=dtype)


def _kivi():
  return PagedKIVICache.init_paged(1, 64, 2, 8, jnp.float32, num_pages=NUM_PAGES, page_size=32,
                                   bits=4, group_size=32, residual=32)


KINDS = {
    "f32": lambda: (_paged(jnp.float32), _paged(jnp.float32)),
    "bf16": lambda: (_paged(jnp.bfloat16), _paged(jnp.bfloat16)),
    "int8": lambda: (_paged(jnp.int8), _paged(jnp.int8)),  # + f32 scale pools: a u8 block
    "kivi": lambda: (_kivi(), _kivi()),
    # No repeating layer: f32 pools staged in u8 next to int8 and bf16 ones.
    "mixed": lambda: (_paged(jnp.float32, 5), _paged(jnp.int8), _paged(jnp.bfloat16, 4)),
}


def _random(caches, seed):
  """`caches` with every pool filled with random bits (NaNs and infinities included)."""
  rng = np.random.default_rng(seed)
  out = []
  for c in caches:
    fields = {}
    for name in c.POOL_FIELDS:
      pool = getattr(c, name)
      if pool is not None:
        raw = rng.integers(0, 256, pool.size * pool.dtype.itemsize, dtype=np.uint8)
        fields[name] = jnp.asarray(raw.view(pool.dtype).reshape(pool.shape))
    out.append(c.replace(**fields))
  return tuple(out)


def _bits(caches):
  return [np.asarray(getattr(c, n)).view(np.uint8) for c in caches for n in c.POOL_FIELDS
          if getattr(c, n) is not None]


@functools.lru_cache(maxsize=None)
def _codec(kind):
  """One codec per kind: its write programs compile once per bucket for the module."""
  return PageCodec(KINDS[kind]())


def _reload(codec, dst, pages, rows, path):
  if path in ("arena", "rows"):
    return codec.write(dst, pages, rows)
  if path == "array":
    return codec.write(dst, pages, np.stack(rows))
  if path == "staged":
    return codec.write(dst, pages, codec.stage(pages, rows, NUM_PAGES))
  handle = codec.prefetch(rows)  # "prefetch": the rows' objects, written from the block
  try:
    return codec.write(dst, pages, [handle.row(i) for i in range(len(rows))])
  finally:
    codec.release(handle)


def _spy(monkeypatch, codec):
  """Counts the calls of the codec's two updates: {"staged": ..., "arena": ...}."""
  calls = {"staged": 0, "arena": 0}
  for name, key in (("_write", "staged"), ("_write_rows", "arena")):
    def spy(*args, fn=getattr(codec, name), key=key):
      calls[key] += 1
      return fn(*args)
    monkeypatch.setattr(codec, name, spy)
  return calls


def _want(src, dst, pages):
  """The reference: `dst`'s pool bits with page q of `src` on page q for q in `pages`."""
  want = [p.copy() for p in _bits(dst)]
  for got_src, w in zip(_bits(src), want):
    w[:, pages] = got_src[:, pages]
  return want


# The fast suite: f32 and KIVI rows read from the arena on every list, mixed caches with gaps
# and the whole pool, the staging copy, the prefetch and the array paths once or twice; every
# other combination in the slow suite.
FAST = ({("f32", "arena", n) for n in PAGE_LISTS} | {("kivi", "arena", n) for n in PAGE_LISTS} |
        {("mixed", "arena", "gaps"), ("mixed", "arena", "whole"), ("f32", "rows", "run9"),
         ("kivi", "rows", "gaps"), ("f32", "prefetch", "run9"), ("kivi", "array", "whole")})


@pytest.mark.parametrize("kind, path, name", [
    pytest.param(k, p, n, marks=() if (k, p, n) in FAST else pytest.mark.slow)
    for k in KINDS for p in ("arena", "rows", "array", "staged", "prefetch") for n in PAGE_LISTS])
def test_reload_after_spill_is_bit_identical(kind, path, name, monkeypatch):
  """"arena": the tier's rows (a `RowArena`) read where they are; "rows": rows of a tier
  without an arena, through the staging block; then a stacked array, `stage`, `prefetch`."""
  pages = PAGE_LISTS[name]
  codec = _codec(kind)
  src, dst = _random(KINDS[kind](), 0), _random(KINDS[kind](), 1)
  want = _want(src, dst, pages)
  tier = HostTier(10**9, pinned=False, arena=path != "rows")
  blocks = [object() for _ in pages]
  for block, row in zip(blocks, codec.read(src, pages)):  # spill
    tier.put(block, row)
  rows = [tier.take(block) for block in blocks]  # reload
  calls = _spy(monkeypatch, codec)
  for got, w in zip(_bits(_reload(codec, dst, pages, rows, path)), want):
    np.testing.assert_array_equal(got, w)
  if path in ("arena", "rows"):
    assert calls == ({"staged": 0, "arena": 1} if path == "arena" else
                     {"staged": 1, "arena": 0})


@pytest.mark.parametrize("kind", ["f32", pytest.param("bf16", marks=pytest.mark.slow),
                                  pytest.param("int8", marks=pytest.mark.slow), "kivi",
                                  pytest.param("mixed", marks=pytest.mark.slow)])
def test_arena_rows_from_several_chunks_evicted_and_in_any_slot_order(kind, monkeypatch):
  """A tier of 2 pages (chunks of 4 slots) spilled the whole pool in shuffled order: the
  rows pushed out by LRU eviction stay valid while held (their slots are not reused), they
  span several chunks in an order unrelated to the pages', and one write of them all is
  bit-identical (one update per chunk; parts longer than a chunk are never traced)."""
  codec = _codec(kind)
  pages = PAGE_LISTS["whole"]
  order = list(np.random.default_rng(5).permutation(pages))
  src, dst = _random(KINDS[kind](), 6), _random(KINDS[kind](), 7)
  want = _want(src, dst, pages)
  read = codec.read(src, order)
  tier = HostTier(2 * codec.page_bytes, pinned=False)
  held = {}
  for page, row in zip(order, read):
    for block, payload in tier.put(page, row):  # the pages pushed out: held by us
      held[block] = payload
  for page in list(tier._items):  # pylint: disable=protected-access
    held[page] = tier.take(page)
  arena = tier.arenas[codec.page_bytes]
  assert arena.slots_per_chunk == 4 and len(arena.chunks) == 4
  del read
  for page, row in zip(order, codec.read(src, order)):  # nothing was overwritten
    np.testing.assert_array_equal(held[page], row)
  calls = _spy(monkeypatch, codec)
  for got, w in zip(_bits(codec.write(dst, pages, [held[p] for p in pages])), want):
    np.testing.assert_array_equal(got, w)
  assert calls == {"staged": 0, "arena": 4}


def test_a_reload_mixing_arena_rows_longer_rows_and_plain_rows_is_bit_identical(monkeypatch):
  """One write of rows from where they come in a real reload: page rows of the arena, pages
  riding in longer rows (a boundary state's 8 bytes after the page, in the arena of that row
  size: read from there too; 7 bytes: not a multiple of the f32 staging unit, staged) and
  plain rows (a disk page; staged). One update per arena chunk, one staged for the rest; a
  page listed twice still gets its last row."""
  codec = _codec("f32")
  pages = PAGE_LISTS["gaps"]  # page 7 twice: its last row (a plain one) wins
  src, dst = _random(KINDS["f32"](), 8), _random(KINDS["f32"](), 9)
  tier = HostTier(10**9, pinned=False)
  rows = []
  for i, row in enumerate(codec.read(src, pages)):
    block, extra = object(), (0, 8, 7, None)[i % 4]
    if extra is None:
      rows.append(np.array(row))
      continue
    tier.put(block, np.concatenate([row, np.full(extra, 7, np.uint8)]))
    rows.append(tier.take(block)[:codec.page_bytes])  # as the prefix cache unpacks them
  assert sorted(tier.arenas) == [codec.page_bytes + e for e in (0, 7, 8)]
  want = _want(src, dst, pages)
  calls = _spy(monkeypatch, codec)
  for got, w in zip(_bits(codec.write(dst, pages, rows)), want):
    np.testing.assert_array_equal(got, w)
  assert calls == {"staged": 1, "arena": 2}


def test_a_chunk_device_put_that_copies_turns_the_arena_path_off(monkeypatch):
  """Where `device_put` of a chunk does not alias it (a copy of the whole chunk), that write
  is still right and later writes stage instead."""
  codec = PageCodec(KINDS["f32"]())
  pages = PAGE_LISTS["run9"]
  src = _random(KINDS["f32"](), 10)
  tier = HostTier(10**6, pinned=False)
  blocks = [object() for _ in pages]
  for block, row in zip(blocks, codec.read(src, pages)):
    tier.put(block, row)
  rows = [tier.take(block) for block in blocks]
  put = offload.jax.device_put
  monkeypatch.setattr(offload.jax, "device_put", lambda x, *a, **k: put(np.array(x), *a, **k))
  for _ in range(2):
    dst = _random(KINDS["f32"](), 11)
    want = _want(src, dst, pages)
    for got, w in zip(_bits(codec.write(dst, pages, rows)), want):
      np.testing.assert_array_equal(got, w)
    assert not codec._arena_aliases


def test_the_two_thread_copy_stages_what_one_thread_does(monkeypatch):
  """A synchronous write of at least _SPLIT_BYTES copies half the rows on a helper thread."""
  codec = _codec("kivi")
  pages = PAGE_LISTS["whole"]
  src = _random(KINDS["kivi"](), 2)
  rows = list(codec.read(src, pages))
  one = codec.write(_random(KINDS["kivi"](), 3), pages, rows)
  monkeypatch.setattr(offload, "_SPLIT_BYTES", 0)
  two = codec.write(_random(KINDS["kivi"](), 3), pages, rows)
  assert codec._helper is not None
  for a, b in zip(_bits(one), _bits(two)):
    np.testing.assert_array_equal(a, b)


def test_the_staging_layout_follows_the_pools_of_one_layer():
  """The period is the pools of one layer (K and V; KIVI's six), the whole list when the
  layers differ; the staging unit is the narrowest pool item."""
  assert (_codec("f32")._period, _codec("f32")._unit) == (1, 4)  # K and V pools alike
  assert (_codec("bf16")._period, _codec("bf16")._unit) == (1, 2)
  assert (_codec("int8")._period, _codec("int8")._unit) == (4, 1)  # K, V, then 2 scales
  assert (_codec("kivi")._period, _codec("kivi")._unit) == (6, 1)
  assert _codec("mixed")._period == len(_codec("mixed").layouts)
  assert offload._period([]) == 1


def test_a_bucket_longer_than_the_pool_reads_and_writes_every_page(monkeypatch):
  """13 pages are a 16-row bucket: no program may trace a 16-page part of a 13-page pool
  (the jitted gather, forced here as off the host, and the update)."""
  codec = _codec("f32")
  pages = PAGE_LISTS["whole"]
  src = _random(KINDS["f32"](), 4)
  want = codec.read(src, pages)
  monkeypatch.setattr(offload, "_on_host", lambda pool: False)
  np.testing.assert_array_equal(codec.read(src, pages), want)
  for a, b in zip(_bits(codec.write(_random(KINDS["f32"](), 5), pages, want)), _bits(src)):
    np.testing.assert_array_equal(a, b)
