"""One run at a time per workdir: an OS-level lock held for the whole run.

    with workdir.locked([workdir, train_dir], wait=False):
      ...  # write results, train, checkpoint, report

`locked` takes an exclusive `fcntl.flock` on `<dir>/.lock` of each
directory (created if needed) and writes the holder's PID into it. The
kernel releases a flock when the process that holds it exits, however it
exits (SIGKILL, a crash, a power cut), so a dead run never leaves a stale
lock: the file may still hold its PID, but the next run locks it at once.
A directory that another live process holds raises `WorkdirBusyError`
(a `cli.UserError`: one line naming the directory and the holder's PID,
exit status 2), or, with `wait=True`, blocks until the holder is done.

Directories are locked in one order (sorted real paths, duplicates
dropped), so two waiting runs never deadlock. A directory inside another
locked one is still locked itself: another run may name it directly (the
quant sweep's `experiment.train_dir=runs/default/train` is the main job's
training directory), and only its own lock file keeps the two apart. The
lock file is never deleted: deleting it would let a third run lock a new
file while the second still waits on the old one. A run probes the lock
before its validation (`check_free`, which creates nothing) so that a busy
workdir fails at once; the probe holds the lock for an instant.

Limits: flock is advisory (only runs that use this module are kept out); it
is per open file description, so a second `locked` on the same directory in
the same process fails like another process would; a child process that
inherits the descriptor (fork without exec) shares the lock; and on some
network filesystems flock is local to one machine.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import time
from typing import Iterator, Mapping, Sequence

from absl import logging

from experiments.framework import cli

LOCK_NAME = ".lock"


class WorkdirBusyError(cli.UserError):
  """Another live process holds the lock of a run directory."""


def _holder(fd: int) -> str:
  """The PID written in an open lock file ("unknown" if the holder has not written it yet)."""
  for _ in range(20):  # the holder writes its PID right after locking
    text = os.pread(fd, 64, 0).decode("ascii", "replace").strip()
    if text:
      return text
    time.sleep(0.01)
  return "unknown"


class DirLock:
  """An exclusive flock on `<directory>/.lock` (see the module doc).

  Args:
    directory: the directory to lock (created if missing).
    label: how messages name it ("workdir", "training directory").
  """

  def __init__(self, directory: str, label: str = "workdir"):
    self.directory = os.path.abspath(directory)
    self.label = label
    self.path = os.path.join(self.directory, LOCK_NAME)
    self._fd: int | None = None

  def acquire(self, wait: bool = False) -> None:
    """Takes the lock; writes this process's PID into the lock file.

    Raises:
      WorkdirBusyError: another process holds it and `wait` is False.
      RuntimeError: this DirLock already holds it.
    """
    if self._fd is not None:
      raise RuntimeError(f"{self.path}: already locked by this DirLock")
    os.makedirs(self.directory, exist_ok=True)
    fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
      try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
      except OSError as e:
        if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
          raise
        holder = _holder(fd)
        if not wait:
          raise WorkdirBusyError(self._busy_message(holder)) from None
        logging.warning("%s %s is in use by another run (pid %s); waiting for it to finish",
                        self.label, self.directory, holder)
        fcntl.flock(fd, fcntl.LOCK_EX)
      os.ftruncate(fd, 0)
      os.pwrite(fd, f"{os.getpid()}\n".encode("ascii"), 0)
    except BaseException:
      os.close(fd)
      raise
    self._fd = fd

  def release(self) -> None:
    """Empties the lock file and releases the lock (no-op when not held)."""
    if self._fd is None:
      return
    fd, self._fd = self._fd, None
    try:
      os.ftruncate(fd, 0)
    finally:
      os.close(fd)  # closing the last descriptor releases the flock

  def check_free(self) -> None:
    """Raises WorkdirBusyError now if another process holds the lock; creates nothing (a run
    probes before its validation, so a busy workdir fails at once, not after it).

    Only a probe: the lock is free again when this returns, and `acquire` decides.
    """
    try:
      fd = os.open(self.path, os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
      return  # no run has ever locked it
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
      if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
        raise
      raise WorkdirBusyError(self._busy_message(_holder(fd))) from None
    finally:
      os.close(fd)

  def _busy_message(self, holder: str) -> str:
    return (f"{self.label} {self.directory} is in use by another run (pid {holder}); wait for "
            f"it to finish, or pass --wait to start when it does")

  @property
  def held(self) -> bool:
    """Whether this DirLock holds its lock."""
    return self._fd is not None

  def __enter__(self) -> "DirLock":
    self.acquire()
    return self

  def __exit__(self, *exc) -> None:
    self.release()


def _labelled(directories: Sequence[str] | Mapping[str, str]) -> dict[str, tuple[str, str]]:
  """real path -> (path as given, label), None entries dropped, one entry per directory."""
  labels = dict(directories) if isinstance(directories, Mapping) else {
      d: "workdir" for d in directories}
  real = {}
  for directory, label in labels.items():
    if directory is not None:
      real.setdefault(os.path.realpath(os.path.abspath(directory)), (directory, label))
  return real


def check_free(directories: Sequence[str] | Mapping[str, str]) -> None:
  """Raises WorkdirBusyError if another process holds one of `directories` (as `locked`
  takes them); creates nothing. A probe for failing early: `locked` still decides."""
  for path, (directory, label) in sorted(_labelled(directories).items()):
    DirLock(directory, label).check_free()


@contextlib.contextmanager
def locked(directories: Sequence[str] | Mapping[str, str], *, wait: bool = False
           ) -> Iterator[list[DirLock]]:
  """Holds the locks of `directories` for the block (see the module doc).

  Args:
    directories: paths, or a mapping path -> label for messages (default
      label "workdir"); None entries are skipped, a directory named twice
      is locked once.
    wait: block until each lock is free instead of raising.

  Yields:
    The DirLocks held, in the order they were taken.

  Raises:
    WorkdirBusyError: a directory is held by another process (not `wait`).
  """
  real = _labelled(directories)
  with contextlib.ExitStack() as stack:
    held = []
    for path in sorted(real):
      directory, label = real[path]
      lock = DirLock(directory, label)
      lock.acquire(wait=wait)
      stack.callback(lock.release)
      held.append(lock)
    yield held
