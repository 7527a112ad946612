"""Tests for kvattn.Transformer and its model config schema."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from ml_collections import config_dict

import kvattn
from kvattn import memory
from kvattn.models import transformer
from tests.kvattn.models import cached_forward

SMALL = dict(d_model=32, num_layers=2, mlp_dim=64)
GQA = dict(kind="gqa", num_heads=4, num_kv_heads=2, head_dim=8)
MLA_FIELDS = dict(kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8)


def small_config(**overrides):
  attention = {**GQA, **MLA_FIELDS, **overrides.pop("attention", {})}
  return transformer.model_config(**{**SMALL, **overrides}, attention=attention)


@functools.partial(jax.jit, static_argnums=0)
def _apply(graphdef, state, tokens, caches, new_lengths):
  return nnx.merge(graphdef, state)(tokens, caches=caches, new_lengths=new_lengths)


def test_default_config_builds_the_documented_model():
  cfg = transformer.model_config()
  assert cfg.vocab_size == 259 == kvattn.training.data.VOCAB_SIZE
  assert (cfg.d_model, cfg.num_layers, cfg.mlp_dim) == (256, 4, 768)
  assert cfg.attention.kind == "gqa" and cfg.layers == ()
  spec = transformer.resolve_config(cfg)
  assert len(spec.layers) == 4 and all(layer.kind == "gqa" for layer in spec.layers)
  assert spec.layers[0].num_kv_heads == 8 and spec.layers[0].kv_lora_rank is None
  # Every placeholder can be set (typed) and locked configs accept overrides of existing keys.
  cfg.lock()
  cfg.attention.window = 16
  cfg.attention.q_lora_rank = 8
  assert transformer.resolve_config(cfg).layers[0].window == 16
  with pytest.raises(AttributeError):
    cfg.attention.not_a_key = 1  # locked: the typo is refused by ml_collections itself


def test_from_config_forward_shapes_and_params():
  cfg = small_config()
  model = kvattn.Transformer.from_config(cfg, rngs=nnx.Rngs(0))
  tokens = jnp.arange(2 * 5, dtype=jnp.int32).reshape(2, 5)
  logits, caches = _apply(*nnx.split(model), tokens, None, None)
  assert logits.shape == (2, 5, 259) and logits.dtype == jnp.float32 and caches is None
  assert np.isfinite(np.asarray(logits)).all()
  params = nnx.state(model, nnx.Param)
  n = sum(x.size for x in jax.tree.leaves(params))
  D, F, V, N, K, H = 32, 64, 259, 4, 2, 8
  per_layer = 2 * D + D * N * H + 2 * D * K * H + N * H * D + 3 * D * F
  assert n == V * D + 2 * per_layer + D  # tied head: no extra V x D
  untied = kvattn.Transformer.from_config(small_config(tie_embeddings=False), rngs=nnx.Rngs(0))
  assert sum(x.size for x in jax.tree.leaves(nnx.state(untied, nnx.Param))) == n + D * V


def test_per_layer_overrides_mix_variants():
  cfg = small_config(num_layers=3, layers=({}, {"kind": "mla"}, {"num_kv_heads": 1, "window": 3}))
  model = kvattn.Transformer.from_config(cfg, rngs=nnx.Rngs(0))
  kinds = [type(layer.attn).__name__ for layer in model.layers]
  assert kinds == ["GroupedQueryAttention", "MultiHeadLatentAttention", "GroupedQueryAttention"]
  assert model.layers[0].attn.num_kv_heads == 2 and model.layers[2].attn.num_kv_heads == 1
  assert model.layers[2].attn.window == 3 and model.layers[0].attn.window is None
  caches = model.init_caches(2, 10, local_layers="full")
  assert [type(c).__name__ for c in caches] == ["KVCache", "LatentCache", "KVCache"]
  caches = model.init_caches(2, 10)  # default: the windowed layer gets a ring of 3
  assert [type(c).__name__ for c in caches] == ["KVCache", "LatentCache", "RingKVCache"]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cache_bytes_per_token_matches_measured_bytes(dtype):
  cfg = small_config(num_layers=3, layers=({}, {"kind": "mla"}, {"num_kv_heads": 1}))
  model = kvattn.Transformer.from_config(cfg, rngs=nnx.Rngs(0))
  itemsize = jnp.dtype(dtype).itemsize
  expected = (2 * 2 * 8 + (16 + 4) + 2 * 1 * 8) * itemsize  # GQA K=2 + MLA C+R + MQA
  assert transformer.cache_bytes_per_token(cfg, dtype) == expected
  assert model.cache_bytes_per_token(dtype) == expected
  caches = model.init_caches(3, 7, dtype)
  measured = sum(memory.measured_bytes_per_token(c) for c in caches)
  assert measured == expected
  assert sum(sum(a.nbytes for a in c.storage_arrays()) for c in caches) == 3 * 7 * expected


@pytest.mark.slow  # the fast suite: test_generation's greedy parity on the same mixed stack
def test_cached_prefill_and_decode_match_full_forward():
  """DESIGN invariant 1 for a model mixing GQA (windowed MQA) and MLA layers."""
  cfg = small_config(layers=({"num_kv_heads": 1, "window": 3}, {"kind": "mla"}))
  model = kvattn.Transformer.from_config(cfg, rngs=nnx.Rngs(1))
  lengths = np.array([5, 2, 1], np.int32)
  steps, width = 3, 5
  seqs = jax.random.randint(jax.random.key(0), (3, width + steps), 0, 259, jnp.int32)
  caches = model.init_caches(3, 12, local_layers="full")  # the windowed layer over a full cache
  caches = cached_forward.assert_cached_steps_match_full(model, caches, seqs, lengths, width, steps)
  np.testing.assert_array_equal(caches[0].lengths, lengths + steps)


@pytest.mark.parametrize("where,overrides,message", [
    ("top", dict(d_modle=32), r"model\.d_modle is not a known key"),
    ("attention", dict(attention=dict(num_kv_head=2)), r"model\.attention\.num_kv_head is not"),
])
def test_model_config_rejects_unknown_keys(where, overrides, message):
  del where
  with pytest.raises(ValueError, match=message):
    transformer.model_config(**overrides)


@pytest.mark.parametrize("mutate,message", [
    (lambda c: setattr(c.attention, "num_kv_heads", 3),
     r"model\.attention\.num_kv_heads must divide model\.attention\.num_heads; got 3 and 4"),
    (lambda c: setattr(c.attention, "kind", "mqa"), r"model\.attention\.kind must be one of"),
    (lambda c: setattr(c.attention, "head_dim", 7), r"model\.attention\.head_dim must be even"),
    (lambda c: setattr(c, "d_model", 0), r"model\.d_model must be a positive int; got 0"),
    (lambda c: setattr(c, "dtype", "int8"), r"model\.dtype must name a floating dtype"),
    (lambda c: setattr(c, "norm_eps", -1.0), r"model\.norm_eps must be a positive"),
    (lambda c: setattr(c, "layers", ({}, {}, {})), r"model\.layers must be empty or have"),
    (lambda c: setattr(c, "layers", ({}, {"kind": "mla", "qk_rope_head_dim": 3})),
     r"model\.layers\[1\]\.qk_rope_head_dim must be even"),
    (lambda c: setattr(c, "layers", ({"windw": 3}, {})),
     r"model\.layers\[0\]\.windw is not a known"),
    (lambda c: setattr(c.attention, "decode_implementation", "bogus"),
     r"model\.attention\.decode_implementation must be one of \[.*'xla'.*\] or None for "
     r"attention kind 'gqa'; got 'bogus'"),
    (lambda c: setattr(c, "layers", ({}, {"kind": "mla", "decode_implementation": "xla_pool"})),
     r"model\.layers\[1\]\.decode_implementation must be one of \['pallas', 'xla', "
     r"'xla_blocked'\] or None for attention kind 'mla'; got 'xla_pool'"),
])
def test_invalid_values_name_the_key(mutate, message):
  cfg = small_config()
  mutate(cfg)
  with pytest.raises(ValueError, match=message):
    kvattn.Transformer.from_config(cfg, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match=message):
    transformer.cache_bytes_per_token(cfg)


def test_plain_dict_config_and_unknown_key_in_dict():
  d = small_config().to_dict()
  model = kvattn.Transformer.from_config(d, rngs=nnx.Rngs(0))
  assert model.num_layers == 2
  d["dropout"] = 0.1
  with pytest.raises(ValueError, match=r"model\.dropout is not a known key"):
    transformer.resolve_config(d)
  del d["dropout"]
  d["tie_embeddings"] = 1  # a plain dict is not type-checked by ml_collections; we check
  with pytest.raises(ValueError, match=r"model\.tie_embeddings must be a bool; got 1"):
    transformer.resolve_config(d)
  assert isinstance(transformer.model_config(), config_dict.ConfigDict)


def test_bad_tokens_and_caches_raise():
  model = kvattn.Transformer.from_config(small_config(), rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="tokens must have rank 2"):
    model(jnp.zeros((4,), jnp.int32))
  with pytest.raises(TypeError, match="tokens must have an integer dtype"):
    model(jnp.zeros((1, 4), jnp.float32))
  with pytest.raises(ValueError, match="one cache per layer"):
    model(jnp.zeros((1, 4), jnp.int32), caches=model.init_caches(1, 8)[:1])


def test_truncated_keeps_the_first_layers():
  """`truncated(n)`: the first n blocks with the same embedding and head; its caches and
  bytes follow; a cross-layer-sharing model keeps the owners of the kept layers."""
  model = transformer.Transformer.from_config(small_config(num_layers=3), rngs=nnx.Rngs(0))
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 64, (2, 5)), jnp.int32)
  np.testing.assert_array_equal(model.truncated(3)(tokens)[0], model(tokens)[0])
  short = model.truncated(1)
  assert short.num_layers == 1 and len(short.init_caches(2, 8)) == 1
  assert short.cache_bytes_per_token() * 3 == model.cache_bytes_per_token()
  # The same as a 1-layer model built from its config and given these weights.
  one = transformer.Transformer.from_config(small_config(num_layers=1), rngs=nnx.Rngs(1))
  nnx.update(one, nnx.state(short))
  np.testing.assert_array_equal(one(tokens)[0], short(tokens)[0])
  assert one.spec == short.spec
  logits, _ = short(tokens, short.init_caches(2, 8))
  np.testing.assert_allclose(logits, short(tokens)[0], rtol=1e-5, atol=1e-5)
  assert model.num_layers == 3  # the original is untouched
  shared = transformer.Transformer.from_config(small_config(num_layers=4, cla_factor=2),
                                               rngs=nnx.Rngs(0))
  assert shared.truncated(3).cache_layers == (0, 2) and shared.truncated(1).num_caches == 1
  for bad in (0, 5, 1.0, True):
    with pytest.raises(ValueError, match="num_layers must be an int in"):
      shared.truncated(bad)
