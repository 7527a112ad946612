"""Attention over quantized (int8 / fp8) caches: every decode path, prefill, modules, generate.

Two comparisons per path:
  * against f32 attention over the *dequantized* cache (`values * scales`): tight (f32
    rounding only) -- the path applies the scales it was given, in the right places;
  * against f32 attention over the original float cache: within a format-dependent
    tolerance -- the quantization error itself (unit-normal q, k, v; H = 16).
"""


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import kvattn
from kvattn import KVCache, ops
from kvattn.ops import xla_blocked
from pallas_kernels import dense_decode as kernels
from tests.pallas_kernels import _helpers

FORMATS = {name: dtype for name, (dtype, _) in _helpers.FORMATS.items()}  # short name -> dtype
# Max abs error of attention over the quantized cache vs the f32 cache, unit-normal inputs.
# Measured maxima over these grids: int8 0.013, e4m3 0.08, e5m2 0.22; about 2x margin.
TOL = {"int8": 0.03, "e4m3": 0.15, "e5m2": 0.4}
EXACT = 2e-5  # vs attention over the dequantized cache: f32 rounding only
S = 64
LENGTHS = jnp.array([0, 1, 15, 17, 63, 64], jnp.int32)  # B = 6 rows, edges of 16-slot blocks
DENSE_IMPLS = ("xla", "xla_blocked", "pallas")  # "pallas" runs interpreted on CPU


def _query_as_read(q, sm_scale, name, impl):
  """The query the backend's logits use: `xla_blocked` reads an int8 cache's keys through
  s8 dots, with the (scaled) query quantized per row as the cache is (`ops.quantize_kv`)."""
  if not (impl == "xla_blocked" and name == "int8"):
    return q
  values, scale = ops.quantize_kv(q.astype(jnp.float32) * sm_scale, jnp.int8)
  return ops.dequantize_kv(values, scale, jnp.float32) / sm_scale


def _formats_and_impls(fast_pallas_format):
  """(format, backend) pairs; the Pallas kernel runs interpreted on CPU, so by default only
  for `fast_pallas_format` (tests/pallas_kernels cover the kernels on every format)."""
  return [pytest.param(name, impl, marks=pytest.mark.slow)
          if impl == "pallas" and name != fast_pallas_format else (name, impl)
          for impl in DENSE_IMPLS for name in FORMATS]


def _dense(num_heads=8, num_kv=2, head_dim=16, seed=0):
  rng = np.random.default_rng(seed)
  b = len(LENGTHS)
  q = rng.standard_normal((b, num_heads, head_dim))
  k = rng.standard_normal((b, num_kv, S, head_dim))
  v = rng.standard_normal((b, num_kv, S, head_dim))
  return (jnp.asarray(x, jnp.float32) for x in (q, k, v))


def _latent(num_heads=4, latent=32, rope=16, seed=1):
  rng = np.random.default_rng(seed)
  b = len(LENGTHS)
  shapes = ((b, num_heads, latent), (b, num_heads, rope), (b, S, latent), (b, S, rope))
  q_lat, q_rope, c_kv, k_rope = (jnp.asarray(rng.standard_normal(s), jnp.float32) for s in shapes)
  return q_lat, q_rope, c_kv, k_rope * 3.0  # the two parts at different magnitudes


def _poison(values, scales, lengths, slot_axis):
  """Garbage in every slot at or past each length: NaN scales and the format's extreme
  (NaN where the format has one) as values."""
  return _helpers.poison(values, scales, lengths, None, slot_axis)


