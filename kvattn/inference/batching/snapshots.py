"""Boundary states of a prefix cache: what a cached prefix of m tokens needs besides its pages."""

from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np


class BoundarySnapshots:
  """Snapshots of layers `layers` (indices into the caches), `counts[i]` tokens each.

  Attributes:
    nbytes: bytes of one snapshot.
    empty: the snapshot of an empty row (zeros) on `home`.
    exact_only: a state can only be taken at the row's exact length (a residual ring drops a
      group's full precision when it flushes), so a prefill is split where it is taken.
  """

  def __init__(self, caches: Sequence[Any], layers: Sequence[int], counts: Sequence[int],
               home: Any, *, exact_only: bool = False):
    self.layers = tuple(layers)
    self.counts = tuple(int(c) for c in counts)
    self.exact_only = exact_only
    self.layouts = [lay for i, n in zip(self.layers, self.counts)
                    for lay in caches[i].boundary_layout(n)]
    self.home = home
    self.nbytes = sum(int(np.prod(sh)) * jnp.dtype(d).itemsize for sh, d in self.layouts)
    self.empty = jax.tree.map(jnp.zeros_like,
                              jax.device_put(self._snapshot_of(caches, 0, 0), home))
    self._take = jax.jit(self._snapshot_of)

  def _snapshot_of(self, caches, slot, end):
    return tuple(caches[i].boundary_state(slot, end, n) for i, n in zip(self.layers, self.counts))

  def take(self, caches: Sequence[Any], slot: int, end: int) -> tuple:
    """The snapshot at token `end` of row `slot`."""
    return self._take(tuple(caches), np.int32(slot), np.int32(end))

  def restore(self, caches: Sequence[Any], slot, snapshot, end) -> tuple:
    """`caches` with row `slot` holding what an `end`-token row holds (`end` 0: empty;
    traceable)."""
    caches = list(caches)
    for (i, n), state in zip(zip(self.layers, self.counts), snapshot):
      caches[i] = caches[i].with_boundary_state(slot, state, end, n)
    return tuple(caches)

  def encode(self, snapshot) -> np.ndarray:
    """`u8[nbytes]`: the snapshot's raw bytes (host)."""
    leaves = [np.asarray(a) for a in jax.tree.leaves(snapshot)]
    return np.concatenate([a.reshape(-1).view(np.uint8) for a in leaves])

  def decode(self, data: Any) -> tuple:
    """The snapshot `encode` gave these bytes of, on `home`.

    Raises:
      ValueError: `data` does not hold exactly `nbytes` bytes.
    """
    data = np.asarray(data, np.uint8).reshape(-1)
    if data.size != self.nbytes:
      raise ValueError(f"data must hold {self.nbytes} bytes; got {data.size}")
    arrays, offset = [], 0
    for shape, dtype in self.layouts:
      size = int(np.prod(shape)) * jnp.dtype(dtype).itemsize
      arrays.append(np.ascontiguousarray(data[offset:offset + size]).view(
          jnp.dtype(dtype)).reshape(shape))
      offset += size
    return jax.device_put(jax.tree.unflatten(jax.tree.structure(self.empty), arrays), self.home)


class RingSnapshots(BoundarySnapshots):
  """The rings' states (`ring_layers`, windows `windows`): tokens `[m - W, m)` of each ring.
  The batcher's rings hold `W + page_size - 1` slots, so a row of n tokens still holds the
  window of its last page boundary."""

  def __init__(self, caches: Sequence[Any], ring_layers: Sequence[int],
               windows: Sequence[int], home: Any):
    super().__init__(caches, ring_layers, windows, home)


class ResidualSnapshots(BoundarySnapshots):
  """The residual rings' states of low-bit pools with a residual R > 0."""

  def __init__(self, caches: Sequence[Any], home: Any):
    layers = [i for i, c in enumerate(caches) if getattr(c, "residual", 0) > 0
              and hasattr(c, "boundary_state")]
    super().__init__(caches, layers, [caches[i].residual for i in layers], home,
                     exact_only=True)
