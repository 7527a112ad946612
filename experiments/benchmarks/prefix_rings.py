"""The batcher's prefix cache with the per-layer layout (rings for the windowed layers).

    python -m experiments.benchmarks.prefix_rings                        # Gemma 3 270M
    python -m experiments.benchmarks.prefix_rings --model=gemma3-270m --random_weights \
        --system_len=40 --question_len=4 --new_tokens=2 --window=16

Serves, through one `ContinuousBatcher(prefix_cache=True, local_layers="ring")` and one
without the prefix cache (`local_layers="ring"`), the same requests: a warm-up pair with
another system prompt (compiles), then `--requests` prompts of a shared `--system_len`-token
system prompt and a distinct `--question_len`-token question each, one at a time. With rings
a hit needs the rings' snapshot at the cached prefix's end: the first prompt of the system
prompt is a miss, the second reveals the shared prefix (its prefill is split there and the
rings snapshotted), the later ones hit. Prints, per request, time to first token (`add`,
first token on the host) in both batchers, interleaved (this machine may be loaded: the ratio
of medians is what to read), the tokens the prefix cache took from the cache, whether the
greedy tokens agree, and the snapshot count and bytes (`stats()`), next to the bytes of the
pages the hit reused.
"""

from __future__ import annotations

import statistics
import time

import jax
import numpy as np

from experiments.evals import models
from experiments.framework import cli
from kvattn.inference.batching import ContinuousBatcher


def _ttft(batcher, rid, prompt, new):
  jax.block_until_ready(jax.tree.leaves(batcher.caches))
  start = time.perf_counter()
  batcher.add(rid, prompt, new)
  ttft = time.perf_counter() - start
  out = None
  while batcher.active:
    for f in batcher.step():
      out = f
  return ttft, out


def run(argv=None) -> dict:
  """The measurement (module doc); returns what it printed."""
  parser = cli.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--model", default="gemma3-270m")
  parser.add_argument("--random_weights", action="store_true")
  parser.add_argument("--system_len", type=int, default=768)
  parser.add_argument("--question_len", type=int, default=16)
  parser.add_argument("--new_tokens", type=int, default=4)
  parser.add_argument("--requests", type=int, default=4)
  parser.add_argument("--page_size", type=int, default=16)
  parser.add_argument("--window", type=int, default=0,
                      help="override the windowed layers' window (0: the model's)")
  args = parser.parse_args(argv)
  model, _ = models.load_model(args.model, random_weights=args.random_weights)
  if args.window:
    for layer in model.layers:
      if getattr(layer.attn, "window", None) is not None:
        layer.attn.window = args.window
  vocab = int(model.vocab_size)
  rng = np.random.default_rng(0)
  system, warm = (rng.integers(0, vocab, args.system_len).astype(np.int32) for _ in range(2))
  questions = [rng.integers(0, vocab, args.question_len).astype(np.int32)
               for _ in range(args.requests + 2)]
  n = args.system_len + args.question_len
  opts = dict(num_slots=1, page_size=args.page_size, max_len=n + args.new_tokens - 1,
              max_prompt_len=n, local_layers="ring")
  pages = -(-(n + args.new_tokens) // args.page_size)
  cached = ContinuousBatcher(model, num_pages=4 * pages, prefix_cache=True, **opts)
  plain = ContinuousBatcher(model, num_pages=pages, **opts)
  for i, q in enumerate(questions[:2]):  # warm-up: miss, then split at the shared prefix
    for b in (cached, plain):
      _ttft(b, f"warm{i}", np.concatenate([warm, q]), args.new_tokens)
  rows = []
  for i, q in enumerate(questions[2:]):
    prompt = np.concatenate([system, q])
    before = cached.allocator.counters["cached_tokens"]
    t_cached, f_cached = _ttft(cached, f"r{i}", prompt, args.new_tokens)
    t_plain, f_plain = _ttft(plain, f"r{i}", prompt, args.new_tokens)
    rows.append(dict(ttft_cached_s=t_cached, ttft_plain_s=t_plain,
                     cached_tokens=cached.allocator.counters["cached_tokens"] - before,
                     same_tokens=f_cached.tokens.tolist() == f_plain.tokens.tolist()))
  stats = cached.stats()
  global_layers = [i for i in range(len(cached.caches)) if i not in cached.ring_layers]
  page_bytes = sum(int(np.prod(cached.caches[i].k_pages.shape[2:])) * 2 *
                   cached.caches[i].k_pages.dtype.itemsize for i in global_layers)
  print(f"model {args.model} (random weights: {args.random_weights}), backend "
        f"{jax.default_backend()}, {len(cached.ring_layers)} ring layers / {len(global_layers)} "
        f"paged, prompt {args.system_len} + {args.question_len}, page {args.page_size}")
  print("| request | cached tokens | TTFT prefix cache s | TTFT no prefix cache s | same tokens |")
  print("|---|---|---|---|---|")
  for i, r in enumerate(rows):
    print(f"| r{i} | {r['cached_tokens']} | {r['ttft_cached_s']:.3f} | {r['ttft_plain_s']:.3f} | "
          f"{r['same_tokens']} |")
  hits = [r for r in rows if r["cached_tokens"]]
  if hits:
    ratio = (statistics.median(r["ttft_plain_s"] for r in hits) /
             statistics.median(r["ttft_cached_s"] for r in hits))
    print(f"hits: median TTFT without / with the prefix cache = {ratio:.2f}x")
  print(f"ring snapshots held: {stats['ring_snapshots']}, {stats['ring_snapshot_bytes'] / 2**20:.2f}"
        f" MiB ({stats['ring_snapshot_bytes'] // max(stats['ring_snapshots'], 1)} B each); one "
        f"page of the paged layers: {page_bytes} B; a hit of {args.system_len} tokens reuses "
        f"{args.system_len // args.page_size * page_bytes / 2**20:.2f} MiB of pages")
  return {"rows": rows, "stats": stats, "page_bytes": page_bytes}


def main(argv=None) -> None:
  """Prints the time-to-first-token table (module doc); `argv` as `run`'s."""
  run(argv)


if __name__ == "__main__":
  cli.run_plain(main)
