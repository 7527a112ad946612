"""Save and restore KV caches with orbax-checkpoint (resuming from them: `kvattn.inference.resume`).
"""

from __future__ import annotations

import collections
import os
from typing import Any, Hashable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from kvattn import _checks
from kvattn import _multihost
from kvattn.paging.allocator import PageAllocator, pages_for
from kvattn.caches import capabilities
from kvattn.paging.prefix import PrefixCachingAllocator

FORMAT_VERSION = 1
COMMIT_MARKER = "commit_success.txt"
"""The file orbax writes last, when it finalizes a checkpoint (kept also on local disks)."""


def _ocp():
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top  (0.2 s; on first use)
  return ocp


def _kind(cache: Any) -> str:
  return f"{type(cache).__module__}.{type(cache).__qualname__}"


def _as_tuple(caches: Any) -> tuple[Any, ...]:
  return tuple(caches) if isinstance(caches, (tuple, list)) else (caches,)


def _leaf_specs(caches: Sequence[Any]) -> list[dict[str, Any]]:
  specs = []
  for i, cache in enumerate(caches):
    for path, leaf in jax.tree_util.tree_flatten_with_path(cache)[0]:
      specs.append({"cache": i, "path": jax.tree_util.keystr(path),
                    "shape": list(np.shape(leaf)), "dtype": str(jnp.asarray(leaf).dtype)})
  return specs


def _bits(x: Any) -> np.ndarray:
  """The raw bits of `x` as an unsigned-integer numpy array of the same shape."""
  arr = np.ascontiguousarray(_multihost.host_array(x))
  return arr.view(f"u{arr.dtype.itemsize}") if arr.dtype.itemsize > 0 else arr


def allocator_state(allocator: PageAllocator) -> dict[str, Any]:
  """A JSON-serialisable snapshot of `allocator` (sizes, free list, pages and
  tokens of every live sequence).

  Raises:
    TypeError: a live sequence id that is not a str or int (JSON keys).
  """
  live = []
  for seq_id in allocator.live:
    if isinstance(seq_id, bool) or not isinstance(seq_id, (str, int, np.integer)):
      raise TypeError(f"seq_id must be a str or int to be saved; got {seq_id!r}")
    live.append([seq_id if isinstance(seq_id, str) else int(seq_id),
                 [int(p) for p in allocator.pages(seq_id)], allocator.num_tokens(seq_id)])
  free = [int(p) for p in allocator._free]  # pylint: disable=protected-access
  prefix = isinstance(allocator, PrefixCachingAllocator)
  if prefix:  # unreferenced cached pages are saved as free (the prefix index is not saved)
    free = [int(p) for p in allocator._lru][::-1] + free  # pylint: disable=protected-access
  return {"kind": "prefix" if prefix else "plain", "num_pages": allocator.num_pages,
          "page_size": allocator.page_size, "max_pages_per_seq": allocator.max_pages_per_seq,
          "free": free, "live": live}


def _int(name: str, value: Any, low: int, high: int | None = None) -> int:
  """`value` if it is an int in `[low, high]`, else ValueError naming `name`."""
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
    raise ValueError(f"{name} must be an int; got {value!r}")
  if value < low or (high is not None and value > high):
    bound = f">= {low}" if high is None else f"in [{low}, {high}]"
    raise ValueError(f"{name} = {value} must be {bound}")
  return int(value)


