"""`Transformer.hidden` with the layers in one `lax.scan`, over groups of identical layers.

A forward pass over L unrolled layers compiles L layer bodies; scanning over the stacked
layer states compiles one, which is what long streaming evaluations of a 30-layer model
need (seconds instead of tens of seconds per compile). Models whose layers differ in a
repeating pattern (Gemma 2/3: local sliding-window layers and global ones, five local per
global in Gemma 3) scan over groups: the smallest period p with layer i alike layer i % p
(`layer_period`); the scanned body runs the p layers of one group unrolled, so it compiles
p layer bodies and scans L / p times. A model without such a period (p = L) runs its layers
unrolled in one scan step: the plain forward pass. `scan_forward` computes what
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


def layer_period(layer_defs: Sequence[Any]) -> int:
  """The smallest p dividing L with `layer_defs[i] == layer_defs[i % p]` for every i (the
  layers' `nnx` graph definitions: structure and static attributes such as the window):
  1 for alike layers, 6 for Gemma 3's five local and one global layers, L without a
  repeating pattern."""
  n = len(layer_defs)
  for p in range(1, n + 1):
    if n % p == 0 and all(layer_defs[i] == layer_defs[i % p] for i in range(n)):
      return p
  return n


def scan_parts(model) -> tuple[Any, Any]:
  """`(defs, params)` of `scan_forward` for a `kvattn.Transformer`.

  `defs = (layer graph definitions of one group (p of them, `layer_period`), final-norm
  graphdef, model spec)`; `params = (stacked layer states: a tuple of p pytrees, entry j
  stacking layers j, j + p, ... along a new leading axis of L / p, final-norm state,
  (embedding [V, D], its int8 row scales or None), (lm_head [D, V] or None when tied, its
  int8 scales or None))` -- the layer states are a copy of the layer weights.

  Raises:
    ValueError: a final logit soft cap (Gemma 2), which `logits_from_hidden` does not apply.
  """
  parts = [nnx.split(layer) for layer in model.layers]
  period = layer_period([g for g, _ in parts])
  layers = tuple(jax.tree.map(lambda *xs: jnp.stack(xs), *[st for _, st in parts[j::period]])
                 for j in range(period))
  if model.spec.final_soft_cap is not None:
    raise ValueError("scan_forward's logits_from_hidden has no final logit soft cap; "
                     f"model.final_soft_cap = {model.spec.final_soft_cap}")
  norm_def, norm = nnx.split(model.final_norm)
  value = transformer_lib._value  # pylint: disable=protected-access
  embedding = (model.embedding[...], value(getattr(model, "embedding_scale", None)))
  head = (value(model.lm_head), value(getattr(model, "lm_head_scale", None)))
  layer_defs = tuple(g for g, _ in parts[:period])
  return (layer_defs, norm_def, model.spec), (layers, norm, embedding, head)


def stack_caches(caches: Sequence[Any], period: int = 1) -> tuple[Any, ...]:
  """Per-layer caches (a tuple of L pytrees) -> `scan_forward`'s caches: a tuple of
  `period` pytrees, entry j stacking the caches of layers j, j + period, ... along a new
  leading axis (they must be alike: the per-layer layout gives a pattern's local layers
  rings and its global ones the chosen kind, both periodic). `period`: `len(defs[0])` of
  `scan_parts`.

  Raises:
    ValueError: `period` does not divide the number of caches.
  """
  caches = tuple(caches)
  if period < 1 or len(caches) % period:
    raise ValueError(f"period must divide the {len(caches)} caches; got {period}")
  return tuple(jax.tree.map(lambda *xs: jnp.stack(xs), *caches[j::period])
               for j in range(period))


def unstack_caches(stacked: Sequence[Any]) -> tuple[Any, ...]:
  """`stack_caches`' inverse: the per-layer caches, in layer order."""
  stacked = tuple(stacked)
  groups = jax.tree_util.tree_leaves(stacked[0])[0].shape[0]
  return tuple(jax.tree.map(lambda x, g=g: x[g], stacked[j])
               for g in range(groups) for j in range(len(stacked)))


def scan_forward(defs, params, caches, tokens, new_lengths):
  """`Transformer.hidden` with the layers in one `lax.scan`: `(h [B, T, D], caches)`.

  The same computation as `model.hidden(tokens, caches, new_lengths=...)`
  (default positions from the first layer's cache, embedding lookup, the
  Block modules in order, the final norm); `caches` are `stack_caches(caches,
  len(defs[0]))` of the model's per-layer caches. Tested equal to the model's own call.
  """
  layer_defs, norm_def, spec = defs
  layers, norm, embedding, _ = params
  first = jax.tree.map(lambda a: a[0], caches[0])
  positions = gqa_lib.resolve_positions(None, first, *tokens.shape)
  x = transformer_lib.embed(*embedding, tokens, spec)

  def body(x, group):
    states, group_caches = group
    out = []
    for layer_def, state, cache in zip(layer_defs, states, group_caches):
      x, cache = nnx.merge(layer_def, state)(x, cache, positions, new_lengths)
      out.append(cache)
    return x, tuple(out)

  x, caches = jax.lax.scan(body, x, (layers, tuple(caches)))
  return nnx.merge(norm_def, norm)(x), caches


def logits_from_hidden(params, h):
  """`Transformer.logits_from_hidden`: f32 logits of hidden states `[..., D]`."""
  _, _, embedding, head = params
  return transformer_lib.head_logits(h, *embedding, *head)
