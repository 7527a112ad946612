"""Decode-step time of MLA (absorbed vs naive) and of an MHA layer with the same N, H.

    python -m experiments.benchmarks.mla --batch 4 --seq_lens 512,2048,8192 \\
        --d_model 1024 --num_heads 16 --kv_lora_rank 256 --qk_nope_head_dim 64 \\
        --qk_rope_head_dim 32 --v_head_dim 64

For every cache length S it builds three single attention layers from one seed:
`kvattn.MultiHeadLatentAttention` forced onto the absorbed path (what "auto"
runs for a decode step: attention straight against the latent cache through
`kvattn.ops.mla_decode_attention`), the same layer on the naive path (per-head
keys and values expanded from all S latents every step), and an MHA
`kvattn.GroupedQueryAttention` with `num_kv_heads = num_heads` and `head_dim =
--mha_head_dim` (default `--qk_nope_head_dim`, the H of DeepSeek-V2's MHA
comparison). Each cache holds random contents with `lengths = S - 1`, so the
timed step writes one token at slot S - 1 and attends all S slots.

The step is one `jax.jit` program (projections, cache write, attention, output
projection) with the cache donated, so XLA writes the token in place. After
`--warmup` untimed calls (the first compiles) each step runs `--repeats` times,
the three variants round-robin so that load drifts hit them alike, each call
timed around `block_until_ready`; lengths are reset to S - 1 between calls (a
scalar replace, no cache copy). Prints one JSON line per (S, variant):

  ms_median, ms_min, ms_max   wall time of one decode step, milliseconds
  cache_bytes                 measured bytes of the cache's storage arrays
  cache_bytes_per_token       bytes per token slot per layer (kvattn.memory)
  read_elems_per_token        numbers per cached token the attention consumes:
                              C + R (absorbed), N (Hn + R + Hv) (naive,
                              expanded), 2 N H (MHA)

then one JSON line per S with the ratios measured in that run
(`naive_over_absorbed`, `mha_over_absorbed` of medians; `*_min` of minima),
the analytic cache ratio `(C + R) / (2 N H)` next to the measured one (the
script exits if they differ) and the largest |y_naive - y_absorbed| of the
timed step (both paths must compute the same function), and finally a
markdown table.
The first line records the settings, the backends each dispatch point tries
in order when no implementation is named, and the machine.
"""

from __future__ import annotations

import json
import os
import statistics

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags
from flax import nnx

import kvattn
from experiments.framework import cli
from experiments.framework import results
from experiments.framework import timing
from kvattn import memory

FLAGS = flags.FLAGS
flags.DEFINE_integer("batch", 4, "Sequences per batch B.")
flags.DEFINE_list("seq_lens", ["512", "2048", "8192"], "Cache lengths S (slots attended).")
flags.DEFINE_integer("d_model", 1024, "Model width D.")
flags.DEFINE_integer("num_heads", 16, "Query heads N (MLA and MHA).")
flags.DEFINE_integer("kv_lora_rank", 256, "MLA latent width C.")
flags.DEFINE_integer("qk_nope_head_dim", 64, "MLA no-RoPE query/key head width Hn.")
flags.DEFINE_integer("qk_rope_head_dim", 32, "MLA decoupled RoPE width R.")
flags.DEFINE_integer("v_head_dim", 64, "MLA value head width Hv.")
flags.DEFINE_integer("q_lora_rank", None, "MLA query low rank (None: full-rank query).")
flags.DEFINE_integer("mha_head_dim", None, "MHA head width H (default --qk_nope_head_dim).")
flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"],
                  "Parameter, activation and cache dtype.")
flags.DEFINE_string("decode_implementation", None,
                    "Backend of both dispatch points (kvattn.ops.mla_decode_attention and "
                    "decode_attention); None: the dispatcher's pick.")
flags.DEFINE_string("mha_decode_implementation", None,
                    "Overrides --decode_implementation for the MHA layer.")
flags.DEFINE_integer("warmup", 2, "Untimed calls per variant (the first compiles).")
flags.DEFINE_integer("repeats", 10, "Timed calls per variant; medians are reported.")
flags.DEFINE_integer("seed", 0, "Weights, cache contents and inputs.")

VARIANTS = ("mla_absorbed", "mla_naive", "mha")


