"""Qwen2 and Qwen3 (Yang et al. 2024, 2025): Llama's block with per-layer windows.

HF `Qwen2ForCausalLM` ("qwen2": q/k/v biases) and `Qwen3ForCausalLM` ("qwen3": qk-norm,
no biases). With `use_sliding_window`, the layers `layer_types` marks
"sliding_attention" -- else those from `max_window_layers` on -- attend over
`sliding_window` tokens. GGUF architectures "qwen2" and "qwen3" (rows in HF order).
Tokenizer: Qwen2's pre-tokenizer split (single digits).
"""

from __future__ import annotations

import functools

from kvattn.checkpoints.families import base, llama, readers

QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def _windows(config, num_layers):
  """Per-layer windows as transformers' Qwen2Config / Qwen3Config set them."""
  window = readers.sliding_window(config)
  if not readers.flag(config, "use_sliding_window", False):
    return [None] * num_layers
  types = config.get("layer_types")
  if types is None:
    first = readers.integer(config, "max_window_layers", 28, minimum=0)
    types = ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]
  return readers.layer_type_windows(types, window, num_layers)


QWEN2 = base.register(base.Family(
    model_type="qwen2",
    model_config=functools.partial(readers.gqa_model, bias=True, windows=_windows),
    gguf_architecture="qwen2",
    gguf_layer_names=llama.GGUF_LAYER_NAMES,
    gguf_attention_bias=True,
    pre_tokenizer_splits=dict.fromkeys(("qwen2", "deepseek-r1-qwen"), QWEN2_SPLIT),
))
QWEN3 = base.register(base.Family(
    model_type="qwen3",
    model_config=functools.partial(readers.gqa_model, qk_norm=True, windows=_windows),
    gguf_architecture="qwen3",
    gguf_layer_names={**llama.GGUF_LAYER_NAMES_NO_BIAS, **llama.GGUF_QK_NORM_NAMES},
))
