"""Expected attention: score each key by the attention the next queries are expected to pay it.

Devoto et al. 2025, "Expected Attention: KV Cache Compression by Estimating Attention from
Future Queries Distribution", arXiv 2510.00636 (kvpress's `ExpectedAttentionPress`). The next
queries of query head n are modelled as a Gaussian: the mean `mu` and covariance `Sigma` of the
chunk's queries before RoPE (tokens `< num_sinks` left out, as kvpress's `n_sink`), rotated by
RoPE averaged over the `n_future_positions` positions after the chunk (`R = mean_p R_p`,
`mu' = R mu`, `Sigma' = R Sigma R^T`). For a stored (RoPE'd) key k of head dim H,
`E[exp(q.k / sqrt(H))] = exp(k.mu' / sqrt(H) + k^T Sigma' k / (2 H))`; as in kvpress these
logits are softmax-normalised over the live candidates (tokens `>= num_sinks`) per query head,
averaged over the G query heads of the KV head and multiplied by the value norm `||v||`.

Differences from kvpress: the statistics are those of the chunk being written (kvpress: the
whole prompt, once, at prefill -- the same when the prompt is one chunk); a decode step (one
query) has zero covariance, so under a fixed budget the score during decoding is the newest
query's expected attention. A write through `update` (no queries) keeps the carried scores.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kvattn.caches import eviction
from kvattn.caches.presses._common import dequantized, live

NAME = "expected_attention"


def query_statistics(queries: jax.Array, query_pos: jax.Array, num_sinks: int
                     ) -> tuple[jax.Array, jax.Array]:
  """Mean `f32[B, N, H]` and covariance `f32[B, N, H, H]` (divided by the count, as kvpress)
  of the queries `[B, T, N, H]` whose token `query_pos` is `>= num_sinks` (zeros for a row
  with none)."""
  use = (query_pos >= num_sinks)[:, :, None, None]  # [B, T, 1, 1]; padding is -1
  q = jnp.where(use, queries.astype(jnp.float32), 0.0)
  count = jnp.maximum(use.sum(axis=1), 1)  # [B, 1, 1]
  mean = q.sum(axis=1) / count
  centred = jnp.where(use, q - mean[:, None], 0.0)
  cov = jnp.einsum("BTNI,BTNJ->BNIJ", centred, centred) / count[..., None]
  return mean, cov


def averaged_rotation(rope, end: jax.Array, head_dim: int, num_future: int):
  """`(cos, sin)`, each `f32[B, H/2]`: RoPE's rotation averaged over the positions
  `end[b] .. end[b] + num_future - 1` (read off `rope` applied to the unit vector of each
  rotate-half pair, so any scaling the module uses is included)."""
  probe = jnp.concatenate([jnp.ones(head_dim // 2), jnp.zeros(head_dim // 2)])
  positions = end[:, None] + jnp.arange(num_future, dtype=jnp.int32)[None, :]  # [B, F]
  rotated = rope(jnp.broadcast_to(probe, positions.shape + (head_dim,)), positions)
  cos, sin = jnp.split(rotated.astype(jnp.float32).mean(axis=1), 2, axis=-1)
  return cos, sin


def rotate(x: jax.Array, cos: jax.Array, sin: jax.Array, axis: int) -> jax.Array:
  """`R x` along `axis` of `x: f32[B, ...]`, R the rotate-half rotation of `(cos, sin)`
  (`f32[B, H/2]`)."""
  x = jnp.moveaxis(x, axis, -1)
  shape = (x.shape[0],) + (1,) * (x.ndim - 2) + (x.shape[-1] // 2,)
  c, s = cos.reshape(shape), sin.reshape(shape)
  x1, x2 = jnp.split(x, 2, axis=-1)
  return jnp.moveaxis(jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1), -1, axis)


def score(c: eviction.Candidates, options: dict[str, int]) -> jax.Array:
  """`f32[B, K, S + T]`: expected attention of the next queries times `||v||`."""
  if c.queries is None:  # written through `update`: nothing new to estimate from
    return c.carried
  num_sinks = options["num_sinks"]
  batch, num_kv_heads, _, head_dim = c.k.shape
  num_heads = c.queries.shape[2]
  mean, cov = query_statistics(c.queries, c.query_pos, num_sinks)
  cos, sin = averaged_rotation(c.rope, c.end[:, 0, 0], head_dim, options["n_future_positions"])
  mean = rotate(mean, cos, sin, -1)
  cov = rotate(rotate(cov, cos, sin, -2), cos, sin, -1)
  groups = num_heads // num_kv_heads
  mean = mean.reshape(batch, num_kv_heads, groups, head_dim)
  cov = cov.reshape(batch, num_kv_heads, groups, head_dim, head_dim)
  mask = live(c) & (c.pos >= num_sinks)
  k = dequantized(c.k, c.k_scale, mask)
  logits = jnp.einsum("BKSH,BKGH->BKGS", k, mean) / jnp.sqrt(head_dim)
  quad = jnp.einsum("BKSI,BKGIJ,BKSJ->BKGS", k, cov, k)
  logits = jnp.where(mask[:, :, None], logits + quad / (2 * head_dim), -jnp.inf)
  probs = jax.nn.softmax(logits, axis=-1)
  probs = jnp.where(mask[:, :, None], probs, 0.0).mean(axis=2)  # a row with none: 0, not NaN
  v_norm = jnp.linalg.norm(dequantized(c.v, c.v_scale, mask), axis=-1)
  return probs * v_norm


POLICY = eviction.EvictionPolicy(
    score=score,
    options={"n_future_positions": (lambda budget: 512, 1), "recent_size": (lambda budget: 0, 0)},
    protected="recent_size")
eviction.register_eviction_policy(NAME, POLICY)
