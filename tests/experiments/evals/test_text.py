"""experiments.evals.text: the one passkey builder and the corpus ids."""

import numpy as np

from experiments.evals import text as text_lib
from kvattn.training import data


def test_passkey_prompt_holds_the_key_once_at_its_depth_and_asks_for_it():
  tok = data.ByteTokenizer()
  where = []
  for depth in (0.0, 0.5, 1.0):
    ids = text_lib.passkey_prompt(tok, 600, depth, 12345)
    text = tok.decode(ids)
    assert text.count("The pass key is 12345.") == 1
    assert text.endswith(text_lib.QUESTION)
    assert 500 <= len(ids) <= 600
    where.append(text.index("The pass key is 12345."))
  # Depth 0: the needle first; depth 1: right before the question; 0.5 in between (the
  # filler comes in whole repeats, so the middle is approximate).
  assert where[0] <= 1 and where[0] < where[1] < where[2]
  assert len(text) - where[2] < 100


def test_passkey_prompts_are_a_padded_batch_of_random_keys():
  tok = data.ByteTokenizer(bos=True)
  prompts, lengths, keys = text_lib.passkey_prompts(tok, 600, 3, seed=1)
  assert prompts.shape == (3, lengths.max()) and len(set(keys)) == 3
  for b, key in enumerate(keys):
    assert prompts[b, 0] == data.BOS_ID and not prompts[b, lengths[b]:].any()
    assert data.decode(prompts[b, :lengths[b]]).count(f"The pass key is {key}.") == 1
  again = text_lib.passkey_prompts(tok, 600, 3, seed=1)
  np.testing.assert_array_equal(again[0], prompts)


def test_corpus_and_held_out_tokens():
  tok = data.ByteTokenizer()
  ids = text_lib.corpus_tokens(tok, 100)
  held = text_lib.held_out_tokens(tok, 100)
  assert ids.shape == held.shape == (100,) and ids.dtype == np.int32
  assert not np.array_equal(ids, held)  # the validation split is other documents


def test_document_tokens_skip_and_count():
  ids = text_lib.document_tokens(None, 50)
  later = text_lib.document_tokens(None, 40, skip_tokens=10)
  assert ids.dtype == np.int32 and ids.shape == (50,)
  np.testing.assert_array_equal(ids[10:], later)
