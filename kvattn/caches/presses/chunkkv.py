"""ChunkKV: keep whole chunks of contiguous tokens, ranked by an inner policy's score.

Liu et al. 2025, "ChunkKV: Semantic-Preserving KV Cache Compression for Efficient Long-Context
LLM Inference", arXiv 2502.00299 (kvpress's `ChunkKVPress`). Tokens `[i * chunk_size, (i + 1) *
chunk_size)` form chunk i; a chunk's score is the mean over its live candidates of the inner
policy's score summed over the layer's KV heads, so every KV head keeps the same chunks (one
selection per layer, as the paper and kvpress). Every candidate carries its chunk's score, so
the cache keeps the best chunks whole; when the budget is not a multiple of `chunk_size` the
last chunk it reaches is cut (its earliest tokens kept) -- kvpress keeps a whole number of
chunks instead, so its cache size varies. The inner policy's own score is what the cache carries
(an accumulating inner policy, SnapKV by default, keeps accumulating its mass).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kvattn.caches import eviction
from kvattn.caches.presses._common import inner_policy, live, rank_and_carry

NAME = "chunkkv"
DEFAULT_CHUNK_SIZE = 20
"""kvpress's `chunk_length` default."""


def chunk_means(values: jax.Array, pos: jax.Array, chunk_size: int) -> jax.Array:
  """`f32[B, S]`: for each live slot (`pos >= 0`) the mean of `values: f32[B, S]` over the
  live slots of its chunk (`pos // chunk_size`); 0 elsewhere."""
  num = pos.shape[-1]

  def one_row(x, p):
    ok = p >= 0
    chunk = jnp.where(ok, p // chunk_size, jnp.iinfo(jnp.int32).max)
    order = jnp.argsort(chunk, stable=True)
    sorted_chunk = chunk[order]
    starts = jnp.concatenate([jnp.ones(1, bool), sorted_chunk[1:] != sorted_chunk[:-1]])
    segment = jnp.cumsum(starts) - 1  # dense chunk index of each sorted slot
    x_sorted = jnp.where(ok[order], x[order], 0.0)
    total = jax.ops.segment_sum(x_sorted, segment, num_segments=num)
    count = jax.ops.segment_sum(ok[order].astype(jnp.float32), segment, num_segments=num)
    mean_sorted = total[segment] / jnp.maximum(count[segment], 1.0)
    return jnp.where(ok, jnp.zeros_like(x).at[order].set(mean_sorted), 0.0)

  return jax.vmap(one_row)(values, pos)


def chunked(inner: str) -> eviction.EvictionPolicy:
  """The ChunkKV policy over `inner` (a name of `eviction.POLICY_TABLE`): its options plus
  `chunk_size` (default 20), its scoring queries and protected window.

  Raises:
    ValueError: `inner` is not a registered policy.
  """
  base = inner_policy(inner, "inner")

  def score(c: eviction.Candidates, options: dict[str, int]):
    rank, carry = rank_and_carry(base.score(c, options))
    mask = live(c)
    # Every KV head holds the same tokens in the same slots (chunks are chosen per layer).
    per_token = jnp.where(mask, rank, 0.0).sum(axis=1)  # [B, S + T]
    means = chunk_means(per_token, c.pos[:, 0], options["chunk_size"])
    return jnp.broadcast_to(means[:, None], c.pos.shape), carry

  return eviction.EvictionPolicy(
      score=score,
      options={**base.options, "chunk_size": (lambda budget: DEFAULT_CHUNK_SIZE, 1)},
      score_queries=base.score_queries, protected=base.protected,
      query_window=base.query_window)


def register(inner: str) -> str:
  """Registers ChunkKV over `inner` as policy and cache kind `chunkkv_<inner>` (once); returns
  the name (`chunkkv` itself is SnapKV's)."""
  name = f"{NAME}_{inner}"
  if name not in eviction.POLICY_TABLE:
    eviction.register_eviction_policy(name, chunked(inner))
  return name


eviction.register_eviction_policy(NAME, chunked("snapkv"))
