"""The main job (configs/default.py, experiments/families/real_model.py) end to end.

The fast suite runs `python -m experiments.main --config=configs/default.py:smoke` as a
person would (a subprocess from the repo root) on the 2-layer random model
(`--config.model.name=random-tiny`: the same family code without the seconds of loading and
compiling the 30-layer SmolLM2), counts its terminal lines and checks its files and numbers;
the same command on SmolLM2 itself is `slow`. The runner's bookkeeping is tested with a
stand-in family (test_runner.py, test_runs.py); the byte-level toy comparison in test_toy.py.
"""

import json
import math
import os
import re
import socket

import pytest

from configs import default
from experiments.families import real_model as rme
from experiments.framework import runner
from experiments.framework import logs
from tests.experiments import subproc

MAX_TERMINAL_LINES = 60


def run_main(workdir, *overrides):
  proc = subproc.popen("experiments.main", *subproc.main_args(
      str(workdir), *overrides, config="configs/default.py:smoke"))
  out, err = proc.communicate(timeout=900)
  return proc.returncode, out, err


def check_run(workdir, rc, out, err, num_layers):
  assert rc == 0, err
  # tqdm redraws its bar with carriage returns: a terminal shows each bar as one line.
  lines = (out + err).replace("\r", "\n").splitlines()
  shown = [line for line in (out + err).splitlines() if line.strip()]
  assert len(shown) < MAX_TERMINAL_LINES, out + err
  assert not [line for line in lines if re.match(r"^[IW]\d{4} |INFO", line)], err  # no INFO
  for name in ("results.jsonl", "results.csv", "report.md", "config.json", logs.LOG_FILE,
               *rme.PLOTS.values()):
    assert os.path.getsize(os.path.join(workdir, name)) > 0, name
  with open(os.path.join(workdir, logs.LOG_FILE)) as f:
    assert "INFO" in f.read()  # the library logging went to log.txt
  with open(os.path.join(workdir, "report.md")) as f:
    report = f.read()
  for png in rme.PLOTS.values():
    assert f"]({png})" in report
    with open(os.path.join(workdir, png), "rb") as f:
      assert f.read(8) == b"\x89PNG\r\n\x1a\n"
  # The summary: the table, then where the report, the plots and the log are.
  assert "| point |" in out and f"Report: {workdir}/report.md" in out
  assert f"Log:    {workdir}/{logs.LOG_FILE}" in out and "quality_vs_cache.png" in out
  with open(os.path.join(workdir, "results.jsonl")) as f:
    records = {r["label"]: r for r in map(json.loads, f)}
  assert len(records) == len(default.get_sweep("smoke"))
  ref, other = records["Krel-dense-float32"], records["K1-h2o48-int8"]
  assert ref["reference"] and not other["reference"]
  assert ref["greedy_agreement"] == 1.0 and 0.0 <= other["greedy_agreement"] <= 1.0
  # Teacher-forced top-1 agreement over the scored positions: 1 for the reference itself, a
  # multiple of 1 / num_tokens for the others.
  assert ref["top1_agreement"] == 1.0 and 0.0 <= other["top1_agreement"] <= 1.0
  matches = other["top1_agreement"] * other["num_tokens"]
  assert matches == pytest.approx(round(matches), abs=1e-9)
  assert "| top-1 agreement | greedy agreement |" in report
  assert ref["num_layers"] == other["num_layers"] == num_layers and other["num_kv_heads"] == 1
  # f32: 2 (K and V) x K x H x 4 bytes per layer; int8 K = 1: 2 x (H + 4-byte scale) per layer.
  head_dim = ref["cache_bytes_per_token"] / (num_layers * 2 * ref["num_kv_heads"] * 4)
  assert other["cache_bytes_per_token"] == num_layers * 2 * (head_dim + 4)
  assert other["cache_slots_per_seq"] == 48 and ref["cache_slots_per_seq"] == 64
  for r in records.values():
    assert r["decode_tokens_per_s"] > 0 and math.isfinite(r["ppl"]) and r["ppl"] > 1
    assert len(r["greedy_tokens"]) == 8
    # The long-context speed point: B = 2 rows of 96 random tokens through the point's cache.
    assert (r["speed_batch"], r["speed_context"]) == (2, 96) and r["speed_tokens_per_s"] > 0
    assert r["speed_read_bytes"] > r["speed_cache_read_bytes"] > 0 and r["speed_roofline"] > 0
  # The f32 full cache reads all 96 tokens, the int8 H2O its 48 slots.
  assert ref["speed_cache_read_bytes"] == ref["cache_bytes_per_token"] * 2 * 96
  assert other["speed_cache_read_bytes"] == other["cache_bytes_per_token"] * 2 * 48
  assert "decode tok/s B2x96" in out and "roofline" in out


