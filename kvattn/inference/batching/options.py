"""The batcher's records and its setup: options checked, caches built through the registry
(pageable kinds as page pools, every other kind as fixed rows per slot), placed on a mesh."""

from __future__ import annotations

import collections
import dataclasses
import types
from typing import Any, Hashable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kvattn import _checks
from kvattn import _multihost
from kvattn.caches import capabilities
from kvattn.caches import registry
from kvattn.caches._layers import gqa_layers
from kvattn.inference import speculative as speculative_lib
from kvattn.inference.batching.snapshots import ResidualSnapshots, RingSnapshots
from kvattn.inference.generation import Sampling
from kvattn.paging.allocator import PageAllocator
from kvattn.paging.prefix import PrefixCachingAllocator

FINISH_REASONS = ("eos", "length", "out_of_pages", "cancelled")

# Where Pallas kernels compile (kvattn.ops.pallas); elsewhere naming "pallas" runs it interpreted.
_PALLAS_PLATFORMS = ("gpu", "cuda", "rocm", "tpu")


class NoFreeSlotError(RuntimeError):
  """Every slot is busy; retire a sequence (step until one finishes) first."""


@dataclasses.dataclass(frozen=True)
class Finished:
  """A sequence that left the batch.

  Attributes:
    request_id: the id given to `add`.
    tokens: `i32[n]` generated tokens (EOS included when it ended the sequence).
    reason: one of `FINISH_REASONS`.
    slot: the slot it occupied.
    joined_step, finished_step: `ContinuousBatcher.steps` when it joined and left.
  """

  request_id: Hashable
  tokens: np.ndarray
  reason: str
  slot: int
  joined_step: int
  finished_step: int


@dataclasses.dataclass
class Live:
  """A request in a slot: its id, the tokens generated so far, its budget and when it joined."""

  request_id: Hashable
  tokens: list
  max_new_tokens: int
  cache_len: int  # tokens in the cache (host mirror of lengths[slot])
  joined_step: int
  prompt: Any = None  # the prompt's token ids (kept for the prefix cache)


def batcher_cache(cache: Any, *, page_size: int, seed: int | None
                  ) -> tuple[str, dict[str, Any], registry.CacheKind]:
  """`(kind, options, record)` of `ContinuousBatcher(cache=)`: None ("paged"), a kind name or
  a registry spec. A pageable kind's `page_size` / `seed`, when set, must be the batcher's.

  Raises:
    ValueError: an unknown kind or option, or a `page_size` / `seed` other than the
      batcher's, naming `cache.<key>`.
  """
  if cache is None:
    cache = "paged"
  spec = {"kind": cache} if isinstance(cache, str) else cache
  kind, options = registry.cache_options(spec, "cache")
  entry = registry.CACHE_KIND_TABLE[kind]
  if options.get("compress") == "context":
    raise ValueError(f"cache.compress = 'context' is not supported by the ContinuousBatcher yet "
                     f"(kind {kind!r}): a row's first write is its context, and the batcher's "
                     f"steps write to idle rows; use compress='fixed', or kvattn.generate("
                     f"context_lengths=)")
  if not entry.pageable:
    return kind, options, entry
  given = spec.to_dict() if hasattr(spec, "to_dict") else dict(spec)
  for key, value in (("page_size", page_size), ("seed", seed)):
    if given.get(key) is not None and given[key] != value:
      raise ValueError(f"cache.{key} must be unset or the batcher's {key} = {value!r} (the "
                       f"batcher owns the pool); got {given[key]!r}")
  return kind, {k: v for k, v in options.items() if k not in ("page_size", "seed")}, entry


def attending_layers(model: nnx.Module) -> list[Any]:
  """Every GQA attention module that reads a cache (owners and `kv_source` readers)."""
  return [layer.attn for layer in model.layers if hasattr(layer.attn, "decode_implementation")]


def shared_page_decoding(model: nnx.Module) -> nnx.Module:
  """`model`, or a copy sharing its parameters whose default-backend layers decode with
  backends that read each row's pages through its own row (shared prefix pages)."""
  if all(a.decode_implementation is not None for a in attending_layers(model)):
    return model
  safe = ("pallas", "xla") if jax.default_backend() in _PALLAS_PLATFORMS else "xla"
  model = nnx.merge(*nnx.split(model))
  for a in attending_layers(model):
    if a.decode_implementation is None:
      a.decode_implementation = safe
  return model


def _refuse(name: str, value: Any, why: str, kind: str) -> None:
  raise ValueError(f"{name} is not supported with cache kind {kind!r}: {why}; got "
                   f"{name}={value!r}")


