"""kvattn: attention variants and their KV caches in JAX, Flax NNX and Pallas.

Every subpackage and public name is reachable after `import kvattn` (docs/DESIGN.md has the
contract):

  subpackages: `ops`, `memory`, `caches`, `paging`, `models`, `checkpoints`, `inference`,
    `training`, `sharding` (imported on first use);
  modules: `GroupedQueryAttention`, `MultiHeadLatentAttention`, `Transformer`;
  caches: `KVCache`, `LatentCache`, `PagedKVCache`, `RingKVCache`, `SinkKVCache`,
    `EvictingKVCache`, `LengthSwitchKVCache`; paging: `PageAllocator`,
    `PrefixCachingAllocator`, `OutOfPagesError`;
  generation and serving: `generate`, `ContinuousBatcher`, `from_pretrained`;
  earlier top-level names: `transformer`, `data`, `train`.
"""

# ---- Subpackages, one job each ---------------------------------------------------------------
from kvattn import ops          # attention ops, RoPE, quantization, decode dispatch points
from kvattn import memory       # analytic and measured KV-cache bytes
from kvattn import caches       # the cache kinds, their registry, save / restore
from kvattn import paging       # page allocator, prefix sharing, offload tiers
from kvattn import models       # attention modules, Transformer, conversions
from kvattn import checkpoints  # from_pretrained, GGUF, tokenizer, hub
from kvattn import inference    # generate, ContinuousBatcher, resume
from kvattn import training     # corpus and training loop
# `kvattn.sharding` (device meshes) is imported on first use.

# ---- Attention modules (flax.nnx) ------------------------------------------------------------
from kvattn.models import GroupedQueryAttention, MultiHeadLatentAttention, Transformer

# ---- Caches (registered pytrees, pure updates) -----------------------------------------------
from kvattn.caches import (EvictingKVCache, KVCache, LatentCache, LengthSwitchKVCache,
                           PagedKVCache, RingKVCache, SinkKVCache)
from kvattn.paging import OutOfPagesError, PageAllocator, PrefixCachingAllocator

# ---- Generation, serving, pretrained models --------------------------------------------------
from kvattn.inference import ContinuousBatcher, generate
from kvattn.checkpoints import from_pretrained

# ---- Modules kept at their earlier names -----------------------------------------------------
from kvattn.models import transformer
from kvattn.training import data

__version__ = "0.1.0"

__all__ = [
    "ContinuousBatcher", "EvictingKVCache", "GroupedQueryAttention", "KVCache", "LatentCache",
    "LengthSwitchKVCache", "MultiHeadLatentAttention", "OutOfPagesError", "PageAllocator",
    "PagedKVCache", "PrefixCachingAllocator", "RingKVCache", "SinkKVCache", "Transformer",
    "caches", "checkpoints", "data", "from_pretrained", "generate", "inference", "memory",
    "models", "ops", "paging", "sharding", "train", "training", "transformer",
]

_LAZY = {"sharding": "kvattn.sharding", "train": "kvattn.training.trainer"}


def __getattr__(name):
  # orbax (training) and the mesh code load on first use.
  if name in _LAZY:
    import importlib  # pylint: disable=g-import-not-at-top
    return importlib.import_module(_LAZY[name])
  raise AttributeError(f"module 'kvattn' has no attribute {name!r}")
