"""Tests for kvattn.MultiHeadLatentAttention and kvattn.LatentCache (DeepSeek-V2 MLA)."""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.extend import core as jex_core

import kvattn
from kvattn import memory, ops

# Tiny dims: C + R (40) != qk_nope + qk_rope (16), v_head_dim (12) != qk_nope (8).
DIMS = dict(d_model=32, num_heads=4, kv_lora_rank=32, qk_nope_head_dim=8, qk_rope_head_dim=8,
            v_head_dim=12)
PROMPT_LENGTHS = (6, 3, 1, 0)  # right-padded batch; the last sequence starts empty
STEPS = 3


def make(path="auto", q_lora_rank=None, seed=0, **overrides):
  kwargs = dict(DIMS, q_lora_rank=q_lora_rank, path=path, rngs=nnx.Rngs(seed))
  kwargs.update(overrides)
  return kvattn.MultiHeadLatentAttention(**kwargs)


def inputs(batch, num_tokens, d_model=DIMS["d_model"], seed=1, scale=1.0, dtype=jnp.float32):
  x = scale * jax.random.normal(jax.random.key(seed), (batch, num_tokens, d_model))
  return x.astype(dtype)


@functools.partial(jax.jit, static_argnums=0)
def _mla_reference(graphdef, state, x, sm_scale):
  return mla_reference_body(nnx.merge(graphdef, state), x, sm_scale)


def mla_reference(layer, x, sm_scale):
  graphdef, state = nnx.split(layer)
  return _mla_reference(graphdef, state, x, jnp.float32(sm_scale))


def mla_reference_body(layer, x, sm_scale):
  """Independent per-head MLA (DeepSeek-V2 eq. 9-19) over one causal sequence, no cache.

  Written from the paper with explicit per-head keys: k[s, n] = [c_kv[s] W_UK[n] |
  k_rope[s]] (ONE rope key for every head) and v[s, n] = c_kv[s] W_UV[n].
  """
  def rms(z, scale):
    return z / jnp.sqrt(jnp.mean(z * z, axis=-1, keepdims=True) + layer.rms_eps) * scale

  hn, c = layer.qk_nope_head_dim, layer.kv_lora_rank
  positions = jnp.broadcast_to(jnp.arange(x.shape[1]), x.shape[:2])
  if layer.q_lora_rank is None:
    q = jnp.einsum("BTD,DNH->BTNH", x, layer.q_proj[...])
  else:
    c_q = rms(x @ layer.q_down_proj[...], layer.q_norm[...])
    q = jnp.einsum("BTQ,QNH->BTNH", c_q, layer.q_up_proj[...])
  q = jnp.concatenate([q[..., :hn], ops.apply_rope(q[..., hn:], positions,
                                                   rope_theta=layer.rope_theta)], -1)
  down = x @ layer.kv_down_proj[...]
  c_kv = rms(down[..., :c], layer.kv_norm[...])
  k_rope = ops.apply_rope(down[..., c:], positions, rope_theta=layer.rope_theta)  # [B, S, R]
  k_nope = jnp.einsum("BSC,CNH->BSNH", c_kv, layer.k_up_proj[...])
  k = jnp.concatenate(
      [k_nope, jnp.broadcast_to(k_rope[:, :, None], k_nope.shape[:3] + k_rope.shape[-1:])], -1)
  v = jnp.einsum("BSC,CNV->BSNV", c_kv, layer.v_up_proj[...])
  logits = jnp.einsum("BTNH,BSNH->BNTS", q, k) * sm_scale
  t = x.shape[1]
  logits = jnp.where(jnp.tril(jnp.ones((t, t), bool)), logits, -jnp.inf)
  out = jnp.einsum("BNTS,BSNV->BTNV", jax.nn.softmax(logits, -1), v)
  return jnp.einsum("BTNV,NVD->BTD", out, layer.o_proj[...])


@functools.partial(jax.jit, static_argnums=0)
def _apply(graphdef, state, x, cache, new_lengths):
  return nnx.merge(graphdef, state)(x, cache=cache, new_lengths=new_lengths)


