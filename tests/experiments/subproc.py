"""Runs the entry points under experiments/ as a person would: a subprocess from the repo root."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STANDIN = "tests/experiments/standin.py"  # the stand-in family's config (no model)


def env() -> dict[str, str]:
  """The environment of a subprocess: this checkout first on the path."""
  out = dict(os.environ)
  out["PYTHONPATH"] = ROOT + (os.pathsep + out["PYTHONPATH"] if out.get("PYTHONPATH") else "")
  return out


def popen(module: str, *args: str, stderr=subprocess.PIPE) -> subprocess.Popen:
  """`python -m <module> <args>` started in the repo root (stdout and stderr piped, text)."""
  return subprocess.Popen([sys.executable, "-m", module, *args], cwd=ROOT, env=env(),
                          stdout=subprocess.PIPE, stderr=stderr, text=True)


def main_args(workdir: str, *overrides: str, config: str = STANDIN) -> list[str]:
  """`experiments.main` arguments for `config` in `workdir` with `--config.` overrides."""
  return [f"--config={config}", f"--workdir={workdir}", *[f"--config.{o}" for o in overrides]]
