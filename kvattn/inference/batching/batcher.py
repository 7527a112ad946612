"""The host scheduler: `ContinuousBatcher` joins, steps and retires sequences between calls
of its jitted programs (`programs`), one batch row (slot) per live sequence."""

from __future__ import annotations

import collections
import dataclasses
from typing import Any, Hashable, Iterable, Sequence

import numpy as np
from flax import nnx

from kvattn import _checks
from kvattn import _multihost
from kvattn import vocab
from kvattn.inference.batching import options as options_lib
from kvattn.inference.batching import programs
from kvattn.inference.batching import speculation
from kvattn.inference.batching.options import Finished, Live, NoFreeSlotError
from kvattn.paging.allocator import NO_PAGE, OutOfPagesError, PageAllocator, pages_for
from kvattn.paging.offload import PageCodec


class ContinuousBatcher:
  """Fixed-slot continuous batching (Orca, OSDI 2022) of a `kvattn.Transformer` over caches
  of any registered kind: a pageable kind as page pools (PagedAttention, SOSP 2023; prefix
  cache and offload), any other as fixed rows per slot.
  """

  def __init__(self, model: nnx.Module, *, num_slots: int, num_pages: int, page_size: int,
               max_len: int, max_prompt_len: int, temperature: float = 0.0,
               top_k: int | None = None, top_p: float | None = None,
               eos_id: int | None = None, pad_id: int = vocab.PAD_ID, dtype: Any = None,
               seed: int | None = None, rng: Any = None, prefix_cache: bool = False,
               offload: Any = None, mesh: Any = None, speculative: Any = None,
               local_layers: str = "full", max_ring_snapshots: int | None = None,
               cache: Any = None):
    """Builds the caches, the allocators and the jitted programs.

    Args:
      model: a `kvattn.Transformer` whose layers are MHA/GQA/MQA.
      num_slots: batch rows B decoded together.
      num_pages: pages P in each layer's pool (a kind with fixed rows uses none).
      page_size: tokens per page.
      max_len: per-sequence capacity in tokens (prompt + generated - 1).
      max_prompt_len: static prefill length; prompts are right-padded to it.
      temperature, top_k, top_p: sampling (`kvattn.inference.generation.Sampling`).
      eos_id: token that ends a sequence, or None.
      pad_id: token reported for inactive slots.
      dtype: cache dtype (default the model's compute dtype).
      seed: shuffles the allocator's free list (None: ascending pages).
      rng: jax key or int seed for sampling (None: 0).
      prefix_cache: share cached prompt prefixes (`kvattn.paging.prefix`); pageable kinds.
      offload: a `kvattn.paging.offload.TieredStore` for evicted cached pages; needs `prefix_cache`.
      mesh: a `kvattn.sharding.make_mesh` mesh or None: parameters by the sharding rules, every
        cache by its logical axes (`kvattn.caches.sharded.BATCHER_RULES`).
      speculative: a `PromptLookup` or `DraftModel` (greedy only).
      local_layers: "full" or "ring" (`kvattn.caches.registry.build_caches`).
      max_ring_snapshots: with `prefix_cache`, the most boundary snapshots kept (LRU); default `4 *
        num_slots`.
      cache: the kind: None ("paged"), a registered kind's name or a registry spec.

    Raises:
      ValueError/TypeError: bad sizes or options (naming the option), an MLA layer, a mesh axis that
        does not divide `num_slots` / `num_pages` or the heads, an option the kind refuses
        (`PoolPlan.refuses`; `prefix_cache` / `offload` with a kind of fixed rows).
    """
    model = options_lib.configure(
        self, model, num_slots=num_slots, num_pages=num_pages, page_size=page_size,
        max_len=max_len, max_prompt_len=max_prompt_len, temperature=temperature, top_k=top_k,
        top_p=top_p, eos_id=eos_id, pad_id=pad_id, dtype=dtype, seed=seed, rng=rng,
        prefix_cache=prefix_cache, offload=offload, mesh=mesh, speculative=speculative,
        local_layers=local_layers, max_ring_snapshots=max_ring_snapshots, cache=cache)
    self._graphdef, self._state = nnx.split(model)
    self._slots: list[Live | None] = [None] * self.num_slots
    self._last = np.full((self.num_slots,), self.pad_id, np.int32)
    self.steps = 0
    self.traces: collections.Counter = collections.Counter()
    programs.build(self)
    self._offload, self._codec = offload, None
    self._prefetches: dict[Hashable, Any] = {}  # request id -> PrefetchedPages
    if offload is not None:
      codec = self._codec = PageCodec(self.caches)
      self.allocator.bind_device(lambda pages: codec.read(self.caches, pages),
                                 self._offload_writer(codec), state_codec=self._snapshots)

  def _offload_writer(self, codec):
    def write(pages, payloads):
      self.caches = codec.write(self.caches, pages, payloads)
    return write

  # Queries.
  @property
  def free_slots(self) -> list[int]:
    return [i for i, s in enumerate(self._slots) if s is None]

  @property
  def active(self) -> dict[Hashable, int]:
    """Live request ids -> slot."""
    return {s.request_id: i for i, s in enumerate(self._slots) if s is not None}

  @property
  def allocator(self) -> PageAllocator:
    """The page allocator of the whole pool (one data shard; else see `allocators`)."""
    if len(self.allocators) > 1:
      raise AttributeError(
          f"the pool is split over mesh axis 'data' into {len(self.allocators)} shards: use "
          f"allocators[j] (its page i is page j * {self._pages_per_shard} + i of the pool)")
    return self.allocators[0]

  def can_add(self, prompt_len: int) -> bool:
    """True if a prompt of `prompt_len` tokens would be admitted now."""
    return any(self.allocators[self._shard(s)].can_allocate(self._pool_tokens(int(prompt_len)))
               for s in self.free_slots)

  def stats(self) -> dict[str, Any]:
    """Slot occupancy and the allocators' `PoolStats` (summed over data shards) as a dict;
    with boundary snapshots their count and device bytes."""
    pools = [dataclasses.asdict(a.stats()) for a in self.allocators]
    total = {k: v if k == "page_size" else sum(p[k] for p in pools)
             for k, v in pools[0].items() if k != "waste_fraction"}
    reserved = total["reserved_slots"]
    total["waste_fraction"] = total["internal_waste_slots"] / reserved if reserved else 0.0
    out = {"steps": self.steps, "active_slots": self.num_slots - len(self.free_slots),
           "prefill_tokens": self.prefill_tokens, **total}
    if self._snapshots is not None:  # device bytes besides the pools and the rings
      out["ring_snapshots"] = sum(a.num_states for a in self.allocators)
      out["ring_snapshot_bytes"] = sum(a.state_bytes for a in self.allocators)
    return out

  # Scheduling.
  def prefetch(self, request_id: Hashable, prompt: Sequence[int]) -> int:
    """Starts moving the offloaded pages of `prompt`'s cached prefix to the device for a
    request that will join later (`add(request_id, prompt, ...)`): the host copy and the
    transfer run on a worker thread, so they overlap the decode steps taken meanwhile, and
    the join then only updates the pools. Without a store that prefetches (`TieredStore`;
    a `SharedPrefixStore` reads its files at the join), or when no page of the prefix is
    offloaded, nothing is staged. A second prefetch for the same id replaces the
    first. The pages stay the store's: `cancel_prefetch` (or a join of another prompt) puts
    back whatever the join did not use.

    Args:
      request_id: the id `add` will be called with (not live).
      prompt: its token ids (1-D ints).

    Returns:
      Pages being staged.

    Raises:
      ValueError: `request_id` is live already.
      TypeError: `prompt` is not a 1-D sequence of ints.
    """
    prompt = np.asarray(prompt)
    if prompt.ndim != 1 or not (np.issubdtype(prompt.dtype, np.integer) or prompt.size == 0):
      raise TypeError(f"prompt must be a 1-D sequence of int token ids; got "
                      f"{prompt.dtype}{list(prompt.shape)}")
    if request_id in self.active:
      raise ValueError(f"request_id must not be live already; got {request_id!r}")
    self.cancel_prefetch(request_id)
    if not self._can_prefetch or prompt.size < 2:
      return 0
    allocator = self.allocator
    # The blocks `allocate_prompt` will match (prefix.py's own walk; never all the prompt).
    blocks = allocator._trim(allocator._walk(  # pylint: disable=protected-access
        prompt.astype(np.int64), (prompt.size - 1) // self.page_size))
    blocks = [b for b in blocks if b.tier != "device"]
    if not blocks:
      return 0
    handle = self._offload.prefetch(blocks, self._codec)
    self._prefetches[request_id] = handle
    return handle.num_rows

  @property
  def _can_prefetch(self) -> bool:
    """Whether the offload store stages pages ahead (`TieredStore`; a `SharedPrefixStore`
    reads its files at the join)."""
    return callable(getattr(self._offload, "prefetch", None))

  def cancel_prefetch(self, request_id: Hashable) -> bool:
    """Drops the prefetch of `request_id` (if any): its pages go back to the offload store,
    its staging block to the codec. Returns whether there was one."""
    handle = self._prefetches.pop(request_id, None)
    if handle is None:
      return False
    self._offload.release(handle)
    return True

  def add(self, request_id: Hashable, prompt: Sequence[int], max_new_tokens: int) -> int | Finished:
    """Joins a sequence: allocates its prompt pages and prefills it into a free slot; offloaded
    prefix pages come from its `prefetch` if one was started.

    Args:
      request_id: any hashable id not currently live.
      prompt: token ids, `1 <= len <= max_prompt_len`, each in `[0, V)`.
      max_new_tokens: tokens to generate (>= 1); `len(prompt) + max_new_tokens
        - 1` must fit `max_len`.

    Returns:
      The slot it occupies; or, when it finished at once (first token EOS, or
      `max_new_tokens == 1`), its `Finished` record (the slot is free again).

    Raises:
      ValueError/TypeError: a bad prompt, length or id (nothing changes).
      NoFreeSlotError: every slot is busy (nothing changes).
      OutOfPagesError: too few free pages for the prompt (nothing changes; a prefetch is
        kept for the next try).
    """
    handle = self._prefetches.pop(request_id, None)
    if handle is None:
      return self._add(request_id, prompt, max_new_tokens)
    try:
      result = self._add(request_id, prompt, max_new_tokens)
    except (NoFreeSlotError, OutOfPagesError):
      self._prefetches[request_id] = handle  # nothing changed: the next try uses it
      raise
    except BaseException:
      self._offload.release(handle)
      raise
    self._offload.release(handle)  # what the join did not take goes back to the store
    return result

  def _add(self, request_id: Hashable, prompt: Sequence[int], max_new_tokens: int
           ) -> int | Finished:
    """`add` without the prefetch bookkeeping."""
    prompt = np.asarray(prompt)
    if prompt.ndim == 1 and prompt.shape[0] == 0:  # np.asarray([]) is float64: check first
      raise ValueError(f"prompt of {request_id!r} must hold at least one token (an empty prompt "
                       f"cannot be continued; start it with BOS); got []")
    if prompt.ndim != 1 or not np.issubdtype(prompt.dtype, np.integer):
      raise TypeError(f"prompt must be a 1-D sequence of int token ids; got "
                      f"{prompt.dtype}{list(prompt.shape)}")
    n = int(prompt.shape[0])
    if not 1 <= n <= self.max_prompt_len:
      raise ValueError(f"prompt length must lie in [1, max_prompt_len] = [1, "
                       f"{self.max_prompt_len}]; got {n}")
    if prompt.min() < 0 or prompt.max() >= self.vocab_size:
      raise ValueError(f"prompt must hold token ids in [0, {self.vocab_size}); got "
                       f"{int(prompt.min())}..{int(prompt.max())}")
    max_new_tokens = _checks.positive_int("max_new_tokens", max_new_tokens)
    if n + max_new_tokens - 1 > self.max_len:
      raise ValueError(f"max_new_tokens = {max_new_tokens} would overflow the cache: {n} + "
                       f"{max_new_tokens} - 1 > max_len = {self.max_len}")
    if request_id in self.active:
      raise ValueError(f"request_id must not be live already; got {request_id!r}")
    free = self.free_slots
    if not free:
      raise NoFreeSlotError(f"no free slot for {request_id!r}: all {self.num_slots} are busy")
    slot = self._choose_slot(free, prompt)
    shard = self._shard(slot)
    allocator = self.allocators[shard]
    if self.prefix_cache:  # both raise OutOfPagesError before any change
      start = allocator.allocate_prompt(request_id, prompt)
    else:
      start = 0
      allocator.allocate(request_id, self._pool_tokens(n))
    row = self._row(request_id, shard)
    snapshot = None
    if self._snapshots is not None:
      snapshot = allocator.state_of(request_id) if start else self._snapshots.empty
      if snapshot is None:
        raise RuntimeError(f"the prefix cache matched {start} tokens of {request_id!r} "
                           "without a ring snapshot at their end")
      # Cached pages reach further than the last snapshot (a prefix shared with an earlier
      # prompt, which diverged there): prefill up to that boundary first and snapshot the
      # rings there, so later prompts sharing it hit (module docstring).
      mark = allocator.match(prompt[:(n - 1) // self.page_size * self.page_size],
                             with_state=False)
      if mark > start:
        start, snapshot = self._prefill_to(mark, slot, row, request_id, prompt, start,
                                           snapshot)
      end = n // self.page_size * self.page_size
      if self._snapshots.exact_only and start < end < n:
        # A residual ring drops a group's full precision when it flushes, so it cannot be
        # snapshotted at the last page boundary after the fact: prefill up to it first
        # (the same page-by-page chunks, so the same state).
        start, snapshot = self._prefill_to(end, slot, row, request_id, prompt, start,
                                           snapshot)
    self.caches, first, self._rng = self._prefill(slot, row, prompt[start:], start, snapshot)
    self.prefill_tokens += n - start
    if self.prefix_cache:
      allocator.register(request_id, prompt)  # full prompt pages: prefilled, so exact
      self._keep_snapshot(slot, request_id, n)
    first = int(_multihost.host_array(first))
    self._slots[slot] = Live(request_id, [first], max_new_tokens, n, self.steps, prompt)
    self._last[slot] = first
    self._history[slot, :n] = prompt
    if self._draft_caches:
      full = np.zeros((self.max_prompt_len,), np.int32)
      full[:n] = prompt
      self._draft_caches = self._draft_join(self._draft_state, self._draft_caches,
                                            np.int32(slot), full, np.int32(n))
    self._history[slot, n] = first
    self._ends[slot] = n + 1
    reason = self._reason(self._slots[slot], first)
    return self._finish(slot, reason) if reason else slot

  def step(self) -> list[Finished]:
    """One decode iteration for every live slot; returns the sequences that left. With
    `speculative`, one verify pass: each live sequence gains 1..k + 1 tokens."""
    if self.speculative is not None:
      return speculation.speculative_step(self)
    finished = []
    for slot, live in enumerate(self._slots):
      if live is None:
        continue
      shard = self._shard(slot)
      try:  # the token fed this step lands in slot live.cache_len
        added = self.allocators[shard].grow(live.request_id, self._pool_tokens(live.cache_len + 1))
      except OutOfPagesError:
        finished.append(self._finish(slot, "out_of_pages"))
        continue
      if added:
        self.caches = self._set_row(self.caches, np.int32(slot),
                                    self._row(live.request_id, shard))
    active = np.array([s is not None for s in self._slots])
    if not active.any():
      return finished
    self.caches, nxt, self._rng = self._step(self._state, self.caches, self._last, active,
                                             self._rng)
    nxt = _multihost.host_array(nxt)
    self.steps += 1
    for slot, live in enumerate(self._slots):
      if live is None:
        continue
      token = int(nxt[slot])
      live.cache_len += 1
      live.tokens.append(token)
      self._last[slot] = token
      reason = self._reason(live, token)
      if reason:
        finished.append(self._finish(slot, reason))
    return finished

  def cancel(self, request_id: Hashable) -> Finished:
    """Retires a live sequence now, as `step` retires a finished one.

    Args:
      request_id: the id of a live sequence (`active`).

    Returns:
      Its `Finished` record with reason "cancelled" and the tokens generated
      so far (at least the prefill's first one).

    Raises:
      ValueError: `request_id` is not live (never added, finished, or
        cancelled already); nothing changes.
    """
    slot = self.active.get(request_id)
    if slot is None:
      raise ValueError(f"request_id must be a live request to cancel; got {request_id!r} "
                       f"({len(self.active)} live)")
    return self._finish(slot, "cancelled")

  def run(self, requests: Iterable[tuple[Hashable, Sequence[int], int]]
          ) -> dict[Hashable, Finished]:
    """Serves `requests` (id, prompt, max_new_tokens) first-come first-served. With an offload
    store, the offloaded prefix pages of the request waiting at the head of the queue are
    prefetched while the live ones decode (`prefetch`).

    Raises:
      OutOfPagesError: a prompt needs more pages than the whole pool has.
    """
    queue = collections.deque(requests)
    done: dict[Hashable, Finished] = {}
    while queue or self.active:
      while queue and self.can_add(len(queue[0][1])):
        rid, prompt, max_new = queue.popleft()
        result = self.add(rid, prompt, max_new)
        if isinstance(result, Finished):
          done[rid] = result
      if queue and self._can_prefetch and queue[0][0] not in self._prefetches:
        self.prefetch(queue[0][0], queue[0][1])
      if queue and not self.active:
        rid, prompt, _ = queue[0]
        self.cancel_prefetch(rid)
        raise OutOfPagesError(rid, self.allocators[0].pages_needed(self._pool_tokens(len(prompt))),
                              max(a.num_free for a in self.allocators))
      for f in self.step():
        done[f.request_id] = f
    return done

  # Helpers.
  def _shard(self, slot: int) -> int:
    """The data shard of `slot` (0 without a data-parallel mesh)."""
    return slot // self._slots_per_shard

  def _row(self, request_id: Hashable, shard: int) -> np.ndarray:
    """`i32[pages_per_seq]`: the block-table row of `request_id` in pool page ids."""
    row = self.allocators[shard].block_table_row(request_id)
    return np.where(row == NO_PAGE, NO_PAGE, row + shard * self._pages_per_shard).astype(np.int32)

  def _choose_slot(self, free: list[int], prompt: np.ndarray) -> int:
    """The slot a joining prompt takes: the first free slot whose data shard can take it (with the
    prefix cache, shards holding a longer cached prefix first); if none can, the first free slot
    (whose allocator then raises OutOfPagesError). One data shard: always `free[0]`."""
    if len(self.allocators) == 1:
      return free[0]
    firsts = {}
    for s in free:
      firsts.setdefault(self._shard(s), s)
    order = list(firsts)
    if self.prefix_cache:
      order.sort(key=lambda j: -self.allocators[j].match(prompt))
    for j in order:
      if self.allocators[j].can_allocate(self._pool_tokens(len(prompt))):
        return firsts[j]
    return free[0]

  def _bucket(self, n: int) -> int:
    """Padded prefill width: `max_prompt_len`, or with the prefix cache the
    next power of two >= n (at most `max_prompt_len`)."""
    if self._chunked_prefill:  # one width: whole pages
      return pages_for(self.max_prompt_len, self.page_size) * self.page_size
    if not self.prefix_cache:
      return self.max_prompt_len
    return min(self.max_prompt_len, 1 << max(0, int(n) - 1).bit_length())

  def _prefill(self, slot: int, row: np.ndarray, rest: np.ndarray, start: int, snapshot):
    """Runs the join program: `rest` (the prompt after its `start` cached tokens) into slot
    `slot`. Returns `(caches, first token, rng)`."""
    padded = np.zeros((self._bucket(len(rest)),), np.int32)
    padded[:len(rest)] = rest
    return self._join(self._state, self.caches, np.int32(slot), row, padded,
                      np.int32(len(rest)), self._rng, np.int32(start), snapshot)

  def _prefill_to(self, end: int, slot: int, row, request_id, prompt, start: int, snapshot):
    """Prefills `prompt[start:end]`, registers `prompt[:end]` and its boundary snapshot.
    Returns `(end, snapshot)`."""
    allocator = self.allocators[self._shard(slot)]
    self.caches, _, _ = self._prefill(slot, row, prompt[start:end], start, snapshot)
    snapshot = self._snapshots.take(self.caches, slot, end)
    allocator.register(request_id, prompt[:end])
    allocator.set_state(request_id, end, snapshot, self._snapshots.nbytes)
    self.prefill_tokens += end - start
    return end, snapshot

  def _keep_snapshot(self, slot: int, request_id: Hashable, held: int) -> None:
    """With rings and the prefix cache: snapshots the slot's rings at the last page boundary
    of its `held` tokens when the registered chain ends there without one."""
    if self._snapshots is None:
      return
    end = held // self.page_size * self.page_size
    if self._snapshots.exact_only and end != held:
      return  # only at the row's exact length (`add` split the prefill there)
    allocator = self.allocators[self._shard(slot)]
    if allocator.needs_state(request_id, end):
      allocator.set_state(request_id, end, self._snapshots.take(self.caches, slot, end),
                          self._snapshots.nbytes)

  def _reason(self, live: Live, token: int) -> str | None:
    if self.eos_id is not None and token == self.eos_id:
      return "eos"
    if len(live.tokens) >= live.max_new_tokens:
      return "length"
    return None

  def _finish(self, slot: int, reason: str) -> Finished:
    live = self._slots[slot]
    if self.prefix_cache and not self._chunked_prefill:
      # The cache holds the prompt and the generated tokens fed back. (Low-bit pools register
      # only their prompt pages, at join: a page a decode step filled holds what attention
      # over the quantized store computed, not what a prefill of the same text writes.)
      held = np.concatenate([live.prompt, np.asarray(live.tokens[:live.cache_len - len(
          live.prompt)], np.int64)])
      allocator = self.allocators[self._shard(slot)]
      allocator.register(live.request_id, held)
      self._keep_snapshot(slot, live.request_id, live.cache_len)  # before the rings are reset
      allocator.free(live.request_id)
    else:
      self.allocators[self._shard(slot)].free(live.request_id)
    self.caches = self._release(self.caches, np.int32(slot))
    self._slots[slot] = None
    self._last[slot] = self.pad_id
    self._ends[slot] = 0
    return Finished(live.request_id, np.asarray(live.tokens, np.int32), reason, slot,
                    live.joined_step, self.steps)
