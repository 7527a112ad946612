"""Offload tiers: bit-exact host and disk round trips, LRU fall-through, corruption detected."""

import functools
import os

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kvattn import PagedKVCache

from kvattn.paging import offload

from kvattn.models import transformer
from kvattn.inference.batching import ContinuousBatcher
from kvattn.inference.generation import generate
from kvattn.paging.offload import DiskTier, HostTier, PageCodec, TieredStore, make_store


class _Block:
  """A stand-in for prefix_cache.CachedBlock (the tiers only set `.tier`)."""
  tier = "device"


def _payload(seed, size=24):
  return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)


PINNED = [False, None] + ([True] if offload.pinned_host_available() else [])


@pytest.mark.parametrize("pinned", PINNED)
def test_host_tier_round_trip_is_bit_exact(pinned):
  tier = HostTier(100, pinned=pinned)
  block, data = _Block(), _payload(0)
  assert tier.put(block, data) == []
  assert tier.used_bytes == 24
  np.testing.assert_array_equal(np.asarray(tier.take(block)), data)
  assert tier.used_bytes == 0 and len(tier) == 0


def test_pinned_host_is_the_default_on_accelerators_that_offer_it():
  import jax  # pylint: disable=g-import-not-at-top
  tier = HostTier(100)
  assert tier.pinned == (offload.pinned_host_available() and jax.devices()[0].platform != "cpu")
  if offload.pinned_host_available():
    tier = HostTier(100, pinned=True)
    tier.put(b := _Block(), _payload(1))
    assert tier.take(b).sharding.memory_kind == "pinned_host"


def test_arena_rows_keep_their_slot_while_anything_references_them():
  """A taken row (or a view of it) keeps its slot: later stores go elsewhere and its bytes
  stay; the slot is reused, lowest first, once the last reference is gone."""
  tier = HostTier(3 * 24, pinned=False)
  blocks = [_Block() for _ in range(3)]
  for i, b in enumerate(blocks):
    tier.put(b, _payload(i))
  arena = tier.arenas[24]
  assert (arena.row_bytes, arena.slots_per_chunk, arena.num_held) == (24, 6, 3)
  slot = lambda row: offload._arena_slot(row)[1:]
  row = tier.take(blocks[1])
  assert slot(row) == (0, 1) and arena.num_held == 3
  view = row[:10]
  del row
  tier.put(b := _Block(), _payload(7))  # the lowest free slot: 3, not 1
  assert slot(tier.take(b)) == (0, 3)
  np.testing.assert_array_equal(view, _payload(1)[:10])
  assert arena.num_held == 3
  del view
  assert arena.num_held == 2
  tier.put(b, _payload(8))
  assert slot(tier.take(b)) == (0, 1)


def test_a_full_arena_adds_a_chunk_and_drops_it_once_free():
  tier = HostTier(24, pinned=False)  # chunks of 2 slots
  held = []
  for i in range(5):
    held.extend(p for _, p in tier.put(_Block(), _payload(i)))  # pushed out, held here
  assert len(tier) == 1 and tier.arenas[24].num_held == 5
  assert [c is not None for c in tier.arenas[24].chunks] == [True, True, True]
  assert [offload._arena_slot(p)[1:] for p in held] == [(0, 0), (0, 1), (1, 0), (1, 1)]
  np.testing.assert_array_equal(np.stack(held), np.stack([_payload(i) for i in range(4)]))
  held.clear()
  assert tier.arenas[24].num_held == 1
  assert [c is not None for c in tier.arenas[24].chunks] == [True, False, True]


def test_host_tier_arenas_per_row_size_and_plain_copies_past_them(monkeypatch):
  monkeypatch.setattr(offload, "_MAX_ARENAS", 2)
  tier = HostTier(1000, pinned=False)
  sizes = [24, 40, 24, 56]  # the third size is past _MAX_ARENAS = 2
  blocks = [_Block() for _ in sizes]
  for i, (b, size) in enumerate(zip(blocks, sizes)):
    tier.put(b, _payload(i, size))
  tier.put(c := _Block(), _payload(9).view(np.int8))  # not u8: a plain copy
  assert sorted(tier.arenas) == [24, 40]
  for i, (b, size) in enumerate(zip(blocks, sizes)):
    got = tier.take(b)
    np.testing.assert_array_equal(got, _payload(i, size))
    where = offload._arena_slot(got)
    assert (where is None) == (size == 56)
    if where is not None:
      assert where[0] is tier.arenas[size]
  got = tier.take(c)
  assert offload._arena_slot(got) is None and got.dtype == np.int8
  plain = HostTier(1000, pinned=False, arena=False)
  plain.put(c, _payload(0))
  assert plain.arenas == {} and offload._arena_slot(plain.take(c)) is None


