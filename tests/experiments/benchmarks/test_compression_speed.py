"""experiments/benchmarks/compression_speed.py: its FLOP count, flags and full-config count."""

import pytest

from experiments.benchmarks import compression_speed as cs

DIMS = dict(d_model=4, mlp_dim=6, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=2,
            vocab_size=10)


def test_example_flops_counts_every_product_by_hand():
  # Per token and layer: q 4x4, k and v 4x2 each, o 4x4, gate/up/down 3 x 4x6 = 120 MACs;
  # 2 layers, 2 FLOPs per MAC: 480. Attention: 2 heads x 2 dims x 2 products x 2 FLOPs x 2
  # layers = 32 per (query, key).
  f = cs.example_flops(DIMS, context=3, question=2, new_tokens=3, kept=1)
  assert f["prefill_context"] == 3 * 480 + 32 * (1 + 2 + 3)
  assert f["prefill_question"] == 2 * 480 + 32 * ((1 + 1) + (1 + 2))
  assert f["lm_head"] == 2 * 4 * 10
  assert f["decode"] == 2 * (480 + 80) + 32 * ((1 + 2 + 1) + (1 + 2 + 2))
  assert f["total"] == f["prefill"] + f["decode"] == (
      f["prefill_context"] + f["prefill_question"] + f["lm_head"] + f["decode"])


def test_flags_parse_and_bad_entries_raise_naming_them():
  assert cs.parse_points("snapkv:0.5,none:0") == [("snapkv", 0.5), ("none", 0.0)]
  assert cs.parse_configs("float32:8,int8:1") == [("float32", 8), ("int8", 1)]
  for bad in ("snapkv", "snapkv:1.0", "none:0.5", "snapkv:0"):
    with pytest.raises(ValueError, match="policy:ratio"):
      cs.parse_points(bad)
  for bad in ("float16:4", "int8:0", "int8"):
    with pytest.raises(ValueError, match="param_dtype:batch"):
      cs.parse_configs(bad)


def test_full_config_points_follow_the_config():
  smoke = cs.full_config_points("smoke")  # the random model, knorm at 0.5 and 0.75, 2 seeds
  assert smoke == {"models": 1, "policies": 1, "ratios": 2, "points": 3,
                   "examples_per_point": 2, "batch": 2, "batches_run_per_point": 2}
  est = cs.estimate_full_config(10.0, 30.0, "smoke")
  assert est["total_s"] == 3 * 30.0 + 3 * 2 * 10.0


def test_press_names_map_back_to_kvpress():
  assert cs.press_of("sink") == "streaming_llm"
  assert cs.press_of("h2o") == "observed_attention"
  assert cs.press_of("snapkv+knorm") == "composed"
  assert cs.press_of("knorm") == "knorm" and cs.press_of("none") == "none"


def test_sweep_summary_sets_the_sweep_against_kvpress_of_the_same_round():
  peer = [{"kind": "kvpress", "round": 0, "policy": p, "ratio": 0.5, "wall_s": 6.0,
           "examples": 2, "scores": [1.0, 0.0]} for p in ("knorm", "snapkv")]
  sweep = {"kind": "sweep", "round": 0, "load": 1.0, "wall_s": 2.0, "record_s": 0.5,
           "example_points": 4, "example_points_per_s": 2.0,
           "points": [{"policy": "knorm", "ratio": 0.5, "scores": [1.0, 0.0]},
                      {"policy": "snapkv", "ratio": 0.5, "scores": [1.0, 1.0]}]}
  row = cs.summarize_sweep(peer + [sweep]).splitlines()[-1]
  # kvpress: 4 example-points in 12 s = 0.333/s; the sweep 2.0/s -> 6.00x; 3 of 4 scores equal.
  assert row == "| 0 | 1.0 | 2.0 (0.5) | 12.0 | 4 | 2.000 | 0.333 | 6.00 | 3 of 4 |"
  lonely = cs.summarize_sweep([sweep]).splitlines()[-1]
  assert lonely == "| 0 | 1.0 | 2.0 (0.5) | - | 4 | 2.000 | - | - | - |"
