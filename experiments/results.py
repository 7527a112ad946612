"""Result files of an experiment run: append-only JSONL, CSV, atomic writes.

Every file is written atomically (a temporary file in the same directory,
flushed and fsynced, then `os.replace`d over the target), so an interrupted
run never leaves a truncated file behind: at worst the point in progress is
lost. `results.jsonl` holds one JSON object per finished point and is only
ever extended; a rerun reads it to skip finished points.
"""

from __future__ import annotations

import csv
import io
import json
import os
import platform
import tempfile
from typing import Any, Iterable, Mapping

import jax


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


class ResultStore:
  """`results.jsonl` in a workdir: one JSON object per finished point.

  Each record carries a `"point"` key (a string naming the sweep point);
  `done()` returns the finished ones so a rerun skips them. `append` rewrites
  the file atomically with the new line added, so the file is always a
  complete prefix of the run.
  """

  def __init__(self, workdir: str, filename: str = "results.jsonl"):
    self.workdir = workdir
    self.path = os.path.join(workdir, filename)
    os.makedirs(workdir, exist_ok=True)

  def records(self) -> list[dict[str, Any]]:
    """Every record of the store, in append order ([] before the first append)."""
    if not os.path.exists(self.path):
      return []
    with open(self.path, encoding="utf-8") as f:
      return [json.loads(line) for line in f if line.strip()]

  def done(self) -> set[str]:
    """The `"point"` ids already recorded (a rerun skips them)."""
    return {r["point"] for r in self.records() if "point" in r}

  def append(self, record: Mapping[str, Any]) -> None:
    """Appends one JSON record atomically. Raises ValueError without a `"point"` key."""
    if "point" not in record:
      raise ValueError(f"record must have a 'point' key; got keys {sorted(record)}")
    existing = b""
    if os.path.exists(self.path):
      with open(self.path, "rb") as f:
        existing = f.read()
    if existing and not existing.endswith(b"\n"):
      existing += b"\n"
    line = json.dumps(record, sort_keys=True, default=_jsonable).encode("utf-8") + b"\n"
    atomic_write_bytes(self.path, existing + line)


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
