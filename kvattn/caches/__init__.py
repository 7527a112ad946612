"""KV caches: one layer's cache is a registered pytree behind `protocol`.

Kinds (each a file; `registry` names them for configs, `generate` and the CLI):
  `KVCache`, `LatentCache`   dense.py: `k, v: [B, K, S, H]`; MLA `c_kv: [B, S, C]`.
  `PagedKVCache`             paged.py: page pools + block tables.
  `RingKVCache`, `SinkKVCache`
                             window.py: sliding window, StreamingLLM sinks + window.
  `EvictingKVCache`          eviction.py: a budget filled by a score policy (H2O, SnapKV,
                             TOVA, ...); a policy is one score function in `POLICY_TABLE`.
  `Sharded*Cache`            sharded.py: the dense, paged, latent kinds on a device mesh.
  `LengthSwitchKVCache`      length_switch.py: K heads up to a length, pooled after.
  `KIVICache`, `RotatedCache`
                             kivi.py, rotated.py: 2/4-bit KIVI and 3/4-bit rotated codebook
                             stores + a full-precision residual (_residual.py).
  `PagedKIVICache`           paged_kivi.py: the KIVI store in pages.
  `KIVILatentCache`          kivi_latent.py: MLA's latents at 2/4 bits (kivi2 / kivi4 of MLA).
Support: `registry` (the one table of cache kinds; `build_caches` and
`cache_factory_from_config` make a whole model's caches from `{"kind": ..., **options}`),
`checkpoint` (save / restore with orbax), `protocol` (the interface), `_slots` (the
protocol's bookkeeping members the kinds inherit), `transaction` (draft tokens written
tentatively and rolled back exactly, for speculative decoding).
"""

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
from kvattn.caches import registry
from kvattn.caches import transaction
from kvattn.caches.registry import (CacheFactory, CacheKind, build_caches,
                                    cache_factory_from_config, register_cache_kind)

__all__ = [
    "CacheFactory", "CacheKind", "EvictingKVCache", "KIVICache", "KIVILatentCache", "KVCache", "LatentCache",
    "LengthSwitchKVCache", "PagedKIVICache", "PagedKVCache", "RingKVCache", "RotatedCache", "SinkKVCache",
    "build_caches", "cache_factory_from_config", "capabilities", "checkpoint", "protocol",
    "register_cache_kind", "registry", "sharded", "transaction",
]


def __getattr__(name):
  if name in ("checkpoint", "sharded"):  # orbax (~0.2 s), the mesh code: on first use
    import importlib  # pylint: disable=g-import-not-at-top
    return importlib.import_module(f"kvattn.caches.{name}")
  raise AttributeError(f"module 'kvattn.caches' has no attribute {name!r}")
