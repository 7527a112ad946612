"""The batcher under load: a short soak, cancel, shared pages, a disk tier that cannot write."""

import errno
import functools
import logging
import os

import numpy as np
import pytest
from flax import nnx

from experiments.benchmarks import soak as bench_soak
from experiments.evals import models
from kvattn.caches.registry import gqa_layers
from kvattn.inference.batching import ContinuousBatcher
from kvattn.inference.generation import generate
from kvattn.models import transformer
from kvattn.paging import offload
from kvattn.paging.allocator import NO_PAGE
from kvattn.paging.offload import DiskTier, HostTier, TieredStore

PAGE, MAX_LEN, MAX_NEW = 4, 24, 8
WIDTH = 32  # the padded prompt width of every reference (the soak's max_len)


@functools.lru_cache(maxsize=None)
def _model():
  return models.tiny_model(0)


@functools.lru_cache(maxsize=None)
def _alone(prompt: tuple) -> tuple:
  """Greedy tokens of `prompt` decoded alone by kvattn.generate (one padded width and one
  max_new for every call: one compile; greedy tokens are prefix-consistent)."""
  padded = np.zeros((1, WIDTH), np.int32)
  padded[0, :len(prompt)] = prompt
  tokens, _ = generate(_model(), padded, np.array([len(prompt)], np.int32), MAX_NEW)
  return tuple(np.asarray(tokens)[0].tolist())


def _prompt(seed, n):
  return np.random.default_rng(seed).integers(0, 256, n).astype(np.int32)


# -- the short soak --------------------------------------------------------------------------------

# 4 slots of up to 8 pages over a pool of 16 (smaller than the 4 x 8 pages the slots could hold,
# so the default CPU decode backend would be the pool scan), 3 system prompts, tiers of 4 + 8
# pages, arrivals faster than the slots finish, a fifth of the requests cancelled.
SHORT = bench_soak.SoakConfig(requests=60, slots=4, pages=16, page_size=PAGE, max_len=WIDTH,
                              max_new=MAX_NEW, systems=3, system_len=12, suffix_len=6,
                              arrival_rate=1.0, cancel_fraction=0.2, host_pages=4, disk_pages=8,
                              rss_every=5)


def test_short_soak_keeps_every_invariant(tmp_path):
  record, details = bench_soak.run_soak(SHORT, disk_dir=str(tmp_path / "disk"), model=_model())
  requests, served, batcher = details["requests"], details["served"], details["batcher"]
  # Nothing lost, nothing twice: every request has exactly one final reason.
  assert set(served.reasons) == {r.rid for r in requests}
  assert record["lost"] == 0 and record["duplicated"] == 0
  assert sum(record["finished"].values()) == SHORT.requests
  # Every output is what the request gets alone (a cancelled one: a prefix of it).
  for r in requests:
    got, reason = tuple(served.tokens[r.rid]), served.reasons[r.rid]
    want = _alone(tuple(r.prompt.tolist()))[:r.max_new]
    assert got == want[:len(got)], r.rid
    assert reason == "cancelled" or (reason == "length" and len(got) == r.max_new), r.rid
  assert record["checked"] == SHORT.requests and record["mismatches"] == 0
  assert record["tokens_generated"] == sum(len(t) for t in served.tokens.values())
  # No page leaked: all free after draining, and on the free list once the cache is cleared.
  assert record["pages_free_start"] == record["pages_free_end"] == SHORT.pages
  assert record["pages_free_after_clear"] == SHORT.pages
  batcher.allocator.check()
  assert batcher.free_slots == list(range(SHORT.slots))
  assert (np.asarray(batcher.caches[0].block_tables) == NO_PAGE).all()
  assert not np.asarray(batcher.caches[0].lengths).any()
  assert record["tier_files_ok"]
  # No compilation or trace after warm-up.
  assert record["compiles_after_warmup"] == 0 and record["traces_after_warmup"] == 0
  assert record["batcher_traces_unchanged"]
  # Host memory over the second half: only a coarse bound in a run of about 60 ticks (it
  # catches gross growth, not a slow leak; the long benchmark run measures flatness).
  assert record["rss_samples"] >= 10
  assert abs(record["rss_growth_mb"]) < 8
  # The load really was there: a queue while slots ran, cancellations both ways, preemption,
  # evictions to both tiers and reloads from both, prefix hits.
  assert record["max_queue"] > SHORT.slots and record["ticks_queue_with_live"] > 10
  assert record["cancelled_live"] > 0 and record["cancelled_queued"] > 0
  assert record["preemptions"] > 0 and record["evictions"] > 0
  assert record["tier_moves"]["host->device"] > 0 and record["tier_moves"]["disk->device"] > 0
  assert record["tier_moves"]["last->drop"] > 0
  assert record["prefix_hit_fraction"] > 0.2
  assert bench_soak.failures(record) == []


