r"""Compression: RULER-style score against compression ratio, per eviction policy and model.

    python -m experiments.main --config=configs/compression.py --workdir=runs/compression
    python -m experiments.main --config=configs/compression.py:smoke --workdir=/tmp/compression

The "compression" family of experiments/framework/runner.py (`experiment.kind =
"compression"`), configs/compression.py. Points: per model (sweep entry), one uncompressed
point ("none", ratio 0: the dense cache, kvpress's ratio 0 = no press) and one per policy and
ratio > 0. The policies are read at run time: `compression.policies`, or, when empty, every
entry of `kvattn.caches.eviction.POLICY_TABLE` plus "sink" (StreamingLLM), so a newly
registered policy joins the sweep without an edit here.

Per point: the examples `ruler.make(task, tokenizer, length, seed)` for every task, length
and seed < `workload.seeds`, through the chat template when the tokenizer has one; each
task's examples run `workload.batch` at a time through `kvattn.generate` (jitted, batched,
per-sequence lengths, prompts padded to one width so a point compiles once); with
`workload.warmup` the first batch is run twice and the second run timed, so `examples_per_s`
is steady-state (compilation is `first_call_s`); without it `examples_per_s` includes the
compilation (`includes_compile`). A ratio r gives each row a budget of `int(context_tokens * (1 - r))` tokens
(`context_tokens`: the chat template's start and the context, what kvpress compresses), and:
  - protocol "fixed_budget": the cache holds the batch's smallest such budget for the whole
    prompt and answer (the question and answer evict too; not kvpress's protocol);
  - protocol "context": the spec gets `compress="context"` and `compression_ratio=r`, and
    `generate(context_lengths=)` compresses the context only (needs that option on main).

With `compression.replay` (the default) a batch's context is run through the model once per
model (`experiments.evals.replay.record`) and every point whose caches qualify (the dense
point and the evicting kinds under "context") writes its caches from the recorded queries,
keys and values, then prefills the question and decodes on caches turned dense (or appending:
`replay.compacted`; one compiled question and answer program per model): the tokens of `generate(context_lengths=)` (tested), and the
recording's seconds (`record_s`) are not in `examples_per_s`. ThinK, the decoding kinds and
"fixed_budget" points run through `kvattn.generate`.

`cache_bytes_per_seq` is measured, not computed: the bytes of the storage arrays
(`storage_arrays()`) of the caches the point's factory builds for one sequence at the
point's `max_len`, summed over layers (sliding-window layers keep their rings).
"""

from __future__ import annotations

import collections
import json
import os
import time
from typing import Any, Mapping, Sequence

import numpy as np

from experiments.evals import models
from experiments.evals import replay
from experiments.evals import ruler
from experiments.framework import checks
from experiments.framework import report as report_lib
from experiments.framework import runner

PROTOCOLS = ("fixed_budget", "context")
NONE = "none"  # the uncompressed point of a model (ratio 0)


def schema() -> dict[str, tuple[str, ...]]:
  """Sections and keys of a "compression" config (configs/compression.py documents each)."""
  return {
      "model": ("name", "dtype"),
      "workload": ("tasks", "lengths", "seeds", "batch", "max_new_tokens", "warmup"),
      "compression": ("policies", "ratios", "protocol", "num_sinks", "local_layers", "replay"),
      "peer": ("kvpress_jsonl",),
      "experiment": ("kind", "name", "max_points"),
  }


def default_policies() -> tuple[str, ...]:
  """Every eviction policy registered now, then "sink": the sweep when none is named."""
  from kvattn.caches import eviction  # pylint: disable=g-import-not-at-top
  return (*eviction.POLICY_TABLE, "sink")


