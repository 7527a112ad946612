"""Cache factories: the caches of a whole model, for `kvattn.generate(cache_factory=)`.

A cache factory is `(batch, max_len, dtype) -> per-layer caches`
(`CacheFactory`); `generate` calls it instead of `model.init_caches` (the
dense default). Here: paged caches for every layer of a model
(`init_paged_caches`, `paged_cache_factory`) and the `cache.kind` switch of
the experiment configs (`cache_factory_from_config`); bounded long-context
caches chosen by a policy dict (`policy_caches`, `policy_cache_factory`:
`kvattn.caches.long_context`'s ring, sink and eviction kinds).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterable, Mapping, Sequence

import jax.numpy as jnp

from kvattn import _checks
from kvattn.caches import length_switch
from kvattn.caches import long_context
from kvattn.paging.allocator import PageAllocator, pages_for
from kvattn.caches.paged import PagedKVCache

CacheFactory = Callable[[int, int, Any], Sequence[Any]]
"""`(batch, max_len, dtype) -> one cache per layer` (dtype None: the model's)."""

def gqa_layers(model) -> list[Any]:
  """The attention modules of `model.layers[i].attn`; ValueError for non-GQA layers."""
  layers = getattr(model, "layers", None)
  if layers is None:
    raise TypeError(f"model must have .layers with an .attn each (a kvattn.Transformer); got "
                    f"{type(model).__name__}")
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


def paged_cache_factory(model, *, page_size: int = 16, tokens_per_seq: Iterable[int] | None = None,
                        seed: int | None = None):
  """A `cache_factory(batch, max_len, dtype)` for `kvattn.generate` that builds
  paged caches (`init_paged_caches`).

  With `tokens_per_seq` each sequence gets only its own pages; without it
  every sequence gets `ceil(max_len / page_size)` pages.
  """
  page_size = _checks.positive_int("page_size", page_size)
  wanted = None if tokens_per_seq is None else [int(t) for t in tokens_per_seq]

  def factory(batch: int, max_len: int, dtype: Any = None) -> tuple[PagedKVCache, ...]:
    tokens = [max_len] * batch if wanted is None else wanted
    if len(tokens) != batch:
      raise ValueError(f"tokens_per_seq must have one entry per sequence ({batch}); got "
                       f"{len(tokens)}")
    return init_paged_caches(model, tokens, page_size=page_size, max_len=max_len, dtype=dtype,
                             seed=seed)[0]

  return factory


# ----------------------------------------------------------------------------------------------
# The `cache.kind` switch of the configs: a table of kinds.

REQUIRED = object()
"""The default of a `CacheKind` option the config must set."""


@dataclasses.dataclass(frozen=True)
class CacheKind:
  """One `cache.kind` value: its options and how it builds a cache factory.

  Attributes:
    build: `(model, options, tokens_per_seq) -> CacheFactory | None` (None:
      `generate`'s default dense caches); `options` holds every option of
      `options` below, defaults filled in, None where the kind's own default
      applies.
    options: option name -> default (`REQUIRED`: the config must set it).
    doc: one line for error messages and docs.
  """

  build: Callable[[Any, dict[str, Any], Sequence[int] | None], CacheFactory | None]
  options: Mapping[str, Any]
  doc: str


def _policy_kind(kind: str) -> Callable[..., CacheFactory]:
  """The `CacheKind.build` of a long-context kind: `policy_cache_factory` of its options."""

  def build(model, options, tokens_per_seq):
    del tokens_per_seq  # bounded kinds: the capacity is the window / budget
    policy = {k: v for k, v in options.items() if v is not None}
    return policy_cache_factory(model, {"kind": kind, **policy})

  return build


CACHE_KIND_TABLE: dict[str, CacheKind] = {
    "dense": CacheKind(lambda model, options, tokens_per_seq: None, {},
                       "model.init_caches: dense KVCache / LatentCache of max_len"),
    "paged": CacheKind(
        lambda model, o, tokens_per_seq: paged_cache_factory(
            model, page_size=o["page_size"], tokens_per_seq=tokens_per_seq, seed=o["seed"]),
        {"page_size": 16, "seed": None}, "PagedKVCache pages per sequence (paged_cache_factory)"),
    "ring": CacheKind(_policy_kind("window"), {"window": REQUIRED},
                      "RingKVCache: the last `window` tokens (sliding-window attention)"),
    "sink": CacheKind(_policy_kind("sink"), {"num_sinks": 4, "window": REQUIRED},
                      "SinkKVCache: StreamingLLM, `num_sinks` first tokens + a ring of `window`"),
    **{policy: CacheKind(_policy_kind(policy),
                         {"budget": REQUIRED, "num_sinks": None,
                          **{o: None for o in long_context.POLICY_OPTIONS[policy]}},
                         f"EvictingKVCache(policy={policy!r}): `budget` slots per KV head")
       for policy in long_context.POLICIES},
    "length_switch": CacheKind(
        lambda model, o, tokens_per_seq: length_switch_cache_factory(
            model, switch_length=o["switch_length"], num_kv_heads_after=o["num_kv_heads_after"]),
        {"switch_length": REQUIRED, "num_kv_heads_after": REQUIRED},
        "LengthSwitchKVCache: K heads up to switch_length, then num_kv_heads_after pooled heads"),
}
"""`cache.kind` -> `CacheKind`. "ring", "sink" and the eviction policies of
`kvattn.caches.long_context` take their sizes from the config (None: the policy's
default, e.g. H2O's recent window of budget // 2). Add a kind with one entry
(`register_cache_kind`)."""

CACHE_KINDS = tuple(CACHE_KIND_TABLE)
"""The `cache.kind` values when this module was imported (the table may grow)."""


def register_cache_kind(name: str, kind: CacheKind) -> None:
  """Adds `name` to `CACHE_KIND_TABLE`; ValueError when it is taken."""
  if not isinstance(name, str) or not name or name in CACHE_KIND_TABLE:
    raise ValueError(f"cache kind name must be a new non-empty string; got {name!r} (taken: "
                     f"{tuple(CACHE_KIND_TABLE)})")
  CACHE_KIND_TABLE[name] = kind


def cache_options(cache_config: Any, where: str = "cache") -> tuple[str, dict[str, Any]]:
  """`(kind, options)` of a `cache` config section, checked against `CACHE_KIND_TABLE`.

  `cache_config`: a ConfigDict or mapping with `kind` and that kind's options;
  a key set to None counts as unset (flat ml_collections schemas keep every
  key), so defaults fill it. `max_len` and `dtype` are the experiments' own
  keys and are ignored here.

  Raises:
    ValueError: an unknown kind, a key the kind does not take, a required
      option unset -- naming `<where>.<key>`.
  """
  if hasattr(cache_config, "to_dict"):
    cache_config = cache_config.to_dict()
  if not isinstance(cache_config, Mapping):
    raise TypeError(f"{where} must be a dict or ConfigDict with a 'kind'; got "
                    f"{type(cache_config).__name__}")
  kind = cache_config.get("kind")
  if kind not in CACHE_KIND_TABLE:
    raise ValueError(f"{where}.kind must be one of {tuple(CACHE_KIND_TABLE)}; got {kind!r}")
  spec = CACHE_KIND_TABLE[kind]
  given = {k: v for k, v in cache_config.items()
           if k not in ("kind",) + EXPERIMENT_CACHE_KEYS and v is not None}
  unknown = sorted(set(given) - set(spec.options))
  if unknown:
    raise ValueError(f"{where}.{unknown[0]} is not an option of {where}.kind = {kind!r} (it takes "
                     f"{tuple(spec.options)}); got {where}.{unknown[0]} = {given[unknown[0]]!r}")
  options = {**spec.options, **given}
  missing = [k for k, v in options.items() if v is REQUIRED]
  if missing:
    raise ValueError(f"{where}.{missing[0]} must be set for {where}.kind = {kind!r} "
                     f"({spec.doc})")
  return kind, options


EXPERIMENT_CACHE_KEYS = ("max_len", "dtype")
"""Keys of experiment `cache` sections that are not options of a kind."""


def cache_factory_from_config(model, cache_config, *, tokens_per_seq: Iterable[int] | None = None,
                              where: str = "cache") -> CacheFactory | None:
  """The `cache.kind` switch: the cache factory of a config's `cache` section.

  `cache_config.kind` is a key of `CACHE_KIND_TABLE`: "dense" -> None
  (`generate`'s default dense caches); "paged" -> `paged_cache_factory(model,
  page_size=, seed=, tokens_per_seq=)`; "ring" (`window`), "sink" (`num_sinks`,
  `window`) and each eviction policy of `kvattn.caches.long_context` (`budget` and the
  policy's options: `recent_size`, `window_size`, `kernel_size`, `seed`,
  `num_sinks`) -> `policy_cache_factory`. The options are checked and the
  caches' sizes validated now.

  Usage: `kvattn.generate(model, prompts, lengths, n,
  cache_factory=cache_factory_from_config(model, config.cache))`.

  Raises:
    ValueError: an unknown kind, an option the kind does not take, a missing
      or bad option -- the message names `<where>.<key>`.
  """
  kind, options = cache_options(cache_config, where)
  tokens = None if tokens_per_seq is None else [int(t) for t in tokens_per_seq]
  try:
    return CACHE_KIND_TABLE[kind].build(model, options, tokens)
  except ValueError as e:
    raise ValueError(f"{where} (kind {kind!r}, options {options}): {e}") from e


# ----------------------------------------------------------------------------------------------
# Long-context policies (kvattn.caches.long_context): bounded caches chosen by name.

POLICY_KINDS = ("full", "window", "sink") + long_context.POLICIES + ("length_switch",)
"""`policy["kind"]` values: "full" (dense `KVCache` of max_len), "window"
(`RingKVCache`, key `window`), "sink" (`SinkKVCache`, keys `num_sinks`,
`window`), an eviction policy name (`EvictingKVCache`, key `budget` plus the
policy's options), or "length_switch" (`kvattn.caches.length_switch.LengthSwitchKVCache`
of max_len, keys `switch_length`, `num_kv_heads_after`)."""


def _policy_dict(policy: Any) -> dict[str, Any]:
  if hasattr(policy, "to_dict"):  # an ml_collections ConfigDict
    policy = policy.to_dict()
  if not isinstance(policy, Mapping):
    raise TypeError(f"policy must be a dict with a 'kind' (one of {POLICY_KINDS}); got "
                    f"{type(policy).__name__}")
  policy = dict(policy)
  kind = policy.pop("kind", None)
  if kind not in POLICY_KINDS:
    raise ValueError(f"policy['kind'] must be one of {POLICY_KINDS}; got {kind!r}")
  return {"kind": kind, **policy}


def _policy_keys(policy: dict[str, Any], required: tuple[str, ...]) -> list[Any]:
  kind = policy["kind"]
  extra = sorted(set(policy) - set(required) - {"kind"})
  missing = [key for key in required if key not in policy]
  if missing or extra:
    raise ValueError(f"policy kind {kind!r} takes exactly the keys {required}; missing "
                     f"{missing}, unknown {extra}")
  return [policy[key] for key in required]


def policy_caches(model, batch: int, max_len: int, dtype: Any, policy: Any) -> tuple[Any, ...]:
  """One empty cache per layer of `model` for a long-context `policy` dict.

  `policy`: `{"kind": "full"}` (dense caches of `max_len`), `{"kind": "window",
  "window": W}`, `{"kind": "sink", "num_sinks": s, "window": W}`, or
  `{"kind": <eviction policy>, "budget": n, **options}` (`kvattn.caches.long_context`).
  The bounded kinds ignore `max_len`: their capacity is the window / budget.

  Raises:
    ValueError: an unknown kind, missing or unknown keys, bad sizes, an MLA layer.
    TypeError: a policy that is not a dict.
  """
  policy = _policy_dict(policy)
  kind = policy["kind"]
  dtype = getattr(model, "dtype", jnp.float32) if dtype is None else dtype
  if kind == "full":
    _policy_keys(policy, ())
    return tuple(layer.attn.init_cache(batch, max_len, dtype) for layer in model.layers)
  if kind == "length_switch":
    switch_length, after = _policy_keys(policy, ("switch_length", "num_kv_heads_after"))
    return length_switch_caches(model, batch, max_len, dtype, switch_length=switch_length,
                                num_kv_heads_after=after)
  attns = gqa_layers(model)
  if kind == "window":
    (window,) = _policy_keys(policy, ("window",))
    return tuple(long_context.RingKVCache.init(batch, window, a.num_kv_heads, a.head_dim, dtype)
                 for a in attns)
  if kind == "sink":
    num_sinks, window = _policy_keys(policy, ("num_sinks", "window"))
    return tuple(long_context.SinkKVCache.init(batch, num_sinks, window, a.num_kv_heads,
                                               a.head_dim, dtype, rope_theta=a.rope_theta,
                                               rope_scaling=a.rope_scaling)
                 for a in attns)
  options = dict(policy)
  del options["kind"]
  if "budget" not in options:
    raise ValueError(f"policy kind {kind!r} needs a 'budget'; got keys {sorted(policy)}")
  budget = options.pop("budget")
  return tuple(long_context.EvictingKVCache.init(batch, budget, a.num_kv_heads, a.head_dim,
                                                 dtype, policy=kind, **options)
               for a in attns)


def policy_cache_factory(model, policy: Any) -> CacheFactory:
  """A `cache_factory(batch, max_len, dtype)` for `kvattn.generate` that builds
  `policy_caches(model, ..., policy)`; the policy is validated now (ValueError)."""
  checked = _policy_dict(policy)
  policy_caches(model, 1, 1, None, checked)  # validates sizes and options up front

  def factory(batch: int, max_len: int, dtype: Any = None) -> tuple[Any, ...]:
    return policy_caches(model, batch, max_len, dtype, checked)

  return factory


# ----------------------------------------------------------------------------------------------
# Length switch (kvattn.caches.length_switch): K KV heads up to a length, pooled heads after it.


def length_switch_caches(model, batch: int, max_len: int, dtype: Any = None, *,
                         switch_length: int, num_kv_heads_after: int):
  """One empty `LengthSwitchKVCache` per layer of `model` (all layers GQA).

  Raises:
    ValueError: an MLA layer; `num_kv_heads_after` not dividing a layer's K;
      `switch_length` not a positive int; bad sizes.
  """
  dtype = getattr(model, "dtype", jnp.float32) if dtype is None else dtype
  return tuple(length_switch.LengthSwitchKVCache.init(
      batch, max_len, a.num_kv_heads, a.head_dim, dtype, switch_length=switch_length,
      num_kv_heads_after=num_kv_heads_after) for a in gqa_layers(model))


def length_switch_cache_factory(model, *, switch_length: int,
                                num_kv_heads_after: int) -> CacheFactory:
  """A `cache_factory(batch, max_len, dtype)` for `kvattn.generate` building
  `length_switch_caches`; the settings are checked now (ValueError)."""
  for a in gqa_layers(model):
    length_switch.check_switch(a.num_kv_heads, num_kv_heads_after, switch_length)

  def factory(batch: int, max_len: int, dtype: Any = None):
    return length_switch_caches(model, batch, max_len, dtype, switch_length=switch_length,
                                num_kv_heads_after=num_kv_heads_after)

  return factory
