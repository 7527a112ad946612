"""Multi-worker soak: thousands of requests served by several batcher processes that take them
from one shared queue directory, some cancelled, one worker killed mid-run.

    python -m experiments.benchmarks.soak_workers --requests 3000 --workers 3 --out soak.jsonl

The workload is `experiments.benchmarks.soak`'s (`make_requests`: shared system prompts,
repeats, random prompts, 1..`--max_new` greedy tokens, a `--cancel_fraction` cancelled by the
client), served by `--workers` worker processes (this module, `--role=worker`), each a
`ContinuousBatcher` of `soak.make_batcher` (the tiny random model of `--seed`, prefix cache, a
host and a disk tier of its own) -- separate JAX runtimes that share only a directory:

  queue/<rid>.json     a request (prompt, max_new), written by the driver (write, then rename)
  claimed/<w>/<rid>.json   taken by worker w: `os.rename` out of queue/ (atomic: one worker
                       wins a request, the others get FileNotFoundError)
  cancel/<rid>         the client cancelled it: the driver drops it if still queued (a rename
                       into dropped/), else the worker holding it cancels it (live:
                       `ContinuousBatcher.cancel`; claimed, not yet admitted: dropped)
  done/<rid>.json      its final record (tokens, reason, worker): `os.link` of a temporary file,
                       which fails if one exists -- a second final goes to dup/ instead
  stop                 the driver's: every request has its final record

The driver (this process) keeps at most `--backlog` requests queued, writes a request's cancel
marker once `cancel_wait` more requests have been submitted after it (`soak.make_requests`'s
cancelled-while-waiting half: most are still queued) or, for the other half (`cancel_run`),
once a worker has claimed it and `cancel_run` more requests are done (most are live), and,
with `--kill_after` > 0, kills worker 0 with SIGKILL once that many requests are done: the
requests it held and had not finished go back to queue/ (a recompute elsewhere; a worker
writes nothing but final records, so nothing of the dead one's work survives to duplicate).
"out_of_pages" preemptions are resubmitted by the worker itself (prompt + tokens so far, at the
head of its own queue), as in `soak.serve`.

Checked, and reported in one JSON line (printed, and appended to `--out`):

  requests, finished           per final reason ("length", "cancelled")
  cancel_requested, cancelled_queued   cancel markers written; requests the driver dropped
                               from the queue (the rest were cancelled by a worker, or had
                               finished first)
  lost                         requests with no final record: must be 0
  duplicated                   final records beyond the first (dup/): must be 0
  wrong                        requests whose tokens differ from `kvattn.generate` of the
                               prompt alone (`soak.alone`; a cancelled one: not a prefix):
                               must be 0 (`--check` of them, 0 = all)
  by_worker                    final records per worker
  requeued                     requests taken back from the killed worker
  wall_s                       from the first request queued to the last final record
  worker_exit_codes            the killed worker's is -9, the others' 0

Exit status 1 (after the line) if `lost`, `duplicated` or `wrong` is not 0.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

import numpy as np

from experiments.benchmarks import soak
from experiments.framework import cli


def _write(path: str, payload: dict) -> None:
  tmp = f"{path}.{os.getpid()}.tmp"
  with open(tmp, "w", encoding="utf-8") as f:
    json.dump(payload, f)
  os.replace(tmp, path)


def _read(path: str) -> dict:
  with open(path, encoding="utf-8") as f:
    return json.load(f)


def _name(rid: int) -> str:
  return f"{rid:08d}.json"


# ----------------------------------------------------------------------------------------------
# A worker.


class Worker:
  """One worker process's loop over the shared directory (module doc)."""

  def __init__(self, directory: str, index: int, config: soak.SoakConfig):
    from experiments.evals import models  # pylint: disable=g-import-not-at-top
    self.dir, self.index = directory, index
    self.claimed = os.path.join(directory, "claimed", str(index))
    os.makedirs(self.claimed, exist_ok=True)
    disk = os.path.join(directory, "disk", str(index))
    self.batcher = soak.make_batcher(models.tiny_model(config.seed), config, disk)
    self.pending: collections.deque = collections.deque()  # (rid, prompt, max_new, got)
    self.tokens: dict[int, list[int]] = {}  # tokens of live or preempted requests

  def _cancelled(self, rid: int) -> bool:
    return os.path.exists(os.path.join(self.dir, "cancel", str(rid)))

  def _final(self, rid: int, tokens: list[int], reason: str) -> None:
    """Publishes `rid`'s final record once; a second one goes to dup/."""
    path = os.path.join(self.dir, "done", _name(rid))
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
      json.dump(dict(rid=rid, tokens=tokens, reason=reason, worker=self.index), f)
    try:
      os.link(tmp, path)
    except FileExistsError:
      os.replace(tmp, os.path.join(self.dir, "dup", f"{rid}.{self.index}.{time.time_ns()}"))
    else:
      os.unlink(tmp)
    os.unlink(os.path.join(self.claimed, _name(rid)))
    self.tokens.pop(rid, None)

  def _record(self, f) -> None:
    rid = f.request_id
    got = self.tokens.setdefault(rid, [])
    got.extend(int(t) for t in f.tokens)
    if f.reason == "out_of_pages":  # resubmitted here: prompt + tokens so far
      prompt, max_new = self._requests[rid]
      self.pending.appendleft((rid, np.concatenate([prompt, np.asarray(got, np.int32)]),
                               max_new - len(got)))
    else:
      self._final(rid, got, f.reason)

  def _claim(self) -> bool:
    """Takes the lowest-numbered queued request, if any (False when the queue is empty)."""
    queue = os.path.join(self.dir, "queue")
    for name in sorted(n for n in os.listdir(queue) if n.endswith(".json")):
      try:
        os.rename(os.path.join(queue, name), os.path.join(self.claimed, name))
      except FileNotFoundError:
        continue  # another worker (or the driver's cancellation) took it
      req = _read(os.path.join(self.claimed, name))
      prompt = np.asarray(req["prompt"], np.int32)
      self._requests[req["rid"]] = (prompt, req["max_new"])
      self.pending.append((req["rid"], prompt, req["max_new"]))
      return True
    return False

  def run(self) -> None:
    self._requests: dict[int, tuple[np.ndarray, int]] = {}
    stop = os.path.join(self.dir, "stop")
    while True:
      for rid in [r for r in self.batcher.active if self._cancelled(r)]:
        self._record(self.batcher.cancel(rid))
      for item in [p for p in self.pending if self._cancelled(p[0])]:
        self.pending.remove(item)
        self._final(item[0], self.tokens.get(item[0], []), "cancelled")
      if not self.pending:
        self._claim()
      while self.pending and self.batcher.can_add(len(self.pending[0][1])):
        rid, prompt, max_new = self.pending.popleft()
        result = self.batcher.add(rid, prompt, max_new)
        if not isinstance(result, int):
          self._record(result)
        if not self.pending:
          self._claim()
      if self.pending and not self.batcher.active:
        raise RuntimeError(f"request {self.pending[0][0]} can never join this worker's pool")
      if self.batcher.active:
        for f in self.batcher.step():
          self._record(f)
      elif os.path.exists(stop):
        return
      else:
        time.sleep(0.01)


