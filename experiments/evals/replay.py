"""One context forward pass, compressed many ways: the compression sweep's engine.

Under kvpress's protocol (`compress="context"`, `kvattn.caches._context`) the context's own
forward pass does not depend on the cache: its queries attend every context token, and the
cache only chooses what to keep after. So a sweep over policies and ratios need not run the
model over the context once per point. `record` runs it once per batch without caches and
keeps each layer's queries, keys and values before RoPE (`q [B, Tc, N, H]`, `k, v [B, Tc, K,
H]`, the layer's `qkv`); `generate_after` then, per point, writes each layer's cache from them
(`GroupedQueryAttention.cache_step`: the same RoPE, scoring queries and selection as in the
model; its attention output is not used, so XLA drops it), turns the caches dense where that
is exact (`compacted`), prefills the rest of the prompts (the question) on top and decodes:
`kvattn.generate(..., context_lengths=)`'s result, at a fraction of its cost (the context's
projections and MLP run once per batch, not once per point).

Only caches whose context write returns full attention over the chunk qualify
(`replayable`: each declares `capabilities.context_replayable`): dense `KVCache`, the evicting
kinds in context mode (`EvictingKVCache(compress="context")`, PyramidKV's per-layer ones,
Q-Filter) and the sliding-window rings (windowed attention, as the layer's `window` gives
without a cache). The others (ThinK, the decoding kinds, fixed budgets, which evict inside
the context's write) run through `kvattn.generate`. Models with cross-layer KV sharing are not
replayed.

The outputs equal `generate`'s up to float rounding: the recorded pass attends without a
cache, `generate`'s through it (a different reduction length), so a later layer's input may
differ in the last bits (tested: the same tokens on the tiny model and on SmolLM2's RULER
examples, docs/benchmarks.md).
"""

from __future__ import annotations

import functools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kvattn.caches import capabilities
from kvattn.inference import generation
from kvattn.models import gqa as gqa_lib
from kvattn.models import transformer as transformer_lib


def replayable(model: Any, caches: Sequence[Any]) -> bool:
  """Whether `generate_after` runs `model` with `caches` (module doc): a model without
  cross-layer KV sharing, one cache per layer, each `capabilities.context_replayable`."""
  if any(s is not None for s in getattr(model, "kv_sources", ()) or ()):
    return False
  if not hasattr(model, "layers") or len(caches) != len(model.layers):
    return False
  return all(capabilities.context_replayable(c) for c in caches)


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _record(graphdef, state, tokens, new_lengths):
  model = nnx.merge(graphdef, state)
  positions = gqa_lib.resolve_positions(None, None, *tokens.shape)
  x = transformer_lib.embed(model.embedding[...],
                            transformer_lib._value(getattr(model, "embedding_scale", None)),  # pylint: disable=protected-access
                            tokens, model.spec)
  inputs = []
  for layer in model.layers:
    inputs.append(layer.attn.qkv(layer.attn_norm(x)))  # the step's own projections (CSE)
    x, _, _ = layer.step(x, None, positions, new_lengths)
  return tuple(inputs)


@functools.partial(jax.jit, static_argnames=("attn_def",), donate_argnames=("cache",))
def _write(attn_def, attn_state, cache, qkv, new_lengths):
  attn = nnx.merge(attn_def, attn_state)
  positions = gqa_lib.resolve_positions(None, cache, *qkv[1].shape[:2])
  _, cache = attn.cache_step(cache, *qkv, positions, new_lengths)
  return cache


def record(model: Any, context: np.ndarray, context_lengths: np.ndarray
           ) -> tuple[jax.Array, ...]:
  """Each layer's `(q [B, Tc, N, H], k [B, Tc, K, H], v [B, Tc, K, H])` over the contexts,
  before RoPE (compute dtype): a tuple of L.

  Args:
    model: a `kvattn.Transformer` without cross-layer KV sharing.
    context: `int[B, Tc]` right-padded context tokens.
    context_lengths: `int[B]` in `[1, Tc]`.

  Raises:
    ValueError: shapes that do not match, lengths outside `[1, Tc]`, or a model with
      cross-layer KV sharing.
  """
  context, context_lengths = np.asarray(context), np.asarray(context_lengths)
  if context.ndim != 2 or context_lengths.shape != context.shape[:1]:
    raise ValueError(f"context must be [B, Tc] and context_lengths [B]; got shapes "
                     f"{context.shape} and {context_lengths.shape}")
  if context_lengths.min() < 1 or context_lengths.max() > context.shape[1]:
    raise ValueError(f"context_lengths must lie in [1, {context.shape[1]}]; got "
                     f"{context_lengths.tolist()}")
  if any(s is not None for s in getattr(model, "kv_sources", ()) or ()):
    raise ValueError("record does not replay models with cross-layer KV sharing (kv_sources)")
  graphdef, state = nnx.split(model)
  return _record(graphdef, state, jnp.asarray(context, jnp.int32),
                 jnp.asarray(context_lengths, jnp.int32))


