"""Where a cache's dimensions live on a device mesh: `CacheLayout` (the shard_map twins of
`kvattn.caches.sharded`) and `place` (any kind, from its declared logical axes).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from kvattn import _checks
from kvattn.caches import capabilities
from kvattn.sharding import axis_size, mesh_axes, resolve_rules

LAYOUT_KINDS = ("dense", "paged", "latent")


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
  """The mesh axes of the query heads N of a layer with `num_kv_heads` K on `axis`."""
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

  Raises:
    ValueError: a mesh axis that does not divide the dimension it splits (batch B, slots S, page
      pool P), naming the axis; K and the heads axis where neither divides the other; `num_heads`
      missing where needed (naming the axis, K and the splits N may take) or not a multiple of
      `num_kv_heads`; a multi-axis rule for the batch, slots or KV heads.
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
    raise ValueError(f"kind must be one of {LAYOUT_KINDS}; got {kind!r}")
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
# Any kind, from its logical axes.


def place(cache: Any, mesh: Mesh, rules: Mapping[str, Any] | None = None) -> Any:
  """`cache` (any kind) with each array placed on `mesh` by its logical axes
  (`capabilities.logical_axes`) and `rules`; it stays the same kind.

  Raises:
    ValueError: a batch / page / slot dimension its mesh axes do not divide (naming the axis).
  """
  rules = resolve_rules(rules)
  axes = capabilities.logical_axes(cache)
  where = {"cache_batch": "the batch B", "cache_pages": "the page pool P (num_pages)",
           "cache_sequence": "the cache slots S"}

  def mesh_of(name, size):
    if name is None:
      return None
    found = tuple(a for a in mesh_axes(rules.get(name)) if mesh.shape[a] > 1) or None
    if found is None:
      return None
    if name == "cache_kv_heads":
      return found if size % axis_size(mesh, found) == 0 else None
    _divides(mesh, found, size, where.get(name, name))
    return found

  def put(field, a):
    names = axes.get(field, ())
    spec = [mesh_of(n, a.shape[d]) for d, n in enumerate(names)]
    return jax.device_put(a, NamedSharding(mesh, _spec(*spec)))

  return cache.replace(**{f.name: put(f.name, getattr(cache, f.name))
                          for f in dataclasses.fields(cache)
                          if isinstance(getattr(cache, f.name), jax.Array)})
