r"""kvpress (NVIDIA, PyPI `kvpress` 0.5.5) on the local RULER-style suite: the peer of the
compression family (configs/compression.py).

Runs in its own venv, since kvpress pins transformers < 5.3 (setup.cfg's `kvpress` extra;
never together with `[peers]`):

    python3 -m venv /work/kvpress-venv
    /work/kvpress-venv/bin/pip install "torch==2.13.0+cpu" "kvpress==0.5.5" gguf
    # (CPU torch; add --extra-index-url https://download.pytorch.org/whl/cpu where the
    # configured indexes lack the +cpu wheel)
    /work/kvpress-venv/bin/python -m experiments.benchmarks.peers.kvpress_ruler \
        --presses knorm,snapkv --ratios 0,0.5 --tasks niah_single --lengths 1024 \
        --seeds 0,1,2,3 --out runs/kvpress_ruler.jsonl

It imports neither jax nor kvattn: the examples come from `experiments.evals.ruler` (numpy
only) with the Hugging Face tokenizer of the same GGUF, so `(task, length, seed)` gives the
same prompt text as kvattn's side (the record's `prompt_sha1` lets the report check that).
Each example goes through kvpress's `KVPressTextGenerationPipeline`: the chat-templated
context (`Example.context`) is prefilled and compressed by the press at `compression_ratio`,
then the question (`"\n\n" + Example.question`, the template's end and the answer prefix) is
appended uncompressed and answered greedily for `ruler.MAX_NEW_TOKENS[task]` tokens, one
example at a time. Concatenated, context and question are `ruler.encode(..., chat=True)`'s
text.

One JSON line per `(press, ratio, task, length, seed)` is appended to `--out` as soon as it
is scored (`score`, `output`, `wall_s`: seconds of the pipeline call); a rerun with the same
`--out` skips the keys already there. A press that cannot run offline (it downloads weights or
a data set) gets one record with `skipped` and the reason, and no example of it is run.
"""

from __future__ import annotations

import argparse
import glob
import importlib.metadata
import json
import os
import time
from typing import Any, Callable, Iterable, Sequence

from experiments.evals import ruler

RATIOS = (0.0, 0.25, 0.5, 0.75, 0.9)
MODEL_GLOBS = {
    "smollm2-135m-instruct": "~/.cache/kvattn/smollm2-135m-instruct/*.gguf",
    "gemma3-270m": "~/.cache/kvattn/gemma3-270m/*.gguf",
}
"""Registered model name -> the GGUF file kvattn.from_pretrained caches (the same weights)."""

OFFLINE_SKIPS = {
    "qfilter": "QFilterPress downloads its projections (nthngdy/<model>_qfilt) from the "
               "Hugging Face Hub; none is published for SmolLM2 / Gemma 3 270M, and the "
               "machine is offline",
    "duo_attention": "DuoAttentionPress downloads its head patterns (or, on the fly, the "
                     "booksum data set) from the network; the machine is offline",
}
"""Presses kvpress has that cannot run here, with the reason written to their record."""

KVATTN_NAMES = {"observed_attention": "h2o", "streaming_llm": "sink", "composed": "snapkv+knorm",
                "decoding": "decoding_knorm", "adakv": "adakv_snapkv"}
"""kvpress press name -> the kvattn cache kind it corresponds to, where the names differ
(ObservedAttention is H2O's accumulated attention; StreamingLLM is sinks plus a window;
"composed" is SnapKV then Knorm, kvattn's `composed.compose("snapkv", "knorm")`; "decoding" is
DecodingPress over Knorm, kvattn's "decoding_knorm"; "adakv" is AdaKVPress(SnapKVPress),
kvattn's "adakv_snapkv" under the context protocol, as is every "adakv_<inner>")."""

ADAKV_INNER = {"keydiff": "KeyDiffPress", "expected_attention": "ExpectedAttentionPress",
               "knorm": "KnormPress", "snapkv": "SnapKVPress"}
