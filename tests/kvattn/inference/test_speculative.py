"""Tests for speculative decoding (kvattn.inference.speculative) and cache transactions
(kvattn.caches.transaction): the drafters on hand-computed cases, acceptance statistics,
EOS and the token budget inside a pass, the latent cache, the up-front errors.

Every cache kind's rollback and its speculative output are checked by the conformance
suite (tests/kvattn/caches/test_every_kind.py)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import kvattn
from kvattn.caches import transaction
from kvattn.inference import speculative
from kvattn.inference.generation import prefill
from kvattn.models import transformer

GQA = dict(kind="gqa", num_heads=4, num_kv_heads=2, head_dim=8)
MLA = dict(kind="mla", num_heads=4, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
           v_head_dim=8)


def tiny_model(attention, seed=0, num_layers=2):
  cfg = transformer.model_config(d_model=32, num_layers=num_layers, mlp_dim=64,
                                 attention=attention)
  return transformer.Transformer.from_config(cfg, rngs=nnx.Rngs(seed))


@pytest.fixture(scope="module")
def gqa():
  return tiny_model(GQA)


def _drafts(history, end, **kw):
  lookup = speculative.PromptLookup(**kw)
  return np.asarray(speculative.prompt_lookup_drafts(
      jnp.asarray(history, jnp.int32), jnp.asarray(end, jnp.int32), lookup))


def test_prompt_lookup_drafts_on_hand_computed_texts():
  hist = [[1, 2, 3, 1, 2, 0, 0, 0, 0],  # "1 2" seen at 0: copy "3 1 2", then periodically
          [1, 2, 1, 3, 1, 0, 0, 0, 0],  # "3 1" only as the tail; "1": the latest, at 2
          [5, 6, 7, 0, 0, 0, 0, 0, 0],  # no match: the last token
          [4, 0, 0, 0, 0, 0, 0, 0, 0],  # one token: nothing earlier
          [9, 8, 7, 9, 8, 6, 9, 8, 0]]  # "9 8": the latest earlier occurrence, at 3
  got = _drafts(hist, [5, 5, 3, 1, 8], num_draft_tokens=4, max_ngram_size=2)
  np.testing.assert_array_equal(got, [[3, 1, 2, 3], [3, 1, 3, 1], [7, 7, 7, 7], [4, 4, 4, 4],
                                      [6, 9, 8, 6]])
  # min_ngram_size = 2: a lone 1-gram match is no match.
  got = _drafts(hist[1:2], [5], num_draft_tokens=2, max_ngram_size=2, min_ngram_size=2)
  np.testing.assert_array_equal(got, [[1, 1]])


def test_the_target_drafting_for_itself_accepts_every_draft(gqa):
  prompts = np.random.default_rng(0).integers(0, 256, (2, 7), dtype=np.int32)
  lengths = np.array([7, 4], np.int32)
  want, _ = kvattn.generate(gqa, prompts, lengths, 11)
  k = 4
  caches = gqa.init_caches(2, 7 + 11 - 1 + k)
  first, caches, _ = prefill(gqa, prompts, lengths, caches)
  tokens, count, _, stats = speculative.decode(gqa, first, caches, prompts, lengths, 11,
                                               speculative.DraftModel(gqa, k))
  np.testing.assert_array_equal(np.asarray(tokens), np.asarray(want))
  np.testing.assert_array_equal(np.asarray(count), [11, 11])
  # 10 tokens after the first: two passes of k + 1.
  np.testing.assert_array_equal(np.asarray(stats["passes"]), [2, 2])
  np.testing.assert_array_equal(np.asarray(stats["accepted"]), [2 * k, 2 * k])


@pytest.mark.slow  # the fast suite checks prompt lookup's output (test_every_kind.py)
def test_prompt_lookup_accepts_drafts_of_a_repeating_text(gqa):
  # A model that repeats: its greedy output of a prompt, appended, is found by lookup.
  rng = np.random.default_rng(1)
  prompt = rng.integers(0, 256, (1, 6), dtype=np.int32)
  plain, _ = kvattn.generate(gqa, prompt, [6], 24)
  plain = np.asarray(plain)
  looped = np.concatenate([prompt, plain[:, :23]], axis=1)  # the text so far, again
  lengths = np.array([looped.shape[1]], np.int32)
  want, _ = kvattn.generate(gqa, looped, lengths, 16)
  k = 3
  caches = gqa.init_caches(1, looped.shape[1] + 16 - 1 + k)
  first, caches, _ = prefill(gqa, looped, lengths, caches)
  tokens, count, _, stats = speculative.decode(gqa, first, caches, looped, lengths, 16,
                                               speculative.PromptLookup(k))
  np.testing.assert_array_equal(np.asarray(tokens), np.asarray(want))
  assert int(stats["accepted"][0]) > 0, stats
  assert int(stats["passes"][0]) + int(stats["accepted"][0]) == 15


def test_the_latent_cache_speculates_token_for_token_and_stops_at_eos_inside_a_pass():
  model = tiny_model(MLA)
  prompts = np.random.default_rng(2).integers(0, 256, (2, 8), dtype=np.int32)
  prompts[0, 4:] = prompts[0, :4]
  lengths = np.array([8, 5], np.int32)
  plain, _ = kvattn.generate(model, prompts, lengths, 12)
  # EOS: a token emitted mid-pass ends its row there, as in plain decoding.
  eos = int(np.asarray(plain)[0, 6])
  want, want_len = kvattn.generate(model, prompts, lengths, 12, eos_id=eos)
  assert int(want_len[0]) <= 7
  got, got_len = kvattn.generate(model, prompts, lengths, 12, eos_id=eos,
                                 speculative=speculative.PromptLookup(3, max_ngram_size=2))
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  np.testing.assert_array_equal(np.asarray(got_len), np.asarray(want_len))


@pytest.mark.slow  # the fast suite drafts with a GQA model (the target itself)
def test_a_latent_draft_model_speculates_token_for_token():
  model = tiny_model(MLA)
  prompts = np.random.default_rng(2).integers(0, 256, (2, 8), dtype=np.int32)
  lengths = np.array([8, 5], np.int32)
  want, _ = kvattn.generate(model, prompts, lengths, 12)
  got, _ = kvattn.generate(model, prompts, lengths, 12, speculative=speculative.DraftModel(
      tiny_model(MLA, seed=1, num_layers=1), 3))
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_bad_settings_raise_before_any_compute(gqa):
  prompts, lengths = np.zeros((1, 3), np.int32), np.array([3], np.int32)
  with pytest.raises(ValueError, match="temperature"):
    kvattn.generate(gqa, prompts, lengths, 4, temperature=0.5,
                    speculative=speculative.PromptLookup())
  with pytest.raises(TypeError, match="speculative"):
    kvattn.generate(gqa, prompts, lengths, 4, speculative=4)
  other = tiny_model(GQA)
  other.vocab_size = 100
  with pytest.raises(ValueError, match="vocabulary"):
    kvattn.generate(gqa, prompts, lengths, 4, speculative=speculative.DraftModel(other))
  with pytest.raises(ValueError, match="min_ngram_size"):
    speculative.PromptLookup(max_ngram_size=2, min_ngram_size=3)
  with pytest.raises(ValueError, match="num_draft_tokens"):
    speculative.PromptLookup(num_draft_tokens=0)
  with pytest.raises(ValueError, match="num_draft_tokens"):  # no room for the drafts
    kvattn.generate(gqa, prompts, lengths, 4, caches=gqa.init_caches(1, 6),
                    speculative=speculative.PromptLookup(2))


def test_a_transaction_takes_one_write(gqa):
  attn = gqa.layers[0].attn
  cache = attn.init_cache(1, 8)
  draft = transaction.begin(cache)
  with pytest.raises(ValueError, match="already"):
    transaction.begin(draft)
  with pytest.raises(TypeError, match="Draft"):
    transaction.commit(cache, jnp.array([1]))
  assert transaction.commit(draft, jnp.array([0])) is cache  # nothing written
  x = jnp.ones((1, 2, gqa.d_model), jnp.float32)
  _, written = attn(x, cache=draft)
  assert isinstance(written, transaction.Draft) and int(written.lengths[0]) == 2
  with pytest.raises(ValueError, match="one write"):
    attn(x, cache=written)
  assert int(transaction.commit(written, jnp.array([1])).lengths[0]) == 1
