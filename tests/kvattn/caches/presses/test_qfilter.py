"""Q-Filter calibration (kvattn/caches/presses/qfilter.py): filters from the model's own queries.

The scoring itself is checked against its numpy reference in test_presses.py; here the filters:
the eigenvector of the recorded Gram matrix equals numpy's first right singular vector of the
queries (signed so they project positively), and `calibrate` on a small model gives, for its
first layer, that vector of the layer's RoPE'd queries computed independently (embedding, norm,
query projection, numpy RoPE). A slow test checks on SmolLM2 that the projection predicts the
attention each key receives.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from flax import nnx

from kvattn.caches import registry
from kvattn.caches.presses import qfilter
from kvattn.models import transformer
from tests.kvattn.caches.presses import reference as ref


def _svd_filter(queries):
  """numpy: the first right singular vector of `queries [M, H]`, its mean projection >= 0."""
  _, _, vt = np.linalg.svd(queries, full_matrices=False)
  u = vt[0]
  return u if (queries @ u).sum() >= 0 else -u


def test_filters_from_gram_are_the_signed_first_right_singular_vectors():
  rng = np.random.default_rng(0)
  queries = rng.normal(size=(2, 50, 6)) + np.array([[3, 0, 0, 0, 0, -1], [0, 0, -2, 1, 0, 0]])[:, None]
  gram = np.einsum("kmi,kmj->kij", queries, queries)
  got = qfilter.filters_from_gram(gram, queries.sum(axis=1))
  for k in range(2):
    np.testing.assert_allclose(got[k], _svd_filter(queries[k]), atol=1e-5)
    assert (queries[k] @ got[k]).sum() > 0


@pytest.fixture(scope="module")
def model():
  cfg = transformer.model_config(d_model=32, num_layers=2, mlp_dim=64,
                                 attention=dict(num_heads=4, num_kv_heads=2, head_dim=8))
  return transformer.Transformer.from_config(cfg, rngs=nnx.Rngs(1))


def test_calibrate_takes_the_first_layers_own_rope_queries(model):
  tokens = qfilter.calibration_tokens(num_tokens=48)
  assert tokens.shape == (1, 48) and tokens.max() < 256  # bytes of the stdlib text
  lengths = np.array([48, 30])
  batch = np.concatenate([tokens, tokens], axis=0)
  filters = qfilter.calibrate(model, batch, lengths)
  assert len(filters) == 2 and all(f.shape == (2, 8) for f in filters)
  np.testing.assert_allclose(np.linalg.norm(filters[0], axis=-1), 1.0, atol=1e-5)
  # Layer 0 independently: embedding -> norm -> query projection -> numpy RoPE, real tokens only.
  attn = model.layers[0].attn
  x = np.asarray(model.embedding[...])[batch]
  q = np.asarray(attn._q(model.layers[0].attn_norm(x)), np.float64)  # pylint: disable=protected-access
  q = ref.rope(q, np.arange(48)[None, :, None], attn.rope_theta)  # [B, T, N, H]
  real = np.arange(48)[None, :] < lengths[:, None]
  for k in range(2):
    group = q[:, :, 2 * k:2 * k + 2][real].reshape(-1, 8)  # both query heads of KV head k
    np.testing.assert_allclose(filters[0][k], _svd_filter(group), atol=1e-4)
  # The kind builds from the kept filters (the same model: no second calibration).
  caches = registry.build_caches(model, 2, 16, None, {"kind": "qfilter", "budget": 4})
  np.testing.assert_array_equal(np.asarray(caches[0].filters[1]), filters[0])
  assert caches[1].filters.shape == (2, 2, 8)


def test_bad_calibration_input_raises_and_other_vocabularies_fold_the_bytes(model, caplog):
  with pytest.raises(ValueError, match="tokens"):
    qfilter.calibrate(model, np.zeros((2,), np.int32))
  with pytest.raises(ValueError, match="lengths"):
    qfilter.calibrate(model, np.zeros((1, 4), np.int32), np.array([5]))
  with pytest.raises(ValueError, match="num_tokens"):
    qfilter.calibration_tokens(num_tokens=0)
  cfg = transformer.model_config(d_model=32, num_layers=1, mlp_dim=64, vocab_size=40,
                                 attention=dict(num_heads=4, num_kv_heads=2, head_dim=8))
  other = transformer.Transformer.from_config(cfg, rngs=nnx.Rngs(2))
  (cache,) = registry.build_caches(other, 1, 16, None, {"kind": "qfilter", "budget": 4})
  assert "folded" in caplog.text
  want = qfilter.calibrate(other, qfilter.calibration_tokens() % 40)
  np.testing.assert_array_equal(np.asarray(cache.filters[0]), want[0])


@pytest.mark.slow  # SmolLM2: one calibration and one 600-token prefill (~1 min of CPU)
def test_on_smollm2_the_projection_predicts_the_attention_a_key_receives(smollm2):
  from scipy import stats  # pylint: disable=g-import-not-at-top
  from kvattn.inference.generation import prefill  # pylint: disable=g-import-not-at-top
  model, tokenizer = smollm2
  filters = qfilter.calibrate(model, qfilter.calibration_tokens(tokenizer, 512))
  text = open(os.path.join(os.path.dirname(os.__file__), "argparse.py")).read()[:6000]
  ids = np.asarray(tokenizer.encode(text)[:600], np.int32)[None]
  caches = registry.build_caches(model, 1, 600, None, {"kind": "h2o", "budget": 600})
  _, caches, _ = prefill(model, ids, np.array([600], np.int32), caches)
  rho = [stats.spearmanr(np.asarray(c.k)[0, h, 4:] @ f[h], np.asarray(c.scores)[0, h, 4:])[0]
         for c, f in zip(caches, filters) for h in range(f.shape[0])]
  assert np.mean(rho) > 0.2  # measured 0.40 on argparse.py (keys past the first 4)
