"""One prefix cache for several workers (`kvattn.paging.shared`): a page worker A published is
a hit for worker B with the tokens of a plain `generate`; racing writers leave only whole,
verified files; a damaged file or another namespace is a miss and a recompute, never a page."""

import functools
import os
import threading

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kvattn.inference.batching import ContinuousBatcher
from kvattn.inference.generation import generate
from kvattn.models import transformer
from kvattn.paging.offload import HostTier, TieredStore
from kvattn.paging.prefix import PrefixCachingAllocator, page_digest
from kvattn.paging.shared import SharedPrefixStore, decode_page, encode_page, namespace

PS, MAX_PROMPT, MAX_NEW = 4, 20, 4
PREFIX = 13  # 3 full pages shared; the 4th page differs by the suffix


@functools.lru_cache(maxsize=None)
def _model(seed=0):
  cfg = transformer.model_config(d_model=32, num_layers=2, mlp_dim=64,
                                 attention=dict(num_heads=4, num_kv_heads=2, head_dim=8))
  return transformer.Transformer.from_config(cfg, rngs=nnx.Rngs(seed))


@functools.lru_cache(maxsize=None)
def _alone(prompt, seed=0):
  padded = np.zeros((1, MAX_PROMPT), np.int32)
  padded[0, :len(prompt)] = prompt
  tokens, _ = generate(_model(seed), padded, np.array([len(prompt)], np.int32), MAX_NEW)
  return tuple(np.asarray(tokens)[0].tolist())


def _prompts(seed=5):
  """Three 16-token prompts sharing their first 13 tokens (3 full pages)."""
  rng = np.random.default_rng(seed)
  prefix = rng.integers(3, 250, PREFIX).astype(np.int32)
  return [np.concatenate([prefix, rng.integers(3, 250, 3).astype(np.int32)]) for _ in range(3)]


def _worker(directory, seed=0, num_pages=12, local=None, programs_of=None):
  """A batcher over the shared `directory`. `programs_of`: a batcher of the same model and
  shapes whose compiled programs it runs (the batcher jits its programs per instance; sharing
  them saves the fast suite a compile, and changes nothing the test checks)."""
  ns = namespace(_model(seed), page_size=PS, dtype=jnp.float32)
  b = ContinuousBatcher(_model(seed), num_slots=1, num_pages=num_pages, page_size=PS,
                        max_len=MAX_PROMPT + MAX_NEW, max_prompt_len=MAX_PROMPT,
                        prefix_cache=True, offload=SharedPrefixStore(directory, ns, local=local))
  if programs_of is not None:
    for name in ("_join", "_step", "_set_row", "_release"):
      setattr(b, name, getattr(programs_of, name))
  return b


def _serve(batcher, rid, prompt, seed=0):
  out = batcher.run([(rid, prompt, MAX_NEW)])[rid]
  assert tuple(out.tokens.tolist()) == _alone(tuple(prompt.tolist()), seed), rid
  batcher.allocator.check()
  return out