KVPRESS_OPTIONS = {
    "snapkv": {"window_size": 64, "kernel_size": 5},
    "chunkkv": {"window_size": 64, "kernel_size": 5, "chunk_size": 20},
    "criticalkv": {"window_size": 64, "kernel_size": 5},
    "snapkv+knorm": {"window_size": 64, "kernel_size": 5},
    "expected_attention": {"num_sinks": 4, "n_future_positions": 512},
    "h2o": {"recent_size": 0},
}
"""Options where kvpress 0.5.5's press defaults differ from kvattn's policy defaults, used
under the "context" protocol so that both sides run the same policy: SnapKVPress (alone and
inside ChunkKVPress, CriticalKVPress, ComposedPress) has window_size 64, kernel_size 5
(kvattn's default window is min(32, budget // 2)); ChunkKVPress chunk_length 20;
ExpectedAttentionPress n_sink 4 (sinks kept and left out of the query statistics; kvattn's
num_sinks defaults to 0) and n_future_positions 512; ObservedAttentionPress protects no
recent window (kvattn's h2o defaults to half the capacity)."""

THINK_WINDOW = 32
"""ThinKPress's `window_size`: the last context queries that score the key channels."""
DECODING_INTERVAL = 8
"""DecodingPress's `compression_interval` in the peer (experiments/benchmarks/peers/
kvpress_ruler.py): the buffer above the target size."""
QFILTER_TOKENS = 1024
"""Tokens of the default corpus (the model's tokenizer) Q-Filter's filters are computed from."""
STRUCTURAL = ("think",)
"""Kinds that are not bounded eviction kinds but have a "context" spec here (ThinK prunes key
channels: the ratio is kvpress's `key_channel_compression_ratio`)."""


def spec_of(policy: str, budget: int, ratio: float, protocol: str, num_sinks: int, *,
            head_dim: int | None = None, context_tokens: int | None = None) -> dict[str, Any]:
  """The cache spec of one point (`kvattn.caches.registry`): dense at ratio 0; else, under
  "fixed_budget", `registry.spec_at_budget(policy, budget)`; under "context", what runs as
  kvpress's press at `ratio` (`budget` = the kept context tokens, `int(n * (1 - ratio))`):
    - an eviction policy: `{"kind": policy, "compress": "context", "compression_ratio":
      ratio}` plus `KVPRESS_OPTIONS[policy]`; "criticalkv" adds `first_keep = budget // 2`
      (kvpress's `first_stage_ratio` 0.5), "snapkv+knorm" `first_keep = 2 * budget` (the
      peer's SnapKV stage keeps that many, `kvpress_ruler.composed_ratios`);
    - "sink": StreamingLLM on the context, the "recent" policy with `num_sinks` sinks
      (the first tokens and the newest of the context kept, the rest appended);
    - "think": `keep_channels = head_dim - int(head_dim * ratio)` of `head_dim` (needed),
      window `THINK_WINDOW`;
    - "decoding_<policy>": `budget + DECODING_INTERVAL` slots evicting back to `budget`
      (kvattn compresses the prefill too, kvpress's DecodingPress does not: docs/presses.md);
    - "pyramidkv": its "context" mode (kvpress's layer schedule at `context_tokens`, needed)
      over SnapKV with kvpress's window 64 and kernel 5; "pyramidkv_<policy>" the same
      schedule over `policy`'s scores with `KVPRESS_OPTIONS[policy]` (context only; kvpress's
      PyramidKVPress is SnapKV's alone);
    - "adakv_<policy>" (kvattn/caches/adakv_context.py, kvpress's `AdaKVPress(<press>)`):
      per-head budgets over `policy`'s scores, with `KVPRESS_OPTIONS[policy]` (context only).

  Raises:
    ValueError: "think" without `head_dim`, "pyramidkv" without `context_tokens`, "adakv"
      under "context" (it has no context mode), or "adakv_<policy>" / "pyramidkv_<policy>"
      under "fixed_budget" (they have only the context mode).
  """
  from kvattn.caches import registry  # pylint: disable=g-import-not-at-top
  if policy == NONE or ratio == 0:
    return {"kind": "dense"}
  inner = adakv_inner(policy) or pyramid_inner(policy)
  if inner is not None:
    if protocol != "context":
      raise ValueError(f"policy {policy!r} has only the context mode (kvpress's protocol); run "
                       "it with compression.protocol='context' ('adakv' and 'pyramidkv' have "
                       "the fixed budget)")
    if pyramid_inner(policy) is not None:
      if context_tokens is None:
        raise ValueError(f"context_tokens must be given for policy {policy!r} (the context "
                         "length of its layer schedule); got None")
      return {"kind": "pyramidkv", "compress": "context", "compression_ratio": float(ratio),
              "context_tokens": int(context_tokens), "policy": inner,
              **KVPRESS_OPTIONS.get(inner, {})}
    return {"kind": policy, "compress": "context", "compression_ratio": float(ratio),
            **KVPRESS_OPTIONS.get(inner, {})}
  if protocol != "context":
    return registry.spec_at_budget(policy, max(budget, num_sinks + 1) if policy == "sink"
                                   else max(budget, 1), num_sinks=num_sinks)
  if policy == "think":
    if head_dim is None:
      raise ValueError("head_dim must be given for policy 'think' (keep_channels = head_dim - "
                       "int(head_dim * ratio)); got None")
    return {"kind": "think", "keep_channels": max(1, head_dim - int(head_dim * ratio)),
            "window_size": THINK_WINDOW}
  if policy.startswith("decoding_"):
    return {"kind": policy, "budget": max(budget, 1) + DECODING_INTERVAL,
            "compression_interval": DECODING_INTERVAL}
  if policy == "pyramidkv":
    if context_tokens is None:
      raise ValueError("context_tokens must be given for policy 'pyramidkv' (the context "
                       "length of its layer schedule); got None")
    return {"kind": "pyramidkv", "compress": "context", "compression_ratio": float(ratio),
            "context_tokens": int(context_tokens), **KVPRESS_OPTIONS["snapkv"]}
  if policy == "adakv":
    raise ValueError(f"policy {policy!r} has no context mode (compress='context'); run it "
                     "with compression.protocol='fixed_budget'")
  spec = {"kind": "recent" if policy == "sink" else policy, "compress": "context",
          "compression_ratio": float(ratio), **KVPRESS_OPTIONS.get(policy, {})}
  if policy == "sink":
    spec["num_sinks"] = num_sinks
  if policy == "criticalkv":
    spec["first_keep"] = max(budget, 1) // 2
  if policy == "snapkv+knorm":
    spec["first_keep"] = 2 * max(budget, 1)
  return spec


