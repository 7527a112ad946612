"""Model families: one module per family, each registering what kvattn reads of it.

A `Family` (`base.py`) holds a config.json `model_type`'s config mapping, its
per-layer norm names, its GGUF architecture and tensor names, and its tokenizer
quirks; `kvattn.checkpoints` (hf_config, weights, gguf, tokenizer) only looks
families up here. A new family is one module calling `register` plus its import
line below (the order below is the order errors list them in).
"""

from kvattn.checkpoints.families.base import (  # noqa: F401  (the registry's face)
    Family, ModelParts, UnsupportedError, by_gguf_architecture, gguf_architectures, lookup,
    model_types, pre_tokenizer_split, register, sentencepiece_architectures)

# Each import registers its families.
from kvattn.checkpoints.families import llama  # noqa: F401,E402  isort: skip
from kvattn.checkpoints.families import mistral  # noqa: F401,E402  isort: skip
from kvattn.checkpoints.families import qwen  # noqa: F401,E402  isort: skip
from kvattn.checkpoints.families import gemma  # noqa: F401,E402  isort: skip
from kvattn.checkpoints.families import deepseek  # noqa: F401,E402  isort: skip
