"""Sweep runner: config + sweep -> validated points -> one measured record per point -> report.

    python -m experiments.main --config=configs/default.py --workdir=runs/default

A run is one *experiment family*, chosen by `config.experiment.kind` and looked
up in `FAMILIES` (`register_family` adds one; an unregistered kind K imports
`experiments/K_experiment.py`, which registers itself). A family is three
things:

  * `points(config, sweep) -> list[Point]`: expands the base config and the
    sweep (a list of dotted-key overrides, `get_sweep()` of the config file)
    into points and validates every one of them -- unknown keys, bad values,
    memory -- raising ValueError naming the key *before any work*;
  * `measure(point) -> dict`: the record of one point (metrics; `run` adds
    the point id, the environment and the time);
  * `report(records) -> str`: writes the report files (markdown, plots) into
    the workdir from the records of this run's points and returns the
    markdown;
  * optionally `preflight(point)`: cheap checks of a point that need more
    than its config (the shipped families trace one decode step against
    abstract model and caches, `check_decode_step`), run for every point
    before any work.

`run` also refuses a command-line override of a key the sweep sets (the sweep
would silently replace it for every point): `check_overrides_kept` compares
the config with the config file's own `get_config(arg)`.

`run` owns the bookkeeping shared by all families (experiments/results.py):
`results.jsonl` is append-only, one JSON object per finished point with a
`"point"` id; a rerun with the same config skips the points already there;
every file is written atomically, so an interrupt loses at most the point in
progress; `results.csv` mirrors `results.jsonl`; a tqdm bar runs over the
points with an ETA.

Point ids are `<label>-<hash>`: the hash covers every config field that can
change a measurement (not bookkeeping such as `experiment.max_points`), so a
rerun with a changed config measures new points instead of reusing stale ones,
and the report only shows the points of the current config.

The "variants" family (this module, `VariantsFamily`) is the main job: for
each sweep entry (an attention variant: MHA K = N, GQA, MQA K = 1, MLA) and
each sequence length S in `cache.seq_lens`
  (a) trains the model briefly on the default corpus (`kvattn.train`), once
      per variant -- points that differ only in S share the training, and the
      trained params are cached in `<workdir>/train/<hash>/` (or
      `experiment.train_dir`), so a rerun does not retrain;
  (b) builds the caches for batch `cache.batch` and capacity S, reads their
      bytes from the real arrays (`kvattn.memory`) and stops with
      `CacheAccountingError` if they differ from the analytic figure
      (`kvattn.transformer.cache_bytes_per_token`);
  (c) times the compiled prefill and decode programs of `kvattn.generate`
      (prompts of real validation text filling the cache; `decode.warmup`
      untimed runs, then `decode.repeats` timed prefills, each followed by
      `decode.decode_repeats` timed decode loops from copies of its caches;
      median / min / max of each);
  (d) records the environment (`experiments.results.environment`) and the
      full point config.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import hashlib
import importlib
import importlib.util
import json
import math
import os
import platform
import statistics
import sys
import time
from typing import Any, Callable, Mapping, Protocol, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import tqdm
from absl import logging
from flax import nnx
from ml_collections import config_dict

from experiments import report as report_lib
from experiments import results
from kvattn import cache as cache_lib
from kvattn import data as data_lib
from kvattn import memory
from kvattn import train as train_lib
from kvattn.ops import quant
from kvattn import transformer as transformer_lib
from kvattn.generate import Sampling, decode, prefill

# ----------------------------------------------------------------------------------------------
# Generic part: points, families, the run loop.


@dataclasses.dataclass(frozen=True)
class Point:
  """One measurement of a sweep.

  id: unique, stable string (the `"point"` key of results.jsonl).
  label: short human name (e.g. "GQA-K2-S512").
  config: the full point config as a plain nested dict (sweep overrides applied).
  group: points with the same group share expensive work (e.g. one training).
  params: the point's coordinates for reports (e.g. variant, K, seq_len).
  """

  id: str
  label: str
  config: dict[str, Any]
  group: str
  params: dict[str, Any]


class Family(Protocol):
  """An experiment family (see the module doc)."""

  def points(self, config: Any, sweep: Sequence[Mapping[str, Any]]) -> list[Point]:
    ...

  def measure(self, point: Point) -> dict[str, Any]:
    ...

  def report(self, records: Sequence[Mapping[str, Any]]) -> str:
    ...


FamilyFactory = Callable[[str], Family]  # workdir -> Family
FAMILIES: dict[str, FamilyFactory] = {}


def register_family(kind: str, factory: FamilyFactory) -> None:
  """Makes `config.experiment.kind = kind` run the family `factory(workdir)`."""
  FAMILIES[kind] = factory


def family_factory(kind: Any) -> FamilyFactory:
  """The family registered for `kind`, importing `experiments.<kind>_experiment` if needed.

  A family module registers itself on import (`register_family`), so a new
  family plugs in by convention: `experiment.kind = "paged"` loads
  `experiments/paged_experiment.py`.

  Raises:
    ValueError: no family of that kind is registered or importable.
  """
  if kind not in FAMILIES and isinstance(kind, str) and kind.isidentifier():
    try:
      importlib.import_module(f"experiments.{kind}_experiment")
    except ModuleNotFoundError as e:
      if e.name != f"experiments.{kind}_experiment":
        raise
  if kind not in FAMILIES:
    raise ValueError(f"experiment.kind must be one of {sorted(FAMILIES)} (or name a module "
                     f"experiments/<kind>_experiment.py that registers it); got {kind!r}")
  return FAMILIES[kind]


def to_dict(config: Any) -> dict[str, Any]:
  """A deep plain-dict copy of a ConfigDict / mapping (tuples kept)."""
  if hasattr(config, "to_dict"):
    return copy.deepcopy(config.to_dict())
  if isinstance(config, Mapping):
    return {k: to_dict(v) if isinstance(v, Mapping) or hasattr(v, "to_dict") else copy.deepcopy(v)
            for k, v in config.items()}
  raise TypeError(f"config must be a ConfigDict or a mapping; got {type(config).__name__}")


def flat_keys(d: Mapping[str, Any], prefix: str = "") -> list[str]:
  """The dotted keys of the leaves of a nested mapping (`{"a": {"b": 1}}` -> `["a.b"]`)."""
  out = []
  for key, value in d.items():
    if isinstance(value, Mapping):
      out += flat_keys(value, f"{prefix}{key}.")
    else:
      out.append(f"{prefix}{key}")
  return out


def _nearest(key: str, keys: Sequence[str]) -> str:
  close = difflib.get_close_matches(key, keys, n=1)
  return f" (did you mean {close[0]}?)" if close else ""


def check_schema(d: Mapping[str, Any], schema: Mapping[str, Sequence[str]], where: str = "config"
                 ) -> None:
  """Checks that `d` has exactly the sections and keys of `schema`.

  Args:
    d: the config as a nested plain dict.
    schema: section -> the dotted keys below it (`"model"` -> `("d_model", ...,
      "attention.kind", ...)`).
    where: prefix of the error messages.

  Raises:
    ValueError: an unknown or missing section or key, named by its dotted path.
  """
  for section in d:
    if section not in schema:
      raise ValueError(f"{where}: {section} is not a known section; expected one of "
                       f"{sorted(schema)}")
  for section, keys in schema.items():
    if section not in d:
      raise ValueError(f"{where}: section {section} is missing; expected keys {sorted(keys)}")
    if not isinstance(d[section], Mapping):
      raise ValueError(f"{where}: {section} must be a section (ConfigDict); got {d[section]!r}")
    given = flat_keys(d[section])
    for key in given:
      if key not in keys:
        raise ValueError(f"{where}: {section}.{key} is not a known key"
                         f"{_nearest(key, keys)}; expected one of {sorted(keys)}")
    for key in keys:
      if key not in given:
        raise ValueError(f"{where}: {section}.{key} is missing")


def apply_overrides(config: Any, overrides: Mapping[str, Any], where: str) -> dict[str, Any]:
  """`config` with dotted-key `overrides` (`{"model.attention.num_kv_heads": 2}`) applied.

  The overrides go through ml_collections' `update_from_flattened_dict` on a
  locked deep copy of `config`, so a key that is not in the config is refused
  and a value is type-checked against the field (typed placeholders of a
  ConfigDict included) exactly as a `--config.<key>=` override would be.

  Returns:
    The overridden config as a nested plain dict (`config` is not changed).

  Raises:
    ValueError: a key that is not in the config or a value of the wrong type,
      named with `where`.
    TypeError: `overrides` is not a mapping.
  """
  if not isinstance(overrides, Mapping):
    raise TypeError(f"{where} must be a dict of dotted-key overrides; got {overrides!r}")
  if isinstance(config, config_dict.ConfigDict):
    cfg = copy.deepcopy(config)
  else:
    cfg = config_dict.ConfigDict(to_dict(config))
  cfg.lock()
  for dotted, value in overrides.items():
    try:
      cfg.update_from_flattened_dict({str(dotted): copy.deepcopy(value)})
    except (KeyError, AttributeError):
      keys = flat_keys(cfg.to_dict())
      raise ValueError(f"{where}: {dotted} is not a known key{_nearest(str(dotted), keys)}"
                       ) from None
    except TypeError as e:
      raise ValueError(f"{where}: {dotted} = {value!r} has the wrong type: {e}") from None
  return cfg.to_dict()


_MISSING = object()


def _get(d: Mapping[str, Any], dotted: str) -> Any:
  """The value at a dotted path of a nested mapping (`_MISSING` if it is not there)."""
  for part in dotted.split("."):
    if not isinstance(d, Mapping) or part not in d:
      return _MISSING
    d = d[part]
  return d


def digest(obj: Any, length: int = 8) -> str:
  """Short stable hash of a JSON-able object (sorted keys; tuples == lists)."""
  text = json.dumps(obj, sort_keys=True, default=str)
  return hashlib.sha1(text.encode("utf-8")).hexdigest()[:length]


def _config_module(config_file: str) -> tuple[Any, list[str], str]:
  """`(module, [arg] or [], path)` of a `--config=path.py[:arg]` value (the file imported)."""
  path, *arg = config_file.split(":", 1)
  if not os.path.exists(path):
    raise FileNotFoundError(f"config file {path!r} does not exist")
  spec = importlib.util.spec_from_file_location(f"_kvattn_sweep_{digest(path)}", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module, arg, path


def load_sweep(config_file: str | None) -> list[dict[str, Any]]:
  """`get_sweep(arg)` of the config file named as in `--config=path.py[:arg]`.

  The sweep takes the same argument as `get_config` (e.g. "smoke"), so a
  small config comes with a small sweep. A file without `get_sweep` (or no
  file) gives one point per base config: `[{}]`.

  Raises:
    FileNotFoundError: the config file does not exist.
    TypeError: `get_sweep` does not return a list of dicts.
  """
  if not config_file:
    return [{}]
  module, arg, path = _config_module(config_file)
  if not hasattr(module, "get_sweep"):
    return [{}]
  sweep = module.get_sweep(*arg)
  if not isinstance(sweep, (list, tuple)) or not all(isinstance(s, Mapping) for s in sweep):
    raise TypeError(f"{path}: get_sweep() must return a list of dicts of dotted-key overrides; "
                    f"got {sweep!r}")
  return [dict(s) for s in sweep] or [{}]


def load_config_defaults(config_file: str | None) -> dict[str, Any] | None:
  """`get_config(arg)` of the config file of `--config=path.py[:arg]` as a plain dict:
  the config before any command-line override (None without a file)."""
  if not config_file:
    return None
  module, arg, _ = _config_module(config_file)
  return to_dict(module.get_config(*arg))


def check_overrides_kept(config: Any, sweep: Sequence[Mapping[str, Any]],
                         defaults: Mapping[str, Any] | None, config_file: str | None = None
                         ) -> None:
  """Fails when a command-line override would be silently replaced by the sweep.

  Every sweep entry's dotted keys replace the base config's values, so an
  override such as `--config.model.attention.num_kv_heads=4` of a key the sweep
  sets would be discarded for every point. Compares `config` (as given on the
  command line) with `defaults` (`get_config(arg)` of the same file) on each
  key some sweep entry sets.

  Raises:
    ValueError: naming the key, its value on the command line and in the
      file, and the values the sweep gives it.
  """
  if defaults is None:
    return
  d = to_dict(config)
  keys = []
  for entry in sweep:
    keys += [str(k) for k in entry if k not in keys]
  for dotted in keys:
    given, default = _get(d, dotted), _get(defaults, dotted)
    if given != default:
      values = list(dict.fromkeys(repr(entry[dotted]) for entry in sweep if dotted in entry))
      source = f" of {config_file}" if config_file else ""
      raise ValueError(
          f"config: {dotted} = {given!r} overrides the config file's {default!r}, but the sweep"
          f"{source} sets {dotted} for its points ({', '.join(values)}), so the override would "
          f"be silently discarded; drop the override, or change the sweep (get_sweep) / the "
          f"keys it sets instead")


@dataclasses.dataclass
class RunResult:
  """What `run` returns: the report (path and markdown) and the records of the config's points."""
  report_path: str
  report: str  # the markdown
  records: list[dict[str, Any]]  # the records of this config's points
  measured: list[str]  # point ids measured by this invocation
  complete: bool  # every point of the config has a record


