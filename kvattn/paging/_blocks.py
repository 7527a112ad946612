"""The blocks of a prefix cache (chained page keys) and their boundary states: what a cached
prefix needs besides its pages (`kvattn.inference.batching.snapshots`), kept on the device
up to a bound (LRU) and moved with its page to an offload tier and back."""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any, Callable, Hashable, Sequence

import numpy as np

ROOT_KEY = b""
"""The key a first page's key is chained from."""


def page_digest(parent: bytes, tokens: np.ndarray) -> bytes:
  """The key of a full page: `sha256(parent || int32-LE bytes of tokens)` (32 bytes)."""
  return hashlib.sha256(parent + np.asarray(tokens, "<i4").tobytes()).digest()


@dataclasses.dataclass(eq=False)
class CachedBlock:
  """One registered full page of token ids and where its KV lives now.

  Attributes:
    key: its chained key (`page_digest`).
    tokens: `i32[page_size]` the token ids it holds.
    parent: the block of the previous page (None for a first page).
    page: the device page holding its KV, or None while offloaded.
    tier: "device", or the name of the offload tier holding it.
    state: the boundary state at the end of this block (module docstring), or None
      (also while offloaded: then its bytes follow the page's in the tier payload).
    state_bytes: bytes of that state (on the device, or in the tier payload), 0 for none.
  """

  key: bytes
  tokens: np.ndarray
  parent: "CachedBlock | None"
  page: int | None
  tier: str = "device"
  state: Any = None
  state_bytes: int = 0


Reader = Callable[[Sequence[int]], Any]
"""`pages -> u8[n, page_bytes]`: the contents of device pages (all layers)."""
Writer = Callable[[Sequence[int], Any], None]
"""`(pages, u8[n, page_bytes]) -> None`: writes contents into device pages."""



class BoundaryStates:
  """The boundary-state members of `PrefixCachingAllocator` (its `_states`, `_max_states`,
  `_state_codec`, `_seq_blocks`, `_reader` / `_writer`, `offload` and `counters`)."""

  def bind_device(self, reader: Reader, writer: Writer, state_codec: Any = None) -> None:
    """Sets the callbacks that read and write device page contents (for offload), and for boundary
    states the object whose `encode(state) -> u8[n]` and `decode(u8[n]) -> state` move a state to
    and from its tier payload (None: a block's state is dropped when the block is offloaded)."""
    self._reader, self._writer = reader, writer
    self._state_codec = state_codec

  # Boundary states.
  @property
  def state_bytes(self) -> int:
    """Bytes of the boundary states held on the device (offloaded ones count in the tiers)."""
    return sum(b.state_bytes for b in self._states.values())

  @property
  def num_states(self) -> int:
    """Boundary states held on the device."""
    return len(self._states)

  def needs_state(self, seq_id: Hashable, end: int) -> bool:
    """True if the registered chain of `seq_id` ends exactly at token `end` (> 0) and that
    block holds no state yet: a state taken at `end` would be kept by `set_state`."""
    done, last = self._registered[seq_id]
    return (self.boundary_states and end > 0 and last is not None and done * self.page_size
            == end and last.state is None and last.tier == "device")

  def set_state(self, seq_id: Hashable, end: int, state: Any, nbytes: int) -> bool:
    """Attaches `state` (`nbytes` bytes) to the block of `seq_id` ending at token `end`
    when `needs_state(seq_id, end)`; drops the least recently used states beyond
    `max_states`. Returns whether it was attached."""
    if not self.needs_state(seq_id, end):
      return False
    block = self._registered[seq_id][1]
    block.state, block.state_bytes = state, int(nbytes)
    self._states[id(block)] = block
    self.counters["states_set"] += 1
    self._bound_states()
    return True

  def _bound_states(self) -> None:
    """Drops the least recently used states beyond `max_states`."""
    while self.max_states is not None and len(self._states) > self.max_states:
      _, old = self._states.popitem(last=False)
      old.state, old.state_bytes = None, 0
      self.counters["states_dropped"] += 1

  def state_of(self, seq_id: Hashable) -> Any:
    """The boundary state at the end of the prefix `allocate_prompt` matched for `seq_id`
    (None on a miss, or once its chain has grown past the match)."""
    return self._registered[seq_id][1].state if self._registered[seq_id][1] else None

  @staticmethod
  def _has_state(block: CachedBlock) -> bool:
    return block.state is not None or (block.tier != "device" and block.state_bytes > 0)

  def _trim(self, blocks: list[CachedBlock]) -> list[CachedBlock]:
    """`blocks` cut after the last block holding a state (boundary states), else as given."""
    if not self.boundary_states:
      return blocks
    end = max((j + 1 for j, b in enumerate(blocks) if self._has_state(b)), default=0)
    return blocks[:end]

  def _drop_state(self, block: CachedBlock) -> None:
    self._states.pop(id(block), None)
    block.state, block.state_bytes = None, 0

  def _payload(self, block: CachedBlock, row: Any) -> Any:
    """The tier payload of an evicted block: its page's bytes, then its state's (if any)."""
    self._states.pop(id(block), None)
    if block.state is None:
      return row
    if self._state_codec is None:
      self._drop_state(block)
      return row
    extra = np.asarray(self._state_codec.encode(block.state), np.uint8).reshape(-1)
    block.state, block.state_bytes = None, int(extra.size)
    return np.concatenate([np.asarray(row, np.uint8).reshape(-1), extra])

  def _unpack(self, block: CachedBlock, payload: Any) -> Any:
    """A tier payload back into the page's bytes; the state (if any) back on the block."""
    if block.state_bytes == 0:
      return payload
    payload = np.asarray(payload, np.uint8).reshape(-1)
    row, extra = payload[:-block.state_bytes], payload[-block.state_bytes:]
    block.state = self._state_codec.decode(extra)
    self._states[id(block)] = block  # the newest: a chain's deepest state is loaded last
    self._bound_states()
    return row