def build(variant: str, dtype):
  """The attention module of one benchmark row."""
  rngs = nnx.Rngs(FLAGS.seed)  # one seed: both MLA paths get identical weights
  if variant == "mha":
    return kvattn.GroupedQueryAttention(
        d_model=FLAGS.d_model, num_heads=FLAGS.num_heads, num_kv_heads=FLAGS.num_heads,
        head_dim=FLAGS.mha_head_dim or FLAGS.qk_nope_head_dim, dtype=dtype, param_dtype=dtype,
        decode_implementation=mha_implementation(), rngs=rngs)
  return kvattn.MultiHeadLatentAttention(
      d_model=FLAGS.d_model, num_heads=FLAGS.num_heads, kv_lora_rank=FLAGS.kv_lora_rank,
      qk_nope_head_dim=FLAGS.qk_nope_head_dim, qk_rope_head_dim=FLAGS.qk_rope_head_dim,
      v_head_dim=FLAGS.v_head_dim, q_lora_rank=FLAGS.q_lora_rank,
      path=variant.removeprefix("mla_"), dtype=dtype, param_dtype=dtype,
      decode_implementation=FLAGS.decode_implementation, rngs=rngs)


def mha_implementation() -> str | None:
  """The decode backend the MHA comparison row uses."""
  return FLAGS.mha_decode_implementation or FLAGS.decode_implementation


def filled_cache(layer, seq_len: int, dtype):
  """A cache of S slots with random contents and lengths S - 1 (room for the new token)."""
  batch = FLAGS.batch
  cache = layer.init_cache(batch, seq_len, dtype)
  keys = iter(jax.random.split(jax.random.key(FLAGS.seed + 1), 2))
  # Unit-RMS contents: what RMSNorm'd latents and projected keys/values look like.
  cache = jax.tree_util.tree_map(
      lambda a: jax.random.normal(next(keys), a.shape, a.dtype) if a.ndim == 3 or a.ndim == 4
      else a, cache)
  return cache.replace(lengths=jnp.full((batch,), seq_len - 1, jnp.int32))


def read_elems_per_token(variant: str) -> int:
  """Cache elements read per token by one decode step of the row."""
  n, r = FLAGS.num_heads, FLAGS.qk_rope_head_dim
  if variant == "mla_absorbed":
    return FLAGS.kv_lora_rank + r
  if variant == "mla_naive":
    return n * (FLAGS.qk_nope_head_dim + r + FLAGS.v_head_dim)
  return 2 * n * (FLAGS.mha_head_dim or FLAGS.qk_nope_head_dim)


class Timed:
  """One variant's jitted, cache-donating decode step and its cache at one S."""

  def __init__(self, variant: str, seq_len: int, dtype):
    layer = build(variant, dtype)
    graphdef, self.state = nnx.split(layer)

    def step(state, x, cache):
      return nnx.merge(graphdef, state)(x, cache=cache)

    self.step = jax.jit(step, donate_argnums=2)
    self.cache = filled_cache(layer, seq_len, dtype)
    self.start_lengths = np.asarray(self.cache.lengths)  # host copy: the device one is donated
    self.row = {
        "variant": variant, "S": seq_len, "batch": FLAGS.batch,
        "cache_bytes": sum(a.nbytes for a in self.cache.storage_arrays()),
        "cache_bytes_per_token": memory.measured_bytes_per_token(self.cache),
        "read_elems_per_token": read_elems_per_token(variant),
    }
    self.times = []
    self.y = None

  def __call__(self, x, record: bool) -> None:
    elapsed, _, (self.y, self.cache) = timing.timed(self.step, self.state, x, self.cache)
    if record:
      self.times.append(elapsed)
    # The same step again next time (never an overflow); a scalar replace, no cache copy.
    self.cache = self.cache.replace(lengths=jnp.asarray(self.start_lengths))

  def result(self) -> dict:
    return dict(self.row, ms_median=1000.0 * statistics.median(self.times),
                ms_min=1000.0 * min(self.times), ms_max=1000.0 * max(self.times),
                repeats=len(self.times))


def time_variants(seq_len: int, x, dtype) -> tuple[dict, dict]:
  """Times the variants round-robin (one call of each per repeat), so drifts in
  machine load hit all of them alike."""
  timed = {variant: Timed(variant, seq_len, dtype) for variant in VARIANTS}
  for i in range(FLAGS.warmup + FLAGS.repeats):
    for t in timed.values():
      t(x, record=i >= FLAGS.warmup)
  rows = {v: t.result() for v, t in timed.items()}
  outputs = {v: np.asarray(t.y, np.float32) for v, t in timed.items()}
  return rows, outputs