"""kvattn policy -> the kvpress ScorerPress `AdaKVPress` wraps in press "adakv_<policy>" (kvattn's
kinds of the same names, kvattn/caches/adakv_context.py)."""
ADAKV_PRESSES = tuple(f"adakv_{inner}" for inner in ADAKV_INNER)


def press_names() -> tuple[str, ...]:
  """The presses this runner knows, in the order of the report."""
  return ("knorm", "snapkv", "tova", "observed_attention", "random", "streaming_llm",
          "expected_attention", "keydiff", "qfilter", "chunkkv", "criticalkv", "composed",
          "pyramidkv", "adakv", *ADAKV_PRESSES, "think", "duo_attention", "decoding")


def composed_ratios(ratio: float, context_tokens: int) -> tuple[float, float]:
  """`(r1, r2)` of `ComposedPress([SnapKVPress(r1), KnormPress(r2)])` that keep what kvattn's
  "snapkv+knorm" keeps at `ratio`: SnapKV narrows the n context tokens to
  `min(n, 2 * kept)` (kvattn's default `first_keep`, twice the kept count), Knorm keeps
  `kept = max(1, int(n * (1 - ratio)))` of them (each ratio puts half a token of margin under
  kvpress's `int(m * (1 - r))`)."""
  n = context_tokens
  kept = max(1, int(n * (1 - ratio)))
  first = min(n, 2 * kept)
  r1 = 0.0 if first == n else 1 - (first + 0.5) / n
  r2 = 1 - (kept + 0.5) / first
  return r1, max(r2, 0.0)


def make_press(name: str, ratio: float, context_tokens: int) -> Any:
  """The kvpress press `name` at `compression_ratio=ratio` (None at ratio 0: no press).

  ThinK prunes key channels, not tokens: `ratio` is its `key_channel_compression_ratio`.
  ChunkKV, CriticalKV and AdaKV wrap SnapKVPress (kvattn's inner default); "adakv_<inner>" is
  `AdaKVPress(<ADAKV_INNER[inner]>)` at its default safeguard (alpha 0.2); "composed" is
  SnapKV then Knorm at `composed_ratios`.
  DecodingPress compresses during decoding only: every 8 generated tokens the cache is
  brought back to `int(context_tokens * (1 - ratio))` tokens by KnormPress scores.

  Raises:
    ValueError: an unknown `name`, or one of `OFFLINE_SKIPS`.
  """
  if name in OFFLINE_SKIPS:
    raise ValueError(f"press {name!r} cannot run offline: {OFFLINE_SKIPS[name]}")
  if name != "none" and name not in press_names():
    raise ValueError(f"press must be one of {press_names()}; got {name!r}")
  if ratio == 0 or name == "none":
    return None
  import kvpress  # pylint: disable=g-import-not-at-top
  factories: dict[str, Callable[[], Any]] = {
      "knorm": lambda: kvpress.KnormPress(compression_ratio=ratio),
      "snapkv": lambda: kvpress.SnapKVPress(compression_ratio=ratio),
      "tova": lambda: kvpress.TOVAPress(compression_ratio=ratio),
      "observed_attention": lambda: kvpress.ObservedAttentionPress(compression_ratio=ratio),
      "random": lambda: kvpress.RandomPress(compression_ratio=ratio, seed=0),
      "streaming_llm": lambda: kvpress.StreamingLLMPress(compression_ratio=ratio),
      "expected_attention": lambda: kvpress.ExpectedAttentionPress(compression_ratio=ratio),
      "keydiff": lambda: kvpress.KeyDiffPress(compression_ratio=ratio),
      "chunkkv": lambda: kvpress.ChunkKVPress(press=kvpress.SnapKVPress(compression_ratio=ratio)),
      "criticalkv": lambda: kvpress.CriticalKVPress(
          press=kvpress.SnapKVPress(compression_ratio=ratio)),
      "composed": lambda: kvpress.ComposedPress([
          kvpress.SnapKVPress(compression_ratio=composed_ratios(ratio, context_tokens)[0]),
          kvpress.KnormPress(compression_ratio=composed_ratios(ratio, context_tokens)[1])]),
      "pyramidkv": lambda: kvpress.PyramidKVPress(compression_ratio=ratio),
      "adakv": lambda: kvpress.AdaKVPress(press=kvpress.SnapKVPress(compression_ratio=ratio)),
      **{f"adakv_{inner}": (lambda cls=cls: kvpress.AdaKVPress(
          press=getattr(kvpress, cls)(compression_ratio=ratio)))
         for inner, cls in ADAKV_INNER.items()},
      "think": lambda: kvpress.ThinKPress(key_channel_compression_ratio=ratio),
      "decoding": lambda: kvpress.DecodingPress(
          base_press=kvpress.KnormPress(), compression_interval=8,
          target_size=max(1, int(context_tokens * (1 - ratio)))),
  }
  if name not in factories:
    raise ValueError(f"press must be one of {press_names()}; got {name!r}")
  return factories[name]()


