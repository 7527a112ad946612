r"""Cross-layer KV sharing (CLA) on SmolLM2-135M and Gemma 3 270M, converted and uptrained (issue 29).

    python -m experiments.main --config=configs/cla_pretrained.py --workdir=runs/cla
    python -m experiments.main --config=configs/cla_pretrained.py:smoke --workdir=/tmp/cla_smoke

The `heads_pretrained` family (experiments/families/heads_pretrained.py) with `convert.kind =
"cla"`: `kvattn.models.convert.to_cla` pairs adjacent layers of one type (Gemma's local and
global layers apart; `kvattn.models.config.cla_sources`) and gives each pair one K/V projection,
the mean of the pair's (`convert.method = "mean"`, as the GQA paper mean-pools heads) or the first
layer's ("first"), then uptrains the attention parameters. Points per source (`get_sweep()`):
the source as released (the control: its perplexity and passkey, and what the same uptraining
does to an unconverted model) and CLA2 by "mean" and by "first". Each point: cache bytes per
token (measured from the arrays, checked against `Transformer.cache_bytes_per_token`),
held-out perplexity and passkey accuracy converted and uptrained, decode tokens/s.

`get_config(arg)`: "" (the run: 30 attention-only steps of 4 x 128 tokens, 8 evaluation rows of
128 tokens, 2 passkey prompts of 1k tokens; sized for ~15 minutes of a quiet 2-core machine, see
docs/benchmarks.md "Cross-layer KV sharing") or "smoke" (a tiny random 2-layer llama with the byte
tokenizer, seconds).
"""

import configs
from configs import heads_sweep_pretrained

ARGS = ("", "smoke")
SOURCES = (("smollm2-135m-instruct", 3), ("gemma3-270m", 1))
"""(source, its KV heads K): the control point regroups to K, i.e. copies the source."""


def get_config(arg=None):
  """heads_sweep_pretrained's reduced budget (30 steps), or its smoke config on 2 layers."""
  smoke = configs.check_arg(arg, ARGS) == "smoke"
  config = heads_sweep_pretrained.get_config("smoke" if smoke else "reduced")
  config.model.num_layers = 2  # smoke: two layers, one pair to share
  config.convert.kind = "cla"
  config.convert.cla_factor = 2  # CLA2: pairs of adjacent layers of one type.
  config.convert.method = "mean"
  if not smoke:
    config.train.steps = 30  # attention-only steps of 4 x 128 tokens
    config.train.warmup_steps = 3
    config.train.checkpoint_every = 0
  config.experiment.name = "kvattn: cross-layer KV sharing (CLA) on pretrained models"
  return config


def get_sweep(arg=None):
  """CLA2-mean on both sources, the sources as released (regrouped to their own K: a copy),
  CLA2-first on both."""
  if configs.check_arg(arg, ARGS) == "smoke":
    return [{"convert.kind": "regroup", "convert.num_kv_heads": 3},
            {"convert.kind": "cla", "convert.method": "mean"}]
  cla = [{"source.name": source, "convert.kind": "cla", "convert.method": method}
         for method in ("mean", "first") for source, _ in SOURCES]
  control = [{"source.name": source, "convert.kind": "regroup", "convert.num_kv_heads": kv_heads,
              "convert.method": "mean"} for source, kv_heads in SOURCES]
  return cla[:2] + control + cla[2:]  # most informative first: a run stopped early has them
