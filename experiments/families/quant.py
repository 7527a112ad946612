r"""Quantized KV caches: memory, decode speed and quality of int8 / fp8 caches per variant.

    python -m experiments.main --config=configs/quant_sweep.py --workdir=runs/quant
    python -m experiments.main --config=configs/quant_sweep.py:smoke --workdir=/tmp/quant

The "quant" experiment family of experiments/framework/runner.py (`experiment.kind =
"quant"`). It extends the main job's "variants" family
(experiments/families/variants.py): the same config
sections (plus `quality`), the same training per variant (cached in
`<workdir>/train/<hash>/` or `experiment.train_dir`, with the same hash as the
main job's, so `--config.experiment.train_dir=runs/default/train` reuses its
trainings), the same cache-bytes check and decode timing; the runner keeps
the bookkeeping (results.jsonl, resume, atomic files). One point per
(variant, cache dtype) at one capacity S (`cache.seq_lens`). Per point:

  * cache bytes per token from the real arrays (values plus the f32 scales of
    a quantized cache: `storage_arrays()`), checked against
    `kvattn.memory`'s analytic figure (`checks.CacheAccountingError` stops the
    run if they differ);
  * decode tokens/s of kvattn.generate's compiled prefill + decode loop at
    capacity S (the main job's measurement: prompt of real validation text
    filling the cache, warm-up, median of timed runs);
  * teacher-forced validation bits per byte through the cache: for each of
    `quality.rows` validation rows, the first `quality.prefix` tokens are
    prefilled into an empty cache of the point's dtype in one call, then the
    remaining tokens are fed one per decode step (T = 1, the decode dispatch
    path), each step's logits scoring the next token. Every attention --
    prefill included -- reads keys and values back from the (quantized) cache,
    so the figure is the model's quality when decoding reads that cache. Bits
    per byte as in kvattn.training.trainer (nats over non-PAD targets / ln 2 / byte
    targets). The same rows' no-cache figure (one causal forward pass in the
    model dtype) is recorded next to it;
  * greedy agreement with the bf16 cache: `quality.agreement_prompts` prompts
    of validation text, `quality.agreement_tokens` greedy tokens each through
    `kvattn.generate` with this cache dtype and with bf16; the fraction of
    positions that match, and where each prompt's tokens first differ.

The report (report.md, quant_quality.png) puts each dtype next to the bf16
cache of the same variant.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from typing import Any, Mapping, Sequence

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from experiments.framework import report as report_lib
from experiments.framework import results
from experiments.framework import runner
from experiments.framework import overrides
from experiments.framework import checks
from experiments.families import variants as variants_experiment
from experiments.families import variants_report
from kvattn.training import data as data_lib
from kvattn import memory
from kvattn.training import trainer as train_lib
from kvattn.models import transformer as transformer_lib
from kvattn.inference.generation import generate
from kvattn.ops import quant

BASELINE_DTYPE = "bfloat16"
FILES = {"plot": "quant_quality.png"}
SHORT = {"float32": "f32", "bfloat16": "bf16", "float16": "f16", "int8": "int8",
         "float8_e4m3fn": "fp8-e4m3", "float8_e5m2": "fp8-e5m2"}


def schema() -> dict[str, tuple[str, ...]]:
  """The "variants" schema plus `quality` (see configs/quant_sweep.py for each field)."""
  return {**variants_experiment.variants_schema(),
          "quality": ("rows", "prefix", "agreement_tokens", "agreement_prompts",
                      "agreement_prompt_len")}



@functools.partial(jax.jit, static_argnames=("graphdef", "prefix"))
def _teacher_forced(graphdef, state, rows, caches, *, prefix: int):
  """Per-target nll `f32[B, L]` of rows `i32[B, L + 1]`, every logit read through `caches`.

  Tokens `[0, prefix)` are prefilled in one call, then tokens `prefix .. L-1` are
  fed one per step (`lax.scan` of T = 1 model calls, the decode path).
  """
  model = nnx.merge(graphdef, state)
  inputs, targets = rows[:, :-1], rows[:, 1:]
  logits_pre, caches = model(inputs[:, :prefix], caches=caches)  # [B, prefix, V]

  def step(caches, token):  # token: i32[B]
    logits, caches = model(token[:, None], caches=caches)
    return caches, logits[:, 0].astype(jnp.float32)

  caches, logits_dec = lax.scan(step, caches, inputs[:, prefix:].T)  # [L - prefix, B, V]
  logits = jnp.concatenate([logits_pre.astype(jnp.float32),
                            jnp.moveaxis(logits_dec, 0, 1)], axis=1)
  return optax.softmax_cross_entropy_with_integer_labels(logits, targets)


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _no_cache(graphdef, state, rows):
  """Per-target nll `f32[B, L]` of one causal forward pass without a cache."""
  nll, _, _ = train_lib.token_losses(nnx.merge(graphdef, state), rows)
  return nll


def bits_per_byte(nll: np.ndarray, targets: np.ndarray) -> float:
  """kvattn.training.trainer's bits/byte: nats summed over non-PAD targets / ln 2 / byte targets."""
  mask = targets != data_lib.PAD_ID
  num_bytes = np.sum(mask & (targets < data_lib.NUM_BYTES))
  return float(np.sum(np.where(mask, nll, 0.0)) / math.log(2) / num_bytes)


