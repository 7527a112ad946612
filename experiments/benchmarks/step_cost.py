"""Where a decode step's time goes: per-layer and fixed cost, bytes, roofline, and the XLA ops.

    python -m experiments.benchmarks.step_cost --param_dtype=int8 --cache=float32
    python -m experiments.benchmarks.step_cost --param_dtype=float32 --cache=int8 \\
        --layers=1,15,30 --contexts=16,512,4000 --batch=4
    python -m experiments.benchmarks.step_cost --cache=kivi4 --breakdown_layers=0   # no profile

Any weight dtype (`--param_dtype`: float32, bfloat16, int8 for W8A8) and any cache (`--cache`:
a storage dtype for the dense cache, or a registered kind such as `kivi4`, `rotated4`, `h2o`)
goes through the same three measurements, in one process, on `--model` cut to each of
`--layers` layers (`Transformer.truncated`, the same embedding and head):

1. **Step time.** `kvattn.generate`'s compiled decode loop (`timing.decode_rounds`, every
   (layers, context) point timed in interleaved rounds) after a prefill of `--contexts`
   random tokens. A least-squares line over the layer counts gives, per context, the cost
   of one layer (`per_layer_ms`) and the rest of the step (`fixed_ms`: embedding, final
   norm, the LM head, sampling, the loop).
2. **Bytes and roofline.** The bytes one layer's step must read at least (its parameters plus
   its cache at the mean attended length, scales included) over this machine's read
   bandwidth measured in the same run (`timing.read_bandwidth`) give the read time;
   `roofline_fraction` = read time / `per_layer_ms`.
3. **Breakdown** (`--breakdown_layers` > 0). A child process of this module runs the decode
   loop of the model cut to that many layers under `jax.profiler` with XLA:CPU's per-thunk
   trace events (`--xla_cpu_enable_xprof_traceme`) and dumps the optimized HLO; every
   thunk's time is matched to its HLO instruction (kind, shape and the JAX op that made it)
   and summed per step. The trace events cost a few microseconds each, so these times
   run above the untraced step; read them as shares. Rows: the largest groups, then the
   count of thunks per step and the time in thunks under 10 us. `--breakdown_program=prefill`
   profiles one prefill of the last `--contexts` value instead (per-prefill times).

Prints JSON lines (`"point"`, `"fit"`, `"breakdown"` records) and a markdown table of each.
`--random_weights` uses the architecture with random weights (no checkpoint download).
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re
import subprocess
import sys
import tempfile
from typing import Any, Sequence

import numpy as np

from experiments.framework import cli

THUNK_SMALL_US = 10.0
"""Thunks shorter than this (microseconds) are counted apart: the per-op fixed cost."""


def fit_line(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
  """`(slope, intercept)` of the least-squares line through `(xs, ys)`.

  Raises:
    ValueError: fewer than two distinct xs.
  """
  xs, ys = np.asarray(xs, np.float64), np.asarray(ys, np.float64)
  if len(set(xs.tolist())) < 2:
    raise ValueError(f"--layers needs at least two distinct layer counts; got {xs.tolist()}")
  slope, intercept = np.polyfit(xs, ys, 1)
  return float(slope), float(intercept)


def parse_ints(name: str, text: str) -> list[int]:
  """Comma-separated positive ints; ValueError naming `name` otherwise."""
  try:
    values = [int(v) for v in text.split(",") if v.strip()]
  except ValueError:
    values = []
  if not values or min(values) < 1:
    raise ValueError(f"--{name} must be comma-separated positive ints; got {text!r}")
  return values


# ----------------------------------------------------------------------------------------------
# The model and its caches.


def _load(args):
  from experiments.evals import models  # pylint: disable=g-import-not-at-top
  model, _ = models.load_model(args.model, random_weights=args.random_weights,
                               param_dtype=None if args.param_dtype == "float32"
                               else args.param_dtype,
                               dtype="bfloat16" if args.param_dtype == "bfloat16"
                               else "float32")
  return model


def _caches(model, cache: str, batch: int, capacity: int):
  """Empty caches of `cache` (a storage dtype of the dense cache, or a registered kind)."""
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from kvattn.caches import registry  # pylint: disable=g-import-not-at-top
  try:
    dtype = jnp.dtype(cache)
  except TypeError:
    return registry.build_caches(model, batch, capacity, None, {"kind": cache}, where="--cache")
  return model.init_caches(batch, capacity, dtype=dtype)


def _prefilled(model, cache: str, batch: int, context: int, capacity: int, seed: int = 0):
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from kvattn.inference.generation import prefill  # pylint: disable=g-import-not-at-top
  vocab = int(model.vocab_size)
  prompts = np.random.RandomState(seed).randint(0, vocab, (batch, context))
  caches = _caches(model, cache, batch, capacity)
  first, caches, _ = prefill(model, jnp.asarray(prompts, jnp.int32),
                             jnp.full((batch,), context, jnp.int32), caches)
  return first, caches


def layer_bytes(model, caches, capacity: int, batch: int) -> tuple[int, float]:
  """`(parameter bytes of one layer, cache bytes per token of one layer)` (scales included;
  the mean over the model's layers)."""
  from flax import nnx  # pylint: disable=g-import-not-at-top
  from kvattn import memory  # pylint: disable=g-import-not-at-top
  num_layers = len(model.layers)
  params = sum(memory.tree_bytes(nnx.state(layer, nnx.Param)) for layer in model.layers)
  return params // num_layers, memory.tree_bytes(caches) / (batch * capacity * len(caches))


# ----------------------------------------------------------------------------------------------
# 1 and 2: step time, regression, bytes.


def measure(args) -> list[dict[str, Any]]:
  """The step-time points and the per-context fits (module doc, 1 and 2)."""
  from experiments.benchmarks import real  # pylint: disable=g-import-not-at-top
  from experiments.framework import timing  # pylint: disable=g-import-not-at-top
  base = _load(args)
  layers, contexts = args.layers, args.contexts
  if max(layers) > base.num_layers:
    raise ValueError(f"--layers must be at most the model's {base.num_layers} layers; got "
                     f"{max(layers)}")
  capacity_extra = (args.repeats + 1) * (args.steps + 1) + 8
  runs, info = {}, {}
  for num_layers in layers:
    model = base if num_layers == base.num_layers else base.truncated(num_layers)
    for context in contexts:
      capacity = context + capacity_extra
      first, caches = _prefilled(model, args.cache, args.batch, context, capacity)
      name = f"{num_layers}x{context}"
      runs[name] = (model, first, caches)
      info[name] = layer_bytes(model, caches, capacity, args.batch)
  bandwidth = timing.read_bandwidth(args.bandwidth_mib << 20)
  out = timing.decode_rounds(runs, args.steps, args.repeats)
  records = []
  for num_layers in layers:
    for context in contexts:
      name = f"{num_layers}x{context}"
      records.append({"record": "point", "layers": num_layers, "context": context,
                      "step_ms": 1e3 * float(np.median(out[name]["wall"])),
                      "step_cpu_ms": 1e3 * float(np.median(out[name]["cpu"]))})
  mean_extra = (args.repeats + 1) * (args.steps + 1) / 2  # cached tokens beyond the context
  for context in contexts:
    pts = [r for r in records if r["context"] == context]
    per_layer, fixed = fit_line([r["layers"] for r in pts], [r["step_ms"] for r in pts])
    params, per_token = info[f"{layers[0]}x{context}"]
    read = params + args.batch * (context + mean_extra) * per_token
    read_ms = 1e3 * read / bandwidth
    records.append({
        "record": "fit", "param_dtype": args.param_dtype, "cache": args.cache,
        "batch": args.batch, "context": context, "per_layer_ms": per_layer, "fixed_ms": fixed,
        "layer_param_bytes": params, "layer_cache_bytes_per_token": per_token,
        "layer_read_bytes": read, "read_bandwidth_gb_s": bandwidth / 1e9,
        "layer_read_ms": read_ms, "roofline_fraction": read_ms / per_layer})
  return records


# ----------------------------------------------------------------------------------------------
# 3: the breakdown, in a child process with XLA's trace events on.


def _hlo_instructions(path: str) -> dict[str, tuple[str, str, str]]:
  """name -> (shape, opcode, JAX op name) of every instruction of an optimized HLO dump."""
  info = {}
  with open(path, encoding="utf-8") as f:
    for line in f:
      m = re.match(r"\s*(?:ROOT )?%([\w.\-]+) = (\S+) ([\w\-]+)\(", line)
      if m:
        op = re.search(r'op_name="([^"]*)"', line)
        info[m.group(1)] = (m.group(2), m.group(3), op.group(1) if op else "")
  return info


def _op_label(op_name: str) -> str:
  """The tail of a JAX op name, with the decode loop's prefix and branch numbers dropped."""
  op = re.sub(r"branch_\d+_fun", "branch", op_name)
  op = re.sub(r"^jit\([^)]*\)/(while/body/)?", "", op)
  return op[-56:]


def group_thunks(events: list[dict], info: dict[str, tuple[str, str, str]], steps: int
                 ) -> dict[str, Any]:
  """Per-step microseconds of the trace's thunks grouped by (kind, shape, JAX op); control
  thunks (conditional, while, call) are left out, since their bodies' thunks are counted."""
  groups, counts = collections.Counter(), collections.Counter()
  thunks, small = 0, 0.0
  for e in events:
    if e.get("ph") != "X":
      continue
    name = e["name"]
    inst = info.get(name) or info.get(name.split(".clone")[0])
    if inst is None or inst[1] in ("conditional", "while", "call"):
      continue
    dur = float(e.get("dur", 0.0))
    kind = re.sub(r"[\d.]+$", "", name.split(".clone")[0])
    key = f"{kind} {inst[0].split('{')[0]} {_op_label(inst[2])}"
    groups[key] += dur
    counts[key] += 1
    thunks += 1
    if dur < THUNK_SMALL_US:
      small += dur
  total = sum(groups.values())
  rows = [{"op": k, "us_per_step": t / steps, "share": t / total, "per_step": counts[k] / steps}
          for k, t in groups.most_common()]
  return {"thunk_us_per_step": total / steps, "thunks_per_step": thunks / steps,
          "small_thunk_us_per_step": small / steps, "rows": rows}


def breakdown_child(args) -> dict[str, Any]:
  """Runs in the child (XLA_FLAGS set by `breakdown`): one traced decode call."""
  import jax  # pylint: disable=g-import-not-at-top
  from kvattn.inference.generation import decode  # pylint: disable=g-import-not-at-top
  base = _load(args)
  num_layers = args.breakdown_layers
  model = base if num_layers == base.num_layers else base.truncated(num_layers)
  context, steps = args.contexts[-1], args.steps * 2
  trace_dir = os.path.join(args.child_dir, "trace")
  if args.breakdown_program == "prefill":  # one traced prefill of `context` tokens per row
    steps = 1
    _prefilled(model, args.cache, args.batch, context, context)  # compiles
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
      jax.block_until_ready(_prefilled(model, args.cache, args.batch, context, context))
  else:
    first, caches = _prefilled(model, args.cache, args.batch, context, context + 3 * steps + 8)
    tokens, _, caches = decode(model, first, caches, steps + 1)  # compiles
    jax.block_until_ready(caches)
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
      tokens, _, caches = decode(model, tokens[:, -1], caches, steps + 1)
      jax.block_until_ready(caches)
  (trace,) = glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True)
  with gzip.open(trace) as f:
    events = json.load(f)
  events = events["traceEvents"] if isinstance(events, dict) else events
  program = f"jit__{args.breakdown_program}"
  hlos = glob.glob(os.path.join(args.child_dir, "hlo", f"*{program}*cpu_after_optimizations.txt"))
  if len(hlos) != 1:
    raise RuntimeError(f"expected one optimized HLO of {program}; found {hlos}")
  out = group_thunks(events, _hlo_instructions(hlos[0]), steps)
  out.update(record="breakdown", program=args.breakdown_program, layers=num_layers, context=context, batch=args.batch,
             param_dtype=args.param_dtype, cache=args.cache)
  return out


