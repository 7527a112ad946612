"""The long-context experiment: configs, validation before work, a measured run on a tiny model."""

import json
import os

import pytest

from configs import long_context as lc_config
from experiments.families import long_context as lce
from experiments.framework import runner


def _tiny(**overrides):
  cfg = lc_config.get_config("smoke")
  cfg.update_from_flattened_dict({
      "model.name": "random-tiny", "text.num_tokens": 40, "text.chunk": 8, "text.bins": 2,
      "passkey.contexts": (48,), "passkey.depths": (0.0, 1.0), "passkey.new_tokens": 3,
      "speed.steps": 2, "speed.repeats": 2, "speed.kinds": ("ring", "tova"),
      "speed.budgets": (8,), **overrides})
  return cfg


def test_configs_and_sweeps_validate():
  full, smoke = lc_config.get_config(), lc_config.get_config("smoke")
  assert full.experiment.kind == smoke.experiment.kind == "long_context"
  assert full.text.num_tokens > smoke.text.num_tokens
  points = lce.LongContextFamily("/nonexistent").points(full, lc_config.get_sweep())
  assert len(points) == 2 + 3 * 8 and len({p.id for p in points}) == len(points)
  assert [p.label for p in points[:3]] == ["dense", "speed", "ring-256"]
  with pytest.raises(ValueError, match="config argument"):
    lc_config.get_config("huge")


@pytest.mark.parametrize("overrides,message", [
    ({"cache.kind": "lru"}, "cache.kind must be one of"),
    ({"cache.kind": "sink", "cache.budget": 4}, "cache.budget must be >= cache.num_sinks"),
    ({"text.chunk": 0}, "text.chunk must be an int >= 1"),
    ({"cache.kind": "speed", "speed.kinds": ("dense",)}, "speed.kinds must hold kinds of"),
    ({"speed.repeats": 0}, "speed.repeats must be an int >= 1"),
])
def test_bad_points_fail_before_any_work(overrides, message, tmp_path):
  with pytest.raises(ValueError, match=message):
    runner.run(_tiny(), str(tmp_path), [overrides])
  assert not os.path.exists(tmp_path / "results.jsonl")


def test_policy_dicts():
  assert lce.policy_dict({"kind": "sink", "budget": 256, "num_sinks": 4}) == {
      "kind": "sink", "num_sinks": 4, "window": 252}
  assert lce.policy_dict({"kind": "ring", "budget": 8, "num_sinks": 4}) == {
      "kind": "ring", "window": 8}
  assert lce.policy_dict({"kind": "tova", "budget": 8, "num_sinks": 4}) == {
      "kind": "tova", "budget": 8}