def run(layer, x, cache=None, new_lengths=None):
  """`layer(x, cache=cache, new_lengths=new_lengths)` compiled once per config and shape.

  Eager calls compile every primitive for every new shape; one jitted call per
  configuration keeps the file fast. Eager behaviour is tested where it differs
  (errors raised on concrete values).
  """
  graphdef, state = nnx.split(layer)
  return _apply(graphdef, state, x, cache, new_lengths)


def prefill_decode(layer, x, prompt_lengths, steps, capacity, fill=None, cache_dtype=jnp.float32):
  """Prefills right-padded prompts in one call, then decodes `steps` tokens one at a time.

  Sequence b's stream is x[b, :prompt_lengths[b] + steps]. Returns (prefill outputs [B, T, D],
  decode outputs [B, steps, D], final cache).
  """
  batch = x.shape[0]
  prompt_lengths = jnp.asarray(prompt_lengths, jnp.int32)
  cache = layer.init_cache(batch, capacity, cache_dtype)
  if fill is not None:  # garbage in every unused slot
    cache = cache.replace(c_kv=jnp.full_like(cache.c_kv, fill),
                          k_rope=jnp.full_like(cache.k_rope, fill))
  t_prompt = int(prompt_lengths.max())
  y_prefill, cache = run(layer, x[:, :t_prompt], cache, prompt_lengths)
  decoded = []
  for t in range(steps):
    xt = jnp.take_along_axis(x, (prompt_lengths + t)[:, None, None], axis=1)
    yt, cache = run(layer, xt, cache)
    decoded.append(yt[:, 0])
  return y_prefill, jnp.stack(decoded, axis=1), cache


def test_latent_cache_update_and_overflow():
  cache = kvattn.LatentCache.init(2, 4, 3, 2)
  assert (cache.batch, cache.max_len, cache.kv_lora_rank, cache.qk_rope_head_dim) == (2, 4, 3, 2)
  assert cache.storage_slots == 8 and cache.dtype == jnp.float32
  c_new = jnp.arange(2 * 3 * 3, dtype=jnp.float32).reshape(2, 3, 3) + 1
  r_new = -jnp.arange(2 * 3 * 2, dtype=jnp.float32).reshape(2, 3, 2) - 1
  cache = cache.update(c_new, r_new, new_lengths=jnp.array([3, 1]))
  np.testing.assert_array_equal(cache.lengths, [3, 1])
  np.testing.assert_array_equal(cache.c_kv[0, :3], c_new[0])
  np.testing.assert_array_equal(cache.c_kv[1, :1], c_new[1, :1])
  np.testing.assert_array_equal(cache.c_kv[1, 1:], 0.0)  # padding tokens are not written
  np.testing.assert_array_equal(cache.k_rope[0, :3], r_new[0])
  cache = cache.update(c_new[:, :1], r_new[:, :1])  # each sequence at its own offset
  np.testing.assert_array_equal(cache.c_kv[0, 3], c_new[0, 0])
  np.testing.assert_array_equal(cache.c_kv[1, 1], c_new[1, 0])
  np.testing.assert_array_equal(cache.lengths, [4, 2])
  with pytest.raises(ValueError, match="cache overflow"):
    cache.update(c_new[:, :1], r_new[:, :1])  # eager: raises before writing
  # Under jit the token that does not fit is dropped and the flag is sticky.
  over = jax.jit(lambda c: c.update(c_new[:, :1], r_new[:, :1]))(cache)
  np.testing.assert_array_equal(over.lengths, [5, 3])
  np.testing.assert_array_equal(over.overflowed, [True, False])
  np.testing.assert_array_equal(over.c_kv[0], cache.c_kv[0])
  np.testing.assert_array_equal(over.c_kv[1, 2], c_new[1, 0])
  with pytest.raises(ValueError, match="c_kv_new"):
    cache.update(jnp.zeros((2, 1, 4)), r_new[:, :1])
  with pytest.raises(ValueError, match="k_rope_new"):
    cache.update(c_new[:, :1], jnp.zeros((2, 1, 3)))
  with pytest.raises(ValueError, match="kv_lora_rank"):
    kvattn.LatentCache.init(2, 4, 0, 2)
  with pytest.raises(TypeError, match="dtype"):
    kvattn.LatentCache.init(2, 4, 3, 2, jnp.int32)
  with pytest.raises(TypeError, match="c_kv_new must have a floating dtype; got int32"):
    cache.update(jnp.ones((2, 1, 3), jnp.int32), r_new[:, :1])


