r"""Sharded KV caches on a device mesh: bytes per device, communication, decode step time.

    python -m experiments.benchmarks.sharding            # context 4096, 1..8 devices
    python -m experiments.benchmarks.sharding --smoke    # context 640, three meshes
    python -m experiments.benchmarks.sharding --processes=2   # + 2 processes x 4 devices

Prints one JSON line per (mesh, cache kind): `mesh` (data, model, seq sizes),
`cache_kind` (dense, paged, mla), `context` (tokens held per sequence),
`total_cache_bytes` (all layers, global arrays), `per_device_cache_bytes` (the most any
device holds, read from the arrays' `addressable_shards`), `max_abs_diff_vs_single_device`
(decode-step logits against the same caches on one device), `tokens_equal_single_device`
(greedy tokens of `--steps` decode steps), `decode_step_ms` (median wall time of one
jitted decode step), `collective_bytes_per_step` (bytes the step's collectives produce
per device, summed from the compiled HLO: all-reduce, all-gather, reduce-scatter,
all-to-all, collective-permute) and `cache_all_gathers` (collectives with a
cache-sized dimension: 0 means the cache never moves).

On CPU it sets up 8 simulated devices itself (`--xla_force_host_platform_device_count=8`
before JAX starts); they share the machine's cores, so bytes and communication volume
are the scaling evidence and step times only a sanity check. On an accelerator host the
meshes use the devices it has.

`--processes=P` (P > 1, CPU) first runs the meshes of all 8 devices in this one process, then
again as P processes on localhost with `8 / P` devices each (`jax.distributed.initialize`, CPU
collectives over gloo, one global mesh), alternating the two `--rounds` times; every row
carries `processes`. The multi-process rows compare against the same one-device reference, so
`tokens_equal_single_device` checks them too. Each process computes the step; process 0
prints.
"""

from __future__ import annotations

import os

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + " --xla_force_host_platform_device_count=8")

# pylint: disable=g-import-not-at-top,wrong-import-position
import argparse
import functools
import json
import math
import re
import socket
import statistics
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from experiments.framework import cli
from kvattn import _multihost
from kvattn.caches import dense as cache_lib
from kvattn.caches import paged as paged_lib
from kvattn import sharding
from kvattn.caches import sharded
from kvattn.models import transformer

BATCH, PAGE_SIZE, HEADROOM = 8, 16, 16
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "pred": 1, "s8": 1, "u8": 1,
          "f64": 8, "s64": 8}


def model_fn(kind: str):
  """A one-layer model constructor: GQA N = K = 8, H = 64, or MLA C = 256, R = 32."""
  if kind == "mla":
    attention = dict(kind="mla", num_heads=8, kv_lora_rank=256, qk_nope_head_dim=64,
                     qk_rope_head_dim=32, v_head_dim=64)
  else:
    attention = dict(num_heads=8, num_kv_heads=8, head_dim=64)
  cfg = transformer.model_config(d_model=384, num_layers=1, mlp_dim=768, attention=attention)
  return lambda: transformer.Transformer.from_config(cfg, rngs=nnx.Rngs(0))


def filled_caches(model, kind: str, context: int, layout_mesh) -> tuple:
  """Plain one-device caches with random contents and `context - HEADROOM` tokens per row
  (pages laid out as `sharded.init_caches` lays them out on `layout_mesh`)."""
  capacity = context
  keys = iter(jax.random.split(jax.random.key(3), 8))
  lengths = jnp.full((BATCH,), context - HEADROOM, jnp.int32)
  out = []
  for layer in model.layers:
    a = layer.attn
    if kind == "mla":
      out.append(cache_lib.LatentCache(
          c_kv=jax.random.normal(next(keys), (BATCH, capacity, a.kv_lora_rank)),
          k_rope=jax.random.normal(next(keys), (BATCH, capacity, a.qk_rope_head_dim)),
          lengths=lengths))
    elif kind == "dense":
      shape = (BATCH, a.num_kv_heads, capacity, a.head_dim)
      out.append(cache_lib.KVCache(k=jax.random.normal(next(keys), shape),
                                   v=jax.random.normal(next(keys), shape), lengths=lengths))
    else:
      pps = capacity // PAGE_SIZE
      lay = sharded.cache_layout(layout_mesh, None, kind="paged", batch=BATCH,
                                  max_len=capacity, num_kv_heads=a.num_kv_heads,
                                  num_pages=BATCH * pps)
      tables = jnp.asarray(sharded.sharded_block_tables(BATCH, pps, layout_mesh, lay))
      shape = (a.num_kv_heads, BATCH * pps, PAGE_SIZE, a.head_dim)
      out.append(paged_lib.PagedKVCache(
          k_pages=jax.random.normal(next(keys), shape),
          v_pages=jax.random.normal(next(keys), shape), block_tables=tables, lengths=lengths))
  return tuple(out)


