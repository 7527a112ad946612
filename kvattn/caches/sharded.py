"""KV caches sharded over a device mesh (`kvattn.sharding` holds the mesh and its rules)."""

from __future__ import annotations

import dataclasses
import types
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.sharding import Mesh, PartitionSpec as P

from kvattn import _checks
from kvattn.caches import dense as cache_lib
from kvattn.caches import paged as paged_lib
from kvattn.caches import registry
from kvattn.caches.mesh_layout import (CacheLayout, _divides, _single_axis, _spec,  # noqa: F401
                                       cache_layout, check_query_heads, place)
from kvattn.paging.allocator import NO_PAGE, pages_for
from kvattn.ops import context_parallel as cp
from kvattn.sharding import axis_size, resolve_rules


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
  """

  layout: CacheLayout | None = struct.field(pytree_node=False, default=None)

  @staticmethod
  def layout_for(c, mesh, rules, num_heads) -> CacheLayout:
    return cache_layout(mesh, rules, kind="dense", batch=c.batch, max_len=c.max_len,
                        num_kv_heads=c.num_kv_heads, num_heads=num_heads)

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
  """

  layout: CacheLayout | None = struct.field(pytree_node=False, default=None)

  @staticmethod
  def layout_for(c, mesh, rules, num_heads) -> CacheLayout:
    return cache_layout(mesh, rules, kind="paged", batch=c.batch, max_len=c.max_len,
                        num_kv_heads=c.num_kv_heads, num_heads=num_heads,
                        num_pages=c.num_pages)

  def slot_view(self, slot):
    """A batch-1 view; the row is replicated, the pool stays split (the shard holding the
    row's pages writes them; attention merges the shards' partials over `data`)."""
    view = super().slot_view(slot)
    lay = self.layout
    if lay is None:
      return view
    return view.replace(layout=dataclasses.replace(
        lay, batch=None, seq=lay.pages[0] if lay.pages else None))

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
  """

  layout: CacheLayout | None = struct.field(pytree_node=False, default=None)

  @staticmethod
  def layout_for(c, mesh, rules, num_heads) -> CacheLayout:
    del num_heads
    return cache_layout(mesh, rules, kind="latent", batch=c.batch, max_len=c.max_len)

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


TWIN_KINDS = ("dense", "paged")
"""Kinds `init_caches` builds as shard_map twins; every other kind is placed (`place`)."""


def init_caches(model, batch: int, max_len: int, mesh: Mesh, *,
                rules: Mapping[str, Any] | None = None, dtype: Any = None,
                kind: Any = "dense", page_size: int = 16,
                local_layers: str = "full") -> tuple[Any, ...]:
  """One empty cache per layer of `model` that owns one, on `mesh`.

  Args:
    model: a `kvattn.Transformer`.
    batch, max_len: B and the capacity S in tokens.
    mesh: a `make_mesh` mesh.
    rules: logical-axis rule overrides (`resolve_rules`).
    dtype: cache storage dtype (default the model's compute dtype; int8 / fp8 too).
    kind: "dense" (`ShardedKVCache`; MLA layers `ShardedLatentCache`) or "paged"
      (`ShardedPagedKVCache`, `max_len / page_size` pages per row, tables from
      `sharded_block_tables`), built inside `jax.jit` with `out_shardings`; or any other
      registered kind's name or spec, built by the registry and `place`d.
    page_size: tokens per page (paged).
    local_layers: "full" or "ring" (`registry.build_caches`); rings are `place`d.

  Raises:
    ValueError: an unknown kind or `local_layers`; a mesh axis that does not divide B, S or
      the pool (naming the axis); K and the model axis where neither divides the other.
  """
  batch = _checks.positive_int("batch", batch)
  max_len = _checks.positive_int("max_len", max_len)
  page_size = _checks.positive_int("page_size", page_size)
  dtype = model.dtype if dtype is None else dtype
  if local_layers not in registry.LOCAL_LAYER_LAYOUTS:
    raise ValueError(f"local_layers must be one of {registry.LOCAL_LAYER_LAYOUTS}; got "
                     f"{local_layers!r}")
  if kind not in TWIN_KINDS:
    if isinstance(kind, str) and kind not in registry.CACHE_KIND_TABLE:
      raise ValueError(f"kind must be one of {tuple(registry.CACHE_KIND_TABLE)}; got {kind!r}")
    spec = {"kind": kind} if isinstance(kind, str) else kind
    registry.cache_options(spec, "kind")
    return tuple(place(c, mesh, rules) for c in registry.build_caches(
        model, batch, max_len, dtype, spec, local_layers=local_layers))
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
  ring = registry.CACHE_KIND_TABLE["ring"].build
  return tuple(
      place(ring(types.SimpleNamespace(layers=[layer]), batch, max_len, dtype,
                 {"window": layer.attn.window}, None)[0], mesh, rules)
      if i in rings else next(built) for i, layer in ((i, model.layers[i]) for i in owners))


def place_ring(ring: Any, mesh: Mesh, rules: Mapping[str, Any] | None = None) -> Any:
  """`place` (kept for callers of the per-layer layout's rings)."""
  return place(ring, mesh, rules)


def place_lowbit(cache: Any, mesh: Mesh, rules: Mapping[str, Any] | None = None) -> Any:
  """`place` (kept for callers of the sub-byte kinds)."""
  return place(cache, mesh, rules)


def _fields(cache) -> dict[str, Any]:
  return {f.name: getattr(cache, f.name) for f in dataclasses.fields(cache)}


def cache_factory(model, mesh: Mesh, *, rules: Mapping[str, Any] | None = None,
                  kind: Any = "dense", page_size: int = 16, local_layers: str = "full"):
  """`(batch, max_len, dtype=None) -> caches` for `kvattn.generate(..., cache_factory=)`."""
  seq = _single_axis(resolve_rules(rules), "cache_sequence")
  step = axis_size(mesh, seq) * (page_size if kind == "paged" else 1) if kind in TWIN_KINDS \
      else 1

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

_TWINS = {cls.__mro__[1]: cls for cls in (ShardedKVCache, ShardedPagedKVCache,
                                          ShardedLatentCache)}
"""Exact class -> its shard_map twin (a subclass of a kind is `place`d, not twinned)."""


def place_caches(caches: Sequence[Any], mesh: Mesh, rules: Mapping[str, Any] | None = None,
                 *, num_heads: int | Sequence[int | None] | None = None) -> tuple[Any, ...]:
  """Existing caches moved onto `mesh`: `KVCache` / `PagedKVCache` / `LatentCache` as their
  shard_map twins, every other kind `place`d by its logical axes. A paged cache's rows must
  use the pages of their data shard (or use `HEADS_ONLY_RULES`).

  Raises:
    ValueError: as `cache_layout` / `place` (naming the mesh axis, the head counts and the
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
    twin = _TWINS.get(type(c))
    try:
      if twin is None:
        out.append(place(c, mesh, rules))
        continue
      lay = twin.layout_for(c, mesh, rules, n)
    except ValueError as e:
      raise ValueError(f"caches[{i}]: {e}") from None
    fields = {k: v for k, v in _fields(c).items() if k != "layout"}
    sharded = twin(**fields, layout=lay)
    out.append(jax.device_put(sharded, sharded.shardings()))
  return tuple(out)


def lowbit_cache_factory(model, mesh: Mesh, cache: Any, *,
                         rules: Mapping[str, Any] | None = None):
  """`(batch, max_len, dtype=None) -> caches` for `kvattn.generate(..., cache_factory=)`: the
  registry's caches of spec `cache` (any kind) built on the default device, then `place`d on `mesh`.

  Raises:
    ValueError: an unknown kind or option (naming `cache.<key>`), or as `place` (at the factory's
      call).
  """
  cache = {"kind": cache} if isinstance(cache, str) else cache
  build = registry.cache_factory_from_config(model, cache)

  def factory(batch: int, max_len: int, dtype: Any = None) -> tuple[Any, ...]:
    return tuple(place(c, mesh, rules) for c in build(batch, max_len, dtype))
  return factory
