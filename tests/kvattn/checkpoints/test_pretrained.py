"""kvattn.from_pretrained / build_model against transformers on tiny random checkpoints.

The checkpoints and transformers' outputs under tests/fixtures/hf/ are written by
tests/fixtures/make_hf_fixtures.py (torch + transformers, run by hand); these tests need neither.
"""

from __future__ import annotations

import functools
import json
import pathlib
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import kvattn
from kvattn.caches import registry as cache_factories
from kvattn.checkpoints import pretrained

FIXTURES = pathlib.Path(__file__).resolve().parents[2] / "fixtures" / "hf"
GQA_CASES = ("llama_gqa", "llama_mqa", "llama_rope3", "mistral_window", "qwen2_bias", "qwen3",
             "gemma2", "gemma3")
MLA_CASES = ("deepseek_v2", "deepseek_v2_qlora_yarn")
PAGED_CASES = ("llama_gqa", "llama_mqa")  # GQA and MQA
ATOL = 1e-4  # f32 logits against transformers' f32 logits


@functools.lru_cache(maxsize=None)
def _load(name: str):
  model, tokenizer = kvattn.from_pretrained(FIXTURES / name, dtype="float32")
  return model, tokenizer


def _expected(name: str):
  """`(tokens [P] i64 arrays, logits [P] f32[T_p + NEW, V] arrays, meta)` for the fixture."""
  arrays = np.load(FIXTURES / name / "expected.npz")
  meta = json.loads((FIXTURES / name / "expected.json").read_text())
  n = len(meta["prompt_lengths"])
  return ([arrays[f"tokens_{i}"] for i in range(n)], [arrays[f"logits_{i}"] for i in range(n)],
          meta)


def _padded(seqs, width=None):
  width = width or max(len(s) for s in seqs)
  out = np.zeros((len(seqs), width), np.int32)
  for b, s in enumerate(seqs):
    out[b, :len(s)] = s
  return out


@functools.partial(jax.jit, static_argnums=(0, 5))
def _forward_and_cached(graphdef, state, tokens, prompt_lengths, steps, capacity):
  """Full forward (no cache) over `tokens [B, T]`, and the same logits through dense caches:
  prefill the first `prompt_lengths[b]` tokens of each row, then one decode step (T = 1) per
  column of `steps [B, NEW]` (row b: the tokens after its prompt). Returns `(full [B, T, V],
  last [B, V] logits of each prompt's last token, decoded [B, NEW, V])`."""
  model = nnx.merge(graphdef, state)
  full, _ = model(tokens)
  caches = model.init_caches(tokens.shape[0], capacity)
  logits, caches = model(tokens, caches=caches, new_lengths=prompt_lengths)  # padding unwritten
  last = jnp.take_along_axis(logits, (prompt_lengths - 1)[:, None, None], axis=1)[:, 0]

  def step(caches, token):
    out, caches = model(token[:, None], caches=caches)
    return caches, out[:, 0]

  _, decoded = jax.lax.scan(step, caches, steps.T)
  return full, last, jnp.swapaxes(decoded, 0, 1)


def _case(name: str):
  """`(model, tokens, logits, prompt_lengths i32[P], new_tokens)` of fixture `name`."""
  model, _ = _load(name)
  tokens, logits, meta = _expected(name)
  return model, tokens, logits, np.asarray(meta["prompt_lengths"], np.int32), meta["new_tokens"]


def _check_parity(name: str):
  model, tokens, logits, lengths, new = _case(name)
  steps = np.stack([t[n:n + new] for t, n in zip(tokens, lengths)]).astype(np.int32)
  graphdef, state = nnx.split(model)
  full, last, decoded = jax.device_get(_forward_and_cached(
      graphdef, state, _padded(tokens), lengths, steps, int(lengths.max()) + new))
  for b, (t, want) in enumerate(zip(tokens, logits)):
    n = lengths[b]
    np.testing.assert_allclose(full[b, :len(t)], want, atol=ATOL, rtol=0,
                               err_msg=f"{name}: full forward, prompt {b}")
    np.testing.assert_allclose(last[b], want[n - 1], atol=ATOL, rtol=0,
                               err_msg=f"{name}: prefill through the cache, prompt {b}")
    np.testing.assert_allclose(decoded[b], want[n:n + new], atol=ATOL, rtol=0,
                               err_msg=f"{name}: decode steps through the cache, prompt {b}")


