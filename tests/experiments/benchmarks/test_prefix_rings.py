"""experiments.benchmarks.prefix_rings on the tiny local/global model."""

import pytest

from experiments.benchmarks import prefix_rings


@pytest.mark.slow  # a dozen joins over two batchers; the batcher itself: test_batching_rings_prefix
def test_third_prompt_of_a_shared_prefix_hits_with_the_same_tokens():
  out = prefix_rings.run(["--model=random-tiny-local", "--system_len=20", "--question_len=3",
                           "--new_tokens=2", "--requests=3", "--page_size=4"])
  rows = out["rows"]
  # r0's prompt ends on a page boundary past 20 (its snapshot at 20 already: 23 // 4 * 4 = 20).
  assert [r["cached_tokens"] for r in rows] == [0, 20, 20]
  assert all(r["same_tokens"] for r in rows)
  assert out["stats"]["ring_snapshot_bytes"] > 0
