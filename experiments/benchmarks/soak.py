"""Soak: thousands of requests through `ContinuousBatcher` with the prefix cache and offload.

    python -m experiments.benchmarks.soak --requests 2000 --out soak.jsonl

A tiny random model (2 layers, GQA 4/2 heads, the tests' pattern) serves
`--requests` requests through `--slots` slots over a small pool of `--pages`
pages, `prefix_cache=True`, with a host tier and a disk tier behind it
(`kvattn.paging.offload`; `--disk_dir`, default a temporary directory). The
workload (`make_requests`, seeded):

  * prompts: most start with one of `--systems` shared "system prompts"
    (then a short random suffix), some repeat an earlier prompt exactly, the
    rest are random; output lengths uniform in [1, `--max_new`]. Greedy.
  * arrivals: Poisson, `--arrival_rate` requests per scheduler tick (one
    decode step), faster than the slots finish them: requests are submitted
    between steps while others run, and a queue builds up.
  * cancellations: a `--cancel_fraction` of requests is cancelled by its
    client: half at a random tick after arrival (most are still waiting in
    the queue then, and are dropped from it), half at a random tick after
    they join (mid-flight: `ContinuousBatcher.cancel`).
  * preemption: a running sequence that finds no free page leaves with reason
    "out_of_pages"; the scheduler resubmits it at the front of the queue as
    prompt + tokens so far with the rest of its budget (recompute; its pages
    were registered on the way out, so the prefix cache usually serves them).

Before serving, `warm_up` compiles every program serving can call (the
prefill of every prompt length, a decode step, a page growth, a retirement, an
eviction, and the reload of every page count from the tiers). Then every
backend compilation and trace is counted (`jax.monitoring`) until the queue
is drained, and RSS (psutil) is sampled every `--rss_every` ticks.

Checked, and reported in one JSON line (printed, and appended to `--out`):

  requests, finished          every request ends exactly once: `lost` (no
                              final record) and `duplicated` (a record after
                              its final one) must be 0
  tokens_generated            tokens returned, over all requests
  wall_s, tokens_per_s        serving wall time (warm-up and checks excluded)
  pages, pages_free_start     the pool; free pages after warm-up (unreferenced
                              cached pages count as free: they are reusable)
  pages_free_end              after draining; must equal pages
  pages_free_after_clear      after `offload_cached()` moved every cached page
                              out: the free list alone; must equal pages
  compiles_after_warmup       backend compilations while serving; must be 0
  traces_after_warmup         jaxpr traces while serving; must be 0
  rss_peak_mb, rss_growth_mb  peak RSS, and RSS at the end of serving minus at
                              its middle tick (MiB)
  checked, mismatches         requests compared with `kvattn.generate` of the
                              same prompt alone (greedy; `--check`, 0 = all):
                              a finished request's tokens equal its first
                              `max_new` tokens alone, a cancelled one's a prefix
  tier_files_ok               the index's blocks per tier equal each tier's
                              pages, and the disk directory holds exactly the
                              disk tier's files (none leaked)

plus the workload, the prefix-cache counters (hits, evictions, pages offloaded
and reloaded, misses) and the tiers' moves while serving, and the disk tier's
error if it was disabled. Exit status 1 (after the line) if an invariant fails.
"""

from __future__ import annotations

import collections
import dataclasses
import heapq
import itertools
import json
import os
import platform
import tempfile
import time
from typing import Any, Callable, Sequence

import jax
import numpy as np
import psutil
from absl import app, flags
from flax import nnx

from experiments.evals import models
from experiments.framework import cli
from kvattn.inference.batching import ContinuousBatcher, Finished
from kvattn.inference.generation import generate
from kvattn.paging.offload import DiskTier, HostTier, TieredStore

FLAGS = flags.FLAGS

# jax._src.dispatch's event names (recorded through jax.monitoring on every backend compile and
# every jaxpr trace of a jitted function).
COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
TRACE_EVENT = "/jax/core/compile/jaxpr_trace_duration"


