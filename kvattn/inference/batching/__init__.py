"""Continuous batching (Orca, Yu et al., OSDI 2022) over caches of any registered kind.

`ContinuousBatcher` keeps `num_slots` batch rows at static shapes, so joining and leaving
never recompile; the slot index is traced, so each jitted program compiles once. A pageable
kind (`CacheKind.pool`: "paged", "paged_kivi2/4", a kind of one's own) gets one page pool per
layer under one block table (PagedAttention, Kwon et al., SOSP 2023), a host `PageAllocator`,
and optionally the prefix cache with offload (`kvattn.paging.prefix`, `.offload`); every other
kind (ring, sink, each eviction policy, the low-bit kinds, dense) gets fixed rows, one per
slot. Greedy decoding gives each sequence the tokens `kvattn.generate` gives it alone.
"""

from kvattn.inference.batching.batcher import ContinuousBatcher
from kvattn.inference.batching.options import (FINISH_REASONS, Finished, NoFreeSlotError,
                                               batcher_cache)
from kvattn.inference.batching.snapshots import (BoundarySnapshots, ResidualSnapshots,
                                                 RingSnapshots)

__all__ = ["BoundarySnapshots", "ContinuousBatcher", "FINISH_REASONS", "Finished",
           "NoFreeSlotError", "ResidualSnapshots", "RingSnapshots", "batcher_cache"]