def _check_generate(model, tokens, lengths, new, **kwargs):
  prompts = _padded([t[:n] for t, n in zip(tokens, lengths)])
  out, out_lengths = kvattn.generate(model, prompts, lengths, new, **kwargs)
  assert np.asarray(out_lengths).tolist() == [new] * len(tokens)
  for b, (t, n) in enumerate(zip(tokens, lengths)):
    assert np.asarray(out[b]).tolist() == t[n:n + new].tolist(), f"prompt {b}"


@pytest.mark.parametrize("name", GQA_CASES + MLA_CASES)
def test_logits_match_transformers(name):
  """Full forward, cached prefill and cached decode steps of every fixture: its logits."""
  _check_parity(name)


# generate() adds its own compilation per fixture; the logits above already pin each
# architecture, so the fast suite runs it on one GQA and one MLA fixture.
# (gemma3's generate() runs in the fast suite with the per-layer cache layout:
# tests/kvattn/caches/test_per_layer_layout.py.)
GENERATE_FAST = ("llama_gqa", "deepseek_v2")


@pytest.mark.parametrize("name", [name if name in GENERATE_FAST else
                                  pytest.param(name, marks=pytest.mark.slow)
                                  for name in GQA_CASES + MLA_CASES])
def test_generate_gives_transformers_greedy_tokens(name):
  model, tokens, _, lengths, new = _case(name)
  _check_generate(model, tokens, lengths, new)  # dense KVCache / latent caches
  if name in MLA_CASES:  # latent caches, absorbed decode
    assert all(isinstance(c, kvattn.LatentCache) for c in model.init_caches(1, 4))
  if name in PAGED_CASES:
    _check_generate(model, tokens, lengths, new,
                    cache_factory=cache_factories.cache_factory_from_config(model, {"kind": "paged", "page_size": 4}))


# ----------------------------------------------------------------------------------------------
# Checkpoint files, configs and dtypes.


def _params(model):
  return jax.tree.leaves(nnx.state(model, nnx.Param))


def _assert_same_params(a, b):
  leaves_a, leaves_b = _params(a), _params(b)
  assert len(leaves_a) == len(leaves_b)
  for x, y in zip(leaves_a, leaves_b):
    assert x.dtype == y.dtype and x.shape == y.shape
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _copy_checkpoint(tmp_path, name="llama_gqa", *, drop=(), replace=None, config=None):
  """A copy of fixture `name` (an f32 one) in tmp_path, its tensors edited: `drop` names,
  `replace` {name: array}; `config` updates config.json."""
  from safetensors.numpy import load_file, save_file  # pylint: disable=g-import-not-at-top
  out = tmp_path / name
  out.mkdir()
  tensors = load_file(FIXTURES / name / "model.safetensors")
  for key in drop:
    del tensors[key]
  tensors.update(replace or {})
  save_file(tensors, out / "model.safetensors")
  cfg = json.loads((FIXTURES / name / "config.json").read_text())
  cfg.update(config or {})
  (out / "config.json").write_text(json.dumps(cfg))
  return out


def test_missing_tensor_names_the_tensor_and_the_file(tmp_path):
  name = "model.layers.1.self_attn.k_proj.weight"
  path = _copy_checkpoint(tmp_path, drop=[name])
  with pytest.raises(ValueError, match=rf"model\.safetensors: tensor '{name}' is missing .*"
                                       rf"expected shape \[32, 64\]"):
    kvattn.from_pretrained(path)


