"""User errors on the command line: one `error: ...` line (at most two lines) and exit status 2.

Every case is a subprocess, as a person would type it; they all start at once
(module fixture) so the test costs about one interpreter start per core.
Mistakes in flags and config keys are reported before JAX is imported; the
cases that need the runner use the stand-in family (tests/experiments/standin.py),
so nothing trains.
"""

import os
import re
import sys

import pytest
from ml_collections import config_dict

from experiments.framework import cli
from tests.experiments import subproc

SMOKE = "configs/toy.py:smoke"

# name -> (module, args, regex the error line must match); {workdir} is a fresh directory.
CASES = {
    "unknown_key": ("experiments.main", subproc.main_args("{workdir}", "model.nonexistent=3",
                                                          config=SMOKE),
                    r"error: --config\.model\.nonexistent=3: no such key in "
                    r"configs/toy\.py:smoke; nearest: --config\.model\.\w+$"),
    "typo_key": ("experiments.main", subproc.main_args("{workdir}", "train.stepz=3", config=SMOKE),
                 r"error: --config\.train\.stepz=3: no such key .*; "
                 r"nearest: --config\.train\.steps$"),
    "key_in_wrong_section": ("experiments.main",
                             subproc.main_args("{workdir}", "decode.num_layers=2", config=SMOKE),
                             r"no such key .*; nearest: --config\.model\.num_layers$"),
    "value_of_wrong_type": ("experiments.main",
                            subproc.main_args("{workdir}", "model.num_layers=abc", config=SMOKE),
                            r"error: --config\.model\.num_layers=abc: expected int \(invalid "
                            r"literal for int\(\) with base 10: 'abc'\)$"),
    "invalid_value": ("experiments.main", subproc.main_args("{workdir}", "standin.num_points=0"),
                      r"error: config: standin\.num_points must be an int >= 1; got 0$"),
    "missing_config_file": ("experiments.main",
                            ["--config=configs/nofile.py", "--workdir={workdir}"],
                            r"error: --config=configs/nofile\.py: config file "
                            r"'configs/nofile\.py' does not exist"),
    "bad_config_argument": ("experiments.main", ["--config=configs/toy.py:tiny",
                                                 "--workdir={workdir}"],
                            r"error: --config=configs/toy\.py:tiny: config argument must be "
                            r"one of .*; got 'tiny'$"),
    "unknown_flag": ("experiments.main", [f"--config={SMOKE}", "--worksdir={workdir}"],
                     r"error: --worksdir=.*: no such flag; nearest: --workdir$"),
    "missing_flag": ("experiments.main", [f"--config={SMOKE}"], r"error: --workdir is required$"),
    "positional_argument": ("experiments.main", [f"--config={SMOKE}", "--workdir={workdir}", "x"],
                            r"error: unexpected arguments: x"),
    # --import (a user's module that registers a cache kind) names the flag and the value.
    "import_missing_file": ("experiments.main", [*subproc.main_args("{workdir}", config=SMOKE),
                                                 "--import=my/policy.py"],
                            r"error: --import=my/policy\.py: file 'my/policy\.py' does not "
                            r"exist \(relative paths start at "),
    "import_missing_module": ("experiments.chat", ["--prompt=hi", "--import=my_policy"],
                              r"error: --import=my_policy: no module named 'my_policy' on "
                              r"sys\.path"),
    "chat_unknown_cache": ("experiments.chat", ["--prompt=hi", "--cache=keydiff-lite"],
                           r"error: cache must be one of \[.*'dense'.*\], optionally with a "
                           r"suffix of .*; got 'keydiff-lite'$"),
    # The other entry points share the wrapper (test_every_entry_point_uses_the_wrapper): one
    # absl and one argparse entry point here.
    "demo": ("experiments.demo", ["--num_head=3"], r"error: --num_head=3: no such flag; "
             r"nearest: --num_heads$"),
    "bench_quant_decode": ("experiments.benchmarks.quant_decode", ["--repeats=x"],
                           r"error: argument --repeats: invalid int value: 'x'"),
}
VERBOSE = ("experiments.main", [*subproc.main_args("{workdir}", "train.stepz=3", config=SMOKE),
                                "--verbosity=1"])
