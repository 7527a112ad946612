"""The quantized-cache experiment: configs, validation before work, a measured run, resume."""

import json
import os

import numpy as np
import pytest

from configs import quant_sweep
from experiments.families import quant as qe
from experiments.framework import runner
from experiments.families import variants as variants_experiment
from kvattn.training import data as data_lib
from kvattn import memory


def _smoke(**overrides):
  cfg = quant_sweep.get_config("smoke")
  cfg.decode.warmup = 0  # the one timed run compiles: fine for a test, not for a figure
  cfg.decode.repeats = cfg.decode.decode_repeats = 1
  cfg.update_from_flattened_dict(overrides)
  return cfg


def test_configs_and_sweep():
  full, smoke = quant_sweep.get_config(), quant_sweep.get_config("smoke")
  assert full.experiment.kind == smoke.experiment.kind == "quant"
  sweep = quant_sweep.get_sweep()
  assert len(sweep) == 16
  assert [s["cache.dtype"] for s in sweep[:4]] == ["bfloat16", "int8", "float8_e4m3fn",
                                                    "float8_e5m2"]
  assert {s.get("model.attention.num_kv_heads") for s in sweep} == {8, 2, 1, None}
  with pytest.raises(ValueError, match="config argument must be one of"):
    quant_sweep.get_config("huge")
  # Every point of the full sweep validates before any work, with the dtype in its label.
  points = qe.QuantFamily("/nonexistent").points(full, sweep)
  assert [p.label for p in points[:4]] == ["MHA-K8-bf16", "MHA-K8-int8", "MHA-K8-fp8-e4m3",
                                           "MHA-K8-fp8-e5m2"]
  assert points[-1].label == "MLA-fp8-e5m2"
  assert len({p.id for p in points}) == 16
  assert len({p.group for p in points}) == 4  # one training per variant
  # The trainings are the main job's (same hash), so its train dir can be shared.
  from configs import toy as default  # pylint: disable=g-import-not-at-top
  main = variants_experiment.VariantsFamily("/nonexistent").points(default.get_config(),
                                                                   default.get_sweep())
  assert {p.group for p in points} <= {p.group for p in main}


@pytest.mark.parametrize("overrides,message", [
    ({"cache.dtype": "int16"}, r"sweep\[0\] .*cache.dtype must name a floating dtype, a "
                               r"quantized KV format"),
    ({"quality.prefix": 32}, r"quality.prefix must be < data.seq_len = 32"),
    ({"quality.nope": 1}, "quality.nope is not a known key"),
    ({"cache.seq_lens": (16, 32)}, "cache.seq_lens must hold one S"),
    ({"quality.rows": 10**6}, "quality.rows must be at most the"),
])
def test_bad_points_fail_before_any_work(overrides, message, tmp_path):
  with pytest.raises(ValueError, match=message):
    runner.run(_smoke(), str(tmp_path), [overrides])
  assert not os.path.exists(tmp_path / "results.jsonl")


@pytest.mark.parametrize("overrides,message", [
    ({"cache.dtype": "int8"}, r"config: cache\.dtype = 'int8' overrides the config file's "
                              r"'bfloat16', but the sweep of configs/quant_sweep\.py:smoke"),
    ({"cache.dtype": "int16"}, r"config: cache\.dtype must name a floating dtype"),
    ({"model.attention.decode_implementation": "pallas"},
     r"MHA-K8-bf16: model\.attention\.decode_implementation = 'pallas' cannot run"),
])
def test_command_line_overrides_fail_before_any_work(overrides, message, tmp_path):
  with pytest.raises(ValueError, match=message):
    runner.run(_smoke(**overrides), str(tmp_path / "run"), quant_sweep.get_sweep("smoke"),
               config_file="configs/quant_sweep.py:smoke")
  assert not os.path.exists(tmp_path / "run")


def test_agreement_and_bits_per_byte_by_hand():
  ref = np.array([[1, 2, 3, 4], [5, 6, 7, 8]])
  out = qe.agreement(np.array([[1, 2, 9, 4], [5, 6, 7, 8]]), ref)
  assert out["greedy_agreement"] == 7 / 8
  assert out["greedy_first_divergence"] == [2, 4] and out["greedy_first_divergence_mean"] == 3
  nll = np.full((1, 3), np.log(2.0))
  targets = np.array([[65, data_lib.EOS_ID, data_lib.PAD_ID]])
  # 2 bits over the two non-PAD targets, one of which is a byte.
  assert qe.bits_per_byte(nll, targets) == pytest.approx(2.0)


@pytest.mark.slow  # trains; the runner's resume is tested without training in test_runner.py
def test_run_measures_bytes_speed_quality_and_resumes(tmp_path):
  cfg = _smoke()
  sweep = [{"model.attention.kind": "gqa", "model.attention.num_kv_heads": 1, "cache.dtype": d}
           for d in ("bfloat16", "int8")]
  result = runner.run(cfg, str(tmp_path), sweep)
  assert result.complete and len(result.measured) == 2
  for name in ("results.jsonl", "results.csv", "report.md", "config.json", qe.FILES["plot"]):
    assert os.path.getsize(tmp_path / name) > 0, name
  bf16, int8 = result.records
  layers, h = cfg.model.num_layers, cfg.model.attention.head_dim
  # Bytes from the arrays == analytic; int8 values are 1 byte plus a 4-byte scale per head.
  assert bf16["cache_bytes_per_token"] == layers * 2 * 1 * h * 2
  assert int8["cache_bytes_per_token"] == layers * 2 * 1 * (h + 4)
  assert int8["cache_bytes_per_token"] == int8["cache_bytes_per_token_analytic"]
  assert int8["scale_bytes_per_token"] == layers * 2 * 4
  assert memory.gqa_bytes_per_token(1, h, "int8") * layers == int8["cache_bytes_per_token"]
  assert bf16["decode_tokens_per_s"] > 0 and int8["decode_tokens_per_s"] > 0
  # The bf16 point agrees with itself; int8 (the same trained model) agrees for a while.
  assert bf16["greedy_agreement"] == 1.0
  assert bf16["greedy_first_divergence_mean"] == cfg.quality.agreement_tokens
  assert 0.0 <= int8["greedy_agreement"] <= 1.0
  # Quality through the cache stays next to the no-cache figure of the same rows.
  for r in (bf16, int8):
    assert np.isfinite(r["teacher_forced_bits_per_byte"])
    assert abs(r["teacher_forced_bits_per_byte"] - r["no_cache_bits_per_byte"]) < 0.02
  assert int8["no_cache_bits_per_byte"] == bf16["no_cache_bits_per_byte"]
  report = (tmp_path / "report.md").read_text()
  assert "| MQA | 1 | int8 |" in report and "Δ vs bf16" in report
  # Rerun: nothing new is measured, each point is recorded once.
  again = runner.run(cfg, str(tmp_path), sweep)
  assert again.measured == [] and again.complete
  lines = (tmp_path / "results.jsonl").read_text().splitlines()
  assert sorted(json.loads(l)["point"] for l in lines) == sorted(r["point"] for r in result.records)
