"""The lowbit experiment (KIVI on a real model): configs, validation before work, a tiny run."""

import os

import pytest

from configs import lowbit as lowbit_config
from experiments.families import lowbit
from experiments.framework import runner


def test_configs_and_sweeps_validate():
  full = lowbit_config.get_config()
  assert full.experiment.kind == "lowbit" and full.text.num_tokens + full.text.new_tokens == 4096
  points = lowbit.LowbitFamily("/nonexistent").points(full, lowbit_config.get_sweep())
  assert [p.label for p in points] == [
      "dense-float32", "kivi4-g32-r128", "kivi2-g32-r128", "rotated4-r0-lloyd-max",
      "rotated3-r0-lloyd-max", "kivi2-g32-r128-prerope", "dense-int8", "kivi4-g32-r32",
      "kivi2-g32-r32", "kivi4-g32-r128-prerope", "dense-bfloat16", "rotated4-r128-lloyd-max",
      "rotated3-r128-lloyd-max", "kivi4-g32-r0", "kivi2-g32-r0", "rotated4-r0-uniform"]
  assert len({p.id for p in points}) == len(points)
  for arg in ("reduced", "smoke", "speed"):
    cfg = lowbit_config.get_config(arg)
    assert lowbit.LowbitFamily("/x").points(cfg, lowbit_config.get_sweep(arg))
  assert [p.label for p in lowbit.LowbitFamily("/x").points(
      lowbit_config.get_config("speed"), lowbit_config.get_sweep("speed"))] == ["speed"]
  with pytest.raises(ValueError, match="config argument"):
    lowbit_config.get_config("huge")


@pytest.mark.parametrize("overrides,message", [
    ({"cache.kind": "kivi3"}, "cache.kind must be one of"),
    ({"cache.kind": "kivi4", "cache.residual": 5}, "residual"),
    ({"cache.kind": "rotated4", "cache.group_size": 4}, "not an option"),
    ({"cache.kind": "dense", "cache.residual": 32}, "apply to the low-bit kinds only"),
    ({"cache.kind": "speed", "speed.caches": ("dense",)}, "needs its dtype"),
    ({"cache.kind": "speed", "speed.caches": ("kivi5",)}, "kind must be one of"),
    ({"cache.kind": "speed", "speed.batch": 0}, "speed.batch"),
])
def test_bad_points_fail_before_any_work(overrides, message, tmp_path):
  with pytest.raises(ValueError, match=message):
    runner.run(lowbit_config.get_config("smoke"), str(tmp_path), [overrides])
  assert not os.path.exists(tmp_path / "results.jsonl")


@pytest.mark.slow  # ~30 s per point on 2 cores; the fast suite validates the configs above
def test_smoke_run_measures_bytes_quality_and_speed(tmp_path):
  result = runner.run(lowbit_config.get_config("smoke"), str(tmp_path),
                      lowbit_config.get_sweep("smoke"))
  assert result.complete and len(result.records) == 4
  by = {r["label"]: r for r in result.records}
  ref, k4 = by["dense-float32"], by["kivi4-g8-r16"]
  assert ref["bytes_vs_f32"] == 1.0 and k4["bytes_vs_f32"] < 0.5
  assert by["kivi2-g8-r0-prerope"]["bytes_vs_f32"] < k4["bytes_vs_f32"]
  assert by["rotated3-r8-lloyd-max"]["bytes_vs_f32"] < 0.5
  assert abs(k4["ppl"] / ref["ppl"] - 1) < 0.05
  for r in result.records:
    assert r["decode_tokens_per_s"] > 0 and len(r["greedy_tokens"]) == 8
  assert "| kivi4-g8-r16 |" in (tmp_path / "report.md").read_text()


def test_peer_step_is_validated_and_joins_the_table(tmp_path):
  cfg = lowbit_config.get_config("smoke")
  cfg.peers.run, cfg.peers.bits = True, (4, 3)
  with pytest.raises(ValueError, match=r"peers.bits must list 2 and / or 4"):
    lowbit.LowbitFamily("/x").points(cfg, lowbit_config.get_sweep("smoke"))
  ours = [{"label": "dense-float32", "reference": True, "cache_bytes_per_token": 100.0,
           "bytes_vs_f32": 1.0, "ppl": 5.0, "greedy_tokens": [1, 2, 3, 4],
           "passkey_accuracy": 1.0, "decode_tokens_per_s": 10.0}]
  peers = {"info": {}, "results": [{"name": "hf-quanto4-g64-r128", "cache_bytes_per_token": 20.0,
                                    "ppl": 5.5, "greedy_tokens": [1, 2, 0, 4],
                                    "decode_tokens_per_s": 2.0}]}
  assert lowbit.peer_rows(ours, peers) == [
      ["hf-quanto4-g64-r128", "20.0", "0.200x", "5.5000", "+10.00%", "0.750", "-", "2.0"]]
  # A peer that cannot run (here: an interpreter without the [peers] extra, or a missing
  # GGUF) is an error naming the module, not a silent row.
  with pytest.raises(RuntimeError, match="hf_quantized_cache failed"):
    lowbit.run_peer("python3", {"gguf": str(tmp_path / "none.gguf"), "ids": [1, 2],
                                "chunk": 1, "new_tokens": 2, "threads": 1, "caches": []})


@pytest.mark.slow  # ~1 min on 2 cores (three caches, each compiling its prefill and decode)
def test_speed_point_times_every_cache_interleaved(tmp_path):
  cfg = lowbit_config.get_config("smoke")
  cfg.speed.caches = ("dense:float32", "dense:int8", "kivi4")
  result = runner.run(cfg, str(tmp_path), [{"cache.kind": "speed"}])
  assert result.complete and len(result.records) == 1
  speed = result.records[0]["speed"]
  assert list(speed) == ["dense:float32", "dense:int8", "kivi4"]
  assert speed["dense:float32"]["tokens_per_s_vs_f32"] == 1.0
  assert speed["dense:int8"]["tokens_per_s_vs_int8"] == 1.0
  for row in speed.values():
    assert row["decode_tokens_per_s"] > 0 and len(row["step_ms_rounds"]) == 1
    assert len(row["tokens"][0]) == 2 * 2 + 1  # the first token, then (repeats + 1) * steps
  # (At this capacity KIVI's residual of 128 holds every token: no store to shrink.)
  assert speed["dense:int8"]["cache_bytes_per_token"] < speed["dense:float32"][
      "cache_bytes_per_token"]
  assert speed["dense:int8"]["greedy_agreement_vs_f32"] > 0.5
  assert "## Decode speed at batch 2, prompt 40" in (tmp_path / "report.md").read_text()
