"""The tiny model and prompts the batcher tests share: 2 layers (the second a sliding window
of 6 tokens), D 32, 4 query / 2 KV heads of 8, byte vocabulary."""

import functools

import numpy as np
from flax import nnx

from kvattn.models import transformer


@functools.lru_cache(maxsize=None)
def model():
  cfg = transformer.model_config(d_model=32, num_layers=2, mlp_dim=64, layers=({}, {"window": 6}),
                                 attention=dict(num_heads=4, num_kv_heads=2, head_dim=8))
  return transformer.Transformer.from_config(cfg, rngs=nnx.Rngs(0))


def prompt(seed, n):
  """`i32[n]` random byte ids drawn with `seed`."""
  return np.random.default_rng(seed).integers(0, 256, n).astype(np.int32)
