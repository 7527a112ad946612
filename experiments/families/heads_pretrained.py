r"""Head grouping on a pretrained model: convert to fewer KV heads or to MLA, then uptrain.

    python -m experiments.main --config=configs/heads_sweep_pretrained.py --workdir=runs/hp
    python -m experiments.main --config=configs/heads_sweep_pretrained.py:smoke --workdir=/tmp/hp

Each point converts the source checkpoint (`source.name`: a `kvattn.from_pretrained` name or
path, e.g. SmolLM2-135M-Instruct with N = 9 query and K = 3 KV heads; or "random": a random
model of the `model` section with the byte tokenizer, for smoke runs) with `kvattn.models.convert`
(`convert.kind`: "regroup" to `convert.num_kv_heads` heads by `convert.method` "mean" or
"first"; "mla" to a latent of `convert.kv_lora_rank` plus `convert.qk_rope_head_dim` rope
dims, MHA2MLA; "cla" to cross-layer KV sharing at `convert.cla_factor`, the shared K/V
projection of each group the `convert.method` "mean" or "first" of the group's) and measures, on the default corpus tokenized with the model's tokenizer:

* cache bytes per token (read from the arrays of a dense / latent cache, checked against
  `Transformer.cache_bytes_per_token`);
* validation perplexity on `data.eval_rows` held-out rows, converted and after `train.steps`
  uptraining steps (`kvattn.training.trainer.uptrain`, attention parameters only when
  `uptrain.attention_only`; orbax checkpoints under the workdir, so a rerun resumes);
* passkey retrieval accuracy (Mohtashami & Jaggi 2023): a 5-digit key stated once inside
  filler text of `passkey.context_len` tokens at a random depth, then asked for; greedy
  decoding must produce it (`passkey.samples` prompts), converted and uptrained;
* greedy decode tokens/s through `kvattn.generate`'s compiled prefill and decode programs.

The report has the table and a quality-vs-cache-bytes plot with one marker per point and an
arrow from the converted to the uptrained perplexity.
"""

from __future__ import annotations

import os
import time
from typing import Any, Mapping, Sequence

import jax.numpy as jnp
import numpy as np
from flax import nnx

from experiments.framework import report as report_lib
from experiments.framework import runner
from experiments.framework import overrides
from experiments.framework import checks
from experiments.evals import text as text_lib
from experiments.framework import timing
from kvattn.models import convert
from kvattn.training import data as data_lib
from kvattn.training import trainer as train_lib
from kvattn.models import transformer as transformer_lib

CONVERT_KINDS = ("regroup", "mla", "cla")


def schema() -> dict[str, tuple[str, ...]]:
  """Sections and keys of a "heads_pretrained" config (configs/heads_sweep_pretrained.py)."""
  return {
      "source": ("name",),
      "model": tuple(overrides.flat_keys(transformer_lib.model_config().to_dict())),
      "convert": ("kind", "num_kv_heads", "method", "kv_lora_rank", "qk_rope_head_dim",
                  "rope_selection", "cla_factor"),
      "data": ("seq_len", "max_bytes", "validation_fraction", "eval_rows"),
      "train": tuple(train_lib.train_config().keys()),
      "uptrain": ("attention_only",),
      "passkey": ("context_len", "samples", "seed"),
      "decode": ("batch", "prompt_len", "new_tokens", "repeats"),
      "experiment": ("kind", "name", "max_points"),
  }


def label(conv: Mapping[str, Any], source_kv_heads: int) -> str:
  """`K9-dup`, `K3`, `K1-mean`, `K1-first`, `MLA-C104-R24`, `CLA2-mean` (names of the table
  and plot)."""
  if conv["kind"] == "cla":
    return f"CLA{conv['cla_factor']}-{conv['method']}"
  if conv["kind"] == "mla":
    return f"MLA-C{conv['kv_lora_rank']}-R{conv['qk_rope_head_dim']}"
  k = conv["num_kv_heads"]
  if k == source_kv_heads:
    return f"K{k}"
  return f"K{k}-dup" if k > source_kv_heads else f"K{k}-{conv['method']}"


def convert_model(model: transformer_lib.Transformer, conv: Mapping[str, Any]
                  ) -> transformer_lib.Transformer:
  """The point's converted model (`kvattn.models.convert`); a copy even when nothing changes."""
  if conv["kind"] == "cla":
    return convert.to_cla(model, conv["cla_factor"], method=conv["method"])
  if conv["kind"] == "mla":
    return convert.to_mla(model, conv["kv_lora_rank"], conv["qk_rope_head_dim"],
                          method=conv["method"], rope_selection=conv["rope_selection"])
  return convert.regroup_kv_heads(model, conv["num_kv_heads"], method=conv["method"])


