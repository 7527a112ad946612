"""A test-only pageable cache kind, added by this one file: nothing in kvattn names it.

`ToyPagedKVCache` is `PagedKVCache` under another class with a static `label`; importing this
module registers it as cache kind "toy_paged" through the public API (`paged.kind`, which
declares its pool plan). It then runs through `generate`, the `ContinuousBatcher` with the
prefix cache, save / restore, mesh placement and the conformance suite
(tests/kvattn/caches/test_toy_paged_kind.py, test_every_kind.py, tests/sharding).
"""

from __future__ import annotations

from flax import struct

from kvattn.caches import paged
from kvattn.caches import registry


@struct.dataclass
class ToyPagedKVCache(paged.PagedKVCache):
  """`PagedKVCache` with a static `label` (pools `[K, P, page_size, H]`, tables `i32[B, W]`)."""

  label: str = struct.field(pytree_node=False, default="toy")


if "toy_paged" not in registry.CACHE_KIND_TABLE:  # the one registry line (reloads skip it)
  registry.register_cache_kind("toy_paged", paged.kind(ToyPagedKVCache, "ToyPagedKVCache"))
