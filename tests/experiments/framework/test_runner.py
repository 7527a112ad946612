"""The generic runner with a test-only stand-in family (no model, no training).

Resume, skipping finished points, atomic writes, refusal of overrides the sweep
would discard and validation before any work are properties of
`experiments.framework.runner.run`, whatever the family: they are tested here once, on a
family whose `measure` returns numbers and records that it was called.
"""

from __future__ import annotations

import csv
import json
import os

import pytest
from ml_collections import config_dict

from experiments.framework import runner

from experiments.framework import overrides as overrides_lib

SCHEMA = {"grid": ("xs", "scale"), "experiment": ("kind", "name", "max_points")}


class StandIn:
  """A family over `grid.xs` whose measurement is `y = scale * x`.

  `LOG` records every call (`("preflight" | "measure", label)` and
  `("report", [labels])`); `INTERRUPT_AT` makes `measure` raise
  KeyboardInterrupt at that label, as a Ctrl-C in the middle of a point would.
  """

  kind = "grid_standin"
  LOG: list[tuple[str, object]] = []
  INTERRUPT_AT: str | None = None

  def __init__(self, workdir: str):
    self.workdir = workdir

  def points(self, config, sweep):
    overrides_lib.check_schema(overrides_lib.to_dict(config), SCHEMA)
    points = []
    for i, overrides in enumerate(sweep or [{}]):
      where = f"sweep[{i}]" if overrides else "config"
      d = overrides_lib.apply_overrides(config, overrides, where)
      scale = d["grid"]["scale"]
      if not isinstance(scale, (int, float)) or scale <= 0:
        raise ValueError(f"{where}: grid.scale must be > 0; got {scale!r}")
      for x in d["grid"]["xs"]:
        label = f"x{x}-s{scale}"
        pid = f"{label}-{overrides_lib.digest({'x': x, 'scale': scale})}"  # the measured part only
        points.append(runner.Point(pid, label, d,
                                   group=str(scale), params={"x": x}))
    return points

  def preflight(self, point):
    self.LOG.append(("preflight", point.label))
    if point.params["x"] < 0:
      raise ValueError(f"{point.label}: x must be >= 0 (found by the pre-flight)")

  def measure(self, point):
    self.LOG.append(("measure", point.label))
    if point.label == self.INTERRUPT_AT:
      raise KeyboardInterrupt
    return {"y": point.params["x"] * point.config["grid"]["scale"]}

  def report(self, records):
    self.LOG.append(("report", [r["label"] for r in records]))
    markdown = "\n".join(f"| {r['label']} | {r['y']} |" for r in records) + "\n"
    with open(os.path.join(self.workdir, "report.md"), "w", encoding="utf-8") as f:
      f.write(markdown)
    return markdown


runner.register_family(StandIn.kind, StandIn)


@pytest.fixture(autouse=True)
def _fresh_log():
  StandIn.LOG.clear()
  StandIn.INTERRUPT_AT = None
  yield
  StandIn.LOG.clear()
  StandIn.INTERRUPT_AT = None


def _config(xs=(1, 2, 3), scale=2.0):
  config = config_dict.ConfigDict()
  config.grid = config_dict.ConfigDict({"xs": tuple(xs), "scale": scale})
  config.experiment = config_dict.ConfigDict(
      {"kind": "grid_standin", "name": "stand-in", "max_points": config_dict.placeholder(int)})
  return config


def _measured():
  return [label for kind, label in StandIn.LOG if kind == "measure"]


def _stored(workdir):
  with open(os.path.join(workdir, "results.jsonl"), encoding="utf-8") as f:
    return [json.loads(line) for line in f]


