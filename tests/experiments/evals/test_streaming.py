"""experiments.evals.streaming: teacher-forced scores (NLL and top-1) against a numpy reference."""

import jax.numpy as jnp
import numpy as np
import pytest

from experiments.evals import models
from experiments.evals import streaming


def _numpy_scores(logits: np.ndarray, targets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """Reference: per-position NLL (nats) of `targets` and argmax of f32 `logits[n, V]`."""
  logits = logits.astype(np.float64)
  shifted = logits - logits.max(axis=-1, keepdims=True)
  logp = shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))
  return -logp[np.arange(len(targets)), targets], np.argmax(logits, axis=-1)


@pytest.fixture(scope="module")
def tiny():
  model = models.tiny_model(seed=3)
  ids = np.random.default_rng(0).integers(1, 256, size=24).astype(np.int32)
  logits, _ = model(jnp.asarray(ids[None, :-1]))  # one full causal pass, no cache
  return model, ids, np.asarray(logits[0], np.float32)


@pytest.mark.parametrize("count, chunk", [(23, 8), (1, 8), (8, 8), (9, 8)])
def test_streaming_scores_equal_the_full_pass(tiny, count, chunk):
  """Chunked streaming through a dense cache gives the full causal pass's NLL and argmax at
  every position (lengths 1, chunk, chunk + 1, several chunks with a padded last one)."""
  model, ids, logits = tiny
  ids = ids[:count + 1]
  caches = model.init_caches(1, -(-count // chunk) * chunk, jnp.float32)
  nll, argmax, _ = streaming.streaming_scores(model, caches, ids, chunk)
  want_nll, want_arg = _numpy_scores(logits[:count], ids[1:count + 1])
  assert argmax.dtype == np.int32 and argmax.shape == nll.shape == (count,)
  np.testing.assert_array_equal(argmax, want_arg)
  np.testing.assert_allclose(nll, want_nll, atol=1e-5)
  assert streaming.top1_agreement(argmax, want_arg) == 1.0
  # streaming_nll is the same pass without the argmax.
  again, _ = streaming.streaming_nll(model, model.init_caches(1, caches[0].capacity,
                                                              jnp.float32), ids, chunk)
  np.testing.assert_array_equal(again, nll)


def test_streaming_scores_of_an_evicting_cache_leave_the_reference():
  """An H2O cache of 4 slots scoring 23 tokens: positions before the first eviction agree
  with the full pass; the agreement equals numpy's mean over positions."""
  model = models.tiny_model(seed=3)
  ids = np.random.default_rng(0).integers(1, 256, size=24).astype(np.int32)
  ref = np.argmax(np.asarray(model(jnp.asarray(ids[None, :-1]))[0][0]), axis=-1)
  caches = model.init_caches(1, 24, jnp.float32, cache={"kind": "h2o", "budget": 4})
  _, argmax, _ = streaming.streaming_scores(model, caches, ids, 1)
  np.testing.assert_array_equal(argmax[:4], ref[:4])  # the cache still holds every token
  assert streaming.top1_agreement(argmax, ref) == pytest.approx(np.mean(argmax == ref))
  assert streaming.top1_agreement(argmax, ref) < 1.0


def test_top1_agreement_by_hand():
  assert streaming.top1_agreement(np.array([3]), np.array([3])) == 1.0
  assert streaming.top1_agreement(np.array([3]), np.array([4])) == 0.0
  assert streaming.top1_agreement(np.array([1, 2, 3, 4]), np.array([1, 0, 3, 0])) == 0.5
  with pytest.raises(ValueError, match=r"at least one position; got 0"):
    streaming.top1_agreement(np.zeros(0, np.int32), np.zeros(0, np.int32))
  with pytest.raises(ValueError, match=r"same length; got shapes \(3,\) and \(2,\)"):
    streaming.top1_agreement(np.zeros(3, np.int32), np.zeros(2, np.int32))
  with pytest.raises(ValueError, match=r"1-D"):
    streaming.top1_agreement(np.zeros((2, 2), np.int32), np.zeros((2, 2), np.int32))


def test_streaming_scores_of_no_positions_are_empty(tiny):
  model, ids, _ = tiny
  nll, argmax, _ = streaming.streaming_scores(model, model.init_caches(1, 8, jnp.float32),
                                              ids[:1], 8)
  assert nll.shape == argmax.shape == (0,)
