"""The read rate XLA:CPU's dots reach at decode shapes, against a plain reduction's.

    python -m experiments.benchmarks.xla_cpu_dots
    python -m experiments.benchmarks.xla_cpu_dots --shapes=3072x576,576x1536 --chain=60

A decode step is a chain of matrix-vector products over weights too large for the caches
(one or two activation rows: batch 1, or XLA:CPU's padded int8 form) and of attention dots
over the KV cache. This times such products the way the model runs them: `--chain` distinct
weights of one shape (together far larger than the last-level cache, so each is read from
memory), multiplied in one jitted chain (each product depends on the one before, so none is
skipped or overlapped), and reports each form's read rate (bytes of the weight over the time
of one product) next to `jnp.sum` over a 512 MiB array in the same run:

  * `f32 x[1,K]@W[K,N]`: the f32 model's projection at batch 1;
  * `bf16 x[2,K]@W[K,N]`: bf16 weights (two rows: one row takes a slow path);
  * `u8s8 W[N,K].x[2,K]^T`: the int8 model's packed form (`kvattn.models.int8.u8s8_dot`);
  * `s8s8 x[2,K].W[K,N]`: the plain s8 x s8 form (the weight as the right operand);
  * attention over `--context` cached tokens of one layer (`B x K x S x H`, G queries per KV
    head): the logits and the probability-weighted values as f32 einsums over an f32
    cache, and over an int8 cache converted to f32, or with the query quantized per row
    and the logits as one s8 x s8 -> s32 einsum; a bf16 cache converted to f32, or read by
    bf16 x bf16 -> f32 einsums (the query and probabilities rounded to bf16); a 4-bit cache
    (two codes per byte, f32 per-token scale and zero) unpacked to f32 before the einsums,
    or unpacked as the producer of a multiply-reduce (no dot).

Prints a markdown table: form, shape, microseconds per product, GB/s, and GB/s over the
reduction's.
"""

from __future__ import annotations

import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from experiments.framework import cli
from kvattn import ops
from kvattn.models import int8


def _per_call(fn: Callable, args: tuple, calls: int, repeats: int = 3) -> float:
  """Best seconds per call of `fn(*args)` over `repeats` samples of `calls` calls."""
  jax.block_until_ready(fn(*args))
  best = float("inf")
  for _ in range(repeats):
    start = time.perf_counter()
    out = None
    for _ in range(calls):
      out = fn(*args)
    jax.block_until_ready(out)
    best = min(best, (time.perf_counter() - start) / calls)
  return best


def chained(product: Callable) -> Callable:
  """A jitted chain `x -> x + tiny(product(w_i, x))` over a list of weights: the products
  run in order, each reads its weight, and none can be folded away."""
  @jax.jit
  def run(weights, x):
    for w in weights:
      y = product(w, x)
      x = x + (jnp.max(y) > 2 ** 30).astype(x.dtype)
    return x
  return run


def gemv_forms(n: int, k: int, chain: int, rng: np.random.RandomState):
  """`(name, fn, weights, x, weight bytes)` of each product form for a `[K, N]` weight."""
  f32 = [jnp.asarray(rng.randn(k, n), jnp.float32) for _ in range(chain)]
  yield ("f32 x[1,K]@W[K,N]", chained(lambda w, x: x @ w), f32,
         jnp.ones((1, k), jnp.float32), 4 * n * k)
  del f32
  bf16 = [jnp.asarray(rng.randn(k, n), jnp.bfloat16) for _ in range(chain)]
  yield ("bf16 x[2,K]@W[K,N]",
         chained(lambda w, x: jnp.dot(x, w, preferred_element_type=jnp.float32)), bf16,
         jnp.ones((2, k), jnp.bfloat16), 2 * n * k)
  del bf16
  packed = [jnp.asarray(rng.randint(0, 256, (n, k)), jnp.uint8) for _ in range(chain)]
  yield ("u8s8 W[N,K].x[2,K]^T", chained(int8.u8s8_dot), packed,
         jnp.ones((2, k), jnp.int8), n * k)
  del packed
  s8 = [jnp.asarray(rng.randint(-127, 128, (k, n)), jnp.int8) for _ in range(chain)]
  yield ("s8s8 x[2,K].W[K,N]",
         chained(lambda w, x: jnp.dot(x, w, preferred_element_type=jnp.int32)), s8,
         jnp.ones((2, k), jnp.int8), n * k)


