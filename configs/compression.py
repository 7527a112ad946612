r"""Compression: RULER-style score against compression ratio for every eviction policy.

    python -m experiments.main --config=configs/compression.py --workdir=runs/compression
    python -m experiments.main --config=configs/compression.py:smoke --workdir=/tmp/compression
    python -m experiments.main --config=configs/compression.py:smollm2 --workdir=runs/c_smollm2
    python -m experiments.main --config=configs/compression.py --workdir=runs/compression \
        --config.peer.kvpress_jsonl=runs/kvpress_ruler_smollm2.jsonl

Points (experiments/families/compression.py): one per model of `get_sweep()` and, at run
time, per policy (every entry of `kvattn.caches.eviction.POLICY_TABLE` plus "sink" when
`compression.policies` is empty) and ratio in `compression.ratios`; ratio 0 is one
uncompressed (dense) point per model. Each point answers `workload.seeds` examples per task
and length of experiments.evals.ruler, `workload.batch` at a time, and records the mean
score, examples/s and the cache bytes actually held per sequence.

`compression.protocol` is the one switch of how a ratio becomes a cache:
  - "fixed_budget" (today): the policy's cache holds `int(context_tokens * (1 - ratio))`
    slots for the whole prompt and answer (the question and answer evict too);
  - "context": kvpress's protocol, the context compressed at prefill by `ratio`, the
    question and answer appended uncompressed (the eviction kinds' `compress="context"`
    option and `generate(context_lengths=)`, once they are on main).

Full config: SmolLM2-135M-Instruct and Gemma 3 270M on niah_single at 1024 tokens (the task
both score 1.0 on uncompressed, docs/benchmarks.md), 4 seeds, every registered policy at
ratios 0.25-0.9: 114 points of one batch each, 21 minutes on 2 cores with
`compression.replay` (docs/benchmarks.md). `get_config("smoke")`: the 2-layer random model
with the byte tokenizer, seconds.
"""

from ml_collections import config_dict

import configs

MODELS = {"smollm2": "smollm2-135m-instruct", "gemma3": "gemma3-270m"}  # The sweep.
ARGS = ("", "smoke", *MODELS)  # "smollm2" / "gemma3": the full config on that model alone.


def get_config(arg=None):
  """The full config; `arg="smoke"` shrinks everything to seconds."""
  smoke = configs.check_arg(arg, ARGS) == "smoke"
  config = config_dict.ConfigDict()

  # The model: a kvattn.from_pretrained name (set per point by the sweep) or "random-tiny".
  config.model = configs.named_model("random-tiny" if smoke else MODELS["smollm2"])

  # The examples (experiments.evals.ruler): every task x length x seed is one example.
  config.workload = config_dict.ConfigDict()
  config.workload.tasks = ("niah_single",)  # Tasks of ruler.TASKS (qualifying ones).
  config.workload.lengths = (512,) if smoke else (1024,)  # Prompt lengths (tokens).
  config.workload.seeds = 2 if smoke else 4  # Seeds 0..seeds-1 per task and length.
  config.workload.batch = 2 if smoke else 4  # Sequences per generate call.
  config.workload.max_new_tokens = 4 if smoke else 0  # Answer tokens; 0 = ruler.MAX_NEW_TOKENS.
  config.workload.warmup = smoke  # False: one run per batch, examples/s includes what
  # compiles at the point (with replay, a model's first point compiles its question and
  # answer programs, later ones a layer's write); True: the first batch twice, the second timed.

  # The compression sweep.
  config.compression = config_dict.ConfigDict()
  config.compression.policies = ("knorm",) if smoke else ()  # Cache
  # kinds compared; () = every registered eviction policy (POLICY_TABLE) plus "sink". Also
  # "pyramidkv", "decoding_<policy>", "think" (spec_of: kvpress's settings under "context");
  # "adakv" under "fixed_budget" only; "adakv_<policy>" (AdaKV over keydiff,
  # expected_attention, knorm, snapkv: kvpress's AdaKVPress) and "pyramidkv_<policy>"
  # (PyramidKV's layer schedule over any eviction policy) under "context" only.
  config.compression.ratios = (0.0, 0.5, 0.75) if smoke else (0.0, 0.25, 0.5, 0.75, 0.9)
  config.compression.protocol = "context"  # kvpress's protocol; or "fixed_budget" (docstring).
  config.compression.num_sinks = 4  # Sinks of the "sink" kind (StreamingLLM's n_sink).
  config.compression.replay = True  # The context's forward pass once per batch and model,
  # every point writing its caches from the recorded layer inputs (experiments/evals/
  # replay.py; kvpress's protocol and the dense point); False: kvattn.generate per point.
  config.compression.local_layers = "ring"  # "ring": sliding-window layers (Gemma 3) keep
  # their exact ring cache and only global layers are compressed; "full": every layer.

  # The peer: kvpress's records (experiments/benchmarks/peers/kvpress_ruler.py), drawn
  # beside ours in the report; "" = none.
  config.peer = config_dict.ConfigDict()
  config.peer.kvpress_jsonl = ""

  # Bookkeeping.
  config.experiment = config_dict.ConfigDict()
  config.experiment.kind = "compression"  # experiments/families/compression.py.
  config.experiment.name = ""  # Report title; "" = default.
  config.experiment.max_points = 0  # Stop after this many new points (0 = all).
  return config


def get_sweep(arg=None):
  """One entry per model (the smoke run: the random model alone; "smollm2" / "gemma3": that
  model alone)."""
  arg = configs.check_arg(arg, ARGS)
  if arg == "smoke":
    return [{}]
  return [{"model.name": MODELS[arg]}] if arg else [{"model.name": m} for m in MODELS.values()]
