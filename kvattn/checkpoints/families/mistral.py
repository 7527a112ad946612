"""Mistral (Jiang et al. 2023): Llama's block with one sliding window on every layer.

HF `MistralForCausalLM` (`model_type` "mistral"): `sliding_window` (tokens, or null for
full attention) applies to every layer. No GGUF architecture of its own (llama.cpp writes
Mistral files as "llama").
"""

from __future__ import annotations

import functools

from kvattn.checkpoints.families import base, readers


def _windows(config, num_layers):
  return [readers.sliding_window(config)] * num_layers


FAMILY = base.register(base.Family(
    model_type="mistral",
    model_config=functools.partial(readers.gqa_model, windows=_windows),
))
