r"""The main job: KV-cache choices compared on SmolLM2-135M-Instruct.

    python -m experiments.main --config=configs/default.py --workdir=runs/default
    python -m experiments.main --config=configs/default.py:smoke --workdir=/tmp/smoke
    python -m experiments.main --config=configs/default.py --workdir=runs/b256 \
        --config.cache.budget=256

Points (`get_sweep()`): cache storage dtype (float32, bfloat16, int8,
float8_e4m3fn) x cache policy (the full dense cache, H2O eviction at
`cache.budget` slots) x head grouping (the 3 KV heads as released, and 1 KV
head by mean-pooling, `kvattn.models.convert.regroup_kv_heads`, with no
uptraining), on the pretrained model `model.name` (`kvattn.from_pretrained`;
the wheel is fetched once per machine and cached). Each point measures cache
bytes per token, decode tokens/s at batch 1 and at `speed.batch` x `speed.context`
(with its roofline fraction), perplexity on held-out text, and teacher-forced top-1 and greedy
agreement with the float32 full cache of the released model (experiments/families/real_model.py). About 17
minutes on a 2-core CPU, 6 of them the long-context speed point (README: measured time;
`--config.speed.batch=0` skips it).

`get_config(arg)` and `get_sweep(arg)` take "" (the full run), "smoke" (two
points on short texts, for tests and a quick look; every text holds more tokens than
`cache.budget`, so a bounded kind evicts in each measurement), "kind" or "kind-smoke"
(one point, the config as given: `cache.kind`, default h2o, at `cache.dtype` and
`heads.num_kv_heads`, scored against the float32 full cache computed in the run; the
sweep sets no key, so any kind -- one of yours loaded by `--import` -- is an override):

    python -m experiments.main --config=configs/default.py:kind-smoke --workdir=/tmp/mine \
        --import=my_policy.py --config.cache.kind=my-policy

The byte-level train-from-scratch comparison of MHA/GQA/MQA/MLA is configs/toy.py.

On several devices (docs/sharding.md; on a CPU host simulate them with
XLA_FLAGS=--xla_force_host_platform_device_count=2):

    python -m experiments.main --config=configs/default.py --workdir=runs/tp2 \
        --config.mesh.shape="(1,1,2)"

(SmolLM2-135M has 3 KV heads, so a `model` axis of 2 fits only the K = 1
points; `seq` splits every point's full cache.)
"""

import itertools

from ml_collections import config_dict

import configs
from kvattn import sharding

ARGS = ("", "smoke", "kind", "kind-smoke")
CACHE_DTYPES = ("float32", "bfloat16", "int8", "float8_e4m3fn")
KINDS = ("dense", "h2o")  # Issue 21's length-switch kind joins here once it lands.
KV_HEADS = (0, 1)  # 0 = as released (SmolLM2-135M: 3).


def _check_arg(arg):
  return configs.check_arg(arg, ARGS)


