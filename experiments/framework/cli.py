"""Command-line errors of the entry points under experiments/: one line, exit status 2.

    if __name__ == "__main__":
      cli.run(main)          # absl entry points (app.run with these rules)
      cli.run_plain(main)    # argparse: main(sys.argv[1:]), parser cli.ArgumentParser

A *user error* is something the person at the command line can fix: an
unknown flag or config key (`--config.model.nonexistent=3`), a value of the
wrong kind (`--config.model.num_layers=abc`), a missing config file, an
invalid config (the runner's validation, `ConfigError`), a workdir another
run holds (`experiments.framework.workdir.WorkdirBusyError`), an unreadable results
file. It is reported as `error: <what>` on stderr -- naming the flag or
dotted key, the value and what was expected, and for a mistyped name the
nearest valid one (difflib) -- and the process exits with status 2, without
a traceback. Everything else is a fault of the program and keeps Python's
traceback (exit status 1). absl's `--verbosity=1` (or `-v 1`) also prints
the traceback of a user error.

Which exceptions count as user errors: `UserError` and its subclasses,
absl's flag errors and `app.UsageError`, and the AttributeError/KeyError that
ml_collections' config_flags raise while parsing an override of a key the
config does not have (recognised by looking the override up in the config;
any other exception during flag parsing stays a fault). A ValueError raised
deep inside a run is *not* a user error unless the code that validates
input marks it (the runner turns the ValueErrors of its validation phase,
before any work, into `ConfigError`).

`--import=MODULE_OR_FILE` (`define_import_flag`, `import_modules`) loads a user's own
module -- one that registers a cache kind or an eviction policy -- before the entry
point validates its config, so the kind is a valid `cache.kind` / `--cache`.

This module imports only the standard library at import time (absl and
ml_collections on use), so argparse entry points that run on machines with
nothing but JAX (experiments/benchmarks/decode.py) can use it.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import importlib
import importlib.util
import os
import re
import sys
import traceback
from typing import Any, Callable, Iterator, NoReturn, Sequence

EXIT_USER_ERROR = 2  # the exit status of a user error (argparse's convention)


class UserError(Exception):
  """An error in the user's input (flags, config, files, a busy workdir).

  `experiments.framework.cli.run` reports it as one line, `error: <message>`, and exit
  status 2; the message must say what was given and what was expected.
  """


class ConfigError(UserError, ValueError):
  """An invalid config value or sweep (a ValueError too, for callers that catch ValueError)."""


@contextlib.contextmanager
def config_errors() -> Iterator[None]:
  """Turns a ValueError raised inside the block into a `ConfigError` (same message).

  For validation code that runs before any work: its ValueErrors name the
  key, the value and what was expected, so they are user errors. The
  original exception is chained (`__cause__`) for `--verbosity=1`.
  """
  try:
    yield
  except ConfigError:
    raise
  except ValueError as e:
    raise ConfigError(str(e)) from e


def is_user_error(error: BaseException) -> bool:
  """Whether `error` is a user error (see the module doc), not a fault of the program."""
  if isinstance(error, UserError):
    return True
  absl_flags, absl_app = sys.modules.get("absl.flags"), sys.modules.get("absl.app")
  if absl_flags is not None and isinstance(error, absl_flags.Error):
    return True
  return absl_app is not None and isinstance(error, absl_app.UsageError)


def one_line(message: str) -> str:
  """`message` as one line: the last line of a traceback inside it (the exception, without
  its type name), else its lines joined with spaces."""
  if "Traceback (most recent call last)" in message:
    last = [line for line in message.splitlines() if line.strip()][-1].strip()
    return re.sub(r"^[\w.]+(Error|Exception): ", "", last)
  return " ".join(line.strip() for line in message.splitlines() if line.strip())


def report(error: BaseException, *, verbose: bool = False) -> NoReturn:
  """Prints a user error as `error: ...` on stderr (after its traceback if `verbose`) and
  exits with status 2."""
  if verbose:
    traceback.print_exception(error)
  sys.stderr.write(f"error: {one_line(str(error))}\n")
  sys.stderr.flush()
  sys.exit(EXIT_USER_ERROR)


def _verbose(argv: Sequence[str]) -> bool:
  """absl's verbosity >= 1: from the parsed flags, or from argv when parsing failed."""
  flags = sys.modules.get("absl.flags")
  if flags is not None and flags.FLAGS.is_parsed():
    return flags.FLAGS["verbosity"].value >= 1
  for i, arg in enumerate(argv):
    match = re.fullmatch(r"--?(?:v|verbosity)(?:=(-?\d+))?", arg)
    if match:
      value = match.group(1) if match.group(1) is not None else (
          argv[i + 1] if i + 1 < len(argv) else "0")
      return value.lstrip("-").isdigit() and int(value) >= 1
  return False