def passkey_accuracy(model: Any, tokenizer: Any, passkey: Mapping[str, Any]) -> float:
  """Fraction of passkey prompts whose greedy continuation (8 tokens) contains the key.

  The prompts run one at a time (a batch of B 2k-token prefills would hold B x N x T^2
  attention scores at once, ~0.6 GB per layer at B = 4 on SmolLM2), each right-padded to the
  longest with its own length, so a model compiles one prefill and one decode program.
  """
  from kvattn.inference.generation import generate  # pylint: disable=g-import-not-at-top
  prompts, lengths, keys = text_lib.passkey_prompts(tokenizer, passkey["context_len"], passkey["samples"],
                                           passkey["seed"])
  hits = 0
  for b, key in enumerate(keys):
    tokens, n = generate(model, prompts[b:b + 1], lengths[b:b + 1], 8)
    hits += key in tokenizer.decode(np.asarray(tokens[0, :int(n[0])]).tolist())
  return hits / len(keys)


class HeadsPretrainedFamily:
  """Converted checkpoints at several KV-head counts and MLA ranks (module doc)."""

  kind = "heads_pretrained"

  def __init__(self, workdir: str):
    self.workdir = workdir
    self._title = "kvattn: head grouping on a pretrained model"
    # Sources and datasets by key, kept for a sweep that alternates sources (a few GB at most).
    self._sources: dict[str, tuple[Any, Any]] = {}  # key -> (model, tokenizer)
    self._datasets: dict[str, data_lib.Dataset] = {}

  # -- source, data ---------------------------------------------------------------------------

  def source(self, d: Mapping[str, Any]) -> tuple[transformer_lib.Transformer, Any]:
    """The source model and tokenizer, loaded once per source (and kept)."""
    key = overrides.digest({"source": d["source"], "model": d["model"]})
    if key not in self._sources:
      name = d["source"]["name"]
      if name == "random":
        spec = checks.model_spec(d, "config")
        model, tok = transformer_lib.Transformer(spec, rngs=nnx.Rngs(0)), data_lib.ByteTokenizer(bos=True)
      else:
        from kvattn.checkpoints import pretrained  # pylint: disable=g-import-not-at-top
        try:
          model, tok = pretrained.from_pretrained(name)
        except (FileNotFoundError, KeyError) as e:
          raise ValueError(f"source.name must be 'random' or a kvattn.from_pretrained source; "
                           f"got {name!r} ({e})") from None
      self._sources[key] = (model, tok)
    return self._sources[key]

  def dataset(self, d: Mapping[str, Any]) -> data_lib.Dataset:
    """The default corpus tokenized with the source's tokenizer (once per source and data)."""
    key = overrides.digest({"source": d["source"], "data": d["data"]})
    if key not in self._datasets:
      _, tok = self.source(d)
      dd = d["data"]
      self._datasets[key] = data_lib.load_token_dataset(
          tok.encode, eos_id=tok.eos_id, seq_len=dd["seq_len"], max_bytes=dd["max_bytes"],
          validation_fraction=dd["validation_fraction"])
    return self._datasets[key]

  # -- points and validation -------------------------------------------------------------------

  def _check(self, d: Mapping[str, Any], where: str) -> str:
    """Validates one point (converting abstractly); returns its label."""
    conv = d["convert"]
    if conv["kind"] not in CONVERT_KINDS:
      raise ValueError(f"{where}: convert.kind must be one of {CONVERT_KINDS}; got "
                       f"{conv['kind']!r}")
    for key in ("seq_len", "eval_rows"):
      checks.check_int(f"{where}: data.{key}", d["data"][key])
    for key in ("context_len", "samples"):
      checks.check_int(f"{where}: passkey.{key}", d["passkey"][key])
    for key in ("batch", "prompt_len", "new_tokens", "repeats"):
      checks.check_int(f"{where}: decode.{key}", d["decode"][key])
    train_lib.check_train_config(d["train"])
    model, _ = self.source(d)
    try:  # the conversion's own checks (no weights computed)
      if conv["kind"] == "cla":
        convert.check_cla(model, conv["cla_factor"], method=conv["method"])
      elif conv["kind"] == "mla":
        convert.check_to_mla(model, conv["kv_lora_rank"], conv["qk_rope_head_dim"],
                             method=conv["method"], rope_selection=conv["rope_selection"])
      else:
        convert.check_regroup(model, conv["num_kv_heads"], method=conv["method"])
    except (ValueError, NotImplementedError) as e:
      raise ValueError(f"{where}: convert: {e}") from None
    return label(conv, model.layers[0].attn.num_kv_heads)

  def points(self, config: Any, sweep: Sequence[Mapping[str, Any]]) -> list[runner.Point]:
    """One point per sweep entry, each conversion validated before any work.

    Raises:
      ValueError: unknown key, bad value, impossible conversion or duplicate point.
    """
    base = overrides.to_dict(config)
    overrides.check_schema(base, schema())
    self._title = base["experiment"]["name"] or self._title

    # Several sources (a sweep over `source.name`): the labels name the source too.
    sources = {entry.get("source.name", base["source"]["name"]) for entry in sweep}

    def point_of(d, where):
      name = self._check(d, where)
      if len(sources) > 1:
        name = f"{d['source']['name']}/{name}"
      return runner.PointSpec(name, {k: v for k, v in d.items() if k != "experiment"},
                              overrides.digest(d["source"], 12), {"convert": dict(d["convert"])})

    return runner.expand_points(config, sweep, point_of)

  # -- measurement ----------------------------------------------------------------------------

  def _evaluate(self, model, d) -> dict[str, float]:
    """Loss and perplexity on the first `data.eval_rows` validation rows. The trainer splits
    the model as `uptrain` does, so the converted model, uptrain's own final evaluation and
    the uptrained model share one compiled eval step (no train step runs: nothing donated)."""
    rows = self.dataset(d).validation_rows[:d["data"]["eval_rows"]]
    trainable = train_lib.ATTENTION_PARAMS if d["uptrain"]["attention_only"] else nnx.Param
    trainer = train_lib.Trainer(model, d["train"], trainable=trainable, pad_id=-1)
    return trainer.evaluate_tokens(train_lib.token_eval_batches(rows, d["train"]["batch_size"]))

  def _decode_speed(self, model, d) -> dict[str, float]:
    dec = d["decode"]
    prompts = jnp.ones((dec["batch"], dec["prompt_len"]), jnp.int32)
    lengths = jnp.full((dec["batch"],), dec["prompt_len"], jnp.int32)
    speeds = []
    for _ in range(dec["repeats"] + 1):  # the first run compiles
      caches = model.init_caches(dec["batch"], dec["prompt_len"] + dec["new_tokens"])
      _, first, caches, key = timing.timed_prefill(model, prompts, lengths, caches)
      seconds, _, _, _, _ = timing.timed_decode(model, first, caches, dec["new_tokens"], key)
      speeds.append(dec["batch"] * dec["new_tokens"] / seconds)
    return timing.stats("decode_tokens_per_s", speeds[1:])

  def measure(self, point: runner.Point) -> dict[str, Any]:
    d = point.config
    cpu_start, wall_start = time.process_time(), time.perf_counter()
    source, tok = self.source(d)
    model = convert_model(source, d["convert"])
    analytic = model.cache_bytes_per_token()
    record: dict[str, Any] = {
        "label": point.label, "convert_kind": d["convert"]["kind"],
        "source": d["source"]["name"], "cache_bytes_per_token_analytic": analytic,
        **checks.check_cache_bytes(model.init_caches(1, 16), analytic, 1, 16),
        "source_cache_bytes_per_token": source.cache_bytes_per_token()}
    before = self._evaluate(model, d)
    record.update(perplexity_converted=before["perplexity"], loss_converted=before["loss"],
                  eval_tokens=before["tokens"],
                  passkey_converted=passkey_accuracy(model, tok, d["passkey"]))
    record.update(self._decode_speed(model, d))
    ckpt = os.path.join(self.workdir, "uptrain", point.id)
    cpu_train = time.process_time()
    # The converted model is not used after this: uptrain takes it over (no copy of 135M
    # params on a memory-tight shared machine).
    result = train_lib.uptrain(model, self.dataset(d), d["train"],
                               attention_only=d["uptrain"]["attention_only"],
                               checkpoint_dir=ckpt)
    cpu_train = time.process_time() - cpu_train
    after = self._evaluate(result.model, d)
    record.update(perplexity_uptrained=after["perplexity"], loss_uptrained=after["loss"],
                  uptrain_steps=result.metrics["steps"],
                  uptrain_seconds=result.metrics["train_seconds"],
                  uptrain_cpu_seconds=cpu_train, uptrain_train_loss=result.metrics["train_loss"],
                  uptrain_tokens=result.metrics["steps"] * d["train"]["batch_size"]
                  * d["data"]["seq_len"],
                  passkey_uptrained=passkey_accuracy(result.model, tok, d["passkey"]))
    record.update(point_cpu_seconds=time.process_time() - cpu_start,
                  point_wall_seconds=time.perf_counter() - wall_start)
    return record

  # -- report ---------------------------------------------------------------------------------

  def report(self, records: Sequence[Mapping[str, Any]]) -> str:
    return write_report(self.workdir, records, title=self._title)


