"""Pure numpy references of the presses' scores and of the eviction cache's selection.

`Simulation` keeps, per row and KV head, the kept tokens as python lists (float64), scores the
candidates with a reference score and keeps the budget as `EvictingKVCache` documents: sinks and
the protected recent window first, then the highest scores (ties: the earlier candidate), the
kept slots sorted by position. Nothing here calls kvattn.
"""

from __future__ import annotations

import numpy as np

THETA = 10000.0


def rope(x: np.ndarray, positions: np.ndarray, theta: float = THETA) -> np.ndarray:
  """Rotate-half RoPE of `x [..., H]` at integer `positions` (broadcast to x.shape[:-1])."""
  half = x.shape[-1] // 2
  inv_freq = theta ** (-np.arange(0, 2 * half, 2) / (2 * half))
  angles = np.asarray(positions, np.float64)[..., None] * inv_freq
  x1, x2 = x[..., :half], x[..., half:]
  return np.concatenate([x1 * np.cos(angles) - x2 * np.sin(angles),
                         x2 * np.cos(angles) + x1 * np.sin(angles)], axis=-1)


def rotation_matrix(position: int, head_dim: int, theta: float = THETA) -> np.ndarray:
  """`[H, H]` RoPE at `position` as a matrix (`R x == rope(x, position)`)."""
  return rope(np.eye(head_dim), np.full(head_dim, position), theta).T


def knorm(k):
  return -np.linalg.norm(k, axis=-1)


def keydiff(k):
  unit = k / np.maximum(np.linalg.norm(k, axis=-1, keepdims=True), 1e-12)
  anchor = unit.mean(axis=0)
  return -(unit @ anchor) / max(np.linalg.norm(anchor), 1e-12)


def qfilter(k, u):
  return k @ u


def expected_attention(k, v, pos, queries, query_pos, end, *, num_sinks, n_future):
  """kvpress's definition: `queries [T, G, H]` before RoPE of this KV head's G heads."""
  head_dim = k.shape[-1]
  use = query_pos >= num_sinks
  q = queries[use]  # [T', G, H]
  mean = q.mean(axis=0) if len(q) else np.zeros(queries.shape[1:])
  centred = q - mean
  cov = (np.einsum("tgi,tgj->gij", centred, centred) / max(len(q), 1))
  rot = np.mean([rotation_matrix(end + f, head_dim) for f in range(n_future)], axis=0)
  mean = mean @ rot.T  # [G, H]
  cov = np.einsum("ij,gjk,lk->gil", rot, cov, rot)
  ok = pos >= num_sinks
  logits = k @ mean.T / np.sqrt(head_dim) + np.einsum("si,gij,sj->sg", k, cov, k) / (2 * head_dim)
  logits = np.where(ok[:, None], logits, -np.inf)
  if not ok.any():
    return np.zeros(len(k))
  probs = np.exp(logits - logits[ok].max(axis=0))
  probs = probs / probs.sum(axis=0)
  return probs.mean(axis=1) * np.linalg.norm(v, axis=-1)


def attention_mass(q_rot, q_pos, k, pos, scoring):
  """Probability mass the scoring queries (`q_rot [T, G, H]` RoPE'd, tokens `q_pos`) give each
  candidate (`k [S, H]`, tokens `pos`), summed over the G heads."""
  head_dim = k.shape[-1]
  mass = np.zeros(len(k))
  for t in np.flatnonzero(scoring):
    visible = pos <= q_pos[t]
    for g in range(q_rot.shape[1]):
      logits = np.where(visible, k @ q_rot[t, g] / np.sqrt(head_dim), -np.inf)
      p = np.exp(logits - logits.max())
      mass += p / p.sum()
  return mass


def avg_pool(x, size):
  left = size // 2
  padded = np.concatenate([np.zeros(left), x, np.zeros(size - 1 - left)])
  return np.array([padded[i:i + size].sum() / size for i in range(len(x))])


