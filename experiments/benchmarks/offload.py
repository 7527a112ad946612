"""Offload tiers at memory speed: page spills and reloads against a host memcpy (issue 40 item 4).

    python -m experiments.benchmarks.offload
    python -m experiments.benchmarks.offload --model=random-tiny --pages=8 --repeats=3

The page pool of a `ContinuousBatcher` on `--model` (SmolLM2-135M-Instruct: 30 layers,
K = 3, H = 64, f32, pages of 16 tokens = 0.70 MiB over all layers; 360 pages). For each page
list -- `--pages` consecutive pages, the same count in runs of 4 with gaps, one page, the
whole pool -- the median over `--repeats` of:

  * memcpy: `np.copyto` of as many bytes into a preallocated array, in the same run;
  * spill: `PageCodec.read` of the pages, then each row put in a `HostTier` (pool ->
    host tier, as the prefix cache evicts);
  * reload: the rows taken from the tier, then `PageCodec.write` into the pool until the
    caches are ready (host tier -> pool, as a prefix hit reloads), also through a
    `pinned_host` tier where the backend offers that memory kind;
  * the per-pool gather / scatter `PageCodec` used before (one `pool.at[:, pages].set` per
    pool), in the same run, for comparison.

Then the overlap of a reload with compute: one decode step of the batcher (two live
requests), the reload's staging (`PageCodec.stage`: the host copy and the transfer) alone,
and both at once (the staging on a thread); `hidden` = the share of the staging's time that
the step hid. Prints one table; the machine's load average goes beside it (on a loaded
machine the GB/s are indicative only).
"""

from __future__ import annotations

import os
import statistics
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np

from experiments.evals import models
from experiments.framework import cli
from experiments.framework import report as report_lib
from kvattn.inference.batching import ContinuousBatcher
from kvattn.paging import offload


def _median_s(fn, repeats: int, setup=None, clock=time.perf_counter) -> float:
  """Median seconds of `fn()` over `repeats` runs after one untimed run (it compiles and
  warms the allocator); `setup()` runs untimed before each; `clock` is wall time, or
  `time.process_time` (CPU seconds of every thread of the process)."""
  times = []
  for i in range(repeats + 1):
    if setup is not None:
      setup()
    start = clock()
    fn()
    if i:
      times.append(clock() - start)
  return statistics.median(times)


def _rates(nbytes: int, fn, repeats: int, setup=None) -> tuple[float, float]:
  """`(GB/s of wall time, GB per CPU-second)` of `fn` moving `nbytes` (medians). The second
  counts the CPU time the process got, so it moves less with the machine's load."""
  return (nbytes / _median_s(fn, repeats, setup) / 1e9,
          nbytes / _median_s(fn, repeats, setup, time.process_time) / 1e9)


def _scatter_codec(codec: offload.PageCodec):
  """The reload of the earlier `PageCodec.write`: the rows split per pool on the host, then
  one jitted scatter per pool (`pool.at[:, pages].set`), the caches donated."""
  def write(caches, pages, parts):
    it = iter(parts)
    out = []
    for c in caches:
      fields = {}
      for name in getattr(c, "POOL_FIELDS", ()):
        pool = getattr(c, name)
        if pool is not None:
          new = jax.lax.bitcast_convert_type(next(it), pool.dtype)
          fields[name] = pool.at[:, pages].set(new)
      out.append(c.replace(**fields) if fields else c)
    return tuple(out)

  jitted = jax.jit(write, donate_argnums=(0,))

  def run(caches, pages, rows):
    payload = np.stack(rows)
    parts, offset = [], 0
    for (shape, dtype), size in zip(codec.layouts, codec.sizes):
      width = jnp.dtype(dtype).itemsize
      raw = np.ascontiguousarray(payload[:, offset:offset + size]).view(f"u{width}")
      parts.append(np.moveaxis(raw.reshape((len(pages),) + shape), 0, 1))
      offset += size
    return jitted(tuple(caches), jnp.asarray(np.asarray(pages, np.int32)), parts)

  return run


