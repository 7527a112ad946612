"""What cross-layer KV sharing's sharing layer costs in a compiled step, per cache kind.

    JAX_DISABLE_MOST_OPTIMIZATIONS=0 python -m experiments.benchmarks.cla_step
    python -m experiments.benchmarks.cla_step --batch=2 --length=256 --window=32 --tokens=1

For kinds with a step of their own (ring, sinks, eviction, the low-bit kinds) a layer reading
its owner's cache (`kv_source`) runs that step again on the owner's cache before its write, with
the owner's keys and its own queries, and drops the cache it returns (docs/caches.md, "Cross-
layer KV sharing"). This compiles one step of `--tokens` tokens (1: decode; more: a prefill
chunk) of a small random model (4 layers, MQA with head_dim 256, as Gemma 3) with and without
sharing (`cla_factor` 2) for each kind, and reads from the compiled program (XLA's own numbers,
nothing timed): the cache bytes, `memory_analysis().temp_size_in_bytes` (buffers besides the
arguments and outputs), and the scatters and sorts in the optimized HLO. If the dropped write
survived compilation, the sharing model would hold as many scatters (sorts for H2O) as the
model without sharing, not half; a second copy of a cache would show in the temp bytes.

Kinds: "ring-layout" (local, local, global, global layers with `--window`; the locals get
`RingKVCache`s, `local_layers="ring"`), and over four global layers "sink", "h2o", "kivi4"
(budgets of half the length). Prints one markdown row per (kind, sharing).
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
from flax import nnx

from experiments.framework import cli
import kvattn
from kvattn import memory
from kvattn.caches import registry
from kvattn.models import transformer

KINDS = ("ring-layout", "sink", "h2o", "kivi4")


def _model(kind: str, window: int, factor: int | None):
  local = {"window": window, "rope_theta": 10000.0}
  cfg = dict(vocab_size=256, d_model=64, num_layers=4, mlp_dim=128, mlp_activation="gelu_tanh",
             attention=dict(num_heads=4, num_kv_heads=1, head_dim=256), cla_factor=factor)
  if kind == "ring-layout":
    cfg["layers"] = (local, local, {"rope_theta": 1e6}, {"rope_theta": 1e6})
  return kvattn.Transformer.from_config(transformer.model_config(**cfg), rngs=nnx.Rngs(0))


def _caches(model, kind: str, batch: int, length: int):
  half = length // 2
  if kind == "ring-layout":
    return model.init_caches(batch, length, local_layers="ring")
  spec = {"sink": {"kind": "sink", "num_sinks": 4, "window": half - 4},
          "h2o": {"kind": "h2o", "budget": half}, "kivi4": {"kind": "kivi4"}}[kind]
  return registry.build_caches(model, batch, length, None, spec)


def measure(kind: str, factor: int | None, *, batch: int, length: int, window: int,
            tokens: int) -> dict:
  """The compiled step's numbers (module docstring) for one kind and sharing factor."""
  model = _model(kind, window, factor)
  caches = _caches(model, kind, batch, length)
  graphdef, state = nnx.split(model)

  def step(state, ids, caches):
    return nnx.merge(graphdef, state).hidden(ids, caches,
                                             new_lengths=jnp.full((batch,), tokens, jnp.int32))

  compiled = jax.jit(step, donate_argnums=(2,)).lower(
      state, jnp.zeros((batch, tokens), jnp.int32), caches).compile()
  hlo = compiled.as_text()
  return {"kind": kind, "cla_factor": factor or 1, "tokens": tokens,
          "cache_mib": memory.tree_bytes(caches) / 2**20,
          "temp_mib": compiled.memory_analysis().temp_size_in_bytes / 2**20,
          "scatters": hlo.count(" scatter("), "sorts": hlo.count(" sort(")}


def run(argv=None) -> list[dict]:
  """The measurement (module doc); returns what it printed."""
  parser = cli.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--batch", type=int, default=8)
  parser.add_argument("--length", type=int, default=2048, help="cache capacity in tokens")
  parser.add_argument("--window", type=int, default=512, help="local layers' window")
  parser.add_argument("--tokens", default="1,64", help="step widths, comma-separated")
  parser.add_argument("--kinds", default=",".join(KINDS))
  args = parser.parse_args(argv)
  rows = []
  print(f"backend {jax.default_backend()}, JAX_DISABLE_MOST_OPTIMIZATIONS="
        f"{os.environ.get('JAX_DISABLE_MOST_OPTIMIZATIONS', '0')}")
  print("| kind | T | cla_factor | cache MiB | temp MiB | scatters | sorts |")
  print("|---|---|---|---|---|---|---|")
  for t in (int(x) for x in args.tokens.split(",")):
    for kind in args.kinds.split(","):
      for factor in (None, 2):
        r = measure(kind, factor, batch=args.batch, length=args.length, window=args.window,
                    tokens=t)
        rows.append(r)
        print(f"| {kind} | {t} | {r['cla_factor']} | {r['cache_mib']:.1f} | "
              f"{r['temp_mib']:.2f} | {r['scatters']} | {r['sorts']} |", flush=True)
  return rows


def main(argv=None) -> None:
  """Prints the compiled steps' table (module doc); `argv` as `run`'s."""
  run(argv)


if __name__ == "__main__":
  cli.run_plain(main)
