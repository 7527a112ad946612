"""Smallest real kvattn run: prefill + decode through the KV cache per variant.

    python -m experiments.demo

For MHA (K = N), GQA (K = N/4) and MQA (K = 1) it builds one attention layer,
prefills a batch of right-padded prompts of different lengths in one call,
decodes token by token through the cache, checks the result against a full
causal forward pass (DESIGN.md invariant 1), and prints the cache bytes per
token measured from the real arrays next to `kvattn.memory`'s analytic figure.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
from absl import flags
from flax import nnx

import kvattn
from experiments.framework import cli

FLAGS = flags.FLAGS
flags.DEFINE_integer("d_model", 256, "Model width D.")
flags.DEFINE_integer("num_heads", 8, "Query heads N.")
flags.DEFINE_integer("head_dim", 32, "Head width H.")
flags.DEFINE_integer("batch", 2, "Sequences per batch.")
flags.DEFINE_integer("max_len", 64, "Cache capacity S in tokens.")
flags.DEFINE_integer("decode_steps", 8, "Tokens decoded one at a time after the prefill.")


def run_variant(name: str, num_kv_heads: int) -> dict:
  """Prefills and decodes one attention variant through a KVCache; returns its summary row."""
  layer = kvattn.GroupedQueryAttention(
      d_model=FLAGS.d_model, num_heads=FLAGS.num_heads, num_kv_heads=num_kv_heads,
      head_dim=FLAGS.head_dim, rngs=nnx.Rngs(0))
  batch, steps = FLAGS.batch, FLAGS.decode_steps
  prompt_lengths = jnp.array([max(1, 12 - 5 * b) for b in range(batch)], jnp.int32)
  prompt_len = int(prompt_lengths.max())
  total = prompt_len + steps
  x = jax.random.normal(jax.random.key(1), (batch, total, FLAGS.d_model))

  cache = layer.init_cache(batch, FLAGS.max_len)
  _, cache = layer(x[:, :prompt_len], cache=cache, new_lengths=prompt_lengths)
  decoded = []
  for t in range(steps):
    # Sequence b's next input is token prompt_lengths[b] + t of its own stream.
    xt = jnp.take_along_axis(x, (prompt_lengths + t)[:, None, None], axis=1)
    yt, cache = layer(xt, cache=cache)
    decoded.append(yt[:, 0])
  decoded = jnp.stack(decoded, axis=1)  # [B, steps, D]

  max_err = 0.0
  for b in range(batch):
    n = int(prompt_lengths[b]) + steps
    full, _ = layer(x[b:b + 1, :n])
    max_err = max(max_err, float(jnp.abs(full[0, n - steps:] - decoded[b]).max()))

  return {
      "variant": name,
      "num_kv_heads": num_kv_heads,
      "cache_bytes_per_token_measured": kvattn.memory.measured_bytes_per_token(cache),
      "cache_bytes_per_token_analytic": kvattn.memory.gqa_bytes_per_token(
          num_kv_heads, FLAGS.head_dim, cache.dtype),
      "lengths": cache.lengths.tolist(),
      "max_abs_err_vs_full_forward": max_err,
  }


def main(argv):
  """absl entry point of the demo."""
  del argv
  n = FLAGS.num_heads
  variants = [("MHA", n), ("GQA", max(1, n // 4)), ("MQA", 1)]
  rows = [run_variant(name, k) for name, k in variants]
  mha = rows[0]["cache_bytes_per_token_measured"]
  for row in rows:
    row["cache_vs_mha"] = row["cache_bytes_per_token_measured"] / mha
    print(json.dumps(row))
  for row in rows:
    if row["cache_bytes_per_token_measured"] != row["cache_bytes_per_token_analytic"]:
      raise SystemExit(f"measured cache bytes differ from kvattn.memory for {row['variant']}")
    if row["max_abs_err_vs_full_forward"] > 1e-4:
      raise SystemExit(f"cached decode differs from the full forward for {row['variant']}")


if __name__ == "__main__":
  cli.run(main)