@dataclasses.dataclass(frozen=True)
class SoakConfig:
  """One soak run (the flags' defaults)."""

  requests: int = 2000  # requests served
  slots: int = 8  # batcher slots B
  pages: int = 40  # pages in the pool (small: 12 hold one full-length sequence)
  page_size: int = 8  # tokens per page
  max_len: int = 96  # tokens per sequence (prompt + generated - 1); also the longest prompt
  max_new: int = 32  # output lengths are uniform in [1, max_new]
  systems: int = 8  # shared system prompts
  system_len: int = 48  # their lengths are uniform in [page_size, system_len]
  suffix_len: int = 16  # a shared prompt's own suffix: [1, suffix_len] tokens
  shared_fraction: float = 0.7  # prompts that start with a system prompt
  repeat_fraction: float = 0.1  # prompts that repeat an earlier prompt exactly
  arrival_rate: float = 1.0  # Poisson arrivals per scheduler tick (one decode step)
  cancel_fraction: float = 0.05  # requests their client cancels
  host_pages: int = 16  # host tier capacity, in pages
  disk_pages: int = 48  # disk tier capacity, in pages
  seed: int = 0  # weights, workload and the allocator's page order
  rss_every: int = 25  # ticks between RSS samples
  check: int = 0  # requests compared with generate alone (0: all)


@dataclasses.dataclass(frozen=True)
class Request:
  """A client request: `prompt` (`i32[n]`), `max_new` tokens, arrival and cancel ticks."""

  rid: int
  prompt: np.ndarray
  max_new: int
  arrival: int
  cancel_wait: int | None = None  # its client cancels it this many ticks after arrival
  cancel_run: int | None = None  # ... or this many ticks after it first joins


@dataclasses.dataclass
class Served:
  """What `serve` saw: per request id its tokens and final reason, and the counts."""

  tokens: dict[int, list[int]]
  reasons: dict[int, str]
  duplicated: int = 0  # records that arrived after a request's final record
  preemptions: int = 0  # "out_of_pages" records (each resubmitted)
  cancelled_live: int = 0  # cancelled through ContinuousBatcher.cancel
  cancelled_queued: int = 0  # cancelled while waiting
  ticks: int = 0
  max_queue: int = 0  # requests waiting at once (arrived, not admitted)
  queue_with_live: int = 0  # ticks where some waited while others ran
  rss: list[int] = dataclasses.field(default_factory=list)  # bytes, every rss_every ticks


def make_requests(config: SoakConfig) -> list[Request]:
  """The seeded workload of `config` (module doc), in arrival order."""
  rng = np.random.default_rng(config.seed)
  tokens = lambda n: rng.integers(0, 256, n).astype(np.int32)
  systems = [tokens(int(rng.integers(config.page_size, config.system_len + 1)))
             for _ in range(config.systems)]
  longest = config.system_len + config.suffix_len
  gaps = rng.exponential(1.0 / config.arrival_rate, config.requests)
  arrivals = np.floor(np.cumsum(gaps) - gaps[0]).astype(int)
  out: list[Request] = []
  for rid in range(config.requests):
    kind = rng.random()
    if out and kind < config.repeat_fraction:
      prompt = out[int(rng.integers(len(out)))].prompt
    elif kind < config.repeat_fraction + config.shared_fraction:
      prompt = np.concatenate([systems[int(rng.integers(config.systems))],
                               tokens(int(rng.integers(1, config.suffix_len + 1)))])
    else:
      prompt = tokens(int(rng.integers(1, longest + 1)))
    max_new = int(rng.integers(1, min(config.max_new, config.max_len - len(prompt) + 1) + 1))
    cancel = {}
    if rng.random() < config.cancel_fraction:
      when = "cancel_wait" if rng.random() < 0.5 else "cancel_run"
      cancel[when] = int(rng.integers(1, max(2, config.max_new)))
    out.append(Request(rid, prompt, max_new, int(arrivals[rid]), **cancel))
  return out


def make_batcher(model: nnx.Module, config: SoakConfig, disk_dir: str) -> ContinuousBatcher:
  """The batcher of `config`: prefix cache on, a host then a disk tier (capacities in pages)."""
  page_bytes = model.cache_bytes_per_token() * config.page_size
  store = TieredStore([HostTier(config.host_pages * page_bytes),
                       DiskTier(disk_dir, config.disk_pages * page_bytes)])
  return ContinuousBatcher(model, num_slots=config.slots, num_pages=config.pages,
                           page_size=config.page_size, max_len=config.max_len,
                           max_prompt_len=config.max_len, seed=config.seed, prefix_cache=True,
                           offload=store)