def test_wrong_shape_names_the_tensor_the_file_and_both_shapes(tmp_path):
  name = "model.layers.0.mlp.up_proj.weight"
  path = _copy_checkpoint(tmp_path, replace={name: np.zeros((64, 96), np.float32)})
  with pytest.raises(ValueError, match=rf"model\.safetensors: tensor '{name}' has shape "
                                       rf"\[64, 96\]; expected \[96, 64\]"):
    kvattn.from_pretrained(path)


def test_a_tensor_the_config_does_not_describe_is_an_error(tmp_path):
  # A q bias in a llama checkpoint whose config says attention_bias false: loading it silently
  # would drop it, i.e. give a different model.
  name = "model.layers.0.self_attn.q_proj.bias"
  path = _copy_checkpoint(tmp_path, replace={name: np.ones((64,), np.float32)})
  with pytest.raises(ValueError, match=rf"tensor '{name}' is not read"):
    kvattn.from_pretrained(path)


def test_sharded_checkpoint_loads_the_same_weights(tmp_path):
  from safetensors.numpy import load_file, save_file  # pylint: disable=g-import-not-at-top
  tensors = load_file(FIXTURES / "llama_gqa" / "model.safetensors")
  names = sorted(tensors)
  shards = {"model-00001-of-00002.safetensors": names[::2],
            "model-00002-of-00002.safetensors": names[1::2]}
  out = tmp_path / "sharded"
  out.mkdir()
  shutil.copy(FIXTURES / "llama_gqa" / "config.json", out)
  for shard, keys in shards.items():
    save_file({k: tensors[k] for k in keys}, out / shard)
  index = {"metadata": {}, "weight_map": {k: s for s, keys in shards.items() for k in keys}}
  (out / "model.safetensors.index.json").write_text(json.dumps(index))
  model, tokenizer = kvattn.from_pretrained(out)
  assert tokenizer is None
  _assert_same_params(model, _load("llama_gqa")[0])

  # The index puts a tensor in a shard that does not hold it.
  index["weight_map"][names[0]] = "model-00002-of-00002.safetensors"
  (out / "model.safetensors.index.json").write_text(json.dumps(index))
  with pytest.raises(ValueError, match=rf"00002-of-00002.safetensors: tensor '{names[0]}' "
                                       rf"listed in .*index.json is not in this shard"):
    kvattn.from_pretrained(out)
  # A shard is missing.
  index["weight_map"][names[0]] = "model-00001-of-00002.safetensors"
  (out / "model.safetensors.index.json").write_text(json.dumps(index))
  (out / "model-00002-of-00002.safetensors").unlink()
  with pytest.raises(FileNotFoundError, match=r"model-00002-of-00002.safetensors: shard listed"):
    kvattn.from_pretrained(out)


def test_missing_files_name_the_path(tmp_path):
  with pytest.raises(FileNotFoundError, match=r"config\.json"):
    kvattn.from_pretrained(tmp_path)  # a directory without config.json
  shutil.copy(FIXTURES / "llama_gqa" / "config.json", tmp_path)
  with pytest.raises(FileNotFoundError, match=r"no model\.safetensors or "
                                              r"model\.safetensors\.index\.json"):
    kvattn.from_pretrained(tmp_path)
  with pytest.raises(FileNotFoundError, match=r"nope\.gguf: no such file"):
    kvattn.from_pretrained(tmp_path / "nope.gguf")
  with pytest.raises(FileNotFoundError, match=r"'no-such-model' is neither an existing file nor "
                                              r"a registered checkpoint"):
    kvattn.from_pretrained("no-such-model")
  with pytest.raises(ValueError, match=r"config\.json' is a file but not a \.gguf file"):
    kvattn.from_pretrained(tmp_path / "config.json")
  with pytest.raises(TypeError, match="source must be a path"):
    kvattn.from_pretrained(3)


