"""The cache registry: every cache kind by name, and the caches of a whole model.

One vocabulary: a cache is chosen by a spec `{"kind": <name>, **options}` (a dict
or an ml_collections ConfigDict, e.g. a config's `cache` section) whose kind is a
key of `CACHE_KIND_TABLE`. The same spec goes to `build_caches` (one cache per
layer), `cache_factory_from_config` (a `CacheFactory` for
`kvattn.generate(cache_factory=)`), `Transformer.init_caches(cache=)`, the
experiment configs and `experiments.chat --cache`.

Adding a kind is one file (the cache class) plus one `register_cache_kind` line
(or one entry below); an eviction policy is one score function plus one
`register_eviction_policy` line (`kvattn.caches.eviction.POLICY_TABLE`).
"""

from __future__ import annotations

import dataclasses
import types
from typing import Any, Callable, Iterable, Mapping, Sequence

import jax.numpy as jnp

from kvattn import _checks
from kvattn.caches import eviction
from kvattn.caches import kivi
from kvattn.caches import paged_kivi
from kvattn.caches import rotated
from kvattn.caches import length_switch
from kvattn.caches import window as window_lib
from kvattn.caches.paged import PagedKVCache
from kvattn.paging.allocator import PageAllocator, pages_for

CacheFactory = Callable[[int, int, Any], Sequence[Any]]
"""`(batch, max_len, dtype) -> one cache per layer` (dtype None: the model's)."""

def cache_owners(model) -> Any:
  """`model`, or for a model with cross-layer KV sharing (`model.cache_layers` shorter than
  its layers) a stand-in whose `.layers` are the layers that own a cache: what the builders
  read, so they build one cache per owning layer, in order."""
  owners = getattr(model, "cache_layers", None)
  if owners is None or len(owners) == len(model.layers):
    return model
  return types.SimpleNamespace(layers=[model.layers[i] for i in owners],
                               dtype=getattr(model, "dtype", None))


def gqa_layers(model) -> list[Any]:
  """The attention modules of `model.layers[i].attn` (of the layers that own a cache:
  `cache_owners`); ValueError for non-GQA layers."""
  layers = getattr(model, "layers", None)
  if layers is None:
    raise TypeError(f"model must have .layers with an .attn each (a kvattn.Transformer); got "
                    f"{type(model).__name__}")
  layers = cache_owners(model).layers
  attns = []
  for i, layer in enumerate(layers):
    attn = layer.attn
    if not (hasattr(attn, "num_kv_heads") and hasattr(attn, "head_dim")):
      raise ValueError(
          f"paged caches hold K-head keys and values (MHA/GQA/MQA); layer {i} is "
          f"{type(attn).__name__}: use cache kind 'dense' for it")
    attns.append(attn)
  return attns


def init_paged_caches(model, tokens_per_seq: Iterable[int], *, page_size: int = 16,
                      max_len: int | None = None, dtype: Any = None, extra_pages: int = 0,
                      seed: int | None = None) -> tuple[tuple[PagedKVCache, ...], PageAllocator]:
  """Empty paged caches for every layer of `model`, pages allocated per sequence.

  Sequence b gets `ceil(tokens_per_seq[b] / page_size)` pages from a
  `PageAllocator` (seq ids 0..B-1), not the worst case of the batch: this is
  where paging saves memory. All layers share the page ids (one block table),
  each has its own pool of `P = sum of pages + extra_pages` pages.

  Args:
    model: a `kvattn.Transformer` whose layers are all GQA-family attention.
    tokens_per_seq: tokens each sequence will hold (e.g. prompt length +
      max_new_tokens - 1 in `generate`).
    page_size: tokens per page.
    max_len: per-sequence capacity (block-table width * page_size, rounded up
      to whole pages); default the largest `tokens_per_seq`.
    dtype: cache dtype (default the model's compute dtype).
    extra_pages: free pages left in the pool (for growth, e.g. in batching).
    seed: shuffles the free list (non-contiguous pages); None = ascending.

  Returns:
    `(caches, allocator)`: one `PagedKVCache` per layer (lengths 0) and the
    allocator that owns their pages.

  Raises:
    ValueError: an MLA layer, a sequence longer than `max_len`, bad sizes.
  """
  attns = gqa_layers(model)
  tokens = [int(t) for t in tokens_per_seq]
  if not tokens or min(tokens) < 0:
    raise ValueError(f"tokens_per_seq must be a non-empty list of ints >= 0; got {tokens}")
  page_size = _checks.positive_int("page_size", page_size)
  max_len = max(max(tokens), 1) if max_len is None else _checks.positive_int("max_len", max_len)
  if max(tokens) > max_len:
    raise ValueError(f"tokens_per_seq must be <= max_len = {max_len}; got {tokens}")
  if isinstance(extra_pages, bool) or not isinstance(extra_pages, int) or extra_pages < 0:
    raise ValueError(f"extra_pages must be an int >= 0; got {extra_pages!r}")
  pps = pages_for(max_len, page_size)
  num_pages = max(1, sum(pages_for(t, page_size) for t in tokens) + extra_pages)
  allocator = PageAllocator(num_pages, page_size, pps, seed=seed)
  for b, t in enumerate(tokens):
    allocator.allocate(b, t)
  tables = allocator.block_tables(range(len(tokens)), pps)
  dtype = getattr(model, "dtype", jnp.float32) if dtype is None else dtype
  caches = tuple(
      PagedKVCache.init(len(tokens), num_pages=num_pages, page_size=page_size,
                        pages_per_seq=pps, num_kv_heads=attn.num_kv_heads,
                        head_dim=attn.head_dim, dtype=dtype, block_tables=tables)
      for attn in attns)
  return caches, allocator