@pytest.mark.parametrize("name,impl", _formats_and_impls("int8"))
def test_dense_decode_paths_apply_the_scales(name, impl):
  dtype = FORMATS[name]
  q, k, v = _dense()
  kq, ks = ops.quantize_kv(k, dtype)
  vq, vs = ops.quantize_kv(v, dtype)
  window = 20 if impl == "xla" else None  # one window case per format (compiles are costly)
  out = ops.decode_attention(q, kq, vq, LENGTHS, k_scale=ks, v_scale=vs, window=window,
                             implementation=impl)
  dequantized = kernels.decode_attention_reference(
      _query_as_read(q, q.shape[-1] ** -0.5, name, impl), ops.dequantize_kv(kq, ks),
      ops.dequantize_kv(vq, vs), LENGTHS, window=window)
  np.testing.assert_allclose(out, dequantized, atol=EXACT, rtol=EXACT)
  exact = kernels.decode_attention_reference(q, k, v, LENGTHS, window=window)
  np.testing.assert_allclose(out, exact, atol=TOL[name])
  np.testing.assert_array_equal(out[0], 0.0)  # length 0: zeros
  # Garbage (NaN values where the format has NaN, -128 for int8, NaN scales) in unused slots.
  kp, ksp = _poison(kq, ks, LENGTHS, 2)
  vp, vsp = _poison(vq, vs, LENGTHS, 2)
  dirty = ops.decode_attention(q, kp, vp, LENGTHS, k_scale=ksp, v_scale=vsp, window=window,
                               implementation=impl)
  np.testing.assert_array_equal(dirty, out)


@pytest.mark.parametrize("name,impl", _formats_and_impls("e4m3"))
def test_latent_decode_paths_apply_the_scales(name, impl):
  dtype = FORMATS[name]
  q_lat, q_rope, c_kv, k_rope = _latent()
  cq, cs = ops.quantize_kv(c_kv, dtype)
  rq, rs = ops.quantize_kv(k_rope, dtype)
  out = ops.mla_decode_attention(q_lat, q_rope, cq, rq, LENGTHS, sm_scale=0.15, c_kv_scale=cs,
                                 k_rope_scale=rs, implementation=impl)
  dequantized = kernels.mla_decode_attention_reference(
      _query_as_read(q_lat, 0.15, name, impl), _query_as_read(q_rope, 0.15, name, impl),
      ops.dequantize_kv(cq, cs), ops.dequantize_kv(rq, rs), LENGTHS, sm_scale=0.15)
  np.testing.assert_allclose(out, dequantized, atol=EXACT, rtol=EXACT)
  exact = kernels.mla_decode_attention_reference(q_lat, q_rope, c_kv, k_rope, LENGTHS,
                                                 sm_scale=0.15)
  np.testing.assert_allclose(out, exact, atol=TOL[name])
  cp, csp = _poison(cq, cs, LENGTHS, 1)
  rp, rsp = _poison(rq, rs, LENGTHS, 1)
  dirty = ops.mla_decode_attention(q_lat, q_rope, cp, rp, LENGTHS, sm_scale=0.15,
                                   c_kv_scale=csp, k_rope_scale=rsp, implementation=impl)
  np.testing.assert_array_equal(dirty, out)


@pytest.mark.parametrize("name", FORMATS)
def test_prefill_attention_applies_the_scales(name):
  dtype = FORMATS[name]
  q, k, v = _dense()
  t = 5
  qt = jnp.stack([q] * t, axis=1) * jnp.arange(1.0, t + 1)[None, :, None, None]  # [B, T, N, H]
  kq, ks = ops.quantize_kv(k, dtype)
  vq, vs = ops.quantize_kv(v, dtype)
  offsets = jnp.maximum(LENGTHS - t, 0)
  out = ops.attention(qt, kq, vq, q_offsets=offsets, kv_lengths=LENGTHS, k_scale=ks,
                      v_scale=vs, window=30)
  expected = ops.attention(qt, ops.dequantize_kv(kq, ks), ops.dequantize_kv(vq, vs),
                           q_offsets=offsets, kv_lengths=LENGTHS, window=30)
  np.testing.assert_allclose(out, expected, atol=EXACT, rtol=EXACT)
  q_lat, q_rope, c_kv, k_rope = _latent()
  cq, cs = ops.quantize_kv(c_kv, dtype)
  rq, rs = ops.quantize_kv(k_rope, dtype)
  q_lat_t, q_rope_t = q_lat[:, None].repeat(t, 1), q_rope[:, None].repeat(t, 1)
  out = ops.mla_attention(q_lat_t, q_rope_t, cq, rq, sm_scale=0.15, q_offsets=offsets,
                          kv_lengths=LENGTHS, c_kv_scale=cs, k_rope_scale=rs)
  expected = ops.mla_attention(q_lat_t, q_rope_t, ops.dequantize_kv(cq, cs),
                               ops.dequantize_kv(rq, rs), sm_scale=0.15, q_offsets=offsets,
                               kv_lengths=LENGTHS)
  np.testing.assert_allclose(out, expected, atol=EXACT, rtol=EXACT)