def test_build_model_takes_a_dict_of_numpy_arrays():
  """The interface the GGUF reader uses: config dict + {HF name: f32 numpy array}."""
  from safetensors.numpy import load_file  # pylint: disable=g-import-not-at-top
  config = json.loads((FIXTURES / "llama_gqa" / "config.json").read_text())
  tensors = load_file(FIXTURES / "llama_gqa" / "model.safetensors")
  model = pretrained.build_model(config, tensors)
  _assert_same_params(model, _load("llama_gqa")[0])
  with pytest.raises(ValueError, match=r"^tensor 'model.norm.weight' is missing"):
    pretrained.build_model(config, {k: v for k, v in tensors.items() if k != "model.norm.weight"})


def test_weights_are_cast_to_param_dtype():
  # llama_mqa is stored in bf16: the f32 model holds exactly the bf16 values, a bf16 model the
  # same bits; compute dtype and param dtype are set independently.
  f32 = _load("llama_mqa")[0]
  bf16, _ = kvattn.from_pretrained(FIXTURES / "llama_mqa", dtype="bfloat16")
  mixed, _ = kvattn.from_pretrained(FIXTURES / "llama_mqa", param_dtype="bfloat16")
  assert {x.dtype for x in _params(f32)} == {jnp.dtype("float32")}
  assert {x.dtype for x in _params(bf16)} == {jnp.dtype("bfloat16")}
  assert bf16.dtype == jnp.bfloat16 and mixed.dtype == jnp.float32
  for x, y, z in zip(_params(f32), _params(bf16), _params(mixed)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y, np.float32))
    np.testing.assert_array_equal(np.asarray(y), np.asarray(z))


def test_architecture_settings_reach_the_model():
  spec = _load("qwen2_bias")[0].spec
  assert [layer.window for layer in spec.layers] == [None, 4]  # max_window_layers = 1
  assert all(layer.qkv_bias for layer in spec.layers) and spec.tie_embeddings
  spec = _load("mistral_window")[0].spec
  assert [layer.window for layer in spec.layers] == [5, 5] and not spec.tie_embeddings
  spec = _load("llama_mqa")[0].spec
  assert (spec.layers[0].num_kv_heads, spec.layers[0].head_dim, spec.norm_eps) == (1, 24, 1e-6)
  assert spec.layers[0].rope_scaling == "linear" and spec.layers[0].rope_factor == 2.0
  spec = _load("deepseek_v2_qlora_yarn")[0].spec
  layer = spec.layers[0]
  assert (layer.kind, layer.q_lora_rank, layer.rope_scaling) == ("mla", 24, "yarn")
  # transformers: attention factor mscale(4, 1) / mscale(4, 0.5); softmax scale x mscale(4, .5)^2
  m = lambda s: 0.1 * s * np.log(4.0) + 1.0  # pylint: disable=unnecessary-lambda-assignment
  np.testing.assert_allclose(layer.rope_attention_factor, m(1.0) / m(0.5), rtol=1e-12)
  np.testing.assert_allclose(layer.softmax_scale_factor, m(0.5) ** 2, rtol=1e-12)


def test_gemma_and_qwen3_settings_reach_the_model():
  spec = _load("gemma3")[0].spec
  local, full = spec.layers
  assert (local.window, local.rope_theta, local.rope_scaling) == (4, 1e4, None)
  assert (full.window, full.rope_theta, full.rope_scaling, full.rope_factor) == (
      None, 1e6, "linear", 2.0)
  assert local.qk_norm and local.num_kv_heads == 1 and local.soft_cap is None
  np.testing.assert_allclose(local.sm_scale, 24 ** -0.5)
  assert (spec.mlp_activation, spec.scale_embeddings, spec.post_norms, spec.final_soft_cap) == (
      "gelu_tanh", True, True, None)
  spec = _load("gemma2")[0].spec
  assert [layer.window for layer in spec.layers] == [4, None]  # even layers local
  assert [layer.soft_cap for layer in spec.layers] == [2.0, 2.0] and spec.final_soft_cap == 4.0
  assert not spec.layers[0].qk_norm
  spec = _load("qwen3")[0].spec
  assert spec.layers[0].qk_norm and not spec.post_norms and spec.mlp_activation == "silu"
  assert spec.layers[0].sm_scale is None and not spec.layers[0].qkv_bias


