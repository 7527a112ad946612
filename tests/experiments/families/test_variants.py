"""The toy comparison (configs/toy.py, the main job before SmolLM2) end to end: the smoke run,
the command line, validation before training.

The fast suite runs the toy comparison once (`configs/toy.py:smoke`,
`default_run`); the runner's own bookkeeping (resume, skipping finished
points, atomic writes, refusals before work) is tested with a stand-in family
in test_runner.py. The other configs' smoke runs and the end-to-end resume
with training are `slow`. The smoke runs share one directory of trained params
(`experiment.train_dir`), so each variant is trained once for the whole
module; the prefill/decode programs compiled by the first run are reused by
the later ones (same shapes).
"""

import collections
import csv
import importlib
import json
import math
import os
import sys

import pytest
from absl import flags

from configs import heads_sweep, seqlen_sweep
from configs import toy as default
from experiments import main as main_lib
from experiments.framework import runner
from experiments.framework import overrides
from experiments.framework import checks
from experiments.families import variants
from experiments.families import variants_report
import kvattn
from kvattn import memory
from kvattn.training import trainer as train_lib
from kvattn.models import transformer as transformer_lib

FILES = ("results.jsonl", "results.csv", "report.md", "config.json",
         *variants_report.PLOTS.values())
FIELDS = ("point", "label", "variant", "num_kv_heads", "seq_len", "batch",
          "cache_bytes_per_token", "cache_bytes_per_token_analytic", "cache_bytes",
          "prefill_s", "prefill_s_min", "prefill_s_max",
          "decode_ms_per_step", "decode_ms_per_step_min", "decode_ms_per_step_max",
          "decode_tokens_per_s", "decode_tokens_per_s_min", "decode_tokens_per_s_max",
          "validation_loss", "validation_bits_per_byte", "train_steps", "environment", "config")


@pytest.fixture(scope="module")
def train_dir(tmp_path_factory):
  return str(tmp_path_factory.mktemp("trained"))


def smoke_config(module, train_dir, **overrides):
  config = module.get_config("smoke")
  config.experiment.train_dir = train_dir
  config.update_from_flattened_dict(overrides)
  return config


@pytest.fixture(scope="module")
def default_run(tmp_path_factory, train_dir):
  workdir = str(tmp_path_factory.mktemp("default"))
  result = runner.run(smoke_config(default, train_dir), workdir, default.get_sweep("smoke"),
                      config_file="configs/toy.py:smoke")
  return workdir, result


def analytic_bytes_per_token(record):
  """Independent arithmetic: GQA 2 K H itemsize per layer, MLA (C + R) itemsize per layer."""
  cfg = record["config"]
  layers, att = cfg["model"]["num_layers"], cfg["model"]["attention"]
  itemsize = 4  # float32 caches in every config
  if record["variant"] == "MLA":
    return layers * (att["kv_lora_rank"] + att["qk_rope_head_dim"]) * itemsize
  return layers * 2 * record["num_kv_heads"] * att["head_dim"] * itemsize