def test_main_smoke_reads_well(tmp_path):
  """The README's main command at `:smoke`: < 60 terminal lines, INFO logging in log.txt."""
  rc, out, err = run_main(tmp_path, "model.name=random-tiny")
  check_run(str(tmp_path), rc, out, err, num_layers=2)


@pytest.mark.slow
def test_main_smoke_on_smollm2(tmp_path):
  rc, out, err = run_main(tmp_path)
  check_run(str(tmp_path), rc, out, err, num_layers=30)


@pytest.mark.parametrize("overrides, match", [
    ({"cache.kind": "lru"}, r"cache\.kind must be one of"),
    ({"cache.dtype": "int4"}, r"cache\.dtype must"),
    ({"cache.dtype": "int32"}, r"cache\.dtype must be a float dtype or one of"),
    ({"heads.method": "max"}, r"heads\.method must be 'mean' or 'first'"),
    ({"heads.num_kv_heads": -1}, r"heads\.num_kv_heads must be an int >= 0"),
    ({"text.new_tokens": 2}, r"text\.new_tokens must be an int >= 3"),
    ({"cache.kind": "sink", "cache.budget": 4}, r"cache\.budget must be >= cache\.num_sinks"),
    ({"mesh.shape": (1, 1, 64)}, r"mesh: mesh\.shape \(1, 1, 64\) needs 64 devices"),
])
def test_bad_point_is_named_before_any_work(tmp_path, overrides, match):
  family = rme.RealModelFamily(str(tmp_path))
  with pytest.raises(ValueError, match=r"sweep\[0\].*" + match):
    family.points(default.get_config("smoke"), [overrides])
  assert not os.listdir(tmp_path)


@pytest.mark.parametrize("arg", default.ARGS)
def test_shipped_config_validates(tmp_path, arg):
  config = default.get_config(arg)
  points = rme.RealModelFamily(str(tmp_path)).points(config, default.get_sweep(arg))
  assert len({p.id for p in points}) == len(points) == len(default.get_sweep(arg))
  assert sum(p.params["reference"] for p in points) == (0 if arg.startswith("kind") else 1)
  # Every measurement holds more tokens than the budget, so a bounded kind evicts in each
  # (the scored text, the greedy prompt + continuation, the speed context).
  text = config.text
  assert min(text.num_tokens, text.prompt_tokens + text.new_tokens,
             config.speed.context) > config.cache.budget
  if not arg:  # cache dtype x policy x head grouping
    assert {(p.params["cache_dtype"], p.params["policy"], p.params["num_kv_heads_setting"])
            for p in points} == {(d, p, k) for d in default.CACHE_DTYPES
                                 for p in default.KINDS for k in default.KV_HEADS}


def test_distributed_initialize_comes_first(tmp_path):
  """`--distributed` calls jax.distributed.initialize() (here one process) before anything
  else: loading configs/default.py and the runner touch no JAX backend, so the run reaches
  the config's validation (a user error, exit 2) instead of JAX's RuntimeError."""
  with socket.socket() as s:
    s.bind(("localhost", 0))
    port = s.getsockname()[1]
  proc = subproc.popen("experiments.main", *subproc.main_args(
      str(tmp_path / "run"), "model.name=random-tiny", "text.new_tokens=2",
      config="configs/default.py:smoke"), "--distributed",
      f"--coordinator_address=localhost:{port}", "--num_processes=1", "--process_id=0")
  out, err = proc.communicate(timeout=300)
  assert proc.returncode == 2, out + err
  assert "text.new_tokens must be an int >= 3" in err and "must be called before" not in err


