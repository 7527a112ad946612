"""What a cache kind can do, asked of the cache (its class) instead of kept in lists."""

from __future__ import annotations

from typing import Any, ClassVar, Mapping

import dataclasses

import jax
import jax.numpy as jnp

BATCH, HEADS, SEQ, PAGES = "cache_batch", "cache_kv_heads", "cache_sequence", "cache_pages"


def _arrays(cache) -> dict[str, jax.Array]:
  return {f.name: getattr(cache, f.name) for f in dataclasses.fields(cache)
          if isinstance(getattr(cache, f.name), jax.Array)}


def bounded(cache) -> bool:
  """True when `cache` holds at most a fixed budget of tokens (class attribute `BOUNDED`)."""
  return bool(getattr(cache, "BOUNDED", False))


def context_replayable(cache) -> bool:
  """True when `cache`'s first write returns the chunk's own causal attention (windowed as the
  layer asks), whatever the cache keeps of it: so that write can be redone from the layer's
  recorded input (`experiments.evals.replay`). Class attribute or property
  `CONTEXT_REPLAYABLE`."""
  return bool(getattr(cache, "CONTEXT_REPLAYABLE", False))


def paged(cache) -> bool:
  """True when `cache` is a page pool (class attribute `POOL_FIELDS` names its `[K, P, ...]`
  arrays)."""
  return bool(getattr(cache, "POOL_FIELDS", ()))


def rollback(cache) -> str | None:
  """How a draft written into `cache` is undone (`kvattn.caches.transaction`): "lengths",
  "journal" (an undo log) or "copy" (the cache from before the write)."""
  return getattr(cache, "ROLLBACK", "journal" if hasattr(cache, "draft_journal") else "copy")


def op(cache, name: str):
  """`cache.<name>` (a row operation of `Rows` / `Pages`), or `Rows`' for a class from
  outside kvattn whose every array holds the batch on axis 0."""
  method = getattr(type(cache), name, None) or getattr(Rows, name)
  return method.__get__(cache)


def tokens_before(end, count: int, capacity: int) -> tuple[jax.Array, jax.Array]:
  """`(p i32[count], idx i32[count])`: tokens `[end - count, end)` and their slots in a ring of
  `capacity` slots (token p in slot p % capacity)."""
  p = end - count + jnp.arange(count, dtype=jnp.int32)
  return p, jnp.mod(p, capacity)


def row_tokens(a: jax.Array | None, slot, p: jax.Array, idx: jax.Array) -> jax.Array | None:
  """Row `slot` of a ring array `a: [B, K, C, ...]` at slots `idx`, zeros where `p < 0`."""
  if a is None:
    return None
  row = jnp.take(jax.lax.dynamic_index_in_dim(a, slot, keepdims=False), idx, axis=1)
  valid = (p >= 0).reshape((1, -1) + (1,) * (row.ndim - 2))
  return jnp.where(valid, row, jnp.zeros_like(row))


def put_row_tokens(a: jax.Array | None, slot, idx: jax.Array, new) -> jax.Array | None:
  """`a: [B, K, C, ...]` with row `slot`'s slots `idx` set to `new: [K, n, ...]`."""
  if a is None:
    return None
  row = jax.lax.dynamic_index_in_dim(a, slot, keepdims=False).at[:, idx].set(new)
  return jax.lax.dynamic_update_index_in_dim(a, row, slot, 0)


def logical_axes(cache) -> dict[str, tuple[str | None, ...]]:
  """Field -> logical names of its dims: the class's own `logical_axes()`, else rows
  `[B, K, ...]` (a rank >= 3 array) or `[B, ...]`."""
  own = getattr(cache, "logical_axes", None)
  if callable(own):
    return own()
  return Rows.logical_axes(cache)


class TruncateByLengths:
  """Token t in slot t and slots past `lengths` unused: truncating only lowers `lengths`."""

  def truncate(self, length):
    """This cache holding only its first `length` tokens per row (`i32[B]`)."""
    return self.replace(lengths=jnp.minimum(self.lengths, length))


