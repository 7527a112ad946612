"""The main job's `cache.compress` / `cache.compression_ratio` (kvpress's protocol as a point)."""

from __future__ import annotations

import pytest

from configs import default
from experiments.families import real_model as rme
from experiments.framework import overrides as overrides_lib


def test_compress_options_make_the_spec_the_label_and_keep_old_ids(tmp_path):
  family = rme.RealModelFamily(str(tmp_path))
  config = default.get_config("smoke")
  fixed, ratio, budget = family.points(config, [
      {"cache.kind": "h2o"},
      {"cache.kind": "snapkv", "cache.compress": "context", "cache.compression_ratio": 0.5},
      {"cache.kind": "knorm", "cache.compress": "context"}])
  assert (fixed.label, ratio.label, budget.label) == (
      "Krel-h2o48-float32", "Krel-snapkv-ctxr0.5-float32", "Krel-knorm-ctx48-float32")
  # A fixed-budget point hashes the cache section without the new keys (ids of earlier runs).
  d = fixed.config
  old = {s: d[s] for s in ("cache", "heads", "text", "speed")}
  old["cache"] = {k: v for k, v in d["cache"].items() if k not in ("compress",
                                                                   "compression_ratio")}
  old["model"] = {k: v for k, v in d["model"].items() if k != "param_dtype"}
  old = {s: old[s] for s in ("model", "cache", "heads", "text", "speed")}
  assert fixed.id == f"{fixed.label}-{overrides_lib.digest(old)}"
  assert rme.cache_spec(ratio.config["cache"]) == {
      "kind": "snapkv", "compress": "context", "compression_ratio": 0.5}
  assert rme.cache_spec(budget.config["cache"]) == {
      "kind": "knorm", "budget": 48, "compress": "context", "compression_ratio": None}


@pytest.mark.parametrize("overrides,match", [
    ({"cache.kind": "dense", "cache.compress": "context"}, "eviction kinds only"),
    ({"cache.kind": "h2o", "cache.compression_ratio": 0.5},
     r"cache\.compression_ratio is an option of compress='context'"),
    ({"cache.kind": "h2o", "cache.compress": "context", "cache.compression_ratio": 1.5},
     r"cache\.compression_ratio must be a float in \[0, 1\)"),
    ({"cache.kind": "h2o", "cache.compress": "everything"}, r"cache\.compress must be one of"),
])
def test_bad_compress_options_are_named_before_any_work(tmp_path, overrides, match):
  with pytest.raises(ValueError, match=r"sweep\[0\].*" + match):
    rme.RealModelFamily(str(tmp_path)).points(default.get_config("smoke"), [overrides])