# -- cancel and shared pages -----------------------------------------------------------------------


def _batcher(**kw):
  args = dict(num_slots=4, num_pages=10, page_size=PAGE, max_len=MAX_LEN, max_prompt_len=16,
              seed=0, prefix_cache=True)
  args.update(kw)
  return ContinuousBatcher(_model(), **args)


def test_cancel_frees_the_slot_and_pages_and_spares_a_sequence_sharing_them():
  # 10 pages < 4 slots x 6 pages per sequence: the pool scan would be the default CPU backend,
  # and "a" and "b" share two prefix pages while both run.
  batcher = _batcher()
  system = _prompt(0, 8)
  a, b = np.concatenate([system, _prompt(1, 2)]), np.concatenate([system, _prompt(2, 3)])
  assert batcher.add("a", a, MAX_NEW) == 0
  batcher.step()
  assert batcher.add("b", b, MAX_NEW) == 1
  assert batcher.allocator.pages("a")[:2] == batcher.allocator.pages("b")[:2]
  batcher.step()
  f = batcher.cancel("a")
  assert f.reason == "cancelled" and f.slot == 0 and tuple(f.tokens) == _alone(tuple(a))[:3]
  assert batcher.active == {"b": 1} and batcher.free_slots == [0, 2, 3]
  assert (np.asarray(batcher.caches[0].block_tables)[0] == NO_PAGE).all()
  assert int(np.asarray(batcher.caches[1].lengths)[0]) == 0
  for rid in ("a", "nobody"):
    with pytest.raises(ValueError, match=f"request_id must be a live request to cancel; got "
                       f"'{rid}' \\(1 live\\)"):
      batcher.cancel(rid)
  finished = []
  while batcher.active:
    finished += batcher.step()
  assert tuple(finished[0].tokens) == _alone(tuple(b))
  # "a"'s pages were registered when it was cancelled: its prompt again prefills 2 tokens.
  before = batcher.prefill_tokens
  out = batcher.run([("a2", a, MAX_NEW)])
  assert tuple(out["a2"].tokens) == _alone(tuple(a))
  assert batcher.prefill_tokens - before == 2
  assert batcher.allocator.num_free == 10
  batcher.allocator.check()
  # One join per prefill bucket (16, 4, 2 tokens), every other program once.
  assert batcher.traces == {"join": 3, "step": 1, "set_row": 1, "release": 1}
  # The caller's model keeps its own backend choice.
  assert [a.decode_implementation for a in gqa_layers(_model())] == [None, None]


def test_the_pool_scan_backend_is_refused_with_the_prefix_cache():
  cfg = transformer.model_config(d_model=32, num_layers=2, mlp_dim=64, attention=dict(
      num_heads=4, num_kv_heads=2, head_dim=8, decode_implementation="xla_pool"))
  model = transformer.Transformer.from_config(cfg, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="decode_implementation must not be 'xla_pool' with "
                     "prefix_cache=True"):
    ContinuousBatcher(model, num_slots=2, num_pages=4, page_size=PAGE, max_len=8,
                      max_prompt_len=8, prefix_cache=True)


