"""Real-model prefill/decode speed next to HF transformers and llama.cpp, measured in one run.

    python -m experiments.benchmarks.real --model smollm2-135m-instruct --batch 1 \\
        --prompt_len 512 --new_tokens 64 [--cache_dtype int8] [--param_dtype int8] \\
        [--random_weights] [--quality_tokens 1024]
    python -m experiments.benchmarks.real --peers --peer_python /path/to/python \\
        --variants float32:float32,int8:float32,int8:int8 --shapes 1x512,1x4000,4x4000,8x512

Without `--peers` it prints one JSON line for kvattn, the median of
`--repeats` timed rounds after one untimed round (which compiles), all in this
process. With `--peers` every system runs in its own processes, one process
at a time: each kvattn variant of `--variants` (`param_dtype:cache_dtype`,
a `--child kvattn` process of this module; an optional third field is the
process's `XLA_FLAGS`, e.g. `int8:float32:--xla_cpu_use_xnnpack=true`), HF transformers and llama.cpp
with each KV cache of `--llama_cache_types` (`xllamacpp`; batch 1 only). Per
round, each system in turn gets a fresh process that loads, runs one untimed
and one timed prefill + decode, and exits before the next system's starts, so
no system is timed while another's threads (XLA's worker threads included)
are alive; rounds alternate the systems, so a busy machine slows all alike and
the ratios (`decode_vs_hf_transformers`, `prefill_vs_hf_transformers`,
`decode_vs_llama_cpp_f16`, `decode_vs_llama_cpp_q8_0`, `decode_vs_llama_cpp_best`)
are measured in one run. The kvattn processes share a persistent compilation
cache, so rounds after the first load their programs instead of compiling.
`--alone_check` (default on) first times each peer once before any kvattn
process has run; its line then has `alone_decode_tokens_per_s` and
`interleaved_over_alone_decode` (1.0 when the interleaving does not disturb
the peer), and `decode_tokens_per_s_rounds` lists every round. The prompts are
tokenized by a `--child prepare` process, so this process never starts JAX's
runtime. Prompts are real text (the default corpus of
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

Peers (`--peers`; the `[peers]` extra: torch, transformers, xllamacpp, gguf)
run as subprocesses of `--peer_python` (`experiments/benchmarks/peers/*`,
protocol in `experiments/benchmarks/peers/protocol.py`), never imported here:
HF transformers (torch CPU, f32, the same GGUF through `from_pretrained(...,
gguf_file=...)`, its cached decode loop timed directly) and llama.cpp
(`xllamacpp`'s in-process server, the GGUF as shipped, its own timings; batch
1 only: its server runs a batch as unevenly scheduled slots). A peer that
cannot start (not installed, batch > 1 for llama.cpp) gets a line with
`"skipped"` and the reason. `--threads` (default 2) is given to the peers;
ours uses XLA's CPU threads. Greedy agreement: HF's line has
`greedy_tokens_equal` per kvattn variant (fraction of equal tokens),
llama.cpp's `greedy_text_prefix_equal` (the fraction of kvattn's generated
text before the first differing character; its API returns text).

`--random_weights` builds the model's architecture (`evals.models.RANDOM_CONFIGS`, the same
shapes as the registered checkpoint) with random weights, and uses byte-level
ids of the same text, so a machine without the checkpoint (the GPU machine)
can time it; no peers then. `--quality_tokens N` adds `perplexity` (of N
held-out tokens, run through a cache of `--cache_dtype` with `--param_dtype`
weights), `perplexity_f32` and `perplexity_ratio` (to the f32 cache with f32 weights), and
`greedy_agreement_vs_f32`: the fraction of the timed run's greedy tokens equal to those of
f32 weights with an f32 cache.
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
  flags.DEFINE_list("variants", [], "With --peers: kvattn variants param_dtype:cache_dtype, each "
                    "its own system, e.g. float32:float32,int8:int8 (default: --param_dtype:"
                    "--cache_dtype).")
  flags.DEFINE_list("shapes", [], "With --peers: BATCHxPROMPT_LEN shapes run one after the "
                    "other in one invocation (e.g. 1x512,1x4000,4x4000,8x512); default "
                    "--batch x --prompt_len.")
  flags.DEFINE_list("llama_cache_types", ["f16", "q8_0"], "With --peers: llama.cpp KV caches.")
  flags.DEFINE_list("hf_dtypes", ["float32", "bfloat16"],
                    "With --peers: HF transformers' weight and compute dtypes, one peer each "
                    "(bfloat16: its fastest setting on CPUs with avx512_bf16 or AMX).")
  flags.DEFINE_bool("alone_check", True, "With --peers: time each peer once more before any "
                    "kvattn process has run, and report interleaved / alone.")
  flags.DEFINE_bool("quality_only", False, "Only the quality of every --variants entry (no "
                    "timing): perplexity of --quality_tokens held-out tokens and greedy agreement "
                    "of --new_tokens after a --prompt_len prompt, against f32 weights and cache.")
  flags.DEFINE_string("child", None, "Internal: 'prepare' (write the prompts) or 'kvattn' (serve "
                      "runs over the peer protocol) for --peers' separate processes.")
  flags.DEFINE_string("request", None, "Internal: the request file of --child.")


# HF-style configs of the registered models, for --random_weights (the values the GGUF holds).
PEERS = {"hf_transformers": "experiments.benchmarks.peers.hf_transformers",
         "llama_cpp": "experiments.benchmarks.peers.llama_cpp_peer"}
KVATTN_CHILD = "experiments.benchmarks.real"


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

  def __init__(self, name: str, python: str, request: dict[str, Any], *,
               module: str | None = None, args: Sequence[str] = (),
               env: dict[str, str] | None = None):
    self.name = name
    self._request = tempfile.NamedTemporaryFile("w", suffix=".json", delete=False)
    json.dump(request, self._request)
    self._request.close()
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    # stderr goes to a file: a chatty peer (llama.cpp logs every slot) would fill a pipe
    # nobody reads and block.
    self._stderr = tempfile.TemporaryFile("w+")
    self.proc = subprocess.Popen(
        [python, "-m", module or PEERS[name], *args, "--request", self._request.name], cwd=root,
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr, text=True,
        env={**os.environ, **(env or {})})
    try:
      self.info = self._read()
    except (RuntimeError, ValueError):
      self.close()
      raise

  def _read(self) -> dict[str, Any]:
    line = self.proc.stdout.readline()
    if not line:
      self.proc.wait()
      self._stderr.seek(0)
      err = self._stderr.read().strip().splitlines()
      raise RuntimeError(f"peer {self.name} exited: {' | '.join(err[-3:]) or 'no output'}")
    out = json.loads(line)
    if "error" in out:
      raise RuntimeError(f"peer {self.name}: {out['error']}")
    return out

  def __call__(self) -> Run:
    self.proc.stdin.write("run\n")
    self.proc.stdin.flush()
    out = self._read()
    self.info.update({k: v for k, v in out.items() if k in (
        "weight_bytes", "cache_bytes_per_token", "read_bandwidth_bytes_per_s", "text")})
    return Run(out["prefill_s"], out["decode_s"], out["prefill_cpu_s"], out["decode_cpu_s"],
               np.asarray(out["tokens"], np.int32))

  def close(self) -> None:
    """Asks the process to quit and waits until it has exited (so nothing of it runs on)."""
    if self.proc.poll() is None:
      try:
        self.proc.stdin.write("quit\n")
        self.proc.stdin.flush()
        self.proc.wait(timeout=60)
      except (OSError, subprocess.TimeoutExpired):
        self.proc.kill()
        self.proc.wait()
    self._stderr.close()
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


def _load(model_name: str, random_weights: bool, param_dtype: str):
  """`(model, reference f32 model, tokenizer)` of `--model` with `param_dtype` weights."""
  try:
    reference, tok = models.load_model(model_name, random_weights=random_weights)
  except ValueError as e:
    raise app.UsageError(f"--random_weights: {e}") from None
  model = reference if param_dtype == "float32" else _load_variant(reference, tok, param_dtype)
  return model, reference, tok


def _load_variant(reference, tok, param_dtype: str):
  if param_dtype == "int8":
    return models.quantize(nnx.clone(reference), tok)
  return cast_params(reference, param_dtype)


def _prompts(tok, batch: int, prompt_len: int) -> np.ndarray:
  return np.tile(text_lib.document_tokens(tok, prompt_len), (batch, 1))


def prepare_child(request_path: str) -> None:
  """`--child prepare`: writes the prompts (tokenized by the model's tokenizer) and the GGUF
  path into the request file, then exits (so no JAX thread of it outlives it)."""
  from kvattn.checkpoints import hub  # pylint: disable=g-import-not-at-top
  from kvattn.checkpoints import gguf  # pylint: disable=g-import-not-at-top
  path = hub.resolve(FLAGS.model)
  tok = gguf.load_gguf(path).tokenizer
  with open(request_path, encoding="utf-8") as f:
    request = json.load(f)
  request.update(gguf=str(path), prompts=_prompts(tok, FLAGS.batch, FLAGS.prompt_len).tolist())
  with open(request_path, "w", encoding="utf-8") as f:
    json.dump(request, f)


def kvattn_child(request_path: str) -> None:
  """`--child kvattn`: kvattn as a peer process (`peers/protocol.py`): loads the model with the
  request's `param_dtype`, then per `run` measures the read bandwidth and runs `ours` once."""
  from experiments.benchmarks.peers import protocol  # pylint: disable=g-import-not-at-top
  with open(request_path, encoding="utf-8") as f:
    request = json.load(f)
  model, _, tok = _load(FLAGS.model, False, request["param_dtype"])
  prompts = np.asarray(request["prompts"], np.int32)
  cache_dtype = request["cache_dtype"]
  run = ours(model, prompts, int(request["new_tokens"]), cache_dtype)
  nbytes = int(request["bandwidth_mib"]) << 20

  def run_once():
    bandwidth = timing_lib.read_bandwidth(nbytes)
    r = run()
    return {"prefill_s": r.prefill_s, "decode_s": r.decode_s, "prefill_cpu_s": r.prefill_cpu_s,
            "decode_cpu_s": r.decode_cpu_s, "tokens": r.tokens.tolist(),
            "text": [tok.decode(r.tokens[0].tolist())],
            "weight_bytes": weight_bytes(model),
            "cache_bytes_per_token": model.cache_bytes_per_token(cache_dtype),
            "read_bandwidth_bytes_per_s": bandwidth}

  protocol.serve({"system": "kvattn", "param_dtype": request["param_dtype"],
                  "cache_dtype": cache_dtype, "jax": jax.__version__}, run_once)


def _common_prefix_fraction(a: str, b: str) -> float:
  """Characters of `a` before its first difference from `b`, over len(a)."""
  n = 0
  for x, y in zip(a, b):
    if x != y:
      break
    n += 1
  return n / max(1, len(a))


def orchestrate(batch: int, prompt_len: int, new_tokens: int) -> None:
  """`--peers`: every system in its own processes, one at a time (module doc)."""
  workdir = tempfile.mkdtemp(prefix="bench_real_")
  request_path = os.path.join(workdir, "request.json")
  with open(request_path, "w", encoding="utf-8") as f:
    json.dump({"new_tokens": new_tokens, "threads": FLAGS.threads}, f)
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  subprocess.run([sys.executable, "-m", KVATTN_CHILD, "--child=prepare", f"--request={request_path}",
                  f"--model={FLAGS.model}", f"--batch={batch}", f"--prompt_len={prompt_len}"],
                 cwd=root, check=True)
  with open(request_path, encoding="utf-8") as f:
    request = json.load(f)
  variants = FLAGS.variants or [f"{FLAGS.param_dtype}:{FLAGS.cache_dtype or 'float32'}"]
  systems: dict[str, tuple[str, str, dict[str, Any], list[str]]] = {}
  for variant in variants:
    param_dtype, _, rest = variant.partition(":")
    cache_dtype, _, xla_flags = rest.partition(":")
    if param_dtype not in ("float32", "bfloat16", "int8") or not cache_dtype:
      raise app.UsageError(f"--variants entries must be param_dtype:cache_dtype[:XLA_FLAGS] "
                           f"with param_dtype float32, bfloat16 or int8; got {variant!r}")
    name = f"kvattn_w{param_dtype}_c{cache_dtype}" + (f"_{xla_flags}" if xla_flags else "")
    systems[name] = (
        sys.executable, KVATTN_CHILD, {**request, "param_dtype": param_dtype,
                                       "cache_dtype": cache_dtype, "xla_flags": xla_flags,
                                       "bandwidth_mib": FLAGS.bandwidth_mib},
        ["--child=kvattn", f"--model={FLAGS.model}"])
  peers = {}
  for dtype in FLAGS.hf_dtypes:  # f32 keeps the name the ratios have always used
    if dtype not in ("float32", "bfloat16"):
      raise app.UsageError(f"--hf_dtypes entries must be float32 or bfloat16; got {dtype!r}")
    name = "hf_transformers" + ("" if dtype == "float32" else f"_{dtype}")
    peers[name] = (FLAGS.peer_python, PEERS["hf_transformers"], {**request, "dtype": dtype}, [])
  skipped: dict[str, str] = {}
  for cache_type in FLAGS.llama_cache_types:
    name = f"llama_cpp_{cache_type}"
    if batch != 1:
      skipped[name] = (f"llama.cpp's in-process server runs a batch as parallel slots, unevenly "
                       f"(issue 31); left out at --batch {batch}")
      continue
    peers[name] = (FLAGS.peer_python, PEERS["llama_cpp"], {**request, "cache_type": cache_type},
                   [])
  # kvattn children share a persistent compilation cache, so later rounds skip compiling.
  env = {"JAX_COMPILATION_CACHE_DIR": os.path.join(workdir, "jax_cache"),
         "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
         "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}
  os.environ.update(env)
  info: dict[str, dict[str, Any]] = {}

  def one_process(name, spec) -> Run | None:
    """Starts `name`'s process, runs one untimed and one timed round, waits for its exit."""
    python, module, req, args = spec
    env = {"XLA_FLAGS": req["xla_flags"]} if req.get("xla_flags") else {}
    try:
      proc = Peer(name, python, req, module=module, args=args, env=env)
    except (RuntimeError, OSError, ValueError) as e:
      skipped[name] = str(e)
      return None
    try:
      proc()  # warm-up: compiles ours, warms the peers' caches
      result = proc()
      info[name] = proc.info
    finally:
      proc.close()
    return result

  alone: dict[str, Run] = {}
  if FLAGS.alone_check:  # before any kvattn process has run: each peer alone on the machine
    for name, spec in peers.items():
      r = one_process(name, spec)
      if r is not None:
        alone[name] = r
  everything = {**systems, **{n: p for n, p in peers.items() if n not in skipped}}
  runs: dict[str, list[Run]] = {name: [] for name in everything}
  for _ in range(FLAGS.repeats):  # rounds alternate: every system once per round, in turn
    for name, spec in everything.items():
      if name in skipped:
        continue
      r = one_process(name, spec)
      if r is not None:
        runs[name].append(r)
  bandwidth = max(info[n]["read_bandwidth_bytes_per_s"] for n in systems if n in info)
  common = dict(batch=batch, prompt_len=prompt_len, new_tokens=new_tokens, bandwidth=bandwidth,
                model=FLAGS.model, random_weights=False, load_avg_1min=os.getloadavg()[0],
                cpu_count=os.cpu_count(), threads=FLAGS.threads, isolated_processes=True)
  lines = {}
  for name, rs in runs.items():
    if not rs:
      continue
    extra = {k: info[name][k] for k in ("version", "param_dtype", "cache_dtype", "cache_type",
                                        "dtype") if k in info[name]}
    lines[name] = summary(name, rs, weight_bytes_=info[name]["weight_bytes"],
                          cache_bytes_per_token=info[name]["cache_bytes_per_token"],
                          decode_tokens_per_s_rounds=[batch * (new_tokens - 1) / r.decode_s
                                                      for r in rs], **extra, **common)
    if name in alone:
      a = alone[name]
      lines[name]["alone_decode_tokens_per_s"] = batch * (new_tokens - 1) / a.decode_s
      lines[name]["alone_prefill_tokens_per_s"] = batch * prompt_len / a.prefill_s
      lines[name]["interleaved_over_alone_decode"] = (
          lines[name]["decode_tokens_per_s"] / lines[name]["alone_decode_tokens_per_s"])
  llamas = [n for n in lines if n.startswith("llama_cpp")]
  for name in systems:
    if name not in lines:
      continue
    ours_line = lines[name]
    ref_tokens = runs[name][0].tokens
    for other in lines:
      if other in systems:
        continue
      for what in ("decode", "prefill"):
        ours_line[f"{what}_vs_{other}"] = (ours_line[f"{what}_tokens_per_s"]
                                           / lines[other][f"{what}_tokens_per_s"])
      if runs[other][0].tokens.size:
        lines[other].setdefault("greedy_tokens_equal", {})[name] = float(
            np.mean(runs[other][0].tokens == ref_tokens))
      elif "text" in info[other]:
        lines[other].setdefault("greedy_text_prefix_equal", {})[name] = _common_prefix_fraction(
            info[name]["text"][0], info[other]["text"][0])
    if llamas:
      best = max(llamas, key=lambda n: lines[n]["decode_tokens_per_s"])
      ours_line["decode_vs_llama_cpp_best"] = (ours_line["decode_tokens_per_s"]
                                               / lines[best]["decode_tokens_per_s"])
      ours_line["llama_cpp_best"] = best
  for line in lines.values():
    print(json.dumps(line))
  for name, why in skipped.items():
    print(json.dumps({"system": name, "skipped": why, "batch": batch, "prompt_len": prompt_len}))


def quality_grid(batch: int, prompt_len: int, new_tokens: int) -> None:
  """`--quality_only`: one JSON line per `--variants` entry (module doc), one process."""
  if not FLAGS.quality_tokens:
    raise app.UsageError("--quality_only needs --quality_tokens > 0")
  reference, _, tok = _load(FLAGS.model, FLAGS.random_weights, "float32")
  held_out = text_lib.document_tokens(tok, FLAGS.quality_tokens, skip_tokens=prompt_len)
  prompts = _prompts(tok, batch, prompt_len)
  ppl_f32 = perplexity(reference, held_out, "float32")
  want = ours(reference, prompts, new_tokens, "float32")().tokens
  weights = {"float32": reference}
  for variant in FLAGS.variants or [f"{FLAGS.param_dtype}:{FLAGS.cache_dtype or 'float32'}"]:
    param_dtype, _, cache_dtype = variant.partition(":")
    cache_dtype = cache_dtype or "float32"
    if param_dtype not in weights:
      weights[param_dtype] = _load_variant(reference, tok, param_dtype)
    model = weights[param_dtype]
    ppl = perplexity(model, held_out, cache_dtype)
    got = ours(model, prompts, new_tokens, cache_dtype)().tokens
    print(json.dumps({
        "system": "kvattn", "param_dtype": param_dtype, "cache_dtype": cache_dtype,
        "model": FLAGS.model, "quality_tokens": FLAGS.quality_tokens, "perplexity": ppl,
        "perplexity_f32": ppl_f32, "perplexity_ratio": ppl / ppl_f32,
        "greedy_agreement_vs_f32": float(np.mean(got == want)), "batch": batch,
        "prompt_len": prompt_len, "new_tokens": new_tokens,
        "weight_bytes": weight_bytes(model)}), flush=True)


def main(argv: Sequence[str]) -> None:
  """absl entry point: one JSON line per system."""
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if FLAGS.child == "prepare":
    return prepare_child(FLAGS.request)
  if FLAGS.child == "kvattn":
    return kvattn_child(FLAGS.request)
  if FLAGS.child is not None:
    raise app.UsageError(f"--child must be 'prepare' or 'kvattn'; got {FLAGS.child!r}")
  for name in ("batch", "prompt_len", "repeats", "threads", "bandwidth_mib"):
    if getattr(FLAGS, name) < 1:
      raise app.UsageError(f"--{name} must be >= 1; got {getattr(FLAGS, name)}")
  if FLAGS.new_tokens < 2:
    raise app.UsageError(f"--new_tokens must be >= 2; got {FLAGS.new_tokens}")
  if FLAGS.peers and FLAGS.random_weights:
    raise app.UsageError("--peers needs the checkpoint; it cannot run with --random_weights")
  batch, prompt_len, new_tokens = FLAGS.batch, FLAGS.prompt_len, FLAGS.new_tokens
  if FLAGS.quality_only:
    return quality_grid(batch, prompt_len, new_tokens)
  if FLAGS.peers:
    shapes = []
    for shape in FLAGS.shapes or [f"{batch}x{prompt_len}"]:
      b, _, p = shape.partition("x")
      if not (b.isdigit() and p.isdigit() and int(b) > 0 and int(p) > 0):
        raise app.UsageError(f"--shapes entries must be BATCHxPROMPT_LEN; got {shape!r}")
      shapes.append((int(b), int(p)))
    for b, p in shapes:
      orchestrate(b, p, new_tokens)
    return None
  cache_dtype = FLAGS.cache_dtype or "float32"
  model, reference, tok = _load(FLAGS.model, FLAGS.random_weights, FLAGS.param_dtype)
  prompts = _prompts(tok, batch, prompt_len)
  run = ours(model, prompts, new_tokens, cache_dtype)
  runs: list[Run] = []
  bandwidths = []
  for round_ in range(FLAGS.repeats + 1):  # round 0 compiles
    bandwidths.append(timing_lib.read_bandwidth(FLAGS.bandwidth_mib << 20))
    result = run()
    if round_:
      runs.append(result)
  bandwidth = max(bandwidths)
  common = dict(batch=batch, prompt_len=prompt_len, new_tokens=new_tokens, bandwidth=bandwidth,
                model=FLAGS.model, random_weights=FLAGS.random_weights,
                load_avg_1min=os.getloadavg()[0], cpu_count=os.cpu_count(),
                backend=jax.default_backend())
  line = summary("kvattn", runs, weight_bytes_=weight_bytes(model),
                 cache_bytes_per_token=model.cache_bytes_per_token(cache_dtype),
                 cache_dtype=cache_dtype, param_dtype=FLAGS.param_dtype, **common)
  if FLAGS.quality_tokens:
    held_out = text_lib.document_tokens(tok, FLAGS.quality_tokens, skip_tokens=prompt_len)
    line["perplexity"] = perplexity(model, held_out, cache_dtype)
    line["perplexity_f32"] = perplexity(reference, held_out, "float32")
    line["perplexity_ratio"] = line["perplexity"] / line["perplexity_f32"]
    line["quality_tokens"] = FLAGS.quality_tokens
    # Greedy agreement: the timed run's tokens against f32 weights with an f32 cache.
    want = ours(reference, prompts, new_tokens, "float32")().tokens
    line["greedy_agreement_vs_f32"] = float(np.mean(runs[0].tokens == want))
  print(json.dumps(line))


if __name__ == "__main__":
  _define_flags()
  cli.run(main)
