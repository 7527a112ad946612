"""The compression family (configs/compression.py): points read from the policy registry at
run time, validation before any work, the smoke run end to end, the report beside kvpress;
and the kvpress peer's record / resume logic (without torch)."""

import json
import os

import pytest

from configs import compression as compression_config
from experiments.benchmarks.peers import kvpress_ruler
from experiments.evals import ruler
from experiments.families import compression
from experiments.framework import runner
from kvattn.caches import eviction


def test_points_follow_the_registry_at_run_time(monkeypatch):
  config = compression_config.get_config("smollm2")
  family = compression.CompressionFamily("/nonexistent")
  points = family.points(config, compression_config.get_sweep("smollm2"))
  policies = (*eviction.POLICY_TABLE, "sink")
  assert len(points) == 1 + 4 * len(policies)  # "none" + every policy at 4 ratios > 0
  assert points[0].params == {"model_name": "smollm2-135m-instruct", "policy": "none",
                              "ratio": 0.0, "protocol": "context"}
  assert {p.params["policy"] for p in points[1:]} == set(policies)
  assert len({p.id for p in points}) == len(points)
  # a policy registered later joins the sweep with no edit of the family or the config
  monkeypatch.setitem(eviction.POLICY_TABLE, "later_policy", eviction.POLICY_TABLE["recent"])
  again = family.points(config, compression_config.get_sweep("smollm2"))
  assert len(again) == len(points) + 4
  assert [p.params["model_name"] for p in family.points(config, compression_config.get_sweep())
          ][-1] == "gemma3-270m"


@pytest.mark.parametrize("overrides,message", [
    ({"compression.protocol": "grow"}, r"compression.protocol must be one of \('fixed_budget', "
                                       r"'context'\); got 'grow'"),
    ({"compression.ratios": (0.0, 1.0)}, r"compression.ratios must be numbers in \[0, 1\); "
                                         r"got 1.0"),
    ({"compression.policies": ("dense",)}, "compression.policies must hold bounded cache kinds"),
    ({"workload.tasks": ("niah",)}, "workload.tasks must hold tasks of"),
    ({"workload.lengths": (64,)}, "workload.lengths must be an int >= 128"),
    ({"peer.kvpress_jsonl": "/nonexistent.jsonl"}, "peer.kvpress_jsonl: no such file"),
])
def test_bad_points_fail_before_any_work(overrides, message, tmp_path):
  with pytest.raises(ValueError, match=message):
    runner.run(compression_config.get_config("smoke"), str(tmp_path), [overrides])
  assert not os.path.exists(tmp_path / "results.jsonl")


def test_spec_of_each_protocol():
  assert compression.spec_of("knorm", 300, 0.0, "fixed_budget", 4) == {"kind": "dense"}
  assert compression.spec_of("knorm", 300, 0.5, "fixed_budget", 4) == {"kind": "knorm",
                                                                       "budget": 300}
  assert compression.spec_of("sink", 300, 0.5, "fixed_budget", 4) == {
      "kind": "sink", "num_sinks": 4, "window": 296}
  assert compression.spec_of("sink", 2, 0.9, "fixed_budget", 4)["window"] == 1  # budget+1
  assert compression.spec_of("snapkv", 0, 0.9, "fixed_budget", 4)["budget"] == 1
  assert compression.spec_of("snapkv", 300, 0.25, "context", 4) == {
      "kind": "snapkv", "compress": "context", "compression_ratio": 0.25, "window_size": 64,
      "kernel_size": 5}  # kvpress's SnapKVPress defaults
  assert compression.spec_of("knorm", 300, 0.5, "context", 4) == {
      "kind": "knorm", "compress": "context", "compression_ratio": 0.5}


