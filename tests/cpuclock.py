"""A pytest plugin: CPU-seconds of every test, for judging the suite's cost on a busy machine.

    python -m pytest -p tests.cpuclock ...   # appends to $CPUCLOCK_OUT (/tmp/cpuclock.tsv)

Each line is `nodeid<TAB>cpu_s<TAB>wall_s` for setup + call + teardown: `cpu_s` is the user +
system time of this process (all its threads) and of the subprocesses it reaped in that time
(`os.times`), so it changes little with the machine's load, unlike `--durations` (wall time).
A module or session fixture is charged to the first test that uses it. Lines are appended as
tests finish, so a run that is stopped early still leaves its measurements.
"""

import os
import time

import pytest


def _cpu_seconds() -> float:
  t = os.times()
  return t.user + t.system + t.children_user + t.children_system


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
  del nextitem
  cpu, wall = _cpu_seconds(), time.perf_counter()
  yield
  with open(os.environ.get("CPUCLOCK_OUT", "/tmp/cpuclock.tsv"), "a", encoding="utf-8") as f:
    f.write(f"{item.nodeid}\t{_cpu_seconds() - cpu:.3f}\t{time.perf_counter() - wall:.3f}\n")