def run(main: Callable[[list[str]], Any], argv: Sequence[str] | None = None) -> NoReturn:
  """`absl.app.run(main)` with user errors reported as one line and exit status 2.

  Flags are parsed by `parse_flags` (flag and config-override errors become
  `UserError`s naming the flag); an `app.UsageError` from `main` is reported
  like a `UserError` (not with absl's usage text). Faults propagate with
  their traceback.
  """
  from absl import app  # pylint: disable=g-import-not-at-top

  argv = list(sys.argv if argv is None else argv)

  def guarded_main(args):
    try:
      return main(args)
    except app.UsageError as e:
      raise UserError(str(e)) from e

  try:
    app.run(guarded_main, argv=argv, flags_parser=parse_flags)
  except Exception as e:  # pylint: disable=broad-except
    if not is_user_error(e):
      raise
    report(e, verbose=_verbose(argv))
  sys.exit(0)  # app.run exits itself; not reached


def print_and_save(text: str, path: str | None) -> None:
  """Prints `text` and, when `path` is set, writes it there with a final newline."""
  print(text)
  if path:
    with open(path, "w", encoding="utf-8") as f:
      f.write(text + "\n")


def run_plain(main: Callable[[list[str]], Any], argv: Sequence[str] | None = None
              ) -> NoReturn:
  """`sys.exit(main(argv))` (argv: `sys.argv[1:]`) with user errors reported as one line and
  exit status 2 (argparse entry points; their parser is `ArgumentParser`)."""
  argv = list(sys.argv[1:] if argv is None else argv)
  try:
    code = main(argv)
  except Exception as e:  # pylint: disable=broad-except
    if not is_user_error(e):
      raise
    report(e)
  sys.exit(code)


class ArgumentParser(argparse.ArgumentParser):
  """argparse's parser whose errors are `UserError`s: one line and exit status 2 under
  `run_plain` (argparse itself prints the whole usage text before its message)."""

  def error(self, message: str) -> NoReturn:
    raise UserError(f"{message} (see {self.prog} --help)")


# ----------------------------------------------------------------------------------------------
# --import: a user's module (a cache kind or eviction policy of their own) loaded by name.

IMPORT_FLAG = "import"


def define_import_flag() -> None:
  """Defines absl's repeatable `--import=MODULE_OR_FILE` (read by `import_modules`)."""
  from absl import flags  # pylint: disable=g-import-not-at-top
  if IMPORT_FLAG in flags.FLAGS:  # main.py and chat.py in one process (tests)
    return
  flags.DEFINE_multi_string(
      IMPORT_FLAG, [], "A module of your own to import first, e.g. one that registers a cache "
      "kind or eviction policy: a dotted name importable from the current directory "
      "(my_pkg.my_policy) or a .py file (path/to/my_policy.py); repeat for several.")


def _import_file(path: str) -> None:
  """Executes the .py file `path` as module `<its stem>`, unless some module (say, one a config
  file imported by its dotted name) already is that file: a kind registers once."""
  path = os.path.realpath(path)
  files = {os.path.realpath(f) for m in list(sys.modules.values())
           if isinstance(f := getattr(m, "__file__", None), str)}
  if path in files:
    return
  name = os.path.splitext(os.path.basename(path))[0]
  if name in sys.modules:
    raise UserError(f"a module named {name!r} is already imported (from "
                    f"{getattr(sys.modules[name], '__file__', None)}); rename the file")
  spec = importlib.util.spec_from_file_location(name, path)
  module = importlib.util.module_from_spec(spec)
  sys.modules[name] = module  # dataclasses and pickling look their module up here
  try:
    spec.loader.exec_module(module)
  except BaseException:
    del sys.modules[name]
    raise


