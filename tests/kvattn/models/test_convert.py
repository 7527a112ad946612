"""kvattn.models.convert: regrouping KV heads (GQA paper) and GQA -> MLA (MHA2MLA), and uptraining."""

from __future__ import annotations

import pathlib
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import kvattn
from kvattn import memory
from kvattn.caches import registry as cache_factories
from kvattn.models import convert
from kvattn.training import data
from kvattn.training import trainer as train_lib
from kvattn.models import transformer as transformer_lib

V = 64


def _model(num_heads=4, num_kv_heads=2, head_dim=8, *, qkv_bias=False, num_layers=1, d_model=32,
           seed=0, **attention):
  cfg = transformer_lib.model_config(
      vocab_size=V, d_model=d_model, num_layers=num_layers, mlp_dim=64,
      attention=dict(num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                     rope_theta=100.0, qkv_bias=qkv_bias, **attention))
  model = transformer_lib.Transformer.from_config(cfg, rngs=nnx.Rngs(seed))
  if qkv_bias:  # random biases (they are initialised to zero)
    keys = iter(jax.random.split(jax.random.key(seed + 1), 3 * num_layers))
    for layer in model.layers:
      for name in ("q_bias", "k_bias", "v_bias"):
        b = getattr(layer.attn, name)
        b[...] = 0.5 * jax.random.normal(next(keys), b[...].shape)
  return model


def _tokens(batch=2, length=12, seed=1):
  return jax.random.randint(jax.random.key(seed), (batch, length), 0, V)


@nnx.jit
def _forward(model, tokens, caches=None):
  """`model(tokens, caches=caches)` compiled once per shape (eager dispatch of every op of a
  converted model costs more than compiling it)."""
  return model(tokens, caches=caches)


def _logits(model, tokens):
  return np.asarray(_forward(model, tokens)[0])


def _max_err(a, b):
  return float(np.max(np.abs(a - b)))


# ----------------------------------------------------------------------------------------------
# regroup_kv_heads


# The default suite keeps one bias case and one plain case; the rest of the grid is slow.
@pytest.mark.parametrize("heads,target,qkv_bias", [
    ((4, 1), 4, True), ((6, 3), 6, False),
    *[pytest.param(h, t, b, marks=pytest.mark.slow) for h, t, b in [
        ((4, 2), 4, False), ((4, 2), 4, True), ((4, 1), 2, False), ((4, 1), 2, True),
        ((4, 1), 4, False), ((6, 3), 6, True)]]])
def test_duplicating_kv_heads_leaves_logits_unchanged(heads, target, qkv_bias):
  model = _model(*heads, qkv_bias=qkv_bias)
  tokens = _tokens()
  expanded = convert.regroup_kv_heads(model, target)
  assert all(layer.attn.num_kv_heads == target for layer in expanded.layers)
  assert expanded.spec.attention.num_kv_heads == target
  np.testing.assert_allclose(_logits(expanded, tokens), _logits(model, tokens), atol=1e-5)


@pytest.mark.parametrize("method", convert.REGROUP_METHODS)
def test_pooling_groups_of_identical_heads_leaves_logits_unchanged(method):
  model = _model(8, 4, qkv_bias=True)
  for layer in model.layers:  # heads 2j and 2j + 1 identical: pooling to K = 2 loses nothing
    for name in ("k_proj", "v_proj", "k_bias", "v_bias"):
      p = getattr(layer.attn, name)
      w = p[...]
      p[...] = w.at[..., 1::2, :].set(w[..., 0::2, :])
  tokens = _tokens()
  pooled = convert.regroup_kv_heads(model, 2, method=method)
  assert pooled.layers[0].attn.k_proj[...].shape[1] == 2
  np.testing.assert_allclose(_logits(pooled, tokens), _logits(model, tokens), atol=1e-5)


def _rope_np(x, positions, theta):  # x [T, H], rotate-half pairs (i, i + H/2)
  half = x.shape[-1] // 2
  freq = theta ** (-np.arange(half) * 2.0 / x.shape[-1])
  ang = positions[:, None] * freq
  x1, x2 = x[:, :half], x[:, half:]
  return np.concatenate([x1 * np.cos(ang) - x2 * np.sin(ang), x2 * np.cos(ang) + x1 * np.sin(ang)],
                        -1)


