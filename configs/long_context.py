r"""Long-context caches on a real model: streaming perplexity, passkey retrieval, cost.

    python -m experiments.main --config=configs/long_context.py:smoke \
        --workdir=/tmp/long_context
    python -m experiments.main --config=configs/long_context.py \
        --workdir=runs/long_context

Points (`get_sweep()`): the full cache, then at each budget of BUDGETS a plain
sliding window without sinks ("ring"), StreamingLLM with 4 sinks ("sink")
and every eviction policy of `kvattn.caches.eviction.POLICIES`, on
SmolLM2-135M-Instruct (`kvattn.from_pretrained`). Each point measures the
streaming perplexity of `text.num_tokens` tokens of the default corpus of
`kvattn.training.data`, fed `text.chunk` tokens at a time (1 = exact token by token),
passkey retrieval over `passkey.contexts` x `passkey.depths`, cache bytes per
sequence; one "speed" point measures decode tokens/s and the eviction
overhead per step of every kind and budget side by side
(experiments/families/long_context.py).

`get_config(arg)` and `get_sweep(arg)` take "" (the full run), "smoke", or "gemma3" /
"gemma3-16k": Gemma 3 270M (five local layers of window 512 per global one) at 8k / 16k
tokens, its full cache in both layouts (every layer at full length; the per-layer layout,
rings of 512 for the local layers) and bounded caches on its global layers only:

    python -m experiments.main --config=configs/long_context.py:gemma3 \
        --workdir=runs/long_context_gemma3
"""

from ml_collections import config_dict

import configs

ARGS = ("", "smoke", "gemma3", "gemma3-16k")
GEMMA_TOKENS = {"gemma3": 8192, "gemma3-16k": 16384}  # Text and passkey length per argument.
GEMMA_BUDGET = 1024  # Budget of the bounded caches on Gemma's global layers (2x its window).
BUDGETS = (256, 512, 1024)  # Cache budgets (tokens per sequence) of the full run.
SMOKE_BUDGETS = (64,)
NUM_SINKS = 4  # StreamingLLM's sink count.
EVICTION = ("h2o", "snapkv", "tova", "recent", "random", "knorm")
SMOKE_KINDS = ("ring", "sink", "h2o")


def get_config(arg=None):
  """The full config; `arg="smoke"` shrinks it to about a minute; "gemma3" / "gemma3-16k":
  Gemma 3 270M at 8k / 16k tokens (module doc)."""
  arg = configs.check_arg(arg, ARGS)
  smoke = arg == "smoke"
  config = config_dict.ConfigDict()

  config.model = configs.named_model()

  # The cache of the point, a kind of kvattn.caches.registry: "dense" (capacity = everything), "ring" (RingKVCache of
  # `budget` slots), "sink" (SinkKVCache: num_sinks + budget - num_sinks), or an eviction policy
  # (EvictingKVCache of `budget` slots per KV head, policy defaults of kvattn.caches.window / eviction);
  # "speed" is the decode-speed point (section `speed`).
  config.cache = config_dict.ConfigDict()
  config.cache.kind = "dense"
  config.cache.budget = 256  # Tokens per sequence (ignored by "dense").
  config.cache.num_sinks = NUM_SINKS  # Sinks of kind "sink".
  config.cache.local_layers = "full"  # "ring": the per-layer layout (layers whose sliding
  # window is shorter than the text, e.g. Gemma 3's local layers, get a ring of it; the kind
  # above applies to the other layers); "full": the kind on every layer.

  # Streaming perplexity (StreamingLLM's evaluation) over the default corpus of kvattn.training.data.
  config.text = config_dict.ConfigDict()
  config.text.num_tokens = 256 if smoke else 2048  # Tokens scored (each predicted from the
  # tokens before it through the cache); 2048 is twice the largest budget.
  config.text.chunk = 64 if smoke else 128  # Tokens fed per forward pass; 1 = exact
  # token-by-token streaming. The full run's 2048 tokens, chunk 128 and two passkey depths fit it
  # in 30 minutes on 2 cores (26.5 min measured idle; 4096 tokens, chunk 64 and three depths
  # needed an estimated 45-55).
  config.text.bins = 4 if smoke else 16  # Position bins of the perplexity-vs-position plot.

  # Passkey retrieval: filler text with "The pass key is NNNNN. Remember it." at a depth.
  config.passkey = config_dict.ConfigDict()
  config.passkey.contexts = (192,) if smoke else (1024, 2048, 4096)  # Prompt lengths (tokens).
  config.passkey.depths = (0.5,) if smoke else (0.25, 0.75)  # Needle depth (fraction).
  config.passkey.new_tokens = 8  # Greedy tokens decoded after the question.
  config.passkey.seed = 0  # Draws the pass keys.

  # Decode speed (the point with cache.kind = "speed"): each kind at each budget and the full
  # cache holding text.num_tokens tokens, decoded at batch 1 in interleaved rounds; the report
  # gives medians of the per-round ratios to the full cache and to the ring of the same budget.
  config.speed = config_dict.ConfigDict()
  config.speed.kinds = ("ring", "h2o") if smoke else ("ring", "sink") + EVICTION  # Needs
  # "ring" for the eviction-overhead ratio.
  config.speed.budgets = SMOKE_BUDGETS if smoke else BUDGETS
  config.speed.steps = 4 if smoke else 8  # Timed decode steps per cache and round.
  config.speed.repeats = 3  # Rounds (medians over them).

  config.experiment = config_dict.ConfigDict()
  config.experiment.kind = "long_context"
  config.experiment.name = "kvattn: long-context caches on SmolLM2-135M-Instruct"
  config.experiment.max_points = config_dict.placeholder(int)
  if arg in GEMMA_TOKENS:
    _gemma(config, GEMMA_TOKENS[arg])
  return config


def _gemma(config, num_tokens):
  """Gemma 3 270M at `num_tokens`: one text and one passkey prompt of that length (depth
  0.5), fed 256 tokens per forward pass (a chunk's f32 logits over the 262k vocabulary are
  256 MiB); no speed point (experiments/benchmarks/per_layer_layout.py times decoding)."""
  config.model.name = "gemma3-270m"
  config.cache.budget = GEMMA_BUDGET
  config.text.num_tokens = num_tokens
  config.text.chunk = 256
  config.text.bins = 16
  config.passkey.contexts = (num_tokens,)
  config.passkey.depths = (0.5,)
  config.experiment.name = (f"kvattn: long-context caches on Gemma 3 270M at {num_tokens} "
                            f"tokens")


def get_sweep(arg=None):
  """The full cache, the speed point, then every bounded kind at every budget; Gemma: the
  full cache in the per-layer layout and in full allocation, then StreamingLLM and H2O at
  GEMMA_BUDGET on the global layers (rings on the local ones), most informative first."""
  arg = configs.check_arg(arg, ARGS)
  if arg in GEMMA_TOKENS:
    ring = {"cache.local_layers": "ring"}
    return [{"cache.kind": "dense", **ring}, {"cache.kind": "dense"},
            {"cache.kind": "sink", **ring}, {"cache.kind": "h2o", **ring}]
  smoke = arg == "smoke"
  kinds = SMOKE_KINDS if smoke else ("ring", "sink") + EVICTION
  budgets = SMOKE_BUDGETS if smoke else BUDGETS
  return [{"cache.kind": "dense"}, {"cache.kind": "speed"}] + [
      {"cache.kind": kind, "cache.budget": budget} for budget in budgets for kind in kinds]
