r"""Long-context caches on a real model: streaming perplexity, passkey retrieval and cost.

    python -m experiments.main --config=configs/long_context.py:smoke \
        --workdir=/tmp/long_context

The "long_context" family of experiments/framework/runner.py (`experiment.kind =
"long_context"`). One point per sweep entry of configs/long_context.py: a
cache kind of `kvattn.caches.registry` ("dense", "ring" = a window without
sinks, "sink" = StreamingLLM, or an eviction policy of `kvattn.caches.eviction`)
at a budget (`registry.spec_at_budget`), on the model `model.name`
(`kvattn.from_pretrained`). Measured per point:

  * streaming perplexity: `text.num_tokens + 1` tokens of the default corpus
    of `kvattn.training.data` (stdlib sources and pydoc topics, tokenized with the
    model's tokenizer) go through the cache `text.chunk` tokens per forward
    pass; each token's negative log-likelihood is read from the logits of the
    token before it. Reported: perplexity overall, over the second half, and
    per position bin (the plot);
  * passkey retrieval: for each context length of `passkey.contexts`, one
    batch of prompts (one row per depth of `passkey.depths`: filler sentences,
    the needle "The pass key is NNNNN. Remember it. NNNNN is the pass key." at
    that depth, then "What is the pass key? The pass key is"), prefilled in
    chunks, then `passkey.new_tokens` greedy tokens; a row is correct when the
    5 digits appear in them;
  * cache bytes per sequence (the storage arrays, checked equal to capacity x
    the model's bytes per token) and the bookkeeping bytes (slot positions,
    eviction scores, lengths) beside them;
  * speed (one extra point, `cache.kind = "speed"`): every kind of
    `speed.kinds` at every budget of `speed.budgets`, and the full cache
    holding (up to) `text.num_tokens` tokens, are filled (the bounded ones past their
    budget, so every decode step evicts), then decoded at batch 1 through
    `kvattn.generate`'s compiled decode loop (`timing.decode_rounds`) in
    `speed.repeats` interleaved rounds of `speed.steps` steps each (the order
    rotates every round). Per round the step times are turned into
    ratios -- tokens/s over the full cache's, step time over the plain ring's
    at the same budget (the eviction overhead) -- and the report gives their
    medians: ratios measured side by side survive a shared, noisy machine
    where absolute times do not.

Every forward pass but the timed decode goes through `scan_forward`: the model's layers in one
`lax.scan` (the same Block modules, their states stacked), so a point compiles
one layer body instead of the 30 unrolled layers of SmolLM2 (seconds instead of
tens of seconds per compile, the bulk of a smoke run); the caches are donated
and updated in place, as in `kvattn.generate`.

The report (report.md) puts the numbers next to the published claims
(StreamingLLM, H2O, SnapKV, kvpress) and says which hold on this model;
ppl_vs_position.png and passkey_<policy>.png are its plots.
"""

from __future__ import annotations

import functools
import math
import os
import time
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from experiments.framework import report as report_lib
from experiments.framework import runner
from experiments.framework import overrides
from experiments.framework import checks
from experiments.framework import timing
from experiments.evals import models
from experiments.evals import streaming
from experiments.evals import text as text_lib
from kvattn.caches import registry as cache_registry
from kvattn.models import scan

BOUNDED = cache_registry.bounded_kinds()  # The kinds with a budget.
KINDS = ("dense",) + BOUNDED
SPEED = "speed"  # cache.kind of the speed point (module doc).
FILES = {"plot": "ppl_vs_position.png", "heatmap": "passkey_{kind}.png"}

# The published claims the report checks (paper, what it reports).
CLAIMS = {
    "streamingllm": "Xiao et al. 2023 (arXiv 2309.17453), Fig. 3 / Table 1: a window without "
                    "sinks explodes in perplexity once the first tokens leave it; 4 sinks keep "
                    "perplexity near the full cache's.",
    "h2o": "Zhang et al. 2023 (arXiv 2306.14048): a 20% heavy-hitter + recent budget performs "
           "close to the full cache.",
    "snapkv": "Li et al. 2024 (arXiv 2404.14469): a compressed cache keeps needle retrieval "
              "close to the full cache.",
    "kvpress": "NVIDIA kvpress benchmarks: every method degrades, even at small compression "
               "ratios.",
}


