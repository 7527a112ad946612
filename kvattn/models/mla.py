"""Multi-head Latent Attention (DeepSeek-V2, arXiv 2405.04434, §2.1 and appendix C).

Caches only `c_kv = RMSNorm(x W_DKV): [B, T, C]` (eq. 9) and the shared rope key
`k_rope = RoPE(x W_KR): [B, T, R]` (eq. 15-17): `(C + R) * itemsize` bytes per token and layer.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from kvattn import _checks
from kvattn.caches import dense as cache_lib
from kvattn import ops
from kvattn.caches.protocol import MLACache, type_error, write
from kvattn.models import int8 as int8_lib
from kvattn.models.gqa import check_input, resolve_positions

PATHS = ("auto", "naive", "absorbed")
DECODE_OP = "mla_decode_attention"
"""The `kvattn.ops` dispatch point an MLA layer decodes through (absorbed path)."""


def decode_implementations() -> tuple[str, ...]:
  """Backend names `decode_implementation` may take (`kvattn.ops.available_implementations`
  of the MLA decode op), sorted."""
  return tuple(sorted(ops.available_implementations(DECODE_OP)))


def _init(in_axis, out_axis):
  return nnx.initializers.variance_scaling(
      1.0, "fan_in", "truncated_normal", in_axis=in_axis, out_axis=out_axis)


def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
  """RMSNorm (Zhang & Sennrich 2019) over the last axis in f32: `x / sqrt(mean(x^2) + eps) *
  scale` in x's dtype."""
  xf = x.astype(jnp.float32)
  norm = jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
  return (xf * norm * scale.astype(jnp.float32)).astype(x.dtype)


