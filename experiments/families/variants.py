"""The "variants" experiment family: MHA / GQA / MQA / MLA compared on memory, speed, quality.

The main job (`experiment.kind = "variants"`, configs/default.py, heads_sweep.py,
seqlen_sweep.py; the runner is experiments/framework/runner.py). For each sweep entry
(an attention variant: MHA K = N, GQA, MQA K = 1, MLA) and each sequence
length S in `cache.seq_lens`, `VariantsFamily`
  (a) trains the model briefly on the default corpus (`kvattn.training.trainer`), once
      per variant -- points that differ only in S share the training, and the
      trained params are cached in `<workdir>/train/<hash>/` (or
      `experiment.train_dir`), so a rerun does not retrain;
  (b) builds the caches for batch `cache.batch` and capacity S, reads their
      bytes from the real arrays (`kvattn.memory`) and stops with
      `CacheAccountingError` if they differ from the analytic figure
      (`kvattn.models.transformer.cache_bytes_per_token`);
  (c) times the compiled prefill and decode programs of `kvattn.generate`
      (prompts of real validation text filling the cache; `decode.warmup`
      untimed runs, then `decode.repeats` timed prefills, each followed by
      `decode.decode_repeats` timed decode loops from copies of its caches;
      median / min / max of each);
  (d) records the environment (`experiments.framework.results.environment`) and the
      full point config.

The report (`write_report`): one table per S comparing each variant with MHA
at the same S, measured in the same run, against the figures commonly quoted
for them (`QUOTED`), timing and training tables, and three plots:

  decode_ms_per_step.png   decode ms/step vs S, one line per variant
                           (median, bars from min to max);
  cache_bytes.png          measured cache bytes (whole batch) vs S;
  quality_vs_cache.png     validation bits/byte vs cache bytes/token, one
                           marker per variant.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import statistics
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from flax import nnx
from ml_collections import config_dict

from experiments.framework import results
from experiments.framework import runner
from experiments.framework import overrides
from experiments.framework import checks
from experiments.framework import timing
from experiments.families import variants_report
from kvattn.caches import dense as cache_lib
from kvattn.training import data as data_lib
from kvattn import memory
from kvattn import sharding
from kvattn.caches import sharded
from kvattn.training import trainer as train_lib
from kvattn.models import transformer as transformer_lib
from kvattn.ops import quant

# ----------------------------------------------------------------------------------------------
# Points: schema, names, memory.


_PARAM_BYTES: dict[str, int] = {}


def param_bytes(spec: transformer_lib.ModelSpec) -> int:
  """Bytes of the model's parameters (from abstract shapes; nothing is allocated)."""
  key = repr(spec)
  if key not in _PARAM_BYTES:
    abstract = nnx.eval_shape(lambda: transformer_lib.Transformer(spec, rngs=nnx.Rngs(0)))
    leaves = jax.tree_util.tree_leaves(nnx.state(abstract, nnx.Param))
    _PARAM_BYTES[key] = int(sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in leaves))
  return _PARAM_BYTES[key]


def point_memory_bytes(spec: transformer_lib.ModelSpec, batch: int, seq_len: int,
                       cache_dtype: Any, train_batch: int = 0, train_seq_len: int = 0
                       ) -> dict[str, int]:
  """Upper estimate of the bytes one point needs at its peak (prefill at capacity S).

  * cache: `B * S * cache_bytes_per_token` (kvattn.memory via the model);
  * params: 4 copies (weights, gradients and AdamW's two moments while training);
  * attention: the prefill of one layer materialises f32 logits and
    probabilities `[B, N, S, S]` (reference attention): 3 such arrays are
    counted to leave room for the mask and XLA temporaries; training counts
    the same for its rows;
  * activations: 16 f32 arrays of `[B, S, max(D, F, N * width)]`.

  Returns:
    dict of the parts in bytes and `"total"`.
  """
  heads = max(layer.num_heads for layer in spec.layers)
  width = max(spec.d_model, spec.mlp_dim, *(
      layer.num_heads * (layer.head_dim or (layer.qk_nope_head_dim + layer.qk_rope_head_dim +
                                            layer.v_head_dim)) for layer in spec.layers))
  tokens = max(batch * seq_len, train_batch * train_seq_len)
  square = max(batch * seq_len * seq_len, train_batch * train_seq_len * train_seq_len)
  parts = {
      "cache": batch * seq_len * transformer_lib.cache_bytes_per_token(spec, cache_dtype),
      "params": 4 * param_bytes(spec),
      "attention": 3 * heads * square * 4,
      "activations": 16 * tokens * width * 4,
  }
  parts["total"] = sum(parts.values())
  return parts


