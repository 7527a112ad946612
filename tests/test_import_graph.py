"""The package's import graph: no circles, and the layers import in one direction.

Edges are the imports of each module under `kvattn/` and `pallas_kernels/`, read with
`ast` (no import runs). `from pkg import name` points at `pkg.name` when that is a
module, else at `pkg`. Imports inside functions count for circles (a lazy import hides a
circle, it does not remove it); the layer test reads module-level imports only.
"""

import ast
import functools
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("kvattn", "pallas_kernels")


@functools.lru_cache(maxsize=1)
def _modules() -> dict[str, pathlib.Path]:
  found = {}
  for package in PACKAGES:
    for path in sorted((ROOT / package).rglob("*.py")):
      parts = list(path.relative_to(ROOT).with_suffix("").parts)
      if parts[-1] == "__init__":
        parts.pop()
      found[".".join(parts)] = path
  return found


def _is_package(name: str, modules) -> bool:
  return modules[name].name == "__init__.py"


def _edges(modules, lazy: bool = True) -> dict[str, set[str]]:
  return _edges_of(lazy)


@functools.lru_cache(maxsize=2)
def _edges_of(lazy: bool) -> dict[str, set[str]]:
  modules = _modules()
  edges = {}
  for name, path in modules.items():
    tree = ast.parse(path.read_text())
    base = name if _is_package(name, modules) else name.rpartition(".")[0]
    targets = set()
    for node in (ast.walk(tree) if lazy else tree.body):
      if isinstance(node, ast.Import):
        targets.update(a.name for a in node.names)
      elif isinstance(node, ast.ImportFrom):
        if node.level:
          pkg = base.split(".")
          pkg = pkg[:len(pkg) - node.level + 1]
          source = ".".join(pkg + ([node.module] if node.module else []))
        else:
          source = node.module or ""
        for alias in node.names:
          sub = f"{source}.{alias.name}"
          targets.add(sub if sub in modules else source)
    edges[name] = {t for t in targets if t in modules and t != name}
  return edges


def _cycles(edges) -> list[list[str]]:
  """Strongly connected components with more than one module (Tarjan)."""
  index, low, stack, on, out = {}, {}, [], set(), []

  def visit(v):
    index[v] = low[v] = len(index)
    stack.append(v)
    on.add(v)
    for w in sorted(edges[v]):
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      comp = []
      while True:
        w = stack.pop()
        on.discard(w)
        comp.append(w)
        if w == v:
          break
      if len(comp) > 1:
        out.append(sorted(comp))

  for v in sorted(edges):
    if v not in index:
      visit(v)
  return out


def test_graph_reads_the_packages():
  modules = _modules()
  edges = _edges(modules)
  assert "kvattn.caches.registry" in modules and "pallas_kernels" in modules
  assert "kvattn.caches.dense" in edges["kvattn.caches"]


def test_no_import_circle():
  modules = _modules()
  edges = _edges(modules)
  cycles = _cycles(edges)
  assert not cycles, f"import circles among modules: {cycles}"


@pytest.mark.parametrize("lower, upper", [
    ("pallas_kernels", "kvattn"),
    ("kvattn.caches", "kvattn.inference"),
    ("kvattn.ops", "kvattn.caches"),
    ("kvattn.ops", "kvattn.models"),
    ("kvattn.caches", "kvattn.models"),
    ("kvattn.inference", "kvattn.training"),
    ("kvattn.paging", "kvattn.inference"),
    ("kvattn.paging", "kvattn.caches"),
])
def test_layer_does_not_import_upward(lower, upper):
  modules = _modules()
  edges = _edges(modules, lazy=False)
  bad = sorted((m, t) for m, ts in edges.items() if m == lower or m.startswith(lower + ".")
               for t in ts if t == upper or t.startswith(upper + "."))
  assert not bad, f"{lower} must not import {upper} at module level: {bad}"
