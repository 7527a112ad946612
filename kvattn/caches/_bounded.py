"""What the bounded cache kinds share (`window.py`: ring, sinks; `eviction.py`)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kvattn import _checks
from kvattn.caches import _slots
from kvattn.caches import capabilities
from kvattn.caches import dense as cache_lib
from kvattn.ops import quant

# ----------------------------------------------------------------------------------------------
# Shared pieces.


def check_q(cache, q, num_tokens: int) -> None:
  """Checks queries `q: [B, T, N, H]` (floating) against the cache's B, H and K (N a
  multiple of K) and `num_tokens` = T; ValueError/TypeError naming `q`."""
  _checks.rank("q", q, 4, "[B, T, N, H]")
  _checks.floating("q", q)
  if q.shape[0] != cache.batch or q.shape[1] != num_tokens or q.shape[3] != cache.head_dim:
    raise ValueError(f"q must have shape [B, T, N, H] = ({cache.batch}, {num_tokens}, N, "
                     f"{cache.head_dim}); got {tuple(q.shape)}")
  _checks.head_layout(q.shape[2], cache.num_kv_heads)


def check_implementation(cache, implementation) -> None:
  """ValueError unless `implementation` is None or "xla" (the bounded kinds attend through
  the XLA positional path only)."""
  if implementation not in (None, "xla"):
    raise ValueError(f"implementation must be None or 'xla' for a {type(cache).__name__} (its "
                     f"attention is the XLA positional path); got {implementation!r}")


def check_lengths(cache) -> None:
  """Eager check of the cache's own `lengths` before a write: tokens written, >= 0 (these
  kinds grow past their capacity by design). Traced: no check."""
  _checks.values_in_range("cache lengths", cache.lengths, 0)


def prelude(cache, implementation) -> None:
  """What every `update_attend_unchecked` checks of its own (the arguments are the
  caller's business): the backend this kind can run, its `lengths` (eager)."""
  check_implementation(cache, implementation)
  check_lengths(cache)



def new_positions(lengths: jax.Array, new_lengths: jax.Array, num_tokens: int) -> jax.Array:
  """`i32[B, T]`: token index `lengths[b] + t` of each new token, -1 for padding."""
  t = jnp.arange(num_tokens, dtype=jnp.int32)[None, :]
  return jnp.where(t < new_lengths[:, None], lengths[:, None] + t, -1)


def heads_first(x: jax.Array) -> jax.Array:
  """`[B, T, K, ...]` -> `[B, K, T, ...]`."""
  return jnp.swapaxes(x, 1, 2)


def encode_new(cache, k_new, v_new):
  """New keys and values in storage layout `[B, K, T, H]` and dtype, with scales `[B, K, T]`."""
  (k, ks), (v, vs) = cache_lib.encode(k_new, cache.dtype), cache_lib.encode(v_new, cache.dtype)
  k, v = heads_first(k).astype(cache.dtype), heads_first(v).astype(cache.dtype)
  return k, v, (None if ks is None else heads_first(ks)), (None if vs is None else
                                                           heads_first(vs))


def concat(stored, new, axis: int = 2):
  """`stored` followed by `new` along the slot `axis` (None stays None: a float cache's
  absent scales)."""
  return None if stored is None else jnp.concatenate([stored, new], axis=axis)


def scatter_slots(buffer: jax.Array, new: jax.Array, slots: jax.Array) -> jax.Array:
  """`buffer[b, :, slots[b, t]] = new[b, :, t]` for `[B, K, S, ...]` buffers and
  `[B, K, T, ...]` new values; slots >= S are dropped."""
  rows = jnp.broadcast_to(jnp.arange(slots.shape[0], dtype=jnp.int32)[:, None], slots.shape)
  return quant.set_stored(buffer, (rows, slice(None), slots), jnp.swapaxes(new, 1, 2),
                          mode="drop")


def scale_kwargs(k_scale, v_scale) -> dict[str, Any]:
  """The `k_scale=`/`v_scale=` keywords of the positional ops: empty for a float cache."""
  return {} if k_scale is None else {"k_scale": k_scale, "v_scale": v_scale}


def min_window(a: int | None, b: int | None) -> int | None:
  """The narrower of two windows in tokens (None: no window)."""
  return b if a is None else (a if b is None else min(a, b))


def float_keys(k: jax.Array) -> jax.Array:
  """Stored keys as f32 values (a quantized cache's scales stay separate)."""
  return k.astype(jnp.float32)


class CheckedStep:
  """`update_attend` for a kind whose step is `update_attend_unchecked` (the modules call that
  directly): checks `q`, `k`, `v` and `new_lengths`, then runs the step."""

  def update_attend(self, q, k, v, *, new_lengths=None, **step):
    """`cache_protocol.update_attend`: checks `q`, `k`, `v` and `new_lengths`, then
    `update_attend_unchecked`."""
    new_lengths = cache_lib.check_new_kv(self, k, v, new_lengths)
    check_q(self, q, k.shape[1])
    return self.update_attend_unchecked(q, k, v, new_lengths=new_lengths, **step)


class BoundedCache(CheckedStep, _slots.Slots, _slots.KVHeads, capabilities.Rows):
  """Members the three kinds share (sizes and storage from `_slots`, the protocol's
  bookkeeping). `capacity` is the window / budget the cache was built with; these kinds
  never overflow (`lengths` grows past it by design), so they have no `overflowed`."""

  BOUNDED = True
  _SIZES = {"batch": ("k", 0), "num_kv_heads": ("k", 1), "capacity": ("k", 2),
            "head_dim": ("k", 3)}
  _VALUES, _SCALES = ("k", "v"), ("k_scale", "v_scale")

  def slot_positions(self) -> jax.Array:
    """`i32[B, capacity]`: the original token index held by each slot, -1 for none."""
    return self.pos

  def check_state(self, name: str = "cache") -> None:
    """Eager check of the bookkeeping (`kvattn.caches.checkpoint.restore_caches` runs it):
    `lengths >= 0` and `pos` exactly what the kind keeps after `lengths` tokens
    (`expected_pos`). Traced: no check.

    Raises:
      ValueError: naming the leaf and slot, e.g. "layer 0 pos[1, 3] = 9 ...".
    """
    _checks.values_in_range(f"{name} lengths", self.lengths, 0)
    if not (_checks.is_concrete(self.lengths) and _checks.is_concrete(self.pos)):
      return
    lengths, pos = np.asarray(self.lengths).astype(np.int64), np.asarray(self.pos)
    want = self.expected_pos(lengths)
    if (pos != want).any():
      b, s = (int(x) for x in np.argwhere(pos != want)[0])
      raise ValueError(f"{name} pos[{b}, {s}] = {int(pos[b, s])}, but a {type(self).__name__} "
                       f"of {self.capacity} slots holding {int(lengths[b])} tokens keeps token "
                       f"{int(want[b, s])} there (-1: none)")



class WrappingCache(BoundedCache):
  """Ring and sinks: new tokens overwrite slots chosen by `_slots`; no scoring."""

  ROLLBACK = "journal"

  chunk_equals_steps = True
  """A chunk attends the stored slots plus its own tokens, masked by position: what the
  one-token steps attend (`kvattn.caches.transaction`)."""

  def draft_journal(self, new_lengths: jax.Array, num_tokens: int) -> dict[str, Any]:
    """The undo log of a draft of `num_tokens` tokens (`kvattn.caches.transaction`): the slots it
    writes (`i32[B, T]`, the capacity where none) and their old contents (keys, values, scales `[B,
    T, K, ...]`, `pos` `[B, T]`), and `lengths`. At most `min(T, capacity)` distinct slots per row:
    the chunk's write keeps only its last `capacity` tokens."""
    slots = self._slots(new_lengths, num_tokens)
    rows = jnp.broadcast_to(jnp.arange(self.batch, dtype=jnp.int32)[:, None], slots.shape)
    safe = jnp.minimum(slots, self.capacity - 1)
    old = lambda buf: None if buf is None else buf[rows, :, safe]
    return dict(slots=slots, lengths=self.lengths, pos=self.pos[rows, safe], k=old(self.k),
                v=old(self.v), k_scale=old(self.k_scale), v_scale=old(self.v_scale))

  def undo_draft(self, journal: dict[str, Any]):
    """The cache before the draft journaled in `journal` (`draft_journal`): the old
    contents scattered back into the slots the draft wrote, bit for bit."""
    slots = journal["slots"]
    rows = jnp.broadcast_to(jnp.arange(self.batch, dtype=jnp.int32)[:, None], slots.shape)
    back = lambda buf, old: None if buf is None else buf.at[rows, :, slots].set(old,
                                                                                mode="drop")
    return self.replace(k=back(self.k, journal["k"]), v=back(self.v, journal["v"]),
                        k_scale=back(self.k_scale, journal["k_scale"]),
                        v_scale=back(self.v_scale, journal["v_scale"]),
                        pos=self.pos.at[rows, slots].set(journal["pos"], mode="drop"),
                        lengths=journal["lengths"])

  def _write(self, k, v, ks, vs, new_lengths):
    """Scatters encoded new tokens (`[B, K, T, ...]`) into their `_slots`."""
    num_tokens = k.shape[2]
    slots = self._slots(new_lengths, num_tokens)
    new_pos = new_positions(self.lengths, new_lengths, num_tokens)
    scatter = lambda buf, new: None if buf is None else scatter_slots(buf, new, slots)
    rows = jnp.broadcast_to(jnp.arange(self.batch, dtype=jnp.int32)[:, None], slots.shape)
    return self.replace(k=scatter(self.k, k), v=scatter(self.v, v),
                        pos=self.pos.at[rows, slots].set(new_pos, mode="drop"),
                        lengths=self.lengths + new_lengths,
                        k_scale=scatter(self.k_scale, ks), v_scale=scatter(self.v_scale, vs))

  def update(self, k_new: jax.Array, v_new: jax.Array, new_lengths: jax.Array | None = None):
    """Writes `k_new, v_new: [B, T, K, H]` for `t < new_lengths[b]` into the slots the
    kind assigns (only the tokens no later token of the chunk overwrites)."""
    return self.update_unchecked(k_new, v_new,
                                 cache_lib.check_new_kv(self, k_new, v_new, new_lengths))

  def update_unchecked(self, k_new: jax.Array, v_new: jax.Array, new_lengths: jax.Array):
    """`update` for callers that checked its arguments; checks the cache's `lengths`."""
    check_lengths(self)
    return self._write(*encode_new(self, k_new, v_new), new_lengths)

  def attend(self, q: jax.Array, *, q_offsets: jax.Array, sm_scale: float | None = None,
             window: int | None = None, soft_cap: float | None = None,
             implementation: str | None = None) -> jax.Array:
    """Queries at tokens `q_offsets[b] + t` against the stored slots: exact for T == 1
    after `update`; a chunk's queries see only what the cache still holds (the module
    goes through `update_attend`, which is exact for chunks)."""
    check_implementation(self, implementation)
    q_pos = q_offsets[:, None] + jnp.arange(q.shape[1], dtype=jnp.int32)[None, :]
    return self._attend(q, self.k, self.v, self.k_scale, self.v_scale, self.pos, q_pos,
                        self.lengths, sm_scale=sm_scale, window=window, soft_cap=soft_cap)

  def _step(self, q, k, v, new_lengths, opts):
    """One token: write, then attend the stored slots. A chunk: attend the stored slots
    plus the chunk's own tokens, then write (the chunk may overwrite its own window)."""
    num_tokens = k.shape[1]
    if num_tokens == 1:
      new = self.update_unchecked(k, v, new_lengths)
      return new.attend(q, q_offsets=self.lengths, **opts), new
    kq, vq, ks, vs = encode_new(self, k, v)
    q_pos = self.lengths[:, None] + jnp.arange(num_tokens, dtype=jnp.int32)[None, :]
    cand_pos = jnp.concatenate([self.pos, new_positions(self.lengths, new_lengths,
                                                         num_tokens)], axis=1)
    out = self._attend(q, concat(self.k, kq), concat(self.v, vq), concat(self.k_scale, ks),
                       concat(self.v_scale, vs), cand_pos, q_pos, self.lengths + new_lengths,
                       sm_scale=opts["sm_scale"], window=opts["window"],
                       soft_cap=opts["soft_cap"])
    return out, self._write(kq, vq, ks, vs, new_lengths)


def empty_storage(batch, capacity, num_kv_heads, head_dim, dtype):
  """Zeros `[B, K, S, H]` keys and values, their scales (quantized dtypes) and
  `pos = -1`, `lengths = 0`."""
  batch = _checks.positive_int("batch", batch)
  num_kv_heads = _checks.positive_int("num_kv_heads", num_kv_heads)
  head_dim = _checks.positive_int("head_dim", head_dim)
  dtype = cache_lib.check_storage_dtype(dtype)
  shape = (batch, num_kv_heads, capacity, head_dim)
  return dict(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype),
              lengths=jnp.zeros((batch,), jnp.int32),
              k_scale=cache_lib.scale_init(shape[:3], dtype),
              v_scale=cache_lib.scale_init(shape[:3], dtype))
