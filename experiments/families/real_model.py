r"""The main job: KV-cache dtype x cache policy x head grouping on a pretrained model.

    python -m experiments.main --config=configs/default.py --workdir=runs/default

The "real_model" family of experiments/framework/runner.py (`experiment.kind =
"real_model"`). One point per sweep entry of configs/default.py: a cache
storage dtype (`cache.dtype`), a cache kind (`cache.kind`: "dense" or a
bounded kind of `kvattn.caches.registry` at `cache.budget` tokens) and a head grouping
(`heads.num_kv_heads`: 0 = the model as released, else
`kvattn.models.convert.regroup_kv_heads` without uptraining) on the model
`model.name` (`kvattn.from_pretrained`). Measured per point, batch 1:

  * cache bytes per token (every layer's storage arrays, scales included,
    over the token slots they hold) and per sequence after the held-out text;
  * perplexity of `text.num_tokens` held-out tokens (the validation
    documents of kvattn.training.data's default corpus, tokenized with the model's
    tokenizer), streamed through the cache `text.chunk` tokens per forward
    pass (`experiments.evals.streaming.streaming_scores`);
  * teacher-forced top-1 agreement over the same positions: the fraction where the
    point's argmax equals the reference's (the float32 full cache of the released model,
    streamed once per run; 1 for the reference itself), from the logits of the
    perplexity pass (`streaming.top1_agreement`). One near-tie moves it by 1/n, where
    it can end a greedy continuation's agreement;
  * a greedy continuation of `text.new_tokens` tokens after the
    `text.prompt_tokens` held-out tokens that follow the scored text: decode
    tokens/s over its steps after the first (which compiles), and greedy
    agreement = the fraction of positions equal to the reference's (the
    float32 full cache of the released model; 1 for the reference itself);
  * decode speed where the cache matters (`speed.*`, batch 0 skips it): `speed.batch`
    rows holding `speed.context` random tokens written through the point's cache
    (experiments/evals/decode_speed.py), greedy steps timed through the same compiled
    loop, and the roofline fraction: the step's weight and cache bytes at the read
    bandwidth measured once per run (`timing.read_bandwidth`) over the step time.

On a mesh (`mesh.shape`, kvattn.sharding): the parameters are placed by the
sharding rules (`sharding.place_model`) and the full cache is created sharded
(`sharded.init_caches`: KV heads over `model`, slots over `seq`); a bounded
policy's cache has no sharded kind: it starts replicated over the mesh and
XLA's partitioner lays out its updates (`per_device_cache_bytes` records the
result). Batch 1 needs `data` = 1, `seq` must divide `text.chunk` and the
point's KV heads must fit `model` (checked before any work, ValueError naming
the key); records then add `mesh` and `per_device_cache_bytes`. One device
(shape None) keeps the point ids of earlier runs.

The report (report.md) has one table (ratios against the reference point)
and two plots linked from it: quality_vs_cache.png (one column per head grouping, each
with its own perplexity scale, perplexity above and top-1 agreement below, against cache
KiB per sequence; a legend names the points) and decode_speed.png (the long-context tok/s).
"""

from __future__ import annotations

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
from experiments.evals import decode_speed
from experiments.evals import streaming
from experiments.evals import text as text_lib
from kvattn.caches import registry as cache_registry
from kvattn import memory
from kvattn import sharding
from kvattn.caches import sharded
from kvattn.ops import quant

REFERENCE = {"dtype": "float32", "kind": "dense", "num_kv_heads": 0, "param_dtype": "float32"}
WEIGHT_DTYPES = ("float32", "int8")
"""`model.param_dtype` values: float weights, or "int8" (W8A8, `kvattn.models.int8`)."""
PLOTS = {"quality": "quality_vs_cache.png", "speed": "decode_speed.png"}


def schema() -> dict[str, tuple[str, ...]]:
  """Sections and keys of a "real_model" config (configs/default.py documents each)."""
  return {
      "model": ("name", "dtype", "param_dtype"),
      "cache": ("dtype", "kind", "budget", "num_sinks", "compress", "compression_ratio"),
      "heads": ("num_kv_heads", "method"),
      "text": ("num_tokens", "chunk", "prompt_tokens", "new_tokens"),
      "speed": ("batch", "context", "steps", "repeats"),
      "mesh": ("shape", "rules"),
      "experiment": ("kind", "name", "max_points"),
  }