def adakv_inner(policy: str) -> str | None:
  """The inner policy of an "adakv_<policy>" kind (AdaKV under the context protocol), else
  None."""
  from kvattn.caches import adakv_context  # pylint: disable=g-import-not-at-top
  return adakv_context.inner_of(policy)


def pyramid_inner(policy: str) -> str | None:
  """The inner policy of a "pyramidkv_<policy>" point (PyramidKV's context schedule over
  `policy`, an eviction policy of `eviction.POLICY_TABLE`), else None."""
  from kvattn.caches import eviction  # pylint: disable=g-import-not-at-top
  if not policy.startswith("pyramidkv_"):
    return None
  inner = policy[len("pyramidkv_"):]
  return inner if inner in eviction.POLICY_TABLE else None


class CompressionFamily(runner.FamilyState):
  """Score vs compression ratio on the RULER-style suite (module doc)."""

  kind = "compression"

  def __init__(self, workdir: str):
    super().__init__(workdir, schema(), "kvattn: RULER-style score vs compression ratio")
    self._records: dict = {}  # compression.replay's recorded context passes (current model)

  def _check(self, d: Mapping[str, Any], where: str) -> None:
    w, c = d["workload"], d["compression"]
    for task in w["tasks"]:
      if task not in ruler.TASKS:
        raise ValueError(f"{where}: workload.tasks must hold tasks of {ruler.TASKS}; got "
                         f"{task!r}")
    if not w["tasks"] or not w["lengths"]:
      raise ValueError(f"{where}: workload.tasks and workload.lengths must not be empty")
    for n in w["lengths"]:
      checks.check_int(f"{where}: workload.lengths", n, 128)
    checks.check_int(f"{where}: workload.seeds", w["seeds"])
    checks.check_int(f"{where}: workload.batch", w["batch"])
    checks.check_int(f"{where}: workload.max_new_tokens", w["max_new_tokens"], 0)
    checks.check_int(f"{where}: compression.num_sinks", c["num_sinks"], 0)
    if c["protocol"] not in PROTOCOLS:
      raise ValueError(f"{where}: compression.protocol must be one of {PROTOCOLS}; got "
                       f"{c['protocol']!r}")
    if not isinstance(c["replay"], bool):
      raise ValueError(f"{where}: compression.replay must be a bool; got {c['replay']!r}")
    if c["local_layers"] not in ("ring", "full"):
      raise ValueError(f"{where}: compression.local_layers must be 'ring' or 'full'; got "
                       f"{c['local_layers']!r}")
    for r in c["ratios"]:
      if isinstance(r, bool) or not isinstance(r, (int, float)) or not 0 <= r < 1:
        raise ValueError(f"{where}: compression.ratios must be numbers in [0, 1); got {r!r}")
    from kvattn.caches import registry  # pylint: disable=g-import-not-at-top
    for p in c["policies"]:
      context_only = adakv_inner(p) is not None or pyramid_inner(p) is not None
      if p not in STRUCTURAL and not context_only and (
          p not in registry.CACHE_KIND_TABLE or not registry.CACHE_KIND_TABLE[p].bounded):
        raise ValueError(f"{where}: compression.policies must hold bounded cache kinds "
                         f"{registry.bounded_kinds()}, {STRUCTURAL}, adakv_<policy> kinds or "
                         f"pyramidkv_<policy>; "
                         f"got {p!r}")
      if c["protocol"] == "context" and p == "adakv":
        raise ValueError(f"{where}: compression.policies: {p!r} has no context mode; use "
                         f"compression.protocol='fixed_budget' for it (or 'adakv_snapkv')")
      if c["protocol"] != "context" and context_only:
        raise ValueError(f"{where}: compression.policies: {p!r} has only the context mode; "
                         f"use compression.protocol='context' for it")
    if d["peer"]["kvpress_jsonl"] and not os.path.exists(d["peer"]["kvpress_jsonl"]):
      raise ValueError(f"{where}: peer.kvpress_jsonl: no such file "
                       f"{d['peer']['kvpress_jsonl']!r}")

  def points(self, config: Any, sweep: Sequence[Mapping[str, Any]]) -> list[runner.Point]:
    """Per sweep entry (model): "none" and every policy x ratio > 0 (module doc)."""
    self.load_config(config)

    def point_of(d, where):
      self._check(d, where)
      c = d["compression"]
      policies = tuple(c["policies"]) or default_policies()
      name = d["model"]["name"]
      measured = {"model": d["model"], "workload": d["workload"],
                  "protocol": c["protocol"], "local_layers": c["local_layers"],
                  "replay": c["replay"]}
      pairs = [(NONE, 0.0)] if any(r == 0 for r in c["ratios"]) else []
      pairs += [(p, float(r)) for p in policies for r in c["ratios"] if r > 0]
      return [runner.PointSpec(
          f"{name}-{p}-r{r:g}", {**measured, "policy": p, "ratio": r,
                                 "num_sinks": c["num_sinks"] if p == "sink" else None},
          name, {"model_name": name, "policy": p, "ratio": r, "protocol": c["protocol"]})
              for p, r in pairs]

    return runner.expand_points(config, sweep, point_of)

  def model(self, point: runner.Point) -> tuple[Any, Any]:
    """The point's `(model, tokenizer)`, loaded once per model name; Q-Filter's filters
    calibrated on the model's own tokens of the default corpus before its first "qfilter"
    point (not the byte ids the kind would fold into the vocabulary)."""
    if self._model is None or self._model[0] != point.group:
      d = point.config["model"]
      self._model = (point.group, models.load_model(d["name"], d["dtype"]), set())
    (model, tokenizer), calibrated = self._model[1], self._model[2]
    if point.params["policy"] == "qfilter" and not calibrated and hasattr(tokenizer, "encode"):
      from kvattn.caches.presses import qfilter  # pylint: disable=g-import-not-at-top
      qfilter.calibrate(model, qfilter.calibration_tokens(tokenizer, QFILTER_TOKENS))
      calibrated.add("qfilter")
    return model, tokenizer

  def measure(self, point: runner.Point) -> dict[str, Any]:
    d, p = point.config, point.params
    return measure(*self.model(point), d["workload"], d["compression"], p["policy"],
                   p["ratio"], self._records)

  def report(self, records: Sequence[Mapping[str, Any]]) -> str:
    peer = read_kvpress((self._config or {}).get("peer", {}).get("kvpress_jsonl", ""))
    return write_report(self.workdir, records, peer, title=self._title)


