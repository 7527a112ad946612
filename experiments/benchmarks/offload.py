"""Offload tiers at memory speed: page spills and reloads against a host memcpy (issue 40 item 4).

    python -m experiments.benchmarks.offload
    python -m experiments.benchmarks.offload --model=random-tiny --pages=8 --repeats=3

The page pool of a `ContinuousBatcher` on `--model` (SmolLM2-135M-Instruct: 30 layers,
K = 3, H = 64, f32, pages of 16 tokens = 0.70 MiB over all layers; 360 pages). For each page
list -- `--pages` consecutive pages, the same count in runs of 4 with gaps, one page, the
whole pool -- the median over `--repeats` rounds, the figures interleaved within each round, of:

  * memcpy: `np.copyto` of as many bytes into a preallocated array, in the same run;
  * spill: `PageCodec.read` of the pages, then each row put in a `HostTier` (pool ->
    host tier, as the prefix cache evicts);
  * reload: the rows taken from the tier, then `PageCodec.write` into the pool until the
    caches are ready (host tier -> pool, as a prefix hit reloads). The default `HostTier`
    keeps its rows in a `RowArena`: the write reads them where they are (the arena chunk's
    zero-copy `device_put`, one jitted update that reads each run at its slots and writes it
    transposed into the pools): one copy of the data;
  * reload staged: the same through a `HostTier(arena=False)` (a copy per row): one copy of
    the rows into the codec's reused staging block, laid out pool-major (by two threads
    from 4 MiB on), its zero-copy `device_put`, the jitted update (a copy without a
    transpose): two copies of the data; also through a `pinned_host` tier where the backend
    offers that memory kind ("reload pinned", staged the same way);
  * install prefetched: `PageCodec.write` of rows a `PageCodec.prefetch` already staged (what
    a join waits for when the prefetch ran during a decode step): the jitted update only.

Then the overlap of a prefetch with compute: one decode step of the batcher (two live
requests), a prefetch of the pages' rows alone (copy into a staging block and transfer, on
the codec's worker thread), and both at once; `hidden` = the share of the prefetch's time
that the step hid (`(step + prefetch - both) / prefetch`, unclamped: above 100% or below 0
the noise of the step exceeds the prefetch). Prints one table; the machine's load average goes beside it (on a loaded
machine the GB/s are indicative only).
"""

from __future__ import annotations

import os
import statistics
import time

import jax
import numpy as np

from experiments.evals import models
from experiments.framework import cli
from experiments.framework import report as report_lib
from kvattn.inference.batching import ContinuousBatcher
from kvattn.paging import offload


def _interleaved(fns: dict, repeats: int) -> dict[str, tuple[float, float]]:
  """Median `(wall seconds, CPU seconds of the process)` of each `(fn, setup)` in `fns`, the
  functions alternating within each of `repeats` rounds after one untimed round (it compiles
  and warms the allocator); `setup()` runs untimed before its `fn()`. CPU seconds
  (`time.process_time`) count every thread of the process, XLA's included."""
  times: dict[str, list[tuple[float, float]]] = {name: [] for name in fns}
  for i in range(repeats + 1):
    for name, (fn, setup) in fns.items():
      if setup is not None:
        setup()
      wall, cpu = time.perf_counter(), time.process_time()
      fn()
      if i:
        times[name].append((time.perf_counter() - wall, time.process_time() - cpu))
  return {name: (statistics.median(t[0] for t in ts), statistics.median(t[1] for t in ts))
          for name, ts in times.items()}


