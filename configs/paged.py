r"""Paged vs dense KV cache on a long-tailed mix of sequence lengths (PagedAttention).

    python -m experiments.main --config=configs/paged.py --workdir=runs/paged
    python -m experiments.main --config=configs/paged.py:smoke --workdir=/tmp/paged
    python -m experiments.main --config=configs/paged.py --workdir=runs/paged \
        --config.workload.num_sequences=32 --config.cache.max_len=2048

Points (`get_sweep()`): the dense cache (every sequence reserves
`cache.max_len` slots, as a contiguous per-request cache must) and the paged
cache at page sizes 8, 16, 32, 64 and 128 (each sequence holds
`ceil(length / page_size)` pages from a `kvattn.PageAllocator`). Every point
serves the same `workload.num_sequences` sequences, whose final lengths
(prompt + new tokens - 1) follow a lognormal distribution: most short, a few
near `cache.max_len`. Each point records the bytes the caches reserve and use
(read from the real arrays), the waste, how many sequences of the same mix fit
in the dense cache's memory, and decode tokens/s through `kvattn.generate`'s
compiled prefill and decode programs. Kwon et al. (SOSP 2023) report 60-80% of
KV memory wasted by contiguous caches and under 4% with paging; the report
puts the measured waste next to those figures.

`get_config(arg)` and `get_sweep(arg)` take "" (the full run, a few minutes
on a 2-core CPU) or "smoke" (seconds).
"""

from ml_collections import config_dict

import configs

from kvattn.models import transformer

ARGS = ("", "smoke")
PAGE_SIZES = (8, 16, 32, 64, 128)  # The page-size sweep.


def get_config(arg=None):
  """The full config; `arg="smoke"` shrinks everything to seconds."""
  smoke = configs.check_arg(arg, ARGS) == "smoke"
  config = config_dict.ConfigDict()

  # The model (kvattn.models.transformer schema: `ModelSpec` and `AttentionSpec` list every field, its
  # default and meaning); only the values that differ from those defaults are set here. Weights
  # are random: decode speed and cache bytes do not depend on them.
  config.model = transformer.model_config(
      d_model=32 if smoke else 128,  # Model width D.
      num_layers=1 if smoke else 2,  # Transformer blocks L.
      mlp_dim=64 if smoke else 384,  # SwiGLU hidden width F.
      attention=dict(  # Must be kind "gqa": paged caches hold K-head keys and values.
          num_heads=4 if smoke else 8,  # Query heads N.
          num_kv_heads=2,  # KV heads K.
          head_dim=8 if smoke else 32,  # Head width H (even).
      ))
  # Also in the model: `model.dtype` (compute dtype, and the cache dtype unless cache.dtype is
  # set) and `model.attention.decode_implementation` (the kvattn.ops backend of the decode steps,
  # dense and paged: "xla", "pallas" or None, the best one for the device and shapes).

  # The cache measured at each point.
  config.cache = config_dict.ConfigDict()
  cache = config.cache
  cache.kind = "dense"  # "dense" (capacity max_len per sequence) or "paged" (set by the sweep).
  cache.page_size = 16  # Tokens per page (paged only; set by the sweep).
  cache.max_len = 128 if smoke else 512  # Longest sequence allowed (tokens): the dense
  # capacity per sequence and the paged block-table width * page_size.
  cache.dtype = config_dict.placeholder(str)  # Cache dtype; None = model.dtype.
  cache.seed = 0  # Shuffles the allocator's free list (pages are handed out out of order).

  # The sequences served: final lengths (prompt + new tokens - 1) drawn from a lognormal.
  config.workload = config_dict.ConfigDict()
  workload = config.workload
  # Full run: mean length about 0.28 of max_len, as in ShareGPT-like chat traces (the
  # PagedAttention paper's: ~500 of 2048 tokens), scaled down to fit a 2-core CPU.
  workload.num_sequences = 8 if smoke else 32  # Sequences B decoded together.
  workload.median_len = 24 if smoke else 128  # Median final length (tokens).
  workload.sigma = 1.0 if smoke else 0.9  # Lognormal shape: std of log(length); larger = longer
  # tail.
  workload.min_len = 4 if smoke else 32  # Shortest final length (tokens); >= decode.new_tokens
  # (every prompt has at least one token).
  workload.budget_sequences = 64 if smoke else 256  # Length of the stream (same distribution)
  # drawn to count how many sequences the paged cache fits in the dense cache's memory.
  workload.seed = 0  # Draws the lengths and the prompt tokens (the same for every point).

  # Decode timing through kvattn.generate's compiled prefill and decode programs.
  config.decode = config_dict.ConfigDict()
  decode = config.decode
  decode.new_tokens = 4 if smoke else 32  # Tokens generated per sequence (decode steps + 1).
  decode.warmup = 1  # Untimed runs first (the first one compiles).
  decode.repeats = 1 if smoke else 7  # Timed runs; median, min and max are reported (paged
  # points also time the dense cache this many times, alternately).

  # Experiment bookkeeping.
  config.experiment = config_dict.ConfigDict()
  experiment = config.experiment
  experiment.kind = "paged"  # Family (experiments.families.paged registers it).
  experiment.name = "kvattn: paged vs dense KV cache"  # Report title.
  experiment.max_points = config_dict.placeholder(int)  # Measure at most this many new points
  # in one invocation (None: all); a rerun continues.
  return config


def get_sweep(arg=None):
  """Dense, then paged at every page size of PAGE_SIZES."""
  configs.check_arg(arg, ARGS)
  return [{"cache.kind": "dense"}] + [
      {"cache.kind": "paged", "cache.page_size": p} for p in PAGE_SIZES]
