r"""A stand-in experiment family and its config: the runner's bookkeeping without a model.

    python -m experiments.main --config=tests/experiments/standin.py --workdir=DIR \
        --config.standin.num_points=4

Loading this file (as a config file, or importing it) registers the family
"standin" (`runner.register_family`), so `experiment.kind = "standin"` runs
it. Point i (id `p<i>`) writes `<workdir>/measuring-p<i>` when it starts;
points with i >= `standin.wait_from` then wait until the file
`standin.wait_file` exists (a gate the test opens, or never: the test kills
the run), and point `standin.fail_at` raises ValueError (a fault of the program,
not a user error: not raised by validation). The record is `value = i**2`
and the measuring process's PID.
"""

import os
import time

from ml_collections import config_dict

from experiments.framework import results
from experiments.framework import runner
from experiments.framework import overrides as overrides_lib

SCHEMA = {"experiment": ("kind", "name", "max_points", "train_dir"),
          "standin": ("num_points", "wait_file", "wait_from", "fail_at")}


class StandinFamily:
  """Points p0..p<n-1>; see the module doc."""

  def __init__(self, workdir: str):
    self.workdir = workdir

  def points(self, config, sweep):
    d = overrides_lib.to_dict(config)
    overrides_lib.check_schema(d, SCHEMA)
    points = []
    for i, overrides in enumerate(sweep or [{}]):
      where = f"sweep[{i}]" if overrides else "config"
      e = overrides_lib.apply_overrides(config, overrides, where)
      overrides_lib.check_schema(e, SCHEMA, where)
      n = e["standin"]["num_points"]
      if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"{where}: standin.num_points must be an int >= 1; got {n!r}")
      points += [runner.Point(f"p{j}", f"P{j}", e, "g", {"index": j}) for j in range(n)]
    return points

  def measure(self, point):
    s, index = point.config["standin"], point.params["index"]
    with open(os.path.join(self.workdir, f"measuring-{point.id}"), "w", encoding="utf-8") as f:
      f.write(f"{os.getpid()}\n")
    if index == s["fail_at"]:
      raise ValueError(f"stand-in fault at point {point.id}")  # a bug, not a user error
    while s["wait_file"] and index >= s["wait_from"] and not os.path.exists(s["wait_file"]):
      time.sleep(0.02)
    return {"value": index**2, "pid": os.getpid()}

  def report(self, records):
    rows = [f"| {r['point']} | {r['value']} |" for r in records]
    markdown = "\n".join(["| point | value |", "|---|---:|", *rows]) + "\n"
    results.atomic_write_text(os.path.join(self.workdir, "report.md"), markdown)
    return markdown


runner.register_family("standin", StandinFamily)


def get_config(arg: str = ""):
  """The stand-in config (`arg` is ignored)."""
  del arg
  config = config_dict.ConfigDict()
  config.experiment = config_dict.ConfigDict({
      "kind": "standin", "name": "stand-in", "max_points": config_dict.placeholder(int),
      "train_dir": config_dict.placeholder(str)})
  config.standin = config_dict.ConfigDict({
      "num_points": 3, "wait_file": config_dict.placeholder(str), "wait_from": 0,
      "fail_at": -1})
  return config


def get_sweep(arg: str = ""):
  del arg
  return [{}]
