"""The batcher's speculative step: drafts verified in one pass through a cache transaction
(`kvattn.caches.transaction`); per slot the last token and its accepted drafts are kept, token
for token what the batcher emits without speculation. Pages only rejected drafts used go back
(`PageAllocator.shrink`); with the prefix cache a row's pages from its write position on are
copied on write first (`PrefixCachingAllocator.prepare_write`)."""

from __future__ import annotations

import numpy as np

from kvattn import _multihost
from kvattn.paging.allocator import OutOfPagesError
from kvattn.paging.prefix import copy_pages


def speculative_step(self) -> list:
  """`ContinuousBatcher.step` with speculation: each live sequence gains 1..k + 1 tokens."""
  finished = []
  k = self.speculative.num_draft_tokens
  new_lengths = np.zeros((self.num_slots,), np.int32)
  for slot, live in enumerate(self._slots):
    if live is None:
      continue
    shard = self._shard(slot)
    allocator = self.allocators[shard]
    written = min(k + 1, live.max_new_tokens - len(live.tokens))  # >= 1 while live
    try:
      copies = []
      if self.prefix_cache:  # copy-on-write: never write a shared or registered page
        copies = allocator.prepare_write(live.request_id, live.cache_len)
      added = allocator.grow(live.request_id, self._pool_tokens(live.cache_len + written))
    except OutOfPagesError:
      finished.append(self._finish(slot, "out_of_pages"))
      continue
    if copies:
      self.caches = copy_pages(self.caches, copies)
    if added or copies:
      self.caches = self._set_row(self.caches, np.int32(slot),
                                  self._row(live.request_id, shard))
    new_lengths[slot] = written
  if not new_lengths.any():
    return finished
  self.caches, greedy, emit, self._draft_caches = self._spec_step(
      self._state, self.caches, self._history, self._ends, new_lengths, self._draft_state,
      self._draft_caches)
  greedy, emit = _multihost.host_array(greedy), _multihost.host_array(emit)
  self.steps += 1
  for slot, live in enumerate(self._slots):
    if live is None or not new_lengths[slot]:
      continue
    self.spec_stats["passes"] += 1
    self.spec_stats["drafted"] += k
    self.spec_stats["accepted"] += int(emit[slot]) - 1
    reason = None
    for token in greedy[slot, :emit[slot]]:  # stop at EOS or the budget, as `step` does
      token = int(token)
      live.cache_len += 1
      live.tokens.append(token)
      self._history[slot, self._ends[slot]] = token
      self._ends[slot] += 1
      reason = self._reason(live, token)
      if reason:
        break
    self._last[slot] = live.tokens[-1]
    shard = self._shard(slot)
    if reason:
      finished.append(self._finish(slot, reason))
      continue
    returned = self.allocators[shard].shrink(live.request_id, self._pool_tokens(live.cache_len))
    if returned:  # the pages only rejected drafts used went back; the row stops naming them
      self.spec_stats["pages_returned"] += len(returned)
      self.caches = self._set_row(self.caches, np.int32(slot),
                                  self._row(live.request_id, shard))
  return finished