def agreement(tokens: np.ndarray, reference: np.ndarray) -> dict[str, Any]:
  """Greedy agreement of `tokens` with `reference` (both `i32[B, n]`).

  Returns the fraction of equal positions, the first differing position of
  each row (n when none differs) and their mean.
  """
  same = tokens == reference
  first = [int(np.argmin(row)) if not row.all() else int(row.size) for row in same]
  return {"greedy_agreement": float(same.mean()), "greedy_first_divergence": first,
          "greedy_first_divergence_mean": float(np.mean(first))}


class QuantFamily(variants_experiment.VariantsFamily):
  """Each variant x each cache dtype: bytes, decode speed, quality (module doc)."""

  kind = "quant"

  def __init__(self, workdir: str):
    super().__init__(workdir)
    self.schema = schema()
    self._title = "kvattn: quantized KV caches"
    self._reference_tokens: dict[str, np.ndarray] = {}
    self._no_cache_bpb: dict[str, float] = {}

  # -- points and validation -------------------------------------------------------------------

  def _check(self, d: Mapping[str, Any], where: str):
    """The variants family's checks, then the `quality` section; ValueError naming the key."""
    spec = super()._check(d, where)  # cache.dtype included (float or int8/fp8)
    if len(d["cache"]["seq_lens"]) != 1:
      raise ValueError(f"{where}: cache.seq_lens must hold one S for the quant family; got "
                       f"{d['cache']['seq_lens']!r}")
    q, seq_len = d["quality"], d["data"]["seq_len"]
    checks.check_int(f"{where}: quality.rows", q["rows"])
    prefix = checks.check_int(f"{where}: quality.prefix", q["prefix"])
    if prefix >= seq_len:
      raise ValueError(f"{where}: quality.prefix must be < data.seq_len = {seq_len} (at least one "
                       f"decode step); got {prefix}")
    checks.check_int(f"{where}: quality.agreement_tokens", q["agreement_tokens"])
    checks.check_int(f"{where}: quality.agreement_prompts", q["agreement_prompts"])
    checks.check_int(f"{where}: quality.agreement_prompt_len", q["agreement_prompt_len"])
    return spec

  def points(self, config: Any, sweep: Sequence[Mapping[str, Any]]) -> list[runner.Point]:
    """The variants family's points (one per sweep entry at the one S), relabelled with the
    cache dtype; ids also hash the `quality` section.

    Raises:
      ValueError: as the variants family, plus bad cache dtypes and `quality` values, or more
        `quality.rows` than the corpus has validation rows.
    """
    points = super().points(config, sweep)
    out = []
    for p in points:
      d = p.config
      rows = self._dataset(d, p.label).validation_rows.shape[0]
      if d["quality"]["rows"] > rows:
        raise ValueError(f"{p.label}: quality.rows must be at most the {rows} validation rows of "
                         f"the corpus; got {d['quality']['rows']}")
      dtype = p.params["cache_dtype"]
      variant, k = p.params["variant"], p.params["num_kv_heads"]
      label = f"{variant}{'' if k is None else f'-K{k}'}-{SHORT.get(dtype, dtype)}"
      pid = f"{label}-{overrides.digest({'point': p.id, 'quality': d['quality']})}"
      out.append(dataclasses.replace(p, id=pid, label=label, params={
          **p.params, "cache_dtype_short": SHORT.get(dtype, dtype),
          "quantized": quant.is_quantized(dtype)}))
    return out

  # -- measurement ----------------------------------------------------------------------------

  def preflight(self, point: runner.Point) -> None:
    """The variants family's check (batch `cache.batch`, capacity S), then the same abstract
    decode step at the shape of the greedy-agreement caches (`generate`'s capacity
    `agreement_prompt_len + agreement_tokens - 1`, batch `agreement_prompts`), so a backend
    that cannot run either shape fails before any training."""
    super().preflight(point)
    d = point.config
    q = d["quality"]
    spec = transformer_lib.resolve_config(d["model"])
    batch = q["agreement_prompts"]
    capacity = q["agreement_prompt_len"] + q["agreement_tokens"] - 1
    implementation = d["model"]["attention"]["decode_implementation"]
    for dtype in {jnp.dtype(d["cache"]["dtype"] or d["model"]["dtype"]), jnp.dtype(BASELINE_DTYPE)}:
      key = ("agreement", repr(spec), batch, capacity, str(dtype))
      if key not in self._preflighted:
        checks.check_decode_step(
            spec, lambda model, dtype=dtype: model.init_caches(batch, capacity, dtype), batch,
            implementation=implementation, where=point.label)
        self._preflighted.add(key)

  def _rows(self, d: Mapping[str, Any]) -> np.ndarray:
    return self._dataset(d, "quality").validation_rows[:d["quality"]["rows"]]

  def _variant_key(self, point: runner.Point) -> str:
    """Points of one trained model and one quality setup share it (the cache dtype aside)."""
    return overrides.digest({"group": point.group, "quality": point.config["quality"],
                          "decode_seed": point.config["decode"]["seed"]})

  def teacher_forced(self, point: runner.Point, model, dtype) -> dict[str, float]:
    """Teacher-forced bits/byte through a cache of `dtype`, and without a cache (the latter
    does not depend on the cache: computed once per variant)."""
    d = point.config
    rows = self._rows(d)
    seq_len = rows.shape[1] - 1
    graphdef, state = nnx.split(model)
    caches = model.init_caches(rows.shape[0], seq_len, dtype)
    nll = _teacher_forced(graphdef, state, jnp.asarray(rows), caches,
                             prefix=d["quality"]["prefix"])
    targets = rows[:, 1:]
    key = self._variant_key(point)
    if key not in self._no_cache_bpb:
      reference = _no_cache(graphdef, state, jnp.asarray(rows))
      self._no_cache_bpb = {key: bits_per_byte(np.asarray(reference), targets)}
    return {"teacher_forced_bits_per_byte": bits_per_byte(np.asarray(nll), targets),
            "no_cache_bits_per_byte": self._no_cache_bpb[key],
            "quality_rows": int(rows.shape[0]), "quality_prefix": d["quality"]["prefix"]}

  def greedy(self, model, d: Mapping[str, Any], dtype) -> np.ndarray:
    q = d["quality"]
    prompts = self.prompts(d, q["agreement_prompts"], q["agreement_prompt_len"])
    lengths = np.full((prompts.shape[0],), prompts.shape[1], np.int32)
    tokens, _ = generate(model, prompts, lengths, q["agreement_tokens"], cache_dtype=dtype)
    return np.asarray(tokens)

  def reference_tokens(self, point: runner.Point, model) -> np.ndarray:
    """The bf16-cache greedy tokens of the point's variant (computed once per variant)."""
    key = self._variant_key(point)
    if key not in self._reference_tokens:
      self._reference_tokens = {key: self.greedy(model, point.config, jnp.bfloat16)}
    return self._reference_tokens[key]

  def measure(self, point: runner.Point) -> dict[str, Any]:
    """Bytes and decode timing (the variants family's measure), then quality."""
    record = super().measure(point)
    d = point.config
    model, _ = self.trained_model(point)
    dtype = jnp.dtype(d["cache"]["dtype"] or d["model"]["dtype"])
    record.update(self.teacher_forced(point, model, dtype))
    reference = self.reference_tokens(point, model)
    tokens = reference if dtype == jnp.dtype(BASELINE_DTYPE) else self.greedy(model, d, dtype)
    record.update(agreement(tokens, reference))
    record.update({
        "agreement_tokens": int(tokens.shape[1]), "agreement_prompts": int(tokens.shape[0]),
        "scale_bytes_per_token": int(sum(
            memory.tree_bytes(c.storage_arrays()[2:]) for c in model.init_caches(1, 1, dtype))),
        "decode_implementation": d["model"]["attention"]["decode_implementation"],
    })
    return record

  # -- report ---------------------------------------------------------------------------------

  def report(self, records: Sequence[Mapping[str, Any]]) -> str:
    return write_report(self.workdir, records, title=self._title, config=self._config)