@functools.partial(jax.jit, static_argnums=0)
def _step(graphdef, state, tokens, caches):
  logits, caches = nnx.merge(graphdef, state)(tokens[:, None], caches)
  return logits[:, 0], caches


def greedy(model, caches, steps: int):
  """`(first-step logits, i32[B, steps] greedy tokens)` of `steps` decode steps."""
  graphdef, state = nnx.split(model)
  tokens = np.zeros((BATCH,), np.int32)  # numpy: a replicated input on any mesh
  out, first = [], None
  for _ in range(steps):
    logits, caches = _step(graphdef, state, tokens, caches)
    first = logits if first is None else first
    tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    out.append(tokens)
  return first, jnp.stack(out, axis=1)


def collectives(hlo: str, cache_dims: set[int]) -> tuple[int, dict[str, int], int]:
  """`(bytes, {op: count}, cache-sized collectives)` of the collectives in `hlo`
  (result shapes, per device; async start/done pairs counted once)."""
  total, counts, cache_moves = 0, {}, 0
  for line in hlo.splitlines():
    op = next((c for c in COLLECTIVES if f" {c}(" in line or f" {c}-start(" in line), None)
    if op is None:
      continue
    counts[op] = counts.get(op, 0) + 1
    result = line.split("=", 1)[1].split(op, 1)[0]
    for dtype, dims in re.findall(r"(\w+)\[([\d,]*)\]", result):
      shape = [int(d) for d in dims.split(",") if d]
      total += _BYTES.get(dtype, 4) * math.prod(shape)
      cache_moves += bool(cache_dims & set(shape))
  return total, counts, cache_moves