def check_outputs(workdir, result, config, expected_kv_heads):
  """Files, fields and sane values of a finished run; returns records by (variant, K, S)."""
  for name in FILES:
    assert os.path.getsize(os.path.join(workdir, name)) > 0, name
  for name in variants_report.PLOTS.values():
    with open(os.path.join(workdir, name), "rb") as f:
      assert f.read(8) == b"\x89PNG\r\n\x1a\n", name
  assert not [n for n in os.listdir(workdir) if n.startswith(".tmp-")]  # no torn writes left
  seq_lens = tuple(config.cache.seq_lens)
  records = result.records
  assert result.complete
  assert len(records) == (len(expected_kv_heads) + 1) * len(seq_lens)  # + MLA
  with open(os.path.join(workdir, "results.jsonl")) as f:
    lines = [json.loads(line) for line in f]
  assert [r["point"] for r in lines] == [r["point"] for r in records]
  with open(os.path.join(workdir, "results.csv")) as f:
    rows = list(csv.DictReader(f))
  assert len(rows) == len(records)
  assert {"cache_bytes_per_token", "decode_tokens_per_s", "config.model.d_model",
          "environment.jax_version"} <= set(rows[0])

  by = {}
  for r in records:
    for field in FIELDS:
      assert field in r, field
    by[(r["variant"], r["num_kv_heads"], r["seq_len"])] = r
    batch, s = r["batch"], r["seq_len"]
    spec = transformer_lib.resolve_config(r["config"]["model"])
    assert r["cache_bytes_per_token"] == r["cache_bytes_per_token_analytic"] \
        == transformer_lib.cache_bytes_per_token(spec) == analytic_bytes_per_token(r)
    assert r["cache_bytes"] == batch * s * r["cache_bytes_per_token"]
    assert sum(r["cache_bytes_per_token_per_layer"]) == r["cache_bytes_per_token"]
    assert r["decode_tokens_per_s"] > 0 and r["prefill_s"] > 0
    assert r["decode_tokens_per_s_min"] <= r["decode_tokens_per_s"] <= r["decode_tokens_per_s_max"]
    assert r["decode_ms_per_step_min"] <= r["decode_ms_per_step"] <= r["decode_ms_per_step_max"]
    steps = r["new_tokens"] - 1
    assert math.isclose(r["decode_tokens_per_s"], batch * steps / r["decode_s"], rel_tol=1e-9)
    assert r["prompt_len"] + steps == s  # the cache ends exactly full
    # A few steps of training: better than nothing known, no better than a real model.
    assert 0.5 < r["validation_bits_per_byte"] < math.log2(259) + 1
    assert r["train_steps"] == config.train.steps
    assert r["environment"]["backend"] and r["environment"]["cpu_count"] >= 1
    assert set(r["config"]) == set(variants.variants_schema())
  assert {k for (v, k, _) in by if v != "MLA"} == set(expected_kv_heads)

  n = config.model.attention.num_heads
  for s in seq_lens:
    mha, mqa = by[("MHA", n, s)], by[("MQA", 1, s)]
    assert mqa["cache_bytes_per_token"] * n == mha["cache_bytes_per_token"]  # MQA is 1/N of MHA
    for (v, k, s2), r in by.items():
      if s2 == s and v != "MLA":
        assert r["cache_bytes_per_token"] * n == mha["cache_bytes_per_token"] * k

  with open(os.path.join(workdir, "report.md")) as f:
    report = f.read()
  assert report == result.report
  assert "| " + " | ".join(variants_report.VARIANT_COLUMNS) + " |" in report
  for s in seq_lens:
    assert f"## S = {s}" in report
  assert report.count("| MQA | 1 | ") == len(seq_lens)
  assert f"| MQA | 1 | {mqa['cache_bytes_per_token']:,} | {1 / n:.1%} |" in report
  return by


