"""The paged-cache experiment: configs, validation before work, a measured run, resume."""

import json
import os

import numpy as np
import pytest

from configs import paged as paged_config
from experiments.families import paged as pe
from experiments.framework import runner


def _smoke(**overrides):
  cfg = paged_config.get_config("smoke")
  cfg.decode.warmup = 0  # the one timed run compiles: fine for a test, not for a figure
  cfg.update_from_flattened_dict(overrides)
  return cfg


def test_configs_and_sweep():
  full, smoke = paged_config.get_config(), paged_config.get_config("smoke")
  assert full.experiment.kind == smoke.experiment.kind == "paged"
  assert smoke.cache.max_len < full.cache.max_len
  sweep = paged_config.get_sweep("smoke")
  assert sweep[0] == {"cache.kind": "dense"}
  assert [s["cache.page_size"] for s in sweep[1:]] == [8, 16, 32, 64, 128]
  with pytest.raises(ValueError, match="config argument must be one of"):
    paged_config.get_config("huge")
  # The full sweep validates (every point, before any work).
  points = pe.PagedFamily("/nonexistent").points(full, paged_config.get_sweep())
  assert [p.label for p in points] == ["dense"] + [f"paged-P{p}" for p in (8, 16, 32, 64, 128)]
  assert len({p.id for p in points}) == 6


@pytest.mark.parametrize("overrides,message", [
    ({"cache.kind": "ring"}, r"sweep\[0\] .*cache.kind must be one of \('dense', 'paged'\)"),
    ({"model.attention.kind": "mla"}, "model.attention.kind must be 'gqa'"),
    ({"cache.page_size": 0}, "cache.page_size must be an int >= 1; got 0"),
    ({"workload.min_len": 2}, "workload.min_len must be an int >= 4"),
    ({"cache.nope": 1}, "cache.nope is not a known key"),
])
def test_bad_points_fail_before_any_work(overrides, message, tmp_path):
  with pytest.raises(ValueError, match=message):
    runner.run(_smoke(), str(tmp_path), [overrides])
  assert not os.path.exists(tmp_path / "results.jsonl")


@pytest.mark.parametrize("overrides,message", [
    ({"cache.page_size": 32}, r"config: cache\.page_size = 32 overrides the config file's 16, but "
                              r"the sweep of configs/paged\.py:smoke sets cache\.page_size"),
    ({"cache.kind": "paged"}, r"config: cache\.kind = 'paged' overrides"),
    ({"model.attention.num_kv_heads": 3}, r"config: model\.attention\.num_kv_heads must divide"),
    # The dense kernel pads H = 8 to 16; the paged kernel still declines H = 8.
    ({"model.attention.decode_implementation": "pallas"},
     r"paged-P8 \(paged cache\): model\.attention\.decode_implementation = 'pallas' cannot "
     r"run this point's decode step .*NotImplementedError: pallas: head dim H=8"),
])
def test_command_line_overrides_fail_before_any_work(overrides, message, tmp_path):
  # As `--config=configs/paged.py:smoke --config.<key>=<value>` would: the config as given is
  # validated, an override the sweep would discard fails, and so does a decode backend that
  # cannot run a point (traced abstractly before any work).
  with pytest.raises(ValueError, match=message):
    runner.run(_smoke(**overrides), str(tmp_path / "run"), paged_config.get_sweep("smoke"),
               config_file="configs/paged.py:smoke")
  assert not os.path.exists(tmp_path / "run")


def test_run_measures_waste_and_resumes(tmp_path):
  cfg = _smoke()
  sweep = [{"cache.kind": "dense"}, {"cache.kind": "paged", "cache.page_size": 8}]
  result = runner.run(cfg, str(tmp_path), sweep)
  assert result.complete and len(result.measured) == 2
  for name in ("results.jsonl", "results.csv", "report.md", "config.json", *pe.FILES.values()):
    assert os.path.getsize(tmp_path / name) > 0, name
  dense, paged = result.records
  final = np.asarray(dense["final_lengths"])
  assert paged["final_lengths"] == dense["final_lengths"]  # one workload for every point
  assert final.max() > 2 * np.median(final)  # long-tailed
  batch, max_len, bpt = cfg.workload.num_sequences, cfg.cache.max_len, dense["bytes_per_token"]
  # Bytes read from the arrays agree with the arithmetic of each layout.
  assert dense["bytes_reserved"] == batch * max_len * bpt
  assert paged["bytes_reserved"] == int(np.sum(-(-final // 8) * 8)) * bpt
  assert dense["bytes_used"] == paged["bytes_used"] == int(final.sum()) * bpt
  assert dense["waste_fraction"] == pytest.approx(1 - final.sum() / (batch * max_len))
  assert paged["waste_fraction"] == pytest.approx(paged["internal_waste_fraction"])
  assert paged["waste_fraction"] < 8 * batch / final.sum()  # < one page per sequence
  assert paged["waste_fraction"] < dense["waste_fraction"]
  assert paged["sequences_at_dense_budget"] > dense["sequences_at_dense_budget"] == batch
  assert paged["decode_tokens_per_s"] > 0 and dense["decode_tokens_per_s"] > 0
  # The paged point timed the dense cache alternately with itself: its ratio is from those runs.
  assert paged["speed_vs_dense"] == pytest.approx(  # one timed pair in the smoke run
      paged["decode_tokens_per_s"] / paged["dense_decode_tokens_per_s_interleaved"])
  assert dense["speed_vs_dense"] == 1.0
  waste = json.loads((tmp_path / "waste.json").read_text())
  assert waste["paper"]["contiguous_waste"] == [0.6, 0.8]
  assert waste["dense"]["waste_fraction"] == pytest.approx(dense["waste_fraction"])
  assert [p["page_size"] for p in waste["paged"]] == [8]
  report = (tmp_path / "report.md").read_text()
  assert "Waste: measured vs the PagedAttention paper" in report and "60.0%-80.0%" in report
  # A rerun skips the finished points and appends nothing.
  lines = (tmp_path / "results.jsonl").read_text().splitlines()
  again = runner.run(cfg, str(tmp_path), sweep)
  assert again.measured == [] and again.complete
  assert (tmp_path / "results.jsonl").read_text().splitlines() == lines
