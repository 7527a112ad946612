"""Decode-attention bandwidth: XLA path vs the Pallas kernel vs JAX's GPU kernel.

    python -m experiments.benchmarks.decode                      # CPU preset
    python -m experiments.benchmarks.decode --preset=gpu         # on a GPU
    python -m experiments.benchmarks.decode --preset=gpu_quick --tune --out=/tmp/bench.md
    python -m experiments.benchmarks.decode --sweep --sweep_lengths 10,1024,8192   # capacity sweep

Decode attention is memory-bound: each step reads the attended K/V slots once
and does O(G) flops per byte. For every shape the script reports

  kv_bytes        bytes of K/V that must be read: sum over b of the attended
                  slots (lengths[b], or the window) x K x (H + Hv) x itemsize
                  (MLA: slots x (C + R) x itemsize, c_kv serving as key and value)
  ms              median wall time of one call, milliseconds (each sample runs
                  `--calls` back-to-back calls and divides, so per-call Python
                  dispatch overlaps device work as in a decode loop; samples of
                  all implementations and ceilings are taken round-robin so
                  background load affects them alike)
  gbps            kv_bytes / time, GB/s (1e9 bytes)
  of_ceiling      gbps / ceiling_gbps

and two bandwidth ceilings measured in the same run on an array of the same
number of bytes as the K/V read: `copy` (a jitted `-x`, counted as read +
write, 2 x bytes / time, the STREAM convention) and `read` (a jitted f32 sum,
bytes / time). `ceiling_gbps` is the larger of the two.

Implementations (each inside `jax.jit`, inputs created outside the timing):
  xla            `kvattn.ops.decode_attention(..., implementation="xla")`
  pallas         `pallas_kernels.decode_attention` compiled (GPU/TPU only; on
                 CPU the kernel runs only interpreted and is not timed)
  jax_gqa        `jax.experimental.pallas.ops.gpu.decode_attention.gqa` (GPU
                 only) called with its own `[B, S, K, H]` layout; its wrapper
                 transposes K and V to `[B, K, S, H]` inside the call
  jax_mqa_vmap   the same JAX kernel (`mqa`) vmapped over K on our
                 `[B, K, S, H]` layout: the kernel without the transpose
  xla_blocked    `implementation="xla_blocked"` (CPU only; see kvattn/ops/xla_blocked.py)
MLA shapes time `kvattn.ops.mla_decode_attention` ("xla") and
`pallas_kernels.mla_decode_attention` ("pallas"). Without kvattn (no flax on
the machine) the plain-jnp `*_reference` of pallas_kernels stands in for the
XLA path, labelled "jnp_reference".

Prints one JSON line per (shape, implementation), then a markdown table; with
`--out` the table is also written there.

`--sweep` instead measures whether decode cost follows the live length: for
each cache kind (dense GQA f32 B=4 N=8 K=2 H=64; MLA latent f32 B=4 N=16
C=512 R=64; the same GQA cache in int8 with scales) and each live length L of
`--sweep_lengths`, the default path (`implementation=None`) on a cache sized
to fit (S = L) and on capacities `--sweep_capacities` >= L, all timers of a
length sampled round-robin in one run; it prints the step time and its ratio
to the fitted cache (the goal: <= 1.5 up to 32x the live length), and the
plain "xla" path on the largest capacity for comparison. `max_abs_diff_vs_xla` checks that the
timed implementations agree with the XLA path on the timed inputs.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import json

import jax
import jax.numpy as jnp
import numpy as np

from experiments.framework import cli
from experiments.framework import timing
from pallas_kernels import dense_decode as pk

try:  # kvattn needs flax; a bare GPU image may only have JAX.
  import kvattn.ops as kvattn_ops
except ImportError:  # pragma: no cover - depends on the machine
  kvattn_ops = None


def _parser() -> argparse.ArgumentParser:
  # argparse rather than absl: experiments/gpu_check.sh runs this on machines
  # that may have nothing but JAX installed.
  p = cli.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--preset", choices=["cpu", "gpu", "gpu_quick"], default=None,
                 help="Shape list; default: 'gpu' on GPU/TPU, 'cpu' otherwise.")
  p.add_argument("--length_fraction", type=float, default=1.0,
                 help="Each sequence's length as a fraction of S (the kernel reads only that).")
  p.add_argument("--impls", type=lambda s: s.split(","), default=None,
                 help="Comma-separated subset of implementations to time.")
  p.add_argument("--warmup", type=int, default=2, help="Untimed calls (the first compiles).")
  p.add_argument("--repeats", type=int, default=5, help="Timings; the median is reported.")
  p.add_argument("--calls", type=int, default=0,
                 help="Calls per timing (0: about 50 ms worth, at least 1).")
  p.add_argument("--tune", action="store_true",
                 help="Also time the kernel over a grid of tunables on the preset's first "
                      "dense and first MLA shape (GPU/TPU) and report each configuration.")
  p.add_argument("--out", default=None, help="Also write the markdown table to this file.")
  p.add_argument("--sweep", action="store_true",
                 help="Capacity-vs-length sweep of the default decode path instead of presets.")
  p.add_argument("--sweep_lengths", type=lambda s: [int(x) for x in s.split(",")],
                 default=[10, 1024, 8192], help="Live lengths of the sweep.")
  p.add_argument("--sweep_capacities", type=lambda s: [int(x) for x in s.split(",")],
                 default=[512, 1024, 2048, 4096, 8192, 16384, 32768],
                 help="Cache capacities of the sweep (those >= the length are run).")
  p.add_argument("--sweep_kinds", type=lambda s: s.split(","), default=["gqa", "mla", "int8"],
                 help="Cache kinds of the sweep: gqa, mla, int8.")
  return p


FLAGS = _parser().parse_args([])


@dataclasses.dataclass(frozen=True)
class Shape:
  """One benchmark point. `kind` "dense": K/V heads; "mla": N heads on a latent cache."""
  name: str
  kind: str
  batch: int
  num_heads: int
  capacity: int
  dtype: str
  num_kv: int = 1
  head_dim: int = 128       # dense H; MLA: latent width C
  v_dim: int = 128          # dense Hv; MLA: rope width R

  def kv_bytes(self, lengths) -> int:
    item = jnp.dtype(self.dtype).itemsize
    slots = int(np.sum(np.minimum(lengths, self.capacity)))
    per_slot = self.num_kv * (self.head_dim + self.v_dim) if self.kind == "dense" else (
        self.head_dim + self.v_dim)
    return slots * per_slot * item


PRESETS = {
    # 2-core CPU: f32 (XLA's CPU dots are far slower in bf16) plus one bf16 point.
    "cpu": [
        Shape("gqa_s1k", "dense", 4, 32, 1024, "float32", num_kv=8),
        Shape("gqa_s8k", "dense", 4, 32, 8192, "float32", num_kv=8),
        Shape("gqa_s8k_bf16", "dense", 4, 32, 8192, "bfloat16", num_kv=8),
        Shape("mqa_s32k", "dense", 1, 8, 32768, "float32", num_kv=1),
        Shape("mla_s8k", "mla", 4, 16, 8192, "float32", head_dim=512, v_dim=64),
    ],
    # H200: K/V reads from 64 MiB to 2 GiB; the goal applies once >= 1 GiB.
    "gpu": [
        Shape("gqa_b8_s8k", "dense", 8, 32, 8192, "bfloat16", num_kv=8),
        Shape("gqa_b32_s8k", "dense", 32, 32, 8192, "bfloat16", num_kv=8),
        Shape("gqa_b16_s32k", "dense", 16, 64, 32768, "bfloat16", num_kv=8),
        Shape("mha_b4_s4k", "dense", 4, 32, 4096, "bfloat16", num_kv=32),
        Shape("mqa_b1_s128k", "dense", 1, 8, 131072, "bfloat16", num_kv=1),
        Shape("gqa48_b16_s16k_h64", "dense", 16, 48, 16384, "bfloat16", num_kv=2,
              head_dim=64, v_dim=64),
        Shape("mla_b32_s8k", "mla", 32, 16, 8192, "bfloat16", head_dim=512, v_dim=64),
        Shape("mla_b64_s16k", "mla", 64, 128, 16384, "bfloat16", head_dim=512, v_dim=64),
    ],
    # A few minutes of compile + run on an H200, still reaching >= 1 GiB reads.
    "gpu_quick": [
        Shape("gqa_b8_s8k", "dense", 8, 32, 8192, "bfloat16", num_kv=8),
        Shape("gqa_b32_s8k", "dense", 32, 32, 8192, "bfloat16", num_kv=8),
        Shape("mqa_b1_s128k", "dense", 1, 8, 131072, "bfloat16", num_kv=1),
        Shape("mla_b64_s16k", "mla", 64, 128, 16384, "bfloat16", head_dim=512, v_dim=64),
    ],
}


def _timer(fn, *args) -> timing.Timer:
  """A timer of jitted `fn(*args)` with the command line's --calls and --warmup
  (`--calls 0`: about 50 ms of calls per sample). Callers interleave samples of
  several timers (`timing.round_robin`) so that load from other processes hits
  them alike (ratios within one run stay meaningful)."""
  return timing.Timer(fn, *args, calls=FLAGS.calls, warmup=FLAGS.warmup)


def _time(fn, *args) -> float:
  """Median seconds per call of jitted `fn(*args)` (one timer on its own)."""
  timer = _timer(fn, *args)
  timer.warm()
  timing.round_robin([timer], FLAGS.repeats)
  return timer.median()


def _ceiling_timers(num_bytes: int) -> dict[str, tuple[timing.Timer, float]]:
  """Timers of a copy and a read of `num_bytes` bytes, with the bytes each moves."""
  x = jnp.ones((max(num_bytes // 4, 1),), jnp.float32)
  return {"copy_gbps": (_timer(jax.jit(lambda x: -x), x), 2 * x.nbytes),
          "read_gbps": (_timer(jax.jit(jnp.sum), x), x.nbytes)}


def ceilings(num_bytes: int) -> dict[str, float]:
  """Copy (read + write counted) and read bandwidth in GB/s on `num_bytes` bytes."""
  out = {}
  for name, (timer, moved) in _ceiling_timers(num_bytes).items():
    timer.warm()
    timing.round_robin([timer], FLAGS.repeats)
    out[name] = moved / timer.median() / 1e9
  return out


def _inputs(shape: Shape, key):
  dtype = jnp.dtype(shape.dtype)
  ks = jax.random.split(key, 4)
  lengths = jnp.full((shape.batch,), max(1, int(round(shape.capacity * FLAGS.length_fraction))),
                     jnp.int32)
  if shape.kind == "dense":
    q = jax.random.normal(ks[0], (shape.batch, shape.num_heads, shape.head_dim), dtype)
    k = jax.random.normal(ks[1], (shape.batch, shape.num_kv, shape.capacity, shape.head_dim),
                          dtype)
    v = jax.random.normal(ks[2], (shape.batch, shape.num_kv, shape.capacity, shape.v_dim), dtype)
    return (q, k, v, lengths)
  c, r = shape.head_dim, shape.v_dim
  return (jax.random.normal(ks[0], (shape.batch, shape.num_heads, c), dtype) * 0.05,
          jax.random.normal(ks[1], (shape.batch, shape.num_heads, r), dtype) * 0.05,
          jax.random.normal(ks[2], (shape.batch, shape.capacity, c), dtype),
          jax.random.normal(ks[3], (shape.batch, shape.capacity, r), dtype),
          lengths)


def implementations(shape: Shape) -> dict:
  """name -> (jitted fn, args transform) for the implementations that run here."""
  compiled = jax.default_backend() in ("gpu", "cuda", "rocm", "tpu")
  on_gpu = jax.default_backend() in ("gpu", "cuda")
  impls = {}
  if shape.kind == "mla":
    scale = (128 + 64) ** -0.5  # DeepSeek-V2: 1/sqrt(qk_nope + qk_rope)
    if kvattn_ops is None:
      impls["jnp_reference"] = jax.jit(functools.partial(pk.mla_decode_attention_reference,
                                                         sm_scale=scale))
    else:
      impls["xla"] = jax.jit(functools.partial(kvattn_ops.mla_decode_attention,
                                               sm_scale=scale, implementation="xla"))
      if not compiled:
        impls["xla_blocked"] = jax.jit(functools.partial(
            kvattn_ops.mla_decode_attention, sm_scale=scale, implementation="xla_blocked"))
    if compiled:
      impls["pallas"] = jax.jit(functools.partial(pk.mla_decode_attention, sm_scale=scale))
    return impls
  if kvattn_ops is None:
    impls["jnp_reference"] = jax.jit(pk.decode_attention_reference)
  else:
    impls["xla"] = jax.jit(functools.partial(kvattn_ops.decode_attention, implementation="xla"))
    if not compiled:
      impls["xla_blocked"] = jax.jit(functools.partial(kvattn_ops.decode_attention,
                                                       implementation="xla_blocked"))
  if compiled:
    impls["pallas"] = jax.jit(pk.decode_attention)
  if on_gpu and shape.head_dim == shape.v_dim:
    from jax.experimental.pallas.ops.gpu import decode_attention as jax_decode

    def jax_gqa(q, k, v, lengths):  # k, v: [B, S, K, H], its own layout
      return jax_decode.gqa(q, k, v, kv_seq_len=lengths)

    def jax_mqa_vmap(q, k, v, lengths):  # our [B, K, S, H] layout, no transpose
      b, n, h = q.shape
      qg = q.reshape(b, shape.num_kv, n // shape.num_kv, h)
      per_kv = jax.vmap(lambda q, k, v, l: jax_decode.mqa(q, k, v, kv_seq_len=l),
                        in_axes=(1, 1, 1, None), out_axes=1)
      return per_kv(qg, k, v, lengths).reshape(b, n, h)

    impls["jax_gqa"] = (jax.jit(jax_gqa), "bskh")
    impls["jax_mqa_vmap"] = jax.jit(jax_mqa_vmap)
  return impls


def run_shape(shape: Shape, key) -> list[dict]:
  """Times every implementation and both ceilings on one shape, interleaved."""
  args = _inputs(shape, key)
  lengths = np.asarray(args[-1])
  kv_bytes = shape.kv_bytes(lengths)
  ceiling_timers = _ceiling_timers(kv_bytes)
  timers, outs, rows = {}, {}, []
  for name, impl in implementations(shape).items():
    if FLAGS.impls and name not in FLAGS.impls:
      continue
    fn, call_args = impl, args
    if isinstance(impl, tuple):  # JAX's gqa takes [B, S, K, H] (made outside the timing)
      fn = impl[0]
      call_args = (args[0], jnp.swapaxes(args[1], 1, 2), jnp.swapaxes(args[2], 1, 2), args[3])
    timer = _timer(fn, *call_args)
    try:
      outs[name] = np.asarray(timer.warm(), np.float32)
    except Exception as e:  # pylint: disable=broad-except
      rows.append({"shape": shape.name, "impl": name, "error": f"{type(e).__name__}: {e}"[:300]})
      print(json.dumps(rows[-1]), flush=True)
      continue
    timers[name] = timer
  for timer, _ in ceiling_timers.values():
    timer.warm()
  # Round-robin: every timer sees the same background load.
  timing.round_robin([t for t, _ in ceiling_timers.values()] + list(timers.values()),
                     FLAGS.repeats)
  ceil = {name: moved / timer.median() / 1e9 for name, (timer, moved) in ceiling_timers.items()}
  ceiling = max(ceil.values())
  reference = outs.get("xla", outs.get("jnp_reference"))
  for name, timer in timers.items():
    seconds = timer.median()
    row = {
        "shape": shape.name, "impl": name, **dataclasses.asdict(shape),
        "length": int(lengths[0]), "kv_bytes": kv_bytes, "ms": seconds * 1e3,
        "gbps": kv_bytes / seconds / 1e9, "of_ceiling": kv_bytes / seconds / 1e9 / ceiling,
        "ceiling_gbps": ceiling, **ceil,
        "max_abs_diff_vs_xla": (None if reference is None
                                else float(np.max(np.abs(outs[name] - reference)))),
        "backend": jax.default_backend(), "device": jax.devices()[0].device_kind,
    }
    rows.append(row)
    print(json.dumps(row), flush=True)
  return rows


def table(rows: list[dict]) -> str:
  """The markdown table of the measured rows."""
  lines = ["| shape | B | N | K | S | L | dtype | impl | K/V MiB | ms | GB/s | copy GB/s | "
           "read GB/s | of ceiling | max diff vs xla |",
           "|---|---:|---:|---:|---:|---:|---|---|---:|---:|---:|---:|---:|---:|---:|"]
  for r in rows:
    if "error" in r:
      lines.append(f"| {r['shape']} | | | | | | | {r['impl']} | error: {r['error'][:80]} "
                   "| | | | | | |")
      continue
    diff = "" if r["max_abs_diff_vs_xla"] is None else f"{r['max_abs_diff_vs_xla']:.1e}"
    kv = r["num_kv"] if r["kind"] == "dense" else "MLA"
    lines.append(
        f"| {r['shape']} | {r['batch']} | {r['num_heads']} | {kv} | {r['capacity']} | "
        f"{r['length']} | {r['dtype']} | {r['impl']} | {r['kv_bytes'] / 2**20:.0f} | "
        f"{r['ms']:.3f} | {r['gbps']:.1f} | {r['copy_gbps']:.1f} | {r['read_gbps']:.1f} | "
        f"{r['of_ceiling']:.2f} | {diff} |")
  return "\n".join(lines)


def tune(shape: Shape, key) -> str:
  """Times the compiled kernel over a small grid of tunables on one shape.

  Dense shapes sweep block_k x num_splits x num_warps; MLA shapes (wide values,
  many heads on one KV head) sweep block_k x block_g at 8 warps. One JSON line
  per configuration (key "tune"), then a markdown table.
  """
  args = _inputs(shape, key)
  kv_bytes = shape.kv_bytes(np.asarray(args[-1]))
  ceiling = max(ceilings(kv_bytes).values())
  if shape.kind == "dense":
    fn = pk.decode_attention
    grid = [dict(block_k=bk, num_splits=ns, num_warps=nw)
            for bk, ns, nw in itertools.product((64, 128), (None, 16), (4, 8))]
  else:
    fn = functools.partial(pk.mla_decode_attention, sm_scale=0.1)
    grid = [dict(block_k=bk, block_g=bg, num_warps=8)
            for bk, bg in itertools.product((32, 64), (16, 32, 64))]
  lines = [f"Tuning {shape.name} (K/V {kv_bytes / 2**20:.0f} MiB, ceiling {ceiling:.0f} GB/s)",
           "| config | ms | GB/s | of ceiling |", "|---|---:|---:|---:|"]
  for config in grid:
    record = {"tune": shape.name, **config, "ceiling_gbps": ceiling}
    try:
      seconds = _time(jax.jit(functools.partial(fn, **config)), *args)
      record.update(ms=seconds * 1e3, gbps=kv_bytes / seconds / 1e9,
                    of_ceiling=kv_bytes / seconds / 1e9 / ceiling)
      lines.append(f"| {config} | {record['ms']:.3f} | {record['gbps']:.0f} | "
                   f"{record['of_ceiling']:.2f} |")
    except Exception as e:  # pylint: disable=broad-except
      record["error"] = f"{type(e).__name__}: {e}"[:300]
      lines.append(f"| {config} | error: {record['error'][:80]} | | |")
    print(json.dumps(record), flush=True)
  return "\n".join(lines)


SWEEP_SHAPES = {  # capacity is set per point
    "gqa": Shape("gqa", "dense", 4, 8, 0, "float32", num_kv=2, head_dim=64, v_dim=64),
    "int8": Shape("int8", "dense", 4, 8, 0, "int8", num_kv=2, head_dim=64, v_dim=64),
    "mla": Shape("mla", "mla", 4, 16, 0, "float32", head_dim=512, v_dim=64),
}


def _sweep_args(shape: Shape, capacity: int, length: int, key):
  """Inputs of the default path at one sweep point (int8: quantized K/V and scales)."""
  ks = jax.random.split(key, 4)
  lengths = jnp.full((shape.batch,), length, jnp.int32)
  if shape.kind == "mla":
    c, r = shape.head_dim, shape.v_dim
    return (jax.random.normal(ks[0], (shape.batch, shape.num_heads, c)) * 0.05,
            jax.random.normal(ks[1], (shape.batch, shape.num_heads, r)) * 0.05,
            jax.random.normal(ks[2], (shape.batch, capacity, c)),
            jax.random.normal(ks[3], (shape.batch, capacity, r)), lengths), {}
  q = jax.random.normal(ks[0], (shape.batch, shape.num_heads, shape.head_dim))
  k = jax.random.normal(ks[1], (shape.batch, shape.num_kv, capacity, shape.head_dim))
  v = jax.random.normal(ks[2], (shape.batch, shape.num_kv, capacity, shape.v_dim))
  if shape.dtype == "int8":
    (k, k_scale), (v, v_scale) = (kvattn_ops.quantize_kv(x, jnp.int8) for x in (k, v))
    return (q, k, v, lengths), {"k_scale": k_scale, "v_scale": v_scale}
  return (q, k, v, lengths), {}


def sweep() -> list[dict]:
  """Step time of the default decode path vs capacity at fixed live lengths (`--sweep`)."""
  if kvattn_ops is None:
    raise SystemExit("--sweep needs kvattn")
  rows = []
  for kind in FLAGS.sweep_kinds:
    shape = SWEEP_SHAPES[kind]
    op = kvattn_ops.mla_decode_attention if shape.kind == "mla" else kvattn_ops.decode_attention
    kw = {"sm_scale": (128 + 64) ** -0.5} if shape.kind == "mla" else {}
    for length in FLAGS.sweep_lengths:
      capacities = sorted({length} | {c for c in FLAGS.sweep_capacities if c >= length})
      timers = {}
      for i, capacity in enumerate(capacities):
        args, scales = _sweep_args(shape, capacity, length, jax.random.key(i))
        fn = jax.jit(functools.partial(op, **kw, **scales))
        timers[capacity] = _timer(fn, *args)
        if capacity == capacities[-1] and capacity > length:
          plain = jax.jit(functools.partial(op, **kw, **scales, implementation="xla"))
          timers["xla"] = _timer(plain, *args)
      for timer in timers.values():
        timer.warm()
      timing.round_robin(list(timers.values()), FLAGS.repeats)
      fitted = timers[length].median()
      for capacity, timer in timers.items():
        row = {"sweep": kind, "length": length,
               "capacity": capacities[-1] if capacity == "xla" else capacity,
               "impl": "xla" if capacity == "xla" else "default",
               "ms": timer.median() * 1e3, "ratio_to_fitted": timer.median() / fitted}
        rows.append(row)
        print(json.dumps(row), flush=True)
  return rows


def sweep_table(rows: list[dict]) -> str:
  """Markdown: one row per (kind, length), step ms and ratio to the fitted cache per capacity."""
  capacities = sorted({r["capacity"] for r in rows if r["impl"] == "default"})
  lines = ["| cache | L | " + " | ".join(f"S={c}" for c in capacities) + " | xla at max S |",
           "|---|---:|" + "---:|" * (len(capacities) + 1)]
  for kind in dict.fromkeys(r["sweep"] for r in rows):
    for length in dict.fromkeys(r["length"] for r in rows if r["sweep"] == kind):
      cells = {r["capacity"]: r for r in rows if r["sweep"] == kind and r["length"] == length
               and r["impl"] == "default"}
      xla = [r for r in rows if r["sweep"] == kind and r["length"] == length
             and r["impl"] == "xla"]
      line = f"| {kind} | {length} | " + " | ".join(
          f"{cells[c]['ms']:.3f} ({cells[c]['ratio_to_fitted']:.2f}x)" if c in cells else ""
          for c in capacities)
      line += f" | {xla[0]['ms']:.3f} ({xla[0]['ratio_to_fitted']:.1f}x) |" if xla else " |"
      lines.append(line)
  return "\n".join(lines)


def main(argv=None):
  """Command-line entry point (`python -m experiments.benchmarks.decode --help`)."""
  global FLAGS
  FLAGS = _parser().parse_args(argv)
  preset = FLAGS.preset or ("gpu" if jax.default_backend() != "cpu" else "cpu")
  print(json.dumps({"preset": preset, "backend": jax.default_backend(),
                    "device": jax.devices()[0].device_kind, "jax": jax.__version__,
                    "kvattn": kvattn_ops is not None}), flush=True)
  if FLAGS.sweep:
    text = sweep_table(sweep())
    print(text)
    if FLAGS.out:
      with open(FLAGS.out, "w") as f:
        f.write(text + "\n")
    return
  rows = []
  for i, shape in enumerate(PRESETS[preset]):
    rows += run_shape(shape, jax.random.key(i))
  text = table(rows)
  if FLAGS.tune and jax.default_backend() != "cpu":
    first_dense = next(s for s in PRESETS[preset] if s.kind == "dense")
    first_mla = next((s for s in PRESETS[preset] if s.kind == "mla"), None)
    for shape in (first_dense, first_mla):
      if shape is not None:
        text += "\n\n" + tune(shape, jax.random.key(99))
  print(text)
  if FLAGS.out:
    with open(FLAGS.out, "w") as f:
      f.write(text + "\n")


if __name__ == "__main__":
  cli.run_plain(main)
