"""Fused decode attention over a KIVI store: packed 2/4-bit codes dequantized in registers.

The store of `kvattn.caches.kivi.KIVICache` (KIVI, Liu et al. 2024, arXiv 2402.02750): per
sequence and KV head, `Sq` token slots (token s in slot s) of

* key codes `u8[Sq, H * bits / 8]`, `8 // bits` codes per byte along H (code `i` of byte
  `j` is channel `j * (8 // bits) + i`, at bits `[i * bits, (i + 1) * bits)`), dequantized
  per channel over groups of `group_size` tokens: `k[s, h] = code * k_scale[s // g, h] +
  k_zero[s // g, h]` with `k_scale, k_zero: [Sq / g, H]`;
* value codes, the same packing, dequantized per token over groups of `vg` channels:
  `v[s, h] = code * v_scale[s, h // vg] + v_zero[s, h // vg]` with `v_scale, v_zero:
  [Sq, H / vg]`.

One new query token per sequence attends store slots `[starts[b], lengths[b])` (the caller
knows the query's token and window; the KIVI cache attends its full-precision residual
ring apart and merges the two by their log-sum-exp, which is why `return_lse` exists).
The kernel loads a block of `block_k` slots (a multiple of `group_size`, so a block holds
whole key groups) in its packed form -- `bits / 8` bytes per code, plus the scales --
unpacks the codes with shifts and masks, broadcasts each key group's scale row over its
`group_size` tokens and each value scale over its `vg` channels, and dequantizes in f32 in
registers; no dequantized copy of the store exists outside the kernel. The rest is the
dense kernel's math (`_common`): GQA-grouped queries (the G heads of a KV head are one
tile), an online softmax over key blocks (FlashAttention-2), key-axis splits merged by
log-sum-exp (flash-decoding), masked logits replaced and masked value rows zeroed, so
garbage (NaN scales, random codes) in unused slots never reaches an output.

`lowbit_paged_decode` reads the same store from page pools. Schedules as in
`dense_decode.py`: "loop" (GPU, Triton; grid `(B, K, G tiles, splits)`,
each program a `fori_loop` over its blocks) and "grid" (TPU, Mosaic; key blocks on the last
grid axis, `starts` / `lengths` scalar-prefetched, the clamped block index map skips
blocks outside the range; the key scales of a row are one whole-row VMEM block, sliced per
step, since `block_k / group_size` rows are fewer than Mosaic's sublane tile). CPU runs
either with `interpret=True`. Layout: kernels, launcher, public wrapper, reference.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import _common
from pallas_kernels import attention_common as common

BITS = (2, 4)
"""Code widths the kernel unpacks (KIVI's)."""

# ----------------------------------------------------------------------------
# Dequantization of one block (values, inside the kernels).
# ----------------------------------------------------------------------------


def _unpack(packed, bits: int):
  """`i32[bk, W * 8 / bits]`: the codes of packed bytes `u8[bk, W]` in channel order.

  Byte j's code i (bits `[i * bits, (i + 1) * bits)`) is channel `j * (8 // bits) + i`:
  a `[bk, W, 8 // bits]` shift-and-mask, then a row-major reshape (Triton: `tt.reshape`).
  """
  per_byte = 8 // bits
  shifts = lax.broadcasted_iota(jnp.int32, (1, 1, per_byte), 2) * bits
  codes = (packed.astype(jnp.int32)[:, :, None] >> shifts) & ((1 << bits) - 1)
  return codes.reshape(packed.shape[0], packed.shape[1] * per_byte)


def dequant_keys(packed, scale, zero, bits: int, group_size: int):
  """f32 `[bk, H]` keys from codes `u8[bk, W]` and per-channel group rows `[bk / g, H]`."""
  codes = _unpack(packed, bits).astype(jnp.float32)
  bk, h = codes.shape

  def rows(x):  # [bk / g, H] -> [bk, H], each group row repeated over its g tokens
    x = x.astype(jnp.float32)
    return jnp.broadcast_to(x[:, None, :], (bk // group_size, group_size, h)).reshape(bk, h)

  return codes * rows(scale) + rows(zero)


def dequant_values(packed, scale, zero, bits: int):
  """f32 `[bk, H]` values from codes `u8[bk, W]` and per-token channel groups `[bk, H / vg]`."""
  codes = _unpack(packed, bits).astype(jnp.float32)
  bk, h = codes.shape
  groups = scale.shape[-1]

  def cols(x):  # [bk, H / vg] -> [bk, H], each scale over its vg channels
    x = x.astype(jnp.float32)
    return jnp.broadcast_to(x[:, :, None], (bk, groups, h // groups)).reshape(bk, h)

  return codes * cols(scale) + cols(zero)


# ----------------------------------------------------------------------------
# Kernels.
# ----------------------------------------------------------------------------


def _loop_kernel(
    start_ref,   # i32[]  first attended slot of this sequence
    length_ref,  # i32[]  one past the last attended slot
    q_ref,       # [Gb, H]
    kc_ref,      # u8[Sq, W]
    ks_ref,      # [Sq / g, H]
    kz_ref,      # [Sq / g, H]
    vc_ref,      # u8[Sq, W]
    vs_ref,      # [Sq, H / vg]
    vz_ref,      # [Sq, H / vg]
    o_ref,       # f32[Gb, H]
    lse_ref,     # f32[Gb, 1]
    *rest,       # (count i32[Gb, 1])
    bits: int,
    group_size: int,
    step: _common.Step,
):
  """"loop" schedule: one program per (b, k, G tile, split), fori_loop over blocks."""
  sm_scale, soft_cap, block_k, blocks_per_split, precision = step
  start, length, first, num_blocks = _common.loop_range(start_ref, length_ref, block_k,
                                                        blocks_per_split)
  q = q_ref[...]
  groups_per_block = block_k // group_size

  def body(i, carry):
    m, l, acc = carry
    slot0 = pl.multiple_of((first + i) * block_k, block_k)
    rows = pl.ds(slot0, block_k)
    group_rows = pl.ds(pl.multiple_of((first + i) * groups_per_block, groups_per_block),
                       groups_per_block)
    k = dequant_keys(kc_ref[rows, :], ks_ref[group_rows, :], kz_ref[group_rows, :], bits,
                      group_size).astype(q.dtype)
    v = dequant_values(vc_ref[rows, :], vs_ref[rows, :], vz_ref[rows, :], bits).astype(q.dtype)
    s = _common.logits(q, k, sm_scale=sm_scale, soft_cap=soft_cap, precision=precision)
    return _common.online_softmax_step(m, l, acc, s, v, slot0, start, length, precision)

  _common.loop_blocks(num_blocks, body, o_ref, lse_ref, *rest)


def _grid_kernel(
    starts_ref,   # i32[B] (SMEM, scalar-prefetched)
    lengths_ref,  # i32[B] (SMEM, scalar-prefetched)
    q_ref,        # [Gb, H]
    kc_ref,       # u8[bk, W]
    ks_ref,       # [Sq / g, H]  (the whole row)
    kz_ref,       # [Sq / g, H]
    vc_ref,       # u8[bk, W]
    vs_ref,       # [bk, H / vg]
    vz_ref,       # [bk, H / vg]
    o_ref,        # f32[Gb, H]
    lse_ref,      # f32[Gb, 128]
    *rest,        # (count i32[Gb, 128]), scratch m, l f32[Gb, 128], acc f32[Gb, H], (count)
    bits: int,
    group_size: int,
    step: _common.Step,
):
  """"grid" schedule: key blocks on the last (sequential) grid axis."""
  sm_scale, soft_cap, block_k, blocks_per_split, precision = step
  groups_per_block = block_k // group_size

  def block(_, blk):
    q = q_ref[...]
    group_rows = pl.ds(blk * groups_per_block, groups_per_block)
    k = dequant_keys(kc_ref[...], ks_ref[group_rows, :], kz_ref[group_rows, :], bits,
                     group_size).astype(q.dtype)
    v = dequant_values(vc_ref[...], vs_ref[...], vz_ref[...], bits).astype(q.dtype)
    return _common.logits(q, k, sm_scale=sm_scale, soft_cap=soft_cap, precision=precision), v

  _common.grid_body(starts_ref, lengths_ref, (o_ref, lse_ref) + rest, block,
                    count=len(rest) == 5, block_size=block_k,
                    blocks_per_split=blocks_per_split, precision=precision)


# ----------------------------------------------------------------------------
# Launcher.
# ----------------------------------------------------------------------------


def _block_k(schedule: str, store_capacity: int, group_size: int, head_dim: int,
             block_k: int | None) -> int:
  """Resolves and checks the key block; ValueError if unfit.

  A block holds whole key groups and divides Sq. "loop" (Triton): a power of two >= 16
  (dots and tensors), by default the largest dividing Sq up to the dense kernel's target
  for a 16-bit K + V read of 2 H elements per slot (128 slots at H = 64). "grid" (Mosaic):
  a multiple of 32 (the 1-byte sublane tile of the codes), by default the largest
  multiple of `lcm(g, 32)` up to 512 dividing Sq, else all of Sq.
  """
  sq, g = store_capacity, group_size
  if schedule == "loop":
    if block_k is None:
      bk = max(g, _common.loop_block_target(2 * head_dim))
      while bk >= g and (sq % bk or bk % g or not _common.is_pow2(bk)):
        bk //= 2
      if bk < max(g, 16) or not _common.is_pow2(bk):
        raise ValueError(f"group_size must be a power of two >= 16 for the \"loop\" schedule "
                         f"(Triton); got {g}")
      return bk
    if block_k < 16 or not _common.is_pow2(block_k) or block_k % g or sq % block_k:
      raise ValueError(f"block_k must be a power of two >= 16, a multiple of group_size = {g} "
                       f"and divide Sq = {sq} for the \"loop\" schedule; got {block_k}")
    return block_k
  unit = g * 32 // _gcd(g, 32)
  if block_k is None:
    bk = (512 // unit) * unit
    while bk >= unit and sq % bk:
      bk -= unit
    return bk if bk >= unit else sq
  if sq % block_k or block_k % g or (block_k % 32 and block_k != sq):
    raise ValueError(f"block_k must divide Sq = {sq}, be a multiple of group_size = {g} and of "
                     f"32 (or Sq) for the \"grid\" schedule; got {block_k}")
  return block_k


def _gcd(a: int, b: int) -> int:
  while b:
    a, b = b, a % b
  return a


def _partials(q, store, starts, lengths, *, bits, group_size, sm_scale, soft_cap, block_k,
              block_g, num_splits, schedule, interpret, count, num_warps, num_stages):
  """Runs the kernel: `q [B, K, Gp, H]` grouped, `store` the six store arrays; returns the
  per-split partials of `_common.launch`."""
  batch, num_kv, gp, head_dim = q.shape
  kc = store[0]
  sq, width = kc.shape[2], kc.shape[3]
  vgroups = store[4].shape[-1]
  num_blocks = sq // block_k
  bps = -(-num_blocks // num_splits)
  precision = lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
  kernel_kw = dict(bits=bits, group_size=group_size,
                   step=_common.Step(sm_scale, soft_cap, block_k, bps, precision))
  gs = sq // group_size
  if schedule == "loop":
    def spec(shape):
      return pl.BlockSpec((None, None) + shape, lambda b, h, g, j: (b, h, 0, 0))

    scalar = pl.BlockSpec((None,), lambda b, h, g, j: (b,))
    in_specs = [scalar, scalar,
                pl.BlockSpec((None, None, block_g, head_dim), lambda b, h, g, j: (b, h, g, 0)),
                spec((sq, width)), spec((gs, head_dim)), spec((gs, head_dim)),
                spec((sq, width)), spec((sq, vgroups)), spec((sq, vgroups))]
    kernel, grid = _loop_kernel, (batch, num_kv, gp // block_g, num_splits)
  else:
    def block(width_):
      def index(b, h, g, j, i, st, ln):
        lo, hi = _common.block_bounds(st[b], ln[b], block_k)
        return b, h, _common.kv_block_index(j, i, lo, hi, bps), 0
      return pl.BlockSpec((None, None, block_k, width_), index)

    whole = pl.BlockSpec((None, None, gs, head_dim), lambda b, h, g, j, i, st, ln: (b, h, 0, 0))
    in_specs = [pl.BlockSpec((None, None, block_g, head_dim),
                             lambda b, h, g, j, i, st, ln: (b, h, g, 0)),
                block(width), whole, whole, block(width), block(vgroups), block(vgroups)]
    kernel, grid = _grid_kernel, (batch, num_kv, gp // block_g, num_splits, bps)
  return _common.launch(
      functools.partial(kernel, **kernel_kw), [starts, lengths, q] + list(store),
      schedule=schedule, grid=grid, in_specs=in_specs, block_g=block_g, hv=head_dim,
      count=count, num_scalar_prefetch=2, interpret=interpret, num_warps=num_warps,
      num_stages=num_stages, name="kvattn_kivi_decode_attention")


@functools.partial(jax.jit, static_argnames=(
    "bits", "sm_scale", "soft_cap", "interpret", "block_k", "block_g", "num_splits",
    "schedule", "return_lse", "count_blocks", "num_warps", "num_stages"))
def _decode_impl(q, store, starts, lengths, *, bits, sm_scale, soft_cap, interpret, block_k,
                 block_g, num_splits, schedule, return_lse, count_blocks, num_warps,
                 num_stages):
  batch, num_heads, head_dim = q.shape
  _, num_kv, sq, _ = store[0].shape
  group_size = sq // store[1].shape[2]
  groups = num_heads // num_kv
  block_k = _block_k(schedule, sq, group_size, head_dim, block_k)
  dot_dtype = _common.dot_dtype(q.dtype, jnp.int8)  # f32, or q's when bf16 / f16
  block_g = _common.g_tile(schedule, groups, head_dim, dot_dtype, block_g)
  gp = _common.round_up(groups, block_g)
  num_blocks = sq // block_k
  if num_splits is None:
    num_splits = _common.default_splits(schedule, batch * num_kv * (gp // block_g), num_blocks)
  num_splits = min(num_splits, num_blocks)
  starts = jnp.clip(starts.astype(jnp.int32), 0, sq)
  lengths = jnp.clip(lengths.astype(jnp.int32), 0, sq)
  qg = _common.group_queries(q, num_kv, gp, dot_dtype)  # H is a power of two: no lane padding
  outs = _partials(qg, store, starts, lengths, bits=bits, group_size=group_size,
                   sm_scale=sm_scale, soft_cap=soft_cap, block_k=block_k, block_g=block_g,
                   num_splits=num_splits, schedule=schedule, interpret=interpret,
                   count=count_blocks, num_warps=num_warps, num_stages=num_stages)
  return _common.finish(outs, num_heads, groups, q.dtype, return_lse, count_blocks, head_dim)


# ----------------------------------------------------------------------------
# Public wrapper.
# ----------------------------------------------------------------------------


def store_dims(q, k_codes, bits: int, bit_widths) -> tuple[int, int, int, int]:
  """`(B, H, K, Sq)` of a low-bit kernel's `q: [B, N, H]` and `k_codes: u8[B, K, Sq, W]`.

  Raises:
    ValueError: `bits` not in `bit_widths`, wrong ranks, N not a multiple of K, Sq = 0.
  """
  if isinstance(bits, bool) or bits not in bit_widths:
    raise ValueError(f"bits must be one of {bit_widths}; got {bits!r}")
  if q.ndim != 3:
    raise ValueError(f"q must be [B, N, H]; got shape {q.shape}")
  if k_codes.ndim != 4:
    raise ValueError(f"k_codes must be u8[B, K, Sq, H * bits / 8]; got shape {k_codes.shape}")
  batch, num_heads, head_dim = q.shape
  num_kv, sq = k_codes.shape[1], k_codes.shape[2]
  if num_kv < 1 or num_heads % num_kv:
    raise ValueError(f"num_heads must be divisible by num_kv_heads; got {num_heads} and "
                     f"{num_kv}")
  if sq < 1:
    raise ValueError("k_codes must hold at least one store slot (Sq >= 1); got Sq = 0")
  return batch, head_dim, num_kv, sq


def check_store(q, starts, lengths, want, given, sm_scale, soft_cap) -> None:
  """Each array of `given` (name -> array) has the shape `want[name]`, codes (`*_codes`) are
  uint8 and the rest (and q) floating, `starts` / `lengths` are integer `[B]`.

  Raises:
    ValueError: a shape that does not fit (naming the argument); a bad `sm_scale` /
      `soft_cap`.
    TypeError: a wrong dtype (naming the argument).
  """
  for name, shape in want.items():
    if tuple(given[name].shape) != shape:
      raise ValueError(f"{name} must have shape {shape}; got {tuple(given[name].shape)}")
  for name, x in given.items():
    if name.endswith("_codes") and x.dtype != jnp.uint8:
      raise TypeError(f"{name} must be uint8 (packed codes); got {x.dtype}")
  for name, x in [("q", q)] + [(n, x) for n, x in given.items() if not n.endswith("_codes")]:
    if not jnp.issubdtype(x.dtype, jnp.floating):
      raise TypeError(f"{name} must be floating; got {x.dtype}")
  for name, x in (("starts", starts), ("lengths", lengths)):
    if x.shape != (q.shape[0],):
      raise ValueError(f"{name} must be i32[B] with B = {q.shape[0]}; got shape {x.shape}")
    if not jnp.issubdtype(x.dtype, jnp.integer):
      raise TypeError(f"{name} must be integers; got {x.dtype}")
  common.options(None, soft_cap, sm_scale)


def check_args(q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, starts, lengths, bits,
               sm_scale=None, soft_cap=None) -> int:
  """The argument checks of `kivi_decode_attention` (`store_dims`, `check_store`, H a
  multiple of `8 // bits`, the group sizes dividing Sq and H); returns the group size."""
  batch, head_dim, num_kv, sq = store_dims(q, k_codes, bits, BITS)
  per_byte = 8 // bits
  if head_dim % per_byte:
    raise ValueError(f"head_dim must be a multiple of 8 // bits = {per_byte}; got {head_dim}")
  if k_scale.ndim != 4 or k_scale.shape[2] < 1 or sq % k_scale.shape[2]:
    raise ValueError(f"k_scale must be [B, K, Sq / group_size, H] with Sq = {sq}; got shape "
                     f"{k_scale.shape}")
  group_size = sq // k_scale.shape[2]
  if v_scale.ndim != 4 or v_scale.shape[3] < 1 or head_dim % v_scale.shape[3]:
    raise ValueError(f"v_scale must be [B, K, Sq, H / value_group] with H = {head_dim}; got "
                     f"shape {v_scale.shape}")
  codes_shape = (batch, num_kv, sq, head_dim // per_byte)
  groups_shape = (batch, num_kv, sq // group_size, head_dim)
  values_shape = (batch, num_kv, sq, v_scale.shape[3])
  check_store(q, starts, lengths,
              {"k_codes": codes_shape, "v_codes": codes_shape, "k_scale": groups_shape,
               "k_zero": groups_shape, "v_scale": values_shape, "v_zero": values_shape},
              {"k_codes": k_codes, "v_codes": v_codes, "k_scale": k_scale, "k_zero": k_zero,
               "v_scale": v_scale, "v_zero": v_zero}, sm_scale, soft_cap)
  return group_size


def kivi_decode_attention(
    q: jax.Array,        # [B, N, H]
    k_codes: jax.Array,  # u8[B, K, Sq, H * bits / 8]
    k_scale: jax.Array,  # [B, K, Sq / g, H]
    k_zero: jax.Array,   # [B, K, Sq / g, H]
    v_codes: jax.Array,  # u8[B, K, Sq, H * bits / 8]
    v_scale: jax.Array,  # [B, K, Sq, H / vg]
    v_zero: jax.Array,   # [B, K, Sq, H / vg]
    starts: jax.Array,   # i32[B]
    lengths: jax.Array,  # i32[B]
    *,
    bits: int,
    sm_scale: float | None = None,
    soft_cap: float | None = None,
    **tunables: Any,
):
  """Decode attention of one query token per sequence against a packed KIVI store.

  Sequence b attends store slots `[starts[b], lengths[b])` (both clamped to `[0, Sq]`;
  an empty range gives zeros and lse -inf); query head n reads KV head `n // (N // K)`.
  softmax(q k^T sm_scale) v (Vaswani et al. 2017, eq. 1) with k and v dequantized block by
  block inside the kernel (module doc: layout, KIVI's key-per-channel / value-per-token
  groups). The group size `g = Sq / k_scale.shape[2]` and the value group
  `vg = H / v_scale.shape[3]` follow from the shapes.

  Args:
    q: `[B, N, H]` queries (f32, or bf16 / f16: the dots then run in q's dtype).
    k_codes, v_codes: `u8[B, K, Sq, H * bits / 8]` packed codes.
    k_scale, k_zero: `[B, K, Sq / g, H]` float, per channel per group of g tokens.
    v_scale, v_zero: `[B, K, Sq, H / vg]` float, per token per group of vg channels.
    starts, lengths: `i32[B]` the attended slot range.
    bits: 2 or 4.
    sm_scale: logit scale, default `1 / sqrt(H)`.
    soft_cap: `cap * tanh(s / cap)` of the scaled logits, or None.
    **tunables: as `dense_decode.decode_attention_unchecked` (`block_k` a multiple of g
      dividing Sq).

  Returns:
    `[B, N, H]` in q's dtype (f32 accumulation); with `return_lse`, `(out, f32[B, N])`;
    with `count_blocks`, `(result, i32[B, K])` key blocks processed.

  Raises:
    ValueError, TypeError: `check_args`; an unfit tunable or schedule / platform
      (`dense_decode.decode_attention`).
  """
  check_args(q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, starts, lengths, bits,
             sm_scale, soft_cap)
  return kivi_decode_attention_unchecked(
      q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, starts, lengths, bits=bits,
      sm_scale=sm_scale, soft_cap=soft_cap, **tunables)


def kivi_decode_attention_unchecked(q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero,
                                    starts, lengths, *, bits, sm_scale=None, soft_cap=None,
                                    interpret=False, block_k=None, block_g=None,
                                    num_splits=None, schedule=None, platform=None,
                                    num_warps=None, num_stages=None, return_lse=False,
                                    count_blocks=False):
  """`kivi_decode_attention` without the argument checks (for kvattn's KIVI cache, which
  built the arrays); the tunables are still resolved and checked here."""
  schedule = _common.check_schedule(schedule, interpret, (
      ("block_k", block_k), ("block_g", block_g), ("num_splits", num_splits)), platform)
  sq, head_dim = k_codes.shape[2], q.shape[-1]
  _block_k(schedule, sq, sq // k_scale.shape[2], head_dim, block_k)  # raises before tracing
  sm_scale = float(head_dim ** -0.5 if sm_scale is None else sm_scale)
  soft_cap = None if soft_cap is None else float(soft_cap)
  return _decode_impl(q, (k_codes, k_scale, k_zero, v_codes, v_scale, v_zero), starts, lengths,
                      bits=bits, sm_scale=sm_scale, soft_cap=soft_cap, interpret=interpret,
                      block_k=block_k, block_g=block_g, num_splits=num_splits,
                      schedule=schedule, return_lse=return_lse, count_blocks=count_blocks,
                      num_warps=num_warps, num_stages=num_stages)


def unsupported_reason(q_shape, k_codes_shape, k_scale_shape, *,
                       platform: str | None = None) -> str | None:
  """Why the compiled kernel cannot run these shapes, or None (`store_reason`)."""
  del q_shape
  return store_reason(platform, k_scale_shape[3],
                      k_codes_shape[2] // max(1, k_scale_shape[2]))


def store_reason(platform: str | None, head_dim: int, group_size: int,
                 page_size: int | None = None) -> str | None:
  """Why a compiled KIVI kernel cannot read a store, or None. GPU (Triton): H and the group
  size powers of two >= 16 (and a page size a power of two). TPU (Mosaic): H a multiple of
  64 and the group size a power of two. Lowered for "cuda" and "tpu" by
  tests/pallas_kernels/test_lowering.py; never compiled on a device yet."""
  platform = platform or _common.platform()
  if platform in _common.GPU_PLATFORMS:
    sizes = [("head dim H", head_dim, 16), ("group_size", group_size, 16)]
    for what, d, least in sizes + ([("page_size", page_size, 1)] if page_size else []):
      if d < least or not _common.is_pow2(d):
        return f"{what}={d} is not a power of two >= {least} (Triton)"
    return None
  if platform == "tpu":
    if head_dim % 64:
      return f"head dim H={head_dim} is not a multiple of 64 (TPU lanes)"
    if not _common.is_pow2(group_size):
      return f"group_size={group_size} is not a power of two"
    return None
  return f"no compiled Pallas backend on {platform!r}"


# ----------------------------------------------------------------------------
# Reference (plain jnp, f32).
# ----------------------------------------------------------------------------


def unpack_reference(packed: jax.Array, bits: int) -> jax.Array:
  """`i32[..., W * 8 / bits]`: codes of `u8[..., W]`, code i of byte j is channel
  `j * (8 // bits) + i` (integer division and remainder, not shifts)."""
  per_byte = 8 // bits
  b = jnp.repeat(packed.astype(jnp.int32), per_byte, axis=-1)
  i = jnp.arange(packed.shape[-1] * per_byte) % per_byte
  return (b // (1 << (bits * i))) % (1 << bits)


def dequantize_reference(k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, bits: int):
  """f32 `(k, v)`: `[B, K, Sq, H]` the whole store dequantized (module doc)."""
  f32 = jnp.float32
  kc, vc = unpack_reference(k_codes, bits).astype(f32), unpack_reference(v_codes, bits).astype(f32)
  g = kc.shape[2] // k_scale.shape[2]
  vg = vc.shape[3] // v_scale.shape[3]
  k = kc * jnp.repeat(k_scale.astype(f32), g, axis=2) + jnp.repeat(k_zero.astype(f32), g, axis=2)
  v = vc * jnp.repeat(v_scale.astype(f32), vg, axis=3) + jnp.repeat(v_zero.astype(f32), vg,
                                                                     axis=3)
  return k, v


def kivi_decode_attention_reference(q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero,
                                    starts, lengths, *, bits, sm_scale=None, soft_cap=None,
                                    return_lse=False, **unused_tunables: Any):
  """Plain-jnp f32 `kivi_decode_attention` (same signature; tunables ignored): the store
  dequantized up front, then `store_attention_reference`. `[B, N, H]` in q's dtype (and
  `f32[B, N]` lse)."""
  del unused_tunables
  k, v = dequantize_reference(k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, bits)
  out, lse = store_attention_reference(q, k, v, starts, lengths, sm_scale=sm_scale,
                                       soft_cap=soft_cap)
  out = out.astype(q.dtype)
  return (out, lse) if return_lse else out


def store_attention_reference(q, k, v, starts, lengths, *, sm_scale=None, soft_cap=None):
  """f32 `(out [B, N, Hv], lse [B, N])` of one query per sequence against dense f32 `k, v:
  [B, K, Sq, H]`: `[B, N, Sq]` logits masked outside `[starts, lengths)` (clamped to `[0,
  Sq]`) by replacement, masked value rows zeroed (garbage never leaks); an empty range gives
  zeros and lse -inf. The shared core of the low-bit stores' references."""
  sq = k.shape[2]
  num_kv, num_heads = k.shape[1], q.shape[1]
  sm_scale = q.shape[-1] ** -0.5 if sm_scale is None else sm_scale
  hi = lax.Precision.HIGHEST
  kh = jnp.repeat(k, num_heads // num_kv, axis=1)
  vh = jnp.repeat(v, num_heads // num_kv, axis=1)
  logits = jnp.einsum("BNH,BNSH->BNS", q.astype(jnp.float32), kh, precision=hi) * sm_scale
  if soft_cap is not None:
    logits = soft_cap * jnp.tanh(logits / soft_cap)
  slots = jnp.arange(sq)[None, :]
  starts, lengths = jnp.clip(starts, 0, sq), jnp.clip(lengths, 0, sq)
  mask = (slots >= starts[:, None]) & (slots < lengths[:, None])  # [B, Sq]
  logits = jnp.where(mask[:, None], logits, -jnp.inf)
  top = jnp.max(logits, axis=-1, keepdims=True)
  top = jnp.where(jnp.isfinite(top), top, 0.0)
  p = jnp.where(mask[:, None], jnp.exp(logits - top), 0.0)
  denom = jnp.sum(p, axis=-1)
  vh = jnp.where(mask[:, None, :, None], vh, 0.0)
  out = jnp.einsum("BNS,BNSH->BNH", p, vh, precision=hi) / jnp.where(denom > 0, denom,
                                                                       1.0)[..., None]
  lse = jnp.where(denom > 0, top[..., 0] + jnp.log(jnp.where(denom > 0, denom, 1.0)), -jnp.inf)
  return out, lse
