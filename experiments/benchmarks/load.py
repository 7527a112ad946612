"""Load time and prefill/decode speed of a pretrained model under `kvattn.generate`.

    python -m experiments.benchmarks.load --model smollm2-135m-instruct --batches 1,8 \\
        --prompt_len 512 --new_tokens 64

Takes `--model`, `--cache`, `--page_size` and `--dtype` as `experiments.chat`
does. Times `kvattn.checkpoints.pretrained.from_pretrained(--model)` (the checkpoint already in
the cache), then for each batch size builds `--prompt_len`-token prompts from
real text (the tokenizer's ids of a paragraph, repeated), runs the prefill and
the decode loop once to compile them, and times `--repeats` further runs (no
eos: every one of the `new_tokens - 1` decode steps runs). Prints one JSON
line per batch size: medians of

  prefill_tokens_per_s   batch * prompt_len / prefill seconds
  decode_tokens_per_s    batch * (new_tokens - 1) / decode seconds
  load_s                 from_pretrained wall seconds
  cache_bytes            bytes of every cache array (`kvattn.memory.tree_bytes`)
  *_cpu_s                process CPU seconds (the work, which a busy machine's
                         other processes do not inflate)
"""

from __future__ import annotations

import json
import os
import statistics
from typing import Sequence

import jax
import numpy as np
from absl import app, flags

from experiments import chat
from experiments.framework import cli

# --model, --cache, --page_size and --dtype are experiments.chat's flags.
FLAGS = flags.FLAGS
flags.DEFINE_list("batches", ["1", "8"], "Batch sizes B.")
flags.DEFINE_integer("prompt_len", 512, "Prompt tokens per sequence (all full length).")
flags.DEFINE_integer("new_tokens", 64, "Tokens generated per sequence (decode steps + 1).")
flags.DEFINE_integer("repeats", 3, "Timed runs per batch size (after one compiling run).")

TEXT = ("The history of the city begins with a small settlement on an island in the river. "
        "Over the centuries it grew into a centre of trade, learning and government, and its "
        "bridges, markets and churches drew people from the whole country. ")


def main(argv: Sequence[str]) -> None:
  """absl entry point: one JSON line per batch size."""
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if FLAGS.new_tokens < 2:
    raise app.UsageError(f"--new_tokens must be >= 2; got {FLAGS.new_tokens}")
  model, tok, load_s = chat.load(FLAGS.model, FLAGS.dtype)
  ids = tok.encode(TEXT)
  ids = (ids * (FLAGS.prompt_len // len(ids) + 1))[:FLAGS.prompt_len]
  for batch in (int(b) for b in FLAGS.batches):
    prompts = np.tile(np.asarray(ids, np.int32), (batch, 1))
    lengths = np.full((batch,), FLAGS.prompt_len, np.int32)
    runs = [chat.run(model, prompts, lengths, FLAGS.new_tokens, cache=FLAGS.cache,
                     page_size=FLAGS.page_size)
            for _ in range(FLAGS.repeats + 1)][1:]  # the first compiles
    if any(int(r.lengths.min()) != FLAGS.new_tokens for r in runs):
      raise RuntimeError("decode stopped early")
    prefill_s = statistics.median(r.prefill_s for r in runs)
    decode_s = statistics.median(r.decode_s for r in runs)
    print(json.dumps({
        "model": FLAGS.model, "batch": batch, "prompt_len": FLAGS.prompt_len,
        "new_tokens": FLAGS.new_tokens, "cache": FLAGS.cache, "dtype": FLAGS.dtype,
        "load_s": round(load_s, 2), "prefill_s": prefill_s, "decode_s": decode_s,
        "prefill_cpu_s": statistics.median(r.prefill_cpu_s for r in runs),
        "decode_cpu_s": statistics.median(r.decode_cpu_s for r in runs),
        "prefill_tokens_per_s": batch * FLAGS.prompt_len / prefill_s,
        "decode_tokens_per_s": batch * (FLAGS.new_tokens - 1) / decode_s,
        "cache_bytes": runs[0].cache_bytes, "repeats": FLAGS.repeats,
        "backend": jax.default_backend(), "device": jax.devices()[0].device_kind,
        "cpu_count": os.cpu_count(), "load_avg_1min": os.getloadavg()[0]}))


if __name__ == "__main__":
  cli.run(main)
