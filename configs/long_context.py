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

`get_config(arg)` and `get_sweep(arg)` take "" (the full run) or "smoke".
"""

from ml_collections import config_dict

ARGS = ("", "smoke")
BUDGETS = (256, 512, 1024)  # Cache budgets (tokens per sequence) of the full run.
SMOKE_BUDGETS = (64,)
NUM_SINKS = 4  # StreamingLLM's sink count.
EVICTION = ("h2o", "snapkv", "tova", "recent", "random", "knorm")
SMOKE_KINDS = ("ring", "sink", "h2o")


def _check_arg(arg):
  arg = arg or ""
  if arg not in ARGS:
    raise ValueError(f"config argument must be one of {ARGS} (':smoke' selects the small run); "
                     f"got {arg!r}")
  return arg


def get_config(arg=None):
  """The full config; `arg="smoke"` shrinks it to about a minute."""
  smoke = _check_arg(arg) == "smoke"
  config = config_dict.ConfigDict()

  config.model = config_dict.ConfigDict()
  config.model.name = "smollm2-135m-instruct"  # kvattn.from_pretrained name, or "random-tiny"
  # (a 2-layer random GQA model with the byte tokenizer, for tests).
  config.model.dtype = "float32"  # Compute and cache dtype.

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
  return config


def get_sweep(arg=None):
  """The full cache, the speed point, then every bounded kind at every budget."""
  smoke = _check_arg(arg) == "smoke"
  kinds = SMOKE_KINDS if smoke else ("ring", "sink") + EVICTION
  budgets = SMOKE_BUDGETS if smoke else BUDGETS
  return [{"cache.kind": "dense"}, {"cache.kind": "speed"}] + [
      {"cache.kind": kind, "cache.budget": budget} for budget in budgets for kind in kinds]