def test_worker_b_hits_the_prefix_worker_a_published_with_the_tokens_of_generate(tmp_path):
  a = _worker(tmp_path)
  b = _worker(tmp_path, programs_of=a)
  first, second, third = _prompts()
  _serve(a, "a", first)
  store_a = a.allocator.offload
  # Its 4 prompt pages at join, then none (16 + 3 tokens: the decode filled no page).
  assert store_a.counters["published"] == 4 == len(store_a.files())
  assert all(store_a.verify(f) for f in store_a.files())
  _serve(b, "b", second)  # tokens equal generate's (asserted in _serve)
  alloc = b.allocator
  assert alloc.counters["shared_pages"] == 3 and alloc.counters["cached_tokens"] == 12
  assert b.prefill_tokens == len(second) - 12  # only the suffix was computed
  assert alloc.offload.counters["hits"] == 3
  # B's own pages are indexed now: its next request hits locally, reading no file.
  _serve(b, "b2", third)
  assert alloc.offload.counters["hits"] == 3 and alloc.counters["cached_tokens"] == 24
  assert b.prefill_tokens == len(second) + len(third) - 24
  # A shared page is written once: the files are A's and B's new pages.
  assert len(store_a.files()) == 4 + alloc.offload.counters["published"]

  # A damaged file: a miss from that page on, recomputed with the same tokens.
  first, second, _ = _prompts(seed=6)
  _serve(a, "c", first)
  key0 = page_digest(b"", first[:PS])
  path = store_a.path_of(page_digest(key0, first[PS:2 * PS]))
  data = bytearray(open(path, "rb").read())
  data[len(data) // 2] ^= 1  # one bit of the second page's payload
  open(path, "wb").write(bytes(data))
  assert not store_a.verify(path)
  before = b.prefill_tokens
  _serve(b, "d", second)
  assert alloc.offload.counters["corrupt"] == 1 and alloc.counters["offload_misses"] == 1
  assert alloc.counters["shared_pages"] == 3 + 1  # the first page only; the rest recomputed
  assert b.prefill_tokens - before == len(second) - PS
  # The bad file was removed and B's recompute published a good one in its place.
  assert store_a.verify(path) and all(store_a.verify(f) for f in store_a.files())


@pytest.mark.slow  # two more batchers to compile (~10 s each on a loaded 2-core VM)
@pytest.mark.parametrize("local", [None, "host"])
def test_an_evicted_page_comes_back_from_the_shared_store_or_the_local_tier(tmp_path, local):
  # 6 pages: one request (15 + 4 - 1 tokens: 5 pages) evicts the other prefix.
  tier = TieredStore([HostTier(10**6)]) if local else None
  b = _worker(tmp_path, num_pages=6, local=tier)
  rng = np.random.default_rng(9)
  other = rng.integers(3, 250, 14).astype(np.int32)
  first, second, _ = _prompts()
  _serve(b, "p", first)
  _serve(b, "q", other)  # evicts first's pages (dropped: they are in the directory)
  alloc = b.allocator
  assert alloc.counters["evictions"] > 0
  _serve(b, "r", second)
  if local:  # from the host tier, never read back from a file
    assert alloc.counters["pages_offloaded"] > 0 and alloc.offload.counters["hits"] == 0
    assert alloc.counters["pages_reloaded"] > 0 and alloc.counters["shared_pages"] == 0
  else:  # no device read on eviction; the evicted pages come back from the directory
    assert alloc.counters["pages_offloaded"] == 0
    assert alloc.counters["shared_pages"] == alloc.offload.counters["hits"] > 0
  assert b.prefill_tokens == len(first) + len(other) + len(second) - 12


@pytest.mark.parametrize("change", ["weights", "dtype", "page_size", "cache", "weights_id"])
def test_another_model_dtype_page_size_or_kind_has_another_namespace(change):
  base = dict(page_size=PS, dtype=jnp.float32)
  ns = namespace(_model(0), **base)
  assert ns == namespace(_model(0), **base) and len(ns) == 32
  other = {"weights": lambda: namespace(_model(1), **base),
           "dtype": lambda: namespace(_model(0), page_size=PS, dtype=jnp.bfloat16),
           "page_size": lambda: namespace(_model(0), page_size=8, dtype=jnp.float32),
           "cache": lambda: namespace(_model(0), **base, cache={"kind": "paged_kivi4"}),
           "weights_id": lambda: namespace(_model(0), **base, weights_id="ckpt-1")}[change]()
  assert other != ns


@pytest.mark.slow  # a second model's programs to compile
def test_a_worker_of_another_model_never_reads_the_pages(tmp_path):
  a, b = _worker(tmp_path, seed=0), _worker(tmp_path, seed=1)
  first, second, _ = _prompts()
  _serve(a, "a", first)
  # Even a page file copied into B's namespace under the right key is refused (its header
  # names A's namespace).
  src, dst = a.allocator.offload, b.allocator.offload
  for path in src.files():
    target = os.path.join(dst.root, os.path.relpath(path, src.root))
    os.makedirs(os.path.dirname(target), exist_ok=True)
    open(target, "wb").write(open(path, "rb").read())
  _serve(b, "b", second, seed=1)
  assert dst.counters["hits"] == 0 and dst.counters["corrupt"] == 1
  assert b.allocator.counters["shared_pages"] == 0 and b.prefill_tokens == len(second)


def test_every_damage_to_a_page_file_is_detected():
  ns, key, tokens = b"n" * 32, b"k" * 32, np.arange(PS, dtype=np.int32)
  payload = np.random.default_rng(0).integers(0, 256, 40, dtype=np.uint8)
  data = encode_page(ns, key, tokens, payload)
  np.testing.assert_array_equal(decode_page(data, ns, key, tokens), payload)
  assert decode_page(data, b"m" * 32, key, tokens) is None  # another namespace
  assert decode_page(data, ns, b"j" * 32, tokens) is None  # another key
  assert decode_page(data, ns, key, tokens + 1) is None  # other tokens
  for i in range(0, len(data), 7):  # any byte, header, tokens, payload or checksum
    bad = bytearray(data)
    bad[i] ^= 0x10
    assert decode_page(bytes(bad), ns, key, tokens) is None, i
  for cut in (0, 10, len(data) - 1):
    assert decode_page(data[:cut], ns, key, tokens) is None
  assert decode_page(data + b"\0", ns, key, tokens) is None


def test_racing_writers_of_the_same_pages_leave_only_whole_verified_files(tmp_path):
  stores = [SharedPrefixStore(tmp_path, "race") for _ in range(3)]
  rng = np.random.default_rng(1)
  pages = [(bytes([i]) * 32, rng.integers(0, 99, PS).astype(np.int32),
            rng.integers(0, 256, 64 * 1024, dtype=np.uint8)) for i in range(6)]
  stop, seen, errors = threading.Event(), [], []

  def write(store):
    for _ in range(25):
      for key, tokens, payload in pages:
        store.write(key, tokens, payload)

  def read(store):
    while not stop.is_set():
      for key, tokens, payload in pages:
        got = store.read(key, tokens)
        if got is not None:
          seen.append(key)
          if not np.array_equal(got, payload):
            errors.append(key)

  reader = threading.Thread(target=read, args=(stores[2],))
  reader.start()
  writers = [threading.Thread(target=write, args=(s,)) for s in stores[:2]]
  for t in writers:
    t.start()
  for t in writers:
    t.join()
  stop.set()
  reader.join()
  assert not errors and seen  # every read verified and equal to what was written
  assert stores[2].counters["corrupt"] == 0
  assert stores[0].counters["published"] + stores[1].counters["published"] == 2 * 25 * 6
  files = stores[0].files()
  assert len(files) == 6 and all(stores[0].verify(f) for f in files)
  leftovers = [n for _, _, names in os.walk(stores[0].root) for n in names if n.endswith(".tmp")]
  assert leftovers == []


def test_match_looks_in_the_shared_store_without_changing_the_index(tmp_path):
  store = SharedPrefixStore(tmp_path, "n1")
  payload = lambda page: np.full((1, 8), page, np.uint8)
  a = PrefixCachingAllocator(8, PS, offload=store)
  a.bind_device(lambda pages: np.concatenate([payload(p) for p in pages]), None)
  a.allocate_prompt("x", list(range(1, 10)))
  assert a.register("x", list(range(1, 10))) == 2 and len(store.files()) == 2
  writes = []
  b = PrefixCachingAllocator(8, PS, offload=SharedPrefixStore(tmp_path, "n1"))
  b.bind_device(None, lambda pages, rows: writes.append((list(pages), np.stack(rows))))
  assert b.match(list(range(1, 10))) == 8 and b.cached_blocks() == {}
  assert b.allocate_prompt("y", list(range(1, 9)) + [0, 0]) == 8
  (pages, rows), = writes
  np.testing.assert_array_equal(rows[:, 0], [a.pages("x")[0], a.pages("x")[1]])
  assert pages == list(b.pages("y")[:2]) and b.cached_blocks() == {"device": 2}
  b.check()
  # A store in another namespace over the same directory sees nothing.
  c = PrefixCachingAllocator(8, PS, offload=SharedPrefixStore(tmp_path, "n2"))
  assert c.match(list(range(1, 10))) == 0


def test_prune_keeps_the_newest_pages_and_removes_stale_temporaries(tmp_path):
  store = SharedPrefixStore(tmp_path, "p")
  tokens = np.zeros(PS, np.int32)
  for i in range(4):
    store.write(bytes([i]) * 32, tokens, np.zeros(100, np.uint8))
    os.utime(store.path_of(bytes([i]) * 32), (1000 + i, 1000 + i))
  size = os.path.getsize(store.files()[0])
  stale = os.path.join(os.path.dirname(store.path_of(b"\0" * 32)), ".x.1.y.tmp")
  open(stale, "wb").close()
  os.utime(stale, (1, 1))
  assert store.prune(2 * size) == 3  # two oldest pages and the temporary
  assert [store.contains(bytes([i]) * 32) for i in range(4)] == [False, False, True, True]
  assert not os.path.exists(stale)


def test_a_page_that_cannot_be_written_is_counted_and_nothing_is_left(tmp_path):
  store = SharedPrefixStore(tmp_path, "ro")
  key = b"\1" * 32
  open(os.path.dirname(store.path_of(key)), "wb").close()  # a file where its folder goes
  assert not store.write(key, np.zeros(PS, np.int32), np.zeros(8, np.uint8))
  assert not store.write(key, np.zeros(PS, np.int32), np.zeros(8, np.uint8))
  assert store.counters["write_errors"] == 2 and store.files() == []
  assert store.read(key, np.zeros(PS, np.int32)) is None and store.counters["missing"] == 1


@pytest.mark.parametrize("call,match", [
    (lambda d: SharedPrefixStore(d, ""), "ns must be a non-empty string"),
    (lambda d: SharedPrefixStore(d, "../up"), "ns must be a non-empty string"),
    (lambda d: SharedPrefixStore(d, 7), "ns must be a non-empty string"),
    (lambda d: SharedPrefixStore(d, "ok", local=object()), "local must be a"),
    (lambda d: SharedPrefixStore(d, "ok").prune(-1), "max_bytes must be an int >= 0"),
    (lambda d: namespace(_model(), page_size=0, dtype=jnp.float32), "page_size must be an int"),
    (lambda d: namespace(_model(), page_size=True, dtype=jnp.float32), "page_size must be"),
    (lambda d: namespace(object(), page_size=4, dtype=jnp.float32), "model must have .layers"),
])
def test_bad_arguments_are_refused(call, match, tmp_path):
  with pytest.raises(ValueError, match=match):
    call(tmp_path)



def test_an_evicted_published_page_is_forgotten_without_a_read_and_found_again(tmp_path):
  reads = []
  a = PrefixCachingAllocator(3, PS, offload=SharedPrefixStore(tmp_path, "e"))
  a.bind_device(lambda pages: reads.append(list(pages)) or np.zeros((len(pages), 8), np.uint8),
                lambda pages, rows: None)
  a.allocate_prompt("x", list(range(1, 10)))
  a.register("x", list(range(1, 10)))
  a.free("x")
  assert len(reads) == 1 and len(reads[0]) == 2  # the publish: one read of both pages
  a.allocate_prompt("y", [9] * 12)  # takes all 3 pages: the 2 cached ones are evicted
  assert len(reads) == 1 and a.counters["evictions"] == 2 and a.cached_blocks() == {}
  a.free("y")
  assert a.allocate_prompt("z", list(range(1, 10))) == 8  # back from the directory
  assert a.counters["shared_pages"] == 2
  a.check()


def test_pools_with_boundary_states_neither_publish_nor_hit(tmp_path):
  store = SharedPrefixStore(tmp_path, "s")
  a = PrefixCachingAllocator(8, PS, offload=store, boundary_states=True)
  a.bind_device(lambda pages: np.zeros((len(pages), 8), np.uint8), None)
  a.allocate_prompt("x", list(range(1, 10)))
  a.register("x", list(range(1, 10)))
  assert store.files() == [] and a.counters["pages_published"] == 0
  SharedPrefixStore(tmp_path, "s").write(page_digest(b"", np.arange(1, 5)), np.arange(1, 5),
                                         np.zeros(8, np.uint8))
  for states, found in ((True, 0), (False, 4)):
    b = PrefixCachingAllocator(8, PS, offload=SharedPrefixStore(tmp_path, "s"),
                               boundary_states=states)
    b.bind_device(None, lambda pages, rows: None)
    assert b.match(list(range(1, 10)), with_state=False) == found


def test_a_queued_run_over_the_shared_store_serves_every_request(tmp_path):
  # `run` prefetches the head of its queue through stores that stage ahead; the shared store
  # reads its files at the join instead, so a queue (one slot, three requests) must not reach it.
  b = _worker(tmp_path)
  assert not b._can_prefetch  # pylint: disable=protected-access
  prompts = _prompts(seed=7)
  out = b.run([(f"r{i}", p, MAX_NEW) for i, p in enumerate(prompts)])
  for i, p in enumerate(prompts):
    assert tuple(out[f"r{i}"].tokens.tolist()) == _alone(tuple(p.tolist()), 0)
  b.allocator.check()
  assert b.allocator.counters["cached_tokens"] == 2 * 12  # the 2nd and 3rd hit the 1st's pages