# ----------------------------------------------------------------------------------------------
# The driver.


def _spawn(directory: str, index: int, args) -> subprocess.Popen:
  flags = [f"--{f.name}={getattr(args, f.name)}" for f in dataclasses.fields(soak.SoakConfig)]
  # One persistent compilation cache for the workers: the first to compile a program stores it,
  # the others load it (the workers run the same programs).
  env = dict(os.environ, JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"),
             JAX_COMPILATION_CACHE_DIR=os.path.join(directory, "jax_cache"),
             JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
             JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
  return subprocess.Popen(
      [sys.executable, "-m", "experiments.benchmarks.soak_workers", "--role=worker",
       f"--dir={directory}", f"--index={index}", *flags], env=env)


def drive(args, config: soak.SoakConfig, directory: str) -> dict[str, Any]:
  """Runs the workers over `config`'s requests (module doc); the record, without the token
  check."""
  for sub in ("queue", "claimed", "cancel", "done", "dup", "dropped"):
    os.makedirs(os.path.join(directory, sub), exist_ok=True)
  requests = soak.make_requests(config)
  workers = [_spawn(directory, i, args) for i in range(args.workers)]
  path = lambda sub, rid: os.path.join(directory, sub, _name(rid))
  cancels: list[tuple[int, int]] = []  # (submissions after which to cancel, rid)
  running: list[tuple[int, int]] = []  # (rid, requests done after its claim to cancel it)
  cancels_done: list[tuple[int, int]] = []  # (requests done after which to cancel, rid)
  dropped: set[int] = set()
  requeued, killed, submitted = 0, False, 0
  start = time.perf_counter()
  try:
    while True:
      done = sum(n.endswith(".json") for n in os.listdir(os.path.join(directory, "done")))
      if done + len(dropped) >= len(requests):
        break
      for p in workers:
        if p.poll() not in (None, -signal.SIGKILL):
          raise RuntimeError(f"a worker exited with {p.returncode}")
      queued = len(os.listdir(os.path.join(directory, "queue")))
      while submitted < len(requests) and queued < args.backlog:
        r = requests[submitted]
        _write(path("queue", r.rid), dict(rid=r.rid, prompt=r.prompt.tolist(),
                                          max_new=r.max_new))
        if r.cancel_wait is not None:
          cancels.append((submitted + r.cancel_wait, r.rid))
        elif r.cancel_run is not None:
          running.append((r.rid, r.cancel_run))
        submitted += 1
        queued += 1
      for rid, wait in [c for c in running if not os.path.exists(path("queue", c[0]))]:
        running.remove((rid, wait))  # claimed: cancel it once `wait` more are done
        cancels_done.append((done + wait, rid))
      due = [c for c in cancels if c[0] <= submitted or submitted == len(requests)]
      due_done = [c for c in cancels_done if c[0] <= done]
      for c in due:
        cancels.remove(c)
      for c in due_done:
        cancels_done.remove(c)
      for _, rid in due + due_done:
        with open(os.path.join(directory, "cancel", str(rid)), "w", encoding="utf-8"):
          pass
        try:  # still queued: the driver drops it
          os.rename(path("queue", rid), path("dropped", rid))
          dropped.add(rid)
        except FileNotFoundError:
          pass  # a worker holds it (or it is done)
      if args.kill_after and not killed and done >= args.kill_after:
        workers[0].send_signal(signal.SIGKILL)
        workers[0].wait()
        killed = True
        held = os.path.join(directory, "claimed", "0")
        for name in os.listdir(held):
          if name.endswith(".json") and not os.path.exists(
              os.path.join(directory, "done", name)):
            os.rename(os.path.join(held, name), os.path.join(directory, "queue", name))
            requeued += 1
      time.sleep(0.02)
    wall = time.perf_counter() - start
    with open(os.path.join(directory, "stop"), "w", encoding="utf-8"):
      pass
    codes = [p.wait(timeout=args.timeout) for p in workers]
  finally:
    for p in workers:
      if p.poll() is None:
        p.kill()
  finals = {}
  for name in os.listdir(os.path.join(directory, "done")):
    if name.endswith(".json"):
      rec = _read(os.path.join(directory, "done", name))
      finals[rec["rid"]] = rec
  for rid in dropped:
    finals.setdefault(rid, dict(rid=rid, tokens=[], reason="cancelled", worker="driver"))
  return dict(
      requests=len(requests), workers=args.workers,
      finished=dict(collections.Counter(f["reason"] for f in finals.values())),
      cancel_requested=sum(r.cancel_wait is not None or r.cancel_run is not None
                           for r in requests),
      cancelled_queued=len(dropped),
      lost=sum(r.rid not in finals for r in requests),
      duplicated=len(os.listdir(os.path.join(directory, "dup"))),
      by_worker=dict(collections.Counter(str(f["worker"]) for f in finals.values())),
      requeued=requeued, killed_worker=0 if killed else None,
      worker_exit_codes=codes, wall_s=round(wall, 2),
      tokens_generated=sum(len(f["tokens"]) for f in finals.values()),
      _finals=finals, _requests=requests)


def check(record: dict[str, Any], config: soak.SoakConfig) -> dict[str, Any]:
  """Adds `checked` and `wrong` (module doc) to `record`; drops its private fields."""
  from experiments.evals import models  # pylint: disable=g-import-not-at-top
  model = models.tiny_model(config.seed)
  finals, requests = record.pop("_finals"), record.pop("_requests")
  chosen = list(requests)
  if config.check and config.check < len(chosen):
    pick = np.random.default_rng(config.seed + 1).choice(len(chosen), config.check,
                                                         replace=False)
    chosen = [chosen[i] for i in sorted(pick)]
  wrong = []
  for r in chosen:
    f = finals.get(r.rid)
    if f is None:
      continue  # counted as lost
    want = soak.alone(model, r.prompt, config.max_new, config.max_len)[:r.max_new].tolist()
    full = f["reason"] == "length"
    if (full and f["tokens"] != want) or want[:len(f["tokens"])] != f["tokens"]:
      wrong.append(r.rid)
  record.update(checked=len(chosen), wrong=len(wrong), wrong_ids=wrong[:10])
  return record


def main(argv=None) -> int:
  """The driver (default) or one worker (`--role=worker`); see the module doc."""
  p = cli.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--role", default="driver", choices=("driver", "worker"))
  p.add_argument("--dir", default=None, help="the shared directory (default: a temporary one)")
  p.add_argument("--index", type=int, default=0, help="worker index")
  p.add_argument("--workers", type=int, default=3)
  p.add_argument("--backlog", type=int, default=32, help="requests queued at most")
  p.add_argument("--kill_after", type=int, default=0,
                 help="SIGKILL worker 0 once this many requests are done (0: never)")
  p.add_argument("--timeout", type=float, default=600.0, help="seconds a worker may take to stop")
  p.add_argument("--out", default=None, help="JSON lines file the record is appended to")
  defaults = soak.SoakConfig()
  for field in dataclasses.fields(soak.SoakConfig):
    p.add_argument(f"--{field.name}", type=type(getattr(defaults, field.name)),
                   default=getattr(defaults, field.name))
  args = p.parse_args(argv)
  config = soak.SoakConfig(**{f.name: getattr(args, f.name)
                              for f in dataclasses.fields(soak.SoakConfig)})
  if args.role == "worker":
    Worker(args.dir, args.index, config).run()
    return 0
  if args.workers < 1 or (args.kill_after and args.workers < 2):
    p.error(f"--workers must be >= 1 (>= 2 with --kill_after); got {args.workers}")
  with tempfile.TemporaryDirectory(prefix="kvattn-soak-workers-") as tmp:
    record = drive(args, config, args.dir or tmp)
  record = check(record, config)
  record.update(config=dataclasses.asdict(config), kill_after=args.kill_after,
                backlog=args.backlog, cpu_count=os.cpu_count(), machine=platform.machine(),
                load_avg_1min=round(os.getloadavg()[0], 2))
  line = json.dumps(record)
  print(line, flush=True)
  if args.out:
    with open(args.out, "a", encoding="utf-8") as f:
      f.write(line + "\n")
  return 1 if record["lost"] or record["duplicated"] or record["wrong"] else 0


if __name__ == "__main__":
  cli.run_plain(main)
