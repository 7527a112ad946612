r"""The length-switch ("hybrid attention") cache on SmolLM2: speed, bytes and quality vs the
unswitched cache, beside the source's claim.

    python -m experiments.main --config=configs/length_switch.py:smoke --workdir=/tmp/ls
    python -m experiments.main --config=configs/length_switch.py --workdir=runs/length_switch

Points (`get_sweep()`): at each context of CONTEXTS, the unswitched dense cache ("never")
and a `kvattn.LengthSwitchKVCache` switching SmolLM2-135M-Instruct's 3 KV heads to 1 (their
mean) at each length of SWITCH_LENGTHS. Each point measures perplexity over `context`
tokens, decode tokens/s after them, cache bytes, and passkey accuracy at that context
(experiments/families/length_switch.py).

`get_config(arg)` and `get_sweep(arg)` take "" (the full run), "smoke" or "reduced" (both
contexts, switch at 256 only, one passkey depth, 8 decode steps, chunks of 512: for a
machine too busy for the full run).
"""

from ml_collections import config_dict

import configs

ARGS = ("", "smoke", "reduced")
CONTEXTS = (1024, 4096)  # Context lengths (tokens) of the full run.
SWITCH_LENGTHS = (256, 1024)  # Switch lengths of the full run (plus "never": the dense cache).
SMOKE_CONTEXTS = (256,)
SMOKE_SWITCH_LENGTHS = (64,)
REDUCED_SWITCH_LENGTHS = (256,)  # "reduced": both contexts, one switch length, one depth.


def get_config(arg=None):
  """The full config; `arg="smoke"` shrinks it to under a minute on a quiet machine."""
  arg = configs.check_arg(arg, ARGS)
  smoke, reduced = arg == "smoke", arg == "reduced"
  config = config_dict.ConfigDict()

  config.model = configs.named_model()

  # The point's cache: "dense" (the unswitched KVCache) or "length_switch"
  # (kvattn.LengthSwitchKVCache: K heads for the first switch_length tokens of a sequence, then
  # num_kv_heads_after mean-pooled heads).
  config.cache = config_dict.ConfigDict()
  config.cache.kind = "dense"
  config.cache.switch_length = 256  # Tokens held with all K heads (kind "length_switch").
  config.cache.num_kv_heads_after = 1  # Pooled heads after the switch; divides K (3 on SmolLM2).

  config.text = config_dict.ConfigDict()
  config.text.context = SMOKE_CONTEXTS[0] if smoke else CONTEXTS[0]  # Tokens of text scored
  # for perplexity, and the passkey prompts' length.
  # Tokens per forward pass (the switch cache is exact for any chunking).
  config.text.chunk = 128 if smoke else 512 if reduced else 256

  # Passkey retrieval (prompts of experiments/families/long_context.py).
  config.passkey = config_dict.ConfigDict()
  # Needle depths (fraction of the prompt).
  config.passkey.depths = (0.5,) if smoke or reduced else (0.1, 0.5, 0.9)
  config.passkey.new_tokens = 8  # Greedy tokens decoded after the question.
  config.passkey.seed = 0  # Draws the pass keys.

  # Decode speed after the perplexity text (batch 1).
  config.decode = config_dict.ConfigDict()
  config.decode.steps = 4 if smoke else 8 if reduced else 32  # Timed decode steps.
  # A switch point also times its switched cache, the unswitched one and an MHA cache (the
  # model's KV heads duplicated to N) in this many interleaved rounds of `steps` steps each:
  # the speed ratios of the report, measured under one load.
  config.decode.repeats = 2 if smoke else 3

  config.experiment = config_dict.ConfigDict()
  config.experiment.kind = "length_switch"
  config.experiment.name = "kvattn: length-switch cache on SmolLM2-135M-Instruct (3 -> 1 KV heads)"
  config.experiment.max_points = config_dict.placeholder(int)
  return config


def get_sweep(arg=None):
  """At each context: the dense cache, then the switch cache at each switch length."""
  arg = configs.check_arg(arg, ARGS)
  contexts = SMOKE_CONTEXTS if arg == "smoke" else CONTEXTS
  switches = {"smoke": SMOKE_SWITCH_LENGTHS, "reduced": REDUCED_SWITCH_LENGTHS}.get(
      arg, SWITCH_LENGTHS)
  return [entry for context in contexts for entry in (
      [{"text.context": context, "cache.kind": "dense"}] +
      [{"text.context": context, "cache.kind": "length_switch", "cache.switch_length": s}
       for s in switches])]
