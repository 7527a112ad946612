"""Prefill and decode speed of `kvattn.generate` on a random-weight Transformer.

    python -m experiments.benchmarks.generate --batch 4 --prompt_len 2048 --new_tokens 64 \\
        --d_model 256 --num_layers 4 --num_heads 8 --head_dim 32 --mlp_dim 768 \\
        --num_kv_heads 8 --variant gqa

Builds a `kvattn.Transformer` (every layer GQA with `--num_kv_heads`, or MLA
with `--kv_lora_rank`/`--qk_rope_head_dim`), full-length random prompts, and
times the two compiled programs of `kvattn.generate` separately: the prefill
call and the decode loop (one `lax.while_loop`, `new_tokens - 1` model steps;
no EOS, so every step runs). After `--warmup` untimed runs (compilation), it
times `--prefill_repeats` prefill calls and `--repeats` decode loops (each on a
copy of the same prefilled caches, so a slow prefill does not limit the
number of decode samples) and reports medians (and min/max) of wall time
measured around `block_until_ready`. Prints one JSON line:

  prefill_s, decode_s        median seconds
  decode_tokens_per_s        batch * (new_tokens - 1) / decode_s
  ms_per_step                1000 * decode_s / (new_tokens - 1)
  prefill_tokens_per_s       batch * prompt_len / prefill_s
  cache_bytes                measured bytes of the caches' storage arrays
  ... plus the settings, min/max of each time and the environment.
"""

from __future__ import annotations

import json
import os
import platform
import statistics

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags
from flax import nnx

from experiments.framework import cli
from experiments.framework import timing
from kvattn.models import transformer as transformer_lib

FLAGS = flags.FLAGS
flags.DEFINE_integer("batch", 4, "Sequences per batch B.")
flags.DEFINE_integer("prompt_len", 2048, "Prompt tokens per sequence (all full length).")
flags.DEFINE_integer("new_tokens", 64, "Tokens generated per sequence (decode steps + 1).")
flags.DEFINE_enum("variant", "gqa", ["gqa", "mla"], "Attention of every layer.")
flags.DEFINE_integer("num_kv_heads", 8, "GQA: KV heads K (N: MHA, 1: MQA).")
flags.DEFINE_integer("d_model", 256, "Model width D.")
flags.DEFINE_integer("num_layers", 4, "Layers L.")
flags.DEFINE_integer("num_heads", 8, "Query heads N.")
flags.DEFINE_integer("head_dim", 32, "GQA head width H; MLA qk_nope_head_dim and v_head_dim.")
flags.DEFINE_integer("mlp_dim", 768, "SwiGLU hidden width F.")
flags.DEFINE_integer("kv_lora_rank", 64, "MLA latent width C.")
flags.DEFINE_integer("qk_rope_head_dim", 16, "MLA RoPE width R.")
flags.DEFINE_integer("vocab_size", 259, "Vocabulary size V (259: kvattn.training.data bytes + specials).")
flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16", "float16"],
                  "Compute, parameter and cache dtype.")
flags.DEFINE_enum("cache_dtype", None,
                  ["float32", "bfloat16", "float16", "int8", "float8_e4m3fn", "float8_e5m2"],
                  "KV-cache storage dtype (default --dtype; int8/fp8 store f32 per-token scales).")
flags.DEFINE_string("decode_implementation", None, "kvattn.ops decode backend (None: best).")
flags.DEFINE_integer("warmup", 1, "Untimed runs (the first compiles).")
flags.DEFINE_integer("repeats", 10, "Timed decode loops (each on a copy of the prefilled caches).")
flags.DEFINE_integer("prefill_repeats", 3, "Timed prefill calls.")
flags.DEFINE_integer("max_len", None, "Cache capacity S (default prompt_len + new_tokens - 1).")
flags.DEFINE_integer("seed", 0, "Weights and prompts.")


def model_config():
  """The model config of the `--variant` flag."""
  if FLAGS.variant == "gqa":
    attention = dict(kind="gqa", num_heads=FLAGS.num_heads, num_kv_heads=FLAGS.num_kv_heads,
                     head_dim=FLAGS.head_dim)
  else:
    attention = dict(kind="mla", num_heads=FLAGS.num_heads, kv_lora_rank=FLAGS.kv_lora_rank,
                     qk_nope_head_dim=FLAGS.head_dim, qk_rope_head_dim=FLAGS.qk_rope_head_dim,
                     v_head_dim=FLAGS.head_dim)
  attention["decode_implementation"] = FLAGS.decode_implementation
  return transformer_lib.model_config(
      vocab_size=FLAGS.vocab_size, d_model=FLAGS.d_model, num_layers=FLAGS.num_layers,
      mlp_dim=FLAGS.mlp_dim, dtype=FLAGS.dtype, param_dtype=FLAGS.dtype, attention=attention)