def schema() -> dict[str, tuple[str, ...]]:
  """Sections and keys of a "long_context" config (configs/long_context.py documents each)."""
  return {
      "model": ("name", "dtype"),
      "cache": ("kind", "budget", "num_sinks", "local_layers"),
      "text": ("num_tokens", "chunk", "bins"),
      "passkey": ("contexts", "depths", "new_tokens", "seed"),
      "speed": ("kinds", "budgets", "steps", "repeats"),
      "experiment": ("kind", "name", "max_points"),
  }


def policy_dict(cache: Mapping[str, Any]) -> dict[str, Any]:
  """The cache spec (`kvattn.caches.registry`) of a config's `cache` section: its kind
  holding `cache.budget` tokens (`registry.spec_at_budget`)."""
  return cache_registry.spec_at_budget(cache["kind"], cache["budget"],
                                       num_sinks=cache["num_sinks"])


@functools.lru_cache(maxsize=8)
def _steps(defs):
  """Jitted steps (caches donated): `nll_step(params, caches, tokens, new_lengths, targets) ->
  (nll f32[B, T], caches)` and `next_step(params, caches, tokens, new_lengths, pick) ->
  (argmax i32[B] of the logits at position pick[b] of row b, caches)`."""

  @functools.partial(jax.jit, donate_argnums=(1,))
  def nll_step(params, caches, tokens, new_lengths, targets):
    h, caches = scan.scan_forward(defs, params, caches, tokens, new_lengths)
    logp = jax.nn.log_softmax(scan.logits_from_hidden(params, h), axis=-1)
    return -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0], caches

  @functools.partial(jax.jit, donate_argnums=(1,))
  def next_step(params, caches, tokens, new_lengths, pick):
    h, caches = scan.scan_forward(defs, params, caches, tokens, new_lengths)
    h = jnp.take_along_axis(h, pick[:, None, None], axis=1)[:, 0]  # [B, D]
    return jnp.argmax(scan.logits_from_hidden(params, h), axis=-1).astype(jnp.int32), caches

  return nll_step, next_step


