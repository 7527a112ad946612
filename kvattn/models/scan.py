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

Cross-layer KV sharing (CLA, `model.kv_sources`): the scanned body wires each group's
layers as `Transformer.hidden` does (an owner hands its `SharedKV` to the layers reading it),
so a source must lie in its reader's group at the same place in every group (else the
period grows until it does: at worst L, one unrolled step); the caches are those of the
owning layers only, `cache_period(defs)` of them per group.
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
  """Per-layer caches (a tuple of L pytrees) -> `scan_forward`'s caches: a tuple of
  `period` pytrees, entry j stacking the caches of layers j, j + period, ... along a new
  leading axis (they must be alike: the per-layer layout gives a pattern's local layers
  rings and its global ones the chosen kind, both periodic). `period`: `cache_period(defs)`
  of `scan_parts` (`len(defs[0])` without cross-layer KV sharing); `caches` are the owning
  layers' under sharing.

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
  cache_period(defs))` of the model's per-layer caches (one per owning layer under
  cross-layer KV sharing). Tested equal to the model's own call.
  """
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
