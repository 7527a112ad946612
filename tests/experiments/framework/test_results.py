"""Result store: append-only JSONL (robust reading), atomic writes, CSV flattening."""

import csv
import json
import logging
import os

import pytest

from experiments.framework import cli
from experiments.framework import results


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


def _store(tmp_path, *points):
  store = results.ResultStore(str(tmp_path))
  for p in points:
    store.append({"point": p, "v": p.upper()})
  return store


def test_append_appends_a_line_without_rewriting(tmp_path, monkeypatch):
  store = _store(tmp_path, "a", "b")
  before = open(store.path, "rb").read()
  inode = os.stat(store.path).st_ino
  monkeypatch.setattr(os, "replace", lambda *a: pytest.fail("append must not replace the file"))
  store.append({"point": "c"})
  after = open(store.path, "rb").read()
  assert after.startswith(before) and after[len(before):] == b'{"point": "c"}\n'
  assert os.stat(store.path).st_ino == inode
  assert sorted(os.listdir(tmp_path)) == ["results.jsonl"]  # no temp files


@pytest.mark.parametrize("newline", [b"", b"\n"])  # an interrupted append; an editor's cut
def test_torn_final_line_is_set_aside(tmp_path, caplog, newline):
  store = _store(tmp_path, "a", "b")
  whole = open(store.path, "rb").read()
  torn = b'{"point": "c", "v": "unfinish'
  with open(store.path, "ab") as f:
    f.write(torn + newline)
  with caplog.at_level(logging.WARNING):
    assert store.done() == {"a", "b"}  # reading skips it and changes nothing
  assert f"{store.path}:3: torn final line" in caplog.text
  assert open(store.path, "rb").read() == whole + torn + newline
  caplog.clear()
  with caplog.at_level(logging.WARNING):
    assert store.recover() == 3
  assert f"{store.path}:3: torn final line (an interrupted write) set aside in " \
         f"{store.corrupt_path}" in caplog.text
  assert open(store.path, "rb").read() == whole
  assert open(store.corrupt_path, "rb").read() == torn + b"\n"
  assert store.recover() is None  # nothing left to repair


def test_append_after_a_torn_line_sets_it_aside_first(tmp_path):
  store = _store(tmp_path, "a")
  with open(store.path, "ab") as f:
    f.write(b'{"poi')
  store.append({"point": "b"})
  assert [r["point"] for r in store.read()] == ["a", "b"]
  assert open(store.corrupt_path, "rb").read() == b'{"poi\n'


def test_valid_final_line_without_newline_is_kept(tmp_path):
  store = _store(tmp_path, "a")
  with open(store.path, "ab") as f:
    f.write(b'{"point": "b"}')
  assert store.done() == {"a", "b"}
  store.append({"point": "c"})
  assert [r["point"] for r in store.read()] == ["a", "b", "c"]
  assert not os.path.exists(store.corrupt_path)


@pytest.mark.parametrize("bad", [b'{"point": "x", "v":', b"[1, 2]", b'{"no_point": 1}',
                                 b"\xff\xfe"])
def test_unreadable_line_before_the_last_names_file_and_line(tmp_path, bad):
  store = _store(tmp_path, "a")
  with open(store.path, "ab") as f:
    f.write(bad + b'\n{"point": "b"}\n')
  before = open(store.path, "rb").read()
  for read in (store.read, store.records, store.done, store.recover):
    with pytest.raises(results.RecordsError, match=rf"^{store.path}:2: not "):
      read()
  assert open(store.path, "rb").read() == before  # nothing repaired
  assert issubclass(results.RecordsError, cli.UserError)


def test_final_line_that_parses_but_is_no_record_is_an_error(tmp_path):
  store = _store(tmp_path, "a")
  with open(store.path, "ab") as f:
    f.write(b"42\n")
  with pytest.raises(results.RecordsError, match=rf"{store.path}:2: not a record"):
    store.recover()


def test_duplicates_resolve_to_the_newest(tmp_path, caplog):
  path = os.path.join(tmp_path, "results.jsonl")
  lines = [{"point": "a", "v": 1, "measured_at": "2026-01-02T00:00:00+0000"},
           {"point": "b", "v": 1},
           {"point": "a", "v": 2, "measured_at": "2026-01-01T23:00:00-0200"},  # newest (01:00Z)
           {"point": "b", "v": 2},  # no times: the later line
           {"point": "a", "v": 3, "measured_at": "2026-01-01T00:00:00+0000"}]  # older, later line
  with open(path, "w") as f:
    f.writelines(json.dumps(r) + "\n" for r in lines)
  store = results.ResultStore(str(tmp_path))
  with caplog.at_level(logging.WARNING):
    records = store.records()
    store.records()
  assert [(r["point"], r["v"]) for r in records] == [("a", 2), ("b", 2)]
  assert len(store.read()) == 5 and store.done() == {"a", "b"}
  assert caplog.text.count("has 3 records (lines 1, 3, 5); using the newest") == 1  # warned once
  assert "point b has 2 records (lines 2, 4)" in caplog.text