def test_default_smoke(default_run):
  workdir, result = default_run
  n = default.get_config("smoke").model.attention.num_heads
  by = check_outputs(workdir, result, default.get_config("smoke"), {n, n // 2, n // 4, 1})
  # The report's rows carry each point's measured cache bytes and bits/byte.
  for r in result.records:
    k = "—" if r["num_kv_heads"] is None else r["num_kv_heads"]
    row = f"| {r['variant']} | {k} | {r['cache_bytes_per_token']:,} | "
    assert row in result.report, row
    assert f" | {r['validation_bits_per_byte']:.3f} | " in result.report
  assert {v for v, _, _ in by} == {"MHA", "GQA", "MQA", "MLA"}
  first_s = default.get_config("smoke").cache.seq_lens[0]
  for (v, k, _), r in by.items():  # the variant's training is shared across S
    assert r["validation_bits_per_byte"] == by[(v, k, first_s)]["validation_bits_per_byte"]
  assert len({r["train_group"] for r in result.records}) == 5


@pytest.mark.slow
def test_heads_sweep_smoke(tmp_path, default_run, train_dir):
  result = runner.run(smoke_config(heads_sweep, train_dir), str(tmp_path),
                      overrides.load_sweep("configs/heads_sweep.py:smoke"))
  n = heads_sweep.get_config("smoke").model.attention.num_heads
  divisors = {k for k in range(1, n + 1) if n % k == 0}
  by = check_outputs(str(tmp_path), result, heads_sweep.get_config("smoke"), divisors)
  # Same model and training as the default smoke run: its trained params were reused, not retrained.
  trained = {(r["variant"], r["num_kv_heads"]): r["train_seconds"] for r in default_run[1].records}
  for (v, k, _), r in by.items():
    assert r["train_seconds"] == trained[(v, k)]


@pytest.mark.slow
def test_seqlen_sweep_smoke(tmp_path, default_run, train_dir):
  config = smoke_config(seqlen_sweep, train_dir)
  seq_lens = tuple(config.cache.seq_lens)
  assert seq_lens == (16, 32)  # powers of two up to the smoke cap (memory allows far more)
  result = runner.run(config, str(tmp_path), overrides.load_sweep("configs/seqlen_sweep.py:smoke"))
  n = config.model.attention.num_heads
  by = check_outputs(str(tmp_path), result, config, {n, n // 4, 1})
  for (v, k, s), r in by.items():  # cache bytes grow linearly in S
    assert r["cache_bytes"] * seq_lens[0] == by[(v, k, seq_lens[0])]["cache_bytes"] * s


def test_seqlen_sweep_stops_where_memory_ends(monkeypatch):
  monkeypatch.setattr(checks, "available_memory_bytes", lambda: 2**30)  # 1 GiB, half usable
  config = seqlen_sweep.get_config("")
  seq_lens = config.cache.seq_lens
  assert seq_lens[0] == 256 and all(b == 2 * a for a, b in zip(seq_lens, seq_lens[1:]))
  spec = transformer_lib.resolve_config(config.to_dict()["model"])
  need = lambda s: variants.point_memory_bytes(spec, config.cache.batch, s, "float32",
                                            config.train.batch_size, config.data.seq_len)["total"]
  assert need(seq_lens[-1]) <= 2**29 < need(2 * seq_lens[-1])


@pytest.mark.slow  # the runner's resume is tested without training in test_runner.py
def test_resume_after_stop_and_interrupt(tmp_path, monkeypatch, default_run):
  """Stop after k points, interrupt one, rerun: every point exactly once; no retraining."""
  workdir = str(tmp_path)
  config = default.get_config("smoke")  # trains into WORKDIR/train
  config.cache.seq_lens = (16, 24, 32)
  n = config.model.attention.num_heads
  sweep = [{"model.attention.num_kv_heads": n}]  # MHA at three S: one training
  trainings = []
  real_train = train_lib.train_and_evaluate

  def counting_train(cfg, workdir=None):
    trainings.append(cfg.model.attention.num_kv_heads)
    return real_train(cfg, workdir=workdir)

  monkeypatch.setattr(train_lib, "train_and_evaluate", counting_train)
  store = lambda: [json.loads(l) for l in open(os.path.join(workdir, "results.jsonl"))]

  first = runner.run(config, workdir, sweep, max_points=1)
  assert len(first.measured) == 1 and not first.complete and len(store()) == 1
  assert trainings == [n]
  assert os.path.exists(os.path.join(workdir, "report.md"))

  # An interrupt during the third point (before its record) loses only that point.
  real_measure = variants.VariantsFamily.measure
  calls = []

  def interrupted(self, point):
    calls.append(point.label)
    if len(calls) == 2:
      raise KeyboardInterrupt
    return real_measure(self, point)

  monkeypatch.setattr(variants.VariantsFamily, "measure", interrupted)
  with pytest.raises(KeyboardInterrupt):
    runner.run(config, workdir, sweep)
  assert calls == ["MHA-K8-S24", "MHA-K8-S32"]
  assert len(store()) == 2 and trainings == [n]  # restored from WORKDIR/train, not retrained
  assert not [name for name in os.listdir(workdir) if name.startswith(".tmp-")]

  monkeypatch.setattr(variants.VariantsFamily, "measure", real_measure)
  third = runner.run(config, workdir, sweep)
  assert third.complete and len(third.measured) == 1 and trainings == [n]
  fourth = runner.run(config, workdir, sweep)
  assert fourth.measured == [] and trainings == [n]
  points = [r["point"] for r in store()]
  assert len(points) == 3 and collections.Counter(points).most_common(1)[0][1] == 1
  assert [r["point"] for r in fourth.records] == [r["point"] for r in third.records]
  # The same config measured elsewhere gets the same point ids (they hash the config, not paths).
  shared = {r["point"] for r in default_run[1].records}
  assert [r["point"] in shared for r in third.records] == [True, False, True]


@pytest.mark.slow
@pytest.mark.parametrize("module, seq_lens", [(default, (256, 512)), (heads_sweep, (256,)),
                                              (seqlen_sweep, (256, 512, 1024))])
def test_full_size_configs(tmp_path, module, seq_lens):
  """The full-size models of every config, with short training and few S (not the full run)."""
  config = module.get_config("")
  config.train.steps, config.train.warmup_steps, config.train.eval_batches = 20, 2, 2
  config.train.checkpoint_every = 0
  config.cache.seq_lens = seq_lens
  config.decode.repeats = config.decode.decode_repeats = 1
  result = runner.run(config, str(tmp_path), module.get_sweep(""))
  n = config.model.attention.num_heads
  kv_heads = {k for k in (n, n // 2, n // 4, 1) if module is default} | (
      {k for k in range(1, n + 1) if n % k == 0} if module is heads_sweep else set()) | (
          {n, n // 4, 1} if module is seqlen_sweep else set())
  check_outputs(str(tmp_path), result, config, kv_heads)


@pytest.fixture
def no_training(monkeypatch):
  def fail(*args, **kwargs):
    raise AssertionError("training started before validation finished")

  monkeypatch.setattr(train_lib, "train_and_evaluate", fail)
  monkeypatch.setattr(variants.VariantsFamily, "measure", fail)


@pytest.mark.parametrize("mutate, sweep, match", [
    (lambda d: d["cache"].update(seq_lenz=(16,)), None, r"cache\.seq_lenz is not a known key"),
    (lambda d: d.update(optimizer={}), None, r"optimizer is not a known section"),
    (lambda d: d["model"].pop("d_model"), None, r"model\.d_model is missing"),
    (None, [{"model.attention.num_kv_hedas": 2}],
     r"model\.attention\.num_kv_hedas is not a known key"),
    (None, [{"model.attention.num_kv_heads": 3}],
     r"model\.attention\.num_kv_heads must divide model\.attention\.num_heads; got 3 and 8"),
    (lambda d: d["cache"].update(seq_lens=(16, 2**22)), None,
     r"cache\.seq_lens = 4194304 is larger than memory allows"),
    (lambda d: d["cache"].update(seq_lens=(3,)), None, r"cache\.seq_lens must be an int >= 4"),
    (lambda d: d["cache"].update(batch=0), None, r"cache\.batch must be an int >= 1"),
    (lambda d: d["decode"].update(repeats=0), None, r"decode\.repeats must be an int >= 1"),
    (lambda d: d["train"].update(warmup_steps=5), None, r"train\.warmup_steps must be less"),
    (lambda d: d["model"]["attention"].update(decode_implementation=3), None,
     r"model\.attention\.decode_implementation must be a str or None"),
    (lambda d: d["experiment"].update(kind="paged_typo"), None, r"experiment\.kind must be one of"),
    (lambda d: d["mesh"].update(shape=(2, 1, 1)), None, r"mesh: mesh\.shape \(2, 1, 1\) needs 2"),
])
def test_bad_config_fails_before_training(tmp_path, no_training, mutate, sweep, match):
  d = default.get_config("smoke").to_dict()
  if mutate is not None:
    mutate(d)
  workdir = str(tmp_path / "run")
  with pytest.raises(ValueError, match=match):
    runner.run(d, workdir, sweep or default.get_sweep("smoke"))
  assert not os.path.exists(workdir)  # nothing written, nothing trained


def test_bad_sweep_entry_is_named(tmp_path, no_training):
  sweep = default.get_sweep("smoke") + [{"model.attention.num_kv_heads": 5}]
  with pytest.raises(ValueError, match=r"sweep\[5\] .*attention\.num_kv_heads must divide"):
    runner.run(default.get_config("smoke"), str(tmp_path), sweep)
  with pytest.raises(ValueError, match=r"sweep\[1\] .*same point MHA-K8-S16"):
    runner.run(default.get_config("smoke"), str(tmp_path),
               [{}, {"model.attention.num_kv_heads": 8}])


def test_config_arguments():
  assert overrides.load_sweep("configs/toy.py:smoke") == default.get_sweep("smoke")
  assert overrides.load_sweep("configs/toy.py") == default.get_sweep()
  assert [e["model.attention.num_kv_heads"] for e in heads_sweep.get_sweep()[:-1]] == [
      12, 6, 4, 3, 2, 1]
  with pytest.raises(ValueError, match=r"config argument must be one of"):
    default.get_config("tiny")
  # Every field of every config is in the runner's schema (and vice versa).
  for module in (default, heads_sweep, seqlen_sweep):
    for arg in ("", "smoke"):
      overrides.check_schema(module.get_config(arg).to_dict(), variants.variants_schema())


@pytest.fixture
def parse_flags(monkeypatch):
  """Parses main's flags as the command line would (config_flags reads sys.argv)."""
  parsed = []
  before = set(flags.FLAGS)

  def parse(*args):
    argv = ["experiments.main", *args]
    monkeypatch.setattr(sys, "argv", argv)
    parsed.append(True)
    return flags.FLAGS(argv)

  yield parse
  flags.FLAGS.unparse_flags()
  for name in set(flags.FLAGS) - before:  # the --config.<field> flags config_flags defined
    delattr(flags.FLAGS, name)


def test_main_command_line(tmp_path, parse_flags, capsys, default_run, train_dir):
  workdir = str(tmp_path / "cli")
  parse_flags("--config=configs/toy.py:smoke", f"--workdir={workdir}",
              "--config.model.num_layers=1", f"--config.experiment.train_dir={train_dir}")
  config = flags.FLAGS.config
  assert config.model.num_layers == 1 and config.is_locked
  main_lib.main(["experiments.main"])
  out = capsys.readouterr().out
  assert f"Report: {os.path.join(workdir, 'report.md')}" in out
  assert "| " + " | ".join(variants_report.VARIANT_COLUMNS) + " |" in out
  # Same config as the default smoke run: the same points, trained params reused.
  with open(os.path.join(workdir, "results.jsonl")) as f:
    assert {json.loads(l)["point"] for l in f} == {r["point"] for r in default_run[1].records}


def test_main_unknown_override_names_the_key(tmp_path, parse_flags):
  # config_flags reports the unknown field (and suggests "steps") while parsing the flags.
  with pytest.raises((flags.Error, AttributeError, KeyError), match=r"stepz"):
    parse_flags("--config=configs/toy.py:smoke", f"--workdir={tmp_path}",
                "--config.train.stepz=3")


@pytest.mark.parametrize("override, match", [
    # Bad values in the config as given fail naming the key, even where the sweep sets it.
    ("model.attention.num_kv_heads=3",
     r"config: model\.attention\.num_kv_heads must divide model\.attention\.num_heads; got 3 "
     r"and 8"),
    ("model.attention.kind=foo",
     r"config: model\.attention\.kind must be one of \('gqa', 'mla'\); got 'foo'"),
    # A valid override of a key the sweep sets would be discarded for every point: an error.
    ("model.attention.num_kv_heads=4",
     r"config: model\.attention\.num_kv_heads = 4 overrides the config file's 8, but the sweep of "
     r"configs/toy\.py:smoke sets model\.attention\.num_kv_heads for its points "
     r"\(8, 4, 2, 1\), so "
     r"the override would be silently discarded"),
    ("model.attention.kind=mla",
     r"config: model\.attention\.kind = 'mla' overrides the config file's 'gqa'"),
    # Decode backends: unknown names at validation, unfit shapes at the pre-flight decode step.
    ("model.attention.decode_implementation=bogus",
     r"config: model\.attention\.decode_implementation must be one of \[.*'xla'.*\] or None for "
     r"attention kind 'gqa'; got 'bogus'"),
    ("model.attention.decode_implementation=xla_pool",  # a paged-cache backend: not an MLA one
     r"sweep\[4\] .*model\.attention\.decode_implementation must be one of .* for attention "
     r"kind 'mla'"),
    # (The dense and MLA kernels pad any head dim now, so 'pallas' fits the toy smoke; the
    # pre-flight refusal is tested by the paged and quant families' shapes.)
])
def test_command_line_override_fails_before_training(tmp_path, parse_flags, no_training,
                                                     override, match):
  workdir = str(tmp_path / "cli")
  parse_flags("--config=configs/toy.py:smoke", f"--workdir={workdir}", f"--config.{override}")
  with pytest.raises(ValueError, match=match):
    main_lib.main(["experiments.main"])
  assert not os.path.exists(workdir)  # nothing written, nothing trained


def test_overrides_of_keys_the_sweep_does_not_set_are_kept():
  sweep = default.get_sweep("smoke")
  defaults = overrides.load_config_defaults("configs/toy.py:smoke")
  config = default.get_config("smoke")
  config.model.num_layers = 2  # not a sweep key
  config.model.attention.kind = "gqa"  # a sweep key, set to the file's own value
  overrides.check_overrides_kept(config, sweep, defaults, "configs/toy.py:smoke")
  overrides.check_overrides_kept(default.get_config("smoke"), sweep, None)  # no file: no check
  config.model.attention.num_kv_heads = 2
  with pytest.raises(ValueError, match=r"model\.attention\.num_kv_heads = 2 overrides"):
    overrides.check_overrides_kept(config, sweep, defaults)


def test_cache_accounting_mismatch_stops(tmp_path, monkeypatch, default_run, train_dir):
  real = transformer_lib.cache_bytes_per_token
  monkeypatch.setattr(transformer_lib, "cache_bytes_per_token",
                      lambda cfg, dtype=None: real(cfg, dtype) + 1)
  with pytest.raises(checks.CacheAccountingError, match=r"measured cache bytes differ"):
    runner.run(smoke_config(default, train_dir), str(tmp_path), default.get_sweep("smoke")[:1])
  assert not os.path.exists(os.path.join(tmp_path, "results.jsonl"))


def test_check_cache_bytes_on_real_caches():
  gqa = [kvattn.KVCache.init(3, 5, 2, 4, "float32"), kvattn.KVCache.init(3, 5, 2, 4, "float32")]
  mla = [kvattn.LatentCache.init(3, 5, 8, 2, "bfloat16")]
  for caches, per_token in ((gqa, 2 * memory.gqa_bytes_per_token(2, 4, "float32")),
                            (mla, memory.mla_bytes_per_token(8, 2, "bfloat16"))):
    got = checks.check_cache_bytes(caches, per_token, 3, 5)
    assert got["cache_bytes_per_token"] == per_token
    assert got["cache_bytes"] == 15 * per_token == memory.tree_bytes(
        [c.storage_arrays() for c in caches])
    assert got["cache_bookkeeping_bytes"] == len(caches) * 3 * 4  # i32 lengths
    with pytest.raises(checks.CacheAccountingError, match=r"differ from the analytic figure"):
      checks.check_cache_bytes(caches, per_token * 2, 3, 5)


def test_variant_rows_against_quoted_ranges():
  def rec(variant, k, bpt, tps, bpb):
    return {"variant": variant, "num_kv_heads": k, "seq_len": 64, "cache_bytes_per_token": bpt,
            "decode_tokens_per_s": tps, "validation_bits_per_byte": bpb}
  rows = variants_report.variant_rows([
      rec("MHA", 8, 1024, 100.0, 2.0), rec("GQA", 2, 256, 200.0, 2.1),
      rec("MQA", 1, 128, 600.0, 2.25), rec("MLA", None, 288, 90.0, 1.9)])
  mha, gqa, mqa, mla = rows[64]
  assert mha[3:6] == ["100.0%", "100", "1.00×"] and mha[-1] == "—"
  assert gqa[3] == "25.0%" and gqa[5] == "2.00×" and gqa[7] == "+0.100"
  assert gqa[-1] == "cache yes, speed yes"
  assert mqa[3] == "12.5%" and mqa[5] == "6.00×" and mqa[-1] == "cache yes, speed no"
  assert mla[1] == "—" and mla[-2].startswith('"adaptive"') and mla[-1] == "n/a"
  no_baseline = variants_report.variant_rows([rec("GQA", 2, 256, 200.0, 2.1)])[64][0]
  assert no_baseline[3] == "n/a" and no_baseline[-1] == "n/a (no MHA point)"


SHIPPED = ["toy", "heads_sweep", "seqlen_sweep", "quant_sweep", "paged"]


def _validate_and_preflight(tmp_path, name, arg, preflight_points):
  module = importlib.import_module(f"configs.{name}")
  config, sweep = module.get_config(arg), module.get_sweep(arg)
  family = runner.family_factory(config.experiment.kind)(str(tmp_path))
  points = family.points(overrides.to_dict(config), sweep)
  assert len(points) >= len(sweep) >= 1
  assert len({p.id for p in points}) == len(points)
  preflight = getattr(family, "preflight", None)
  for point in points if preflight and preflight_points else ():
    preflight(point)
  assert not os.listdir(tmp_path)  # nothing written before the run proper


@pytest.mark.parametrize("name", SHIPPED)
@pytest.mark.parametrize("arg", ["", "smoke"])
def test_every_shipped_config_validates_and_preflights(tmp_path, no_training, name, arg):
  """Each config file as shipped (full size and smoke) passes the runner's validation without
  training (a base config whose own values do not validate would stop the real run before its
  first point); the smoke points also pass the abstract decode-step pre-flight."""
  _validate_and_preflight(tmp_path, name, arg, preflight_points=arg == "smoke")


@pytest.mark.slow  # the same pre-flight code as the smoke points, on the full-size shapes
@pytest.mark.parametrize("name", SHIPPED)
def test_every_full_size_point_preflights(tmp_path, no_training, name):
  _validate_and_preflight(tmp_path, name, "", preflight_points=True)


def test_sweep_overrides_go_through_ml_collections_on_a_locked_copy():
  config = default.get_config("smoke")
  d = overrides.apply_overrides(config, {"model.attention.window": 8, "cache.batch": 3}, "sweep[0]")
  assert d["model"]["attention"]["window"] == 8 and d["cache"]["batch"] == 3
  assert config.model.attention.window is None and config.cache.batch == 2  # a copy
  assert not config.is_locked
  with pytest.raises(ValueError, match=r"sweep\[0\]: model\.attention\.windw is not a known key "
                                       r"\(did you mean model\.attention\.window\?\)"):
    overrides.apply_overrides(config, {"model.attention.windw": 8}, "sweep[0]")
  # A typed placeholder refuses a value of another type, as `--config.<key>=` does.
  with pytest.raises(ValueError, match=r"sweep\[0\]: model\.attention\.window = 'wide' has the "
                                       r"wrong type"):
    overrides.apply_overrides(config, {"model.attention.window": "wide"}, "sweep[0]")
  with pytest.raises(ValueError, match=r"attention\.kind is not a known key"):
    overrides.apply_overrides(config, {"attention.kind": "mla"}, "sweep[0]")  # the one path: model.


def test_one_path_per_setting():
  """`model.attention.<field>` is the same key in the file, on the command line and in a sweep."""
  schema = variants.variants_schema()
  assert "attention" not in schema and "kernel" not in schema
  assert {"attention.kind", "attention.num_kv_heads", "attention.decode_implementation",
          "num_layers"} <= set(schema["model"])
  for name in ("toy", "heads_sweep", "seqlen_sweep", "quant_sweep", "paged"):
    module = importlib.import_module(f"configs.{name}")
    config = module.get_config("smoke")
    for entry in module.get_sweep("smoke"):
      for dotted in entry:
        overrides.apply_overrides(config, {dotted: entry[dotted]}, name)  # every sweep key exists
    assert transformer_lib.resolve_config(config.model).num_layers == config.model.num_layers