def test_float_calls_are_unchanged_and_errors_name_the_scales():
  q, k, v = _dense()
  plain = ops.decode_attention(q, k, v, LENGTHS, implementation="xla")
  np.testing.assert_array_equal(plain, ops.decode_attention_xla(q, k, v, LENGTHS))
  kq, ks = ops.quantize_kv(k, jnp.int8)
  vq, vs = ops.quantize_kv(v, jnp.int8)
  with pytest.raises(TypeError, match=r"k has the quantized dtype int8: pass its per-slot "
                     r"scales k_scale f32\[B, K, S\]"):
    ops.decode_attention(q, kq, vq, LENGTHS)
  with pytest.raises(TypeError, match="k_scale is only for quantized caches"):
    ops.decode_attention(q, k, v, LENGTHS, k_scale=ks, v_scale=vs)
  with pytest.raises(ValueError, match=r"v_scale must have shape f32\[B, K, S\] = \(6, 2, 64\); "
                     r"got \(6, 2, 63\)"):
    ops.decode_attention(q, kq, vq, LENGTHS, k_scale=ks, v_scale=vs[..., :63])
  with pytest.raises(TypeError, match="k must have a floating dtype or a quantized KV format"):
    ops.decode_attention(q, kq.astype(jnp.int32), vq.astype(jnp.int32), LENGTHS, k_scale=ks,
                         v_scale=vs)
  q_lat, q_rope, c_kv, k_rope = _latent()
  with pytest.raises(TypeError, match="c_kv has the quantized dtype int8: pass its per-slot "
                     "scales c_kv_scale"):
    ops.mla_decode_attention(q_lat, q_rope, c_kv.astype(jnp.int8), k_rope.astype(jnp.int8),
                             LENGTHS, sm_scale=0.1)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="CPU dispatch rules")
def test_cpu_dispatch_reads_quantized_caches_block_by_block():
  # Quantized caches take the length-aware blocked path like float ones once S > 256.
  q = jax.random.normal(jax.random.key(0), (1, 8, 64))
  k = jax.random.normal(jax.random.key(1), (1, 2, 320, 64))
  kq, ks = ops.quantize_kv(k, jnp.int8)
  lengths = jnp.array([200])
  step = jax.jit(lambda *a, **kw: ops.decode_attention(*a, **kw),
                 static_argnames=("implementation",))
  auto = step(q, kq, kq, lengths, k_scale=ks, v_scale=ks)
  np.testing.assert_array_equal(auto, step(q, kq, kq, lengths, k_scale=ks, v_scale=ks,
                                           implementation="xla_blocked"))
  with pytest.raises(NotImplementedError, match="S=64 <= 256 slots"):
    xla_blocked.decode(q, kq[:, :, :64], kq[:, :, :64], lengths, explicit=False,
                        k_scale=ks[:, :, :64], v_scale=ks[:, :, :64])


# ----------------------------------------------------------------------------------------------
# Modules and generation.


def _gqa(num_kv):
  return kvattn.GroupedQueryAttention(d_model=32, num_heads=4, num_kv_heads=num_kv, head_dim=16,
                                      rngs=nnx.Rngs(0))


def _mla():
  return kvattn.MultiHeadLatentAttention(d_model=32, num_heads=4, kv_lora_rank=32,
                                         qk_nope_head_dim=8, qk_rope_head_dim=16, v_head_dim=8,
                                         rngs=nnx.Rngs(0))


@pytest.mark.parametrize("module", [  # fast suite: GQA (MQA is K = 1; the latent's scales:
    "gqa", pytest.param("mqa", marks=pytest.mark.slow),  # test_latent_decode_paths_apply_...)
    pytest.param("mla", marks=pytest.mark.slow)])