def check_allocator_state(state: Any) -> None:
  """Checks a saved `allocator_state` before anything is built from it.

  Raises:
    ValueError: naming the key: sizes that are not positive ints, a page outside the pool, a page
      twice on the free list or in one sequence, a page both free and held, a page held by two
      sequences of a plain `PageAllocator` (only a `PrefixCachingAllocator` shares), pages that do
      not match a sequence's token count, or pages neither free nor held (lost).
  """
  if not isinstance(state, dict) or not {"kind", "num_pages", "page_size", "max_pages_per_seq",
                                         "free", "live"} <= set(state):
    raise ValueError(f"allocator must be a saved allocator_state; got {state!r:.200}")
  if state["kind"] not in ("plain", "prefix"):
    raise ValueError(f"allocator.kind must be 'plain' or 'prefix'; got {state['kind']!r}")
  num_pages = _int("allocator.num_pages", state["num_pages"], 1)
  page_size = _int("allocator.page_size", state["page_size"], 1)
  width = _int("allocator.max_pages_per_seq", state["max_pages_per_seq"], 1)
  if not isinstance(state["free"], list) or not isinstance(state["live"], list):
    raise ValueError("allocator.free and allocator.live must be lists")
  where: dict[int, str] = {}  # page -> where it was first seen
  for i, page in enumerate(state["free"]):
    page = _int(f"allocator.free[{i}]", page, 0, num_pages - 1)
    if page in where:
      raise ValueError(f"allocator.free[{i}] = {page} is already at {where[page]}")
    where[page] = f"allocator.free[{i}]"
  ids = set()
  for i, entry in enumerate(state["live"]):
    if not (isinstance(entry, list) and len(entry) == 3 and isinstance(entry[1], list)):
      raise ValueError(f"allocator.live[{i}] must be [seq_id, pages, tokens]; got {entry!r:.200}")
    seq_id, pages, tokens = entry
    if isinstance(seq_id, bool) or not isinstance(seq_id, (str, int)) or seq_id in ids:
      raise ValueError(f"allocator.live[{i}] seq_id must be a new str or int; got {seq_id!r}")
    ids.add(seq_id)
    name = f"allocator.live[{i}] ({seq_id!r})"
    tokens = _int(f"{name} tokens", tokens, 0, width * page_size)
    if len(pages) != pages_for(tokens, page_size):
      raise ValueError(f"{name} holds {len(pages)} pages for {tokens} tokens; pages of "
                       f"{page_size} tokens need {pages_for(tokens, page_size)}")
    own = set()
    for j, page in enumerate(pages):
      page = _int(f"{name} pages[{j}]", page, 0, num_pages - 1)
      if page in own:
        raise ValueError(f"{name} pages[{j}] = {page} is already one of its pages")
      own.add(page)
      seen = where.get(page)
      if seen is not None and (seen.startswith("allocator.free") or state["kind"] == "plain"):
        raise ValueError(f"{name} pages[{j}] = {page} is already at {seen} (a page is free or "
                         "held; only a PrefixCachingAllocator shares held pages)")
      where.setdefault(page, f"{name} pages[{j}]")
  lost = sorted(set(range(num_pages)) - set(where))
  if lost:
    raise ValueError(f"allocator pages {lost[:8]} are neither free nor held by a live sequence "
                     f"(lost); num_pages = {num_pages}")


def allocator_from_state(state: dict[str, Any]) -> PageAllocator:
  """The allocator `allocator_state` described (same kind, free-list order, pages and token counts;
  a `PrefixCachingAllocator` with its refcounts and an empty prefix index), checked first
  (`check_allocator_state`) and then with its `check`.

  Raises:
    ValueError: a state that breaks the allocator's invariants, naming the key.
  """
  check_allocator_state(state)
  cls = PrefixCachingAllocator if state.get("kind") == "prefix" else PageAllocator
  alloc = cls(state["num_pages"], state["page_size"], state["max_pages_per_seq"])
  alloc._free = [int(p) for p in state["free"]]  # pylint: disable=protected-access
  for seq_id, pages, tokens in state["live"]:
    alloc._pages[seq_id] = [int(p) for p in pages]  # pylint: disable=protected-access
    alloc._tokens[seq_id] = int(tokens)  # pylint: disable=protected-access
    if cls is PrefixCachingAllocator:
      alloc._ref[pages] += 1  # pylint: disable=protected-access
      alloc._registered[seq_id] = (0, None)  # pylint: disable=protected-access
  try:
    alloc.check()
  except RuntimeError as e:
    raise ValueError(f"allocator: {e}") from None
  return alloc