def import_modules(values: Sequence[str], flag: str = IMPORT_FLAG) -> None:
  """Imports each `--import` value in order: a path ending in `.py` (relative to the current
  directory) or a dotted module name (sys.path: the current directory under `python -m`).

  Raises:
    UserError: a file or module that does not exist, or one whose import raised (the
      message names `--<flag>=<value>` and the error; the original is chained).
  """
  for value in values:
    where = f"--{flag}={value}"
    if value.endswith(".py"):
      if not os.path.isfile(value):
        raise UserError(f"{where}: file {value!r} does not exist (relative paths start at "
                        f"{os.getcwd()})")
      load = lambda v=value: _import_file(v)
    else:
      if not re.fullmatch(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*", value):
        raise UserError(f"{where}: expected a dotted module name (my_pkg.my_policy) or a .py "
                        "file")
      load = lambda v=value: importlib.import_module(v)
    try:
      load()
    except UserError as e:
      raise UserError(f"{where}: {e}") from e
    except ModuleNotFoundError as e:
      if e.name is not None and value.startswith(e.name) and (
          value == e.name or value[len(e.name)] == "."):
        raise UserError(f"{where}: no module named {e.name!r} on sys.path (the current directory "
                        f"is {os.getcwd()}); give a dotted name or a .py file") from e
      raise UserError(f"{where}: importing it raised ModuleNotFoundError: {e}") from e
    except Exception as e:  # pylint: disable=broad-except
      raise UserError(f"{where}: importing it raised {type(e).__name__}: {one_line(str(e))}"
                      ) from e


# ----------------------------------------------------------------------------------------------
# absl flags and ml_collections config overrides.


def parse_flags(argv: Sequence[str]) -> list[str]:
  """Parses absl's FLAGS from `argv` (a flags_parser for `app.run`); returns the arguments left.

  Raises:
    UserError: an unknown flag or config key (with the nearest valid name),
      a value the flag's parser rejects (with the type it expects), a
      required flag missing, a config file that does not exist or whose
      `get_config` rejects its argument.
  """
  from absl import flags  # pylint: disable=g-import-not-at-top

  try:
    args = flags.FLAGS(list(argv))
  except (flags.Error, AttributeError, KeyError, OSError) as e:
    problem = config_problem(argv)
    if problem is not None:
      raise UserError(problem) from e
    if isinstance(e, flags.Error):
      raise UserError(_flag_error_message(e)) from e
    raise  # not a config key we can name: a fault
  # config_flags defers the error of a missing config file until the config is read.
  problem = config_problem(argv, check_keys=False)
  if problem is not None:
    raise UserError(problem)
  return args


def _config_flag_names() -> list[str]:
  """Names of the ml_collections config-file flags defined (`DEFINE_config_file`)."""
  from absl import flags  # pylint: disable=g-import-not-at-top
  if "ml_collections.config_flags" not in sys.modules:
    return []
  from ml_collections.config_flags import config_flags  # pylint: disable=g-import-not-at-top
  return [name for name in list(flags.FLAGS)
          if isinstance(flags.FLAGS[name].parser, config_flags.ConfigFileFlagParser)]


def _argv_value(argv: Sequence[str], name: str) -> str | None:
  """The last value of `--name=VALUE` / `--name VALUE` in argv (None if absent)."""
  value = None
  for i, arg in enumerate(argv):
    match = re.fullmatch(rf"--?{re.escape(name)}(?:=(.*))?", arg, re.DOTALL)
    if match:
      value = match.group(1) if match.group(1) is not None else (
          argv[i + 1] if i + 1 < len(argv) else None)
  return value


def config_problem(argv: Sequence[str], *, check_keys: bool = True) -> str | None:
  """Names what is wrong with the config flags of `argv`, if it is a user's mistake.

  For each ml_collections config-file flag (e.g. `--config=FILE[:ARG]`): the
  file must exist, and (`check_keys`: loads the config once more) every
  override `--config.a.b=V` must name a key of `get_config(ARG)`. Returns one
  line for the first problem found, or None (nothing found, or the config
  cannot even be loaded: that error is left to the caller).
  """
  for name in _config_flag_names():
    value = _argv_value(argv, name)
    if value is None:
      continue
    path = value.split(":", 1)[0]
    if not os.path.isfile(path):
      return (f"--{name}={value}: config file {path!r} does not exist (relative paths start at "
              f"{os.getcwd()})")
    overrides = []
    for arg in argv if check_keys else ():
      match = re.match(rf"--?(?:no)?{re.escape(name)}\.([^=]+)", arg)
      if match:
        overrides.append((arg, match.group(1)))
    if not overrides:
      continue
    from ml_collections.config_flags import config_flags  # pylint: disable=g-import-not-at-top
    try:
      config = config_flags.ConfigFileFlagParser(name, lock_config=False).parse(value)
      _ = config.keys()  # a config that failed to load raises on any access
    except Exception:  # pylint: disable=broad-except
      return None
    for arg, dotted in overrides:
      problem = missing_key(config, dotted, prefix=f"--{name}.", where=f" in {value}")
      if problem is not None:
        return f"{arg}: {problem}"
  return None


def _leaf_paths(config: Any, prefix: str = "") -> list[str]:
  out = []
  for key, value in config.items():
    if hasattr(value, "items") and hasattr(value, "keys"):
      out += _leaf_paths(value, f"{prefix}{key}.")
    else:
      out.append(f"{prefix}{key}")
  return out


def nearest(name: str, candidates: Sequence[str], cutoff: float = 0.6) -> str | None:
  """The candidate closest to `name` (difflib ratio), or None if none reaches `cutoff`."""
  found = difflib.get_close_matches(name, list(candidates), n=1, cutoff=cutoff)
  return found[0] if found else None


def missing_key(config: Any, dotted: str, *, prefix: str = "", where: str = "") -> str | None:
  """Why `dotted` ("model.num_layers") is not a key of the nested `config`, or None if it is.

  The reason reads `no such key<where>; nearest: <prefix><path>`, with the
  nearest valid path by difflib: over
  all leaf paths if one is close (so `model.attention.num_kv_heads` finds
  `attention.num_kv_heads`), else the closest key of the deepest section
  that exists.
  """
  node, parts = config, dotted.split(".")
  for i, part in enumerate(parts):
    if hasattr(node, "keys") and part in node.keys():
      node = node[part]
      continue
    if not hasattr(node, "keys"):
      return f"{prefix}{'.'.join(parts[:i])} is a value, not a section{where}"
    paths = _leaf_paths(config)
    best = nearest(dotted, paths)
    if best is None:
      section = ".".join(parts[:i])
      local = [p for p in paths if p.startswith(section + ".")] if section else paths
      best = max(local or paths, key=lambda p: difflib.SequenceMatcher(None, dotted, p).ratio())
    return f"no such key{where}; nearest: {prefix}{best}"
  return None


def _flag_error_message(error: Exception) -> str:
  """One line for an absl flag error: the flag, the value and what was expected."""
  from absl import flags  # pylint: disable=g-import-not-at-top

  if isinstance(error, flags.UnrecognizedFlagError):
    names = [n for n in flags.FLAGS if not any(n.startswith(c + ".")
                                                for c in _config_flag_names())]
    best = nearest(error.flagname, names, cutoff=0.5)
    hint = f"nearest: --{best}" if best else "see --helpshort"
    return f"{error.flagvalue or '--' + error.flagname}: no such flag; {hint}"
  text = str(error)
  match = re.fullmatch(r"flag --([^=\s]+)=(.*?): (.*)", text, re.DOTALL)
  if match is None:
    return one_line(text)
  name, value, reason = match.group(1), match.group(2), one_line(match.group(3))
  if reason.endswith("must have a value other than None."):
    return f"--{name} is required"
  if name in flags.FLAGS and name not in _config_flag_names():
    return f"--{name}={value}: expected {flags.FLAGS[name].flag_type()} ({reason})"
  return f"--{name}={value}: {reason}"
