"""Pretrained checkpoints: `from_pretrained` (pretrained.py, hf_config.py, weights.py),
`families` (one module per model family), `gguf`, `tokenizer`, `chat_template`, `hub`."""

from kvattn.checkpoints import chat_template, families, gguf, hub, tokenizer
from kvattn.checkpoints.pretrained import build_model, from_pretrained
from kvattn.checkpoints.tokenizer import Tokenizer

__all__ = ["Tokenizer", "build_model", "chat_template", "families", "from_pretrained", "gguf",
           "hub", "tokenizer"]