def attention_forms(batch: int, context: int, chain: int, rng: np.random.RandomState):
  """`(name, fn, caches, q, cache bytes)` of one layer's decode attention (K=3, G=3, H=64,
  SmolLM2's heads) over `context` tokens, per form (module doc)."""
  kv, groups, width = 3, 3, 64
  shape = (batch, kv, context, width)

  def softmax_values(logits, values, scale):
    p = jnp.exp(logits - jnp.max(logits, -1, keepdims=True)) * scale
    return jnp.einsum("BKGS,BKSH->BKGH", p, values)

  def f32_attention(cache, q):
    k, v = cache
    return softmax_values(jnp.einsum("BKGH,BKSH->BKGS", q, k), v, 1.0)

  def int8_converted(cache, q):
    k, v, s = cache
    logits = jnp.einsum("BKGH,BKSH->BKGS", q, k.astype(jnp.float32)) * s[:, :, None]
    return softmax_values(logits, v.astype(jnp.float32), s[:, :, None])

  def int8_s8_logits(cache, q):
    k, v, s = cache
    q8, q_scale = ops.quantize_kv(q, jnp.int8)  # as kvattn's xla_blocked path does
    logits = jnp.einsum("BKGH,BKSH->BKGS", q8, k, preferred_element_type=jnp.int32)
    logits = logits.astype(jnp.float32) * q_scale[..., None] * s[:, :, None]
    return softmax_values(logits, v.astype(jnp.float32), s[:, :, None])

  def bf16_converted(cache, q):
    k, v = cache
    return softmax_values(jnp.einsum("BKGH,BKSH->BKGS", q, k.astype(jnp.float32)),
                          v.astype(jnp.float32), 1.0)

  def bf16_dots(cache, q):  # the query rounded to bf16, f32 accumulation
    k, v = cache
    logits = jnp.einsum("BKGH,BKSH->BKGS", q.astype(jnp.bfloat16), k,
                        preferred_element_type=jnp.float32)
    p = jnp.exp(logits - jnp.max(logits, -1, keepdims=True))
    return jnp.einsum("BKGS,BKSH->BKGH", p.astype(jnp.bfloat16), v,
                      preferred_element_type=jnp.float32)

  def unpack4(packed, scale, zero):  # two 4-bit codes per byte -> f32, per-token scale/zero
    codes = jnp.stack([packed & 15, packed >> 4], axis=-1).reshape(packed.shape[:-1] + (-1,))
    return codes.astype(jnp.float32) * scale[..., None] + zero[..., None]

  def int4_converted(cache, q):
    k, v, ks, kz, vs, vz = cache
    return softmax_values(jnp.einsum("BKGH,BKSH->BKGS", q, unpack4(k, ks, kz)),
                          unpack4(v, vs, vz), 1.0)

  def int4_fused(cache, q):  # the unpack as the producer of a multiply-reduce, no dot
    k, v, ks, kz, vs, vz = cache
    logits = jnp.sum(q[:, :, :, None, :] * unpack4(k, ks, kz)[:, :, None], axis=-1)
    p = jnp.exp(logits - jnp.max(logits, -1, keepdims=True))
    return jnp.sum(p[..., None] * unpack4(v, vs, vz)[:, :, None], axis=3)

  q = jnp.asarray(rng.randn(batch, kv, groups, width), jnp.float32)
  f32 = [(jnp.asarray(rng.randn(*shape), jnp.float32),
          jnp.asarray(rng.randn(*shape), jnp.float32)) for _ in range(chain)]
  yield "attention f32 cache", chained(lambda c, x: f32_attention(c, x)), f32, q, 2 * 4 * np.prod(
      shape)
  del f32
  q8 = [(jnp.asarray(rng.randint(-127, 128, shape), jnp.int8),
         jnp.asarray(rng.randint(-127, 128, shape), jnp.int8),
         jnp.asarray(rng.rand(batch, kv, context), jnp.float32)) for _ in range(chain)]
  nbytes = 2 * np.prod(shape) + 4 * batch * kv * context
  yield "attention int8 cache, to f32", chained(int8_converted), q8, q, nbytes
  yield "attention int8 cache, s8 logits", chained(int8_s8_logits), q8, q, nbytes
  del q8
  b16 = [(jnp.asarray(rng.randn(*shape), jnp.bfloat16),
          jnp.asarray(rng.randn(*shape), jnp.bfloat16)) for _ in range(chain)]
  yield "attention bf16 cache, to f32", chained(bf16_converted), b16, q, 2 * 2 * np.prod(shape)
  yield "attention bf16 cache, bf16 dots", chained(bf16_dots), b16, q, 2 * 2 * np.prod(shape)
  del b16
  packed = shape[:-1] + (width // 2,)
  q4 = [tuple(jnp.asarray(rng.randint(0, 256, packed), jnp.uint8) for _ in range(2))
        + tuple(jnp.asarray(rng.rand(batch, kv, context), jnp.float32) for _ in range(4))
        for _ in range(chain)]
  nbytes = 2 * np.prod(packed) + 4 * 4 * batch * kv * context
  yield "attention 4-bit cache, to f32", chained(int4_converted), q4, q, nbytes
  yield "attention 4-bit cache, fused reduce", chained(int4_fused), q4, q, nbytes


def run(argv: Sequence[str] | None = None) -> list[dict]:
  """The measurement (module doc); returns the rows it printed."""
  parser = cli.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--shapes", default="3072x576,960x576,576x1536",
                      help="weights N x K (outputs x inputs), comma-separated")
  parser.add_argument("--chain", type=int, default=40, help="distinct weights per chain")
  parser.add_argument("--batch", type=int, default=1, help="attention rows B")
  parser.add_argument("--context", type=int, default=4000, help="attention: cached tokens")
  parser.add_argument("--bandwidth_mib", type=int, default=512, help="the reduction's array")
  args = parser.parse_args(argv)
  if min(args.chain, args.batch, args.context, args.bandwidth_mib) < 1:
    raise ValueError(f"--chain, --batch, --context and --bandwidth_mib must be >= 1; got "
                     f"{args.chain}, {args.batch}, {args.context}, {args.bandwidth_mib}")
  try:
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
  except ValueError:
    shapes = []
  if not shapes or any(len(s) != 2 or min(s) < 1 for s in shapes):
    raise ValueError(f"--shapes must be comma-separated NxK pairs; got {args.shapes!r}")
  big = jnp.ones((args.bandwidth_mib << 18,), jnp.float32)
  bandwidth = big.nbytes / _per_call(jax.jit(jnp.sum), (big,), 3)
  del big
  print(f"jnp.sum over {args.bandwidth_mib} MiB: {bandwidth / 1e9:.1f} GB/s\n")
  print("| form | shape | us per product | GB/s | of jnp.sum |")
  print("|---|---|---:|---:|---:|")
  rng = np.random.RandomState(0)
  rows = []
  def all_forms():  # one form's arrays alive at a time
    for n, k in shapes:
      for form in gemv_forms(n, k, args.chain, rng):
        yield f"{n}x{k}", form
    for form in attention_forms(args.batch, args.context, args.chain, rng):
      yield f"B={args.batch} S={args.context}", form

  for shape, (name, fn, weights, x, nbytes) in all_forms():
    seconds = _per_call(fn, (weights, x), 2) / args.chain
    rate = nbytes / seconds
    rows.append({"form": name, "shape": shape, "us": 1e6 * seconds, "gb_s": rate / 1e9,
                 "of_sum": rate / bandwidth})
    print(f"| {name} | {shape} | {1e6 * seconds:.1f} | {rate / 1e9:.1f} | "
          f"{rate / bandwidth:.2f} |", flush=True)
    del weights
  return rows


def main(argv: Sequence[str] | None = None) -> None:
  """Prints the table (module doc)."""
  run(argv)


if __name__ == "__main__":
  cli.run_plain(main)