class Rows:
  """Fixed rows: every array leaf holds batch row b at index b of axis 0."""

  BOUNDED: ClassVar[bool] = False
  POOL_FIELDS: ClassVar[tuple[str, ...]] = ()
  FLOAT_ONLY: ClassVar[bool] = False
  ROW_EMPTY: ClassVar[Mapping[str, Any]] = {"pos": -1}
  """Fields an empty row sets, and their fill (others keep their bytes; `lengths` is 0)."""

  def logical_axes(self) -> dict[str, tuple[str | None, ...]]:
    return {n: (BATCH, HEADS) + (None,) * (a.ndim - 2) if a.ndim >= 3 else
            (BATCH,) + (None,) * (a.ndim - 1) for n, a in _arrays(self).items()}

  def slot_view(self, slot):
    """The batch-1 cache of row `slot` (traced)."""
    return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, slot, keepdims=True), self)

  def with_slot_view(self, slot, view):
    """This cache with row `slot` replaced by the batch-1 `view`."""
    return jax.tree.map(lambda a, r: jax.lax.dynamic_update_index_in_dim(a, r, slot, 0),
                        self, view)

  def reset_slot(self, slot):
    """Row `slot` empty: `lengths` 0 and the `ROW_EMPTY` fields filled."""
    empty = getattr(self, "ROW_EMPTY", Rows.ROW_EMPTY)
    fills = {n: getattr(self, n).at[slot].set(v) for n, v in empty.items()
             if getattr(self, n, None) is not None}
    return self.replace(lengths=self.lengths.at[slot].set(0), **fills)

  def assign_slot(self, slot, pages=None, length=0):
    """Row `slot` empty for a new sequence (`pages` unused; `length` must be 0 or the row is
    then restored from a boundary state)."""
    del pages, length
    return op(self, "reset_slot")(slot)

  def release_slot(self, slot):
    return op(self, "reset_slot")(slot)

  def set_block_row(self, slot, row):
    del slot, row
    return self


class Pages:
  """Paged kinds: `POOL_FIELDS` pools `[K, P, ...]`, `block_tables: i32[B, W]`, `lengths`."""

  BOUNDED: ClassVar[bool] = False
  FLOAT_ONLY: ClassVar[bool] = False
  POOL_FIELDS: ClassVar[tuple[str, ...]] = ("k_pages", "v_pages", "k_scale_pages",
                                            "v_scale_pages")

  def logical_axes(self) -> dict[str, tuple[str | None, ...]]:
    rows = Rows.logical_axes(self)
    return {n: (HEADS, PAGES) + (None,) * (a.ndim - 2) if n in self.POOL_FIELDS else rows[n]
            for n, a in _arrays(self).items()}

  def pools(self) -> list[jax.Array]:
    return [getattr(self, n) for n in self.POOL_FIELDS if getattr(self, n) is not None]

  def slot_view(self, slot):
    """A batch-1 view: row `slot` of the block table and lengths over the shared pools."""
    return self.replace(
        block_tables=jax.lax.dynamic_index_in_dim(self.block_tables, slot, keepdims=True),
        lengths=jax.lax.dynamic_index_in_dim(self.lengths, slot, keepdims=True))

  def with_slot_view(self, slot, view):
    """The pools `view` wrote, and row `slot`'s length."""
    pools = {n: getattr(view, n) for n in self.POOL_FIELDS if getattr(view, n) is not None}
    return self.replace(lengths=self.lengths.at[slot].set(view.lengths[0]), **pools)

  def set_block_row(self, slot, row):
    return self.replace(block_tables=self.block_tables.at[slot].set(row))

  def copy_pages(self, old: jax.Array, new: jax.Array):
    """Page `old[i]` copied to page `new[i]` in every pool (`i32[n]` each)."""
    return self.replace(**{n: getattr(self, n).at[:, new].set(getattr(self, n)[:, old])
                           for n in self.POOL_FIELDS if getattr(self, n) is not None})


