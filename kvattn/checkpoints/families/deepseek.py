"""DeepSeek-V2 (DeepSeek-AI 2024) with dense MLP layers: multi-head latent attention.

HF `DeepseekV2ForCausalLM` ("deepseek_v2"): MLA with or without a query low-rank
projection (`q_lora_rank`), RoPE over `qk_rope_head_dim` dims with "linear" or "yarn"
scaling (Peng et al. 2023; transformers' `yarn_apply_mscale` multiplies the softmax
scale by mscale^2). Mixture-of-experts layers are refused (`first_k_dense_replace` must
cover every layer). The tensor names are MLA's (`kvattn.checkpoints.weights`). No GGUF.
"""

from __future__ import annotations

from typing import Any, Mapping

from kvattn.ops import rope as rope_lib

from kvattn.checkpoints.families import base, readers


def _check_dense_mlp(config: Mapping[str, Any], num_layers: int) -> None:
  """Every layer must be a dense MLP (mixture-of-experts layers raise)."""
  experts = config.get("n_routed_experts", 64)
  if not experts:
    return
  readers.check_int("n_routed_experts", experts, 0)
  first_dense = readers.integer(config, "first_k_dense_replace", 0, minimum=0)
  freq = readers.integer(config, "moe_layer_freq", 1)
  moe = [i for i in range(num_layers) if i >= first_dense and i % freq == 0]
  if moe:
    raise readers.unsupported(
        "first_k_dense_replace", first_dense,
        f"layers {moe} would be mixture-of-experts layers (n_routed_experts = "
        f"{config.get('n_routed_experts', 64)}); only dense MLP layers are supported "
        f"(first_k_dense_replace >= num_hidden_layers = {num_layers})")


def _model_config(config: Mapping[str, Any]) -> base.ModelParts:
  readers.check_activation(config, readers.SWIGLU)
  num_heads = readers.integer(config, "num_attention_heads")
  num_layers = readers.integer(config, "num_hidden_layers")
  theta, scaling = readers.rope_parameters(config)
  _check_dense_mlp(config, num_layers)
  if config.get("attention_bias"):
    raise readers.unsupported("attention_bias", config["attention_bias"],
                              "MLA projections without biases only")
  num_kv = readers.integer(config, "num_key_value_heads", num_heads)
  if num_kv != num_heads:
    raise readers.unsupported("num_key_value_heads", num_kv,
                              f"MLA expands keys and values per query head ({num_heads})")
  rope_dim = readers.integer(config, "qk_rope_head_dim")
  if rope_dim % 2:
    raise ValueError(f"config key 'qk_rope_head_dim' must be even (RoPE rotates pairs); got "
                     f"{rope_dim}")
  q_lora_rank = config.get("q_lora_rank")
  attention = dict(
      num_heads=num_heads, rope_theta=theta, kind="mla",
      kv_lora_rank=readers.integer(config, "kv_lora_rank"),
      qk_nope_head_dim=readers.integer(config, "qk_nope_head_dim"), qk_rope_head_dim=rope_dim,
      v_head_dim=readers.integer(config, "v_head_dim"),
      q_lora_rank=None if q_lora_rank is None else readers.integer(config, "q_lora_rank"))
  attention.update(readers.rope_scaling_fields(scaling, ("linear", "yarn"), config))
  mscale_all_dim = (scaling or {}).get("mscale_all_dim")
  if mscale_all_dim:  # transformers' yarn_apply_mscale: the softmax scale times mscale^2
    attention["softmax_scale_factor"] = rope_lib.yarn_mscale(attention["rope_factor"],
                                                             mscale_all_dim) ** 2
  return base.ModelParts(attention, {}, ())


FAMILY = base.register(base.Family(model_type="deepseek_v2", model_config=_model_config))
