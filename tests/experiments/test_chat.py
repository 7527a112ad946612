"""experiments.chat: cache choices, the timed prefill + decode, and the command on a tiny GGUF."""

from __future__ import annotations

import re

import numpy as np
import pytest
from absl import flags
from absl.testing import flagsaver
from flax import nnx

from experiments import chat
from kvattn import memory
from kvattn.caches import paged
from kvattn.caches import registry as cache_registry
from kvattn.models import transformer as transformer_lib
from tests.experiments import subproc
from tests.kvattn.checkpoints import test_gguf


@pytest.fixture(scope="module")
def model():
  cfg = transformer_lib.model_config(
      vocab_size=32, d_model=32, num_layers=2, mlp_dim=64,
      attention=dict(num_heads=4, num_kv_heads=2, head_dim=8))
  return transformer_lib.Transformer.from_config(cfg, rngs=nnx.Rngs(0))


CHOICES = {"dense": ("dense", None), "dense-bf16": ("dense", "bfloat16"),
           "dense-int8": ("dense", "int8"), "dense-fp8": ("dense", "float8_e4m3fn"),
           "paged": ("paged", None), "paged-int8": ("paged", "int8")}


def test_cache_choices(model):
  sizes = {}
  for name, (kind, dtype) in CHOICES.items():
    assert chat.parse_cache(name) == (kind, dtype)
    caches = chat.make_caches(model, name, 2, 20, page_size=4)
    assert len(caches) == 2
    assert isinstance(caches[0], paged.PagedKVCache) == (kind == "paged"), name
    storage = caches[0].storage_arrays()[0]
    assert storage.dtype == np.dtype(dtype or "float32"), name
    sizes[name] = sum(a.nbytes for c in caches for a in c.storage_arrays())
  # 2 layers x (K + V) x B=2 x 20 slots x K=2 heads x H=8, plus f32 scales per token per head.
  assert sizes["dense"] == 2 * 2 * 2 * 20 * 2 * 8 * 4
  assert sizes["dense-bf16"] == sizes["dense"] // 2
  assert sizes["dense-int8"] == sizes["dense"] // 4 + 2 * 2 * 2 * 20 * 2 * 4
  with pytest.raises(ValueError, match="cache must be one of"):
    chat.make_caches(model, "dense-int3", 1, 4)


def test_every_registered_kind_is_a_cache_choice(model):
  # --cache names the registry's kinds; their options come from --cache_option.
  options = {"ring": ["window=8"], "sink": ["window=6"], "length_switch": [
      "switch_length=8", "num_kv_heads_after=1"]}
  for kind, entry in cache_registry.CACHE_KIND_TABLE.items():
    given = options.get(kind, ["budget=8"] if "budget" in entry.options else [])
    caches = chat.make_caches(model, kind, 1, 16, options=chat.parse_options(given))
    assert len(caches) == 2 and int(caches[0].lengths[0]) == 0, kind
  caches = chat.make_caches(model, "h2o-int8", 1, 64, options={"budget": 8})
  assert caches[0].capacity == 8 and caches[0].k.dtype == np.int8
  with pytest.raises(ValueError, match="cache.budget must be set"):
    chat.make_caches(model, "h2o", 1, 16)
  with pytest.raises(ValueError, match="cache_option must be key=int"):
    chat.parse_options(["budget"])


def test_run_paged_equals_dense_and_stops_at_eos(model):
  prompts = np.array([[3, 4, 5, 6], [7, 8, 0, 0]], np.int32)
  lengths = np.array([4, 2], np.int32)
  dense = chat.run(model, prompts, lengths, 6, cache="dense")
  pages = chat.run(model, prompts, lengths, 6, cache="paged", page_size=2)
  np.testing.assert_array_equal(dense.tokens, pages.tokens)
  assert dense.lengths.tolist() == [6, 6]
  assert dense.prefill_s > 0 and dense.decode_s > 0 and dense.cache_bytes > 0
  eos = int(dense.tokens[0, 2])  # stop sequence 0 at its third token
  stopped = chat.run(model, prompts, lengths, 6, eos_id=eos)
  first = list(dense.tokens[0]).index(eos) + 1
  assert stopped.lengths[0] == first
  np.testing.assert_array_equal(stopped.tokens[0, :first], dense.tokens[0, :first])


def test_chat_command_on_a_tiny_gguf(tmp_path, capsys):
  path = test_gguf.write_tiny_gguf(tmp_path / "tiny.gguf", test_gguf._hf_tensors())
  parsed = flags.FLAGS.is_parsed()
  flags.FLAGS.mark_as_parsed()
  try:
    with flagsaver.flagsaver(model=str(path), prompt="ab ab", max_new_tokens=3,
                             cache="paged-int8", page_size=4, warmup=False):
      chat.main(["chat"])
  finally:
    if not parsed:
      flags.FLAGS.unparse_flags()
  reply, line = capsys.readouterr().out.strip().split("\n")[-2:]
  assert "load" in line and "prefill" in line and "cache paged int8" in line
  # The tiny vocabulary decodes to a string made of its tokens (or nothing after eos).
  assert set(reply) <= set("ab <|end|>")


def test_chat_command_prints_only_the_reply_and_its_summary(tmp_path):
  # Run as a person runs it: absl's INFO log of JAX's backend probe ("Unable to initialize
  # backend 'tpu'") used to come first; only warnings and errors may reach stderr now.
  path = test_gguf.write_tiny_gguf(tmp_path / "tiny.gguf", test_gguf._hf_tensors())
  proc = subproc.popen("experiments.chat", f"--model={path}", "--prompt=ab ab",
                       "--max_new_tokens=2", "--nowarmup")
  out, err = proc.communicate(timeout=300)
  assert proc.returncode == 0, err
  assert "Unable to initialize backend" not in out + err
  assert not [line for line in err.splitlines() if line.startswith("I")], err  # no INFO lines
  reply, summary = out.splitlines()
  assert set(reply) <= set("ab <|end|>") and summary.startswith("load ")


def test_chat_runs_a_policy_from_the_users_own_module(tmp_path):
  # --import loads a module outside kvattn (by dotted name here; test_main.py gives a file)
  # before --cache is checked; the cache then holds its budget of 2 slots per layer.
  path = test_gguf.write_tiny_gguf(tmp_path / "tiny.gguf", test_gguf._hf_tensors())
  proc = subproc.popen("experiments.chat", f"--model={path}", "--prompt=ab ab ab ab",
                       "--max_new_tokens=3", "--nowarmup", "--import=tests.experiments.user_policy",
                       "--cache=keydiff-lite", "--cache_option=budget=2")
  out, err = proc.communicate(timeout=300)
  assert proc.returncode == 0, err
  summary = out.splitlines()[-1]
  prompt_len = int(re.search(r"prefill (\d+) tok", summary).group(1))
  cache_bytes = int(re.search(r"cache keydiff-lite model dtype ([\d,]+) bytes",
                              summary).group(1).replace(",", ""))
  from tests.experiments import user_policy  # pylint: disable=g-import-not-at-top
  model, _, _ = chat.load(str(path), "float32")
  max_len = prompt_len + 3 - 1
  assert prompt_len > 2  # the prompt alone overflows the budget: the policy evicts
  caches = chat.make_caches(model, user_policy.NAME, 1, max_len, options={"budget": 2})
  assert caches[0].capacity == 2 and cache_bytes == memory.tree_bytes(caches)
  assert cache_bytes < memory.tree_bytes(chat.make_caches(model, "dense", 1, max_len))

