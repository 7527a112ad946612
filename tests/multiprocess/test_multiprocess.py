"""Two processes on localhost, 4 CPU devices each, one global mesh of 8 (`jax.distributed`,
CPU collectives over gloo): sharded `generate` (caches from `cache_factory` and prebuilt),
the batcher with the prefix cache, and save / restore of sharded caches give the tokens and
values of one device, on every process (`_worker.py` runs the checks)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def run_workers(num_processes: int, checks: list[str], timeout: int = 400) -> list[dict]:
  """Runs `_worker.py` as `num_processes` processes; returns every JSON line, per process."""
  env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
             JAX_PLATFORMS="cpu", KVATTN_WORKER_TIMEOUT=str(timeout - 30))
  port = _free_port()
  with tempfile.TemporaryDirectory() as directory:
    procs = [subprocess.Popen(
        [sys.executable, "-m", "tests.multiprocess._worker", str(i), str(num_processes),
         str(port), ",".join(checks), directory], cwd=ROOT, env=env, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True) for i in range(num_processes)]
    outputs = []
    for proc in procs:
      try:
        out, err = proc.communicate(timeout=timeout)
      except subprocess.TimeoutExpired:
        for p in procs:
          p.kill()
        raise
      outputs.append((proc.returncode, out, err))
  results = [json.loads(line) for _, out, _ in outputs for line in out.splitlines()
             if line.startswith("{")]
  failed = [r for r in results if not r["ok"]]
  assert all(code == 0 for code, _, _ in outputs) and not failed, (
      json.dumps(failed, indent=1)[-4000:] + "\n" + "\n".join(e[-2000:] for _, _, e in outputs))
  assert len(results) == num_processes * len(checks)
  return results


def _check_two_processes(checks: list[str]) -> None:
  results = run_workers(2, checks)
  by_check = {}
  for r in results:
    by_check.setdefault(r["check"], []).append(r)
  for name, rows in by_check.items():
    assert sorted(r["process"] for r in rows) == [0, 1], name
    # Every process reads the same global values.
    assert rows[0]["tokens"] == rows[1]["tokens"], name
  for name in ("generate_dense", "generate_paged"):
    if name in by_check:
      row = by_check[name][0]
      assert row["tokens"] == row["reference"] and row["prebuilt"] == row["reference"], name
  if "batcher" in by_check:
    batcher = by_check["batcher"][0]
    assert batcher["tokens"] == batcher["reference"]
    # The shared 8-token prefix is reused; each data shard keeps its own prefix index, so
    # the mesh reuses at most what one device does.
    assert batcher["reference_prefill_tokens"] <= batcher["prefill_tokens"] < batcher[
        "prompt_tokens"]
  if "checkpoint" in by_check:
    checkpoint = by_check["checkpoint"][0]
    assert checkpoint["leaves_equal"] and checkpoint["placement_kept"]
    assert checkpoint["tokens"] == [6, 3, 1, 5]


def test_two_processes_generate_and_batch_the_tokens_of_one_device():
  _check_two_processes(["generate_dense", "batcher"])


@pytest.mark.slow
def test_two_processes_paged_generate_and_checkpoint():
  _check_two_processes(["generate_paged", "checkpoint"])


@pytest.mark.slow
def test_one_process_with_eight_devices_gives_the_same_tokens():
  one = {r["check"]: r for r in run_workers(1, ["generate_dense", "generate_paged", "batcher"])}
  two = {r["check"]: r for r in run_workers(2, ["generate_dense", "generate_paged", "batcher"])
         if r["process"] == 0}
  for name in one:
    assert one[name]["tokens"] == two[name]["tokens"], name


def _main_job(workdir: str, num_processes: int) -> list[dict]:
  """The main job's smoke config on a random model over a (1, 8, 1) mesh, as
  `num_processes` processes of `8 // num_processes` devices; process 0's records."""
  port = _free_port()
  env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
             JAX_PLATFORMS="cpu",
             XLA_FLAGS=f"--xla_force_host_platform_device_count={8 // num_processes}")
  flags = ["--config=configs/default.py:smoke", "--config.model.name=random-tiny",
           "--config.mesh.shape=(1,8,1)", f"--workdir={workdir}"]
  if num_processes > 1:
    flags += ["--distributed", f"--coordinator_address=localhost:{port}",
              f"--num_processes={num_processes}"]
  procs = [subprocess.Popen(
      [sys.executable, "-m", "experiments.main", *flags]
      + ([f"--process_id={i}"] if num_processes > 1 else []), cwd=ROOT, env=env,
      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(num_processes)]
  outs = [p.communicate(timeout=600)[0] for p in procs]
  assert all(p.returncode == 0 for p in procs), "\n".join(o[-3000:] for o in outs)
  with open(os.path.join(workdir, "results.jsonl"), encoding="utf-8") as f:
    return [json.loads(line) for line in f]


@pytest.mark.slow  # two main-job runs, ~3 CPU-minutes
def test_main_job_on_two_processes_equals_one_process(tmp_path):
  two = _main_job(str(tmp_path / "two"), 2)
  one = _main_job(str(tmp_path / "one"), 1)
  with open(tmp_path / "two" / "process_1" / "results.jsonl", encoding="utf-8") as f:
    other = [json.loads(line) for line in f]
  assert [r["point"] for r in two] == [r["point"] for r in one] == [r["point"] for r in other]
  for a, b, c in zip(two, one, other):
    assert a["greedy_tokens"] == b["greedy_tokens"] == c["greedy_tokens"], a["point"]
    assert a["ppl"] == pytest.approx(b["ppl"], rel=1e-6) and a["ppl"] == c["ppl"], a["point"]


@pytest.mark.slow  # 12 one-layer steps compiled in 3 processes, ~2 CPU-minutes
def test_sharding_benchmark_on_two_processes_matches_one_process():
  env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
             JAX_PLATFORMS="cpu")
  env.pop("XLA_FLAGS", None)
  out = subprocess.run(
      [sys.executable, "-m", "experiments.benchmarks.sharding", "--smoke", "--processes=2",
       "--rounds=1", "--steps=2", "--repeats=1"], cwd=ROOT, env=env, capture_output=True,
      text=True, timeout=900, check=True).stdout
  rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
  by = {(r["processes"], r["cache_kind"], tuple(r["mesh"])): r for r in rows}
  assert len(by) == len(rows) == 2 * 3 * 2  # processes 1, 2 x dense, paged, mla x two meshes
  for (processes, kind, mesh), r in by.items():
    assert r["tokens_equal_single_device"] and r["cache_all_gathers"] == 0, r
    if processes == 2:  # the same program: the same bytes per device and collectives
      one = by[(1, kind, mesh)]
      for key in ("per_device_cache_bytes", "total_cache_bytes", "collective_bytes_per_step",
                  "collectives"):
        assert r[key] == one[key], (key, r)
