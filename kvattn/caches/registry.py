"""The cache registry: every cache kind by name, and the caches of a whole model."""

from __future__ import annotations

import dataclasses
import sys
import types
from typing import Any, Callable, Iterable, Mapping, Sequence

import jax.numpy as jnp

from kvattn import _checks
from kvattn.caches._layers import cache_owners, gqa_layers, ring_layers  # noqa: F401  (public)

CacheFactory = Callable[[int, int, Any], Sequence[Any]]
"""`(batch, max_len, dtype) -> one cache per layer` (dtype None: the model's)."""


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
    at_budget: bounded kinds: `(budget, num_sinks) -> options` holding `budget` tokens per
      sequence (`spec_at_budget`); None: the capacity grows with `max_len`.
    pool: pageable kinds: `(options, *, max_len, page_size, prefix_cache) -> PoolPlan`
      (`kvattn.caches.paged.PoolPlan`); None: fixed rows per sequence.
    float_only: no int8 / fp8 storage (building one is a TypeError).
    check: `(options, where) -> None`, raising ValueError naming `<where>.<key>` for options
      that do not go together (run by `cache_options` after the defaults are filled in);
      None: none.
    slots: `(options, context_lengths int[B], total_lengths int[B]) -> int | None`, the slots
      per sequence `max_len` must give when each row's first `context_lengths[b]` of
      `total_lengths[b]` tokens are a context the kind compresses (`slots_needed`;
      `generate(context_lengths=)`); None (or a None result): `max(total_lengths)`.
  """

  build: Builder
  options: Mapping[str, Any]
  doc: str
  at_budget: Callable[[int, int], dict[str, Any]] | None = None
  pool: Callable[..., Any] | None = None
  float_only: bool = False
  check: Callable[[dict[str, Any], str], None] | None = None
  slots: Callable[..., int | None] | None = None

  @property
  def bounded(self) -> bool:
    """Capacity fixed whatever the sequence length (window, budget)."""
    return self.at_budget is not None

  @property
  def pageable(self) -> bool:
    """Built as page pools a serving loop schedules (`pool`)."""
    return self.pool is not None


CACHE_KIND_TABLE: dict[str, CacheKind] = {}
"""Cache kind -> `CacheKind`; each kind's file registers itself (`register_cache_kind`)."""


def register_cache_kind(name: str, kind: CacheKind) -> None:
  """Adds `name` to `CACHE_KIND_TABLE`; ValueError when it is taken."""
  if not isinstance(name, str) or not name or name in CACHE_KIND_TABLE:
    raise ValueError(f"cache kind name must be a new non-empty string; got {name!r} (taken: "
                     f"{tuple(CACHE_KIND_TABLE)})")
  if not isinstance(kind, CacheKind):
    raise TypeError(f"kind must be a CacheKind; got {type(kind).__name__}")
  CACHE_KIND_TABLE[name] = kind


EXPERIMENT_CACHE_KEYS = ("max_len", "dtype")
"""Keys of experiment `cache` sections that are not options of a kind."""


def cache_options(spec: Any, where: str = "cache") -> tuple[str, dict[str, Any]]:
  """`(kind, options)` of a cache spec, checked against `CACHE_KIND_TABLE`.

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
  if entry.check is not None:
    entry.check(options, where)
  return kind, options


def slots_needed(cache: Any, context_lengths: Any, total_lengths: Any) -> int | None:
  """The slots per sequence (`max_len`) the kind of spec `cache` needs when each row b holds
  `total_lengths[b]` tokens whose first `context_lengths[b]` are a context (kvpress's
  protocol): for a context-compressing eviction kind its kept context plus the rest
  (`CacheKind.slots`); None for every other kind (`max(total_lengths)` for a growing one).

  Raises:
    ValueError: as `cache_options`.
  """
  kind, options = cache_options(cache)
  hook = CACHE_KIND_TABLE[kind].slots
  if hook is None:
    return None
  need = hook(options, [int(c) for c in context_lengths], [int(t) for t in total_lengths])
  return None if need is None else int(need)


LOCAL_LAYER_LAYOUTS = ("full", "ring")
"""`local_layers` of `build_caches`: "full" (every layer the chosen kind) or "ring" (the
per-layer layout: a layer with a sliding window shorter than max_len gets a ring of `window`
slots)."""


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
      window W < max_len; every windowed layer for a kind with `compress="context"`, whose
      sequences see more tokens than its slots) gets a `RingKVCache` of W slots in `dtype` --
      exact for that
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
  # A context-compressing kind holds fewer slots than the tokens its sequence sees (the kept
  # context plus the rest): every windowed layer gets its ring then, whatever max_len.
  seen = max_len if options.get("compress") != "context" else sys.maxsize
  rings = ring_layers(model, seen) if local_layers == "ring" else []
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
  ring = CACHE_KIND_TABLE["ring"].build
  return tuple(
      ring(types.SimpleNamespace(layers=[layer]), batch, max_len, dtype,
           {"window": layer.attn.window}, None)[0] if i in rings else next(built)
      for i, layer in enumerate(model.layers))


def cache_factory_from_config(model, cache: Any, *, tokens_per_seq: Iterable[int] | None = None,
                              where: str = "cache", local_layers: str = "full") -> CacheFactory:
  """A `CacheFactory` (`kvattn.generate(cache_factory=)`) building `build_caches(..., cache)`;
  its attribute `spec` is the checked spec (`generate(context_lengths=)` sizes it by
  `slots_needed`).

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

  factory.spec = spec  # read by `generate(context_lengths=)` to size the caches (`slots_needed`)
  return factory



def bounded_kinds() -> tuple[str, ...]:
  """The registered kinds whose capacity is fixed whatever the sequence length."""
  return tuple(k for k, v in CACHE_KIND_TABLE.items() if v.bounded)


def spec_at_budget(kind: str, budget: int | None, *, num_sinks: int = 4) -> dict[str, Any]:
  """The spec of `kind` holding `budget` tokens per sequence (and KV head): a growing kind
  ignores `budget` (its options at their defaults); a bounded kind's `CacheKind.at_budget`
  gives its options (ring: a window of `budget`; sink: `num_sinks` sinks plus a window of
  `budget - num_sinks`; an eviction policy: `budget` slots).

  Raises:
    ValueError: an unknown kind; for a bounded kind a budget that is not a positive int
      (an int > num_sinks for "sink").
  """
  if kind not in CACHE_KIND_TABLE:
    raise ValueError(f"kind must be one of {tuple(CACHE_KIND_TABLE)}; got {kind!r}")
  entry = CACHE_KIND_TABLE[kind]
  if not entry.bounded:
    return {"kind": kind}
  return {"kind": kind, **entry.at_budget(_checks.positive_int("budget", budget), num_sinks)}


_MOVED = {"init_paged_caches": "kvattn.caches.paged", "register_eviction_policy":
          "kvattn.caches.eviction", "eviction_kind": "kvattn.caches.eviction"}


def __getattr__(name):
  if name == "CACHE_KINDS":  # the kinds registered now
    return tuple(CACHE_KIND_TABLE)
  if name in _MOVED:
    import importlib  # pylint: disable=g-import-not-at-top
    return getattr(importlib.import_module(_MOVED[name]), name)
  raise AttributeError(f"module 'kvattn.caches.registry' has no attribute {name!r}")