def test_modules_decode_through_a_quantized_cache(module):
  attn = _mla() if module == "mla" else _gqa(1 if module == "mqa" else 2)
  x = jax.random.normal(jax.random.key(3), (2, 12, 32))
  full, _ = attn(x)  # causal forward, no cache
  for name, dtype in FORMATS.items():
    cache = attn.init_cache(2, 16, dtype)
    y_pre, cache = attn(x[:, :7], cache=cache)  # prefill reads the quantized slots too
    steps = [y_pre]
    step = jax.jit(lambda a, xt, c: a(xt, cache=c))
    for t in range(7, 12):
      y, cache = step(attn, x[:, t:t + 1], cache)
      steps.append(y)
    out = jnp.concatenate(steps, axis=1)
    scale = float(jnp.abs(full).max())
    err = float(jnp.abs(out - full).max())
    assert err <= TOL[name] * scale, (name, err, scale)
    assert cache.quantized and cache.dtype == dtype
    np.testing.assert_array_equal(cache.lengths, [12, 12])


def test_generate_runs_unchanged_on_quantized_caches():
  cfg = kvattn.models.transformer.model_config(
      vocab_size=64, d_model=32, num_layers=2, mlp_dim=64,
      attention=dict(num_heads=4, num_kv_heads=2, head_dim=8))
  model = kvattn.Transformer.from_config(cfg, rngs=nnx.Rngs(0))
  prompts = jax.random.randint(jax.random.key(0), (2, 6), 0, 64)
  lengths = jnp.array([6, 3])
  tokens = {}
  for name, dtype in {"f32": jnp.float32, **FORMATS}.items():
    caches = model.init_caches(2, 16, dtype)
    assert all(c.quantized == (name != "f32") for c in caches)
    tokens[name], out_lengths = kvattn.generate(model, prompts, lengths, 8, caches=caches)
    np.testing.assert_array_equal(out_lengths, [8, 8])
  # Greedy decoding through an int8 cache follows the f32 cache here (tiny random model: the
  # logit gaps are much larger than int8's error); fp8 may diverge, but stays in the vocabulary.
  np.testing.assert_array_equal(tokens["int8"], tokens["f32"])
  for name in FORMATS:
    assert tokens[name].shape == (2, 8) and int(tokens[name].max()) < 64


# ----------------------------------------------------------------------------------------------
# Paged caches.


# Jitted once per shape (eager op-by-op dispatch compiles every primitive of every call).
_paged_decode = jax.jit(ops.paged_decode_attention, static_argnames=("window", "implementation"))
_decode = jax.jit(ops.decode_attention, static_argnames=("window", "implementation"))
_update = jax.jit(lambda c, k, v, n: c.update(k, v, n))


def _junk(dtype):
  return jnp.asarray(-128 if dtype == jnp.int8 else jnp.nan, dtype)


@pytest.mark.parametrize("name", [  # fast suite: int8 (the fp8 formats share its path)
    pytest.param(n, marks=pytest.mark.slow) if n != "int8" else n for n in FORMATS])