def run(config: Any, workdir: str, sweep: Sequence[Mapping[str, Any]] = ({},), *,
        config_file: str | None = None, max_points: int | None = None,
        defaults: Mapping[str, Any] | None = None) -> RunResult:
  """Runs (or resumes) the experiment of `config` over `sweep` in `workdir`.

  Before any work (nothing is written, nothing trained): the family validates
  the base config as given, then every point (`Family.points`); a
  command-line override of a key the sweep sets fails
  (`check_overrides_kept`, when `defaults` are known); and, for families with
  a `preflight(point)`, each point's model and caches are built abstractly
  and one decode step is traced, so a decode backend that cannot run a
  point's shapes fails then, naming `model.attention.decode_implementation`.

  Args:
    config: the full config (ConfigDict or nested mapping); `experiment.kind`
      picks the family.
    workdir: output directory (created).
    sweep: dotted-key overrides; the family expands each entry into points
      (the variants family: one per S in `cache.seq_lens`).
    config_file: recorded with the run (`--config` value).
    max_points: measure at most this many new points in this invocation
      (None: `config.experiment.max_points`, where 0/None means all).
    defaults: the config file's own `get_config(arg)` (plain dict), to tell
      command-line overrides from the file's values; None: `config_file`'s
      (`load_config_defaults`), or no check without a file.

  Returns:
    A RunResult (the report is written even when points remain).

  Raises:
    ValueError: invalid config or sweep, an override the sweep would discard,
      or a decode backend that cannot run a point (before any training or
      measurement).
  """
  d = to_dict(config)
  kind = d.get("experiment", {}).get("kind")
  factory = family_factory(kind)
  if max_points is None:
    max_points = d["experiment"].get("max_points")
  if max_points is not None and (isinstance(max_points, bool) or not isinstance(max_points, int)
                                 or max_points < 0):
    raise ValueError(f"experiment.max_points must be a non-negative int or None; got "
                     f"{max_points!r}")
  workdir = os.path.abspath(workdir)
  family = factory(workdir)
  points = family.points(config, list(sweep))  # validates everything before any work
  if defaults is None:
    defaults = load_config_defaults(config_file)
  check_overrides_kept(d, sweep, defaults, config_file)
  preflight = getattr(family, "preflight", None)
  if preflight is not None:
    for point in points:
      preflight(point)
  os.makedirs(workdir, exist_ok=True)
  results.atomic_write_text(os.path.join(workdir, "config.json"), json.dumps(
      {"config_file": config_file, "config": d, "sweep": list(sweep),
       "points": [p.id for p in points]}, indent=2, sort_keys=True, default=str) + "\n")

  store = results.ResultStore(workdir)
  done = store.done()
  todo = [p for p in points if p.id not in done]
  if len(todo) < len(points):
    logging.info("resuming: %d of %d points already in %s", len(points) - len(todo), len(points),
                 store.path)
  if max_points:
    todo = todo[:max_points]
  measured = []
  bar = tqdm.tqdm(total=len(todo), desc="points", unit="point",
                  dynamic_ncols=True)
  try:
    for point in todo:
      bar.set_postfix_str(point.label)
      start = time.perf_counter()
      record = family.measure(point)
      record = {"point": point.id, "label": point.label, "family": kind, **point.params,
                **record, "point_seconds": time.perf_counter() - start,
                "load_avg_1min": os.getloadavg()[0], "measured_at": time.strftime(
                    "%Y-%m-%dT%H:%M:%S%z"), "environment": results.environment(),
                "cpu_model": cpu_model(),
                "config": point.config}
      store.append(record)
      results.write_csv(os.path.join(workdir, "results.csv"), store.records())
      measured.append(point.id)
      bar.update(1)
  finally:
    bar.close()
  ids = {p.id for p in points}
  order = {p.id: i for i, p in enumerate(points)}
  records = sorted((r for r in store.records() if r["point"] in ids),
                   key=lambda r: order[r["point"]])
  results.write_csv(os.path.join(workdir, "results.csv"), store.records())
  markdown = family.report(records)
  return RunResult(os.path.join(workdir, "report.md"), markdown, records, measured,
                   len(records) == len(points))


