"""`experiments.benchmarks.per_layer_layout --fill=random`: both layouts hold the same random
context (the rings the newest W of the dense caches' tokens), so one decode step gives the same
logits through both. On the tiny random Gemma 3 checkpoint (a local layer with window 4, then a
global layer)."""

from __future__ import annotations

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import kvattn
from experiments.benchmarks import per_layer_layout
from kvattn.caches.window import RingKVCache

FIXTURE = pathlib.Path(__file__).resolve().parents[2] / "fixtures" / "hf" / "gemma3"


def test_random_fill_gives_both_layouts_the_same_context():
  model, _ = kvattn.from_pretrained(FIXTURE)
  context, capacity = 9, 12
  filled = per_layer_layout.random_fill(model, context, capacity, jnp.float32)
  full, ring = filled["full"], filled["ring"]
  assert [type(c).__name__ for c in ring] == ["RingKVCache", "KVCache"]
  dense, window = full[0], ring[0]
  assert isinstance(window, RingKVCache) and window.window == 4
  pos = np.asarray(window.pos)[0]
  np.testing.assert_array_equal(np.sort(pos), [5, 6, 7, 8])  # the newest W = 4 of 9 tokens
  np.testing.assert_array_equal(np.asarray(window.k)[0][:, pos % 4],
                                np.asarray(dense.k)[0][:, pos])
  np.testing.assert_array_equal(np.asarray(window.v)[0][:, pos % 4],
                                np.asarray(dense.v)[0][:, pos])
  assert np.all(np.asarray(dense.k)[0][:, context:] == 0)  # nothing past the context
  assert [int(c.lengths[0]) for c in full + ring] == [context] * 4
  graphdef, state = nnx.split(model)
  step = jax.jit(lambda state, caches: nnx.merge(graphdef, state)(jnp.array([[3]]), caches)[0])
  np.testing.assert_allclose(np.asarray(step(state, ring)), np.asarray(step(state, full)),
                             rtol=1e-5, atol=1e-5)
