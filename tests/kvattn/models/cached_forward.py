"""The check behind DESIGN invariants 1 and 2 for whole models, shared by the model tests."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


def _apply(graphdef, state, tokens, caches, new_lengths):
  return nnx.merge(graphdef, state)(tokens, caches=caches, new_lengths=new_lengths)


def assert_cached_steps_match_full(model, caches, seqs, lengths, width: int, steps: int):
  """Prefills row b's first `lengths[b]` tokens of `seqs: i32[B, width + steps]` into `caches`
  (their unused slots poisoned with NaN), then runs `steps` one-token steps; every logit must
  equal one causal forward pass over `seqs` (atol 1e-5). Returns the caches."""
  graphdef, state = nnx.split(model)
  full, _ = _apply(graphdef, state, seqs, None, None)  # causal over each sequence
  caches = tuple(jax.tree.map(lambda a: jnp.full_like(a, jnp.nan)
                              if jnp.issubdtype(a.dtype, jnp.floating) else a, c) for c in caches)
  prompts = jnp.where(jnp.arange(width)[None] < lengths[:, None], seqs[:, :width], 0)
  logits, caches = _apply(graphdef, state, prompts, caches, jnp.asarray(lengths))
  for b, n in enumerate(lengths):
    np.testing.assert_allclose(logits[b, :n], full[b, :n], atol=1e-5)
  for t in range(steps):
    nxt = seqs[np.arange(len(lengths)), lengths + t][:, None]
    logits, caches = _apply(graphdef, state, nxt, caches, None)
    for b, n in enumerate(lengths):
      np.testing.assert_allclose(logits[b, 0], full[b, n + t], atol=1e-5)
  return caches