def save_caches(path: str | os.PathLike, caches: Any, *, allocator: PageAllocator | None = None,
                tokens: dict[Hashable, Sequence[int]] | Sequence[Sequence[int]] | None = None,
                extra: dict[str, Any] | None = None) -> None:
  """Writes `caches` (one cache or a sequence of per-layer caches) to `path`, atomically.

  Args:
    path: directory to create; must not exist yet.
    caches: a cache pytree or a tuple/list of them (a model's per-layer caches).
    allocator: the `PageAllocator` of a paged pool, saved with its state.
    tokens: token ids the caches hold, per batch row (list of lists) or per sequence id (dict), for
      `resume` / `reusable_length`.
    extra: more JSON-serialisable metadata.

  Raises:
    ValueError: `path` exists.
    TypeError: metadata that is not JSON-serialisable (nothing restorable is left at `path`).
  """
  ocp = _ocp()
  path = os.path.abspath(os.fspath(path))
  if os.path.exists(path):
    raise ValueError(f"path must not exist yet (checkpoints are never overwritten); got {path}")
  caches = _as_tuple(caches)
  leaves = [_bits(x) for c in caches for x in jax.tree_util.tree_leaves(c)]
  if isinstance(tokens, dict):
    tokens = {"by_id": [[k, [int(t) for t in v]] for k, v in tokens.items()]}
  elif tokens is not None:
    tokens = {"by_row": [[int(t) for t in row] for row in tokens]}
  meta = {"format_version": FORMAT_VERSION, "kinds": [_kind(c) for c in caches],
          "structures": [str(jax.tree_util.tree_structure(c)) for c in caches],
          "leaves": _leaf_specs(caches), "tokens": tokens,
          "allocator": None if allocator is None else allocator_state(allocator),
          "extra": extra or {}}
  checkpointer = ocp.Checkpointer(ocp.CompositeCheckpointHandler())
  checkpointer.save(path, args=ocp.args.Composite(
      arrays=ocp.args.StandardSave({f"leaf_{i:05d}": x for i, x in enumerate(leaves)}),
      meta=ocp.args.JsonSave(meta)))


def is_complete(path: str | os.PathLike) -> bool:
  """True if `path` is a finalized orbax checkpoint (a save that ran to its end)."""
  ocp = _ocp()
  path = os.fspath(path)
  return (os.path.isdir(path) and not ocp.utils.is_tmp_checkpoint(path)
          and ocp.utils.is_checkpoint_finalized(path)
          and os.path.exists(os.path.join(path, COMMIT_MARKER)))


def read_metadata(path: str | os.PathLike) -> dict[str, Any]:
  """The JSON metadata of a complete checkpoint (kinds, leaves, tokens, allocator, extra).

  Raises:
    ValueError: `path` is missing or not a finalized checkpoint.
  """
  ocp = _ocp()
  path = os.path.abspath(os.fspath(path))
  if not is_complete(path):
    raise ValueError(f"path must be a complete cache checkpoint; {path} is missing or was never "
                     "finalized (an interrupted save)")
  checkpointer = ocp.Checkpointer(ocp.CompositeCheckpointHandler())
  return checkpointer.restore(path, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]


