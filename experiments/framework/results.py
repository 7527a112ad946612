"""Result files of an experiment run: append-only JSONL, CSV, atomic writes.

`results.jsonl` holds one JSON object per finished point; a record is
appended as one line (a single `write` on a file opened for appending, then
fsync), never by rewriting the file, and a rerun reads it to skip finished
points. Only one run writes a workdir at a time (experiments/framework/workdir.py), so
appends never interleave. Reading is robust (`ResultStore`):

  * a torn final line (an interrupted append, a full disk, a cut copy) is
    skipped with a warning naming file and line; the run that holds the
    workdir sets it aside (`recover`: appended to `results.jsonl.corrupt`
    next to it, then cut from the store), so its point is measured again;
  * any other unreadable line stops the run: `RecordsError` names file:line;
  * several records of one point (older versions, hand-merged files)
    resolve to the newest (`measured_at`, else the later line), with a
    warning; `records()` returns one record per point.

Every other file (results.csv, report.md, config.json) is written atomically
(a temporary file in the same directory, flushed and fsynced, then
`os.replace`d over the target), so an interrupted run never leaves a
truncated one behind.
"""

from __future__ import annotations

import csv
import dataclasses
import datetime
import io
import json
import os
import platform
import tempfile
from typing import Any, Iterable, Mapping

import jax
from absl import logging

from experiments.framework import cli


def atomic_write_bytes(path: str, data: bytes) -> None:
  """Writes `data` to `path` via a temp file + fsync + rename."""
  directory = os.path.dirname(os.path.abspath(path))
  os.makedirs(directory, exist_ok=True)
  fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-", suffix=os.path.basename(path))
  try:
    with os.fdopen(fd, "wb") as f:
      f.write(data)
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, path)
  except BaseException:
    if os.path.exists(tmp):
      os.unlink(tmp)
    raise


def atomic_write_text(path: str, text: str) -> None:
  """Writes `text` (UTF-8) to `path` atomically (`atomic_write_bytes`: temp file + rename)."""
  atomic_write_bytes(path, text.encode("utf-8"))


def environment() -> dict[str, Any]:
  """The machine a result was measured on (recorded with every point)."""
  device = jax.devices()[0]
  return {
      "jax_version": jax.__version__,
      "backend": jax.default_backend(),
      "device_kind": device.device_kind,
      "device_count": jax.device_count(),
      "cpu_count": os.cpu_count(),
      "python": platform.python_version(),
      "platform": platform.platform(),
      "processor": platform.processor() or platform.machine(),
  }


class RecordsError(cli.UserError, ValueError):
  """A line of a results file that cannot be read and is not a torn final line."""


@dataclasses.dataclass(frozen=True)
class _Scan:
  """What a results file holds: `(line number, record)` in file order, and its tail."""
  records: list[tuple[int, dict[str, Any]]]
  torn: tuple[int, int, bytes] | None  # (line number, byte offset, bytes) of a torn final line
  unterminated: bool  # the last (valid) line lacks its newline


def _parse_line(raw: bytes) -> tuple[dict[str, Any] | None, str]:
  """One line -> `(record, "")`, or `(None, why it is not one)`; `why` starts with "not JSON"
  when the line does not even parse (a cut line)."""
  try:
    record = json.loads(raw.decode("utf-8"))
  except (UnicodeDecodeError, json.JSONDecodeError) as e:
    return None, f"not JSON ({e})"
  if not isinstance(record, dict) or "point" not in record:
    return None, f"not a record (a JSON object with a 'point' key): {raw[:80]!r}"
  return record, ""


def _measured_at(record: Mapping[str, Any]) -> datetime.datetime | None:
  try:
    return datetime.datetime.strptime(str(record["measured_at"]), "%Y-%m-%dT%H:%M:%S%z")
  except (KeyError, ValueError):
    return None


def _newer(new: Mapping[str, Any], old: Mapping[str, Any]) -> bool:
  """Whether `new` (a later line) replaces `old` (an earlier line) of the same point: the
  later `measured_at` wins when both have one, else the later line."""
  t_new, t_old = _measured_at(new), _measured_at(old)
  if t_new is not None and t_old is not None:
    return t_new >= t_old
  return True


