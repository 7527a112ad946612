"""Save and restore KV caches with orbax-checkpoint (resuming from them: `kvattn.inference.resume`).

`save_caches(path, caches, allocator=, tokens=)` writes any pytree of caches
(a model's tuple of per-layer `KVCache`, `PagedKVCache`, `LatentCache`,
quantized ones with their scales, or any other registered cache kind) and,
optionally, the `PageAllocator` that hands out a paged pool's pages (a
`PrefixCachingAllocator` keeps its shared pages and refcounts; its
unreferenced cached pages are saved as free and its prefix index is rebuilt
by `register`) and the token ids the caches hold. `restore_caches(path, like)` reads it back into
the structure of `like` (a template: freshly built caches of the same kinds
and shapes).

Bit-exact: every array leaf is stored as its raw bits (viewed as an unsigned
integer of its width, so bf16, fp8 and NaN payloads survive whatever the
storage format makes of floats) and viewed back on restore.

Atomic: orbax writes into a temporary directory and renames it into place
with a commit marker only when everything is written (its "finalize");
`restore_caches` refuses a directory that orbax does not report finalized or
that lacks the marker, so an interrupted save never leaves a checkpoint that
restores (what it leaves is a `<path>.orbax-checkpoint-tmp*` directory).

Mismatches: the checkpoint records, per cache, its kind (class name) and,
per leaf, its pytree path, shape and dtype; restoring into a template that
differs in any of them raises ValueError naming the first difference.
"""

from __future__ import annotations

import os
from typing import Any, Hashable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from kvattn.paging.allocator import PageAllocator
from kvattn.caches.dense import KVCache, LatentCache
from kvattn.caches.paged import PagedKVCache
from kvattn.paging.prefix import PrefixCachingAllocator

FORMAT_VERSION = 1
COMMIT_MARKER = "commit_success.txt"
"""The file orbax writes last, when it finalizes a checkpoint (kept also on local disks)."""
TRUNCATABLE = (KVCache, LatentCache, PagedKVCache)
"""Kinds that keep token t in slot t, so shortening `lengths` truncates them."""


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
  arr = np.ascontiguousarray(np.asarray(x))
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


def allocator_from_state(state: dict[str, Any]) -> PageAllocator:
  """The allocator `allocator_state` described (same kind, free-list order,
  pages and token counts; a `PrefixCachingAllocator` with its refcounts and
  an empty prefix index), checked with its `check`."""
  cls = PrefixCachingAllocator if state.get("kind") == "prefix" else PageAllocator
  alloc = cls(state["num_pages"], state["page_size"], state["max_pages_per_seq"])
  alloc._free = [int(p) for p in state["free"]]  # pylint: disable=protected-access
  for seq_id, pages, tokens in state["live"]:
    alloc._pages[seq_id] = [int(p) for p in pages]  # pylint: disable=protected-access
    alloc._tokens[seq_id] = int(tokens)  # pylint: disable=protected-access
    if cls is PrefixCachingAllocator:
      alloc._ref[pages] += 1  # pylint: disable=protected-access
      alloc._registered[seq_id] = (0, None)  # pylint: disable=protected-access
  alloc.check()
  return alloc


def save_caches(path: str | os.PathLike, caches: Any, *, allocator: PageAllocator | None = None,
                tokens: dict[Hashable, Sequence[int]] | Sequence[Sequence[int]] | None = None,
                extra: dict[str, Any] | None = None) -> None:
  """Writes `caches` (one cache or a sequence of per-layer caches) to `path`, atomically.

  Args:
    path: directory to create; must not exist yet.
    caches: a cache pytree or a tuple/list of them (a model's per-layer caches).
    allocator: the `PageAllocator` of a paged pool, saved with its state.
    tokens: token ids the caches hold, per batch row (list of lists) or per
      sequence id (dict), for `resume` / `reusable_length`.
    extra: more JSON-serialisable metadata.

  Raises:
    ValueError: `path` exists.
    TypeError: metadata that is not JSON-serialisable (nothing restorable is
      left at `path`).
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
    like: caches of the saved kinds, shapes and dtypes (contents ignored),
      one or a tuple/list as saved; restored arrays go to `like`'s devices.

  Returns:
    `(caches, allocator or None, tokens or None)`: caches in `like`'s form
    (one cache or a tuple), the saved allocator rebuilt, and the saved token
    ids (list of rows, or dict by sequence id).

  Raises:
    ValueError: an incomplete checkpoint (interrupted save), or one whose
      cache kinds, leaves, shapes or dtypes differ from `like` (the message
      names the first difference).
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
      new.append(jax.device_put(value, x.sharding) if isinstance(x, jax.Array)
                 else jnp.asarray(value))
      n += 1
    result.append(jax.tree_util.tree_unflatten(treedef, new))
  alloc = None if meta["allocator"] is None else allocator_from_state(meta["allocator"])
  tokens = meta["tokens"]
  if tokens is not None:
    tokens = (tokens["by_row"] if "by_row" in tokens else
              {k: v for k, v in tokens["by_id"]})
  return (result[0] if single else tuple(result)), alloc, tokens
