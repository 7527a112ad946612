"""Host-side paging of a paged KV pool: allocation, prefix sharing, offload tiers."""

from kvattn.paging.allocator import OutOfPagesError, PageAllocator, PoolStats, pages_for
from kvattn.paging.prefix import PrefixCachingAllocator
from kvattn.paging.offload import DiskTier, HostTier, PageCodec, TieredStore, make_store

__all__ = ["DiskTier", "HostTier", "OutOfPagesError", "PageAllocator", "PageCodec", "PoolStats",
           "PrefixCachingAllocator", "TieredStore", "make_store", "pages_for"]