def test_every_point_is_measured_once_recorded_and_reported(tmp_path):
  workdir = str(tmp_path)
  result = runner.run(_config(), workdir, [{}, {"grid.scale": 3.0}])
  labels = ["x1-s2.0", "x2-s2.0", "x3-s2.0", "x1-s3.0", "x2-s3.0", "x3-s3.0"]
  assert result.complete and _measured() == labels
  assert [label for kind, label in StandIn.LOG if kind == "preflight"] == labels
  assert StandIn.LOG[-1] == ("report", labels)  # the report sees the records in point order
  assert [r["y"] for r in result.records] == [2.0, 4.0, 6.0, 3.0, 6.0, 9.0]
  assert [r["point"] for r in _stored(workdir)] == result.measured
  r = result.records[0]
  assert (r["label"], r["family"], r["x"]) == ("x1-s2.0", "grid_standin", 1)
  assert r["config"]["grid"]["scale"] == 2.0 and list(r["config"]["grid"]["xs"]) == [1, 2, 3]
  assert r["environment"]["backend"] and r["cpu_model"] and r["point_seconds"] >= 0
  with open(os.path.join(workdir, "results.csv"), encoding="utf-8") as f:
    rows = list(csv.DictReader(f))
  assert [row["point"] for row in rows] == result.measured and "config.grid.scale" in rows[0]
  with open(os.path.join(workdir, "config.json"), encoding="utf-8") as f:
    saved = json.load(f)
  assert saved["points"] == result.measured and saved["sweep"] == [{}, {"grid.scale": 3.0}]
  assert any(line.startswith("jax:") for line in saved["environment_info"])
  assert result.report == open(os.path.join(workdir, "report.md"), encoding="utf-8").read()


def test_rerun_skips_finished_points_and_a_changed_config_gets_new_points(tmp_path):
  workdir = str(tmp_path)
  first = runner.run(_config(), workdir)
  StandIn.LOG.clear()
  again = runner.run(_config(), workdir)
  assert again.measured == [] and again.complete and _measured() == []
  assert [r["point"] for r in again.records] == first.measured
  # One more x: only the new point is measured; the file holds each point once.
  grown = runner.run(_config(xs=(1, 2, 3, 4)), workdir)
  assert _measured() == ["x4-s2.0"] and len(grown.records) == 4
  # Another scale changes every point id (the id hashes the config): all are measured anew,
  # and the report shows only the points of the current config.
  StandIn.LOG.clear()
  other = runner.run(_config(scale=5.0), workdir)
  assert _measured() == ["x1-s5.0", "x2-s5.0", "x3-s5.0"]
  assert StandIn.LOG[-1] == ("report", ["x1-s5.0", "x2-s5.0", "x3-s5.0"])
  points = [r["point"] for r in _stored(workdir)]
  assert len(points) == len(set(points)) == 7 and len(other.records) == 3


def test_max_points_stops_early_and_a_rerun_continues(tmp_path):
  workdir = str(tmp_path)
  first = runner.run(_config(), workdir, max_points=2)
  assert not first.complete and first.measured == [r["point"] for r in first.records]
  assert _measured() == ["x1-s2.0", "x2-s2.0"] and os.path.exists(tmp_path / "report.md")
  config = _config()
  config.experiment.max_points = 1  # the config key works like the argument
  second = runner.run(config, workdir)
  assert _measured()[-1] == "x3-s2.0" and second.complete and len(second.measured) == 1
  with pytest.raises(ValueError, match=r"experiment\.max_points must be a non-negative int"):
    runner.run(_config(), workdir, max_points=-1)


def test_an_interrupt_loses_only_the_point_in_progress(tmp_path):
  workdir = str(tmp_path)
  StandIn.INTERRUPT_AT = "x2-s2.0"
  with pytest.raises(KeyboardInterrupt):
    runner.run(_config(), workdir)
  stored = _stored(workdir)  # every line parses: no torn write
  assert [r["label"] for r in stored] == ["x1-s2.0"]
  assert not [name for name in os.listdir(workdir) if name.startswith(".tmp-")]
  StandIn.INTERRUPT_AT = None
  StandIn.LOG.clear()
  result = runner.run(_config(), workdir)
  assert _measured() == ["x2-s2.0", "x3-s2.0"] and result.complete
  assert [r["label"] for r in _stored(workdir)] == ["x1-s2.0", "x2-s2.0", "x3-s2.0"]


