"""Blocked XLA decode attention: the flash-decoding recurrence as an XLA while loop.

The `"xla_blocked"` backend of `kvattn.ops.decode_attention` and
`mla_decode_attention`. It walks the key axis in blocks of `block_k` slots
with `lax.fori_loop`, keeping the running max, sum and f32 accumulator of the
online softmax (FlashAttention-2, Dao 2023, algorithm 1), so each K/V block is
read once and no `[B, N, S]` logits exist. The loop runs only over the blocks
some sequence of the batch attends (`[min_b start_b, max_b length_b)`), so the
work follows the longest real length, not the capacity.

Semantics are `decode_attention_xla`'s (query at slot `lengths[b] - 1`,
window, soft cap, zeros for length-0 rows, lengths clamped to S); masked
logits are replaced by -inf, their probabilities are exact zeros and masked
value rows are zeroed in the block, so garbage in unused slots cannot leak.
Quantized caches (int8 / fp8 with f32 per-slot scales) are converted to f32
block by block, the scales multiplying the block's logits and probabilities.

With `implementation=None` it runs only on CPU and only for int8/fp8 caches
whose f32 conversion reaches `MIN_CONVERTED_BYTES_QUANT[format]` bytes
(`_fits`; the measurements behind this are in docs/benchmarks.md, "Design
notes from measurements"). Named explicitly it runs anywhere.
"""

from __future__ import annotations

import jax
from jax import lax
import jax.numpy as jnp

from kvattn.ops import quant
from pallas_kernels import attention_common as common

# Bytes of one f32 K/V block (B * K * block_k * (H + Hv) * 4). Measured on a
# 2-core CPU (experiments/bench_decode.py): 1-4 MiB blocks were fastest for
# B * K = 32 (64-128 slots), B * K = 8 (256-512), B * K = 1 (2048) and MLA
# with B = 4, C + R = 576 (128): enough work per loop iteration to hide its
# overhead, little enough to stay in cache between the two dots.
_BLOCK_BYTES = 2 << 20
# Quantized caches: the plain path's dots make XLA:CPU convert the whole int8/fp8 cache to
# an f32 copy of B * K * S * (H + Hv) * 4 bytes every step. Measured on the 2-core CPU
# (experiments/bench_quant_decode.py, two runs; docs/benchmarks.md "Quantized cache"), int8:
# plain was as fast or faster up to a 4 MiB copy; at 16 MiB (H = 64, S = 1024) blocked was
# 0.9-1.6x the plain speed, at 32-64 MiB (H = 128) 3-7x. fp8 (converted in software on CPU):
# at 16 MiB blocked was 2x slower, at 32-64 MiB 1.0-1.4x faster. So the blocked path is
# picked from these many bytes of converted cache, per format.
MIN_CONVERTED_BYTES_QUANT = {"int8": 8 << 20, "float8_e4m3fn": 32 << 20,
                             "float8_e5m2": 32 << 20}


