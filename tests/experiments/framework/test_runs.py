"""Runs that share a workdir, die mid-point or meet a damaged results file (stand-in family).

The stand-in family (tests/experiments/standin.py) measures nothing: a point
records `value = i**2` and its process's PID, optionally after waiting for a
gate file, so these tests exercise the runner's bookkeeping in seconds.
"""

import collections
import csv
import json
import logging
import os
import re
import signal
import time

import pytest

from experiments.framework import cli
from experiments.framework import results
from experiments.framework import runner
from experiments.framework import workdir as workdir_lib
from tests.experiments import standin
from tests.experiments import subproc


def run(workdir, **standin_overrides):
  config = standin.get_config()
  for key, value in standin_overrides.items():
    config.standin[key] = value
  return runner.run(config, str(workdir), standin.get_sweep())


def lines(workdir):
  with open(os.path.join(workdir, "results.jsonl"), encoding="utf-8") as f:
    return [json.loads(line) for line in f]


def rows(markdown):
  """The point rows of a stand-in report."""
  return re.findall(r"^\| p\d+ \|.*$", markdown, re.MULTILINE)


def report_rows(workdir):
  with open(os.path.join(workdir, "report.md"), encoding="utf-8") as f:
    return rows(f.read())


def csv_rows(workdir):
  with open(os.path.join(workdir, "results.csv"), encoding="utf-8") as f:
    return list(csv.DictReader(f))


def test_torn_last_line_is_set_aside_and_its_point_rerun(tmp_path, caplog):
  first = run(tmp_path)
  assert first.measured == ["p0", "p1", "p2"]
  path = os.path.join(tmp_path, "results.jsonl")
  data = open(path, "rb").read()
  cut = data.rindex(b"\n", 0, len(data) - 1) + 1 + 40  # 40 bytes into the third line
  with open(path, "r+b") as f:
    f.truncate(cut)
  with caplog.at_level(logging.WARNING):
    second = run(tmp_path)
  assert f"{path}:3: torn final line (an interrupted write) set aside in {path}.corrupt" \
      in caplog.text
  assert second.measured == ["p2"] and second.complete
  assert open(path + ".corrupt", "rb").read() == data[cut - 40:cut] + b"\n"
  assert [r["point"] for r in lines(tmp_path)] == ["p0", "p1", "p2"]
  assert len(report_rows(tmp_path)) == 3 and len(csv_rows(tmp_path)) == 3


def test_corrupt_middle_line_stops_the_run_naming_file_and_line(tmp_path):
  run(tmp_path, num_points=2)
  path = os.path.join(tmp_path, "results.jsonl")
  first, second = open(path, "rb").read().splitlines(keepends=True)
  damaged = first[:30] + b"\n" + second
  with open(path, "wb") as f:
    f.write(damaged)
  with pytest.raises(results.RecordsError, match=rf"^{path}:1: not JSON") as info:
    run(tmp_path, num_points=3)
  assert cli.is_user_error(info.value)
  assert open(path, "rb").read() == damaged  # nothing measured, nothing repaired
  assert not os.path.exists(os.path.join(tmp_path, "measuring-p2"))


def test_duplicate_records_give_one_row(tmp_path, caplog):
  run(tmp_path)
  path = os.path.join(tmp_path, "results.jsonl")
  records = lines(tmp_path)
  newer = dict(records[1], value=99, measured_at="2999-01-01T00:00:00+0000")
  with open(path, "a", encoding="utf-8") as f:  # a hand-merged file: p1 twice, p0 twice
    f.write(json.dumps(newer) + "\n" + json.dumps(records[0]) + "\n")
  with caplog.at_level(logging.WARNING):
    again = run(tmp_path)
  assert again.measured == [] and again.complete
  assert "point p1 has 2 records (lines 2, 4); using the newest" in caplog.text
  assert [(r["point"], r["value"]) for r in again.records] == [("p0", 0), ("p1", 99), ("p2", 4)]
  assert report_rows(tmp_path) == ["| p0 | 0 |", "| p1 | 99 |", "| p2 | 4 |"]
  assert [row["point"] for row in csv_rows(tmp_path)] == ["p0", "p1", "p2"]


def test_csv_is_written_once_per_run_and_after_a_fault(tmp_path, monkeypatch):
  writes, real = [], results.write_csv

  def counting(path, records):
    records = list(records)
    writes.append(len(records))
    real(path, records)

  monkeypatch.setattr(results, "write_csv", counting)
  with pytest.raises(ValueError, match="stand-in fault at point p2"):
    run(tmp_path, num_points=4, fail_at=2)
  assert writes == [2]  # once, in the run's `finally`: the two finished points
  assert [row["point"] for row in csv_rows(tmp_path)] == ["p0", "p1"]
  run(tmp_path, num_points=4)
  assert writes == [2, 4]