@pytest.mark.parametrize("sweep, match", [
    ([{}, {"grid.scale": 0.0}], r"sweep\[1\]: grid\.scale must be > 0; got 0\.0"),
    ([{"grid.scael": 3.0}], r"sweep\[0\]: grid\.scael is not a known key \(did you mean "
                            r"grid\.scale\?\)"),
    ([{"grid.scale": "big"}], r"sweep\[0\]: grid\.scale = 'big' has the wrong type"),
    ([{}, {"grid.xs": (1, -1)}], r"x-1-s2\.0: x must be >= 0 \(found by the pre-flight\)"),
])
def test_invalid_points_fail_before_any_work(tmp_path, sweep, match):
  workdir = str(tmp_path / "run")
  with pytest.raises(ValueError, match=match):
    runner.run(_config(), workdir, sweep)
  assert _measured() == [] and not os.path.exists(workdir)  # nothing measured or written


def test_bad_sections_and_keys_fail_before_any_work(tmp_path):
  config = _config().to_dict()
  config["grid"]["step"] = 1
  with pytest.raises(ValueError, match=r"config: grid\.step is not a known key"):
    runner.run(config, str(tmp_path / "run"))
  del config["grid"]["step"]
  config["experiment"]["kind"] = "grid_standin_typo"
  with pytest.raises(ValueError, match=r"experiment\.kind must be one of .*'grid_standin'"):
    runner.run(config, str(tmp_path / "run"))
  assert _measured() == [] and not os.path.exists(tmp_path / "run")


def test_an_override_the_sweep_would_discard_is_refused(tmp_path):
  sweep = [{"grid.scale": 2.0}, {"grid.scale": 3.0}]
  defaults = _config().to_dict()  # the config file's own get_config()
  config = _config(scale=4.0)  # as `--config.grid.scale=4` would give
  with pytest.raises(ValueError, match=r"config: grid\.scale = 4\.0 overrides the config file's "
                                       r"2\.0, but the sweep sets grid\.scale for its points "
                                       r"\(2\.0, 3\.0\)"):
    runner.run(config, str(tmp_path / "run"), sweep, defaults=defaults)
  assert _measured() == [] and not os.path.exists(tmp_path / "run")
  # An override of a key no sweep entry sets is kept.
  result = runner.run(_config(xs=(5,)), str(tmp_path / "run"), sweep, defaults=defaults)
  assert [r["y"] for r in result.records] == [10.0, 15.0]


def test_expand_points_is_the_one_sweep_loop():
  from ml_collections import config_dict  # pylint: disable=g-import-not-at-top
  cfg = config_dict.ConfigDict({"a": {"x": 1, "y": 2}})
  cfg.lock()

  def point_of(d, where):
    if d["a"]["x"] < 0:
      raise ValueError(f"{where}: a.x must be >= 0")
    return [runner.PointSpec(f"x{d['a']['x']}-{n}", {"a": d["a"], "n": n}, "g", {"n": n})
            for n in range(d["a"]["y"])]

  points = runner.expand_points(cfg, [{}, {"a.x": 3}], point_of)
  assert [p.label for p in points] == ["x1-0", "x1-1", "x3-0", "x3-1"]
  assert points[2].config["a"]["x"] == 3 and points[0].config["a"]["x"] == 1
  assert len({p.id for p in points}) == 4 and points[1].params == {"n": 1}
  with pytest.raises(ValueError, match=r"sweep\[1\] .*a\.x must be >= 0"):
    runner.expand_points(cfg, [{}, {"a.x": -1}], point_of)
  with pytest.raises(ValueError, match=r"sweep\[1\] .*same point x1-0 as sweep\[0\]"):
    runner.expand_points(cfg, [{"a.x": 1}, {"a.x": 1}], point_of)
  with pytest.raises(ValueError, match="a.z"):
    runner.expand_points(cfg, [{"a.z": 1}], point_of)