def settings(dtype) -> dict:
  """The sizes and options of this run (from the flags), recorded with every row."""
  return {
      "d_model": FLAGS.d_model, "num_heads": FLAGS.num_heads,
      "kv_lora_rank": FLAGS.kv_lora_rank, "qk_nope_head_dim": FLAGS.qk_nope_head_dim,
      "qk_rope_head_dim": FLAGS.qk_rope_head_dim, "v_head_dim": FLAGS.v_head_dim,
      "q_lora_rank": FLAGS.q_lora_rank,
      "mha_head_dim": FLAGS.mha_head_dim or FLAGS.qk_nope_head_dim,
      "dtype": jnp.dtype(dtype).name,
      "mla_decode_implementation": FLAGS.decode_implementation,
      "mha_decode_implementation": mha_implementation(),
      # With None the dispatcher tries these in order; each declines what it cannot run.
      "mla_backends_in_order": list(kvattn.ops.available_implementations("mla_decode_attention")),
      "mha_backends_in_order": list(kvattn.ops.available_implementations("decode_attention")),
  }


def run() -> list[dict]:
  """Times every variant at every `--seq_lens` value; returns one dict per measurement."""
  dtype = jnp.dtype(FLAGS.dtype)
  seq_lens = [int(s) for s in FLAGS.seq_lens]
  if min(seq_lens) < 1:
    raise app.UsageError(f"--seq_lens must be positive; got {FLAGS.seq_lens}")
  x = jax.random.normal(jax.random.key(FLAGS.seed + 2), (FLAGS.batch, 1, FLAGS.d_model), dtype)
  env = dict(results.environment(), load_avg_1min=os.getloadavg()[0])
  cfg = settings(dtype)
  print(json.dumps({"settings": cfg, "environment": env}))
  summary = []
  for seq_len in seq_lens:
    rows, outputs = time_variants(seq_len, x, dtype)
    for row in rows.values():
      print(json.dumps(row), flush=True)
    absorbed = rows["mla_absorbed"]
    ratio = {
        "S": seq_len,
        "naive_over_absorbed": rows["mla_naive"]["ms_median"] / absorbed["ms_median"],
        "mha_over_absorbed": rows["mha"]["ms_median"] / absorbed["ms_median"],
        "naive_over_absorbed_min": rows["mla_naive"]["ms_min"] / absorbed["ms_min"],
        "mha_over_absorbed_min": rows["mha"]["ms_min"] / absorbed["ms_min"],
        "cache_ratio_mla_over_mha": memory.mla_to_mha_cache_ratio(
            FLAGS.kv_lora_rank, FLAGS.qk_rope_head_dim, FLAGS.num_heads, cfg["mha_head_dim"]),
        "cache_ratio_measured": (rows["mla_absorbed"]["cache_bytes_per_token"]
                                 / rows["mha"]["cache_bytes_per_token"]),
        "max_abs_diff_naive_vs_absorbed": float(
            np.abs(outputs["mla_naive"] - outputs["mla_absorbed"]).max()),
        "load_avg_1min": os.getloadavg()[0],
    }
    print(json.dumps(ratio), flush=True)
    if abs(ratio["cache_ratio_measured"] - ratio["cache_ratio_mla_over_mha"]) > 1e-12:
      raise SystemExit("measured MLA/MHA cache bytes differ from kvattn.memory's ratio")
    summary.append((rows, ratio))
  print()
  print("Median (min) ms per decode step; ratios of medians (of mins).")
  print()
  print("| S | absorbed ms | naive ms | MHA ms | naive/absorbed | MHA/absorbed |")
  print("|---:|---:|---:|---:|---:|---:|")
  for rows, ratio in summary:
    cells = [f"{rows[v]['ms_median']:.2f} ({rows[v]['ms_min']:.2f})" for v in VARIANTS]
    print(f"| {ratio['S']} | " + " | ".join(cells) + " | "
          f"{ratio['naive_over_absorbed']:.1f} ({ratio['naive_over_absorbed_min']:.1f}) | "
          f"{ratio['mha_over_absorbed']:.2f} ({ratio['mha_over_absorbed_min']:.2f}) |")
  return [r for _, r in summary]


def main(argv):
  """absl entry point: prints the table of decode timings."""
  del argv
  run()


if __name__ == "__main__":
  cli.run(main)