# ----------------------------------------------------------------------------------------------
# The table of kinds.

REQUIRED = object()
"""The default of a `CacheKind` option the spec must set."""

Builder = Callable[[Any, int, int, Any, dict[str, Any], "Sequence[int] | None"], tuple[Any, ...]]


@dataclasses.dataclass(frozen=True)
class CacheKind:
  """One cache kind: its options and how it builds a model's caches.

  Attributes:
    build: `(model, batch, max_len, dtype, options, tokens_per_seq) -> one cache per
      layer`; `dtype` is resolved (never None), `options` holds every option below
      with defaults filled in (None where the kind's own default applies),
      `tokens_per_seq` is None or the tokens each sequence will hold (`paged` uses it).
    options: option name -> default (`REQUIRED`: the spec must set it).
    doc: one line for error messages and docs.
  """

  build: Builder
  options: Mapping[str, Any]
  doc: str


def _dense(model, batch, max_len, dtype, options, tokens_per_seq):
  del options, tokens_per_seq
  return tuple(layer.attn.init_cache(batch, max_len, dtype) for layer in model.layers)


def _paged(model, batch, max_len, dtype, o, tokens_per_seq):
  tokens = [max_len] * batch if tokens_per_seq is None else list(tokens_per_seq)
  if len(tokens) != batch:
    raise ValueError(f"tokens_per_seq must have one entry per sequence ({batch}); got "
                     f"{len(tokens)}")
  return init_paged_caches(model, tokens, page_size=o["page_size"], max_len=max_len,
                           dtype=dtype, seed=o["seed"])[0]


def _ring(model, batch, max_len, dtype, o, tokens_per_seq):
  del max_len, tokens_per_seq  # bounded: the capacity is the window
  return tuple(window_lib.RingKVCache.init(batch, o["window"], a.num_kv_heads, a.head_dim, dtype)
               for a in gqa_layers(model))


def _sink(model, batch, max_len, dtype, o, tokens_per_seq):
  del max_len, tokens_per_seq
  return tuple(window_lib.SinkKVCache.init(batch, o["num_sinks"], o["window"], a.num_kv_heads,
                                           a.head_dim, dtype, rope_theta=a.rope_theta,
                                           rope_scaling=a.rope_scaling)
               for a in gqa_layers(model))


def _evicting(policy: str) -> Builder:
  def build(model, batch, max_len, dtype, o, tokens_per_seq):
    del max_len, tokens_per_seq  # bounded: the capacity is the budget
    options = {k: v for k, v in o.items() if k != "budget" and v is not None}
    return tuple(eviction.EvictingKVCache.init(batch, o["budget"], a.num_kv_heads, a.head_dim,
                                               dtype, policy=policy, **options)
                 for a in gqa_layers(model))
  return build


