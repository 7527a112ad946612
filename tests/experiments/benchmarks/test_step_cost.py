"""experiments.benchmarks.step_cost (the regression, the thunk grouping, one real run) and xla_cpu_dots."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from experiments.benchmarks import step_cost
from tests.experiments import subproc

_HLO = """\
HloModule jit__decode
%fused_computation.1 (p: f32[4]) -> f32[4] {
  ROOT %x = f32[4]{0} exponential(f32[4]{0} %p)
}
ENTRY %main {
  %ynn_fusion.3 = s32[960,2]{1,0} fusion(%a, %b), kind=kCustom, calls=%c, metadata={op_name="jit(_decode)/while/body/kvattn_u8s8_dot" stack_frame_id=1}
  %ynn_fusion.4 = s32[960,2]{1,0} fusion(%a, %b), kind=kCustom, calls=%c, metadata={op_name="jit(_decode)/while/body/kvattn_u8s8_dot" stack_frame_id=1}
  %cond.7 = (f32[1]{0}) conditional(%i, %t), branch_computations={%r}
  ROOT %exp_fusion = f32[1,3,3,96]{3,2,1,0} fusion(%s), kind=kLoop, calls=%fused_computation.1, metadata={op_name="jit(_decode)/while/body/cond/branch_2_fun/exp"}
}
"""


def test_fit_line_recovers_slope_and_intercept():
  per_layer, fixed = step_cost.fit_line([1, 15, 30], [3.0 + 0.5 * n for n in (1, 15, 30)])
  assert per_layer == pytest.approx(0.5) and fixed == pytest.approx(3.0)
  with pytest.raises(ValueError, match="two distinct layer counts"):
    step_cost.fit_line([4, 4], [1.0, 2.0])


def test_parse_ints_names_the_flag():
  assert step_cost.parse_ints("layers", "1,15,30") == [1, 15, 30]
  for bad in ("", "a", "0,4", "-1"):
    with pytest.raises(ValueError, match="--layers"):
      step_cost.parse_ints("layers", bad)


def test_thunks_are_grouped_by_kind_shape_and_op(tmp_path):
  path = tmp_path / "hlo.txt"
  path.write_text(_HLO)
  info = step_cost._hlo_instructions(str(path))  # pylint: disable=protected-access
  assert info["ynn_fusion.3"] == ("s32[960,2]{1,0}", "fusion",
                                  "jit(_decode)/while/body/kvattn_u8s8_dot")
  events = ([{"ph": "X", "name": "ynn_fusion.3", "dur": 30.0},
             {"ph": "X", "name": "ynn_fusion.4", "dur": 50.0},
             {"ph": "X", "name": "exp_fusion.clone", "dur": 4.0},
             {"ph": "X", "name": "cond.7", "dur": 500.0},  # control: its body is counted
             {"ph": "X", "name": "$python frame", "dur": 900.0},  # not a thunk
             {"ph": "i", "name": "ynn_fusion.3"}] * 2)
  out = step_cost.group_thunks(events, info, steps=2)
  assert out["thunks_per_step"] == 3 and out["thunk_us_per_step"] == pytest.approx(84.0)
  assert out["small_thunk_us_per_step"] == pytest.approx(4.0)
  first, second = out["rows"]
  assert first["op"] == "ynn_fusion s32[960,2] kvattn_u8s8_dot"
  assert first["us_per_step"] == pytest.approx(80.0) and first["per_step"] == 2
  assert second["op"] == "exp_fusion f32[1,3,3,96] cond/branch/exp"
  assert sum(r["share"] for r in out["rows"]) == pytest.approx(1.0)


@pytest.mark.slow  # a whole benchmark run; the fast suite checks its parts above
def test_a_run_on_the_tiny_model_fits_its_points_and_names_the_step_ops():
  """The whole benchmark, breakdown child included, on the 2-layer random model: every
  point is timed, the fit has the bytes of one layer, and the breakdown finds the decode
  loop's thunks (its attention exp among them)."""
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             PYTHONPATH=f"{subproc.ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
  cmd = [sys.executable, "-m", "experiments.benchmarks.step_cost", "--model=random-tiny",
         "--param_dtype=float32", "--cache=int8", "--layers=1,2", "--contexts=3,20",
         "--steps=2", "--repeats=2", "--bandwidth_mib=8", "--breakdown_layers=1", "--top=1000"]
  proc = subprocess.run(cmd, cwd=subproc.ROOT, env=env, capture_output=True, text=True,
                        timeout=600, check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  records = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
  points = [r for r in records if r["record"] == "point"]
  assert {(r["layers"], r["context"]) for r in points} == {(1, 3), (1, 20), (2, 3), (2, 20)}
  assert all(r["step_ms"] > 0 for r in points)
  fits = [r for r in records if r["record"] == "fit"]
  assert [r["context"] for r in fits] == [3, 20]
  for r in fits:
    assert r["layer_param_bytes"] > 0 and r["read_bandwidth_gb_s"] > 0
    # int8 K and V with an f32 scale each per token and KV head
    assert r["layer_cache_bytes_per_token"] > 0
    assert r["roofline_fraction"] == pytest.approx(r["layer_read_ms"] / r["per_layer_ms"])
  (brk,) = [r for r in records if r["record"] == "breakdown"]
  assert brk["layers"] == 1 and brk["thunks_per_step"] > 10
  assert np.isclose(sum(r["share"] for r in brk["rows"]), 1.0, atol=0.02)
  assert any("exp" in r["op"] for r in brk["rows"])
  assert "| per layer ms |" in proc.stdout


def test_xla_cpu_dots_times_every_form_and_checks_its_flags():
  from experiments.benchmarks import xla_cpu_dots  # pylint: disable=g-import-not-at-top
  rows = xla_cpu_dots.run(["--shapes=32x16", "--chain=2", "--context=8", "--bandwidth_mib=4"])
  assert [r["form"] for r in rows] == [
      "f32 x[1,K]@W[K,N]", "bf16 x[2,K]@W[K,N]", "u8s8 W[N,K].x[2,K]^T", "s8s8 x[2,K].W[K,N]",
      "attention f32 cache", "attention int8 cache, to f32", "attention int8 cache, s8 logits",
      "attention bf16 cache, to f32", "attention bf16 cache, bf16 dots",
      "attention 4-bit cache, to f32", "attention 4-bit cache, fused reduce"]
  assert all(r["us"] > 0 and r["gb_s"] > 0 and r["of_sum"] > 0 for r in rows)
  for bad in (["--shapes=32"], ["--shapes=0x4"], ["--chain=0"]):
    with pytest.raises(ValueError, match="--"):
      xla_cpu_dots.run(bad)
