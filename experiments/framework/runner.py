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
would silently replace it for every point): `overrides.check_overrides_kept`
compares the config with the config file's own `get_config(arg)`. Configs and
sweeps as data live in `overrides.py`, the run's logs in `logs.py`, the checks
the families share in `checks.py`.

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
import dataclasses
import importlib
import importlib.util
import json
import os
import platform
import sys
import time
from typing import Any, Callable, Mapping, Protocol, Sequence

import jax
import numpy as np
import psutil
import tqdm
from absl import logging

from experiments.framework import cli
from experiments.framework import results
from experiments.framework import workdir as workdir_lib
from experiments.framework.logs import LOG_FILE, quiet_terminal, workdir_log
from experiments.framework.overrides import apply_overrides, check_overrides_kept, check_schema, digest, load_config_defaults, load_sweep, to_dict


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


class FamilyState:
  """What a family holds from the start: its workdir, config schema and report title
  (`experiment.name` may replace it), and the config and model it loaded last (None)."""

  def __init__(self, workdir: str, schema: Any, title: str):
    self.workdir = workdir
    self.schema = schema
    self._title = title
    self._config: dict[str, Any] | None = None
    self._model: Any = None

  def _check(self, d: Mapping[str, Any], where: str) -> None:
    """The family's checks of a config dict beyond its schema (ValueError naming `where`)."""

  def load_config(self, config: Any) -> dict[str, Any]:
    """`config` as a dict, checked against the schema and by `_check`; keeps it as `_config`
    and takes `experiment.name`, when set, as the report title."""
    base = to_dict(config)
    check_schema(base, self.schema)
    self._check(base, "config")
    self._config = base
    self._title = base["experiment"]["name"] or self._title
    return base


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
    if jax.process_count() > 1 and jax.process_index() > 0:
      # A multi-process run (`--distributed`): every process measures every point (SPMD),
      # and process i > 0 keeps its records apart, so no two processes write one file.
      workdir = os.path.join(workdir, f"process_{jax.process_index()}")
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
    if jax.process_count() > 1:  # process 0's records decide, so every process runs the same
      from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
      mask = multihost_utils.broadcast_one_to_all(
          np.array([p.id not in done for p in points], bool))
      todo = [p for p, run in zip(points, np.asarray(mask)) if run]
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