def page_lists(count: int, num_pages: int) -> dict[str, list[int]]:
  """The page lists measured: consecutive, runs of 4 with gaps, one page, the whole pool."""
  count = min(count, num_pages // 2)
  gapped = [p for p in range(2 * count) if p % 8 < 4][:count]
  return {f"{count} consecutive": list(range(1, count + 1)),
          f"{count} in runs of 4": gapped, "1 page": [num_pages // 2],
          f"whole pool ({num_pages})": list(range(num_pages))}


def measure(batcher: ContinuousBatcher, pages: list[int], repeats: int
            ) -> dict[str, tuple[float, float]]:
  """`_rates` of memcpy, spill, reload (host and pinned tiers) and the earlier scatter for
  `pages` of the batcher's pool (module doc)."""
  codec = offload.PageCodec(batcher.caches)
  nbytes = len(pages) * codec.page_bytes
  src = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
  dst = np.empty_like(src)
  out = {"MiB": nbytes / 2**20, "memcpy": _rates(nbytes, lambda: np.copyto(dst, src), repeats)}
  blocks = [object() for _ in pages]

  def spill(tier):
    for b, row in zip(blocks, codec.read(batcher.caches, pages)):
      tier.put(b, row)

  def empty(tier):
    for b in blocks:
      tier.discard(b)

  def reload(tier):
    rows = [tier.take(b) for b in blocks]
    batcher.caches = codec.write(batcher.caches, pages, rows)
    jax.block_until_ready(batcher.caches)

  host = offload.HostTier(2 * nbytes, pinned=False)
  out["spill"] = _rates(nbytes, lambda: spill(host), repeats, setup=lambda: empty(host))
  out["reload"] = _rates(nbytes, lambda: reload(host), repeats, setup=lambda: (
      empty(host), spill(host)))
  if offload.pinned_host_available():
    pinned = offload.HostTier(2 * nbytes, pinned=True)
    out["reload pinned"] = _rates(nbytes, lambda: reload(pinned), repeats, setup=lambda: (
        empty(pinned), spill(pinned)))
  scatter = _scatter_codec(codec)
  rows = list(codec.read(batcher.caches, pages))

  def old():
    batcher.caches = scatter(batcher.caches, pages, rows)
    jax.block_until_ready(batcher.caches)

  out["scatter reload"] = _rates(nbytes, old, repeats)
  return out


def overlap(batcher: ContinuousBatcher, pages: list[int], repeats: int) -> dict[str, float]:
  """Seconds of one decode step, of staging `pages`' reload, of both at once (staging on a
  thread), of the pool update after staging, and the share of the staging hidden."""
  codec = offload.PageCodec(batcher.caches)
  rows = list(codec.read(batcher.caches, pages))
  num_pages = codec._pools(batcher.caches)[0].shape[1]  # pylint: disable=protected-access

  def step():
    batcher.step()
    jax.block_until_ready(batcher.caches)

  def stage():
    return jax.block_until_ready(codec.stage(pages, rows, num_pages).device)

  def both():
    thread = threading.Thread(target=stage)
    thread.start()
    step()
    thread.join()

  t_step, t_stage, t_both = (_median_s(f, repeats) for f in (step, stage, both))
  staged = codec.stage(pages, rows, num_pages)

  def update():
    batcher.caches = codec.write(batcher.caches, pages, staged)
    jax.block_until_ready(batcher.caches)

  return {"step_s": t_step, "stage_s": t_stage, "both_s": t_both,
          "update_s": _median_s(update, repeats),
          "hidden": max(0.0, min(1.0, (t_step + t_stage - t_both) / t_stage))}


def main(argv=None) -> None:
  """Prints the GB/s table and the overlap (module doc)."""
  parser = cli.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--model", default="smollm2-135m-instruct",
                      help="a model of experiments.evals.models.load_model")
  parser.add_argument("--pages", type=int, default=65, help="pages per list (default: the "
                      "65 pages of the prefix_reuse config's 1024-token system prompt)")
  parser.add_argument("--num_pages", type=int, default=360, help="pages in the pool")
  parser.add_argument("--repeats", type=int, default=5, help="timed runs per figure (at most "
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
  for name, pages in page_lists(args.pages, args.num_pages).items():
    r = measure(batcher, pages, args.repeats)
    rows.append([name, f"{r['MiB']:.1f}", cell(r["memcpy"]), cell(r["spill"]),
                 cell(r["reload"]), cell(r.get("reload pinned", (float("nan"),) * 2)),
                 cell(r["scatter reload"]), f"{r['reload'][0] / r['memcpy'][0]:.0%} "
                 f"({r['reload'][1] / r['memcpy'][1]:.0%})"])
  print("GB/s of wall time (GB per CPU-second of the process)")
  print(report_lib.markdown_table(
      ["pages", "MiB", "memcpy", "spill", "reload", "reload pinned", "earlier scatter reload",
       "reload / memcpy"], rows))
  rng = np.random.default_rng(1)
  vocab = int(model.vocab_size)
  for rid in ("a", "b"):  # two live requests: every step decodes both
    batcher.add(rid, rng.integers(0, vocab, 32).astype(np.int32), 256 - 32)
  o = overlap(batcher, list(range(1, args.pages + 1)), args.repeats)
  print(f"\noverlap ({args.pages} pages): decode step {o['step_s'] * 1e3:.1f} ms, staging "
        f"{o['stage_s'] * 1e3:.1f} ms, both {o['both_s'] * 1e3:.1f} ms -> {o['hidden']:.0%} of "
        f"the staging hidden; the pool update after it {o['update_s'] * 1e3:.1f} ms")
  print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs; JAX "
        f"{jax.__version__}, {jax.devices()[0].platform}")


if __name__ == "__main__":
  cli.run_plain(main)