runner.register_family("quant", QuantFamily)


# ----------------------------------------------------------------------------------------------
# Report.


def table_rows(records: Sequence[Mapping[str, Any]]) -> list[list[str]]:
  """One row per point; ratios and deltas against the bf16 point of the same variant."""
  base = {variants_report.variant_key(r): r for r in records
          if r["cache_dtype"] == BASELINE_DTYPE}
  rows = []
  for r in records:
    b = base.get(variants_report.variant_key(r))
    bytes_ratio = f"{r['cache_bytes_per_token'] / b['cache_bytes_per_token']:.1%}" if b else "n/a"
    speed = f"{r['decode_tokens_per_s'] / b['decode_tokens_per_s']:.2f}×" if b else "n/a"
    delta = (f"{r['teacher_forced_bits_per_byte'] - b['teacher_forced_bits_per_byte']:+.4f}"
             if b else "n/a")
    rows.append([
        r["variant"], "—" if r["num_kv_heads"] is None else str(r["num_kv_heads"]),
        r["cache_dtype_short"], f"{r['cache_bytes_per_token']:,}", bytes_ratio,
        f"{r['decode_tokens_per_s']:,.0f}", speed, f"{r['teacher_forced_bits_per_byte']:.4f}",
        delta, f"{r['greedy_agreement']:.1%}", f"{r['greedy_first_divergence_mean']:.0f}"])
  return rows


