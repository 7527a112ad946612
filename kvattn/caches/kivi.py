"""KIVI: a 2- or 4-bit KV cache with a full-precision residual window (arXiv 2402.02750).

Liu et al. 2024, "KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV Cache": keys are
quantized per channel (one scale and zero point per channel over a group of `group_size`
consecutive tokens: key outliers live in a few channels), values per token (one scale and
zero point per token over groups of `group_size` channels), both asymmetric (min / max);
the newest tokens stay in the compute dtype and are flushed into the quantized store one
group of `group_size` tokens at a time (KIVI's algorithm 1; the paper's R is `residual`).

Keys before RoPE (KVQuant, Hooper et al. 2024, arXiv 2401.18079): with `pre_rope=True` the
store holds keys before RoPE and each dequantized block is rotated at its tokens' positions
inside the loop (the queries at theirs). Key positions are the token indices, so this mode
assumes the default positions (token t at position t, what `Transformer` and `generate`
use); `update_attend` checks that eagerly. `update` then takes keys BEFORE RoPE.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from kvattn import _checks
from kvattn.caches import _residual
from kvattn.caches import kivi_latent
from kvattn.caches import registry
from kvattn.caches._layers import cache_owners, gqa_layers
from kvattn.ops import lowbit

SCALE_DTYPES = _residual.SCALE_DTYPES
store_slots, ring_slots = _residual.store_slots, _residual.ring_slots


def value_group(group_size: int, head_dim: int) -> int:
  """Channels per value scale: `min(group_size, head_dim)`."""
  return min(group_size, head_dim)


def analytic_bytes_per_token(*, max_len: int, num_kv_heads: int, head_dim: int, bits: int,
                             group_size: int, residual: int, dtype: Any,
                             scale_dtype: Any = "float16") -> float:
  """Bytes per token slot of one layer's KIVI cache of capacity `max_len` (module doc): packed
  codes, scales and zero points of the store plus the residual ring, divided by `max_len`."""
  h, s = head_dim, jnp.dtype(scale_dtype).itemsize
  sq, rb = store_slots(max_len, residual, group_size), ring_slots(max_len, residual, group_size)
  per_store_slot = 2 * h * bits / 8 + 2 * h * s / group_size + 2 * (h // value_group(
      group_size, h)) * s
  return num_kv_heads * (sq * per_store_slot + rb * 2 * h * jnp.dtype(dtype).itemsize) / max_len


@struct.dataclass
class KIVICache(_residual.ResidualStoreCache):
  """KIVI cache of one GQA layer (module doc: layout, writing, attention).

  Attributes:
    k_codes, v_codes: `u8[B, K, Sq, H * bits / 8]` packed codes of the store.
    k_scale, k_zero: `[B, K, Sq / group_size, H]` per channel per token group.
    v_scale, v_zero: `[B, K, Sq, H / value_group]` per token per channel group.
    k_res, v_res: `[B, K, Rb, H]` the residual ring in the compute dtype.
    lengths: `i32[B]` tokens written (past `max_len` only after an overflow under jit).
    bits, group_size, residual, max_len, pre_rope: static settings.
    rope_theta, rope_scaling: the layer's RoPE (read only when `pre_rope`).
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
  pre_rope: bool = struct.field(pytree_node=False, default=False)
  rope_theta: float = struct.field(pytree_node=False, default=10000.0)
  rope_scaling: Any = struct.field(pytree_node=False, default=None)

  @classmethod
  def init(cls, batch: int, max_len: int, num_kv_heads: int, head_dim: int,
           dtype=jnp.float32, *, bits: int = 4, group_size: int = 32, residual: int = 128,
           pre_rope: bool = False, scale_dtype: Any = "float16", rope_theta: float = 10000.0,
           rope_scaling: Any = None) -> "KIVICache":
    """An empty cache (`lengths == 0`).

    Args:
      batch, max_len, num_kv_heads, head_dim: B, S, K, H.
      dtype: the residual's (compute) dtype, a float dtype.
      bits: 2 or 4.
      group_size: tokens per key group and channels per value group (capped at H); H must
        be a multiple of `min(group_size, H)`.
      residual: R, tokens kept in `dtype` (a multiple of `group_size`, >= 0).
      pre_rope: store keys before RoPE (module doc).
      scale_dtype: "float16", "bfloat16" or "float32".
      rope_theta, rope_scaling: the layer's RoPE (used when `pre_rope`).

    Raises:
      ValueError: a size that is not a positive int, `bits` not 2 / 4, `residual` not a
        multiple of `group_size`, H not a multiple of the value group or of `8 // bits`.
      TypeError: a `dtype` that is not floating (int8 / fp8: this kind quantizes itself).
    """
    batch = _checks.positive_int("batch", batch)
    max_len = _checks.positive_int("max_len", max_len)
    num_kv_heads = _checks.positive_int("num_kv_heads", num_kv_heads)
    head_dim = _checks.positive_int("head_dim", head_dim)
    if isinstance(bits, bool) or bits not in (2, 4):
      raise ValueError(f"bits must be one of (2, 4); got {bits!r}")
    group_size = _checks.positive_int("group_size", group_size)
    residual = _residual.check_residual(residual, group_size)
    vg = value_group(group_size, head_dim)
    if head_dim % vg:
      raise ValueError(f"head_dim must be a multiple of min(group_size, head_dim) = {vg}; got "
                       f"{head_dim}")
    width = lowbit.packed_width(head_dim, bits)
    dtype = _residual.check_float_dtype(dtype)
    if str(scale_dtype) not in SCALE_DTYPES and jnp.dtype(scale_dtype).name not in SCALE_DTYPES:
      raise ValueError(f"scale_dtype must be one of {SCALE_DTYPES}; got {scale_dtype!r}")
    sdt = jnp.dtype(scale_dtype)
    sq, rb = store_slots(max_len, residual, group_size), ring_slots(max_len, residual, group_size)
    bk = (batch, num_kv_heads)
    return cls(
        k_codes=jnp.zeros(bk + (sq, width), jnp.uint8),
        v_codes=jnp.zeros(bk + (sq, width), jnp.uint8),
        k_scale=jnp.ones(bk + (sq // group_size, head_dim), sdt),
        k_zero=jnp.zeros(bk + (sq // group_size, head_dim), sdt),
        v_scale=jnp.ones(bk + (sq, head_dim // vg), sdt),
        v_zero=jnp.zeros(bk + (sq, head_dim // vg), sdt),
        k_res=jnp.zeros(bk + (rb, head_dim), dtype), v_res=jnp.zeros(bk + (rb, head_dim), dtype),
        lengths=jnp.zeros((batch,), jnp.int32), bits=bits, group_size=group_size,
        residual=int(residual), max_len=max_len, pre_rope=bool(pre_rope),
        rope_theta=float(rope_theta), rope_scaling=rope_scaling)

  def storage_arrays(self) -> tuple[jax.Array, ...]:
    """Codes, scales, zero points and the residual ring (`lengths` is bookkeeping)."""
    return (self.k_codes, self.v_codes, self.k_scale, self.k_zero, self.v_scale, self.v_zero,
            self.k_res, self.v_res)

  def analytic_bytes_per_token(self) -> float:
    """`analytic_bytes_per_token` of this cache's settings (from sizes, not arrays)."""
    return analytic_bytes_per_token(
        max_len=self.max_len, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
        bits=self.bits, group_size=self.group_size, residual=self.residual, dtype=self.dtype,
        scale_dtype=self.k_scale.dtype)

  def read_block(self, offset: jax.Array, size: int) -> tuple[jax.Array, jax.Array]:
    """Store slots `[offset, offset + size)` dequantized: f32 `(k, v)` `[B, K, size, H]` (keys as
    stored). `offset` and `size` must be multiples of `group_size`."""
    g = self.group_size
    sl = lambda x, o, n: jax.lax.dynamic_slice_in_dim(x, o, n, axis=2)
    return self._dequantize(sl(self.k_codes, offset, size), sl(self.k_scale, offset // g, size // g),
                            sl(self.k_zero, offset // g, size // g), sl(self.v_codes, offset, size),
                            sl(self.v_scale, offset, size), sl(self.v_zero, offset, size))

  def _dequantize(self, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero):
    """f32 `(k, v)` `[B, K, n, H]` of n store slots' codes `u8[B, K, n, W]`, key group rows
    `[B, K, n / g, H]` and value scales `[B, K, n, H / vg]` (KIVI's dequantization)."""
    g, h = self.group_size, self.head_dim
    kc = lowbit.unpack_codes(k_codes, self.bits)
    vc = lowbit.unpack_codes(v_codes, self.bits)
    b, kh, size = kc.shape[:3]
    kc = kc.reshape(b, kh, size // g, g, h)
    k = lowbit.dequantize_groups(kc, k_scale, k_zero, axis=3).reshape(b, kh, size, h)
    vg = value_group(g, h)
    vc = vc.reshape(b, kh, size, h // vg, vg)
    v = lowbit.dequantize_groups(vc, v_scale, v_zero, axis=4).reshape(b, kh, size, h)
    return k, v

  def _store_decode(self, q, starts, lengths, implementation, **options):
    """The store by `kvattn.ops.dispatch`'s "kivi_store_decode" (`_residual`)."""
    from kvattn.ops import dispatch  # pylint: disable=g-import-not-at-top
    return dispatch.dispatch(
        "kivi_store_decode", implementation, q, self.k_codes, self.k_scale, self.k_zero,
        self.v_codes, self.v_scale, self.v_zero, starts, lengths, bits=self.bits,
        pre_rope=self.pre_rope, **options)

  def _encode(self, k: jax.Array, v: jax.Array, num_groups: int) -> dict[str, Any]:
    """The store fields of `num_groups` groups of tokens `k, v: [B, K, n g, H]` (f32): keys
    per channel over each group, values per token over `value_group` channels."""
    g = self.group_size
    b, kh, _, h = k.shape
    sdt = self.k_scale.dtype
    kc, ks, kz = lowbit.quantize_groups(k.reshape(b, kh, num_groups, g, h), self.bits,
                                        axis=3, scale_dtype=sdt)
    vg = value_group(g, h)
    vc, vs, vz = lowbit.quantize_groups(v.reshape(b, kh, num_groups * g, h // vg, vg),
                                        self.bits, axis=4, scale_dtype=sdt)
    kc = lowbit.pack_codes(kc.reshape(b, kh, num_groups * g, h), self.bits)
    vc = lowbit.pack_codes(vc.reshape(b, kh, num_groups * g, h), self.bits)
    return {"k_codes": (kc, "token"), "v_codes": (vc, "token"), "k_scale": (ks, "group"),
            "k_zero": (kz, "group"), "v_scale": (vs, "token"), "v_zero": (vz, "token")}


def build(bits: int):
  """The registry builder of kind `kivi{bits}`: one `KIVICache` per GQA layer."""

  def _build(model, batch, max_len, dtype, options, tokens_per_seq):
    del tokens_per_seq
    attns = [layer.attn for layer in cache_owners(model).layers]
    if any(hasattr(a, "kv_lora_rank") for a in attns):
      if options["pre_rope"]:
        raise ValueError("cache.pre_rope must be False for an MLA model (its shared RoPE key "
                         "k_rope reaches the cache RoPE'd); got cache.pre_rope = True")
      # MLA layers: their latents (kvattn.caches.kivi_latent); GQA layers checked below.
      mla = {i: kivi_latent.KIVILatentCache.init(
          batch, max_len, a.kv_lora_rank, a.qk_rope_head_dim, dtype, bits=bits,
          group_size=options["group_size"], residual=options["residual"],
          scale_dtype=options["scale_dtype"])
             for i, a in enumerate(attns) if hasattr(a, "kv_lora_rank")}
      if len(mla) == len(attns):
        return tuple(mla[i] for i in range(len(attns)))
    return tuple(KIVICache.init(
        batch, max_len, a.num_kv_heads, a.head_dim, dtype, bits=bits,
        group_size=options["group_size"], residual=options["residual"],
        pre_rope=options["pre_rope"], scale_dtype=options["scale_dtype"],
        rope_theta=a.rope_theta, rope_scaling=a.rope_scaling)
                 for a in gqa_layers(model))

  return _build


OPTIONS = {"group_size": 32, "residual": 128, "pre_rope": False, "scale_dtype": "float16"}
"""The registry options of `kivi2` / `kivi4` and their defaults (KIVI's G = 32, R = 128)."""


for _bits in (2, 4):
  registry.register_cache_kind(f"kivi{_bits}", registry.CacheKind(
      build(_bits), OPTIONS, f"KIVICache: {_bits}-bit keys per channel / values per token, "
      f"`residual` newest tokens in full precision", float_only=True))
