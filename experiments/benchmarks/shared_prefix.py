"""One prefix cache for several workers: TTFT of a remote hit against a local hit and a miss.

    python -m experiments.benchmarks.shared_prefix                       # 2048 + 32 tokens
    python -m experiments.benchmarks.shared_prefix --prefix=256 --rounds=3   # quick

Two workers, two processes, two JAX runtimes that share only a directory
(`kvattn.paging.shared.SharedPrefixStore`). This process is worker B; it first runs worker A
(this module, `--role=publisher`) to the end: A serves, per round, a prompt of a fresh
random `--prefix`-token prefix plus a `--suffix`-token suffix, publishing its full pages.
Both hold `--model` with the same random weights (SmolLM2-135M's shapes by default: 30
layers, 9 query heads, 3 KV heads of 64) and a `ContinuousBatcher` over paged f32 pools of
`--page_size` tokens, one slot.

Per round worker B times, in an order rotated every round:
- `miss`: a fresh prompt on a batcher without a prefix cache (the whole prompt prefilled);
- `miss_publish`: a fresh prompt on B's shared batcher (prefilled, then its pages published);
- `local_hit`: right after `miss_publish`, the same prefix with another suffix (pages in B's
  pool: only the suffix is prefilled);
- `remote_hit`: A's prefix of this round with another suffix (pages read from A's files,
  verified, written into B's pool; only the suffix is prefilled).
TTFT is the wall time of `batcher.add(..., max_new_tokens=1)` (allocation, reload, prefill,
publishing, the first token on the host); CPU is the process's CPU seconds over the same call.
Round 0 compiles every program and checks that the remote hit's first token equals a miss's
on the same prompt; it is not counted. A's `miss_publish` times come from its own process.
Last, the file part of a remote hit alone: `SharedPrefixStore.read` (open, read, sha256,
header checks) over one published prefix's pages, median of 3.

Prints one JSON line per record and a markdown table with each path's median and its ratio
to `miss`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

import jax.numpy as jnp
import numpy as np

from experiments.framework import cli

from kvattn.inference.batching import ContinuousBatcher
from kvattn.paging.prefix import page_digest
from kvattn.paging.shared import SharedPrefixStore, namespace


def _model(args):
  from experiments.evals import models  # pylint: disable=g-import-not-at-top
  model, _ = models.load_model(args.model, random_weights=True, seed=0)
  args.vocab = int(model.vocab_size)  # prompts draw token ids below it
  return model


def _prompt(args, seed: int, suffix_seed: int) -> np.ndarray:
  """A `--prefix`-token prefix drawn from `seed` and a `--suffix`-token suffix from
  `suffix_seed` (random token ids)."""
  prefix = np.random.default_rng(seed).integers(3, args.vocab, args.prefix)
  suffix = np.random.default_rng(10**6 + suffix_seed).integers(3, args.vocab, args.suffix)
  return np.concatenate([prefix, suffix]).astype(np.int32)


def _batcher(model, args, store=None, prefix_cache=True):
  n = args.prefix + args.suffix
  pages = (n + args.page_size - 1) // args.page_size + 1
  return ContinuousBatcher(model, num_slots=1, num_pages=2 * pages + 2, page_size=args.page_size,
                           max_len=n + 1, max_prompt_len=n, dtype=jnp.dtype(args.cache_dtype),
                           prefix_cache=prefix_cache, offload=store)


def _timed(batcher, rid, prompt) -> dict:
  before = dict(batcher.allocator.counters) if batcher.prefix_cache else {}
  filled = batcher.prefill_tokens
  wall, cpu = time.perf_counter(), time.process_time()
  out = batcher.add(rid, prompt, 1)
  wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
  after = batcher.allocator.counters if batcher.prefix_cache else {}
  delta = lambda k: int(after.get(k, 0) - before.get(k, 0))
  return dict(ttft_s=wall, cpu_s=cpu, first=int(out.tokens[0]),
              prefilled=batcher.prefill_tokens - filled, shared_pages=delta("shared_pages"),
              published=delta("pages_published"))


def _store(model, args):
  start = time.perf_counter()
  ns = namespace(model, page_size=args.page_size, dtype=args.cache_dtype)
  return SharedPrefixStore(args.dir, ns), time.perf_counter() - start


def publisher(args) -> None:
  """Worker A: per round (0 compiles) serves prefix `round` + suffix 0 and prints its time."""
  model = _model(args)
  store, ns_s = _store(model, args)
  batcher = _batcher(model, args, store)
  for r in range(args.rounds + 1):
    row = _timed(batcher, f"a{r}", _prompt(args, 1000 + r, 0))
    print(json.dumps(dict(record="publisher", round=r, namespace_s=ns_s, **row)), flush=True)


def _read_verify(store, prompt, page_size: int, repeats: int = 3) -> dict:
  """Median time of `store.read` (open, read, sha256 and header checks) over the full pages
  of `prompt`'s prefix that are in the store: the file part of a remote hit."""
  keys, parent = [], b""
  for j in range((len(prompt) - 1) // page_size):
    chunk = prompt[j * page_size:(j + 1) * page_size]
    parent = page_digest(parent, chunk)
    if not store.contains(parent):
      break
    keys.append((parent, chunk))
  times, cpus, nbytes = [], [], 0
  for _ in range(repeats):
    wall, cpu = time.perf_counter(), time.process_time()
    nbytes = sum(store.read(k, t).nbytes for k, t in keys)
    times.append(time.perf_counter() - wall)
    cpus.append(time.process_time() - cpu)
  s = float(np.median(times))
  return dict(pages=len(keys), mib=nbytes / 2**20, s=s, cpu_s=float(np.median(cpus)),
              gbps=nbytes / s / 1e9 if s else 0.0)


def main(argv=None) -> int:
  """Runs worker A as a child process to the end, then worker B's rounds here; prints the
  records and a table. Returns the exit status."""
  p = cli.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--role", default="reader", choices=("reader", "publisher"))
  p.add_argument("--dir", default=None, help="the shared directory (default a temporary one)")
  p.add_argument("--model", default="smollm2-135m-instruct")
  p.add_argument("--prefix", type=int, default=2048, help="shared prefix tokens")
  p.add_argument("--suffix", type=int, default=32, help="suffix tokens after the prefix")
  p.add_argument("--page_size", type=int, default=16)
  p.add_argument("--cache_dtype", default="float32")
  p.add_argument("--rounds", type=int, default=3, help="timed rounds (after one compiling)")
  args = p.parse_args(argv)
  if args.role == "publisher":
    publisher(args)
    return 0
  with tempfile.TemporaryDirectory() as scratch:
    args.dir = args.dir or scratch
    flags = [a for a in (argv if argv is not None else sys.argv[1:]) if not a.startswith(
        ("--role", "--dir"))]
    child = subprocess.run([sys.executable, "-m", "experiments.benchmarks.shared_prefix",
                            "--role=publisher", f"--dir={args.dir}", *flags],
                           env=dict(os.environ), stdout=subprocess.PIPE, text=True, check=True)
    published = [json.loads(line) for line in child.stdout.splitlines() if line.startswith("{")]
    for row in published:
      print(json.dumps(row), flush=True)
    reader(args, published)
  return 0


def reader(args, published: list[dict]) -> None:
  """Worker B's rounds (module docstring)."""
  model = _model(args)
  store, ns_s = _store(model, args)
  shared = _batcher(model, args, store)
  plain = _batcher(model, args, prefix_cache=False)
  rows = []
  for r in range(args.rounds + 1):
    got = {}

    def miss():
      got["miss"] = _timed(plain, f"m{r}", _prompt(args, 3000 + r, 1))

    def publish_then_local():
      got["miss_publish"] = _timed(shared, f"p{r}", _prompt(args, 2000 + r, 1))
      got["local_hit"] = _timed(shared, f"l{r}", _prompt(args, 2000 + r, 2))

    def remote():
      got["remote_hit"] = _timed(shared, f"r{r}", _prompt(args, 1000 + r, 3))

    order = [miss, publish_then_local, remote]
    for fn in order[r % 3:] + order[:r % 3]:
      fn()
    if r == 0:  # the remote hit's first token against a miss on the same prompt
      check = _timed(plain, "check", _prompt(args, 1000, 3))
      tokens_equal = check["first"] == got["remote_hit"]["first"]
      print(json.dumps(dict(record="check", tokens_equal=tokens_equal,
                            remote_first=got["remote_hit"]["first"], miss_first=check["first"])),
            flush=True)
      continue
    for path, row in got.items():
      rows.append(dict(record="round", round=r, path=path, **row))
      print(json.dumps(rows[-1]), flush=True)
  for row in published[1:]:
    rows.append(dict(row, path="miss_publish (worker A)"))
  med = lambda path, k: float(np.median([x[k] for x in rows if x["path"] == path]))
  miss = med("miss", "ttft_s")
  record = dict(record="shared_prefix", model=args.model, prefix=args.prefix,
                suffix=args.suffix, page_size=args.page_size, cache_dtype=args.cache_dtype,
                rounds=args.rounds, namespace_s=ns_s, tokens_equal=tokens_equal,
                page_bytes=None, store=dict(store.counters))
  for path in ("miss", "miss_publish", "miss_publish (worker A)", "local_hit", "remote_hit"):
    record[path] = dict(ttft_s=med(path, "ttft_s"), cpu_s=med(path, "cpu_s"),
                        prefilled=med(path, "prefilled"), shared_pages=med(path, "shared_pages"),
                        published=med(path, "published"), vs_miss=miss / med(path, "ttft_s"))
  files = store.files()
  record["page_bytes"] = os.path.getsize(files[0]) if files else None
  record["read_verify"] = _read_verify(store, _prompt(args, 1001, 3), args.page_size)
  print(json.dumps(record), flush=True)
  rv = record["read_verify"]
  print(f"reading and verifying the {rv['pages']} page files of one prefix ({rv['mib']:.1f} MiB): "
        f"{rv['s']:.3f} s ({rv['gbps']:.2f} GB/s), CPU {rv['cpu_s']:.3f} s")
  print("| path | TTFT s (median) | CPU s (median) | miss / TTFT | prefilled tokens | pages "
        "from the shared store | pages published |\n|---|---:|---:|---:|---:|---:|---:|")
  for path in ("miss", "miss_publish", "miss_publish (worker A)", "local_hit", "remote_hit"):
    x = record[path]
    print(f"| {path} | {x['ttft_s']:.3f} | {x['cpu_s']:.3f} | {x['vs_miss']:.2f}x | "
          f"{x['prefilled']:.0f} | {x['shared_pages']:.0f} | {x['published']:.0f} |")


if __name__ == "__main__":
  cli.run_plain(main)
