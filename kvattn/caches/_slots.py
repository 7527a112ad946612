"""The cache protocol's bookkeeping members, written once for every kind."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kvattn import _checks
from kvattn.ops import quant


def slot_positions(lengths: jax.Array, capacity: int) -> jax.Array:
  """`i32[B, capacity]`: slot s holds token s where `s < lengths[b]`, else -1
  (the `slot_positions()` of a cache that keeps token t in slot t)."""
  slots = jnp.arange(capacity, dtype=jnp.int32)[None, :]
  return jnp.where(slots < lengths[:, None], slots, -1)


def encode(x: jax.Array, dtype) -> tuple[jax.Array, jax.Array | None]:
  """`(values, scales)` to store `x` (`[..., width]`) in a cache of `dtype`:
  `quantize_kv` for a quantized dtype, else `(x, None)` (cast on write)."""
  if quant.is_quantized(dtype):
    return quant.quantize_kv(x, dtype)
  return x, None


def _size(cache, name: str) -> int:
  field, axis = cache._SIZES[name]  # pylint: disable=protected-access
  return getattr(cache, field).shape[axis]


class Slots:
  """Sizes, storage and scales of a cache kind, from its declared layout (module doc)."""

  _SIZES: dict[str, tuple[str, int]] = {}
  _VALUES: tuple[str, ...] = ()
  _SCALES: tuple[str, ...] = ()
  _SCALE_ARGS: tuple[str, ...] | None = None

  @property
  def batch(self) -> int:
    """Sequences B."""
    return _size(self, "batch")

  @property
  def capacity(self) -> int:
    """Tokens (slots) one sequence can hold."""
    return _size(self, "capacity")

  @property
  def dtype(self) -> jnp.dtype:
    """The storage dtype (a float, or int8 / fp8 with scales)."""
    return getattr(self, self._VALUES[0]).dtype

  @property
  def quantized(self) -> bool:
    """True when values are stored int8/fp8 with scales."""
    return getattr(self, self._SCALES[0]) is not None

  @property
  def storage_slots(self) -> int:
    """Token slots the storage arrays hold: B * capacity."""
    return self.batch * self.capacity

  def storage_arrays(self) -> tuple[jax.Array, ...]:
    """The arrays whose size grows with the token slots (for `kvattn.memory`): the values, and
    their scales when quantized; bookkeeping (`lengths`, `pos`) is not storage."""
    fields = self._VALUES + (self._SCALES if self.quantized else ())
    return tuple(getattr(self, f) for f in fields)

  def written(self, new: tuple[jax.Array, ...], write) -> dict[str, jax.Array]:
    """The `_VALUES` fields (and their `_SCALES` when quantized) after a write, for `self.replace`:
    `new[i]` (the tokens for value i, in its layout minus the slots) is encoded in the cache dtype
    (`encode`) and `write(buffer, tokens)` scatters values and scales into their buffers."""
    out = {}
    for field, scale_field, tokens in zip(self._VALUES, self._SCALES, new):
      values, scales = encode(tokens, self.dtype)
      out[field] = write(getattr(self, field), values)
      if scales is not None:
        out[scale_field] = write(getattr(self, scale_field), scales)
    return out

  def scale_kwargs(self) -> dict[str, jax.Array]:
    """The scales as the attention ops take them (`{"k_scale": ..., "v_scale": ...}`),
    or `{}` for a float cache."""
    if not self.quantized:
      return {}
    return {arg: getattr(self, f) for arg, f in zip(self._SCALE_ARGS or self._SCALES,
                                                     self._SCALES)}

  def dequantized(self, dtype=jnp.float32) -> tuple[jax.Array, ...]:
    """The stored values as they are laid out (`(k, v)` `[B, K, S, H]` for a dense
    cache), in `dtype` (`values * scales`; a float cache is only cast). Materialises a
    copy: for tests and inspection, not decode."""
    values = tuple(getattr(self, f) for f in self._VALUES)
    if not self.quantized:
      return tuple(x.astype(dtype) for x in values)
    return tuple(quant.dequantize_kv(x, getattr(self, s), dtype)
                 for x, s in zip(values, self._SCALES))


class TokenSlots(Slots):
  """A kind that holds token t in slot t of its row and can overflow (`Slots` plus the
  protocol's slot members)."""

  @property
  def overflowed(self) -> jax.Array:
    """`bool[B]`: True for sequences that were written past `capacity` under jit."""
    return self.lengths > self.capacity

  def slot_positions(self) -> jax.Array:
    """`i32[B, capacity]`: slot s holds token s below `lengths[b]`, else -1."""
    return slot_positions(self.lengths, self.capacity)

  def check_state(self, name: str = "cache") -> None:
    """Eager check of the bookkeeping (`kvattn.caches.checkpoint.restore_caches` runs it):
    `lengths` in `[0, capacity]` (the slots then follow from it). Traced: no check.

    Raises:
      ValueError: naming the leaf and row, e.g. "layer 3 lengths[1] = -2 must lie in [0, 8]".
    """
    _checks.values_in_range(f"{name} lengths", self.lengths, 0, self.capacity)


class KVHeads:
  """The sizes a GQA module checks a cache against (read from `_SIZES`)."""

  @property
  def num_kv_heads(self) -> int:
    """KV heads K."""
    return _size(self, "num_kv_heads")

  @property
  def head_dim(self) -> int:
    """Head width H."""
    return _size(self, "head_dim")


class LengthsRollback:
  """The transaction members (`kvattn.caches.transaction`) of a kind that keeps token t in
  slot t and whose slots past `lengths` are unused: a draft journals `lengths` and commits
  by setting `lengths = journal + keep` (no copy, no replay). Chunks through the layer's
  step equal one-token steps. A subclass that writes otherwise (a residual window, groups
  quantized as they fill) must not inherit this."""

  ROLLBACK = "lengths"

  chunk_equals_steps = True

  def draft_journal(self, new_lengths: jax.Array, num_tokens: int) -> jax.Array:
    """`i32[B]`: the lengths before the draft."""
    del new_lengths, num_tokens
    return self.lengths

  def undo_draft(self, journal: jax.Array):
    """The cache before the draft: its lengths (the draft's slots become unused)."""
    return self.replace(lengths=journal)

  def commit_draft(self, journal: jax.Array, keep: jax.Array):
    """The cache holding the first `keep[b]` draft tokens of row b."""
    return self.replace(lengths=journal + keep)

