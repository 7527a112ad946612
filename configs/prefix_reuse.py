r"""Prefix reuse: a shared system prompt served recomputed, cached on the device, from host, from disk.

    python -m experiments.main --config=configs/prefix_reuse.py --workdir=runs/prefix_reuse
    python -m experiments.main --config=configs/prefix_reuse.py:smoke --workdir=/tmp/prefix

Points (`get_sweep()`): `prefix_cache.mode` off (every prompt prefilled in
full), device (cached pages stay in the pool), host (cached pages are moved
to host memory before each request and reloaded on the hit) and disk (moved
to memmap files, host tier of 0 bytes). Every point serves the same requests
through `kvattn.ContinuousBatcher`: a `workload.system_len`-token system
prompt followed by a different `workload.question_len`-token question each.
Records: `ttft_s`, `throughput_tokens_per_s`, `pages_saved`, offload and
reload GB/s next to a plain numpy copy's GB/s measured in the same run.

`get_config(arg)` and `get_sweep(arg)` take "" (SmolLM2-135M-Instruct through
`kvattn.from_pretrained`, several minutes on a 2-core CPU) or "smoke" (a tiny
random model, under a minute).
"""

from ml_collections import config_dict

import configs

from kvattn.models import transformer

ARGS = ("", "smoke")
MODES = ("off", "device", "host", "disk")  # The sweep: kvattn.paging.offload.PREFIX_CACHE_MODES.


def get_config(arg=None):
  """The full config; `arg="smoke"` shrinks everything to seconds."""
  smoke = configs.check_arg(arg, ARGS) == "smoke"
  config = config_dict.ConfigDict()

  # Where the weights come from: a name or file for kvattn.from_pretrained, or "" for a model
  # with random weights built from `model` (prefill cost depends on the shapes, not the values).
  config.source = config_dict.ConfigDict()
  config.source.pretrained = "" if smoke else "smollm2-135m-instruct"
  config.source.dtype = "float32"  # Compute dtype of the pretrained model.
  # The random model (used when source.pretrained is ""): kvattn.models.transformer schema.
  config.model = transformer.model_config(
      d_model=64, num_layers=2, mlp_dim=128,
      attention=dict(num_heads=4, num_kv_heads=2, head_dim=16))

  # The requests: one shared system prompt, a different question each (random token ids).
  config.workload = config_dict.ConfigDict()
  config.workload.system_len = 64 if smoke else 1024  # Shared prefix (tokens).
  config.workload.question_len = 8 if smoke else 32  # Distinct suffix per request (tokens).
  config.workload.num_requests = 2 if smoke else 4  # Requests timed per point.
  config.workload.new_tokens = 4 if smoke else 8  # Tokens generated per request.
  config.workload.seed = 0  # Token ids of the prompts.

  # The batcher and its page pool.
  config.cache = config_dict.ConfigDict()
  config.cache.page_size = 8 if smoke else 16  # Tokens per page.
  config.cache.num_slots = 2 if smoke else 4  # Sequences decoded together.
  config.cache.num_pages = 64 if smoke else 360  # Pages in each layer's pool.

  # The prefix cache and its offload tiers (bytes).
  config.prefix_cache = config_dict.ConfigDict()
  config.prefix_cache.mode = "off"  # "off", "device", "host" or "disk" (set by the sweep).
  config.prefix_cache.host_bytes = 2**31  # Host tier capacity ("host"; "disk" uses 0).
  config.prefix_cache.disk_bytes = 2**33  # Disk tier capacity ("disk").
  config.prefix_cache.directory = ""  # Disk tier files; "" = <workdir>/offload.

  # Bookkeeping.
  config.experiment = config_dict.ConfigDict()
  config.experiment.kind = "prefix_reuse"  # experiments/families/prefix_reuse.py.
  config.experiment.name = ""  # Report title; "" = default.
  config.experiment.max_points = 0  # Stop after this many new points (0 = all).
  return config


def get_sweep(arg=None):
  """One point per prefix-cache mode."""
  configs.check_arg(arg, ARGS)
  return [{"prefix_cache.mode": mode} for mode in MODES]