def test_disk_tier_round_trip_is_bit_exact_and_removes_its_file(tmp_path):
  tier = DiskTier(tmp_path, 100)
  block, data = _Block(), _payload(2)
  tier.put(block, data)
  path = tier.path_of(block)
  assert os.path.getsize(path) == 24
  np.testing.assert_array_equal(tier.take(block), data)
  assert not os.path.exists(path)


@pytest.mark.parametrize("damage", ["delete", "flip", "truncate"])
def test_a_deleted_or_corrupted_disk_page_is_a_miss(damage, tmp_path):
  tier = DiskTier(tmp_path, 100)
  block = _Block()
  tier.put(block, _payload(3))
  path = tier.path_of(block)
  if damage == "delete":
    os.remove(path)
  elif damage == "flip":
    raw = bytearray(open(path, "rb").read())
    raw[5] ^= 1
    open(path, "wb").write(bytes(raw))
  else:
    open(path, "wb").write(b"xx")
  assert tier.take(block) is None
  assert tier.used_bytes == 0


def test_a_full_tier_pushes_its_least_recent_pages_down_and_the_last_drops(tmp_path):
  dropped = []
  store = TieredStore([HostTier(48), DiskTier(tmp_path, 48)])
  store.on_drop = dropped.append
  blocks = [_Block() for _ in range(6)]
  for i, b in enumerate(blocks):
    store.put(b, _payload(i))
  # 24-byte pages, 2 per tier: the newest two in host, the two before on disk, the rest dropped.
  assert [b.tier for b in blocks] == ["dropped", "dropped", "disk", "disk", "host", "host"]
  assert dropped == blocks[:2]
  assert store.used_bytes() == {"host": 48, "disk": 48}
  np.testing.assert_array_equal(np.asarray(store.take(blocks[2])), _payload(2))
  np.testing.assert_array_equal(np.asarray(store.take(blocks[5])), _payload(5))
  assert store.take(blocks[0]) is None
  # A page larger than a tier goes straight to the next one.
  big = _Block()
  store.put(big, _payload(9, 60))
  assert dropped[-1] is big


def test_zero_capacity_passes_everything_through(tmp_path):
  store = TieredStore([HostTier(0), DiskTier(tmp_path, 100)])
  b = _Block()
  store.put(b, _payload(0))
  assert b.tier == "disk"


@pytest.mark.parametrize("call,match", [
    (lambda d: make_store("ssd"), "prefix_cache must be one of"),
    (lambda d: make_store("host", host_bytes=-1), "host_bytes must be an int number of bytes"),
    (lambda d: make_store("disk", host_bytes=10, disk_bytes=10), "directory must be given"),
    (lambda d: HostTier(1.5), "capacity_bytes must be an int"),
    (lambda d: DiskTier(d, -3), "capacity_bytes must be an int"),
    (lambda d: TieredStore([]), "at least one"),
    (lambda d: TieredStore([HostTier(1), HostTier(2)]), "distinct names"),
    (lambda d: offload.RowArena(0, 10), "row_bytes must be >= 1"),
] + ([(lambda d: HostTier(1, pinned=True, arena=True), "arena must be False or None")]
     if offload.pinned_host_available() else []))
def test_bad_tier_settings_are_refused(call, match, tmp_path):
  with pytest.raises(ValueError, match=match):
    call(tmp_path)


def test_make_store_modes(tmp_path):
  assert make_store("off") is None and make_store("device") is None
  assert [t.name for t in make_store("host", host_bytes=8).tiers] == ["host"]
  assert [t.name for t in make_store("disk", directory=tmp_path).tiers] == ["host", "disk"]


# f32 (values only) and int8 (values + scale pages) in the fast suite.
@pytest.mark.parametrize("dtype", [jnp.float32, pytest.param(jnp.bfloat16, marks=pytest.mark.slow),
                                   jnp.int8, pytest.param(jnp.float8_e4m3fn,
                                                          marks=pytest.mark.slow)])