def timed_prefill(model: nnx.Module, prompts: jax.Array, lengths: jax.Array, caches: Any
                  ) -> tuple[float, jax.Array, Any, jax.Array]:
  """Runs `kvattn.generate`'s compiled prefill (greedy) on `caches`, which it donates.

  Returns `(wall seconds, first tokens i32[B], prefilled caches, rng key)`; the
  clock stops when the results are ready.
  """
  jax.block_until_ready((prompts, caches))
  t0 = time.perf_counter()
  first, caches, key = prefill(model, prompts, lengths, caches, sampling=Sampling())
  jax.block_until_ready((first, caches))
  return time.perf_counter() - t0, first, caches, key


def timed_decode(model: nnx.Module, first: jax.Array, caches: Any, new_tokens: int,
                 key: jax.Array) -> tuple[float, float, jax.Array, jax.Array, Any]:
  """Runs `kvattn.generate`'s compiled greedy decode loop on `caches`, which it donates
  (pass a copy to decode the same prefilled caches again).

  Returns `(wall seconds, process CPU seconds, tokens i32[B, new_tokens], lengths
  i32[B], caches)`. The CPU seconds (all of this process's threads) measure the
  work done, which other processes sharing the machine do not inflate the way
  they inflate wall time.
  """
  jax.block_until_ready(caches)
  t0, c0 = time.perf_counter(), time.process_time()
  tokens, out_lengths, caches = decode(model, first, caches, new_tokens, sampling=Sampling(),
                                       rng=key)
  jax.block_until_ready((tokens, out_lengths, caches))
  return time.perf_counter() - t0, time.process_time() - c0, tokens, out_lengths, caches


