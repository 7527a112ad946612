r"""The length-switch ("hybrid attention") cache on a real model: speed, bytes, quality.

    python -m experiments.main --config=configs/length_switch.py:smoke --workdir=/tmp/ls

The "length_switch" family of experiments/framework/runner.py (`experiment.kind =
"length_switch"`). One point per (context length, cache) of
configs/length_switch.py: the unswitched dense cache ("never") or a
`kvattn.LengthSwitchKVCache` that pools the model's K KV heads to
`cache.num_kv_heads_after` once a sequence holds more than
`cache.switch_length` tokens, on `model.name` (`kvattn.from_pretrained`).
Measured per point, at batch 1:

  * perplexity of the first `context` tokens of the default corpus of
    `kvattn.training.data` (held out: nothing here trains on it), fed `text.chunk`
    tokens per forward pass (exact for this cache: a chunk's queries below
    the switch read the full heads, the others the pooled ones);
  * decode: `decode.steps` greedy steps after that text through
    `kvattn.generate`'s compiled decode loop (`timing.decode_rounds`; every
    row has switched when `switch_length < context`): tokens/s (wall) and CPU
    seconds per step (`time.process_time`, all threads);
  * cache bytes per sequence, measured from the arrays and checked against
    the two-segment formula (`LengthSwitchKVCache.storage_bytes`) or
    capacity x bytes per token (dense); the cache bytes a decode step reads
    (the pooled segment after the switch) and the parameter bytes it reads,
    from which the report derives the best speedup a memory-bound step can
    get;
  * for a switch point, the decode step of its switched cache, of the
    unswitched cache and of an MHA cache (the model's KV heads duplicated to N
    by `kvattn.models.convert.regroup_kv_heads`: the same logits), each holding
    `context` tokens, timed in `decode.repeats` interleaved rounds of
    `decode.steps` steps (`decode_speed`): the speedups the report sets
    against the claim, each measured under one load;
  * passkey retrieval at `context` tokens, one prompt per depth of
    `passkey.depths` (prompts of `experiments.families.long_context`),
    `passkey.new_tokens` greedy tokens; correct when the 5 digits appear.

Prompts, corpus and model loading are `experiments.families.long_context`'s
(`passkey_prompt`, `corpus_tokens`, `load_model`). The report (report.md)
gives every metric as a ratio to the unswitched cache at the same context and
puts the source's claim (1.8x faster than MHA at 1024 tokens, 3.5x at 4096,
< 1% accuracy loss) beside them.
"""

from __future__ import annotations

import functools
import math
import os
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from experiments.evals import models
from experiments.evals import text as text_lib
from experiments.framework import report as report_lib
from experiments.framework import results
from experiments.framework import runner
from experiments.framework import checks
from experiments.framework import timing
from kvattn.models import convert
from kvattn import memory

KINDS = ("dense", "length_switch")
# Caches `decode_speed` times: MHA (the model's KV heads duplicated to N), the model's own
# dense cache, the switch cache.
SPEED_KINDS = ("mha", "dense", "length_switch")
CLAIM = ("the source's \"hybrid attention\" (full KV heads for short sequences, one shared KV "
         "head past a length): 1.8x faster than MHA at 1024 tokens, 3.5x at 4096, with under "
         "1% accuracy loss (a cloud provider's test, as quoted)")


def schema() -> dict[str, tuple[str, ...]]:
  """Sections and keys of a "length_switch" config (configs/length_switch.py documents each)."""
  return {
      "model": ("name", "dtype"),
      "cache": ("kind", "switch_length", "num_kv_heads_after"),
      "text": ("context", "chunk"),
      "passkey": ("depths", "new_tokens", "seed"),
      "decode": ("steps", "repeats"),
      "experiment": ("kind", "name", "max_points"),
  }


