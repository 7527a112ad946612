"""PageAllocator: ownership invariants under random operation sequences, exhaustion, stats."""

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvattn import OutOfPagesError, PageAllocator
from kvattn.paging.allocator import NO_PAGE, pages_for


class AllocatorMachine(RuleBasedStateMachine):
  """Random allocate / grow / free sequences against a plain model of ownership."""

  NUM_PAGES, PAGE_SIZE, MAX_PAGES = 12, 4, 5

  def __init__(self):
    super().__init__()
    self.alloc = PageAllocator(self.NUM_PAGES, self.PAGE_SIZE, self.MAX_PAGES, seed=0)
    self.tokens = {}  # model: live seq -> tokens
    self.owned = {}  # seq -> pages as last reported
    self.next_id = 0

  def _snapshot(self):
    return {s: self.alloc.pages(s) for s in self.alloc.live}, self.alloc.num_free

  @rule(num_tokens=st.integers(0, 5 * 4))
  def allocate(self, num_tokens):
    seq = self.next_id
    self.next_id += 1
    before = self._snapshot()
    need = pages_for(num_tokens, self.PAGE_SIZE)
    if need > self.alloc.num_free:
      with pytest.raises(OutOfPagesError) as e:
        self.alloc.allocate(seq, num_tokens)
      assert (e.value.needed, e.value.available) == (need, before[1])
      assert self._snapshot() == before  # a refusal changes nothing
      return
    pages = self.alloc.allocate(seq, num_tokens)
    assert len(pages) == need
    assert not set(pages) & {p for ps in before[0].values() for p in ps}
    self.tokens[seq], self.owned[seq] = num_tokens, pages

  @precondition(lambda self: self.tokens)
  @rule(data=st.data(), extra=st.integers(0, 9))
  def grow(self, data, extra):
    seq = data.draw(st.sampled_from(sorted(self.tokens)))
    target = min(self.tokens[seq] + extra, self.MAX_PAGES * self.PAGE_SIZE)
    before = self._snapshot()
    need = pages_for(target, self.PAGE_SIZE) - len(self.owned[seq])
    if need > self.alloc.num_free:
      with pytest.raises(OutOfPagesError):
        self.alloc.grow(seq, target)
      assert self._snapshot() == before
      return
    added = self.alloc.grow(seq, target)
    assert len(added) == need
    assert self.alloc.pages(seq) == self.owned[seq] + added  # old pages keep their order
    self.tokens[seq], self.owned[seq] = target, self.alloc.pages(seq)

  @precondition(lambda self: self.tokens)
  @rule(data=st.data())
  def free(self, data):
    seq = data.draw(st.sampled_from(sorted(self.tokens)))
    free_before = self.alloc.num_free
    freed = self.alloc.free(seq)
    assert freed == self.owned[seq]
    assert self.alloc.num_free == free_before + len(freed)
    del self.tokens[seq], self.owned[seq]
    with pytest.raises(ValueError, match="seq_id must be a live sequence"):
      self.alloc.free(seq)  # a second free is refused, never double-frees

  @invariant()
  def ownership_is_exclusive_and_complete(self):
    self.alloc.check()
    owned = [p for s in self.alloc.live for p in self.alloc.pages(s)]
    assert len(owned) == len(set(owned))
    assert self.alloc.num_used == len(owned) == sum(
        pages_for(t, self.PAGE_SIZE) for t in self.tokens.values())
    assert self.alloc.num_free + self.alloc.num_used == self.NUM_PAGES
    stats = self.alloc.stats()
    assert stats.tokens == sum(self.tokens.values())
    assert 0 <= stats.internal_waste_slots < self.PAGE_SIZE * max(1, len(self.tokens))

  def teardown(self):
    for seq in list(self.tokens):
      self.alloc.free(seq)
    # Every page came back: the free count returns to its start.
    assert self.alloc.num_free == self.NUM_PAGES and self.alloc.live == ()
    self.alloc.check()


TestAllocatorMachine = AllocatorMachine.TestCase
TestAllocatorMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)


@settings(max_examples=40, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["alloc", "grow", "free"]), st.integers(0, 40)),
                    max_size=40))
def test_any_operation_sequence_returns_every_page(ops):
  alloc = PageAllocator(16, 8, 6)
  live = []
  for i, (op, n) in enumerate(ops):
    try:
      if op == "alloc":
        alloc.allocate(i, min(n, 48))
        live.append(i)
      elif op == "grow" and live:
        seq = live[n % len(live)]
        alloc.grow(seq, min(alloc.num_tokens(seq) + n, 48))
      elif op == "free" and live:
        alloc.free(live.pop(n % len(live)))
    except OutOfPagesError:
      pass
    alloc.check()
  for seq in live:
    alloc.free(seq)
  assert alloc.num_free == 16
  assert sorted(alloc._free) == list(range(16))