def write_report(workdir: str, records: Sequence[Mapping[str, Any]], *, title: str,
                 config: Mapping[str, Any] | None = None) -> str:
  """Writes report.md and quant_quality.png atomically; returns the markdown."""
  records = list(records)
  lines = [f"# {title}", ""]
  if records:
    r0, cfg = records[0], records[0]["config"]
    att, mod = cfg["model"]["attention"], cfg["model"]
    env = r0["environment"]
    lines += [
        f"Model: D = {mod['d_model']}, L = {mod['num_layers']}, N = {att['num_heads']} query "
        f"heads, H = {att['head_dim']} (MLA: C = {att['kv_lora_rank']}, R = "
        f"{att['qk_rope_head_dim']}), {mod['dtype']} compute; each variant trained "
        f"{r0['train_steps']} steps. Cache: batch {r0['batch']}, S = {r0['seq_len']}; "
        f"quantized caches store 1-byte values plus one f32 scale per token per KV head "
        f"(MLA: one per token for c_kv and one for k_rope), counted in the bytes. "
        f"Decode: {r0['decode_steps']} steps through kvattn.generate, medians of "
        f"{r0['repeats'] * r0['decode_repeats']} timed loops. Quality: "
        f"{r0['quality_rows']} validation rows of {cfg['data']['seq_len']} tokens, "
        f"teacher-forced through the cache ({r0['quality_prefix']} tokens prefilled, the rest "
        f"one per decode step); greedy agreement over {r0['agreement_tokens']} tokens from "
        f"{r0['agreement_prompts']} prompts against the bf16 cache. Machine: "
        f"{r0.get('cpu_model', env['device_kind'])} ({env['cpu_count']} CPUs, "
        f"{env['backend']}), JAX {env['jax_version']}, 1-minute load average "
        f"{min(r['load_avg_1min'] for r in records):.1f}-"
        f"{max(r['load_avg_1min'] for r in records):.1f}.", ""]
  lines.append(report_lib.markdown_table(
      ["variant", "K", "cache", "bytes/token", "vs bf16", "decode tok/s", "speed vs bf16",
       "val bits/byte (via cache)", "Δ vs bf16", "greedy agreement", "first divergence (mean)"],
      table_rows(records)))
  if records:
    no_cache = {}
    for r in records:
      no_cache.setdefault(variants_report.variant_key(r), r["no_cache_bits_per_byte"])
    lines += ["", "No-cache bits/byte of the same rows (one causal forward pass, "
              f"{records[0]['config']['model']['dtype']}): " + ", ".join(
                  f"{k} {v:.4f}" for k, v in no_cache.items()) + ".", "",
              "Reading: `vs bf16` is the cache size over the bf16 cache of the same variant "
              "(1-byte values are half of bf16's; the f32 scales add 4 bytes per token per KV "
              "head, i.e. 4/H of the values: 25% at H = 16, 3% at H = 128). `Δ vs bf16`: "
              "bits/byte through this cache minus through the bf16 cache. `greedy agreement`: "
              "share of the "
              "generated positions equal to the bf16 cache's (after the first difference the "
              "two continuations are different texts, so this falls quickly once they part); "
              "`first divergence`: mean position of the first differing token "
              f"({records[0]['agreement_tokens']} = none). Speed ratios on a shared CPU move by "
              "tens of percent between runs; on CPU the 1-byte formats are converted to f32 "
              "before the dots, so they save memory, not time.", "",
              f"![quality vs bytes]({FILES['plot']})", ""]
  return report_lib.write_report(
      workdir, "\n".join(lines), records,
      lambda workdir, records: _plot(records, os.path.join(workdir, FILES["plot"])))