def test_paged_quantized_cache_equals_the_dense_one(name):
  dtype = FORMATS[name]
  page, pages_per_seq, num_pages = 4, 5, 16
  lengths = jnp.array([0, 1, 4, 5, 20], jnp.int32)  # empty, one token, a full page, a fresh page
  batch, num_kv, head_dim = len(lengths), 2, 16
  rng = np.random.default_rng(7)
  perm = rng.permutation(num_pages)
  tables = np.full((batch, pages_per_seq), -1, np.int32)
  at = 0
  for b, n in enumerate(-(-np.asarray(lengths) // page)):  # random distinct pages per sequence
    tables[b, :n] = perm[at:at + n]
    at += n
  k = jnp.asarray(rng.standard_normal((batch, page * pages_per_seq, num_kv, head_dim)),
                  jnp.float32) * 3.0
  v = jnp.asarray(rng.standard_normal(k.shape), jnp.float32)
  paged = kvattn.PagedKVCache.init(batch, num_pages=num_pages, page_size=page,
                                   pages_per_seq=pages_per_seq, num_kv_heads=num_kv,
                                   head_dim=head_dim, dtype=dtype, block_tables=tables)
  assert paged.quantized and paged.k_scale_pages.shape == (num_kv, num_pages, page)
  assert kvattn.memory.measured_bytes_per_token(paged) == kvattn.memory.gqa_bytes_per_token(
      num_kv, head_dim, dtype)
  # Garbage everywhere first: free pages and the tails of last pages keep it.
  paged = paged.replace(k_pages=jnp.full_like(paged.k_pages, _junk(dtype)),
                        v_pages=jnp.full_like(paged.v_pages, _junk(dtype)),
                        k_scale_pages=jnp.full_like(paged.k_scale_pages, jnp.nan),
                        v_scale_pages=jnp.full_like(paged.v_scale_pages, jnp.nan))
  paged = _update(paged, k, v, lengths)
  dense = _update(KVCache.init(batch, page * pages_per_seq, num_kv, head_dim, dtype), k, v,
                  lengths)
  as_dense = jax.jit(lambda c: c.to_dense())(paged)
  for b, n in enumerate(np.asarray(lengths)):  # same values and scales in the valid slots
    np.testing.assert_array_equal(np.asarray(as_dense.k[b, :, :n].astype(jnp.float32)),
                                  np.asarray(dense.k[b, :, :n].astype(jnp.float32)))
    np.testing.assert_array_equal(np.asarray(as_dense.v_scale[b, :, :n]),
                                  np.asarray(dense.v_scale[b, :, :n]))
  q = jnp.asarray(rng.standard_normal((batch, 8, head_dim)), jnp.float32)
  expected = _decode(q, dense.k, dense.v, lengths, implementation="xla", **dense.scale_kwargs())
  for impl in ("xla", "xla_pool", None):
    out = _paged_decode(q, paged.k_pages, paged.v_pages, paged.block_tables,
                                     lengths, implementation=impl, **paged.scale_kwargs())
    np.testing.assert_allclose(out, expected, atol=EXACT, rtol=EXACT, err_msg=str(impl))
  windowed = _decode(q, dense.k, dense.v, lengths, window=3, implementation="xla",
                     **dense.scale_kwargs())
  for impl in ("xla", "xla_pool"):
    out = _paged_decode(q, paged.k_pages, paged.v_pages, paged.block_tables,
                                     lengths, window=3, implementation=impl,
                                     **paged.scale_kwargs())
    np.testing.assert_allclose(out, windowed, atol=EXACT, rtol=EXACT, err_msg=str(impl))
  exact = kernels.decode_attention_reference(q, jnp.moveaxis(k, 1, 2), jnp.moveaxis(v, 1, 2),
                                             lengths)
  np.testing.assert_allclose(out := _paged_decode(
      q, paged.k_pages, paged.v_pages, paged.block_tables, lengths, **paged.scale_kwargs()),
      exact, atol=3 * TOL[name])  # keys at 3x the unit scale
  np.testing.assert_array_equal(out[0], 0.0)
  # The Pallas paged kernel (interpreted on CPU) reads the scale pools too.
  out = ops.paged_decode_attention(q, paged.k_pages, paged.v_pages, paged.block_tables, lengths,
                                   implementation="pallas", **paged.scale_kwargs())
  np.testing.assert_allclose(out, expected, atol=EXACT, rtol=EXACT)
  with pytest.raises(TypeError, match="k_pages has the quantized dtype"):
    ops.paged_decode_attention(q, paged.k_pages, paged.v_pages, paged.block_tables, lengths)


def test_paged_layer_prefills_and_decodes_through_quantized_pools():
  attn = _gqa(2)
  x = jax.random.normal(jax.random.key(4), (2, 9, 32))
  dense, paged = attn.init_cache(2, 12, jnp.int8), kvattn.PagedKVCache.contiguous(
      2, 12, 2, 16, jnp.int8, page_size=4)
  outs = {}
  step = jax.jit(lambda xt, c: attn(xt, cache=c))
  for kind, cache in (("dense", dense), ("paged", paged)):
    y, cache = step(x[:, :6], cache)  # prefill: gathered dense view + scales
    ys = [y]
    for t in range(6, 9):
      y, cache = step(x[:, t:t + 1], cache)  # decode: paged dispatch with scale pools
      ys.append(y)
    outs[kind] = jnp.concatenate(ys, axis=1)
  np.testing.assert_allclose(outs["paged"], outs["dense"], atol=1e-5, rtol=1e-5)