def measure(mesh_shape, kind: str, context: int, steps: int, repeats: int) -> dict:
  """One JSON row of the benchmark: a one-layer `kind` model ("dense", "paged", "mla") on a
  mesh of `mesh_shape` `(data, model, seq)`, caches holding `context` tokens, against the
  same model on one device: total and per-device cache bytes (addressable shards), the
  compiled decode step's collectives and their bytes, cache all-gathers (0 expected), max
  abs logit difference and greedy-token equality over `steps` steps, and the median decode
  step time in ms of `repeats` runs (a sanity check only on simulated devices)."""
  make = model_fn(kind)
  mesh = sharding.make_mesh(mesh_shape)
  with jax.default_device(jax.local_devices()[0]):
    plain_model = make()
    plain = filled_caches(plain_model, kind, context, mesh)
    ref = greedy(plain_model, plain, steps)  # same shapes for every mesh: compiled once
  model = sharding.shard_model(make, mesh)
  caches = sharded.place_caches(plain, mesh)
  logits, tokens = (_multihost.host_array(x) for x in greedy(model, caches, steps))
  arrays = [a for c in caches for a in c.storage_arrays()]
  per_device = sharding.per_device_bytes(arrays)
  graphdef, state = nnx.split(model)
  first = np.zeros((BATCH,), np.int32)
  hlo = _step.lower(graphdef, state, first, caches).compile().as_text()
  # Dimensions only a cache has: S and the pages of a pool. Both must differ from every model
  # dimension (D = 384, F = 768, C = 256, ...), or e.g. the all-reduce of [B, 1, D] counts.
  comm, counts, cache_moves = collectives(hlo, {context, BATCH * context // PAGE_SIZE})
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(_step(graphdef, state, first, caches))
    times.append(time.perf_counter() - t0)
  return dict(
      mesh=list(mesh_shape), devices=math.prod(mesh_shape), cache_kind=kind, context=context,
      total_cache_bytes=sum(a.nbytes for a in arrays),
      per_device_cache_bytes=max(per_device.values()),
      max_abs_diff_vs_single_device=float(np.max(np.abs(logits - np.asarray(ref[0])))),
      tokens_equal_single_device=bool(np.array_equal(tokens, np.asarray(ref[1]))),
      decode_step_ms=round(1e3 * statistics.median(times), 3),
      collective_bytes_per_step=comm, collectives=counts, cache_all_gathers=cache_moves,
      platform=jax.devices()[0].platform, processes=jax.process_count())


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def _run_processes(num_processes: int, argv: list[str]) -> list[str]:
  """Runs this benchmark as `num_processes` processes on localhost (`8 / num_processes` CPU
  devices each, one `jax.distributed` run); returns process 0's JSON lines.

  Raises:
    RuntimeError: a process that failed, with the end of its stderr.
  """
  port = _free_port()
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=(
      os.environ.get("XLA_FLAGS", "").replace("--xla_force_host_platform_device_count=8", "")
      + f" --xla_force_host_platform_device_count={8 // num_processes}"))
  procs = [subprocess.Popen(
      [sys.executable, "-m", "experiments.benchmarks.sharding", *argv,
       f"--coordinator=localhost:{port}", f"--num_processes={num_processes}",
       f"--process_id={i}"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
      text=True) for i in range(num_processes)]
  outs = [p.communicate() for p in procs]
  for i, (p, (_, err)) in enumerate(zip(procs, outs)):
    if p.returncode:
      raise RuntimeError(f"process {i} of {num_processes} exited with {p.returncode}:\n"
                         f"{err[-3000:]}")
  return [line for line in outs[0][0].splitlines() if line.startswith("{")]


def main(argv=None):
  """Prints one JSON line per (cache kind, mesh) (module doc); `argv` without the program."""
  argv = list(sys.argv[1:] if argv is None else argv)
  parser = cli.ArgumentParser(description=__doc__.split("\n", 1)[0])
  parser.add_argument("--smoke", action="store_true", help="context 640, three meshes")
  parser.add_argument("--context", type=int, default=None, help="tokens per sequence")
  parser.add_argument("--steps", type=int, default=4, help="greedy decode steps compared")
  parser.add_argument("--repeats", type=int, default=3, help="timed decode steps")
  parser.add_argument("--processes", type=int, default=1,
                      help="> 1: the 8-device meshes also as this many processes (module doc)")
  parser.add_argument("--rounds", type=int, default=2,
                      help="with --processes: alternations of one process and several")
  # One process of a --processes run (set by _run_processes).
  parser.add_argument("--coordinator", default=None, help=argparse.SUPPRESS)
  parser.add_argument("--num_processes", type=int, default=1, help=argparse.SUPPRESS)
  parser.add_argument("--process_id", type=int, default=0, help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.processes < 1 or 8 % args.processes:
    raise cli.UserError(f"--processes must divide 8 (1, 2, 4 or 8); got {args.processes}")
  if args.rounds < 1:
    raise cli.UserError(f"--rounds must be >= 1; got {args.rounds}")
  if args.coordinator:  # one process of a multi-process run
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(args.coordinator, args.num_processes, args.process_id,
                               initialization_timeout=120)
  n = jax.device_count()
  if args.smoke:
    meshes = [(1, 1, 1), (2, 2, 2), (1, 1, 8)]
  else:  # 1, 2, 4, 8 devices along each axis, then a mixed mesh
    meshes = [(1, 1, 1)] + [s for k in (2, 4, 8) for s in ((k, 1, 1), (1, k, 1), (1, 1, k))]
    meshes.append((2, 2, 2))
  if args.coordinator or args.processes > 1:  # every process must hold part of the mesh
    meshes = [m for m in meshes if math.prod(m) == 8]
  meshes = [m for m in meshes if math.prod(m) <= n]
  context = args.context or (640 if args.smoke else 4096)  # 384 would equal D (see measure)

  def rows():
    for kind in ("dense", "paged", "mla"):
      for mesh_shape in meshes:
        yield json.dumps(measure(mesh_shape, kind, context, args.steps,
                                 2 if args.smoke else args.repeats))

  if args.processes == 1:
    for row in rows():
      if jax.process_index() == 0:
        print(row, flush=True)
    return 0
  passed = [f"--context={context}", f"--steps={args.steps}", f"--repeats={args.repeats}"]
  passed += ["--smoke"] if args.smoke else []
  for _ in range(args.rounds):  # alternate: one process of 8 devices, then P processes
    for row in rows():
      print(row, flush=True)
    for row in _run_processes(args.processes, passed):
      print(row, flush=True)
  return 0


if __name__ == "__main__":
  cli.run_plain(main)