@pytest.mark.parametrize("method", convert.REGROUP_METHODS)
def test_pooling_a_two_head_toy_to_one_kv_head_matches_a_hand_computation(method):
  model = _model(2, 2, 4, num_layers=1, d_model=6, qkv_bias=True)
  pooled = convert.regroup_kv_heads(model, 1, method=method)
  a, p = model.layers[0].attn, pooled.layers[0].attn
  x = np.asarray(jax.random.normal(jax.random.key(3), (1, 5, 6)), np.float64)
  wq, wk, wv, wo = (np.asarray(w[...], np.float64) for w in (a.q_proj, a.k_proj, a.v_proj,
                                                              a.o_proj))
  bq, bk, bv = (np.asarray(b[...], np.float64) for b in (a.q_bias, a.k_bias, a.v_bias))
  pick = (lambda w: (w[..., 0, :] + w[..., 1, :]) / 2) if method == "mean" else \
      (lambda w: w[..., 0, :])
  pos = np.arange(5.0)
  k = _rope_np(x[0] @ pick(wk) + pick(bk), pos, 100.0)  # the one KV head [T, H]
  v = x[0] @ pick(wv) + pick(bv)
  y = np.zeros((5, 6))
  for n in range(2):
    q = _rope_np(x[0] @ wq[:, n] + bq[n], pos, 100.0)
    s = q @ k.T / 2.0 + np.triu(np.full((5, 5), -np.inf), 1)  # scale 1/sqrt(H = 4)
    prob = np.exp(s - s.max(-1, keepdims=True))
    y += (prob / prob.sum(-1, keepdims=True)) @ v @ wo[n]
  got, _ = p(jnp.asarray(x, jnp.float32))
  np.testing.assert_allclose(np.asarray(got[0]), y, atol=1e-5)
  np.testing.assert_allclose(np.asarray(p.k_proj[...])[:, 0], pick(wk), atol=1e-6)


@pytest.mark.slow  # ~15 s on the shared machine; the Gemma 3 fixture's logits run in the fast suite
def test_regrouping_gemma3_keeps_its_qk_norm_and_logits():
  # The tiny transformers Gemma 3 (MQA, qk-norm, local + global layers): duplicating its one KV
  # head keeps every logit; MLA has no qk-norm, so to_mla refuses it.
  fixture = pathlib.Path(__file__).resolve().parents[2] / "fixtures" / "hf" / "gemma3"
  model, _ = kvattn.from_pretrained(fixture)
  regrouped = convert.regroup_kv_heads(model, 2)
  assert regrouped.spec.post_norms and all(layer.qk_norm for layer in regrouped.spec.layers)
  np.testing.assert_array_equal(np.asarray(regrouped.layers[1].attn.k_norm[...]),
                                np.asarray(model.layers[1].attn.k_norm[...]))
  tokens = jnp.asarray([[1, 5, 9, 17, 33, 2, 7]], jnp.int32)
  logits = [jax.jit(lambda state, g=nnx.graphdef(m): nnx.merge(g, state)(tokens)[0])(
      nnx.state(m)) for m in (regrouped, model)]
  np.testing.assert_allclose(np.asarray(logits[0]), np.asarray(logits[1]), atol=1e-5, rtol=0)
  with pytest.raises(NotImplementedError, match="layer 0 has a qk-norm"):
    convert.to_mla(model, 16, 4)


def test_regroup_keeps_the_source_and_the_other_parameters():
  model = _model(4, 2)
  before = jax.tree.map(np.asarray, nnx.state(model, nnx.Param))
  pooled = convert.regroup_kv_heads(model, 1)
  after = jax.tree.map(np.asarray, nnx.state(model, nnx.Param))
  jax.tree.map(np.testing.assert_array_equal, before, after)
  np.testing.assert_array_equal(np.asarray(pooled.embedding[...]),
                                np.asarray(model.embedding[...]))
  np.testing.assert_array_equal(np.asarray(pooled.layers[0].mlp.up[...]),
                                np.asarray(model.layers[0].mlp.up[...]))


# ----------------------------------------------------------------------------------------------
# to_mla: step 1 (partial RoPE) and step 2 (SVD) apart.


