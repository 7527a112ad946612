"""One prefix cache for two worker processes (`kvattn.paging.shared`): both race on the same
prompt's pages, then a prompt worker `a` prefilled is a hit for worker `b`; every token equals
one `generate`'s and every page file left is whole and verified (`_shared_prefix_worker.py`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from kvattn.paging.shared import SharedPrefixStore

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.slow  # two processes importing JAX and compiling a batcher each: ~75 s at load 20
def test_a_prompt_worker_a_prefilled_is_a_hit_for_worker_b(tmp_path, timeout=400):
  env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
             JAX_PLATFORMS="cpu", KVATTN_WORKER_TIMEOUT=str(timeout - 30))
  procs = [subprocess.Popen([sys.executable, "-m", "tests.multiprocess._shared_prefix_worker",
                             role, str(tmp_path)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True) for role in ("a", "b")]
  outputs = []
  try:
    for proc in procs:
      outputs.append(proc.communicate(timeout=timeout))
  finally:
    for proc in procs:
      proc.kill()
  rows = {}
  for out, _ in outputs:
    for line in out.splitlines():
      if line.startswith("{"):
        row = json.loads(line)
        rows[row["role"]] = row
  assert all(p.returncode == 0 for p in procs) and len(rows) == 2 and all(
      r["ok"] for r in rows.values()), (json.dumps(rows)[-4000:] + "\n" +
                                        "\n".join(e[-2000:] for _, e in outputs))
  for row in rows.values():
    assert row["tokens"] == row["reference"], row["role"]
  assert rows["b"]["shared_pages_b"] == 3 and rows["b"]["store"]["hits"] >= 3
  assert rows["a"]["store"].get("corrupt", 0) == rows["b"]["store"].get("corrupt", 0) == 0
  # The directory holds only whole pages that pass every check, and no temporary.
  ns = [d for d in os.listdir(tmp_path) if os.path.isdir(tmp_path / d)]
  assert len(ns) == 1
  store = SharedPrefixStore(tmp_path, ns[0])
  files = store.files()
  assert files and all(store.verify(f) for f in files)
  assert not [n for _, _, names in os.walk(tmp_path) for n in names if n.endswith(".tmp")]
  # race: 4 pages, a: 4, b: 1 new (its last page): each written once or more, kept once.
  assert len(files) == 4 + 4 + 1
