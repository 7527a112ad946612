"""experiments.benchmarks.cla_step: the sharing layer's dropped write leaves the compiled step."""

import jax
import pytest

from experiments.benchmarks import cla_step


@pytest.mark.slow  # two compiles with XLA's optimizations on; the numbers: docs/benchmarks.md
def test_sharing_halves_the_writes_of_a_compiled_decode_step():
  before = jax.config.read("jax_disable_most_optimizations")
  jax.config.update("jax_disable_most_optimizations", False)  # CSE is what merges the writes
  try:
    plain, shared = (cla_step.measure("ring-layout", f, batch=2, length=128, window=16, tokens=1)
                     for f in (None, 2))
  finally:
    jax.config.update("jax_disable_most_optimizations", before)
  assert shared["cache_mib"] * 2 == pytest.approx(plain["cache_mib"])
  # Without sharing each of the 4 caches writes; with it, only the 2 owners' writes remain
  # (the sharing layers' recomputed writes are the owners', merged).
  assert plain["scatters"] > 0 and shared["scatters"] * 2 == plain["scatters"]
  assert shared["temp_mib"] <= 1.05 * plain["temp_mib"]  # no second copy of a ring
