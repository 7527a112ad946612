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


def resolved_policy_options(policy: str, budget: int, options: dict[str, Any]) -> dict[str, int]:
  """The policy's options with its defaults for `budget` filled in (`EvictingKVCache.init`
  checks them), so every layer gets the same observation window whatever its own budget."""
  probe = EvictingKVCache.init(1, budget, 1, 1, policy=policy, **options)
  return dict(probe.options)


def build(model, batch, max_len, dtype, o, tokens_per_seq) -> tuple[EvictingKVCache, ...]:
  """The PyramidKV kind's builder: one `EvictingKVCache` per GQA layer, of the budget
  `layer_budgets` gives it."""
  del max_len, tokens_per_seq  # bounded: the capacity is the schedule
  policy = DEFAULT_POLICY if o.get("policy") is None else o["policy"]
  if not isinstance(policy, str) or policy not in POLICY_TABLE:
    raise ValueError(f"policy must be one of {tuple(POLICY_TABLE)}; got {policy!r}")
  budget = _checks.positive_int("budget", o["budget"])
  given = {k: o[k] for k in _POLICY_OPTIONS if o.get(k) is not None}
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


registry.register_cache_kind("pyramidkv", registry.CacheKind(
    build, {"budget": registry.REQUIRED, "policy": None, "beta": None, "ratio": None,
            **{name: None for name in _POLICY_OPTIONS}},
    "PyramidKV: EvictingKVCache(policy) per layer, budgets decreasing with depth; `budget` is "
    "the mean per layer", at_budget=lambda budget, num_sinks: {"budget": budget}))
