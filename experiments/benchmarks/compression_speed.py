r"""Examples per second of the compression family against kvpress, interleaved (issue 39).

    python -m experiments.benchmarks.compression_speed --seeds=8 --rounds=2 \
        --points=snapkv:0.5,none:0 --configs=float32:8,int8:8,bfloat16:8 \
        --kvpress_python=/work/kvpress-venv/bin/python --out=runs/compression_speed.jsonl
    python -m experiments.benchmarks.compression_speed --sweep=4 --seeds=4 --rounds=2 \
        --points=knorm:0.25,knorm:0.5,keydiff:0.5,snapkv:0.5 --out=runs/sweep_speed.jsonl

One process runs kvattn (every `--configs` entry `param_dtype:batch`: "float32" f32 weights
and compute, "int8" W8A8 weights (`kvattn.models.int8`) with f32 compute, "bfloat16" bf16
weights, compute and cache); a child process in kvpress's venv (`--child=kvpress`, torch,
no jax) keeps kvpress 0.5.5's `KVPressTextGenerationPipeline` loaded and answers requests on
stdin. The examples are the compression family's (`experiments.evals.ruler`, niah_single at
1024 tokens, chat template, greedy, `ruler.MAX_NEW_TOKENS` tokens), the points
`policy:ratio` on kvpress's protocol (`compression.spec_of(..., "context", ...)`; "none:0" is
the dense cache / no press). Each round runs, per point, kvpress on every example (one at a
time, as its pipeline does), then each kvattn config on the same examples (`batch` at a
time, compiled once per config before the rounds): the alternation is what makes the ratio
meaningful on a shared machine. Every timing has wall and process-CPU seconds, and is split
into prefill (kvattn: the `prefill` call, context and question writes; kvpress: the base
model's first forward, the context with the press) and the rest (question and decode).

`--roofline` first times this machine's f32 GEMM (a `[2048, 2048]` jnp.dot here, torch.mm in
the child, alternated) and the s8 x s8 -> s32 dot XLA runs for W8A8, and writes the matmul
FLOPs of one example (`example_flops`: projections, causal attention, LM head at the
positions each system projects) so that prefill GFLOP/s can be set against the peak.

`--sweep=BATCH` times a sweep instead: every point of `--points` on the same examples, as the
compression family runs them (`experiments.families.compression.measure` with
`compression.replay`: the context's forward pass recorded once per batch of `BATCH` examples,
each point writing its caches from it, then the question and the answer), against kvpress on
the same points one example at a time. Each round starts from an empty recording, so the
recording's seconds are in the sweep's; one untimed round first compiles every program. The
figure is (examples x points) per second of the whole sweep.

Output: one JSON line per measurement in `--out` (`kind`: "gemm", "flops", "kvpress",
"kvattn", "sweep"); a summary (medians per config, ratios against kvpress) is printed at the
end (`summarize`).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from experiments.evals import ruler
from experiments.framework import cli

MODEL = "smollm2-135m-instruct"
TASK, LENGTH = "niah_single", 1024
PARAM_DTYPES = ("float32", "int8", "bfloat16")
GEMM_N = 2048  # the roofline GEMM: [N, N] x [N, N], 2 N^3 FLOPs


# ----------------------------------------------------------------------------------------------
# FLOPs (analytic, matmuls only).


def example_flops(dims: Mapping[str, int], context: int, question: int, new_tokens: int,
                  kept: int, *, head_positions: int = 1) -> dict[str, float]:
  """Matmul FLOPs (2 per multiply-add) of one example on kvpress's protocol.

  Args:
    dims: `d_model, mlp_dim, num_layers, num_heads, num_kv_heads, head_dim, vocab_size`.
    context, question: tokens of the context (compressed) and of the rest of the prompt.
    new_tokens: answer tokens; the first comes from the prefill, `new_tokens - 1` decode steps.
    kept: context tokens kept after compression (`context` uncompressed).
    head_positions: prompt positions projected onto the vocabulary (1: the last only).

  Returns:
    FLOPs of `prefill_context` (projections + causal attention of the context),
    `prefill_question` (projections + attention over the kept context and itself),
    `lm_head` (the prompt's projected positions), `decode` (steps: projections, attention,
    LM head) and `total`.
  """
  d, f, n_layers = dims["d_model"], dims["mlp_dim"], dims["num_layers"]
  nq, nkv, h, vocab = dims["num_heads"], dims["num_kv_heads"], dims["head_dim"], dims["vocab_size"]
  proj = 2 * n_layers * (d * nq * h + 2 * d * nkv * h + nq * h * d + 3 * d * f)  # per token
  attn = lambda keys: 2 * 2 * n_layers * nq * h * keys  # one query against `keys` keys
  ctx = proj * context + sum(attn(t + 1) for t in range(context))
  qst = proj * question + sum(attn(kept + t + 1) for t in range(question))
  head = 2 * d * vocab
  steps = max(new_tokens - 1, 0)
  dec = sum(proj + attn(kept + question + t + 1) + head for t in range(steps))
  out = {"prefill_context": ctx, "prefill_question": qst, "lm_head": head * head_positions,
         "decode": dec}
  out["prefill"] = ctx + qst + out["lm_head"]
  out["total"] = out["prefill"] + dec
  return {k: float(v) for k, v in out.items()}


def model_dims(model: Any) -> dict[str, int]:
  """`example_flops`'s dims of a `kvattn.Transformer` (every layer alike)."""
  spec = model.spec
  a = spec.attention
  return {"d_model": spec.d_model, "mlp_dim": spec.mlp_dim, "num_layers": spec.num_layers,
          "num_heads": a.num_heads, "num_kv_heads": a.num_kv_heads, "head_dim": a.head_dim,
          "vocab_size": spec.vocab_size}