def _check_template(meta: dict[str, Any], like: tuple[Any, ...], path: str) -> None:
  kinds = [_kind(c) for c in like]
  if len(kinds) != len(meta["kinds"]):
    raise ValueError(f"checkpoint {path} holds {len(meta['kinds'])} caches but the template has "
                     f"{len(kinds)}")
  for i, (want, got) in enumerate(zip(meta["kinds"], kinds)):
    if want != got:
      raise ValueError(f"cache {i}: checkpoint {path} holds a {want} but the template is a {got}")
  specs = _leaf_specs(like)
  saved = {(s["cache"], s["path"]): s for s in meta["leaves"]}
  have = {(s["cache"], s["path"]): s for s in specs}
  for key in sorted(set(saved) ^ set(have)):
    where = "checkpoint" if key in saved else "template"
    raise ValueError(f"cache {key[0]}: leaf {key[1]} is only in the {where} (quantized scales "
                     f"or another layout?); checkpoint {path}")
  for key, spec in have.items():
    for field in ("shape", "dtype"):
      if saved[key][field] != spec[field]:
        raise ValueError(f"cache {key[0]}{key[1]}: {field} mismatch: checkpoint {path} has "
                         f"{saved[key][field]}, template has {spec[field]}")
  for i, (want, cache) in enumerate(zip(meta.get("structures", []), like)):
    got = str(jax.tree_util.tree_structure(cache))
    if want != got:  # same arrays, other static fields (e.g. a policy or a RoPE setting)
      raise ValueError(f"cache {i}: static fields differ: checkpoint {path} has {want}, "
                       f"template has {got}")


def restore_caches(path: str | os.PathLike, like: Any
                   ) -> tuple[Any, PageAllocator | None, Any]:
  """Reads a checkpoint written by `save_caches` into the structure of `like`.

  Args:
    path: the checkpoint directory.
    like: caches of the saved kinds, shapes and dtypes (contents ignored), one or a tuple/list as
      saved; restored arrays go to `like`'s devices.

  Returns:
    `(caches, allocator or None, tokens or None)`: caches in `like`'s form
    (one cache or a tuple), the saved allocator rebuilt, and the saved token
    ids (list of rows, or dict by sequence id).

  Raises:
    ValueError: an incomplete checkpoint (interrupted save), one whose cache kinds, leaves, shapes
      or dtypes differ from `like` (the message names the first difference), or one whose values
      break a cache's, the allocator's or the tokens' invariants (`check_values`,
      `check_allocator_state`; the message names the layer and leaf). Nothing of such a checkpoint
      is returned.
  """
  ocp = _ocp()
  path = os.path.abspath(os.fspath(path))
  meta = read_metadata(path)
  single = not isinstance(like, (tuple, list))
  like = _as_tuple(like)
  _check_template(meta, like, path)
  flat = [x for c in like for x in jax.tree_util.tree_leaves(c)]
  abstract = {}
  for n, x in enumerate(flat):
    dtype = jnp.asarray(x).dtype
    abstract[f"leaf_{n:05d}"] = jax.ShapeDtypeStruct(np.shape(x), np.dtype(f"u{dtype.itemsize}"))
  checkpointer = ocp.Checkpointer(ocp.CompositeCheckpointHandler())
  bits = checkpointer.restore(path, args=ocp.args.Composite(
      arrays=ocp.args.StandardRestore(abstract)))["arrays"]
  result, n = [], 0
  for cache in like:
    leaves, treedef = jax.tree_util.tree_flatten(cache)
    new = []
    for x in leaves:
      value = np.asarray(bits[f"leaf_{n:05d}"]).view(jnp.asarray(x).dtype)
      new.append(_multihost.put(value, x.sharding) if isinstance(x, jax.Array)
                 else jnp.asarray(value))
      n += 1
    result.append(jax.tree_util.tree_unflatten(treedef, new))
  try:
    alloc = None if meta.get("allocator") is None else allocator_from_state(meta["allocator"])
    tokens = _read_tokens(meta.get("tokens"))
    check_values(result, alloc, tokens)
  except ValueError as e:
    raise ValueError(f"checkpoint {path}: {e}") from None
  return (result[0] if single else tuple(result)), alloc, tokens