def cpu_model() -> str:
  """The CPU's model name (Linux /proc/cpuinfo; else `platform.machine()`)."""
  try:
    with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
      for line in f:
        if line.startswith("model name"):
          return line.split(":", 1)[1].strip()
  except OSError:
    pass
  return platform.machine()


def check_decode_step(spec: transformer_lib.ModelSpec, make_caches: Callable[[Any], Any],
                      batch: int, *, implementation: str | None, where: str) -> None:
  """Traces one T = 1 decode step of the model of `spec`, abstractly.

  The model (`nnx.eval_shape`) and its caches (`make_caches(model)`, built
  inside `jax.eval_shape`) are shapes only: nothing of their size is
  allocated and nothing runs. Tracing the step goes through the decode
  dispatch points with the point's shapes, so a backend named by
  `model.attention.decode_implementation` that cannot run them (NotImplementedError,
  e.g. a Pallas kernel's head-dim or block constraints, or a name the
  cache's dispatch point does not know) fails here, before any training.

  Raises:
    ValueError: naming `model.attention.decode_implementation`, its value, the point
      and the backend's reason.
  """
  abstract = nnx.eval_shape(lambda: transformer_lib.Transformer(spec, rngs=nnx.Rngs(0)))
  graphdef, state = nnx.split(abstract)

  def step(state):
    model = nnx.merge(graphdef, state)
    logits, _ = model(jnp.zeros((batch, 1), jnp.int32), make_caches(model))
    return logits

  try:
    jax.eval_shape(step, state)
  except (NotImplementedError, ValueError, TypeError) as e:
    raise ValueError(
        f"{where}: model.attention.decode_implementation = {implementation!r} cannot run this "
        f"point's decode step (checked before any training): {type(e).__name__}: {e}") from None


