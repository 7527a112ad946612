"""KV caches sharded over a device mesh (`kvattn.sharding` holds the mesh and its rules).

`ShardedKVCache`, `ShardedPagedKVCache`, `ShardedLatentCache` subclass the dense, paged and
latent kinds with a static `CacheLayout` and run `update` / `attend` in `jax.shard_map`
(the layouts, the context-parallel merge and the placement rules: `kvattn.sharding`'s module
doc and docs/sharding.md). `init_caches` / `cache_factory` create them directly sharded;
`place_caches` moves existing caches onto a mesh.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from kvattn import _checks
from kvattn.caches import dense as cache_lib
from kvattn.caches import paged as paged_lib
from kvattn.caches import registry
from kvattn.caches import window as window_lib
from kvattn.paging.allocator import NO_PAGE, pages_for
from kvattn.ops import context_parallel as cp

from kvattn.sharding import CACHE_KINDS, axis_size, mesh_axes, resolve_rules


# ----------------------------------------------------------------------------------------------
# Cache layouts.


@dataclasses.dataclass(frozen=True)
class CacheLayout:
  """Where a sharded cache's dimensions live (static; hashable).

  Attributes:
    mesh: the cache's mesh: the model mesh, with its heads axis viewed as
      (heads, heads + "_rep") when KV heads are replicated.
    batch: mesh axis of the batch dimension, or None.
    seq: mesh axis of the slot dimension (context parallel), or None.
    kv_heads: mesh axes of the KV-head dimension (dense, paged).
    q_heads: mesh axes of the query-head dimension of the attention inputs.
    pages: mesh axes of the page-pool dimension (paged).
  """

  mesh: Mesh
  batch: str | None = None
  seq: str | None = None
  kv_heads: tuple[str, ...] = ()
  q_heads: tuple[str, ...] = ()
  pages: tuple[str, ...] = ()

  def sharding(self, *spec) -> NamedSharding:
    """`NamedSharding` of this layout's mesh for the mesh axes `spec` (one per array axis)."""
    return NamedSharding(self.mesh, P(*spec))

  def shard_index(self, axes: tuple[str, ...]) -> jax.Array:
    """Inside `shard_map`: this device's linear index along `axes` (row-major)."""
    index = jnp.int32(0)
    for a in axes:
      index = index * self.mesh.shape[a] + jax.lax.axis_index(a)
    return index

  def smap(self, f, in_specs, out_specs):
    """`jax.shard_map` of `f` over this layout's mesh (per-device code of the cache ops)."""
    return jax.shard_map(f, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs,
                         check_vma=False)


def _single_axis(rules, name, mesh: Mesh | None = None) -> str | None:
  """The one mesh axis `rules[name]` names, or None (none, or of size 1 on `mesh`: a
  size-1 axis splits nothing, so the cache takes the single-device path)."""
  axes = mesh_axes(rules[name])
  if len(axes) > 1:
    raise ValueError(f"mesh.rules[{name!r}] must be one mesh axis or None for a cache; "
                     f"got {rules[name]!r}")
  if not axes or (mesh is not None and mesh.shape[axes[0]] == 1):
    return None
  return axes[0]


def _divides(mesh: Mesh, axes: Any, size: int, what: str) -> None:
  n = axis_size(mesh, axes)
  if size % n:
    raise ValueError(f"mesh axis {axes!r} of size {n} must divide {what}; got {size}")


