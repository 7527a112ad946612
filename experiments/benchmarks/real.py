"""Real-model prefill/decode speed next to HF transformers and llama.cpp, measured in one run.

    python -m experiments.benchmarks.real --model smollm2-135m-instruct --batch 1 \\
        --prompt_len 512 --new_tokens 64 [--cache_dtype int8] [--param_dtype bfloat16] \\
        [--peers --peer_python /path/to/python] [--random_weights] [--quality_tokens 1024]

Prints one JSON line per system (`kvattn`, then `hf_transformers` and
`llama_cpp` with `--peers`), each the median of `--repeats` timed rounds after
one untimed round (which compiles ours). The systems run interleaved, round by
round -- ours, then each peer -- so a busy machine slows all of them alike and
the ratios (`decode_vs_hf`, `prefill_vs_hf`, `decode_vs_llama_cpp`) are
measured in one run. Prompts are real text (the default corpus of
`kvattn.training.data`, the CPython standard library's sources, tokenized by the
model's tokenizer), every sequence `--prompt_len` tokens; decoding is greedy
and runs all `new_tokens - 1` steps (no eos).

Fields of every line:

  prefill_tokens_per_s   batch * prompt_len / prefill seconds
  decode_tokens_per_s    batch * (new_tokens - 1) / decode-loop seconds
  *_cpu_s                process CPU seconds of the same (the work; other
                         processes on a shared machine do not inflate them)
  weight_bytes           parameter bytes one decode step reads (all of them
                         for a tied LM head; the embedding table is left out
                         when the head is untied, only B rows of it are read)
  cache_bytes_per_token  KV-cache bytes per token of the whole model (scales
                         of a quantized cache included)
  mean_live_tokens       prompt_len + new_tokens / 2: the mean number of
                         cached tokens decode step i (1 .. new_tokens - 1)
                         attends, P + i
  bytes_read_per_step    weight_bytes + batch * mean_live_tokens *
                         cache_bytes_per_token: what one decode step must
                         read at least
  read_bandwidth_bytes_per_s  this machine's read bandwidth measured in this
                         run: the best of `jnp.sum` over a `--bandwidth_mib`
                         f32 array, measured before every round
  roofline_fraction      bytes_read_per_step * (decode steps/s) / bandwidth

Peers (`--peers`; the `[peers]` extra: torch, transformers, llama-cpp-python,
gguf) run as subprocesses of `--peer_python` (`experiments/benchmarks/peers/*`, protocol
in `experiments/benchmarks/peers/protocol.py`), never imported here: HF transformers
(torch CPU, f32, the same GGUF through `from_pretrained(..., gguf_file=...)`,
its cached decode loop timed directly) and llama.cpp (`llama-cpp-python`, the
GGUF as shipped, batch 1 only). A peer that cannot start (not installed,
batch > 1 for llama.cpp) gets a line with `"skipped"` and the reason.
`--threads` (default 2) is given to both; ours uses XLA's CPU threads.

`--random_weights` builds the model's architecture (`evals.models.RANDOM_CONFIGS`, the same
shapes as the registered checkpoint) with random weights, and uses byte-level
ids of the same text, so a machine without the checkpoint (the GPU machine)
can time it; no peers then. `--quality_tokens N` adds `perplexity` (of N
held-out tokens, run through a cache of `--cache_dtype` with `--param_dtype`
weights) and `perplexity_ratio` (to the f32 cache with f32 weights).
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags
from flax import nnx

from experiments.framework import cli
from experiments.framework import timing as timing_lib
from experiments.evals import models
from experiments.evals import text as text_lib
from kvattn import memory
from kvattn.models import transformer as transformer_lib
from kvattn.inference.generation import decode, prefill

FLAGS = flags.FLAGS


def _define_flags() -> None:
  """Defines the command-line flags (at run time, not import, so tests and notebooks can
  import this module beside other entry points that define `--model`)."""
  flags.DEFINE_string("model", "smollm2-135m-instruct",
                      "Registered name (kvattn.checkpoints.hub) or .gguf file.")
  flags.DEFINE_integer("batch", 1, "Sequences B.")
  flags.DEFINE_integer("prompt_len", 512, "Prompt tokens per sequence P.")
  flags.DEFINE_integer("new_tokens", 64, "Tokens generated per sequence N (N - 1 decode steps).")
  flags.DEFINE_string("cache_dtype", None,
                      "KV-cache dtype: float32, bfloat16, int8, float8_e4m3fn (default float32).")
  flags.DEFINE_enum("param_dtype", "float32", ["float32", "bfloat16", "int8"],
                    "Weight storage dtype (compute is f32; int8: W8A8, kvattn.models.int8).")
  flags.DEFINE_bool("peers", False, "Also run HF transformers and llama.cpp (subprocesses).")
  flags.DEFINE_string("peer_python", sys.executable, "Python interpreter that runs the peers.")
  flags.DEFINE_integer("threads", 2, "Threads of the peers.")
  flags.DEFINE_bool("random_weights", False,
                    "Random weights of the model's architecture (no checkpoint needed).")
  flags.DEFINE_integer("repeats", 3, "Timed rounds (after one untimed round).")
  flags.DEFINE_integer("bandwidth_mib", 512, "Size of the bandwidth probe array in MiB.")
  flags.DEFINE_integer("quality_tokens", 0, "Held-out tokens for the perplexity (0: skip).")


# HF-style configs of the registered models, for --random_weights (the values the GGUF holds).
PEERS = {"hf_transformers": "experiments.benchmarks.peers.hf_transformers",
         "llama_cpp": "experiments.benchmarks.peers.llama_cpp_peer"}


# ----------------------------------------------------------------------------------------------
# Arithmetic of the bytes a decode step reads.


def mean_live_tokens(prompt_len: int, new_tokens: int) -> float:
  """Mean cached tokens a decode step attends: step i (1 .. N - 1) attends P + i, so P + N / 2."""
  return prompt_len + new_tokens / 2


def bytes_read_per_step(weight_bytes: int, cache_bytes_per_token: int, batch: int,
                        prompt_len: int, new_tokens: int) -> float:
  """Weights once plus every sequence's live cache: the least one decode step reads."""
  return weight_bytes + batch * mean_live_tokens(prompt_len, new_tokens) * cache_bytes_per_token


