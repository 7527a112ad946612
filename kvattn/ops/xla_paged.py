"""The XLA paths of paged decode attention (PagedAttention, Kwon et al. 2023, §4.1).

A page pool `[K, P, page_size, H]` holds every sequence's keys and values;
`block_tables: i32[B, pages_per_seq]` maps logical page j of sequence b (slots
`[j * page_size, (j + 1) * page_size)`) to a physical page, entries outside `[0, P)`
meaning "no page". Attention equals the dense one on the gathered view and never depends
on page order or on what unused slots and free pages hold. Backends of
`dispatch.paged_decode_attention` (which checked the arguments and clamped the lengths
to the assigned pages): "xla_pool" scans the pool in place (work follows P), "xla"
gathers each sequence's pages and runs `decode_attention_xla`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from kvattn import _checks
from kvattn.ops import quant
from kvattn.ops import xla as _xla


def gather_pages(
    pages: jax.Array,  # [K, P, page_size, H] (or a scale pool f32[K, P, page_size])
    block_tables: jax.Array,  # i32[B, pages_per_seq]
) -> jax.Array:  # [B, K, pages_per_seq * page_size, H] (scales: [B, K, S])
  """`[B, K, pages_per_seq * page_size, H]` view of each sequence's pages (a scale pool
  `[K, P, page_size]` gives `[B, K, S]`); entries outside `[0, P)` read a clamped page, so
  callers mask by length (or use `gather_pages_zeroed`).
  """
  if pages.ndim == 3:  # a scale pool: one number per slot
    return gather_pages(pages[..., None], block_tables)[..., 0]
  num_pages = pages.shape[1]
  ids = jnp.clip(block_tables, 0, num_pages - 1)
  gathered = quant.read_stored(lambda bits: jnp.take(bits, ids, axis=1), pages)
  # [K, B, pages_per_seq, page_size, H]
  k, b, n, ps, h = gathered.shape
  return jnp.moveaxis(gathered, 0, 1).reshape(b, k, n * ps, h)


def assigned_slots(
    block_tables: jax.Array,  # i32[B, pages_per_seq]
    num_pages: int,
    page_size: int,
) -> jax.Array:  # i32[B]
  """`i32[B]`: `page_size` times the leading block-table entries in `[0, num_pages)`; a
  length past it lost tokens under jit.
  """
  assigned = (block_tables >= 0) & (block_tables < num_pages)  # [B, pages_per_seq]
  leading = jnp.sum(jnp.cumprod(assigned.astype(jnp.int32), axis=1), axis=1)
  return (leading * page_size).astype(jnp.int32)


def gather_pages_zeroed(pages: jax.Array, block_tables: jax.Array, fill: float = 0) -> jax.Array:
  """`gather_pages` with the slots of unassigned pages set to `fill`."""
  num_pages, page_size = pages.shape[1], pages.shape[2]
  dense = gather_pages(pages, block_tables)
  assigned = (block_tables >= 0) & (block_tables < num_pages)  # [B, pages_per_seq]
  assigned = jnp.repeat(assigned, page_size, axis=1)  # [B, S]
  assigned = assigned.reshape(assigned.shape[:1] + (1,) + assigned.shape[1:]
                              + (1,) * (dense.ndim - 3))
  return jnp.where(assigned, dense, jnp.asarray(fill, dense.dtype))


def paged_decode_attention_xla(q, k_pages, v_pages, block_tables, lengths, *, k_scale=None,
                               v_scale=None, **options) -> jax.Array:
  """The "xla" backend: `decode_attention_xla` on the gathered view (scale pools
  gathered alike); reads all `pages_per_seq` pages of every sequence.
  """
  k = gather_pages(k_pages, block_tables)
  v = gather_pages(v_pages, block_tables)
  scales = {}
  if k_scale is not None:
    scales = {"k_scale": gather_pages(k_scale, block_tables),
              "v_scale": gather_pages(v_scale, block_tables)}
  # Slots outside the window (and past the length) cannot leak: the dense path keeps only the
  # attended slots' values and scales (no zeroed copy of the gathered V needed here).
  return _xla.decode_attention_xla(q, k, v, lengths, **scales, **options)


def paged_decode_attention_pool_xla(q, k_pages, v_pages, block_tables, lengths, *,
                                    sm_scale=None, window=None, soft_cap=None, k_scale=None,
                                    v_scale=None) -> jax.Array:
  """The "xla_pool" backend: attention page by page over the pool, in place.

  The tables are inverted into `owner[p]` and `logical[p]`; each page's keys meet its
  owner's query and the softmax over a sequence's pages is a segmented reduction
  (`segment_max` / `segment_sum`), so each pool page is read once. Needs what
  `PageAllocator` guarantees: no page used by two sequences.
  """
  batch, num_heads, head_dim = q.shape
  num_kv, num_pages, page_size, _ = k_pages.shape
  pages_per_seq = block_tables.shape[1]
  groups = num_heads // num_kv
  scale = head_dim ** -0.5 if sm_scale is None else sm_scale
  starts, lengths = _xla.attended_range(lengths, pages_per_seq * page_size, window)

  # Invert the tables: page -> (owner, logical index). Entries a sequence does
  # not use (past its length, unassigned) are scattered out of range (dropped).
  j = jnp.arange(pages_per_seq, dtype=jnp.int32)[None, :]
  used = (j < (lengths[:, None] + page_size - 1) // page_size) & (block_tables >= 0) & (
      block_tables < num_pages)
  target = jnp.where(used, block_tables, num_pages).reshape(-1)
  rows = jnp.broadcast_to(jnp.arange(batch, dtype=jnp.int32)[:, None], used.shape).reshape(-1)
  owner = jnp.full((num_pages,), batch, jnp.int32).at[target].set(rows, mode="drop")  # B = none
  logical = jnp.zeros((num_pages,), jnp.int32).at[target].set(
      jnp.broadcast_to(j, used.shape).reshape(-1), mode="drop")
  has_owner = owner < batch
  safe_owner = jnp.where(has_owner, owner, 0)

  slot = logical[:, None] * page_size + jnp.arange(page_size, dtype=jnp.int32)[None, :]  # [P, ps]
  keep = has_owner[:, None] & (slot >= starts[safe_owner][:, None]) & (
      slot < lengths[safe_owner][:, None])  # [P, ps]

  qg = q.reshape(batch, num_kv, groups, head_dim)[safe_owner]  # [P, K, G, H]
  if k_scale is not None:  # a quantized pool: dot in q's dtype, scales on the logits
    qg = qg.astype(jnp.promote_types(q.dtype, jnp.bfloat16))
  else:
    qg = qg.astype(k_pages.dtype)
  # 'S' here runs over the page_size slots of each page.
  logits = jnp.einsum("PKGH,KPSH->PKGS", qg, k_pages,
                      preferred_element_type=jnp.float32) * scale
  if k_scale is not None:
    logits = logits * jnp.moveaxis(k_scale, 0, 1)[:, :, None, :].astype(jnp.float32)
  if soft_cap is not None:
    logits = soft_cap * jnp.tanh(logits / soft_cap)
  logits = jnp.where(keep[:, None, None, :], logits, -jnp.inf)
  segment = jnp.where(has_owner, owner, batch)  # pages of no sequence go to a dropped segment
  row_max = jax.ops.segment_max(jnp.max(logits, axis=-1), segment, num_segments=batch)  # [B,K,G]
  row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
  probs = jnp.where(keep[:, None, None, :], jnp.exp(logits - row_max[safe_owner][..., None]), 0.0)
  denom = jax.ops.segment_sum(jnp.sum(probs, axis=-1), segment, num_segments=batch)  # [B, K, G]
  if v_scale is not None:  # masked slots' scales zeroed: probs stay exactly 0 there
    probs = probs * jnp.where(keep[:, None, :], jnp.moveaxis(v_scale, 0, 1).astype(jnp.float32),
                              0.0)[:, :, None, :]
  values = jnp.where(keep[None, :, :, None], v_pages,
                     jnp.zeros((), v_pages.dtype))  # [K, P, ps, Hv], masked slots zeroed
  weighted = jnp.einsum("PKGS,KPSV->PKGV", probs, values, preferred_element_type=jnp.float32)
  out = jax.ops.segment_sum(weighted, segment, num_segments=batch)  # [B, K, G, Hv]
  out = out / jnp.where(denom > 0, denom, 1.0)[..., None]
  return out.reshape(batch, num_heads, v_pages.shape[-1]).astype(q.dtype)


def pool_decode(q, k_pages, v_pages, block_tables, lengths, *, explicit, **options):
  """The "xla_pool" backend of `dispatch.paged_decode_attention`; picked (when not named)
  if scanning the pool reads less than gathering (P < B * pages_per_seq)."""
  if not explicit and k_pages.shape[1] >= block_tables.shape[0] * block_tables.shape[1]:
    raise NotImplementedError(
        f"xla_pool: the pool ({k_pages.shape[1]} pages) is not smaller than the gathered view "
        f"({block_tables.shape[0]} x {block_tables.shape[1]} pages)")
  return paged_decode_attention_pool_xla(q, k_pages, v_pages, block_tables, lengths, **options)


def check_block_tables(block_tables, lengths, num_pages: int, page_size: int) -> None:
  """Host check of concrete `block_tables` and `lengths` (skipped when traced).

  Raises:
    ValueError: a length outside `[0, pages_per_seq * page_size]`, a page a sequence uses
      that is not in `[0, num_pages)`, or one page used twice (naming row and page).
  """
  if not (_checks.is_concrete(block_tables) and _checks.is_concrete(lengths)):
    return
  tables = np.asarray(block_tables)
  host_lengths = np.asarray(lengths).astype(np.int64)
  capacity = tables.shape[1] * page_size
  bad = (host_lengths < 0) | (host_lengths > capacity)
  if bad.any():
    b = int(np.flatnonzero(bad)[0])
    raise ValueError(
        f"lengths must lie in [0, pages_per_seq * page_size] = [0, {capacity}]; got "
        f"lengths[{b}] = {int(host_lengths[b])} (all: {host_lengths.tolist()})")
  used = -(-host_lengths // page_size)
  in_use = np.arange(tables.shape[1])[None, :] < used[:, None]  # [B, pages_per_seq]
  unassigned = in_use & ((tables < 0) | (tables >= num_pages))
  if unassigned.any():
    b, j = (int(x) for x in np.argwhere(unassigned)[0])
    raise ValueError(
        f"block_tables[{b}, {j}] must be a page in [0, {num_pages}) since sequence {b} "
        f"has {int(host_lengths[b])} tokens; got {int(tables[b, j])}")
  pages, counts = np.unique(tables[in_use], return_counts=True)
  if (counts > 1).any():
    page = int(pages[counts > 1][0])
    first, second = (tuple(int(x) for x in loc)
                     for loc in np.argwhere(in_use & (tables == page))[:2])
    raise ValueError(
        f"block_tables must not give page {page} to two live slots; got it at "
        f"{first} and {second}")
