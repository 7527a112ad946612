r"""Every K that divides N (MHA ... GQA ... MQA), plus MLA, at two sequence lengths.

    python -m experiments.main --config=configs/heads_sweep.py --workdir=runs/heads
    python -m experiments.main --config=configs/heads_sweep.py:smoke --workdir=/tmp/heads

The model, training, cache and decode settings are those of configs/toy.py
(every field is documented there) except for the fields set below. The full
run uses N = 12 query heads, so K runs over 1, 2, 3, 4, 6 and 12; the smoke
run keeps default.py's smoke model (N = 8: K in 1, 2, 4, 8), so the two smoke
runs can share trained params (`--config.experiment.train_dir`).

`get_config(arg)` and `get_sweep(arg)` take the same argument ("" or
"smoke"); the sweep is computed from the defaults of `get_config(arg)`, not
from command-line overrides.
"""

from configs import toy as default


def get_config(arg=None):
  """configs/toy.py's config with N = 12 query heads and S in (256, 1024) (""), or its smoke
  config unchanged ("smoke"); see the module docstring."""
  config = default.get_config(arg)
  if (arg or "") != "smoke":
    config.model.attention.num_heads = 12  # Query heads N: divisors 1, 2, 3, 4, 6, 12: six K.
    # KV heads K of the config as given (MHA); every sweep entry sets its own. The runner
    # validates the base config too, so it must divide N.
    config.model.attention.num_kv_heads = 12
    config.cache.seq_lens = (256, 1024)  # Capacities S measured (tokens).
  config.experiment.name = "kvattn: every K dividing N, plus MLA"  # Report title.
  return config


def get_sweep(arg=None):
  """One entry per divisor K of N (descending: MHA first), then MLA."""
  n = get_config(arg).model.attention.num_heads
  divisors = [k for k in range(n, 0, -1) if n % k == 0]
  return [{"model.attention.kind": "gqa", "model.attention.num_kv_heads": k}
          for k in divisors] + [{"model.attention.kind": "mla"}]
