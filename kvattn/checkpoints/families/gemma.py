"""Gemma 2 and Gemma 3 (Gemma Team 2024, 2025): local and global layers, four norms a block.

HF `Gemma2ForCausalLM` ("gemma2") and `Gemma3ForCausalLM` ("gemma3_text"): GeGLU
(tanh GELU), embeddings times sqrt(D), four RMSNorms per block whose scales are stored
as w and applied as 1 + w, queries scaled by `query_pre_attn_scalar`^-1/2, soft caps
(Gemma 2), qk-norm (Gemma 3). Local layers attend over `sliding_window` tokens with
their own RoPE base (`rope_local_base_freq` or `rope_parameters.sliding_attention`;
Gemma 2 has one base for both); the layer pattern is `layer_types`, else one global
layer in `sliding_window_pattern` (2 for Gemma 2, 6 for Gemma 3). GGUF architecture
"gemma3", with llama.cpp's layer pattern, local RoPE base and query scale, which the
file does not state. Tokenizer: Gemma's SentencePiece vocabulary in GGUF files.
"""

from __future__ import annotations

import functools
from typing import Any, Mapping

from kvattn.models import transformer as transformer_lib

from kvattn.checkpoints.families import base, llama, readers

GEMMA_NORMS = (("attn_norm", "input_layernorm"), ("post_attn_norm", "post_attention_layernorm"),
               ("mlp_norm", "pre_feedforward_layernorm"),
               ("post_mlp_norm", "post_feedforward_layernorm"))
