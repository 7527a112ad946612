"""Checks and measurements the families share: model specs, a traced decode step before
any work, cache bytes against the analytic count, available memory."""

from __future__ import annotations

import sys
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from kvattn import memory
from kvattn.models import transformer as transformer_lib


def model_spec(d: Mapping[str, Any], where: str) -> transformer_lib.ModelSpec:
  """The resolved `model` section of a point config (`kvattn.models.transformer.resolve_config`).

  Raises:
    ValueError: an invalid `model` section, the message prefixed with `where`.
  """
  try:
    return transformer_lib.resolve_config(d["model"])
  except ValueError as e:
    raise ValueError(f"{where}: {e}") from None


def check_decode_step(spec: transformer_lib.ModelSpec, make_caches: Callable[[Any], Any],
                      batch: int, *, implementation: str | None, where: str) -> None:
  """Traces one T = 1 decode step of the model of `spec`, abstractly.

  The model (`nnx.eval_shape`) and its caches (`make_caches(model)`, built
  inside `jax.eval_shape`) are shapes only: nothing of their size is
  allocated and nothing runs. Tracing the step goes through the decode
  dispatch points with the point's shapes, so a backend named by
  `model.attention.decode_implementation` that cannot run them (NotImplementedError,
  e.g. a Pallas kernel's head-dim or block constraints, or a name the
  cache's dispatch point does not know) fails here, before any training.

  Raises:
    ValueError: naming `model.attention.decode_implementation`, its value, the point
      and the backend's reason.
  """
  abstract = nnx.eval_shape(lambda: transformer_lib.Transformer(spec, rngs=nnx.Rngs(0)))
  graphdef, state = nnx.split(abstract)

  def step(state):
    model = nnx.merge(graphdef, state)
    logits, _ = model(jnp.zeros((batch, 1), jnp.int32), make_caches(model))
    return logits

  try:
    jax.eval_shape(step, state)
  except (NotImplementedError, ValueError, TypeError) as e:
    raise ValueError(
        f"{where}: model.attention.decode_implementation = {implementation!r} cannot run this "
        f"point's decode step (checked before any training): {type(e).__name__}: {e}") from None


class CacheAccountingError(RuntimeError):
  """The bytes of the real cache arrays differ from the analytic figure."""


def check_int(where: str, value: Any, minimum: int = 1) -> int:
  """`value` if it is an int >= `minimum` (not a bool), else ValueError naming `where`."""
  if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
    raise ValueError(f"{where} must be an int >= {minimum}; got {value!r}")
  return value


def check_cache_bytes(caches: Sequence[Any], analytic_per_token: int, batch: int, seq_len: int
                      ) -> dict[str, Any]:
  """Measures the caches' real arrays and checks them against the analytic figure.

  Args:
    caches: one cache per layer (`storage_arrays()`, `num_slots`).
    analytic_per_token: `kvattn.models.transformer.cache_bytes_per_token` (whole model).
    batch, seq_len: B and S the caches were built for.

  Returns:
    `cache_bytes_per_token` (measured, summed over layers; equals the
    analytic figure), `cache_bytes` (storage arrays of all layers,
    `B * S * per_token`) and `cache_bookkeeping_bytes` (lengths etc.).

  Raises:
    CacheAccountingError: measured and analytic bytes differ.
  """
  per_token = sum(memory.measured_bytes_per_token(c) for c in caches)
  storage = sum(memory.tree_bytes(c.storage_arrays()) for c in caches)
  if per_token != analytic_per_token or storage != batch * seq_len * analytic_per_token:
    raise CacheAccountingError(
        f"measured cache bytes differ from the analytic figure: {per_token} bytes/token measured "
        f"vs {analytic_per_token} analytic (kvattn.models.transformer.cache_bytes_per_token); "
        f"{storage} bytes in the arrays vs B * S * analytic = "
        f"{batch * seq_len * analytic_per_token}; stopping")
  return {"cache_bytes_per_token": int(per_token), "cache_bytes": int(storage),
          "cache_bookkeeping_bytes": int(memory.tree_bytes(list(caches)) - storage)}


def available_memory_bytes() -> int:
  """Bytes of host RAM available to new allocations (`kvattn.memory.host_available_bytes`;
  the points run on the host's RAM)."""
  return memory.host_available_bytes()


if __name__ == "__main__":  # pragma: no cover
  sys.exit("run `python -m experiments.main --config=configs/default.py --workdir=DIR`")
