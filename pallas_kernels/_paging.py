"""The page-pool pieces shared by `paged_decode` and `lowbit_paged_decode`.

A key block is `pages_per_block` pages named by a sequence's block-table row. "loop"
(Triton): the program holds its KV head's whole pool and gathers the block's pages
(`page_ids`, `gather_pages`). "grid" (Mosaic): one page operand per page of the block,
its index map reading the scalar-prefetched tables (`page_spec`). Imports only jax.
"""

from __future__ import annotations

from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels._common import block_bounds, default_splits




def page_ids(table_ref, blk, pages_per_block: int, num_pages: int):
  """("loop") The physical pages of key block `blk`, clamped into `[0, P)`: unassigned
  entries (-1) read a pool page instead of faulting; their slots lie past the length."""
  ids = table_ref[pl.ds(pl.multiple_of(blk * pages_per_block, pages_per_block),
                        pages_per_block)]
  return jnp.clip(ids, 0, num_pages - 1)


def gather_pages(ref, ids, rows: int):
  """("loop") `[rows, X]`: the pages `ids` of a `[P, page_rows, X]` pool ref, in order."""
  return ref[ids].reshape(rows, ref.shape[-1])


def pool_spec(num_pages: int, shape):
  """("loop") The whole `[P, *shape]` pool of KV head h; the kernel gathers pages from it."""
  return pl.BlockSpec((None, num_pages) + tuple(shape), lambda b, h, g, j: (h, 0, 0, 0))


def grid_logical_page(blk, j, lo, hi, pages_per_block: int, pages_padded: int):
  """("grid") Logical page that page operand j fetches at key block `blk`.

  Operand j holds pages `j, j + ppb, ...`; its page `blk * ppb + j` is clamped into
  the needed pages of its residue class inside `[lo, hi)`, so steps outside them
  repeat a needed page and the pipeline issues no DMA for them.
  """
  ppb = pages_per_block
  first = lo + lax.rem(j - lax.rem(lo, ppb) + ppb, ppb)  # smallest page >= lo, = j mod ppb
  top = jnp.maximum(hi - 1, 0)
  last = top - lax.rem(lax.rem(top, ppb) - j + ppb, ppb)  # largest page <= hi - 1, = j mod ppb
  page = jnp.minimum(jnp.maximum(blk * ppb + j, first), jnp.maximum(last, first))
  return jnp.minimum(page, pages_padded - 1)


def page_spec(j: int, shape, *, num_pages: int, page_size: int, pages_per_block: int,
              blocks_per_split: int, pages_padded: int):
  """("grid") BlockSpec of page operand j of a `[K, P, *shape]` pool: its index map reads
  the physical page from the scalar-prefetched tables (`grid_logical_page`)."""

  def index(b, h, g, sp, st, starts_ref, lengths_ref, tables_ref):
    lo, hi = block_bounds(starts_ref[b], lengths_ref[b], page_size)
    page = grid_logical_page(sp * blocks_per_split + st, j, lo, hi, pages_per_block,
                             pages_padded)
    phys = tables_ref[b * pages_padded + page]
    return h, jnp.minimum(jnp.maximum(phys, 0), num_pages - 1), 0, 0

  return pl.BlockSpec((None, None) + tuple(shape), index)


def page_splits(block_tables, schedule: str, programs: int, pages_per_block: int,
                num_splits: int | None):
  """`(tables i32[B, padded], num_splits, blocks_per_split)`: the page axis cut into
  splits of whole key blocks, the tables padded with -1 (never inside a range)."""
  pps = block_tables.shape[1]
  num_blocks = -(-pps // pages_per_block)
  if num_splits is None:
    num_splits = default_splits(schedule, programs, num_blocks)
  num_splits = min(num_splits, num_blocks)
  bps = -(-num_blocks // num_splits)
  padded = num_splits * bps * pages_per_block
  tables = jnp.pad(block_tables.astype(jnp.int32), ((0, 0), (0, padded - pps)),
                   constant_values=-1)
  return tables, num_splits, bps
