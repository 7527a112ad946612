"""Pretrained checkpoints from strangers: HF safetensors, GGUF, tokenizers, the model hub.

  `from_pretrained`   pretrained.py: a checkpoint as `(Transformer, Tokenizer | None)`;
                      hf_config.py maps config.json onto the model config, weights.py
                      fills a model with HF-named tensors (`build_model`).
  `families`          one module per model family (llama, mistral, qwen, gemma, deepseek):
                      config mapping, tensor names, GGUF and tokenizer quirks (`register`).
  `gguf`              llama.cpp GGUF files in HF's vocabulary (`load_gguf`).
  `tokenizer`         `Tokenizer` (HF `tokenizers`), ids as transformers gives them.
  `chat_template`     checkpoints' chat templates in jinja2's sandbox, under a budget per render.
  `hub`               registered names fetched once, verified (`resolve`, `register`).
"""

from kvattn.checkpoints import chat_template, families, gguf, hub, tokenizer
from kvattn.checkpoints.pretrained import build_model, from_pretrained
from kvattn.checkpoints.tokenizer import Tokenizer

__all__ = ["Tokenizer", "build_model", "chat_template", "families", "from_pretrained", "gguf",
           "hub", "tokenizer"]