def _read_tokens(saved: Any) -> list[list[int]] | dict[Any, list[int]] | None:
  """The saved `tokens` (rows, or a dict by sequence id), checked to be lists of ints."""
  if saved is None:
    return None
  if not isinstance(saved, dict) or len(saved) != 1 or not isinstance(
      saved.get("by_row", saved.get("by_id")), list):
    raise ValueError(f"tokens must be saved as by_row or by_id lists; got {saved!r:.200}")
  rows = saved.get("by_row", saved.get("by_id"))
  if "by_id" in saved:
    if any(not (isinstance(e, list) and len(e) == 2) for e in rows):
      raise ValueError("tokens.by_id must be [seq_id, ids] pairs")
    names, rows = [f"tokens[{k!r}]" for k, _ in saved["by_id"]], [v for _, v in saved["by_id"]]
  else:
    names = [f"tokens[{b}]" for b in range(len(rows))]
  for name, row in zip(names, rows):
    if not isinstance(row, list):
      raise ValueError(f"{name} must be a list of token ids; got {row!r:.100}")
    for t, token in enumerate(row):
      _int(f"{name}[{t}]", token, 0)
  return rows if "by_row" in saved else {k: v for k, v in saved["by_id"]}


def check_values(caches: Sequence[Any], allocator: PageAllocator | None = None,
                 tokens: Any = None) -> None:
  """Checks restored per-layer `caches` against themselves, `allocator` and `tokens`.

  Raises:
    ValueError: naming the layer, leaf and entry.
  """
  for i, cache in enumerate(caches):
    check = getattr(cache, "check_state", None)
    if callable(check):
      check(f"layer {i}")
    elif hasattr(cache, "lengths"):
      _checks.values_in_range(f"layer {i} lengths", cache.lengths, 0)
  holders = None
  if allocator is not None:
    holders = collections.Counter(p for s in allocator.live for p in allocator.pages(s))
  for i, cache in enumerate(caches):
    if capabilities.paged(cache):
      _check_shared_pages(f"layer {i}", cache, allocator, holders)
  if isinstance(tokens, list):
    for i, cache in enumerate(caches):
      if not hasattr(cache, "lengths"):
        continue
      lengths = _multihost.host_array(cache.lengths)
      if len(tokens) != lengths.shape[0]:
        raise ValueError(f"tokens holds {len(tokens)} rows, but layer {i} has batch "
                         f"{lengths.shape[0]}")
      for b, row in enumerate(tokens):
        if len(row) != lengths[b]:
          raise ValueError(f"tokens[{b}] holds {len(row)} ids, but layer {i} lengths[{b}] = "
                           f"{int(lengths[b])}")


def _check_shared_pages(name: str, cache: Any, allocator: PageAllocator | None,
                        holders: collections.Counter | None) -> None:
  if allocator is not None and (allocator.num_pages, allocator.page_size) != (
      cache.num_pages, cache.page_size):
    raise ValueError(f"allocator num_pages, page_size = {allocator.num_pages}, "
                     f"{allocator.page_size}, but {name} has a pool of {cache.num_pages} pages "
                     f"of {cache.page_size} tokens")
  tables = _multihost.host_array(cache.block_tables)
  assigned = (tables >= 0) & (tables < cache.num_pages)
  pages, counts = np.unique(tables[assigned], return_counts=True)
  for page, count in zip(pages.tolist(), counts.tolist()):
    allowed = 1 if holders is None else holders.get(page, 0)
    if count <= allowed:
      continue
    at = [tuple(int(x) for x in loc) for loc in np.argwhere(assigned & (tables == page))]
    if holders is None:
      raise ValueError(f"{name} block_tables{list(at[0])} and {list(at[1])} both hold page "
                       f"{page}; rows share pages only as a saved PrefixCachingAllocator says")
    if allowed == 0:
      raise ValueError(f"{name} block_tables{list(at[0])} = {page}, a page the saved allocator "
                       "has free (no live sequence holds it)")
    raise ValueError(f"{name} block_tables hold page {page} {count} times (at {at}), but the "
                     f"saved allocator gives it to {allowed} live sequence(s)")