def breakdown(args, argv: Sequence[str]) -> dict[str, Any]:
  """The breakdown (module doc, 3) from a child process of this module."""
  with tempfile.TemporaryDirectory() as tmp:
    env = dict(os.environ)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_cpu_enable_xprof_traceme=true"
                        f" --xla_dump_to={tmp}/hlo --xla_dump_hlo_as_text"
                        " --xla_dump_hlo_pass_re=^$").strip()
    cmd = [sys.executable, "-m", "experiments.benchmarks.step_cost", *argv,
           "--child", "breakdown", "--child_dir", tmp]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if proc.returncode:
      raise RuntimeError(f"the breakdown child failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ----------------------------------------------------------------------------------------------
# Entry point.


def _parser():
  parser = cli.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--model", default="smollm2-135m-instruct")
  parser.add_argument("--random_weights", action="store_true")
  parser.add_argument("--param_dtype", default="int8", choices=("float32", "bfloat16", "int8"))
  parser.add_argument("--cache", default="float32",
                      help="a storage dtype of the dense cache, or a registered cache kind")
  parser.add_argument("--layers", default="1,15,30", help="layer counts of the regression")
  parser.add_argument("--contexts", default="16,512", help="cached tokens before decoding")
  parser.add_argument("--batch", type=int, default=1)
  parser.add_argument("--steps", type=int, default=16, help="decode steps per timed call")
  parser.add_argument("--repeats", type=int, default=5, help="timed rounds")
  parser.add_argument("--bandwidth_mib", type=int, default=512)
  parser.add_argument("--breakdown_layers", type=int, default=2,
                      help="layers of the profiled model (0: no breakdown)")
  parser.add_argument("--top", type=int, default=20, help="breakdown rows printed")
  parser.add_argument("--breakdown_program", default="decode", choices=("decode", "prefill"),
                      help="the profiled program: the decode loop (per step), or one prefill "
                           "of the last --contexts value")
  parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
  parser.add_argument("--child_dir", default=None, help=argparse.SUPPRESS)
  return parser


def _check(args) -> None:
  args.layers = parse_ints("layers", args.layers)
  args.contexts = parse_ints("contexts", args.contexts)
  for name in ("batch", "steps", "repeats", "bandwidth_mib"):
    if getattr(args, name) < 1:
      raise ValueError(f"--{name} must be >= 1; got {getattr(args, name)}")
  if args.breakdown_layers < 0:
    raise ValueError(f"--breakdown_layers must be >= 0; got {args.breakdown_layers}")


def print_tables(records: list[dict[str, Any]], top: int) -> None:
  """Markdown tables of the fits and the breakdown."""
  fits = [r for r in records if r["record"] == "fit"]
  if fits:
    print("\n| weights | cache | B | context | per layer ms | fixed ms | layer reads MB "
          "| read ms at GB/s | roofline |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in fits:
      print(f"| {r['param_dtype']} | {r['cache']} | {r['batch']} | {r['context']} | "
            f"{r['per_layer_ms']:.3f} | {r['fixed_ms']:.2f} | {r['layer_read_bytes'] / 1e6:.2f} "
            f"| {r['layer_read_ms']:.3f} at {r['read_bandwidth_gb_s']:.1f} | "
            f"{r['roofline_fraction']:.2f} |")
  for r in records:
    if r["record"] != "breakdown":
      continue
    unit = "prefill" if r.get("program") == "prefill" else "step"
    print(f"\nBreakdown of {r.get('program', 'decode')}, {r['layers']} layers, context "
          f"{r['context']}, B={r['batch']}: {r['thunk_us_per_step']:.0f} us/{unit} in "
          f"{r['thunks_per_step']:.0f} thunks ({r['small_thunk_us_per_step']:.0f} us in thunks "
          f"under {THUNK_SMALL_US:.0f} us)")
    print(f"\n| us/{unit} | share | per {unit} | thunk, shape, JAX op |")
    print("|---:|---:|---:|---|")
    for row in r["rows"][:top]:
      print(f"| {row['us_per_step']:.1f} | {100 * row['share']:.1f}% | {row['per_step']:.0f} "
            f"| `{row['op']}` |")


def main(argv: Sequence[str] | None = None) -> None:
  """Measures and prints (module doc)."""
  argv = list(sys.argv[1:] if argv is None else argv)
  args = _parser().parse_args(argv)
  _check(args)
  if args.child == "breakdown":
    print(json.dumps(breakdown_child(args)))
    return
  records = measure(args)
  for r in records:
    print(json.dumps(r), flush=True)
  if args.breakdown_layers:
    r = breakdown(args, argv)
    print(json.dumps(dict(r, rows=r["rows"][:args.top])))
    records.append(r)
  print_tables(records, args.top)


if __name__ == "__main__":
  cli.run_plain(main)