runner.register_family("compression", CompressionFamily)


def _decode(tokenizer: Any, ids: Sequence[int]) -> str:
  try:
    return tokenizer.decode(list(ids), skip_special_tokens=True)
  except TypeError:  # the byte tokenizer takes no keywords
    return tokenizer.decode(list(ids))


def measure(model: Any, tokenizer: Any, workload: Mapping[str, Any],
            compression: Mapping[str, Any], policy: str, ratio: float,
            records: dict | None = None) -> dict[str, Any]:
  """The record of one point: scores, outputs, budgets, examples/s and cache bytes held
  (module doc). `records`: with `compression.replay`, the recorded context passes
  (`experiments.evals.replay`) kept between points, keyed by model and batch rows."""
  import jax  # pylint: disable=g-import-not-at-top
  import kvattn  # pylint: disable=g-import-not-at-top
  from kvattn import memory  # pylint: disable=g-import-not-at-top
  from kvattn.caches import registry  # pylint: disable=g-import-not-at-top

  chat = getattr(tokenizer, "chat_template", None) is not None
  eos = getattr(tokenizer, "eos_id", None)
  protocol, batch = compression["protocol"], workload["batch"]
  examples = [ruler.make(t, tokenizer, n, s) for t in workload["tasks"]
              for n in workload["lengths"] for s in range(workload["seeds"])]
  ids = [ruler.encode(tokenizer, e, chat=chat) for e in examples]
  contexts = [ruler.context_tokens(tokenizer, e, chat=chat) for e in examples]
  width = max(len(r) for r in ids)
  head_dim = _head_dim(model)
  scores, outputs, budgets = [0.0] * len(examples), [""] * len(examples), [0] * len(examples)
  timed_s, first_s, cache_bytes, specs, engines = 0.0, 0.0, [], [], set()
  record_s = 0.0
  for task in workload["tasks"]:
    new = workload["max_new_tokens"] or ruler.MAX_NEW_TOKENS[task]
    index = [i for i, e in enumerate(examples) if e.task == task]
    for start in range(0, len(index), batch):
      rows = index[start:start + batch]
      lengths = np.array([len(ids[i]) for i in rows], np.int32)
      prompts = np.zeros((len(rows), width), np.int32)
      for b, i in enumerate(rows):
        prompts[b, :lengths[b]] = ids[i]
      budget = min(int(contexts[i] * (1 - ratio)) for i in rows)
      spec = spec_of(policy, budget, ratio, protocol, compression["num_sinks"],
                     head_dim=head_dim, context_tokens=min(contexts[i] for i in rows))
      factory = registry.cache_factory_from_config(model, spec,
                                                   local_layers=compression["local_layers"])
      kwargs = {"eos_id": eos, "cache_factory": factory, "max_len": width + new - 1}
      slots = None
      if protocol == "context" and spec["kind"] != "dense":
        kwargs["context_lengths"] = np.array([contexts[i] for i in rows], np.int32)
        # Sized as generate sizes it (the kept context plus the question and the answer), for
        # the point's largest example, so every batch of the point runs one compiled program.
        slots = registry.slots_needed(spec, np.array([contexts[i] for i in index]),
                                      np.array([len(ids[i]) + new - 1 for i in index]))
        kwargs["max_len"] = slots or kwargs["max_len"]

      contexts_b = np.array([contexts[i] for i in rows], np.int32)
      replayed = (records is not None and compression.get("replay", False)
                  and (spec["kind"] == "dense" or protocol == "context")
                  and bool((lengths > contexts_b).all()) and bool((contexts_b > 0).all()))
      if replayed:
        replayed = replay.replayable(model, factory(1, kwargs["max_len"]))  # kinds only

      if replayed:  # the context's forward pass once per batch, shared by every point
        key = (id(model), tuple(rows))
        if any(k[0] != id(model) for k in records):
          records.clear()  # another model's
        if key not in records:
          context, rest, rest_lengths = replay.split_prompts(prompts, lengths, contexts_b)
          t0 = time.perf_counter()
          inputs = jax.block_until_ready(replay.record(model, context, contexts_b))
          record_s += time.perf_counter() - t0
          records[key] = (inputs, rest, rest_lengths)
        inputs, rest, rest_lengths = records[key]

      def call():
        if replayed:
          tokens, counts = replay.generate_after(
              model, inputs, contexts_b, factory(len(rows), kwargs["max_len"]), rest,
              rest_lengths, new, eos_id=eos, capacity=width + new - 1)
        else:
          tokens, counts = kvattn.generate(model, prompts, lengths, new, **kwargs)
        return jax.block_until_ready((tokens, counts))

      first = start == 0 and task == workload["tasks"][0]
      if first and workload["warmup"]:  # compile (one program per point: same width and batch throughout)
        t0 = time.perf_counter()
        call()
        first_s = time.perf_counter() - t0
      t0 = time.perf_counter()
      tokens, counts = call()
      timed_s += time.perf_counter() - t0
      engines.add("replay" if replayed else "generate")
      tokens, counts = np.asarray(tokens), np.asarray(counts)
      for b, i in enumerate(rows):
        outputs[i] = _decode(tokenizer, tokens[b, :counts[b]].tolist())
        scores[i] = ruler.score(examples[i], outputs[i])
        budgets[i] = contexts[i] if spec["kind"] == "dense" else (
            max(1, int(contexts[i] * (1 - ratio))) if slots else budget)  # kvpress's count
      caches = factory(1, slots or width + new - 1)
      cache_bytes.append(sum(memory.tree_bytes(c.storage_arrays()) for c in caches))
      specs.append(spec)
  return {
      "policy": policy, "ratio": ratio, "protocol": protocol,
      "score": float(np.mean(scores)), "scores": scores, "outputs": outputs,
      "tasks": [e.task for e in examples], "lengths": [e.length for e in examples],
      "seeds": [e.seed for e in examples], "prompt_sha1": [ruler.prompt_sha1(e)
                                                           for e in examples],
      "context_tokens": contexts, "prompt_tokens": [len(r) for r in ids], "budgets": budgets,
      "specs": list(dict.fromkeys(json.dumps(s, sort_keys=True) for s in specs)),
      "cache_bytes_per_seq": float(np.mean(cache_bytes)), "num_examples": len(examples),
      "examples_per_s": len(examples) / timed_s, "timed_s": timed_s, "first_call_s": first_s,
      "includes_compile": not workload["warmup"],
      "engine": "+".join(sorted(engines)), "record_s": record_s,
      "chat_template": chat,
  }


