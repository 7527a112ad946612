"""kvattn.checkpoints.tokenizer: GGUF-metadata BPE, tokenizer.json files, chat templates, bad input."""

from __future__ import annotations

import json
import pathlib
import re
import time

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


# ------------------------------------------------------------------------------------------------
# Render budgets: hostile templates stop fast, naming the template's file and the limit; real
# templates render as before.

_HOSTILE_TEMPLATES = {
    # kind: (template, the limit the error names)
    "nested loops": (
        "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
        "TEMPLATE_MAX_STEPS"),
    "a million namespace updates": (  # 4 s before the budget
        "{% set ns = namespace(x=0) %}{% for i in range(100000) %}{% for j in range(10) %}"
        "{% set ns.x = ns.x + 1 %}{% endfor %}{% endfor %}{{ ns.x }}", "TEMPLATE_MAX_STEPS"),
    "macro call tree": (
        "{% macro t(n) %}{% if n %}{{ t(n - 1) }}{{ t(n - 1) }}{% endif %}{% endmacro %}"
        "{{ t(40) }}",
        "TEMPLATE_MAX_STEPS"),
    "huge string multiply": ("{{ 'x' * 10**10 }}", "TEMPLATE_MAX_CHARS"),
    "huge list multiply": ("{{ [1] * 10**10 }}", "TEMPLATE_MAX_CHARS"),
    "nested list multiply": ("{{ ([[1] * 1000] * 1000)|length }}", "TEMPLATE_MAX_CHARS"),
    "string appends in a loop": (
        "{% set ns = namespace(s='') %}{% for i in range(100000) %}{% for j in range(100) %}"
        "{% set ns.s = ns.s ~ 'x' %}{% endfor %}{% endfor %}{{ ns.s|length }}",
        "TEMPLATE_WORK_FACTOR"),
    "output of a loop": (
        "{% for i in range(100000) %}{% for j in range(1000) %}xxxxxxxxxx{% endfor %}{% endfor %}",
        "TEMPLATE_MAX_CHARS"),
    "doubling by macro recursion": (
        "{% macro d(s, n) %}{{ d(s ~ s, n - 1) if n else s|length }}{% endmacro %}{{ d('x', 40) }}",
        "TEMPLATE_MAX_CHARS"),
    "join over a huge range": ("{{ range(10**9)|join }}", "jinja2.sandbox.MAX_RANGE"),
    "join with a huge separator": ("{{ range(100000)|join('x' * 100000) }}", "TEMPLATE_MAX_CHARS"),
    "str.join with a huge separator": (
        "{{ ('x' * 100000).join(range(100000)|map('string')) }}", "TEMPLATE_MAX_CHARS"),
    "huge power": ("{{ 10 ** 100000000 }}", "TEMPLATE_MAX_DIGITS"),
    "center filter": ("{{ 'x'|center(10**10) }}", "TEMPLATE_MAX_CHARS"),
    "str.ljust": ("{{ 'x'.ljust(10**10) }}", "TEMPLATE_MAX_CHARS"),
    "str.replace": ("{% set s = 'a' * 100000 %}{{ s.replace('a', s) }}", "TEMPLATE_MAX_CHARS"),
    "printf width": ("{{ '%10000000000s' % 'x' }}", "TEMPLATE_MAX_CHARS"),
    "str.format width": ("{{ '{:>10000000000}'.format('x') }}", "TEMPLATE_MAX_CHARS"),
    "tojson indent": ("{{ [[[1]]]|tojson(indent=10**9) }}", "TEMPLATE_MAX_CHARS"),
    "lipsum": ("{{ lipsum(n=10**7) }}", "TEMPLATE_MAX_CHARS"),
    "slices in a loop": (
        "{% set s = 'x' * 1000000 %}{% for i in range(100000) %}{% set t = s[1:] %}{% endfor %}",
        "TEMPLATE_WORK_FACTOR"),
    "scans in a loop": (
        "{% set s = 'x' * 1000000 %}{% for i in range(100000) %}{% if 'y' in s %}{% endif %}"
        "{% endfor %}", "TEMPLATE_WORK_FACTOR"),
    "recursion": ("{% macro r() %}{{ r() }}{% endmacro %}{{ r() }}", "recursion limit"),
}


@pytest.mark.parametrize("kind", _HOSTILE_TEMPLATES)
def test_hostile_template_stops_fast_naming_its_file_and_the_limit(kind):
  template, limit = _HOSTILE_TEMPLATES[kind]
  tok = Tokenizer.from_gguf_metadata(_metadata(**{"tokenizer.chat_template": template}),
                                     source="/models/evil.gguf")
  start = time.perf_counter()
  with pytest.raises(tokenizer_lib.ChatTemplateBudgetError,
                     match=rf"^chat template of /models/evil\.gguf: .*{re.escape(limit)}"):
    tok.apply_chat_template([{"role": "user", "content": "hi"}])
  # About 1 s at worst on a loaded 2-core machine (most kinds stop in milliseconds).
  assert time.perf_counter() - start < 5
  assert issubclass(tokenizer_lib.ChatTemplateBudgetError, ValueError)