def _block_size(capacity: int, rows: int, width: int) -> int | None:
  """Slots per block: a power of two near 2 MiB / (rows * width * 4), dividing S."""
  target = max(1, _BLOCK_BYTES // (rows * width * 4))
  bk = min(2048, max(64, 1 << (target.bit_length() - 1)))
  while bk >= 16:
    if capacity % bk == 0:
      return bk
    bk //= 2
  return None


def blocked_decode(
    q1: jax.Array,        # [B, K, G, H1] f32, already scaled by sm_scale
    q2: jax.Array | None,  # [B, K, G, H2] f32 (scaled) or None
    k1: jax.Array,        # [B, K, S, H1], or [B, S, H1] meaning K = 1
    k2: jax.Array | None,  # like k1 with width H2, or None
    v: jax.Array | None,  # like k1 with width Hv, or None: the value is k1
    lengths: jax.Array,   # i32[B]
    *,
    window: int | None,
    soft_cap: float | None,
    block_k: int,
    scales: tuple[jax.Array | None, jax.Array | None, jax.Array | None] = (None, None, None),
) -> jax.Array:
  """Returns f32 `[B, K, G, Hv]`: attention over slots `[max(0, L - W), L)`.

  Three-axis caches (MLA's `[B, S, C]`) are sliced as they are and given
  their unit K axis per block: reshaping the whole cache outside the loop
  made XLA:CPU copy it into the loop state on every call.

  `scales = (s1, s2, sv)`: per-slot scales (`f32[B, K, S]`, or `[B, S]` for
  three-axis caches) of a quantized k1, k2 and v (sv is ignored when the
  value is k1, which then uses s1), or None for float operands.
  """
  slot_axis = k1.ndim - 2
  batch, capacity = k1.shape[0], k1.shape[slot_axis]
  num_kv = k1.shape[1] if k1.ndim == 4 else 1
  starts, lengths = common.attended_range(lengths, capacity, window)
  first = jnp.min(starts) // block_k
  last = (jnp.max(lengths) + block_k - 1) // block_k
  values = k1 if v is None else v
  groups, hv = q1.shape[2], values.shape[-1]
  s1, s2, sv = scales
  if v is None:
    sv = s1

  def block(x, offset):  # [B, K, bk, X] f32
    x = lax.dynamic_slice_in_dim(x, offset, block_k, axis=slot_axis).astype(jnp.float32)
    return x if x.ndim == 4 else x[:, None]

  def scale_block(x, offset):  # [B, K, 1, bk] f32 (broadcasts over G)
    x = lax.dynamic_slice_in_dim(x, offset, block_k, axis=x.ndim - 1).astype(jnp.float32)
    return (x if x.ndim == 3 else x[:, None])[:, :, None, :]

  def scaled(s, scale, offset):
    return s if scale is None else s * scale_block(scale, offset)

  def body(i, carry):
    m, l, acc = carry
    offset = i * block_k
    kb = block(k1, offset)
    s = scaled(jnp.einsum("BKGH,BKSH->BKGS", q1, kb), s1, offset)
    if k2 is not None:
      s = s + scaled(jnp.einsum("BKGR,BKSR->BKGS", q2, block(k2, offset)), s2, offset)
    if soft_cap is not None:
      s = soft_cap * jnp.tanh(s / soft_cap)
    slots = offset + jnp.arange(block_k, dtype=jnp.int32)
    valid = (slots[None] >= starts[:, None]) & (slots[None] < lengths[:, None])  # [B, bk]
    s = jnp.where(valid[:, None, None], s, -jnp.inf)
    m_next = jnp.maximum(m, jnp.max(s, axis=-1))
    alpha = jnp.exp(m - m_next)
    p = jnp.exp(s - m_next[..., None])
    vb = kb if v is None else block(v, offset)
    vb = jnp.where(valid[:, None, :, None], vb, 0.0)
    pv = p if sv is None else p * jnp.where(valid[:, None, None, :],
                                            scale_block(sv, offset), 0.0)
    acc = alpha[..., None] * acc + jnp.einsum("BKGS,BKSV->BKGV", pv, vb)
    return m_next, alpha * l + jnp.sum(p, axis=-1), acc

  init = (jnp.full((batch, num_kv, groups), common.M_INIT, jnp.float32),
          jnp.zeros((batch, num_kv, groups), jnp.float32),
          jnp.zeros((batch, num_kv, groups, hv), jnp.float32))
  _, l, acc = lax.fori_loop(first, last, body, init)
  return acc / jnp.where(l > 0, l, 1.0)[..., None]


def _fits(dtype, capacity: int, rows: int, width: int) -> None:
  """Raises NotImplementedError where the plain path is as fast (see the constants).

  `rows` is B * K, `width` the elements read per slot (H + Hv; MLA C + R).
  """
  if jax.default_backend() != "cpu":
    raise NotImplementedError("xla_blocked: tuned for XLA:CPU only")
  if quant.is_quantized(dtype):
    converted, needed = rows * capacity * width * 4, MIN_CONVERTED_BYTES_QUANT[dtype.name]
    if converted < needed:
      raise NotImplementedError(
          f"xla_blocked: quantized cache whose f32 conversion ({converted} bytes) is below "
          f"{needed} for {dtype.name}")
  else:
    raise NotImplementedError(
        f"xla_blocked: not picked automatically for {dtype} caches (slower than the plain "
        "path inside the compiled generate loop); name it to use it")
  if capacity % 16:
    raise NotImplementedError(f"xla_blocked: S={capacity} is not a multiple of 16")


def decode_attention_blocked(
    q: jax.Array,        # [B, N, H]
    k: jax.Array,        # [B, K, S, H]
    v: jax.Array,        # [B, K, S, Hv]
    lengths: jax.Array,  # i32[B]
    *,
    sm_scale: float | None = None,
    window: int | None = None,
    soft_cap: float | None = None,
    block_k: int | None = None,
    k_scale: jax.Array | None = None,  # f32[B, K, S]
    v_scale: jax.Array | None = None,  # f32[B, K, S]
) -> jax.Array:
  """`decode_attention_xla` semantics computed block by block.

  `block_k` (slots per loop iteration, must divide S) defaults to a size
  tuned for XLA:CPU. `k_scale, v_scale` are the scales of a quantized
  (int8/fp8) cache, applied per block. Returns `[B, N, Hv]` in q's dtype.
  """
  batch, num_kv, capacity, head_dim = k.shape
  width = head_dim + v.shape[-1]
  block_k = block_k or _block_size(capacity, batch * num_kv, width) or capacity
  scale = head_dim ** -0.5 if sm_scale is None else sm_scale
  qg = q.astype(jnp.float32).reshape(batch, num_kv, -1, head_dim) * scale
  out = blocked_decode(qg, None, k, None, v, lengths, window=window, soft_cap=soft_cap,
                       block_k=block_k, scales=(k_scale, None, v_scale))
  return out.reshape(batch, q.shape[1], v.shape[-1]).astype(q.dtype)


def mla_decode_attention_blocked(
    q_latent: jax.Array,  # [B, N, C]
    q_rope: jax.Array,    # [B, N, R]
    c_kv: jax.Array,      # [B, S, C]
    k_rope: jax.Array,    # [B, S, R]
    lengths: jax.Array,   # i32[B]
    *,
    sm_scale: float,
    window: int | None = None,
    block_k: int | None = None,
    c_kv_scale: jax.Array | None = None,  # f32[B, S]
    k_rope_scale: jax.Array | None = None,  # f32[B, S]
) -> jax.Array:
  """`mla_decode_attention_xla` semantics, blocked: key `[c_kv | k_rope]`, value c_kv.

  The two key parts are read in place (no concatenation); a quantized cache's
  scales are applied per block. Returns `[B, N, C]`.
  """
  batch, capacity, latent = c_kv.shape
  block_k = block_k or _block_size(capacity, batch, latent + k_rope.shape[-1]) or capacity
  f32 = jnp.float32
  out = blocked_decode((q_latent.astype(f32) * sm_scale)[:, None],
                       (q_rope.astype(f32) * sm_scale)[:, None], c_kv, k_rope, None,
                       lengths, window=window, soft_cap=None,
                       block_k=block_k, scales=(c_kv_scale, k_rope_scale, None))
  return out[:, 0].astype(q_latent.dtype)


def _decode(q, k, v, lengths, *, explicit, **options):
  if not explicit:
    _fits(k.dtype, k.shape[2], k.shape[0] * k.shape[1], k.shape[3] + v.shape[3])
  return decode_attention_blocked(q, k, v, lengths, **options)


def _mla_decode(q_latent, q_rope, c_kv, k_rope, lengths, *, explicit, **options):
  if not explicit:
    _fits(c_kv.dtype, c_kv.shape[1], c_kv.shape[0], c_kv.shape[2] + k_rope.shape[2])
  return mla_decode_attention_blocked(q_latent, q_rope, c_kv, k_rope, lengths, **options)