def _head_dim(model: Any) -> int | None:
  """The head dim of the model's attention layers (ThinK's channels), None if not found."""
  from kvattn.caches._layers import gqa_layers  # pylint: disable=g-import-not-at-top
  try:
    return int(gqa_layers(model)[0].head_dim)
  except (AttributeError, IndexError, TypeError):
    return None


def read_kvpress(path: str) -> list[dict[str, Any]]:
  """The records of experiments/benchmarks/peers/kvpress_ruler.py in `path` ([] for "");
  torn lines are skipped."""
  out = []
  if path and os.path.exists(path):
    with open(path) as f:
      for line in f:
        try:
          out.append(json.loads(line))
        except json.JSONDecodeError:
          continue
  return out


def _mean(xs: Sequence[float]) -> float | None:
  return float(np.mean(xs)) if xs else None


def _fmt(x: float | None, spec: str = ".2f") -> str:
  return "-" if x is None else format(x, spec)


def kvpress_table(peer: Sequence[Mapping[str, Any]]
                  ) -> dict[tuple[str, str, float], dict[str, Any]]:
  """kvpress's records by `(model, kvattn kind, ratio)`: mean score, examples/s (one at a
  time, the inverse mean wall seconds), the seeds and prompt digests it saw. Its uncompressed
  run (press "none") is keyed as kind "none", ratio 0."""
  groups = collections.defaultdict(list)
  for r in peer:
    if r.get("skipped") or r.get("score") is None:
      continue
    groups[r["model"], r.get("kvattn_kind", r["press"]), float(r["ratio"])].append(r)
  return {k: {"score": _mean([r["score"] for r in v]), "n": len(v),
              "examples_per_s": 1.0 / _mean([r["wall_s"] for r in v]),
              "sha1": [((r["task"], r["length"], r["seed"]), r["prompt_sha1"]) for r in v]}
          for k, v in groups.items()}


