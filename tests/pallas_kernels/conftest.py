"""The `slow_when_interpreted` marker of the kernel tests.

A kernel case marked `slow_when_interpreted` is `slow` in an `...Interpret`
class (the Pallas interpreter on CPU compiles every case as a large XLA
program) and stays in the default selection when compiled (GPU/TPU, where
`experiments/gpu_check.sh` runs the compiled classes with the default markers).
"""

from __future__ import annotations

import pytest


def pytest_configure(config):
  config.addinivalue_line(
      "markers", "slow_when_interpreted: slow in an ...Interpret test class (interpret mode on "
      "CPU), default when compiled")


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(items):
  for item in items:
    if item.get_closest_marker("slow_when_interpreted") and getattr(item.cls, "INTERPRET", False):
      item.add_marker(pytest.mark.slow)
