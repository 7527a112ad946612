"""kvattn.models.scan: the scanned forward pass equals the model's own call."""

import jax
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
  np.testing.assert_array_equal(stacked[0].lengths[1], caches[1].lengths)


def test_mixed_layers_scan_over_groups_or_run_unrolled():
  # Gemma 3's pattern: local layers (window 4) and global ones, as the fixture's 2 layers
  # repeated twice -> period 2, scanned twice; layers without a pattern -> period L.
  from kvattn.models import transformer  # pylint: disable=g-import-not-at-top
  from flax import nnx  # pylint: disable=g-import-not-at-top
  cfg = transformer.model_config(d_model=32, num_layers=4, mlp_dim=64, vocab_size=64,
                                 attention=dict(num_heads=4, num_kv_heads=1, head_dim=8),
                                 layers=({"window": 4}, {}) * 2)
  model = transformer.Transformer.from_config(cfg, rngs=nnx.Rngs(0))
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 64, (2, 9)), jnp.int32)
  new_lengths = jnp.array([9, 6], jnp.int32)
  defs, params = scan.scan_parts(model)
  assert len(defs[0]) == 2 and params[0][0]["attn"]["q_proj"][...].shape[0] == 2
  # The per-layer layout: rings for the local layers, dense caches for the global ones.
  caches = model.init_caches(2, 24, local_layers="ring")
  stacked = scan.stack_caches(caches, len(defs[0]))
  graphdef, state = nnx.split(model)
  forward = jax.jit(lambda state, c: nnx.merge(graphdef, state)(tokens, c, new_lengths=new_lengths))
  want, caches = forward(state, caches)  # 9 tokens wrap the rings (jitted: eager is slow)
  h, stacked = jax.jit(scan.scan_forward, static_argnums=0)(defs, params, stacked, tokens,
                                                             new_lengths)
  np.testing.assert_allclose(scan.logits_from_hidden(params, h), want, atol=1e-5)
  for got, ref in zip(scan.unstack_caches(stacked), caches):
    assert type(got) is type(ref)
    np.testing.assert_array_equal(got.pos if hasattr(ref, "pos") else got.lengths,
                                  ref.pos if hasattr(ref, "pos") else ref.lengths)
  model.layers[2].attn.window = 2  # no repeating pattern: one step of the unrolled layers
  assert scan.layer_period([nnx.graphdef(layer) for layer in model.layers]) == 4