# q_lora_rank = 16 against the paper: slow here; the fast suite pins the q-LoRA path against
# transformers (test_pretrained.py, deepseek_v2_qlora_yarn) and against itself (below).
@pytest.mark.parametrize("q_lora_rank", [None, pytest.param(16, marks=pytest.mark.slow)])
def test_matches_paper_reference_and_scale_uses_nope_plus_rope(q_lora_rank):
  x = inputs(2, 7, scale=2.0)
  right = DIMS["qk_nope_head_dim"] + DIMS["qk_rope_head_dim"]
  wrong = DIMS["kv_lora_rank"] + DIMS["qk_rope_head_dim"]
  base = make("naive", q_lora_rank)  # every layer built with one seed has these params
  expected = mla_reference(base, x, right ** -0.5)
  # With 1/sqrt(C + R) the output is clearly different: this test would catch it.
  assert float(jnp.abs(expected - mla_reference(base, x, wrong ** -0.5)).max()) > 1e-2
  for path in ("naive", "absorbed"):
    layer = make(path, q_lora_rank)
    assert layer.sm_scale == pytest.approx(right ** -0.5)
    y, cache = run(layer, x)
    assert cache is None and y.shape == x.shape
    np.testing.assert_allclose(y, expected, atol=2e-5)


@pytest.mark.parametrize("q_lora_rank", [None, pytest.param(16, marks=pytest.mark.slow)])
def test_absorbed_equals_naive_prefill_and_decode(q_lora_rank):
  x = inputs(len(PROMPT_LENGTHS), max(PROMPT_LENGTHS) + STEPS)
  results = {}
  for path in ("naive", "absorbed"):
    results[path] = prefill_decode(make(path, q_lora_rank), x, PROMPT_LENGTHS, STEPS, capacity=12)
  (pn, dn, cn), (pa, da, ca) = results["naive"], results["absorbed"]
  for b, n in enumerate(PROMPT_LENGTHS):  # prefill outputs of real (unpadded) tokens
    np.testing.assert_allclose(pa[b, :n], pn[b, :n], atol=2e-5)
  np.testing.assert_allclose(da, dn, atol=2e-5)
  np.testing.assert_array_equal(ca.lengths, cn.lengths)
  np.testing.assert_allclose(ca.c_kv, cn.c_kv, atol=1e-6)
  np.testing.assert_allclose(ca.k_rope, cn.k_rope, atol=1e-6)
  # Without a cache both paths match the paper reference (test above).


# "auto" (q-LoRA) runs the naive prefill over the cache and the absorbed decode; "absorbed"
# adds the absorbed multi-token prefill. The naive-only run is in the slow suite.
@pytest.mark.parametrize("path", ["auto", pytest.param("naive", marks=pytest.mark.slow),
                                  "absorbed"])
def test_incremental_decode_matches_full_forward_and_ignores_unused_slots(path):
  layer = make(path, q_lora_rank=16 if path == "auto" else None)
  x = inputs(len(PROMPT_LENGTHS), max(PROMPT_LENGTHS) + STEPS)
  clean = prefill_decode(layer, x, PROMPT_LENGTHS, STEPS, capacity=12)
  full, _ = run(layer, x)  # causal: token t of sequence b sees only its own tokens <= t
  for b, n in enumerate(PROMPT_LENGTHS):
    np.testing.assert_allclose(clean[0][b, :n], full[b, :n], atol=1e-5)
    np.testing.assert_allclose(clean[1][b], full[b, n:n + STEPS], atol=1e-5)
  np.testing.assert_array_equal(clean[2].lengths, np.array(PROMPT_LENGTHS) + STEPS)
  for fill in (jnp.nan, 1e30):
    # Garbage in unused slots changes nothing beyond float rounding (a NaN may
    # route the reference through a differently compiled but equivalent dot).
    dirty = prefill_decode(layer, x, PROMPT_LENGTHS, STEPS, capacity=12, fill=fill)
    for b, n in enumerate(PROMPT_LENGTHS):
      np.testing.assert_allclose(dirty[0][b, :n], clean[0][b, :n], rtol=0, atol=1e-6)
    np.testing.assert_allclose(dirty[1], clean[1], rtol=0, atol=1e-6)