def _length_switch(model, batch, max_len, dtype, o, tokens_per_seq):
  del tokens_per_seq
  return tuple(length_switch.LengthSwitchKVCache.init(
      batch, max_len, a.num_kv_heads, a.head_dim, dtype, switch_length=o["switch_length"],
      num_kv_heads_after=o["num_kv_heads_after"]) for a in gqa_layers(model))


def eviction_kind(policy: str) -> CacheKind:
  """The `CacheKind` of `EvictingKVCache(policy=policy)`: `budget` slots per KV head."""
  return CacheKind(_evicting(policy),
                   {"budget": REQUIRED, "num_sinks": None,
                    **{o: None for o in eviction.policy_options(policy)}},
                   f"EvictingKVCache(policy={policy!r}): `budget` slots per KV head")


CACHE_KIND_TABLE: dict[str, CacheKind] = {
    "dense": CacheKind(_dense, {}, "KVCache / LatentCache of max_len (layer.attn.init_cache)"),
    "paged": CacheKind(_paged, {"page_size": 16, "seed": None},
                       "PagedKVCache, pages per sequence (init_paged_caches)"),
    "ring": CacheKind(_ring, {"window": REQUIRED},
                      "RingKVCache: the last `window` tokens (sliding-window attention)"),
    "sink": CacheKind(_sink, {"num_sinks": 4, "window": REQUIRED},
                      "SinkKVCache: StreamingLLM, `num_sinks` first tokens + a ring of `window`"),
    **{policy: eviction_kind(policy) for policy in eviction.POLICIES},
    "length_switch": CacheKind(
        _length_switch, {"switch_length": REQUIRED, "num_kv_heads_after": REQUIRED},
        "LengthSwitchKVCache: K heads up to switch_length, then num_kv_heads_after pooled heads"),
    **{f"kivi{bits}": CacheKind(kivi.build(bits), kivi.OPTIONS,
                                f"KIVICache: {bits}-bit keys per channel / values per token, "
                                f"`residual` newest tokens in full precision")
       for bits in (2, 4)},
    **{f"rotated{bits}": CacheKind(rotated.build(bits), rotated.OPTIONS,
                                   f"RotatedCache: Hadamard-rotated K/V, {bits}-bit codebook "
                                   f"per token (+ `residual` newest tokens in full precision)")
       for bits in (3, 4)},
    **{f"paged_kivi{bits}": CacheKind(paged_kivi.build(bits), paged_kivi.OPTIONS,
                                      f"PagedKIVICache: kivi{bits} with its quantized store in "
                                      f"pages of `page_size` slots (a multiple of group_size)")
       for bits in (2, 4)},
}
"""Cache kind -> `CacheKind`: "dense", "paged" (`page_size`, `seed`), "ring"
(`window`), "sink" (`num_sinks`, `window`), each eviction policy of
`kvattn.caches.eviction` (`budget`, `num_sinks` and the policy's options; None: the
policy's default, e.g. H2O's recent window of budget // 2) and "length_switch"
(`switch_length`, `num_kv_heads_after`). The bounded kinds (ring, sink, eviction)
ignore `max_len`: their capacity is the window / budget."""

CACHE_KINDS = tuple(CACHE_KIND_TABLE)
"""The cache kinds when this module was imported (the table may grow)."""


def register_cache_kind(name: str, kind: CacheKind) -> None:
  """Adds `name` to `CACHE_KIND_TABLE`; ValueError when it is taken."""
  if not isinstance(name, str) or not name or name in CACHE_KIND_TABLE:
    raise ValueError(f"cache kind name must be a new non-empty string; got {name!r} (taken: "
                     f"{tuple(CACHE_KIND_TABLE)})")
  if not isinstance(kind, CacheKind):
    raise TypeError(f"kind must be a CacheKind; got {type(kind).__name__}")
  CACHE_KIND_TABLE[name] = kind


def register_eviction_policy(name: str, policy: eviction.EvictionPolicy) -> None:
  """Adds an eviction policy (`eviction.POLICY_TABLE`) and its cache kind `name`."""
  if not isinstance(name, str) or not name or name in eviction.POLICY_TABLE:
    raise ValueError(f"policy name must be a new non-empty string; got {name!r} (taken: "
                     f"{tuple(eviction.POLICY_TABLE)})")
  if not isinstance(policy, eviction.EvictionPolicy):
    raise TypeError(f"policy must be an EvictionPolicy; got {type(policy).__name__}")
  if name in CACHE_KIND_TABLE:
    raise ValueError(f"cache kind {name!r} is taken")
  eviction.POLICY_TABLE[name] = policy
  CACHE_KIND_TABLE[name] = eviction_kind(name)


