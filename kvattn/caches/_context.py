"""Context compression for the evicting caches: kvpress's "compress at prefill, then grow".

kvpress (NVIDIA, `kvpress` 0.5.5, `ScorerPress.compress`) scores the context's keys once, at
prefill, keeps `int(n_context * (1 - compression_ratio))` of them per KV head, and then appends
the question and the answer uncompressed. `EvictingKVCache(compress="context")` does the same
under jit with per-sequence lengths: a row's first write is its context (every row of the
cache's first `update` / `update_attend` call, 0 tokens included); later writes append. These
are the pieces that do not depend on the cache: the kept count (exactly kvpress's
`max(1, int(n * (1 - ratio)))`, in float64), the option checks of the cache
spec, and the slots a sequence needs.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kvattn import _checks

MODES = ("fixed", "context")
"""`compress` of an eviction kind: "fixed" (a budget of slots held forever, evicting on every
write past it) or "context" (the first write is compressed, later writes appended)."""


SPEC_OPTIONS = {"budget": None, "compress": "fixed", "compression_ratio": None}
"""The options a kind built on `EvictingKVCache` adds to its `CacheKind` for this protocol
(`budget` is then required by `check_spec` with "fixed" only)."""


def split_options(options: dict[str, Any], max_len: int) -> tuple[Any, dict[str, Any],
                                                                  dict[str, Any]]:
  """`(budget, mode, rest)` of a builder's options: `EvictingKVCache.init(batch, budget, ...,
  **mode, **rest)` (`mode` empty for "fixed"; for "context" the compress keywords and
  `capacity=max_len`), `rest` the other options set."""
  compress = options.get("compress") or "fixed"
  rest = {k: v for k, v in options.items() if k not in SPEC_OPTIONS and v is not None}
  mode = {} if compress == "fixed" else {
      "compress": compress, "compression_ratio": options.get("compression_ratio"),
      "capacity": max_len}
  return options.get("budget"), mode, rest


def kind_slots(options: dict[str, Any], context_lengths, total_lengths) -> int | None:
  """`CacheKind.slots` of such a kind: `slots_needed` with "context", None with "fixed"."""
  if (options.get("compress") or "fixed") == "fixed":
    return None
  return slots_needed(options, context_lengths, total_lengths)


def check_ratio(name: str, ratio: Any) -> float | None:
  """`ratio` as a float in [0, 1), or None; ValueError naming `name` otherwise."""
  if ratio is None:
    return None
  if isinstance(ratio, bool) or not isinstance(ratio, (int, float, np.integer, np.floating)) \
      or not 0.0 <= float(ratio) < 1.0 or math.isnan(float(ratio)):
    raise ValueError(f"{name} must be a float in [0, 1) (the fraction of the context's tokens "
                     f"dropped, as kvpress's compression_ratio); got {ratio!r}")
  return float(ratio)


def check_mode(name: str, compress: Any) -> str:
  """`compress` if it is one of `MODES`; ValueError naming `name` otherwise."""
  if compress not in MODES:
    raise ValueError(f"{name} must be one of {MODES}; got {compress!r}")
  return compress


def check_spec(options: dict[str, Any], where: str) -> None:
  """Checks an eviction kind's spec options (`registry.CacheKind.check`).

  "fixed" needs `budget` and takes no `compression_ratio`; "context" needs `budget` (the most
  context tokens kept) or `compression_ratio` (or both: the smaller count).

  Raises:
    ValueError: naming `<where>.<key>` and the value.
  """
  compress = check_mode(f"{where}.compress", options.get("compress") or "fixed")
  ratio = check_ratio(f"{where}.compression_ratio", options.get("compression_ratio"))
  budget = options.get("budget")
  if compress == "fixed":
    if budget is None:
      raise ValueError(f"{where}.budget must be set for compress='fixed' (slots per sequence "
                       f"and KV head); got None")
    if ratio is not None:
      raise ValueError(f"{where}.compression_ratio is an option of compress='context' only; "
                       f"got {where}.compression_ratio = {ratio!r} with compress='fixed'")
  elif budget is None and ratio is None:
    raise ValueError(f"{where}.budget or {where}.compression_ratio must be set for "
                     f"compress='context' (how many context tokens each sequence keeps)")


def kept_count(num_context: int, ratio: float | None, budget: int | None) -> int:
  """Context tokens a sequence keeps: `max(1, int(n * (1 - ratio)))` for n >= 1 (kvpress
  0.5.5's `compute_n_kept`, float64), at most `budget`; `n` without either; 0 for n = 0."""
  kept = int(num_context)
  if ratio is not None and kept > 0:
    kept = max(1, int(num_context * (1 - ratio)))
  if budget is not None:
    kept = min(kept, int(budget))
  return kept


def kept_counts(new_lengths: jax.Array, num_tokens: int, ratio: float | None,
                budget: int | None) -> jax.Array:
  """`i32[B]`: `kept_count` of `new_lengths: i32[B]` (each in `[0, num_tokens]`), traced.

  The counts come from a static table of `num_tokens + 1` entries computed in Python, so they
  equal kvpress's float64 `max(1, int(n * (1 - ratio)))` exactly (f32 arithmetic differs at
  boundaries, e.g. `int(10 * (1 - 0.3)) == 7`).
  """
  table = np.array([kept_count(n, ratio, budget) for n in range(num_tokens + 1)], np.int32)
  return jnp.asarray(table)[jnp.clip(new_lengths, 0, num_tokens)]


def slots_needed(options: dict[str, Any], context_lengths: np.ndarray,
                 total_lengths: np.ndarray) -> int:
  """Slots per sequence a context-compressing cache needs: the most, over rows, of the kept
  context plus everything after it (`total_lengths - context_lengths` tokens), at least 1.

  Args:
    options: the spec's options (`compression_ratio`, `budget`).
    context_lengths, total_lengths: `int[B]` tokens of each row's context and in all.
  """
  ratio, budget = options.get("compression_ratio"), options.get("budget")
  need = [kept_count(int(c), ratio, budget) + int(t) - int(c)
          for c, t in zip(np.asarray(context_lengths), np.asarray(total_lengths))]
  return max([1, *need])


def check_context_lengths(context_lengths: Any, prompt_lengths: np.ndarray) -> np.ndarray:
  """`context_lengths` as `int[B]` in `[0, prompt_lengths[b]]` (host).

  Raises:
    TypeError: a traced or non-integer array.
    ValueError: a wrong shape or a value outside its row's range, naming the row.
  """
  if isinstance(context_lengths, jax.core.Tracer):
    raise TypeError("context_lengths must be concrete (generate validates on the host); got a "
                    "tracer")
  arr = np.asarray(context_lengths)
  if not np.issubdtype(arr.dtype, np.integer):
    raise TypeError(f"context_lengths must have an integer dtype; got {arr.dtype}")
  if arr.shape != prompt_lengths.shape:
    raise ValueError(f"context_lengths must have shape [B] = {prompt_lengths.shape}; got "
                     f"{arr.shape}")
  bad = (arr < 0) | (arr > prompt_lengths)
  if bad.any():
    b = int(np.argwhere(bad)[0][0])
    raise ValueError(f"context_lengths[{b}] = {int(arr[b])} must lie in [0, prompt_lengths[{b}] "
                     f"= {int(prompt_lengths[b])}] (the first context_lengths[b] prompt tokens "
                     f"are the context)")
  return arr.astype(np.int32)


def positive_capacity(capacity: Any) -> int:
  """The storage slots of a context-compressing cache (a positive int); ValueError for None."""
  if capacity is None:
    raise ValueError("capacity must be set for compress='context' (slots per sequence and KV "
                     "head: the kept context plus everything after it; slots_needed)")
  return _checks.positive_int("capacity", capacity)
