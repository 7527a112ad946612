"""Tests for the RULER-style suite (experiments.evals.ruler): lengths, seeds, and that each
task's references are what its context says, recomputed from the text."""

import collections
import re

import numpy as np
import pytest

import kvattn
from experiments.evals import models
from experiments.evals import ruler
from kvattn.training import data as data_lib


class ByteTokenizer:
  """Byte-level ids (kvattn.training.data.encode): one token per byte."""

  def encode(self, text, add_special_tokens=False):
    del add_special_tokens
    return data_lib.encode(text).tolist()

  def decode(self, ids, skip_special_tokens=True):
    del skip_special_tokens
    return data_lib.decode(ids)

  def apply_chat_template(self, messages, add_generation_prompt=True):
    return f"<user>{messages[0]['content']}</user><assistant>" if add_generation_prompt else ""


TOK = ByteTokenizer()


@pytest.mark.parametrize("task", ruler.TASKS)
@pytest.mark.parametrize("length", [1024, 3000])
def test_prompt_fills_the_budget_and_the_seed_fixes_it(task, length):
  ex = ruler.make(task, TOK, length, seed=3)
  ids = ruler.encode(TOK, ex, chat=True)
  assert length - ruler.TEMPLATE_ROOM - 300 <= len(ids) <= length, len(ids)  # 300: one sentence
  assert ruler.make(task, TOK, length, seed=3) == ex
  assert ruler.make(task, TOK, length, seed=4) != ex
  assert ids[-len(TOK.encode(ex.answer_prefix)):] == TOK.encode(ex.answer_prefix)


@pytest.mark.parametrize("task", [t for t in ruler.TASKS if t.startswith("niah")])
def test_needles_hold_the_answers(task):
  ex = ruler.make(task, TOK, 2000, seed=0)
  needles = re.findall(r"One of the special magic numbers for ([a-z]+-[a-z]+) is: (\d{7})\.",
                       ex.context)
  assert len(needles) == (1 if task == "niah_single" else ruler.NUM_NEEDLES)
  asked = re.findall(r"[a-z]+-[a-z]+", ex.question)
  want = tuple(v for k, v in needles if k in asked)
  if task in ("niah_single", "niah_multikey"):
    assert len(asked) == 1 and ex.answers == want
  else:
    assert sorted(ex.answers) == sorted(want) and len(want) == ruler.NUM_NEEDLES
  # the haystack has no digits: the needles' numbers are the only ones
  assert sorted(re.findall(r"\d+", ex.context)) == sorted(v for _, v in needles)


def test_variable_tracking_answers_are_the_chain():
  ex = ruler.make("variable_tracking", TOK, 2000, seed=1)
  value = re.search(r"the value (\d+)", ex.question).group(1)
  assigned = dict(re.findall(r"VAR ([A-Z]{5}) = (VAR [A-Z]{5}|\d+)\.", ex.context))
  holds = {v for v, rhs in assigned.items() if rhs == value}
  while True:  # follow the assignments from the literal
    more = {v for v, rhs in assigned.items() if rhs.startswith("VAR ") and rhs[4:] in holds}
    if more <= holds:
      break
    holds |= more
  assert holds == set(ex.answers) and len(holds) == ruler.CHAIN_HOPS + 1


@pytest.mark.parametrize("task, top", [("common_words", ruler.NUM_COMMON), ("frequent_words", 3)])
def test_word_tasks_answer_the_most_frequent(task, top):
  ex = ruler.make(task, TOK, 3000, seed=2)
  words = re.findall(r"[a-z]+", ex.context)
  counts = collections.Counter(words)
  ranked = counts.most_common()
  assert set(ex.answers) == {w for w, _ in ranked[:top]}
  assert ranked[top - 1][1] > ranked[top][1]  # no tie at the cut


def test_score_is_the_fraction_of_references_found():
  ex = ruler.Example("niah_multivalue", 1024, 0, "", "", "", ("1234567", "7654321"))
  assert ruler.score(ex, "They are 1234567 and 7654321.") == 1.0
  assert ruler.score(ex, "1234567, then nothing") == 0.5
  assert ruler.score(ex, "") == 0.0
  words = ruler.Example("common_words", 1024, 0, "", "", "", ("Alpha",))
  assert ruler.score(words, "1. alpha") == 1.0


def test_bad_arguments_are_named():
  with pytest.raises(ValueError, match="task must be one of"):
    ruler.make("niah", TOK, 1024)
  with pytest.raises(ValueError, match="length must be an int >= 128"):
    ruler.make("niah_single", TOK, 64)


@pytest.mark.slow  # generates with a model; the task builders are tested above
def test_evaluate_scores_the_greedy_answer_of_each_prompt():
  model = models.tiny_model()
  examples = [ruler.make(t, TOK, 256, seed=0) for t in ("niah_single", "frequent_words")]
  scores, outputs = ruler.evaluate(model, TOK, examples, chat=False, batch=1)
  for ex, got, s in zip(examples, outputs, scores):
    ids = np.asarray([ruler.encode(TOK, ex)], np.int32)
    tokens, count = kvattn.generate(model, ids, np.array([ids.shape[1]], np.int32),
                                    ruler.MAX_NEW_TOKENS[ex.task])
    assert got == TOK.decode(np.asarray(tokens)[0, :int(count[0])].tolist())
    assert s == ruler.score(ex, got)
