"""kvattn.checkpoints.tokenizer: GGUF-metadata BPE, tokenizer.json files, chat templates, bad input."""

from __future__ import annotations

import json

import jinja2
import pytest
import tokenizers
from tokenizers import pre_tokenizers, processors

from kvattn.checkpoints import tokenizer as tokenizer_lib
from kvattn.checkpoints.tokenizer import Tokenizer

G = "\u0120"  # GPT-2's spelling of a space byte


def _metadata(**overrides):
  md = {
      "tokenizer.ggml.model": "gpt2",
      "tokenizer.ggml.pre": "smollm",
      # Token 6 is stored with a real space, as some converters write it: it is respelled.
      "tokenizer.ggml.tokens": ["<|end|>", "a", "b", "ab", G, G + "ab", " b", "<think>", "c"],
      "tokenizer.ggml.token_type": [3, 1, 1, 1, 1, 1, 1, 4, 1],
      "tokenizer.ggml.merges": ["a b", f"{G} ab", f"{G} b"],
      "tokenizer.ggml.bos_token_id": 0,
      "tokenizer.ggml.eos_token_id": 0,
      "tokenizer.chat_template": (
          "{% for m in messages %}\n"
          "  <{{ m['role'] }}>{{ m['content'] }}<|end|>\n"
          "{% endfor %}\n"
          "{% if add_generation_prompt %}<assistant>{% endif %}"),
  }
  md.update(overrides)
  return md


def test_byte_alphabet_is_gpt2s():
  table = tokenizer_lib._byte_alphabet()
  assert sorted(table) == list(range(256))
  assert set(table.values()) == set(pre_tokenizers.ByteLevel.alphabet())
  assert table[ord(" ")] == G and table[ord("a")] == "a" and table[ord("\n")] == "\u010a"


def test_gguf_metadata_tokenizer_encodes_and_decodes():
  tok = Tokenizer.from_gguf_metadata(_metadata())
  assert (tok.bos_id, tok.eos_id, tok.add_bos, tok.vocab_size) == (0, 0, False, 9)
  assert tok.encode("ab ab") == [3, 5]
  assert tok.encode(" b") == [6]  # the respelled " b" merged from "Ġ b"
  assert tok.encode("ab<|end|>ab") == [3, 0, 3]  # control tokens stay whole
  assert tok.encode("<think>c") == [7, 8]  # user-defined tokens stay whole
  assert tok.decode([3, 5, 0]) == "ab ab<|end|>"
  assert tok.decode([3, 5, 0], skip_special_tokens=True) == "ab ab"
  assert tok.token(5) == G + "ab"


def test_add_bos_prepends_bos():
  tok = Tokenizer.from_gguf_metadata(_metadata(**{"tokenizer.ggml.add_bos_token": True}))
  assert tok.encode("ab") == [0, 3]
  assert tok.encode("ab", add_special_tokens=False) == [3]


@pytest.mark.parametrize("pre,pieces", [
    ("smollm", ["12345"]),  # GPT-2's own split keeps a run of digits together
    ("llama-bpe", ["123", "45"]),  # Llama 3: at most three digits per piece
    ("qwen2", ["1", "2", "3", "4", "5"]),  # Qwen2: one digit per piece
])
def test_pre_tokenizer_split_follows_ggml_pre(pre, pieces):
  tok = Tokenizer.from_gguf_metadata(_metadata(**{"tokenizer.ggml.pre": pre}))
  assert [p for p, _ in tok.backend.pre_tokenizer.pre_tokenize_str("12345")] == pieces


def test_chat_template_trims_blocks_like_transformers():
  tok = Tokenizer.from_gguf_metadata(_metadata())
  messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
  # trim_blocks drops the newline after a tag, lstrip_blocks the indent before one; the
  # indented line is not a block tag, so its two spaces stay.
  assert tok.apply_chat_template(messages) == "  <user>hi<|end|>\n  <assistant>yo<|end|>\n" \
      "<assistant>"
  assert tok.apply_chat_template(messages, add_generation_prompt=False).endswith("yo<|end|>\n")


def test_chat_template_helpers_and_sandbox():
  tok = Tokenizer.from_gguf_metadata(_metadata(**{"tokenizer.chat_template": (
      "{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}{% endif %}"
      "{{ messages | tojson }}{{ bos_token }}")}))
  assert tok.apply_chat_template([{"role": "user", "content": "<é>"}]) == \
      '[{"role": "user", "content": "<é>"}]<|end|>'
  with pytest.raises(jinja2.TemplateError, match="user first"):
    tok.apply_chat_template([{"role": "system", "content": "x"}])
  evil = Tokenizer.from_gguf_metadata(_metadata(**{
      "tokenizer.chat_template": "{{ messages.append({'role': 'x'}) }}"}))
  with pytest.raises(jinja2.exceptions.SecurityError):
    evil.apply_chat_template([{"role": "user", "content": "x"}])


