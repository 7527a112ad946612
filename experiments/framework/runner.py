"""Sweep runner: config + sweep -> validated points -> one measured record per point -> report.

    python -m experiments.main --config=configs/default.py --workdir=runs/default

A run is one *experiment family*, chosen by `config.experiment.kind` and looked
up in `FAMILIES` (`register_family` adds one; an unregistered kind K imports
`experiments/families/K.py`, which registers itself). A family is three
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

`run` owns the bookkeeping shared by all families (experiments/framework/results.py):
`results.jsonl` is append-only, one JSON object per finished point with a
`"point"` id; a rerun with the same config skips the points already there;
every file is written atomically, so an interrupt loses at most the point in
progress; `results.csv` mirrors `results.jsonl`; a tqdm bar runs over the
points with an ETA; every log record of the run goes to `<workdir>/log.txt`
(under `main` the terminal shows warnings and the summary only).

Point ids are `<label>-<hash>`: the hash covers every config field that can
change a measurement (not bookkeeping such as `experiment.max_points`), so a
rerun with a changed config measures new points instead of reusing stale ones,
and the report only shows the points of the current config.

The families: `experiments/families/real_model.py` ("real_model", the main job),
`experiments/families/variants.py` ("variants", the byte-level toy comparison),
`experiments/families/quant.py` ("quant") and `experiments/families/paged.py`
("paged").
"""

from __future__ import annotations

import copy
import contextlib
import dataclasses
import difflib
import hashlib
import importlib
import importlib.util
import json
import logging as std_logging
import os
import platform
import sys
import time
from typing import Any, Callable, Iterator, Mapping, Protocol, Sequence

import jax
import jax.numpy as jnp
import psutil
import tqdm
from absl import logging
from flax import nnx
from ml_collections import config_dict

from experiments.framework import cli
from experiments.framework import results
from experiments.framework import workdir as workdir_lib
from kvattn import memory
from kvattn.models import transformer as transformer_lib

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
    """The validated points of `config` with each `sweep` entry's overrides applied; raises
    ValueError naming the key before any work when a point is invalid."""
    ...

  def measure(self, point: Point) -> dict[str, Any]:
    """Runs one point; its record (JSON-serialisable), appended to results.jsonl by the runner."""
    ...

  def report(self, records: Sequence[Mapping[str, Any]]) -> str:
    """Writes report.md (and its plots) into the workdir from every record; returns the markdown."""
    ...


FamilyFactory = Callable[[str], Family]  # workdir -> Family
FAMILIES: dict[str, FamilyFactory] = {}


def register_family(kind: str, factory: FamilyFactory) -> None:
  """Makes `config.experiment.kind = kind` run the family `factory(workdir)`."""
  FAMILIES[kind] = factory


def family_factory(kind: Any) -> FamilyFactory:
  """The family registered for `kind`, importing `experiments.families.<kind>` if needed.

  A family module registers itself on import (`register_family`), so a new
  family plugs in by convention: `experiment.kind = "paged"` loads
  `experiments/families/paged.py`.

  Raises:
    ValueError: no family of that kind is registered or importable.
  """
  if kind not in FAMILIES and isinstance(kind, str) and kind.isidentifier():
    try:
      importlib.import_module(f"experiments.families.{kind}")
    except ModuleNotFoundError as e:
      if e.name != f"experiments.families.{kind}":
        raise
  if kind not in FAMILIES:
    raise ValueError(f"experiment.kind must be one of {sorted(FAMILIES)} (or name a module "
                     f"experiments/families/<kind>.py that registers it); got {kind!r}")
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


@dataclasses.dataclass(frozen=True)
class PointSpec:
  """What a family says of one point of a sweep entry (`expand_points`).

  label: short name (tables, plots, the id's prefix).
  measured: the JSON-able part of the config that changes the measurement; the id hashes it.
  group: points of one group share work (a loaded or trained model).
  params: family-specific fields copied into the record.
  """

  label: str
  measured: Any
  group: str
  params: dict[str, Any]