# The absorbed case also compares with the naive path's decode (slow: naive alone).
@pytest.mark.parametrize("path", [pytest.param("naive", marks=pytest.mark.slow), "absorbed"])
def test_window_and_empty_rows(path):
  layer = make(path, window=3)
  x = inputs(2, 9)
  _, dec, _ = prefill_decode(layer, x, (5, 2), 4, capacity=10)
  full, _ = run(layer, x)
  for b, n in enumerate((5, 2)):
    np.testing.assert_allclose(dec[b], full[b, n:n + 4], atol=1e-5)
  np.testing.assert_allclose(dec, prefill_decode(make("naive", window=3), x, (5, 2), 4, 10)[1],
                             atol=2e-5)
  # A row that stays empty (length 0) returns exact zeros, never NaN.
  cache = layer.init_cache(2, 4)
  cache = cache.replace(c_kv=jnp.full_like(cache.c_kv, jnp.nan))
  y, cache = run(layer, x[:, :1], cache, jnp.array([1, 0]))
  np.testing.assert_array_equal(cache.lengths, [1, 0])
  np.testing.assert_array_equal(y[1], 0.0)
  assert bool(jnp.isfinite(y[0]).all())


@functools.partial(jax.jit, static_argnums=0)
def _heads(graphdef, state, x):
  """Per-head outputs [B, T, N, Hv]: cached prefill, one cached decode step, no-cache forward."""
  layer = nnx.merge(graphdef, state)
  cache = layer.init_cache(x.shape[0], 8)
  prefill, cache = layer.attend_heads(x[:, :5], cache=cache)
  step, cache = layer.attend_heads(x[:, 5:], cache=cache)
  full, _ = layer.attend_heads(x)
  return jnp.concatenate([prefill, step, full], axis=1), cache


# "auto" traces the naive prefill and full forward and the absorbed decode step.
@pytest.mark.parametrize("path, q_lora_rank", [
    ("auto", None), pytest.param("absorbed", 16, marks=pytest.mark.slow)])
def test_rope_key_is_shared_by_all_heads(path, q_lora_rank):
  hn, head = DIMS["qk_nope_head_dim"], 2
  x = inputs(2, 6)
  base = make(path, q_lora_rank)
  # Token 0 of a sequence attends only itself, so its output cannot depend on
  # logits; every later token must react to a change of its head's logits.
  later = np.array([t for t in range(12) if t not in (0, 6)])  # [prefill 0-4, step 5, full 0-5]

  def heads(layer):
    graphdef, state = nnx.split(layer)
    return _heads(graphdef, state, x)

  ref, cache = heads(base)
  assert cache.k_rope.shape == (2, 8, DIMS["qk_rope_head_dim"])  # one rope key, no head axis
  noise = jax.random.normal(jax.random.key(7), (DIMS["d_model"], DIMS["qk_rope_head_dim"]))
  perturbed = nnx.clone(base)  # perturb only head `head`'s rope-query weights
  w = perturbed.q_proj if q_lora_rank is None else perturbed.q_up_proj
  w[...] = w[...].at[:, head, hn:].add(noise[:w.shape[0]])
  out, _ = heads(perturbed)
  others = [n for n in range(DIMS["num_heads"]) if n != head]
  np.testing.assert_array_equal(out[:, :, others], ref[:, :, others])
  assert float(jnp.abs(out - ref).max(axis=-1)[:, later, head].min()) > 1e-4
  # The shared rope key itself (W_KR: last R columns of kv_down_proj) moves every head.
  shared = nnx.clone(base)
  c = DIMS["kv_lora_rank"]
  shared.kv_down_proj[...] = shared.kv_down_proj[...].at[:, c:].add(noise)
  out, _ = heads(shared)
  assert float(jnp.abs(out - ref).max(axis=-1)[:, later].min()) > 1e-4


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_cache_bytes_per_token_and_ratio_to_mha(dtype):
  c, r, n, h = DIMS["kv_lora_rank"], DIMS["qk_rope_head_dim"], DIMS["num_heads"], 8
  cache = make().init_cache(3, 16, dtype)
  itemsize = jnp.dtype(dtype).itemsize
  assert memory.measured_bytes_per_token(cache) == (c + r) * itemsize
  assert memory.mla_bytes_per_token(c, r, dtype) == (c + r) * itemsize
  mha = kvattn.GroupedQueryAttention(d_model=DIMS["d_model"], num_heads=n, num_kv_heads=n,
                                     head_dim=h, rngs=nnx.Rngs(0)).init_cache(3, 16, dtype)
  ratio = memory.mla_to_mha_cache_ratio(c, r, n, h)
  assert ratio == pytest.approx((c + r) / (2 * n * h))
  assert ratio == pytest.approx(
      memory.measured_bytes_per_token(cache) / memory.measured_bytes_per_token(mha))
  # Writing tokens does not change the footprint (the update returns same-shaped arrays).
  _, cache = run(make(), inputs(3, 2), cache)
  assert memory.measured_bytes_per_token(cache) == (c + r) * itemsize