def run() -> dict:
  """Times the prefill and decode loop of `--variant`; returns the JSON row."""
  cfg = model_config()
  model = transformer_lib.Transformer.from_config(cfg, rngs=nnx.Rngs(FLAGS.seed))
  batch, prompt_len, new_tokens = FLAGS.batch, FLAGS.prompt_len, FLAGS.new_tokens
  if new_tokens < 2:
    raise app.UsageError(f"--new_tokens must be >= 2 (one decode step at least); got {new_tokens}")
  max_len = FLAGS.max_len or prompt_len + new_tokens - 1
  if max_len < prompt_len + new_tokens - 1:
    raise app.UsageError(f"--max_len must be >= prompt_len + new_tokens - 1; got {max_len}")
  rng = np.random.default_rng(FLAGS.seed)
  prompts = jnp.asarray(rng.integers(0, 256, (batch, prompt_len)), jnp.int32)
  lengths = jnp.full((batch,), prompt_len, jnp.int32)

  def fresh_caches():
    caches = model.init_caches(batch, max_len, FLAGS.cache_dtype or FLAGS.dtype)
    jax.block_until_ready(caches)
    return caches

  def timed_prefill():
    return timing.timed_prefill(model, prompts, lengths, fresh_caches())

  def timed_decode(first, caches, key):
    caches = jax.tree.map(jnp.copy, caches)  # decode donates its caches: work on a copy
    seconds, _, _, out_lengths, _ = timing.timed_decode(model, first, caches, new_tokens, key)
    return seconds, out_lengths

  for _ in range(FLAGS.warmup):  # compiles both programs
    _, first, prefilled, key = timed_prefill()
    timed_decode(first, prefilled, key)
  prefill_times = []
  for _ in range(FLAGS.prefill_repeats):
    seconds, first, prefilled, key = timed_prefill()
    prefill_times.append(seconds)
  decode_times = []
  for _ in range(FLAGS.repeats):  # each decodes from a copy of the same prefilled caches
    seconds, out_lengths = timed_decode(first, prefilled, key)
    decode_times.append(seconds)
  cache_bytes = sum(sum(a.nbytes for a in c.storage_arrays()) for c in prefilled)
  if int(np.asarray(out_lengths).min()) != new_tokens:
    raise RuntimeError(f"decode stopped early: lengths {np.asarray(out_lengths).tolist()}")

  prefill_s, decode_s = statistics.median(prefill_times), statistics.median(decode_times)
  steps = new_tokens - 1
  return {
      "variant": FLAGS.variant,
      "num_kv_heads": FLAGS.num_kv_heads if FLAGS.variant == "gqa" else None,
      "kv_lora_rank": FLAGS.kv_lora_rank if FLAGS.variant == "mla" else None,
      "qk_rope_head_dim": FLAGS.qk_rope_head_dim if FLAGS.variant == "mla" else None,
      "batch": batch, "prompt_len": prompt_len, "new_tokens": new_tokens,
      "d_model": FLAGS.d_model, "num_layers": FLAGS.num_layers, "num_heads": FLAGS.num_heads,
      "head_dim": FLAGS.head_dim, "mlp_dim": FLAGS.mlp_dim, "dtype": FLAGS.dtype,
      "prefill_s": prefill_s, "decode_s": decode_s,
      "decode_tokens_per_s": batch * steps / decode_s,
      "ms_per_step": 1000.0 * decode_s / steps,
      "prefill_tokens_per_s": batch * prompt_len / prefill_s,
      "prefill_s_min": min(prefill_times), "prefill_s_max": max(prefill_times),
      "decode_s_min": min(decode_times), "decode_s_max": max(decode_times),
      "repeats": FLAGS.repeats, "prefill_repeats": FLAGS.prefill_repeats, "max_len": max_len,
      "decode_implementation": FLAGS.decode_implementation,
      "cache_bytes": cache_bytes,
      "cache_bytes_per_token": transformer_lib.cache_bytes_per_token(
          cfg, FLAGS.cache_dtype or FLAGS.dtype),
      "cache_bytes_analytic": batch * max_len * transformer_lib.cache_bytes_per_token(
          cfg, FLAGS.cache_dtype or FLAGS.dtype),
      "cache_dtype": FLAGS.cache_dtype or FLAGS.dtype,
      "jax": jax.__version__, "backend": jax.default_backend(),
      "device": jax.devices()[0].device_kind, "cpu_count": os.cpu_count(),
      "machine": platform.machine(),
      "load_avg_1min": os.getloadavg()[0],
  }


def main(argv):
  """absl entry point: prints one JSON line."""
  del argv
  print(json.dumps(run()))


if __name__ == "__main__":
  cli.run(main)
