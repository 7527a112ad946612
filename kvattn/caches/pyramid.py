"""PyramidKV: a per-layer budget schedule over evicting caches.

PyramidKV (Cai et al. 2024, "PyramidKV: Dynamic KV Cache Compression based on Pyramidal
Information Funneling", arXiv 2406.02069, §3.2): lower layers spread their attention widely,
upper layers concentrate it on few tokens, so the lower layers get large budgets and the upper
ones small, decreasing arithmetically, with the same total as a uniform budget over the layers.
Each layer is an `EvictingKVCache` (SnapKV's scores by default, as the paper) of its own budget,
so the bytes held differ per layer and sum to the uniform total (or `ratio` of it).

The schedule (`layer_budgets`): every layer keeps the policy's protected slots (`num_sinks` plus
its observation / recent window, as the paper keeps the observation window in every layer), and
the rest `R = ratio * budget * L - L * protected` is shared out as the paper's Eq.: the top layer
gets `k[L-1] = R / (beta L)`, the bottom `k[0] = 2 R / L - k[L-1]`, and the layers between the
arithmetic sequence `k[l] = k[0] - (k[0] - k[L-1]) l / (L - 1)` (mean `R / L`). Rounded down,
the remaining slots go one each to the layers with the largest fractional parts (lower layers
first on ties), so the integer budgets sum to exactly `R`.

Context compression (`compress="context"`, kvpress's protocol, `PyramidKVPress`): each layer is
an `EvictingKVCache(compress="context")` whose first write (the context) keeps the count
`context_layer_budgets` gives it and whose later writes are appended. That schedule is
kvpress 0.5.5's `PyramidKVPress.get_layer_budget` (from the paper's code, KVCache-Factory) at a
context of `context_tokens` tokens: mean `n (1 - ratio)` per layer, the top layer `1 / beta` of
it, the bottom capped at `n - window_size` (the excess moved to the top), and the uniform count
`round(n (1 - ratio))` when the top would fall below the window. kvpress computes it from each
row's own context length; here it is computed once per cache, at `context_tokens` (a row with
a shorter context keeps at most its whole context per layer).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from kvattn import _checks
from kvattn.caches import registry
from kvattn.caches._layers import gqa_layers
from kvattn.caches.eviction import POLICY_TABLE, EvictingKVCache

DEFAULT_POLICY = "snapkv"
DEFAULT_BETA = 20.0
"""The paper's beta: the top layer gets `1 / beta` of the mean share (its code's default 20)."""

_POLICY_OPTIONS = ("num_sinks", "window_size", "kernel_size", "recent_size", "seed")
"""Options passed through to the layers' policy (the built-in policies' options)."""


def _check_ratio(ratio: Any) -> float:
  if isinstance(ratio, bool) or not isinstance(ratio, (int, float, np.integer, np.floating)) \
      or not 0 < float(ratio) <= 1:
    raise ValueError(f"ratio must be a number in (0, 1] (the share of the uniform total "
                     f"budget * num_layers); got {ratio!r}")
  return float(ratio)


def _check_beta(beta: Any) -> float:
  if isinstance(beta, bool) or not isinstance(beta, (int, float, np.integer, np.floating)) \
      or not math.isfinite(float(beta)) or float(beta) < 1:
    raise ValueError(f"beta must be a finite number >= 1 (1: uniform budgets); got {beta!r}")
  return float(beta)


def layer_budgets(num_layers: int, budget: int, *, protected: int = 0,
                  minimum: int = 1, beta: float = DEFAULT_BETA,
                  ratio: float = 1.0) -> tuple[int, ...]:
  """PyramidKV's budget per layer, lowest layer first (module docstring: the schedule).

  Args:
    num_layers: L, the layers sharing the total.
    budget: the uniform budget (slots per sequence and KV head) it replaces.
    protected: slots every layer keeps before the schedule (sinks + observation window).
    minimum: the fewest slots a layer may get (`num_sinks + 1` for an evicting cache).
    beta: the top layer gets `1 / beta` of the mean share; 1 gives uniform budgets.
    ratio: the total is `floor(ratio * budget * L)` slots.

  Returns:
    `tuple[int]` of L budgets, non-increasing, summing to `floor(ratio * budget * L)`.

  Raises:
    ValueError: a size that is not a positive int, `ratio` outside (0, 1], `beta` < 1, a total
      below `L * protected`, or a layer below `minimum` -- naming the option.
  """
  num_layers = _checks.positive_int("num_layers", num_layers)
  budget = _checks.positive_int("budget", budget)
  ratio, beta = _check_ratio(ratio), _check_beta(beta)
  total = math.floor(ratio * budget * num_layers + 1e-9)
  rest = total - num_layers * protected
  if rest < 0:
    raise ValueError(f"budget * ratio ({budget} * {ratio}) must leave every layer its "
                     f"{protected} protected slots (sinks + window); got a total of {total} "
                     f"for {num_layers} layers")
  if num_layers == 1:
    shares = np.array([float(rest)])
  else:
    top = rest / (beta * num_layers)
    bottom = 2 * rest / num_layers - top
    shares = bottom - (bottom - top) * np.arange(num_layers) / (num_layers - 1)
  floors = np.floor(shares + 1e-9).astype(np.int64)
  extra = rest - int(floors.sum())
  order = sorted(range(num_layers), key=lambda i: (-(shares[i] - floors[i]), i))
  floors[order[:extra]] += 1
  out = tuple(int(protected + s) for s in floors)
  if min(out) < minimum:
    raise ValueError(f"budget {budget} with beta {beta} and ratio {ratio} gives the top layer "
                     f"{min(out)} slots, below the {minimum} it needs (num_sinks + 1): raise "
                     f"budget or lower beta")
  return out


def context_layer_budgets(num_layers: int, context_tokens: int, compression_ratio: float, *,
                          window_size: int, beta: float = DEFAULT_BETA) -> tuple[int, ...]:
  """Context tokens each layer keeps under kvpress's protocol, lowest layer first (module doc).

  kvpress 0.5.5's `PyramidKVPress.get_layer_budget` for a context of n = `context_tokens`:
  mean `m = n (1 - compression_ratio)`, `min_num = m / beta`, `max_num = 2 m - min_num`; when
  `max_num >= n - window_size`, `max_num = n - window_size` and `min_num = 2 m - max_num`; when
  not `n >= max_num >= min_num >= window_size`, every layer keeps `max(1, round(m))` (SnapKV);
  else layer l keeps `round(max_num - l (max_num - min_num) / (L - 1))` (Python's round, half
  to even, as torch's caller does).

  Returns:
    `tuple[int]` of L counts, each in `[1, n]`.

  Raises:
    ValueError: a size that is not a positive int, a ratio outside [0, 1), beta < 1.
  """
  num_layers = _checks.positive_int("num_layers", num_layers)
  n = _checks.positive_int("context_tokens", context_tokens)
  window = _checks.positive_int("window_size", window_size)
  beta = _check_beta(beta)
  if isinstance(compression_ratio, bool) or not isinstance(
      compression_ratio, (int, float, np.integer, np.floating)) \
      or not 0 <= float(compression_ratio) < 1:
    raise ValueError(f"compression_ratio must be a float in [0, 1); got {compression_ratio!r}")
  mean = n * (1 - float(compression_ratio))
  min_num = mean / beta
  max_num = 2 * mean - min_num
  if max_num >= n - window:
    max_num = n - window
    min_num = 2 * mean - max_num
  if not n >= max_num >= min_num >= window:
    return (max(1, round(mean)),) * num_layers
  steps = (max_num - min_num) / (num_layers - 1) if num_layers > 1 else 0.0
  return tuple(min(n, max(1, round(max_num - layer * steps))) for layer in range(num_layers))


def resolved_policy_options(policy: str, budget: int, options: dict[str, Any]) -> dict[str, int]:
  """The policy's options with its defaults for `budget` filled in (`EvictingKVCache.init`
  checks them), so every layer gets the same observation window whatever its own budget."""
  probe = EvictingKVCache.init(1, budget, 1, 1, policy=policy, **options)
  return dict(probe.options)


def build(model, batch, max_len, dtype, o, tokens_per_seq) -> tuple[EvictingKVCache, ...]:
  """The PyramidKV kind's builder: one `EvictingKVCache` per GQA layer, of the budget
  `layer_budgets` gives it."""
  del tokens_per_seq
  policy = DEFAULT_POLICY if o.get("policy") is None else o["policy"]
  if not isinstance(policy, str) or policy not in POLICY_TABLE:
    raise ValueError(f"policy must be one of {tuple(POLICY_TABLE)}; got {policy!r}")
  given = {k: o[k] for k in _POLICY_OPTIONS if o.get(k) is not None}
  if (o.get("compress") or "fixed") == "context":
    attns = gqa_layers(model)
    given = _context_options(policy, given)
    kept = _context_budgets(len(attns), o, policy, given)
    # The largest layer sets the slots (`_slots`); a layer of fewer kept tokens is as much
    # smaller, so the bytes held follow the schedule. A max_len below the largest count (a
    # validation build, or a caller not sizing by `slots_needed`) caps every layer at max_len.
    rest = _checks.positive_int("max_len", max_len) - max(kept)
    sizes = [(b, b + rest) if rest >= 0 else (min(b, max_len), max_len) for b in kept]
    return tuple(EvictingKVCache.init(batch, b, a.num_kv_heads, a.head_dim, dtype, policy=policy,
                                      compress="context", capacity=c, **given)
                 for a, (b, c) in zip(attns, sizes))
  del max_len  # bounded: the capacity is the schedule
  budget = _checks.positive_int("budget", o["budget"])
  options = resolved_policy_options(policy, budget, given)
  window = POLICY_TABLE[policy].protected
  protected = options["num_sinks"] + (options[window] if window else 0)
  attns = gqa_layers(model)
  budgets = layer_budgets(
      len(attns), budget, protected=protected, minimum=options["num_sinks"] + 1,
      beta=DEFAULT_BETA if o.get("beta") is None else o["beta"],
      ratio=1.0 if o.get("ratio") is None else o["ratio"])
  return tuple(EvictingKVCache.init(batch, b, a.num_kv_heads, a.head_dim, dtype, policy=policy,
                                    **options) for a, b in zip(attns, budgets))


def _context_options(policy: str, given: dict[str, Any]) -> dict[str, Any]:
  """The layers' policy options under "context": an observation window (`window_size`) not
  given is `SNAPKV_WINDOW` in every layer (the schedule's window), not each layer's default."""
  if POLICY_TABLE[policy].protected == "window_size" and given.get("window_size") is None:
    return {**given, "window_size": SNAPKV_WINDOW}
  return given


def _context_budgets(num_layers: int, o: dict[str, Any], policy: str,
                     given: dict[str, Any]) -> tuple[int, ...]:
  """`context_layer_budgets` of a "context" spec; its window is the policy's observation
  window (`window_size`), else `SNAPKV_WINDOW`."""
  size = _context_options(policy, given).get("window_size")
  return context_layer_budgets(
      num_layers, o["context_tokens"], o["compression_ratio"],
      window_size=SNAPKV_WINDOW if size is None else size,
      beta=DEFAULT_BETA if o.get("beta") is None else o["beta"])


SNAPKV_WINDOW = 64
"""PyramidKVPress's `window_size` default, the schedule's window under "context" when the
spec sets none."""


def _check(o: dict[str, Any], where: str) -> None:
  """"fixed" needs `budget`; "context" needs `compression_ratio` and `context_tokens` and
  takes no `budget` or `ratio`."""
  compress = o.get("compress") or "fixed"
  if compress not in ("fixed", "context"):
    raise ValueError(f"{where}.compress must be 'fixed' or 'context'; got {compress!r}")
  if compress == "fixed":
    if o.get("budget") is None:
      raise ValueError(f"{where}.budget must be set (the mean slots per layer); got None")
    for key in ("compression_ratio", "context_tokens"):
      if o.get(key) is not None:
        raise ValueError(f"{where}.{key} needs compress='context'; got {o[key]!r}")
    return
  for key in ("compression_ratio", "context_tokens"):
    if o.get(key) is None:
      raise ValueError(f"{where}.{key} must be set for compress='context'; got None")
  for key in ("budget", "ratio"):
    if o.get(key) is not None:
      raise ValueError(f"{where}.{key} is for compress='fixed'; got {o[key]!r} with "
                       "compress='context'")


def _slots(o: dict[str, Any], context_lengths, total_lengths) -> int | None:
  """Slots per sequence under "context": the largest layer's kept context (the bottom layer's,
  which does not depend on the number of layers) plus the rest of the longest row."""
  if (o.get("compress") or "fixed") == "fixed":
    return None
  policy = DEFAULT_POLICY if o.get("policy") is None else o["policy"]
  given = {k: o[k] for k in _POLICY_OPTIONS if o.get(k) is not None}
  top = _context_budgets(2, o, policy, given)[0]
  return max([1, *(min(int(c), top) + int(t) - int(c)
                   for c, t in zip(context_lengths, total_lengths))])


registry.register_cache_kind("pyramidkv", registry.CacheKind(
    build, {"budget": None, "policy": None, "beta": None, "ratio": None, "compress": None,
            "compression_ratio": None, "context_tokens": None,
            **{name: None for name in _POLICY_OPTIONS}},
    "PyramidKV: EvictingKVCache(policy) per layer, budgets decreasing with depth; `budget` is "
    "the mean per layer (or compress='context' with compression_ratio and context_tokens)",
    at_budget=lambda budget, num_sinks: {"budget": budget}, check=_check, slots=_slots))
