"""kvattn.from_pretrained / build_model against transformers on tiny random checkpoints.

The checkpoints and transformers' outputs under tests/fixtures/hf/ are written by
tests/fixtures/make_hf_fixtures.py (torch + transformers, run by hand); these tests need neither.
"""

from __future__ import annotations

import functools
import json
import pathlib
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import kvattn
from kvattn import paged, pretrained

FIXTURES = pathlib.Path(__file__).resolve().parents[1] / "fixtures" / "hf"
GQA_CASES = ("llama_gqa", "llama_mqa", "llama_rope3", "mistral_window", "qwen2_bias")
MLA_CASES = ("deepseek_v2", "deepseek_v2_qlora_yarn")
PAGED_CASES = ("llama_gqa", "llama_mqa", "llama_rope3")
ATOL = 1e-4  # f32 logits against transformers' f32 logits


@functools.lru_cache(maxsize=None)
def _load(name: str):
  model, tokenizer = kvattn.from_pretrained(FIXTURES / name, dtype="float32")
  return model, tokenizer


def _expected(name: str):
  """`(tokens [P] i64 arrays, logits [P] f32[T_p + NEW, V] arrays, meta)` for the fixture."""
  arrays = np.load(FIXTURES / name / "expected.npz")
  meta = json.loads((FIXTURES / name / "expected.json").read_text())
  n = len(meta["prompt_lengths"])
  return ([arrays[f"tokens_{i}"] for i in range(n)], [arrays[f"logits_{i}"] for i in range(n)],
          meta)


def _padded(seqs, width=None):
  width = width or max(len(s) for s in seqs)
  out = np.zeros((len(seqs), width), np.int32)
  for b, s in enumerate(seqs):
    out[b, :len(s)] = s
  return out


@functools.partial(jax.jit, static_argnums=(0, 5))
def _forward_and_cached(graphdef, state, tokens, prompt_lengths, steps, capacity):
  """Full forward (no cache) over `tokens [B, T]`, and the same logits through dense caches:
  prefill the first `prompt_lengths[b]` tokens of each row, then one decode step (T = 1) per
  column of `steps [B, NEW]` (row b: the tokens after its prompt). Returns `(full [B, T, V],
  last [B, V] logits of each prompt's last token, decoded [B, NEW, V])`."""
  model = nnx.merge(graphdef, state)
  full, _ = model(tokens)
  caches = model.init_caches(tokens.shape[0], capacity)
  logits, caches = model(tokens, caches=caches, new_lengths=prompt_lengths)  # padding unwritten
  last = jnp.take_along_axis(logits, (prompt_lengths - 1)[:, None, None], axis=1)[:, 0]

  def step(caches, token):
    out, caches = model(token[:, None], caches=caches)
    return caches, out[:, 0]

  _, decoded = jax.lax.scan(step, caches, steps.T)
  return full, last, jnp.swapaxes(decoded, 0, 1)


def _check_parity(name: str):
  model, _ = _load(name)
  tokens, logits, meta = _expected(name)
  lengths = np.asarray(meta["prompt_lengths"], np.int32)
  new = meta["new_tokens"]
  steps = np.stack([t[n:n + new] for t, n in zip(tokens, lengths)]).astype(np.int32)
  graphdef, state = nnx.split(model)
  full, last, decoded = jax.device_get(_forward_and_cached(
      graphdef, state, _padded(tokens), lengths, steps, int(lengths.max()) + new))
  for b, (t, want) in enumerate(zip(tokens, logits)):
    n = lengths[b]
    np.testing.assert_allclose(full[b, :len(t)], want, atol=ATOL, rtol=0,
                               err_msg=f"{name}: full forward, prompt {b}")
    np.testing.assert_allclose(last[b], want[n - 1], atol=ATOL, rtol=0,
                               err_msg=f"{name}: prefill through the cache, prompt {b}")
    np.testing.assert_allclose(decoded[b], want[n:n + new], atol=ATOL, rtol=0,
                               err_msg=f"{name}: decode steps through the cache, prompt {b}")
  return model, tokens, lengths, new


def _check_generate(model, tokens, lengths, new, **kwargs):
  prompts = _padded([t[:n] for t, n in zip(tokens, lengths)])
  out, out_lengths = kvattn.generate(model, prompts, lengths, new, **kwargs)
  assert np.asarray(out_lengths).tolist() == [new] * len(tokens)
  for b, (t, n) in enumerate(zip(tokens, lengths)):
    assert np.asarray(out[b]).tolist() == t[n:n + new].tolist(), f"prompt {b}"


@pytest.mark.parametrize("name", GQA_CASES)
def test_gqa_architectures_match_transformers(name):
  model, tokens, lengths, new = _check_parity(name)
  _check_generate(model, tokens, lengths, new)  # dense KVCache
  if name in PAGED_CASES:
    _check_generate(model, tokens, lengths, new,
                    cache_factory=paged.paged_cache_factory(model, page_size=4))


@pytest.mark.parametrize("name", MLA_CASES)
def test_deepseek_v2_mla_matches_transformers(name):
  model, tokens, lengths, new = _check_parity(name)
  assert all(isinstance(c, kvattn.LatentCache) for c in model.init_caches(1, 4))
  _check_generate(model, tokens, lengths, new)  # latent caches, absorbed decode
