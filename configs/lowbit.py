r"""KV caches below 8 bits on SmolLM2-135M-Instruct: KIVI 2/4-bit next to f32 / bf16 / int8.

    python -m experiments.main --config=configs/lowbit.py --workdir=runs/lowbit
    python -m experiments.main --config=configs/lowbit.py:smoke --workdir=/tmp/lowbit
    python -m experiments.main --config=configs/lowbit.py:speed --workdir=runs/lowbit-speed
    python -m experiments.main --config=configs/lowbit.py --workdir=runs/lowbit \
        --config.peers.run=True --config.peers.python=/path/to/peers-venv/bin/python

Points (`get_sweep()`): the dense cache in float32 (the reference), bfloat16 and int8, and
the KIVI kinds (`kivi4`, `kivi2`, kvattn/caches/kivi.py) at residuals 0 / 32 / 128 with keys
quantized after RoPE, and at residual 128 with keys quantized before RoPE (KVQuant), and the
rotated codebook kinds (`rotated4`, `rotated3`, kvattn/caches/rotated.py) at residuals 0 and
128 (Lloyd-Max codebook; `rotated4` also with the uniform one). Each
point measures (experiments/families/lowbit.py): cache bytes per token read from the arrays at
a capacity of `text.num_tokens + text.new_tokens` tokens, streaming perplexity over
`text.num_tokens` held-out tokens (`text.chunk` per forward pass), then from that cache a
greedy continuation of `text.new_tokens` tokens through `generate`'s compiled decode loop
(decode tokens/s at that context; agreement with the f32 cache's tokens), and passkey
retrieval at `passkey.context` tokens. With `peers.run` (the `--peers` step) HF transformers'
`QuantizedCache` (quanto, `peers.bits` at `peers.residual`) and its f32 `DynamicCache` stream
the same tokens in a subprocess: perplexity, bytes per token, greedy decode speed.

The speed point (`cache.kind = "speed"`, the sweep of "speed"): the caches of
`speed.caches` (f32 and int8 dense, KIVI-4 and rotated-4 at their registry defaults) filled
with `speed.batch` prompts of `speed.prompt` tokens and decoded in interleaved rounds in one
process (the issue's "at prompt 4000, batch 4, the 4-bit cache decodes faster than int8").

`get_config(arg)` / `get_sweep(arg)` take "" (the full run: 4k tokens), "reduced" (1k tokens,
fewer points: for a busy machine), "speed" (the speed point alone) or "smoke" (a random tiny
model, seconds; for tests; its speed section is tiny too).
"""

from ml_collections import config_dict

import configs

ARGS = ("", "reduced", "smoke", "speed")
SPEED_CACHES = ("dense:float32", "dense:int8", "kivi4", "rotated4")
DENSE_DTYPES = ("float32", "bfloat16", "int8")  # Dense-cache storage dtypes compared.
KIVI_KINDS = ("kivi4", "kivi2")
ROTATED_KINDS = ("rotated4", "rotated3")
RESIDUALS = (0, 32, 128)  # KIVI's R (tokens kept in the compute dtype), keys after RoPE.
PRE_ROPE_RESIDUAL = 128  # The residual of the keys-before-RoPE points.