def key_of(record: dict[str, Any]) -> tuple:
  """The resume key of a record: `(model, press, ratio, task, length, seed)`; a skip record
  (`skipped` set) has task, length and seed None."""
  return (record["model"], record["press"], float(record["ratio"]), record.get("task"),
          record.get("length"), record.get("seed"))


def read_done(path: str) -> dict[tuple, dict[str, Any]]:
  """Records already in the JSON-lines file `path` by `key_of` (empty when it does not exist);
  a torn last line (an interrupted write) is ignored, so its example is run again."""
  done = {}
  if path and os.path.exists(path):
    with open(path) as f:
      for line in f:
        try:
          record = json.loads(line)
        except json.JSONDecodeError:
          continue
        done[key_of(record)] = record
  return done


def append(path: str, record: dict[str, Any]) -> None:
  """Appends one record as a JSON line and flushes it to disk."""
  with open(path, "a") as f:
    f.write(json.dumps(record) + "\n")
    f.flush()
    os.fsync(f.fileno())


def todo(model: str, presses: Sequence[str], ratios: Sequence[float], tasks: Sequence[str],
         lengths: Sequence[int], seeds: Sequence[int], done: dict[tuple, Any]
         ) -> list[tuple[str, float, str, int, int]]:
  """The `(press, ratio, task, length, seed)` points not yet in `done`, in run order; the
  presses of `OFFLINE_SKIPS` give one `(press, 0.0, None, None, None)` point for their skip
  record instead (none once written). Ratio 0 is no press at all, the same for every press:
  it runs once, as press "none"."""
  out = []
  if any(float(r) == 0 for r in ratios):
    presses = ["none", *presses]
  for press in presses:
    if press in OFFLINE_SKIPS:
      if (model, press, 0.0, None, None, None) not in done:
        out.append((press, 0.0, None, None, None))
      continue
    for ratio in ratios:
      if (float(ratio) == 0) != (press == "none"):
        continue
      for task in tasks:
        for length in lengths:
          for seed in seeds:
            if (model, press, float(ratio), task, length, seed) not in done:
              out.append((press, float(ratio), task, length, seed))
  return out


def load(model: str, attn_implementation: str) -> tuple[Any, Any]:
  """`(model, tokenizer)` from the cached GGUF through transformers (`gguf_file=`), f32."""
  import torch  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top
  files = sorted(glob.glob(os.path.expanduser(MODEL_GLOBS[model])))
  if not files:
    raise FileNotFoundError(f"no GGUF for {model} under {MODEL_GLOBS[model]}; run kvattn's "
                            f"from_pretrained({model!r}) once to cache it")
  folder, name = os.path.split(files[0])
  tok = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
  lm = transformers.AutoModelForCausalLM.from_pretrained(
      folder, gguf_file=name, dtype=torch.float32, attn_implementation=attn_implementation)
  return lm.eval(), tok