def test_gemma3_older_config_format_and_default_pattern():
  # google/gemma-3-270m's config.json: rope_theta + rope_local_base_freq + rope_scaling (global
  # layers only), sliding_window_pattern instead of layer_types.
  new = _config("gemma3")
  old = {k: v for k, v in new.items() if k not in ("rope_parameters", "layer_types")}
  old.update(rope_theta=1e6, rope_local_base_freq=1e4, sliding_window_pattern=2,
             rope_scaling=dict(type="linear", factor=2.0))
  assert (pretrained.model_config_from_hf(old).to_dict()
          == pretrained.model_config_from_hf(new).to_dict())
  old.update(num_hidden_layers=7, sliding_window_pattern=6)
  spec = kvattn.models.transformer.resolve_config(pretrained.model_config_from_hf(old))
  assert [layer.window for layer in spec.layers] == [4] * 5 + [None, 4]
  with pytest.raises(NotImplementedError, match=r"hidden_activation='gelu' is not supported"):
    pretrained.model_config_from_hf(_config("gemma3", hidden_activation="gelu"))
  with pytest.raises(NotImplementedError, match=r"use_bidirectional_attention=True"):
    pretrained.model_config_from_hf(_config("gemma3", use_bidirectional_attention=True))


def _config(name, **updates):
  config = json.loads((FIXTURES / name / "config.json").read_text())
  config.update(updates)
  return config


def test_older_config_format_gives_the_same_model_config():
  # transformers < 5 and most hub checkpoints: rope_theta + rope_scaling (type key "type").
  for name in ("llama_rope3", "llama_mqa", "deepseek_v2_qlora_yarn"):
    new = _config(name)
    old = dict(new)
    params = dict(old.pop("rope_parameters"))
    old["rope_theta"] = params.pop("rope_theta")
    params["type"] = params.pop("rope_type")
    old["rope_scaling"] = params
    assert (pretrained.model_config_from_hf(old).to_dict()
            == pretrained.model_config_from_hf(new).to_dict()), name


@pytest.mark.parametrize("name, updates, match", [
    ("deepseek_v2", dict(first_k_dense_replace=1),
     r"first_k_dense_replace=1 .*layers \[1\] would be mixture-of-experts"),
    ("llama_gqa", dict(rope_parameters=dict(rope_type="dynamic", factor=2.0, rope_theta=1e4)),
     r"rope_parameters.rope_type='dynamic' is not supported"),
    ("llama_gqa", dict(rope_parameters=dict(rope_type="yarn", factor=2.0, rope_theta=1e4,
                                            original_max_position_embeddings=64)),
     r"rope_parameters.rope_type='yarn' .*model_type 'llama' supports \['linear', 'llama3'\]"),
    ("llama_gqa", dict(model_type="gpt2"), r"model_type='gpt2' is not supported"),
    ("llama_gqa", dict(attention_bias=True), r"attention_bias=True is not supported"),
    ("deepseek_v2", dict(attention_bias=True), r"attention_bias=True is not supported"),
    ("llama_gqa", dict(hidden_act="gelu"), r"hidden_act='gelu' is not supported"),
    ("llama_gqa", dict(mlp_bias=True), r"mlp_bias=True is not supported"),
    ("llama_gqa", dict(partial_rotary_factor=0.5), r"partial_rotary_factor=0.5"),
    ("qwen2_bias", dict(layer_types=["full_attention", "chunked_attention"]),
     r"layer_types\[1\]='chunked_attention' is not supported"),
    ("deepseek_v2", dict(num_key_value_heads=2), r"num_key_value_heads=2 is not supported"),
])
def test_configs_the_model_cannot_represent_raise(name, updates, match):
  with pytest.raises(NotImplementedError, match=match):
    pretrained.model_config_from_hf(_config(name, **updates))


def test_missing_required_config_key_is_named():
  config = _config("llama_gqa")
  del config["hidden_size"]
  with pytest.raises(ValueError, match=r"config key 'hidden_size' is missing"):
    pretrained.model_config_from_hf(config)
  config = _config("llama_rope3")
  del config["rope_parameters"]["low_freq_factor"]
  with pytest.raises(ValueError, match=r"config key 'rope_parameters.low_freq_factor' is "
                                       r"missing"):
    pretrained.model_config_from_hf(config)


