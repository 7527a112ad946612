"""Host-side paging of a paged KV pool: allocation, prefix sharing, offload tiers.

  `PageAllocator`, `OutOfPagesError`   allocator.py: pages per sequence, block tables.
  `PrefixCachingAllocator`             prefix.py: refcounted pages shared by prompt prefix.
  `TieredStore`, `HostTier`, `DiskTier`, `PageCodec`
                                       offload.py: evicted cached pages on host and disk.
"""

from kvattn.paging.allocator import OutOfPagesError, PageAllocator, PoolStats, pages_for
from kvattn.paging.prefix import PrefixCachingAllocator
from kvattn.paging.offload import DiskTier, HostTier, PageCodec, TieredStore, make_store

__all__ = ["DiskTier", "HostTier", "OutOfPagesError", "PageAllocator", "PageCodec", "PoolStats",
           "PrefixCachingAllocator", "TieredStore", "make_store", "pages_for"]