def _is_reference(d: Mapping[str, Any]) -> bool:
  return (d["cache"]["dtype"], d["cache"]["kind"], d["heads"]["num_kv_heads"],
          d["model"]["param_dtype"]) == tuple(REFERENCE.values())


def cache_spec(cache: Mapping[str, Any]) -> dict[str, Any]:
  """The registry spec of a point's `cache` section: the kind at `cache.budget`
  (`registry.spec_at_budget`), and for an eviction kind with `cache.compress = "context"` its
  kept context: `cache.compression_ratio` when set (then `cache.budget` is not used), else
  `cache.budget` tokens.

  Raises:
    ValueError: `cache.compress` / `cache.compression_ratio` set for a kind without them.
  """
  spec = cache_registry.spec_at_budget(cache["kind"], cache["budget"],
                                       num_sinks=cache["num_sinks"])
  compress, ratio = cache.get("compress") or "fixed", cache.get("compression_ratio")
  if compress == "fixed" and ratio is None:
    return spec
  if "compress" not in cache_registry.CACHE_KIND_TABLE[cache["kind"]].options:
    raise ValueError(f"cache.compress = {compress!r} / cache.compression_ratio = {ratio!r} "
                     f"apply to the eviction kinds only; cache.kind = {cache['kind']!r}")
  spec.update(compress=compress, compression_ratio=ratio)
  if compress == "context" and ratio is not None:
    spec.pop("budget", None)
  return spec


def _label(d: Mapping[str, Any]) -> str:
  k = d["heads"]["num_kv_heads"]
  policy = d["cache"]["kind"]
  policy = policy if policy == "dense" else f"{policy}{d['cache']['budget']}"
  if (d["cache"].get("compress") or "fixed") == "context":
    ratio = d["cache"].get("compression_ratio")
    policy = f"{d['cache']['kind']}-ctx" + (f"{d['cache']['budget']}" if ratio is None
                                             else f"r{ratio:g}")
  label = f"K{k or 'rel'}-{policy}-{d['cache']['dtype']}"
  if d["model"]["param_dtype"] != "float32":
    label += f"-w{d['model']['param_dtype']}"
  shape = d["mesh"]["shape"]
  return label if shape is None else f"{label}-mesh{'x'.join(map(str, shape))}"