# "auto" covers the naive prefill and absorbed decode, and adds the bf16-vs-f32 check.
@pytest.mark.parametrize("path, q_lora_rank", [
    ("auto", None), pytest.param("absorbed", 16, marks=pytest.mark.slow)])
def test_bf16_large_inputs_stay_finite(path, q_lora_rank):
  # "auto" runs the naive prefill and the absorbed decode; "absorbed" both absorbed.
  layer = make(path, q_lora_rank)
  x = inputs(len(PROMPT_LENGTHS), max(PROMPT_LENGTHS) + STEPS, scale=300.0, dtype=jnp.bfloat16)
  pre, dec, cache = prefill_decode(layer, x, PROMPT_LENGTHS, STEPS, capacity=12,
                                   cache_dtype=jnp.bfloat16)
  assert pre.dtype == dec.dtype == cache.c_kv.dtype == jnp.bfloat16
  for b, n in enumerate(PROMPT_LENGTHS):
    assert bool(jnp.isfinite(pre[b, :n]).all())
  assert bool(jnp.isfinite(dec).all())
  assert bool(jnp.isfinite(cache.k_rope).all())
  if path != "auto":
    return
  # Unscaled bf16 stays close to f32: products accumulate in f32.
  x1 = inputs(2, 6, dtype=jnp.bfloat16)
  y16, _ = run(layer, x1)
  y32, _ = run(layer, x1.astype(jnp.float32))
  np.testing.assert_allclose(y16.astype(jnp.float32), y32, atol=5e-2)


def cache_sized_intermediates(layer, x, cache):
  """(primitive, shape) of every value in one traced step that has the cache's slot axis."""
  graphdef, state = nnx.split(layer)

  def step(state, x, cache):
    return nnx.merge(graphdef, state)(x, cache=cache)

  jaxpr = jax.make_jaxpr(step)(state, x, cache).jaxpr
  found = []

  def walk(jaxpr):
    for eqn in jaxpr.eqns:
      for var in eqn.outvars:
        if cache.max_len in var.aval.shape:
          found.append((eqn.primitive.name, tuple(var.aval.shape)))
    for sub in jex_core.subjaxprs(jaxpr):  # into pjit / custom_jvp bodies
      walk(sub)

  walk(jaxpr)
  return found