def test_tiny_run_measures_reports_and_bounded_caches_with_room_equal_the_full_cache(tmp_path):
  sweep = [{"cache.kind": "dense"}, {"cache.kind": "h2o", "cache.budget": 64},
           {"cache.kind": "ring", "cache.budget": 8},
           {"cache.kind": "tova", "cache.budget": 8}, {"cache.kind": "speed"}]
  result = runner.run(_tiny(), str(tmp_path), sweep)
  assert result.complete and len(result.records) == 5
  by = {r["label"]: r for r in result.records}
  speed = by.pop("speed")["speed"]
  assert set(speed) == {"dense", "ring-8", "tova-8"}
  assert speed["ring-8"]["step_vs_ring"] == 1.0 and speed["dense"]["step_vs_ring"] is None
  assert speed["tova-8"]["context"] == 8 + 8 and speed["dense"]["context"] == 40
  for v in speed.values():
    assert v["tokens_per_s"] > 0 and v["tokens_per_s_vs_full"] > 0
  full = by["dense"]
  # Room for all 40 + 3 tokens: the same perplexity as the full cache.
  assert by["h2o-64"]["ppl"] == pytest.approx(full["ppl"], rel=1e-5)
  assert by["ring-8"]["ppl"] != pytest.approx(full["ppl"], rel=1e-5)
  # Memory is the budget: 2 layers x 8 slots x 2 (k, v) x 2 KV heads x 8 dims x 4 bytes.
  assert by["ring-8"]["cache_bytes_per_seq"] == 2 * 8 * 2 * 2 * 8 * 4
  assert by["tova-8"]["cache_bytes_per_seq"] == by["ring-8"]["cache_bytes_per_seq"]
  assert by["tova-8"]["bookkeeping_bytes_per_seq"] > by["ring-8"]["bookkeeping_bytes_per_seq"]
  for r in by.values():
    assert len(r["ppl_bins"]) == 2 and r["chunk"] == 8
    assert set(r["passkey_correct"]) == {"48"} and len(r["passkey_correct"]["48"]) == 2
    assert r["cpu_seconds"] > 0
  report = (tmp_path / "report.md").read_text()
  assert "## Published claims" in report and "StreamingLLM" not in report  # no window-vs-sink pair
  assert "kvpress" in report and "chunk length 8" in report and "## Decode speed" in report
  for name in ("ppl_vs_position.png", "passkey_h2o.png", "passkey_tova.png"):
    assert (tmp_path / name).stat().st_size > 0
  lines = (tmp_path / "results.jsonl").read_text().splitlines()
  assert len(lines) == 5 and json.loads(lines[0])["family"] == "long_context"


@pytest.mark.slow  # twins in the fast suite: test_scan.py (mixed layers), test_per_layer_layout.py
def test_windowed_layers_scan_in_groups_and_the_per_layer_layout_is_exact(tmp_path):
  # A model with Gemma's pattern (layers 0, 2: window 8; 1, 3: global): the family scans it
  # in groups of 2 layers, reports where the windows bound the cache, and the per-layer
  # layout (rings of 8 for the local layers) scores as the full allocation does.
  cfg = _tiny(**{"model.name": "random-tiny-local"})
  sweep = [{"cache.kind": "dense"}, {"cache.kind": "dense", "cache.local_layers": "ring"}]
  result = runner.run(cfg, str(tmp_path), sweep)
  by = {r["label"]: r for r in result.records}
  assert set(by) == {"dense", "dense+ring"}
  full, ring = by["dense"], by["dense+ring"]
  assert full["windowed_layers"] == [0, 2] and full["windows"] == [8]
  assert ring["ppl"] == pytest.approx(full["ppl"], rel=1e-5)
  assert ring["passkey_correct"] == full["passkey_correct"]
  # Bytes: 2 global layers x capacity 48 + 2 rings x 8 slots, x 2 (k, v) x 2 heads x 8 x 4 B.
  slot = 2 * 2 * 8 * 4
  assert full["cache_bytes_per_seq"] == 4 * full["capacity"] * slot
  assert ring["cache_bytes_per_seq"] == (2 * full["capacity"] + 2 * 8) * slot
  assert full["per_layer_layout_bytes_per_seq"] == ring["cache_bytes_per_seq"]
  report = (tmp_path / "report.md").read_text()
  assert "## Where the windowed layers already bound the cache" in report
  assert "dense all: perplexity full layout" in report
  with pytest.raises(ValueError, match="cache.local_layers must be one of"):
    runner.run(cfg, str(tmp_path / "bad"), [{"cache.local_layers": "rings"}])


def test_gemma3_configs_validate():
  for arg, tokens in (("gemma3", 8192), ("gemma3-16k", 16384)):
    cfg = lc_config.get_config(arg)
    assert cfg.model.name == "gemma3-270m" and cfg.text.num_tokens == tokens
    points = lce.LongContextFamily("/nonexistent").points(cfg, lc_config.get_sweep(arg))
    assert [p.label for p in points] == ["dense+ring", "dense", "sink-1024+ring",
                                         "h2o-1024+ring"]
