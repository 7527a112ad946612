"""HF `config.json` -> the kvattn `model` config (`model_config_from_hf`): the shared keys
here, the rest by the family of `model_type` (`kvattn.checkpoints.families`)."""

from __future__ import annotations

import re
from typing import Any, Mapping

import jax.numpy as jnp
from ml_collections import config_dict

from kvattn.models import transformer as transformer_lib

from kvattn.checkpoints import families
from kvattn.checkpoints.families import readers

# Tensors some checkpoints store that no model parameter reads (RoPE tables recomputed at load).
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


# kvattn `model` / `model.attention` fields -> the config.json keys `model_config_from_hf` reads
# them from ("{rope}.{type}": the RoPE dict and type key of `readers.rope_source`), for errors.
_CONFIG_KEYS = {
    "vocab_size": "vocab_size", "d_model": "hidden_size", "num_layers": "num_hidden_layers",
    "mlp_dim": "intermediate_size", "norm_eps": "rms_norm_eps",
    "num_heads": "num_attention_heads", "num_kv_heads": "num_key_value_heads",
    "head_dim": "head_dim (else hidden_size / num_attention_heads)",
    "rope_theta": "rope_theta or rope_parameters.rope_theta", "window": "sliding_window",
    "kv_lora_rank": "kv_lora_rank",
    "qk_nope_head_dim": "qk_nope_head_dim", "qk_rope_head_dim": "qk_rope_head_dim",
    "v_head_dim": "v_head_dim", "q_lora_rank": "q_lora_rank",
    "rope_scaling": "{rope}.{type}", "rope_factor": "{rope}.factor",
    "rope_original_max_position": "{rope}.original_max_position_embeddings",
    "rope_low_freq_factor": "{rope}.low_freq_factor",
    "rope_high_freq_factor": "{rope}.high_freq_factor",
    "rope_beta_fast": "{rope}.beta_fast", "rope_beta_slow": "{rope}.beta_slow",
    "rope_attention_factor": "{rope}.attention_factor (else from factor and mscale)",
    "softmax_scale_factor": "{rope}.mscale_all_dim",
}


def model_config_from_hf(config: Mapping[str, Any], *, dtype: Any = None,
                         param_dtype: Any = None, where: str | None = None
                         ) -> config_dict.ConfigDict:
  """The kvattn `model` ConfigDict of an HF config.json mapping; errors name the config.json
  key (e.g. `num_key_value_heads`) and start with `where`.

  Raises:
    families.UnsupportedError: a `model_type` no family reads (a ValueError and a
      NotImplementedError; lists the supported ones).
    NotImplementedError: a setting the model cannot represent (naming key and value).
    ValueError: a missing or invalid required key.
  """
  try:
    cfg = _model_config_from_hf(config, dtype=dtype, param_dtype=param_dtype)
  except (ValueError, NotImplementedError) as e:
    if where is None:
      raise
    raise type(e)(f"{where}: {e}") from e
  try:
    transformer_lib.resolve_config(cfg)
  except ValueError as e:  # a check _model_config_from_hf lacks: name the keys behind it
    prefix, kind_key = readers.rope_source(config)
    keys = [f"{field} <- {key.format(rope=prefix, type=kind_key)}"
            for field, key in _CONFIG_KEYS.items() if re.search(rf"\b{field}\b", str(e))]
    if not keys:  # not about the config (dtype=, param_dtype=)
      raise
    raise ValueError(f"{where + ': ' if where else ''}the model this config describes is "
                     f"invalid: {e} (kvattn field <- config key: {'; '.join(keys)})") from e
  return cfg


def _model_config_from_hf(config: Mapping[str, Any], *, dtype: Any = None,
                          param_dtype: Any = None) -> config_dict.ConfigDict:
  """`model_config_from_hf` without the file in its errors and the final check."""
  if not isinstance(config, Mapping):
    raise TypeError(f"config must be a mapping of config.json keys; got {type(config).__name__}")
  family = families.lookup(config.get("model_type"))
  if config.get("mlp_bias"):
    raise readers.unsupported("mlp_bias", config["mlp_bias"], "the MLP has no biases")
  if config.get("quantization_config"):
    raise readers.unsupported("quantization_config", config["quantization_config"],
                              "quantized checkpoint weights (load a float checkpoint)")
  dtype = jnp.dtype(jnp.float32 if dtype is None else dtype)
  param_dtype = dtype if param_dtype is None else jnp.dtype(param_dtype)
  parts = family.model_config(config)
  cfg = transformer_lib.model_config(
      vocab_size=readers.integer(config, "vocab_size"),
      d_model=readers.integer(config, "hidden_size"),
      num_layers=readers.integer(config, "num_hidden_layers"),
      mlp_dim=readers.integer(config, "intermediate_size"),
      tie_embeddings=readers.flag(config, "tie_word_embeddings", False),
      norm_eps=readers.check_number("rms_norm_eps", readers.get(config, "rms_norm_eps", 1e-6)),
      dtype=dtype.name, param_dtype=param_dtype.name, attention=parts.attention, **parts.model)
  cfg.layers = parts.layers
  return cfg
