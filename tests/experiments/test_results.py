"""Result store: append-only JSONL, atomic writes, CSV flattening."""

import csv
import json
import os

import pytest

from experiments import results


def test_append_and_done(tmp_path):
  store = results.ResultStore(str(tmp_path))
  assert store.records() == [] and store.done() == set()
  store.append({"point": "a", "metrics": {"x": 1.5}})
  store.append({"point": "b", "metrics": {"x": 2}})
  assert store.done() == {"a", "b"}
  lines = open(store.path).read().splitlines()
  assert [json.loads(l)["point"] for l in lines] == ["a", "b"]
  with pytest.raises(ValueError, match="record must have a 'point' key"):
    store.append({"x": 1})


def test_atomic_write_leaves_old_file_on_failure(tmp_path, monkeypatch):
  path = str(tmp_path / "report.md")
  results.atomic_write_text(path, "old")

  def boom(*args, **kwargs):
    raise KeyboardInterrupt

  monkeypatch.setattr(os, "replace", boom)
  with pytest.raises(KeyboardInterrupt):
    results.atomic_write_text(path, "new")
  monkeypatch.undo()
  assert open(path).read() == "old"
  assert [p.name for p in tmp_path.iterdir()] == ["report.md"]  # no temp file left


def test_csv_flattens_nested_records(tmp_path):
  path = str(tmp_path / "results.csv")
  results.write_csv(path, [{"point": "a", "m": {"x": 1}}, {"point": "b", "m": {"y": [1, 2]}}])
  rows = list(csv.DictReader(open(path)))
  assert rows[0] == {"point": "a", "m.x": "1", "m.y": ""}
  assert rows[1]["m.y"] == "[1, 2]"


def test_environment_fields():
  env = results.environment()
  for key in ("jax_version", "backend", "device_kind", "cpu_count"):
    assert env[key] not in (None, "")
