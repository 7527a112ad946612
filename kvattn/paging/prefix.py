"""Automatic prefix caching for the paged KV cache (vLLM APC / SGLang RadixAttention): full
pages keyed by their chained token prefix (`page_digest`), shared by refcount, evicted LRU,
optionally offloaded (`kvattn.paging.offload`) or shared with other workers
(`kvattn.paging.shared`: a local miss falls through to the shared store, new pages are
published when registered); boundary states in `_blocks`."""

from __future__ import annotations

import collections
from typing import Any, Hashable, Sequence

import jax.numpy as jnp
import numpy as np

from kvattn.paging._blocks import (ROOT_KEY, BoundaryStates, CachedBlock, Reader,  # noqa: F401
                                   Writer, page_digest)
from kvattn.paging.allocator import OutOfPagesError, PageAllocator, PoolStats, pages_for
from kvattn.paging.shared import SHARED_TIER


class PrefixCachingAllocator(BoundaryStates, PageAllocator):
  """A `PageAllocator` that caches full pages by their token prefix and shares them."""

  def __init__(self, num_pages: int, page_size: int, max_pages_per_seq: int | None = None, *,
               seed: int | None = None, offload: Any = None, boundary_states: bool = False,
               max_states: int | None = None):
    """Args as `PageAllocator`; `offload` is a `kvattn.paging.offload.TieredStore`, a
    `kvattn.paging.shared.SharedPrefixStore` (pages shared with other workers) or None (evicted
    blocks are forgotten). With `offload`, call `bind_device(reader, writer)` before the first
    eviction (with a shared store, before the first prompt). `boundary_states`: a match must end at a block holding a state (module docstring);
    `max_states` (an int >= 1, None: no limit) bounds how many are kept.

    Raises:
      ValueError: bad sizes; `max_states` not a positive int.
    """
    super().__init__(num_pages, page_size, max_pages_per_seq, seed=seed)
    if max_states is not None and (isinstance(max_states, bool) or not isinstance(
        max_states, (int, np.integer)) or max_states < 1):
      raise ValueError(f"max_states must be an int >= 1 or None; got {max_states!r}")
    self.boundary_states = bool(boundary_states)
    self.max_states = None if max_states is None else int(max_states)
    # Blocks holding a state on the device, least recently used first.
    self._states: collections.OrderedDict[int, CachedBlock] = collections.OrderedDict()
    self._state_codec: Any = None
    self._ref = np.zeros((self.num_pages,), np.int64)
    self._index: dict[bytes, CachedBlock] = {}
    self._page_block: dict[int, CachedBlock] = {}
    self._lru: collections.OrderedDict[int, None] = collections.OrderedDict()
    self._registered: dict[Hashable, tuple[int, CachedBlock | None]] = {}
    self.offload = offload
    self._reader: Reader | None = None
    self._writer: Writer | None = None
    if offload is not None:
      offload.on_drop = self._forget
    self.counters = collections.Counter()

  # Queries.
  @property
  def num_free(self) -> int:
    """Pages an allocation can take: free ones plus unreferenced cached ones."""
    return len(self._free) + len(self._lru)

  @property
  def num_cached(self) -> int:
    """Unreferenced cached pages on the device (reusable, evicted LRU)."""
    return len(self._lru)

  @property
  def num_used(self) -> int:
    """Pages referenced by live sequences."""
    return self.num_pages - self.num_free

  def refcount(self, page: int) -> int:
    """Live block-table entries holding `page`."""
    return int(self._ref[page])

  def cached_blocks(self) -> dict[str, int]:
    """Blocks in the index per tier ("device", and each offload tier's name)."""
    return dict(collections.Counter(b.tier for b in self._index.values()))

  def match(self, tokens: Sequence[int], *, with_state: bool = True) -> int:
    """Tokens of `tokens` served by cached blocks (any tier): a multiple of `page_size`, 0 on a
    miss."""
    blocks = self._walk(np.asarray(tokens, np.int64).reshape(-1), None)
    return len(self._trim(blocks) if with_state else blocks) * self.page_size

  # Mutations.
  def allocate_prompt(self, seq_id: Hashable, prompt: Sequence[int]) -> int:
    """Registers `seq_id` for `prompt`, reusing cached pages for its longest cached prefix of whole
    pages, but never all of it: at most `(len(prompt) - 1) // page_size` pages, so the last prompt
    token is evaluated and produces the first new token.

    Returns:
      Tokens already in the cache (prefill `prompt[returned:]`).

    Raises:
      ValueError: `seq_id` live, an empty or too long prompt.
      OutOfPagesError: too few pages for the rest (nothing changes).
    """
    if seq_id in self._pages:
      raise ValueError(f"seq_id must not be live already; got {seq_id!r}")
    prompt = np.asarray(prompt, np.int64).reshape(-1)
    if prompt.size == 0:
      raise ValueError("prompt must hold at least one token; got []")
    n = self._check_tokens(int(prompt.size))
    blocks = self._trim(self._walk(prompt, (n - 1) // self.page_size))
    on_device = [b for b in blocks if b.tier == "device"]
    needed = pages_for(n, self.page_size) - len(on_device)
    available = self.num_free - sum(1 for b in on_device if b.page in self._lru)
    if needed > available:
      raise OutOfPagesError(seq_id, needed, available)
    # Fetch offloaded blocks before taking pages (taking may push blocks down the tiers).
    payloads = []
    for j, block in enumerate(blocks):
      if block.tier == "device":
        continue
      payload = self.offload.take(block)
      if payload is None:  # dropped by its tier or corrupted: recompute from here
        self._forget(block)
        self.counters["offload_misses"] += 1
        blocks = self._trim(blocks[:j])
        break
      payloads.append((block, payload))
    keep = {id(b) for b in blocks}
    for b, p in payloads:  # fetched past the last state a miss left: back to the tiers
      if id(b) not in keep:
        self.offload.put(b, p)
    payloads = [(b, self._unpack(b, p)) for b, p in payloads if id(b) in keep]
    pages = []
    for block in blocks:
      if block.tier == "device":
        self._lru.pop(block.page, None)
        self._ref[block.page] += 1
        pages.append(block.page)
      else:
        pages.append(None)
    fresh = [self._take_one() for _ in range(pages_for(n, self.page_size) - sum(
        p is not None for p in pages))]
    loaded = []
    for j, page in enumerate(pages):
      if page is None:
        pages[j] = fresh.pop(0)
        block = blocks[j]
        if block.tier == SHARED_TIER:  # another worker's page: now in our index too
          self._index[block.key] = block
          self.counters["shared_pages"] += 1
        block.page, block.tier = pages[j], "device"
        self._page_block[pages[j]] = block
        loaded.append(pages[j])
    if loaded:
      self._writer(loaded, [p for _, p in payloads])
      self.counters["pages_reloaded"] += len(loaded)
    pages.extend(fresh)
    for p in pages[len(blocks):]:
      self._ref[p] = 1
    for p in loaded:
      self._ref[p] = 1
    self._pages[seq_id] = pages
    self._tokens[seq_id] = n
    self._registered[seq_id] = (len(blocks), blocks[-1] if blocks else None)
    self.counters["prompt_tokens"] += n
    self.counters["cached_tokens"] += len(blocks) * self.page_size
    if blocks and id(blocks[-1]) in self._states:
      self._states.move_to_end(id(blocks[-1]))
    return len(blocks) * self.page_size

  def allocate(self, seq_id: Hashable, num_tokens: int) -> tuple[int, ...]:
    """`PageAllocator.allocate` (no prefix lookup): fresh pages, refcount 1."""
    pages = super().allocate(seq_id, num_tokens)
    self._ref[list(pages)] = 1
    self._registered[seq_id] = (0, None)
    return pages

  def grow(self, seq_id: Hashable, num_tokens: int) -> tuple[int, ...]:
    """`PageAllocator.grow`; added pages get refcount 1."""
    added = super().grow(seq_id, num_tokens)
    self._ref[list(added)] = 1
    return added

  def _give_back(self, pages: list[int]) -> None:
    """`shrink`'s dropped pages each lose one reference (a registered one stays cached)."""
    for page in reversed(pages):
      self._release(page)

  def shrink(self, seq_id: Hashable, num_tokens: int) -> tuple[int, ...]:
    """`PageAllocator.shrink`; a registered chain reaching past the pages kept ends at
    the last page kept."""
    dropped = super().shrink(seq_id, num_tokens)
    done, parent = self._registered[seq_id]
    kept = len(self._pages[seq_id])
    if done > kept:
      self._registered[seq_id] = (kept, self._nth_block(parent, done - kept))
    return dropped

  def register(self, seq_id: Hashable, tokens: Sequence[int]) -> int:
    """Makes the full pages of `seq_id` shareable: `tokens` are the token ids written into its cache
    so far (at most its token count); each full page not yet registered is entered in the index
    under its chained key. A key already held by an identical block (the same prefix computed twice)
    is kept and the chain continues through it; a key held by a different block (a hash collision)
    ends registration for this sequence.

    Returns:
      Full pages of the sequence now registered or identical to a cached block.

    Raises:
      ValueError: `seq_id` not live, or more tokens than it holds.
    """
    pages = self._owned(seq_id)
    tokens = np.asarray(tokens, np.int64).reshape(-1)
    if tokens.size > self._tokens[seq_id]:
      raise ValueError(f"tokens must not exceed the {self._tokens[seq_id]} tokens of "
                       f"{seq_id!r}; got {tokens.size}")
    done, parent = self._registered[seq_id]
    if done < 0:  # a collision ended this sequence's chain
      return 0
    new = []
    for j in range(done, tokens.size // self.page_size):
      chunk = tokens[j * self.page_size:(j + 1) * self.page_size]
      key = page_digest(ROOT_KEY if parent is None else parent.key, chunk)
      block = self._index.get(key)
      if block is None:
        block = CachedBlock(key, chunk.astype(np.int32), parent, pages[j])
        self._index[key] = block
        self._page_block[pages[j]] = block
        new.append(block)
      elif block.parent is not parent or not np.array_equal(block.tokens, chunk):
        self.counters["collisions"] += 1
        self._registered[seq_id] = (-1, None)
        self._publish(new)
        return j
      elif block.tier != "device":  # our page holds the same KV: it becomes the block's home
        self.offload.discard(block)
        self._drop_state(block)  # its bytes went with the tier payload
        block.page, block.tier = pages[j], "device"
        self._page_block[pages[j]] = block
      parent = block
      self._registered[seq_id] = (j + 1, parent)
    self._publish(new)
    return self._registered[seq_id][0]

  def free(self, seq_id: Hashable, tokens: Sequence[int] | None = None) -> tuple[int, ...]:
    """Retires `seq_id`, first registering its full pages when `tokens` (the ids written into its
    cache) are given. Each page loses one reference; an unreferenced registered page stays cached
    (LRU, tail pages first), the others go back on the free list.

    Returns:
      The sequence's pages.

    Raises:
      ValueError: `seq_id` is not live.
    """
    pages = self._owned(seq_id)
    if tokens is not None:
      self.register(seq_id, tokens)
    for page in reversed(pages):
      self._release(page)
    del self._pages[seq_id], self._tokens[seq_id], self._registered[seq_id]
    return tuple(pages)

  def fork(self, src: Hashable, dst: Hashable) -> tuple[int, ...]:
    """Registers `dst` sharing every page of `src` (its partly filled last page included); each
    gains a reference. Call `prepare_write` before either writes.

    Raises:
      ValueError: `src` not live or `dst` live.
    """
    pages = self._owned(src)
    if dst in self._pages:
      raise ValueError(f"dst must not be live already; got {dst!r}")
    self._ref[pages] += 1
    self._pages[dst] = list(pages)
    self._tokens[dst] = self._tokens[src]
    self._registered[dst] = self._registered[src]
    return tuple(pages)

  def prepare_write(self, seq_id: Hashable, start: int) -> list[tuple[int, int]]:
    """Copy-on-write before `seq_id` writes tokens from position `start` on: every page of it at or
    after `start // page_size` that another sequence also references, or that is registered
    (read-only), is replaced by a private page.

    Returns:
      `(old_page, new_page)` pairs; copy their device contents
      (`copy_pages`) before writing.

    Raises:
      ValueError: unknown `seq_id`.
      OutOfPagesError: too few pages for the copies (nothing changes).
    """
    pages = self._owned(seq_id)
    shared = [j for j in range(max(0, int(start)) // self.page_size, len(pages))
              if self._ref[pages[j]] > 1 or pages[j] in self._page_block]
    if len(shared) > self.num_free:
      raise OutOfPagesError(seq_id, len(shared), self.num_free)
    copies = []
    for j in shared:
      old, new = pages[j], self._take_one()
      self._ref[new] = 1
      pages[j] = new
      self._release(old)
      copies.append((old, new))
    if shared:
      done, parent = self._registered[seq_id]
      if done > shared[0]:  # its registered chain now ends before the first copied page
        self._registered[seq_id] = (shared[0], self._nth_block(parent, done - shared[0]))
    self.counters["cow_copies"] += len(copies)
    return copies

  def offload_cached(self) -> int:
    """Moves every unreferenced cached device page to the offload store now
    (one batched read), freeing its page: what a scheduler does with cold
    prefixes before it needs the room. Without a store they are forgotten.

    Returns:
      Pages moved (or forgotten).
    """
    pages = list(self._lru)
    if not pages:
      return 0
    payloads = (self.offload.rows(self._reader(pages)) if self._keeps_evictions() else None)
    for i, page in enumerate(pages):
      del self._lru[page]
      block = self._page_block.pop(page)
      if payloads is None:
        self._forget(block)
      else:
        block.page, block.tier = None, "offloading"
        self.offload.put(block, self._payload(block, payloads[i]))
        self.counters["pages_offloaded"] += 1
      self._free.append(page)
    return len(pages)

  def check(self) -> None:
    """`PageAllocator.check`'s partition for shared pages, plus the refcounts,
    the LRU list and the index (for tests).

    Raises:
      RuntimeError: a broken invariant, named.
    """
    counts = collections.Counter(p for pages in self._pages.values() for p in pages)
    for page in range(self.num_pages):
      if counts.get(page, 0) != self._ref[page]:
        raise RuntimeError(f"page {page}: refcount {self._ref[page]} but held "
                           f"{counts.get(page, 0)} times")
    free, lru, used = set(self._free), set(self._lru), set(counts)
    if len(free) != len(self._free):
      raise RuntimeError("a page is on the free list twice")
    if free & lru or free & used or lru & used:
      raise RuntimeError("a page is in two of free / cached / referenced")
    if free | lru | used != set(range(self.num_pages)):
      raise RuntimeError("pages were lost or invented")
    for page, block in self._page_block.items():
      if block.page != page or block.tier != "device" or self._index.get(block.key) is not block:
        raise RuntimeError(f"page {page}: its cached block is not indexed there")
    if not lru <= set(self._page_block):
      raise RuntimeError("an unregistered page is on the LRU list")
    for block in self._states.values():
      if block.state is None or block.tier != "device" or self._index.get(block.key) is not block:
        raise RuntimeError(f"a boundary state is held for a block not indexed on the device "
                           f"(tier {block.tier!r})")
    if self.max_states is not None and len(self._states) > self.max_states:
      raise RuntimeError(f"{len(self._states)} boundary states held, max_states "
                         f"{self.max_states}")
    for seq_id, pages in self._pages.items():
      if len(pages) != pages_for(self._tokens[seq_id], self.page_size):
        raise RuntimeError(f"sequence {seq_id!r} holds {len(pages)} pages for "
                           f"{self._tokens[seq_id]} tokens")

  def stats(self) -> PoolStats:
    """`PoolStats`: `used_pages` counts each referenced page once, so with
    sharing `tokens` (summed over sequences) may exceed `reserved_slots`;
    the waste is the unused tail of each sequence's last page."""
    used, tokens = self.num_used, sum(self._tokens.values())
    waste = sum(pages_for(t, self.page_size) * self.page_size - t for t in self._tokens.values())
    reserved = used * self.page_size
    return PoolStats(num_pages=self.num_pages, page_size=self.page_size, used_pages=used,
                     free_pages=self.num_free, live_sequences=len(self._pages), tokens=tokens,
                     reserved_slots=reserved, internal_waste_slots=waste,
                     waste_fraction=waste / reserved if reserved else 0.0)

  # Helpers.
  def _walk(self, tokens: np.ndarray, max_pages: int | None) -> list[CachedBlock]:
    limit = tokens.size // self.page_size
    if max_pages is not None:
      limit = min(limit, max_pages)
    blocks, parent = [], None
    # The shared store's pages can only be used once a device writer is bound.
    shared = (getattr(self.offload, "contains", None)
              if not self.boundary_states and self._writer is not None else None)
    for j in range(limit):
      chunk = tokens[j * self.page_size:(j + 1) * self.page_size]
      key = page_digest(ROOT_KEY if parent is None else parent.key, chunk)
      block = self._index.get(key)
      if block is None and shared is not None and shared(key):
        # Not in our pool or tiers, in the shared store: a block outside the index until
        # `allocate_prompt` loads it (so `match` changes nothing).
        block = CachedBlock(key, chunk.astype(np.int32), parent, None, tier=SHARED_TIER)
      if block is None or block.parent is not parent or not np.array_equal(block.tokens, chunk):
        break
      blocks.append(block)
      parent = block
    return blocks

  def _keeps_evictions(self) -> bool:
    """Whether an evicted block's page is read and handed to the offload store (not with a
    shared store without local tiers: the page was published when registered)."""
    return (self.offload is not None and self._reader is not None
            and getattr(self.offload, "keeps_evictions", True))

  def _publish(self, blocks: list[CachedBlock]) -> None:
    """Hands newly registered blocks to a shared store (`kvattn.paging.shared`), which writes
    those no worker has written yet. Pools with boundary states are not shared."""
    publish = getattr(self.offload, "publish", None)
    if blocks and publish is not None and self._reader is not None and not self.boundary_states:
      self.counters["pages_published"] += publish(blocks, self._reader)

  @staticmethod
  def _nth_block(last: CachedBlock | None, back: int) -> CachedBlock | None:
    for _ in range(back):
      last = None if last is None else last.parent
    return last

  def _release(self, page: int) -> None:
    self._ref[page] -= 1
    if self._ref[page] == 0:
      if page in self._page_block:
        self._lru[page] = None
      else:
        self._free.append(page)

  def _take(self, seq_id: Hashable, count: int) -> list[int]:
    if count > self.num_free:
      raise OutOfPagesError(seq_id, count, self.num_free)
    return [self._take_one() for _ in range(count)]

  def _take_one(self) -> int:
    if self._free:
      return self._free.pop()
    page, _ = self._lru.popitem(last=False)
    block = self._page_block.pop(page)
    self.counters["evictions"] += 1
    if self._keeps_evictions():
      block.page, block.tier = None, "offloading"
      self.offload.put(block, self._payload(block, self.offload.rows(self._reader([page]))[0]))
      self.counters["pages_offloaded"] += 1
    else:
      self._forget(block)
    return page

  def _forget(self, block: CachedBlock) -> None:
    self._drop_state(block)
    if self._index.get(block.key) is block:
      del self._index[block.key]
    if block.page is not None and self._page_block.get(block.page) is block:
      del self._page_block[block.page]
    block.page, block.tier = None, "dropped"


def copy_pages(caches: Sequence[Any], copies: Sequence[tuple[int, int]]) -> tuple[Any, ...]:
  """Copies page `old` to page `new` in every pool of every paged cache (its
  `copy_pages`; a cache without pages is passed through), for each `(old, new)` of
  `PrefixCachingAllocator.prepare_write`."""
  caches = tuple(caches)
  if not copies:
    return caches
  old = jnp.asarray([o for o, _ in copies], jnp.int32)
  new = jnp.asarray([n for _, n in copies], jnp.int32)
  return tuple(c.copy_pages(old, new) if getattr(c, "POOL_FIELDS", ()) else c for c in caches)