def run(model: str, presses: Sequence[str], ratios: Sequence[float], tasks: Sequence[str],
        lengths: Sequence[int], seeds: Sequence[int], out: str,
        progress: Callable[[str], None] = print) -> None:
  """Runs every point of `todo` through kvpress's pipeline and appends its record (module
  doc). ObservedAttention gets the model with eager attention (it reads the weights). torch
  and kvpress are imported at the first point that runs a model (skip records need neither).
  """
  points = todo(model, presses, ratios, tasks, lengths, seeds, read_done(out))
  pipes: dict[str, Any] = {}
  try:
    version = importlib.metadata.version("kvpress")
  except importlib.metadata.PackageNotFoundError:
    version = None
  for i, (press, ratio, task, length, seed) in enumerate(points):
    base = {"model": model, "press": press, "ratio": ratio, "task": task, "length": length,
            "seed": seed, "kvpress_version": version, "system": "kvpress",
            "kvattn_kind": KVATTN_NAMES.get(press, press)}
    if task is None:
      append(out, {**base, "skipped": OFFLINE_SKIPS[press]})
      progress(f"{press}: skipped ({OFFLINE_SKIPS[press]})")
      continue
    attn = "eager" if press == "observed_attention" else "sdpa"
    if attn not in pipes:
      import torch  # pylint: disable=g-import-not-at-top
      import kvpress  # pylint: disable=g-import-not-at-top
      torch.set_grad_enabled(False)
      lm, tok = load(model, attn)
      pipes[attn] = kvpress.KVPressTextGenerationPipeline(model=lm, tokenizer=tok)
    pipe = pipes[attn]
    example = ruler.make(task, pipe.tokenizer, length, seed)
    templated = pipe.preprocess(example.context, ["\n\n" + example.question],
                                example.answer_prefix, max_context_length=10**9)
    context_tokens = int(templated["context_ids"].shape[1])
    question_tokens = int(templated["questions_ids"][0].shape[1])
    start = time.perf_counter()
    answer = pipe(example.context, question="\n\n" + example.question,
                  answer_prefix=example.answer_prefix,
                  press=make_press(press, ratio, context_tokens),
                  max_new_tokens=ruler.MAX_NEW_TOKENS[task])["answer"]
    wall = time.perf_counter() - start
    record = {**base, "score": ruler.score(example, answer), "output": answer,
              "answers": list(example.answers), "wall_s": wall,
              "context_tokens": context_tokens, "question_tokens": question_tokens,
              "prompt_sha1": ruler.prompt_sha1(example)}
    append(out, record)
    progress(f"[{i + 1}/{len(points)}] {press} ratio {ratio} {task} {length} seed {seed}: "
             f"score {record['score']:.2f} in {wall:.1f} s: {answer!r}")


def _floats(text: str) -> list[float]:
  return [float(x) for x in text.split(",") if x]


def _ints(text: str) -> list[int]:
  return [int(x) for x in text.split(",") if x]


def main(argv: Iterable[str] | None = None) -> None:
  """Parses the flags of the module doc and `run`s; a bad flag exits with status 2."""
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--model", default="smollm2-135m-instruct", choices=sorted(MODEL_GLOBS))
  parser.add_argument("--presses", default=",".join(press_names()))
  parser.add_argument("--ratios", default=",".join(str(r) for r in RATIOS))
  parser.add_argument("--tasks", default="niah_single")
  parser.add_argument("--lengths", default="1024")
  parser.add_argument("--seeds", default="0,1,2,3")
  parser.add_argument("--out", required=True, help="JSON-lines file, appended and resumed")
  args = parser.parse_args(argv)
  presses = [p for p in args.presses.split(",") if p]
  for p in presses:
    if p not in press_names():
      parser.error(f"--presses must hold names of {press_names()}; got {p!r}")
  tasks = [t for t in args.tasks.split(",") if t]
  for t in tasks:
    if t not in ruler.TASKS:
      parser.error(f"--tasks must hold tasks of {ruler.TASKS}; got {t!r}")
  ratios = _floats(args.ratios)
  for r in ratios:
    if not 0 <= r < 1:
      parser.error(f"--ratios must be in [0, 1); got {r}")
  run(args.model, presses, ratios, tasks, _ints(args.lengths), _ints(args.seeds), args.out)


if __name__ == "__main__":
  main()