def _gib(n: float) -> str:
  return f"{n / 2**30:.2f} GiB"


def variants_schema() -> dict[str, tuple[str, ...]]:
  """Sections and keys of a "variants" config (see configs/default.py for each field)."""
  return {
      "model": tuple(overrides.flat_keys(transformer_lib.model_config().to_dict())),
      "cache": ("dtype", "batch", "seq_lens", "memory_fraction"),
      "decode": ("new_tokens", "warmup", "repeats", "decode_repeats", "seed"),
      "train": tuple(train_lib.train_config().keys()),
      "data": tuple(data_lib.data_config().keys()),
      "experiment": ("kind", "name", "max_points", "train_dir"),
      "mesh": ("shape", "rules"),
  }


# Config fields that do not change a measurement (left out of point and training hashes).
_BOOKKEEPING = {
    "experiment": ("name", "max_points", "train_dir"),
    "cache": ("memory_fraction", "seq_lens"),  # a point carries its own seq_len
    "train": ("progress", "log_every", "checkpoint_every", "eval_every"),
}


def _measured_part(d: Mapping[str, Any], sections: Sequence[str]) -> dict[str, Any]:
  return {s: {k: v for k, v in d[s].items() if k not in _BOOKKEEPING.get(s, ())}
          for s in sections}


def variant_name(spec: transformer_lib.ModelSpec) -> tuple[str, int | None]:
  """("MHA" | "GQA" | "MQA" | "MLA" | "mixed", K) of a model whose layers share one variant."""
  kinds = {(layer.kind, layer.num_kv_heads, layer.num_heads) for layer in spec.layers}
  if len(kinds) != 1:
    return "mixed", None
  kind, k, n = kinds.pop()
  if kind == "mla":
    return "MLA", None
  if k == n:
    return "MHA", k
  return ("MQA" if k == 1 else "GQA"), k