def write_report(workdir: str, records: Sequence[Mapping[str, Any]],
                 peer: Sequence[Mapping[str, Any]] = (), *, title: str) -> str:
  """Writes report.md (score, bytes and speed tables; kvpress beside ours when `peer` has
  records; the skipped presses) and compression.png; returns the markdown."""
  by_model = collections.defaultdict(dict)
  for r in records:
    by_model[r["model_name"]][r["policy"], r["ratio"]] = r
  ratios = sorted({r["ratio"] for r in records} | {0.0})
  kvp = kvpress_table(peer)
  lines = [f"# {title}", ""]
  if records:
    r0 = records[0]
    lines += [
        f"Protocol: **{r0['protocol']}**"
        + (" (the cache holds int(context_tokens * (1 - ratio)) slots for prompt and answer "
           "alike: not kvpress's protocol, which compresses the context only)"
           if r0["protocol"] == "fixed_budget" else " (kvpress's: context compressed, "
           "question and answer appended)")
        + f". Ratio 0 is the dense cache. Each cell: mean score of {r0['num_examples']} "
        f"examples (tasks {sorted(set(r0['tasks']))}, lengths {sorted(set(r0['lengths']))}).",
        ""]
  for model, points in by_model.items():
    base = points.get((NONE, 0.0))
    policies = sorted({p for p, _ in points if p != NONE})
    rows, byte_rows, speed_rows = [], [], []
    for p in policies:
      row, brow, srow = [p], [p], [p]
      for ratio in ratios:
        r = base if ratio == 0 else points.get((p, ratio))
        cell = _fmt(r and r["score"])
        peer_cell = kvp.get((model, p, ratio)) or (kvp.get((model, NONE, 0.0)) if ratio == 0
                                                    else None)
        if peer_cell:
          cell += f" / {peer_cell['score']:.2f}"
        row.append(cell)
        brow.append(_fmt(r and r["cache_bytes_per_seq"] / 2**20, ".2f"))
        srow.append(_fmt(r and r["examples_per_s"], ".2f") + ("*" if r and r.get(
            "includes_compile") else ""))
      rows.append(row)
      byte_rows.append(brow)
      speed_rows.append(srow)
    heads = ["policy"] + [f"ratio {x:g}" for x in ratios]
    lines += [f"## {model}", "", "Score (kvattn" + (" / kvpress" if kvp else "") + "):", "",
              report_lib.markdown_table(heads, rows), "",
              "Cache bytes held per sequence (MiB, measured storage arrays):", "",
              report_lib.markdown_table(heads, byte_rows), "",
              "Examples per second (kvattn, batched; steady state after compilation, * = "
              "compilation included"
              + (f"; replay: the question, answer and each layer's context write per point, "
                 f"the context's forward pass recorded once per batch in "
                 f"{sum(r.get('record_s', 0.0) for r in points.values()):.1f} s, not counted"
                 if any("replay" in r.get("engine", "") for r in points.values()) else "")
              + "):", "",
              report_lib.markdown_table(heads, speed_rows), ""]
    if kvp:
      lines += _peer_lines(model, points, kvp)
  skipped = sorted({(r["press"], r["skipped"]) for r in peer if r.get("skipped")})
  if skipped:
    lines += ["## kvpress presses not run", ""] + [f"- {p}: {why}" for p, why in skipped] + [""]
  markdown = "\n".join(lines)
  return report_lib.write_report(workdir, markdown, records,
                                 lambda w, recs: _plot(w, by_model, ratios, kvp))


