"""HF `config.json` -> the kvattn `model` config (`model_config_from_hf`).

Supported `model_type`s: "llama" (Llama 2/3, SmolLM2, TinyLlama; rope scaling "linear" and
"llama3"), "mistral" (`sliding_window` -> every layer's window), "qwen2" (q/k/v biases;
`use_sliding_window` / `max_window_layers` / `layer_types` -> per-layer windows), "qwen3"
(qwen2's windows, qk-norm, no biases), "gemma2" and "gemma3_text" (GeGLU, embeddings times
sqrt(D), four norms per block, `query_pre_attn_scalar`, soft caps, local layers with
`sliding_window` and their own RoPE base -- `rope_local_base_freq` or
`rope_parameters.sliding_attention` -- next to the global layers', qk-norm for Gemma 3) and
"deepseek_v2" with dense MLP layers only (MLA with or without `q_lora_rank`; rope scaling
"yarn"). Whatever the model cannot represent -- mixture-of-experts layers, an unknown rope
type, an unknown `model_type`, a bias the architecture does not have, another activation --
raises NotImplementedError naming the config key and value instead of building a different
model; a malformed value raises ValueError naming the file's own key.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, Mapping, Sequence

import jax.numpy as jnp
from ml_collections import config_dict

from kvattn.models import transformer as transformer_lib
from kvattn.ops import rope as rope_lib

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text",
                         "deepseek_v2")
GEMMA_MODEL_TYPES = ("gemma2", "gemma3_text")

_ACTIVATIONS = ("silu", "swish")
_GEMMA_ACTIVATIONS = ("gelu_pytorch_tanh",)  # GeGLU with tanh GELU
# Gemma's local / global layer pattern when config.json has no `layer_types`: layer i is
# global iff (i + 1) % pattern == 0 (transformers' default; Gemma 3's `sliding_window_pattern`).
_GEMMA_PATTERN = {"gemma2": 2, "gemma3_text": 6}
# Tensors some checkpoints store that no model parameter reads (RoPE tables recomputed at load).
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


# ----------------------------------------------------------------------------------------------
# HF config -> kvattn model config.


def _get(config: Mapping[str, Any], key: str, default: Any = dataclasses.MISSING) -> Any:
  if key in config and config[key] is not None:
    return config[key]
  if default is dataclasses.MISSING:
    raise ValueError(f"config key {key!r} is missing (model_type "
                     f"{config.get('model_type')!r} needs it)")
  return default


def _check_int(key: str, value: Any, minimum: int = 1) -> int:
  """`value` of config key `key`, which must be an integer >= `minimum` (JSON, not a bool)."""
  if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
    what = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
    raise ValueError(f"config key {key!r} must be {what}; got {value!r}")
  return value


def _check_number(key: str, value: Any, minimum: float | None = 0.0) -> float:
  """`value` of config key `key`, a finite number > `minimum` (>= 0 when `minimum` is None)."""
  ok = (not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
        and (value >= 0 if minimum is None else value > minimum))
  if not ok:
    what = "a finite number >= 0" if minimum is None else "a positive finite number"
    raise ValueError(f"config key {key!r} must be {what}; got {value!r}")
  return float(value)


def _int(config: Mapping[str, Any], key: str, default: Any = dataclasses.MISSING, *,
         minimum: int = 1) -> int:
  return _check_int(key, _get(config, key, default), minimum)


def _flag(config: Mapping[str, Any], key: str, default: bool) -> bool:
  value = _get(config, key, default)
  if not isinstance(value, bool):
    raise ValueError(f"config key {key!r} must be true or false; got {value!r}")
  return value


def _unsupported(key: str, value: Any, why: str) -> NotImplementedError:
  return NotImplementedError(f"config {key}={value!r} is not supported: {why}")


def _rope_source(config: Mapping[str, Any]) -> tuple[str, str]:
  """The config.json keys of the RoPE scaling: `(dict, type key)`, e.g. ("rope_parameters",
  "rope_type") of transformers 5 or ("rope_scaling", "type") of older checkpoints."""
  prefix = "rope_scaling" if config.get("rope_scaling") else "rope_parameters"
  source = config.get(prefix)
  source = source if isinstance(source, Mapping) else {}
  return prefix, "type" if "rope_type" not in source and "type" in source else "rope_type"


def _rope_parameters(config: Mapping[str, Any]) -> tuple[float, dict[str, Any] | None]:
  """`(rope_theta, scaling)`: the base and the scaling parameters (None: plain RoPE).

  Reads transformers 5's `rope_parameters` and the older `rope_theta` +
  `rope_scaling` (whose type key is `rope_type` or `type`).
  """
  params = config.get("rope_parameters") or {}
  if not isinstance(params, Mapping):
    raise ValueError(f"config key 'rope_parameters' must be a mapping; got {params!r}")
  if params and all(isinstance(v, Mapping) for v in params.values()):
    raise _unsupported("rope_parameters", params, "per-layer-type RoPE parameters")
  theta_key = "rope_parameters.rope_theta" if "rope_theta" in params else "rope_theta"
  theta = params.get("rope_theta", config.get("rope_theta"))
  theta = 10000.0 if theta is None else _check_number(theta_key, theta)
  scaling = config.get("rope_scaling")
  if scaling and not isinstance(scaling, Mapping):
    raise ValueError(f"config key 'rope_scaling' must be a mapping; got {scaling!r}")
  scaling = dict(scaling) if scaling else dict(params)
  scaling.pop("rope_theta", None)
  kind = scaling.pop("rope_type", None) or scaling.pop("type", None) or "default"
  scaling.pop("type", None)
  partial = scaling.pop("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
  if partial is not None and _check_number("partial_rotary_factor", partial) != 1.0:
    raise _unsupported("partial_rotary_factor", partial, "RoPE over part of the head dim")
  if kind == "default":
    return theta, None
  return theta, {"rope_type": kind, **scaling}


def _gemma_rope(config: Mapping[str, Any], model_type: str
                ) -> tuple[tuple[float, dict | None], tuple[float, dict | None]]:
  """`((theta, scaling) of the global layers, (theta, scaling) of the local layers)` of Gemma.

  Reads transformers 5's per-layer-type `rope_parameters` (`{"full_attention": {...},
  "sliding_attention": {...}}`) or the older `rope_theta` + `rope_scaling` (global layers)
  and `rope_local_base_freq` (local layers, Gemma 3; Gemma 2 has one base for both).
  """
  params = config.get("rope_parameters")
  if isinstance(params, Mapping) and params and all(
      isinstance(v, Mapping) for v in params.values()):
    unknown = sorted(set(params) - {"full_attention", "sliding_attention"})
    if unknown:
      raise _unsupported(f"rope_parameters.{unknown[0]}", params[unknown[0]],
                         "only full_attention and sliding_attention layer types")
    default = {"full_attention": 1e6, "sliding_attention": 1e4} if model_type == "gemma3_text" \
        else {"full_attention": 1e4, "sliding_attention": 1e4}
    out = []
    for kind in ("full_attention", "sliding_attention"):
      sub = dict(params.get(kind) or {})
      sub.setdefault("rope_theta", default[kind])
      out.append(_rope_parameters({"rope_parameters": sub}))
    return out[0], out[1]
  theta, scaling = _rope_parameters(config)
  if model_type == "gemma3_text":
    if config.get("rope_theta") is None and not config.get("rope_parameters"):
      theta = 1e6  # transformers' Gemma 3 default
    local = config.get("rope_local_base_freq")
    local = 10000.0 if local is None else _check_number("rope_local_base_freq", local)
    return (theta, scaling), (local, None)
  return (theta, scaling), (theta, scaling)


def _rope_scaling_fields(scaling: Mapping[str, Any] | None, allowed: Sequence[str],
                         config: Mapping[str, Any]) -> dict[str, Any]:
  """The `model.attention` rope-scaling keys of a scaling dict (empty for plain RoPE)."""
  if scaling is None:
    return {}
  kind = scaling["rope_type"]
  prefix, kind_key = _rope_source(config)
  if kind not in allowed:
    raise _unsupported(f"{prefix}.{kind_key}", kind,
                       f"model_type {config.get('model_type')!r} supports {list(allowed)}")

  def need(key, check=_check_number):
    if scaling.get(key) is None:
      raise ValueError(f"config key '{prefix}.{key}' is missing ({kind_key} {kind!r} needs it)")
    return check(f"{prefix}.{key}", scaling[key])

  def number(key, default, minimum=0.0):
    value = scaling.get(key)
    return default if value is None else _check_number(f"{prefix}.{key}", value, minimum)

  if kind == "yarn" and scaling.get("factor") is None:  # DeepSeek-V3: the ratio of contexts
    factor = (_int(config, "max_position_embeddings")
              / need("original_max_position_embeddings", _check_int))
  else:
    factor = need("factor")
  fields = dict(rope_scaling=kind, rope_factor=factor)
  if kind == "llama3":
    fields.update(
        rope_low_freq_factor=need("low_freq_factor"),
        rope_high_freq_factor=need("high_freq_factor"),
        rope_original_max_position=need("original_max_position_embeddings", _check_int))
  elif kind == "yarn":
    if scaling.get("truncate", True) is not True:
      raise _unsupported(f"{prefix}.truncate", scaling["truncate"],
                         "an untruncated YaRN correction range")
    f = fields["rope_factor"]
    attention_factor = number("attention_factor", None)
    mscale, mscale_all_dim = number("mscale", None, None), number("mscale_all_dim", None, None)
    if attention_factor is None:  # as transformers' _compute_yarn_parameters
      if mscale and mscale_all_dim:
        attention_factor = rope_lib.yarn_mscale(f, mscale) / rope_lib.yarn_mscale(
            f, mscale_all_dim)
      else:
        attention_factor = rope_lib.yarn_mscale(f)
    fields.update(
        rope_original_max_position=need("original_max_position_embeddings", _check_int),
        rope_beta_fast=number("beta_fast", None) or 32.0,
        rope_beta_slow=number("beta_slow", None) or 1.0,
        rope_attention_factor=float(attention_factor))
  return fields


def _check_common(config: Mapping[str, Any]) -> None:
  if config.get("model_type") in GEMMA_MODEL_TYPES:
    key = "hidden_activation" if config.get("hidden_activation") else "hidden_act"
    act = config.get(key, "gelu_pytorch_tanh")
    if act not in _GEMMA_ACTIVATIONS:
      raise _unsupported(key, act, f"the MLP is GeGLU (one of {_GEMMA_ACTIVATIONS})")
    if config.get("use_bidirectional_attention"):
      raise _unsupported("use_bidirectional_attention", config["use_bidirectional_attention"],
                         "causal attention only")
  else:
    act = config.get("hidden_act", "silu")
    if act not in _ACTIVATIONS:
      raise _unsupported("hidden_act", act, f"the MLP is SwiGLU (one of {_ACTIVATIONS})")
  if config.get("mlp_bias"):
    raise _unsupported("mlp_bias", config["mlp_bias"], "the MLP has no biases")
  if config.get("quantization_config"):
    raise _unsupported("quantization_config", config["quantization_config"],
                       "quantized checkpoint weights (load a float checkpoint)")


def _layer_windows(config: Mapping[str, Any], model_type: str, num_layers: int) -> list:
  """Per-layer sliding windows in tokens (None: full attention), as transformers sets them."""
  window = config.get("sliding_window")
  if window is not None:
    window = _check_int("sliding_window", window)
  if model_type == "mistral":
    return [window] * num_layers
  if model_type in GEMMA_MODEL_TYPES:
    window = _int(config, "sliding_window")
    types = config.get("layer_types")
    if types is None:
      pattern = _int(config, "sliding_window_pattern", _GEMMA_PATTERN[model_type])
      types = ["sliding_attention" if (i + 1) % pattern else "full_attention"
               for i in range(num_layers)]
  elif model_type in ("qwen2", "qwen3"):
    if not _flag(config, "use_sliding_window", False):
      return [None] * num_layers
    types = config.get("layer_types")
    if types is None:
      first = _int(config, "max_window_layers", 28, minimum=0)
      types = ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]
  else:
    return [None] * num_layers
  if not isinstance(types, (list, tuple)) or len(types) != num_layers:
    raise ValueError(f"config key 'layer_types' must be a list of num_hidden_layers = "
                     f"{num_layers} entries; got {types!r:.100}")
  for i, t in enumerate(types):
    if t not in ("full_attention", "sliding_attention"):
      raise _unsupported(f"layer_types[{i}]", t, "only full and sliding attention layers")
  return [window if t == "sliding_attention" else None for t in types]


def _check_dense_mlp(config: Mapping[str, Any], num_layers: int) -> None:
  """DeepSeek-V2: every layer must be a dense MLP (mixture-of-experts layers raise)."""
  experts = config.get("n_routed_experts", 64)
  if not experts:
    return
  _check_int("n_routed_experts", experts, 0)
  first_dense = _int(config, "first_k_dense_replace", 0, minimum=0)
  freq = _int(config, "moe_layer_freq", 1)
  moe = [i for i in range(num_layers) if i >= first_dense and i % freq == 0]
  if moe:
    raise _unsupported("first_k_dense_replace", first_dense,
                       f"layers {moe} would be mixture-of-experts layers (n_routed_experts = "
                       f"{config.get('n_routed_experts', 64)}); only dense MLP layers are "
                       f"supported (first_k_dense_replace >= num_hidden_layers = {num_layers})")


# kvattn `model` / `model.attention` fields -> the config.json keys `model_config_from_hf` reads
# them from ("{rope}.{type}": the RoPE dict and type key of `_rope_source`), for errors.
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
  """The kvattn `model` ConfigDict of an HF config.json mapping (architecture mapping).

  Every value is checked in the config's own terms: errors name the config.json
  key (`num_key_value_heads`, `rope_parameters.factor`), never kvattn's field
  (`model.attention.num_kv_heads`).

  Args:
    config: config.json keys (`model_type`, `hidden_size`, ...).
    dtype: compute dtype name or dtype; default float32.
    param_dtype: parameter dtype; default `dtype`.
    where: the file `config` came from (e.g. ".../config.json"); errors start
      with it.

  Raises:
    NotImplementedError: a `model_type` outside `SUPPORTED_MODEL_TYPES` or a
      setting the model cannot represent (message names the key and value).
    ValueError: a missing or invalid required key (message names the key).
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
    prefix, kind_key = _rope_source(config)
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
  model_type = config.get("model_type")
  if model_type not in SUPPORTED_MODEL_TYPES:
    raise _unsupported("model_type", model_type, f"supported: {list(SUPPORTED_MODEL_TYPES)}")
  _check_common(config)
  dtype = jnp.dtype(jnp.float32 if dtype is None else dtype)
  param_dtype = dtype if param_dtype is None else jnp.dtype(param_dtype)
  d_model = _int(config, "hidden_size")
  num_heads = _int(config, "num_attention_heads")
  num_layers = _int(config, "num_hidden_layers")
  model: dict[str, Any] = {}
  if model_type in GEMMA_MODEL_TYPES:
    (theta, scaling), local_rope = _gemma_rope(config, model_type)
  else:
    theta, scaling = _rope_parameters(config)
  attention = dict(num_heads=num_heads, rope_theta=theta)
  layers: Sequence[dict] = ()
  if model_type == "deepseek_v2":
    _check_dense_mlp(config, num_layers)
    if config.get("attention_bias"):
      raise _unsupported("attention_bias", config["attention_bias"],
                         "MLA projections without biases only")
    num_kv = _int(config, "num_key_value_heads", num_heads)
    if num_kv != num_heads:
      raise _unsupported("num_key_value_heads", num_kv,
                         f"MLA expands keys and values per query head ({num_heads})")
    rope_dim = _int(config, "qk_rope_head_dim")
    if rope_dim % 2:
      raise ValueError(f"config key 'qk_rope_head_dim' must be even (RoPE rotates pairs); got "
                       f"{rope_dim}")
    attention.update(
        kind="mla", kv_lora_rank=_int(config, "kv_lora_rank"),
        qk_nope_head_dim=_int(config, "qk_nope_head_dim"), qk_rope_head_dim=rope_dim,
        v_head_dim=_int(config, "v_head_dim"),
        q_lora_rank=None if config.get("q_lora_rank") is None else _int(config, "q_lora_rank"))
    attention.update(_rope_scaling_fields(scaling, ("linear", "yarn"), config))
    mscale_all_dim = (scaling or {}).get("mscale_all_dim")
    if mscale_all_dim:  # transformers' yarn_apply_mscale: the softmax scale times mscale^2
      attention["softmax_scale_factor"] = rope_lib.yarn_mscale(attention["rope_factor"],
                                                               mscale_all_dim) ** 2
  else:
    if model_type != "qwen2" and config.get("attention_bias"):
      raise _unsupported("attention_bias", config["attention_bias"],
                         f"model_type {model_type!r} projections without biases only")
    num_kv = _int(config, "num_key_value_heads", num_heads)
    if num_heads % num_kv:
      raise ValueError(f"config key 'num_attention_heads' ({num_heads}) must be divisible by "
                       f"'num_key_value_heads' ({num_kv})")
    if config.get("head_dim") is not None:
      head_dim, head_dim_key = _int(config, "head_dim"), "'head_dim'"
    elif d_model >= num_heads:
      head_dim, head_dim_key = d_model // num_heads, "'hidden_size' / 'num_attention_heads'"
    else:
      raise ValueError(f"config key 'hidden_size' ({d_model}) must be at least "
                       f"'num_attention_heads' ({num_heads}) when 'head_dim' is not set")
    if head_dim % 2:
      raise ValueError(f"config key {head_dim_key} must be even (RoPE rotates pairs); got "
                       f"{head_dim}")
    attention.update(kind="gqa", num_kv_heads=num_kv, head_dim=head_dim)
    if model_type == "qwen2":
      attention["qkv_bias"] = True
    attention["qk_norm"] = model_type in ("qwen3", "gemma3_text")
    attention.update(_rope_scaling_fields(scaling, ("linear", "llama3"), config))
    windows = _layer_windows(config, model_type, num_layers)
    if model_type in GEMMA_MODEL_TYPES:
      attention["sm_scale"] = _check_number(
          "query_pre_attn_scalar", _get(config, "query_pre_attn_scalar", head_dim)) ** -0.5
      if config.get("attn_logit_softcapping") is not None:
        attention["soft_cap"] = _check_number("attn_logit_softcapping",
                                              config["attn_logit_softcapping"])
      if config.get("final_logit_softcapping") is not None:
        model["final_soft_cap"] = _check_number("final_logit_softcapping",
                                                config["final_logit_softcapping"])
      model.update(mlp_activation="gelu_tanh", scale_embeddings=True, post_norms=True)
      # Local layers: the window and their own RoPE (every rope_* field, so none of the
      # global layers' scaling is left over); global layers: `attention` as it is.
      local_theta, local_scaling = local_rope
      local = {"rope_theta": local_theta,
               **{name: None for name in transformer_lib.ROPE_SCALING_FIELDS},
               **_rope_scaling_fields(local_scaling, ("linear", "llama3"), config)}
      layers = tuple({"window": w, **local} if w is not None else {} for w in windows)
    elif len(set(windows)) == 1:
      attention["window"] = windows[0]
    else:
      layers = tuple({"window": w} for w in windows)
  cfg = transformer_lib.model_config(
      vocab_size=_int(config, "vocab_size"), d_model=d_model, num_layers=num_layers,
      mlp_dim=_int(config, "intermediate_size"),
      tie_embeddings=_flag(config, "tie_word_embeddings", False),
      norm_eps=_check_number("rms_norm_eps", _get(config, "rms_norm_eps", 1e-6)),
      dtype=dtype.name, param_dtype=param_dtype.name, attention=attention, **model)
  cfg.layers = layers
  return cfg