# ----------------------------------------------------------------------------------------------
# The kvpress child (its venv: torch and kvpress, no jax).


def _child_kvpress() -> None:
  """Serves kvpress requests: one JSON object per stdin line, `{"op": "gemm", "n": N,
  "repeats": R}` or `{"op": "run", "press": p, "ratio": r, "seeds": [...]}`; answers each
  with one stdout line `RESULT <json>` (stdout's other lines are the libraries' noise)."""
  import torch  # pylint: disable=g-import-not-at-top
  import kvpress  # pylint: disable=g-import-not-at-top
  from experiments.benchmarks.peers import kvpress_ruler  # pylint: disable=g-import-not-at-top

  torch.set_grad_enabled(False)
  lm, tok = kvpress_ruler.load(MODEL, "sdpa")
  pipe = kvpress.KVPressTextGenerationPipeline(model=lm, tokenizer=tok)
  calls: list[tuple[float, float]] = []  # (wall, cpu) of each base-model forward

  def pre(_module, _args, _kwargs):
    calls.append((time.perf_counter(), time.process_time()))

  def post(_module, _args, _kwargs, _out):
    t0, c0 = calls.pop()
    calls.append((-(time.perf_counter() - t0), -(time.process_time() - c0)))

  lm.model.register_forward_pre_hook(pre, with_kwargs=True)
  lm.model.register_forward_hook(post, with_kwargs=True)

  def reply(obj):
    sys.stdout.write("RESULT " + json.dumps(obj) + "\n")
    sys.stdout.flush()

  reply({"ready": True, "torch": torch.__version__, "threads": torch.get_num_threads()})
  for line in sys.stdin:
    req = json.loads(line)
    if req["op"] == "gemm":
      n = req["n"]
      a, b = torch.randn(n, n), torch.randn(n, n)
      torch.mm(a, b)
      walls, cpus = [], []
      for _ in range(req["repeats"]):
        t0, c0 = time.perf_counter(), time.process_time()
        torch.mm(a, b)
        walls.append(time.perf_counter() - t0)
        cpus.append(time.process_time() - c0)
      reply({"wall_s": walls, "cpu_s": cpus})
      continue
    out = []
    for seed in req["seeds"]:
      example = ruler.make(TASK, tok, LENGTH, seed)
      templated = pipe.preprocess(example.context, ["\n\n" + example.question],
                                  example.answer_prefix, max_context_length=10**9)
      context = int(templated["context_ids"].shape[1])
      calls.clear()
      t0, c0 = time.perf_counter(), time.process_time()
      answer = pipe(example.context, question="\n\n" + example.question,
                    answer_prefix=example.answer_prefix,
                    press=kvpress_ruler.make_press(req["press"], req["ratio"], context),
                    max_new_tokens=ruler.MAX_NEW_TOKENS[TASK])["answer"]
      wall, cpu = time.perf_counter() - t0, time.process_time() - c0
      out.append({"seed": seed, "wall_s": wall, "cpu_s": cpu, "prefill_wall_s": -calls[0][0],
                  "prefill_cpu_s": -calls[0][1], "forwards": len(calls), "output": answer,
                  "score": ruler.score(example, answer), "context_tokens": context,
                  "question_tokens": int(templated["questions_ids"][0].shape[1]),
                  "prompt_sha1": ruler.prompt_sha1(example)})
    reply({"examples": out})


