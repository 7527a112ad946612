r"""The byte-level toy comparison: MHA, GQA, MQA and MLA trained from scratch, compared on cache
memory, decode speed and quality (the main job before it moved to SmolLM2: configs/default.py).

    python -m experiments.main --config=configs/toy.py --workdir=runs/toy
    python -m experiments.main --config=configs/toy.py:smoke --workdir=/tmp/smoke
    python -m experiments.main --config=configs/toy.py --workdir=runs/l4 \
        --config.model.num_layers=4 --config.cache.seq_lens='(512, 2048)'
    python -m experiments.main --config=configs/toy.py --workdir=runs/window \
        --config.model.attention.window=128

Points: every entry of `get_sweep()` (one attention variant each: MHA K = N,
GQA K = N/2 and N/4, MQA K = 1, MLA) at every S in `cache.seq_lens`. Each
variant is trained once (`train.steps` on the default corpus) and the
trained params serve all its sequence lengths. Sized to finish in well under
10 minutes on a 2-core CPU (see README for the measured time).

`get_config(arg)` and `get_sweep(arg)` take the same argument: "" (the full
run) or "smoke" (tiny sizes for tests and a quick look). The sweep is
computed from the defaults of `get_config(arg)`, not from command-line
overrides: `--config.model.attention.num_heads=16` keeps K in {8, 4, 2, 1},
so there is no MHA point (the report says "n/a" in the "vs MHA" columns), and
a K that does not divide N fails validation naming
`model.attention.num_kv_heads`. Overriding a key the sweep sets
(`model.attention.kind`, `model.attention.num_kv_heads`) fails before any
training, naming the key: the sweep would discard it. Every setting has one
dotted path, the same in this file, on the command line and in the sweep.
"""

from ml_collections import config_dict

import configs

from kvattn import sharding
from kvattn.models import transformer

ARGS = ("", "smoke")


def _check_arg(arg):
  return configs.check_arg(arg, ARGS)