def test_summary_and_plot_links(tmp_path):
  """`runner.summary` shows the first table and the paths; `link_plots` links unlinked PNGs."""
  (tmp_path / "a.png").write_bytes(b"png")
  (tmp_path / "b.png").write_bytes(b"png")
  md = runner.link_plots(str(tmp_path), "# t\n\n![a](a.png)\n", since=0.0)
  assert md.endswith("## Plots\n\n![b](b.png)\n") and md.count("(a.png)") == 1
  with open(tmp_path / "report.md") as f:
    assert f.read() == md
  report = "# t\n\n| x | y |\n|---|---:|\n| 1 | 2 |\n\nmore\n\n| second | table |\n"
  result = runner.RunResult(str(tmp_path / "report.md"), report, [{}], ["p"], False)
  text = runner.summary(result, str(tmp_path))
  assert "| 1 | 2 |" in text and "second" not in text
  assert "rerun to continue" in text and str(tmp_path / "b.png") in text
  assert len(text.splitlines()) < 10


def test_a_kind_added_by_one_file_runs_in_the_main_job(tmp_path):
  # tests/experiments/reversed_config.py imports the test-only kind (one file + one registry
  # line) and sets cache.kind = "reversed": the main job runs it with no other edit.
  proc = subproc.popen("experiments.main", *subproc.main_args(
      str(tmp_path), "model.name=random-tiny", config="tests/experiments/reversed_config.py"))
  out, err = proc.communicate(timeout=900)
  assert proc.returncode == 0, err
  with open(os.path.join(tmp_path, "results.jsonl")) as f:
    records = [json.loads(line) for line in f]
  (record,) = records
  assert record["policy"] == "reversed" and record["greedy_agreement"] == 1.0
  # Its reference is streamed in the run (no reference point in the sweep): the kind holds
  # every token, so every position's top-1 equals the reference's.
  assert record["top1_agreement"] == 1.0


TOY_PAGED = "tests/kvattn/caches/toy_paged_kind.py"  # a pageable kind in one test-only file
USER_POLICY = "tests/experiments/user_policy.py"  # outside kvattn; registers "keydiff-lite"


def _main_with_import(tmp_path, kind, path):
  """The one record of `:kind-smoke` on the random tiny model with `cache.kind=kind`, the
  kind's module loaded by `--import=path`."""
  # --import loads the file before the config is validated; :kind-smoke's sweep sets no key,
  # so --config.cache.kind names the user's kind (docs/DESIGN.md, "Recipes").
  proc = subproc.popen("experiments.main", *subproc.main_args(
      str(tmp_path), "model.name=random-tiny", f"cache.kind={kind}",
      config="configs/default.py:kind-smoke"), f"--import={path}")
  out, err = proc.communicate(timeout=900)
  assert proc.returncode == 0, err
  with open(os.path.join(tmp_path, "results.jsonl")) as f:
    (record,) = [json.loads(line) for line in f]
  assert record["policy"] == kind
  return record


@pytest.mark.slow  # issue 38 item 9's proof; the fast suite runs the user's policy below
def test_a_pageable_kind_from_one_file_runs_in_the_main_job(tmp_path):
  record = _main_with_import(tmp_path, "toy_paged", TOY_PAGED)
  # Paged storage holds every token: greedy decoding equals the dense reference's.
  assert record["greedy_agreement"] == 1.0


@pytest.mark.slow  # the fast suite: a kind from one file (below) and the policy notebook
def test_a_policy_from_the_users_own_file_runs_in_the_main_job(tmp_path):
  record = _main_with_import(tmp_path, "keydiff-lite", USER_POLICY)
  budget = default.get_config("kind-smoke").cache.budget
  assert record["budget"] == budget
  # The cache holds its budget: 48 slots, and the speed point reads 48 of its 96 tokens.
  assert record["cache_slots_per_seq"] == budget
  assert record["speed_cache_read_bytes"] == record["cache_bytes_per_token"] * 2 * budget
  assert 0.0 <= record["greedy_agreement"] <= 1.0 and math.isfinite(record["ppl"])
  assert 0.0 <= record["top1_agreement"] <= 1.0

