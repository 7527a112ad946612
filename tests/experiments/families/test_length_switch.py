"""The length-switch experiment: configs, validation before work, a measured run on a tiny model."""

import json
import os

import pytest

from configs import length_switch as ls_config
from experiments.families import length_switch as lse
from experiments.framework import runner
from experiments.evals import models


def _tiny(**overrides):
  cfg = ls_config.get_config("smoke")
  cfg.update_from_flattened_dict({
      "model.name": "random-tiny", "text.context": 256, "text.chunk": 32,
      "passkey.depths": (0.5,), "passkey.new_tokens": 2, "decode.steps": 2, **overrides})
  return cfg


def test_configs_and_sweeps_validate():
  full, smoke = ls_config.get_config(), ls_config.get_config("smoke")
  assert full.experiment.kind == smoke.experiment.kind == "length_switch"
  points = lse.LengthSwitchFamily("/nonexistent").points(full, ls_config.get_sweep())
  assert [p.label for p in points] == [
      "ctx1024-never", "ctx1024-switch256", "ctx1024-switch1024",
      "ctx4096-never", "ctx4096-switch256", "ctx4096-switch1024"]
  assert len({p.id for p in points}) == 6
  assert points[1].params == {"context": 1024, "switch_length": 256, "num_kv_heads_after": 1}
  assert len(lse.LengthSwitchFamily("/x").points(smoke, ls_config.get_sweep("smoke"))) == 2
  with pytest.raises(ValueError, match="config argument"):
    ls_config.get_config("huge")


@pytest.mark.parametrize("overrides,message", [
    ({"cache.kind": "ring"}, "cache.kind must be one of"),
    ({"cache.kind": "length_switch", "cache.switch_length": 0},
     "cache.switch_length must be an int >= 1"),
    ({"text.chunk": 512}, "text.chunk must be <= text.context"),
])
def test_bad_points_fail_before_any_work(overrides, message, tmp_path):
  with pytest.raises(ValueError, match=message):
    runner.run(_tiny(), str(tmp_path), [overrides])
  assert not os.path.exists(tmp_path / "results.jsonl")


@pytest.mark.parametrize("never", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_tiny_run_measures_ratios_and_reports_the_claim(tmp_path, never):
  sweep = [{"cache.kind": "dense"}, {"cache.kind": "length_switch", "cache.switch_length": 16}]
  if never:  # 512 >= the capacity (9 chunks of 32 + 3): no switch, the dense perplexity
    sweep.append({"cache.kind": "length_switch", "cache.switch_length": 512})
  result = runner.run(_tiny(), str(tmp_path), sweep)
  assert result.complete and len(result.records) == len(sweep)
  by = {r["label"]: r for r in result.records}
  dense, switched = by["ctx256-never"], by["ctx256-switch16"]
  if never:
    assert by["ctx256-switch512"]["ppl"] == pytest.approx(dense["ppl"], rel=1e-5)
    assert not by["ctx256-switch512"]["switched_at_decode"]
  assert switched["ppl"] != pytest.approx(dense["ppl"], rel=1e-3)
  assert switched["switched_at_decode"]
  # Bytes: 2 layers x (K=2 heads x 16 slots + 1 pooled head x 51 slots) x 2 (k, v) x 8 x 4 B.
  cap = dense["capacity"]
  assert cap == 293  # 9 chunks of 32, plus room for two rounds of 2 decode steps and one
  assert dense["cache_bytes_per_seq"] == 2 * 2 * cap * 2 * 8 * 4
  assert switched["cache_bytes_per_seq"] == 2 * (2 * 16 + 1 * cap) * 2 * 8 * 4
  assert switched["cache_bytes_read_per_step"] == 2 * 1 * cap * 2 * 8 * 4
  assert lse.bound(switched, dense["cache_bytes_read_per_step"]) > 1
  for r in result.records:
    assert r["decode_tokens_per_s"] > 0 and len(r["passkey_correct"]) == 1
  # The switch point's interleaved timing: its own, the unswitched and the MHA cache's.
  assert "speedup_vs_mha" not in dense
  walls = switched["interleaved_wall_s_per_step"]
  assert set(walls) == {"mha", "dense", "length_switch"}
  assert switched["speedup_vs_mha"] == pytest.approx(walls["mha"] / walls["length_switch"])
  assert switched["speedup_vs_dense"] == pytest.approx(walls["dense"] / walls["length_switch"])
  report = (tmp_path / "report.md").read_text()
  assert "## The source's claim" in report and "1.8x faster than MHA" in report
  assert "context 256, switch at 16: decode" in report and "x an MHA cache" in report
  assert "| speedup | vs MHA |" in report
  assert (tmp_path / "speed.png").stat().st_size > 0
  lines = (tmp_path / "results.jsonl").read_text().splitlines()
  assert len(lines) == len(sweep) and json.loads(lines[0])["family"] == "length_switch"


def test_decode_speed_rows():
  model, _ = models.load_model("random-tiny", "float32")
  rows = lse.decode_speed(model, [24], switch_length=8, steps=1, repeats=2)
  assert [(r["context"], r["cache"]) for r in rows] == [
      (24, "mha"), (24, "dense"), (24, "length_switch")]
  heads = model.layers[0].attn
  assert [r["num_kv_heads"] for r in rows] == [heads.num_heads, heads.num_kv_heads, 1]
  for r in rows:
    assert len(r["wall_rounds"]) == 2 and r["wall_s_per_step"] > 0 and r["cpu_s_per_step"] >= 0
    assert min(r["wall_rounds"]) <= r["wall_s_per_step"] <= max(r["wall_rounds"])
  with pytest.raises(ValueError, match="kinds must be"):
    lse.decode_speed(model, [24], kinds=("ring",))
  with pytest.raises(ValueError, match="repeats must be an int >= 1"):
    lse.decode_speed(model, [24], repeats=0)