def roofline_fraction(bytes_per_step: float, decode_tokens_per_s: float, batch: int,
                      bandwidth: float) -> float:
  """Achieved read rate (bytes per step x steps per second) over the machine's `bandwidth`."""
  return bytes_per_step * (decode_tokens_per_s / batch) / bandwidth


def read_bandwidth(nbytes: int, repeats: int = 3) -> float:
  """Bytes/s of the best of `repeats` jitted `jnp.sum` over an f32 array of `nbytes`.

  A reduction reads every byte once and writes nothing, so it is the read rate
  a decode step (which streams weights and cache) can reach at best.
  """
  x = jnp.ones((max(1, nbytes // 4),), jnp.float32)
  total = jax.jit(jnp.sum)
  total(x).block_until_ready()
  best = float("inf")
  for _ in range(repeats):
    start = time.perf_counter()
    total(x).block_until_ready()
    best = min(best, time.perf_counter() - start)
  return x.nbytes / best


def weight_bytes(model: transformer_lib.Transformer) -> int:
  """Parameter bytes one decode step reads (module doc)."""
  total = memory.tree_bytes(nnx.state(model, nnx.Param))
  if model.lm_head is not None:  # an untied head: the embedding is read a row per sequence
    total -= model.embedding[...].nbytes
  return total


# ----------------------------------------------------------------------------------------------
# One system's runs.


@dataclasses.dataclass
class Run:
  """One prefill + decode of the prompts by one system (wall and CPU seconds)."""

  prefill_s: float
  decode_s: float
  prefill_cpu_s: float
  decode_cpu_s: float
  tokens: np.ndarray  # i32[B, new_tokens]


def ours(model, prompts: np.ndarray, new_tokens: int, cache_dtype: Any) -> Callable[[], Run]:
  """A callable that runs `kvattn.generate`'s compiled prefill and decode loop once."""
  batch, prompt_len = prompts.shape
  lengths = jnp.full((batch,), prompt_len, jnp.int32)
  tokens_in = jnp.asarray(prompts, jnp.int32)

  def run() -> Run:
    caches = model.init_caches(batch, prompt_len + new_tokens - 1, cache_dtype)
    prefill_s, prefill_cpu, (first, caches, key) = timing_lib.timed(
        prefill, model, tokens_in, lengths, caches)
    decode_s, decode_cpu, (tokens, _, _) = timing_lib.timed(
        decode, model, first, caches, new_tokens, rng=key)
    return Run(prefill_s, decode_s, prefill_cpu, decode_cpu, np.asarray(tokens))

  return run


class Peer:
  """A peer subprocess speaking `experiments/benchmarks/peers/protocol.py`."""

  def __init__(self, name: str, python: str, request: dict[str, Any]):
    self.name = name
    self._request = tempfile.NamedTemporaryFile("w", suffix=".json", delete=False)
    json.dump(request, self._request)
    self._request.close()
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    self.proc = subprocess.Popen(
        [python, "-m", PEERS[name], "--request", self._request.name], cwd=root,
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
      self.info = self._read()
    except (RuntimeError, ValueError):
      self.close()
      raise

  def _read(self) -> dict[str, Any]:
    line = self.proc.stdout.readline()
    if not line:
      err = self.proc.stderr.read().strip().splitlines()
      raise RuntimeError(f"peer {self.name} exited: {' | '.join(err[-3:]) or 'no output'}")
    out = json.loads(line)
    if "error" in out:
      raise RuntimeError(f"peer {self.name}: {out['error']}")
    return out

  def __call__(self) -> Run:
    self.proc.stdin.write("run\n")
    self.proc.stdin.flush()
    out = self._read()
    self.info.update(weight_bytes=out["weight_bytes"],
                     cache_bytes_per_token=out["cache_bytes_per_token"])
    return Run(out["prefill_s"], out["decode_s"], out["prefill_cpu_s"], out["decode_cpu_s"],
               np.asarray(out["tokens"], np.int32))

  def close(self) -> None:
    if self.proc.poll() is None:
      try:
        self.proc.stdin.write("quit\n")
        self.proc.stdin.flush()
        self.proc.wait(timeout=30)
      except (OSError, subprocess.TimeoutExpired):
        self.proc.kill()
    os.unlink(self._request.name)


def summary(system: str, runs: Sequence[Run], *, batch: int, prompt_len: int, new_tokens: int,
            weight_bytes_: int, cache_bytes_per_token: int, bandwidth: float,
            **extra: Any) -> dict[str, Any]:
  """One system's JSON line: medians over `runs` and the bytes/roofline fields (module doc)."""
  prefill_s = statistics.median(r.prefill_s for r in runs)
  decode_s = statistics.median(r.decode_s for r in runs)
  decode_tps = batch * (new_tokens - 1) / decode_s
  per_step = bytes_read_per_step(weight_bytes_, cache_bytes_per_token, batch, prompt_len,
                                 new_tokens)
  return {
      "system": system, "batch": batch, "prompt_len": prompt_len, "new_tokens": new_tokens,
      "prefill_tokens_per_s": batch * prompt_len / prefill_s,
      "decode_tokens_per_s": decode_tps,
      "prefill_s": prefill_s, "decode_s": decode_s,
      "prefill_cpu_s": statistics.median(r.prefill_cpu_s for r in runs),
      "decode_cpu_s": statistics.median(r.decode_cpu_s for r in runs),
      "weight_bytes": int(weight_bytes_), "cache_bytes_per_token": int(cache_bytes_per_token),
      "mean_live_tokens": mean_live_tokens(prompt_len, new_tokens),
      "bytes_read_per_step": per_step,
      "read_bandwidth_bytes_per_s": bandwidth,
      "roofline_fraction": roofline_fraction(per_step, decode_tps, batch, bandwidth),
      "repeats": len(runs), **extra}


# ----------------------------------------------------------------------------------------------
# Model, prompts, quality.


def cast_params(model, param_dtype: Any):
  """A copy of `model` whose parameters are stored in `param_dtype` (compute unchanged; int8:
  the W8A8 copy, `kvattn.models.transformer.quantize_model`)."""
  if jnp.dtype(param_dtype) == jnp.int8:
    return transformer_lib.quantize_model(nnx.clone(model))
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  params = jax.tree.map(lambda p: p.astype(param_dtype), params)
  return nnx.merge(graphdef, params, rest)


def perplexity(model, ids: np.ndarray, cache_dtype: Any) -> float:
  """exp(mean next-token NLL) of `ids` (`i32[T]`), every layer attending through a cache of
  `cache_dtype` (so a quantized cache's rounding reaches every attention read)."""
  graphdef, state = nnx.split(model)

  @jax.jit
  def nll(state, tokens):
    m = nnx.merge(graphdef, state)
    caches = m.init_caches(1, tokens.shape[1], cache_dtype)
    logits, _ = m(tokens, caches)
    logp = jax.nn.log_softmax(logits[0, :-1].astype(jnp.float32), axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, tokens[0, 1:, None], axis=-1))

  return float(jnp.exp(nll(state, jnp.asarray(ids, jnp.int32)[None])))


def main(argv: Sequence[str]) -> None:
  """absl entry point: one JSON line per system."""
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  for name in ("batch", "prompt_len", "repeats", "threads", "bandwidth_mib"):
    if getattr(FLAGS, name) < 1:
      raise app.UsageError(f"--{name} must be >= 1; got {getattr(FLAGS, name)}")
  if FLAGS.new_tokens < 2:
    raise app.UsageError(f"--new_tokens must be >= 2; got {FLAGS.new_tokens}")
  if FLAGS.peers and FLAGS.random_weights:
    raise app.UsageError("--peers needs the checkpoint; it cannot run with --random_weights")
  batch, prompt_len, new_tokens = FLAGS.batch, FLAGS.prompt_len, FLAGS.new_tokens
  cache_dtype = FLAGS.cache_dtype or "float32"
  try:
    reference, tok = models.load_model(FLAGS.model, random_weights=FLAGS.random_weights)
  except ValueError as e:
    raise app.UsageError(f"--random_weights: {e}") from None
  model = reference if FLAGS.param_dtype == "float32" else cast_params(reference,
                                                                        FLAGS.param_dtype)
  prompts = np.tile(text_lib.document_tokens(tok, prompt_len), (batch, 1))

  systems: dict[str, Callable[[], Run]] = {"kvattn": ours(model, prompts, new_tokens,
                                                          cache_dtype)}
  skipped: dict[str, str] = {}
  peers: list[Peer] = []
  if FLAGS.peers:
    from kvattn.checkpoints import hub  # pylint: disable=g-import-not-at-top
    gguf_path = str(hub.resolve(FLAGS.model))
    request = {"gguf": gguf_path, "prompts": prompts.tolist(), "new_tokens": new_tokens,
               "threads": FLAGS.threads}
    for name in PEERS:
      if name == "llama_cpp" and batch != 1:
        skipped[name] = f"llama-cpp-python's API runs batch 1; got --batch {batch}"
        continue
      try:
        peer = Peer(name, FLAGS.peer_python, request)
      except (RuntimeError, OSError, ValueError) as e:
        skipped[name] = str(e)
        continue
      peers.append(peer)
      systems[name] = peer

  runs: dict[str, list[Run]] = {name: [] for name in systems}
  bandwidths = []
  try:
    for round_ in range(FLAGS.repeats + 1):  # round 0 compiles ours and warms the peers
      bandwidths.append(read_bandwidth(FLAGS.bandwidth_mib << 20))
      for name, run in systems.items():
        result = run()
        if round_:
          runs[name].append(result)
  finally:
    for peer in peers:
      peer.close()
  bandwidth = max(bandwidths)

  common = dict(batch=batch, prompt_len=prompt_len, new_tokens=new_tokens, bandwidth=bandwidth,
                model=FLAGS.model, random_weights=FLAGS.random_weights,
                load_avg_1min=os.getloadavg()[0], cpu_count=os.cpu_count(),
                backend=jax.default_backend())
  lines = {"kvattn": summary(
      "kvattn", runs["kvattn"], weight_bytes_=weight_bytes(model),
      cache_bytes_per_token=model.cache_bytes_per_token(cache_dtype), cache_dtype=cache_dtype,
      param_dtype=FLAGS.param_dtype, **common)}
  for peer in peers:
    first = runs[peer.name][0].tokens
    lines[peer.name] = summary(
        peer.name, runs[peer.name], weight_bytes_=peer.info["weight_bytes"],
        cache_bytes_per_token=peer.info["cache_bytes_per_token"],
        version=peer.info.get("version"),
        greedy_tokens_equal_kvattn=float(np.mean(first == runs["kvattn"][0].tokens)), **common)
  ours_line = lines["kvattn"]
  for name in lines:
    if name != "kvattn":
      for what in ("decode", "prefill"):
        ours_line[f"{what}_vs_{name}"] = (ours_line[f"{what}_tokens_per_s"]
                                          / lines[name][f"{what}_tokens_per_s"])
  if FLAGS.quality_tokens:
    held_out = text_lib.document_tokens(tok, FLAGS.quality_tokens, skip_tokens=prompt_len)
    ours_line["perplexity"] = perplexity(model, held_out, cache_dtype)
    ours_line["perplexity_ratio"] = ours_line["perplexity"] / perplexity(reference, held_out,
                                                                         "float32")
    ours_line["quality_tokens"] = FLAGS.quality_tokens
  for line in lines.values():
    print(json.dumps(line))
  for name, why in skipped.items():
    print(json.dumps({"system": name, "skipped": why, "batch": batch,
                      "prompt_len": prompt_len}))


if __name__ == "__main__":
  _define_flags()
  cli.run(main)
