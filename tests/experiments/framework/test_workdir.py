"""The workdir lock: one holder, its PID named, waiting, no stale lock after a kill."""

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from experiments.framework import cli
from experiments.framework import workdir
from tests.experiments import subproc


def test_second_holder_is_refused_with_the_pid(tmp_path):
  first = workdir.DirLock(str(tmp_path / "run"))
  first.acquire()
  assert open(first.path).read() == f"{os.getpid()}\n"
  # flock is per open file: a second DirLock in this process is refused like another process.
  second = workdir.DirLock(str(tmp_path / "run"), label="training directory")
  with pytest.raises(workdir.WorkdirBusyError,
                     match=rf"^training directory {tmp_path}/run is in use by another run "
                           rf"\(pid {os.getpid()}\); .*--wait") as info:
    second.acquire()
  assert isinstance(info.value, cli.UserError) and not second.held
  first.release()
  assert open(first.path).read() == ""  # no PID of a finished run left behind
  second.acquire()
  second.release()


def test_check_free_probes_without_creating(tmp_path):
  directory = str(tmp_path / "run")
  workdir.check_free([directory])
  assert not os.path.exists(directory)  # nothing created
  with workdir.locked({directory: "workdir"}):
    with pytest.raises(workdir.WorkdirBusyError, match=rf"\(pid {os.getpid()}\)"):
      workdir.check_free({directory: "workdir"})
  workdir.check_free([directory])  # free again, and the probe did not take it
  with workdir.locked([directory]):
    pass


def test_wait_blocks_until_the_holder_releases(tmp_path):
  first = workdir.DirLock(str(tmp_path))
  first.acquire()
  released = []

  def release_later():
    time.sleep(0.3)
    released.append(time.monotonic())
    first.release()

  thread = threading.Thread(target=release_later)
  thread.start()
  with workdir.locked([str(tmp_path)], wait=True) as held:
    acquired = time.monotonic()
    assert [lock.held for lock in held] == [True]
  thread.join()
  assert released and acquired >= released[0]


def test_locked_takes_each_directory_once_in_one_order(tmp_path):
  a, b = str(tmp_path / "a"), str(tmp_path / "a" / "train")
  with workdir.locked({b: "training directory", a: "workdir", None: "skipped"}) as held:
    assert [lock.directory for lock in held] == [a, b]  # sorted: no deadlock between waiters
    assert [lock.label for lock in held] == ["workdir", "training directory"]
    with pytest.raises(workdir.WorkdirBusyError, match=r"^workdir .*/a/train is in use"):
      with workdir.locked([b]):
        pass
  with workdir.locked([a, a + "/", os.path.join(b, "..")]) as held:  # one directory, one lock
    assert len(held) == 1
  with pytest.raises(workdir.WorkdirBusyError):  # a failure releases what was taken
    with workdir.locked([a]):
      with workdir.locked([b, a]):
        pass
  with workdir.locked([b]):
    pass


def test_a_killed_holder_leaves_no_stale_lock(tmp_path):
  code = ("import os, signal, sys; from experiments.framework import workdir; "
          "workdir.DirLock(sys.argv[1]).acquire(); print(os.getpid(), flush=True); "
          "os.kill(os.getpid(), signal.SIGKILL)")
  proc = subprocess.run([sys.executable, "-c", code, str(tmp_path)], cwd=subproc.ROOT,
                        env=subproc.env(), capture_output=True, text=True, timeout=120)
  assert proc.returncode == -signal.SIGKILL
  assert open(os.path.join(tmp_path, workdir.LOCK_NAME)).read() == proc.stdout  # its PID
  with workdir.locked([str(tmp_path)]) as held:  # the dead run's PID is there; the lock is not
    assert held[0].held