# -- a disk tier that cannot write -----------------------------------------------------------------


def _warnings(caplog):
  return [r for r in caplog.records
          if r.name == offload.__name__ and r.levelno == logging.WARNING]


def test_a_disk_tier_whose_directory_is_a_file_stores_nothing_and_warns_once(tmp_path, caplog):
  path = tmp_path / "not_a_dir"
  path.write_bytes(b"x")
  with caplog.at_level(logging.WARNING):
    tier = DiskTier(path, 10**6)
    pages = [np.full((24,), i, np.uint8) for i in range(3)]
    for i, p in enumerate(pages):
      assert tier.put(i, p) == [(i, p)]  # handed back: the next tier (or a drop) gets it
  assert "FileExistsError" in tier.error and len(tier) == 0 and tier.used_bytes == 0
  (warning,) = _warnings(caplog)
  assert str(path) in warning.getMessage() and "goes on without it" in warning.getMessage()
  assert path.read_bytes() == b"x"


# Two system prompts alternating through one slot and 6 pages: each request evicts the other
# prefix, which goes straight to disk (host tier of 0 bytes) and comes back on the next request.
def _alternating(n):
  rng = np.random.default_rng(3)
  systems = [rng.integers(0, 256, 12).astype(np.int32) for _ in range(2)]
  return [(f"r{i}", np.concatenate([systems[i % 2], rng.integers(0, 256, 2).astype(np.int32)]),
           4) for i in range(n)]


# "replaced": the directory is removed and a file put in its place mid-run (what a read-only
# directory does to writes; tests run as root, where chmod 0o500 stops nothing). "enospc": the
# write itself is patched to write half the page and raise OSError(ENOSPC), as a full disk does.
@pytest.mark.parametrize("failure", ["replaced", "enospc"])
def test_generation_goes_on_when_the_disk_tier_cannot_write(failure, tmp_path, caplog,
                                                            monkeypatch):
  directory = tmp_path / "disk"
  store = TieredStore([HostTier(0), DiskTier(directory, 10**6)])
  batcher = ContinuousBatcher(_model(), num_slots=1, num_pages=6, page_size=PAGE, max_len=20,
                              max_prompt_len=16, seed=0, prefix_cache=True, offload=store)
  requests = _alternating(8)
  out = batcher.run(requests[:3])  # r0's prefix to disk, back for r2; r1's to disk
  disk = store.tiers[1]
  assert batcher.allocator.counters["pages_reloaded"] > 0 and len(disk) > 0
  held, reloaded = len(disk), batcher.allocator.counters["pages_reloaded"]
  if failure == "replaced":
    for name in os.listdir(directory):
      os.remove(directory / name)
    os.rmdir(directory)
    directory.write_bytes(b"not a directory")
  else:
    def full_disk(path, data):
      with open(path, "wb") as f:
        f.write(data[:len(data) // 2])
      raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
    monkeypatch.setattr(offload, "_write_file", full_disk)
  with caplog.at_level(logging.WARNING):
    out.update(batcher.run(requests[3:]))
  for rid, prompt, _ in requests:
    assert tuple(out[rid].tokens) == _alone(tuple(prompt.tolist()))[:4], rid
  (warning,) = _warnings(caplog)  # said once, however many pages it was offered
  expected = {"replaced": "NotADirectoryError", "enospc": "No space left on device"}[failure]
  assert expected in warning.getMessage() and expected in disk.error
  assert store.moves[("last", "drop")] > 0  # pages it could not take were dropped
  if failure == "replaced":  # the pages it held are gone: misses, recomputed
    assert batcher.allocator.counters["offload_misses"] > 0 and len(disk) < held
  else:  # the pages written before stay readable; no partial page is left behind
    assert batcher.allocator.counters["pages_reloaded"] > reloaded
    assert sorted(os.listdir(directory)) == sorted(
        os.path.basename(disk.path_of(b)) for b in disk._items)  # pylint: disable=protected-access
  batcher.allocator.check()
  assert batcher.allocator.num_free == 6
