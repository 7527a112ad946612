"""KV caches: one layer's cache is a registered pytree behind `protocol`."""

from kvattn.caches import protocol
from kvattn.caches import capabilities
# Each kind's file registers it; the import order is the registry's order.
from kvattn.caches.dense import KVCache, LatentCache
from kvattn.caches.paged import PagedKVCache
from kvattn.caches.window import RingKVCache, SinkKVCache
from kvattn.caches.eviction import EvictingKVCache
from kvattn.caches.length_switch import LengthSwitchKVCache
from kvattn.caches.kivi import KIVICache
from kvattn.caches.kivi_latent import KIVILatentCache
from kvattn.caches.rotated import RotatedCache
from kvattn.caches.paged_kivi import PagedKIVICache
from kvattn.caches import presses  # the presses' policies and kinds (one file each)
from kvattn.caches import pyramid  # noqa: F401  (registers kind "pyramidkv")
from kvattn.caches.adakv import AdaKVCache
from kvattn.caches.adakv_context import AdaKVContextCache  # kinds "adakv_<policy>"
from kvattn.caches.duo import DuoKVCache
from kvattn.caches.think import ThinKCache
from kvattn.caches import registry
from kvattn.caches import transaction
from kvattn.caches.registry import (CacheFactory, CacheKind, build_caches,
                                    cache_factory_from_config, register_cache_kind)

__all__ = [
    "AdaKVCache", "AdaKVContextCache", "CacheFactory", "CacheKind", "DuoKVCache", "EvictingKVCache", "KIVICache", "KIVILatentCache", "KVCache", "LatentCache",
    "LengthSwitchKVCache", "PagedKIVICache", "PagedKVCache", "RingKVCache", "RotatedCache", "SinkKVCache", "ThinKCache",
    "build_caches", "cache_factory_from_config", "capabilities", "checkpoint", "presses", "protocol",
    "register_cache_kind", "registry", "sharded", "transaction",
]


def __getattr__(name):
  if name in ("checkpoint", "sharded"):  # orbax (~0.2 s), the mesh code: on first use
    import importlib  # pylint: disable=g-import-not-at-top
    return importlib.import_module(f"kvattn.caches.{name}")
  raise AttributeError(f"module 'kvattn.caches' has no attribute {name!r}")
