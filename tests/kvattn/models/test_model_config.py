"""The model config schema: one dataclass per section, the ConfigDict and validation from it."""

from __future__ import annotations

import dataclasses
import inspect

import jax.numpy as jnp
import pytest
from flax import nnx
from ml_collections import config_dict

import kvattn
from kvattn.models import transformer


def _fields(cls):
  return [f.name for f in dataclasses.fields(cls)]


def test_config_dict_has_exactly_the_dataclass_fields_and_defaults():
  cfg = transformer.model_config()
  assert list(cfg.keys()) == sorted(_fields(transformer.ModelSpec))  # ConfigDict sorts keys
  assert sorted(cfg.attention.keys()) == sorted(_fields(transformer.AttentionSpec))
  for f in dataclasses.fields(transformer.AttentionSpec):
    assert cfg.attention[f.name] == f.default, f.name
  for f in dataclasses.fields(transformer.ModelSpec):
    if f.name != "attention":
      assert cfg[f.name] == f.default, f.name
  # None defaults become typed placeholders: a value of the wrong type is refused.
  with pytest.raises(TypeError):
    cfg.attention.window = "wide"
  cfg.attention.window = 16
  assert transformer.resolve_config(cfg).layers[0].window == 16


def test_every_field_a_kind_uses_is_a_keyword_of_its_module():
  """The schema's fields are the attention modules' keywords (make_attention passes them); the
  rope_* scaling fields are grouped into one `rope_scaling` keyword (AttentionSpec.rope())."""
  modules = {"gqa": kvattn.GroupedQueryAttention, "mla": kvattn.MultiHeadLatentAttention}
  for kind, cls in modules.items():
    params = inspect.signature(cls.__init__).parameters
    used = [name for name in transformer.attention_fields(kind)
            if name != "kind" and name not in transformer.ROPE_SCALING_FIELDS]
    assert len(used) >= 5 and all(name in params for name in used), (kind, used)
    assert "rope_scaling" in params
  assert "head_dim" in transformer.attention_fields("gqa")
  assert "head_dim" not in transformer.attention_fields("mla")


def test_resolved_spec_drops_the_other_kinds_fields_and_is_idempotent():
  cfg = transformer.model_config(d_model=32, num_layers=2, mlp_dim=64,
                                 attention=dict(num_heads=4, num_kv_heads=2, head_dim=8),
                                 layers=({}, {"kind": "mla"}))
  spec = transformer.resolve_config(cfg)
  gqa, mla = spec.layers
  assert (gqa.num_kv_heads, gqa.head_dim, gqa.kv_lora_rank, gqa.q_lora_rank) == (2, 8, None, None)
  assert (mla.num_kv_heads, mla.head_dim, mla.kv_lora_rank) == (None, None, 64)
  assert spec.dtype == jnp.dtype("float32") and spec.attention == gqa
  assert transformer.resolve_config(spec) == spec
  hash(spec)  # a static attribute of the module: must be hashable


def test_a_dataclass_instance_and_a_partial_mapping_are_configs():
  spec = transformer.ModelSpec(d_model=32, num_layers=1, mlp_dim=64,
                               attention=transformer.AttentionSpec(num_heads=2, num_kv_heads=1,
                                                                   head_dim=8))
  model = kvattn.Transformer(spec, rngs=nnx.Rngs(0))  # resolved on the way in
  assert model.num_layers == 1 and model.layers[0].attn.num_kv_heads == 1
  # Missing fields of a mapping take their defaults.
  partial = transformer.resolve_config({"d_model": 32, "attention": {"num_heads": 16}})
  assert partial.num_layers == 4 and partial.layers[0].num_kv_heads == 8
  with pytest.raises(ValueError, match=r"model\.attention\.num_kv_heads must divide"):
    transformer.resolve_config({"attention": {"num_heads": 6}})  # default K = 8 does not divide


@pytest.mark.parametrize("overrides, message", [
    (dict(attention=transformer.AttentionSpec(kind="mla")), None),
    (dict(attention=config_dict.ConfigDict({"kind": "gqa"})), None),
    (dict(attention=dict(kind="mqa")), r"model\.attention\.kind must be one of \('gqa', 'mla'\)"),
    (dict(attention=dict(rope_theta=float("inf"))), r"rope_theta must be a positive finite"),
    (dict(attention=dict(soft_cap=0.0)), r"model\.attention\.soft_cap must be a positive"),
    (dict(attention=dict(window=True)), r"model\.attention\.window must be a positive int"),
    (dict(attention=dict(decode_implementation=3)),
     r"model\.attention\.decode_implementation must be a str or None; got 3"),
    (dict(param_dtype="int32"), r"model\.param_dtype must name a floating dtype"),
])
def test_values_are_checked_by_field_type(overrides, message):
  cfg = transformer.model_config(**overrides)
  if message is None:
    transformer.resolve_config(cfg)
  else:
    with pytest.raises(ValueError, match=message):
      transformer.resolve_config(cfg)


def test_bad_config_type():
  with pytest.raises(TypeError, match=r"model must be a ConfigDict or a mapping; got int"):
    transformer.resolve_config(3)
