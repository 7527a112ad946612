"""Decode attention over quantized caches: time per step of each path and cache dtype.

    python -m experiments.benchmarks.quant_decode                 # CPU shapes
    python -m experiments.benchmarks.quant_decode --repeats=30 --out=/tmp/quant_decode.md

For each shape (B, N, K, H, S; every sequence at length S) and cache dtype
(f32, bf16, int8, fp8 e4m3; the 1-byte ones with `f32[B, K, S]` scales from
`kvattn.ops.quantize_kv`) it times `kvattn.ops.decode_attention` with
`implementation="xla"` (scales on logits/probabilities; XLA converts the
1-byte cache for its dots), `"xla_blocked"` (blocks converted and scaled one
at a time) and `None` (what the dispatcher picks), each jitted, inputs made
outside the timing. Samples of all (dtype, path) pairs of a shape are taken
round-robin, so background load hits them alike; each sample runs `--calls`
back-to-back calls. Reports the median microseconds per call, the ratio to
the f32 cache's plain XLA path of the same shape (measured in the same run),
the cache bytes read per call (values + scales) and, for `None`, which path
the dispatcher took.
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp

from experiments.framework import cli
from experiments.framework import timing
from kvattn import ops
from kvattn.ops import dispatch, quant

SHAPES = (  # (B, N, K, H, S)
    (4, 8, 8, 16, 512),  # the quant sweep's MHA decode (configs/quant_sweep.py)
    (4, 8, 2, 16, 4096),
    (4, 8, 8, 64, 1024),
    (4, 8, 8, 128, 2048),
    (1, 8, 1, 128, 32768),
)
DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16, "int8": jnp.int8,
          "fp8-e4m3": jnp.float8_e4m3fn}
IMPLS = ("xla", "xla_blocked", None)


def _parser() -> argparse.ArgumentParser:
  p = cli.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--repeats", type=int, default=15, help="timed samples per (dtype, path)")
  p.add_argument("--calls", type=int, default=5, help="back-to-back calls per sample")
  p.add_argument("--out", default=None, help="also write the markdown table here")
  return p


def _picked(q, k, v, lengths, scales) -> str:
  """The backend `implementation=None` runs for these inputs (the dispatcher's first fit)."""
  for name in dispatch.available_implementations("decode_attention"):
    fn = dispatch.IMPLEMENTATIONS["decode_attention"][name]
    try:
      jax.eval_shape(lambda *a: fn(*a, explicit=False, **scales), q, k, v, lengths)
      return name
    except NotImplementedError:
      continue
  return "none"


def run(args) -> list[dict]:
  """Times decode for every cache dtype; returns the rows."""
  rows = []
  for b, n, kh, h, s in SHAPES:
    key = jax.random.key(0)
    q = jax.random.normal(key, (b, n, h))
    k = jax.random.normal(jax.random.fold_in(key, 1), (b, kh, s, h))
    v = jax.random.normal(jax.random.fold_in(key, 2), (b, kh, s, h))
    lengths = jnp.full((b,), s, jnp.int32)
    timers = {}
    for name, dtype in DTYPES.items():
      if quant.is_quantized(dtype):
        (kq, ks), (vq, vs) = ops.quantize_kv(k, dtype), ops.quantize_kv(v, dtype)
        scales = {"k_scale": ks, "v_scale": vs}
      else:
        kq, vq, scales = k.astype(dtype), v.astype(dtype), {}
      for impl in IMPLS:
        fn = jax.jit(lambda q, k, v, l, sc, impl=impl: ops.decode_attention(
            q, k, v, l, implementation=impl, **sc))
        timer = timing.Timer(fn, q, kq, vq, lengths, scales, calls=args.calls)
        timer.warm()  # compiles
        timers[(name, impl)] = (timer,
                                _picked(q, kq, vq, lengths, scales) if impl is None else impl,
                                int(sum(x.nbytes for x in (kq, vq, *scales.values()))))
    timing.round_robin([t for t, _, _ in timers.values()], args.repeats)
    base = timers[("f32", "xla")][0].median()
    for (name, impl), (timer, picked, nbytes) in timers.items():
      us = 1e6 * timer.median()
      row = {"B": b, "N": n, "K": kh, "H": h, "S": s, "cache": name,
             "implementation": "auto" if impl is None else impl, "runs": picked,
             "cache_bytes": nbytes, "us_per_call": us, "vs_f32_xla": base * 1e6 / us}
      print(json.dumps(row))
      rows.append(row)
  return rows


def table(rows: list[dict]) -> str:
  """The markdown table of the measured rows."""
  lines = ["| B | N | K | H | S | cache | path | ran | cache MiB | µs/call | speed vs f32 xla |",
           "|---:|---:|---:|---:|---:|---|---|---|---:|---:|---:|"]
  for r in rows:
    lines.append(f"| {r['B']} | {r['N']} | {r['K']} | {r['H']} | {r['S']} | {r['cache']} | "
                 f"{r['implementation']} | {r['runs']} | {r['cache_bytes'] / 2**20:.2f} | "
                 f"{r['us_per_call']:,.0f} | {r['vs_f32_xla']:.2f}× |")
  return "\n".join(lines)


def main(argv=None):
  """Command-line entry point (`--help` lists the flags)."""
  args = _parser().parse_args(argv)
  cli.print_and_save(table(run(args)), args.out)


if __name__ == "__main__":
  cli.run_plain(main)