def test_tokenizer_json_next_to_the_checkpoint_is_loaded(tmp_path):
  import tokenizers  # pylint: disable=g-import-not-at-top
  from kvattn.checkpoints import tokenizer as tokenizer_lib  # pylint: disable=g-import-not-at-top
  vocab = {f"w{i}": i for i in range(128)}
  backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="w0"))
  backend.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
  backend.decoder = tokenizers.decoders.WordPiece(prefix="##")
  path = _copy_checkpoint(tmp_path)
  backend.save(str(path / "tokenizer.json"))
  model, tokenizer = kvattn.from_pretrained(path)
  assert isinstance(tokenizer, tokenizer_lib.Tokenizer)
  tokens, _, meta = _expected("llama_gqa")
  prompt = tokens[1][:meta["prompt_lengths"][1]]
  ids = tokenizer.encode(" ".join(f"w{i}" for i in prompt))
  assert ids == prompt.tolist()
  out, _ = kvattn.generate(model, np.asarray([ids], np.int32), np.asarray([len(ids)]), 3)
  assert np.asarray(out[0]).tolist() == tokens[1][len(ids):len(ids) + 3].tolist()
  assert tokenizer.decode(np.asarray(out[0]).tolist()) == " ".join(
      f"w{i}" for i in np.asarray(out[0]).tolist())


def test_new_attention_keys_are_validated_with_the_dotted_key():
  from kvattn.models import transformer  # pylint: disable=g-import-not-at-top
  cfg = transformer.model_config(d_model=32, num_layers=2, mlp_dim=64, attention=dict(
      num_heads=4, num_kv_heads=2, head_dim=8, rope_scaling="llama3", rope_factor=8.0))
  with pytest.raises(ValueError, match=r"model\.attention: rope_original_max_position must be "
                                       r"set for rope_scaling 'llama3'"):
    transformer.resolve_config(cfg)
  cfg.attention.rope_scaling = "ntk"
  with pytest.raises(ValueError, match=r"model\.attention\.rope_scaling must be one of"):
    transformer.resolve_config(cfg)
  cfg.attention.rope_scaling = "linear"
  cfg.attention.qkv_bias = True
  cfg.layers = ({}, {"kind": "mla", "softmax_scale_factor": 1.5})
  model = kvattn.Transformer.from_config(cfg, rngs=nnx.Rngs(0))
  gqa, mla = model.layers[0].attn, model.layers[1].attn
  assert gqa.rope_scaling == kvattn.ops.RopeScaling("linear", 8.0) == mla.rope_scaling
  assert gqa.q_bias.shape == (4, 8) and gqa.k_bias.shape == (2, 8)
  assert mla.sm_scale == pytest.approx(1.5 * (32 + 16) ** -0.5)
  with pytest.raises(TypeError, match=r"rope_scaling must be a kvattn.ops.RopeScaling"):
    kvattn.GroupedQueryAttention(d_model=32, num_heads=4, num_kv_heads=2, head_dim=8,
                                 rope_scaling="linear", rngs=nnx.Rngs(0))