def _head_mesh(mesh: Mesh, axis: str, num_kv_heads: int) -> tuple[Mesh, tuple[str, ...]]:
  """The mesh with `axis` (size m) viewed as (K, m / K) when K < m, and the q-head axes."""
  m = mesh.shape[axis]
  if num_kv_heads % m == 0:
    return mesh, (axis,)
  if m % num_kv_heads:
    raise ValueError(
        f"num_kv_heads {num_kv_heads} and mesh axis {axis!r} of size {m}: one must divide "
        f"the other (KV heads are split over the axis, or replicated K / min(K, {m}) per "
        f"device)")
  names = list(mesh.axis_names)
  i = names.index(axis)
  shape = list(mesh.devices.shape)
  shape[i:i + 1] = [num_kv_heads, m // num_kv_heads]
  names[i:i + 1] = [axis, axis + "_rep"]
  view = Mesh(mesh.devices.reshape(shape), tuple(names),
              axis_types=(jax.sharding.AxisType.Auto,) * len(names))
  return view, (axis, axis + "_rep")


def _query_heads(mesh: Mesh, view: Mesh, axis: str, heads: tuple[str, ...],
                 num_kv_heads: int, num_heads: int | None) -> tuple[str, ...]:
  """The mesh axes of the query heads N of a layer with `num_kv_heads` K on `axis`.

  With K >= the axis (K heads split over it) N splits likewise. With fewer, the KV heads
  are replicated (the `view` of `axis` as (K, m / K)); N then splits over both view axes
  when m divides it, else over the K part only (each query group whole on the devices of
  its KV head). Only N tells the two apart, so it is required then.
  """
  m = mesh.shape[axis]
  if num_heads is not None:
    _checks.head_layout(num_heads, num_kv_heads)
  if len(heads) == 1:  # K split over the axis; N, a multiple of K, splits the same way
    return heads
  if num_heads is None:
    raise ValueError(
        f"num_heads is required for a cache of num_kv_heads = {num_kv_heads} on mesh axis "
        f"{axis!r} of size {m}: the KV heads are replicated {m // num_kv_heads}x and the query "
        f"heads split over {heads} ({m} devices) when {m} divides num_heads, else over "
        f"({axis!r},) ({num_kv_heads} devices); pass the layer's num_heads "
        "(place_caches(..., num_heads=))")
  return heads if num_heads % axis_size(view, heads) == 0 else (axis,)


def cache_layout(mesh: Mesh, rules: Mapping[str, Any] | None, *, kind: str, batch: int,
                 max_len: int, num_kv_heads: int | None = None, num_heads: int | None = None,
                 num_pages: int | None = None) -> CacheLayout:
  """The layout of one layer's cache of `kind` ("dense", "paged" or "latent") on `mesh`.

  Every layout it returns runs: the attention of a layer with `num_heads` query heads
  over `num_kv_heads` KV heads fits it (`check_query_heads`). `num_heads` is needed
  only when the heads axis is larger than `num_kv_heads` (the KV heads are then
  replicated, and how the query heads split depends on N).

  Raises:
    ValueError: a mesh axis that does not divide the dimension it splits (batch B,
      slots S, page pool P), naming the axis; K and the heads axis where neither
      divides the other; `num_heads` missing where needed (naming the axis, K and
      the splits N may take) or not a multiple of `num_kv_heads`; a multi-axis rule
      for the batch, slots or KV heads.
  """
  rules = resolve_rules(rules)
  batch_axis = _single_axis(rules, "cache_batch", mesh)
  seq_axis = _single_axis(rules, "cache_sequence", mesh)
  _divides(mesh, batch_axis, batch, "the batch B")
  if kind == "latent":
    _divides(mesh, seq_axis, max_len, "the cache slots S (max_len)")
    return CacheLayout(mesh=mesh, batch=batch_axis, seq=seq_axis)
  head_axis = _single_axis(rules, "cache_kv_heads", mesh)
  view, q_heads = mesh, ()
  if head_axis is not None:
    if num_kv_heads is None:
      raise ValueError(f"num_kv_heads is required for a {kind} cache with its KV heads on "
                       f"mesh axis {head_axis!r}")
    view, heads = _head_mesh(mesh, head_axis, num_kv_heads)
    q_heads = _query_heads(mesh, view, head_axis, heads, num_kv_heads, num_heads)
  kv_heads = () if head_axis is None else (head_axis,)
  if kind == "dense":
    _divides(mesh, seq_axis, max_len, "the cache slots S (max_len)")
    return CacheLayout(mesh=view, batch=batch_axis, seq=seq_axis, kv_heads=kv_heads,
                       q_heads=q_heads)
  if kind != "paged":
    raise ValueError(f"kind must be one of {CACHE_KINDS + ('latent',)}; got {kind!r}")
  pages = tuple(a for a in mesh_axes(rules["cache_pages"]) if mesh.shape[a] > 1)
  allowed = tuple(a for a in (batch_axis, seq_axis) if a is not None)
  if any(a not in allowed for a in pages) or (batch_axis and pages[:1] != (batch_axis,)):
    raise ValueError(f"mesh.rules['cache_pages'] must be the batch axis then optionally the "
                     f"sequence axis of {allowed} (each data shard's rows use its own pages); "
                     f"got {rules['cache_pages']!r}")
  _divides(mesh, pages, num_pages, "the page pool P (num_pages)")
  return CacheLayout(mesh=view, batch=batch_axis, seq=seq_axis if seq_axis in pages else None,
                     kv_heads=kv_heads, q_heads=q_heads, pages=pages)


def check_query_heads(layout: CacheLayout, num_heads: int, num_kv_heads: int) -> None:
  """Raises ValueError, before any shard_map, unless `num_heads` query heads fit `layout`
  (a layout made for another N: `cache_layout(num_heads=)`, `place_caches(num_heads=)`)."""
  n = axis_size(layout.mesh, layout.q_heads)
  if num_heads % n:
    axis = layout.kv_heads[0]
    raise ValueError(
        f"the query heads ({num_heads}) must split over the cache layout's mesh axes "
        f"{layout.q_heads} ({n} devices, the KV heads ({num_kv_heads}) replicated over "
        f"{axis!r}); the layout was made for another num_heads: build the caches with "
        f"num_heads={num_heads} (init_caches, place_caches(..., num_heads=))")


def _spec(*axes, ndim: int | None = None) -> P:
  """A PartitionSpec of the first `ndim` of `axes` (each None, an axis or a tuple)."""
  entries = tuple(None if not a else a if isinstance(a, str) else
                  (a[0] if len(a) == 1 else tuple(a)) for a in axes)
  return P(*entries[:ndim])


# ----------------------------------------------------------------------------------------------
# Sharded caches.


def _encode_pair(a, b, dtype):
  (a, a_s), (b, b_s) = cache_lib.encode(a, dtype), cache_lib.encode(b, dtype)
  return a, b, a_s, b_s


def _write_slots(cache, names, new_a, new_b, new_lengths, buf_axes, new_axes, *, slot_axis):
  """`update_unchecked` of the dense and latent kinds: encodes `new_a, new_b` ([B, T, ...])
  into the fields `names` (values, then scales) and writes them per shard (`write_tokens`;
  a sequence shard gets `lengths` minus its first slot, so it keeps the slots it holds)."""
  lengths = cache_lib.advance_lengths(cache.lengths, new_lengths, cache.max_len)
  lay = cache.layout
  slot_len = cache.max_len // axis_size(lay.mesh, lay.seq)
  new = dict(zip(names, _encode_pair(new_a, new_b, cache.dtype)))
  bufs = {n: getattr(cache, n) for n in names if getattr(cache, n) is not None}
  new = {n: new[n] for n in bufs}
  buf_spec = {n: _spec(*buf_axes, ndim=bufs[n].ndim) for n in bufs}
  new_spec = {n: _spec(*new_axes, ndim=new[n].ndim) for n in new}

  def local(bufs, new, lengths, new_lengths):
    first = 0 if lay.seq is None else jax.lax.axis_index(lay.seq) * slot_len
    return {n: cache_lib.write_tokens(bufs[n], new[n], lengths - first, new_lengths,
                                      slot_axis=slot_axis) for n in bufs}

  written = lay.smap(local, (buf_spec, new_spec, P(lay.batch), P(lay.batch)), buf_spec)(
      bufs, new, cache.lengths, new_lengths)
  return cache.replace(lengths=lengths, **written)


@struct.dataclass
class ShardedKVCache(cache_lib.KVCache):
  """A `KVCache` whose arrays are sharded by `layout` (B over data, K over model, S over
  seq); `update` and `attend` run per shard in `jax.shard_map` (module docstring).

  Logical axes: `k, v`: (cache_batch, cache_kv_heads, cache_sequence, cache_head_dim);
  `k_scale, v_scale`: the first three; `lengths`: (cache_batch,).
  """

  layout: CacheLayout | None = struct.field(pytree_node=False, default=None)

  def shardings(self) -> "ShardedKVCache":
    """This cache with a `NamedSharding` in place of each array (for `out_shardings`)."""
    lay = self.layout
    kv = lay.sharding(*_spec(lay.batch, lay.kv_heads, lay.seq, None))
    sc = None if self.k_scale is None else lay.sharding(*_spec(lay.batch, lay.kv_heads, lay.seq))
    return self.replace(k=kv, v=kv, lengths=lay.sharding(lay.batch), k_scale=sc, v_scale=sc)

  def update_unchecked(self, k_new, v_new, new_lengths) -> "ShardedKVCache":
    """`KVCache.update` on each shard (`update` checks, then comes here): a sequence
    shard writes the tokens whose slots fall in its range."""
    lay = self.layout
    return _write_slots(self, ("k", "v", "k_scale", "v_scale"), k_new, v_new, new_lengths,
                        (lay.batch, lay.kv_heads, lay.seq, None),
                        (lay.batch, None, lay.kv_heads, None), slot_axis=2)

  def attend(self, q, *, q_offsets, sm_scale=None, window=None, soft_cap=None,
             implementation=None):
    """`KVCache.attend` per shard; over a sequence split, partial attention + LSE merge."""
    lay = self.layout
    check_query_heads(lay, q.shape[2], self.num_kv_heads)
    slot_len = self.max_len // axis_size(lay.mesh, lay.seq)
    arrays = {"k": self.k, "v": self.v, **self.scale_kwargs()}
    specs = {n: _spec(lay.batch, lay.kv_heads, lay.seq, None, ndim=a.ndim)
             for n, a in arrays.items()}
    q_spec = _spec(lay.batch, None, lay.q_heads, None)

    def local(q, arrays, lengths, q_offsets):
      if lay.seq is None:
        view = cache_lib.KVCache(lengths=lengths, **arrays)
        return view.attend(q, q_offsets=q_offsets, sm_scale=sm_scale, window=window,
                           soft_cap=soft_cap, implementation=implementation)
      first = jax.lax.axis_index(lay.seq) * slot_len
      key_pos = jnp.broadcast_to(first + jnp.arange(slot_len, dtype=jnp.int32),
                                 (q.shape[0], slot_len))
      q_pos = q_offsets[:, None] + jnp.arange(q.shape[1], dtype=jnp.int32)
      o, lse = cp.partial_attention(q, arrays["k"], arrays["v"], key_pos, q_pos, lengths,
                                    sm_scale=sm_scale, window=window, soft_cap=soft_cap,
                                    k_scale=arrays.get("k_scale"),
                                    v_scale=arrays.get("v_scale"))
      return cp.merge_partials(o, lse, lay.seq).astype(q.dtype)

    return lay.smap(local, (q_spec, specs, P(lay.batch), P(lay.batch)), q_spec)(
        q, arrays, self.lengths, q_offsets)


@struct.dataclass
class ShardedPagedKVCache(paged_lib.PagedKVCache):
  """A `PagedKVCache` whose pools are sharded by `layout`: K over model, pages over
  (data, seq); block tables and lengths over data. The rows of data shard j must use
  only that shard's pages (`init_caches` builds such tables; a page outside the range
  is never written or read). With the pool split over `seq` too, each shard attends
  the row's pages it holds and the partials are merged (LSE).

  Logical axes: pools (cache_kv_heads, cache_pages, cache_page_slots, cache_head_dim);
  scale pools the first three; `block_tables` (cache_batch, cache_table); `lengths`
  (cache_batch,).
  """

  layout: CacheLayout | None = struct.field(pytree_node=False, default=None)

  def shardings(self) -> "ShardedPagedKVCache":
    """This cache with a `NamedSharding` in place of each array (for `out_shardings`)."""
    lay = self.layout
    pool = lay.sharding(*_spec(lay.kv_heads, lay.pages, None, None))
    sc = None if self.k_scale_pages is None else lay.sharding(*_spec(lay.kv_heads, lay.pages))
    return self.replace(k_pages=pool, v_pages=pool, k_scale_pages=sc, v_scale_pages=sc,
                        block_tables=lay.sharding(lay.batch, None),
                        lengths=lay.sharding(lay.batch))

  def _local_pages(self, block_tables, local_pages):
    """Inside shard_map: `(local page ids i32[B, pages_per_seq], held bool[...])`."""
    first = self.layout.shard_index(self.layout.pages) * local_pages
    local = block_tables - first
    held = (local >= 0) & (local < local_pages)
    return jnp.where(held, local, NO_PAGE), held

  def update_unchecked(self, k_new, v_new, new_lengths) -> "ShardedPagedKVCache":
    """Writes through the block table (`update` checks, then comes here); each shard
    writes the tokens of its pages."""
    lengths = cache_lib.advance_lengths(self.lengths, new_lengths, self.max_len)
    lay = self.layout
    names = ("k_pages", "v_pages", "k_scale_pages", "v_scale_pages")
    new = dict(zip(names, _encode_pair(k_new, v_new, self.dtype)))
    pools = {n: getattr(self, n) for n in names if getattr(self, n) is not None}
    new = {n: new[n] for n in pools}
    pool_spec = {n: _spec(lay.kv_heads, lay.pages, None, None, ndim=pools[n].ndim) for n in pools}
    new_spec = {n: _spec(lay.batch, None, lay.kv_heads, None, ndim=new[n].ndim) for n in new}
    page_size, table_width = self.page_size, self.pages_per_seq

    def local(pools, new, tables, lengths, new_lengths):
      local_pages = next(iter(pools.values())).shape[1]
      page_ids, held = self._local_pages(tables, local_pages)
      t = jnp.arange(k_new.shape[1], dtype=jnp.int32)[None, :]
      slots = lengths[:, None] + t  # [B, T]
      logical = jnp.clip(slots // page_size, 0, table_width - 1)
      page = jnp.take_along_axis(page_ids, logical, axis=1)
      ok = ((t < new_lengths[:, None]) & (slots < table_width * page_size)
            & jnp.take_along_axis(held, logical, axis=1))
      page = jnp.where(ok, page, local_pages)  # local_pages = dropped
      return {n: pools[n].at[:, page, slots % page_size].set(
          jnp.moveaxis(new[n], 2, 0).astype(pools[n].dtype), mode="drop") for n in pools}

    written = lay.smap(local, (pool_spec, new_spec, P(lay.batch, None), P(lay.batch),
                               P(lay.batch)), pool_spec)(
        pools, new, self.block_tables, self.lengths, new_lengths)
    return self.replace(lengths=lengths, **written)

  def attend(self, q, *, q_offsets, sm_scale=None, window=None, soft_cap=None,
             implementation=None):
    """`PagedKVCache.attend` per shard; over pages split on `seq`, the row's local pages
    gathered, partial attention and LSE merge."""
    lay = self.layout
    check_query_heads(lay, q.shape[2], self.num_kv_heads)
    pools = {"k_pages": self.k_pages, "v_pages": self.v_pages}
    if self.quantized:
      pools.update(k_scale_pages=self.k_scale_pages, v_scale_pages=self.v_scale_pages)
    specs = {n: _spec(lay.kv_heads, lay.pages, None, None, ndim=a.ndim) for n, a in pools.items()}
    q_spec = _spec(lay.batch, None, lay.q_heads, None)
    page_size = self.page_size

    def local(q, pools, tables, lengths, q_offsets):
      local_pages = pools["k_pages"].shape[1]
      page_ids, held = self._local_pages(tables, local_pages)
      if lay.seq is None:
        view = paged_lib.PagedKVCache(block_tables=page_ids, lengths=lengths, **pools)
        return view.attend(q, q_offsets=q_offsets, sm_scale=sm_scale, window=window,
                           soft_cap=soft_cap, implementation=implementation)
      gather = lambda pool: jnp.moveaxis(pool[:, jnp.clip(page_ids, 0)], 1, 0)  # [B, K, W, ps..]
      flat = lambda x: x.reshape(x.shape[:2] + (-1,) + x.shape[4:])  # [B, K, W * ps, ...]
      arrays = {n: flat(gather(p)) for n, p in pools.items()}
      slot = jnp.arange(page_ids.shape[1] * page_size, dtype=jnp.int32)
      key_pos = jnp.where(jnp.repeat(held, page_size, axis=1), slot[None], -1)
      q_pos = q_offsets[:, None] + jnp.arange(q.shape[1], dtype=jnp.int32)
      o, lse = cp.partial_attention(q, arrays["k_pages"], arrays["v_pages"], key_pos, q_pos,
                                    lengths, sm_scale=sm_scale, window=window,
                                    soft_cap=soft_cap, k_scale=arrays.get("k_scale_pages"),
                                    v_scale=arrays.get("v_scale_pages"))
      return cp.merge_partials(o, lse, lay.seq).astype(q.dtype)

    return lay.smap(local, (q_spec, specs, P(lay.batch, None), P(lay.batch), P(lay.batch)),
                    q_spec)(q, pools, self.block_tables, self.lengths, q_offsets)


@struct.dataclass
class ShardedLatentCache(cache_lib.LatentCache):
  """A `LatentCache` sharded by `layout`: B over data, S over seq (replicated over
  model). The absorbed `attend` runs per shard (partials merged by LSE over a sequence
  split); `attend_expanded` (the naive prefill path) runs on the global arrays.

  Logical axes: `c_kv` (cache_batch, cache_sequence, cache_latent), `k_rope`
  (cache_batch, cache_sequence, cache_rope), scales the first two, `lengths`
  (cache_batch,).
  """

  layout: CacheLayout | None = struct.field(pytree_node=False, default=None)

  def shardings(self) -> "ShardedLatentCache":
    """This cache with a `NamedSharding` in place of each array (for `out_shardings`)."""
    lay = self.layout
    parts = lay.sharding(lay.batch, lay.seq, None)
    sc = None if self.c_kv_scale is None else lay.sharding(lay.batch, lay.seq)
    return self.replace(c_kv=parts, k_rope=parts, c_kv_scale=sc, k_rope_scale=sc,
                        lengths=lay.sharding(lay.batch))

  def update_unchecked(self, c_kv_new, k_rope_new, new_lengths) -> "ShardedLatentCache":
    """`LatentCache.update` on each shard (`update` checks, then comes here; a sequence
    shard writes its slots)."""
    lay = self.layout
    return _write_slots(self, ("c_kv", "k_rope", "c_kv_scale", "k_rope_scale"), c_kv_new,
                        k_rope_new, new_lengths, (lay.batch, lay.seq, None),
                        (lay.batch, None, None), slot_axis=1)

  def attend(self, q_latent, q_rope, *, q_offsets, sm_scale, window=None,
             implementation=None):
    """`LatentCache.attend` (absorbed) per shard; partials merged over a sequence split."""
    lay = self.layout
    slot_len = self.max_len // axis_size(lay.mesh, lay.seq)
    arrays = {"c_kv": self.c_kv, "k_rope": self.k_rope, **self.scale_kwargs()}
    specs = {n: _spec(lay.batch, lay.seq, None, ndim=a.ndim) for n, a in arrays.items()}
    q_spec = P(lay.batch, None, None, None)

    def local(q_latent, q_rope, arrays, lengths, q_offsets):
      if lay.seq is None:
        view = cache_lib.LatentCache(lengths=lengths, **arrays)
        return view.attend(q_latent, q_rope, q_offsets=q_offsets, sm_scale=sm_scale,
                           window=window, implementation=implementation)
      first = jax.lax.axis_index(lay.seq) * slot_len
      key_pos = jnp.broadcast_to(first + jnp.arange(slot_len, dtype=jnp.int32),
                                 (q_latent.shape[0], slot_len))
      q_pos = q_offsets[:, None] + jnp.arange(q_latent.shape[1], dtype=jnp.int32)
      o, lse = cp.partial_mla_attention(
          q_latent, q_rope, arrays["c_kv"], arrays["k_rope"], key_pos, q_pos, lengths,
          sm_scale=sm_scale, window=window, c_kv_scale=arrays.get("c_kv_scale"),
          k_rope_scale=arrays.get("k_rope_scale"))
      return cp.merge_partials(o, lse, lay.seq).astype(q_latent.dtype)

    return lay.smap(local, (q_spec, q_spec, specs, P(lay.batch), P(lay.batch)), q_spec)(
        q_latent, q_rope, arrays, self.lengths, q_offsets)


# ----------------------------------------------------------------------------------------------
# Creating sharded caches.


def sharded_block_tables(batch: int, pages_per_seq: int, mesh: Mesh, layout: CacheLayout
                         ) -> np.ndarray:
  """`i32[B, pages_per_seq]`: row b (data shard j, local row r) gets its logical page i
  on `seq` shard `i // (pages_per_seq / s)`, in that device's range of the pool, so
  every data shard's rows use its own pages and each row's tokens are spread evenly
  over the sequence shards. Needs `s` to divide `pages_per_seq` (ValueError)."""
  d = axis_size(layout.mesh, layout.batch)
  s = axis_size(layout.mesh, layout.seq)
  if pages_per_seq % s:
    raise ValueError(f"mesh axis {layout.seq!r} of size {s} must divide the pages per "
                     f"sequence; got {pages_per_seq}")
  rows = batch // d
  per_shard = pages_per_seq // s  # a row's pages on one seq shard
  local_pool = rows * per_shard  # pages per (data, seq) device
  b = np.arange(batch)[:, None]
  i = np.arange(pages_per_seq)[None, :]
  shard = (b // rows) * s + i // per_shard  # linear index over (data, seq)
  return (shard * local_pool + (b % rows) * per_shard + i % per_shard).astype(np.int32)


def _layer_kind(attn) -> str:
  return "latent" if hasattr(attn, "kv_lora_rank") else "gqa"


def init_caches(model, batch: int, max_len: int, mesh: Mesh, *,
                rules: Mapping[str, Any] | None = None, dtype: Any = None,
                kind: str = "dense", page_size: int = 16,
                local_layers: str = "full") -> tuple[Any, ...]:
  """One empty sharded cache per layer of `model`, created directly sharded (built
  inside `jax.jit` with `out_shardings`).

  Args:
    model: a `kvattn.Transformer`.
    batch, max_len: B and the capacity S in tokens.
    mesh: a `make_mesh` mesh.
    rules: logical-axis rule overrides (`resolve_rules`).
    dtype: cache storage dtype (default the model's compute dtype; int8 / fp8 too).
    kind: "dense" (`ShardedKVCache`) or "paged" (`ShardedPagedKVCache`, `max_len /
      page_size` pages per row, the pool exactly the batch's pages, tables from
      `sharded_block_tables`) for GQA layers; MLA layers get `ShardedLatentCache`.
    page_size: tokens per page (paged).
    local_layers: "full" (every layer `kind`) or "ring": the per-layer layout
      (`registry.build_caches`): layers with a sliding window shorter than `max_len` get a
      `RingKVCache` of the window placed by `place_ring`, the others `kind`.

  Raises:
    ValueError: an unknown kind or `local_layers`; a mesh axis that does not divide B, S or the pool
      (naming the axis); K and the model axis where neither divides the other.
  """
  if kind not in CACHE_KINDS:
    raise ValueError(f"kind must be one of {CACHE_KINDS}; got {kind!r}")
  batch = _checks.positive_int("batch", batch)
  max_len = _checks.positive_int("max_len", max_len)
  page_size = _checks.positive_int("page_size", page_size)
  dtype = model.dtype if dtype is None else dtype
  if local_layers not in registry.LOCAL_LAYER_LAYOUTS:
    raise ValueError(f"local_layers must be one of {registry.LOCAL_LAYER_LAYOUTS}; got "
                     f"{local_layers!r}")
  rings = set(registry.ring_layers(model, max_len)) if local_layers == "ring" else set()
  builders = []
  owners = getattr(model, "cache_layers", range(len(model.layers)))  # cross-layer KV sharing
  for i, layer in ((i, model.layers[i]) for i in owners):
    attn = layer.attn
    if i in rings:
      continue
    if _layer_kind(attn) == "latent":
      lay = cache_layout(mesh, rules, kind="latent", batch=batch, max_len=max_len)
      builders.append(lambda lay=lay, a=attn: ShardedLatentCache(
          **_fields(cache_lib.LatentCache.init(batch, max_len, a.kv_lora_rank,
                                               a.qk_rope_head_dim, dtype)), layout=lay))
    elif kind == "dense":
      lay = cache_layout(mesh, rules, kind="dense", batch=batch, max_len=max_len,
                         num_kv_heads=attn.num_kv_heads, num_heads=attn.num_heads)
      builders.append(lambda lay=lay, a=attn: ShardedKVCache(
          **_fields(cache_lib.KVCache.init(batch, max_len, a.num_kv_heads, a.head_dim, dtype)),
          layout=lay))
    else:
      pps = pages_for(max_len, page_size)
      lay = cache_layout(mesh, rules, kind="paged", batch=batch, max_len=max_len,
                         num_kv_heads=attn.num_kv_heads, num_heads=attn.num_heads,
                         num_pages=batch * pps)
      tables = sharded_block_tables(batch, pps, mesh, lay)
      builders.append(lambda lay=lay, a=attn, tables=tables: ShardedPagedKVCache(
          **_fields(paged_lib.PagedKVCache.init(
              batch, num_pages=batch * pps, page_size=page_size, pages_per_seq=pps,
              num_kv_heads=a.num_kv_heads, head_dim=a.head_dim, dtype=dtype,
              block_tables=tables)), layout=lay))

  def build():
    return tuple(b() for b in builders)
  shardings = tuple(c.shardings() for c in jax.eval_shape(build))
  built = iter(jax.jit(build, out_shardings=shardings)())
  return tuple(
      place_ring(window_lib.RingKVCache.init(batch, layer.attn.window, layer.attn.num_kv_heads,
                                             layer.attn.head_dim, dtype), mesh, rules)
      if i in rings else next(built) for i, layer in ((i, model.layers[i]) for i in owners))


def place_ring(ring: window_lib.RingKVCache, mesh: Mesh,
               rules: Mapping[str, Any] | None = None) -> window_lib.RingKVCache:
  """A `RingKVCache` (a local layer's window in the per-layer layout) on `mesh`: rows over
  the `cache_batch` rule's axes (`data`), KV heads over `cache_kv_heads` (`model`) where
  that axis divides them (else replicated), the W slots whole (a window is small: no
  sequence split). It stays a plain `RingKVCache`: XLA partitions its attention (GSPMD).

  Raises:
    ValueError: the batch axes do not divide the rows (naming the axis).
  """
  rules = resolve_rules(rules)
  batch_axes, heads_axes = rules["cache_batch"], rules["cache_kv_heads"]
  if ring.batch % axis_size(mesh, batch_axes):
    raise ValueError(f"mesh axis {batch_axes!r} of size {axis_size(mesh, batch_axes)} must "
                     f"divide the ring's batch {ring.batch}")
  if ring.num_kv_heads % axis_size(mesh, heads_axes):
    heads_axes = None

  def spec(a):
    return P(batch_axes, heads_axes, *([None] * (a.ndim - 2))) if a.ndim >= 3 else \
        P(batch_axes, *([None] * (a.ndim - 1)))
  return jax.tree.map(lambda a: jax.device_put(a, NamedSharding(mesh, spec(a))), ring)


def _fields(cache) -> dict[str, Any]:
  return {f.name: getattr(cache, f.name) for f in dataclasses.fields(cache)}


def cache_factory(model, mesh: Mesh, *, rules: Mapping[str, Any] | None = None,
                  kind: str = "dense", page_size: int = 16, local_layers: str = "full"):
  """`(batch, max_len, dtype=None) -> caches` for `kvattn.generate(..., cache_factory=)`.

  The capacity is `max_len` rounded up to a multiple of what the sequence split needs
  (the `seq` axis size times `page_size` for paged caches), so any length `generate`
  asks for fits; the batch must still divide over `data` (ValueError). `local_layers`
  as in `init_caches`.
  """
  seq = _single_axis(resolve_rules(rules), "cache_sequence")
  step = axis_size(mesh, seq) * (page_size if kind == "paged" else 1)

  def factory(batch: int, max_len: int, dtype: Any = None) -> tuple[Any, ...]:
    max_len = -(-_checks.positive_int("max_len", max_len) // step) * step
    return init_caches(model, batch, max_len, mesh, rules=rules, dtype=dtype, kind=kind,
                       page_size=page_size, local_layers=local_layers)
  return factory


# Rules of `ContinuousBatcher(mesh=...)`: slots (rows) over `data`, the pool over KV heads
# and over `data` (one host allocator per data shard hands out only that shard's pages),
# no sequence split (the pool is replicated over `seq`).
BATCHER_RULES = {"cache_sequence": None, "cache_pages": "data"}
# Rules for a paged cache whose rows may use any page of the pool (e.g. one allocator for
# the whole pool): the pool is split over KV heads only (rows and pages stay whole on every
# device).
HEADS_ONLY_RULES = {"cache_batch": None, "cache_sequence": None, "cache_pages": None}


def place_caches(caches: Sequence[Any], mesh: Mesh, rules: Mapping[str, Any] | None = None,
                 *, num_heads: int | Sequence[int | None] | None = None) -> tuple[Any, ...]:
  """Existing `KVCache` / `PagedKVCache` / `LatentCache`s moved onto `mesh` as their
  sharded kinds (`jax.device_put`; for caches built or restored elsewhere). A paged
  cache's rows must use the pages of their data shard (or use `HEADS_ONLY_RULES`).

  A cache does not know the query heads N of its layer, and where the KV heads are
  fewer than the heads axis (replicated) the layout depends on N, so `num_heads` is
  then required: the layers' N, one int for all or a sequence with one entry per
  cache (e.g. `[layer.attn.num_heads for layer in model.layers]`; None for latent
  caches). Every layout is checked here, so a placed cache either runs with its
  layer or this raises (`cache_layout`), never the first attention call.

  Raises:
    TypeError: a cache of another kind.
    ValueError: as `cache_layout` (naming the mesh axis, the head counts and the
      splits that would fit), or a `num_heads` sequence of another length.
  """
  caches = tuple(caches)
  if num_heads is None or isinstance(num_heads, (int, np.integer)):
    heads = (num_heads,) * len(caches)
  else:
    heads = tuple(num_heads)
    if len(heads) != len(caches):
      raise ValueError(f"num_heads must be an int or have one entry per cache ({len(caches)}); "
                       f"got {len(heads)}")
  out = []
  for i, (c, n) in enumerate(zip(caches, heads)):
    try:
      lay, cls = _placed_layout(c, mesh, rules, n)
    except ValueError as e:
      raise ValueError(f"caches[{i}]: {e}") from None
    fields = {k: v for k, v in _fields(c).items() if k != "layout"}
    sharded = cls(**fields, layout=lay)
    out.append(jax.device_put(sharded, sharded.shardings()))
  return tuple(out)


def _placed_layout(c, mesh: Mesh, rules, num_heads: int | None) -> tuple[CacheLayout, type]:
  """The layout and sharded class of existing cache `c` (`place_caches`)."""
  if isinstance(c, paged_lib.PagedKVCache):
    return cache_layout(mesh, rules, kind="paged", batch=c.batch, max_len=c.max_len,
                        num_kv_heads=c.num_kv_heads, num_heads=num_heads,
                        num_pages=c.num_pages), ShardedPagedKVCache
  if isinstance(c, cache_lib.KVCache):
    return cache_layout(mesh, rules, kind="dense", batch=c.batch, max_len=c.max_len,
                        num_kv_heads=c.num_kv_heads, num_heads=num_heads), ShardedKVCache
  if isinstance(c, cache_lib.LatentCache):
    return (cache_layout(mesh, rules, kind="latent", batch=c.batch, max_len=c.max_len),
            ShardedLatentCache)
  raise TypeError(f"caches must be KVCache, PagedKVCache or LatentCache to shard; got "
                  f"{type(c).__name__}")



# ----------------------------------------------------------------------------------------------
# Caches below 8 bits (KIVI, rotated; dense or paged store) on a mesh.


def place_lowbit(cache: Any, mesh: Mesh, rules: Mapping[str, Any] | None = None) -> Any:
  """A sub-byte cache (`kvattn.caches._residual.ResidualStoreCache`: `KIVICache`,
  `RotatedCache`, `PagedKIVICache`, `KIVILatentCache`) with its arrays placed on `mesh`; it stays the same kind
  and XLA partitions its ops (GSPMD), as `place_ring` does for rings.

  Axes: rows `[B, ...]` (the rings `k_res, v_res: [B, K, Rb, H]`, a dense store's codes,
  scales and zero points `[B, K, Sq, ...]`, `lengths`, `block_tables`) over the
  `cache_batch` rule's axis; the KV-head axis K over `cache_kv_heads` where that axis size
  divides K (else replicated, each device holding every head); a paged store's pools
  `[K, P, ...]` over K likewise and over the `cache_pages` axes that divide P. The store's
  slots are never split (`cache_sequence` is not used: a group of codes and its scale row
  stay on one device, and the store is read block by block along them).

  Raises:
    TypeError: a cache of another kind.
    ValueError: the batch axes do not divide B, or the page axes do not divide P (naming
      the axis).
  """
  from kvattn.caches import _residual  # pylint: disable=g-import-not-at-top
  from kvattn.caches import paged_kivi  # pylint: disable=g-import-not-at-top
  if not isinstance(cache, _residual.ResidualStoreCache):
    raise TypeError(f"cache must be a KIVICache, RotatedCache or PagedKIVICache to place with "
                    f"place_lowbit; got {type(cache).__name__}")
  rules = resolve_rules(rules)
  batch_axes, heads_axes = rules["cache_batch"], rules["cache_kv_heads"]
  _divides(mesh, batch_axes, cache.batch, "the batch B")
  if cache.k_res.shape[1] % axis_size(mesh, heads_axes):  # K (1 for MLA latents)
    heads_axes = None
  paged = isinstance(cache, paged_kivi.PagedKIVICache)
  page_axes = None
  if paged:
    page_axes = tuple(a for a in mesh_axes(rules["cache_pages"]) if mesh.shape[a] > 1) or None
    _divides(mesh, page_axes, cache.num_pages, "the page pool P (num_pages)")
  pools = set(paged_kivi.PagedKIVICache.POOL_FIELDS) if paged else set()

  def place(name, a):
    if name in pools:
      spec = P(heads_axes, page_axes, *([None] * (a.ndim - 2)))
    elif a.ndim >= 3:
      spec = P(batch_axes, heads_axes, *([None] * (a.ndim - 2)))
    else:
      spec = P(batch_axes, *([None] * (a.ndim - 1)))
    return jax.device_put(a, NamedSharding(mesh, spec))

  return cache.replace(**{f.name: place(f.name, getattr(cache, f.name))
                          for f in dataclasses.fields(cache)
                          if isinstance(getattr(cache, f.name), jax.Array)})


def lowbit_cache_factory(model, mesh: Mesh, cache: Any, *,
                         rules: Mapping[str, Any] | None = None):
  """`(batch, max_len, dtype=None) -> caches` for `kvattn.generate(..., cache_factory=)`:
  the registry's caches of spec `cache` (a sub-byte kind: `kivi2`, `kivi4`, `rotated3`,
  `rotated4`, `paged_kivi2`, `paged_kivi4`) built on the host's default device, then placed
  on `mesh` by `place_lowbit`.

  Raises:
    ValueError: a spec of another kind (naming `cache.kind`), or as `place_lowbit` (at the
      factory's call).
  """
  cache = {"kind": cache} if isinstance(cache, str) else cache
  kind, _ = registry.cache_options(cache)
  if not kind.startswith(("kivi", "rotated", "paged_kivi")):
    raise ValueError(f"cache.kind must be a sub-byte kind (kivi*, rotated*, paged_kivi*) for "
                     f"lowbit_cache_factory (the others: cache_factory); got {kind!r}")
  build = registry.cache_factory_from_config(model, cache)

  def factory(batch: int, max_len: int, dtype: Any = None) -> tuple[Any, ...]:
    return tuple(place_lowbit(c, mesh, rules) for c in build(batch, max_len, dtype))
  return factory
