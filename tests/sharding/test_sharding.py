"""kvattn.sharding on 8 simulated CPU devices (tests/sharding/_mesh_checks.py, one process).

The device count is fixed when JAX starts, so the checks run in a subprocess with
`--xla_force_host_platform_device_count=8`: sharded decode logits and `generate` tokens
equal the single-device run, each device holds exactly its share of the cache bytes, the
compiled decode step has no all-gather of the cache, the context-parallel merge survives
empty shards with NaN in their buffers, bad meshes raise ValueError naming the axis, and
every place a cache layout is made checks it up front (`check_layouts`).
`ContinuousBatcher` on a mesh (data parallel over its slots and pool, KV heads over `model`)
gives the single-device tokens with each device holding its share of the pool; the main job's
family (experiments/families/real_model.py on "random-tiny") gives the single-device
perplexity and greedy tokens. The default suite runs a compact grid; the issue's full grid,
the batcher's meshes and the main job are `-m slow`.
"""

import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _run(grid: str, timeout: int) -> list[dict]:
  env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
             JAX_PLATFORMS="cpu")
  proc = subprocess.run([sys.executable, "-m", "tests.sharding._mesh_checks", grid], cwd=ROOT,
                        env=env, capture_output=True, text=True, timeout=timeout, check=False)
  results = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
  failed = [r for r in results if not r["ok"]]
  assert proc.returncode == 0 and results and not failed, (
      f"exit {proc.returncode}; failed: {json.dumps(failed, indent=1)}\n{proc.stderr[-3000:]}")
  return results


def test_sharded_decode_compact_grid():
  results = _run("fast", timeout=900)
  cases = [r for r in results if r["check"] == "case"]
  assert {r["kind"] for r in cases} == {"dense", "paged"}
  assert any(r.get("tokens_equal") for r in cases)
  assert all(r["all_reduces"] > 0 for r in cases)  # the LSE merge over seq, o_proj over model
  assert {r["kind"] for r in results if r["check"] == "empty_shards"} == {"dense", "mla"}
  assert any(r["check"] == "bad_meshes" for r in results)
  assert any(r["check"] == "layouts" for r in results)
  assert [r["mesh"] for r in results if r["check"] == "batcher"] == [[2, 2, 1]]


@pytest.mark.slow
def test_batcher_data_parallel():
  results = _run("batcher", timeout=900)
  assert [(r["mesh"], r["prefix_cache"]) for r in results] == [
      ([2, 1, 1], False), ([2, 2, 1], False), ([2, 2, 1], True)]
  assert all(r["tokens_equal"] and r["per_device"] == [r["share"]] for r in results)


@pytest.mark.slow
def test_sharded_decode_full_grid():
  results = _run("full", timeout=3600)
  cases = [r for r in results if r["check"] == "case"]
  assert len(cases) == 4 * 3 * 2 + 4
  assert all(r["tokens_equal"] for r in cases)
  assert sum(r["check"] == "batcher" for r in results) == 5
  assert sum(r["check"] == "real_model" for r in results) == 1


@pytest.mark.slow
def test_main_job_on_a_mesh():
  results = _run("real_model", timeout=900)
  assert [r["mesh"] for r in results] == [[1, 2, 1], [1, 1, 2]]
  assert all(r["tokens_equal"] and r["ppl_max_rel_diff"] <= 1e-5 for r in results)


@pytest.mark.slow
def test_batcher_with_rings_on_a_mesh():
  # The per-layer layout (issue 29): rings split over `data` with their slots, pools as above;
  # generate on the mesh with rings and sharded dense global layers.
  results = _run("layers", timeout=900)
  assert [r["mesh"] for r in results] == [[2, 1, 1], [2, 2, 1]]
  assert all(r["tokens_equal"] and r["per_device"] == [r["share"]] for r in results)
  assert all(r["kinds"] == ["RingKVCache", "ShardedPagedKVCache"] for r in results)
  assert all(r["generate_tokens_equal"] for r in results)  # sharded.cache_factory(local_layers=)
  assert all(r["generate_kinds"] == ["RingKVCache", "ShardedKVCache"] for r in results)
  assert all(r["speculative_tokens_equal"] for r in results)  # rings commit from undo logs


@pytest.mark.slow  # ~45 CPU-seconds: generate and two batchers compiled on 4 simulated devices
def test_lowbit_caches_on_a_mesh():
  # Issue 28: KIVI caches placed by sharded.place_lowbit (GSPMD): generate through kivi4 and
  # ContinuousBatcher(cache="paged_kivi4") on (2, 2, 1) give the single-device tokens, each
  # device holding a quarter of the codes, scales, zero points and rings.
  (result,) = _run("lowbit", timeout=900)
  assert result["generate_tokens_equal"] and result["tokens_equal"]
  assert result["mla_generate_tokens_equal"]  # KIVILatentCache, rows over data
  assert result["dense_per_device"] == [result["dense_share"]]
  assert result["pool_per_device"] == [result["pool_share"]]
  assert result["kinds"] == ["KIVICache", "PagedKIVICache"]
