r"""Head grouping on SmolLM2-135M: K = 9 / 3 / 1 and MLA, converted and uptrained (issue 18).

    python -m experiments.main --config=configs/heads_sweep_pretrained.py --workdir=runs/hp
    python -m experiments.main --config=configs/heads_sweep_pretrained.py:reduced \
        --workdir=runs/hp_reduced
    python -m experiments.main --config=configs/heads_sweep_pretrained.py:smoke \
        --workdir=/tmp/hp_smoke

Points (`get_sweep()`): SmolLM2-135M-Instruct (N = 9 query heads, K = 3 KV heads, H = 64,
30 layers) regrouped to K = 9 (heads duplicated: exact, the MHA point), 3 (as released),
1 by mean-pooling and 1 by keeping the first head of each group (`kvattn.models.convert
.regroup_kv_heads`), and converted to MLA (`kvattn.models.convert.to_mla`, MHA2MLA: 8 rope dims
(4 highest-frequency pairs) per KV head, R = 24, and a joint SVD of the rest) at latent ranks
C = 72, 232 and 360, i.e. 96, 256 and 384 cached numbers per token and layer: below K = 1
(128), between, and equal to K = 3 (384; C = 360 is the full rank, so that point is the
partial-RoPE model exactly). Each point: cache bytes/token, held-out perplexity and 2k-token
passkey accuracy before and after `train.steps` uptraining steps, decode tokens/s
(experiments/families/heads_pretrained.py).

`get_config(arg)`: "" (the full run: every point, 80 attention-only uptraining steps of
4 x 128 tokens = 40,960 tokens per point, peak lr 3e-4; measured at 67.5 CPU-minutes,
about 54 minutes on an idle 2-core CPU since a step uses ~1.24 cores: over the issue's 45,
which `--config.train.steps=56` would meet; docs/benchmarks.md "Head grouping"), "reduced"
(K3, K1-mean and MLA-C232 with 10 steps, 8 evaluation rows and 2 passkey prompts of 1k tokens) or "smoke" (a
tiny random llama with the byte tokenizer, seconds).

Budget (measured on SmolLM2-135M, 2 cores, CPU-seconds per point): conversion ~3, perplexity
on 32 x 128 held-out tokens ~18 (x2), 4 passkey prompts of 2k tokens in one batch ~50 (x2),
decode speed ~20, train-step compile ~30, one attention-only step of 4 x 128 tokens ~5 (the
backward pass still runs through every layer down to the first attention). Shorter rows buy
more optimiser steps for the same tokens. The GQA paper uptrains with ~5% of the pretraining
compute (SmolLM2: ~2T tokens, so ~100B) and MHA2MLA with 0.3-0.6% of the pretraining data;
40,960 tokens is ~2e-8 of SmolLM2's pretraining, six orders of magnitude below either: the
run shows how much of the loss the first few dozen steps recover, not the papers' endpoint.
The points run in order of interest (K3, K1-mean, MLA-C232, MLA-C72, K1-first, MLA-C360,
K9-dup), so a run stopped early has the informative ones.
"""

from ml_collections import config_dict

import configs

from kvattn.training import trainer as train

from kvattn.models import transformer

ARGS = ("", "reduced", "smoke")


