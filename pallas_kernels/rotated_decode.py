"""Fused decode attention over a rotated codebook store: 3/4-bit codes looked up in registers.

The store of `kvattn.caches.rotated.RotatedCache` (TurboQuant / QuIP#-style: Zandieh et al.
2025, arXiv 2504.19874; Tseng et al. 2024, arXiv 2402.04396): per sequence and KV head k,
`Sq` token slots (token s in slot s) of keys and values rotated by an orthogonal `M_k`
(a randomized Hadamard matrix) and coded per coordinate against one sorted scalar codebook
`c` of `2^bits` levels with one scale per token:

* codes `u8[Sq, W]`, `W = H * bits / 8`: 4-bit codes two per byte (channel `2 j + i` in
  bits `[4 i, 4 i + 4)` of byte j), 3-bit codes eight per three bytes (bytes `3 j .. 3 j +
  2` are a little-endian 24-bit word whose bits `[3 i, 3 i + 3)` hold channel `8 j + i`);
* scales `[Sq]` (any float dtype): `x[s, h] = c[code[s, h]] * scale[s]`.

Attention runs in the rotated space: `q . k = (q M_k) . (k M_k)`, so the queries are rotated
instead of the keys, and `sum_s p_s (v_s M_k)` is turned back once per query by `M_k^T`. The
kernel takes queries already in the rotated space and returns the output there (what the
cache wants: it merges the kernel's output with its full-precision residual ring by
log-sum-exp before turning back); `rotated_decode_attention(..., rotation=M)` does both turns
around the kernel.

Per key block of `block_k` slots the kernel loads the packed bytes, unpacks them with one
small matmul -- `words = bytes @ E` with a constant 0/1/256/65536 matrix `E [W, H]` that
puts each channel's byte (4-bit) or 24-bit word (3-bit) in its lane, exact in bf16 with f32
accumulation (every value is an integer below 2^24), and needs no lane gather or reshape,
which neither Triton (power-of-two tensors) nor Mosaic (lane relayouts) does well for 3-byte
groups -- then shifts and masks each lane's code out and looks the codebook up with a
binary tree of selects over the code's bits (`2^bits - 1` selects, the levels static
constants: no table in memory). The per-token scales never touch the `[bk, H]` tiles: the
key scales multiply the `[Gb, bk]` logits, the value scales the probabilities (zeroed where
masked, so a NaN scale in an unused slot cannot reach the sum). The rest is the dense
kernel's math (`_common`): GQA-grouped queries, an online softmax over key blocks
(FlashAttention-2), key-axis splits merged by log-sum-exp (flash-decoding).

Any `Sq` works (the cache's store is `max_len - residual` slots): "loop" (GPU, Triton; grid
`(B, K, G tiles, splits)`, each program a `fori_loop` over its blocks) shifts a block that
would run past the store back to end at slot Sq and masks the slots it already saw; "grid"
(TPU, Mosaic; key blocks on the last grid axis, `starts` / `lengths` scalar-prefetched, the
clamped block index map skips blocks outside the range) lets the last block run past Sq
(its rows are padding, past every length). CPU runs either with `interpret=True`. Layout:
kernel helpers, kernels, launcher, public wrapper, reference.
"""

from __future__ import annotations

import functools
from typing import Any, Sequence

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from pallas_kernels import _common
from pallas_kernels import attention_common as common
from pallas_kernels import lowbit_decode
from pallas_kernels.lowbit_decode import store_attention_reference

BITS = (3, 4)
"""Code widths the kernel unpacks (the rotated cache's)."""

GRID_BLOCK = 512
"""Default key block of the "grid" schedule (a multiple of 128: the scales' lanes)."""

# ----------------------------------------------------------------------------
# Kernel helpers (values).
# ----------------------------------------------------------------------------


def packed_width(head_dim: int, bits: int) -> int:
  """W, bytes of one token's `head_dim` codes (ValueError when H does not pack)."""
  per = 8 if bits == 3 else 2
  if head_dim % per:
    raise ValueError(f"head_dim must be a multiple of {per} to pack {bits}-bit codes; got "
                     f"{head_dim}")
  return head_dim * bits // 8