def test_context_specs_carry_kvpress_defaults():
  spec = lambda p, **kw: compression.spec_of(p, 476, 0.5, "context", 4, **kw)
  assert spec("expected_attention") == {
      "kind": "expected_attention", "compress": "context", "compression_ratio": 0.5,
      "num_sinks": 4, "n_future_positions": 512}  # ExpectedAttentionPress's n_sink 4
  assert spec("h2o")["recent_size"] == 0  # ObservedAttentionPress protects no window
  assert spec("chunkkv")["chunk_size"] == 20 and spec("chunkkv")["window_size"] == 64
  assert spec("criticalkv")["first_keep"] == 238  # first_stage_ratio 0.5 of the kept count
  assert spec("snapkv+knorm")["first_keep"] == 952  # the peer's SnapKV stage
  assert spec("sink") == {"kind": "recent", "compress": "context", "compression_ratio": 0.5,
                          "num_sinks": 4}  # StreamingLLMPress: 4 sinks and the newest
  assert spec("think", head_dim=64) == {"kind": "think", "keep_channels": 32,
                                        "window_size": 32}
  assert compression.spec_of("think", 476, 0.75, "context", 4, head_dim=64)[
      "keep_channels"] == 16  # int(64 * 0.75) channels pruned
  assert spec("decoding_knorm") == {"kind": "decoding_knorm", "budget": 484,
                                    "compression_interval": 8}
  assert spec("pyramidkv", context_tokens=953) == {
      "kind": "pyramidkv", "compress": "context", "compression_ratio": 0.5,
      "context_tokens": 953, "window_size": 64, "kernel_size": 5}
  from kvattn.caches import registry  # every spec is one the registry accepts
  for p in ("expected_attention", "h2o", "chunkkv", "criticalkv", "snapkv+knorm", "sink",
            "keydiff", "tova", "decoding_knorm"):
    registry.cache_options(spec(p))
  registry.cache_options(spec("think", head_dim=64))
  registry.cache_options(spec("pyramidkv", context_tokens=953))
  with pytest.raises(ValueError, match="head_dim must be given for policy 'think'"):
    spec("think")
  with pytest.raises(ValueError, match="context_tokens must be given for policy 'pyramidkv'"):
    spec("pyramidkv")
  with pytest.raises(ValueError, match="'adakv' has no context mode"):
    spec("adakv")
  # PyramidKV's schedule over another policy's scores (context only).
  assert spec("pyramidkv_keydiff", context_tokens=953) == {
      "kind": "pyramidkv", "compress": "context", "compression_ratio": 0.5,
      "context_tokens": 953, "policy": "keydiff"}
  registry.cache_options(spec("pyramidkv_keydiff", context_tokens=953))
  assert compression.pyramid_inner("pyramidkv_nope") is None
  with pytest.raises(ValueError, match="context_tokens must be given for policy 'pyramidkv_"):
    spec("pyramidkv_knorm")
  with pytest.raises(ValueError, match="only the context mode"):
    compression.spec_of("pyramidkv_keydiff", 476, 0.5, "fixed_budget", 4)
  # AdaKV over a policy (kvpress's AdaKVPress(<press>)): the inner press's kvpress options.
  assert spec("adakv_snapkv") == {"kind": "adakv_snapkv", "compress": "context",
                                  "compression_ratio": 0.5, "window_size": 64, "kernel_size": 5}
  assert spec("adakv_expected_attention")["num_sinks"] == 4
  for p in ("adakv_keydiff", "adakv_knorm", "adakv_snapkv", "adakv_expected_attention"):
    registry.cache_options(spec(p))
  with pytest.raises(ValueError, match="'adakv_keydiff' has only the context mode"):
    compression.spec_of("adakv_keydiff", 476, 0.5, "fixed_budget", 4)
  assert {"adakv_keydiff", "adakv_knorm", "adakv_snapkv", "adakv_expected_attention"} <= set(
      kvpress_ruler.press_names())  # the peer's AdaKVPress over the same presses


