"""`Transformer.hidden` with the layers in one `lax.scan`: layers alike with period p
(`layer_period`; Gemma 3: 6) scan in groups of p, unrolled in the body (p = L: one step);
under cross-layer KV sharing a source lies in its reader's group. Tested equal to the model."""

from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from kvattn.models import gqa as gqa_lib
from kvattn.models import transformer as transformer_lib


def layer_period(layer_defs: Sequence[Any]) -> int:
  """The smallest p dividing L with `layer_defs[i] == layer_defs[i % p]` (nnx graph
  definitions, which hold the window): 1 for alike layers, 6 for Gemma 3, else L."""
  n = len(layer_defs)
  for p in range(1, n + 1):
    if n % p == 0 and all(layer_defs[i] == layer_defs[i % p] for i in range(n)):
      return p
  return n


def scan_parts(model) -> tuple[Any, Any]:
  """`(defs, params)` of `scan_forward` for a `kvattn.Transformer`.

  `defs = (p layer graphdefs, final-norm graphdef, spec, ...)`; `params = (p stacked layer
  states [L / p, ...], final-norm state, (embedding [V, D], scales | None), (lm_head [D, V]
  | None, scales | None))`, a copy of the weights.

  Raises:
    ValueError: a final logit soft cap (Gemma 2).
  """
  parts = [nnx.split(layer) for layer in model.layers]
  sources = tuple(getattr(model, "kv_sources", None) or (None,) * len(parts))
  period = layer_period([g for g, _ in parts])
  while not _sources_periodic(sources, period):  # a period that divides L, up to L itself
    period = next(p for p in range(period + 1, len(parts) + 1) if len(parts) % p == 0)
  group_sources = tuple(sources[:period])
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
  return (layer_defs, norm_def, model.spec, group_sources), (layers, norm, embedding, head)


def _sources_periodic(sources: Sequence[Any], period: int) -> bool:
  """Whether layer i's KV source is `sources[i % period]` shifted to i's group, in it."""
  for i, s in enumerate(sources):
    base, first = i // period * period, sources[i % period]
    if (s is None) != (first is None):
      return False
    if s is not None and (s - base != first or s < base):
      return False
  return True


def cache_period(defs) -> int:
  """Caches per scanned group (`stack_caches`' `period`): the group's layers that own one
  (all `len(defs[0])` of them without cross-layer KV sharing)."""
  return sum(s is None for s in defs[3])


def stack_caches(caches: Sequence[Any], period: int = 1) -> tuple[Any, ...]:
  """Per-layer caches (a tuple of L, or of the owners under sharing) -> a tuple of `period`
  pytrees, entry j stacking the caches of layers j, j + period, ... on a new leading axis.

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
  """`(h [B, T, D], caches)`: `model.hidden(tokens, caches, new_lengths=...)` with the layers
  in one `lax.scan`; `caches` are `stack_caches(caches, cache_period(defs))`."""
  layer_defs, norm_def, spec, group_sources = defs
  read = {s for s in group_sources if s is not None}
  layers, norm, embedding, _ = params
  first = jax.tree.map(lambda a: a[0], caches[0])
  positions = gqa_lib.resolve_positions(None, first, *tokens.shape)
  x = transformer_lib.embed(*embedding, tokens, spec)

  def body(x, group):
    states, group_caches = group
    out, shared = [], {}
    owned = iter(group_caches)
    for j, (layer_def, state) in enumerate(zip(layer_defs, states)):
      layer, source = nnx.merge(layer_def, state), group_sources[j]
      if source is not None:  # reads the K/V its group's owner computed this pass
        x, _, _ = layer.step(x, None, positions, new_lengths, shared_kv=shared[source])
        continue
      x, cache, shared[j] = layer.step(x, next(owned), positions, new_lengths,
                                       share=j in read)
      out.append(cache)
    return x, tuple(out)

  x, caches = jax.lax.scan(body, x, (layers, tuple(caches)))
  return nnx.merge(norm_def, norm)(x), caches


def logits_from_hidden(params, h):
  """`Transformer.logits_from_hidden`: f32 logits of hidden states `[..., D]`."""
  _, _, embedding, head = params
  return transformer_lib.head_logits(h, *embedding, *head)
