"""The one model loader of the experiments: a registered or local checkpoint, its architecture
with random weights, or a tiny random model for tests.

  `load_model("smollm2-135m-instruct")`        `kvattn.from_pretrained` (fetched once).
  `load_model(name, random_weights=True)`      the architecture of `RANDOM_CONFIGS[name]`,
                                               random weights, no tokenizer (a machine that
                                               cannot fetch the checkpoint, e.g. the GPU one).
  `load_model("random-tiny")`                  2 layers, byte vocabulary, `ByteTokenizer`.
  `load_model("random-tiny-local")`            the same with 4 layers alternating a sliding
                                               window of 8 (local) and none (global), as
                                               Gemma's pattern, for tests.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
from flax import nnx

from kvattn.checkpoints import pretrained
from kvattn.models import transformer as transformer_lib
from kvattn.training import data as data_lib

TINY = "random-tiny"
TINY_LOCAL = "random-tiny-local"

RANDOM_CONFIGS = {
    "smollm2-135m-instruct": {
        "model_type": "llama", "vocab_size": 49152, "hidden_size": 576,
        "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
        "num_key_value_heads": 3, "rms_norm_eps": 1e-5, "rope_theta": 100000.0,
        "tie_word_embeddings": True, "hidden_act": "silu", "max_position_embeddings": 8192,
    },
    # google/gemma-3-270m's config.json: five local layers (window 512, RoPE base 10k) per
    # global one (base 1M), MQA with head dim 256.
    "gemma3-270m": {
        "model_type": "gemma3_text", "vocab_size": 262144, "hidden_size": 640,
        "intermediate_size": 2048, "num_hidden_layers": 18, "num_attention_heads": 4,
        "num_key_value_heads": 1, "head_dim": 256, "query_pre_attn_scalar": 256,
        "sliding_window": 512, "sliding_window_pattern": 6, "rope_theta": 1000000.0,
        "rope_local_base_freq": 10000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
        "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 32768,
    },
}
"""HF `config.json` keys of registered checkpoints, for `random_weights=True`."""


def tiny_model(seed: int = 0, *, local_window: int | None = None) -> transformer_lib.Transformer:
  """A 2-layer random GQA model (byte vocabulary, D 32, 4 query / 2 KV heads of 8); with
  `local_window`, 4 layers whose even ones attend a sliding window of that many tokens."""
  layers = () if local_window is None else ({"window": local_window}, {}) * 2
  cfg = transformer_lib.model_config(d_model=32, num_layers=2 if not layers else 4, mlp_dim=64,
                                     attention=dict(num_heads=4, num_kv_heads=2, head_dim=8),
                                     layers=layers)
  return transformer_lib.Transformer.from_config(cfg, rngs=nnx.Rngs(seed))


CALIBRATION_TOKENS = 512
CALIBRATION_SKIP = 100_000
"""SmoothQuant calibration text of `quantize`: this many tokens of the default corpus from
token CALIBRATION_SKIP on (apart from the evaluation texts, which start at its beginning or in
its validation documents)."""


def quantize(model: transformer_lib.Transformer, tok: Any, alpha: float | None = None
             ) -> transformer_lib.Transformer:
  """The W8A8 form of a float `model`, in place (`transformer.quantize_model`); with `alpha`,
  SmoothQuant scale migration first (`transformer.smooth_model`) calibrated on
  `CALIBRATION_TOKENS` tokens of the default corpus (byte ids for the tiny model). Off by
  default: on SmolLM2 it did not lower the perplexity cost reliably (docs/benchmarks.md)."""
  if alpha is None:
    return transformer_lib.quantize_model(model)
  from experiments.evals import text as text_lib  # pylint: disable=g-import-not-at-top
  calibration = text_lib.document_tokens(tok, CALIBRATION_TOKENS, skip_tokens=CALIBRATION_SKIP)
  calibration = calibration % model.vocab_size  # byte ids of the tiny model fit its vocabulary
  transformer_lib.smooth_model(model, calibration[None], alpha=alpha)
  return transformer_lib.quantize_model(model)


def load_model(name: str, dtype: Any = "float32", *, random_weights: bool = False,
               seed: int = 0, param_dtype: Any = None) -> tuple[transformer_lib.Transformer, Any]:
  """`(model, tokenizer or None)` of `name` (module doc), compute dtype `dtype`, weights
  stored in `param_dtype` (default `dtype`; "int8": W8A8, `kvattn.models.int8`).

  Raises:
    ValueError: `random_weights` for a name without a `RANDOM_CONFIGS` entry.
  """
  if param_dtype is not None and jnp.dtype(param_dtype) == jnp.int8:
    model, tok = load_model(name, dtype, random_weights=random_weights, seed=seed)
    return quantize(model, tok), tok
  if name == TINY:
    return tiny_model(seed), data_lib.ByteTokenizer()
  if name == TINY_LOCAL:
    return tiny_model(seed, local_window=8), data_lib.ByteTokenizer()
  if not random_weights:
    return pretrained.from_pretrained(name, dtype=jnp.dtype(dtype), param_dtype=param_dtype)
  if name not in RANDOM_CONFIGS:
    raise ValueError(f"random weights need a RANDOM_CONFIGS entry ({sorted(RANDOM_CONFIGS)}); "
                     f"got {name!r}")
  cfg = pretrained.model_config_from_hf(RANDOM_CONFIGS[name])
  cfg.dtype = str(jnp.dtype(dtype))
  return transformer_lib.Transformer.from_config(cfg, rngs=nnx.Rngs(seed)), None
