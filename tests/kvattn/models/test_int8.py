"""W8A8 (`kvattn.models.int8`, `param_dtype="int8"`): the fast dot against its pure-jnp
reference (exact integer math), the quantizers' bounds and edges, and the int8 model against
f32 on a tiny model, through generate, every cache kind and the batcher."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kvattn.caches import registry
from kvattn.inference.batching import ContinuousBatcher
from kvattn.inference.generation import generate
from kvattn.models import int8
from kvattn.models import scan
from kvattn.models import transformer
from tests.kvattn.caches.test_every_kind import SETTINGS


def _rand(shape, seed=0, scale=1.0):
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape).astype(np.float32) * scale)


# ----------------------------------------------------------------------------------------------
# The dot and the quantizers.


@pytest.mark.parametrize("rows", [0, 1, 2, 7])
@pytest.mark.parametrize("w_shape,num_in,transposed", [
    ((16, 24), 1, False),  # a plain [D, F] weight
    ((16, 3, 8), 1, False),  # q_proj [D, N, H]
    ((3, 8, 16), 2, False),  # o_proj [N, H, D]
    ((40, 16), 1, True),  # a tied embedding [V, D] used as the LM head
])
def test_int8_dot_equals_the_integer_reference_exactly(rows, w_shape, num_in, transposed):
  w = _rand(w_shape, 1)
  if transposed:
    w_q, scale = int8.quantize_weight(w.T, 1)
    w_q = w_q.T
    in_shape = w_shape[1:]
  else:
    w_q, scale = int8.quantize_weight(w, num_in)
    in_shape = w_shape[:num_in]
  x = _rand((rows,) + in_shape, 2, 3.0)
  if rows > 2:
    x = x.at[2].set(0.0)  # an all-zero row stays exactly zero
  got = int8.int8_dot(x, w_q, scale, transposed=transposed)
  want = int8.int8_dot_reference(x, w_q, scale, transposed=transposed)
  assert got.shape == (rows,) + scale.shape and got.dtype == jnp.float32
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  if rows > 2:
    assert not np.any(np.asarray(got[2]))
  # Against the f32 product: each of the two roundings is at most half a step.
  if rows:
    exact = np.asarray(jnp.einsum("md,vd->mv", x.reshape(rows, -1), w.reshape(w_shape[0], -1))
                       if transposed else x.reshape(rows, -1) @ w.reshape(-1, scale.size))
    bound = (np.abs(x.reshape(rows, -1)).max(1, keepdims=True) / 127 / 2 *
             np.abs(np.asarray(int8.dequantize_weight(w_q, scale, transposed=transposed)))
             .reshape((-1, x[0].size) if transposed else (x[0].size, -1))
             .sum(1 if transposed else 0).reshape(1, -1)
             + np.abs(x.reshape(rows, -1)).sum(1, keepdims=True)
             * np.asarray(scale).reshape(1, -1) / 2)
    assert np.all(np.abs(np.asarray(got).reshape(rows, -1) - exact) <= bound * 1.001 + 1e-6)


def test_a_non_finite_row_gives_nan_in_that_row_only():
  w_q, scale = int8.quantize_weight(_rand((8, 5)), 1)
  x = _rand((3, 8)).at[1, 4].set(jnp.nan).at[2, 0].set(jnp.inf)
  got = np.asarray(int8.int8_dot(x, w_q, scale))
  assert np.all(np.isnan(got[1:])) and np.all(np.isfinite(got[0]))
  clean = np.asarray(int8.int8_dot(x[:1], w_q, scale))
  np.testing.assert_array_equal(got[0], clean[0])  # rows are quantized independently


def test_quantize_weight_bounds_and_edges():
  w = _rand((32, 6), 3).at[:, 2].set(0.0)  # channel 2 all zero
  w_q, scale = int8.quantize_weight(w, 1)
  assert w_q.dtype == jnp.int8 and scale.shape == (6,)
  assert int(jnp.max(jnp.abs(w_q.astype(jnp.int32)))) == 127  # the range is used
  assert float(scale[2]) == 1.0 and not np.any(np.asarray(w_q[:, 2]))
  err = np.abs(np.asarray(int8.dequantize_weight(w_q, scale) - w))
  assert np.all(err <= np.asarray(scale) / 2 * 1.0001)
  with pytest.raises(ValueError, match="num_in"):
    int8.quantize_weight(w, 2)
  with pytest.raises(ValueError, match="finite"):
    int8.quantize_weight(w.at[0, 0].set(jnp.inf), 1)


@pytest.mark.parametrize("rows", [0, 1, 7, 64])
@pytest.mark.parametrize("w_shape,num_in", [
    ((16, 24), 1),  # a plain [D, F] weight
    ((16, 3, 8), 1),  # q_proj [D, N, H]
    ((3, 8, 16), 2),  # o_proj [N, H, D]
    ((16, 40), 1),  # an LM head [D, V]
])
def test_packed_weights_give_the_int8_products_bit_for_bit(rows, w_shape, num_in):
  """The stored form (uint8, output-major: pack_weight) through the u8 x s8 dot equals the
  int8 weight through the s8 x s8 dot and the integer reference, exactly."""
  w_q, scale = int8.quantize_weight(_rand(w_shape, 1), num_in)
  w_p = int8.pack_weight(w_q, num_in)
  out_shape, in_shape = w_shape[num_in:], w_shape[:num_in]
  assert w_p.dtype == jnp.uint8 and w_p.shape == out_shape + in_shape
  np.testing.assert_array_equal(np.asarray(int8.unpack_weight(w_p, len(out_shape))),
                                np.asarray(w_q))
  x = _rand((rows,) + in_shape, 2, 3.0)
  if rows > 2:
    x = x.at[2].set(0.0).at[1, 0].set(1e-30)  # a zero row; a row with a tiny entry
  got = jax.jit(int8.int8_dot)(x, w_p, scale)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(int8.int8_dot(x, w_q, scale)))
  np.testing.assert_array_equal(np.asarray(got),
                                np.asarray(int8.int8_dot_reference(x, w_p, scale)))
  np.testing.assert_array_equal(np.asarray(int8.dequantize_weight(w_p, scale)), np.moveaxis(
      np.asarray(int8.dequantize_weight(w_q, scale)), tuple(range(num_in)),
      tuple(range(w_q.ndim - num_in, w_q.ndim))))
  with pytest.raises(ValueError, match="input features"):
    int8.int8_dot(_rand((2, 5)), w_p, scale)


def test_u8s8_dot_is_exact_at_the_int8_extremes_and_checks_its_operands():
  a = jnp.asarray(np.array([[0, 255, 128], [255, 255, 255]], np.uint8))
  b = jnp.asarray(np.array([[-127, 127, 0], [-128, -128, -128]], np.int8))
  want = np.asarray(a, np.int64) @ np.asarray(b, np.int64).T
  np.testing.assert_array_equal(np.asarray(jax.jit(int8.u8s8_dot)(a, b)), want)
  np.testing.assert_array_equal(np.asarray(int8.u8s8_dot(a, b)), want)  # eager
  with pytest.raises(TypeError, match="uint8"):
    int8.u8s8_dot(b, b)
  with pytest.raises(TypeError, match="uint8"):
    int8.u8s8_dot(a, b[:, :2])


def test_a_packed_weight_runs_one_u8_x_s8_dot_with_the_weight_on_the_left():
  """The form XLA:CPU runs without repacking the weight: 2-D u8[N, K] x s8[M, K] -> s32[N, M],
  a single row padded to MIN_ROWS."""
  w_p = int8.pack_weight(int8.quantize_weight(_rand((16, 24)), 1)[0], 1)
  scale = jnp.ones((24,), jnp.float32)
  hlo = jax.jit(lambda x: int8.int8_dot(x, w_p, scale)).lower(_rand((1, 1, 16))).as_text()
  dots = [line for line in hlo.splitlines() if "dot_general" in line]
  assert len(dots) == 1
  assert "tensor<24x16xui8>" in dots[0] and f"tensor<{int8.MIN_ROWS}x16xi8>" in dots[0]
  assert f"-> tensor<24x{int8.MIN_ROWS}xi32>" in dots[0]


def test_a_single_row_is_padded_into_a_2d_s8_dot():
  """The form XLA:CPU runs fast (module doc): 2-D s8 x s8 -> s32, at least MIN_ROWS rows."""
  w_q, scale = int8.quantize_weight(_rand((16, 24)), 1)
  hlo = jax.jit(lambda x: int8.int8_dot(x, w_q, scale)).lower(_rand((1, 1, 16))).as_text()
  dots = [line for line in hlo.splitlines() if "dot_general" in line]
  assert len(dots) == 1
  assert f"tensor<{int8.MIN_ROWS}x16xi8>" in dots[0] and "tensor<16x24xi8>" in dots[0]
  assert "-> tensor<2x24xi32>" in dots[0]


# ----------------------------------------------------------------------------------------------
# The model.


def _config(**kw):
  return transformer.model_config(d_model=32, num_layers=2, mlp_dim=64, **{
      "attention": dict(num_heads=4, num_kv_heads=2, head_dim=8), **kw})


@pytest.fixture(scope="module")
def models():
  f32 = transformer.Transformer.from_config(_config(), rngs=nnx.Rngs(0))
  return f32, transformer.quantize_model(nnx.clone(f32))


def test_config_param_dtype_int8_builds_int8_weights_with_f32_scales():
  m = transformer.Transformer.from_config(_config(param_dtype="int8", tie_embeddings=False),
                                          rngs=nnx.Rngs(0))
  assert m.spec.param_dtype == jnp.int8
  attn, mlp = m.layers[0].attn, m.layers[0].mlp
  for w, s, out, inp in ((attn.q_proj, attn.q_proj_scale, (4, 8), (32,)),
                         (attn.o_proj, attn.o_proj_scale, (32,), (4, 8)),
                         (mlp.gate, mlp.gate_scale, (64,), (32,)),
                         (m.lm_head, m.lm_head_scale, (259,), (32,)),
                         (m.embedding, m.embedding_scale, (259,), (32,))):
    # Stored packed: uint8, output channels first (int8.pack_weight).
    assert w[...].dtype == jnp.uint8 and w[...].shape == out + inp
    assert s[...].dtype == jnp.float32 and s[...].shape == out
  assert m.layers[0].attn_norm.scale[...].dtype == jnp.float32
  with pytest.raises(ValueError, match="model.param_dtype"):
    transformer.resolve_config(_config(param_dtype="int16"))
  with pytest.raises(ValueError, match="already int8"):
    transformer.quantize_model(m)


def test_int8_logits_stay_close_to_f32(models):
  f32, w8 = models
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 259, (2, 12)), jnp.int32)
  a, _ = f32(tokens)
  b, _ = w8(tokens)
  rel = float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(a)))
  assert 0 < rel < 0.05, rel


@pytest.mark.slow  # ~8 CPU-seconds
def test_scan_forward_runs_the_same_int8_products(models):
  _, w8 = models
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 259, (2, 12)), jnp.int32)
  caches = w8.init_caches(2, 12)
  defs, params = scan.scan_parts(w8)
  h, _ = scan.scan_forward(defs, params, scan.stack_caches(caches, len(defs[0])), tokens, None)
  want, _ = w8(tokens, w8.init_caches(2, 12))
  np.testing.assert_allclose(np.asarray(scan.logits_from_hidden(params, h)), np.asarray(want),
                             rtol=1e-5, atol=1e-5)


@pytest.mark.slow  # ~12 CPU-seconds
def test_mla_layers_take_int8_projections():
  cfg = _config(param_dtype="int8", layers=({}, {"kind": "mla"}))
  m = transformer.Transformer.from_config(cfg, rngs=nnx.Rngs(0))
  mla = m.layers[1].attn
  assert mla.kv_down_proj[...].dtype == jnp.uint8 and mla.k_up_proj[...].dtype == jnp.float32
  ref = transformer.Transformer.from_config(_config(layers=({}, {"kind": "mla"})),
                                            rngs=nnx.Rngs(0))
  tokens = jnp.arange(10, dtype=jnp.int32)[None]
  a, _ = ref(tokens, ref.init_caches(1, 10))
  b, _ = m(tokens, m.init_caches(1, 10))
  assert float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(a))) < 0.05


PROMPT_LENGTHS = np.array([9, 5], np.int32)


@pytest.fixture(scope="module")
def prompts():
  out = np.random.default_rng(0).integers(0, 256, (2, 9), dtype=np.int32)
  out[1, 5:] = 0
  return out


def test_generate_int8_weights_with_an_int8_cache(models, prompts):
  f32, w8 = models
  want, _ = generate(f32, prompts, PROMPT_LENGTHS, 6)
  got, lengths = generate(w8, prompts, PROMPT_LENGTHS, 6, cache_dtype=jnp.int8)
  assert got.shape == (2, 6) and np.all(np.asarray(lengths) == 6)
  assert np.mean(np.asarray(got) == np.asarray(want)) >= 0.5  # a random model: loose


@pytest.mark.slow  # ~25 CPU-seconds: one generate compile per kind
@pytest.mark.parametrize("kind", sorted(registry.CACHE_KIND_TABLE))
def test_every_cache_kind_with_room_gives_the_dense_cache_tokens(models, prompts, kind):
  _, w8 = models
  max_len = int(PROMPT_LENGTHS.max()) + 6
  want, _ = generate(w8, prompts, PROMPT_LENGTHS, 6, max_len=max_len)
  caches = registry.build_caches(w8, 2, max_len, None, {"kind": kind, **SETTINGS[kind][0]})
  got, _ = generate(w8, prompts, PROMPT_LENGTHS, 6, caches=caches)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.slow  # ~10 CPU-seconds: compiles the batcher
def test_batcher_with_int8_weights_gives_each_sequence_its_tokens_alone(models):
  _, w8 = models
  rng = np.random.default_rng(1)
  requests = [(f"r{i}", rng.integers(0, 256, n).astype(np.int32), new)
              for i, (n, new) in enumerate([(5, 6), (9, 3), (2, 5)])]
  batcher = ContinuousBatcher(w8, num_slots=2, num_pages=16, page_size=4, max_len=16,
                              max_prompt_len=9, seed=0)
  results = batcher.run(requests)
  for rid, prompt, new in requests:
    padded = np.zeros((1, 9), np.int32)
    padded[0, :len(prompt)] = prompt
    want, _ = generate(w8, padded, np.array([len(prompt)], np.int32), new)
    np.testing.assert_array_equal(results[rid].tokens, np.asarray(want)[0], err_msg=rid)


def test_packed_model_gives_the_unpacked_int8_logits_exactly(models):
  _, w8 = models
  old = int8.unpacked_model(w8)
  assert old.layers[0].mlp.gate[...].dtype == jnp.int8 and old.embedding[...].dtype == jnp.int8
  tokens = jnp.asarray(np.random.default_rng(3).integers(0, 259, (2, 7)), jnp.int32)

  def logits(model):
    graphdef, state = nnx.split(model)
    return jax.jit(lambda state: nnx.merge(graphdef, state)(tokens)[0])(state)

  np.testing.assert_array_equal(np.asarray(logits(w8)), np.asarray(logits(old)))


@pytest.mark.slow  # ~15 CPU-seconds: two generate compiles
def test_packed_model_decodes_the_unpacked_int8_tokens(models, prompts):
  _, w8 = models
  old = int8.unpacked_model(w8)
  want, _ = generate(old, prompts, PROMPT_LENGTHS, 5)
  got, _ = generate(w8, prompts, PROMPT_LENGTHS, 5)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_gqa_fused_int8_qkv_equals_three_separate_products(models):
  _, w8 = models
  attn = w8.layers[0].attn
  x = _rand((2, 3, 32), 5)
  q, k, v = attn.qkv(x)
  for got, name in ((q, "q_proj"), (k, "k_proj"), (v, "v_proj")):
    want = int8.int8_dot(x, getattr(attn, name)[...], getattr(attn, name + "_scale")[...])
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("rows", [0, 1, 5])
def test_int8_dots_share_one_quantization_and_equal_int8_dot(rows):
  """`int8_dots` (one quantization of x, a u8 x s8 dot per weight) gives each weight's
  `int8_dot` bit for bit, for weights of different output shapes; a weight whose input
  features do not match raises."""
  weights = []
  for seed, shape, num_in in ((1, (16, 3, 8), 1), (2, (16, 24), 1), (3, (16, 5), 1)):
    w_q, scale = int8.quantize_weight(_rand(shape, seed), num_in)
    weights.append((int8.pack_weight(w_q, num_in), scale))
  x = _rand((rows, 16), 4, 2.0)
  got = jax.jit(int8.int8_dots)(x, weights)
  for out, (w_p, scale) in zip(got, weights):
    assert out.shape == (rows,) + scale.shape
    np.testing.assert_array_equal(np.asarray(out), np.asarray(int8.int8_dot(x, w_p, scale)))
  bad = int8.pack_weight(int8.quantize_weight(_rand((12, 4), 5), 1)[0], 1)
  with pytest.raises(ValueError, match="input features"):
    int8.int8_dots(x, [weights[0], (bad, jnp.ones((4,)))])


def test_int8_mlp_applies_its_activation():
  """An int8 GeGLU (Gemma) applies tanh GELU, as its float form does (it once ran silu):
  it is far closer to the float GeGLU than to the float SwiGLU of the same weights."""
  mlp = transformer.SwiGLU(16, 24, dtype=jnp.float32, param_dtype=jnp.float32,
                           rngs=nnx.Rngs(0), activation="gelu_tanh")
  x = _rand((2, 3, 16), 6)
  geglu = mlp(x)
  mlp.activation = "silu"
  swiglu = mlp(x)
  mlp.activation = "gelu_tanh"
  int8.quantize_module(mlp)
  got = mlp(x)
  assert float(jnp.max(jnp.abs(got - geglu))) * 4 < float(jnp.max(jnp.abs(got - swiglu)))


@pytest.mark.slow  # ~10 CPU-seconds of eager ops
def test_smoothquant_migration_keeps_the_float_function():
  """SmoothQuant (transformer.smooth_model) rescales norms and weights but computes the same
  logits in f32; the smoothed model then quantizes like any other."""
  f32 = transformer.Transformer.from_config(_config(), rngs=nnx.Rngs(1))
  tokens = jnp.asarray(np.random.default_rng(2).integers(0, 259, (1, 10)), jnp.int32)
  want, _ = f32(tokens)
  smoothed = transformer.smooth_model(nnx.clone(f32), tokens, alpha=0.5)
  got, _ = smoothed(tokens)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-4)
  assert not np.allclose(np.asarray(smoothed.layers[0].mlp.down[...]),
                         np.asarray(f32.layers[0].mlp.down[...]))
  with pytest.raises(ValueError, match="alpha"):
    transformer.smooth_model(nnx.clone(f32), tokens, alpha=1.5)
  w8 = transformer.quantize_model(smoothed)
  with pytest.raises(ValueError, match="before quantize_model"):
    transformer.smooth_model(w8, tokens)