def page_lists(count: int, num_pages: int) -> dict[str, list[int]]:
  """The page lists measured: consecutive, runs of 4 with gaps, one page, the whole pool."""
  count = min(count, num_pages // 2)
  gapped = [p for p in range(2 * count) if p % 8 < 4][:count]
  return {f"{count} consecutive": list(range(1, count + 1)),
          f"{count} in runs of 4": gapped, "1 page": [num_pages // 2],
          f"whole pool ({num_pages})": list(range(num_pages))}


def measure(batcher: ContinuousBatcher, pages: list[int], repeats: int
            ) -> dict[str, tuple[float, float]]:
  """`(GB/s of wall time, GB per CPU-second)` of memcpy, spill, reload (host and pinned
  tiers) and the install of prefetched rows for `pages` of the batcher's pool (module doc),
  measured interleaved."""
  codec = offload.PageCodec(batcher.caches)
  nbytes = len(pages) * codec.page_bytes
  src = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
  dst = np.empty_like(src)
  blocks = [object() for _ in pages]

  def spill(tier):
    for b, row in zip(blocks, codec.read(batcher.caches, pages)):
      tier.put(b, row)

  def empty(tier):
    for b in blocks:
      tier.discard(b)

  def reload(tier):
    rows = [tier.take(b) for b in blocks]
    batcher.caches = codec.write(batcher.caches, pages, rows)  # returns once written

  held = {}

  def prefetched():  # rows already on the device (the prefetch ran during a step)
    rows = [held["h"].row(i) for i in range(len(pages))]
    batcher.caches = codec.write(batcher.caches, pages, rows)
    codec.release(held.pop("h"))

  def prefetch():
    held["h"] = codec.prefetch(list(codec.read(batcher.caches, pages)))
    held["h"].wait()

  host = offload.HostTier(2 * nbytes, pinned=False)  # rows in a RowArena
  plain = offload.HostTier(2 * nbytes, pinned=False, arena=False)  # a copy per row
  fns = {"memcpy": (lambda: np.copyto(dst, src), None),
         "spill": (lambda: spill(host), lambda: empty(host)),
         "reload": (lambda: reload(host), lambda: (empty(host), spill(host))),
         "reload staged": (lambda: reload(plain), lambda: (empty(plain), spill(plain))),
         "install prefetched": (prefetched, prefetch)}
  if offload.pinned_host_available():
    pinned = offload.HostTier(2 * nbytes, pinned=True)
    fns["reload pinned"] = (lambda: reload(pinned), lambda: (empty(pinned), spill(pinned)))
  out = {name: (nbytes / w / 1e9, nbytes / c / 1e9)
         for name, (w, c) in _interleaved(fns, repeats).items()}
  out["MiB"] = nbytes / 2**20
  return out


def overlap(batcher: ContinuousBatcher, pages: list[int], repeats: int) -> dict[str, float]:
  """Seconds of one decode step, of a prefetch of `pages`' rows (the copy into the staging
  block and the transfer, on the codec's worker thread), of both at once, of the install
  after it, and `(step + prefetch - both) / prefetch` (the share the step hid, unclamped);
  interleaved medians."""
  codec = offload.PageCodec(batcher.caches)
  rows = list(codec.read(batcher.caches, pages))

  def step():
    batcher.step()
    jax.block_until_ready(batcher.caches)

  def prefetch():
    handle = codec.prefetch(rows)
    handle.wait()
    codec.release(handle)

  def both():
    handle = codec.prefetch(rows)  # runs on the worker while the step computes
    step()
    handle.wait()
    codec.release(handle)

  held = {}

  def install():
    batcher.caches = codec.write(batcher.caches, pages,
                                 [held["h"].row(i) for i in range(len(pages))])
    codec.release(held.pop("h"))

  def start():
    held["h"] = codec.prefetch(rows)
    held["h"].wait()

  t = _interleaved({"step": (step, None), "prefetch": (prefetch, None), "both": (both, None),
                    "install": (install, start)}, repeats)
  t_step, t_pre, t_both = t["step"][0], t["prefetch"][0], t["both"][0]
  return {"step_s": t_step, "prefetch_s": t_pre, "both_s": t_both, "install_s": t["install"][0],
          "cpu": {k: v[1] for k, v in t.items()},
          "hidden": (t_step + t_pre - t_both) / t_pre}


def main(argv=None) -> None:
  """Prints the GB/s table and the overlap (module doc)."""
  parser = cli.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--model", default="smollm2-135m-instruct",
                      help="a model of experiments.evals.models.load_model")
  parser.add_argument("--pages", type=int, default=65, help="pages per list (default: the "
                      "65 pages of the prefix_reuse config's 1024-token system prompt)")
  parser.add_argument("--num_pages", type=int, default=360, help="pages in the pool")
  parser.add_argument("--repeats", type=int, default=5, help="timed rounds per figure (at most "
                      "40: the overlap's decode steps must fit the requests' 224 new tokens)")
  args = parser.parse_args(argv)
  for name in ("pages", "num_pages", "repeats"):
    if getattr(args, name) < 1:
      raise cli.UserError(f"--{name} must be >= 1; got {getattr(args, name)}")
  if args.repeats > 40:
    raise cli.UserError(f"--repeats must be at most 40; got {args.repeats}")
  model, _ = models.load_model(args.model)
  batcher = ContinuousBatcher(model, num_slots=2, num_pages=args.num_pages, page_size=16,
                              max_len=256, max_prompt_len=64, prefix_cache=True, seed=0)
  rows = []
  cell = lambda r: f"{r[0]:.2f} ({r[1]:.2f})"
  pct = lambda name, r: f"{r[name][0] / r['memcpy'][0]:.0%} ({r[name][1] / r['memcpy'][1]:.0%})"
  for name, pages in page_lists(args.pages, args.num_pages).items():
    r = measure(batcher, pages, args.repeats)
    rows.append([name, f"{r['MiB']:.1f}", cell(r["memcpy"]), cell(r["spill"]),
                 cell(r["reload"]), cell(r["reload staged"]),
                 cell(r.get("reload pinned", (float("nan"),) * 2)),
                 cell(r["install prefetched"]), pct("reload", r), pct("reload staged", r),
                 pct("install prefetched", r)])
  print("GB/s of wall time (GB per CPU-second of the process), interleaved medians")
  print(report_lib.markdown_table(
      ["pages", "MiB", "memcpy", "spill", "reload", "reload staged", "reload pinned",
       "install prefetched", "reload / memcpy", "staged / memcpy", "install / memcpy"], rows))
  rng = np.random.default_rng(1)
  vocab = int(model.vocab_size)
  for rid in ("a", "b"):  # two live requests: every step decodes both
    batcher.add(rid, rng.integers(0, vocab, 32).astype(np.int32), 256 - 32)
  o = overlap(batcher, list(range(1, args.pages + 1)), args.repeats)
  print(f"\noverlap ({args.pages} pages): decode step {o['step_s'] * 1e3:.1f} ms, prefetch "
        f"{o['prefetch_s'] * 1e3:.1f} ms, both {o['both_s'] * 1e3:.1f} ms -> step + prefetch - both "
        f"= {o['hidden']:.0%} of the prefetch (over 100%: the step's noise exceeds the "
        f"prefetch); the install after it {o['install_s'] * 1e3:.1f} ms")
  print("  CPU-seconds: " + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in o["cpu"].items()))
  print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs; JAX "
        f"{jax.__version__}, {jax.devices()[0].platform}")


if __name__ == "__main__":
  cli.run_plain(main)