def test_page_codec_round_trip_is_bit_exact(dtype):
  def cache(seed):
    c = PagedKVCache.init(1, num_pages=6, page_size=4, pages_per_seq=2, num_kv_heads=2,
                          head_dim=3, dtype=dtype)
    rng = np.random.default_rng(seed)
    fields = {}
    for name in ("k_pages", "v_pages", "k_scale_pages", "v_scale_pages"):
      pool = getattr(c, name)
      if pool is not None:
        raw = rng.integers(0, 256, pool.size * pool.dtype.itemsize, dtype=np.uint8)
        fields[name] = jnp.asarray(raw.view(pool.dtype).reshape(pool.shape))
    return c.replace(**fields)

  src = (cache(0), cache(1))
  codec = PageCodec(src)
  payload = codec.read(src, [4, 1])
  per_slot = 2 * 2 * 3 * jnp.dtype(dtype).itemsize + (2 * 2 * 4 if dtype == jnp.int8 or
                                                      dtype == jnp.float8_e4m3fn else 0)
  assert payload.shape == (2, 2 * 4 * per_slot) and payload.dtype == jnp.uint8
  dst = codec.write((cache(2), cache(3)), [0, 5], [np.asarray(payload[0]),
                                                   np.asarray(payload[1])])
  for s, d in zip(src, dst):
    for name in ("k_pages", "v_pages", "k_scale_pages", "v_scale_pages"):
      a, b = getattr(s, name), getattr(d, name)
      if a is None:
        continue
      bits = lambda x: np.asarray(x).view(f"u{x.dtype.itemsize}")
      np.testing.assert_array_equal(bits(b[:, 0]), bits(a[:, 4]))
      np.testing.assert_array_equal(bits(b[:, 5]), bits(a[:, 1]))


# The batcher with offload: generation equals the run without.

PS, MAX_PROMPT, MAX_NEW = 4, 16, 4


@functools.lru_cache(maxsize=None)
def _model():
  cfg = transformer.model_config(d_model=32, num_layers=2, mlp_dim=64,
                                 attention=dict(num_heads=4, num_kv_heads=2, head_dim=8))
  return transformer.Transformer.from_config(cfg, rngs=nnx.Rngs(0))


@functools.lru_cache(maxsize=None)
def _alone(prompt):
  padded = np.zeros((1, MAX_PROMPT), np.int32)
  padded[0, :len(prompt)] = prompt
  tokens, _ = generate(_model(), padded, np.array([len(prompt)], np.int32), MAX_NEW)
  return tuple(np.asarray(tokens)[0].tolist())


def _requests():
  """Two system prompts alternating; the small pool evicts one while the other runs."""
  rng = np.random.default_rng(3)
  systems = [rng.integers(0, 256, 12).astype(np.int32) for _ in range(2)]
  return [(f"r{i}", np.concatenate([systems[i % 2], rng.integers(0, 256, 2).astype(np.int32)]),
           MAX_NEW) for i in range(6)]


def _batcher(store):
  # 6 pages: one request (14 + 4 - 1 tokens) holds 5, so the next one evicts the other prefix.
  return ContinuousBatcher(_model(), num_slots=1, num_pages=6, page_size=PS,
                           max_len=MAX_PROMPT + MAX_NEW, max_prompt_len=MAX_PROMPT, seed=0,
                           prefix_cache=True, offload=store)


def _serve(batcher):
  out = {}
  for rid, prompt, n in _requests():
    out.update(batcher.run([(rid, prompt, n)]))
  return out


# Intact disk pages are reloaded in test_a_corrupted_disk_prefix_is_recomputed_never_served
# (r2 reuses r0's prefix from disk) too: the "disk" case here is in the slow suite.
@pytest.mark.parametrize("mode", ["device", "host",
                                  pytest.param("disk", marks=pytest.mark.slow)] + (
    [pytest.param("pinned", marks=pytest.mark.slow)] if offload.pinned_host_available() else []))
def test_generation_with_offload_equals_generation_without(mode, tmp_path):
  if mode == "pinned":
    store = TieredStore([HostTier(10**6, pinned=True)])
  else:
    store = make_store(mode, host_bytes=10**6 if mode == "host" else 0, disk_bytes=10**6,
                       directory=tmp_path)
  batcher = _batcher(store)
  out = _serve(batcher)
  for rid, prompt, _ in _requests():
    assert tuple(out[rid].tokens.tolist()) == _alone(tuple(prompt.tolist())), rid
  counters = batcher.allocator.counters
  assert counters["evictions"] > 0
  total = sum(len(p) for _, p, _ in _requests())
  if mode == "device":  # evicted prefixes are recomputed
    assert batcher.prefill_tokens > total - 4 * 12
  else:  # every evicted prefix came back from the tier: r2..r5 reuse 3 pages each
    assert counters["pages_offloaded"] > 0 and counters["pages_reloaded"] > 0
    assert batcher.prefill_tokens == total - 4 * 12
  batcher.allocator.check()