class ResultStore:
  """`results.jsonl` in a workdir: one JSON object per finished point (see the module doc).

  Each record carries a `"point"` key (a string naming the sweep point);
  `done()` returns the finished ones so a rerun skips them.
  """

  def __init__(self, workdir: str, filename: str = "results.jsonl"):
    self.workdir = workdir
    self.path = os.path.join(workdir, filename)
    self.corrupt_path = self.path + ".corrupt"
    os.makedirs(workdir, exist_ok=True)
    self._warned: set[tuple[Any, ...]] = set()

  def _warn_once(self, key: tuple[Any, ...], message: str, *args: Any) -> None:
    if key not in self._warned:
      self._warned.add(key)
      logging.warning(message, *args)

  def _scan(self) -> _Scan:
    """Reads and parses the file. Raises RecordsError for an unreadable line before the last."""
    if not os.path.exists(self.path):
      return _Scan([], None, False)
    with open(self.path, "rb") as f:
      data = f.read()
    lines, offset = [], 0
    for number, raw in enumerate(data.split(b"\n"), 1):
      lines.append((number, offset, raw))
      offset += len(raw) + 1
    content = [(n, o, raw) for n, o, raw in lines if raw.strip()]
    records, torn = [], None
    for i, (number, offset, raw) in enumerate(content):
      record, why = _parse_line(raw)
      if record is not None:
        records.append((number, record))
      elif i == len(content) - 1 and why.startswith("not JSON"):
        torn = (number, offset, raw)  # a final line cut short (with or without its newline)
      else:
        raise RecordsError(f"{self.path}:{number}: {why}; only a torn final line is set aside "
                           f"automatically: repair or delete this line")
    unterminated = torn is None and bool(data) and not data.endswith(b"\n")
    return _Scan(records, torn, unterminated)

  def _lines(self) -> list[tuple[int, dict[str, Any]]]:
    """`(line number, record)` of every record, warning once about a torn final line."""
    scan = self._scan()
    if scan.torn is not None:
      number, _, raw = scan.torn
      self._warn_once(("torn", number, raw), "%s:%d: torn final line (an interrupted write) "
                      "ignored; its point counts as not measured", self.path, number)
    return scan.records

  def read(self) -> list[dict[str, Any]]:
    """Every record of the file in append order, duplicates included ([] before the first
    append). A torn final line is skipped with a warning (`recover` sets it aside).

    Raises:
      RecordsError: a line before the last is not a JSON record (names file:line).
    """
    return [record for _, record in self._lines()]

  def records(self) -> list[dict[str, Any]]:
    """One record per point: the newest where a point has several (with a warning), in the
    order of each point's first line.

    Raises:
      RecordsError: as `read`.
    """
    best: dict[str, dict[str, Any]] = {}
    lines: dict[str, list[int]] = {}
    for number, record in self._lines():
      point = record["point"]
      lines.setdefault(point, []).append(number)
      if point not in best or _newer(record, best[point]):
        best[point] = record
    for point, numbers in lines.items():
      if len(numbers) > 1:
        self._warn_once(("dup", point, tuple(numbers)), "%s: point %s has %d records (lines %s); "
                        "using the newest", self.path, point, len(numbers),
                        ", ".join(map(str, numbers)))
    return list(best.values())

  def done(self) -> set[str]:
    """The `"point"` ids already recorded (a rerun skips them)."""
    return {r["point"] for r in self.read()}

  def recover(self) -> int | None:
    """Sets a torn final line aside: appends it (plus a newline) to `<file>.corrupt`, fsyncs,
    then truncates the store before it. Also ends a valid final line that lacks its newline.
    Call it only while holding the workdir (another writer's append in progress looks torn).

    Returns:
      The line number set aside, or None when the file ended cleanly.

    Raises:
      RecordsError: as `read`.
    """
    scan = self._scan()
    if scan.unterminated:
      with open(self.path, "ab") as f:
        f.write(b"\n")
        f.flush()
        os.fsync(f.fileno())
    if scan.torn is None:
      return None
    number, offset, raw = scan.torn
    with open(self.corrupt_path, "ab") as f:
      f.write(raw + b"\n")
      f.flush()
      os.fsync(f.fileno())
    with open(self.path, "r+b") as f:
      f.truncate(offset)
      f.flush()
      os.fsync(f.fileno())
    logging.warning("%s:%d: torn final line (an interrupted write) set aside in %s; its point "
                    "will be measured again", self.path, number, self.corrupt_path)
    return number

  def append(self, record: Mapping[str, Any]) -> None:
    """Appends one JSON record as one line (one write, then fsync); the file is not rewritten.

    Only the file's last byte is read: a torn final line left by an
    earlier writer is set aside first (`recover`), so the new line never
    follows a fragment; the lines before are not re-read (a run validates
    them once, through `done()`, before its first append).

    Raises:
      ValueError: the record has no `"point"` key.
    """
    if "point" not in record:
      raise ValueError(f"record must have a 'point' key; got keys {sorted(record)}")
    line = json.dumps(record, sort_keys=True, default=_jsonable).encode("utf-8") + b"\n"
    if os.path.exists(self.path) and os.path.getsize(self.path) > 0:
      with open(self.path, "rb") as f:
        f.seek(-1, os.SEEK_END)
        if f.read(1) != b"\n":
          self.recover()
    created = not os.path.exists(self.path)
    with open(self.path, "ab") as f:
      f.write(line)
      f.flush()
      os.fsync(f.fileno())
    if created:  # make the new directory entry durable too
      fd = os.open(os.path.dirname(os.path.abspath(self.path)), os.O_RDONLY)
      try:
        os.fsync(fd)
      finally:
        os.close(fd)


def _jsonable(x: Any) -> Any:
  if hasattr(x, "tolist"):
    return x.tolist()
  if hasattr(x, "to_dict"):
    return x.to_dict()
  return str(x)


def flatten(record: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
  """Nested dicts -> dotted keys (for CSV columns)."""
  out: dict[str, Any] = {}
  for key, value in record.items():
    name = f"{prefix}{key}"
    if isinstance(value, Mapping):
      out.update(flatten(value, name + "."))
    elif isinstance(value, (list, tuple)):
      out[name] = json.dumps(value)
    else:
      out[name] = value
  return out


def write_csv(path: str, records: Iterable[Mapping[str, Any]]) -> None:
  """Writes flattened records as CSV (union of keys, first-seen order), atomically."""
  rows = [flatten(r) for r in records]
  columns: list[str] = []
  for row in rows:
    columns.extend(k for k in row if k not in columns)
  buf = io.StringIO()
  writer = csv.DictWriter(buf, fieldnames=columns)
  writer.writeheader()
  writer.writerows(rows)
  atomic_write_text(path, buf.getvalue())
