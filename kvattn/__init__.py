"""kvattn: attention variants and their KV caches in JAX, Flax NNX and Pallas.

Public names (DESIGN.md): `KVCache`, `GroupedQueryAttention`, the `ops`
(reference attention, RoPE, decode dispatch) and `memory` modules.
"""

from kvattn import memory, ops
from kvattn.cache import KVCache, LatentCache
from kvattn.gqa import GroupedQueryAttention
from kvattn.mla import MultiHeadLatentAttention
from kvattn.paged import OutOfPagesError, PageAllocator, PagedKVCache

__version__ = "0.1.0"

__all__ = [
    "GroupedQueryAttention",
    "KVCache",
    "LatentCache",
    "MultiHeadLatentAttention",
    "OutOfPagesError",
    "PageAllocator",
    "PagedKVCache",
    "memory",
    "ops",
]
