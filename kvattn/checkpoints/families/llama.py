"""Llama (Llama 2 / 3, SmolLM2, TinyLlama): the block layout the other families vary.

HF `LlamaForCausalLM` (`model_type` "llama"): SwiGLU, GQA, RoPE with "linear" or
"llama3" scaling (Dubey et al. 2024, sec. 3.3), no biases, full attention. GGUF
architecture "llama": llama.cpp stores the Q/K rows in interleaved-RoPE order
(`convert_hf_to_gguf.permute`), undone at load. Tokenizer: Llama 3's pre-tokenizer split.
"""

from __future__ import annotations

from kvattn.checkpoints.families import base, readers

# GGUF layer tensor -> HF name after "model.layers.{i}.", for the families laid out as Llama
# (the biases are Qwen2's; a llama file holding them is refused).
GGUF_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
GGUF_LAYER_NAMES_NO_BIAS = {k: v for k, v in GGUF_LAYER_NAMES.items() if ".bias" not in k}
GGUF_QK_NORM_NAMES = {
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
}

# Llama 3's split regex (llama.cpp's `tokenizer.ggml.pre` names of the BPE vocabularies whose
# merges were learned on it).
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_LLAMA3_PRE_TOKENIZERS = ("llama3", "llama-v3", "llama-bpe", "smaug-bpe", "dbrx", "falcon3")

FAMILY = base.register(base.Family(
    model_type="llama",
    model_config=readers.gqa_model,
    gguf_architecture="llama",
    gguf_layer_names=GGUF_LAYER_NAMES,
    gguf_rope_rows_permuted=True,
    pre_tokenizer_splits=dict.fromkeys(_LLAMA3_PRE_TOKENIZERS, LLAMA3_SPLIT),
))
