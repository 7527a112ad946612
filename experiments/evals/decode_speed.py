"""Decode speed where the cache matters: B sequences with a long random context.

The main job's greedy run (batch 1, a few hundred tokens) reads mostly weights,
so its tok/s ranks cache kinds by noise. `long_decode` instead fills each
layer's cache with `context` tokens of random keys and values per row through
the kind's own `update` (so a quantized kind quantizes, a bounded kind evicts
or wraps, a low-bit kind packs), then times `kvattn.generate`'s compiled decode
loop (`timing.decode_rounds`) and reports the step's bytes against the read
bandwidth measured in the same run. The contents are random: the speed of a
step does not depend on them, and filling 4 x 4000 tokens costs writes, not a
30-layer prefill.
"""

from __future__ import annotations

import functools
import statistics
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from experiments.framework import timing
from kvattn import memory
from kvattn.caches import protocol


def _random_new(cache: Any, key: jax.Array, tokens: int) -> tuple[jax.Array, jax.Array]:
  """N(0, 1) f32 entries for `tokens` new tokens of `cache`: `(k, v) [B, T, K, H]` of a GQA
  cache, `(c_kv [B, T, C], k_rope [B, T, R])` of an MLA one."""
  ka, kb = jax.random.split(key)
  if isinstance(cache, protocol.MLACache):
    shapes = ((cache.batch, tokens, cache.kv_lora_rank),
              (cache.batch, tokens, cache.qk_rope_head_dim))
  else:
    shapes = ((cache.batch, tokens, cache.num_kv_heads, cache.head_dim),) * 2
  return jax.random.normal(ka, shapes[0]), jax.random.normal(kb, shapes[1])


def random_context(caches: Sequence[Any], context: int, *, chunk: int = 512,
                   seed: int = 0) -> tuple[Any, ...]:
  """`caches` (empty, any kinds) after `context` tokens of N(0, 1) keys and values per row,
  written `chunk` tokens at a time through each cache's own update
  (`kvattn.caches.protocol.write`). The input caches are donated.

  Raises:
    ValueError: `context` or `chunk` is not a positive int.
  """
  for name, value in (("context", context), ("chunk", chunk)):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
      raise ValueError(f"{name} must be a positive int; got {value!r}")
  chunk = min(chunk, context)

  @functools.partial(jax.jit, donate_argnums=0)
  def write(caches, key, count):
    out = []
    for i, cache in enumerate(caches):
      new = _random_new(cache, jax.random.fold_in(key, i), chunk)
      lengths = jnp.full((cache.batch,), count, jnp.int32)
      out.append(protocol.write(cache, *new, new_lengths=lengths))
    return tuple(out)

  caches = tuple(caches)
  key = jax.random.key(seed)
  for start in range(0, context, chunk):
    caches = write(caches, jax.random.fold_in(key, start),
                   jnp.int32(min(chunk, context - start)))
  return caches


def cache_read_bytes(caches: Sequence[Any], context: int) -> int:
  """Bytes one decode step reads from `caches` holding `context` tokens per row: each layer's
  bytes per token slot (`kvattn.memory.measured_bytes_per_token`, scales included) times the
  slots attended, `min(capacity, context)` per row (a bounded kind reads its budget)."""
  return int(sum(memory.measured_bytes_per_token(c) * c.batch * min(c.capacity, context)
                 for c in caches))


def long_decode(model: Any, caches: Sequence[Any], context: int, *, steps: int, repeats: int,
                weight_bytes: int, bandwidth: float, seed: int = 0) -> dict[str, Any]:
  """Times greedy decode steps of `model` on `caches` after a random `context`.

  Args:
    model: a `kvattn.Transformer`.
    caches: its empty caches at batch B, with room for `context + (repeats + 1) * steps + 1`
      tokens per row (a bounded kind: any budget). Donated.
    context: tokens per row before the timed steps.
    steps, repeats: model steps per timed call and timed calls (`timing.decode_rounds`; an
      untimed call compiles first).
    weight_bytes: parameter bytes one step reads.
    bandwidth: read bytes/s measured in the same run (`timing.read_bandwidth`).
    seed: of the random context and first tokens.

  Returns:
    `{"tokens_per_s": B / median step seconds, "step_ms", "step_ms_min", "step_ms_max",
    "read_bytes": weight + cache bytes per step, "cache_read_bytes", "roofline": read time
    at `bandwidth` / median step time, "batch", "context"}`.
  """
  caches = random_context(caches, context, seed=seed)
  cache_bytes = cache_read_bytes(caches, context)
  batch = caches[0].batch
  first = jnp.asarray(np.random.default_rng(seed).integers(0, model.vocab_size, batch),
                      jnp.int32)
  wall = timing.decode_rounds({"run": (model, first, caches)}, steps, repeats)["run"]["wall"]
  step = statistics.median(wall)
  read = weight_bytes + cache_bytes
  return {"batch": int(batch), "context": int(context), "tokens_per_s": batch / step,
          "step_ms": 1e3 * step, "step_ms_min": 1e3 * min(wall), "step_ms_max": 1e3 * max(wall),
          "read_bytes": int(read), "cache_read_bytes": cache_bytes,
          "roofline": read / bandwidth / step}
