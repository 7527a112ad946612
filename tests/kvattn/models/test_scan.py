"""kvattn.models.scan: the scanned forward pass equals the model's own call."""

import jax.numpy as jnp
import numpy as np
import pytest

from experiments.evals import models
from kvattn.models import scan


# Dense and sinks (a cache that does its own RoPE); the evicting kinds through the scan equal the
# full cache in the long-context family's tiny run, hence the model too.
@pytest.mark.parametrize("policy", [None, {"kind": "sink", "num_sinks": 2, "window": 4}])
def test_scan_forward_equals_the_model(policy):
  model = models.tiny_model()
  defs, params = scan.scan_parts(model)
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, (2, 8)), jnp.int32)
  new_lengths = jnp.array([8, 5], jnp.int32)
  caches = model.init_caches(2, 24, cache=policy)
  stacked = scan.stack_caches(caches)
  for _ in range(2):  # the second call passes the capacity of the sink cache
    want, caches = model(tokens, caches, new_lengths=new_lengths)
    h, stacked = scan.scan_forward(defs, params, stacked, tokens, new_lengths)
    logits = scan.logits_from_hidden(params, h)
    np.testing.assert_allclose(logits, want, atol=1e-5)
  np.testing.assert_array_equal(stacked.lengths[1], caches[1].lengths)


def test_layers_of_different_structure_are_named():
  model = models.tiny_model()
  model.layers[1].attn.extra = None  # a structure the first layer does not have
  with pytest.raises(ValueError, match="layer 1 differs from layer 0"):
    scan.scan_parts(model)
