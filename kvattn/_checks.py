"""Argument validation shared by kvattn's public functions.

Every check raises before any compute, with a message that names the argument,
the value it got and what was expected (DESIGN.md, invariant 7).
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np


def positive_int(name: str, value: Any) -> int:
  """Returns `value` as an int, or raises if it is not a positive integer."""
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
    raise TypeError(f"{name} must be a positive int; got {value!r} of type {type(value).__name__}")
  if value <= 0:
    raise ValueError(f"{name} must be a positive int; got {value}")
  return int(value)


def optional_positive_int(name: str, value: Any) -> int | None:
  return None if value is None else positive_int(name, value)


def positive_float(name: str, value: Any) -> float:
  if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
    raise TypeError(f"{name} must be a positive float; got {value!r}")
  if not value > 0 or not np.isfinite(value):
    raise ValueError(f"{name} must be a positive finite float; got {value}")
  return float(value)


def optional_positive_float(name: str, value: Any) -> float | None:
  return None if value is None else positive_float(name, value)


def head_layout(num_heads: Any, num_kv_heads: Any) -> tuple[int, int, int]:
  """Validates a GQA head layout and returns (N, K, G) with G = N // K."""
  n = positive_int("num_heads", num_heads)
  k = positive_int("num_kv_heads", num_kv_heads)
  if n % k:
    raise ValueError(
        f"num_heads must be divisible by num_kv_heads; got {n} and {k}")
  return n, k, n // k


def rank(name: str, x: Any, expected: int, shape_doc: str) -> None:
  if not hasattr(x, "ndim"):
    raise TypeError(f"{name} must be an array {shape_doc}; got {type(x).__name__}")
  if x.ndim != expected:
    raise ValueError(
        f"{name} must have rank {expected} {shape_doc}; got shape {tuple(x.shape)}")


def floating(name: str, x: Any) -> None:
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise TypeError(f"{name} must have a floating dtype; got {x.dtype}")


def integer(name: str, x: Any) -> None:
  if not jnp.issubdtype(x.dtype, jnp.integer):
    raise TypeError(f"{name} must have an integer dtype; got {x.dtype}")


def same_dtype(names: Sequence[str], arrays: Sequence[Any]) -> None:
  dtypes = [a.dtype for a in arrays]
  if any(d != dtypes[0] for d in dtypes):
    listing = ", ".join(f"{n}={d}" for n, d in zip(names, dtypes))
    raise TypeError(f"{' and '.join(names)} must share one dtype; got {listing}")


def dim(name: str, x: Any, axis: int, expected: int, what: str) -> None:
  if x.shape[axis] != expected:
    raise ValueError(
        f"{name}.shape[{axis}] ({what}) must be {expected}; got shape {tuple(x.shape)}")


def float_dtype(name: str, value: Any) -> jnp.dtype:
  """Returns `value` as a floating jnp.dtype (e.g. a compute or parameter dtype).

  Raises:
    TypeError: `value` does not name a dtype, or names a non-floating one.
  """
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
  """Returns `value` if it is None or one of `choices` (backend names), else raises.

  Raises:
    TypeError: a value that is neither a str nor None.
    ValueError: a str that is not one of `choices`.
  """
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


def rope_scaling(value: Any) -> Any:
  """`value` if it is a `kvattn.ops.RopeScaling` or None; TypeError naming `rope_scaling` else."""
  from kvattn.ops import rope  # pylint: disable=g-import-not-at-top  (ops imports _checks)
  if value is not None and not isinstance(value, rope.RopeScaling):
    raise TypeError(f"rope_scaling must be a kvattn.ops.RopeScaling or None; got {value!r}")
  return value