@pytest.mark.parametrize("n", [40, 600, 953, 1001, 4093])
@pytest.mark.parametrize("ratio", [0.1, 0.25, 0.3, 0.5, 0.7, 0.75, 0.9])
def test_composed_ratios_keep_kvattns_counts_under_kvpress_rounding(n, ratio):
  r1, r2 = kvpress_ruler.composed_ratios(ratio, n)
  kept = max(1, int(n * (1 - ratio)))
  first = n if r1 == 0 else int(n * (1 - r1))  # kvpress's compute_n_kept, stage by stage
  assert first == min(n, 2 * kept)
  assert int(first * (1 - r2)) == kept


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp("compression"))
  result = runner.run(compression_config.get_config("smoke"), workdir,
                      compression_config.get_sweep("smoke"))
  return workdir, result.records


def test_smoke_run_end_to_end(smoke_run):
  workdir, records = smoke_run
  config = compression_config.get_config("smoke")
  by = {(r["policy"], r["ratio"]): r for r in records}
  assert sorted(by) == [("knorm", 0.5), ("knorm", 0.75), ("none", 0.0)]
  none = by["none", 0.0]
  n = config.workload.seeds * len(config.workload.tasks) * len(config.workload.lengths)
  for r in records:
    assert r["num_examples"] == len(r["scores"]) == len(r["outputs"]) == n
    assert r["score"] == pytest.approx(sum(r["scores"]) / n)
    assert r["examples_per_s"] > 0 and r["first_call_s"] > 0 and not r["includes_compile"]
    assert r["prompt_sha1"] == none["prompt_sha1"]  # every point answers the same prompts
  # kvpress's protocol: each row keeps int(context_tokens * (1 - ratio)) context tokens
  for ratio in (0.5, 0.75):
    r = by["knorm", ratio]
    assert r["budgets"] == [int(c * (1 - ratio)) for c in r["context_tokens"]]
    assert json.loads(r["specs"][0]) == {"kind": "knorm", "compress": "context",
                                         "compression_ratio": ratio}
  assert json.loads(none["specs"][0]) == {"kind": "dense"}
  # bytes actually held fall with the ratio
  held = [by[k]["cache_bytes_per_seq"] for k in (("none", 0.0), ("knorm", 0.5),
                                                 ("knorm", 0.75))]
  assert held[0] > held[1] > held[2] > 0
  # the table: one row per policy, one column per ratio; ratio 0 is the uncompressed score
  with open(os.path.join(workdir, "report.md")) as f:
    report = f.read()
  score_table = report.split("Score (kvattn):")[1].split("Cache bytes")[0]
  rows = [line for line in score_table.splitlines() if line.startswith("| knorm")]
  assert len(rows) == 1
  cells = [c.strip() for c in rows[0].strip("|").split("|")]
  assert cells == ["knorm", f"{none['score']:.2f}", f"{by['knorm', 0.5]['score']:.2f}",
                   f"{by['knorm', 0.75]['score']:.2f}"]
  assert os.path.getsize(os.path.join(workdir, "compression.png")) > 0


def test_report_beside_kvpress(smoke_run, tmp_path):
  _, records = smoke_run
  none = next(r for r in records if r["policy"] == "none")
  model = none["model_name"]
  peer = [{"model": model, "press": "none", "kvattn_kind": "none", "ratio": 0.0,
           "task": t, "length": n, "seed": s, "score": 1.0, "wall_s": 4.0, "prompt_sha1": h}
          for t, n, s, h in zip(none["tasks"], none["lengths"], none["seeds"],
                                none["prompt_sha1"])]
  peer += [{"model": model, "press": "knorm", "kvattn_kind": "knorm", "ratio": 0.5,
            "task": "niah_single", "length": 512, "seed": s, "score": float(s), "wall_s": 2.0,
            "prompt_sha1": "other"} for s in range(2)]
  peer += [{"model": model, "press": "qfilter", "ratio": 0.0, "skipped": "offline"}]
  markdown = compression.write_report(str(tmp_path), records, peer, title="t")
  row = next(line for line in markdown.splitlines() if line.startswith("| knorm"))
  cells = [c.strip() for c in row.strip("|").split("|")]
  assert cells[1] == f"{none['score']:.2f} / 1.00" and cells[2].endswith(" / 0.50")
  assert cells[3].count("/") == 0  # no kvpress record at 0.75
  assert "Prompts: 2 of 4 kvpress examples have the same text as kvattn's" in markdown
  assert "- qfilter: offline" in markdown
  eps = [r["examples_per_s"] for r in records]
  peer_eps = (1 / 4.0 + 1 / 2.0) / 2
  assert f"= {sum(eps) / len(eps) / peer_eps:.1f}x" in markdown


