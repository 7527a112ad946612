"""The prefix-reuse experiment: config, validation before any work, the smoke run's records."""

import json
import os

import pytest

from configs import prefix_reuse as prefix_config
from experiments.families import prefix_reuse as pre
from experiments.framework import runner


def test_configs_and_sweep():
  full, smoke = prefix_config.get_config(), prefix_config.get_config("smoke")
  assert full.experiment.kind == smoke.experiment.kind == "prefix_reuse"
  assert full.source.pretrained == "smollm2-135m-instruct" and smoke.source.pretrained == ""
  assert (full.workload.system_len, full.workload.question_len) == (1024, 32)
  assert [s["prefix_cache.mode"] for s in prefix_config.get_sweep()] == [
      "off", "device", "host", "disk"]
  with pytest.raises(ValueError, match="config argument must be one of"):
    prefix_config.get_config("huge")
  points = pre.PrefixReuseFamily("/nonexistent").points(full, prefix_config.get_sweep())
  assert [p.label for p in points] == ["off", "device", "host", "disk"]
  assert len({p.id for p in points}) == 4


@pytest.mark.parametrize("overrides,message", [
    ({"prefix_cache.mode": "ssd"}, r"prefix_cache.mode must be one of \('off', 'device', "
                                   r"'host', 'disk'\); got 'ssd'"),
    ({"prefix_cache.host_bytes": -1}, "prefix_cache.host_bytes must be an int >= 0"),
    ({"cache.num_pages": 4}, "cache.num_pages must hold num_slots full requests"),
    ({"workload.question_len": 0}, "workload.question_len must be an int >= 1"),
    ({"cache.nope": 1}, "cache.nope is not a known key"),
])
def test_bad_points_fail_before_any_work(overrides, message, tmp_path):
  with pytest.raises(ValueError, match=message):
    runner.run(prefix_config.get_config("smoke"), str(tmp_path), [overrides])
  assert not os.path.exists(tmp_path / "results.jsonl")


@pytest.mark.slow
def test_smoke_run_records_every_mode(tmp_path):
  runner.run(prefix_config.get_config("smoke"), str(tmp_path), prefix_config.get_sweep("smoke"))
  records = [json.loads(line) for line in open(tmp_path / "results.jsonl")]
  by_mode = {r["prefix_cache"]: r for r in records}
  assert set(by_mode) == {"off", "device", "host", "disk"}
  for r in records:
    for key in ("ttft_s", "throughput_tokens_per_s", "pages_saved", "numpy_copy_gb_s"):
      assert r[key] is not None and r[key] >= 0, key
  assert by_mode["off"]["pages_saved"] == 0
  assert by_mode["off"]["prefill_tokens"] == by_mode["off"]["prompt_tokens"]
  for mode in ("device", "host", "disk"):
    # 2 requests skip the 64-token system prompt's 8 pages each.
    assert by_mode[mode]["pages_saved"] == 16
    assert by_mode[mode]["prefill_tokens"] == by_mode[mode]["prompt_tokens"] - 2 * 64
  for mode in ("host", "disk"):
    assert by_mode[mode]["offload_gb_s"] > 0 and by_mode[mode]["reload_gb_s"] > 0
  assert "Against the published gains" in open(tmp_path / "report.md").read()