def expand_points(config: Any, sweep: Sequence[Mapping[str, Any]] | None,
                  point_of: Callable[[dict[str, Any], str], "PointSpec | Sequence[PointSpec]"]
                  ) -> list["Point"]:
  """The points of a config and its sweep: the one sweep -> points loop every family uses.

  Entry i's dotted-key overrides are applied to a copy of `config` (`apply_overrides`; an
  empty sweep is one entry of no overrides), and `point_of(d, where)` validates the result
  `d` and returns its `PointSpec` (or several: one entry may expand into points, e.g. one per
  sequence length). A point's id is `f"{label}-{digest(measured)}"`; its config a copy of `d`.

  Raises:
    ValueError: an override or a value `point_of` rejects (naming `where`: "config" or
      "sweep[i] {...}"), or two entries that give the same point (naming both).
  """
  points, seen = [], {}
  for i, overrides in enumerate(sweep or [{}]):
    where = f"sweep[{i}] {dict(overrides)}" if overrides else "config"
    d = apply_overrides(config, overrides, where)
    specs = point_of(d, where)
    for spec in [specs] if isinstance(specs, PointSpec) else specs:
      pid = f"{spec.label}-{digest(spec.measured)}"
      if pid in seen:
        raise ValueError(f"{where}: gives the same point {spec.label} as {seen[pid]}; remove "
                         f"the duplicate sweep entry")
      seen[pid] = where
      points.append(Point(pid, spec.label, copy.deepcopy(d), spec.group, dict(spec.params)))
  return points


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
        defaults: Mapping[str, Any] | None = None, wait: bool = False) -> RunResult:
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
    wait: when another run holds the workdir (or the training directory),
      wait for it instead of raising `WorkdirBusyError`.

  After validation, the run holds an OS lock on `workdir` and, for a config
  with `experiment.train_dir`, on the training directory (default
  `<workdir>/train`) until it returns (experiments/framework/workdir.py): a second run
  on either stops at once, or waits with `wait`. The records are read with
  `results.ResultStore` (a torn final line is set aside and its point
  measured again; duplicates resolve to the newest); `results.csv` is
  written once, when the run ends (normally or by an exception), from every
  record of the store.

  Returns:
    A RunResult (the report is written even when points remain).

  Raises:
    ValueError: (`cli.ConfigError`) invalid config or sweep, an override the
      sweep would discard, or a decode backend that cannot run a point
      (before any training or measurement).
    experiments.framework.workdir.WorkdirBusyError: another process holds the workdir
      or the training directory and `wait` is False.
    experiments.framework.results.RecordsError: an unreadable line in results.jsonl
      other than a torn final line.
  """
  with cli.config_errors():  # validation: its ValueErrors are the user's (exit 2 on the CLI)
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
    # One run per workdir (and per training directory, which other workdirs may share): a
    # busy one fails now, before the validation below (seconds: data, pre-flight traces).
    lock_dirs = {workdir: "workdir"}
    train_dir = d["experiment"].get("train_dir", False)  # False: the family has no such key
    if train_dir is None or isinstance(train_dir, str):  # else validation names the bad value
      lock_dirs[train_dir or os.path.join(workdir, "train")] = "training directory"
    if not wait:
      workdir_lib.check_free(lock_dirs)
    family = factory(workdir)
    points = family.points(config, list(sweep))  # validates everything before any work
    if defaults is None:
      defaults = load_config_defaults(config_file)
    check_overrides_kept(d, sweep, defaults, config_file)
    preflight = getattr(family, "preflight", None)
    if preflight is not None:
      for point in points:
        preflight(point)
  with workdir_lib.locked(lock_dirs, wait=wait), workdir_log(workdir):
    report_start = time.time()
    results.atomic_write_text(os.path.join(workdir, "config.json"), json.dumps(
        {"config_file": config_file, "config": d, "sweep": list(sweep),
         "points": [p.id for p in points],
         "environment_info": jax.print_environment_info(return_string=True).splitlines()},
        indent=2, sort_keys=True, default=str) + "\n")
    store = results.ResultStore(workdir)
    store.recover()  # a torn final line (killed mid-append) is set aside; its point reruns
    done = store.done()
    todo = [p for p in points if p.id not in done]
    if len(todo) < len(points):  # on the terminal too: a resumed run says so
      resuming = (f"resuming: {len(points) - len(todo)} of {len(points)} points already in "
                  f"{store.path}")
      logging.info(resuming)
      print(resuming, file=sys.stderr)
    if max_points:
      todo = todo[:max_points]
    measured = []
    bar = tqdm.tqdm(total=len(todo), desc="points", unit="point", dynamic_ncols=True)
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
        measured.append(point.id)
        bar.update(1)
    finally:  # results.csv: every point of the store, once per run, also after an exception
      bar.close()
      results.write_csv(os.path.join(workdir, "results.csv"), store.records())
    ids = {p.id for p in points}
    order = {p.id: i for i, p in enumerate(points)}
    records = sorted((r for r in store.records() if r["point"] in ids),
                     key=lambda r: order[r["point"]])
    markdown = link_plots(workdir, family.report(records), since=report_start)
  return RunResult(os.path.join(workdir, "report.md"), markdown, records, measured,
                   len(records) == len(points))


LOG_FILE = "log.txt"  # In the workdir: every log record of a run (absl, orbax, jax, ...).


class _WorkdirLog(std_logging.Handler):
  """Keeps log records until `open(path)`, then appends them and every later one to the file."""

  def __init__(self):
    super().__init__(std_logging.DEBUG)
    self.setFormatter(std_logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    self._held: list[std_logging.LogRecord] = []
    self._file = None

  def open(self, path: str) -> None:
    self._file = open(path, "a", encoding="utf-8")  # pylint: disable=consider-using-with
    held, self._held = self._held, []
    for record in held:
      self.emit(record)

  def emit(self, record: std_logging.LogRecord) -> None:
    if self._file is None:
      if len(self._held) < 100_000:
        self._held.append(record)
      return
    try:
      self._file.write(self.format(record) + "\n")
      self._file.flush()
    except Exception:  # pylint: disable=broad-except
      self.handleError(record)

  def close(self) -> None:
    if self._file is not None:
      self._file.close()
      self._file = None
    super().close()


_ACTIVE_LOG: _WorkdirLog | None = None


@contextlib.contextmanager
def workdir_log(workdir: str) -> Iterator[None]:
  """Writes the log records of the block (and those `quiet_terminal` held before it) to
  `<workdir>/log.txt` (appended: a resumed run adds to it)."""
  global _ACTIVE_LOG  # pylint: disable=global-statement
  own = _ACTIVE_LOG is None
  handler = _WorkdirLog() if own else _ACTIVE_LOG
  if own:
    std_logging.getLogger().addHandler(handler)
    _ACTIVE_LOG = handler
  handler.open(os.path.join(workdir, LOG_FILE))
  try:
    yield
  finally:
    if own:
      std_logging.getLogger().removeHandler(handler)
      handler.close()
      _ACTIVE_LOG = None


@contextlib.contextmanager
def quiet_terminal(verbose: bool) -> Iterator[None]:
  """Library INFO logging (absl, orbax, jax) goes to the workdir's log.txt, not the terminal.

  For the block: every record from INFO up is held until `run` opens
  `<workdir>/log.txt` (`workdir_log`) and written there; the terminal's
  handlers (absl's, and any other on the root logger) show WARNING and above
  only, unless `verbose` (absl's `--verbosity` >= 1), which leaves them as
  they were.
  """
  global _ACTIVE_LOG  # pylint: disable=global-statement
  root = std_logging.getLogger()
  handler = _WorkdirLog()
  saved_level = root.level
  saved = [(h, h.level) for h in root.handlers]
  if not verbose:
    for h, _ in saved:
      h.setLevel(max(h.level, std_logging.WARNING))
  root.setLevel(min(root.level or std_logging.WARNING, std_logging.INFO))
  root.addHandler(handler)
  _ACTIVE_LOG = handler
  try:
    yield
  finally:
    root.removeHandler(handler)
    handler.close()
    _ACTIVE_LOG = None
    root.setLevel(saved_level)
    for h, level in saved:
      h.setLevel(level)


def link_plots(workdir: str, markdown: str, *, since: float) -> str:
  """`markdown` with an image link for each PNG the report wrote (modified at or after
  `since`) that it does not link yet; report.md is rewritten when one was added."""
  names = sorted(n for n in os.listdir(workdir) if n.endswith(".png")
                 and os.path.getmtime(os.path.join(workdir, n)) >= since - 1
                 and f"]({n})" not in markdown)
  if not names:
    return markdown
  markdown = markdown.rstrip("\n") + "\n\n## Plots\n\n" + "\n".join(
      f"![{n[:-4]}]({n})" for n in names) + "\n"
  results.atomic_write_text(os.path.join(workdir, "report.md"), markdown)
  return markdown


def summary(result: RunResult, workdir: str) -> str:
  """What a run prints at its end: the report's first table, where the report, the plots and
  the log are, and whether points remain."""
  lines, table = result.report.splitlines(), []
  for line in lines:
    if line.startswith("|"):
      table.append(line)
    elif table:
      break
  plots = sorted(n for n in os.listdir(workdir) if n.endswith(".png"))
  status = "" if result.complete else (
      f" ({len(result.records)} points measured so far; rerun to continue)")
  out = [""] + table + ["", f"Report: {result.report_path}{status}"]
  if plots:
    out.append(f"Plots:  {', '.join(os.path.join(workdir, p) for p in plots)}")
  out.append(f"Log:    {os.path.join(workdir, LOG_FILE)}")
  return "\n".join(out)


def main(config: Any, workdir: str, config_file: str | None = None, *, wait: bool = False
         ) -> RunResult:
  """`experiments.main`: loads the sweep of `config_file`, runs, prints a short summary.

  Library INFO logging goes to `<workdir>/log.txt` (`quiet_terminal`; absl's
  `--verbosity=1` also shows it on the terminal).
  """
  from absl import flags  # pylint: disable=g-import-not-at-top
  verbose = flags.FLAGS.is_parsed() and flags.FLAGS["verbosity"].value >= 1
  with quiet_terminal(verbose):
    result = run(config, workdir, load_sweep(config_file), config_file=config_file, wait=wait)
  print(summary(result, os.path.abspath(workdir)))
  return result


def cpu_model() -> str:
  """The host CPU described by psutil, e.g. "x86_64, 2 cores (2 physical), 2596 MHz"."""
  physical = psutil.cpu_count(logical=False)
  freq = psutil.cpu_freq()
  mhz = (freq.max or freq.current) if freq is not None else 0
  return (f"{platform.machine()}, {psutil.cpu_count()} cores"
          f"{f' ({physical} physical)' if physical else ''}{f', {mhz:.0f} MHz' if mhz else ''}")


# ----------------------------------------------------------------------------------------------
# Checks and measurements the families share.


def model_spec(d: Mapping[str, Any], where: str) -> transformer_lib.ModelSpec:
  """The resolved `model` section of a point config (`kvattn.models.transformer.resolve_config`).

  Raises:
    ValueError: an invalid `model` section, the message prefixed with `where`.
  """
  try:
    return transformer_lib.resolve_config(d["model"])
  except ValueError as e:
    raise ValueError(f"{where}: {e}") from None


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


class CacheAccountingError(RuntimeError):
  """The bytes of the real cache arrays differ from the analytic figure."""


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
    analytic_per_token: `kvattn.models.transformer.cache_bytes_per_token` (whole model).
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
        f"vs {analytic_per_token} analytic (kvattn.models.transformer.cache_bytes_per_token); "
        f"{storage} bytes in the arrays vs B * S * analytic = "
        f"{batch * seq_len * analytic_per_token}; stopping")
  return {"cache_bytes_per_token": int(per_token), "cache_bytes": int(storage),
          "cache_bookkeeping_bytes": int(memory.tree_bytes(list(caches)) - storage)}


def available_memory_bytes() -> int:
  """Bytes of host RAM available to new allocations (`kvattn.memory.host_available_bytes`;
  the points run on the host's RAM)."""
  return memory.host_available_bytes()


if __name__ == "__main__":  # pragma: no cover
  sys.exit("run `python -m experiments.main --config=configs/default.py --workdir=DIR`")
