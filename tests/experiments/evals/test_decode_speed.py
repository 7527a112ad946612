"""experiments.evals.decode_speed: the random context goes through each kind's own update, and
the long decode's bytes and roofline follow from it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from experiments.evals import decode_speed
from experiments.evals import models
from kvattn import memory
from kvattn.caches import registry
from kvattn.models import transformer

CONTEXT, CAPACITY, BUDGET = 40, 64, 16


@pytest.fixture(scope="module")
def tiny():
  return models.load_model(models.TINY)[0]


@pytest.mark.parametrize("kind", list(registry.CACHE_KIND_TABLE))
def test_every_kind_holds_the_context_it_was_written(tiny, kind):
  spec = registry.spec_at_budget(kind, BUDGET)
  if kind == "length_switch":  # the switch inside the context
    spec.update(switch_length=24, num_kv_heads_after=1)
  caches = registry.build_caches(tiny, 2, CAPACITY, None, spec)
  filled = decode_speed.random_context(caches, CONTEXT, chunk=16)
  for cache in filled:
    assert np.asarray(cache.lengths).tolist() == [CONTEXT, CONTEXT]
    assert all(bool(jnp.all(jnp.isfinite(a.astype(jnp.float32)))) for a in cache.storage_arrays()
               if jnp.issubdtype(a.dtype, jnp.floating))
  want = sum(memory.measured_bytes_per_token(c) * 2 * min(c.capacity, CONTEXT) for c in filled)
  assert decode_speed.cache_read_bytes(filled, CONTEXT) == int(want)
  if kind in registry.bounded_kinds():  # a bounded kind reads its budget, not the context
    # (on average over the layers: PyramidKV's budgets differ per layer, their mean is BUDGET)
    assert sum(c.capacity for c in filled) <= BUDGET * len(filled)


def test_dense_keys_fill_exactly_the_context_slots(tiny):
  filled = decode_speed.random_context(tiny.init_caches(2, CAPACITY), CONTEXT, chunk=7)
  k = np.asarray(filled[0].k)  # [B, K, S, H]
  assert np.all(np.abs(k[:, :, :CONTEXT]).sum(-1) > 0) and not np.any(k[:, :, CONTEXT:])
  again = decode_speed.random_context(tiny.init_caches(2, CAPACITY), CONTEXT, chunk=7)
  np.testing.assert_array_equal(np.asarray(again[0].k), k)  # seeded


def test_latent_caches_are_filled_too():
  cfg = transformer.model_config(d_model=32, num_layers=1, mlp_dim=64, vocab_size=64,
                                 attention=dict(kind="mla", num_heads=4, kv_lora_rank=16,
                                                qk_nope_head_dim=8, qk_rope_head_dim=4,
                                                v_head_dim=8))
  model = transformer.Transformer.from_config(cfg, rngs=nnx.Rngs(0))
  (cache,) = decode_speed.random_context(model.init_caches(2, CAPACITY), CONTEXT)
  assert np.asarray(cache.lengths).tolist() == [CONTEXT, CONTEXT]
  assert np.all(np.abs(np.asarray(cache.c_kv)[:, :CONTEXT]).sum(-1) > 0)


def test_long_decode_reports_its_bytes_against_the_bandwidth(tiny):
  caches = tiny.init_caches(2, CONTEXT + 3 * 2 + 1, dtype=jnp.int8)
  out = decode_speed.long_decode(tiny, caches, CONTEXT, steps=2, repeats=2, weight_bytes=1000,
                                 bandwidth=1e9)
  assert out["batch"] == 2 and out["context"] == CONTEXT
  assert out["read_bytes"] == 1000 + out["cache_read_bytes"] > 1000
  assert out["step_ms_min"] <= out["step_ms"] <= out["step_ms_max"]
  assert out["tokens_per_s"] == pytest.approx(2e3 / out["step_ms"])
  assert out["roofline"] == pytest.approx(out["read_bytes"] / 1e9 / (out["step_ms"] / 1e3))


@pytest.mark.parametrize("bad", [0, -1, 2.5, True])
def test_bad_context_is_named(tiny, bad):
  with pytest.raises(ValueError, match="context must be a positive int"):
    decode_speed.random_context(tiny.init_caches(1, 8), bad)