def test_a_corrupted_disk_prefix_is_recomputed_never_served(tmp_path):
  store = make_store("disk", host_bytes=0, disk_bytes=10**6, directory=tmp_path)
  batcher = _batcher(store)
  requests = _requests()
  out = batcher.run(requests[:3])  # r0 and r2 share system 0, evicted to disk by r1
  disk = store.tiers[1]
  assert len(disk) > 0
  for name in os.listdir(tmp_path):  # every page on disk gets garbage of the right size
    path = os.path.join(tmp_path, name)
    size = os.path.getsize(path)
    open(path, "wb").write(b"\x7f" * size)
  before = batcher.prefill_tokens
  out.update(batcher.run(requests[3:]))
  for rid, prompt, _ in requests:
    assert tuple(out[rid].tokens.tolist()) == _alone(tuple(prompt.tolist())), rid
  assert batcher.allocator.counters["offload_misses"] > 0
  assert batcher.prefill_tokens - before > sum(len(p) for _, p, _ in requests[3:]) - 3 * 12
  batcher.allocator.check()


def test_offload_needs_the_prefix_cache():
  with pytest.raises(ValueError, match="offload needs prefix_cache=True"):
    ContinuousBatcher(_model(), num_slots=1, num_pages=9, page_size=PS, max_len=20,
                      max_prompt_len=16, offload=make_store("host", host_bytes=100))


# Prefetch: the next request's offloaded pages staged while the current one decodes.


def test_prefetched_pages_give_the_same_tokens_and_a_cancelled_prefetch_leaks_nothing():
  """`run` with a queue prefetches the head's offloaded prefix while the live request decodes
  (one slot: r2 waits for r1, which pushed r0's system prompt to the host tier); a prefetch
  cancelled, or one whose request joins with another prompt, puts every page back."""
  store = make_store("host", host_bytes=10**6)
  batcher = _batcher(store)
  requests = _requests()
  out = batcher.run(requests[:3])
  for rid, prompt, _ in requests[:3]:
    assert tuple(out[rid].tokens.tolist()) == _alone(tuple(prompt.tolist())), rid
  assert store.moves[("host", "prefetch")] > 0
  assert store.moves[("prefetch", "device")] > 0  # r2's join took the staged rows
  assert batcher.prefill_tokens == sum(len(p) for _, p, _ in requests[:3]) - 12
  assert store.num_prefetched == 0 and not batcher._prefetches and not batcher._codec._prefetched
  batcher.allocator.check()
  # r3 shares r1's system prompt, which r2 pushed to the host tier.
  held = (len(store.tiers[0]), store.used_bytes(), batcher.allocator.cached_blocks())
  r3 = requests[3]
  k = batcher.prefetch("r3", r3[1])
  assert k >= 1 and store.num_prefetched == k and len(store.tiers[0]) == held[0] - k
  assert batcher.prefetch("r3", r3[1]) == k  # a second prefetch replaces the first
  assert batcher.cancel_prefetch("r3") and not batcher.cancel_prefetch("r3")
  assert (len(store.tiers[0]), store.used_bytes(), batcher.allocator.cached_blocks()) == held
  assert store.num_prefetched == 0 and not batcher._codec._prefetched
  batcher.allocator.check()
  # A prefetch whose request joins with another prompt: its pages go back to the tier...
  batcher.prefetch("x", r3[1])
  out = batcher.run([("x", requests[4][1], MAX_NEW)])
  assert tuple(out["x"].tokens.tolist()) == _alone(tuple(requests[4][1].tolist()))
  assert store.num_prefetched == 0 and batcher.allocator.cached_blocks().get("host", 0) >= k
  # ... and still serve, bit-exact, a later join.
  before = batcher.allocator.counters["pages_reloaded"]
  out = batcher.run([r3])
  assert tuple(out["r3"].tokens.tolist()) == _alone(tuple(r3[1].tolist()))
  assert batcher.allocator.counters["pages_reloaded"] >= before + k
  batcher.allocator.check()
  with pytest.raises(TypeError, match="prompt must be a 1-D sequence of int token ids"):
    batcher.prefetch("y", np.zeros((2, 3), np.int32))


def test_a_prefetch_without_offloaded_pages_stages_nothing():
  batcher = _batcher(make_store("host", host_bytes=10**6))
  assert batcher.prefetch("r0", _requests()[0][1]) == 0
  assert not batcher._prefetches
  plain = _batcher(None)
  assert plain.prefetch("r0", _requests()[0][1]) == 0