# Gemma 3's four norms: llama.cpp's ffn_norm is the norm before the MLP, which HF calls
# pre_feedforward_layernorm (post_attention_layernorm is the norm of the attention output).
GGUF_LAYER_NAMES = {
    **llama.GGUF_LAYER_NAMES_NO_BIAS, **llama.GGUF_QK_NORM_NAMES,
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
# llama.cpp's Gemma 3 constants the file does not state (llama-model.cpp): one global layer in
# six (layers 5, 11, ...), local RoPE base 10k unless `gemma3.rope.freq_base_swa` says.
_GGUF_PATTERN = 6
_GGUF_LOCAL_BASE = 10000.0


def _rope(config: Mapping[str, Any], full_theta: float, local_base_key: str | None
          ) -> tuple[tuple[float, dict | None], tuple[float, dict | None]]:
  """`((theta, scaling) of the global layers, (theta, scaling) of the local layers)`.

  Reads transformers 5's per-layer-type `rope_parameters` (`{"full_attention": {...},
  "sliding_attention": {...}}`) or the older `rope_theta` + `rope_scaling` (global
  layers) and `local_base_key` (local layers; None: the global layers' RoPE).
  `full_theta`: the global base when the config gives none.
  """
  params = config.get("rope_parameters")
  if isinstance(params, Mapping) and params and all(
      isinstance(v, Mapping) for v in params.values()):
    unknown = sorted(set(params) - {"full_attention", "sliding_attention"})
    if unknown:
      raise readers.unsupported(f"rope_parameters.{unknown[0]}", params[unknown[0]],
                                "only full_attention and sliding_attention layer types")
    default = {"full_attention": full_theta, "sliding_attention": 1e4}
    out = []
    for kind in ("full_attention", "sliding_attention"):
      sub = dict(params.get(kind) or {})
      sub.setdefault("rope_theta", default[kind])
      out.append(readers.rope_parameters({"rope_parameters": sub}))
    return out[0], out[1]
  theta, scaling = readers.rope_parameters(config)
  if local_base_key is None:
    return (theta, scaling), (theta, scaling)
  if config.get("rope_theta") is None and not config.get("rope_parameters"):
    theta = full_theta  # transformers' default
  local = config.get(local_base_key)
  local = 10000.0 if local is None else readers.check_number(local_base_key, local)
  return (theta, scaling), (local, None)


def _model_config(config: Mapping[str, Any], *, pattern: int, full_theta: float,
                  local_base_key: str | None, qk_norm: bool) -> base.ModelParts:
  readers.check_activation(config, readers.GEGLU)
  if config.get("use_bidirectional_attention"):
    raise readers.unsupported("use_bidirectional_attention",
                              config["use_bidirectional_attention"], "causal attention only")
  num_layers = readers.integer(config, "num_hidden_layers")
  (theta, scaling), (local_theta, local_scaling) = _rope(config, full_theta, local_base_key)
  attention = readers.gqa_attention(config, theta, scaling, qk_norm=qk_norm)
  window = readers.sliding_window(config, required=True)
  types = config.get("layer_types")
  if types is None:  # layer i is global iff (i + 1) % pattern == 0, as transformers sets it
    pattern = readers.integer(config, "sliding_window_pattern", pattern)
    types = ["sliding_attention" if (i + 1) % pattern else "full_attention"
             for i in range(num_layers)]
  windows = readers.layer_type_windows(types, window, num_layers)
  attention["sm_scale"] = readers.check_number(
      "query_pre_attn_scalar",
      readers.get(config, "query_pre_attn_scalar", attention["head_dim"])) ** -0.5
  model = {}
  if config.get("attn_logit_softcapping") is not None:
    attention["soft_cap"] = readers.check_number("attn_logit_softcapping",
                                                 config["attn_logit_softcapping"])
  if config.get("final_logit_softcapping") is not None:
    model["final_soft_cap"] = readers.check_number("final_logit_softcapping",
                                                   config["final_logit_softcapping"])
  model.update(mlp_activation="gelu_tanh", scale_embeddings=True, post_norms=True)
  # Local layers: the window and their own RoPE (every rope_* field, so none of the global
  # layers' scaling is left over); global layers: `attention` as it is.
  local = {"rope_theta": local_theta,
           **{name: None for name in transformer_lib.ROPE_SCALING_FIELDS},
           **readers.rope_scaling_fields(local_scaling, readers.GQA_ROPE_SCALINGS, config)}
  layers = tuple({"window": w, **local} if w is not None else {} for w in windows)
  return base.ModelParts(attention, model, layers)


def _gguf_config(get, metadata: Mapping[str, Any], config: Mapping[str, Any], where: str
                 ) -> dict[str, Any]:
  """Gemma 3's config.json keys a GGUF file states, or llama.cpp assumes."""
  if not metadata.get("gemma3.attention.sliding_window"):
    raise ValueError(f"{where}: metadata key gemma3.attention.sliding_window is missing")
  num_layers = config["num_hidden_layers"]
  out = {}
  pattern = metadata.get("gemma3.attention.sliding_window_pattern", _GGUF_PATTERN)
  if isinstance(pattern, list):  # one flag per layer: true = local (sliding) layer
    if len(pattern) != num_layers:
      raise ValueError(f"{where}: gemma3.attention.sliding_window_pattern has {len(pattern)} "
                       f"entries; expected gemma3.block_count = {num_layers}")
    out["layer_types"] = ["sliding_attention" if f else "full_attention" for f in pattern]
  else:
    out["sliding_window_pattern"] = get("attention.sliding_window_pattern", _GGUF_PATTERN)
  out["rope_local_base_freq"] = float(get("rope.freq_base_swa", _GGUF_LOCAL_BASE, kind=float))
  # llama.cpp's query scale: 1 / sqrt(head dim), but 1 / sqrt(D / N) for the 27B (62 layers).
  out["query_pre_attn_scalar"] = (config["hidden_size"] // config["num_attention_heads"]
                                  if num_layers == 62 else config["head_dim"])
  out["hidden_activation"] = "gelu_pytorch_tanh"
  return out


GEMMA2 = base.register(base.Family(
    model_type="gemma2",
    model_config=functools.partial(_model_config, pattern=2, full_theta=1e4,
                                   local_base_key=None, qk_norm=False),
    hf_layer_norms=GEMMA_NORMS, norm_plus_one=True,
    sentencepiece_architectures=("gemma", "gemma2"),  # Gemma 1's vocabulary is Gemma 2's
))
GEMMA3 = base.register(base.Family(
    model_type="gemma3_text",
    model_config=functools.partial(_model_config, pattern=6, full_theta=1e6,
                                   local_base_key="rope_local_base_freq", qk_norm=True),
    hf_layer_norms=GEMMA_NORMS, norm_plus_one=True,
    gguf_architecture="gemma3", gguf_layer_names=GGUF_LAYER_NAMES, gguf_config=_gguf_config,
    sentencepiece_architectures=("gemma3",),
))
