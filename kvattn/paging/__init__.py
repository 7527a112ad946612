"""Host-side paging of a paged KV pool: allocation, prefix sharing, offload tiers."""

from kvattn.paging.allocator import OutOfPagesError, PageAllocator, PoolStats, pages_for
from kvattn.paging.prefix import PrefixCachingAllocator
from kvattn.paging.offload import DiskTier, HostTier, PageCodec, TieredStore, make_store
from kvattn.paging.shared import SharedPrefixStore, namespace

__all__ = ["DiskTier", "HostTier", "OutOfPagesError", "PageAllocator", "PageCodec", "PoolStats",
           "PrefixCachingAllocator", "SharedPrefixStore", "TieredStore", "make_store", "namespace",
           "pages_for"]