FAULT = ("experiments.main", subproc.main_args("{workdir}", "standin.fail_at=1"))


# Run only with `-m slow` (each case is a process importing JAX, ~3.5 CPU-s): the nearest-key
# search (tested in-process below by test_missing_key_names_the_nearest_path) and the other
# ways a config override or argument is refused, which share the one-line error wrapper that
# the fast cases (typo_key, unknown_flag, and an argparse entry point) go through.
SLOW_CASES = ("unknown_key", "key_in_wrong_section", "value_of_wrong_type", "missing_config_file",
              "positional_argument", "bad_config_argument", "missing_flag", "demo",
              "import_missing_module", "chat_unknown_cache")


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory, request):
  """`(returncode, stdout, stderr, workdir)` of every selected case, run concurrently."""
  selected = {item.callspec.params.get("name") for item in request.session.items
              if item.module is request.module and hasattr(item, "callspec")}
  runs = {}
  cases = {name: case for name, case in CASES.items() if name in selected}
  for name, (module, args, *_) in {**cases, "verbose": VERBOSE, "fault": FAULT}.items():
    workdir = str(tmp_path_factory.mktemp(name) / "run")
    runs[name] = (subproc.popen(module, *[a.format(workdir=workdir) for a in args]), workdir)
  out = {}
  for name, (proc, workdir) in runs.items():
    stdout, stderr = proc.communicate(timeout=300)
    out[name] = (proc.returncode, stdout, stderr, workdir)
  return out


@pytest.mark.parametrize("name", [pytest.param(name, marks=pytest.mark.slow)
                                  if name in SLOW_CASES else name for name in sorted(CASES)])
def test_user_error_is_one_line_and_exit_2(outcomes, name):
  returncode, _, stderr, workdir = outcomes[name]
  lines = stderr.splitlines()
  assert returncode == cli.EXIT_USER_ERROR, stderr
  assert 1 <= len(lines) <= 2 and "Traceback" not in stderr, stderr
  assert lines[-1].startswith("error: ")
  assert any(re.search(CASES[name][2], line) for line in lines), stderr
  assert not os.path.exists(workdir)  # stopped before writing anything


def test_verbosity_1_adds_the_traceback(outcomes):
  returncode, _, stderr, _ = outcomes["verbose"]
  assert returncode == cli.EXIT_USER_ERROR
  assert "Traceback (most recent call last)" in stderr
  assert stderr.splitlines()[-1].startswith("error: --config.train.stepz=3: no such key")


def test_a_fault_keeps_its_traceback(outcomes):
  """A bug -- here a ValueError raised while measuring, not by validation -- is not a user error:
  its traceback is printed and the exit status is 1."""
  returncode, _, stderr, workdir = outcomes["fault"]
  assert returncode == 1
  assert "Traceback (most recent call last)" in stderr
  assert stderr.rstrip().endswith("ValueError: stand-in fault at point p1")
  assert "error: " not in stderr
  assert os.path.exists(os.path.join(workdir, "results.jsonl"))  # p0 finished before the fault


def test_missing_key_names_the_nearest_path():
  config = config_dict.ConfigDict({"model": {"num_layers": 2, "d_model": 8},
                                   "attention": {"num_kv_heads": 2, "num_heads": 4}})
  assert cli.missing_key(config, "model.num_layers") is None
  assert cli.missing_key(config, "model.num_layer", prefix="--config.") == (
      "no such key; nearest: --config.model.num_layers")
  # A key under the wrong section finds its real place.
  assert cli.missing_key(config, "model.attention.num_kv_heads").endswith(
      "nearest: attention.num_kv_heads")
  # Nothing close: the closest key of the deepest section that exists.
  assert cli.missing_key(config, "model.zzzzzz").split("nearest: ")[1].startswith("model.")
  assert cli.missing_key(config, "model.d_model.x", where=" in f.py") == (
      "model.d_model is a value, not a section in f.py")