def get_config(arg=None):
  """The full config; `arg="smoke"` shrinks the texts so the run takes about a minute; "kind"
  and "kind-smoke" (the same sizes) measure `cache.kind` (h2o unless overridden) alone."""
  arg = _check_arg(arg)
  smoke = arg in ("smoke", "kind-smoke")
  config = config_dict.ConfigDict()

  config.model = configs.named_model()
  config.model.param_dtype = "float32"  # Weight storage: "float32", or "int8" (W8A8: int8
  # weights with per-channel scales, int8 activations per token, kvattn.models.int8); agreement
  # and the reference point stay against float32 weights.

  # The KV cache of the point (set by the sweep).
  config.cache = config_dict.ConfigDict()
  config.cache.dtype = "float32"  # Storage: a float dtype, or int8 / float8_e4m3fn /
  # float8_e5m2 with f32 per-token scales (kvattn.ops.quantize_kv).
  config.cache.kind = "h2o" if arg.startswith("kind") else "dense"  # A kind of
  # kvattn.caches.registry: "dense" (every token), "ring", "sink", an eviction policy of
  # kvattn.caches.eviction (h2o, snapkv, tova, recent, random, knorm), or one registered by
  # a module of `--import`.
  config.cache.budget = 48 if smoke else 128  # Slots per sequence (and KV head) of a bounded
  # policy; the scored text, the greedy prompt + continuation and the speed context are each
  # longer, so the policy evicts in every measurement.
  config.cache.num_sinks = 4  # Sinks of kind "sink".
  config.cache.compress = "fixed"  # Eviction kinds: "fixed" (`cache.budget` slots held
  # forever) or "context" (kvpress's protocol: a sequence's first write -- here the first
  # `text.chunk` tokens -- is compressed once, later tokens appended until the capacity is
  # full; kvattn.caches.eviction).
  config.cache.compression_ratio = config_dict.placeholder(float)  # compress="context": the
  # fraction in [0, 1) of the context's tokens dropped (kvpress's); None: keep `cache.budget`.

  # Head grouping: the released KV heads, or fewer by kvattn.models.convert.regroup_kv_heads.
  config.heads = config_dict.ConfigDict()
  config.heads.num_kv_heads = 0  # 0 = as released; else K' dividing (or a multiple of) K.
  config.heads.method = "mean"  # "mean" (GQA paper sec. 2.1 mean-pooling) or "first".

  # Quality on held-out text (validation documents of kvattn.training.data's default corpus).
  config.text = config_dict.ConfigDict()
  config.text.num_tokens = 64 if smoke else 512  # Tokens scored by streaming perplexity.
  config.text.chunk = 32 if smoke else 64  # Tokens per forward pass (prefill chunk).
  config.text.prompt_tokens = 48 if smoke else 192  # Prompt of the greedy continuation.
  config.text.new_tokens = 8 if smoke else 32  # Greedy tokens (agreement; the decode steps
  # after the first are timed).

  # Decode speed where the cache matters (experiments/evals/decode_speed.py): `speed.batch`
  # sequences with `speed.context` tokens of random keys and values written through the
  # point's cache, then `speed.repeats` timed calls of `speed.steps` greedy steps. The report's
  # speed column and its roofline fraction (the step's weight and cache bytes at the read
  # bandwidth measured in the run) come from here; batch 0 skips it.
  config.speed = config_dict.ConfigDict()
  config.speed.batch = 2 if smoke else 4
  config.speed.context = 96 if smoke else 4000
  config.speed.steps = 4 if smoke else 8
  config.speed.repeats = 1 if smoke else 3

  # Device mesh (kvattn.sharding, docs/sharding.md): shape None = one device; (data, model, seq)
  # sizes run each point with params and caches sharded, e.g. --config.mesh.shape="(1,2,1)".
  # The job decodes one sequence, so data must be 1; seq must divide text.chunk; the full
  # cache is sharded, a bounded policy's cache starts replicated (XLA lays out its updates).
  config.mesh = sharding.mesh_config()

  config.experiment = config_dict.ConfigDict()
  config.experiment.kind = "real_model"  # Family: experiments/families/real_model.py.
  config.experiment.name = "kvattn: KV-cache choices on SmolLM2-135M-Instruct"  # Report title.
  config.experiment.max_points = config_dict.placeholder(int)  # Measure at most this many new
  # points in one invocation (None: all); a rerun continues.
  return config


def get_sweep(arg=None):
  """Cache dtype x policy x KV heads; the smoke run: the f32 full cache and int8 H2O at K = 1;
  "kind" / "kind-smoke": one point, the config as given."""
  arg = _check_arg(arg)
  if arg.startswith("kind"):
    return [{}]
  if arg == "smoke":
    return [{"cache.dtype": "float32", "cache.kind": "dense", "heads.num_kv_heads": 0},
            {"cache.dtype": "int8", "cache.kind": "h2o", "heads.num_kv_heads": 1}]
  return [{"heads.num_kv_heads": k, "cache.kind": p, "cache.dtype": d}
          for k, p, d in itertools.product(KV_HEADS, KINDS, CACHE_DTYPES)]
