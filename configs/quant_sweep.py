r"""Quantized KV caches: MHA, GQA, MQA and MLA x cache dtype {bf16, int8, fp8 e4m3, fp8 e5m2}.

    python -m experiments.main --config=configs/quant_sweep.py --workdir=runs/quant
    python -m experiments.main --config=configs/quant_sweep.py:smoke --workdir=/tmp/quant
    python -m experiments.main --config=configs/quant_sweep.py --workdir=runs/quant \
        --config.experiment.train_dir=runs/toy/train   # reuse the main job's trainings

Points: every variant of `VARIANTS` (MHA K = N, GQA K = N/4, MQA K = 1, MLA)
with every cache dtype of `CACHE_DTYPES`. Each variant is trained once (the
model, training and data settings are those of configs/toy.py, where
every inherited field is documented, so `experiment.train_dir` can point at
the main job's trained params) and every point of that variant measures, with
its cache dtype (experiments/families/quant.py):
  * cache bytes per token read from the real arrays (values + f32 scales),
    checked against `kvattn.memory` (the run stops if they differ);
  * decode tokens/s through kvattn.generate's compiled loop at S = the one
    entry of `cache.seq_lens`;
  * validation bits per byte with every attention reading the quantized cache
    (teacher forcing: prefill `quality.prefix` tokens of each validation row,
    then feed the rest one token per decode step);
  * greedy-token agreement with the bf16 cache over `quality.agreement_tokens`
    generated tokens.

`get_config(arg)` and `get_sweep(arg)` take "" (the full run) or "smoke"
(tiny sizes, seconds); the sweep is computed from the defaults of
`get_config(arg)`, not from command-line overrides.
"""

from ml_collections import config_dict

from configs import toy as default

ARGS = default.ARGS
# Storage dtypes compared; bf16 is the baseline of every "vs bf16" column.
CACHE_DTYPES = ("bfloat16", "int8", "float8_e4m3fn", "float8_e5m2")


def get_config(arg=None):
  """configs/toy.py's model, training and data, plus the `quality` section."""
  smoke = default._check_arg(arg) == "smoke"  # pylint: disable=protected-access
  config = default.get_config(arg)
  config.cache.dtype = "bfloat16"  # Cache storage dtype (set by the sweep): a float dtype, or
  # int8 / float8_e4m3fn / float8_e5m2 (quantized with one f32 scale per token per KV head).
  config.cache.seq_lens = (32,) if smoke else (512,)  # Capacity S for the decode timing (one S:
  # the quality measurements do not depend on it).
  config.decode.repeats = 2 if smoke else 3  # Timed prefills (median, min, max reported).
  config.decode.decode_repeats = 2 if smoke else 3  # Timed decode loops per timed prefill.

  # Quality of decoding through the cache (experiments/families/quant.py).
  config.quality = config_dict.ConfigDict()
  quality = config.quality
  quality.rows = 16 if smoke else 128  # Validation rows (data.seq_len + 1 tokens each) scored
  # teacher-forced through the cache; 128 = the rows the training's validation bits/byte used
  # (train.eval_batches * train.batch_size), so the no-cache figure is that one.
  quality.prefix = 8 if smoke else 16  # Tokens of each row prefilled in one call; the rest are
  # fed one per decode step. Every logit (prefill ones included) reads the quantized cache.
  quality.agreement_tokens = 32 if smoke else 256  # Greedy tokens generated per prompt and
  # compared with those generated through the bf16 cache.
  quality.agreement_prompts = 2 if smoke else 4  # Prompts (real validation text) generated from.
  quality.agreement_prompt_len = 16 if smoke else 64  # Tokens per prompt.

  config.experiment.kind = "quant"  # Family: experiments/families/quant.py.
  config.experiment.name = "kvattn: quantized KV caches"  # Report title.
  return config


def variants(arg=None):
  """The attention variants compared: MHA (K = N), GQA (K = N/4), MQA (K = 1), MLA."""
  n = get_config(arg).model.attention.num_heads
  return [
      {"model.attention.kind": "gqa", "model.attention.num_kv_heads": n},
      {"model.attention.kind": "gqa", "model.attention.num_kv_heads": max(1, n // 4)},
      {"model.attention.kind": "gqa", "model.attention.num_kv_heads": 1},
      {"model.attention.kind": "mla"},
  ]


def get_sweep(arg=None):
  """Every variant with every cache dtype (variant-major: one training serves four points)."""
  return [{**v, "cache.dtype": dtype} for v in variants(arg) for dtype in CACHE_DTYPES]
