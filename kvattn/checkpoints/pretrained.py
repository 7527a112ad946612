"""Pretrained checkpoints as `kvattn.Transformer`s: `from_pretrained`, `build_model`.

`from_pretrained(source)` accepts

  * a Hugging Face checkpoint directory: `config.json` and either
    `model.safetensors` or shards listed by `model.safetensors.index.json`
    (read with the `safetensors` package; `tokenizer.json` optional);
  * a `.gguf` file (`kvattn.checkpoints.gguf.load_gguf`);
  * a registered name such as "smollm2-135m-instruct" (`kvattn.checkpoints.hub.resolve`,
    which fetches it on first use), then read as a `.gguf` file.

Whatever the source, the checkpoint ends up as an HF-style config mapping
(config.json keys) and HF-named tensors in torch layout (`[out, in]` for a
linear layer), and `build_model` turns those into a `kvattn.Transformer`:

  1. `model_config_from_hf(config)` maps the architecture onto the kvattn
     `model` config schema (`kvattn.models.transformer`). Supported `model_type`s:
     "llama" (Llama 2/3, SmolLM2, TinyLlama; rope scaling "linear" and
     "llama3"), "mistral" (`sliding_window` -> every layer's window), "qwen2"
     (q/k/v biases; `use_sliding_window` / `max_window_layers` /
     `layer_types` -> per-layer windows) and "deepseek_v2" with dense MLP
     layers only (MLA with or without `q_lora_rank`; rope scaling "yarn").
     Whatever the model cannot represent -- mixture-of-experts layers, an
     unknown rope type, an unknown `model_type`, a bias the architecture does
     not have, another activation -- raises NotImplementedError naming the
     config key and value instead of building a different model.
  2. `weight_map` lists, for every parameter of that model, the HF tensor it
     comes from, the tensor's expected shape and how it is rearranged into
     kvattn's layout (e.g. `q_proj.weight [N*H, D]` -> `q_proj [D, N, H]`).
  3. The model is built abstractly (`nnx.eval_shape`, no random init) and its
     parameters are filled with the checkpoint's tensors cast to
     `param_dtype`.

DeepSeek's rope layout: transformers' DeepseekV2 rotates *interleaved* pairs
(x[2i], x[2i+1]) of the R rope dims, kvattn the rotate-half pairs
(x[i], x[i + R/2]) of Llama. The rope columns of the query and rope-key
projections are permuted at load time (evens first, then odds), which turns
one convention into the other; attention logits are dot products over those R
dims, so they are unchanged (the cached `k_rope` holds the permuted order).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import pathlib
import re
from typing import Any, Callable, Iterator, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from ml_collections import config_dict

from kvattn.models import transformer as transformer_lib
from kvattn.ops import rope as rope_lib

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "deepseek_v2")
CONFIG_FILE = "config.json"
SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX_FILE = "model.safetensors.index.json"
TOKENIZER_FILE = "tokenizer.json"

_ACTIVATIONS = ("silu", "swish")
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
  if model_type == "qwen2":
    if not _flag(config, "use_sliding_window", False):
      return [None] * num_layers
    types = config.get("layer_types")
    if types is None:
      first = _int(config, "max_window_layers", 28, minimum=0)
      types = ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]
    if not isinstance(types, (list, tuple)) or len(types) != num_layers:
      raise ValueError(f"config key 'layer_types' must be a list of num_hidden_layers = "
                       f"{num_layers} entries; got {types!r:.100}")
    for i, t in enumerate(types):
      if t not in ("full_attention", "sliding_attention"):
        raise _unsupported(f"layer_types[{i}]", t, "only full and sliding attention layers")
    return [window if t == "sliding_attention" else None for t in types]
  return [None] * num_layers


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
    attention.update(_rope_scaling_fields(scaling, ("linear", "llama3"), config))
    windows = _layer_windows(config, model_type, num_layers)
    if len(set(windows)) == 1:
      attention["window"] = windows[0]
    else:
      layers = tuple({"window": w} for w in windows)
  cfg = transformer_lib.model_config(
      vocab_size=_int(config, "vocab_size"), d_model=d_model, num_layers=num_layers,
      mlp_dim=_int(config, "intermediate_size"),
      tie_embeddings=_flag(config, "tie_word_embeddings", False),
      norm_eps=_check_number("rms_norm_eps", _get(config, "rms_norm_eps", 1e-6)),
      dtype=dtype.name, param_dtype=param_dtype.name, attention=attention)
  cfg.layers = layers
  return cfg


# ----------------------------------------------------------------------------------------------
# HF tensors -> kvattn parameters.


@dataclasses.dataclass(frozen=True)
class WeightEntry:
  """One kvattn parameter and the HF tensor it is read from.

  `param`: path in the model's state, e.g. `("layers", 0, "attn", "q_proj")`;
  `tensor`: HF name; `shape`: the tensor's expected shape; `convert`: maps
  the tensor (torch layout) to the parameter's layout.
  """

  param: tuple[Any, ...]
  tensor: str
  shape: tuple[int, ...]
  convert: Callable[[jax.Array], jax.Array]


def _same(x):
  return x


def _linear(in_shape: tuple[int, ...], out_shape: tuple[int, ...],
            perm: np.ndarray | None = None) -> tuple[tuple[int, ...], Callable]:
  """A torch Linear weight `[prod(out), prod(in)]` -> kvattn `[*in, *out]` (einsum layout).

  `perm` (optional) reorders the last output axis (the DeepSeek rope de-interleave).
  """
  shape = (math.prod(out_shape), math.prod(in_shape))

  def convert(w):
    w = w.reshape(out_shape + in_shape)
    w = jnp.transpose(w, tuple(range(len(out_shape), w.ndim)) + tuple(range(len(out_shape))))
    return w if perm is None else w[..., perm]

  return shape, convert


def _rope_deinterleave(width: int, rope_dim: int) -> np.ndarray:
  """Index permutation of a last axis of `width` whose last `rope_dim` entries are rope dims:
  the non-rope prefix stays, the rope dims go evens first, then odds."""
  rope = np.arange(width - rope_dim, width)
  return np.concatenate([np.arange(width - rope_dim), rope[0::2], rope[1::2]])


def weight_map(spec: transformer_lib.ModelSpec) -> list[WeightEntry]:
  """Every parameter of a `Transformer(spec)` with its HF tensor name, shape and conversion.

  The HF names are those of transformers' `LlamaForCausalLM` family
  (`model.layers.{i}.self_attn.q_proj.weight`, ...) and of
  `DeepseekV2ForCausalLM` for MLA layers (`q_a_proj`, `kv_a_proj_with_mqa`,
  `kv_b_proj`, ...).
  """
  D, F, V = spec.d_model, spec.mlp_dim, spec.vocab_size
  entries = [WeightEntry(("embedding",), "model.embed_tokens.weight", (V, D), _same),
             WeightEntry(("final_norm", "scale"), "model.norm.weight", (D,), _same)]
  if not spec.tie_embeddings:
    entries.append(WeightEntry(("lm_head",), "lm_head.weight", *_linear((D,), (V,))))
  for i, layer in enumerate(spec.layers):
    pre, at = f"model.layers.{i}.", ("layers", i, "attn")
    entries += [
        WeightEntry(("layers", i, "attn_norm", "scale"), pre + "input_layernorm.weight", (D,),
                    _same),
        WeightEntry(("layers", i, "mlp_norm", "scale"), pre + "post_attention_layernorm.weight",
                    (D,), _same),
        WeightEntry(("layers", i, "mlp", "gate"), pre + "mlp.gate_proj.weight",
                    *_linear((D,), (F,))),
        WeightEntry(("layers", i, "mlp", "up"), pre + "mlp.up_proj.weight", *_linear((D,), (F,))),
        WeightEntry(("layers", i, "mlp", "down"), pre + "mlp.down_proj.weight",
                    *_linear((F,), (D,))),
    ]
    pre += "self_attn."
    if layer.kind == "gqa":
      entries += _gqa_entries(layer, D, pre, at)
    else:
      entries += _mla_entries(layer, D, pre, at)
  return entries


def _gqa_entries(layer, D: int, pre: str, at: tuple) -> list[WeightEntry]:
  N, K, H = layer.num_heads, layer.num_kv_heads, layer.head_dim
  entries = [
      WeightEntry(at + ("q_proj",), pre + "q_proj.weight", *_linear((D,), (N, H))),
      WeightEntry(at + ("k_proj",), pre + "k_proj.weight", *_linear((D,), (K, H))),
      WeightEntry(at + ("v_proj",), pre + "v_proj.weight", *_linear((D,), (K, H))),
      WeightEntry(at + ("o_proj",), pre + "o_proj.weight", *_linear((N, H), (D,))),
  ]
  if layer.qkv_bias:
    for name, heads in (("q", N), ("k", K), ("v", K)):
      entries.append(WeightEntry(at + (f"{name}_bias",), pre + f"{name}_proj.bias",
                                 (heads * H,), lambda b, s=(heads, H): b.reshape(s)))
  return entries


def _mla_entries(layer, D: int, pre: str, at: tuple) -> list[WeightEntry]:
  N, C, R = layer.num_heads, layer.kv_lora_rank, layer.qk_rope_head_dim
  Hn, Hv = layer.qk_nope_head_dim, layer.v_head_dim
  q_perm = _rope_deinterleave(Hn + R, R)
  entries = []
  if layer.q_lora_rank is None:
    entries.append(WeightEntry(at + ("q_proj",), pre + "q_proj.weight",
                               *_linear((D,), (N, Hn + R), q_perm)))
  else:
    Cq = layer.q_lora_rank
    entries += [
        WeightEntry(at + ("q_down_proj",), pre + "q_a_proj.weight", *_linear((D,), (Cq,))),
        WeightEntry(at + ("q_norm",), pre + "q_a_layernorm.weight", (Cq,), _same),
        WeightEntry(at + ("q_up_proj",), pre + "q_b_proj.weight",
                    *_linear((Cq,), (N, Hn + R), q_perm)),
    ]
  kv_b_shape = (N * (Hn + Hv), C)

  def kv_b_part(lo, hi):  # [N*(Hn+Hv), C] -> [C, N, hi-lo]
    return lambda w: jnp.transpose(w.reshape(N, Hn + Hv, C)[:, lo:hi], (2, 0, 1))

  entries += [
      WeightEntry(at + ("kv_down_proj",), pre + "kv_a_proj_with_mqa.weight",
                  *_linear((D,), (C + R,), _rope_deinterleave(C + R, R))),
      WeightEntry(at + ("kv_norm",), pre + "kv_a_layernorm.weight", (C,), _same),
      WeightEntry(at + ("k_up_proj",), pre + "kv_b_proj.weight", kv_b_shape, kv_b_part(0, Hn)),
      WeightEntry(at + ("v_up_proj",), pre + "kv_b_proj.weight", kv_b_shape,
                  kv_b_part(Hn, Hn + Hv)),
      WeightEntry(at + ("o_proj",), pre + "o_proj.weight", *_linear((N, Hv), (D,))),
  ]
  return entries


def _origin(tensors: Mapping[str, Any], name: str) -> str:
  """Where tensor `name` lives, for error messages ('' when the mapping cannot tell)."""
  where = getattr(tensors, "origin", None)
  return f"{where(name)}: " if callable(where) else ""


def _shape_of(tensors: Mapping[str, Any], name: str) -> tuple[int, ...]:
  shape_fn = getattr(tensors, "shape", None)
  if callable(shape_fn):
    return tuple(shape_fn(name))
  return tuple(np.shape(tensors[name]))


def build_model(config: Mapping[str, Any], tensors: Mapping[str, Any], *, dtype: Any = None,
                param_dtype: Any = None, where: str | None = None) -> transformer_lib.Transformer:
  """A `kvattn.Transformer` holding a checkpoint's weights.

  Args:
    config: HF config.json keys (see `model_config_from_hf`).
    tensors: HF tensor name -> array in torch layout (`[out_features,
      in_features]` for linear layers), any float dtype (numpy, ml_dtypes
      bfloat16 or jax arrays). Every tensor of `weight_map` must be present;
      a tied head (`tie_word_embeddings`) ignores `lm_head.weight`.
    dtype: compute dtype; default float32.
    param_dtype: parameter dtype the weights are cast to; default `dtype`.
    where: the file `config` came from; config errors start with it.

  Returns:
    The model; `model(tokens)` gives f32 logits `[B, T, vocab_size]`.

  Raises:
    NotImplementedError: an architecture or setting the model cannot
      represent (names the config key and value).
    ValueError: a missing tensor, a tensor of the wrong shape or a non-float
      dtype, or tensors the model would not read (each names the tensor).
  """
  cfg = model_config_from_hf(config, dtype=dtype, param_dtype=param_dtype, where=where)
  spec = transformer_lib.resolve_config(cfg)
  entries = weight_map(spec)
  for e in entries:
    if e.tensor not in tensors:
      raise ValueError(f"{_origin(tensors, e.tensor)}tensor {e.tensor!r} is missing from the "
                       f"checkpoint (expected shape {list(e.shape)})")
    got = _shape_of(tensors, e.tensor)
    if got != e.shape:
      raise ValueError(f"{_origin(tensors, e.tensor)}tensor {e.tensor!r} has shape {list(got)}; "
                       f"expected {list(e.shape)} from config.json")
  used = {e.tensor for e in entries}
  if spec.tie_embeddings:
    used.add("lm_head.weight")  # transformers ties it to the embedding whatever the file holds
  unused = sorted(n for n in tensors if n not in used and not n.endswith(_IGNORED_SUFFIXES))
  if unused:
    raise ValueError(f"{_origin(tensors, unused[0])}tensor {unused[0]!r} is not read by the "
                     f"model config.json describes ({len(unused)} unread tensors: "
                     f"{unused[:5]}{' ...' if len(unused) > 5 else ''})")

  abstract = nnx.eval_shape(lambda: transformer_lib.Transformer(spec, rngs=nnx.Rngs(0)))
  graphdef, state = nnx.split(abstract)
  readers = {}  # tensor -> parameters still to fill from it, so each is read and freed once
  for e in entries:
    readers[e.tensor] = readers.get(e.tensor, 0) + 1
  values, loaded = {}, {}
  for e in entries:
    if e.tensor not in loaded:
      raw = tensors[e.tensor]
      if not jnp.issubdtype(raw.dtype, jnp.floating):
        raise ValueError(f"{_origin(tensors, e.tensor)}tensor {e.tensor!r} has dtype "
                         f"{raw.dtype}; expected a float dtype")
      loaded[e.tensor] = jnp.asarray(raw)
    values[e.param] = e.convert(loaded[e.tensor]).astype(spec.param_dtype)
    readers[e.tensor] -= 1
    if not readers[e.tensor]:
      del loaded[e.tensor]
  flat = nnx.to_flat_state(state)
  missing = [p for p, _ in flat if p not in values]
  if missing:  # a parameter weight_map does not cover: a bug here, not in the checkpoint
    raise RuntimeError(f"no checkpoint tensor is mapped to parameter {missing[0]}")
  for path, var in flat:
    want = var.get_value().shape
    if values[path].shape != want:
      raise RuntimeError(f"parameter {path}: converted shape {values[path].shape} != {want}")
    var.set_value(values[path])
  return nnx.merge(graphdef, nnx.from_flat_state(flat))



# ----------------------------------------------------------------------------------------------
# HF checkpoint directories.


class SafetensorsCheckpoint(Mapping[str, jax.Array]):
  """The tensors of `model.safetensors`, or of the shards `model.safetensors.index.json` lists,
  read lazily (each tensor is read from its memory-mapped file when indexed).

  `shape(name)` and `origin(name)` (the file that holds it) need no read.
  """

  def __init__(self, directory: str | os.PathLike):
    """Opens the checkpoint's safetensors file(s) and reads their headers.

    Raises:
      FileNotFoundError: neither `model.safetensors` nor the index exists in
        `directory`, or a shard the index names is missing (names the file).
      ValueError: an index without a `weight_map`, a tensor the index puts in
        a shard that does not hold it, or an unreadable safetensors file.
    """
    from safetensors import safe_open  # pylint: disable=g-import-not-at-top
    self._open = safe_open
    directory = pathlib.Path(directory)
    single, index = directory / SAFETENSORS_FILE, directory / SAFETENSORS_INDEX_FILE
    if single.is_file():
      files, wanted = [single], None
    elif index.is_file():
      try:
        weight_map_ = json.loads(index.read_text())["weight_map"]
      except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise ValueError(f"{index}: not a safetensors index with a 'weight_map' ({e!r})") from e
      wanted = {name: directory / shard for name, shard in weight_map_.items()}
      files = sorted(set(wanted.values()))
    else:
      raise FileNotFoundError(f"{directory}: no {SAFETENSORS_FILE} or {SAFETENSORS_INDEX_FILE}")
    self._file: dict[str, pathlib.Path] = {}
    self._shape: dict[str, tuple[int, ...]] = {}
    for path in files:
      if not path.is_file():
        raise FileNotFoundError(f"{path}: shard listed in {index} is missing")
      try:
        with safe_open(path, framework="flax") as f:
          for name in f.keys():
            self._file[name] = path
            self._shape[name] = tuple(f.get_slice(name).get_shape())
      except Exception as e:  # safetensors raises its own SafetensorError for a bad header
        raise ValueError(f"{path}: not a readable safetensors file ({e})") from e
    if wanted is not None:
      for name, path in wanted.items():
        if self._file.get(name) != path:
          raise ValueError(f"{path}: tensor {name!r} listed in {index} is not in this shard")

  def __getitem__(self, name: str) -> jax.Array:
    with self._open(self._file[name], framework="flax") as f:
      return f.get_tensor(name)

  def __iter__(self) -> Iterator[str]:
    return iter(self._file)

  def __len__(self) -> int:
    return len(self._file)

  def __contains__(self, name: object) -> bool:
    return name in self._file

  def shape(self, name: str) -> tuple[int, ...]:
    """The stored shape of tensor `name` (no read)."""
    return self._shape[name]

  def origin(self, name: str) -> str:
    """The file holding tensor `name` (for a missing tensor: the checkpoint's file or index)."""
    if name in self._file:
      return str(self._file[name])
    files = sorted({str(p) for p in self._file.values()})
    return files[0] if len(files) == 1 else str(pathlib.Path(files[0]).parent /
                                                SAFETENSORS_INDEX_FILE)


def read_config(directory: str | os.PathLike) -> dict[str, Any]:
  """config.json of a checkpoint directory as a dict.

  Raises:
    FileNotFoundError: no config.json (names the path).
    ValueError: config.json is not a JSON object.
  """
  path = pathlib.Path(directory) / CONFIG_FILE
  if not path.is_file():
    raise FileNotFoundError(f"{path}: a HF checkpoint directory needs {CONFIG_FILE}")
  try:
    config = json.loads(path.read_text())
  except json.JSONDecodeError as e:
    raise ValueError(f"{path}: not valid JSON ({e})") from e
  if not isinstance(config, dict):
    raise ValueError(f"{path}: expected a JSON object; got {type(config).__name__}")
  return config


def _load_tokenizer(directory: pathlib.Path):
  path = directory / TOKENIZER_FILE
  if not path.is_file():
    return None
  from kvattn.checkpoints import tokenizer as tokenizer_lib  # pylint: disable=g-import-not-at-top
  return tokenizer_lib.Tokenizer.from_file(path)


def from_pretrained(source: str | os.PathLike, *, dtype: Any = None,
                    param_dtype: Any = None) -> tuple[transformer_lib.Transformer, Any]:
  """Loads a pretrained checkpoint as `(kvattn.Transformer, tokenizer or None)`.

  Args:
    source: a HF checkpoint directory (config.json + model.safetensors or a
      sharded safetensors index; tokenizer.json optional), a `.gguf` file,
      or a name registered in `kvattn.checkpoints.hub` (e.g. "smollm2-135m-instruct").
    dtype: compute dtype; default float32.
    param_dtype: parameter dtype the checkpoint's weights are cast to;
      default `dtype`.

  Returns:
    `(model, tokenizer)`: the model (every cache kind, `kvattn.generate` and
    the experiments run on it) and a `kvattn.checkpoints.tokenizer.Tokenizer`, or None
    when the checkpoint ships none.

  Raises:
    FileNotFoundError: a path that does not exist and is no registered name,
      a directory without config.json or safetensors files (names the path).
    NotImplementedError: an architecture or setting the model cannot
      represent (names the config key and value).
    ValueError: a missing tensor, a tensor of the wrong shape (names the file
      and the tensor); a file that is not a .gguf file; a bad GGUF file.
    TypeError: `source` is not a str or path.
  """
  if not isinstance(source, (str, os.PathLike)):
    raise TypeError(f"source must be a path or a registered name; got {type(source).__name__}")
  path = pathlib.Path(source)
  if path.is_dir():
    config = read_config(path)
    model = build_model(config, SafetensorsCheckpoint(path), dtype=dtype, param_dtype=param_dtype,
                        where=str(path / CONFIG_FILE))
    return model, _load_tokenizer(path)
  if path.suffix == ".gguf" or path.exists():
    if not path.is_file():
      raise FileNotFoundError(f"{path}: no such file")
    if path.suffix != ".gguf":
      raise ValueError(f"source {str(path)!r} is a file but not a .gguf file; pass a .gguf "
                       f"file or a HF checkpoint directory")
  else:
    from kvattn.checkpoints import hub  # pylint: disable=g-import-not-at-top
    path = hub.resolve(source)
  from kvattn.checkpoints import gguf  # pylint: disable=g-import-not-at-top
  checkpoint = gguf.load_gguf(path)  # checks the metadata and tensors in the file's own names
  model = build_model(checkpoint.config, checkpoint.tensors, dtype=dtype, param_dtype=param_dtype,
                      where=f"the config derived from {path}")
  return model, checkpoint.tokenizer
