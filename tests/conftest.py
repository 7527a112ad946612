"""Suite-wide fixtures.

XLA:CPU maps a few memory regions per compiled executable and keeps every
executable of every jitted function alive in JAX's caches. The interpret-mode
kernel grids compile thousands of programs, and a process has at most
`vm.max_map_count` (65530 by default) mappings: past that, the next compile
segfaults inside LLVM (seen in `pytest -m slow`, ~62k mappings after the
decode-kernel grid alone). After any test that leaves the process above
`_MAX_MAPS`, the compiled-program caches are dropped (`jax.clear_caches()`),
which unmaps them; later tests recompile what they need.

The suite compiles with most XLA optimizations off (`jax_disable_most_optimizations`,
also exported as JAX_DISABLE_MOST_OPTIMIZATIONS so the subprocesses of the experiment, sharding
and notebook tests inherit it): nearly every program here is tiny and its cost is compilation,
so this cuts the suite's CPU time by about a quarter (12.3 -> 9.1 min on 2 cores, the same 825
tests passing). It also compiles XLA:CPU's fusions with the older elemental emitters
(`--xla_cpu_use_fusion_emitters=false` appended to XLA_FLAGS, exported the same way, for the
jaxlib versions in `_EMITTER_FLAG_VERSIONS`, whose XLA is known to have the flag: an unknown
flag aborts XLA): compiling a tiny program then costs about half the CPU time (two test files
measured 128 -> 62 CPU-s; docs/benchmarks.md, "Test suite cost"). The numerics tests compare a fast
path with its reference compiled the same way; the HLO-structure tests (copies per decode step)
hold either way. Set JAX_DISABLE_MOST_OPTIMIZATIONS=0 to test the programs exactly as users
compile them (neither setting is applied then).

Programs compiled in the run are shared through JAX's persistent compilation cache
(`JAX_COMPILATION_CACHE_DIR`, every program however fast it compiled): many tests compile the
same small programs (one tiny model's prefill and decode, the same kernel shapes), in other files,
on the other xdist worker and in the subprocesses of the experiment tests. The directory is made
for the run by the process that starts it (the xdist controller), inherited by the workers and
subprocesses through the environment and removed when the run ends: a run never reads another's
programs (tests/kvattn/models: 124 -> 89 s on 2 cores). A `JAX_COMPILATION_CACHE_DIR` set by the
caller is used as it is and kept.

`smollm2` is the one SmolLM2-135M-Instruct `(model, tokenizer)` of the session: every test that
needs the real checkpoint shares it (loading costs ~5-15 s of CPU). Tests must not modify it.
"""

from __future__ import annotations

import gc
import importlib.metadata
import os
import shutil
import tempfile

os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")
_FAST_COMPILE = os.environ["JAX_DISABLE_MOST_OPTIMIZATIONS"].lower() in ("1", "true", "yes", "on")
_EMITTER_FLAG = "--xla_cpu_use_fusion_emitters=false"
_EMITTER_FLAG_VERSIONS = ("0.10.",)
"""jaxlib version prefixes whose XLA has `_EMITTER_FLAG`."""
if (_FAST_COMPILE and importlib.metadata.version("jaxlib").startswith(_EMITTER_FLAG_VERSIONS)
    and "xla_cpu_use_fusion_emitters" not in os.environ.get("XLA_FLAGS", "")):
  os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_EMITTER_FLAG}".strip()

_OWN_CACHE = None
"""The compilation cache directory this process made (and removes at the end of the run)."""
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  _OWN_CACHE = tempfile.mkdtemp(prefix="kvattn-tests-xla-")
  os.environ["JAX_COMPILATION_CACHE_DIR"] = _OWN_CACHE
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")

import jax  # pylint: disable=g-import-not-at-top  (after the environment it reads)
import pytest

jax.config.update("jax_disable_most_optimizations", _FAST_COMPILE)

_MAPS = "/proc/self/maps"
_MAX_MAPS = 30_000  # about half the default vm.max_map_count


def _num_maps() -> int:
  with open(_MAPS, "rb") as f:
    return sum(chunk.count(b"\n") for chunk in iter(lambda: f.read(1 << 20), b""))


@pytest.fixture(autouse=True)
def _bounded_compiled_programs():
  yield
  if os.path.exists(_MAPS) and _num_maps() > _MAX_MAPS:
    jax.clear_caches()
    gc.collect()


@pytest.fixture(scope="session")
def smollm2():
  """`(model, tokenizer)` of SmolLM2-135M-Instruct, loaded once per session (fetched into
  `$KVATTN_CACHE` once per machine)."""
  from kvattn.checkpoints import pretrained  # pylint: disable=g-import-not-at-top
  return pretrained.from_pretrained("smollm2-135m-instruct")


def pytest_sessionfinish(session, exitstatus):
  """Removes the run's compilation cache (in the process that made it: the xdist controller
  outlives its workers)."""
  del session, exitstatus
  if _OWN_CACHE is not None:
    shutil.rmtree(_OWN_CACHE, ignore_errors=True)
