"""XLA attention over cache slots that carry their token positions.

The long-context caches (`caches.window`, `caches.eviction`) hold tokens out of order,
so each slot carries its token (`kv_pos`, -1 for none) and query t (token `q_pos[b, t]`)
sees slot s iff `0 <= kv_pos[s] <= q_pos[t]` and, with a window W, `kv_pos[s] > q_pos[t]
- W` (`always_visible` slots, attention sinks, skip the window). The math is
`kvattn.ops.attention`'s; the probability mass per KV head and slot is returned for the
eviction policies (H2O, SnapKV, TOVA). Queries run in chunks of `query_chunk` (`lax.scan`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kvattn import _checks


def _chunk_attention(q, k, v, q_pos, kv_pos, visible_always, q_alt, score_rows, *, sm_scale,
                     window, soft_cap, k_scale, v_scale):
  """One block of queries: `q [B, C, N, H]` -> (`out [B, C, N, Hv]` f32, `mass f32[B, K, S]`)."""
  batch, num_kv_heads, _, head_dim = k.shape
  _, chunk, num_heads, _ = q.shape
  groups = num_heads // num_kv_heads

  def logits_of(query):
    qg = jnp.moveaxis(query.reshape(batch, chunk, num_kv_heads, groups, head_dim), 1, 3)
    return jnp.einsum("BKGTH,BKSH->BKGTS", qg, k.astype(query.dtype),
                      preferred_element_type=jnp.float32) * sm_scale

  logits = logits_of(q)
  if q_alt is not None:
    logits = jnp.where(visible_always[:, None, None, None, :], logits_of(q_alt), logits)
  if k_scale is not None:
    logits = logits * k_scale.astype(jnp.float32)[:, :, None, None, :]
  if soft_cap is not None:
    logits = soft_cap * jnp.tanh(logits / soft_cap)
  qp = q_pos[:, None, None, :, None]  # [B, 1, 1, C, 1]
  kp = kv_pos[:, :, None, None, :]  # [B, K, 1, 1, S]
  mask = (kp >= 0) & (kp <= qp)
  if window is not None:
    in_window = kp > qp - window
    if visible_always is not None:
      in_window |= visible_always[:, None, None, None, :]
    mask &= in_window
  logits = jnp.where(mask, logits, -jnp.inf)
  row_max = jnp.max(logits, axis=-1, keepdims=True)
  row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
  probs = jnp.where(mask, jnp.exp(logits - row_max), 0.0)
  denom = jnp.sum(probs, axis=-1, keepdims=True)
  probs = probs / jnp.where(denom > 0, denom, 1.0)  # [B, K, G, C, S], rows sum to 1 or 0
  weights = probs
  if v_scale is not None:
    weights = probs * v_scale.astype(jnp.float32)[:, :, None, None, :]
  visible = jnp.any(mask, axis=(2, 3))  # [B, K, S]: only these values may reach the output
  values = jnp.where(visible[..., None], v, jnp.zeros((), v.dtype))
  out = jnp.einsum("BKGTS,BKSV->BKGTV", weights, values.astype(jnp.float32),
                   preferred_element_type=jnp.float32)
  out = jnp.moveaxis(out, 3, 1).reshape(batch, chunk, num_heads, v.shape[-1])
  mass = jnp.einsum("BKGTS,BT->BKS", probs, score_rows.astype(jnp.float32))
  return out, mass


def positional_attention(
    q: jax.Array,  # [B, T, N, H]
    k: jax.Array,  # [B, K, S, H]
    v: jax.Array,  # [B, K, S, Hv]
    q_pos: jax.Array,  # i32[B, T]
    kv_pos: jax.Array,  # i32[B, S] or i32[B, K, S]
    *,
    sm_scale: float | None = None,
    window: int | None = None,
    soft_cap: float | None = None,
    k_scale: jax.Array | None = None,  # f32[B, K, S]
    v_scale: jax.Array | None = None,  # f32[B, K, S]
    always_visible: jax.Array | None = None,  # bool[B, S]
    q_always_visible: jax.Array | None = None,  # [B, T, N, H]
    score_queries: jax.Array | None = None,  # bool[B, T]
    score_window: int | None = None,
    query_chunk: int = 256,
) -> tuple[jax.Array, jax.Array | None]:
  """Attention of `q: [B, T, N, H]` against S slots holding tokens `kv_pos` (`i32[B, S]` or
  per KV head `i32[B, K, S]`).

  `q_always_visible`: the queries used against `always_visible: bool[B, S]` slots (default
  q). `score_queries: bool[B, T]`: whose probabilities make the mass (None: no mass).
  `score_window`: None, or W such that each row's scoring queries lie among the W queries
  ending at its last one (SnapKV's observation window, TOVA's newest query): the mass is then
  computed from those W queries gathered per row, not from all T (the output, when it is
  used, from all T without the mass); a scoring query outside them is not counted.

  Returns:
    `(out [B, T, N, Hv]` in q's dtype, `mass f32[B, K, S]` or None)`.

  Raises:
    ValueError, TypeError: ranks, shapes or dtypes that do not fit.
  """
  _checks.rank("q", q, 4, "[B, T, N, H]")
  _checks.rank("k", k, 4, "[B, K, S, H]")
  _checks.rank("v", v, 4, "[B, K, S, Hv]")
  _checks.floating("q", q)
  _checks.integer("q_pos", q_pos)
  _checks.integer("kv_pos", kv_pos)
  batch, num_kv_heads, capacity, head_dim = k.shape
  _, num_tokens, num_heads, _ = q.shape
  _checks.head_layout(num_heads, num_kv_heads)
  if q.shape[0] != batch or q.shape[-1] != head_dim:
    raise ValueError(f"q must have shape [B, T, N, H] with B, H = {batch}, {head_dim} from k; "
                     f"got {tuple(q.shape)}")
  if v.shape[:3] != k.shape[:3]:
    raise ValueError(f"v must have shape [B, K, S, Hv] = {k.shape[:3]} + (Hv,); got {v.shape}")
  if q_pos.shape != (batch, num_tokens):
    raise ValueError(f"q_pos must have shape [B, T] = ({batch}, {num_tokens}); got {q_pos.shape}")
  if kv_pos.shape not in ((batch, capacity), (batch, num_kv_heads, capacity)):
    raise ValueError(f"kv_pos must have shape [B, S] or [B, K, S] = ({batch}, [{num_kv_heads}, ]"
                     f"{capacity}); got {kv_pos.shape}")
  window = _checks.optional_positive_int("window", window)
  score_window = _checks.optional_positive_int("score_window", score_window)
  query_chunk = _checks.positive_int("query_chunk", query_chunk)
  if sm_scale is None:
    sm_scale = head_dim ** -0.5
  if kv_pos.ndim == 2:
    kv_pos = jnp.broadcast_to(kv_pos[:, None], (batch, num_kv_heads, capacity))
  kv_pos = kv_pos.astype(jnp.int32)
  q_pos = q_pos.astype(jnp.int32)
  want_mass = score_queries is not None
  rows = (jnp.zeros((batch, num_tokens), bool) if score_queries is None
          else jnp.asarray(score_queries, bool))
  if always_visible is None and q_always_visible is not None:
    raise ValueError("q_always_visible needs always_visible")
  opts = dict(sm_scale=sm_scale, window=window, soft_cap=soft_cap, k_scale=k_scale,
              v_scale=v_scale)
  if want_mass and score_window is not None and score_window < num_tokens:
    out, _ = positional_attention(q, k, v, q_pos, kv_pos, always_visible=always_visible,
                                  q_always_visible=q_always_visible, query_chunk=query_chunk,
                                  **opts)
    # Row b's window: the score_window queries ending at its last scoring query (a row with
    # none gathers rows that are all False and adds no mass).
    last = num_tokens - 1 - jnp.argmax(rows[:, ::-1], axis=1).astype(jnp.int32)
    idx = last[:, None] + jnp.arange(1 - score_window, 1, dtype=jnp.int32)[None, :]  # [B, W]
    inside = idx >= 0
    idx = jnp.maximum(idx, 0)
    gather = lambda x: jnp.take_along_axis(x, idx.reshape(idx.shape + (1,) * (x.ndim - 2)),
                                           axis=1)
    _, mass = _chunk_attention(gather(q), k, v, jnp.where(inside, gather(q_pos), -1), kv_pos,
                               always_visible, None if q_always_visible is None
                               else gather(q_always_visible), gather(rows) & inside, **opts)
    return out, mass

  if num_tokens <= query_chunk:
    out, mass = _chunk_attention(q, k, v, q_pos, kv_pos, always_visible, q_always_visible,
                                 rows, **opts)
    return out.astype(q.dtype), (mass if want_mass else None)

  pad = -num_tokens % query_chunk
  blocks = (num_tokens + pad) // query_chunk

  def split(x, fill):
    x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2), constant_values=fill)
    return jnp.moveaxis(x.reshape((batch, blocks, query_chunk) + x.shape[2:]), 1, 0)

  xs = (split(q, 0), split(q_pos, -1), split(rows, False),
        None if q_always_visible is None else split(q_always_visible, 0))

  def body(mass, x):
    qc, pc, rc, qa = x
    chunk = functools.partial(_chunk_attention, qc, k, v, pc, kv_pos, always_visible, qa,
                              **opts)
    if not want_mass:
      out, m = chunk(rc)
      return mass, out
    # A block without scoring queries (SnapKV's window is the last tokens) adds no mass: its
    # branch has none to compute, and where the output is not used either (a context written
    # only for its scores) XLA drops the block's work.
    out, m = jax.lax.cond(jnp.any(rc), lambda: chunk(rc),
                          lambda: (chunk(rc)[0], jnp.zeros_like(mass)))
    return mass + m, out

  mass, outs = jax.lax.scan(body, jnp.zeros((batch, num_kv_heads, capacity), jnp.float32), xs)
  out = jnp.moveaxis(outs, 0, 1).reshape(batch, blocks * query_chunk, num_heads, v.shape[-1])
  return out[:, :num_tokens].astype(q.dtype), (mass if want_mass else None)


def positional_decode_attention(
    q: jax.Array,  # [B, N, H]
    k: jax.Array,  # [B, K, S, H]
    v: jax.Array,  # [B, K, S, Hv]
    q_pos: jax.Array,  # i32[B]
    kv_pos: jax.Array,  # i32[B, S] or i32[B, K, S]
    **options,
) -> tuple[jax.Array, jax.Array]:
  """One decode query per sequence: `(out [B, N, Hv], probs f32[B, K, S])`, the
  probability mass the G heads of KV head k gave each slot.
  """
  _checks.rank("q", q, 3, "[B, N, H]")
  q_pos = jnp.asarray(q_pos)
  _checks.rank("q_pos", q_pos, 1, "[B]")
  extra = {name: options.pop(name)[:, None] for name in ("q_always_visible",)
           if options.get(name) is not None}
  out, probs = positional_attention(q[:, None], k, v, q_pos[:, None], kv_pos,
                                    score_queries=jnp.ones((q.shape[0], 1), bool),
                                    **extra, **options)
  return out[:, 0], probs