class VariantsFamily:
  """MHA / GQA / MQA / MLA: cache bytes, prefill and decode speed, and quality (module doc)."""

  kind = "variants"

  def __init__(self, workdir: str):
    self.workdir = workdir
    self.schema = variants_schema()
    self._datasets: dict[str, data_lib.Dataset] = {}
    self._trained: tuple[str, nnx.Module, dict[str, Any]] | None = None
    self._title = "kvattn: attention variants compared"
    self._config: dict[str, Any] | None = None
    self._preflighted: set[tuple[Any, ...]] = set()

  # -- points and validation -------------------------------------------------------------------

  def _check(self, d: Mapping[str, Any], where: str) -> transformer_lib.ModelSpec:
    """Validates one point config's values; returns its ModelSpec."""
    spec = checks.model_spec(d, where)
    try:
      train_lib.check_train_config(d["train"])
    except ValueError as e:
      raise ValueError(f"{where}: {e}") from None
    cache, dec = d["cache"], d["decode"]
    if cache["dtype"] is not None:
      try:
        cache_lib.check_storage_dtype(cache["dtype"])
      except TypeError:
        raise ValueError(f"{where}: cache.dtype must name a floating dtype, a quantized KV "
                         f"format {quant.QUANT_NAMES} or None; got {cache['dtype']!r}") from None
    checks.check_int(f"{where}: cache.batch", cache["batch"])
    seq_lens = cache["seq_lens"]
    if not isinstance(seq_lens, (tuple, list)) or not seq_lens:
      raise ValueError(f"{where}: cache.seq_lens must be a non-empty tuple of ints; got "
                       f"{seq_lens!r}")
    new_tokens = checks.check_int(f"{where}: decode.new_tokens", dec["new_tokens"], 2)
    for s in seq_lens:
      checks.check_int(f"{where}: cache.seq_lens", s, new_tokens)  # the prompt needs >= 1 token
    if len(set(seq_lens)) != len(seq_lens):
      raise ValueError(f"{where}: cache.seq_lens must not repeat a value; got {seq_lens!r}")
    fraction = cache["memory_fraction"]
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or \
        not 0 < fraction <= 1:
      raise ValueError(f"{where}: cache.memory_fraction must lie in (0, 1]; got {fraction!r}")
    checks.check_int(f"{where}: decode.warmup", dec["warmup"], 0)
    checks.check_int(f"{where}: decode.repeats", dec["repeats"], 1)
    checks.check_int(f"{where}: decode.decode_repeats", dec["decode_repeats"], 1)
    checks.check_int(f"{where}: decode.seed", dec["seed"], 0)
    if d["data"]["seq_len"] is None:
      raise ValueError(f"{where}: data.seq_len must be a positive int; got None")
    try:
      mesh, _ = sharding.mesh_from_config(d["mesh"])
      for layer in spec.layers if mesh is not None else ():  # B, S, K must fit the mesh
        for s in seq_lens:
          sharded.cache_layout(mesh, d["mesh"]["rules"], batch=cache["batch"], max_len=s,
                                kind="latent" if layer.kind == "mla" else "dense",
                                num_kv_heads=layer.num_kv_heads, num_heads=layer.num_heads)
    except ValueError as e:
      raise ValueError(f"{where}: mesh: {e}") from None
    train_dir = d["experiment"]["train_dir"]
    if train_dir is not None and not isinstance(train_dir, str):
      raise ValueError(f"{where}: experiment.train_dir must be a path or None; got {train_dir!r}")
    return spec

  def _dataset(self, d: Mapping[str, Any], where: str) -> data_lib.Dataset:
    key = overrides.digest(d["data"])
    if key not in self._datasets:
      try:
        self._datasets[key] = data_lib.dataset_from_config(d["data"])
      except (ValueError, TypeError) as e:
        raise ValueError(f"{where}: data: {e}") from None
    dataset = self._datasets[key]
    rows = dataset.train_rows.shape[0]
    if d["train"]["batch_size"] > rows:
      raise ValueError(f"{where}: train.batch_size must be at most the {rows} training rows of "
                       f"the corpus; got {d['train']['batch_size']}")
    return dataset

  def points(self, config: Any, sweep: Sequence[Mapping[str, Any]]) -> list[runner.Point]:
    """Validates config and sweep; one point per (sweep entry, S in cache.seq_lens).

    Points are ordered by variant (training group) and S, so each variant is
    trained once and kept in memory while its sequence lengths are measured.

    Raises:
      ValueError: unknown section/key, bad value, duplicate point, or a point
        that needs more memory than `cache.memory_fraction` of the available
        RAM; the message names the key (and the sweep entry).
    """
    base = overrides.to_dict(config)
    overrides.check_schema(base, self.schema)
    self._check(base, "config")  # the config as given (command-line overrides included)
    self._config = base
    self._title = base["experiment"]["name"] or self._title
    available = checks.available_memory_bytes()
    def point_of(d, where):
      spec = self._check(d, where)
      variant, k = variant_name(spec)
      cache_dtype = d["cache"]["dtype"] or d["model"]["dtype"]
      # Hashes use the resolved ModelSpec, so fields of the other attention kind (e.g. MLA sizes
      # for a GQA point) do not matter; the decode backend does not change training.
      spec_d = json.loads(json.dumps(dataclasses.asdict(spec), default=str))
      trained = {**spec_d, "layers": [{**l, "decode_implementation": None}
                                      for l in spec_d["layers"]]}
      group = overrides.digest({"model": trained, **_measured_part(d, ("train", "data"))}, 12)
      out = []
      for s in d["cache"]["seq_lens"]:
        need = point_memory_bytes(spec, d["cache"]["batch"], s, cache_dtype,
                                  d["train"]["batch_size"], d["data"]["seq_len"])
        allowed = available * d["cache"]["memory_fraction"]
        if need["total"] > allowed:
          raise ValueError(
              f"{where}: cache.seq_lens = {s} is larger than memory allows: the point needs about "
              f"{_gib(need['total'])} (cache {_gib(need['cache'])}, prefill attention "
              f"{_gib(need['attention'])}, activations {_gib(need['activations'])}, params "
              f"{_gib(need['params'])}) but cache.memory_fraction = "
              f"{d['cache']['memory_fraction']} of the {_gib(available)} available allows "
              f"{_gib(allowed)}; use a smaller S or cache.batch")
        measured = _measured_part(d, ("cache", "decode", "train", "data"))
        if d["mesh"]["shape"] is not None:  # one device keeps the hashes of earlier runs
          measured["mesh"] = d["mesh"]
        out.append(runner.PointSpec(
            f"{variant}{'' if k is None else f'-K{k}'}-S{s}",
            {"model": spec_d, "seq_len": s, **measured}, group, {
                "variant": variant, "attention_kind": spec.layers[0].kind,
                "num_heads": spec.layers[0].num_heads, "num_kv_heads": k, "seq_len": s,
                "batch": d["cache"]["batch"], "cache_dtype": str(jnp.dtype(cache_dtype)),
                "memory_estimate_bytes": need["total"], "train_group": group}))
      return out

    points = runner.expand_points(config, sweep, point_of)
    for p in points:  # data problems surface before any training
      self._dataset(p.config, p.label)
    first = {}
    for i, p in enumerate(points):
      first.setdefault(p.group, i)
    return sorted(points, key=lambda p: (first[p.group], p.params["seq_len"]))

  def preflight(self, point: runner.Point) -> None:
    """Traces one decode step of the point's model against its caches (batch
    `cache.batch`, capacity S, the cache dtype), abstractly (`check_decode_step`);
    points with the same shapes are checked once."""
    d = point.config
    spec = transformer_lib.resolve_config(d["model"])
    batch, seq_len = d["cache"]["batch"], point.params["seq_len"]
    dtype = jnp.dtype(d["cache"]["dtype"] or d["model"]["dtype"])
    key = (repr(spec), batch, seq_len, str(dtype))
    if key in self._preflighted:
      return
    checks.check_decode_step(spec, lambda model: model.init_caches(batch, seq_len, dtype), batch,
                      implementation=d["model"]["attention"]["decode_implementation"],
                      where=point.label)
    self._preflighted.add(key)

  # -- training (shared by the points of a group, cached in the workdir) ------------------------

  def train_dir(self, point: runner.Point) -> str:
    """Where the point's training group keeps its params and metrics (shared by its S)."""
    root = point.config["experiment"]["train_dir"] or os.path.join(self.workdir, "train")
    return os.path.join(os.path.abspath(root), point.group)

  def trained_model(self, point: runner.Point) -> tuple[nnx.Module, dict[str, Any]]:
    """The point's trained model and its training metrics (trained once, then restored)."""
    if self._trained is not None and self._trained[0] == point.group:
      return self._trained[1], self._trained[2]
    self._trained = None  # free the previous variant first
    d = point.config
    directory = self.train_dir(point)
    metrics_path = os.path.join(directory, "metrics.json")
    cfg = config_dict.ConfigDict({"model": d["model"], "data": d["data"],
                                  "train": d["train"]})
    if os.path.exists(metrics_path):
      with open(metrics_path, encoding="utf-8") as f:
        metrics = json.load(f)["metrics"]
      spec = transformer_lib.resolve_config(cfg.model)
      tcfg = train_lib.check_train_config(cfg.train)
      trainer = train_lib.Trainer(transformer_lib.Transformer(spec, rngs=nnx.Rngs(tcfg["seed"])),
                                  tcfg)
      trainer.restore(train_lib.checkpoint_manager(os.path.join(directory, "checkpoints")))
      if trainer.step != tcfg["steps"]:
        raise RuntimeError(f"{directory}: checkpoint at step {trainer.step}, expected "
                           f"train.steps = {tcfg['steps']}")
      model = trainer.model
      logging.info("%s: restored trained params from %s", point.label, directory)
    else:
      logging.info("%s: training (%d steps) into %s", point.label, d["train"]["steps"], directory)
      result = train_lib.train_and_evaluate(cfg, workdir=directory)
      model, metrics = result.model, result.metrics
      results.atomic_write_text(metrics_path, json.dumps(
          {"metrics": metrics, "history": result.history, "config": cfg.to_dict()},
          indent=2, sort_keys=True, default=str) + "\n")
    # Fresh uncommitted device arrays: a model restored by orbax (committed arrays) and one just
    # trained (uncommitted) then hit the same compiled prefill/decode programs within a process.
    graphdef, state = nnx.split(model)
    model = nnx.merge(graphdef, jax.tree.map(lambda x: jnp.asarray(np.asarray(x)), state))
    self._trained = (point.group, model, metrics)
    return model, metrics

  # -- measurement ----------------------------------------------------------------------------

  def prompts(self, d: Mapping[str, Any], batch: int, length: int) -> np.ndarray:
    """`i32[B, length]` prompts of real validation text (each starts at a document's BOS)."""
    dataset = self._dataset(d, "prompts")
    stream = dataset.validation_rows[:, :-1].reshape(-1)
    stream = stream[stream != data_lib.PAD_ID]
    starts = np.flatnonzero(stream == data_lib.BOS_ID)
    rng = np.random.default_rng(d["decode"]["seed"])
    out = np.empty((batch, length), np.int32)
    for b in range(batch):
      start = int(starts[rng.integers(len(starts))]) if len(starts) else 0
      row = np.resize(np.roll(stream, -start), length)  # wraps around a short stream
      out[b] = row
    return out

  def measure(self, point: runner.Point) -> dict[str, Any]:
    """Trains (or restores), checks the cache bytes and times prefill and decode."""
    d = point.config
    model, train_metrics = self.trained_model(point)
    spec = transformer_lib.resolve_config(d["model"])
    batch, seq_len = d["cache"]["batch"], point.params["seq_len"]
    new_tokens, warmup, repeats = (d["decode"]["new_tokens"], d["decode"]["warmup"],
                                   d["decode"]["repeats"])
    cache_dtype = jnp.dtype(d["cache"]["dtype"] or d["model"]["dtype"])
    # Prefill writes P tokens and decode writes new_tokens - 1 more (the last sampled token is
    # never fed back), so P = S - new_tokens + 1 leaves the cache exactly full: the decode steps
    # run at contexts P .. S - 1, the longest the capacity allows.
    prompt_len = seq_len - new_tokens + 1
    prompts = jnp.asarray(self.prompts(d, batch, prompt_len))
    lengths = jnp.full((batch,), prompt_len, jnp.int32)
    analytic = transformer_lib.cache_bytes_per_token(spec, cache_dtype)
    mesh, rules = sharding.mesh_from_config(d["mesh"])
    if mesh is None:
      init_caches = lambda: model.init_caches(batch, seq_len, cache_dtype)
    else:  # params and caches sharded by the rules (kvattn.sharding)
      model = sharding.place_model(model, mesh, rules)
      init_caches = lambda: sharded.init_caches(model, batch, seq_len, mesh, rules=rules,
                                                 dtype=cache_dtype)
    cache_record, prefill_times, decode_times = None, [], []
    loops = d["decode"]["decode_repeats"]
    for i in range(warmup + repeats):
      caches = init_caches()
      if cache_record is None:
        cache_record = checks.check_cache_bytes(caches, analytic, batch, seq_len)
        cache_record["mesh"] = None if mesh is None else list(d["mesh"]["shape"])
        cache_record["per_device_cache_bytes"] = max(sharding.per_device_bytes(
            [a for c in caches for a in c.storage_arrays()]).values())
      prefill_time, first, caches, key = timing.timed_prefill(model, prompts, lengths, caches)
      timed_loops = loops if i >= warmup else 1  # a warm-up run needs one decode to compile
      for j in range(timed_loops):  # each loop decodes from its own copy of the prefilled caches
        loop_caches = caches if j == timed_loops - 1 else jax.tree.map(jnp.copy, caches)
        seconds, _, tokens, out_lengths, loop_caches = timing.timed_decode(
            model, first, loop_caches, new_tokens, key)
        if i >= warmup:
          decode_times.append(seconds)
      if i >= warmup:
        prefill_times.append(prefill_time)
      filled = {int(x) for c in loop_caches for x in np.asarray(c.lengths)}
      if filled != {seq_len}:
        raise RuntimeError(f"{point.label}: caches hold {sorted(filled)} tokens after decoding, "
                           f"expected S = {seq_len}")
      del caches, loop_caches
    if int(np.asarray(out_lengths).min()) != new_tokens:
      raise RuntimeError(f"{point.label}: decode stopped early: {np.asarray(out_lengths).tolist()}")
    steps = new_tokens - 1
    ms_per_step = [1000.0 * t / steps for t in decode_times]
    decode_s = statistics.median(decode_times)
    sample = data_lib.decode(np.asarray(tokens)[0])
    return {
        "cache_bytes_per_token_analytic": int(analytic),
        **cache_record,
        "cache_bytes_per_token_per_layer": [float(memory.measured_bytes_per_token(c))
                                            for c in model.init_caches(1, 1, cache_dtype)],
        "params_bytes": int(memory.tree_bytes(nnx.state(model, nnx.Param))),
        "prompt_len": prompt_len, "new_tokens": new_tokens, "decode_steps": steps,
        "warmup": warmup, "repeats": repeats, "decode_repeats": loops,
        **timing.stats("prefill_s", prefill_times),
        "prefill_tokens_per_s": batch * prompt_len / statistics.median(prefill_times),
        **timing.stats("decode_s", decode_times),
        **timing.stats("decode_ms_per_step", ms_per_step),
        # B * steps / decode time: the median run's rate, and the rates of the slowest and the
        # fastest runs (with an even number of repeats the median time is a mean of two).
        "decode_tokens_per_s": batch * steps / decode_s,
        "decode_tokens_per_s_min": batch * steps / max(decode_times),
        "decode_tokens_per_s_max": batch * steps / min(decode_times),
        "sample": sample[:200],
        "train_steps": int(train_metrics["steps"]),
        "train_loss": float(train_metrics["train_loss"]),
        "train_seconds": float(train_metrics["train_seconds"]),
        "validation_loss": float(train_metrics["validation_loss"]),
        "validation_bits_per_byte": float(train_metrics["validation_bits_per_byte"]),
    }

  # -- report ---------------------------------------------------------------------------------

  def report(self, records: Sequence[Mapping[str, Any]]) -> str:
    """Writes report.md and the plots of the variants family; returns the markdown."""
    return variants_report.write_report(self.workdir, records, title=self._title,
                                        config=self._config)