def configure(b, model, *, num_slots, num_pages, page_size, max_len, max_prompt_len,
              temperature, top_k, top_p, eos_id, pad_id, dtype, seed, rng, prefix_cache,
              offload, mesh, speculative, local_layers, max_ring_snapshots, cache):
  """Checks the options and sets up `b` (a `ContinuousBatcher`): caches, allocators,
  snapshots, placement, the draft model. Returns the model the programs run."""
  b.num_slots = _checks.positive_int("num_slots", num_slots)
  b.page_size = _checks.positive_int("page_size", page_size)
  b.max_len = _checks.positive_int("max_len", max_len)
  b.max_prompt_len = _checks.positive_int("max_prompt_len", max_prompt_len)
  if b.max_prompt_len > b.max_len:
    raise ValueError(f"max_prompt_len must be <= max_len = {b.max_len}; got {max_prompt_len}")
  b.sampling = Sampling(float(temperature), top_k, top_p)
  b.vocab_size = int(model.vocab_size)
  if eos_id is not None and not 0 <= int(eos_id) < b.vocab_size:
    raise ValueError(f"eos_id must lie in [0, {b.vocab_size}); got {eos_id}")
  b.eos_id = None if eos_id is None else int(eos_id)
  b.pad_id = int(pad_id)
  if speculative is not None:
    speculative = speculative_lib.check(speculative, b.vocab_size)
    if isinstance(speculative, speculative_lib.DraftModel) and mesh is not None:
      raise ValueError("speculative=DraftModel(...) runs on one device: mesh must be None; "
                       f"got a mesh of shape {dict(mesh.shape)}")
    if b.sampling.temperature != 0.0:
      raise ValueError(f"speculative decoding is greedy: temperature must be 0; got "
                       f"{temperature}")
  b.speculative = speculative
  b.spec_stats = collections.Counter(passes=0, drafted=0, accepted=0, pages_returned=0)
  # Each slot's text (prompt, then generated tokens) for prompt lookup.
  b._history = np.zeros((b.num_slots, b.max_len + 1), np.int32)
  b._ends = np.zeros((b.num_slots,), np.int32)
  attns = gqa_layers(model)
  b.cache_kind, kind_options, entry = batcher_cache(cache, page_size=b.page_size, seed=seed)
  b.pageable = entry.pageable
  plan = None
  if b.pageable:
    plan = entry.pool(kind_options, max_len=b.max_len, page_size=b.page_size,
                      prefix_cache=bool(prefix_cache))
    given = {"speculative": speculative, "local_layers": local_layers if local_layers != "full"
             else None, "offload": offload}
    for name, why in plan.refuses:
      if given.get(name) is not None:
        _refuse(name, given[name], why, b.cache_kind)
    if prefix_cache and plan.residual and mesh is not None:
      raise ValueError(
          f"prefix_cache=True with cache kind {b.cache_kind!r} and a residual runs on one "
          f"device: mesh must be None (residual snapshots are not placed on a mesh); got "
          f"cache.residual = {plan.residual} and a mesh of shape {dict(mesh.shape)}")
    b._pool_tokens, pps = plan.tokens, plan.pages_per_seq
  else:  # fixed rows: no pages (the allocators count nothing)
    for name, value in (("prefix_cache", prefix_cache or None), ("offload", offload)):
      if value is not None:
        _refuse(name, value, "the prefix cache shares pages; this kind keeps fixed rows per "
                "slot (a pageable kind: CacheKind.pool)", b.cache_kind)
    b._pool_tokens, pps = (lambda n: 0), 1
  b._chunked_prefill = bool(plan and plan.chunked_prefill)
  residual_states = bool(plan and plan.residual and prefix_cache)
  if prefix_cache and any(a.decode_implementation == "xla_pool" for a in attending_layers(model)):
    raise ValueError("decode_implementation must not be 'xla_pool' with prefix_cache=True "
                     "(shared pages have several owners; that backend allows one); got "
                     f"{[a.decode_implementation for a in attending_layers(model)]}")
  if offload is not None and not prefix_cache:
    raise ValueError("offload needs prefix_cache=True (only cached prefixes are offloaded)")
  b.prefix_cache = bool(prefix_cache)
  if local_layers not in registry.LOCAL_LAYER_LAYOUTS:
    raise ValueError(f"local_layers must be one of {registry.LOCAL_LAYER_LAYOUTS}; got "
                     f"{local_layers!r}")
  rings = {i for i, a in enumerate(attns) if local_layers == "ring" and
           getattr(a, "window", None) is not None and a.window < b.max_len}
  if rings and b.prefix_cache and mesh is not None:
    raise ValueError(
        "prefix_cache=True with local_layers='ring' runs on one device: mesh must be None "
        f"(ring snapshots are not placed on a mesh); got a mesh of shape {dict(mesh.shape)}")
  b.ring_layers = tuple(sorted(rings))
  num_pages = _checks.positive_int("num_pages", num_pages)
  shards = 1 if mesh is None else int(mesh.shape["data"])  # data-parallel groups
  for name, value in (("num_slots", b.num_slots), ("num_pages", num_pages)):
    if value % shards:
      raise ValueError(f"mesh axis 'data' of size {shards} must divide {name} (each data "
                       f"shard holds an equal part); got {name} = {value}")
  if offload is not None and shards > 1:
    raise ValueError(f"offload needs one data shard (one page allocator); got mesh axis "
                     f"'data' of size {shards}")
  b._slots_per_shard = b.num_slots // shards
  b._pages_per_shard = num_pages // shards
  if max_ring_snapshots is None:
    max_ring_snapshots = 4 * b.num_slots
  max_ring_snapshots = _checks.positive_int("max_ring_snapshots", max_ring_snapshots)
  states = bool(rings) or residual_states
  if b.prefix_cache:
    make = lambda: PrefixCachingAllocator(
        b._pages_per_shard, b.page_size, pps, seed=seed, offload=offload,
        boundary_states=states, max_states=max_ring_snapshots if states else None)
  else:
    make = lambda: PageAllocator(b._pages_per_shard, b.page_size, pps, seed=seed)
  # allocators[j] hands out pages [j * P / d, (j + 1) * P / d) (local ids; `_row` offsets).
  b.allocators = tuple(make() for _ in range(shards))
  b.prefill_tokens = 0  # prompt tokens run through the model (the rest came from the cache)
  dtype = getattr(model, "dtype", jnp.float32) if dtype is None else dtype
  b.caches = _build_caches(b, model, attns, rings, plan, entry, kind_options, dtype,
                           shards * b._pages_per_shard)
  # Committed, as the jitted programs' outputs are: the first call reuses their executable.
  home = jax.local_devices()[0]
  if mesh is not None:
    from kvattn import sharding  # pylint: disable=g-import-not-at-top
    from kvattn.caches import sharded  # pylint: disable=g-import-not-at-top
    model = sharding.place_model(model, mesh)
    pools = [i for i, c in enumerate(b.caches) if capabilities.paged(c)]
    placed = dict(zip(pools, sharded.place_caches(
        [b.caches[i] for i in pools], mesh, sharded.BATCHER_RULES,
        num_heads=[attns[i].num_heads for i in pools])))
    b.caches = tuple(placed[i] if i in placed else sharded.place(c, mesh, sharded.BATCHER_RULES)
                     for i, c in enumerate(b.caches))
    home = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  else:
    b.caches = jax.device_put(b.caches, home)
  b._snapshots = None
  if b.prefix_cache and rings:
    b._snapshots = RingSnapshots(b.caches, b.ring_layers,
                                 [attns[i].window for i in b.ring_layers], home)
  elif residual_states:
    b._snapshots = ResidualSnapshots(b.caches, home)
  if prefix_cache:
    model = shared_page_decoding(model)
  b._draft_graphdef, b._draft_state, b._draft_caches = None, None, ()
  if isinstance(speculative, speculative_lib.DraftModel):
    draft = speculative.model
    b._draft_graphdef, b._draft_state = nnx.split(draft)
    # One dense row per slot at full length (rings cannot roll back by lengths); room for a
    # pass that drafts k past the last kept token.
    b._draft_caches = tuple(draft.init_caches(
        b.num_slots, b.max_len + speculative.num_draft_tokens + 1, local_layers="full"))
    if not all(capabilities.rollback(c) == "lengths" for c in b._draft_caches):
      raise ValueError("speculative.model must build caches that roll back by lengths "
                       "(dense, latent, paged); got "
                       f"{sorted({type(c).__name__ for c in b._draft_caches})}")
    b._draft_caches = jax.tree.map(lambda x: _multihost.put(x, home), b._draft_caches)
    b._draft_state = jax.tree.map(lambda x: _multihost.put(x, home), b._draft_state)
  if rng is None or (isinstance(rng, int) and not isinstance(rng, bool)):
    rng = jax.random.key(0 if rng is None else rng)
  b._rng = _multihost.put(rng, home)  # committed, like the caches
  return model


def _build_caches(b, model, attns, rings, plan, entry, options, dtype, num_pages):
  """One cache per owning layer: a ring of `window` slots for a local layer (plus
  `page_size - 1` with the prefix cache, so the last page boundary's window stays), the
  kind's pool (`plan`) or the kind's fixed rows of `num_slots` sequences."""
  slack = b.page_size - 1 if b.prefix_cache else 0
  ring = registry.CACHE_KIND_TABLE["ring"].build
  owners = list(registry.cache_owners(model).layers)
  rest = [a for i, a in enumerate(attns) if i not in rings]
  if plan is not None:
    built = iter(plan.init(a, b.num_slots, num_pages, dtype) for a in rest)
  else:
    built = iter(entry.build(types.SimpleNamespace(
        layers=[layer for i, layer in enumerate(owners) if i not in rings],
        dtype=getattr(model, "dtype", None)), b.num_slots, b.max_len, dtype, options, None)
                 if rest else ())
  return tuple(
      ring(types.SimpleNamespace(layers=[owners[i]]), b.num_slots, b.max_len, dtype, {"window": a.window + slack},
           None)[0] if i in rings else next(built) for i, a in enumerate(attns))
