"""experiments.evals.replay: a recorded context, compressed per point, gives generate's tokens."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import kvattn
from experiments.evals import models
from experiments.evals import replay
from kvattn.caches import registry

NEW = 5


def _prompts(rng, lengths, width):
  prompts = np.zeros((len(lengths), width), np.int32)
  for b, n in enumerate(lengths):
    prompts[b, :n] = rng.integers(1, 256, n)
  return prompts, np.array(lengths, np.int32)


def _record(model, seed):
  """Rows with contexts of 31, 1 (one token) and 32 tokens (the last row's question is 1
  token) recorded on `model`: `(model, prompts, lengths, contexts, inputs, rest,
  rest_lengths)`."""
  prompts, lengths = _prompts(np.random.default_rng(seed), [40, 19, 33], 40)
  contexts = np.array([31, 1, 32], np.int32)
  context, rest, rest_lengths = replay.split_prompts(prompts, lengths, contexts)
  inputs = replay.record(model, context, contexts)
  return model, prompts, lengths, contexts, inputs, rest, rest_lengths


@pytest.fixture(scope="module")
def recorded():
  # The local/global model (rings on the local layers under "ring").
  got = _record(models.tiny_model(local_window=4), seed=0)
  inputs, width = got[4], got[1].shape[1]  # contexts padded to the prompts' width
  assert len(inputs) == 4 and [x.shape for x in inputs[0]] == [
      (3, width, 4, 8), (3, width, 2, 8), (3, width, 2, 8)]
  return got


@pytest.mark.parametrize("spec", [
    {"kind": "dense"},
    {"kind": "snapkv", "compress": "context", "compression_ratio": 0.75, "window_size": 4,
     "kernel_size": 3},  # the fast suite: the scoring queries' mass and the rings
    pytest.param({"kind": "knorm", "compress": "context", "compression_ratio": 0.5},
                 marks=pytest.mark.slow),
    pytest.param({"kind": "pyramidkv", "compress": "context", "compression_ratio": 0.5,
                  "context_tokens": 31, "window_size": 4, "kernel_size": 3},
                 marks=pytest.mark.slow)], ids=lambda s: s["kind"])
def test_replayed_points_give_the_tokens_and_kept_positions_of_generate(recorded, spec):
  model, prompts, lengths, contexts, inputs, rest, rest_lengths = recorded
  capacity = int(lengths.max()) + NEW - 1
  factory = registry.cache_factory_from_config(model, spec)
  kwargs = {} if spec["kind"] == "dense" else {"context_lengths": contexts}
  slots = registry.slots_needed(spec, contexts, lengths + NEW - 1) or capacity
  want = kvattn.generate(model, prompts, lengths, NEW, cache_factory=factory, max_len=slots,
                         **kwargs)
  for common in ((None, capacity) if spec["kind"] != "dense" else (None,)):
    # the policy's own caches, then the appending form
    got = replay.generate_after(model, inputs, contexts, factory(3, slots), rest,
                                rest_lengths, NEW, capacity=common)
    np.testing.assert_array_equal(got[0], want[0], err_msg=str((spec, common)))
    np.testing.assert_array_equal(got[1], want[1])


def test_appending_keeps_the_kept_slots_and_refuses_a_smaller_capacity():
  model = models.tiny_model()
  spec = {"kind": "tova", "compress": "context", "compression_ratio": 0.5}
  cache = registry.cache_factory_from_config(model, spec)(2, 12)[0]
  grown = replay.appending(cache, 20)
  assert grown.capacity == 20 and grown.policy == "recent"
  np.testing.assert_array_equal(grown.pos[:, :, :12], cache.pos)
  assert (np.asarray(grown.pos[:, :, 12:]) == -1).all()
  with pytest.raises(ValueError, match=r"capacity must be >= the cache's 12; got 11"):
    replay.appending(cache, 11)
  dense = registry.cache_factory_from_config(model, {"kind": "dense"})(2, 12)[0]
  assert replay.appending(dense, 20) is dense


def test_what_cannot_be_replayed_is_refused():
  model = models.tiny_model()
  fixed = registry.cache_factory_from_config(model, {"kind": "knorm", "budget": 8})(2, 8)
  assert not replay.replayable(model, fixed)
  decoding = registry.cache_factory_from_config(model, {"kind": "decoding_knorm",
                                                        "budget": 8})(2, 8)
  assert not replay.replayable(model, decoding)  # evicts inside its prefill
  prompts, lengths = _prompts(np.random.default_rng(1), [9, 6], 9)
  contexts = np.array([5, 3], np.int32)
  context, rest, rest_lengths = replay.split_prompts(prompts, lengths, contexts)
  inputs = replay.record(model, context, contexts)
  with pytest.raises(ValueError, match=r"caches must be dense, evicting with "
                     r"compress='context' or rings"):
    replay.generate_after(model, inputs, contexts, fixed, rest, rest_lengths, NEW)
  with pytest.raises(ValueError, match=r"context_lengths must lie in \[1, "):
    replay.record(model, context, np.array([0, 3]))
  dense = registry.cache_factory_from_config(model, {"kind": "dense"})(2, 16)
  with pytest.raises(ValueError, match=r"rest_lengths in \[1, Tr\]"):
    replay.generate_after(model, inputs, contexts, dense, rest, np.array([0, 3]), NEW)


def test_compacted_dense_caches_give_the_evicting_caches_logits():
  # A model without sliding windows: every layer's evicting cache becomes a dense KVCache
  # whose kept keys moved back to the slot frame; the question's logits equal the evicting
  # caches', and generate_after's first token is their argmax.
  model, prompts, lengths, contexts, inputs, rest, rest_lengths = _record(
      models.tiny_model(seed=3), seed=2)
  spec = {"kind": "snapkv", "compress": "context", "compression_ratio": 0.5, "window_size": 4,
          "kernel_size": 3}
  factory = registry.cache_factory_from_config(model, spec)
  slots = registry.slots_needed(spec, contexts, lengths + NEW - 1)
  capacity = int(lengths.max()) + NEW - 1
  written = [replay._write(*nnx.split(layer.attn), cache, qkv, jnp.asarray(contexts))  # pylint: disable=protected-access
             for layer, cache, qkv in zip(model.layers, factory(3, slots), inputs)]
  dense = replay.compacted(written, capacity, model)
  assert all(isinstance(c, kvattn.KVCache) and c.capacity == capacity for c in dense)
  np.testing.assert_array_equal(dense[0].lengths, [15, 1, 16])  # int(n * 0.5), at least 1
  want, _ = model(jnp.asarray(rest), written, new_lengths=jnp.asarray(rest_lengths))
  got, _ = model(jnp.asarray(rest), dense, new_lengths=jnp.asarray(rest_lengths))
  real = np.arange(rest.shape[1])[None] < rest_lengths[:, None]
  np.testing.assert_allclose(np.asarray(got)[real], np.asarray(want)[real], atol=2e-5)
  again = replay.generate_after(model, inputs, contexts, factory(3, slots), rest, rest_lengths,
                                NEW, capacity=capacity)  # through the dense caches
  first = np.argmax(np.asarray(got)[np.arange(3), rest_lengths - 1], axis=-1)
  np.testing.assert_array_equal(np.asarray(again[0])[:, 0], first)


def test_compacted_keeps_the_appending_form_where_one_frame_is_not_exact():
  model = models.tiny_model()
  contexts = jnp.array([9, 5], jnp.int32)
  rng = np.random.default_rng(4)
  qkv = [tuple(jnp.asarray(rng.normal(size=(2, 9, n, 8)), jnp.float32) for n in (4, 2, 2))
         for _ in range(2)]

  def written(spec, dtype=None):
    factory = registry.cache_factory_from_config(model, spec)
    return [replay._write(*nnx.split(layer.attn), cache, x, contexts)  # pylint: disable=protected-access
            for layer, cache, x in zip(model.layers, factory(2, 16, dtype), qkv)]

  base = {"kind": "knorm", "compress": "context", "compression_ratio": 0.5}
  assert all(isinstance(c, kvattn.KVCache)
             for c in replay.compacted(written(base), 16, model))
  quantized = replay.compacted(written(base, jnp.int8), 16, model)
  assert all(getattr(c, "policy", None) == "recent" for c in quantized)  # int8 keys
  mixed = written(base)
  mixed[1] = written({**base, "compression_ratio": 0.25})[1]  # another count in layer 1
  assert all(getattr(c, "policy", None) == "recent"
             for c in replay.compacted(mixed, 16, model))
  with pytest.raises(ValueError, match=r"capacity must be >= the cache's 16; got 15"):
    replay.compacted(written(base), 15, model)