def test_config_errors_marks_validation_errors():
  with pytest.raises(cli.ConfigError, match="k must be positive") as info:
    with cli.config_errors():
      raise ValueError("k must be positive; got 0")
  assert isinstance(info.value, ValueError) and cli.is_user_error(info.value)
  with pytest.raises(KeyError):  # not a validation error: untouched, not a user error
    with cli.config_errors():
      raise KeyError("x")
  assert not cli.is_user_error(RuntimeError("bug")) and not cli.is_user_error(ValueError("x"))


def test_import_modules_names_the_flag_and_runs_a_file_once(tmp_path, monkeypatch):
  (tmp_path / "user_kind.py").write_text("TOKEN = object()\n")
  (tmp_path / "raises_on_import.py").write_text("raise RuntimeError('boom')\n")
  monkeypatch.chdir(tmp_path)
  monkeypatch.syspath_prepend(str(tmp_path))
  try:
    cli.import_modules(["user_kind.py"])
    token = sys.modules["user_kind"].TOKEN
    # The same file again, by its absolute path and by its module name: not executed again
    # (a kind registers once; a second registration would raise).
    cli.import_modules([str(tmp_path / "user_kind.py"), "user_kind"])
    assert sys.modules["user_kind"].TOKEN is token
    with pytest.raises(cli.UserError, match=r"^--import=user_kind\.nope: no module named"):
      cli.import_modules(["user_kind.nope"])
  finally:
    sys.modules.pop("user_kind", None)
  with pytest.raises(cli.UserError, match=r"^--import=raises_on_import\.py: importing it raised "
                     r"RuntimeError: boom$"):
    cli.import_modules(["raises_on_import.py"])
  assert "raises_on_import" not in sys.modules
  with pytest.raises(cli.UserError, match=r"^--import=a b: expected a dotted module name"):
    cli.import_modules(["a b"])


def test_one_line():
  assert cli.one_line("a\n  b\n") == "a b"
  trace = "Error whilst parsing:\n\nTraceback (most recent call last):\n  File x\nValueError: bad"
  assert cli.one_line(trace) == "bad"


def test_every_entry_point_uses_the_wrapper():
  """Each module under experiments/ that runs as a program hands its main to `cli.run` (absl)
  or `cli.run_plain` (argparse, with `cli.ArgumentParser`)."""
  directory = os.path.join(subproc.ROOT, "experiments")
  entry_points = []
  for parent, _, names in os.walk(directory):
    if os.path.basename(parent) == "peers":
      continue  # run by the peers' own interpreter (benchmarks/real.py --peer_python)
    for name in sorted(names):
      if not name.endswith(".py"):
        continue
      path = os.path.join(parent, name)
      with open(path, encoding="utf-8") as f:
        text = f.read()
      block = re.search(r'^if __name__ == "__main__":(.*)', text, re.MULTILINE | re.DOTALL)
      if block is None or not re.search(r"[(\s]main[()]", block.group(1)):
        continue  # not a program (runner.py's block only points at experiments.main)
      rel = os.path.relpath(path, directory)
      entry_points.append(rel)
      tail = block.group(1)
      assert re.search(r"\bcli\.run(_plain)?\(main\)", tail), rel
      assert "argparse.ArgumentParser(" not in text, rel
      assert "app.run(" not in text, rel
  assert {"main.py", "benchmarks/decode.py", "benchmarks/generate.py", "benchmarks/mla.py",
          "benchmarks/quant_decode.py", "demo.py"} <= set(entry_points)
  # One entry point runs configs: families have no main of their own.
  assert not [p for p in entry_points if p.startswith("families/")]