def main(config: Any, workdir: str, config_file: str | None = None) -> RunResult:
  """`experiments.main`: loads the sweep of `config_file`, runs, prints the report."""
  result = run(config, workdir, load_sweep(config_file), config_file=config_file)
  status = "" if result.complete else (
      f" ({len(result.records)} points measured so far; rerun to continue)")
  print(f"\nReport: {result.report_path}{status}\n")
  print(result.report)
  return result


# ----------------------------------------------------------------------------------------------
# Memory: what a point needs, what the machine has.


def available_memory_bytes() -> int:
  """Bytes of host RAM available to new allocations (`kvattn.memory.host_available_bytes`;
  the points run on the host's RAM). Raises RuntimeError if it cannot be read."""
  available = memory.host_available_bytes()
  if available is None:
    raise RuntimeError("cannot read the available RAM (/proc/meminfo or os.sysconf)")
  return available


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


# ----------------------------------------------------------------------------------------------
# The "variants" family: MHA / GQA / MQA / MLA compared on memory, speed and quality.


class CacheAccountingError(RuntimeError):
  """The bytes of the real cache arrays differ from the analytic figure."""


def variants_schema() -> dict[str, tuple[str, ...]]:
  """Sections and keys of a "variants" config (see configs/default.py for each field)."""
  return {
      "model": tuple(flat_keys(transformer_lib.model_config().to_dict())),
      "cache": ("dtype", "batch", "seq_lens", "memory_fraction"),
      "decode": ("new_tokens", "warmup", "repeats", "decode_repeats", "seed"),
      "train": tuple(train_lib.train_config().keys()),
      "data": tuple(data_lib.data_config().keys()),
      "experiment": ("kind", "name", "max_points", "train_dir"),
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


def check_int(where: str, value: Any, minimum: int = 1) -> int:
  """`value` if it is an int >= `minimum` (not a bool), else ValueError naming `where`."""
  if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
    raise ValueError(f"{where} must be an int >= {minimum}; got {value!r}")
  return value


def check_cache_bytes(caches: Sequence[Any], analytic_per_token: int, batch: int, seq_len: int
                      ) -> dict[str, Any]:
  """Measures the caches' real arrays and checks them against the analytic figure.

  Args:
    caches: one cache per layer (`storage_arrays()`, `num_slots`).
    analytic_per_token: `kvattn.transformer.cache_bytes_per_token` (whole model).
    batch, seq_len: B and S the caches were built for.

  Returns:
    `cache_bytes_per_token` (measured, summed over layers; equals the
    analytic figure), `cache_bytes` (storage arrays of all layers,
    `B * S * per_token`) and `cache_bookkeeping_bytes` (lengths etc.).

  Raises:
    CacheAccountingError: measured and analytic bytes differ.
  """
  per_token = sum(memory.measured_bytes_per_token(c) for c in caches)
  storage = sum(memory.tree_bytes(c.storage_arrays()) for c in caches)
  if per_token != analytic_per_token or storage != batch * seq_len * analytic_per_token:
    raise CacheAccountingError(
        f"measured cache bytes differ from the analytic figure: {per_token} bytes/token measured "
        f"vs {analytic_per_token} analytic (kvattn.transformer.cache_bytes_per_token); "
        f"{storage} bytes in the arrays vs B * S * analytic = "
        f"{batch * seq_len * analytic_per_token}; stopping")
  return {"cache_bytes_per_token": int(per_token), "cache_bytes": int(storage),
          "cache_bookkeeping_bytes": int(memory.tree_bytes(list(caches)) - storage)}


def _stats(name: str, values: Sequence[float]) -> dict[str, float]:
  return {name: statistics.median(values), f"{name}_min": min(values), f"{name}_max": max(values)}


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
    try:
      spec = transformer_lib.resolve_config(d["model"])
    except ValueError as e:
      raise ValueError(f"{where}: {e}") from None
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
    check_int(f"{where}: cache.batch", cache["batch"])
    seq_lens = cache["seq_lens"]
    if not isinstance(seq_lens, (tuple, list)) or not seq_lens:
      raise ValueError(f"{where}: cache.seq_lens must be a non-empty tuple of ints; got "
                       f"{seq_lens!r}")
    new_tokens = check_int(f"{where}: decode.new_tokens", dec["new_tokens"], 2)
    for s in seq_lens:
      check_int(f"{where}: cache.seq_lens", s, new_tokens)  # the prompt needs >= 1 token
    if len(set(seq_lens)) != len(seq_lens):
      raise ValueError(f"{where}: cache.seq_lens must not repeat a value; got {seq_lens!r}")
    fraction = cache["memory_fraction"]
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or \
        not 0 < fraction <= 1:
      raise ValueError(f"{where}: cache.memory_fraction must lie in (0, 1]; got {fraction!r}")
    check_int(f"{where}: decode.warmup", dec["warmup"], 0)
    check_int(f"{where}: decode.repeats", dec["repeats"], 1)
    check_int(f"{where}: decode.decode_repeats", dec["decode_repeats"], 1)
    check_int(f"{where}: decode.seed", dec["seed"], 0)
    if d["data"]["seq_len"] is None:
      raise ValueError(f"{where}: data.seq_len must be a positive int; got None")
    train_dir = d["experiment"]["train_dir"]
    if train_dir is not None and not isinstance(train_dir, str):
      raise ValueError(f"{where}: experiment.train_dir must be a path or None; got {train_dir!r}")
    return spec

  def _dataset(self, d: Mapping[str, Any], where: str) -> data_lib.Dataset:
    key = digest(d["data"])
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

  def points(self, config: Any, sweep: Sequence[Mapping[str, Any]]) -> list[Point]:
    """Validates config and sweep; one point per (sweep entry, S in cache.seq_lens).

    Points are ordered by variant (training group) and S, so each variant is
    trained once and kept in memory while its sequence lengths are measured.

    Raises:
      ValueError: unknown section/key, bad value, duplicate point, or a point
        that needs more memory than `cache.memory_fraction` of the available
        RAM; the message names the key (and the sweep entry).
    """
    base = to_dict(config)
    check_schema(base, self.schema)
    self._check(base, "config")  # the config as given (command-line overrides included)
    self._config = base
    self._title = base["experiment"]["name"] or self._title
    available = available_memory_bytes()
    points, seen = [], {}
    for i, overrides in enumerate(sweep or [{}]):
      where = f"sweep[{i}] {dict(overrides)}" if overrides else "config"
      d = apply_overrides(config, overrides, where)
      spec = self._check(d, where)
      variant, k = variant_name(spec)
      cache_dtype = d["cache"]["dtype"] or d["model"]["dtype"]
      # Hashes use the resolved ModelSpec, so fields of the other attention kind (e.g. MLA sizes
      # for a GQA point) do not matter; the decode backend does not change training.
      spec_d = json.loads(json.dumps(dataclasses.asdict(spec), default=str))
      trained = {**spec_d, "layers": [{**l, "decode_implementation": None}
                                      for l in spec_d["layers"]]}
      group = digest({"model": trained, **_measured_part(d, ("train", "data"))}, 12)
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
        point_cfg = copy.deepcopy(d)
        label = f"{variant}{'' if k is None else f'-K{k}'}-S{s}"
        measured = _measured_part(d, ("cache", "decode", "train", "data"))
        pid = f"{label}-{digest({'model': spec_d, 'seq_len': s, **measured})}"
        if pid in seen:
          raise ValueError(f"{where}: gives the same point {label} as {seen[pid]}; remove the "
                           f"duplicate sweep entry")
        seen[pid] = where
        points.append(Point(pid, label, point_cfg, group, {
            "variant": variant, "attention_kind": spec.layers[0].kind,
            "num_heads": spec.layers[0].num_heads, "num_kv_heads": k, "seq_len": s,
            "batch": d["cache"]["batch"], "cache_dtype": str(jnp.dtype(cache_dtype)),
            "memory_estimate_bytes": need["total"], "train_group": group}))
    for p in points:  # data problems surface before any training
      self._dataset(p.config, p.label)
    first = {}
    for i, p in enumerate(points):
      first.setdefault(p.group, i)
    return sorted(points, key=lambda p: (first[p.group], p.params["seq_len"]))

  def preflight(self, point: Point) -> None:
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
    check_decode_step(spec, lambda model: model.init_caches(batch, seq_len, dtype), batch,
                      implementation=d["model"]["attention"]["decode_implementation"],
                      where=point.label)
    self._preflighted.add(key)

  # -- training (shared by the points of a group, cached in the workdir) ------------------------

  def train_dir(self, point: Point) -> str:
    """Where the point's training group keeps its params and metrics (shared by its S)."""
    root = point.config["experiment"]["train_dir"] or os.path.join(self.workdir, "train")
    return os.path.join(os.path.abspath(root), point.group)

  def trained_model(self, point: Point) -> tuple[nnx.Module, dict[str, Any]]:
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

  def measure(self, point: Point) -> dict[str, Any]:
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
    cache_record, prefill_times, decode_times = None, [], []
    loops = d["decode"]["decode_repeats"]
    for i in range(warmup + repeats):
      caches = model.init_caches(batch, seq_len, cache_dtype)
      if cache_record is None:
        cache_record = check_cache_bytes(caches, analytic, batch, seq_len)
      prefill_time, first, caches, key = timed_prefill(model, prompts, lengths, caches)
      timed_loops = loops if i >= warmup else 1  # a warm-up run needs one decode to compile
      for j in range(timed_loops):  # each loop decodes from its own copy of the prefilled caches
        loop_caches = caches if j == timed_loops - 1 else jax.tree.map(jnp.copy, caches)
        seconds, _, tokens, out_lengths, loop_caches = timed_decode(model, first, loop_caches,
                                                                    new_tokens, key)
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
        **_stats("prefill_s", prefill_times),
        "prefill_tokens_per_s": batch * prompt_len / statistics.median(prefill_times),
        **_stats("decode_s", decode_times),
        **_stats("decode_ms_per_step", ms_per_step),
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
    return report_lib.write_variants_report(self.workdir, records, title=self._title,
                                            config=self._config)


register_family("variants", VariantsFamily)


def fitting_seq_lens(config: Any, start: int, stop: int | None = None) -> tuple[int, ...]:
  """Powers of two S from `start` while a point of `config` fits in memory (and S <= stop).

  Uses the same estimate and limit as validation (`point_memory_bytes`,
  `cache.memory_fraction` of `available_memory_bytes()`), for the base
  attention of `config` and its MHA form (the largest cache of a sweep over
  K), so every sweep entry of the same model size fits.

  Raises:
    ValueError: not even `start` fits.
  """
  d = to_dict(config)
  allowed = available_memory_bytes() * d["cache"]["memory_fraction"]
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


if __name__ == "__main__":  # pragma: no cover
  sys.exit("run `python -m experiments.main --config=configs/default.py --workdir=DIR`")