def warm_up(batcher: ContinuousBatcher, seed: int = 12345) -> None:
  """Runs every program serving can call once, with fresh random prompts (module doc):
  a prefill of every prompt length (each prefill bucket), each with a decode step where it
  fits (a page growth when the prompt fills its pages), the reload of every page count a
  prompt can take from the tiers, and a pool filled past its size (evictions to the tiers).
  """
  rng = np.random.default_rng(seed)
  ids = itertools.count()
  alloc = batcher.allocator

  def once(prompt, max_new):
    batcher.add(("warm-up", next(ids)), prompt, max_new)
    while batcher.active:
      batcher.step()

  longest = batcher.max_prompt_len
  for n in range(1, longest + 1):
    once(rng.integers(0, 256, n), min(2, batcher.max_len - n + 1))
  for k in range(1, (longest - 1) // batcher.page_size + 1):
    prompt = rng.integers(0, 256, k * batcher.page_size + 1)
    once(prompt, 1)  # registers k full pages
    alloc.offload_cached()  # every cached page to the tiers
    once(prompt, 1)  # k pages come back (when the tiers could hold them)
  for _ in range(2 * batcher.allocator.num_pages // max(1, longest // batcher.page_size) + 1):
    once(rng.integers(0, 256, longest), 1)


class EventCounter:
  """Counts `jax.monitoring` compile and trace events (by function name) while `counting`."""

  def __init__(self):
    self.counting = False
    self.compiles: collections.Counter = collections.Counter()
    self.traces: collections.Counter = collections.Counter()

  def __call__(self, event: str, duration: float, **kwargs: Any) -> None:
    del duration
    if not self.counting:
      return
    if event == COMPILE_EVENT:
      self.compiles[kwargs.get("fun_name", "?")] += 1
    elif event == TRACE_EVENT:
      self.traces[kwargs.get("fun_name", "?")] += 1

  def __enter__(self) -> "EventCounter":
    jax.monitoring.register_event_duration_secs_listener(self)
    return self

  def __exit__(self, *exc) -> None:
    jax.monitoring.unregister_event_duration_listener(self)


def serve(batcher: ContinuousBatcher, requests: Sequence[Request], *, rss_every: int = 25,
          rss: Callable[[], int] | None = None) -> Served:
  """Serves `requests` as they arrive (first come, first served; module doc).

  Every tick: the requests whose arrival tick has come join the queue; due
  cancellations are applied (waiting: dropped from the queue; live:
  `batcher.cancel`; finished already: nothing);
  waiting requests join while `can_add` (a preempted one first); one
  `batcher.step()`. A request's tokens are everything its records returned;
  its final reason that of its last record ("out_of_pages" records are
  resubmitted, never final).

  Raises:
    RuntimeError: a waiting request that can never join (the pool is too small).
  """
  rss = rss or (lambda: psutil.Process().memory_info().rss)
  by_id = {r.rid: r for r in requests}
  arriving = collections.deque(sorted(requests, key=lambda r: r.arrival))
  cancels: list[tuple[int, int]] = []  # heap of (tick, rid)
  joined: set[int] = set()
  queue: collections.deque = collections.deque()  # (rid, prompt, max_new) waiting
  served = Served(tokens={r.rid: [] for r in requests}, reasons={})

  def record(f: Finished) -> None:
    if f.request_id in served.reasons:
      served.duplicated += 1
      return
    served.tokens[f.request_id].extend(int(t) for t in f.tokens)
    if f.reason == "out_of_pages":
      served.preemptions += 1
      req, got = by_id[f.request_id], served.tokens[f.request_id]
      queue.appendleft((req.rid, np.concatenate([req.prompt, np.asarray(got, np.int32)]),
                        req.max_new - len(got)))
    else:
      served.reasons[f.request_id] = f.reason

  tick = 0
  while arriving or queue or batcher.active:
    if not queue and not batcher.active and arriving[0].arrival > tick:
      tick = arriving[0].arrival  # idle until the next arrival
    while arriving and arriving[0].arrival <= tick:
      r = arriving.popleft()
      queue.append((r.rid, r.prompt, r.max_new))
      if r.cancel_wait is not None:
        heapq.heappush(cancels, (tick + r.cancel_wait, r.rid))
    while cancels and cancels[0][0] <= tick:
      _, rid = heapq.heappop(cancels)
      if rid in batcher.active:
        record(batcher.cancel(rid))
        served.cancelled_live += 1
      else:
        waiting = [q for q in queue if q[0] == rid]
        if waiting:
          queue.remove(waiting[0])
          served.reasons[rid] = "cancelled"
          served.cancelled_queued += 1
    while queue and batcher.can_add(len(queue[0][1])):
      rid, prompt, max_new = queue.popleft()
      if rid not in joined and by_id[rid].cancel_run is not None:
        heapq.heappush(cancels, (tick + by_id[rid].cancel_run, rid))
      joined.add(rid)
      result = batcher.add(rid, prompt, max_new)
      if isinstance(result, Finished):
        record(result)
    if queue and not batcher.active:
      raise RuntimeError(f"request {queue[0][0]} ({len(queue[0][1])} tokens) can never join a "
                         f"pool of {batcher.allocator.num_pages} pages")
    served.max_queue = max(served.max_queue, len(queue))
    served.queue_with_live += bool(queue) and bool(batcher.active)
    for f in batcher.step():
      record(f)
    if tick % rss_every == 0:
      served.rss.append(rss())
    tick += 1
  served.rss.append(rss())
  served.ticks = tick
  return served


def alone(model: nnx.Module, prompt: np.ndarray, max_new: int, width: int) -> np.ndarray:
  """Greedy `kvattn.generate` of `prompt` alone: `i32[max_new]`. One padded `width` and one
  `max_new` for every call, so generate compiles once (greedy tokens are prefix-consistent)."""
  padded = np.zeros((1, width), np.int32)
  padded[0, :len(prompt)] = prompt
  tokens, _ = generate(model, padded, np.array([len(prompt)], np.int32), max_new)
  return np.asarray(tokens)[0]


def check_outputs(model: nnx.Module, requests: Sequence[Request], served: Served,
                  config: SoakConfig) -> tuple[int, list[int]]:
  """Compares `config.check` requests (0: all; else a seeded sample) with `alone`.

  Returns:
    (requests checked, ids of those that differ).
  """
  chosen = list(requests)
  if config.check and config.check < len(chosen):
    pick = np.random.default_rng(config.seed + 1).choice(len(chosen), config.check, replace=False)
    chosen = [chosen[i] for i in sorted(pick)]
  bad = []
  for r in chosen:
    got = served.tokens[r.rid]
    want = alone(model, r.prompt, config.max_new, config.max_len)[:r.max_new]
    full = served.reasons.get(r.rid) == "length"
    if (full and len(got) != r.max_new) or list(want[:len(got)]) != got:
      bad.append(r.rid)
  return len(chosen), bad


def tiers_consistent(batcher: ContinuousBatcher) -> bool:
  """The allocator's index and the tiers agree (blocks per tier), and the disk tier's
  directory holds exactly its own files."""
  store = batcher.allocator.offload
  blocks = batcher.allocator.cached_blocks()
  ok = all(blocks.get(t.name, 0) == len(t) for t in store.tiers)
  for tier in store.tiers:
    if isinstance(tier, DiskTier) and os.path.isdir(tier.directory):
      files = {os.path.join(tier.directory, f) for f in os.listdir(tier.directory)}
      ok &= files == {tier.path_of(b) for b in tier._items}  # pylint: disable=protected-access
  return ok


def run_soak(config: SoakConfig, *, disk_dir: str | None = None,
             model: nnx.Module | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
  """Runs one soak (module doc).

  Returns:
    `(record, details)`: the JSON record, and `details` with the `requests`,
    the `served` outcome, the `batcher` and the `model` (for tests).
  """
  model = models.tiny_model(config.seed) if model is None else model
  requests = make_requests(config)
  with tempfile.TemporaryDirectory(prefix="kvattn-soak-") as tmp:
    directory = disk_dir or os.path.join(tmp, "disk")
    batcher = make_batcher(model, config, directory)
    alloc = batcher.allocator
    with EventCounter() as events:
      warm_up(batcher)
      pages_free_start = alloc.num_free
      warm = dict(alloc.counters)
      warm_moves = dict(alloc.offload.moves)
      traces_before = dict(batcher.traces)
      events.counting = True
      start = time.perf_counter()
      served = serve(batcher, requests, rss_every=config.rss_every)
      wall_s = time.perf_counter() - start
      events.counting = False
    # What serving did (warm-up before it and the clearing below left out).
    counters = {k: v - warm.get(k, 0) for k, v in alloc.counters.items()}
    moves = {f"{a}->{b}": n - warm_moves.get((a, b), 0)
             for (a, b), n in sorted(alloc.offload.moves.items())}
    pages_free_end = alloc.num_free
    alloc.check()
    tiers_ok = tiers_consistent(batcher)
    alloc.offload_cached()
    pages_free_after_clear = alloc.num_free - alloc.num_cached
    tiers_ok &= tiers_consistent(batcher)
    checked, mismatches = check_outputs(model, requests, served, config)
  rss = np.asarray(served.rss) / 2**20
  tokens = sum(len(t) for t in served.tokens.values())
  disk = [t for t in alloc.offload.tiers if isinstance(t, DiskTier)]
  record = {
      "requests": config.requests,
      "finished": dict(collections.Counter(served.reasons.values())),
      "lost": sum(r.rid not in served.reasons for r in requests),
      "duplicated": served.duplicated,
      "cancelled_live": served.cancelled_live, "cancelled_queued": served.cancelled_queued,
      "preemptions": served.preemptions,
      "tokens_generated": tokens,
      "prefill_tokens": batcher.prefill_tokens,
      "wall_s": round(wall_s, 2), "tokens_per_s": round(tokens / wall_s, 1),
      "ticks": served.ticks, "max_queue": served.max_queue,
      "ticks_queue_with_live": served.queue_with_live,
      "pages": alloc.num_pages, "pages_free_start": pages_free_start,
      "pages_free_end": pages_free_end, "pages_free_after_clear": pages_free_after_clear,
      "compiles_after_warmup": sum(events.compiles.values()),
      "traces_after_warmup": sum(events.traces.values()),
      "compiled_after_warmup": sorted(set(events.compiles) | set(events.traces)),
      "batcher_traces_unchanged": dict(batcher.traces) == traces_before,
      "rss_start_mb": round(float(rss[0]), 1), "rss_peak_mb": round(float(rss.max()), 1),
      "rss_growth_mb": round(float(rss[-1] - rss[len(rss) // 2]), 1),
      "rss_samples": len(rss),
      "checked": checked, "mismatches": len(mismatches), "mismatched_ids": mismatches[:10],
      "tier_files_ok": bool(tiers_ok),
      "prefix_hit_fraction": round(counters.get("cached_tokens", 0)
                                   / max(1, counters.get("prompt_tokens", 0)), 3),
      "evictions": counters.get("evictions", 0),
      "pages_offloaded": counters.get("pages_offloaded", 0),
      "pages_reloaded": counters.get("pages_reloaded", 0),
      "offload_misses": counters.get("offload_misses", 0),
      "tier_moves": moves,
      "disk_error": disk[0].error if disk else None,
      "config": dataclasses.asdict(config),
      "jax": jax.__version__, "backend": jax.default_backend(),
      "device": jax.devices()[0].device_kind, "cpu_count": os.cpu_count(),
      "machine": platform.machine(), "load_avg_1min": round(os.getloadavg()[0], 2),
  }
  details = {"requests": requests, "served": served, "batcher": batcher, "model": model}
  return record, details


def failures(record: dict[str, Any]) -> list[str]:
  """The invariants `record` breaks (empty when it passes)."""
  out = []
  for key in ("lost", "duplicated", "mismatches", "compiles_after_warmup",
              "traces_after_warmup"):
    if record[key]:
      out.append(f"{key} = {record[key]}")
  for key in ("pages_free_start", "pages_free_end", "pages_free_after_clear"):
    if record[key] != record["pages"]:
      out.append(f"{key} = {record[key]} != pages = {record['pages']}")
  for key in ("batcher_traces_unchanged", "tier_files_ok"):
    if not record[key]:
      out.append(f"{key} is false")
  return out


def _define_flags() -> None:
  """Defines the flags (at run time, not import, so tests can import this module)."""
  defaults = SoakConfig()
  for field in dataclasses.fields(SoakConfig):
    value = getattr(defaults, field.name)
    define = flags.DEFINE_float if isinstance(value, float) else flags.DEFINE_integer
    define(field.name, value, f"SoakConfig.{field.name}.")
  flags.DEFINE_string("disk_dir", None, "Disk tier directory (default a temporary directory).")
  flags.DEFINE_string("out", None, "JSON lines file the record is appended to.")


def main(argv: Sequence[str]) -> None:
  """absl entry point: one JSON line; exit status 1 if an invariant fails."""
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  config = SoakConfig(**{f.name: FLAGS[f.name].value for f in dataclasses.fields(SoakConfig)})
  if config.requests < 1 or config.max_new < 1 or not 0 < config.arrival_rate:
    raise app.UsageError(f"--requests, --max_new and --arrival_rate must be positive; got "
                         f"{config.requests}, {config.max_new}, {config.arrival_rate}")
  if config.system_len + config.suffix_len + config.max_new - 1 > config.max_len:
    raise app.UsageError(f"--system_len + --suffix_len + --max_new - 1 must be <= --max_len = "
                         f"{config.max_len}; got {config.system_len} + {config.suffix_len} + "
                         f"{config.max_new} - 1")
  record, _ = run_soak(config, disk_dir=FLAGS.disk_dir)
  line = json.dumps(record)
  print(line, flush=True)
  if FLAGS.out:
    with open(FLAGS.out, "a") as f:
      f.write(line + "\n")
  broken = failures(record)
  if broken:
    raise SystemExit("invariants broken: " + "; ".join(broken))


if __name__ == "__main__":
  _define_flags()
  cli.run(main)