runner.register_family("heads_pretrained", HeadsPretrainedFamily)


def _fmt(x: Any, spec: str = ".2f") -> str:
  return format(x, spec)


def _seconds(x: float | None) -> str:
  return "-" if x is None else f"{x:.0f}"


def write_report(workdir: str, records: Sequence[Mapping[str, Any]], *, title: str) -> str:
  """Writes report.md and quality_vs_cache.png atomically; returns the markdown."""
  records = sorted(records, key=lambda r: (r["source"], r["cache_bytes_per_token"]))
  rows = [[r["label"], r["cache_bytes_per_token"], r["cache_bytes_per_token_analytic"],
           f"{r['cache_bytes_per_token'] / r['source_cache_bytes_per_token']:.3f}",
           _fmt(r["perplexity_converted"]), _fmt(r["perplexity_uptrained"]),
           f"{r['perplexity_uptrained'] / r['perplexity_converted']:.3f}",
           _fmt(r["passkey_converted"]), _fmt(r["passkey_uptrained"]),
           f"{r['decode_tokens_per_s']:.1f}", _seconds(r.get("point_cpu_seconds")),
           _seconds(r.get("point_wall_seconds"))] for r in records]
  table = report_lib.markdown_table(
      ["point", "cache B/token", "analytic", "vs source", "ppl converted", "ppl uptrained",
       "uptrained / converted", "passkey converted", "passkey uptrained", "decode tok/s",
       "CPU s", "wall s"], rows)
  lines = [f"# {title}", ""]
  if records:
    r0 = records[0]
    d = r0["config"]
    cpu = sum(r.get("point_cpu_seconds", 0.0) for r in records)
    wall = sum(r.get("point_wall_seconds", 0.0) for r in records)
    loads = [r["load_avg_1min"] for r in records if "load_avg_1min" in r]
    load = f", 1-min load {min(loads):.1f}-{max(loads):.1f}" if loads else ""
    lines += [
        "Source: " + ", ".join(sorted({f"{r['source']} ({r['source_cache_bytes_per_token']} "
                                       f"cache bytes/token)" for r in records})) + ". "
        f"Perplexity on {int(r0['eval_tokens'])} held-out tokens of the default corpus "
        f"(`data.eval_rows` = {d['data']['eval_rows']} rows of {d['data']['seq_len']}); "
        f"uptraining: {d['train']['steps']} steps of {d['train']['batch_size']} x "
        f"{d['data']['seq_len']} tokens, lr {d['train']['learning_rate']}, "
        f"{'attention parameters only' if d['uptrain']['attention_only'] else 'all parameters'}"
        f". Passkey: {d['passkey']['samples']} prompts of ~{d['passkey']['context_len']} tokens. "
        f"Cache bytes measured from the arrays of a cache (`analytic`: "
        f"`Transformer.cache_bytes_per_token`). Machine: {r0['environment']['device_kind']} "
        f"({r0['environment']['cpu_count']} CPUs). {len(records)} points: {cpu:.0f} process "
        f"CPU-seconds, {wall:.0f} s wall{load} (wall time grows with the machine's load, CPU "
        f"time much less).", ""]
  lines += [table, "", "![quality vs cache](quality_vs_cache.png)", ""]
  return report_lib.write_report(
      workdir, "\n".join(lines), records,
      lambda workdir, records: _plot(records, os.path.join(workdir, "quality_vs_cache.png")))


def _plot(records, path: str) -> None:
  plt = report_lib.pyplot()
  fig, ax = plt.subplots(figsize=(6.5, 4.2))
  for i, r in enumerate(records):
    x, y0 = r["cache_bytes_per_token"], r["perplexity_converted"]
    marker = "s" if r["convert_kind"] == "mla" else "o"
    ax.plot([x], [y0], marker, color=f"C{i}", label=r["label"])
    y1 = r["perplexity_uptrained"]
    ax.annotate("", xy=(x, y1), xytext=(x, y0), arrowprops=dict(arrowstyle="->", color=f"C{i}"))
    ax.plot([x], [y1], marker, color=f"C{i}", fillstyle="none")
  ax.set_xscale("log", base=2)
  ax.set_yscale("log")
  ax.set_xlabel("KV cache bytes per token (all layers)")
  ax.set_ylabel("validation perplexity")
  ax.set_title("converted (filled) -> uptrained (open)")
  ax.legend(fontsize=7)
  report_lib.save_figure(fig, path)