def capacity(context: int, chunk: int, steps: int) -> int:
  """Cache slots of a point: the context rounded up to whole chunks with one chunk of room
  (a passkey prompt may run a little past `context`), plus the decode steps."""
  return (-(-context // chunk) + 1) * chunk + steps + 1


@functools.lru_cache(maxsize=8)
def _step_fn(graphdef):
  """Jitted `(state, caches, tokens, new_lengths) -> (logits f32[B, T, V], caches)`."""

  @functools.partial(jax.jit, donate_argnums=(1,))
  def step(state, caches, tokens, new_lengths):
    logits, caches = nnx.merge(graphdef, state)(tokens, caches, new_lengths=new_lengths)
    return logits.astype(jnp.float32), caches

  return step


class LengthSwitchFamily(runner.FamilyState):
  """Switch lengths x contexts on one real model (module doc)."""

  kind = "length_switch"

  def __init__(self, workdir: str):
    super().__init__(workdir, schema(), "kvattn: length-switch cache")
    self._mha: tuple[str, Any] | None = None

  def _check(self, d: Mapping[str, Any], where: str) -> None:
    cache = d["cache"]
    if cache["kind"] not in KINDS:
      raise ValueError(f"{where}: cache.kind must be one of {KINDS}; got {cache['kind']!r}")
    if cache["kind"] == "length_switch":
      checks.check_int(f"{where}: cache.switch_length", cache["switch_length"])
      checks.check_int(f"{where}: cache.num_kv_heads_after", cache["num_kv_heads_after"])
    context = checks.check_int(f"{where}: text.context", d["text"]["context"], 32)
    checks.check_int(f"{where}: text.chunk", d["text"]["chunk"])
    if d["text"]["chunk"] > context:
      raise ValueError(f"{where}: text.chunk must be <= text.context = {context}; got "
                       f"{d['text']['chunk']}")
    for depth in d["passkey"]["depths"]:
      if isinstance(depth, bool) or not isinstance(depth, (int, float)) or not 0 <= depth <= 1:
        raise ValueError(f"{where}: passkey.depths must be numbers in [0, 1]; got {depth!r}")
    checks.check_int(f"{where}: passkey.new_tokens", d["passkey"]["new_tokens"])
    checks.check_int(f"{where}: decode.steps", d["decode"]["steps"])
    checks.check_int(f"{where}: decode.repeats", d["decode"]["repeats"])

  def points(self, config: Any, sweep: Sequence[Mapping[str, Any]]) -> list[runner.Point]:
    """One point per sweep entry; all validated before any work (ValueError naming the key)."""
    base = self.load_config(config)

    def point_of(d, where):
      self._check(d, where)
      cache, context = d["cache"], d["text"]["context"]
      switch = cache["switch_length"] if cache["kind"] == "length_switch" else None
      measured = {s: d[s] for s in ("model", "text", "passkey", "decode")}
      measured["cache"] = cache if switch is not None else {"kind": "dense"}
      return runner.PointSpec(
          f"ctx{context}-" + ("never" if switch is None else f"switch{switch}"), measured,
          d["model"]["name"], {
              "context": context, "switch_length": switch,
              "num_kv_heads_after": cache["num_kv_heads_after"] if switch is not None else None})

    return runner.expand_points(config, sweep, point_of)

  def model(self, point: runner.Point):
    if self._model is None or self._model[0] != point.group:
      m, tok = models.load_model(point.config["model"]["name"], point.config["model"]["dtype"])
      self._model = (point.group, m, tok)
    return self._model[1], self._model[2]

  def mha_model(self, point: runner.Point):
    """The point's model with its KV heads duplicated to N (`convert.regroup_kv_heads`: the
    same logits, an MHA cache), built once per model."""
    if self._mha is None or self._mha[0] != point.group:
      model, _ = self.model(point)
      self._mha = (point.group, convert.regroup_kv_heads(model, model.layers[0].attn.num_heads))
    return self._mha[1]

  def _caches(self, model, point: runner.Point, max_len: int, dtype):
    cache = point.config["cache"]
    if cache["kind"] == "dense":
      return model.init_caches(1, max_len, dtype)
    return model.init_caches(1, max_len, dtype, cache={
        "kind": "length_switch", "switch_length": cache["switch_length"],
        "num_kv_heads_after": cache["num_kv_heads_after"]})

  # -- measurement ----------------------------------------------------------------------------

  def measure(self, point: runner.Point) -> dict[str, Any]:
    d = point.config
    model, tokenizer = self.model(point)
    graphdef, state = nnx.split(model)
    step = _step_fn(graphdef)
    dtype = jnp.dtype(d["model"]["dtype"])
    context, chunk = d["text"]["context"], d["text"]["chunk"]
    steps, new_tokens = d["decode"]["steps"], d["passkey"]["new_tokens"]
    max_len = capacity(context, chunk, max(2 * steps, new_tokens))  # a compiling round too

    # Perplexity of the first `context` tokens, then decode speed from there.
    ids = text_lib.corpus_tokens(tokenizer, context + 1)
    caches = self._caches(model, point, max_len, dtype)
    nll, caches = _prefill(step, state, caches, ids[:context], chunk, targets=ids[1:])
    storage = sum(a.nbytes for c in caches for a in c.storage_arrays())
    formula = sum(c.storage_bytes() if hasattr(c, "storage_bytes") else
                  c.capacity * memory.gqa_bytes_per_token(c.num_kv_heads, c.head_dim, c.dtype)
                  for c in caches)
    if storage != formula:
      raise checks.CacheAccountingError(f"{point.label}: cache storage {storage} B != the "
                                        f"formula's {formula} B")
    switched = bool(all(np.asarray(getattr(c, "switched", np.zeros(1, bool)))[0]
                        for c in caches))
    read = sum(_read_per_step(c) for c in caches)
    # Timed through generate's compiled decode loop, caches donated (one untimed round compiles).
    timed = timing.decode_rounds({"own": (model, jnp.asarray(ids[-1:]), caches)}, steps, 1)
    wall, cpu = timed["own"]["wall"][0], timed["own"]["cpu"][0]
    one = jnp.ones((1,), jnp.int32)

    # Passkey retrieval, one prompt per depth (batch 1: the shapes of the runs above).
    rng = np.random.default_rng(d["passkey"]["seed"])
    correct = []
    for depth in d["passkey"]["depths"]:
      key = int(rng.integers(10000, 100000))
      prompt = np.asarray(text_lib.passkey_prompt(tokenizer, context, depth, key), np.int32)
      if len(prompt) + new_tokens > max_len:
        raise ValueError(f"{point.label}: passkey prompt of {len(prompt)} tokens does not fit "
                         f"the cache ({max_len} slots)")
      caches = self._caches(model, point, max_len, dtype)
      last, caches = _prefill(step, state, caches, prompt, chunk)
      out = [int(last)]
      for _ in range(new_tokens - 1):
        logits, caches = step(state, caches, jnp.asarray([[out[-1]]], jnp.int32), one)
        out.append(int(jnp.argmax(logits[0, -1])))
      correct.append(int(str(key) in tokenizer.decode(out)))
    params = memory.tree_bytes(nnx.state(model, nnx.Param))

    # The switch against the unswitched and the MHA cache, timed in interleaved rounds (one
    # run, one load): the ratios the report compares with the claim.
    interleaved = {}
    if point.params["switch_length"] is not None:
      rows = decode_speed(model, [context], switch_length=point.params["switch_length"],
                          num_kv_heads_after=point.params["num_kv_heads_after"], steps=steps,
                          repeats=d["decode"]["repeats"], mha_model=self.mha_model(point))
      by = {r["cache"]: r for r in rows}
      switch_wall = by["length_switch"]["wall_s_per_step"]
      interleaved = {
          "interleaved_wall_s_per_step": {k: r["wall_s_per_step"] for k, r in by.items()},
          "interleaved_cpu_s_per_step": {k: r["cpu_s_per_step"] for k, r in by.items()},
          "speedup_vs_dense": by["dense"]["wall_s_per_step"] / switch_wall,
          "speedup_vs_mha": by["mha"]["wall_s_per_step"] / switch_wall,
      }
    return {
        **interleaved,
        "ppl": float(math.exp(nll.mean())),
        "num_tokens": context,
        "chunk": chunk,
        "capacity": max_len,
        "switched_at_decode": switched,
        "cache_bytes_per_seq": storage,
        "cache_bytes_read_per_step": read,
        "param_bytes": params,
        "decode_step_ms": wall * 1e3,
        "decode_tokens_per_s": 1.0 / wall,
        "decode_cpu_s_per_step": cpu,
        "passkey_correct": correct,
        "passkey_depths": [float(x) for x in d["passkey"]["depths"]],
        "passkey_accuracy": float(np.mean(correct)),
        "mha_cache_bytes_read_per_step": sum(
            c.capacity * memory.gqa_bytes_per_token(layer.attn.num_heads, c.head_dim, c.dtype)
            for c, layer in zip(caches, model.layers)),
    }

  def report(self, records: Sequence[Mapping[str, Any]]) -> str:
    return write_report(self.workdir, records, title=self._title)


def _read_per_step(cache) -> int:
  """Cache bytes one decode step of this (batch-1) cache reads: the pooled segment once the
  row has switched, the full segment before; a dense cache its whole capacity (the XLA
  decode path reads every slot and masks)."""
  if not hasattr(cache, "switched"):
    return sum(a.nbytes for a in cache.storage_arrays())
  if bool(np.asarray(cache.switched)[0]):
    return cache.k_pooled.nbytes + cache.v_pooled.nbytes
  return cache.k.nbytes + cache.v.nbytes


def _prefill(step, state, caches, ids: np.ndarray, chunk: int, targets: np.ndarray | None = None):
  """Feeds `ids` (one sequence) `chunk` tokens per call. With `targets` returns
  `(f64[len(ids)] negative log-likelihoods, caches)`, else `(greedy next token, caches)`."""
  n = len(ids)
  nll = np.zeros(n, np.float64)
  last = 0
  for s in range(0, n, chunk):
    e = min(n, s + chunk)
    toks = np.zeros((1, chunk), np.int32)
    toks[0, :e - s] = ids[s:e]
    logits, caches = step(state, caches, jnp.asarray(toks), jnp.asarray([e - s], jnp.int32))
    if targets is not None:
      logp = jax.nn.log_softmax(logits[0, :e - s], axis=-1)
      nll[s:e] = -np.asarray(jnp.take_along_axis(logp, jnp.asarray(targets[s:e])[:, None],
                                                 axis=-1)[:, 0])
    last = int(jnp.argmax(logits[0, e - s - 1]))
  return (nll if targets is not None else last), caches


runner.register_family("length_switch", LengthSwitchFamily)


# ----------------------------------------------------------------------------------------------
# Report.


def bound(record: Mapping[str, Any], baseline_read: float) -> float:
  """The speedup of a memory-bound decode step over one reading `baseline_read` cache bytes:
  (params + baseline cache bytes) / (params + this point's cache bytes read per step)."""
  p = record["param_bytes"]
  return (p + baseline_read) / (p + record["cache_bytes_read_per_step"])


def _ratios(records):
  """Rows of (record, the dense record at its context or None)."""
  dense = {r["context"]: r for r in records if r["switch_length"] is None}
  return [(r, dense.get(r["context"])) for r in records]


def _speedups(r, base):
  """(vs the unswitched cache, vs MHA): a switch point's interleaved wall-clock ratios, or
  (its tokens/s over the unswitched point's, None) for a record without them."""
  if "speedup_vs_dense" in r:
    return r["speedup_vs_dense"], r["speedup_vs_mha"]
  return r["decode_tokens_per_s"] / base["decode_tokens_per_s"], None


def claims(records: Sequence[Mapping[str, Any]]) -> list[str]:
  """The source's claim beside the measurements, and whether it holds."""
  lines = []
  for r, base in _ratios(records):
    if r["switch_length"] is None or base is None:
      continue
    vs_dense, vs_mha = _speedups(r, base)
    loss = r["ppl"] / base["ppl"] - 1
    acc = r["passkey_accuracy"] - base["passkey_accuracy"]
    lines.append(
        f"- context {r['context']}, switch at {r['switch_length']}: decode {vs_dense:.2f}x the "
        f"unswitched GQA cache (memory-bound limit "
        f"{bound(r, base['cache_bytes_read_per_step']):.2f}x)"
        + ("" if vs_mha is None else f", {vs_mha:.2f}x an MHA cache") +
        f" (memory-bound limit {bound(r, r['mha_cache_bytes_read_per_step']):.2f}x); "
        f"perplexity {100 * loss:+.1f}%; passkey accuracy {acc:+.2f}.")
  if not lines:
    return ["(no switched point with an unswitched point at its context: nothing to compare)"]
  by_ctx = {}
  for r, base in _ratios(records):
    if r["switch_length"] is not None and base is not None and r["switched_at_decode"]:
      by_ctx.setdefault(r["context"], []).append((r, base))
  verdict = []
  for ctx, want in ((1024, 1.8), (4096, 3.5)):
    for r, base in by_ctx.get(ctx, []):
      vs_dense, vs_mha = _speedups(r, base)
      speed, against = (vs_dense, "the unswitched cache") if vs_mha is None else (vs_mha, "MHA")
      loss = r["ppl"] / base["ppl"] - 1
      verdict.append(
          f"- claim {want}x vs MHA at {ctx} (switch at {r['switch_length']}): measured "
          f"{speed:.2f}x vs {against}, {100 * loss:+.1f}% perplexity: speed "
          f"{'holds' if speed >= want else 'does not hold'}, < 1% loss "
          f"{'holds' if loss < 0.01 else 'does not hold'}.")
  why = []
  for ctx in sorted({r["context"] for r, _ in _ratios(records)}):
    r = next(r for r, _ in _ratios(records) if r["context"] == ctx)
    free = (r["param_bytes"] + r["mha_cache_bytes_read_per_step"]) / r["param_bytes"]
    why.append(
        f"- Why, at {ctx} tokens: a batch-1 decode step reads the {r['param_bytes'] / 2**20:.0f} "
        f"MiB of parameters whatever the cache, so if its time follows the bytes it reads (a "
        f"memory-bound step, as on a GPU) even a free cache is at most {free:.2f}x faster than "
        f"an MHA cache ({r['mha_cache_bytes_read_per_step'] / 2**20:.0f} MiB read per step); "
        f"against this model's own GQA cache the switch saves only the pooled fraction of its "
        f"cache bytes (the limits above). Where the measured speedup exceeds the limit, the "
        f"attention over the cache costs more per byte than the weight products (XLA:CPU). "
        f"Quality: pooling heads the model was "
        f"trained to keep apart, without uptraining, is the GQA paper's conversion before its "
        f"uptraining step.")
  return lines + [""] + verdict + [""] + why


def write_report(workdir: str, records: Sequence[Mapping[str, Any]], *, title: str) -> str:
  """report.md (a table of ratios to the unswitched cache, the claim) and speed.png."""
  records = sorted(records, key=lambda r: (r["context"], r["switch_length"] or 1 << 30))
  rows = []
  for r, base in _ratios(records):
    ratio = (lambda key: "-" if base is None else f"{r[key] / base[key]:.3f}")
    rows.append([r["context"], r["switch_length"] or "never", f"{r['ppl']:.3f}", ratio("ppl"),
                 f"{r['passkey_accuracy']:.2f}", "-" if base is None else
                 f"{r['passkey_accuracy'] - base['passkey_accuracy']:+.2f}",
                 f"{r['decode_tokens_per_s']:.2f}",
                 *("-" if x is None else f"{x:.2f}" for x in (
                     _speedups(r, base) if "speedup_vs_dense" in r or base is not None
                     else (None, None))),
                 f"{r['decode_cpu_s_per_step'] * 1e3:.0f}",
                 f"{r['cache_bytes_per_seq'] / 2**20:.1f}", ratio("cache_bytes_per_seq"),
                 f"{r['cache_bytes_read_per_step'] / 2**20:.1f}",
                 ratio("cache_bytes_read_per_step"),
                 "-" if base is None else f"{bound(r, base['cache_bytes_read_per_step']):.2f}"])
  table = report_lib.markdown_table(
      ["context", "switch at", "ppl", "ppl ratio", "passkey acc", "acc diff", "decode tok/s",
       "speedup", "vs MHA", "CPU ms/step", "cache MiB/seq", "bytes ratio", "MiB read/step",
       "read ratio", "speed limit"], rows)
  params = records[0]["param_bytes"] if records else 0
  md = [f"# {title}", "",
        "Ratios are to the unswitched (dense, K heads) cache at the same context. Perplexity: "
        "the first `context` tokens of kvattn.training.data's corpus; passkey: one prompt per depth; "
        "decode: batch 1 after that text (tokens/s of the point's own run). Speedup and vs MHA: "
        "a switch point's switched cache against the unswitched one and against an MHA cache "
        "(the model's KV heads duplicated to N), timed in interleaved rounds within the point "
        "(medians of the rounds' wall seconds per step), so each ratio is of one load. "
        "MiB read/step: the cache bytes a decode step reads "
        "(the pooled segment after the switch). Speed limit: the speedup a memory-bound step "
        f"could reach, (params + baseline cache read) / (params + cache read), params = "
        f"{params / 2**20:.0f} MiB read per step.", "", table, "",
        "## The source's claim", "", f"Claim: {CLAIM}.", "", *claims(records), "",
        "![decode speed](speed.png)", ""]
  text = "\n".join(md) + "\n"
  results.atomic_write_text(os.path.join(workdir, "report.md"), text)
  if records:
    plt = report_lib.pyplot()
    fig, ax = plt.subplots(figsize=(5, 3.5))
    for switch in sorted({r["switch_length"] or 0 for r in records}):
      mine = [r for r in records if (r["switch_length"] or 0) == switch]
      ax.plot([r["context"] for r in mine], [r["decode_tokens_per_s"] for r in mine],
              marker="o", label="never" if switch == 0 else f"switch at {switch}")
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("decode tokens/s (batch 1)")
    ax.legend(fontsize=7)
    report_lib.save_figure(fig, os.path.join(workdir, "speed.png"))
  return text


# ----------------------------------------------------------------------------------------------
# Decode speed alone (no text, no passkey): for a machine too busy for the family's runs.


def decode_speed(model, contexts: Sequence[int], *, switch_length: int = 256,
                 num_kv_heads_after: int = 1, steps: int = 8, repeats: int = 3,
                 kinds: Sequence[str] = SPEED_KINDS, mha_model=None) -> list[dict[str, Any]]:
  """Batch-1 decode steps of `model` with each cache of `kinds`, timed in interleaved rounds.

  Kinds: "dense" (the model's own K-head cache), "length_switch" (switched at
  `switch_length` to `num_kv_heads_after` pooled heads) and "mha" (a dense cache of
  `mha_model`, by default `model` with its KV heads duplicated to N by
  `kvattn.models.convert.regroup_kv_heads`: the same logits, an MHA cache). Each cache holds
  `context` tokens (zeros: a step's cost does not depend on the values), so the switch cache
  has switched when `switch_length < context`. Every kind compiles first (one untimed round);
  then each of `repeats` rounds times `steps` steps of every kind in turn through
  `kvattn.generate`'s compiled decode loop (`timing.decode_rounds`), so all kinds see the
  same machine load and their ratios are measured in one run.

  Returns one row per (context, kind): `num_kv_heads` (the KV heads a step reads),
  `wall_s_per_step` and `cpu_s_per_step`
  (`time.process_time`, all threads), each the median over the rounds, and `wall_rounds`
  (seconds per step of every round).
  """
  checks.check_int("steps", steps)
  checks.check_int("repeats", repeats)
  bad = [k for k in kinds if k not in SPEED_KINDS]
  if bad or not kinds:
    raise ValueError(f"kinds must be a non-empty subset of {SPEED_KINDS}; got {tuple(kinds)!r}")
  if "mha" in kinds and mha_model is None:
    mha_model = convert.regroup_kv_heads(model, model.layers[0].attn.num_heads)
  rows = []
  for context in contexts:
    max_len = context + steps * (repeats + 1) + 2
    runs, heads = {}, {}
    for kind in kinds:
      m = mha_model if kind == "mha" else model
      caches = (m.init_caches(1, max_len, cache={
          "kind": "length_switch", "switch_length": switch_length,
          "num_kv_heads_after": num_kv_heads_after})
                if kind == "length_switch" else m.init_caches(1, max_len))
      caches = tuple(c.replace(lengths=jnp.full((1,), context, jnp.int32)) for c in caches)
      heads[kind] = caches[0].num_kv_heads
      if kind == "length_switch" and context > switch_length:
        heads[kind] = num_kv_heads_after  # the heads a step reads once the row has switched
      runs[kind] = (m, jnp.zeros((1,), jnp.int32), caches)
    timed = timing.decode_rounds(runs, steps, repeats)  # generate's compiled decode loop
    for kind in kinds:
      walls, cpus = timed[kind]["wall"], timed[kind]["cpu"]
      rows.append({"context": context, "cache": kind, "num_kv_heads": heads[kind],
                   "steps": steps, "repeats": repeats, "wall_s_per_step": float(np.median(walls)),
                   "cpu_s_per_step": float(np.median(cpus)), "wall_rounds": walls})
    del runs
  return rows


if __name__ == "__main__":
  # python -m experiments.families.length_switch [CONTEXT ...]: decode_speed on SmolLM2
  # (MHA = its KV heads duplicated to N = 9, as released K = 3, switched at 256 to 1), the
  # three interleaved, one JSON line per context and cache.
  import json  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  smol, _ = models.load_model("smollm2-135m-instruct", "float32")
  for row in decode_speed(smol, [int(c) for c in sys.argv[1:]] or [1024, 4096]):
    print(json.dumps(row), flush=True)
