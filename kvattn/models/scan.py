"""`Transformer.hidden` with the layers in one `lax.scan`, for models whose layers are alike.

A forward pass over L unrolled layers compiles L layer bodies; scanning over the stacked
layer states compiles one, which is what long streaming evaluations of a 30-layer model
need (seconds instead of tens of seconds per compile). `scan_forward` computes what
`Transformer.hidden` computes (tested equal); `logits_from_hidden` what
`Transformer.logits_from_hidden` computes.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from kvattn.models import gqa as gqa_lib
from kvattn.models import transformer as transformer_lib


def scan_parts(model) -> tuple[Any, Any]:
  """`(graphdefs, params)` of `scan_forward` for a `kvattn.Transformer` whose layers are alike.

  `params = (stacked layer states [L, ...], final-norm state, (embedding
  [V, D], its int8 row scales or None), (lm_head [D, V] or None when tied,
  its int8 scales or None))`; the layer states are stacked
  along a new leading axis L (a copy of the layer weights).

  Raises:
    ValueError: layers of different structure (e.g. mixed attention kinds, or
      Gemma's local and global layers), which one scanned body cannot run; a
      final logit soft cap (Gemma 2), which `logits_from_hidden` does not apply.
  """
  parts = [nnx.split(layer) for layer in model.layers]
  layer_def = parts[0][0]
  for i, (g, _) in enumerate(parts):
    if g != layer_def:
      raise ValueError(f"scan_forward runs identical layers; layer {i} differs from layer 0")
  layers = jax.tree.map(lambda *xs: jnp.stack(xs), *[st for _, st in parts])
  if model.spec.final_soft_cap is not None:
    raise ValueError("scan_forward's logits_from_hidden has no final logit soft cap; "
                     f"model.final_soft_cap = {model.spec.final_soft_cap}")
  norm_def, norm = nnx.split(model.final_norm)
  value = transformer_lib._value  # pylint: disable=protected-access
  embedding = (model.embedding[...], value(getattr(model, "embedding_scale", None)))
  head = (value(model.lm_head), value(getattr(model, "lm_head_scale", None)))
  return (layer_def, norm_def, model.spec), (layers, norm, embedding, head)


def stack_caches(caches: Sequence[Any]) -> Any:
  """Per-layer caches (a tuple of L alike pytrees) -> one pytree with leading axis L."""
  return jax.tree.map(lambda *xs: jnp.stack(xs), *caches)


def scan_forward(defs, params, caches, tokens, new_lengths):
  """`Transformer.hidden` with the layers in one `lax.scan`: `(h [B, T, D], caches)`.

  The same computation as `model.hidden(tokens, caches, new_lengths=...)`
  (default positions from the first layer's cache, embedding lookup, the
  Block modules in order, the final norm); `caches` are `stack_caches` of the
  model's per-layer caches. Tested equal to the model's own call.
  """
  layer_def, norm_def, spec = defs
  layers, norm, embedding, _ = params
  first = jax.tree.map(lambda a: a[0], caches)
  positions = gqa_lib.resolve_positions(None, first, *tokens.shape)
  x = transformer_lib.embed(*embedding, tokens, spec)

  def body(x, layer_and_cache):
    state, cache = layer_and_cache
    x, cache = nnx.merge(layer_def, state)(x, cache, positions, new_lengths)
    return x, cache

  x, caches = jax.lax.scan(body, x, (layers, caches))
  return nnx.merge(norm_def, norm)(x), caches


def logits_from_hidden(params, h):
  """`Transformer.logits_from_hidden`: f32 logits of hidden states `[..., D]`."""
  _, _, embedding, head = params
  return transformer_lib.head_logits(h, *embedding, *head)