def _peer_lines(model: str, points: Mapping[tuple, Mapping[str, Any]],
                kvp: Mapping[tuple, Mapping[str, Any]]) -> list[str]:
  """Speed beside kvpress's, and whether both saw the same prompts."""
  ours = [r for r in points.values()]
  theirs = [v for (m, _, _), v in kvp.items() if m == model]
  if not theirs:
    return []
  ours_eps = _mean([r["examples_per_s"] for r in ours])
  their_eps = _mean([v["examples_per_s"] for v in theirs])
  sha_ours = {(t, n, s): h for r in ours
              for t, n, s, h in zip(r["tasks"], r["lengths"], r["seeds"], r["prompt_sha1"])}
  pairs = [(k, h) for v in theirs for k, h in v["sha1"] if k in sha_ours]
  same = sum(sha_ours[k] == h for k, h in pairs)
  replayed = any("replay" in r.get("engine", "") for r in ours)
  return [f"Examples/s, mean over points: kvattn {ours_eps:.3f}, kvpress {their_eps:.3f} "
          f"(one example at a time) = {ours_eps / their_eps:.1f}x"
          + (" (not like for like: kvattn's points replay one recorded context pass, "
             "experiments/benchmarks/compression_speed.py compares a whole example)"
             if replayed else "")
          + f". Prompts: {same} of {len(pairs)} kvpress examples have the same text as "
          "kvattn's (task, length, seed).", ""]