def test_budget_error_names_tokenizer_config_json(tmp_path):
  Tokenizer.from_gguf_metadata(_metadata()).backend.save(str(tmp_path / "tokenizer.json"))
  (tmp_path / "tokenizer_config.json").write_text(json.dumps(
      {"chat_template": "{{ 'x' * 10**10 }}"}))
  tok = Tokenizer.from_file(tmp_path / "tokenizer.json")
  assert tok.source == str(tmp_path / "tokenizer_config.json")
  with pytest.raises(ValueError, match=r"tokenizer_config\.json: '\*' would build "
                                       r"10,000,000,000 characters or items, over the limit of "
                                       r"1,000,\d+ per render "
                                       r"\(kvattn.checkpoints.tokenizer.TEMPLATE_MAX_CHARS"):
    tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_budget_grows_with_the_conversation():
  # A conversation longer than TEMPLATE_MAX_CHARS renders: the limit adds twice the input.
  tok = Tokenizer.from_gguf_metadata(_metadata())
  content = "y" * (2 * tokenizer_lib.TEMPLATE_MAX_CHARS)
  assert tok.apply_chat_template([{"role": "user", "content": content}]) == \
      f"  <user>{content}<|end|>\n<assistant>"
  # A loop over 2,000 messages that asks for the message count each time stays within budget.
  tpl = ("{% for m in messages %}{% if loop.index0 < messages|length - 1 and 'content' in m %}"
         "{{ m['content']|trim }}{% endif %}{% endfor %}")
  long = [{"role": "user", "content": "word " * 100} for _ in range(2000)]
  tok = Tokenizer(tok.backend, chat_template=tpl)
  assert tok.apply_chat_template(long) == ("word " * 99 + "word") * 1999


# Templates that use every hook the budget adds (loops, recursion, macros, caller, filters,
# tests, methods, operators, slices, comparisons, set blocks, loop controls): each renders
# exactly as jinja2's plain sandbox with transformers' settings renders it.
_BENIGN_TEMPLATES = [
    "{% for m in messages %}{{ loop.index }}/{{ loop.length }}{{ loop.cycle('a', 'b') }}"
    "{% if loop.last %}!{% endif %}{% endfor %}",
    "{% for x in [1, [2, [3]]] recursive %}{% if x is iterable %}{{ loop(x) }}{% else %}{{ x }}"
    "{% endif %}{% endfor %}",
    "{% macro m(x) %}<{{ x }}{{ caller() if caller }}>{% endmacro %}{{ m(1) }}"
    "{% call m(2) %}c{% endcall %}",
    "{{ messages|map(attribute='role')|join(', ') }} {{ messages|selectattr('role', 'equalto',"
    " 'user')|list|length }} {{ messages|tojson(indent=2) }} {{ 'a\nb'|indent(2, true) }}",
    "{{ 'x'|center(9) }}|{{ 'aXbX'|replace('X', '--') }}|{{ '%s-%05d'|format('a', 42) }}|"
    "{{ range(7)|batch(3)|list }}|{{ range(7)|slice(3)|list }}|{{ 'a b c d'|wordwrap(3) }}|"
    "{{ [[1], [2, 3]]|sum(start=[]) }}|{{ range(4)|sum }}|{{ 'Hello'|upper|truncate(9) }}",
    "{{ 'user' is in(['user', 'system']) }}{{ 3 is divisibleby 3 }}{{ none is none }}"
    "{{ 'ab'.ljust(4, '.') }}{{ '{}-{:>3}'.format(1, 2) }}{{ '-'.join(['a', 'b']) }}"
    "{{ 'a\tb'.expandtabs(4) }}{{ 'abc'.replace('b', 'B') }}",
    "{{ 'x' * 3 }}{{ [1, 2] * 2 }}{{ 2 ** 10 }}{{ 7 // 2 }}{{ 7 % 3 }}{{ '%d%%' % 5 }}"
    "{{ 1 + 2 - 3 }}{{ 'a' ~ 1 ~ none }}{{ 'abcdef'[1:4] }}{{ messages[::-1][0]['role'] }}"
    "{{ 1 < 2 < 3 }}{{ 'a' in 'abc' }}{{ messages[0] == messages[0] }}",
    "{% set ns = namespace(n=0, s='') %}{% for i in range(10) %}{% if i == 2 %}{% continue %}"
    "{% endif %}{% if i > 6 %}{% break %}{% endif %}{% set ns.n = ns.n + i %}"
    "{% set ns.s = ns.s ~ i %}{% endfor %}{{ ns.n }} {{ ns.s }}{% set b %}[{{ ns.s }}]{% endset %}"
    "{{ b }}{% filter upper %}up{% endfilter %}{{ undefined_name }}{{ bos_token }}",
]


@pytest.mark.parametrize("template", _BENIGN_TEMPLATES)
def test_budgeted_render_equals_jinja2s_plain_sandbox(template):
  from jinja2 import sandbox  # pylint: disable=g-import-not-at-top
  from jinja2.ext import loopcontrols  # pylint: disable=g-import-not-at-top
  env = sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                              extensions=[loopcontrols])
  env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
  messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "<é>"}]
  expected = env.from_string(template).render(messages=messages, add_generation_prompt=True,
                                              bos_token="<|end|>", eos_token="<|end|>")
  tok = Tokenizer.from_gguf_metadata(_metadata(**{"tokenizer.chat_template": template}))
  assert tok.apply_chat_template(messages) == expected


def test_smollm2_chat_template_renders_transformers_prompts():
  # The template shipped in SmolLM2-135M-Instruct's GGUF (metadata only, no weights), against
  # the prompts transformers rendered (tests/fixtures/smollm2_reference.json).
  import gguf  # pylint: disable=g-import-not-at-top
  from kvattn.checkpoints import gguf as gguf_lib  # pylint: disable=g-import-not-at-top
  from kvattn.checkpoints import hub
  path = hub.resolve("smollm2-135m-instruct")
  metadata = gguf_lib.read_metadata(gguf.GGUFReader(path))
  tok = Tokenizer.from_gguf_metadata(metadata, source=str(path))
  reference = json.loads((pathlib.Path(__file__).parents[2] / "fixtures" /
                          "smollm2_reference.json").read_text(encoding="utf-8"))
  for chat in reference["chats"]:
    assert tok.apply_chat_template(chat["messages"], add_generation_prompt=True) == chat["prompt"]
