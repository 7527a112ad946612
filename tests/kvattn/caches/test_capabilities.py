"""What each registered kind declares (`kvattn.caches.capabilities`, `CacheKind`): consumers ask
these instead of keeping lists of kinds."""

import jax.numpy as jnp
import numpy as np

from kvattn.caches import capabilities
from kvattn.caches import registry
from kvattn.caches.eviction import EvictingKVCache
from tests.kvattn.caches import toy_paged_kind

B, H, K = "cache_batch", "cache_kv_heads", "cache_pages"


def test_kinds_declare_bounded_pageable_and_float_only():
  table = registry.CACHE_KIND_TABLE
  assert set(registry.bounded_kinds()) >= {"ring", "sink", "h2o", "snapkv", "tova", "recent",
                                            "random", "knorm"}
  assert not {"dense", "paged", "kivi4", "length_switch"} & set(registry.bounded_kinds())
  assert {k for k, v in table.items() if v.pageable} >= {"paged", "paged_kivi2", "paged_kivi4",
                                                         "toy_paged"}
  assert table["kivi4"].float_only and not table["paged"].float_only
  assert registry.spec_at_budget("h2o", 8) == {"kind": "h2o", "budget": 8}
  assert registry.spec_at_budget("sink", 8, num_sinks=2) == {"kind": "sink", "num_sinks": 2,
                                                             "window": 6}
  assert registry.spec_at_budget("toy_paged", 8) == {"kind": "toy_paged"}


def test_logical_axes_rows_and_pools():
  evicting = EvictingKVCache.init(2, 4, 2, 8, policy="h2o")
  assert capabilities.logical_axes(evicting) == {
      "k": (B, H, None, None), "v": (B, H, None, None), "pos": (B, H, None),
      "scores": (B, H, None), "lengths": (B,)}
  assert capabilities.bounded(evicting) and not capabilities.paged(evicting)
  pool = toy_paged_kind.ToyPagedKVCache.init(2, num_pages=4, page_size=2, pages_per_seq=2,
                                             num_kv_heads=2, head_dim=8)
  assert capabilities.logical_axes(pool) == {
      "k_pages": (H, K, None, None), "v_pages": (H, K, None, None),
      "block_tables": (B, None), "lengths": (B,)}
  assert capabilities.paged(pool) and capabilities.rollback(pool) == "lengths"


def test_a_row_reset_is_an_empty_row():
  fresh = EvictingKVCache.init(2, 4, 2, 8, jnp.int8, policy="h2o")
  used = fresh.replace(k=fresh.k + 3, pos=fresh.pos + 5, scores=fresh.scores + 1,
                       k_scale=fresh.k_scale * 2, lengths=fresh.lengths + 7)
  reset = used.reset_slot(1)
  for name in ("k", "pos", "scores", "k_scale", "lengths"):
    np.testing.assert_array_equal(getattr(reset, name)[1], getattr(fresh, name)[1], err_msg=name)
    np.testing.assert_array_equal(getattr(reset, name)[0], getattr(used, name)[0], err_msg=name)
