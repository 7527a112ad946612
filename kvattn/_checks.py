"""kvattn's argument checks: each raises before any compute, naming the argument. The
kernels' own checks (`pallas_kernels.attention_common`) are imported here once.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from kvattn import _multihost

from pallas_kernels.attention_common import (  # noqa: F401  (kvattn's names for them)
    check_decode_args, check_dense_args, check_mla_args, check_mla_decode_args,
    check_paged_args, dim, floating, head_layout, integer, lengths_arg, optional_positive_float,
    optional_positive_int, positive_float, positive_int, rank, same_dtype)


def float_dtype(name: str, value: Any) -> jnp.dtype:
  """`value` as a floating jnp.dtype; TypeError unless it names one."""
  try:
    dtype = jnp.dtype(value)
  except TypeError:
    raise TypeError(f"{name} must be a floating dtype such as jnp.float32 or 'bfloat16'; got "
                    f"{value!r}") from None
  if not jnp.issubdtype(dtype, jnp.floating):
    raise TypeError(f"{name} must be a floating dtype such as jnp.float32 or 'bfloat16'; got "
                    f"{dtype.name}")
  return dtype


def implementation(name: str, value: Any, choices: Sequence[str]) -> str | None:
  """`value` if None or one of `choices`; TypeError for a non-str, ValueError else."""
  if value is None:
    return None
  if not isinstance(value, str):
    raise TypeError(f"{name} must be a str or None; got {value!r} of type {type(value).__name__}")
  if value not in choices:
    raise ValueError(f"{name} must be one of {sorted(choices)} or None; got {value!r}")
  return value


def is_concrete(x: Any) -> bool:
  """True when `x` holds values known on the host (not a tracer)."""
  return not isinstance(x, jax.core.Tracer)


def values_in_range(name: str, x: Any, low: int, high: int | None = None) -> None:
  """Eager: each value of integer `x` lies in `[low, high]` (skipped when traced).

  Raises:
    ValueError: naming the first bad element, e.g. "lengths[1] = -2 must lie in [0, 8]".
  """
  if not is_concrete(x):
    return
  host = _multihost.host_array(x)
  bad = host < low if high is None else (host < low) | (host > high)
  if not bad.any():
    return
  index = tuple(int(i) for i in np.argwhere(bad)[0])
  where = f"{name}[{', '.join(map(str, index))}]" if index else name
  bound = f"be >= {low}" if high is None else f"lie in [{low}, {high}]"
  shown = f"; {name} = {host.tolist()}" if 1 < host.size <= 16 else ""
  raise ValueError(f"{where} = {int(host[index])} must {bound}{shown}")