def get_config(arg=None):
  """The full config; "reduced" and "smoke" shrink the texts (module doc)."""
  arg = configs.check_arg(arg, ARGS)
  smoke, reduced = arg == "smoke", arg == "reduced"
  config = config_dict.ConfigDict()
  config.model = configs.named_model("random-tiny" if smoke else "smollm2-135m-instruct")

  config.cache = config_dict.ConfigDict()
  config.cache.kind = "dense"  # "dense", "kivi4" or "kivi2" (kvattn.caches.registry).
  config.cache.dtype = "float32"  # Dense storage dtype (float, int8, fp8); KIVI: the
  # residual's dtype (a float).
  config.cache.group_size = config_dict.placeholder(int)  # KIVI: tokens per key group and
  # channels per value group (None: the kind's default, 32).
  config.cache.residual = config_dict.placeholder(int)  # KIVI: R (None: 128).
  config.cache.pre_rope = config_dict.placeholder(bool)  # KIVI: keys before RoPE (None: False).
  config.cache.codebook = config_dict.placeholder(str)  # Rotated kinds: "lloyd-max" (None) or
  # "uniform" (kvattn/caches/rotated.py; a fitted tuple goes in a spec, not this flat field).

  config.text = config_dict.ConfigDict()
  config.text.num_tokens = 96 if smoke else (960 if reduced else 4032)  # Scored tokens; with
  # new_tokens the cache holds 4096 (the "at 4k").
  config.text.chunk = 32 if smoke else 256  # Tokens per forward pass while streaming.
  config.text.new_tokens = 8 if smoke else 64  # Greedy tokens after the scored text (agreement
  # with the f32 cache; the steps after the first are timed).

  config.passkey = config_dict.ConfigDict()
  config.passkey.context = 64 if smoke else (512 if reduced else 1024)  # Prompt tokens.
  config.passkey.samples = 2  # Prompts (random keys at random depths).
  config.passkey.new_tokens = 8  # Greedy tokens searched for the key.
  config.passkey.seed = 0

  config.peers = config_dict.ConfigDict()
  config.peers.run = False  # The optional peer step: HF transformers' QuantizedCache (quanto)
  # on the same text, in a subprocess (experiments/benchmarks/peers/hf_quantized_cache.py),
  # once per workdir after the points; its rows join report.md.
  config.peers.python = "python"  # Interpreter with the [peers] extra (torch, transformers,
  # optimum-quanto).
  config.peers.threads = 2  # torch threads of the peer.
  config.peers.bits = (4, 2)  # QuantizedCache(nbits=...) points; an f32 DynamicCache runs too.
  config.peers.residual = 128  # residual_length (tokens kept in full precision).
  config.peers.q_group_size = 64  # transformers' default group along the head dim.

  config.speed = config_dict.ConfigDict()  # The speed point (cache.kind = "speed").
  config.speed.batch = 2 if smoke else 4  # Rows decoded together.
  config.speed.prompt = 40 if smoke else 4000  # Prompt tokens per row (held-out text).
  config.speed.steps = 2 if smoke else 16  # Decode steps per timed round.
  config.speed.repeats = 1 if smoke else 5  # Timed rounds (after one untimed, compiling one).
  config.speed.caches = SPEED_CACHES  # "dense:<dtype>" or a low-bit kind (registry defaults).

  config.experiment = config_dict.ConfigDict()
  config.experiment.kind = "lowbit"  # Family: experiments/families/lowbit.py.
  config.experiment.max_points = config_dict.placeholder(int)  # Measure at most this many new
  # points in one invocation (None: all; the sweep's order puts the telling ones first).
  config.experiment.name = "kvattn: KV caches below 8 bits on SmolLM2-135M-Instruct"
  return config


def get_sweep(arg=None):
  """Most telling first (a run cut short still has the comparison): dense f32, KIVI at
  residual 128, the rotated kinds without residual, 2-bit KIVI with keys before RoPE, dense
  int8, KIVI at residual 32, 4-bit keys before RoPE, dense bf16, then the rest."""
  arg = configs.check_arg(arg, ARGS)
  if arg == "speed":
    return [{"cache.kind": "speed"}]
  dense = [{"cache.kind": "dense", "cache.dtype": d} for d in DENSE_DTYPES]
  if arg == "smoke":
    return dense[:1] + [{"cache.kind": "kivi4", "cache.group_size": 8, "cache.residual": 16},
                        {"cache.kind": "kivi2", "cache.group_size": 8, "cache.residual": 0,
                         "cache.pre_rope": True},
                        {"cache.kind": "rotated3", "cache.residual": 8}]
  residuals = (32,) if arg == "reduced" else RESIDUALS
  kivi = [{"cache.kind": kind, "cache.residual": r} for r in residuals[::-1]
          for kind in KIVI_KINDS]
  pre = [{"cache.kind": kind, "cache.residual": PRE_ROPE_RESIDUAL, "cache.pre_rope": True}
         for kind in KIVI_KINDS]
  rotated = [{"cache.kind": kind, "cache.residual": r} for r in (0, 128)
             for kind in ROTATED_KINDS]
  if arg == "reduced":
    return dense[:1] + kivi + rotated[:2] + dense[1:][::-1]
  return (dense[:1] + kivi[:2] + rotated[:2] + pre[1:] + dense[2:] + kivi[2:4] + pre[:1]
          + dense[1:2] + rotated[2:] + kivi[4:]
          + [{"cache.kind": "rotated4", "cache.codebook": "uniform"}])
