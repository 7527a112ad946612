r"""Sequence length S over powers of two, up to what fits in this machine's memory.

    python -m experiments.main --config=configs/seqlen_sweep.py --workdir=runs/seqlen
    python -m experiments.main --config=configs/seqlen_sweep.py:smoke --workdir=/tmp/seqlen

The model, training and decode settings are those of configs/toy.py (every
field is documented there) except for the fields set below. `cache.seq_lens`
is computed when the config is loaded: S = 256, 512, ... (smoke: 16, 32)
while `experiments.families.variants.point_memory_bytes` -- the cache from
`kvattn.models.transformer.cache_bytes_per_token` plus the prefill's attention
scores, activations and parameters -- stays within `cache.memory_fraction` of
the RAM available now (`experiments.framework.runner.available_memory_bytes`). The
same check runs again before any training, so an override such as
`--config.cache.seq_lens='(1048576,)'` fails naming `cache.seq_lens`.

Variants: MHA, GQA K = N/4, MQA and MLA. `get_sweep(arg)` takes the same
argument as `get_config(arg)` ("" or "smoke").
"""

from configs import toy as default
from experiments.families import variants as variants_experiment

_START = {"": 256, "smoke": 16}  # Smallest S.
_STOP = {"": None, "smoke": 32}  # Largest S tried (None: memory decides).


def get_config(arg=None):
  """configs/toy.py's config, batch 1, with `cache.seq_lens` the powers of two that fit this
  machine's RAM ("") or a short smoke list ("smoke"); see the module docstring."""
  config = default.get_config(arg)
  arg = arg or ""
  if arg != "smoke":
    config.cache.batch = 1  # Sequences B: one, so S can grow furthest.
    config.decode.repeats = 2  # Timed prefills (the long prefills dominate the time).
  # S values: powers of two from _START while a point fits in cache.memory_fraction of the
  # available RAM.
  config.cache.seq_lens = variants_experiment.fitting_seq_lens(config, _START[arg], _STOP[arg])
  config.experiment.name = "kvattn: decode speed and cache size vs sequence length"  # Title.
  return config


def get_sweep(arg=None):
  """MHA, GQA (K = N/4), MQA (K = 1) and MLA."""
  n = get_config(arg).model.attention.num_heads
  return [{"model.attention.kind": "gqa", "model.attention.num_kv_heads": k}
          for k in (n, n // 4, 1)] + [{"model.attention.kind": "mla"}]