def test_partial_rope_reference_with_every_pair_is_the_source_model():
  model = _model(4, 2)
  ref = nnx.clone(model)
  for layer in ref.layers:
    layer.attn = convert.PartialRopeAttention(layer.attn, range(layer.attn.head_dim // 2))
  tokens = _tokens()
  np.testing.assert_allclose(_logits(ref, tokens), _logits(model, tokens), atol=1e-5)


@pytest.mark.parametrize("heads,method,selection", [
    ((4, 2), "joint", "high"), ((4, 1), "split", "uniform"),
    pytest.param((4, 4), "joint", "uniform", marks=pytest.mark.slow),
    pytest.param((4, 2), "split", "high", marks=pytest.mark.slow)])
def test_full_rank_mla_reproduces_the_partial_rope_model(heads, method, selection):
  model = _model(*heads)
  tokens = _tokens()
  R = 4 * heads[1]  # 4 rope dims (2 pairs) per KV head of width 8
  partial = _logits(convert.partial_rope(model, R, rope_selection=selection), tokens)
  full = convert.mla_full_rank(model, R)
  assert full == heads[1] * (2 * 8 - 4)
  mla = convert.to_mla(model, full, R, method=method, rope_selection=selection)
  assert all(isinstance(layer.attn, kvattn.MultiHeadLatentAttention) for layer in mla.layers)
  np.testing.assert_allclose(_logits(mla, tokens), partial, atol=1e-4)
  # Partial RoPE is the approximation: the source model differs from it.
  assert _max_err(partial, _logits(model, tokens)) > 1e-3


def test_lower_ranks_increase_the_error_monotonically():
  model = _model(4, 2)
  tokens = _tokens(batch=4, length=16)
  partial = _logits(convert.partial_rope(model, 8), tokens)
  full = convert.mla_full_rank(model, 8)
  ranks = [full, 18, 12, 6, 1]
  errors = [float(np.sqrt(np.mean((_logits(convert.to_mla(model, c, 8), tokens) - partial) ** 2)))
            for c in ranks]  # RMS logit error on the fixed batch
  assert errors[0] < 1e-6
  assert all(a < b for a, b in zip(errors, errors[1:])), errors


def test_mla_conversion_sizes_and_cache_bytes():
  model = _model(4, 2)
  mla = convert.to_mla(model, 10, 8)
  attn = mla.layers[0].attn
  assert (attn.kv_lora_rank, attn.qk_rope_head_dim, attn.qk_nope_head_dim, attn.v_head_dim,
          attn.num_rope_heads, attn.latent_norm) == (10, 8, 4, 8, 2, False)
  assert mla.cache_bytes_per_token() == mla.num_layers * (10 + 8) * 4  # (C + R) f32 per layer
  assert attn.sm_scale == pytest.approx(8 ** -0.5)  # the source's 1 / sqrt(H)


# ----------------------------------------------------------------------------------------------
# Converted models through every cache kind and generate; measured bytes = analytic.


def _decode_logits(model, tokens, caches, prompt_len):
  """Logits of tokens[:, prompt_len - 1:] via prefill of prompt_len tokens + one-token steps."""
  logits, caches = _forward(model, tokens[:, :prompt_len], caches)
  out = [logits[:, -1]]
  for t in range(prompt_len, tokens.shape[1]):
    logits, caches = _forward(model, tokens[:, t:t + 1], caches)
    out.append(logits[:, 0])
  return np.stack([np.asarray(o) for o in out], 1), caches


def _converted(kind):
  model = _model(4, 2)
  if kind == "mla":
    return convert.to_mla(model, 12, 8)
  return convert.regroup_kv_heads(model, {"K4": 4, "K1-mean": 1}[kind])


# One cache kind per converted kind in the default suite; the full grid is slow.
@pytest.mark.parametrize("kind,cache", [
    ("K1-mean", "paged"), ("mla", "int8"), ("K4", "dense"),
    *[pytest.param(k, c, marks=pytest.mark.slow) for k, c in [
        ("K4", "paged"), ("K4", "int8"), ("K1-mean", "dense"), ("K1-mean", "int8"),
        ("mla", "dense"), ("mla", "paged")]]])
def test_converted_models_decode_through_every_cache_kind(kind, cache):
  model = _converted(kind)
  if kind == "mla" and cache == "paged":
    pytest.skip("paged caches hold K-head keys and values; MLA decodes from its latent cache")
  tokens = _tokens(batch=2, length=10)
  full = _logits(model, tokens)[:, 5:]
  if cache == "paged":
    caches, _ = cache_factories.init_paged_caches(model, [10, 10], page_size=4)
  else:
    caches = model.init_caches(2, 12, dtype=jnp.int8 if cache == "int8" else None)
  dtype = jnp.int8 if cache == "int8" else jnp.float32
  measured = sum(memory.measured_bytes_per_token(c) for c in caches)
  assert measured == model.cache_bytes_per_token(dtype)
  got, _ = _decode_logits(model, tokens, caches, 6)
  np.testing.assert_allclose(got, full, atol=1e-4 if cache != "int8" else 0.15)


@pytest.mark.parametrize("kind", [
    "mla", pytest.param("K4", marks=pytest.mark.slow), pytest.param("K1-mean",
                                                                    marks=pytest.mark.slow)])
def test_converted_models_generate_their_greedy_tokens(kind):
  model = _converted(kind)
  prompts = _tokens(batch=2, length=5)
  tokens, _ = kvattn.generate(model, prompts, jnp.array([5, 5]), 4)
  seq = jnp.concatenate([prompts, jnp.zeros((2, 4), prompts.dtype)], 1)
  for t in range(5, 9):  # greedy by full causal forward passes (positions > t do not matter)
    seq = seq.at[:, t].set(jnp.argmax(_forward(model, seq)[0][:, t - 1], -1))
  np.testing.assert_array_equal(np.asarray(tokens), np.asarray(seq[:, 5:]))
  if kind != "mla":
    factory = cache_factories.cache_factory_from_config(model, {"kind": "paged", "page_size": 4})
    paged, _ = kvattn.generate(model, prompts, jnp.array([5, 5]), 4, cache_factory=factory)
    np.testing.assert_array_equal(np.asarray(paged), np.asarray(tokens))


def test_regrouped_models_decode_through_the_long_context_kinds():
  """The bounded kinds of kvattn.caches.window / eviction (ring, sink, an eviction policy) with room for
  every token give the dense cache's greedy tokens on a regrouped model; an MLA model (latent
  cache, no K-head keys) is refused with a ValueError naming its layer."""
  model = _converted("K1-mean")
  prompts, lengths = _tokens(batch=2, length=5), jnp.array([5, 3])
  dense, _ = kvattn.generate(model, prompts, lengths, 4)
  for policy in ({"kind": "ring", "window": 9}, {"kind": "sink", "num_sinks": 2, "window": 7},
                 {"kind": "h2o", "budget": 9}):
    factory = cache_factories.cache_factory_from_config(model, policy)
    got, _ = kvattn.generate(model, prompts, lengths, 4, cache_factory=factory)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(dense), err_msg=str(policy))
  with pytest.raises(ValueError, match="layer 0 is MultiHeadLatentAttention"):
    cache_factories.cache_factory_from_config(_converted("mla"), {"kind": "ring", "window": 9})


# ----------------------------------------------------------------------------------------------
# Bad input.


def test_bad_input_is_a_clear_value_error():
  model = _model(6, 3, 8)
  with pytest.raises(ValueError, match="num_kv_heads must be a multiple or a divisor"):
    convert.regroup_kv_heads(model, 2)
  with pytest.raises(ValueError, match="num_kv_heads must divide num_heads = 6"):
    convert.regroup_kv_heads(model, 12)
  with pytest.raises(ValueError, match="method must be one of"):
    convert.regroup_kv_heads(model, 1, method="max")
  with pytest.raises(ValueError, match=r"kv_lora_rank must be at most the full rank .* = 36; "
                                       r"got 37"):
    convert.to_mla(model, 37, 12)
  with pytest.raises(ValueError, match="must be below head_dim = 8; got 30 / 3 = 10"):
    convert.to_mla(model, 8, 30)
  with pytest.raises(ValueError, match="multiple of 2 \\* num_kv_heads = 6"):
    convert.to_mla(model, 8, 9)
  with pytest.raises(ValueError, match="kv_lora_rank must be a positive int"):
    convert.to_mla(model, 0, 6)
  with pytest.raises(ValueError, match="rope_selection must be one of"):
    convert.to_mla(model, 8, 6, rope_selection="norm")
  with pytest.raises(ValueError, match="'uniform' needs the kept pairs per head to divide"):
    convert.to_mla(model, 8, 18, rope_selection="uniform")  # 3 pairs of 4
  with pytest.raises(ValueError, match="GQA layers .* layer 0 is MultiHeadLatentAttention"):
    convert.regroup_kv_heads(convert.to_mla(model, 8, 6), 1)
  with pytest.raises(NotImplementedError, match="qkv biases"):
    convert.to_mla(_model(4, 2, qkv_bias=True), 8, 4)
  with pytest.raises(TypeError, match="model must be a kvattn.Transformer"):
    convert.to_mla(object(), 8, 4)


# ----------------------------------------------------------------------------------------------
# Uptraining on subword rows (kvattn.training.trainer.uptrain) and the token dataset.


def test_pack_token_ids_appends_eos_and_drops_the_partial_row():
  docs = [data.Document("a", b"abc"), data.Document("b", b"de")]
  rows = data.pack_token_ids(docs, 2, lambda s: [ord(c) for c in s], eos_id=1)
  np.testing.assert_array_equal(rows, [[97, 98, 99], [1, 100, 101]])  # the last [1] dropped
  with pytest.raises(ValueError, match="at least seq_len \\+ 1 = 9 tokens; got 7"):
    data.pack_token_ids(docs, 8, lambda s: [ord(c) for c in s], eos_id=1)


def _rows(num, seed):
  return np.asarray(jax.random.randint(jax.random.key(seed), (num, 9), 0, V), np.int32)


def test_uptrain_attention_only_changes_only_attention_and_resumes(tmp_path):
  dataset = data.Dataset(_rows(16, 0), _rows(4, 1), 1, 1)
  cfg = train_lib.train_config(steps=4, batch_size=4, warmup_steps=1, learning_rate=1e-2,
                               progress=False, log_every=1, eval_batches=0)
  source = convert.to_mla(_model(4, 2), 12, 8)
  before = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(source, nnx.Param)))
  result = train_lib.uptrain(nnx.clone(source), dataset, cfg, attention_only=True)
  after = nnx.to_pure_dict(nnx.state(result.model, nnx.Param))
  np.testing.assert_array_equal(np.asarray(after["embedding"]), before["embedding"])
  np.testing.assert_array_equal(np.asarray(after["layers"][0]["mlp"]["up"]),
                                before["layers"][0]["mlp"]["up"])
  assert _max_err(np.asarray(after["layers"][0]["attn"]["kv_down_proj"]),
                  before["layers"][0]["attn"]["kv_down_proj"]) > 1e-4
  assert result.metrics["steps"] == 4
  assert result.metrics["validation_perplexity"] == pytest.approx(
      np.exp(result.metrics["validation_loss"]))
  # Resume: a checkpointed run saves steps 2 and 4; without step 4 a rerun resumes at step 2
  # (params, optimiser state, data position) and ends where the straight run ended.
  ckpt = tmp_path / "ckpt"
  cfg.checkpoint_every = 2
  train_lib.uptrain(nnx.clone(source), dataset, cfg, attention_only=True,
                    checkpoint_dir=str(ckpt))
  assert train_lib.checkpoint_manager(str(ckpt)).all_steps() == [2, 4]
  shutil.rmtree(ckpt / "4")
  again = train_lib.uptrain(nnx.clone(source), dataset, cfg, attention_only=True,
                            checkpoint_dir=str(ckpt))
  assert again.history[0]["step"] == 3 and again.metrics["steps"] == 4
  resumed = nnx.to_pure_dict(nnx.state(again.model, nnx.Param))
  np.testing.assert_allclose(np.asarray(resumed["layers"][0]["attn"]["q_proj"]),
                             np.asarray(after["layers"][0]["attn"]["q_proj"]), atol=1e-6)


def test_trainer_refuses_a_filter_that_selects_nothing():
  with pytest.raises(ValueError, match="trainable must select at least one parameter"):
    train_lib.Trainer(_model(), train_lib.train_config(), trainable=nnx.PathContains("nope"))
