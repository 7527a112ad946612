"""Paged decode attention: the XLA backends, the page gather and the block-table checks.

A paged KV cache (PagedAttention, Kwon et al., SOSP 2023, §4.1) stores keys and
values in a pool of fixed-size pages shared by all sequences, `k_pages,
v_pages: [K, P, page_size, H]`, and a block table `i32[B, pages_per_seq]`
maps the j-th logical page of sequence b (slots `[j * page_size, (j + 1) *
page_size)`) to a physical page. An entry outside `[0, P)` (the allocator
writes -1) means "no page": such a logical page is never read into a result
and never written.

Attention is the same as for a dense cache whose slot `s` of sequence b is
slot `s % page_size` of page `block_tables[b, s // page_size]`: the query of
sequence b sits at slot `lengths[b] - 1` and attends
`[max(0, lengths[b] - window), lengths[b])`. Results never depend on page
order, on what unused slots of a sequence's last page hold, or on what free
pages hold (DESIGN.md, invariant 2).

The XLA backends of `kvattn.ops.paged_decode_attention` (`kvattn.ops.dispatch`
lists every backend and the order None tries them in; the public function
checks the arguments once and clamps every row's length to its assigned pages,
`assigned_slots`, so these trust them):
  * `paged_decode_attention_pool_xla` (`"xla_pool"`) scans the page pool in
    place; work follows the pool size P.
  * `paged_decode_attention_xla` (`"xla"`) gathers each sequence's pages into a
    dense `[B, K, S, H]` view and runs `decode_attention_xla`.

Quantized pools (int8 / fp8 values with `f32[K, P, page_size]` scale pools,
passed as `k_scale=`, `v_scale=`): both XLA paths apply the scales to the
logits and probabilities (`kvattn.ops.xla`); the Pallas paged kernel
gathers the scale pages with the value pages and dequantizes each block after
loading it.
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
  """Dense head-major view of each sequence's pages: slot s of sequence b is
  slot `s % page_size` of page `block_tables[b, s // page_size]`. A scale
  pool `[K, P, page_size]` gives `[B, K, pages_per_seq * page_size]`.

  Entries outside `[0, P)` are clamped into range, so the slots of an
  unassigned logical page hold an arbitrary page's contents; callers mask
  them with the lengths (or use `gather_pages_zeroed`).
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
  """Token slots each sequence's assigned pages hold: `page_size` times the
  number of leading block-table entries in `[0, num_pages)` (the entries
  before a row's first unassigned one; at most `pages_per_seq * page_size`).

  A sequence whose `lengths[b]` exceeds this lost tokens (an update under
  jit dropped them); `paged_decode_attention` clamps its length to it.
  """
  assigned = (block_tables >= 0) & (block_tables < num_pages)  # [B, pages_per_seq]
  leading = jnp.sum(jnp.cumprod(assigned.astype(jnp.int32), axis=1), axis=1)
  return (leading * page_size).astype(jnp.int32)


def gather_pages_zeroed(pages: jax.Array, block_tables: jax.Array, fill: float = 0) -> jax.Array:
  """`gather_pages` with the slots of unassigned logical pages (entries outside
  `[0, P)`) set to `fill` (default zero): `[B, K, pages_per_seq * page_size, H]`
  (a scale pool: `[B, K, S]`)."""
  num_pages, page_size = pages.shape[1], pages.shape[2]
  dense = gather_pages(pages, block_tables)
  assigned = (block_tables >= 0) & (block_tables < num_pages)  # [B, pages_per_seq]
  assigned = jnp.repeat(assigned, page_size, axis=1)  # [B, S]
  assigned = assigned.reshape(assigned.shape[:1] + (1,) + assigned.shape[1:]
                              + (1,) * (dense.ndim - 3))
  return jnp.where(assigned, dense, jnp.asarray(fill, dense.dtype))