# A config.json value kvattn cannot use: the error names the file and the config.json key as
# the checkpoint spells it, never kvattn's field (model.attention.num_kv_heads, ...).
@pytest.mark.parametrize("name, updates, key, expected", [
    ("llama_gqa", dict(num_key_value_heads=3), "num_attention_heads",
     r"\(4\) must be divisible by 'num_key_value_heads' \(3\)"),
    ("llama_gqa", dict(num_key_value_heads=0), "num_key_value_heads",
     "must be a positive integer; got 0"),
    ("llama_gqa", dict(num_attention_heads=0), "num_attention_heads",
     "must be a positive integer; got 0"),
    ("llama_gqa", dict(hidden_size=64.5), "hidden_size", "must be a positive integer; got 64.5"),
    ("llama_gqa", dict(hidden_size="64"), "hidden_size", "must be a positive integer; got '64'"),
    ("llama_gqa", dict(num_hidden_layers=True), "num_hidden_layers",
     "must be a positive integer; got True"),
    ("llama_gqa", dict(head_dim=15), "head_dim", r"must be even \(RoPE rotates pairs\); got 15"),
    ("llama_gqa", dict(head_dim=None, hidden_size=60), "hidden_size",
     r"' / 'num_attention_heads' must be even \(RoPE rotates pairs\); got 15"),
    ("llama_gqa", dict(rms_norm_eps="tiny"), "rms_norm_eps",
     "must be a positive finite number; got 'tiny'"),
    ("llama_gqa", dict(tie_word_embeddings="no"), "tie_word_embeddings",
     "must be true or false; got 'no'"),
    ("llama_gqa", dict(rope_parameters=dict(rope_type="default", rope_theta=0)),
     "rope_parameters.rope_theta", "must be a positive finite number; got 0"),
    ("llama_gqa", dict(rope_parameters=dict(rope_type="linear", factor="two", rope_theta=1e4)),
     "rope_parameters.factor", "must be a positive finite number; got 'two'"),
    ("llama_gqa", dict(rope_scaling="linear"), "rope_scaling", "must be a mapping; got 'linear'"),
    ("mistral_window", dict(sliding_window=0), "sliding_window",
     "must be a positive integer; got 0"),
    ("qwen2_bias", dict(layer_types="full_attention"), "layer_types",
     "must be a list of num_hidden_layers = 2 entries"),
    ("deepseek_v2", dict(qk_rope_head_dim=3), "qk_rope_head_dim",
     r"must be even \(RoPE rotates pairs\); got 3"),
    ("deepseek_v2", dict(moe_layer_freq=0, first_k_dense_replace=0), "moe_layer_freq",
     "must be a positive integer; got 0"),
])
def test_bad_config_value_names_the_config_key_and_file(tmp_path, name, updates, key, expected):
  path = _copy_checkpoint(tmp_path, name, config=updates)
  with pytest.raises(ValueError) as info:
    kvattn.from_pretrained(path)
  message = str(info.value)
  assert re.match(rf"{re.escape(str(path / 'config.json'))}: config key '{re.escape(key)}'? ?"
                  rf".*{expected}", message), message
  assert "model." not in message and "num_kv_heads" not in message, message


def test_a_check_only_kvattn_makes_still_names_the_config_keys(tmp_path):
  # llama3 rope needs high_freq_factor > low_freq_factor: kvattn's RopeScaling checks it; the
  # error adds the config.json keys behind the fields it names.
  params = dict(_config("llama_rope3")["rope_parameters"], high_freq_factor=1.0,
                low_freq_factor=4.0)
  path = _copy_checkpoint(tmp_path, "llama_rope3", config=dict(rope_parameters=params))
  with pytest.raises(ValueError, match=r"config\.json: the model this config describes is "
                                       r"invalid: .*rope_high_freq_factor must exceed "
                                       r"rope_low_freq_factor; got 1.0 and 4.0") as info:
    kvattn.from_pretrained(path)
  assert "rope_high_freq_factor <- rope_parameters.high_freq_factor" in str(info.value)
  assert "rope_low_freq_factor <- rope_parameters.low_freq_factor" in str(info.value)


def test_older_config_format_errors_name_its_keys():
  config = _config("llama_gqa", rope_parameters=None, rope_theta=1e4,
                   rope_scaling=dict(type="dynamic", factor=2.0))
  with pytest.raises(NotImplementedError, match=r"^config rope_scaling\.type='dynamic'"):
    pretrained.model_config_from_hf(config)
  config["rope_scaling"] = dict(type="linear", factor=-1)
  with pytest.raises(ValueError, match=r"^config key 'rope_scaling\.factor' must be a positive "
                                       r"finite number; got -1"):
    pretrained.model_config_from_hf(config)