class KvpressChild:
  """The kvpress child process (`_child_kvpress`), started with `python` from the repo root."""

  def __init__(self, python: str):
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": root}
    self._proc = subprocess.Popen(
        [python, "-m", "experiments.benchmarks.compression_speed", "--child=kvpress"],
        cwd=root, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    self.info = self._read()

  def _read(self) -> dict[str, Any]:
    for line in self._proc.stdout:
      if line.startswith("RESULT "):
        return json.loads(line[len("RESULT "):])
    raise RuntimeError(f"the kvpress child exited (status {self._proc.wait()})")

  def request(self, **req) -> dict[str, Any]:
    self._proc.stdin.write(json.dumps(req) + "\n")
    self._proc.stdin.flush()
    return self._read()

  def close(self) -> None:
    self._proc.stdin.close()
    self._proc.wait(timeout=60)


# ----------------------------------------------------------------------------------------------
# kvattn (this process).


class KvattnConfig:
  """One kvattn config: a model in `param_dtype` at `batch`, one point, its batches padded
  to one width so that it compiles once (as the compression family does)."""

  def __init__(self, model: Any, tok: Any, param_dtype: str, batch: int, policy: str,
               ratio: float, seeds: Sequence[int]):
    from experiments.families import compression  # pylint: disable=g-import-not-at-top
    from kvattn.caches import registry  # pylint: disable=g-import-not-at-top
    self.model, self.tok, self.param_dtype, self.batch = model, tok, param_dtype, batch
    self.policy, self.ratio = policy, ratio
    self.new = ruler.MAX_NEW_TOKENS[TASK]
    self.examples = [ruler.make(TASK, tok, LENGTH, s) for s in seeds]
    ids = [ruler.encode(tok, e, chat=True) for e in self.examples]
    self.contexts = np.array([ruler.context_tokens(tok, e, chat=True) for e in self.examples])
    self.lengths = np.array([len(r) for r in ids], np.int32)
    width = int(self.lengths.max())
    self.prompts = np.zeros((len(ids), width), np.int32)
    for i, r in enumerate(ids):
      self.prompts[i, :len(r)] = r
    self.spec = compression.spec_of(policy, 0, ratio, "context", 4)
    self.factory = registry.cache_factory_from_config(model, self.spec)
    self.context_mode = self.spec["kind"] != "dense"
    self.slots = (registry.slots_needed(self.spec, self.contexts, self.lengths + self.new - 1)
                  if self.context_mode else width + self.new - 1)
    self.name = f"kvattn-{param_dtype}-b{batch}"

  def _batch(self, start: int):
    rows = slice(start, start + self.batch)
    prompts, lengths = self.prompts[rows], self.lengths[rows]
    contexts = self.contexts[rows].astype(np.int32)
    if len(prompts) < self.batch:  # the last batch: repeat its last row (results dropped)
      pad = self.batch - len(prompts)
      prompts = np.concatenate([prompts, np.repeat(prompts[-1:], pad, 0)])
      lengths = np.concatenate([lengths, np.repeat(lengths[-1:], pad)])
      contexts = np.concatenate([contexts, np.repeat(contexts[-1:], pad)])
    return prompts, lengths, contexts

  def run_batch(self, start: int) -> dict[str, Any]:
    """Times one batch: prefill (context and question writes) and decode, wall and CPU."""
    import jax  # pylint: disable=g-import-not-at-top
    from kvattn.inference import generation  # pylint: disable=g-import-not-at-top
    prompts, lengths, contexts = self._batch(start)
    caches = tuple(self.factory(self.batch, self.slots, None))
    t0, c0 = time.perf_counter(), time.process_time()
    first, caches, key = jax.block_until_ready(self._prefill(prompts, lengths, contexts,
                                                             caches))
    t1, c1 = time.perf_counter(), time.process_time()
    tokens, counts, _ = jax.block_until_ready(generation.decode(
        self.model, first, caches, self.new, eos_id=self.tok.eos_id, rng=key))
    t2, c2 = time.perf_counter(), time.process_time()
    tokens, counts = np.asarray(tokens), np.asarray(counts)
    n = min(self.batch, len(self.examples) - start)
    outputs = [self.tok.decode(tokens[b, :counts[b]].tolist(), skip_special_tokens=True)
               for b in range(n)]
    return {"prefill_wall_s": t1 - t0, "prefill_cpu_s": c1 - c0, "decode_wall_s": t2 - t1,
            "decode_cpu_s": c2 - c1, "outputs": outputs, "steps": int(counts.max())}

  def _prefill(self, prompts, lengths, contexts, caches):
    """`generation.prefill` (context and question writes in one program on this protocol)."""
    from kvattn.inference import generation  # pylint: disable=g-import-not-at-top
    return generation.prefill(self.model, prompts, lengths, caches,
                              context_lengths=contexts if self.context_mode else None)

  def run(self) -> dict[str, Any]:
    """Every example once, `batch` at a time: the record of one round."""
    batches = [self.run_batch(s) for s in range(0, len(self.examples), self.batch)]
    outputs = [o for b in batches for o in b["outputs"]]
    sums = {k: float(sum(b[k] for b in batches)) for k in (
        "prefill_wall_s", "prefill_cpu_s", "decode_wall_s", "decode_cpu_s")}
    wall = sums["prefill_wall_s"] + sums["decode_wall_s"]
    cpu = sums["prefill_cpu_s"] + sums["decode_cpu_s"]
    return {**sums, "wall_s": wall, "cpu_s": cpu, "examples": len(outputs),
            "examples_per_s": len(outputs) / wall, "cpu_s_per_example": cpu / len(outputs),
            "outputs": outputs, "scores": [ruler.score(e, o) for e, o in
                                           zip(self.examples, outputs)]}

  def computed_prefill_flops(self) -> dict[str, float]:
    """Matmul FLOPs per example of the prefill as kvattn computes it: projections of the
    padded context and question writes (`generation._split_prompts`' widths), each write's
    queries against every candidate (the cache's slots, empty or not, and all its new
    tokens: `positional_attention` does not skip masked ones), the LM head at one position.
    """
    from kvattn.inference import generation  # pylint: disable=g-import-not-at-top
    d = model_dims(self.model)
    proj = example_flops(d, 1, 0, 1, 1)["prefill_context"] - 4 * d["num_layers"] * d[
        "num_heads"] * d["head_dim"]  # per token, without its attention
    attn = 4 * d["num_layers"] * d["num_heads"] * d["head_dim"]  # per (query, key)
    head = 2 * d["d_model"] * d["vocab_size"]
    if not self.context_mode:
      t = self.prompts.shape[1]
      return {"projections": proj * t, "attention": attn * t * self.slots, "lm_head": head}
    prompts, lengths, contexts = self._batch(0)
    context, rest, _ = generation._split_prompts(prompts, lengths, contexts)  # pylint: disable=protected-access
    tc, tr = context.shape[1], rest.shape[1]
    return {"projections": proj * (tc + tr),
            "attention": attn * (tc * (self.slots + tc) + tr * (self.slots + tr)),
            "lm_head": head}


def _load(param_dtype: str):
  from experiments.evals import models  # pylint: disable=g-import-not-at-top
  if param_dtype == "int8":
    return models.load_model(MODEL, "float32", param_dtype="int8")
  return models.load_model(MODEL, param_dtype)


def gemm_jax(n: int, repeats: int, dtype: str = "float32") -> dict[str, list[float]]:
  """Wall and CPU seconds of `repeats` jitted `[n, n] x [n, n]` dots in `dtype` ("float32",
  or "int8": s8 x s8 -> s32, the W8A8 product's form)."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(0)
  if dtype == "int8":
    a, b = (jnp.asarray(rng.integers(-127, 128, (n, n)), jnp.int8) for _ in range(2))
    f = jax.jit(lambda x, y: jax.lax.dot(x, y, preferred_element_type=jnp.int32))
  else:
    a, b = (jnp.asarray(rng.standard_normal((n, n)), jnp.dtype(dtype)) for _ in range(2))
    f = jax.jit(jnp.dot)
  f(a, b).block_until_ready()
  walls, cpus = [], []
  for _ in range(repeats):
    t0, c0 = time.perf_counter(), time.process_time()
    f(a, b).block_until_ready()
    walls.append(time.perf_counter() - t0)
    cpus.append(time.process_time() - c0)
  return {"wall_s": walls, "cpu_s": cpus}


# ----------------------------------------------------------------------------------------------
# The run.


def _append(path: str, record: dict[str, Any]) -> None:
  with open(path, "a") as f:
    f.write(json.dumps(record) + "\n")


def _loadavg() -> float:
  return os.getloadavg()[0]


def parse_points(text: str) -> list[tuple[str, float]]:
  """`"snapkv:0.5,none:0"` -> `[("snapkv", 0.5), ("none", 0.0)]`.

  Raises:
    ValueError: an entry not `policy:ratio` with a ratio in [0, 1), or "none" at a ratio > 0.
  """
  out = []
  for item in filter(None, text.split(",")):
    policy, _, ratio = item.partition(":")
    try:
      r = float(ratio)
    except ValueError:
      raise ValueError(f"--points entries must be policy:ratio; got {item!r}") from None
    if not policy or not 0 <= r < 1 or (policy == "none") != (r == 0):
      raise ValueError(f"--points entries must be policy:ratio with ratio in [0, 1), 'none' "
                       f"exactly at ratio 0; got {item!r}")
    out.append((policy, r))
  return out


def parse_configs(text: str) -> list[tuple[str, int]]:
  """`"float32:8,int8:4"` -> `[("float32", 8), ("int8", 4)]`.

  Raises:
    ValueError: a param dtype outside `PARAM_DTYPES` or a batch < 1.
  """
  out = []
  for item in filter(None, text.split(",")):
    dtype, _, batch = item.partition(":")
    if dtype not in PARAM_DTYPES or not batch.isdigit() or int(batch) < 1:
      raise ValueError(f"--configs entries must be param_dtype:batch with param_dtype in "
                       f"{PARAM_DTYPES} and batch >= 1; got {item!r}")
    out.append((dtype, int(batch)))
  return out


def run(points: Sequence[tuple[str, float]], configs: Sequence[tuple[str, int]],
        seeds: Sequence[int], rounds: int, out: str, kvpress_python: str | None,
        roofline: bool, progress=print) -> None:
  """The interleaved rounds of the module doc; every measurement appended to `out`."""
  child = KvpressChild(kvpress_python) if kvpress_python else None
  if child:
    child.request(op="run", press="none", ratio=0.0, seeds=[0])  # torch's first-call costs
    progress(f"kvpress child ready: {child.info}")
  models = {}
  for dtype in dict.fromkeys(d for d, _ in configs):
    t0 = time.perf_counter()
    models[dtype] = _load(dtype)
    progress(f"loaded {dtype} in {time.perf_counter() - t0:.0f} s")
  tok = next(iter(models.values()))[1]
  if roofline:
    for r in range(3):
      rec = {"kind": "gemm", "n": GEMM_N, "round": r, "load": _loadavg()}
      for name, f in (("jax-f32", lambda: gemm_jax(GEMM_N, 3)),
                      ("jax-s8", lambda: gemm_jax(GEMM_N, 3, "int8")),
                      ("torch-f32", lambda: child and child.request(op="gemm", n=GEMM_N,
                                                                    repeats=3))):
        t = f()
        if t:
          rec[name] = {"gflops_wall": 2 * GEMM_N**3 / min(t["wall_s"]) / 1e9,
                       "gflop_per_cpu_s": 2 * GEMM_N**3 / float(np.median(t["cpu_s"])) / 1e9,
                       **t}
      _append(out, rec)
      progress(json.dumps({k: (v["gflops_wall"], v["gflop_per_cpu_s"]) if isinstance(v, dict)
                           else v for k, v in rec.items()}))
  cfgs = {}
  for policy, ratio in points:
    for dtype, batch in configs:
      c = KvattnConfig(models[dtype][0], tok, dtype, batch, policy, ratio, seeds)
      t0 = time.perf_counter()
      c.run_batch(0)  # compiles prefill and decode
      compile_s = time.perf_counter() - t0
      cfgs[policy, ratio, dtype, batch] = c
      rec = {"kind": "flops", "config": c.name, "policy": policy, "ratio": ratio,
             "param_dtype": dtype, "batch": batch, "first_batch_s": compile_s,
             "computed_prefill_flops": c.computed_prefill_flops(),
             "slots": c.slots}
      if roofline:
        dims = model_dims(c.model)
        per = [example_flops(dims, int(n_c), int(n - n_c), c.new,
                             max(1, int(n_c * (1 - ratio))) if ratio else int(n_c))
               for n_c, n in zip(c.contexts, c.lengths)]
        rec["example_flops"] = {k: float(np.mean([p[k] for p in per])) for k in per[0]}
      _append(out, rec)
      progress(f"{c.name} {policy}:{ratio}: first batch {compile_s:.0f} s, slots {c.slots}")
  for r in range(rounds):
    for policy, ratio in points:
      if child:
        load = _loadavg()
        res = child.request(op="run", press=press_of(policy), ratio=ratio,
                            seeds=list(seeds))["examples"]
        wall, cpu = sum(e["wall_s"] for e in res), sum(e["cpu_s"] for e in res)
        rec = {"kind": "kvpress", "config": "kvpress", "policy": policy, "ratio": ratio,
               "round": r, "load": load, "wall_s": wall, "cpu_s": cpu,
               "prefill_wall_s": sum(e["prefill_wall_s"] for e in res),
               "prefill_cpu_s": sum(e["prefill_cpu_s"] for e in res),
               "examples": len(res), "examples_per_s": len(res) / wall,
               "cpu_s_per_example": cpu / len(res), "per_example": res,
               "scores": [e["score"] for e in res], "outputs": [e["output"] for e in res]}
        _append(out, rec)
        progress(f"round {r} kvpress {policy}:{ratio}: {rec['examples_per_s']:.3f} ex/s, "
                 f"{rec['cpu_s_per_example']:.2f} CPU-s/ex, score {np.mean(rec['scores']):.2f}, "
                 f"load {load:.1f}")
      for dtype, batch in configs:
        c = cfgs[policy, ratio, dtype, batch]
        load = _loadavg()
        rec = {"kind": "kvattn", "config": c.name, "policy": policy, "ratio": ratio,
               "param_dtype": dtype, "batch": batch, "round": r, "load": load, **c.run()}
        _append(out, rec)
        progress(f"round {r} {c.name} {policy}:{ratio}: {rec['examples_per_s']:.3f} ex/s, "
                 f"{rec['cpu_s_per_example']:.2f} CPU-s/ex, score {np.mean(rec['scores']):.2f}, "
                 f"load {load:.1f}")
  if child:
    child.close()


def press_of(policy: str) -> str:
  """kvpress's press name of the kvattn `policy` ("sink" -> "streaming_llm", ...; "none")."""
  from experiments.benchmarks.peers import kvpress_ruler  # pylint: disable=g-import-not-at-top
  return {v: k for k, v in kvpress_ruler.KVATTN_NAMES.items()}.get(policy, policy)


def sweep_settings(seeds: int, batch: int) -> tuple[dict[str, Any], dict[str, Any]]:
  """`(workload, compression)` of the compression family for the sweep: `TASK` at `LENGTH`,
  seeds `0..seeds-1`, `batch` examples per call, kvpress's protocol, replay on, no warmup
  (the untimed first round compiles)."""
  workload = {"tasks": (TASK,), "lengths": (LENGTH,), "seeds": seeds, "batch": batch,
              "max_new_tokens": 0, "warmup": False}
  compression = {"protocol": "context", "num_sinks": 4, "local_layers": "ring", "replay": True}
  return workload, compression


def run_sweep(points: Sequence[tuple[str, float]], batch: int, seeds: int, rounds: int,
              out: str, kvpress_python: str | None, progress=print) -> None:
  """The `--sweep` rounds of the module doc: per round, kvpress on every point (its examples
  one at a time), then kvattn's whole sweep from an empty recording; every record appended to
  `out` (`kind` "kvpress" per point, "sweep" per round with its points inside)."""
  from experiments.families import compression as family  # pylint: disable=g-import-not-at-top
  child = KvpressChild(kvpress_python) if kvpress_python else None
  if child:
    child.request(op="run", press="none", ratio=0.0, seeds=[0])  # torch's first-call costs
    progress(f"kvpress child ready: {child.info}")
  model, tok = _load("float32")
  workload, compression = sweep_settings(seeds, batch)

  def sweep() -> dict[str, Any]:
    records: dict = {}  # empty: this round records the context pass again
    t0, c0 = time.perf_counter(), time.process_time()
    done = [family.measure(model, tok, workload, compression, policy, ratio, records)
            for policy, ratio in points]
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    n = sum(d["num_examples"] for d in done)
    return {"wall_s": wall, "cpu_s": cpu, "example_points": n,
            "example_points_per_s": n / wall, "cpu_s_per_example_point": cpu / n,
            "record_s": sum(d["record_s"] for d in done),
            "engines": sorted({d["engine"] for d in done}),
            "points": [{k: d[k] for k in ("policy", "ratio", "score", "scores", "outputs",
                                          "timed_s", "record_s", "engine",
                                          "cache_bytes_per_seq")} for d in done]}

  t0 = time.perf_counter()
  sweep()  # compiles: the recording, each point's writes, the question and answer programs
  progress(f"kvattn sweep compiled in {time.perf_counter() - t0:.0f} s")
  for r in range(rounds):
    if child:
      for policy, ratio in points:
        load = _loadavg()
        res = child.request(op="run", press=press_of(policy), ratio=ratio,
                            seeds=list(range(seeds)))["examples"]
        wall, cpu = sum(e["wall_s"] for e in res), sum(e["cpu_s"] for e in res)
        rec = {"kind": "kvpress", "config": "kvpress", "policy": policy, "ratio": ratio,
               "round": r, "load": load, "wall_s": wall, "cpu_s": cpu,
               "examples": len(res), "examples_per_s": len(res) / wall,
               "cpu_s_per_example": cpu / len(res), "per_example": res,
               "scores": [e["score"] for e in res], "outputs": [e["output"] for e in res]}
        _append(out, rec)
        progress(f"round {r} kvpress {policy}:{ratio}: {wall:.1f} s, "
                 f"score {np.mean(rec['scores']):.2f}, load {load:.1f}")
    load = _loadavg()
    rec = {"kind": "sweep", "config": f"kvattn-sweep-b{batch}", "round": r, "load": load,
           "batch": batch, **sweep()}
    _append(out, rec)
    progress(f"round {r} kvattn sweep: {rec['wall_s']:.1f} s for {rec['example_points']} "
             f"example-points (record {rec['record_s']:.1f} s), load {load:.1f}")
  if child:
    child.close()


def summarize_sweep(records: Iterable[Mapping[str, Any]]) -> str:
  """Markdown for `--sweep` records: per round, the sweep's example-points per second against
  kvpress's on the same points (its seconds summed over them), and the score agreement."""
  records = list(records)
  sweeps = [r for r in records if r["kind"] == "sweep"]
  lines = ["| round | load | kvattn sweep s (record s) | kvpress s | example-points | "
           "kvattn / s | kvpress / s | x kvpress | scores equal |",
           "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
  for s in sweeps:
    mine = {(p["policy"], p["ratio"]): p for p in s["points"]}
    peer = {(r["policy"], r["ratio"]): r for r in records
            if r["kind"] == "kvpress" and r["round"] == s["round"]}
    if set(peer) != set(mine):
      peer_s, peer_rate, x, equal = "-", "-", "-", "-"
    else:
      total = sum(r["wall_s"] for r in peer.values())
      n = sum(r["examples"] for r in peer.values())
      peer_s, peer_rate = f"{total:.1f}", f"{n / total:.3f}"
      x = f"{s['example_points_per_s'] / (n / total):.2f}"
      pairs = [(a, b) for k in mine for a, b in zip(mine[k]["scores"], peer[k]["scores"])]
      equal = f"{sum(a == b for a, b in pairs)} of {len(pairs)}"
    lines.append(f"| {s['round']} | {s['load']:.1f} | {s['wall_s']:.1f} ({s['record_s']:.1f}) | "
                 f"{peer_s} | {s['example_points']} | {s['example_points_per_s']:.3f} | "
                 f"{peer_rate} | {x} | {equal} |")
  return "\n".join(lines)


def read(path: str) -> list[dict[str, Any]]:
  """The JSON lines of `path`."""
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


def summarize(records: Iterable[Mapping[str, Any]]) -> str:
  """Markdown: per point and config, median examples/s and CPU-s per example over rounds,
  the median of the per-round ratios against kvpress, prefill GFLOP/s, and the score."""
  records = list(records)
  flops = {(r["config"], r["policy"], r["ratio"]): r for r in records if r["kind"] == "flops"}
  lines = ["| point | config | examples/s | x kvpress (per round, median) | CPU-s/example | "
           "prefill GFLOP/s (wall) | prefill GFLOP per CPU-s | score |",
           "|---|---|---:|---:|---:|---:|---:|---:|"]
  runs = [r for r in records if r["kind"] in ("kvpress", "kvattn")]
  for point in dict.fromkeys((r["policy"], r["ratio"]) for r in runs):
    base = {r["round"]: r for r in runs if r["kind"] == "kvpress" and (r["policy"], r["ratio"])
            == point}
    ex_flops = next((f["example_flops"]["prefill"] for f in flops.values()
                     if (f["policy"], f["ratio"]) == point and f.get("example_flops")), None)
    for config in dict.fromkeys(r["config"] for r in runs if (r["policy"], r["ratio"]) == point):
      mine = [r for r in runs if r["config"] == config and (r["policy"], r["ratio"]) == point]
      eps = float(np.median([r["examples_per_s"] for r in mine]))
      ratio = [r["examples_per_s"] / base[r["round"]]["examples_per_s"] for r in mine
               if r["round"] in base]
      cpu = float(np.median([r["cpu_s_per_example"] for r in mine]))
      pw = [r["prefill_wall_s"] / r["examples"] for r in mine]
      pc = [r["prefill_cpu_s"] / r["examples"] for r in mine]
      gw = f"{ex_flops / np.median(pw) / 1e9:.0f}" if ex_flops else "-"
      gc = f"{ex_flops / np.median(pc) / 1e9:.0f}" if ex_flops else "-"
      score = float(np.mean([s for r in mine for s in r["scores"]]))
      lines.append(f"| {point[0]}:{point[1]:g} | {config} | {eps:.3f} | "
                   + (f"{np.median(ratio):.2f} ({min(ratio):.2f}-{max(ratio):.2f})" if ratio
                      else "-") + f" | {cpu:.2f} | {gw} | {gc} | {score:.2f} |")
  gemm = [r for r in records if r["kind"] == "gemm"]
  if gemm:
    lines += ["", f"GEMM [{GEMM_N}]^2, GFLOP/s (best wall) / GFLOP per CPU-s (median):"]
    for name in ("jax-f32", "jax-s8", "torch-f32"):
      got = [r[name] for r in gemm if name in r]
      if got:
        lines.append(f"- {name}: {max(g['gflops_wall'] for g in got):.0f} / "
                     f"{np.median([g['gflop_per_cpu_s'] for g in got]):.0f}")
  return "\n".join(lines)


def full_config_points(arg: str = "") -> dict[str, int]:
  """Points and examples of `configs/compression.py:<arg>` (the family's own expansion:
  per model one dense point and every policy x ratio > 0), and batches run per point
  (`workload.warmup` runs a point's first batch twice)."""
  from configs import compression as config_lib  # pylint: disable=g-import-not-at-top
  from experiments.families import compression  # pylint: disable=g-import-not-at-top
  config = config_lib.get_config(arg or None)
  models = len(config_lib.get_sweep(arg or None))
  w, c = config.workload, config.compression
  policies = len(tuple(c.policies) or compression.default_policies())
  ratios = [r for r in c.ratios if r > 0]
  points = models * (int(any(r == 0 for r in c.ratios)) + policies * len(ratios))
  examples = len(w.tasks) * len(w.lengths) * w.seeds
  batches = -(-examples // w.batch)
  return {"models": models, "policies": policies, "ratios": len(ratios), "points": points,
          "examples_per_point": examples, "batch": w.batch,
          "batches_run_per_point": batches + int(w.warmup)}


def estimate_full_config(seconds_per_batch: float, compile_s: float, arg: str = ""
                         ) -> dict[str, float]:
  """Wall seconds of the full config from one batch's steady-state seconds and one point's
  compilation (every point compiles its own prefill and decode programs)."""
  p = full_config_points(arg)
  run_s = p["points"] * p["batches_run_per_point"] * seconds_per_batch
  return {**p, "compile_s": p["points"] * compile_s, "run_s": run_s,
          "total_s": p["points"] * compile_s + run_s}


def main(argv: Iterable[str] | None = None) -> None:
  """Parses the flags of the module doc and runs (or serves, with `--child=kvpress`)."""
  parser = cli.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--child", choices=("kvpress",), default=None, help=argparse.SUPPRESS)
  parser.add_argument("--points", default="snapkv:0.5,none:0")
  parser.add_argument("--configs", default="float32:8,int8:8")
  parser.add_argument("--seeds", type=int, default=8, help="examples: seeds 0..seeds-1")
  parser.add_argument("--rounds", type=int, default=2)
  parser.add_argument("--kvpress_python", default="/work/kvpress-venv/bin/python",
                      help="python of kvpress's venv; '' = kvattn alone")
  parser.add_argument("--roofline", action="store_true")
  parser.add_argument("--sweep", type=int, default=0,
                      help="batch of the sweep mode (module doc); 0 = the per-point configs")
  parser.add_argument("--out", default="")
  parser.add_argument("--summarize", default="", help="print the summary of this file, exit")
  args = parser.parse_args(argv)
  if args.child:
    _child_kvpress()
    return
  if args.summarize:
    records = read(args.summarize)
    print(summarize_sweep(records) if any(r["kind"] == "sweep" for r in records)
          else summarize(records))
    return
  if not args.out:
    parser.error("--out is required")
  try:
    points, configs = parse_points(args.points), parse_configs(args.configs)
  except ValueError as e:
    parser.error(str(e))
  if args.seeds < 1 or args.rounds < 1:
    parser.error(f"--seeds and --rounds must be >= 1; got {args.seeds}, {args.rounds}")
  if args.sweep < 0:
    parser.error(f"--sweep must be >= 0; got {args.sweep}")
  if args.sweep:
    run_sweep(points, args.sweep, args.seeds, args.rounds, args.out, args.kvpress_python or None)
    print(summarize_sweep(read(args.out)))
    return
  run(points, configs, list(range(args.seeds)), args.rounds, args.out,
      args.kvpress_python or None, args.roofline)
  print(summarize(read(args.out)))


if __name__ == "__main__":
  cli.run_plain(main)