def get_config(arg=None):
  """The full config; "reduced" shrinks the budget, "smoke" uses a tiny random model."""
  arg = configs.check_arg(arg, ARGS)
  smoke, reduced = arg == "smoke", arg == "reduced"
  config = config_dict.ConfigDict()

  config.source = config_dict.ConfigDict()
  # A kvattn.from_pretrained name or path, or "random" (a random model of `model`, byte
  # tokenizer: the smoke run needs no checkpoint).
  config.source.name = "random" if smoke else "smollm2-135m-instruct"

  # Only read when source.name == "random" (kvattn.models.transformer schema): a tiny llama, N = 6,
  # K = 3 like SmolLM2's 9 / 3 grouping.
  config.model = transformer.model_config(
      d_model=48, num_layers=1, mlp_dim=96,
      attention=dict(num_heads=6, num_kv_heads=3, head_dim=8, rope_theta=100000.0))

  config.convert = config_dict.ConfigDict()
  conv = config.convert
  # "regroup" (kvattn.models.convert.regroup_kv_heads), "mla" (to_mla) or "cla" (to_cla).
  conv.kind = "regroup"
  conv.num_kv_heads = 3  # regroup: target K (a multiple or a divisor of the source's K).
  # regroup, cla: "mean" / "first"; mla: "joint" / "split" (SVD_joint/_split).
  conv.method = "mean"
  conv.kv_lora_rank = 232  # mla: latent width C (<= K (2H - R / K)).
  conv.qk_rope_head_dim = 6 if smoke else 24  # mla: cached rope dims R = K * (rope dims per
  # KV head).
  conv.rope_selection = "high"  # mla: RoPE pairs kept, "high" (S_high) or "uniform".
  conv.cla_factor = 2  # cla: layers (of one type) per group sharing one K/V cache.

  config.data = config_dict.ConfigDict()
  data = config.data
  data.seq_len = 64 if smoke else 128  # Tokens per row (training and evaluation).
  data.max_bytes = 2**18 if smoke else 2**21  # Default-corpus bytes read (then tokenized).
  data.validation_fraction = 0.05  # Held-out documents (by name hash).
  data.eval_rows = 4 if smoke else (8 if reduced else 32)  # Validation rows for perplexity.

  # Uptraining (kvattn.training.trainer schema): `train.steps` steps from the converted weights.
  config.train = train.train_config(
      steps=2 if smoke else (10 if reduced else 80), batch_size=2 if smoke else 4,
      learning_rate=3e-4, warmup_steps=1 if smoke else 8, end_learning_rate_ratio=0.1,
      weight_decay=0.0, log_every=10, eval_every=0, eval_batches=1,
      checkpoint_every=0 if smoke else 40, progress=False)
  # eval_batches = 1: uptrain's own final evaluation is not used (the experiment evaluates
  # `data.eval_rows` rows itself), so it is kept to one batch.
  config.uptrain = config_dict.ConfigDict()
  config.uptrain.attention_only = True  # Train only the converted attention layers.

  config.passkey = config_dict.ConfigDict()
  config.passkey.context_len = 128 if smoke else (1024 if reduced else 2048)  # Prompt tokens.
  config.passkey.samples = 1 if smoke else (2 if reduced else 4)  # Prompts (random depths).
  config.passkey.seed = 0  # Keys and depths.

  config.decode = config_dict.ConfigDict()
  config.decode.batch = 1  # Sequences decoded together.
  config.decode.prompt_len = 16 if smoke else 64  # Prompt tokens before the timed decode.
  config.decode.new_tokens = 8 if smoke else 32  # Timed decode steps.
  config.decode.repeats = 1 if smoke else 3  # Timed runs (median reported).

  config.experiment = config_dict.ConfigDict()
  config.experiment.kind = "heads_pretrained"  # experiments/families/heads_pretrained.py.
  config.experiment.name = "kvattn: head grouping on a pretrained model"  # Report title.
  config.experiment.max_points = config_dict.placeholder(int)  # None: all points.
  return config


def get_sweep(arg=None):
  """K = 9 (dup), 3, 1 (mean, first) and MLA at three ranks (module doc)."""
  arg = configs.check_arg(arg, ARGS)
  if arg == "smoke":  # source K = 3, H = 8: full MLA rank 3 * (16 - 2) = 42
    return [{"convert.num_kv_heads": 6}, {"convert.num_kv_heads": 1},
            {"convert.kind": "mla", "convert.method": "joint", "convert.kv_lora_rank": 10}]
  k3, k1_mean, k1_first, k9 = ({"convert.num_kv_heads": k, "convert.method": m}
                               for k, m in ((3, "mean"), (1, "mean"), (1, "first"), (9, "mean")))
  c72, c232, c360 = ({"convert.kind": "mla", "convert.method": "joint", "convert.kv_lora_rank": c}
                     for c in (72, 232, 360))
  if arg == "reduced":
    return [k3, k1_mean, c232]
  return [k3, k1_mean, c232, c72, k1_first, c360, k9]  # most informative first (module doc)