def paged_decode_attention_xla(
    q: jax.Array,  # [B, N, H]
    k_pages: jax.Array,  # [K, P, page_size, H]
    v_pages: jax.Array,  # [K, P, page_size, Hv]
    block_tables: jax.Array,  # i32[B, pages_per_seq]
    lengths: jax.Array,  # i32[B]
    *,
    sm_scale: float | None = None,
    window: int | None = None,
    soft_cap: float | None = None,
    k_scale: jax.Array | None = None,  # f32[K, P, page_size]
    v_scale: jax.Array | None = None,  # f32[K, P, page_size]
) -> jax.Array:  # [B, N, Hv]
  """The XLA paged path: gather through the block table, then dense decode.

  Equivalent to `decode_attention_xla` on the dense view `gather_pages(...)`;
  the gather reads all `pages_per_seq` pages of every sequence (the Pallas
  kernel reads only those below `lengths[b]`). Slots past `lengths[b]`, pages
  the block table does not assign and free pages never reach the output;
  length-0 rows are zeros. Returns `[B, N, Hv]` in q's dtype, f32-accumulated.
  Quantized pools: the scale pools are gathered alike (`[B, K, S]`, S floats
  per row) and applied by `decode_attention_xla`.
  """
  k = gather_pages(k_pages, block_tables)
  v = gather_pages(v_pages, block_tables)
  scales = {}
  if k_scale is not None:
    scales = {"k_scale": gather_pages(k_scale, block_tables),
              "v_scale": gather_pages(v_scale, block_tables)}
  # Slots outside the window (and past the length) cannot leak: the dense path keeps only the
  # attended slots' values and scales (no zeroed copy of the gathered V needed here).
  return _xla.decode_attention_xla(q, k, v, lengths, sm_scale=sm_scale, window=window,
                                   soft_cap=soft_cap, **scales)


def paged_decode_attention_pool_xla(
    q: jax.Array,  # [B, N, H]
    k_pages: jax.Array,  # [K, P, page_size, H]
    v_pages: jax.Array,  # [K, P, page_size, Hv]
    block_tables: jax.Array,  # i32[B, pages_per_seq]
    lengths: jax.Array,  # i32[B]
    *,
    sm_scale: float | None = None,
    window: int | None = None,
    soft_cap: float | None = None,
    k_scale: jax.Array | None = None,  # f32[K, P, page_size]
    v_scale: jax.Array | None = None,  # f32[K, P, page_size]
) -> jax.Array:  # [B, N, Hv]
  """The XLA pool-scan path: attention computed page by page over the pool.

  Instead of gathering every sequence's pages into a dense `[B, K, S, H]`
  copy, this path reads the pool in place: the block tables are inverted
  into `owner[p]` (the sequence using physical page p, or none) and
  `logical[p]` (its index in that sequence), each page's keys are scored
  against its owner's query, and the softmax over a sequence's pages is a
  segmented reduction over the pool (`jax.ops.segment_max`/`segment_sum`:
  max, sum of exp, probability-weighted values). Each pool page is read once,
  so the work follows the pool size P, not B * pages_per_seq: a pool sized to
  the pages in use (what paging is for) costs about the tokens held, not the
  capacity of every slot.

  Requires what `PageAllocator` guarantees: no physical page is used by two
  sequences (logical pages `[0, ceil(lengths[b] / page_size))`). Slots outside
  `[max(0, L - window), L)`, unassigned entries and free pages never reach the
  output (masked logits replaced, masked values zeroed); length-0 rows are
  zeros. Same semantics as `paged_decode_attention_xla`; `[B, N, Hv]` in q's
  dtype, f32-accumulated. Quantized pools: each page's scales multiply its
  logits and (masked slots zeroed) its probabilities.
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
  """Host check that lengths fit, every page a sequence uses is assigned and none is shared.

  For concrete `block_tables: i32[B, pages_per_seq]` and `lengths: i32[B]`:
  every length must lie in `[0, pages_per_seq * page_size]`; logical pages
  `[0, ceil(lengths[b] / page_size))` of every sequence must map into
  `[0, num_pages)`; and no physical page may be used by two sequences (or
  twice by one). Skipped for traced values (under jit,
  `paged_decode_attention` clamps the lengths to the assigned pages instead).

  Raises:
    ValueError: naming the sequence and page (or length) that break the rule.
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