EXPERIMENT_CACHE_KEYS = ("max_len", "dtype")
"""Keys of experiment `cache` sections that are not options of a kind."""


def cache_options(spec: Any, where: str = "cache") -> tuple[str, dict[str, Any]]:
  """`(kind, options)` of a cache spec, checked against `CACHE_KIND_TABLE`.

  `spec`: a dict or ConfigDict with `kind` and that kind's options; a key set to
  None counts as unset (flat ml_collections schemas keep every key), so defaults
  fill it. `max_len` and `dtype` are the experiments' own keys and are ignored.

  Raises:
    ValueError: an unknown kind, a key the kind does not take, a required option
      unset -- naming `<where>.<key>`.
    TypeError: a spec that is not a mapping.
  """
  if hasattr(spec, "to_dict"):
    spec = spec.to_dict()
  if not isinstance(spec, Mapping):
    raise TypeError(f"{where} must be a dict or ConfigDict with a 'kind' (one of "
                    f"{tuple(CACHE_KIND_TABLE)}); got {type(spec).__name__}")
  kind = spec.get("kind")
  if kind not in CACHE_KIND_TABLE:
    raise ValueError(f"{where}.kind must be one of {tuple(CACHE_KIND_TABLE)}; got {kind!r}")
  entry = CACHE_KIND_TABLE[kind]
  given = {k: v for k, v in spec.items()
           if k not in ("kind",) + EXPERIMENT_CACHE_KEYS and v is not None}
  unknown = sorted(set(given) - set(entry.options))
  if unknown:
    raise ValueError(f"{where}.{unknown[0]} is not an option of {where}.kind = {kind!r} (it takes "
                     f"{tuple(entry.options)}); got {where}.{unknown[0]} = {given[unknown[0]]!r}")
  options = {**entry.options, **given}
  missing = [k for k, v in options.items() if v is REQUIRED]
  if missing:
    raise ValueError(f"{where}.{missing[0]} must be set for {where}.kind = {kind!r} "
                     f"({entry.doc})")
  return kind, options


LOCAL_LAYER_LAYOUTS = ("full", "ring")
"""`local_layers` of `build_caches`: "full" (every layer the chosen kind) or "ring" (the
per-layer layout: a layer with a sliding window shorter than max_len gets a ring of `window`
slots)."""


def ring_layers(model, max_len: int) -> list[int]:
  """Indices of the layers the per-layer layout gives a ring: GQA-family attention whose
  sliding `window` is shorter than `max_len` (Gemma's local layers, Mistral's windows)."""
  out = []
  for i, layer in enumerate(getattr(model, "layers", ())):
    attn = layer.attn
    window = getattr(attn, "window", None)
    if window is not None and window < max_len and hasattr(attn, "num_kv_heads"):
      out.append(i)
  return out


