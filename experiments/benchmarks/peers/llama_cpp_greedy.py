"""llama.cpp's greedy continuations of the Gemma 3 270M reference prompts (`xllamacpp`).

    /work/peers-venv/bin/python -m experiments.benchmarks.peers.llama_cpp_greedy \\
        --gguf ~/.cache/kvattn/gemma3-270m/gemma-3-270m-q4_k_m.gguf

For every prompt of tests/fixtures/gemma3_reference.json (its token ids, BOS included) it
asks llama.cpp's server (in process, `xllamacpp.Server.handle_completions`, temperature 0,
top-k 1, 20 tokens, 2 threads, its default f16 KV cache) for the continuation and prints it
next to transformers' greedy text, which kvattn reproduces token for token
(tests/kvattn/checkpoints/test_gemma3.py), and how many leading characters agree. Never
imported by kvattn or its tests; needs the `[peers]` extra.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib

import xllamacpp

REFERENCE = (pathlib.Path(__file__).resolve().parents[3] / "tests" / "fixtures" /
             "gemma3_reference.json")


def main() -> None:
  """Prints llama.cpp's greedy continuation of every reference prompt (module doc)."""
  parser = argparse.ArgumentParser(description=__doc__.split("\n", maxsplit=1)[0])
  parser.add_argument("--gguf", type=pathlib.Path, required=True)
  parser.add_argument("--threads", type=int, default=2)
  args = parser.parse_args()
  ref = json.loads(REFERENCE.read_text(encoding="utf-8"))
  params = xllamacpp.CommonParams()
  params.model.path = os.fspath(args.gguf.expanduser())
  params.n_ctx = 2048
  params.n_parallel = 1
  params.cpuparams.n_threads = args.threads
  params.cpuparams_batch.n_threads = args.threads
  server = xllamacpp.Server(params)
  for prompt, greedy in zip(ref["prompts"], ref["greedy"]):
    result = server.handle_completions({
        "prompt": prompt["ids"], "n_predict": len(greedy["tokens"]), "temperature": 0.0,
        "top_k": 1, "samplers": ["top_k"], "cache_prompt": False})
    text = result["choices"][0]["text"]
    agree = next((i for i, (a, b) in enumerate(zip(text, greedy["text"])) if a != b),
                 min(len(text), len(greedy["text"])))
    print(f"{len(prompt['ids'])} prompt tokens\n  llama.cpp:    {text!r}\n  transformers: "
          f"{greedy['text']!r}\n  the first {agree} characters agree")


if __name__ == "__main__":
  main()