def test_a_shared_training_directory_is_locked_too(tmp_path):
  """Two workdirs with one `experiment.train_dir`: the second run stops (training checkpoints
  have one writer)."""
  train_dir = str(tmp_path / "shared_train")
  config = standin.get_config()
  config.experiment.train_dir = train_dir
  with workdir_lib.locked([train_dir]):
    with pytest.raises(workdir_lib.WorkdirBusyError,
                       match=rf"^training directory {train_dir} is in use by another run "
                             rf"\(pid {os.getpid()}\)"):
      runner.run(config, str(tmp_path / "other"), standin.get_sweep())
  assert not os.path.exists(tmp_path / "other" / "results.jsonl")
  runner.run(config, str(tmp_path / "other"), standin.get_sweep())  # released: runs
  assert os.path.exists(os.path.join(train_dir, workdir_lib.LOCK_NAME))
  with workdir_lib.locked([str(tmp_path / "other" / "train")]):  # not used: train_dir is set
    runner.run(config, str(tmp_path / "other"), standin.get_sweep())


def test_a_busy_workdir_fails_before_validation(tmp_path, monkeypatch):
  monkeypatch.setattr(standin.StandinFamily, "points",
                      lambda *a: pytest.fail("validated although the workdir is busy"))
  with workdir_lib.locked([str(tmp_path)]):
    with pytest.raises(workdir_lib.WorkdirBusyError, match=rf"^workdir {tmp_path} is in use"):
      run(tmp_path)
  assert os.listdir(tmp_path) == [workdir_lib.LOCK_NAME]


def wait_for(predicate, what, timeout=120.0):
  deadline = time.monotonic() + timeout
  while not predicate():
    assert time.monotonic() < deadline, f"timed out waiting for {what}"
    time.sleep(0.05)


def test_concurrent_runs_on_one_workdir(tmp_path):
  """A second run on a busy workdir exits 2 at once; `--wait` waits; the first run's records
  are complete and unduplicated."""
  workdir, gate = str(tmp_path / "run"), str(tmp_path / "gate")
  first = subproc.popen("experiments.main",
                        *subproc.main_args(workdir, f"standin.wait_file={gate}"))
  try:
    wait_for(lambda: os.path.exists(os.path.join(workdir, "measuring-p0")), "the first run")
    with open(tmp_path / "waiter.err", "w") as err:
      waiter = subproc.popen("experiments.main", *subproc.main_args(workdir), "--wait",
                             stderr=err)
      second = subproc.popen("experiments.main", *subproc.main_args(workdir))
      _, stderr = second.communicate(timeout=300)
      assert second.returncode == cli.EXIT_USER_ERROR
      assert first.poll() is None  # exited while the first run still held the workdir
      assert stderr.splitlines() == [f"error: workdir {workdir} is in use by another run (pid "
                                     f"{first.pid}); wait for it to finish, or pass --wait to "
                                     f"start when it does"]
      wait_for(lambda: "waiting for it to finish" in open(tmp_path / "waiter.err").read(),
               "the --wait run to wait")
      assert waiter.poll() is None
      open(gate, "w").close()
      out, _ = first.communicate(timeout=300)
      assert first.returncode == 0
      waited, _ = waiter.communicate(timeout=300)
      assert waiter.returncode == 0
  finally:
    if first.poll() is None:
      first.kill()
  records = lines(workdir)
  assert [r["point"] for r in records] == ["p0", "p1", "p2"]
  assert {r["pid"] for r in records} == {first.pid}  # the waiting run measured nothing
  assert rows(out) == rows(waited) == ["| p0 | 0 |", "| p1 | 1 |", "| p2 | 4 |"]
  assert open(os.path.join(workdir, workdir_lib.LOCK_NAME)).read() == ""


def test_killed_run_resumes_without_duplicates(tmp_path):
  """SIGKILL in the middle of a point: the next run is not blocked, keeps the finished points
  and measures the rest once."""
  workdir, never = str(tmp_path / "run"), str(tmp_path / "never")
  killed = subproc.popen("experiments.main", *subproc.main_args(
      workdir, "standin.num_points=4", f"standin.wait_file={never}", "standin.wait_from=2"))
  try:
    wait_for(lambda: os.path.exists(os.path.join(workdir, "measuring-p2")), "point p2 to start")
  finally:
    killed.send_signal(signal.SIGKILL)
    killed.communicate(timeout=120)
  assert killed.returncode == -signal.SIGKILL
  assert [r["point"] for r in lines(workdir)] == ["p0", "p1"]
  resumed = subproc.popen("experiments.main", *subproc.main_args(workdir, "standin.num_points=4"))
  out, stderr = resumed.communicate(timeout=300)
  assert resumed.returncode == 0, stderr
  assert "resuming: 2 of 4 points already in" in stderr
  records = lines(workdir)
  assert collections.Counter(r["point"] for r in records) == {"p0": 1, "p1": 1, "p2": 1, "p3": 1}
  assert [r["pid"] for r in records] == [killed.pid] * 2 + [resumed.pid] * 2
  assert len(rows(out)) == 4 and len(csv_rows(workdir)) == 4
