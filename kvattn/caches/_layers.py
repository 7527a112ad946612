"""Which layers of a model own a cache, and their attention modules (a leaf: no kind imports)."""

from __future__ import annotations

import types
from typing import Any


def cache_owners(model) -> Any:
  """`model`, or under cross-layer KV sharing (`model.cache_layers` shorter than its layers) a
  stand-in whose `.layers` are the layers that own a cache, in order."""
  owners = getattr(model, "cache_layers", None)
  if owners is None or len(owners) == len(model.layers):
    return model
  return types.SimpleNamespace(layers=[model.layers[i] for i in owners],
                               dtype=getattr(model, "dtype", None))


def gqa_layers(model) -> list[Any]:
  """The attention modules of the layers owning a cache (`cache_owners`).

  Raises:
    TypeError: `model` has no `.layers`.
    ValueError: a layer that is not MHA/GQA/MQA (MLA).
  """
  if getattr(model, "layers", None) is None:
    raise TypeError(f"model must have .layers with an .attn each (a kvattn.Transformer); got "
                    f"{type(model).__name__}")
  attns = []
  for i, layer in enumerate(cache_owners(model).layers):
    attn = layer.attn
    if not (hasattr(attn, "num_kv_heads") and hasattr(attn, "head_dim")):
      raise ValueError(
          f"this cache kind holds K-head keys and values (MHA/GQA/MQA); layer {i} is "
          f"{type(attn).__name__}: use cache kind 'dense' for it")
    attns.append(attn)
  return attns


def ring_layers(model, max_len: int) -> list[int]:
  """Indices of the GQA-family layers whose sliding `window` is shorter than `max_len` (the
  per-layer layout gives them a ring)."""
  out = []
  for i, layer in enumerate(getattr(model, "layers", ())):
    window = getattr(layer.attn, "window", None)
    if window is not None and window < max_len and hasattr(layer.attn, "num_kv_heads"):
      out.append(i)
  return out
