"""KIVI for MLA's latent cache: `c_kv` and `k_rope` at 2 or 4 bits with a full-precision ring.

DeepSeek-V2's MLA (arXiv 2405.04434) caches per token one latent `c_kv` (width C =
`kv_lora_rank`, after the latent RMSNorm) and one shared RoPE key `k_rope` (width R). This
cache stores both as KIVI does keys (Liu et al. 2024, arXiv 2402.02750): asymmetric codes
(scale and zero point, min / max) per channel over each group of `group_size` consecutive
tokens, packed into `uint8` along the channels (`8 // bits` per byte), and the newest
`residual` tokens (plus the partly filled group) in a ring in the compute dtype, flushed into
the store a group at a time (`_residual.ResidualStoreCache`'s writing, with one "KV head").
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from kvattn import _checks
from kvattn.caches import _residual
from kvattn.caches import dense as dense_lib
from kvattn.ops import lowbit

LATENT_BACKENDS = (None, "xla")


def analytic_bytes_per_token(*, max_len: int, kv_lora_rank: int, qk_rope_head_dim: int,
                             bits: int, group_size: int, residual: int, dtype: Any,
                             scale_dtype: Any = "float16") -> float:
  """Bytes per token slot of one layer's latent KIVI cache of capacity `max_len` (module doc):
  codes, scales and zero points of the store plus the ring, over `max_len`."""
  width, s = kv_lora_rank + qk_rope_head_dim, jnp.dtype(scale_dtype).itemsize
  sq = _residual.store_slots(max_len, residual, group_size)
  rb = _residual.ring_slots(max_len, residual, group_size)
  per_store_slot = width * bits / 8 + 2 * width * s / group_size
  return (sq * per_store_slot + rb * width * jnp.dtype(dtype).itemsize) / max_len


@struct.dataclass
class KIVILatentCache(_residual.ResidualStoreCache):
  """KIVI cache of one MLA layer's latents (module doc: layout, attention).

  Attributes:
    k_codes: `u8[B, 1, Sq, C * bits / 8]` packed `c_kv` codes.
    v_codes: `u8[B, 1, Sq, R * bits / 8]` packed `k_rope` codes.
    k_scale, k_zero: `[B, 1, Sq / g, C]`; v_scale, v_zero: `[B, 1, Sq / g, R]`.
    k_res: `[B, 1, Rb, C]`, v_res: `[B, 1, Rb, R]`: the ring in the compute dtype.
    lengths: `i32[B]` tokens written.
    bits, group_size, residual, max_len: static settings.
  """

  k_codes: jax.Array
  v_codes: jax.Array
  k_scale: jax.Array
  k_zero: jax.Array
  v_scale: jax.Array
  v_zero: jax.Array
  k_res: jax.Array
  v_res: jax.Array
  lengths: jax.Array
  bits: int = struct.field(pytree_node=False, default=4)
  group_size: int = struct.field(pytree_node=False, default=32)
  residual: int = struct.field(pytree_node=False, default=128)
  max_len: int = struct.field(pytree_node=False, default=0)
  pre_rope: bool = struct.field(pytree_node=False, default=False)  # always False (k_rope RoPE'd)
  rope_theta: float = struct.field(pytree_node=False, default=10000.0)  # unused
  rope_scaling: Any = struct.field(pytree_node=False, default=None)  # unused

  @classmethod
  def init(cls, batch: int, max_len: int, kv_lora_rank: int, qk_rope_head_dim: int,
           dtype=jnp.float32, *, bits: int = 4, group_size: int = 32, residual: int = 128,
           scale_dtype: Any = "float16") -> "KIVILatentCache":
    """An empty cache (`lengths == 0`).

    Args:
      batch, max_len, kv_lora_rank, qk_rope_head_dim: B, S, C, R.
      dtype: the ring's (compute) dtype, a float dtype.
      bits: 2 or 4 (C and R multiples of `8 // bits`).
      group_size: tokens per scale group (g).
      residual: tokens kept in `dtype`, a multiple of `group_size` (>= 0).
      scale_dtype: "float16", "bfloat16" or "float32".

    Raises:
      ValueError: a size that is not a positive int, `bits` not 2 / 4, `residual` not a
        multiple of `group_size`, C or R not a multiple of `8 // bits`, a bad `scale_dtype`.
      TypeError: a `dtype` that is not floating.
    """
    batch = _checks.positive_int("batch", batch)
    max_len = _checks.positive_int("max_len", max_len)
    c = _checks.positive_int("kv_lora_rank", kv_lora_rank)
    r = _checks.positive_int("qk_rope_head_dim", qk_rope_head_dim)
    if isinstance(bits, bool) or bits not in (2, 4):
      raise ValueError(f"bits must be one of (2, 4); got {bits!r}")
    group_size = _checks.positive_int("group_size", group_size)
    residual = _residual.check_residual(residual, group_size)
    for name, width in (("kv_lora_rank", c), ("qk_rope_head_dim", r)):
      if width % (8 // bits):
        raise ValueError(f"{name} must be a multiple of 8 // bits = {8 // bits} to pack "
                         f"{bits}-bit codes; got {width}")
    dtype = _residual.check_float_dtype(dtype)
    if str(scale_dtype) not in _residual.SCALE_DTYPES and (
        jnp.dtype(scale_dtype).name not in _residual.SCALE_DTYPES):
      raise ValueError(f"scale_dtype must be one of {_residual.SCALE_DTYPES}; got {scale_dtype!r}")
    sdt = jnp.dtype(scale_dtype)
    sq = _residual.store_slots(max_len, residual, group_size)
    rb = _residual.ring_slots(max_len, residual, group_size)
    b1 = (batch, 1)
    return cls(
        k_codes=jnp.zeros(b1 + (sq, lowbit.packed_width(c, bits)), jnp.uint8),
        v_codes=jnp.zeros(b1 + (sq, lowbit.packed_width(r, bits)), jnp.uint8),
        k_scale=jnp.ones(b1 + (sq // group_size, c), sdt),
        k_zero=jnp.zeros(b1 + (sq // group_size, c), sdt),
        v_scale=jnp.ones(b1 + (sq // group_size, r), sdt),
        v_zero=jnp.zeros(b1 + (sq // group_size, r), sdt),
        k_res=jnp.zeros(b1 + (rb, c), dtype), v_res=jnp.zeros(b1 + (rb, r), dtype),
        lengths=jnp.zeros((batch,), jnp.int32), bits=bits, group_size=group_size,
        residual=int(residual), max_len=max_len)

  # ---------------------------------------------------------------------------- sizes
  @property
  def kv_lora_rank(self) -> int:
    return self.k_res.shape[3]

  @property
  def qk_rope_head_dim(self) -> int:
    return self.v_res.shape[3]

  @property
  def num_kv_heads(self):
    """Not a GQA cache (so it never passes for a `GQACache`)."""
    raise AttributeError("a KIVILatentCache holds MLA latents, not KV heads")

  @property
  def head_dim(self):
    """Not a GQA cache (so it never passes for a `GQACache`)."""
    raise AttributeError("a KIVILatentCache holds MLA latents, not KV heads")

  def storage_arrays(self) -> tuple[jax.Array, ...]:
    """Codes, scales, zero points and the ring (`lengths` is bookkeeping)."""
    return (self.k_codes, self.v_codes, self.k_scale, self.k_zero, self.v_scale, self.v_zero,
            self.k_res, self.v_res)

  def analytic_bytes_per_token(self) -> float:
    """`analytic_bytes_per_token` of this cache's settings (from sizes, not arrays)."""
    return analytic_bytes_per_token(
        max_len=self.max_len, kv_lora_rank=self.kv_lora_rank,
        qk_rope_head_dim=self.qk_rope_head_dim, bits=self.bits, group_size=self.group_size,
        residual=self.residual, dtype=self.dtype, scale_dtype=self.k_scale.dtype)

  # ---------------------------------------------------------------------------- store
  def read_block(self, offset: jax.Array, size: int) -> tuple[jax.Array, jax.Array]:
    """Store slots `[offset, offset + size)` dequantized: f32 `(c_kv [B, 1, size, C],
    k_rope [B, 1, size, R])`; `offset`, `size` multiples of `group_size`."""
    g = self.group_size
    sl = lambda x, o, n: jax.lax.dynamic_slice_in_dim(x, o, n, axis=2)
    return tuple(
        self._dequantize(sl(codes, offset, size), sl(scale, offset // g, size // g),
                         sl(zero, offset // g, size // g))
        for codes, scale, zero in ((self.k_codes, self.k_scale, self.k_zero),
                                   (self.v_codes, self.v_scale, self.v_zero)))

  def _dequantize(self, codes, scale, zero):
    """f32 `[B, 1, n, W]` of n slots' packed codes and their group rows `[B, 1, n / g, W]`."""
    g = self.group_size
    c = lowbit.unpack_codes(codes, self.bits)
    b, one, n, w = c.shape
    x = lowbit.dequantize_groups(c.reshape(b, one, n // g, g, w), scale, zero, axis=3)
    return x.reshape(b, one, n, w)

  def _encode(self, k: jax.Array, v: jax.Array, num_groups: int) -> dict[str, Any]:
    """Store fields of `num_groups` groups of latents `k: [B, 1, n g, C]` and RoPE keys
    `v: [B, 1, n g, R]` (f32): per channel over each group of tokens."""
    g, sdt = self.group_size, self.k_scale.dtype
    out = {}
    for part, x in (("k", k), ("v", v)):
      b, one, _, w = x.shape
      codes, scale, zero = lowbit.quantize_groups(x.reshape(b, one, num_groups, g, w), self.bits,
                                                  axis=3, scale_dtype=sdt)
      codes = lowbit.pack_codes(codes.reshape(b, one, num_groups * g, w), self.bits)
      out.update({f"{part}_codes": (codes, "token"), f"{part}_scale": (scale, "group"),
                  f"{part}_zero": (zero, "group")})
    return out

  # ---------------------------------------------------------------------------- writing
  def update(self, c_kv_new: jax.Array, k_rope_new: jax.Array,
             new_lengths: jax.Array | None = None) -> "KIVILatentCache":
    """Writes `c_kv_new: [B, T, C]` (normalised latents) and `k_rope_new: [B, T, R]` (RoPE'd)
    for tokens `t < new_lengths[b]`: complete groups beyond the residual into the store, the
    rest into the ring.

    Raises:
      ValueError, TypeError: as `LatentCache.update` (shapes, dtypes, `new_lengths`, an eager
        overflow).
    """
    for name, x, width, letter in (("c_kv_new", c_kv_new, self.kv_lora_rank, "C"),
                                   ("k_rope_new", k_rope_new, self.qk_rope_head_dim, "R")):
      _checks.rank(name, x, 3, f"[B, T, {letter}]")
      _checks.floating(name, x)
      if x.shape[0] != self.batch or x.shape[2] != width:
        raise ValueError(f"{name} must have shape [B, T, {letter}] = ({self.batch}, T, {width}); "
                         f"got {tuple(x.shape)}")
    if c_kv_new.shape[1] != k_rope_new.shape[1]:
      raise ValueError(f"c_kv_new and k_rope_new must have the same T; got "
                       f"{tuple(c_kv_new.shape)} and {tuple(k_rope_new.shape)}")
    new_lengths = dense_lib.resolve_new_lengths(new_lengths, self.batch, c_kv_new.shape[1])
    return self.update_unchecked(c_kv_new, k_rope_new, new_lengths)

  def update_unchecked(self, c_kv_new: jax.Array, k_rope_new: jax.Array,
                       new_lengths: jax.Array) -> "KIVILatentCache":
    """`update` for callers that checked the arguments (the MLA module, `protocol.write`)."""
    return super().update_unchecked(c_kv_new[:, :, None], k_rope_new[:, :, None], new_lengths)

  def update_attend(self, *args, **kwargs):
    """Not an MLA member: the MLA module writes with `update` and reads with `attend`."""
    raise TypeError("KIVILatentCache is an MLA cache: write with update(c_kv_new, k_rope_new) "
                    "and read with attend / attend_expanded")

  update_attend_unchecked = update_attend

  # ---------------------------------------------------------------------------- reading
  def latents(self, dtype=jnp.float32) -> tuple[jax.Array, jax.Array]:
    """`(c_kv [B, S, C], k_rope [B, S, R])` in token order (token s in slot s, zeros where no
    token): the store dequantized and the ring's tokens put back. A copy: for the naive path,
    tests and references, never the absorbed decode."""
    b, s = self.batch, self.max_len
    nq, ring_tokens = self.readable_quantized, self.ring_tokens()
    parts = self.read_block(jnp.int32(0), self.store_capacity) if self.store_capacity else None
    out = []
    for i, res in enumerate((self.k_res, self.v_res)):
      w = res.shape[3]
      full = jnp.zeros((b, s, w), jnp.float32)
      if parts is not None:
        used = (jnp.arange(self.store_capacity)[None, :] < nq[:, None])[..., None]
        full = full.at[:, :self.store_capacity].set(jnp.where(used, parts[i][:, 0], 0.0))
      rows = jnp.broadcast_to(jnp.arange(b)[:, None], ring_tokens.shape)
      dest = jnp.where(ring_tokens >= 0, ring_tokens, s)
      full = full.at[rows, dest].set(res[:, 0].astype(jnp.float32), mode="drop")
      out.append(full.astype(dtype))
    return tuple(out)

  def dequantized(self, dtype=jnp.float32) -> tuple[jax.Array, jax.Array]:
    """`latents(dtype)` (the base class's name for the token-order copy)."""
    return self.latents(dtype)

  def attend(self, q_latent: jax.Array, q_rope: jax.Array, *, q_offsets: jax.Array,
             sm_scale: float, window: int | None = None,
             implementation: str | None = None) -> jax.Array:
    """`MLACache.attend`, absorbed: `q_latent: [B, T, N, C]`, `q_rope: [B, T, N, R]` against
    the store (block by block, dequantized inside the loop) and the ring; `[B, T, N, C]` in
    q_latent's dtype.

    Raises:
      NotImplementedError: `implementation` other than None / "xla" (no kernel reads a
        latent store).
    """
    names = (implementation,) if implementation is None or isinstance(implementation, str) else (
        tuple(implementation))
    if not any(n in LATENT_BACKENDS for n in names):
      raise NotImplementedError(f"a KIVILatentCache is read by the XLA loop of kvattn.ops.lowbit "
                                f"only; implementation must be None or 'xla' (or a sequence "
                                f"naming one); got {implementation!r}")
    q = jnp.concatenate([q_latent, q_rope.astype(q_latent.dtype)], axis=-1)
    q_tokens = q_offsets[:, None] + jnp.arange(q.shape[1], dtype=jnp.int32)[None, :]

    def read(offset, size):
      c, r = self.read_block(offset, size)
      return jnp.concatenate([c, r], axis=-1), c

    c_res = self.k_res.astype(jnp.float32)
    ring = (jnp.concatenate([c_res, self.v_res.astype(jnp.float32)], axis=-1), c_res,
            self.ring_tokens())
    out = lowbit.blocked_attention(
        q, q_tokens, num_quantized=self.readable_quantized, store_capacity=self.store_capacity,
        read_block=read if self.store_capacity else None, block_size=self._block_size(),
        segments=[ring], sm_scale=float(sm_scale), window=window)
    return out.astype(q_latent.dtype)

  def attend_expanded(self, q: jax.Array, expand, *, dtype: Any, q_offsets: jax.Array,
                      sm_scale: float, window: int | None = None) -> jax.Array:
    """`MLACache.attend_expanded`: the latents dequantized in token order (`latents`), expanded
    by `expand` into per-head keys and values, then `kvattn.ops.attention`; `[B, T, N, Hv]`."""
    from kvattn import ops  # pylint: disable=g-import-not-at-top
    c_kv, k_rope = self.latents(dtype)
    k, v = expand(c_kv, k_rope)
    return ops.attention(q, k, v, q_offsets=q_offsets, kv_lengths=self._stored(),
                         sm_scale=sm_scale, window=window)


def latent_attention_reference(
    q_latent: jax.Array,  # [B, T, N, C]
    q_rope: jax.Array,  # [B, T, N, R]
    c_kv: jax.Array,  # [B, S, C] f32, token s in slot s
    k_rope: jax.Array,  # [B, S, R]
    lengths: jax.Array,  # i32[B]
    q_offsets: jax.Array,  # i32[B]
    *,
    sm_scale: float,
    window: int | None = None,
) -> jax.Array:
  """Plain f32 absorbed MLA attention over dense latents in token order (the reference of
  `KIVILatentCache.attend`): logits `sm_scale (q_latent . c_kv + q_rope . k_rope)`, values
  `c_kv`, query t of row b at token `q_offsets[b] + t`. Returns f32 `[B, T, N, C]`."""
  q = jnp.concatenate([q_latent, q_rope], axis=-1).astype(jnp.float32)
  k = jnp.concatenate([c_kv, k_rope], axis=-1).astype(jnp.float32)[:, None]
  q_tokens = q_offsets[:, None] + jnp.arange(q.shape[1], dtype=jnp.int32)[None, :]
  return lowbit.blocked_attention_reference(q, q_tokens, k, c_kv.astype(jnp.float32)[:, None],
                                            lengths, sm_scale=sm_scale, window=window)
