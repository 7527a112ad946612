"""KV caches: one layer's cache is a registered pytree behind `protocol`.

Kinds (each a file; `registry` names them for configs, `generate` and the CLI):
  `KVCache`, `LatentCache`   dense.py: `k, v: [B, K, S, H]`; MLA `c_kv: [B, S, C]`.
  `PagedKVCache`             paged.py: page pools + block tables.
  `RingKVCache`, `SinkKVCache`, `EvictingKVCache`
                             long_context.py: sliding window, StreamingLLM sinks,
                             eviction by score (H2O, SnapKV, TOVA, ...).
  `LengthSwitchKVCache`      length_switch.py: K heads up to a length, pooled after.
Support: `registry` (the one table of cache kinds and the caches of a whole model),
`checkpoint` (save / restore with orbax), `protocol` (the interface).
"""

from kvattn.caches import protocol
from kvattn.caches.dense import KVCache, LatentCache
from kvattn.caches.paged import PagedKVCache
from kvattn.caches.eviction import EvictingKVCache
from kvattn.caches.window import RingKVCache, SinkKVCache
from kvattn.caches.length_switch import LengthSwitchKVCache
from kvattn.caches import registry
from kvattn.caches.registry import (CacheFactory, CacheKind, cache_factory_from_config,
                                    register_cache_kind)

__all__ = [
    "CacheFactory", "CacheKind", "EvictingKVCache", "KVCache", "LatentCache",
    "LengthSwitchKVCache", "PagedKVCache", "RingKVCache", "SinkKVCache",
    "cache_factory_from_config", "checkpoint", "protocol", "register_cache_kind", "registry",
]


def __getattr__(name):
  if name == "checkpoint":  # orbax (~0.2 s) on first use
    import importlib  # pylint: disable=g-import-not-at-top
    return importlib.import_module("kvattn.caches.checkpoint")
  raise AttributeError(f"module 'kvattn.caches' has no attribute {name!r}")
