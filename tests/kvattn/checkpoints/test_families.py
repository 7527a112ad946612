"""The model-family registry: a family defined outside kvattn loads through from_pretrained.

`toy_family` is Llama with its block norms under other names; a tiny random checkpoint
written here loads as it, holds exactly the written values, and computes the same logits
as the same weights under Llama's names loaded as "llama".
"""

from __future__ import annotations

import dataclasses
import json

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import kvattn
from kvattn.checkpoints import families
from tests.kvattn.checkpoints import toy_family  # registers "kvattn_toy"

V, D, F, L, N, K, H = 64, 32, 48, 2, 4, 2, 8  # vocab, width, MLP, layers, heads, KV heads, head


def _tensors(seed=0):
  """HF-named f32 weights in torch layout, norms under the toy family's names."""
  rng = np.random.default_rng(seed)
  w = lambda *shape: rng.normal(0, 0.2, shape).astype(np.float32)  # noqa: E731
  out = {"model.embed_tokens.weight": w(V, D), "model.norm.weight": 1 + w(D),
         "lm_head.weight": w(V, D)}
  for i in range(L):
    pre = f"model.layers.{i}."
    out.update({
        pre + "ln_attn.weight": 1 + w(D), pre + "ln_mlp.weight": 1 + w(D),
        pre + "self_attn.q_proj.weight": w(N * H, D), pre + "self_attn.k_proj.weight": w(K * H, D),
        pre + "self_attn.v_proj.weight": w(K * H, D), pre + "self_attn.o_proj.weight": w(D, N * H),
        pre + "mlp.gate_proj.weight": w(F, D), pre + "mlp.up_proj.weight": w(F, D),
        pre + "mlp.down_proj.weight": w(D, F)})
  return out


def _write(path, model_type, tensors):
  from safetensors.numpy import save_file  # pylint: disable=g-import-not-at-top
  path.mkdir()
  config = {"model_type": model_type, "vocab_size": V, "hidden_size": D,
            "intermediate_size": F, "num_hidden_layers": L, "num_attention_heads": N,
            "num_key_value_heads": K, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
            "rope_theta": 500.0, "max_position_embeddings": 64}
  (path / "config.json").write_text(json.dumps(config))
  save_file(tensors, path / "model.safetensors")
  return path


def _params(model):
  return {path: np.asarray(var.get_value())
          for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def test_toy_family_loads_the_written_weights_and_matches_llama(tmp_path):
  tensors = _tensors()
  toy, _ = kvattn.from_pretrained(_write(tmp_path / "toy", toy_family.MODEL_TYPE, tensors))
  layer = toy.spec.layers[0]
  assert (toy.spec.num_layers, toy.spec.d_model, toy.spec.vocab_size) == (L, D, V)
  assert (layer.kind, layer.num_kv_heads, layer.head_dim, layer.rope_theta) == ("gqa", K, H, 500.)
  assert layer.window is None and not layer.qk_norm and not toy.spec.post_norms
  params = _params(toy)
  np.testing.assert_array_equal(params[("layers", 1, "attn_norm", "scale")],
                                tensors["model.layers.1.ln_attn.weight"])
  np.testing.assert_array_equal(params[("layers", 0, "mlp_norm", "scale")],
                                tensors["model.layers.0.ln_mlp.weight"])
  q = tensors["model.layers.1.self_attn.q_proj.weight"]  # [N*H, D] -> kvattn [D, N, H]
  np.testing.assert_array_equal(params[("layers", 1, "attn", "q_proj")],
                                q.reshape(N, H, D).transpose(2, 0, 1))

  renames = {".ln_attn.": ".input_layernorm.", ".ln_mlp.": ".post_attention_layernorm."}
  as_llama = {}
  for name, value in tensors.items():
    for ours, theirs in renames.items():
      name = name.replace(ours, theirs)
    as_llama[name] = value
  llama, _ = kvattn.from_pretrained(_write(tmp_path / "llama", "llama", as_llama))
  assert dataclasses.asdict(llama.spec) == dataclasses.asdict(toy.spec)
  tokens = jnp.asarray(np.random.default_rng(1).integers(0, V, (2, 7)), jnp.int32)
  logits = np.asarray(toy(tokens)[0])  # f32[B, T, V]
  assert logits.shape == (2, 7, V) and np.isfinite(logits).all()
  np.testing.assert_array_equal(logits, np.asarray(llama(tokens)[0]))
  # Llama's names are not the toy family's: the loader names the first tensor it misses.
  (tmp_path / "llama" / "config.json").write_text(
      (tmp_path / "llama" / "config.json").read_text().replace('"llama"', '"kvattn_toy"'))
  with pytest.raises(ValueError, match=r"tensor 'model.layers.0.ln_attn.weight' is missing"):
    kvattn.from_pretrained(tmp_path / "llama")


def test_unknown_model_type_is_a_value_error_listing_the_registered_ones(tmp_path):
  tensors = _tensors()
  path = _write(tmp_path / "gpt2", "gpt2", tensors)
  with pytest.raises(ValueError, match=r"config\.json: config model_type='gpt2' is not "
                                       r"supported: supported: \['llama', .*'kvattn_toy'"):
    kvattn.from_pretrained(path)
  with pytest.raises(NotImplementedError):  # as every setting kvattn cannot represent
    families.lookup("gpt2")


def test_a_model_type_or_gguf_architecture_registers_once():
  with pytest.raises(ValueError, match=r"model_type 'kvattn_toy' is already registered"):
    families.register(toy_family.FAMILY)
  with pytest.raises(ValueError, match=r"GGUF architecture 'llama' is already registered by "
                                       r"model_type 'llama'"):
    families.register(families.Family(model_type="kvattn_toy_2", model_config=lambda c: None,
                                      gguf_architecture="llama"))
  assert "kvattn_toy_2" not in families.model_types()


def test_every_gguf_family_maps_its_layer_tensors_onto_its_hf_names():
  # A family's GGUF names must land on the HF names its weights are read under.
  for model_type in families.model_types():
    family = families.lookup(model_type)
    if family.gguf_architecture is None:
      continue
    assert families.by_gguf_architecture(family.gguf_architecture) is family
    hf = set(family.gguf_layer_names.values())
    for _, theirs in family.hf_layer_norms:
      assert f"{theirs}.weight" in hf, (model_type, theirs)
