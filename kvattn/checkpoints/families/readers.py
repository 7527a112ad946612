"""config.json readers the families share: checked values, RoPE, GQA attention, windows.

Every reader checks a value in the config's own terms: errors name the config.json
key (`num_key_value_heads`, `rope_parameters.factor`), never kvattn's field. A
malformed value raises ValueError; a setting the model cannot represent raises
NotImplementedError (`unsupported`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Mapping, Sequence

from kvattn.ops import rope as rope_lib

from kvattn.checkpoints.families import base

# MLP activations: (config keys, first set one wins; default; accepted values; the MLP).
SWIGLU = (("hidden_act",), "silu", ("silu", "swish"), "SwiGLU")
GEGLU = (("hidden_activation", "hidden_act"), "gelu_pytorch_tanh", ("gelu_pytorch_tanh",),
         "GeGLU")  # GeGLU with tanh GELU
# RoPE scaling types the GQA layers implement (MLA: "linear" and "yarn").
GQA_ROPE_SCALINGS = ("linear", "llama3")


def get(config: Mapping[str, Any], key: str, default: Any = dataclasses.MISSING) -> Any:
  """`config[key]`, else `default`; raises ValueError naming the key when it has none."""
  if key in config and config[key] is not None:
    return config[key]
  if default is dataclasses.MISSING:
    raise ValueError(f"config key {key!r} is missing (model_type "
                     f"{config.get('model_type')!r} needs it)")
  return default


def check_int(key: str, value: Any, minimum: int = 1) -> int:
  """`value` of config key `key`, which must be an integer >= `minimum` (JSON, not a bool)."""
  if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
    what = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
    raise ValueError(f"config key {key!r} must be {what}; got {value!r}")
  return value


def check_number(key: str, value: Any, minimum: float | None = 0.0) -> float:
  """`value` of config key `key`, a finite number > `minimum` (>= 0 when `minimum` is None)."""
  ok = (not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
        and (value >= 0 if minimum is None else value > minimum))
  if not ok:
    what = "a finite number >= 0" if minimum is None else "a positive finite number"
    raise ValueError(f"config key {key!r} must be {what}; got {value!r}")
  return float(value)


def integer(config: Mapping[str, Any], key: str, default: Any = dataclasses.MISSING, *,
            minimum: int = 1) -> int:
  """Config key `key` (else `default`) as an integer >= `minimum`; ValueError names the key."""
  return check_int(key, get(config, key, default), minimum)


def flag(config: Mapping[str, Any], key: str, default: bool) -> bool:
  """Config key `key` (else `default`), which must be true or false."""
  value = get(config, key, default)
  if not isinstance(value, bool):
    raise ValueError(f"config key {key!r} must be true or false; got {value!r}")
  return value


def unsupported(key: str, value: Any, why: str) -> NotImplementedError:
  """The error for a setting the model cannot represent: "config key=value is not supported"."""
  return NotImplementedError(f"config {key}={value!r} is not supported: {why}")


def check_activation(config: Mapping[str, Any], mlp: tuple = SWIGLU) -> None:
  """Raises NotImplementedError unless the MLP activation is one `mlp` (`SWIGLU`, `GEGLU`)
  accepts."""
  keys, default, allowed, name = mlp
  key = next((k for k in keys[:-1] if config.get(k)), keys[-1])
  act = config.get(key, default)
  if act not in allowed:
    raise unsupported(key, act, f"the MLP is {name} (one of {allowed})")


def rope_source(config: Mapping[str, Any]) -> tuple[str, str]:
  """The config.json keys of the RoPE scaling: `(dict, type key)`, e.g. ("rope_parameters",
  "rope_type") of transformers 5 or ("rope_scaling", "type") of older checkpoints."""
  prefix = "rope_scaling" if config.get("rope_scaling") else "rope_parameters"
  source = config.get(prefix)
  source = source if isinstance(source, Mapping) else {}
  return prefix, "type" if "rope_type" not in source and "type" in source else "rope_type"


def rope_parameters(config: Mapping[str, Any]) -> tuple[float, dict[str, Any] | None]:
  """`(rope_theta, scaling)`: the base and the scaling parameters (None: plain RoPE).

  Reads transformers 5's `rope_parameters` and the older `rope_theta` +
  `rope_scaling` (whose type key is `rope_type` or `type`).
  """
  params = config.get("rope_parameters") or {}
  if not isinstance(params, Mapping):
    raise ValueError(f"config key 'rope_parameters' must be a mapping; got {params!r}")
  if params and all(isinstance(v, Mapping) for v in params.values()):
    raise unsupported("rope_parameters", params, "per-layer-type RoPE parameters")
  theta_key = "rope_parameters.rope_theta" if "rope_theta" in params else "rope_theta"
  theta = params.get("rope_theta", config.get("rope_theta"))
  theta = 10000.0 if theta is None else check_number(theta_key, theta)
  scaling = config.get("rope_scaling")
  if scaling and not isinstance(scaling, Mapping):
    raise ValueError(f"config key 'rope_scaling' must be a mapping; got {scaling!r}")
  scaling = dict(scaling) if scaling else dict(params)
  scaling.pop("rope_theta", None)
  kind = scaling.pop("rope_type", None) or scaling.pop("type", None) or "default"
  scaling.pop("type", None)
  partial = scaling.pop("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
  if partial is not None and check_number("partial_rotary_factor", partial) != 1.0:
    raise unsupported("partial_rotary_factor", partial, "RoPE over part of the head dim")
  if kind == "default":
    return theta, None
  return theta, {"rope_type": kind, **scaling}


def rope_scaling_fields(scaling: Mapping[str, Any] | None, allowed: Sequence[str],
                        config: Mapping[str, Any]) -> dict[str, Any]:
  """The `model.attention` rope-scaling keys of a scaling dict (empty for plain RoPE)."""
  if scaling is None:
    return {}
  kind = scaling["rope_type"]
  prefix, kind_key = rope_source(config)
  if kind not in allowed:
    raise unsupported(f"{prefix}.{kind_key}", kind,
                      f"model_type {config.get('model_type')!r} supports {list(allowed)}")

  def need(key, check=check_number):
    if scaling.get(key) is None:
      raise ValueError(f"config key '{prefix}.{key}' is missing ({kind_key} {kind!r} needs it)")
    return check(f"{prefix}.{key}", scaling[key])

  def number(key, default, minimum=0.0):
    value = scaling.get(key)
    return default if value is None else check_number(f"{prefix}.{key}", value, minimum)

  if kind == "yarn" and scaling.get("factor") is None:  # DeepSeek-V3: the ratio of contexts
    factor = (integer(config, "max_position_embeddings")
              / need("original_max_position_embeddings", check_int))
  else:
    factor = need("factor")
  fields = dict(rope_scaling=kind, rope_factor=factor)
  if kind == "llama3":
    fields.update(
        rope_low_freq_factor=need("low_freq_factor"),
        rope_high_freq_factor=need("high_freq_factor"),
        rope_original_max_position=need("original_max_position_embeddings", check_int))
  elif kind == "yarn":
    if scaling.get("truncate", True) is not True:
      raise unsupported(f"{prefix}.truncate", scaling["truncate"],
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
        rope_original_max_position=need("original_max_position_embeddings", check_int),
        rope_beta_fast=number("beta_fast", None) or 32.0,
        rope_beta_slow=number("beta_slow", None) or 1.0,
        rope_attention_factor=float(attention_factor))
  return fields


def sliding_window(config: Mapping[str, Any], required: bool = False) -> int | None:
  """`sliding_window` in tokens (None when unset and not `required`)."""
  if required:
    return integer(config, "sliding_window")
  window = config.get("sliding_window")
  return None if window is None else check_int("sliding_window", window)


def layer_type_windows(types: Any, window: int | None, num_layers: int) -> list:
  """Per-layer windows of config.json `layer_types` ("full_attention": None,
  "sliding_attention": `window`), checked."""
  if not isinstance(types, (list, tuple)) or len(types) != num_layers:
    raise ValueError(f"config key 'layer_types' must be a list of num_hidden_layers = "
                     f"{num_layers} entries; got {types!r:.100}")
  for i, t in enumerate(types):
    if t not in ("full_attention", "sliding_attention"):
      raise unsupported(f"layer_types[{i}]", t, "only full and sliding attention layers")
  return [window if t == "sliding_attention" else None for t in types]


def gqa_attention(config: Mapping[str, Any], theta: float, scaling: dict | None, *,
                  bias: bool = False, qk_norm: bool = False) -> dict[str, Any]:
  """The `model.attention` fields of a GQA model (MHA and MQA through the KV-head count).

  `bias`: the q/k/v projections have biases (config `attention_bias` is
  otherwise refused); `qk_norm`: per-head RMSNorm of queries and keys.
  """
  num_heads = integer(config, "num_attention_heads")
  d_model = integer(config, "hidden_size")
  attention = dict(num_heads=num_heads, rope_theta=theta)
  if not bias and config.get("attention_bias"):
    raise unsupported("attention_bias", config["attention_bias"],
                      f"model_type {config.get('model_type')!r} projections without biases only")
  num_kv = integer(config, "num_key_value_heads", num_heads)
  if num_heads % num_kv:
    raise ValueError(f"config key 'num_attention_heads' ({num_heads}) must be divisible by "
                     f"'num_key_value_heads' ({num_kv})")
  if config.get("head_dim") is not None:
    head_dim, head_dim_key = integer(config, "head_dim"), "'head_dim'"
  elif d_model >= num_heads:
    head_dim, head_dim_key = d_model // num_heads, "'hidden_size' / 'num_attention_heads'"
  else:
    raise ValueError(f"config key 'hidden_size' ({d_model}) must be at least "
                     f"'num_attention_heads' ({num_heads}) when 'head_dim' is not set")
  if head_dim % 2:
    raise ValueError(f"config key {head_dim_key} must be even (RoPE rotates pairs); got "
                     f"{head_dim}")
  attention.update(kind="gqa", num_kv_heads=num_kv, head_dim=head_dim)
  if bias:
    attention["qkv_bias"] = True
  attention["qk_norm"] = qk_norm
  attention.update(rope_scaling_fields(scaling, GQA_ROPE_SCALINGS, config))
  return attention


def gqa_model(config: Mapping[str, Any], *, bias: bool = False, qk_norm: bool = False,
              windows: Callable[[Mapping[str, Any], int], list] | None = None
              ) -> base.ModelParts:
  """`ModelParts` of a Llama-like model: SwiGLU, one RoPE, GQA attention, and per-layer
  windows `windows(config, num_layers)` (None: full attention everywhere)."""
  check_activation(config, SWIGLU)
  num_layers = integer(config, "num_hidden_layers")
  attention = gqa_attention(config, *rope_parameters(config), bias=bias, qk_norm=qk_norm)
  sliding_window(config)  # checked where set, even for a family that does not read it
  per_layer = [None] * num_layers if windows is None else windows(config, num_layers)
  if len(set(per_layer)) == 1:
    attention["window"] = per_layer[0]
    return base.ModelParts(attention, {}, ())
  return base.ModelParts(attention, {}, tuple({"window": w} for w in per_layer))
