"""Host-side page allocator of a paged KV cache (PagedAttention, Kwon et al., SOSP 2023)."""

from __future__ import annotations

import dataclasses
from typing import Any, Hashable, Iterable

import numpy as np

from kvattn import _checks

NO_PAGE = -1
"""Block-table entry of a logical page that has no physical page."""


def pages_for(num_tokens: int, page_size: int) -> int:
  """Pages needed to hold `num_tokens` tokens: `ceil(num_tokens / page_size)`."""
  return -(-int(num_tokens) // int(page_size))


class OutOfPagesError(RuntimeError):
  """The pool has fewer free pages than a request needs."""

  def __init__(self, seq_id: Hashable, needed: int, available: int):
    self.seq_id, self.needed, self.available = seq_id, needed, available
    super().__init__(
        f"out of KV pages: sequence {seq_id!r} needs {needed} more page(s) but only "
        f"{available} are free; retire a sequence or build a larger pool")


@dataclasses.dataclass(frozen=True)
class PoolStats:
  """A snapshot of a `PageAllocator`.

  Attributes:
    num_pages: pages in the pool.
    page_size: tokens per page.
    used_pages / free_pages: pages owned by live sequences / on the free list.
    live_sequences: sequences holding pages (or registered with 0 tokens).
    tokens: tokens the live sequences hold.
    reserved_slots: `used_pages * page_size`.
    internal_waste_slots: `reserved_slots - tokens`: the unused tail of each
      sequence's last page (internal fragmentation; < page_size per sequence).
    waste_fraction: `internal_waste_slots / reserved_slots` (0 when nothing is
      reserved). There is no external fragmentation: any free page serves any
      sequence, so a request fails only when fewer pages than it needs are free.
  """

  num_pages: int
  page_size: int
  used_pages: int
  free_pages: int
  live_sequences: int
  tokens: int
  reserved_slots: int
  internal_waste_slots: int
  waste_fraction: float


class PageAllocator:
  """Host-side allocator of the pages of a `PagedKVCache` pool."""

  def __init__(self, num_pages: int, page_size: int, max_pages_per_seq: int | None = None, *,
               seed: int | None = None):
    """Builds an allocator whose pool is entirely free.

    Args:
      num_pages: pages P in the pool.
      page_size: tokens per page.
      max_pages_per_seq: block-table width (default P): a sequence may own at most this many pages.
      seed: if given, the free list starts in a random order (pages are then handed out
        non-contiguously, which exercises page-order independence); default ascending page ids.

    Raises:
      ValueError/TypeError: a size that is not a positive int.
    """
    self.num_pages = _checks.positive_int("num_pages", num_pages)
    self.page_size = _checks.positive_int("page_size", page_size)
    self.max_pages_per_seq = (self.num_pages if max_pages_per_seq is None else
                              _checks.positive_int("max_pages_per_seq", max_pages_per_seq))
    order = np.arange(self.num_pages)
    if seed is not None:
      order = np.random.default_rng(seed).permutation(self.num_pages)
    # A stack: pop() from the end hands out order[0] first.
    self._free: list[int] = [int(p) for p in order[::-1]]
    self._pages: dict[Hashable, list[int]] = {}
    self._tokens: dict[Hashable, int] = {}

  # Queries.
  @property
  def num_free(self) -> int:
    return len(self._free)

  @property
  def num_used(self) -> int:
    return self.num_pages - len(self._free)

  @property
  def live(self) -> tuple[Hashable, ...]:
    """Ids of the live sequences, in allocation order."""
    return tuple(self._pages)

  @property
  def max_tokens_per_seq(self) -> int:
    return self.max_pages_per_seq * self.page_size

  def __contains__(self, seq_id: Hashable) -> bool:
    return seq_id in self._pages

  def pages(self, seq_id: Hashable) -> tuple[int, ...]:
    """Physical pages of `seq_id`, in logical order."""
    return tuple(self._owned(seq_id))

  def num_tokens(self, seq_id: Hashable) -> int:
    """Tokens written for live sequence `seq_id` (ValueError if it is not live)."""
    self._owned(seq_id)
    return self._tokens[seq_id]

  def pages_needed(self, num_tokens: int, seq_id: Hashable | None = None) -> int:
    """Extra pages `seq_id` (or a new sequence, when None) needs to hold
    `num_tokens` tokens in total."""
    have = 0 if seq_id is None else len(self._owned(seq_id))
    return max(0, pages_for(num_tokens, self.page_size) - have)

  def can_allocate(self, num_tokens: int, seq_id: Hashable | None = None) -> bool:
    """True if `allocate` (seq_id None) or `grow` to `num_tokens` would succeed
    as far as free pages go."""
    return self.pages_needed(num_tokens, seq_id) <= self.num_free

  def block_table_row(self, seq_id: Hashable, width: int | None = None) -> np.ndarray:
    """`i32[width]` block-table row of `seq_id` (default width
    `max_pages_per_seq`), padded with `NO_PAGE`."""
    width = self.max_pages_per_seq if width is None else width
    pages = self._owned(seq_id)
    if len(pages) > width:
      raise ValueError(f"width must be at least the {len(pages)} pages of {seq_id!r}; got {width}")
    row = np.full((width,), NO_PAGE, np.int32)
    row[:len(pages)] = pages
    return row

  def block_tables(self, seq_ids: Iterable[Hashable | None],
                   width: int | None = None) -> np.ndarray:
    """`i32[len(seq_ids), width]`: one row per id; None gives an empty row."""
    width = self.max_pages_per_seq if width is None else width
    rows = [np.full((width,), NO_PAGE, np.int32) if s is None else self.block_table_row(s, width)
            for s in seq_ids]
    return np.stack(rows) if rows else np.zeros((0, width), np.int32)

  def stats(self) -> PoolStats:
    """Used/free pages and internal fragmentation of the live sequences."""
    used = self.num_used
    tokens = sum(self._tokens.values())
    reserved = used * self.page_size
    waste = reserved - tokens
    return PoolStats(num_pages=self.num_pages, page_size=self.page_size, used_pages=used,
                     free_pages=self.num_free, live_sequences=len(self._pages), tokens=tokens,
                     reserved_slots=reserved, internal_waste_slots=waste,
                     waste_fraction=waste / reserved if reserved else 0.0)

  # Mutations (atomic).
  def allocate(self, seq_id: Hashable, num_tokens: int) -> tuple[int, ...]:
    """Registers a new sequence holding `num_tokens` tokens and gives it
    `ceil(num_tokens / page_size)` pages.

    Returns:
      The pages given, in logical order.

    Raises:
      ValueError: `seq_id` already live; `num_tokens` negative or more than
        `max_pages_per_seq * page_size`.
      OutOfPagesError: fewer free pages than needed (nothing changes).
    """
    if seq_id in self._pages:
      raise ValueError(f"seq_id must not be live already; got {seq_id!r}")
    num_tokens = self._check_tokens(num_tokens)
    pages = self._take(seq_id, pages_for(num_tokens, self.page_size))
    self._pages[seq_id] = pages
    self._tokens[seq_id] = num_tokens
    return tuple(pages)

  def grow(self, seq_id: Hashable, num_tokens: int) -> tuple[int, ...]:
    """Makes room for `num_tokens` tokens in total in `seq_id`; a sequence that
    crosses a page boundary gets one more page (several for a long jump).

    Returns:
      The pages added (empty when the last page still has room).

    Raises:
      ValueError: unknown `seq_id`; `num_tokens` below the sequence's current
        count or past `max_pages_per_seq * page_size`.
      OutOfPagesError: fewer free pages than needed (nothing changes).
    """
    pages = self._owned(seq_id)
    num_tokens = self._check_tokens(num_tokens)
    if num_tokens < self._tokens[seq_id]:
      raise ValueError(
          f"num_tokens must not shrink sequence {seq_id!r} below its {self._tokens[seq_id]} "
          f"tokens; got {num_tokens}")
    added = self._take(seq_id, pages_for(num_tokens, self.page_size) - len(pages))
    pages.extend(added)
    self._tokens[seq_id] = num_tokens
    return tuple(added)

  def shrink(self, seq_id: Hashable, num_tokens: int) -> tuple[int, ...]:
    """Cuts `seq_id` back to `num_tokens` tokens in total: the pages past the ones they occupy go
    back on the free list (speculative decoding returns the pages only its rejected draft tokens
    used; `kvattn.inference.batching`).

    Returns:
      The pages freed (empty when the last page is still needed).

    Raises:
      ValueError: unknown `seq_id`; `num_tokens` above the sequence's current count or negative.
    """
    pages = self._owned(seq_id)
    num_tokens = self._check_tokens(num_tokens)
    if num_tokens > self._tokens[seq_id]:
      raise ValueError(
          f"num_tokens must not exceed sequence {seq_id!r}'s {self._tokens[seq_id]} tokens "
          f"(shrink only cuts; grow adds); got {num_tokens}")
    keep = pages_for(num_tokens, self.page_size)
    dropped = pages[keep:]
    del pages[keep:]
    self._tokens[seq_id] = num_tokens
    self._give_back(dropped)
    return tuple(dropped)

  def _give_back(self, pages: list[int]) -> None:
    """Pages a sequence dropped (`shrink`) go back on the free list, reused first."""
    self._free.extend(reversed(pages))

  def free(self, seq_id: Hashable) -> tuple[int, ...]:
    """Retires `seq_id`: all its pages go back on the free list.

    Returns:
      The pages freed.

    Raises:
      ValueError: `seq_id` is not live (freed twice, or never allocated).
    """
    pages = self._owned(seq_id)
    del self._pages[seq_id], self._tokens[seq_id]
    self._free.extend(reversed(pages))  # reused first (warm pages), in their old order
    return tuple(pages)

  def check(self) -> None:
    """Verifies the allocator's invariants (for tests and debugging).

    Raises:
      RuntimeError: a page owned twice, a page both owned and free, a page
        lost (neither owned nor free), or a token count its pages cannot hold.
    """
    owned = [p for pages in self._pages.values() for p in pages]
    if len(set(owned)) != len(owned):
      raise RuntimeError("a page is owned by two sequences (or twice by one)")
    if len(set(self._free)) != len(self._free):
      raise RuntimeError("a page is on the free list twice")
    if set(owned) & set(self._free):
      raise RuntimeError("a page is both owned and free")
    if len(owned) + len(self._free) != self.num_pages or any(
        not 0 <= p < self.num_pages for p in owned + self._free):
      raise RuntimeError("pages were lost or invented")
    for seq_id, pages in self._pages.items():
      if len(pages) != pages_for(self._tokens[seq_id], self.page_size):
        raise RuntimeError(f"sequence {seq_id!r} holds {len(pages)} pages for "
                           f"{self._tokens[seq_id]} tokens")

  # Helpers.
  def _owned(self, seq_id: Hashable) -> list[int]:
    try:
      return self._pages[seq_id]
    except KeyError:
      raise ValueError(f"seq_id must be a live sequence; got {seq_id!r}") from None

  def _check_tokens(self, num_tokens: Any) -> int:
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, (int, np.integer)):
      raise TypeError(f"num_tokens must be an int; got {num_tokens!r}")
    if not 0 <= num_tokens <= self.max_tokens_per_seq:
      raise ValueError(
          f"num_tokens must lie in [0, max_pages_per_seq * page_size] = "
          f"[0, {self.max_tokens_per_seq}]; got {num_tokens}")
    return int(num_tokens)

  def _take(self, seq_id: Hashable, count: int) -> list[int]:
    if count > len(self._free):
      raise OutOfPagesError(seq_id, count, len(self._free))
    return [self._free.pop() for _ in range(count)]