runner.register_family("variants", VariantsFamily)


def fitting_seq_lens(config: Any, start: int, stop: int | None = None) -> tuple[int, ...]:
  """Powers of two S from `start` while a point of `config` fits in memory (and S <= stop).

  Uses the same estimate and limit as validation (`point_memory_bytes`,
  `cache.memory_fraction` of `checks.available_memory_bytes()`), for the base
  attention of `config` and its MHA form (the largest cache of a sweep over
  K), so every sweep entry of the same model size fits.

  Raises:
    ValueError: not even `start` fits.
  """
  d = overrides.to_dict(config)
  allowed = checks.available_memory_bytes() * d["cache"]["memory_fraction"]
  attention = d["model"]["attention"]
  mha = dict(d["model"], attention={**attention, "kind": "gqa",
                                    "num_kv_heads": attention["num_heads"]})
  specs = [transformer_lib.resolve_config(d["model"]), transformer_lib.resolve_config(mha)]
  cache_dtype = d["cache"]["dtype"] or d["model"]["dtype"]
  out, s = [], start
  while stop is None or s <= stop:
    need = max(point_memory_bytes(spec, d["cache"]["batch"], s, cache_dtype,
                                  d["train"]["batch_size"], d["data"]["seq_len"])["total"]
               for spec in specs)
    if need > allowed:
      break
    out.append(s)
    s *= 2
  if not out:
    raise ValueError(f"cache.seq_lens: not even S = {start} fits in {_gib(allowed)}")
  return tuple(out)