def get_config(arg=None):
  """The full config; `arg="smoke"` shrinks everything to seconds."""
  smoke = _check_arg(arg) == "smoke"
  config = config_dict.ConfigDict()

  # The model (kvattn.models.transformer schema: `ModelSpec` and `AttentionSpec` list every field, its
  # default and meaning); only the values that differ from those defaults are set here.
  config.model = transformer.model_config(
      d_model=32 if smoke else 128,  # Model width D.
      num_layers=1 if smoke else 2,  # Transformer blocks L.
      mlp_dim=64 if smoke else 384,  # SwiGLU hidden width F (3 D).
      attention=dict(  # Shared by every variant; the sweep sets `kind` and `num_kv_heads`.
          num_heads=8,  # Query heads N (all variants).
          num_kv_heads=8,  # GQA: KV heads K; N = MHA, 1 = MQA (set by the sweep).
          head_dim=4 if smoke else 16,  # GQA: head width H (even).
          # MLA sizes follow DeepSeek-V2's proportions (arXiv 2405.04434 §3.1.1: C = 4 H,
          # R = H / 2), so the MLA cache is (C + R) / (2 N H) = 2.25 / N of MHA's.
          kv_lora_rank=16 if smoke else 64,  # MLA: latent width C.
          qk_rope_head_dim=2 if smoke else 8,  # MLA: decoupled RoPE key width R (even).
          qk_nope_head_dim=4 if smoke else 16,  # MLA: no-RoPE query/key head width.
          v_head_dim=4 if smoke else 16,  # MLA: value head width.
      ))
  # Also in the model: `model.dtype` (compute dtype, and the cache dtype unless cache.dtype is
  # set) and `model.attention.decode_implementation` (the kvattn.ops decode backend: "xla",
  # "pallas" or None, the best one for the device and shapes).

  # KV cache built and measured at each point.
  config.cache = config_dict.ConfigDict()
  cache = config.cache
  cache.dtype = config_dict.placeholder(str)  # Cache dtype; None = model.dtype.
  cache.batch = 2 if smoke else 4  # Sequences B decoded together (and cached).
  cache.seq_lens = (16, 32) if smoke else (256, 512, 1024)  # Capacities S measured (tokens).
  cache.memory_fraction = 0.5  # A point may plan to use this fraction of the available RAM;
  # a larger S fails validation before any training
  # (experiments.families.variants.point_memory_bytes).

  # Decode timing through kvattn.generate's compiled prefill + decode loop.
  config.decode = config_dict.ConfigDict()
  decode = config.decode
  decode.new_tokens = 4 if smoke else 32  # Tokens generated per sequence (decode steps + 1); the
  # prompt is S - new_tokens + 1 tokens of validation text, so the cache ends exactly full.
  decode.warmup = 1  # Untimed runs first (the first one compiles).
  decode.repeats = 2 if smoke else 3  # Timed prefills; median, min and max are reported.
  decode.decode_repeats = 2 if smoke else 3  # Timed decode loops after each timed prefill, each
  # from its own copy of the prefilled caches (decode is cheap; more samples, steadier medians).
  decode.seed = 0  # Picks the validation documents the prompts start from.

  # Device mesh (kvattn.sharding, docs/sharding.md): shape None = one device; (data, model, seq)
  # sizes shard each point's params and caches, e.g. --config.mesh.shape="(1,2,1)".
  config.mesh = sharding.mesh_config()

  # Training per variant (kvattn.training.trainer schema), shared by all sequence lengths.
  config.train = config_dict.ConfigDict()
  train = config.train
  train.steps = 3 if smoke else 150  # Optimiser steps.
  train.batch_size = 4 if smoke else 8  # Rows of data.seq_len tokens per step.
  train.learning_rate = 3e-3  # Peak learning rate.
  train.warmup_steps = 1 if smoke else 15  # Linear warmup steps (< steps).
  train.end_learning_rate_ratio = 0.1  # Cosine decays to learning_rate * this.
  train.weight_decay = 0.1  # AdamW decoupled weight decay.
  train.b1 = 0.9  # Adam first moment.
  train.b2 = 0.95  # Adam second moment.
  train.grad_clip_norm = 1.0  # Global gradient-norm clip.
  train.seed = 0  # Parameter init and data order (the same for every variant).
  train.log_every = 50  # Log train metrics every N steps.
  train.eval_every = 0  # Evaluate every N steps (0: only at the end).
  train.eval_batches = 2 if smoke else 16  # Validation batches per evaluation (0: all).
  train.checkpoint_every = 0 if smoke else 50  # Save every N steps (an interrupted training
  # resumes from there); 0 = only at the end.
  train.progress = True  # tqdm bar over training steps.

  # Text (kvattn.training.data schema): the default corpus needs no download.
  config.data = config_dict.ConfigDict()
  data = config.data
  data.path = config_dict.placeholder(str)  # None = CPython stdlib sources + pydoc topics.
  data.max_bytes = (1 if smoke else 8) * 2**20  # Bytes of text read (deterministic subset).
  data.include_tests = False  # Default corpus: also read the stdlib's test directories.
  data.validation_fraction = 0.1 if smoke else 0.05  # Documents held out (by name hash).
  data.seq_len = 32 if smoke else 128  # Tokens per training row.

  # Experiment bookkeeping.
  config.experiment = config_dict.ConfigDict()
  experiment = config.experiment
  experiment.kind = "variants"  # Family: experiments/families/variants.py.
  experiment.name = "kvattn: MHA vs GQA vs MQA vs MLA"  # Report title.
  experiment.max_points = config_dict.placeholder(int)  # Measure at most this many new points
  # in one invocation (None: all); a rerun continues.
  experiment.train_dir = config_dict.placeholder(str)  # Where trained params are cached
  # (None: WORKDIR/train); share one between runs to reuse trainings.
  return config


def get_sweep(arg=None):
  """The variants compared: MHA (K = N), GQA (K = N/2, N/4), MQA (K = 1), MLA."""
  n = get_config(arg).model.attention.num_heads
  return [
      {"model.attention.kind": "gqa", "model.attention.num_kv_heads": n},
      {"model.attention.kind": "gqa", "model.attention.num_kv_heads": n // 2},
      {"model.attention.kind": "gqa", "model.attention.num_kv_heads": n // 4},
      {"model.attention.kind": "gqa", "model.attention.num_kv_heads": 1},
      {"model.attention.kind": "mla"},
  ]