class MultiHeadLatentAttention(nnx.Module):
  """DeepSeek-V2 Multi-head Latent Attention with a latent KV cache (any `MLACache`).

  `kvattn.LatentCache`: `c_kv: [B, S, C]` (normed), `k_rope: [B, S, R]` (rotated), `lengths:
  i32[B]`; int8 / fp8 add `c_kv_scale, k_rope_scale: f32[B, S]`. Call as
  `kvattn.GroupedQueryAttention`: `y, cache = attn(x [B, T, D], cache=None, positions=None,
  new_lengths=None)`.

  Paths (`path`), equal up to float reassociation: `"naive"` expands per-head keys
  `[c_kv W_UK | k_rope]` and values `c_kv W_UV` (`ops.attention`); `"absorbed"` attends the
  latents with `q_nope W_UK^T: [B, T, N, C]` (appendix C; `ops.mla_decode_attention` for
  T == 1); `"auto"` (default): absorbed for T == 1 with a cache, else naive.

  Parameters (Hn = qk_nope_head_dim, Hv = v_head_dim): `q_proj [D, N, Hn + R]` or
  `q_down_proj [D, Cq]`, `q_norm [Cq]`, `q_up_proj [Cq, N, Hn + R]`; `kv_down_proj [D, C + R]`;
  `kv_norm [C]`; `k_up_proj [C, N, Hn]`; `v_up_proj [C, N, Hv]`; `o_proj [N, Hv, D]`.
  """

  def __init__(
      self,
      *,
      d_model: int,
      num_heads: int,
      kv_lora_rank: int,
      qk_nope_head_dim: int,
      qk_rope_head_dim: int,
      v_head_dim: int,
      q_lora_rank: int | None = None,
      rope_theta: float = 10000.0,
      window: int | None = None,
      rms_eps: float = 1e-6,
      path: str = "auto",
      dtype: Any = None,
      param_dtype: Any = jnp.float32,
      decode_implementation: str | None = None,
      softmax_scale_factor: float = 1.0,
      rope_scaling: ops.RopeScaling | None = None,
      num_rope_heads: int = 1,
      latent_norm: bool = True,
      rngs: nnx.Rngs,
  ):
    """Builds the projections.

    Args:
      d_model, num_heads: D and N.
      kv_lora_rank: latent width C; qk_nope_head_dim: Hn; qk_rope_head_dim: R (even);
        v_head_dim: Hv; q_lora_rank: Cq, or None for a full-rank query.
      rope_theta, rope_scaling: RoPE base and `kvattn.ops.RopeScaling` (or None).
      window: sliding window in tokens, or None. rms_eps: latent RMSNorm epsilon.
      path: `"auto"`, `"naive"` or `"absorbed"`.
      dtype: compute dtype (None: the input's); param_dtype: float, or int8 (W8A8).
      decode_implementation: backend of `ops.mla_decode_attention`, or None.
      softmax_scale_factor: multiplies `(Hn + R)^-0.5` (DeepSeek's YaRN mscale^2).
      num_rope_heads: RoPE over R in this many chunks (1: DeepSeek-V2; `convert.to_mla`
        keeps one per source KV head). latent_norm: False caches `x W_DKV` unnormed.
      rngs: `nnx.Rngs` with a `params` stream.

    Raises:
      ValueError: a non-positive size or scale, odd R, an unknown path or backend, a
        num_rope_heads that does not split R into even chunks.
      TypeError: a non-int size, a non-float dtype, a bad option type.
    """
    self.d_model = _checks.positive_int("d_model", d_model)
    self.num_heads = _checks.positive_int("num_heads", num_heads)
    self.kv_lora_rank = _checks.positive_int("kv_lora_rank", kv_lora_rank)
    self.qk_nope_head_dim = _checks.positive_int("qk_nope_head_dim", qk_nope_head_dim)
    self.qk_rope_head_dim = _checks.positive_int("qk_rope_head_dim", qk_rope_head_dim)
    if self.qk_rope_head_dim % 2:
      raise ValueError(f"qk_rope_head_dim must be even for RoPE; got {qk_rope_head_dim}")
    self.v_head_dim = _checks.positive_int("v_head_dim", v_head_dim)
    self.num_rope_heads = _checks.positive_int("num_rope_heads", num_rope_heads)
    if self.qk_rope_head_dim % (2 * self.num_rope_heads):
      raise ValueError(f"qk_rope_head_dim must split into num_rope_heads chunks of even width; "
                       f"got {qk_rope_head_dim} and {num_rope_heads}")
    if not isinstance(latent_norm, bool):
      raise TypeError(f"latent_norm must be a bool; got {latent_norm!r}")
    self.latent_norm = latent_norm
    self.q_lora_rank = _checks.optional_positive_int("q_lora_rank", q_lora_rank)
    self.rope_theta = _checks.positive_float("rope_theta", rope_theta)
    self.rope_scaling = ops.rope.check_scaling(rope_scaling)
    self.window = _checks.optional_positive_int("window", window)
    self.rms_eps = _checks.positive_float("rms_eps", rms_eps)
    if path not in PATHS:
      raise ValueError(f"path must be one of {PATHS}; got {path!r}")
    self.path = path
    self.dtype = None if dtype is None else _checks.float_dtype("dtype", dtype)
    quantized = int8_lib.is_int8(param_dtype)
    param_dtype = jnp.float32 if quantized else _checks.float_dtype("param_dtype", param_dtype)
    self.decode_implementation = _checks.implementation(
        "decode_implementation", decode_implementation, decode_implementations())
    # DeepSeek-V2 eq. 18: the scale of the trained per-head width (times the YaRN correction).
    self.softmax_scale_factor = _checks.positive_float("softmax_scale_factor",
                                                       softmax_scale_factor)
    self.sm_scale = (self.qk_nope_head_dim + self.qk_rope_head_dim) ** -0.5 * \
        self.softmax_scale_factor

    D, N, C, R = self.d_model, self.num_heads, self.kv_lora_rank, self.qk_rope_head_dim
    Hn, Hv, Hq = self.qk_nope_head_dim, self.v_head_dim, self.qk_nope_head_dim + self.qk_rope_head_dim
    key = rngs.params
    if self.q_lora_rank is None:
      self.q_proj = nnx.Param(_init(0, (1, 2))(key(), (D, N, Hq), param_dtype))
    else:
      Cq = self.q_lora_rank
      self.q_down_proj = nnx.Param(_init(0, 1)(key(), (D, Cq), param_dtype))
      self.q_norm = nnx.Param(jnp.ones((Cq,), param_dtype))
      self.q_up_proj = nnx.Param(_init(0, (1, 2))(key(), (Cq, N, Hq), param_dtype))
    self.kv_down_proj = nnx.Param(_init(0, 1)(key(), (D, C + R), param_dtype))
    if latent_norm:
      self.kv_norm = nnx.Param(jnp.ones((C,), param_dtype))
    self.k_up_proj = nnx.Param(_init(0, (1, 2))(key(), (C, N, Hn), param_dtype))
    self.v_up_proj = nnx.Param(_init(0, (1, 2))(key(), (C, N, Hv), param_dtype))
    self.o_proj = nnx.Param(_init((0, 1), 2)(key(), (N, Hv, D), param_dtype))
    if quantized:
      int8_lib.quantize_module(self)

  def init_cache(self, batch: int, max_len: int, dtype: Any = jnp.float32) -> cache_lib.LatentCache:
    """An empty `LatentCache` shaped for this layer."""
    return cache_lib.LatentCache.init(batch, max_len, self.kv_lora_rank, self.qk_rope_head_dim,
                                      dtype)

  def _einsum(self, spec, a, w, dtype):
    """`einsum(spec, a, w)` in f32, cast to `dtype`; `w` a Param, or the name of one that
    may be int8 (`kvattn.models.int8`, its scale in `<name>_scale`)."""
    scale = None
    if isinstance(w, str):
      w, scale = getattr(self, w), getattr(self, w + "_scale", None)
    return int8_lib.project(spec, a, w, scale, dtype).astype(dtype)

  def _queries(self, x, positions, dtype):
    """Returns `(q_nope [B, T, N, Hn], q_rope [B, T, N, R])`, RoPE applied to q_rope."""
    if self.q_lora_rank is None:
      q = self._einsum("BTD,DNH->BTNH", x, "q_proj", dtype)
    else:
      c_q = self._einsum("BTD,DQ->BTQ", x, "q_down_proj", dtype)
      c_q = rms_norm(c_q, self.q_norm[...], self.rms_eps)
      q = self._einsum("BTQ,QNH->BTNH", c_q, "q_up_proj", dtype)
    q_nope, q_rope = jnp.split(q, [self.qk_nope_head_dim], axis=-1)
    return q_nope, self._rope(q_rope, positions)

  def _rope(self, x, positions):
    """RoPE of `[B, T, ..., R]` rope parts, as `num_rope_heads` chunks of R / num_rope_heads."""
    heads = self.num_rope_heads
    chunks = x.reshape(x.shape[:-1] + (heads, x.shape[-1] // heads))
    out = ops.apply_rope(chunks, positions, rope_theta=self.rope_theta, scaling=self.rope_scaling)
    return out.reshape(x.shape)

  def _latents(self, x, positions, dtype):
    """Returns `(c_kv [B, T, C], k_rope [B, T, R])`: normalised latent, roped shared key."""
    ckr = self._einsum("BTD,DE->BTE", x, "kv_down_proj", dtype)
    c_kv, k_rope = jnp.split(ckr, [self.kv_lora_rank], axis=-1)
    if self.latent_norm:
      c_kv = rms_norm(c_kv, self.kv_norm[...], self.rms_eps)
    return c_kv, self._rope(k_rope, positions)

  def _expand(self, c_kv, k_rope, dtype):
    """Per-head keys `[B, N, S, Hn + R]` and values `[B, N, S, Hv]` from latents
    `c_kv [B, S, C]` and shared rope keys `k_rope [B, S, R]` (the naive path)."""
    k_nope = self._einsum("BSC,CNH->BNSH", c_kv, self.k_up_proj, dtype)  # [B, N, S, Hn]
    v = self._einsum("BSC,CNV->BNSV", c_kv, self.v_up_proj, dtype)  # [B, N, S, Hv]
    k_rope = jnp.broadcast_to(k_rope.astype(dtype)[:, None],
                              k_nope.shape[:3] + (self.qk_rope_head_dim,))  # [B, N, S, R]
    return jnp.concatenate([k_nope, k_rope], axis=-1), v

  def _naive(self, q_nope, q_rope, c_kv, k_rope, new_cache, q_offsets, new_lengths, dtype):
    """Expanded per-head attention, against `new_cache` when there is one (its
    latents, dequantized when quantized), else the T new tokens; `[B, T, N, Hv]`."""
    q = jnp.concatenate([q_nope, q_rope], axis=-1)  # [B, T, N, Hn + R]
    expand = functools.partial(self._expand, dtype=dtype)
    opts = dict(sm_scale=self.sm_scale, window=self.window)
    if new_cache is None:
      return ops.attention(q, *expand(c_kv, k_rope), kv_lengths=new_lengths, **opts)
    return new_cache.attend_expanded(q, expand, dtype=dtype, q_offsets=q_offsets, **opts)

  def _absorbed(self, q_nope, q_rope, c_kv, k_rope, new_cache, q_offsets, new_lengths, dtype):
    """Attention against the latents with W_UK / W_UV absorbed, through
    `new_cache.attend` when there is a cache; returns `[B, T, N, Hv]`."""
    # Appendix C: q_nope . (W_UK c) == (q_nope W_UK^T) . c, f32-accumulated.
    q_latent = self._einsum("BTNH,CNH->BTNC", q_nope, self.k_up_proj, dtype)  # [B, T, N, C]
    opts = dict(sm_scale=self.sm_scale, window=self.window)
    if new_cache is None:
      out = ops.mla_attention(q_latent, q_rope, c_kv, k_rope, kv_lengths=new_lengths, **opts)
    else:
      out = new_cache.attend(q_latent, q_rope, q_offsets=q_offsets,
                             implementation=self.decode_implementation, **opts)
    return self._einsum("BTNC,CNV->BTNV", out, self.v_up_proj, dtype)  # [B, T, N, Hv]

  def attend_heads(
      self,
      x: jax.Array,  # [B, T, D]
      cache: MLACache | None = None,
      positions: jax.Array | None = None,  # i32[B, T]
      new_lengths: jax.Array | None = None,  # i32[B]
  ) -> tuple[jax.Array, MLACache | None]:
    """`__call__` before `o_proj`: per-head outputs `[B, T, N, Hv]`.

    Raises:
      ValueError/TypeError: `x` not `[B, T, D]` floating, a cache that is no `MLACache` of
        this layer's shape, bad positions or new_lengths, or (eager) an overflow.
    """
    check_input(x, self.d_model)
    batch, num_tokens, _ = x.shape
    if cache is not None:
      if not isinstance(cache, MLACache):
        raise type_error("MultiHeadLatentAttention", MLACache, "kvattn.LatentCache", cache)
      got = (cache.batch, cache.kv_lora_rank, cache.qk_rope_head_dim)
      want = (batch, self.kv_lora_rank, self.qk_rope_head_dim)
      if got != want:
        raise ValueError(
            f"cache must have batch, kv_lora_rank, qk_rope_head_dim = {want}; got {got}")
    positions = resolve_positions(positions, cache, batch, num_tokens)
    new_lengths = cache_lib.resolve_new_lengths(new_lengths, batch, num_tokens)

    dtype = self.dtype or x.dtype
    q_nope, q_rope = self._queries(x, positions, dtype)
    c_kv, k_rope = self._latents(x, positions, dtype)
    path = self.path
    if path == "auto":
      path = "absorbed" if cache is not None and num_tokens == 1 else "naive"
    new_cache = None if cache is None else write(cache, c_kv, k_rope, new_lengths=new_lengths)
    q_offsets = None if cache is None else cache.lengths
    attend = self._absorbed if path == "absorbed" else self._naive
    out = attend(q_nope, q_rope, c_kv, k_rope, new_cache, q_offsets, new_lengths, dtype)
    return out, new_cache

  def __call__(
      self,
      x: jax.Array,  # [B, T, D]
      cache: MLACache | None = None,
      positions: jax.Array | None = None,  # i32[B, T]
      new_lengths: jax.Array | None = None,  # i32[B]
  ) -> tuple[jax.Array, MLACache | None]:
    """`(y [B, T, D] in the compute dtype, updated cache or None)`; raises as `attend_heads`."""
    out, new_cache = self.attend_heads(x, cache=cache, positions=positions,
                                       new_lengths=new_lengths)
    y = self._einsum("BTNV,NVD->BTD", out, "o_proj", out.dtype)
    return y, new_cache