def descending_rank(x):
  order = np.argsort(-x, kind="stable")
  rank = np.empty(len(x), np.int64)
  rank[order] = np.arange(len(x))
  return rank


def chunk_means(per_token, pos, chunk_size):
  """Mean of `per_token` over the live candidates (pos >= 0) of each one's chunk; 0 else."""
  chunk = np.where(pos >= 0, pos // chunk_size, -1)
  return np.array([per_token[chunk == c].mean() if c >= 0 else 0.0 for c in chunk])


class Simulation:
  """Per row and KV head: kept tokens `pos`, RoPE'd keys, values and carried scores."""

  def __init__(self, batch, num_kv_heads, budget, *, num_sinks=0, recent=0):
    self.budget, self.num_sinks, self.recent = budget, num_sinks, recent
    self.lengths = np.zeros(batch, np.int64)
    self.kept = [[dict(pos=np.zeros(0, np.int64), k=None, v=None, score=np.zeros(0))
                  for _ in range(num_kv_heads)] for _ in range(batch)]

  def step(self, q, k, v, new_lengths, score_fn, keep_fn=None):
    """One chunk `q [B, T, N, H]`, `k, v [B, T, K, H]` (before RoPE), `new_lengths [B]`.
    Candidates are laid out as the cache's: the budget's slots (kept tokens first, then empty
    ones, pos -1) and the chunk's T tokens (padding: pos -1).
    `score_fn(b, cands, chunk) -> (rank [K, C], carry [K, C])` over every head of row b;
    `keep_fn(b, held, new) -> kept count` (None: the budget)."""
    batch, num_tokens, num_kv_heads, head_dim = k.shape
    for b in range(batch):
      n = int(new_lengths[b])
      if n == 0:
        continue
      positions = self.lengths[b] + np.arange(num_tokens)
      positions = np.where(np.arange(num_tokens) < n, positions, -1)
      k_rot = np.where((positions >= 0)[:, None, None], rope(k[b], positions[:, None]), 0.0)
      v_new = np.where((positions >= 0)[:, None, None], v[b], 0.0)
      cands = []
      for h in range(num_kv_heads):
        old = self.kept[b][h]
        held = len(old["pos"])
        pad = self.budget - held
        old_k = np.zeros((0, head_dim)) if old["k"] is None else old["k"]
        old_v = np.zeros((0, head_dim)) if old["v"] is None else old["v"]
        cands.append(dict(
            pos=np.concatenate([old["pos"], -np.ones(pad, np.int64), positions]),
            k=np.concatenate([old_k, np.zeros((pad, head_dim)), k_rot[:, h]]),
            v=np.concatenate([old_v, np.zeros((pad, head_dim)), v_new[:, h]]),
            carried=np.concatenate([old["score"], np.zeros(pad + num_tokens)])))
      end = self.lengths[b] + n
      chunk = dict(q=q[b], q_pos=positions, end=end, n=n)
      rank, carry = score_fn(b, cands, chunk)
      held = len(self.kept[b][0]["pos"])
      keep = self.budget if keep_fn is None else keep_fn(b, held, n)
      for h, c in enumerate(cands):
        protect = (c["pos"] < self.num_sinks) | (c["pos"] > end - 1 - self.recent)
        priority = np.where(protect, np.inf, rank[h])
        priority = np.where(c["pos"] < 0, -np.inf, priority)
        chosen = np.argsort(-priority, kind="stable")[:keep]
        chosen = chosen[c["pos"][chosen] >= 0]
        chosen = chosen[np.argsort(c["pos"][chosen])]
        self.kept[b][h] = dict(pos=c["pos"][chosen], k=c["k"][chosen], v=c["v"][chosen],
                               score=np.where(np.isfinite(carry[h]), carry[h], 0.0)[chosen])
      self.lengths[b] = end

  def positions(self):
    """Sorted kept tokens per row and head: `[[list]]`."""
    return [[sorted(h["pos"].tolist()) for h in row] for row in self.kept]