def _plot(workdir: str, by_model: Mapping[str, Mapping[tuple, Any]], ratios: Sequence[float],
          kvp: Mapping[tuple, Mapping[str, Any]]) -> None:
  """compression.png: score vs ratio, one panel per model, one line per policy; kvpress's
  points as crosses in the policy's colour."""
  plt = report_lib.pyplot()
  fig, axes = plt.subplots(1, len(by_model), figsize=(6 * len(by_model), 4.5), squeeze=False)
  for ax, (model, points) in zip(axes[0], by_model.items()):
    base = points.get((NONE, 0.0))
    policies = sorted({p for p, _ in points if p != NONE})
    cmap = plt.get_cmap("tab10" if len(policies) <= 10 else "tab20")
    colors = [cmap(i % cmap.N) for i in range(len(policies))]
    for color, p in zip(colors, policies):
      xs = [x for x in ratios if (x == 0 and base) or (p, x) in points]
      ys = [(base if x == 0 else points[p, x])["score"] for x in xs]
      ax.plot(xs, ys, "o-", color=color, label=p)
      px = [x for x in ratios if (model, p, x) in kvp or (x == 0 and (model, NONE, 0.0) in kvp)]
      py = [(kvp.get((model, p, x)) or kvp[model, NONE, 0.0])["score"] for x in px]
      if any(x > 0 for x in px):  # not the shared uncompressed point alone
        ax.plot(px, py, "x--", color=color, alpha=0.7, markersize=9, label=f"{p} (kvpress)")
    ax.set_title(model + (" (crosses: kvpress)" if any(k[0] == model for k in kvp) else ""))
    ax.set_xlabel("compression ratio")
    ax.set_ylabel("RULER-style score")
    ax.set_ylim(-0.05, 1.05)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
  report_lib.save_figure(fig, os.path.join(workdir, "compression.png"))
