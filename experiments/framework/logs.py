"""Logs of a run: every record into `<workdir>/log.txt`, warnings only on the terminal."""

from __future__ import annotations

import contextlib
import logging as std_logging
import os
from typing import Iterator

from absl import logging


LOG_FILE = "log.txt"  # In the workdir: every log record of a run (absl, orbax, jax, ...).


class _WorkdirLog(std_logging.Handler):
  """Keeps log records until `open(path)`, then appends them and every later one to the file."""

  def __init__(self):
    super().__init__(std_logging.DEBUG)
    self.setFormatter(std_logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    self._held: list[std_logging.LogRecord] = []
    self._file = None

  def open(self, path: str) -> None:
    self._file = open(path, "a", encoding="utf-8")  # pylint: disable=consider-using-with
    held, self._held = self._held, []
    for record in held:
      self.emit(record)

  def emit(self, record: std_logging.LogRecord) -> None:
    if self._file is None:
      if len(self._held) < 100_000:
        self._held.append(record)
      return
    try:
      self._file.write(self.format(record) + "\n")
      self._file.flush()
    except Exception:  # pylint: disable=broad-except
      self.handleError(record)

  def close(self) -> None:
    if self._file is not None:
      self._file.close()
      self._file = None
    super().close()


_ACTIVE_LOG: _WorkdirLog | None = None


@contextlib.contextmanager
def workdir_log(workdir: str) -> Iterator[None]:
  """Writes the log records of the block (and those `quiet_terminal` held before it) to
  `<workdir>/log.txt` (appended: a resumed run adds to it)."""
  global _ACTIVE_LOG  # pylint: disable=global-statement
  own = _ACTIVE_LOG is None
  handler = _WorkdirLog() if own else _ACTIVE_LOG
  if own:
    std_logging.getLogger().addHandler(handler)
    _ACTIVE_LOG = handler
  handler.open(os.path.join(workdir, LOG_FILE))
  try:
    yield
  finally:
    if own:
      std_logging.getLogger().removeHandler(handler)
      handler.close()
      _ACTIVE_LOG = None


@contextlib.contextmanager
def quiet_terminal(verbose: bool) -> Iterator[None]:
  """Library INFO logging (absl, orbax, jax) goes to the workdir's log.txt, not the terminal.

  For the block: every record from INFO up is held until `run` opens
  `<workdir>/log.txt` (`workdir_log`) and written there; the terminal's
  handlers (absl's, and any other on the root logger) show WARNING and above
  only, unless `verbose` (absl's `--verbosity` >= 1), which leaves them as
  they were.
  """
  global _ACTIVE_LOG  # pylint: disable=global-statement
  root = std_logging.getLogger()
  handler = _WorkdirLog()
  saved_level = root.level
  saved = [(h, h.level) for h in root.handlers]
  if not verbose:
    for h, _ in saved:
      h.setLevel(max(h.level, std_logging.WARNING))
  root.setLevel(min(root.level or std_logging.WARNING, std_logging.INFO))
  root.addHandler(handler)
  _ACTIVE_LOG = handler
  try:
    yield
  finally:
    root.removeHandler(handler)
    handler.close()
    _ACTIVE_LOG = None
    root.setLevel(saved_level)
    for h, level in saved:
      h.setLevel(level)