def _plot(records, path: str) -> None:
  plt = report_lib.pyplot()
  fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.8))
  markers = {"bfloat16": "o", "int8": "s", "float8_e4m3fn": "^", "float8_e5m2": "v"}
  for i, key in enumerate(dict.fromkeys(variants_report.variant_key(r) for r in records)):
    rs = [r for r in records if variants_report.variant_key(r) == key]
    for r in rs:
      m = markers.get(r["cache_dtype"], "x")
      ax1.scatter(r["cache_bytes_per_token"], r["teacher_forced_bits_per_byte"], color=f"C{i}",
                  marker=m, label=f"{key} {r['cache_dtype_short']}")
      ax2.scatter(r["cache_bytes_per_token"], r["greedy_agreement"], color=f"C{i}", marker=m)
  ax1.set_xscale("log", base=2)
  ax2.set_xscale("log", base=2)
  ax1.set_xlabel("cache bytes per token (all layers)")
  ax2.set_xlabel("cache bytes per token (all layers)")
  ax1.set_ylabel("val bits/byte, decoding through the cache")
  ax2.set_ylabel("greedy agreement with bf16 cache")
  ax1.legend(fontsize=6, ncol=2)
  fig.suptitle("quantized KV caches")
  fig.subplots_adjust(wspace=0.3)
  report_lib.save_figure(fig, path)