def test_absorbed_decode_uses_dispatch_point_without_expanding_cache(monkeypatch):
  calls = []
  real = ops.mla_decode_attention

  def spy(*args, **kwargs):
    calls.append(kwargs)
    return real(*args, **kwargs)

  monkeypatch.setattr(ops, "mla_decode_attention", spy)
  # Widths chosen so per-head keys (Hn, Hn + R) and values (Hv) are recognisable:
  # C = 32, R = 4, Hn = 6, Hv = 10, and 13 slots (a size no other axis has).
  dims = dict(qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=10)
  layer = make("auto", decode_implementation="xla", **dims)
  x = inputs(2, 5)
  empty = layer.init_cache(2, 13)
  cache_sized_intermediates(layer, x[:, :4], empty)  # traces a multi-token prefill
  assert not calls  # prefill: naive path
  cache = empty.replace(lengths=jnp.array([4, 2], jnp.int32))
  absorbed = cache_sized_intermediates(layer, x[:, 4:], cache)  # traces a decode step
  assert len(calls) == 1 and calls[0]["implementation"] == "xla"
  assert calls[0]["sm_scale"] == pytest.approx(10 ** -0.5)

  # The absorbed step never builds per-head keys/values over the slots and
  # never concatenates (copies) the cache; the naive step does both.
  per_head_widths = {6, 10}  # Hn, Hv and Hn + R (= 10)
  assert absorbed and not [(p, s) for p, s in absorbed
                           if p == "concatenate" or s[-1] in per_head_widths]
  naive = cache_sized_intermediates(make("naive", **dims), x[:, 4:], cache)
  assert [s for p, s in naive if p == "concatenate"]
  assert [s for p, s in naive if s[-1] in per_head_widths]


def test_jitted_decode_step_compiles_once_and_matches_eager():
  layer = make("auto")
  graphdef, state = nnx.split(layer)

  @functools.partial(jax.jit, donate_argnums=2)  # cache donated: XLA updates it in place
  @chex.assert_max_traces(n=1)
  def step(state, x, cache):
    return nnx.merge(graphdef, state)(x, cache=cache)

  x = inputs(2, 8)
  cache = layer.init_cache(2, 8)
  _, cache = run(layer, x[:, :4], cache, jnp.array([4, 2]))
  eager_cache = jax.tree_util.tree_map(jnp.copy, cache)  # own buffers: `cache` is donated
  for t in range(4):  # later steps reuse the first compilation; eager and jitted agree
    xt = x[:, 4 + t:5 + t]
    y, cache = step(state, xt, cache)
    ye, eager_cache = layer(xt, cache=eager_cache)
    np.testing.assert_allclose(y, ye, atol=1e-6)
  np.testing.assert_array_equal(cache.lengths, [8, 6])
  np.testing.assert_allclose(cache.c_kv, eager_cache.c_kv, atol=1e-6)


def test_overflow_under_jit_is_flagged_and_does_not_corrupt_other_rows():
  layer = make("auto")
  graphdef, state = nnx.split(layer)
  step = jax.jit(lambda state, x, cache: nnx.merge(graphdef, state)(x, cache=cache))
  x = inputs(2, 6)
  cache = layer.init_cache(2, 4)
  _, cache = run(layer, x[:, :4], cache, jnp.array([4, 1]))
  with pytest.raises(ValueError, match="cache overflow"):
    layer(x[:, 4:5], cache=cache)  # eager: concrete lengths, raises before compute
  y, over = step(state, x[:, 4:5], cache)
  np.testing.assert_array_equal(over.lengths, [5, 2])
  np.testing.assert_array_equal(over.overflowed, [True, False])
  np.testing.assert_array_equal(over.c_kv[0], cache.c_kv[0])  # nothing written out of range
  ok, _ = step(state, x[1:2, 4:5], jax.tree_util.tree_map(lambda a: a[1:2], cache))
  np.testing.assert_allclose(y[1], ok[0], atol=1e-6)


@pytest.mark.parametrize("bad, name", [
    (dict(d_model=0), "d_model"),
    (dict(num_heads=0), "num_heads"),
    (dict(kv_lora_rank=-4), "kv_lora_rank"),
    (dict(qk_nope_head_dim=0), "qk_nope_head_dim"),
    (dict(qk_rope_head_dim=0), "qk_rope_head_dim"),
    (dict(qk_rope_head_dim=7), "qk_rope_head_dim must be even"),
    (dict(v_head_dim=0), "v_head_dim"),
    (dict(q_lora_rank=0), "q_lora_rank"),
    (dict(rope_theta=0.0), "rope_theta"),
    (dict(window=0), "window"),
    (dict(rms_eps=-1.0), "rms_eps"),
    (dict(path="fast"), "path must be one of"),
    (dict(decode_implementation="xla_pool"),  # a paged-cache backend: MLA has no paged cache
     r"decode_implementation must be one of \['pallas', 'xla', 'xla_blocked'\] or None; got "
     r"'xla_pool'"),
])
def test_impossible_dimensions_raise_value_error_naming_them(bad, name):
  with pytest.raises(ValueError, match=name):
    make(**bad)