def test_kvpress_runner_records_and_resume(tmp_path):
  out = str(tmp_path / "kvpress.jsonl")
  args = ("m", ["knorm", "qfilter"], [0.0, 0.5], ["niah_single"], [1024], [0, 1])
  points = kvpress_ruler.todo(*args, kvpress_ruler.read_done(out))
  # ratio 0 runs once as press "none"; an offline press is one skip point
  assert points == [("none", 0.0, "niah_single", 1024, 0), ("none", 0.0, "niah_single", 1024, 1),
                    ("knorm", 0.5, "niah_single", 1024, 0), ("knorm", 0.5, "niah_single", 1024, 1),
                    ("qfilter", 0.0, None, None, None)]
  kvpress_ruler.run("m", ["qfilter"], [0.5], ["niah_single"], [1024], [0], out,
                    progress=lambda line: None)  # a skip needs neither torch nor a model
  kvpress_ruler.append(out, {"model": "m", "press": "knorm", "ratio": 0.5,
                             "task": "niah_single", "length": 1024, "seed": 0, "score": 1.0})
  with open(out, "a") as f:
    f.write('{"model": "m", "press": "knorm", "ratio": 0.5, "task": "niah_si')  # torn
  done = kvpress_ruler.read_done(out)
  assert set(done) == {("m", "qfilter", 0.0, None, None, None),
                       ("m", "knorm", 0.5, "niah_single", 1024, 0)}
  assert "Hugging Face Hub" in done["m", "qfilter", 0.0, None, None, None]["skipped"]
  assert kvpress_ruler.todo(*args, done) == [points[0], points[1], points[3]]


def test_kvpress_runner_bad_input():
  with pytest.raises(ValueError, match="press 'duo_attention' cannot run offline"):
    kvpress_ruler.make_press("duo_attention", 0.5, 100)
  with pytest.raises(ValueError, match="press must be one of"):
    kvpress_ruler.make_press("h2o", 0.5, 100)
  assert kvpress_ruler.make_press("knorm", 0.0, 100) is None  # ratio 0: no press
  with pytest.raises(SystemExit) as e:
    kvpress_ruler.main(["--presses", "h2o", "--out", "/dev/null"])
  assert e.value.code == 2
  with pytest.raises(SystemExit):
    kvpress_ruler.main(["--ratios", "1.0", "--out", "/dev/null"])


def test_context_tokens_end_at_the_context():
  class Chat:
    chat_template = "x"

    def apply_chat_template(self, messages, add_generation_prompt):
      return f"<u>{messages[0]['content']}</u><a>"

    def encode(self, text, add_special_tokens=False):
      return list(text.encode())

  example = ruler.Example("niah_single", 128, 0, "ctx text", "q?", "A:", ("1",))
  assert ruler.context_tokens(Chat(), example, chat=True) == len("<u>ctx text")
  assert ruler.context_tokens(Chat(), example, chat=False) == len("ctx text")
  other = ruler.Example("niah_single", 128, 0, "ctx text", "q2?", "A:", ("1",))
  assert ruler.prompt_sha1(example) != ruler.prompt_sha1(other)
  assert ruler.prompt_sha1(example) == ruler.prompt_sha1(
      ruler.Example("niah_multikey", 256, 3, "ctx text", "q?", "A:", ("2",)))
