"""Decode-attention bandwidth: XLA path vs the Pallas kernel vs JAX's GPU kernel.

    python -m experiments.bench_decode                      # CPU preset
    python -m experiments.bench_decode --preset=gpu         # on a GPU
    python -m experiments.bench_decode --preset=gpu_quick --out=/tmp/bench.md

Decode attention is memory-bound: each step reads the attended K/V slots once
and does O(G) flops per byte. For every shape the script reports

  kv_bytes        bytes of K/V that must be read: sum over b of the attended
                  slots (lengths[b], or the window) x K x (H + Hv) x itemsize
                  (MLA: slots x (C + R) x itemsize, c_kv serving as key and value)
  ms              median wall time of one call, milliseconds (each timing runs
                  `--calls` back-to-back calls and divides, so per-call Python
                  dispatch overlaps device work as in a decode loop)
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
MLA shapes time `kvattn.ops.mla_decode_attention` ("xla") and
`pallas_kernels.mla_decode_attention` ("pallas").

Prints one JSON line per (shape, implementation), then a markdown table; with
`--out` the table is also written there. `max_abs_diff_vs_xla` checks that the
timed implementations agree with the XLA path on the timed inputs.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

import kvattn.ops
import pallas_kernels.decode_attention as pk

FLAGS = flags.FLAGS
flags.DEFINE_enum("preset", None, ["cpu", "gpu", "gpu_quick"],
                  "Shape list; default: 'gpu' on GPU/TPU, 'cpu' otherwise.")
flags.DEFINE_float("length_fraction", 1.0,
                   "Each sequence's length as a fraction of S (the kernel reads only that).")
flags.DEFINE_list("impls", None, "Subset of implementations to time (default: all that run).")
flags.DEFINE_integer("warmup", 2, "Untimed calls per implementation (the first compiles).")
flags.DEFINE_integer("repeats", 5, "Timings per implementation; the median is reported.")
flags.DEFINE_integer("calls", 0, "Calls per timing (0: about 50 ms worth, at least 1).")
flags.DEFINE_string("out", None, "Also write the markdown table to this file.")


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


def _time(fn, *args) -> float:
  """Median seconds per call of jitted `fn(*args)`."""
  for _ in range(FLAGS.warmup):
    jax.block_until_ready(fn(*args))
  calls = FLAGS.calls
  if calls <= 0:
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    calls = max(1, min(200, int(0.05 / max(time.perf_counter() - start, 1e-6))))
  samples = []
  for _ in range(FLAGS.repeats):
    start = time.perf_counter()
    out = None
    for _ in range(calls):
      out = fn(*args)
    jax.block_until_ready(out)
    samples.append((time.perf_counter() - start) / calls)
  return statistics.median(samples)


def ceilings(num_bytes: int) -> dict[str, float]:
  """Copy and read bandwidth (GB/s) on an array of `num_bytes` bytes, this run."""
  x = jnp.ones((max(num_bytes // 4, 1),), jnp.float32)
  copy = _time(jax.jit(lambda x: -x), x)
  read = _time(jax.jit(lambda x: jnp.sum(x)), x)
  return {"copy_gbps": 2 * x.nbytes / copy / 1e9, "read_gbps": x.nbytes / read / 1e9}


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
    impls["xla"] = jax.jit(functools.partial(kvattn.ops.mla_decode_attention, sm_scale=scale,
                                             implementation="xla"))
    if not compiled:
      impls["xla_blocked"] = jax.jit(functools.partial(
          kvattn.ops.mla_decode_attention, sm_scale=scale, implementation="xla_blocked"))
    if compiled:
      impls["pallas"] = jax.jit(functools.partial(pk.mla_decode_attention, sm_scale=scale))
    return impls
  impls["xla"] = jax.jit(functools.partial(kvattn.ops.decode_attention, implementation="xla"))
  if not compiled:
    impls["xla_blocked"] = jax.jit(functools.partial(kvattn.ops.decode_attention,
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
  args = _inputs(shape, key)
  lengths = np.asarray(args[-1])
  kv_bytes = shape.kv_bytes(lengths)
  ceil = ceilings(kv_bytes)
  ceiling = max(ceil.values())
  rows, reference = [], None
  for name, impl in implementations(shape).items():
    if FLAGS.impls and name not in FLAGS.impls:
      continue
    fn, call_args = impl, args
    if isinstance(impl, tuple):  # JAX's gqa takes [B, S, K, H] (made outside the timing)
      fn = impl[0]
      call_args = (args[0], jnp.swapaxes(args[1], 1, 2), jnp.swapaxes(args[2], 1, 2), args[3])
    try:
      out = jax.block_until_ready(fn(*call_args))
      seconds = _time(fn, *call_args)
    except Exception as e:  # pylint: disable=broad-except
      rows.append({"shape": shape.name, "impl": name, "error": f"{type(e).__name__}: {e}"[:300]})
      print(json.dumps(rows[-1]), flush=True)
      continue
    out = np.asarray(out, np.float32)
    if reference is None and name == "xla":
      reference = out
    row = {
        "shape": shape.name, "impl": name, **dataclasses.asdict(shape),
        "length": int(lengths[0]), "kv_bytes": kv_bytes, "ms": seconds * 1e3,
        "gbps": kv_bytes / seconds / 1e9, "of_ceiling": kv_bytes / seconds / 1e9 / ceiling,
        "ceiling_gbps": ceiling, **ceil,
        "max_abs_diff_vs_xla": (None if reference is None
                                else float(np.max(np.abs(out - reference)))),
        "backend": jax.default_backend(), "device": jax.devices()[0].device_kind,
    }
    rows.append(row)
    print(json.dumps(row), flush=True)
  return rows


def table(rows: list[dict]) -> str:
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


def main(argv):
  del argv
  preset = FLAGS.preset or ("gpu" if jax.default_backend() != "cpu" else "cpu")
  print(json.dumps({"preset": preset, "backend": jax.default_backend(),
                    "device": jax.devices()[0].device_kind, "jax": jax.__version__}), flush=True)
  rows = []
  for i, shape in enumerate(PRESETS[preset]):
    rows += run_shape(shape, jax.random.key(i))
  text = table(rows)
  print(text)
  if FLAGS.out:
    with open(FLAGS.out, "w") as f:
      f.write(text + "\n")


if __name__ == "__main__":
  app.run(main)
