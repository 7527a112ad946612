"""The batcher's prefix cache over 4-bit KIVI pools with a residual (issue 28).

    python -m experiments.benchmarks.prefix_lowbit

One `ContinuousBatcher(cache={"kind": "paged_kivi4", "group_size": 32, "residual": 32},
prefix_cache=True)` on SmolLM2-135M-Instruct (CPU or whatever JAX finds), page 32. After a
warm-up request (compiles), three rounds of: a cold prompt (a fresh 256-token system prompt
+ 40 tokens), a second prompt of that system prompt (it reveals the shared prefix: its
prefill is split at 256 and the residual rings snapshotted there), and a third (a hit of 256
tokens: the pages plus the rings restored from the snapshot). Prints each round's join time
(`add` until the caches are ready) of the cold prompt and of the hit, the prompt tokens each
prefilled, the ratio of medians (the machine may be loaded: read the ratio), and the
snapshots' count and bytes from `stats()`.
"""

from __future__ import annotations

import time

import jax
import numpy as np

from experiments.framework import cli
import kvattn
from kvattn.inference.batching import ContinuousBatcher


def main(argv=None) -> None:
  """Prints the cold vs hit join times and the snapshots' bytes (module doc); takes no
  flags."""
  cli.ArgumentParser(description=__doc__.split("\n")[0]).parse_args(argv)  # no options
  model, _ = kvattn.from_pretrained("smollm2-135m-instruct")
  rng = np.random.default_rng(0)
  vocab = int(model.vocab_size)
  spec = {"kind": "paged_kivi4", "group_size": 32, "residual": 32}
  batcher = ContinuousBatcher(model, num_slots=2, num_pages=64, page_size=32, max_len=384,
                              max_prompt_len=320, cache=spec, prefix_cache=True, seed=0)

  def prompt(system):
    return np.concatenate([system, rng.integers(0, vocab, 40)]).astype(np.int32)

  def timed(rid, tokens):
    before = batcher.prefill_tokens
    t = time.perf_counter()
    batcher.add(rid, tokens, 2)
    jax.block_until_ready(batcher.caches)
    dt = time.perf_counter() - t
    while batcher.active:
      batcher.step()
    return dt, batcher.prefill_tokens - before

  timed("warm-up", prompt(rng.integers(0, vocab, 256)))
  colds, hits = [], []
  for i in range(3):
    system = rng.integers(0, vocab, 256)
    cold, cold_tokens = timed(f"cold{i}", prompt(system))
    timed(f"reveal{i}", prompt(system))
    hit, hit_tokens = timed(f"hit{i}", prompt(system))
    colds.append(cold)
    hits.append(hit)
    print(f"cold {cold:.3f} s ({cold_tokens} tokens prefilled)  hit {hit:.3f} s "
          f"({hit_tokens} tokens)", flush=True)
  stats = batcher.stats()
  print(f"median cold / hit: {np.median(colds) / np.median(hits):.2f}x; snapshots "
        f"{stats['ring_snapshots']}, {stats['ring_snapshot_bytes']} bytes "
        f"({stats['ring_snapshot_bytes'] / stats['ring_snapshots']:.0f} per state)")


if __name__ == "__main__":
  cli.run_plain(main)
