"""Host reads and writes that also work in a multi-process run (`jax.distributed`).

In a multi-process run a global array spans devices of other processes: `np.asarray` cannot
read it and `jax.device_put` cannot write to its sharding. These two functions do both
through JAX's multi-host utilities, and are plain `np.asarray` / `jax.device_put` otherwise.
Both are collectives when the array spans processes: every process calls them on the same
arrays in the same order, as SPMD code does.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np


def host_array(x: Any) -> np.ndarray:
  """`x`'s values on the host; an array spread over other processes' devices is gathered
  with `jax.experimental.multihost_utils.process_allgather`."""
  if isinstance(x, jax.Array) and not x.is_fully_addressable:
    from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
  return np.asarray(x)


def put(x: Any, where: Any) -> Any:
  """`jax.device_put(x, where)` for a device or sharding of this process; for a sharding
  spanning other processes, the global array whose every shard is cut from host `x` (the
  same values on every process). Typed PRNG keys keep their type."""
  if isinstance(where, jax.Device) or where.is_fully_addressable:
    return jax.device_put(x, where)
  if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
    impl = jax.random.key_impl(x)
    data = put(host_array(jax.random.key_data(x)), where)
    return jax.jit(lambda d: jax.random.wrap_key_data(d, impl=impl), out_shardings=where)(data)
  host = host_array(x)
  return jax.make_array_from_callback(host.shape, where, lambda index: host[index])
