"""kvattn: attention variants and their KV caches in JAX, Flax NNX and Pallas.

Public names (DESIGN.md): `KVCache`, `GroupedQueryAttention`, the `ops`
(reference attention, RoPE, decode dispatch) and `memory` modules.
"""

from kvattn import memory, ops
from kvattn.cache import KVCache, LatentCache
from kvattn.gqa import GroupedQueryAttention
from kvattn.mla import MultiHeadLatentAttention
from kvattn.paged import OutOfPagesError, PageAllocator, PagedKVCache
from kvattn import data, transformer
from kvattn.transformer import Transformer
from kvattn.generate import generate  # the function; helpers: `from kvattn.generate import ...`
from kvattn.batching import ContinuousBatcher

__version__ = "0.1.0"

__all__ = [
    "ContinuousBatcher",
    "GroupedQueryAttention",
    "KVCache",
    "LatentCache",
    "MultiHeadLatentAttention",
    "OutOfPagesError",
    "PageAllocator",
    "PagedKVCache",
    "Transformer",
    "data",
    "generate",
    "memory",
    "ops",
    "train",
    "transformer",
]


def __getattr__(name):
  # `kvattn.train` imports orbax-checkpoint (~0.2 s); load it on first use.
  if name == "train":
    import importlib  # pylint: disable=g-import-not-at-top
    return importlib.import_module("kvattn.train")
  raise AttributeError(f"module 'kvattn' has no attribute {name!r}")
