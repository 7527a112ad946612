"""The line protocol between `experiments.benchmarks.real` and a peer subprocess.

A peer is started as `python -m experiments.benchmarks.peers.<name> --request FILE` with
a JSON request (`gguf`, `prompts` i32[B][P] token ids, `new_tokens`,
`threads`). It loads the model, prints one JSON line `{"ready": ...}` and
then, for every line `run` read from stdin, performs one greedy prefill +
decode of the prompts and prints one JSON line of measurements:

  prefill_s, decode_s      wall seconds of the prefill and of the decode loop
                           (`new_tokens - 1` steps, timed directly);
  prefill_cpu_s, decode_cpu_s   process CPU seconds of the same;
  tokens                   the generated ids, i32[B][new_tokens];
  weight_bytes, cache_bytes_per_token   what one decode step reads.

A line `quit` (or end of input) ends it. One JSON object per line, nothing
else on stdout (a peer's own chatter goes to stderr). This module imports only
the standard library, so both sides can use it.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any, Callable


def serve(ready: dict[str, Any], run_once: Callable[[], dict[str, Any]]) -> None:
  """Prints `ready`, then one `run_once()` result per `run` line on stdin."""
  print(json.dumps({"ready": True, **ready}), flush=True)
  for line in sys.stdin:
    command = line.strip()
    if command == "quit":
      return
    if command != "run":
      print(json.dumps({"error": f"unknown command {command!r}; expected 'run' or 'quit'"}),
            flush=True)
      continue
    print(json.dumps(run_once()), flush=True)


def timed(fn: Callable[[], Any]) -> tuple[float, float, Any]:
  """`(wall s, process CPU s, fn())`."""
  wall, cpu = time.perf_counter(), time.process_time()
  out = fn()
  return time.perf_counter() - wall, time.process_time() - cpu, out


def read_request(argv: list[str]) -> dict[str, Any]:
  """The JSON request named by `--request FILE` in `argv`.

  Raises:
    SystemExit: no `--request FILE` argument.
  """
  if len(argv) != 3 or argv[1] != "--request":
    raise SystemExit(f"usage: {argv[0]} --request FILE; got {argv[1:]}")
  with open(argv[2], encoding="utf-8") as f:
    return json.load(f)


def load_hf_gguf(request: dict[str, Any], dtype: str = "float32"):
  """Sets torch's threads to `request["threads"]` and loads `request["gguf"]` in `dtype`
  ("float32" or "bfloat16") with `transformers.AutoModelForCausalLM.from_pretrained(dir,
  gguf_file=name)`, in eval mode (torch and transformers are imported here: only the HF
  peers call it)."""
  import os  # pylint: disable=g-import-not-at-top
  import torch  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top
  torch.set_num_threads(int(request["threads"]))
  path = request["gguf"]
  model = transformers.AutoModelForCausalLM.from_pretrained(
      os.path.dirname(path), gguf_file=os.path.basename(path),
      dtype={"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype])
  model.eval()
  return model