class LongContextFamily(runner.FamilyState):
  """Cache policies x budgets on one real model (module doc)."""

  kind = "long_context"

  def __init__(self, workdir: str):
    super().__init__(workdir, schema(), "kvattn: long-context caches")
    self._params: tuple[Any, Any, Any] | None = None  # (model, scan params, steps)
    self._inputs_cache: dict[str, Any] = {}

  def _check(self, d: Mapping[str, Any], where: str) -> None:
    policy, text, passkey, speed = d["cache"], d["text"], d["passkey"], d["speed"]
    if policy["kind"] not in KINDS + (SPEED,):
      raise ValueError(f"{where}: cache.kind must be one of {KINDS + (SPEED,)}; got "
                       f"{policy['kind']!r}")
    budget = checks.check_int(f"{where}: cache.budget", policy["budget"], 2)
    sinks = checks.check_int(f"{where}: cache.num_sinks", policy["num_sinks"], 0)
    if policy["local_layers"] not in cache_registry.LOCAL_LAYER_LAYOUTS:
      raise ValueError(f"{where}: cache.local_layers must be one of "
                       f"{cache_registry.LOCAL_LAYER_LAYOUTS}; got {policy['local_layers']!r}")
    if policy["kind"] == "sink" and budget < sinks + 1:
      raise ValueError(f"{where}: cache.budget must be >= cache.num_sinks + 1 = {sinks + 1}; "
                       f"got {budget}")
    checks.check_int(f"{where}: text.num_tokens", text["num_tokens"], 2)
    checks.check_int(f"{where}: text.chunk", text["chunk"])
    checks.check_int(f"{where}: text.bins", text["bins"])
    for c in passkey["contexts"]:
      checks.check_int(f"{where}: passkey.contexts", c, 32)
    for depth in passkey["depths"]:
      if isinstance(depth, bool) or not isinstance(depth, (int, float)) or not 0 <= depth <= 1:
        raise ValueError(f"{where}: passkey.depths must be numbers in [0, 1]; got {depth!r}")
    checks.check_int(f"{where}: passkey.new_tokens", passkey["new_tokens"])
    checks.check_int(f"{where}: speed.steps", speed["steps"])
    checks.check_int(f"{where}: speed.repeats", speed["repeats"])
    for kind in speed["kinds"]:
      if kind not in BOUNDED:
        raise ValueError(f"{where}: speed.kinds must hold kinds of {BOUNDED}; got {kind!r}")
    for b in speed["budgets"]:
      checks.check_int(f"{where}: speed.budgets", b, sinks + 1)
    # Builds (and so validates) the policies' caches.
    policies = ([policy_dict({**policy, "kind": k, "budget": b})
                 for k in speed["kinds"] for b in speed["budgets"]]
                if policy["kind"] == SPEED else [policy_dict(policy)])
    for p in policies:
      cache_registry.cache_options(p, f"{where}: cache")

  def points(self, config: Any, sweep: Sequence[Mapping[str, Any]]) -> list[runner.Point]:
    """One point per sweep entry; all validated before any work (ValueError naming the key)."""
    base = self.load_config(config)

    def point_of(d, where):
      self._check(d, where)
      policy = d["cache"]
      if policy["kind"] in ("dense", SPEED):
        label = policy["kind"]
      else:
        label = f"{policy['kind']}-{policy['budget']}"
      if policy["local_layers"] != "full":  # the per-layer layout (windowed layers: rings)
        label += f"+{policy['local_layers']}"
      if policy["kind"] == SPEED:  # what changes the speed point's measurement
        measured = {s: d[s] for s in ("model", "text", "speed")}
        measured["num_sinks"] = policy["num_sinks"]
      else:
        measured = {s: d[s] for s in ("model", "text", "passkey")}
        measured["cache"] = policy_dict(policy)
      if policy["local_layers"] != "full":  # absent at the default: earlier point ids hold
        measured["local_layers"] = policy["local_layers"]
      return runner.PointSpec(label, measured, d["model"]["name"], {
          "kind": policy["kind"], "local_layers": policy["local_layers"],
          "budget": None if policy["kind"] in ("dense", SPEED) else policy["budget"]})

    return runner.expand_points(config, sweep, point_of)

  def model(self, point: runner.Point):
    if self._model is None or self._model[0] != point.group:
      m, tok = models.load_model(point.config["model"]["name"], point.config["model"]["dtype"])
      self._model = (point.group, m, tok)
    return self._model[1], self._model[2]

  # -- measurement ----------------------------------------------------------------------------

  def _forward(self, point: runner.Point):
    """`(model, tokenizer, params, nll_step, next_step)` of the point's model."""
    model, tokenizer = self.model(point)
    if self._params is None or self._params[0] is not model:
      defs, params = scan.scan_parts(model)
      self._params = (model, params, _steps(defs))
      self._period = scan.cache_period(defs)  # caches per scanned group (scan.layer_period)
    _, params, (nll_step, next_step) = self._params
    return model, tokenizer, params, nll_step, next_step

  def _inputs(self, point: runner.Point, tokenizer) -> tuple[np.ndarray, dict[str, Any], int]:
    """`(text ids, {context: (prompts, keys)}, full_len)` of a point's config, cached.

    `full_len`: the one capacity of every full cache of the config (the text,
    each padded passkey batch plus its decoded tokens; the speed point fills
    its full cache to `full_len` minus its decode steps), so the full kind
    compiles each step shape once; a dense cache with room to spare gives the
    same outputs.
    """
    d = point.config
    text, passkey, chunk = d["text"], d["passkey"], d["text"]["chunk"]
    key = overrides.digest({"model": d["model"]["name"], "text": text, "passkey": passkey})
    if key not in self._inputs_cache:
      ids = text_lib.corpus_tokens(tokenizer, text["num_tokens"] + 1)
      rng = np.random.default_rng(passkey["seed"])
      prompts: dict[str, Any] = {}
      full_len = text["num_tokens"]
      for context in passkey["contexts"]:
        keys = rng.integers(10000, 100000, len(passkey["depths"])).tolist()
        rows = [text_lib.passkey_prompt(tokenizer, context, depth, k)
                for depth, k in zip(passkey["depths"], keys)]
        prompts[str(context)] = (rows, keys)
        width = -(-max(len(r) for r in rows) // chunk) * chunk
        full_len = max(full_len, width + passkey["new_tokens"])
      self._inputs_cache[key] = (ids, prompts, full_len)
    return self._inputs_cache[key]

  def _caches(self, model, batch, max_len, dtype, policy, local_layers="full"):
    """`(stacked caches, storage bytes per sequence, bookkeeping bytes per sequence,
    capacity)`; the storage is checked equal to the sum over layers of each layer's capacity
    x its bytes per token. `local_layers="ring"`: the per-layer layout (layers with a window
    shorter than `max_len` get a ring of it, the others `policy`); capacity: the largest
    layer's."""
    caches = model.init_caches(batch, max_len, dtype, cache=policy, local_layers=local_layers)
    storage = sum(a.nbytes for c in caches for a in c.storage_arrays())
    every = sum(x.nbytes for x in jax.tree_util.tree_leaves(caches))
    capacity = max(c.capacity for c in caches)
    want = batch * sum(c.capacity * layer.bytes_per_token(dtype)
                       for c, layer in zip(caches, model.spec.layers))
    if storage != want:
      raise checks.CacheAccountingError(
          f"{policy['kind']} ({local_layers}): cache storage {storage} B != {batch} x the sum "
          f"over layers of capacity x bytes per token = {want} B")
    return (scan.stack_caches(caches, self._period), storage // batch,
            (every - storage) // batch, capacity)

  @staticmethod
  def _windowed(model, max_len, dtype, policy) -> dict[str, Any]:
    """Where the layers' own sliding windows already bound the cache (Gemma's local layers):
    the layers with a window shorter than `max_len`, their windows, and the storage bytes per
    sequence of `policy` in the per-layer layout (`local_layers="ring"`), from shapes only."""
    layers = cache_registry.ring_layers(model, max_len)
    shapes = jax.eval_shape(lambda: model.init_caches(1, max_len, dtype, cache=policy,
                                                      local_layers="ring"))
    return {"windowed_layers": layers,
            "windows": sorted({int(model.layers[i].attn.window) for i in layers}),
            "per_layer_layout_bytes_per_seq": int(sum(
                math.prod(a.shape) * jnp.dtype(a.dtype).itemsize
                for c in shapes for a in c.storage_arrays()))}

  def _fill(self, params, nll_step, caches, ids, count, chunk):
    """Feeds `ids[:count]` (batch 1) `chunk` tokens at a time; `(nll f64[count], caches)`."""
    return streaming.feed_chunks(lambda c, *args: nll_step(params, c, *args), caches, ids, count,
                                 chunk)

  def measure(self, point: runner.Point) -> dict[str, Any]:
    cpu0 = time.process_time()
    if point.config["cache"]["kind"] == SPEED:
      record = self._speed(point)
    else:
      record = self._quality(point)
    return {**record, "cpu_seconds": time.process_time() - cpu0}

  def _quality(self, point: runner.Point) -> dict[str, Any]:
    """Streaming perplexity, passkey retrieval and cache bytes of one policy point."""
    d = point.config
    model, tokenizer, params, nll_step, next_step = self._forward(point)
    policy = policy_dict(d["cache"])
    text, passkey = d["text"], d["passkey"]
    dtype = jnp.dtype(d["model"]["dtype"])
    chunk = text["chunk"]

    ids, prompts, full_len = self._inputs(point, tokenizer)
    local = d["cache"]["local_layers"]
    caches, storage, bookkeeping, capacity = self._caches(model, 1, full_len, dtype, policy,
                                                          local)
    start_time = time.perf_counter()
    nll, caches = self._fill(params, nll_step, caches, ids, text["num_tokens"], chunk)
    ppl_s = time.perf_counter() - start_time
    del caches
    bins = np.array_split(nll, text["bins"])

    correct = {context: self._passkey(model, params, next_step, policy, dtype, rows, keys, chunk,
                                      passkey["new_tokens"], tokenizer, full_len, local)
               for context, (rows, keys) in prompts.items()}
    return {
        **self._windowed(model, full_len, dtype, policy),
        "ppl": float(math.exp(nll.mean())),
        "ppl_second_half": float(math.exp(nll[len(nll) // 2:].mean())),
        "ppl_bins": [float(math.exp(b.mean())) for b in bins],
        "ppl_seconds": ppl_s,
        "chunk": chunk,
        "num_tokens": text["num_tokens"],
        "capacity": capacity,
        "cache_bytes_per_seq": storage,
        "bookkeeping_bytes_per_seq": bookkeeping,
        "passkey_correct": correct,
        "passkey_depths": [float(x) for x in passkey["depths"]],
        "passkey_accuracy": float(np.mean([v for row in correct.values() for v in row])),
    }

  def _speed(self, point: runner.Point) -> dict[str, Any]:
    """Decode speed of every kind x budget beside the full cache, interleaved (module doc)."""
    d = point.config
    model, tokenizer, params, nll_step, next_step = self._forward(point)
    text, speed = d["text"], d["speed"]
    dtype = jnp.dtype(d["model"]["dtype"])
    chunk, steps, repeats = text["chunk"], speed["steps"], speed["repeats"]
    ids, _, full_len = self._inputs(point, tokenizer)
    decoded = steps * (repeats + 1)  # the first, untimed round compiles
    if full_len - decoded < 1:
      raise ValueError(f"speed.steps x (speed.repeats + 1) = {decoded} decode steps do not fit the "
                       f"full cache of {full_len} tokens: lower them or raise text.num_tokens")
    entries = {"dense": ("dense", None, {"kind": "dense"},
                        min(text["num_tokens"], full_len - decoded))}
    for budget in speed["budgets"]:
      for kind in speed["kinds"]:
        entries[f"{kind}-{budget}"] = (
            kind, budget, policy_dict({**d["cache"], "kind": kind, "budget": budget}),
            min(text["num_tokens"], budget + chunk))  # past the budget: every step evicts
    runs = {}
    for name, (_, _, policy, fill) in entries.items():
      caches = self._caches(model, 1, full_len, dtype, policy, d["cache"]["local_layers"])[0]
      _, caches = self._fill(params, nll_step, caches, ids, fill, chunk)
      runs[name] = (model, jnp.asarray(ids[fill:fill + 1]), scan.unstack_caches(caches))
    rounds = timing.decode_rounds(runs, steps, repeats)  # generate's compiled decode loop
    times = {name: rounds[name]["wall"] for name in runs}
    out = {}
    for name, (kind, budget, _, fill) in entries.items():
      t = np.array(times[name])
      ring = np.array(times[f"ring-{budget}"]) if f"ring-{budget}" in times else None
      out[name] = {
          "kind": kind, "budget": budget, "context": fill,
          "step_ms": float(np.median(t) * 1e3),
          "tokens_per_s": float(1.0 / np.median(t)),
          "tokens_per_s_vs_full": float(np.median(np.array(times["dense"]) / t)),
          "step_vs_ring": None if ring is None else float(np.median(t / ring)),
          "overhead_ms_vs_ring": None if ring is None else float(np.median(t - ring) * 1e3),
      }
    return {"speed": out, "speed_steps": steps, "speed_repeats": repeats, "chunk": chunk,
            "num_tokens": text["num_tokens"]}

  def _passkey(self, model, params, next_step, policy, dtype, prompts, keys, chunk, new_tokens,
               tokenizer, full_len, local_layers="full") -> list[int]:
    """Chunked prefill of the prompts (one row each), greedy decode; 1 where the key appears."""
    toks, lengths = streaming.padded_rows(prompts, chunk)
    batch, padded = toks.shape
    caches = self._caches(model, batch, full_len, dtype, policy, local_layers)[0]
    last = np.zeros(batch, np.int32)
    for s in range(0, padded, chunk):
      new = np.clip(lengths - s, 0, chunk).astype(np.int32)
      arg, caches = next_step(params, caches, jnp.asarray(toks[:, s:s + chunk]),
                              jnp.asarray(new), jnp.asarray(np.maximum(new - 1, 0)))
      ends = (new > 0) & (lengths - s <= chunk)  # rows whose last prompt token is here
      last = np.where(ends, np.asarray(arg), last)
    out = [last.copy()]
    nxt = jnp.asarray(last)
    ones, zeros = jnp.ones((batch,), jnp.int32), jnp.zeros((batch,), jnp.int32)
    for _ in range(new_tokens - 1):
      nxt, caches = next_step(params, caches, nxt[:, None], ones, zeros)
      out.append(np.asarray(nxt))
    generated = np.stack(out, axis=1)
    return [int(str(key) in tokenizer.decode(generated[b].tolist()))
            for b, key in enumerate(keys)]

  def report(self, records: Sequence[Mapping[str, Any]]) -> str:
    return write_report(self.workdir, records, title=self._title, config=self._config)


runner.register_family("long_context", LongContextFamily)


# ----------------------------------------------------------------------------------------------
# Report.


def _fmt(x, digits=2):
  return "-" if x is None else f"{x:.{digits}f}"


def claims(records: Sequence[Mapping[str, Any]]) -> list[str]:
  """One line per published claim: the measured numbers and whether the claim holds."""
  by = {(r["kind"], r["budget"]): r for r in records}
  full = by.get(("dense", None))
  if full is None:
    return ["(no full-cache point: the claims need it)"]
  base = full["ppl"]
  budgets = sorted({b for (_, b) in by if b is not None})
  lines = []
  paired = [b for b in budgets if ("ring", b) in by and ("sink", b) in by]
  window = [(b, by[("ring", b)]["ppl"] / base) for b in paired]
  sink = [(b, by[("sink", b)]["ppl"] / base) for b in paired]
  if window and sink:
    explodes = all(w > 2 for _, w in window)
    near = all(s < 1.25 for _, s in sink)
    lines.append(
        f"- **StreamingLLM** ({CLAIMS['streamingllm']}) Measured perplexity / full-cache "
        f"perplexity: window without sinks "
        f"{', '.join(f'{r:.2f}x@{b}' for b, r in window)}; 4 sinks "
        f"{', '.join(f'{r:.2f}x@{b}' for b, r in sink)}. Explodes (> 2x) without sinks: "
        f"{'holds' if explodes else 'does not hold'}; near the full cache (< 1.25x) with sinks: "
        f"{'holds' if near else 'does not hold'}.")
  num_tokens = full["num_tokens"]
  h2o = [(b, by[("h2o", b)]) for b in budgets if ("h2o", b) in by]
  if h2o:
    b, r = min(h2o, key=lambda x: abs(x[0] / num_tokens - 0.2))
    ratio = r["ppl"] / base
    lines.append(
        f"- **H2O** ({CLAIMS['h2o']}) Budget {b} = {100 * b / num_tokens:.0f}% of the "
        f"{num_tokens}-token text: perplexity {ratio:.2f}x the full cache; passkey accuracy "
        f"{r['passkey_accuracy']:.2f} vs {full['passkey_accuracy']:.2f}. Close (< 1.1x): "
        f"{'holds' if ratio < 1.1 else 'does not hold'}.")
  snap = [(b, by[("snapkv", b)]) for b in budgets if ("snapkv", b) in by]
  if snap:
    accs = ", ".join(f"{r['passkey_accuracy']:.2f}@{b}" for b, r in snap)
    holds = all(r["passkey_accuracy"] >= full["passkey_accuracy"] - 0.1 for _, r in snap)
    lines.append(
        f"- **SnapKV** ({CLAIMS['snapkv']}) Passkey accuracy {accs} vs full "
        f"{full['passkey_accuracy']:.2f}: within 0.1 of the full cache: "
        f"{'holds' if holds else 'does not hold'}.")
  bounded = [r for (k, b), r in by.items() if b is not None]
  if bounded:
    worse = sum(r["ppl"] > base * 1.001 for r in bounded)
    lines.append(
        f"- **kvpress** ({CLAIMS['kvpress']}) {worse} of {len(bounded)} bounded points have a "
        f"higher perplexity than the full cache (> 0.1%): "
        f"{'holds' if worse == len(bounded) else 'does not hold for every point'}.")
  return lines


def _local(record: Mapping[str, Any]) -> str:
  """The point's `cache.local_layers` ("full" for records made before it existed)."""
  return record.get("local_layers") or "full"


def windowed_lines(records: Sequence[Mapping[str, Any]]) -> list[str]:
  """The report's section on layers whose own sliding window bounds their cache (Gemma's
  local layers): how many, their window, and the per-layer layout's bytes next to each
  point's; empty for models without such layers."""
  mine = [r for r in records if r.get("windowed_layers")]
  if not mine:
    return []
  r0 = mine[0]
  n, windows = len(r0["windowed_layers"]), r0["windows"]
  lines = ["## Where the windowed layers already bound the cache", "",
           f"{n} layers (indices {r0['windowed_layers']}) attend a sliding window of "
           f"{'/'.join(map(str, windows))} tokens: whatever the policy, their cache never needs "
           f"more, so the per-layer layout (`local_layers=\"ring\"`: a ring of the window for "
           f"them, the policy for the other layers; exact) stores what the last column says. A "
           f"bounded policy with a budget >= the window changes nothing on those layers; below "
           f"it, it drops tokens the model would attend.", "",
           "| policy | budget | local layers | cache MiB/seq | per-layer layout MiB/seq | ppl |",
           "|---|---|---|---|---|---|"]
  for r in mine:
    lines.append(f"| {r['kind']} | {r['budget'] or 'all'} | {_local(r)} | "
                 f"{r['cache_bytes_per_seq'] / 2**20:.2f} | "
                 f"{r['per_layer_layout_bytes_per_seq'] / 2**20:.2f} | {_fmt(r['ppl'], 3)} |")
  pairs = [(a, b) for a in mine for b in mine if a["kind"] == b["kind"] and
           a["budget"] == b["budget"] and _local(a) == "full" and _local(b) == "ring"]
  for a, b in pairs:
    lines.append(f"\n{a['kind']} {a['budget'] or 'all'}: perplexity full layout {a['ppl']:.4f}, "
                 f"per-layer layout {b['ppl']:.4f} (rel. diff "
                 f"{abs(a['ppl'] - b['ppl']) / a['ppl']:.1e}); passkey accuracy "
                 f"{a['passkey_accuracy']:.2f} / {b['passkey_accuracy']:.2f}.")
  return lines + [""]


def speed_table(record: Mapping[str, Any]) -> str:
  """The markdown table of a speed record (medians of per-round ratios, module doc)."""
  rows = []
  order = {kind: i for i, kind in enumerate(KINDS)}
  for v in sorted(record["speed"].values(), key=lambda v: (v["budget"] or 0, order[v["kind"]])):
    rows.append([v["kind"], v["budget"] or "all", v["context"], _fmt(v["step_ms"], 1),
                 _fmt(v["tokens_per_s"], 1), _fmt(v["tokens_per_s_vs_full"]),
                 _fmt(v["step_vs_ring"]), _fmt(v["overhead_ms_vs_ring"], 2)])
  return report_lib.markdown_table(
      ["policy", "budget", "tokens held", "step ms", "decode tok/s", "tok/s / full",
       "step / ring (eviction overhead)", "ms/step over ring"], rows)


def write_report(workdir: str, records: Sequence[Mapping[str, Any]], *, title: str,
                 config: Mapping[str, Any] | None) -> str:
  """report.md, ppl_vs_position.png and one passkey heat map per kind; returns the markdown."""
  speed = [r for r in records if r["kind"] == SPEED]
  records = sorted((r for r in records if r["kind"] != SPEED),
                   key=lambda r: (r["budget"] or 0, r["kind"], _local(r) != "full"))
  full_layout = [r for r in records if _local(r) == "full"]  # the claims compare these
  by = {(r["kind"], r["budget"]): r for r in full_layout}
  full = by.get(("dense", None))
  rows = []
  for r in records:
    ctx = " / ".join(f"{np.mean(v):.2f}" for v in r["passkey_correct"].values())
    kind = r["kind"] if _local(r) == "full" else f"{r['kind']} (local layers: {_local(r)})"
    rows.append([kind, r["budget"] or "all", _fmt(r["ppl"], 3),
                 _fmt(r["ppl"] / full["ppl"]) if full else "-", _fmt(r["ppl_second_half"], 3),
                 ctx, f"{r['cache_bytes_per_seq'] / 2**20:.2f}",
                 f"{r['bookkeeping_bytes_per_seq'] / 2**10:.1f}"])
  contexts = " / ".join(next(iter(records))["passkey_correct"]) if records else ""
  first = (records or speed or [{}])[0]
  chunk, num_tokens = first.get("chunk"), first.get("num_tokens")
  table = report_lib.markdown_table(
      ["policy", "budget", "ppl", "ppl / full", "ppl 2nd half", f"passkey acc ({contexts})",
       "cache MiB/seq", "bookkeeping KiB/seq"], rows)
  cpu = sum(r.get("cpu_seconds", 0.0) for r in records + speed)
  wall = sum(r.get("point_seconds", 0.0) for r in records + speed)
  md = [f"# {title}", "",
        f"Streaming perplexity over {num_tokens} tokens of the default corpus of kvattn.training.data, "
        f"fed {chunk} tokens per forward pass (chunk length {chunk}; 1 would be exact "
        f"token-by-token streaming). Passkey accuracy per context length (tokens), averaged "
        f"over depths. Cache MiB/seq: the storage arrays (checked equal to capacity x bytes per "
        f"token); bookkeeping: slot positions, eviction scores, lengths.", "", table, "",
        f"Measured points: {len(records) + len(speed)}, {cpu:.0f} CPU-seconds and {wall:.0f} s "
        f"wall in all.", ""]
  if speed:
    r = speed[-1]
    md += ["## Decode speed", "",
           f"Batch 1, {r['speed_repeats']} interleaved rounds of {r['speed_steps']} timed steps "
           f"per cache; ratios are medians over the rounds of the per-round ratios (tok/s over "
           f"the full cache holding {r['speed']['dense']['context']} tokens; step time over the "
           f"plain ring of the same budget: the eviction overhead). Load average at the end: "
           f"{r.get('load_avg_1min', float('nan')):.1f}.", "", speed_table(r), ""]
  md += windowed_lines(records)
  md += ["## Published claims", "", *(claims(full_layout) or [
      "(no bounded point in the full layout: the claims compare those with the full cache)"]),
         "",
         f"![perplexity vs position]({FILES['plot']})", ""]
  md += [f"![passkey {k}]({FILES['heatmap'].format(kind=k)})"
         for k in sorted({r["kind"] for r in records})]
  return report_lib.write_report(workdir, "\n".join(md) + "\n", records, _plots)


def _plots(workdir: str, records: Sequence[Mapping[str, Any]]) -> None:
  plt = report_lib.pyplot()
  budgets = sorted({r["budget"] for r in records if r["budget"]}) or [None]
  fig, axes = plt.subplots(1, len(budgets), figsize=(5 * len(budgets), 4), squeeze=False)
  for ax, budget in zip(axes[0], budgets):
    for r in records:
      if r["budget"] in (budget, None):
        bins = r["ppl_bins"]
        centers = (np.arange(len(bins)) + 0.5) * r["num_tokens"] / len(bins)
        ax.plot(centers, bins, marker=".", label=r["kind"])
    ax.set_yscale("log")
    ax.set_title(f"budget {budget}")
    ax.set_xlabel("position (tokens)")
    ax.set_ylabel("perplexity")
    ax.legend(fontsize=7)
  report_lib.save_figure(fig, os.path.join(workdir, FILES["plot"]))
  for kind in sorted({r["kind"] for r in records}):
    mine = [r for r in records if r["kind"] == kind]
    fig, axes = plt.subplots(1, len(mine), figsize=(4 * len(mine), 3), squeeze=False)
    for ax, r in zip(axes[0], mine):
      contexts = list(r["passkey_correct"])
      grid = np.array([r["passkey_correct"][c] for c in contexts], float)
      ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
      ax.set_yticks(range(len(contexts)), contexts)
      ax.set_xticks(range(grid.shape[1]), [f"{x:g}" for x in r["passkey_depths"]])
      ax.set_xlabel("needle depth")
      ax.set_ylabel("context (tokens)")
      ax.set_title(f"{kind} budget {r['budget'] or 'all'}")
    report_lib.save_figure(fig, os.path.join(workdir, FILES["heatmap"].format(kind=kind)))