def _seq_capacity(capacity: int, mesh, rules) -> int:
  """`capacity` rounded up to a multiple of the `seq` axis (the greedy run's cache)."""
  step = 1 if mesh is None else sharding.axis_size(mesh, rules["cache_sequence"])
  return -(-capacity // step) * step


class RealModelFamily:
  """Cache dtype x policy x head grouping on one pretrained model (module doc)."""

  kind = "real_model"

  def __init__(self, workdir: str):
    self.workdir = workdir
    self._title = "kvattn: KV-cache choices on a pretrained model"
    self._model: dict[Any, Any] = {}
    self._tokens: dict[tuple[str, int], np.ndarray] = {}
    self._reference: dict[str, np.ndarray] = {}
    self._reference_argmax: dict[str, np.ndarray] = {}
    self._placed: dict[Any, Any] = {}
    self._read_bandwidth: float | None = None

  def _check(self, d: Mapping[str, Any], where: str) -> None:
    cache, heads, text = d["cache"], d["heads"], d["text"]
    if d["model"]["param_dtype"] not in WEIGHT_DTYPES:
      raise ValueError(f"{where}: model.param_dtype must be one of {WEIGHT_DTYPES}; got "
                       f"{d['model']['param_dtype']!r}")
    if cache["kind"] not in cache_registry.CACHE_KIND_TABLE:
      raise ValueError(f"{where}: cache.kind must be one of "
                       f"{tuple(cache_registry.CACHE_KIND_TABLE)} (a kind of your own: load "
                       f"its module with --import); got {cache['kind']!r}")
    try:
      dtype = jnp.dtype(cache["dtype"])
    except TypeError:
      raise ValueError(f"{where}: cache.dtype must name a dtype; got {cache['dtype']!r}"
                       ) from None
    if not (jnp.issubdtype(dtype, jnp.floating) or dtype in quant.QUANT_DTYPES):
      raise ValueError(f"{where}: cache.dtype must be a float dtype or one of "
                       f"{[str(jnp.dtype(q)) for q in quant.QUANT_DTYPES]}; got {cache['dtype']!r}")
    checks.check_int(f"{where}: cache.budget", cache["budget"], 2)
    checks.check_int(f"{where}: cache.num_sinks", cache["num_sinks"], 0)
    checks.check_int(f"{where}: heads.num_kv_heads", heads["num_kv_heads"], 0)
    if heads["method"] not in ("mean", "first"):
      raise ValueError(f"{where}: heads.method must be 'mean' or 'first'; got "
                       f"{heads['method']!r}")
    checks.check_int(f"{where}: text.num_tokens", text["num_tokens"], 2)
    checks.check_int(f"{where}: text.chunk", text["chunk"])
    checks.check_int(f"{where}: text.prompt_tokens", text["prompt_tokens"])
    checks.check_int(f"{where}: text.new_tokens", text["new_tokens"], 3)
    speed = d["speed"]
    checks.check_int(f"{where}: speed.batch", speed["batch"], 0)
    for key in ("context", "steps", "repeats"):
      checks.check_int(f"{where}: speed.{key}", speed[key])
    if cache["kind"] == "sink" and cache["budget"] < cache["num_sinks"] + 1:
      raise ValueError(f"{where}: cache.budget must be >= cache.num_sinks + 1 = "
                       f"{cache['num_sinks'] + 1} for kind 'sink'; got {cache['budget']}")
    if (cache.get("compress") or "fixed") != "fixed" or cache.get("compression_ratio") is not None:
      try:  # the compress options with the kind's (named as cache.<key>)
        cache_registry.cache_options(cache_spec(cache), "cache")
      except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    self._check_mesh(d, where)

  def _check_mesh(self, d: Mapping[str, Any], where: str) -> None:
    """B = 1, S (whole chunks) and the point's KV heads against `mesh` (ValueError naming
    the key). Loads the model (once, as the first point would) to read its heads."""
    try:
      mesh, rules = sharding.mesh_from_config(d["mesh"])
    except ValueError as e:
      raise ValueError(f"{where}: mesh: {e}") from None
    if mesh is None:
      return
    shape = tuple(d["mesh"]["shape"])
    data = sharding.axis_size(mesh, rules["cache_batch"])
    if data != 1:
      raise ValueError(f"{where}: mesh.shape {shape}: the batch axis {rules['cache_batch']!r} "
                       f"must have size 1 (the main job decodes one sequence); got {data}")
    seq = sharding.axis_size(mesh, rules["cache_sequence"])
    if d["text"]["chunk"] % seq:
      raise ValueError(f"{where}: text.chunk must be a multiple of the size {seq} of mesh axis "
                       f"{rules['cache_sequence']!r} of mesh.shape {shape} (the cache holds "
                       f"whole chunks); got {d['text']['chunk']}")
    model, _ = self.model(dict(d, heads={"num_kv_heads": 0, "method": "mean"}))
    k = d["heads"]["num_kv_heads"] or None
    for i, layer in enumerate(model.layers):
      attn = layer.attn
      latent = hasattr(attn, "kv_lora_rank")
      try:
        sharded.cache_layout(mesh, rules, kind="latent" if latent else "dense", batch=1,
                              max_len=d["text"]["chunk"],
                              num_kv_heads=None if latent else k or attn.num_kv_heads,
                              num_heads=attn.num_heads)
      except ValueError as e:
        key = "heads.num_kv_heads" if "num_kv_heads" in str(e) else "mesh"
        raise ValueError(f"{where}: {key} (layer {i}) on mesh.shape {shape}: {e}") from None

  def _on_mesh(self, d: Mapping[str, Any]):
    """`(model, tokenizer, mesh, rules)`: the point's model, its parameters placed on the
    mesh (once per model and mesh) when `mesh.shape` is set."""
    model, tokenizer = self.model(d)
    mesh, rules = sharding.mesh_from_config(d["mesh"])
    if mesh is None:
      return model, tokenizer, None, rules
    key = overrides.digest({"model": d["model"], "heads": d["heads"], "mesh": d["mesh"]})
    if key not in self._placed:
      if len(self._placed) >= 2:  # a point's model and the reference's
        self._placed.clear()
      self._placed[key] = sharding.place_model(model, mesh, rules)
    return self._placed[key], tokenizer, mesh, rules

  @staticmethod
  def _caches(model, capacity: int, dtype, policy, mesh, rules, batch: int = 1):
    """Empty caches of `batch` rows: sharded on a mesh for the full policy
    (`sharded.init_caches`), replicated over it for a bounded one (no sharded kind; XLA lays
    out the updated cache), plain without a mesh."""
    if mesh is None:
      return model.init_caches(batch, capacity, dtype, cache=policy)
    if policy["kind"] == "dense":
      return sharded.init_caches(model, batch, capacity, mesh, rules=rules, dtype=dtype)
    caches = model.init_caches(batch, capacity, dtype, cache=policy)
    return jax.device_put(caches, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))

  def points(self, config: Any, sweep: Sequence[Mapping[str, Any]]) -> list[runner.Point]:
    """One point per sweep entry; all validated before any work (ValueError naming the key)."""
    base = overrides.to_dict(config)
    overrides.check_schema(base, schema())
    self._check(base, "config")
    self._title = base["experiment"]["name"] or self._title

    def point_of(d, where):
      self._check(d, where)
      measured = {s: d[s] for s in ("model", "cache", "heads", "text", "speed")}
      if (d["cache"].get("compress") or "fixed") == "fixed" and d["cache"].get(
          "compression_ratio") is None:  # the fixed budget keeps the ids of earlier runs
        measured["cache"] = {k: v for k, v in d["cache"].items()
                             if k not in ("compress", "compression_ratio")}
      if d["model"]["param_dtype"] == "float32":  # f32 weights keep the ids of earlier runs
        measured["model"] = {k: v for k, v in d["model"].items() if k != "param_dtype"}
      if d["mesh"]["shape"] is not None:  # one device keeps the ids of earlier runs
        measured["mesh"] = d["mesh"]
      return runner.PointSpec(_label(d), measured, f"K{d['heads']['num_kv_heads']}", {
          "cache_dtype": d["cache"]["dtype"], "policy": d["cache"]["kind"],
          "budget": None if d["cache"]["kind"] == "dense" else cache_spec(d["cache"]).get(
              "budget"),
          "compress": d["cache"].get("compress") or "fixed",
          "compression_ratio": d["cache"].get("compression_ratio"),
          "num_kv_heads_setting": d["heads"]["num_kv_heads"],
          "param_dtype": d["model"]["param_dtype"],
          "reference": _is_reference(d)})

    return runner.expand_points(config, sweep, point_of)

  # -- measurement ----------------------------------------------------------------------------

  def model(self, d: Mapping[str, Any]):
    """`(model, tokenizer)` of the point: loaded once, regrouped once per K'."""
    name, dtype = d["model"]["name"], d["model"]["dtype"]
    k, weights = d["heads"]["num_kv_heads"], d["model"]["param_dtype"]
    released = (name, dtype, 0, "", "float32")
    key = (name, dtype, k, d["heads"]["method"] if k else "", weights)
    if released not in self._model:
      self._model = {released: models.load_model(name, dtype)}  # one pretrained model at a time
    if key not in self._model:
      from flax import nnx  # pylint: disable=g-import-not-at-top
      from kvattn.models import convert  # pylint: disable=g-import-not-at-top
      model, tokenizer = self._model[released]
      if k:  # regroup the float weights, then store them as asked
        model = convert.regroup_kv_heads(model, k, method=key[3])
      if weights == "int8":  # W8A8 (experiments.evals.models.quantize)
        model = models.quantize(nnx.clone(model), tokenizer)
      self._model[key] = (model, tokenizer)
    return self._model[key]

  def tokens(self, tokenizer, name: str, count: int) -> np.ndarray:
    if (name, count) not in self._tokens:
      self._tokens[(name, count)] = text_lib.held_out_tokens(tokenizer, count)
    return self._tokens[(name, count)]

  def _greedy(self, d: Mapping[str, Any]) -> tuple[np.ndarray, float]:
    """The greedy run of point config `d`: `(i32[new_tokens] tokens, timed decode seconds)`."""
    model, tokenizer, mesh, rules = self._on_mesh(d)
    text, cache = d["text"], d["cache"]
    ids = self.tokens(tokenizer, d["model"]["name"], text["num_tokens"] + 1 +
                      text["prompt_tokens"])
    prompt = ids[text["num_tokens"] + 1:]
    policy = cache_spec(cache)
    capacity = _seq_capacity(-(-len(prompt) // text["chunk"]) * text["chunk"]
                             + text["new_tokens"], mesh, rules)
    caches = self._caches(model, capacity, jnp.dtype(cache["dtype"]), policy, mesh, rules)
    return streaming.greedy(model, caches, prompt, text["new_tokens"], text["chunk"])

  def _bandwidth(self) -> float:
    """Read bytes/s of this machine, measured once per run (`timing.read_bandwidth` over
    256 MiB, beyond the last-level caches)."""
    if self._read_bandwidth is None:
      self._read_bandwidth = timing.read_bandwidth(256 << 20)
    return self._read_bandwidth

  def _speed(self, d: Mapping[str, Any]) -> dict[str, Any]:
    """The point's decode speed at `speed.batch` x `speed.context` (module doc); {} for
    batch 0."""
    speed, cache = d["speed"], d["cache"]
    if not speed["batch"]:
      return {}
    from experiments.benchmarks import real as bench_real  # pylint: disable=g-import-not-at-top
    model, _, mesh, rules = self._on_mesh(d)
    policy = cache_spec(cache)
    capacity = _seq_capacity(speed["context"] + (speed["repeats"] + 1) * speed["steps"] + 1,
                             mesh, rules)
    caches = self._caches(model, capacity, jnp.dtype(cache["dtype"]), policy, mesh, rules,
                          batch=speed["batch"])
    out = decode_speed.long_decode(model, caches, speed["context"], steps=speed["steps"],
                                   repeats=speed["repeats"],
                                   weight_bytes=bench_real.weight_bytes(model),
                                   bandwidth=self._bandwidth())
    return {f"speed_{k}": v for k, v in out.items()} | {
        "read_bandwidth_bytes_per_s": self._bandwidth()}

  def _reference_config(self, d: Mapping[str, Any]) -> tuple[dict[str, Any], str]:
    """`(config, key)`: point config `d` turned into the reference's (float32 full cache,
    released heads, float32 weights), and the key of its texts (model, text, mesh)."""
    ref = overrides.apply_overrides(d, {"cache.dtype": REFERENCE["dtype"],
                                     "cache.kind": REFERENCE["kind"],
                                     "cache.compress": "fixed", "cache.compression_ratio": None,
                                     "heads.num_kv_heads": REFERENCE["num_kv_heads"],
                                     "model.param_dtype": REFERENCE["param_dtype"]}, "reference")
    return ref, overrides.digest({s: ref[s] for s in ("model", "text", "mesh")})

  def reference_tokens(self, d: Mapping[str, Any]) -> np.ndarray:
    """Greedy tokens of the reference (float32 full cache, released heads) for `d`'s texts."""
    ref, key = self._reference_config(d)
    if key not in self._reference:
      self._reference[key] = self._greedy(ref)[0]
    return self._reference[key]

  def reference_argmax(self, d: Mapping[str, Any]) -> np.ndarray:
    """`i32[text.num_tokens]`: the reference's top-1 token at each held-out position of `d`'s
    scored text (teacher-forced, `streaming.streaming_scores`); computed once per texts."""
    ref, key = self._reference_config(d)
    if key not in self._reference_argmax:
      self._reference_argmax[key] = self._stream(ref)[1]
    return self._reference_argmax[key]

  def _stream(self, d: Mapping[str, Any]):
    """The scored text of point config `d` streamed through its cache: `(nll f64[n], argmax
    i32[n], caches, seconds)` (n = `text.num_tokens`)."""
    model, tokenizer, mesh, rules = self._on_mesh(d)
    text, cache = d["text"], d["cache"]
    policy = cache_spec(cache)
    ids = self.tokens(tokenizer, d["model"]["name"], text["num_tokens"] + 1 +
                      text["prompt_tokens"])[:text["num_tokens"] + 1]
    padded = -(-text["num_tokens"] // text["chunk"]) * text["chunk"]  # the last chunk is padded
    caches = self._caches(model, padded, jnp.dtype(cache["dtype"]), policy, mesh, rules)
    start = time.perf_counter()
    nll, argmax, caches = streaming.streaming_scores(model, caches, ids, text["chunk"])
    return nll, argmax, caches, time.perf_counter() - start

  def measure(self, point: runner.Point) -> dict[str, Any]:
    cpu_start = time.process_time()
    d = point.config
    model, _, mesh, _ = self._on_mesh(d)
    text = d["text"]
    nll, argmax, caches, ppl_s = self._stream(d)
    per_token = sum(memory.measured_bytes_per_token(c) for c in caches)
    per_seq = sum(memory.tree_bytes(c.storage_arrays()) for c in caches)
    on_mesh = {} if mesh is None else {
        "mesh": list(d["mesh"]["shape"]),
        "per_device_cache_bytes": int(max(sharding.per_device_bytes(
            [a for c in caches for a in c.storage_arrays()]).values()))}

    tokens, decode_s = self._greedy(d)
    if _is_reference(d):
      key = self._reference_config(d)[1]
      self._reference.setdefault(key, tokens)
      self._reference_argmax.setdefault(key, argmax)
    reference = self.reference_tokens(d)
    steps = text["new_tokens"] - 1  # decode-loop steps after the first token
    attn = model.layers[0].attn
    return {
        "num_kv_heads": int(attn.num_kv_heads),
        "num_heads": int(attn.num_heads),
        "num_layers": int(model.num_layers),
        "ppl": float(math.exp(nll.mean())),
        "ppl_seconds": ppl_s,
        "num_tokens": text["num_tokens"],
        "top1_agreement": streaming.top1_agreement(argmax, self.reference_argmax(d)),
        "cache_bytes_per_token": float(per_token),
        "cache_bytes_per_seq": int(per_seq),
        "cache_slots_per_seq": int(caches[0].capacity),
        "decode_steps_timed": steps,
        "decode_s": decode_s,
        "decode_tokens_per_s": steps / decode_s if decode_s > 0 else float("nan"),
        "greedy_tokens": tokens.tolist(),
        "greedy_agreement": float(np.mean(tokens == reference)),
        **self._speed(d),
        "point_cpu_s": time.process_time() - cpu_start,
        **on_mesh,
    }

  def report(self, records: Sequence[Mapping[str, Any]]) -> str:
    return write_report(self.workdir, records, title=self._title)


runner.register_family("real_model", RealModelFamily)


# ----------------------------------------------------------------------------------------------
# Report.


def table_rows(records: Sequence[Mapping[str, Any]]) -> list[list[Any]]:
  """One row per record: the columns of the report's table (ratios vs the reference point)."""
  ref = next((r for r in records if r.get("reference")), None)
  rows = []
  for r in records:
    vs = lambda key, r=r: f"{r[key] / ref[key]:.2f}x" if ref else "n/a"
    rows.append([r["label"], r["num_kv_heads"],
                 (r["policy"] if r["budget"] is None else f"{r['policy']} {r['budget']}")
                 + ("" if r.get("compress", "fixed") == "fixed" else " context"
                    + ("" if r.get("compression_ratio") is None
                       else f" r{r['compression_ratio']:g}")),
                 r["cache_dtype"], f"{r['cache_bytes_per_token']:,.0f}",
                 vs("cache_bytes_per_token"), f"{r['cache_bytes_per_seq'] / 2**10:,.0f}",
                 f"{r['decode_tokens_per_s']:.1f}", *_speed_cells(r, ref), f"{r['ppl']:.3f}",
                 vs("ppl"), _fraction(r.get("top1_agreement")), f"{r['greedy_agreement']:.2f}"])
  return rows


def _fraction(x: float | None) -> str:
  """A fraction with 3 decimals ("-" for a record measured before the metric existed)."""
  return "-" if x is None else f"{x:.3f}"


def _speed_cells(r: Mapping[str, Any], ref: Mapping[str, Any] | None) -> list[str]:
  """The long-context decode columns of record `r`: tok/s, ratio to the reference, roofline
  fraction ("-" for a point measured without them)."""
  if "speed_tokens_per_s" not in r:
    return ["-"] * 3
  vs = (f"{r['speed_tokens_per_s'] / ref['speed_tokens_per_s']:.2f}x"
        if ref and "speed_tokens_per_s" in ref else "n/a")
  return [f"{r['speed_tokens_per_s']:.1f}", vs, f"{r['speed_roofline']:.2f}"]


def write_report(workdir: str, records: Sequence[Mapping[str, Any]], *, title: str) -> str:
  """report.md and the two plots (linked from it); returns the markdown."""
  first = records[0] if records else None
  timed = next((r for r in records if "speed_tokens_per_s" in r), None)
  speed_header = (f"decode tok/s B{timed['speed_batch']}x{timed['speed_context']}" if timed
                  else "decode tok/s long")
  headers = ["point", "K", "policy", "cache dtype", "cache B/token", "vs ref",
             "cache KiB/seq", "decode tok/s B1", speed_header, "vs ref", "roofline", "ppl",
             "vs ref", "top-1 agreement", "greedy agreement"]
  md = [f"# {title}", ""]
  if first:
    cfg = first["config"]
    md += [f"Model `{cfg['model']['name']}` ({first['num_layers']} layers, "
           f"{first['num_heads']} query heads; compute {cfg['model']['dtype']}), batch 1. "
           f"Perplexity: {first['num_tokens']} held-out tokens (validation documents of the "
           f"default corpus) streamed {cfg['text']['chunk']} tokens per forward pass. Top-1 "
           f"agreement: over the same {first['num_tokens']} positions (teacher-forced), the "
           f"fraction where the point's most likely next token is the reference's. Greedy "
           f"agreement: {cfg['text']['new_tokens']} greedy tokens after the next "
           f"{cfg['text']['prompt_tokens']} held-out tokens, position by position against the "
           f"reference (float32 full cache, KV heads as released); decode tok/s over the "
           f"{first['decode_steps_timed']} steps after the first. Cache KiB/seq: the storage "
           f"after the scored text (a bounded policy keeps its budget). K = 1 points are "
           f"mean-pooled from the released heads without uptraining.", ""]
  if timed:
    md += [f"{speed_header}: {timed['speed_batch']} sequences holding "
           f"{timed['speed_context']} tokens of random keys and values each, written through "
           f"the point's cache (a bounded policy keeps its budget), then greedy steps through "
           f"the compiled decode loop (median of "
           f"{timed['config']['speed']['repeats']} timed calls of "
           f"{timed['config']['speed']['steps']} steps); roofline: the step's weight and cache bytes at the read bandwidth "
           f"measured in the run ({timed['read_bandwidth_bytes_per_s'] / 1e9:.1f} GB/s, "
           f"`jnp.sum` over 256 MiB) over the step time. Batch-1 tok/s: the greedy run "
           f"above, where the cache is about 2% of a step's reads.", ""]
  md += [report_lib.markdown_table(headers, table_rows(records)), "",
         f"![quality vs cache bytes]({PLOTS['quality']})", "",
         f"![decode speed]({PLOTS['speed']})", ""]
  return report_lib.write_report(workdir, "\n".join(md), records, _plots)


def _point_name(r: Mapping[str, Any]) -> str:
  """A record's legend entry within its head grouping: "dense float32", "h2o 128 int8", ..."""
  name = r["policy"] if r["budget"] is None else f"{r['policy']} {r['budget']}"
  name += f" {r['cache_dtype']}"
  if r.get("param_dtype", "float32") != "float32":
    name += f" w{r['param_dtype']}"
  mesh = r.get("mesh")
  return name if not mesh else f"{name} mesh{'x'.join(map(str, mesh))}"


def plot_quality(records: Sequence[Mapping[str, Any]], path: str) -> None:
  """quality_vs_cache.png: one column per head grouping K (perplexity on its own scale, so
  K = 1's ~10^4 does not flatten K = 3's ~13), perplexity above and top-1 agreement below,
  against cache KiB per sequence; one legend (marker per policy, colour per cache dtype)."""
  plt = report_lib.pyplot()
  groups: dict[int, list[Mapping[str, Any]]] = {}
  for r in records:
    groups.setdefault(int(r["num_kv_heads"]), []).append(r)
  ks = sorted(groups, reverse=True)
  names = sorted({_point_name(r) for r in records})
  dtypes = sorted({r["cache_dtype"] for r in records})
  policies = sorted({r["policy"] for r in records}, key=lambda p: (p != "dense", p))
  colours = {t: plt.get_cmap("tab10")(i % 10) for i, t in enumerate(dtypes)}
  markers = {p: "osD^v<>pP*Xh"[i % 12] for i, p in enumerate(policies)}
  fig, axes = plt.subplots(2, len(ks), figsize=(4.2 * len(ks) + 2.6, 6.4), squeeze=False,
                           sharex="col")
  handles = {}
  for col, k in enumerate(ks):
    top, bottom = axes[0, col], axes[1, col]
    released = any(r["num_kv_heads_setting"] == 0 for r in groups[k])
    top.set_title(f"K = {k} KV heads ({'as released' if released else 'regrouped'})")
    for r in groups[k]:
      x = r["cache_bytes_per_seq"] / 2**10
      style = dict(marker=markers[r["policy"]], color=colours[r["cache_dtype"]], s=46,
                   alpha=0.75, edgecolors="black", linewidths=0.5)
      handles[_point_name(r)] = top.scatter([x], [r["ppl"]], **style)
      if r.get("top1_agreement") is not None:
        bottom.scatter([x], [r["top1_agreement"]], **style)
    top.set_xscale("log")
    top.xaxis.set_minor_formatter(plt.NullFormatter())  # minor labels overlap on short ranges
    top.grid(True, alpha=0.3, which="both")
    bottom.grid(True, alpha=0.3, which="both")
    agreement = [r["top1_agreement"] for r in groups[k] if r.get("top1_agreement") is not None]
    if agreement:  # its own range too: 0.96 and 1.00 apart, not squeezed into [0, 1]
      pad = max(0.01, 0.1 * (max(agreement) - min(agreement)))
      bottom.set_ylim(max(-0.02, min(agreement) - pad), min(1.02, max(agreement) + pad))
    bottom.set_xlabel("cache KiB per sequence (log)")
  axes[0, 0].set_ylabel("held-out perplexity (lower is better)")
  axes[1, 0].set_ylabel("top-1 agreement with the reference")
  fig.legend([handles[n] for n in names], names, loc="center left", bbox_to_anchor=(1.0, 0.5),
             fontsize=8, title="policy, cache dtype", frameon=False)
  fig.suptitle("Quality vs cache size, per head grouping (each panel its own perplexity scale)")
  fig.tight_layout()
  report_lib.save_figure(fig, path)


def _plots(workdir: str, records: Sequence[Mapping[str, Any]]) -> None:
  plot_quality(records, os.path.join(workdir, PLOTS["quality"]))
  plt = report_lib.pyplot()
  fig, ax = plt.subplots(figsize=(max(6, 0.5 * len(records)), 4))
  timed = [r for r in records if "speed_tokens_per_s" in r]
  if timed:  # the long-context point ranks kinds on their bytes
    ax.bar(range(len(timed)), [r["speed_tokens_per_s"] for r in timed])
    ax.set_ylabel(f"decode tokens/s (batch {timed[0]['speed_batch']}, "
                  f"{timed[0]['speed_context']} tokens)")
  else:
    timed = records
    ax.bar(range(len(timed)), [r["decode_tokens_per_s"] for r in timed])
    ax.set_ylabel("decode tokens/s (batch 1)")
  ax.set_xticks(range(len(timed)), [r["label"] for r in timed], rotation=60, ha="right",
                fontsize=7)
  report_lib.save_figure(fig, os.path.join(workdir, PLOTS["speed"]))
