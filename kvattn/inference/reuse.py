"""Resume generation from a restored cache (`kvattn.caches.checkpoint.restore_caches`)."""

from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kvattn import vocab
from kvattn.caches import capabilities
from kvattn.caches.checkpoint import _as_tuple
from kvattn.inference.generation import Sampling, decode, prefill


def reusable_length(cached_tokens: Sequence[int], prompt: Sequence[int]) -> int:
  """Tokens of a cache holding `cached_tokens` that a new `prompt` can keep:
  their longest common prefix, at most `len(prompt) - 1` (the last prompt
  token is always evaluated again, so the first new token is fresh)."""
  cached = np.asarray(cached_tokens, np.int64).reshape(-1)
  prompt = np.asarray(prompt, np.int64).reshape(-1)
  n = min(len(cached), len(prompt) - 1)
  if n <= 0:
    return 0
  differ = np.flatnonzero(cached[:n] != prompt[:n])
  return int(differ[0]) if differ.size else n


def truncate(caches: Any, length: Any) -> Any:
  """Caches that hold only their first `length` tokens per row (`int` or `i32[B]`).

  Raises:
    ValueError: a negative length, or a kind that cannot be truncated.
  """
  out = []
  for cache in _as_tuple(caches):
    n = jnp.broadcast_to(jnp.asarray(length, jnp.int32), cache.lengths.shape)
    if _is_concrete_negative(n):
      raise ValueError(f"length must be >= 0; got {np.asarray(length).tolist()}")
    if hasattr(cache, "truncate"):
      out.append(cache.truncate(n))
    else:
      raise ValueError(f"cache of kind {type(cache).__name__} cannot be truncated (it does not "
                       "keep token t in slot t and has no truncate method); recompute the prompt")
  return tuple(out) if isinstance(caches, (tuple, list)) else out[0]


def _is_concrete_negative(n: jax.Array) -> bool:
  try:
    return bool(np.asarray(n).min(initial=0) < 0)
  except jax.errors.TracerArrayConversionError:
    return False


def resume(model: nnx.Module, caches: Sequence[Any], cached_tokens: Sequence[int],
           prompt: Sequence[int], max_new_tokens: int, *, sampling: Sampling = Sampling(),
           eos_id: int | None = None, pad_id: int = vocab.PAD_ID, rng: Any = None
           ) -> tuple[np.ndarray, tuple[Any, ...]]:
  """Generates for one `prompt` from caches that hold `cached_tokens` (batch 1).

  Args:
    model: the `kvattn.Transformer` that filled the caches.
    caches: per-layer caches of batch 1 holding `cached_tokens`; consumed.
    cached_tokens: `int[n]` token ids in the caches.
    prompt: `int[m]`, m >= 1.
    max_new_tokens: tokens to generate.

  Returns:
    `(tokens i32[<= max_new_tokens], caches)`: generated tokens (through EOS).

  Raises:
    ValueError: an empty prompt, a cache of batch != 1, or a prompt plus new
      tokens past the caches' capacity.
  """
  prompt = np.asarray(prompt, np.int32).reshape(-1)
  if prompt.size == 0:
    raise ValueError("prompt must hold at least one token; got []")
  caches = tuple(caches)
  if any(int(c.lengths.shape[0]) != 1 for c in caches):
    raise ValueError(f"caches must have batch 1; got {[int(c.lengths.shape[0]) for c in caches]}")
  # Bounded kinds (a local layer's ring) never overflow: their capacity is their window.
  capacity = min((int(c.capacity) for c in caches if not capabilities.bounded(c)),
                 default=None)
  if capacity is not None and len(prompt) + max_new_tokens - 1 > capacity:
    raise ValueError(f"prompt ({len(prompt)}) + max_new_tokens ({max_new_tokens}) - 1 exceeds the "
                     f"caches' capacity {capacity}")
  keep = reusable_length(cached_tokens, prompt)
  if not all(c.can_truncate(keep).all() for c in caches if hasattr(c, "can_truncate")):
    keep = 0  # a wrapped ring cannot serve a shorter prefix: recompute the prompt
  caches = truncate(caches, keep)
  rest = prompt[keep:]
  first, caches, rng = prefill(model, rest[None], np.array([len(rest)], np.int32), caches,
                               sampling=sampling, rng=rng)
  tokens, lengths, caches = decode(model, first, caches, max_new_tokens, sampling=sampling,
                                   eos_id=eos_id, pad_id=pad_id, rng=rng)
  return np.asarray(tokens)[0, :int(np.asarray(lengths)[0])], caches
