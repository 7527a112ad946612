"""The pretrained head-grouping experiment: configs, validation before work, passkey, report."""

import json
import os

import pytest

from configs import cla_pretrained as cla_config
from configs import heads_sweep_pretrained as hp_config
from experiments.families import heads_pretrained as hp
from experiments.framework import runner


def test_configs_and_sweeps():
  full, smoke = hp_config.get_config(), hp_config.get_config("smoke")
  assert full.experiment.kind == smoke.experiment.kind == "heads_pretrained"
  assert full.source.name == "smollm2-135m-instruct" and smoke.source.name == "random"
  assert smoke.train.steps < hp_config.get_config("reduced").train.steps < full.train.steps
  assert full.passkey.context_len == 2048
  sweep = hp_config.get_sweep()
  regroup = sorted((s["convert.num_kv_heads"], s["convert.method"]) for s in sweep
                   if "convert.kind" not in s)
  assert regroup == [(1, "first"), (1, "mean"), (3, "mean"), (9, "mean")]
  assert sweep[0] == {"convert.num_kv_heads": 3, "convert.method": "mean"}  # as released first
  # MLA cache sizes per token and layer (C + R) bracket K = 1 (128) and reach K = 3 (384).
  sizes = sorted(s["convert.kv_lora_rank"] + full.convert.qk_rope_head_dim for s in sweep
                 if s.get("convert.kind") == "mla")
  assert sizes[0] < 2 * 1 * 64 < sizes[1] < 2 * 3 * 64 == sizes[2]
  with pytest.raises(ValueError, match="config argument must be one of"):
    hp_config.get_config("huge")


def test_smoke_points_are_validated_and_labelled():
  points = hp.HeadsPretrainedFamily("/nonexistent").points(
      hp_config.get_config("smoke"), hp_config.get_sweep("smoke"))
  assert [p.label for p in points] == ["K6-dup", "K1-mean", "MLA-C10-R6"]
  assert len({p.id for p in points}) == 3


def test_cla_config_points_per_source():
  """configs/cla_pretrained.py: per source the control (a copy) and CLA2 by mean and first."""
  sweep = cla_config.get_sweep()
  assert [(s["source.name"], s["convert.kind"], s["convert.method"]) for s in sweep] == [
      ("smollm2-135m-instruct", "cla", "mean"), ("gemma3-270m", "cla", "mean"),
      ("smollm2-135m-instruct", "regroup", "mean"), ("gemma3-270m", "regroup", "mean"),
      ("smollm2-135m-instruct", "cla", "first"), ("gemma3-270m", "cla", "first")]
  assert {s["source.name"] for s in sweep} == {"smollm2-135m-instruct", "gemma3-270m"}
  smoke = cla_config.get_config("smoke")
  points = hp.HeadsPretrainedFamily("/nonexistent").points(smoke, cla_config.get_sweep("smoke"))
  assert [p.label for p in points] == ["K3", "CLA2-mean"]
  assert hp.label({"kind": "cla", "cla_factor": 3, "method": "first"}, 3) == "CLA3-first"
  assert cla_config.get_config().train.steps == 30
  with pytest.raises(ValueError, match="config argument must be one of"):
    cla_config.get_config("reduced")


@pytest.mark.parametrize("overrides,message", [
    ({"convert.num_kv_heads": 2}, r"sweep\[0\] .*convert: num_kv_heads must be a multiple or a "
                                  r"divisor of the current number of KV heads 3"),
    ({"convert.kind": "mla", "convert.method": "joint", "convert.kv_lora_rank": 43},
     r"convert: kv_lora_rank must be at most the full rank .* = 42; got 43"),
    ({"convert.kind": "mla", "convert.method": "joint", "convert.qk_rope_head_dim": 24},
     r"convert: qk_rope_head_dim / num_kv_heads .* must be below head_dim = 8"),
    ({"convert.kind": "gqa"}, r"convert.kind must be one of \('regroup', 'mla', 'cla'\)"),
    ({"convert.kind": "cla", "convert.cla_factor": 0},
     r"sweep\[0\] .*convert: cla_factor must be a positive int; got 0"),
    ({"passkey.samples": 0}, r"passkey.samples must be an int >= 1; got 0"),
    ({"convert.nope": 1}, "convert.nope is not a known key"),
])
def test_bad_points_fail_before_any_work(overrides, message, tmp_path):
  with pytest.raises(ValueError, match=message):
    runner.run(hp_config.get_config("smoke"), str(tmp_path), [overrides])
  assert not os.path.exists(tmp_path / "results.jsonl")


def _record(label, kind, nbytes, before, after):
  return {"label": label, "convert_kind": kind, "source": "toy", "cache_bytes_per_token": nbytes,
          "cache_bytes_per_token_analytic": nbytes, "source_cache_bytes_per_token": 384,
          "point_cpu_seconds": 12.4, "point_wall_seconds": 30.0, "load_avg_1min": 2.0,
          "perplexity_converted": before,
          "perplexity_uptrained": after, "passkey_converted": 0.5, "passkey_uptrained": 1.0,
          "decode_tokens_per_s": 100.0, "eval_tokens": 1024,
          "environment": {"device_kind": "cpu", "cpu_count": 2},
          "config": hp_config.get_config("smoke").to_dict()}


def test_report_table_and_plot(tmp_path):
  records = [_record("K3", "regroup", 384, 10.0, 9.0), _record("MLA-C10-R6", "mla", 128, 30.0,
                                                                 12.5)]
  md = hp.write_report(str(tmp_path), records, title="t")
  assert ("| MLA-C10-R6 | 128 | 128 | 0.333 | 30.00 | 12.50 | 0.417 | 0.50 | 1.00 | 100.0 | 12 "
          "| 30 |") in md
  assert "2 points: 25 process CPU-seconds, 60 s wall, 1-min load 2.0-2.0" in md
  assert md.index("MLA-C10-R6") < md.index("| K3 ")  # sorted by cache bytes
  assert (tmp_path / "quality_vs_cache.png").stat().st_size > 1000


@pytest.mark.slow
def test_smoke_run_end_to_end(tmp_path):
  result = runner.run(hp_config.get_config("smoke"), str(tmp_path), hp_config.get_sweep("smoke"))
  assert len(result.records) == 3
  lines = [json.loads(l) for l in (tmp_path / "results.jsonl").read_text().splitlines()]
  for r in lines:
    assert r["cache_bytes_per_token"] == r["cache_bytes_per_token_analytic"]
    assert r["perplexity_uptrained"] > 0 and 0 <= r["passkey_converted"] <= 1
  assert (tmp_path / "report.md").exists() and (tmp_path / "quality_vs_cache.png").exists()
