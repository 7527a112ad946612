"""experiments.framework.timing: decode timed through generate's compiled loop."""

import jax.numpy as jnp
import numpy as np
from flax import nnx

from experiments.framework import timing
from kvattn.inference.generation import Sampling, decode, prefill
from kvattn.models import transformer


def _model():
  cfg = transformer.model_config(d_model=16, num_layers=1, mlp_dim=32,
                                 attention=dict(num_heads=2, num_kv_heads=1, head_dim=8))
  return transformer.Transformer.from_config(cfg, rngs=nnx.Rngs(0))


def test_decode_rounds_times_every_run_in_every_round_and_continues_the_decode():
  model = _model()
  prompts, lengths = jnp.asarray([[3, 4, 5]], jnp.int32), jnp.asarray([3], jnp.int32)
  steps, repeats = 2, 3
  capacity = 3 + steps * (repeats + 1) + 1
  runs = {}
  for name in ("a", "b"):
    first, caches, _ = prefill(model, prompts, lengths, model.init_caches(1, capacity),
                               sampling=Sampling())
    runs[name] = (model, first, caches)
  first, caches, _ = prefill(model, prompts, lengths, model.init_caches(1, capacity),
                             sampling=Sampling())
  timed = timing.decode_rounds(runs, steps, repeats)
  assert set(timed) == {"a", "b"}
  for name in timed:
    assert len(timed[name]["wall"]) == repeats and len(timed[name]["cpu"]) == repeats
    assert all(w > 0 for w in timed[name]["wall"])
    assert all(c >= 0 for c in timed[name]["cpu"])
  # The interleaved rounds decoded the greedy continuation, one call of the loop would too.
  want, _, _ = decode(model, first, caches, steps * (repeats + 1) + 1)
  for name in timed:
    np.testing.assert_array_equal(np.asarray(timed[name]["tokens"]), np.asarray(want))


def test_read_bandwidth_is_a_rate():
  assert 1e6 < timing.read_bandwidth(1 << 20, repeats=2) < 1e13