def test_grow_adds_a_page_only_at_a_page_boundary():
  alloc = PageAllocator(8, 4)
  assert alloc.allocate("a", 3) == (0,)
  assert alloc.grow("a", 4) == ()  # the 4th token still fits page 0
  assert alloc.grow("a", 5) == (1,)  # the 5th starts a fresh page
  assert alloc.grow("a", 13) == (2, 3)  # a long jump takes several pages
  assert alloc.pages("a") == (0, 1, 2, 3) and alloc.num_tokens("a") == 13
  assert alloc.allocate("empty", 0) == ()  # a sequence may start with no pages
  assert alloc.grow("empty", 1) == (4,)


def test_block_table_rows():
  alloc = PageAllocator(8, 4, 3, seed=3)
  pages = alloc.allocate("a", 6)
  row = alloc.block_table_row("a")
  assert row.dtype == np.int32 and row.tolist() == list(pages) + [NO_PAGE]
  tables = alloc.block_tables(["a", None])
  assert tables.shape == (2, 3) and tables[1].tolist() == [NO_PAGE] * 3
  with pytest.raises(ValueError, match="width must be at least the 2 pages of 'a'; got 1"):
    alloc.block_table_row("a", 1)


def test_seeded_free_list_hands_out_a_permutation():
  alloc = PageAllocator(10, 2, seed=1)
  pages = alloc.allocate("a", 20)
  assert sorted(pages) == list(range(10)) and list(pages) != list(range(10))


def test_exhaustion_raises_typed_error_and_changes_nothing():
  alloc = PageAllocator(5, 4)
  a = alloc.allocate("a", 8)
  b = alloc.allocate("b", 9)
  assert alloc.num_free == 0
  assert not alloc.can_allocate(1) and alloc.can_allocate(0)
  assert not alloc.can_allocate(13, "b") and alloc.can_allocate(12, "b")
  with pytest.raises(OutOfPagesError, match=r"out of KV pages: sequence 'c' needs 1 more page\(s\) "
                     r"but only 0 are free") as e:
    alloc.allocate("c", 1)
  assert isinstance(e.value, RuntimeError) and (e.value.needed, e.value.available) == (1, 0)
  with pytest.raises(OutOfPagesError):
    alloc.grow("b", 13)
  assert alloc.pages("a") == a and alloc.pages("b") == b
  assert alloc.num_tokens("b") == 9 and "c" not in alloc
  alloc.free("a")
  assert alloc.allocate("c", 5) == a  # freed pages are reused first


def test_bad_requests_raise_value_errors():
  alloc = PageAllocator(8, 4, 2)
  alloc.allocate("a", 4)
  with pytest.raises(ValueError, match="seq_id must not be live already; got 'a'"):
    alloc.allocate("a", 1)
  with pytest.raises(ValueError, match=r"num_tokens must lie in \[0, max_pages_per_seq \* "
                     r"page_size\] = \[0, 8\]; got 9"):
    alloc.allocate("b", 9)
  with pytest.raises(ValueError, match="num_tokens must not shrink sequence 'a' below its 4 "
                     "tokens; got 3"):
    alloc.grow("a", 3)
  with pytest.raises(ValueError, match="seq_id must be a live sequence; got 'zz'"):
    alloc.grow("zz", 3)
  with pytest.raises(TypeError, match="num_tokens must be an int"):
    alloc.allocate("b", 2.0)
  with pytest.raises(ValueError, match="num_pages must be a positive int; got 0"):
    PageAllocator(0, 4)
  alloc.check()


def test_stats_report_internal_fragmentation():
  alloc = PageAllocator(16, 8)
  alloc.allocate("a", 8)  # exactly one full page
  alloc.allocate("b", 9)  # 2 pages, 7 slots unused
  alloc.allocate("c", 1)  # 1 page, 7 slots unused
  s = alloc.stats()
  assert (s.used_pages, s.free_pages, s.live_sequences, s.tokens) == (4, 12, 3, 18)
  assert (s.reserved_slots, s.internal_waste_slots) == (32, 14)
  assert s.waste_fraction == pytest.approx(14 / 32)
  alloc.free("b")
  s = alloc.stats()
  assert (s.used_pages, s.tokens, s.internal_waste_slots) == (2, 9, 7)
  for seq in ("a", "c"):
    alloc.free(seq)
  assert alloc.stats().waste_fraction == 0.0 and alloc.stats().free_pages == 16


def test_shrink_returns_the_pages_past_the_tokens_kept():
  alloc = PageAllocator(8, 4, 4)
  alloc.allocate("a", 5)
  added = alloc.grow("a", 13)  # a speculative write: 2 more pages
  assert len(added) == 2 and alloc.num_free == 4
  assert alloc.shrink("a", 9) == added[1:]  # 9 tokens need 3 pages
  assert alloc.num_tokens("a") == 9 and len(alloc.pages("a")) == 3 and alloc.num_free == 5
  assert alloc.shrink("a", 9) == ()  # nothing past the last page
  assert len(alloc.shrink("a", 0)) == 3 and alloc.pages("a") == () and alloc.num_free == 8
  alloc.check()
  with pytest.raises(ValueError, match="must not exceed"):
    alloc.shrink("a", 1)
  with pytest.raises(ValueError, match="live sequence"):
    alloc.shrink("b", 0)