def test_from_file_reads_tokenizer_config(tmp_path):
  tok = Tokenizer.from_gguf_metadata(_metadata())
  tok.backend.save(str(tmp_path / "tokenizer.json"))
  (tmp_path / "tokenizer_config.json").write_text(json.dumps({
      "bos_token": "<|end|>", "eos_token": {"content": "<|end|>"}, "add_bos_token": True,
      "chat_template": [{"name": "tool_use", "template": "T"},
                        {"name": "default", "template": "{{ messages[0]['content'] }}!"}]}))
  loaded = Tokenizer.from_file(tmp_path / "tokenizer.json")
  assert (loaded.bos_id, loaded.eos_id, loaded.add_bos) == (0, 0, True)
  assert loaded.encode("ab ab") == [0, 3, 5]
  assert loaded.apply_chat_template([{"role": "user", "content": "hey"}]) == "hey!"


def test_from_file_post_processor_bos_is_not_doubled(tmp_path):
  tok = Tokenizer.from_gguf_metadata(_metadata())
  tok.backend.post_processor = processors.TemplateProcessing(
      single="<|end|> $A", special_tokens=[("<|end|>", 0)])
  tok.backend.save(str(tmp_path / "tokenizer.json"))
  (tmp_path / "tokenizer_config.json").write_text(json.dumps(
      {"bos_token": "<|end|>", "add_bos_token": True}))
  loaded = Tokenizer.from_file(tmp_path / "tokenizer.json")
  assert not loaded.add_bos
  assert loaded.encode("ab") == [0, 3]
  assert loaded.encode("ab", add_special_tokens=False) == [3]


def test_from_file_without_config(tmp_path):
  Tokenizer.from_gguf_metadata(_metadata()).backend.save(str(tmp_path / "tokenizer.json"))
  loaded = Tokenizer.from_file(tmp_path / "tokenizer.json")
  assert (loaded.bos_id, loaded.eos_id, loaded.chat_template) == (None, None, None)
  with pytest.raises(ValueError, match="no chat template"):
    loaded.apply_chat_template([{"role": "user", "content": "x"}])


# ------------------------------------------------------------------------------------------------
# Bad input.


def test_bad_files(tmp_path):
  with pytest.raises(FileNotFoundError, match="missing.json"):
    Tokenizer.from_file(tmp_path / "missing.json")
  (tmp_path / "tokenizer.json").write_text("{not json")
  with pytest.raises(ValueError, match="tokenizer.json: not a readable"):
    Tokenizer.from_file(tmp_path / "tokenizer.json")
  Tokenizer.from_gguf_metadata(_metadata()).backend.save(str(tmp_path / "tokenizer.json"))
  (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<nope>"}))
  with pytest.raises(ValueError, match="eos_token '<nope>' is not in the vocabulary"):
    Tokenizer.from_file(tmp_path / "tokenizer.json")


@pytest.mark.parametrize("overrides,error,match", [
    ({"tokenizer.ggml.model": "llama"}, NotImplementedError, "tokenizer.ggml.model='llama'"),
    ({"tokenizer.ggml.tokens": None}, ValueError, "tokenizer.ggml.tokens must be a list"),
    ({"tokenizer.ggml.merges": ["a b c"]}, ValueError, "merges entry 'a b c'"),
    ({"tokenizer.ggml.merges": ["a zz"]}, ValueError, "merges do not fit"),
    ({"tokenizer.ggml.token_type": [1]}, ValueError, "token_type has 1 entries"),
    ({"tokenizer.ggml.eos_token_id": 99}, ValueError, "eos_token_id must be a token id"),
])
def test_bad_metadata_names_key(overrides, error, match):
  with pytest.raises(error, match=match):
    Tokenizer.from_gguf_metadata(_metadata(**overrides))


def test_bad_calls():
  tok = Tokenizer.from_gguf_metadata(_metadata())
  with pytest.raises(TypeError, match="text must be a str"):
    tok.encode(b"ab")
  with pytest.raises(ValueError, match=r"ids must be in \[0, 9\); got \[9, -1\]"):
    tok.decode([1, 9, -1])
  with pytest.raises(ValueError, match="messages must be a sequence of mappings"):
    tok.apply_chat_template("hello")
  with pytest.raises(TypeError, match="backend must be a tokenizers.Tokenizer"):
    Tokenizer("not a tokenizer")
  with pytest.raises(ValueError, match="add_bos=True needs a bos_id"):
    Tokenizer(tokenizers.Tokenizer(tokenizers.models.BPE()), add_bos=True)
