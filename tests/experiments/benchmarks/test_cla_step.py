"""experiments.benchmarks.cla_step: the sharing layer's dropped write leaves the compiled step."""

import json
import os
import subprocess
import sys

import pytest

from tests.experiments import subproc

_MEASURE = """
import json
from experiments.benchmarks import cla_step
print(json.dumps([cla_step.measure("ring-layout", f, batch=2, length=128, window=16, tokens=1)
                  for f in (None, 2)]))
"""


@pytest.mark.slow  # two compiles with XLA's optimizations on; the numbers: docs/benchmarks.md
def test_sharing_halves_the_writes_of_a_compiled_decode_step():
  # In a process compiled as users compile (the suite's conftest turns optimizations and the
  # fusion emitters off; the emitters' absence expands scatters into loops): CSE is what merges
  # the writes.
  env = dict(os.environ, JAX_DISABLE_MOST_OPTIMIZATIONS="0", JAX_PLATFORMS="cpu",
             PYTHONPATH=f"{subproc.ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
  env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split()
                              if "xla_cpu_use_fusion_emitters" not in f)
  proc = subprocess.run([sys.executable, "-c", _MEASURE], cwd=subproc.ROOT, env=env,
                        capture_output=True, text=True, timeout=600, check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  plain, shared = json.loads(proc.stdout.strip().splitlines()[-1])
  assert shared["cache_mib"] * 2 == pytest.approx(plain["cache_mib"])
  # Without sharing each of the 4 caches writes; with it, only the 2 owners' writes remain
  # (the sharing layers' recomputed writes are the owners', merged).
  assert plain["scatters"] > 0 and shared["scatters"] * 2 == plain["scatters"]
  assert shared["temp_mib"] <= 1.05 * plain["temp_mib"]  # no second copy of a ring
