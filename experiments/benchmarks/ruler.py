"""A model's scores on the local RULER-style suite, per task and length (experiments.evals.ruler).

    python -m experiments.benchmarks.ruler --model smollm2-135m-instruct \
        --lengths 1024,2048,4096,8192 --samples 4 --out runs/ruler_smollm2.jsonl
    python -m experiments.benchmarks.ruler --cache '{"kind": "snapkv", "budget": 512}' ...

Each `(task, length, seed)` example is answered greedily through `kvattn.generate` (through
the chat template when the tokenizer has one, else as raw text; `--batch` prompts per call)
and scored by `string_match_all`. One JSON line per example is appended to `--out` as soon as
its batch finishes; a rerun with the same `--out` skips the examples already there (an
interrupted run loses no finished result). At the end a table of mean scores, task by length,
is printed, and the tasks whose mean over lengths
is at least `--qualify` are named: only there does comparing caches mean anything.
"""

from __future__ import annotations

import collections
import json
import os

from absl import flags

from experiments.evals import models
from experiments.evals import ruler
from experiments.framework import cli
from kvattn.caches import registry

flags.DEFINE_string("model", "smollm2-135m-instruct", "Registered name (kvattn.checkpoints.hub).")
flags.DEFINE_list("lengths", ["1024", "2048", "4096", "8192"], "Prompt lengths (tokens).")
flags.DEFINE_list("tasks", list(ruler.TASKS), "Tasks of experiments.evals.ruler.TASKS.")
flags.DEFINE_integer("samples", 4, "Examples (seeds 0..samples-1) per task and length.")
flags.DEFINE_integer("batch", 4, "Prompts per generate call.")
flags.DEFINE_string("cache", "", "A cache spec as JSON (kvattn.caches.registry); empty: dense.")
flags.DEFINE_string("out", "", "JSON-lines results file, appended to and resumed from.")
flags.DEFINE_float("qualify", 0.5, "Mean score over lengths that qualifies a task.")
FLAGS = flags.FLAGS


def _done(path: str) -> dict[tuple, dict]:
  rows = {}
  if path and os.path.exists(path):
    with open(path) as f:
      for line in f:
        if line.strip():
          r = json.loads(line)
          rows[(r["model"], r["cache"], r["task"], r["length"], r["seed"])] = r
  return rows


def main(argv) -> None:
  """Scores every `(task, length, seed)` not yet in `--out`, then prints the table (module
  doc); a bad `--tasks`, `--lengths` or `--cache` is a one-line user error."""
  del argv
  for task in FLAGS.tasks:
    if task not in ruler.TASKS:
      raise cli.UserError(f"--tasks must hold tasks of {ruler.TASKS}; got {task!r}")
  try:
    lengths = [int(x) for x in FLAGS.lengths]
    spec = json.loads(FLAGS.cache) if FLAGS.cache else {"kind": "dense"}
    registry.cache_options(spec, "--cache")
  except ValueError as e:
    raise cli.UserError(str(e)) from e
  cache = json.dumps(spec, sort_keys=True)
  model, tok = models.load_model(FLAGS.model)
  chat = getattr(tok, "chat_template", None) is not None  # a base model gets raw text
  done = _done(FLAGS.out)
  kwargs = {} if spec["kind"] == "dense" else {
      "cache_factory": registry.cache_factory_from_config(model, spec)}
  for length in lengths:
    todo = [ruler.make(t, tok, length, s) for t in FLAGS.tasks for s in range(FLAGS.samples)
            if (FLAGS.model, cache, t, length, s) not in done]
    for start in range(0, len(todo), FLAGS.batch):
      chunk = todo[start:start + FLAGS.batch]
      scores, outputs = ruler.evaluate(model, tok, chunk, chat=chat, batch=FLAGS.batch,
                                       generate_kwargs=kwargs)
      for ex, s, out in zip(chunk, scores, outputs):
        row = {"model": FLAGS.model, "cache": cache, "task": ex.task, "length": length,
               "seed": ex.seed, "score": s, "answers": list(ex.answers), "output": out}
        done[(FLAGS.model, cache, ex.task, length, ex.seed)] = row
        if FLAGS.out:
          with open(FLAGS.out, "a") as f:
            f.write(json.dumps(row) + "\n")
  table = collections.defaultdict(list)
  for (m, c, task, length, _), r in done.items():
    if m == FLAGS.model and c == cache and length in lengths and task in FLAGS.tasks:
      table[task, length].append(r["score"])
  print(f"{FLAGS.model} ({'chat template' if chat else 'raw text'}), cache {cache}: mean "
        f"score of {FLAGS.samples} examples")
  print("| task | " + " | ".join(str(n) for n in lengths) + " |")
  print("|---|" + "---|" * len(lengths))
  qualified = []
  for task in FLAGS.tasks:
    means = [sum(table[task, n]) / max(1, len(table[task, n])) for n in lengths]
    print(f"| {task} | " + " | ".join(f"{m:.2f}" for m in means) + " |")
    if sum(means) / len(means) >= FLAGS.qualify:
      qualified.append(task)
  print(f"tasks at or above {FLAGS.qualify} uncompressed: {qualified or 'none'}")


if __name__ == "__main__":
  cli.run(main)