def appending(cache: Any, capacity: int) -> Any:
  """An evicting cache after its context write, as one that only appends: `policy="recent"`
  with no options and `capacity` slots (the kept slots, then empty ones). While a row holds at
  most the cache's own capacity no policy evicts (the context mode appends), so the policy
  chose all it will choose at the context write; this form makes the question's and
  answer's programs one per model and capacity instead of one per policy and ratio (a
  sweep compiles them once). Other kinds are returned as they are.

  Raises:
    ValueError: `capacity` below the cache's.
  """
  from kvattn.caches import eviction  # pylint: disable=g-import-not-at-top
  if not isinstance(cache, eviction.EvictingKVCache):
    return cache
  if capacity < cache.capacity:
    raise ValueError(f"capacity must be >= the cache's {cache.capacity}; got {capacity}")
  pad = capacity - cache.capacity

  def grow(x, fill):
    if x is None:
      return None
    return jnp.pad(x, [(0, 0), (0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 3),
                   constant_values=fill)

  empty = eviction.EvictingKVCache.ROW_EMPTY
  return eviction.EvictingKVCache(
      k=grow(cache.k, empty["k"]), v=grow(cache.v, empty["v"]), pos=grow(cache.pos, -1),
      scores=grow(cache.scores, 0.0), lengths=cache.lengths,
      k_scale=grow(cache.k_scale, empty["k_scale"]), v_scale=grow(cache.v_scale,
                                                                   empty["v_scale"]),
      context_lengths=cache.context_lengths, policy="recent",
      options=eviction._policy_options("recent", capacity, {}, context=True),  # pylint: disable=protected-access
      compress="context", compression_ratio=0.0, context_budget=None)


def compacted(caches: Sequence[Any], capacity: int, model: Any) -> list[Any]:
  """A model's evicting caches after their context write, as dense `kvattn.KVCache`s of
  `capacity` slots where that is exact, else each as `appending(cache, capacity)`.

  After the context write a row keeps the same count c_b of tokens in every KV head (the
  first c_b slots, sorted by position), all before any later token: each later query sees all
  of them and the appended tokens causally, which is dense attention over the slots. The
  positions differ: the kept keys carry their RoPE at the context's positions, the next token
  is n_b (the context's length), while a dense cache places it at c_b (the model reads its
  positions from its first cache). So the kept keys are moved back by n_b - c_b positions
  (`kvattn.ops.rope.shift_rope`): every query-key distance is then the evicting cache's, and
  the question's and answer's logits equal it up to rounding. They then run the dense cache's
  programs, the same for every policy and ratio of a sweep and for its dense point.

  It applies when every layer's cache is a float `EvictingKVCache` of a layer without a sliding
  window (a window is measured in slots by a dense cache; a quantized key cannot be rotated
  exactly) and every layer and head keeps the same count per row (one position frame for the
  model: not PyramidKV's per-layer budgets, not rings on the local layers).

  Args:
    caches: the model's caches after `_write`, one per layer.
    capacity: slots of the results (at least every cache's).
    model: the model (each layer's `attn.rope_theta`, `rope_scaling`, `window`).

  Raises:
    ValueError: `capacity` below a cache's.
  """
  from kvattn.caches import dense, eviction  # pylint: disable=g-import-not-at-top
  from kvattn.ops import rope  # pylint: disable=g-import-not-at-top
  caches, attns = list(caches), [layer.attn for layer in model.layers]
  fallback = lambda: [appending(c, capacity) for c in caches]  # pylint: disable=unnecessary-lambda-assignment
  if not all(isinstance(c, eviction.EvictingKVCache) and not c.quantized
             and getattr(a, "window", None) is None for c, a in zip(caches, attns)):
    return fallback()
  if capacity < max(c.capacity for c in caches):
    raise ValueError(f"capacity must be >= the cache's {max(c.capacity for c in caches)}; "
                     f"got {capacity}")
  counts = jnp.stack([jnp.sum(c.pos >= 0, axis=-1, dtype=jnp.int32) for c in caches])
  kept = counts[0, :, 0]  # [B]
  if not bool(jnp.all(counts == kept[None, :, None])):
    return fallback()
  out = []
  for c, a in zip(caches, attns):
    shift = jnp.broadcast_to((kept - c.lengths)[:, None], c.k.shape[:2])
    k = rope.shift_rope(c.k, shift, rope_theta=a.rope_theta, scaling=a.rope_scaling)
    pad = [(0, 0), (0, 0), (0, capacity - c.capacity), (0, 0)]
    out.append(dense.KVCache(k=jnp.pad(k, pad), v=jnp.pad(c.v, pad),
                              lengths=jnp.array(kept, copy=True)))  # donated per layer
  return out


def generate_after(model: Any, inputs: Sequence[jax.Array], context_lengths: np.ndarray,
                   caches: Sequence[Any], rest: np.ndarray, rest_lengths: np.ndarray,
                   max_new_tokens: int, *, eos_id: int | None = None,
                   pad_id: int | None = None, capacity: int | None = None
                   ) -> tuple[jax.Array, jax.Array]:
  """Greedy `generate(prompts, ..., context_lengths=)` from a recorded context (module doc).

  Args:
    model: the model `inputs` were recorded on.
    inputs: `record(model, context, context_lengths)`.
    context_lengths: `int[B]`, as recorded.
    caches: empty per-layer caches that pass `replayable`, sized for the kept context plus
      `rest_lengths + max_new_tokens - 1` (`registry.slots_needed`); donated.
    rest: `int[B, Tr]` the rest of each prompt (the question), left-aligned.
    rest_lengths: `int[B]` in `[1, Tr]`.
    max_new_tokens: tokens generated per row (>= 1).
    eos_id, pad_id: as in `generate`.
    capacity: None, or slots (at least every cache's) that the evicting caches are turned
      into dense ones of after the context write (`compacted`; `appending` where that does
      not apply): the question's and the answer's programs then compile once for every
      policy and ratio of a sweep, and run at the dense cache's speed.

  Returns:
    `(tokens i32[B, max_new_tokens], lengths i32[B])`, as `generate`.

  Raises:
    ValueError: caches that do not qualify or do not match `inputs`, or `rest_lengths`
      outside `[1, Tr]`.
  """
  caches = tuple(caches)
  if not replayable(model, caches):
    raise ValueError("caches must be dense, evicting with compress='context' or rings, one "
                     "per layer of a model without KV sharing (replay.replayable); got "
                     f"{sorted({type(c).__name__ for c in caches})}")
  if len(inputs) != len(caches):
    raise ValueError(f"inputs must hold one (q, k, v) per layer ({len(caches)}); got "
                     f"{len(inputs)}")
  rest, rest_lengths = np.asarray(rest), np.asarray(rest_lengths)
  if rest.ndim != 2 or rest_lengths.shape != rest.shape[:1] or rest_lengths.min() < 1 \
      or rest_lengths.max() > rest.shape[1]:
    raise ValueError(f"rest must be [B, Tr] with rest_lengths in [1, Tr]; got shapes "
                     f"{rest.shape}, {rest_lengths.shape} and lengths {rest_lengths.tolist()}")
  new_lengths = jnp.asarray(context_lengths, jnp.int32)
  written = []
  for layer, cache, qkv in zip(model.layers, caches, inputs):
    written.append(_write(*nnx.split(layer.attn), cache, qkv, new_lengths))
  if capacity is not None:
    written = compacted(written, capacity, model)
  first, written, key = generation.prefill(model, rest.astype(np.int32),
                                           rest_lengths.astype(np.int32), written)
  kwargs = {} if pad_id is None else {"pad_id": pad_id}
  tokens, lengths, _ = generation.decode(model, first, written, max_new_tokens, eos_id=eos_id,
                                         rng=key, **kwargs)
  return tokens, lengths


def split_prompts(prompts: np.ndarray, prompt_lengths: np.ndarray, context_lengths: np.ndarray
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """`(context int[B, Tc], rest int[B, Tr], rest_lengths int[B])` of right-padded prompts
  (`generate`'s split, `generation._split_prompts`)."""
  return generation._split_prompts(np.asarray(prompts), np.asarray(prompt_lengths),  # pylint: disable=protected-access
                                   np.asarray(context_lengths))