def unpack_matrix(head_dim: int, bits: int, rows: int | None = None) -> np.ndarray:
  """f32 `E [rows, H]` (rows >= W, the extra rows zero): `bytes @ E` puts channel c's byte
  (4-bit) or 24-bit little-endian word (3-bit) in lane c."""
  width = packed_width(head_dim, bits)
  rows = width if rows is None else rows
  e = np.zeros((rows, head_dim), np.float32)
  c = np.arange(head_dim)
  if bits == 4:
    e[c // 2, c] = 1.0
  else:
    for j in range(3):
      e[3 * (c // 8) + j, c] = 256.0 ** j
  return e


def _shifts(head_dim: int, bits: int):
  """`i32[1, H]`: the bit offset of channel c's code in its byte / word."""
  lane = lax.broadcasted_iota(jnp.int32, (1, head_dim), 1)
  return (lane & 1) * 4 if bits == 4 else (lane & 7) * 3


def _unpack(packed, matrix, bits: int):
  """`i32[bk, H]` codes of packed bytes `[bk, W']` (W' = the matrix's rows)."""
  words = _common.dot(packed.astype(jnp.float32).astype(jnp.bfloat16), matrix)
  words = words.astype(jnp.int32)
  shift = jnp.broadcast_to(_shifts(matrix.shape[1], bits), words.shape)
  return lax.shift_right_logical(words, shift) & ((1 << bits) - 1)


def _lookup(codes, levels: Sequence[float]):
  """f32 `levels[codes]`: a binary tree of selects on the code's bits, levels inlined."""
  vals = [jnp.float32(x) for x in levels]
  bit = 0
  while len(vals) > 1:
    on = (lax.shift_right_logical(codes, jnp.full(codes.shape, bit, jnp.int32)) & 1) == 1
    vals = [jnp.where(on, hi, lo) for lo, hi in zip(vals[0::2], vals[1::2])]
    bit += 1
  return vals[0]


def _decode_block(packed, matrix, bits, levels, dtype):
  return _lookup(_unpack(packed, matrix, bits), levels).astype(dtype)


# ----------------------------------------------------------------------------
# Kernels.
# ----------------------------------------------------------------------------


def _loop_kernel(
    start_ref,   # i32[]  first attended slot of this sequence
    length_ref,  # i32[]  one past the last attended slot
    q_ref,       # [Gb, H]
    kc_ref,      # u8[Sq, W]
    ks_ref,      # [1, Sq]
    vc_ref,      # u8[Sq, W]
    vs_ref,      # [1, Sq]
    e_ref,       # bf16[W', H]
    o_ref,       # f32[Gb, H]
    lse_ref,     # f32[Gb, 1]
    *rest,       # (count i32[Gb, 1])
    bits: int,
    levels: tuple,
    step: _common.Step,
):
  """"loop" schedule: one program per (b, k, G tile, split), fori_loop over blocks."""
  sm_scale, soft_cap, block_k, blocks_per_split, precision = step
  start, length, first, num_blocks = _common.loop_range(start_ref, length_ref, block_k,
                                                        blocks_per_split)
  sq = kc_ref.shape[0]
  width = e_ref.shape[0]
  q = q_ref[...]
  e = e_ref[...]

  def body(i, carry):
    m, l, acc = carry
    lo = (first + i) * block_k
    if sq % block_k:  # the last block is shifted back to end at Sq (Sq >= block_k)
      offset = jnp.minimum(lo, sq - block_k)
    else:
      offset = pl.multiple_of(lo, block_k)
    rows = pl.ds(offset, block_k)
    k = _decode_block(_common.load_rows(kc_ref, rows, width), e, bits, levels, q.dtype)
    s = _common.logits(q, k, sm_scale=sm_scale, soft_cap=soft_cap, precision=precision,
                       k_scale=ks_ref[:, rows])
    v = _decode_block(_common.load_rows(vc_ref, rows, width), e, bits, levels, q.dtype)
    return _common.online_softmax_step(m, l, acc, s, v, offset, jnp.maximum(start, lo),
                                       length, precision, v_scale=vs_ref[:, rows])

  _common.loop_blocks(num_blocks, body, o_ref, lse_ref, *rest)


def _grid_kernel(
    starts_ref,   # i32[B] (SMEM, scalar-prefetched)
    lengths_ref,  # i32[B] (SMEM, scalar-prefetched)
    q_ref,        # [Gb, H]
    kc_ref,       # u8[bk, W]
    ks_ref,       # [1, bk]
    vc_ref,       # u8[bk, W]
    vs_ref,       # [1, bk]
    e_ref,        # bf16[W, H]
    o_ref,        # f32[Gb, H]
    lse_ref,      # f32[Gb, 128]
    *rest,        # (count i32[Gb, 128]), scratch m, l f32[Gb, 128], acc f32[Gb, H], (count)
    bits: int,
    levels: tuple,
    step: _common.Step,
):
  """"grid" schedule: key blocks on the last (sequential) grid axis."""
  sm_scale, soft_cap, block_k, blocks_per_split, precision = step

  def block(*_):
    q = q_ref[...]
    e = e_ref[...]
    k = _decode_block(kc_ref[...], e, bits, levels, q.dtype)
    s = _common.logits(q, k, sm_scale=sm_scale, soft_cap=soft_cap, precision=precision,
                       k_scale=ks_ref[...])
    return s, _decode_block(vc_ref[...], e, bits, levels, q.dtype), vs_ref[...]

  _common.grid_body(starts_ref, lengths_ref, (o_ref, lse_ref) + rest, block,
                    count=len(rest) == 5, block_size=block_k,
                    blocks_per_split=blocks_per_split, precision=precision)


# ----------------------------------------------------------------------------
# Launcher.
# ----------------------------------------------------------------------------


def _block_k(schedule: str, store_capacity: int, head_dim: int, block_k: int | None) -> int:
  """Resolves and checks the key block; ValueError if unfit.

  "loop" (Triton): a power of two >= 16 and <= Sq (a block past the store is shifted
  back), by default the largest up to the dense kernel's target for a 16-bit K + V read of
  2 H elements per slot. "grid" (Mosaic): a multiple of 128 (the scales' lanes) or Sq
  itself, by default `GRID_BLOCK`, or Sq when that is smaller (the last block may run past
  Sq).
  """
  sq = store_capacity
  if schedule == "loop":
    if block_k is None:
      bk = _common.loop_block_target(2 * head_dim)
      while bk > sq:
        bk //= 2
      if bk < 16:
        raise ValueError(f"the \"loop\" schedule (Triton) needs a store of at least 16 slots; "
                         f"got Sq = {sq}")
      return bk
    if block_k < 16 or not _common.is_pow2(block_k) or block_k > sq:
      raise ValueError(f"block_k must be a power of two >= 16 and <= Sq = {sq} for the "
                       f"\"loop\" schedule; got {block_k}")
    return block_k
  if block_k is None:
    return GRID_BLOCK if sq > GRID_BLOCK else sq
  if block_k != sq and (block_k % 128 or block_k > sq):
    raise ValueError(f"block_k must be a multiple of 128 up to Sq = {sq}, or Sq, for the "
                     f"\"grid\" schedule; got {block_k}")
  return block_k


def _partials(q, store, matrix, starts, lengths, *, bits, levels, sm_scale, soft_cap, block_k,
              block_g, num_splits, schedule, interpret, count, num_warps, num_stages):
  """Runs the kernel: `q [B, K, Gp, H]` grouped, `store` (codes, scales [B, K, 1, Sq]) for K
  and V; returns the per-split partials of `_common.launch`."""
  batch, num_kv, gp, head_dim = q.shape
  kc = store[0]
  sq, width = kc.shape[2], kc.shape[3]
  num_blocks = -(-sq // block_k)
  bps = -(-num_blocks // num_splits)
  precision = lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
  kernel_kw = dict(bits=bits, levels=levels,
                   step=_common.Step(sm_scale, soft_cap, block_k, bps, precision))
  rows = matrix.shape[0]
  if schedule == "loop":
    def spec(shape):
      return pl.BlockSpec((None, None) + shape, lambda b, h, g, j: (b, h, 0, 0))

    scalar = pl.BlockSpec((None,), lambda b, h, g, j: (b,))
    in_specs = [scalar, scalar,
                pl.BlockSpec((None, None, block_g, head_dim), lambda b, h, g, j: (b, h, g, 0)),
                spec((sq, width)), spec((1, sq)), spec((sq, width)), spec((1, sq)),
                pl.BlockSpec((rows, head_dim), lambda b, h, g, j: (0, 0))]
    kernel, grid = _loop_kernel, (batch, num_kv, gp // block_g, num_splits)
  else:
    def blk(b, j, i, st, ln):
      lo, hi = _common.block_bounds(st[b], ln[b], block_k)
      return _common.kv_block_index(j, i, lo, hi, bps)

    codes = pl.BlockSpec((None, None, block_k, width),
                         lambda b, h, g, j, i, st, ln: (b, h, blk(b, j, i, st, ln), 0))
    scales = pl.BlockSpec((None, None, 1, block_k),
                          lambda b, h, g, j, i, st, ln: (b, h, 0, blk(b, j, i, st, ln)))
    in_specs = [pl.BlockSpec((None, None, block_g, head_dim),
                             lambda b, h, g, j, i, st, ln: (b, h, g, 0)),
                codes, scales, codes, scales,
                pl.BlockSpec((rows, head_dim), lambda b, h, g, j, i, st, ln: (0, 0))]
    kernel, grid = _grid_kernel, (batch, num_kv, gp // block_g, num_splits, bps)
  return _common.launch(
      functools.partial(kernel, **kernel_kw), [starts, lengths, q] + list(store) + [matrix],
      schedule=schedule, grid=grid, in_specs=in_specs, block_g=block_g, hv=head_dim,
      count=count, num_scalar_prefetch=2, interpret=interpret, num_warps=num_warps,
      num_stages=num_stages, name="kvattn_rotated_decode_attention")


def _rotate_queries(q, rotation):
  """`[B, N, H]` queries into the rotated space (`q M_k` for head n's KV head k), f32."""
  groups = q.shape[1] // rotation.shape[0]
  m = jnp.repeat(rotation.astype(jnp.float32), groups, axis=0)
  return jnp.einsum("BNH,NHJ->BNJ", q.astype(jnp.float32), m,
                    precision=lax.Precision.HIGHEST)


def _rotate_back(out, rotation):
  """f32 `[B, N, H]` outputs back from the rotated space (`out M_k^T`)."""
  groups = out.shape[1] // rotation.shape[0]
  m = jnp.repeat(rotation.astype(jnp.float32), groups, axis=0)
  return jnp.einsum("BNJ,NHJ->BNH", out.astype(jnp.float32), m,
                    precision=lax.Precision.HIGHEST)


@functools.partial(jax.jit, static_argnames=(
    "bits", "levels", "sm_scale", "soft_cap", "interpret", "block_k", "block_g", "num_splits",
    "schedule", "return_lse", "count_blocks", "num_warps", "num_stages"))
def _decode_impl(q, store, rotation, starts, lengths, *, bits, levels, sm_scale, soft_cap,
                 interpret, block_k, block_g, num_splits, schedule, return_lse, count_blocks,
                 num_warps, num_stages):
  batch, num_heads, head_dim = q.shape
  _, num_kv, sq, width = store[0].shape
  groups = num_heads // num_kv
  block_k = _block_k(schedule, sq, head_dim, block_k)
  dot_dtype = _common.dot_dtype(q.dtype, jnp.int8)  # f32, or q's when bf16 / f16
  block_g = _common.g_tile(schedule, groups, head_dim, dot_dtype, block_g)
  gp = _common.round_up(groups, block_g)
  num_blocks = -(-sq // block_k)
  if num_splits is None:
    num_splits = _common.default_splits(schedule, batch * num_kv * (gp // block_g), num_blocks)
  num_splits = min(num_splits, num_blocks)
  starts = jnp.clip(starts.astype(jnp.int32), 0, sq)
  lengths = jnp.clip(lengths.astype(jnp.int32), 0, sq)
  if rotation is not None:
    q = _rotate_queries(q, rotation).astype(q.dtype)
  qg = _common.group_queries(q, num_kv, gp, dot_dtype)  # H is a power of two: no lane padding
  rows = _common.padded_width(width, schedule)  # Triton: a power of two >= 16 (zero rows)
  matrix = jnp.asarray(unpack_matrix(head_dim, bits, rows), jnp.bfloat16)
  store = (store[0], store[1].reshape(batch, num_kv, 1, sq), store[2],
           store[3].reshape(batch, num_kv, 1, sq))  # scales as one row of lanes (free)
  outs = _partials(qg, store, matrix, starts, lengths, bits=bits, levels=levels,
                   sm_scale=sm_scale, soft_cap=soft_cap, block_k=block_k, block_g=block_g,
                   num_splits=num_splits, schedule=schedule, interpret=interpret,
                   count=count_blocks, num_warps=num_warps, num_stages=num_stages)
  result = _common.finish(outs, num_heads, groups, jnp.float32, True, count_blocks, head_dim)
  (out, lse), counts = result if count_blocks else (result, None)
  if rotation is not None:
    out = _rotate_back(out, rotation)
  out = out.astype(q.dtype)
  result = (out, lse) if return_lse else out
  return (result, counts) if count_blocks else result


# ----------------------------------------------------------------------------
# Public wrapper.
# ----------------------------------------------------------------------------


def check_args(q, k_codes, k_scale, v_codes, v_scale, starts, lengths, bits, codebook,
               rotation=None, sm_scale=None, soft_cap=None) -> tuple[float, ...]:
  """The argument checks of `rotated_decode_attention`; returns the codebook as a tuple.

  Raises:
    ValueError: `bits` not 3 / 4; a codebook that is not `2^bits` increasing finite floats;
      shapes that do not fit together (naming the argument, its shape and the expected
      one); an empty store; a bad `sm_scale` / `soft_cap`.
    TypeError: codes not uint8, float arguments that are not floating, integer arguments
      that are not integers.
  """
  if isinstance(bits, bool) or bits not in BITS:
    raise ValueError(f"bits must be one of {BITS}; got {bits!r}")
  try:
    levels = tuple(float(x) for x in codebook)
  except TypeError:
    raise ValueError(f"codebook must be a sequence of {1 << bits} increasing finite floats; "
                     f"got {codebook!r}") from None
  arr = np.asarray(levels)
  if len(levels) != 1 << bits or not np.all(np.isfinite(arr)) or np.any(np.diff(arr) <= 0):
    raise ValueError(f"codebook must hold {1 << bits} increasing finite floats for bits = "
                     f"{bits}; got {codebook!r}")
  batch, head_dim, num_kv, sq = lowbit_decode.store_dims(q, k_codes, bits, BITS)
  width = packed_width(head_dim, bits)
  want = {"k_codes": (batch, num_kv, sq, width), "v_codes": (batch, num_kv, sq, width),
          "k_scale": (batch, num_kv, sq), "v_scale": (batch, num_kv, sq)}
  given = {"k_codes": k_codes, "v_codes": v_codes, "k_scale": k_scale, "v_scale": v_scale}
  if rotation is not None:
    want["rotation"], given["rotation"] = (num_kv, head_dim, head_dim), rotation
  lowbit_decode.check_store(q, starts, lengths, want, given, sm_scale, soft_cap)
  return levels


def rotated_decode_attention(
    q: jax.Array,        # [B, N, H]
    k_codes: jax.Array,  # u8[B, K, Sq, H * bits / 8]
    k_scale: jax.Array,  # [B, K, Sq]
    v_codes: jax.Array,  # u8[B, K, Sq, H * bits / 8]
    v_scale: jax.Array,  # [B, K, Sq]
    starts: jax.Array,   # i32[B]
    lengths: jax.Array,  # i32[B]
    *,
    bits: int,
    codebook: Sequence[float],
    rotation: jax.Array | None = None,  # [K, H, H]
    sm_scale: float | None = None,
    soft_cap: float | None = None,
    **tunables: Any,
):
  """Decode attention of one query token per sequence against a rotated codebook store.

  Sequence b attends store slots `[starts[b], lengths[b])` (both clamped to `[0, Sq]`; an
  empty range gives zeros and lse -inf); query head n reads KV head `n // (N // K)`.
  softmax(q k^T sm_scale) v (Vaswani et al. 2017, eq. 1) with `k[s] = codebook[k_codes[s]] *
  k_scale[s]` (and v alike) decoded block by block inside the kernel (module doc: packing,
  the unpack matmul, the select-tree lookup).

  Args:
    q: `[B, N, H]` queries (f32, or bf16 / f16: the dots then run in q's dtype), in the
      rotated space when `rotation` is None.
    k_codes, v_codes: `u8[B, K, Sq, H * bits / 8]` packed codes (module doc).
    k_scale, v_scale: `[B, K, Sq]` float per-token scales.
    starts, lengths: `i32[B]` the attended slot range.
    bits: 3 or 4.
    codebook: `2^bits` increasing floats (static: one compiled kernel per codebook).
    rotation: `[K, H, H]` float, KV head k's orthogonal `M_k`, or None. Given, q is rotated
      into the store's space before the kernel and the output turned back by `M_k^T` after
      it (lse is unchanged: rotations keep dot products).
    sm_scale: logit scale, default `1 / sqrt(H)`.
    soft_cap: `cap * tanh(s / cap)` of the scaled logits, or None.
    **tunables: as `dense_decode.decode_attention_unchecked` (`block_k`: `_block_k`).

  Returns:
    `[B, N, H]` in q's dtype (f32 accumulation); with `return_lse`, `(out, f32[B, N])`;
    with `count_blocks`, `(result, i32[B, K])` key blocks processed.

  Raises:
    ValueError, TypeError: `check_args`; an unfit tunable or schedule / platform.
  """
  levels = check_args(q, k_codes, k_scale, v_codes, v_scale, starts, lengths, bits, codebook,
                      rotation, sm_scale, soft_cap)
  return rotated_decode_attention_unchecked(
      q, k_codes, k_scale, v_codes, v_scale, starts, lengths, bits=bits, codebook=levels,
      rotation=rotation, sm_scale=sm_scale, soft_cap=soft_cap, **tunables)


def rotated_decode_attention_unchecked(q, k_codes, k_scale, v_codes, v_scale, starts, lengths, *,
                                       bits, codebook, rotation=None, sm_scale=None,
                                       soft_cap=None, interpret=False, block_k=None,
                                       block_g=None, num_splits=None, schedule=None,
                                       platform=None, num_warps=None, num_stages=None,
                                       return_lse=False, count_blocks=False):
  """`rotated_decode_attention` without the argument checks (for kvattn's rotated cache,
  which built the arrays); the tunables are still resolved and checked here."""
  schedule = _common.check_schedule(schedule, interpret, (
      ("block_k", block_k), ("block_g", block_g), ("num_splits", num_splits)), platform)
  head_dim = q.shape[-1]
  _block_k(schedule, k_codes.shape[2], head_dim, block_k)  # raises before tracing
  sm_scale = float(head_dim ** -0.5 if sm_scale is None else sm_scale)
  soft_cap = None if soft_cap is None else float(soft_cap)
  return _decode_impl(q, (k_codes, k_scale, v_codes, v_scale), rotation, starts, lengths,
                      bits=bits, levels=tuple(float(x) for x in codebook), sm_scale=sm_scale,
                      soft_cap=soft_cap, interpret=interpret, block_k=block_k, block_g=block_g,
                      num_splits=num_splits, schedule=schedule, return_lse=return_lse,
                      count_blocks=count_blocks, num_warps=num_warps, num_stages=num_stages)


def unsupported_reason(head_dim: int, store_capacity: int, *,
                       platform: str | None = None) -> str | None:
  """Why the compiled kernel cannot run this store, or None if it can (kvattn's rotated
  cache then reads it with the XLA loop). GPU (Triton): H a power of two >= 16 (dots) and
  Sq >= 16 (one block). TPU (Mosaic): H a multiple of 64. Lowered for "cuda" and "tpu" by
  tests/pallas_kernels/test_lowering.py; never compiled on a device yet."""
  platform = platform or _common.platform()
  if platform in _common.GPU_PLATFORMS:
    if head_dim < 16 or not _common.is_pow2(head_dim):
      return f"head dim H={head_dim} is not a power of two >= 16 (Triton)"
    if store_capacity < 16:
      return f"store of Sq={store_capacity} slots is under one 16-slot block (Triton)"
    return None
  if platform == "tpu":
    if head_dim % 64:
      return f"head dim H={head_dim} is not a multiple of 64 (TPU lanes)"
    return None
  return f"no compiled Pallas backend on {platform!r}"


# ----------------------------------------------------------------------------
# Reference (plain jnp, f32).
# ----------------------------------------------------------------------------


def unpack_reference(packed: jax.Array, bits: int) -> jax.Array:
  """`i32[..., W * 8 / bits]`: the codes of `u8[..., W]` (module doc), by integer division
  and remainder (no shifts, no matmul)."""
  b = packed.astype(jnp.int32)
  if bits == 4:
    b = jnp.repeat(b, 2, axis=-1)
    return (b // jnp.where(jnp.arange(b.shape[-1]) % 2 == 1, 16, 1)) % 16
  groups = b.reshape(b.shape[:-1] + (b.shape[-1] // 3, 3))
  word = groups[..., 0] + 256 * groups[..., 1] + 65536 * groups[..., 2]
  codes = (word[..., None] // (8 ** jnp.arange(8))) % 8
  return codes.reshape(b.shape[:-1] + (b.shape[-1] // 3 * 8,))


def dequantize_reference(codes: jax.Array, scale: jax.Array, bits: int,
                         codebook: Sequence[float]) -> jax.Array:
  """f32 `codebook[codes] * scale[..., None]`: `[..., H]` of packed `u8[..., W]`."""
  levels = jnp.asarray(codebook, jnp.float32)
  return levels[unpack_reference(codes, bits)] * scale.astype(jnp.float32)[..., None]


def rotated_decode_attention_reference(q, k_codes, k_scale, v_codes, v_scale, starts, lengths,
                                       *, bits, codebook, rotation=None, sm_scale=None,
                                       soft_cap=None, return_lse=False,
                                       **unused_tunables: Any):
  """Plain-jnp f32 `rotated_decode_attention` (same signature; tunables ignored): the store
  decoded up front (`dequantize_reference`), q rotated and the output turned back when
  `rotation` is given, `lowbit_decode.store_attention_reference` between."""
  del unused_tunables
  k = dequantize_reference(k_codes, k_scale, bits, codebook)
  v = dequantize_reference(v_codes, v_scale, bits, codebook)
  qs = q if rotation is None else _rotate_queries(q, rotation)
  out, lse = store_attention_reference(qs, k, v, starts, lengths, sm_scale=sm_scale,
                                       soft_cap=soft_cap)
  if rotation is not None:
    out = _rotate_back(out, rotation)
  out = out.astype(q.dtype)
  return (out, lse) if return_lse else out