def test_non_floating_dtypes_raise_type_error_at_construction():
  with pytest.raises(TypeError, match="dtype must be a floating dtype .*; got int32"):
    make(dtype=jnp.int32)
  with pytest.raises(TypeError, match="param_dtype must be a floating dtype .*; got int16"):
    make(param_dtype=jnp.int16)  # int8 is W8A8 (kvattn.models.int8), tested in test_int8


def test_bad_call_arguments_raise_before_compute():
  layer = make()
  x = inputs(2, 3)
  with pytest.raises(TypeError, match="kv_lora_rank"):
    make(kv_lora_rank=16.0)
  with pytest.raises(ValueError, match="d_model"):
    layer(inputs(2, 3, d_model=16))
  with pytest.raises(TypeError, match="LatentCache"):
    layer(x, cache=kvattn.KVCache.init(2, 8, 4, 8))
  with pytest.raises(ValueError, match="kv_lora_rank"):
    layer(x, cache=kvattn.LatentCache.init(2, 8, 16, DIMS["qk_rope_head_dim"]))
  with pytest.raises(ValueError, match="positions"):
    layer(x, positions=jnp.zeros((2, 4), jnp.int32))
  with pytest.raises(ValueError, match="new_lengths"):
    layer(x, cache=layer.init_cache(2, 8), new_lengths=jnp.array([4, 1]))


@pytest.mark.slow
@pytest.mark.parametrize("q_lora_rank", [None, 24])
@pytest.mark.parametrize("dims", [
    dict(d_model=64, num_heads=8, kv_lora_rank=64, qk_nope_head_dim=16, qk_rope_head_dim=8,
         v_head_dim=16),
    dict(d_model=48, num_heads=1, kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=2,
         v_head_dim=32),
])
@pytest.mark.parametrize("window", [None, 1, 4])
def test_paths_agree_on_larger_grid(dims, q_lora_rank, window):
  prompt_lengths = (11, 7, 1, 0, 4)
  steps = 5
  x = inputs(len(prompt_lengths), max(prompt_lengths) + steps, d_model=dims["d_model"])
  results = {}
  for path in ("naive", "absorbed", "auto"):
    layer = kvattn.MultiHeadLatentAttention(**dims, q_lora_rank=q_lora_rank, window=window,
                                            path=path, rngs=nnx.Rngs(3))
    results[path] = prefill_decode(layer, x, prompt_lengths, steps, capacity=17, fill=jnp.nan)
  for path in ("absorbed", "auto"):
    for b, n in enumerate(prompt_lengths):
      np.testing.assert_allclose(results[path][0][b, :n], results["naive"][0][b, :n], atol=2e-5)
    np.testing.assert_allclose(results[path][1], results["naive"][1], atol=2e-5)
  full, _ = run(layer, x)
  for b, n in enumerate(prompt_lengths):
    np.testing.assert_allclose(results["auto"][1][b], full[b, n:n + steps], atol=1e-5)


@pytest.mark.slow  # the interpreted kernel compiles slowly on CPU (~10 s)
def test_decode_through_pallas_backend_matches_xla():
  """The module's decode_implementation reaches the dispatch point: the Pallas
  kernel (interpret mode on CPU when named) gives the XLA result."""
  dims = dict(kv_lora_rank=32, qk_rope_head_dim=16)  # widths the kernel supports
  x = inputs(3, 6)
  ys = {}
  for impl in ("xla", "pallas"):
    layer = make("auto", decode_implementation=impl, **dims)
    cache = layer.init_cache(3, 16)
    cache = cache.replace(c_kv=jnp.full_like(cache.c_kv, jnp.nan))
    _, cache = run(layer, x[:, :5], cache, jnp.array([5, 2, 0]))
    ys[impl], _ = run(layer, x[:, 5:], cache)
  assert bool(jnp.isfinite(ys["pallas"]).all())
  np.testing.assert_allclose(ys["pallas"], ys["xla"], atol=1e-5)