def build_caches(model, batch: int, max_len: int, dtype: Any = None, cache: Any = None, *,
                 tokens_per_seq: Iterable[int] | None = None,
                 where: str = "cache", local_layers: str = "full") -> tuple[Any, ...]:
  """One empty cache per layer of `model` that owns one (`model.cache_layers` under
  cross-layer KV sharing), of the kind `cache` names.

  Args:
    model: a `kvattn.Transformer`.
    batch: B.
    max_len: tokens per sequence (the bounded kinds ignore it).
    dtype: storage dtype (float, or int8 / fp8 with f32 scales); None: the model's.
    cache: a spec `{"kind": ..., **options}` (None: `{"kind": "dense"}`).
    tokens_per_seq: tokens each sequence will hold (`paged` allocates only those).
    where: the name errors give the spec.
    local_layers: "full" (every layer gets the kind, at `max_len`) or "ring": the
      per-layer layout, in which every layer of `ring_layers(model, max_len)` (a sliding
      window W < max_len) gets a `RingKVCache` of W slots in `dtype` -- exact for that
      layer's attention, O(W) memory whatever the context -- and the other (global)
      layers the kind; a paged kind then pools pages for the global layers only.

  Raises:
    ValueError: an unknown kind or option, a bad size -- naming `<where>.<key>`; an
      unknown `local_layers`.
  """
  kind, options = cache_options({"kind": "dense"} if cache is None else cache, where)
  dtype = getattr(model, "dtype", jnp.float32) if dtype is None else dtype
  model = cache_owners(model)  # cross-layer KV sharing: caches for the owning layers only
  tokens = None if tokens_per_seq is None else [int(t) for t in tokens_per_seq]
  if local_layers not in LOCAL_LAYER_LAYOUTS:
    raise ValueError(f"local_layers must be one of {LOCAL_LAYER_LAYOUTS}; got {local_layers!r}")
  rings = ring_layers(model, max_len) if local_layers == "ring" else []
  rest = model
  if rings:  # the kind builds the global layers only (builders read `model.layers`)
    rest = types.SimpleNamespace(
        layers=[layer for i, layer in enumerate(model.layers) if i not in rings],
        dtype=getattr(model, "dtype", None))
  try:
    built = CACHE_KIND_TABLE[kind].build(rest, batch, max_len, dtype, options, tokens) \
        if rest is model or rest.layers else ()
  except ValueError as e:
    raise ValueError(f"{where} (kind {kind!r}, options {options}): {e}") from e
  if not rings:
    return built
  built = iter(built)
  return tuple(
      window_lib.RingKVCache.init(batch, layer.attn.window, layer.attn.num_kv_heads,
                                  layer.attn.head_dim, dtype) if i in rings else next(built)
      for i, layer in enumerate(model.layers))


def cache_factory_from_config(model, cache: Any, *, tokens_per_seq: Iterable[int] | None = None,
                              where: str = "cache", local_layers: str = "full") -> CacheFactory:
  """A `CacheFactory` (`kvattn.generate(cache_factory=)`) building `build_caches(..., cache)`.

  The spec is checked and the caches' sizes validated now (one sequence of one
  token is built), so a bad config fails before any work.

  Usage: `kvattn.generate(model, prompts, lengths, n,
  cache_factory=cache_factory_from_config(model, config.cache))`; `local_layers` as in
  `build_caches` ("ring": the per-layer layout).

  Raises:
    ValueError: an unknown kind, an option the kind does not take, a missing or bad
      option -- the message names `<where>.<key>`.
  """
  kind, options = cache_options(cache, where)
  spec = {"kind": kind, **options}
  tokens = None if tokens_per_seq is None else [int(t) for t in tokens_per_seq]
  if tokens is None:
    build_caches(model, 1, 1, None, spec, where=where, local_layers=local_layers)

  def factory(batch: int, max_len: int, dtype: Any = None) -> tuple[Any, ...]:
    return build_caches(model, batch, max_len, dtype, spec, tokens_per_seq=tokens, where=where,
                        local_layers=local_layers)

  return factory



BOUNDED_KINDS = ("ring", "sink") + eviction.POLICIES
"""Kinds whose capacity is fixed whatever the sequence length (window or budget)."""


def spec_at_budget(kind: str, budget: int | None, *, num_sinks: int = 4) -> dict[str, Any]:
  """The spec of `kind` holding `budget` tokens per sequence (and KV head), for sweeps that
  compare kinds at one memory budget: an unbounded kind ("dense", "paged", ...) ignores
  `budget` (its options at their defaults); "ring" keeps a window of
  `budget`; "sink" `num_sinks` sinks plus a window of `budget - num_sinks`; an eviction
  policy `budget` slots (its other options at their defaults).

  Raises:
    ValueError: an unknown kind; for a bounded kind a budget that is not a positive int
      (an int > num_sinks for "sink").
  """
  if kind not in CACHE_KIND_TABLE:
    raise ValueError(f"kind must be one of {tuple(CACHE_KIND_TABLE)}; got {kind!r}")
  if kind not in BOUNDED_KINDS and kind not in eviction.POLICY_TABLE:
    return {"kind": kind}
  budget = _checks.positive_int("budget", budget)
  if kind == "ring":
    return {"kind": "ring", "window": budget}
  if kind == "sink":
    if budget <= num_sinks:
      raise ValueError(f"budget must be > num_sinks = {num_sinks} for kind 'sink'; got {budget}")
    return {"kind": "sink", "num_sinks": num_sinks, "window": budget - num_sinks}
  return {"kind": kind, "budget": budget}
