"""The fused decode kernel over a packed KIVI store (2/4-bit codes), in interpret mode.

Both schedules ("loop" = Triton GPU, "grid" = Mosaic TPU) against the kernel's own f32
reference (which unpacks with integer arithmetic and dequantizes up front), over slot-range
edges (length 0, 1, block - 1, block, block + 1, Sq; ranges starting inside a group), G = 1
and G > the G tile, splits, a soft cap, a bf16 query, and garbage (random codes, NaN
scales) in every slot outside the attended range. Only jax and numpy are needed: the store
is quantized here with numpy (KIVI: keys per channel over groups of tokens, values per token
over groups of channels); tests/kvattn/caches/test_kivi_pallas.py checks the kernel through
the cache, whose quantizer is kvattn's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import lowbit_decode as lb
from pallas_kernels import lowbit_paged_decode as lpd
from tests.pallas_kernels._helpers import TOL, check_store_kernel, close_lse, jitted

_reference = jitted(lb.kivi_decode_attention_reference)

G_SIZE = 16  # tokens per key group (the smallest the "loop" schedule takes)
BLOCK = 32   # key block: two groups; a multiple of the "grid" schedule's 1-byte tile (32)
SQ = 4 * BLOCK
EDGES = (0, 1, BLOCK - 1, BLOCK, BLOCK + 1, SQ)


def _pack(codes, bits):
  """numpy `u8[..., W * bits / 8]`: code i of byte j is channel `j * (8 // bits) + i`."""
  per_byte = 8 // bits
  c = codes.reshape(codes.shape[:-1] + (codes.shape[-1] // per_byte, per_byte)).astype(np.uint8)
  return np.bitwise_or.reduce(c << (np.arange(per_byte, dtype=np.uint8) * bits), axis=-1)


def _quantize(x, bits, axis):
  """numpy asymmetric min / max quantization along `axis` (scales in f16, as KIVI's)."""
  top = (1 << bits) - 1
  lo, hi = x.min(axis=axis), x.max(axis=axis)
  zero = lo.astype(np.float16)
  scale = ((hi - zero.astype(np.float32)) / top).astype(np.float16)
  s, z = (np.expand_dims(a.astype(np.float32), axis) for a in (scale, zero))
  codes = np.clip(np.round((x - z) / np.where(s > 0, s, 1)), 0, top).astype(np.uint8)
  return codes, scale, zero


def _store(batch, num_kv, head_dim, bits, value_group=16, seed=0):
  """The six store arrays of `batch` rows of SQ random tokens (a key outlier channel)."""
  rng = np.random.default_rng(seed)
  k = rng.standard_normal((batch, num_kv, SQ, head_dim)).astype(np.float32)
  k[..., 3] *= 8.0  # KIVI's per-channel key outliers
  v = rng.standard_normal((batch, num_kv, SQ, head_dim)).astype(np.float32)
  kc, ks, kz = _quantize(k.reshape(batch, num_kv, SQ // G_SIZE, G_SIZE, head_dim), bits, 3)
  vc, vs, vz = _quantize(v.reshape(batch, num_kv, SQ, head_dim // value_group, value_group),
                         bits, 4)
  kc = _pack(kc.reshape(batch, num_kv, SQ, head_dim), bits)
  vc = _pack(vc.reshape(batch, num_kv, SQ, head_dim), bits)
  return [jnp.asarray(a) for a in (kc, ks, kz, vc, vs, vz)]


def _poison(store, starts, lengths, seed=1):
  """Random codes and NaN scales in every slot (key group) outside `[starts, lengths)`."""
  rng = np.random.default_rng(seed)
  kc, ks, kz, vc, vs, vz = (np.array(a) for a in store)
  slots = np.arange(SQ)[None, :]
  unused = (slots < np.asarray(starts)[:, None]) | (slots >= np.asarray(lengths)[:, None])
  gslots = np.arange(SQ // G_SIZE)[None, :] * G_SIZE
  unused_g = ((gslots + G_SIZE <= np.asarray(starts)[:, None])
              | (gslots >= np.asarray(lengths)[:, None]))
  for b in range(len(unused)):
    for codes in (kc, vc):
      codes[b][:, unused[b]] = rng.integers(0, 256, codes[b][:, unused[b]].shape)
    for scale in (vs, vz):
      scale[b][:, unused[b]] = np.nan
    for scale in (ks, kz):
      scale[b][:, unused_g[b]] = np.nan
  return [jnp.asarray(a) for a in (kc, ks, kz, vc, vs, vz)]


CASES = [  # (bits, schedule, N, K, head dim, starts, soft_cap, q dtype)
    (4, "loop", 8, 2, 32, "zero", None, jnp.float32),
    (2, "grid", 4, 4, 64, "inside", None, jnp.float32),  # G = 1; ranges from inside a group
    (4, "loop", 32, 1, 16, "inside", 20.0, jnp.bfloat16),  # G = 32 > the G tile (16)
    (2, "loop", 8, 2, 32, "zero", None, jnp.float32),
    (4, "grid", 8, 2, 64, "zero", 20.0, jnp.float32),
    (2, "loop", 4, 4, 16, "inside", None, jnp.bfloat16),
]
FAST = {0, 1, 2}  # both bit widths, both schedules, G = 1, G > tile, bf16, soft cap, starts


def _starts(kind, lengths):
  if kind == "zero":
    return jnp.zeros_like(lengths)
  return jnp.maximum(lengths - 21, 0)  # 21: not a multiple of the group or the block


@pytest.mark.parametrize("bits,schedule,num_heads,num_kv,head_dim,starts,soft_cap,q_dtype", [
    case if i in FAST else pytest.param(*case, marks=pytest.mark.slow)
    for i, case in enumerate(CASES)])
def test_kernel_matches_reference_over_edges_and_ignores_garbage(
    bits, schedule, num_heads, num_kv, head_dim, starts, soft_cap, q_dtype):
  batch = len(EDGES)
  store = _store(batch, num_kv, head_dim, bits)
  q = jax.random.normal(jax.random.key(2), (batch, num_heads, head_dim)).astype(q_dtype)
  lengths = jnp.asarray(EDGES, jnp.int32)
  starts = _starts(starts, lengths)
  run = lambda s: lb.kivi_decode_attention(
      q, *s, starts, lengths, bits=bits, soft_cap=soft_cap, interpret=True, schedule=schedule,
      block_k=BLOCK, num_splits=2, return_lse=True)
  ref, ref_lse = _reference(q, *store, starts, lengths, bits=bits, soft_cap=soft_cap,
                            return_lse=True)
  check_store_kernel(run, store, _poison(store, starts, lengths), ref, ref_lse, q_dtype,
                     (batch, num_heads, head_dim), TOL[q_dtype])


def test_blocks_outside_the_range_are_not_processed():
  lengths = jnp.asarray([0, 1, BLOCK, BLOCK + 1, SQ], jnp.int32)
  starts = jnp.asarray([0, 0, BLOCK - 1, 2 * BLOCK, 0], jnp.int32)
  store = _store(5, 1, 16, 4)
  q = jax.random.normal(jax.random.key(3), (5, 1, 16))
  for schedule in ("loop", "grid"):
    _, counts = lb.kivi_decode_attention(q, *store, starts, lengths, bits=4, interpret=True,
                                         schedule=schedule, block_k=BLOCK, num_splits=1,
                                         count_blocks=True)
    # [starts, lengths) touches blocks 0; 0; 0; 2 (start 64 > length 33: none); 0-3.
    np.testing.assert_array_equal(np.asarray(counts)[:, 0], [0, 1, 1, 0, 4])


def test_reference_unpacks_and_dequantizes_a_hand_computed_store():
  # One row, one KV head, H = 4 channels, 2-bit codes: byte 0b11_10_01_00 = codes 0,1,2,3.
  kc = jnp.asarray(np.full((1, 1, 16, 1), 0b11100100, np.uint8))
  assert lb.unpack_reference(kc, 2)[0, 0, 0].tolist() == [0, 1, 2, 3]
  assert lb.unpack_reference(jnp.asarray([[0x5A]], jnp.uint8), 4).tolist() == [[0xA, 0x5]]
  ks = jnp.asarray(np.full((1, 1, 1, 4), 0.5, np.float16))
  kz = jnp.asarray(np.array([1, 2, 3, 4], np.float16).reshape(1, 1, 1, 4))
  vs = jnp.ones((1, 1, 16, 1), jnp.float16)
  k, v = lb.dequantize_reference(kc, ks, kz, kc, vs, jnp.zeros_like(vs), 2)
  assert k[0, 0, 5].tolist() == [1.0, 2.5, 4.0, 5.5] and v[0, 0, 0].tolist() == [0, 1, 2, 3]
  # One attended slot: the output is that slot's value, lse the one logit.
  q = jnp.ones((1, 1, 4))
  out, lse = lb.kivi_decode_attention_reference(q, kc, ks, kz, kc, vs, jnp.zeros_like(vs),
                                                jnp.asarray([5]), jnp.asarray([6]), bits=2,
                                                return_lse=True)
  assert out[0, 0].tolist() == [0, 1, 2, 3]
  np.testing.assert_allclose(lse[0, 0], (1 + 2.5 + 4 + 5.5) / 2, rtol=1e-6)


@pytest.mark.parametrize("change,error,match", [
    ({"bits": 3}, ValueError, "bits must be one of"),
    ({"k_codes": jnp.zeros((2, 2, 32, 8), jnp.int8)}, TypeError, "k_codes must be uint8"),
    ({"v_codes": jnp.zeros((2, 2, 32, 4), jnp.uint8)}, ValueError, "v_codes must have shape"),
    ({"k_scale": jnp.zeros((2, 2, 3, 16), jnp.float16)}, ValueError, "k_scale must be"),
    ({"v_zero": jnp.zeros((2, 2, 32, 1), jnp.int32)}, TypeError, "v_zero must be floating"),
    ({"lengths": jnp.zeros((3,), jnp.int32)}, ValueError, "lengths must be i32"),
    ({"starts": jnp.zeros((2,), jnp.float32)}, TypeError, "starts must be integers"),
    ({"q": jnp.zeros((2, 3, 16))}, ValueError, "num_heads must be divisible by"),
    ({"soft_cap": -1.0}, ValueError, "soft_cap"),
    ({"block_k": 24}, ValueError, "block_k must be a power of two"),
])
def test_bad_arguments_raise(change, error, match):
  args = dict(q=jnp.zeros((2, 4, 16)), k_codes=jnp.zeros((2, 2, 32, 8), jnp.uint8),
              k_scale=jnp.zeros((2, 2, 2, 16), jnp.float16),
              k_zero=jnp.zeros((2, 2, 2, 16), jnp.float16),
              v_codes=jnp.zeros((2, 2, 32, 8), jnp.uint8),
              v_scale=jnp.zeros((2, 2, 32, 1), jnp.float16),
              v_zero=jnp.zeros((2, 2, 32, 1), jnp.float16),
              starts=jnp.zeros((2,), jnp.int32), lengths=jnp.zeros((2,), jnp.int32), bits=4,
              interpret=True)
  args.update(change)
  with pytest.raises(error, match=match):
    lb.kivi_decode_attention(**args)


def _paged(store, page_size, seed=0):
  """The store's rows cut into pages of `page_size` slots, shuffled into a pool with 3 spare
  pages of garbage (codes 77, NaN scales); `(pools, block_tables)`."""
  batch = store[0].shape[0]
  pps = SQ // page_size
  num_pages = batch * pps + 3
  tables = np.random.default_rng(seed).permutation(num_pages)[:batch * pps].reshape(batch, pps)
  pools = []
  for x in store:
    x = np.asarray(x)
    rows = page_size * x.shape[2] // SQ  # slots (codes, value scales) or key groups per page
    pool = np.full((x.shape[1], num_pages, rows, x.shape[3]), 77 if x.dtype == np.uint8 else
                   np.nan, x.dtype)
    for b in range(batch):
      for j in range(pps):
        pool[:, tables[b, j]] = x[b, :, j * rows:(j + 1) * rows]
    pools.append(jnp.asarray(pool))
  return pools, jnp.asarray(tables, jnp.int32)


@pytest.mark.parametrize("bits,schedule,page_size,num_heads,num_kv,q_dtype", [
    (4, "loop", 32, 8, 2, jnp.float32),
    (2, "grid", 16, 32, 1, jnp.bfloat16),  # G = 32 in one tile; pages of one group
    pytest.param(2, "loop", 16, 32, 1, jnp.bfloat16, marks=pytest.mark.slow),
    pytest.param(4, "grid", 32, 4, 4, jnp.float32, marks=pytest.mark.slow),  # G = 1
])
def test_paged_kernel_matches_the_dense_reference(bits, schedule, page_size, num_heads, num_kv,
                                                  q_dtype):
  batch = len(EDGES)
  store = _store(batch, num_kv, 32, bits)
  pools, tables = _paged(store, page_size)
  q = jax.random.normal(jax.random.key(4), (batch, num_heads, 32)).astype(q_dtype)
  lengths = jnp.asarray(EDGES, jnp.int32)
  starts = _starts("inside", lengths)
  # "grid": 3 pages per block, so a block runs past the table (padded with unassigned pages).
  tunables = dict(pages_per_block=3) if schedule == "grid" else {}
  (out, lse), counts = lpd.paged_kivi_decode_attention(
      q, *pools, tables, starts, lengths, bits=bits, interpret=True, num_splits=2,
      return_lse=True, schedule=schedule, count_blocks=True, **tunables)
  ref, ref_lse = _reference(q, *store, starts, lengths, bits=bits, return_lse=True)
  np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32),
                             atol=TOL[q_dtype], rtol=TOL[q_dtype])
  close_lse(lse, ref_lse, q_dtype)
  paged_ref = lpd.paged_kivi_decode_attention_reference(q, *pools, tables, starts, lengths,
                                                       bits=bits)
  np.testing.assert_array_equal(np.asarray(paged_ref), np.asarray(ref))
  with pytest.raises(ValueError, match="block_tables must have one row per sequence"):
    lpd.paged_kivi_decode_attention(q, *pools, tables[:2], starts, lengths, bits=bits,
                                   interpret=True)
  # Pages outside [starts, lengths) are not dequantized (the "grid" schedule counts pages;
  # at page_size 16 the rows need 0, 1, 2, 2, 3 and 2 of them).
  if schedule == "grid":
    first = np.asarray(starts) // page_size
    last = -(-np.asarray(lengths) // page_size)
    np.testing.assert_array_equal(np.asarray(counts)[:, 0], np.maximum(last - first, 0))
