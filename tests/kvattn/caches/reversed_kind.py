"""A test-only cache kind, added to kvattn by this one file and its registry line.

`ReversedKVCache` stores token t of a sequence in slot S - 1 - t. Nothing in
kvattn knows it: importing this module registers it as cache kind "reversed", and
it then runs through `generate`, `Transformer.init_caches(cache=)`, a
config-driven experiment (`--config.cache.kind=reversed`, with a config file
that imports this module) and the conformance suite (`test_every_kind.py`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from kvattn import ops
from kvattn.caches import dense as cache_lib
from kvattn.caches import registry


def _write_reversed(buffer, new, lengths, new_lengths, *, slot_axis):
  """Writes token `lengths[b] + t` of `new: [B, T, ...]` to slot `S - 1 - (lengths[b] + t)`."""
  batch, num_tokens = new.shape[:2]
  capacity = buffer.shape[slot_axis]
  t = jnp.arange(num_tokens, dtype=jnp.int32)[None, :]
  token = lengths[:, None] + t  # [B, T]
  keep = (t < new_lengths[:, None]) & (token < capacity)
  slots = jnp.where(keep, capacity - 1 - token, capacity)  # capacity = dropped
  rows = jnp.broadcast_to(jnp.arange(batch, dtype=jnp.int32)[:, None], slots.shape)
  index = (rows,) + (slice(None),) * (slot_axis - 1) + (slots,)
  return buffer.at[index].set(new.astype(buffer.dtype), mode="drop")


def _reversed_slot_positions(lengths, capacity):
  token = capacity - 1 - jnp.arange(capacity, dtype=jnp.int32)[None, :]
  return jnp.where(token < lengths[:, None], token, -1)


@struct.dataclass
class ReversedKVCache:
  """Test-only `GQACache`: token t of sequence b sits in slot `S - 1 - t` of
  `k, v: [B, K, S, H]`; `lengths: i32[B]`."""

  k: jax.Array
  v: jax.Array
  lengths: jax.Array

  @classmethod
  def init(cls, batch, max_len, num_kv_heads, head_dim, dtype=jnp.float32, fill=0.0):
    shape = (batch, num_kv_heads, max_len, head_dim)
    return cls(k=jnp.full(shape, fill, dtype), v=jnp.full(shape, fill, dtype),
               lengths=jnp.zeros((batch,), jnp.int32))

  @property
  def batch(self):
    return self.k.shape[0]

  @property
  def num_kv_heads(self):
    return self.k.shape[1]

  @property
  def capacity(self):
    return self.k.shape[2]

  @property
  def head_dim(self):
    return self.k.shape[3]

  @property
  def storage_slots(self):
    return self.batch * self.capacity

  def storage_arrays(self):
    return self.k, self.v

  def slot_positions(self):
    return _reversed_slot_positions(self.lengths, self.capacity)

  def update(self, k_new, v_new, new_lengths=None):
    new_lengths = cache_lib.resolve_new_lengths(new_lengths, *k_new.shape[:2])
    return ReversedKVCache(
        k=_write_reversed(self.k, k_new, self.lengths, new_lengths, slot_axis=2),
        v=_write_reversed(self.v, v_new, self.lengths, new_lengths, slot_axis=2),
        lengths=cache_lib.advance_lengths(self.lengths, new_lengths, self.capacity))

  def attend(self, q, *, q_offsets, sm_scale=None, window=None, soft_cap=None,
             implementation=None):
    k, v = self.k[:, :, ::-1], self.v[:, :, ::-1]  # token order
    opts = dict(sm_scale=sm_scale, window=window, soft_cap=soft_cap)
    if q.shape[1] == 1:
      return ops.decode_attention(q[:, 0], k, v, self.lengths, implementation=implementation,
                                  **opts)[:, None]
    return ops.attention(q, k, v, q_offsets=q_offsets, kv_lengths=self.lengths, **opts)


def _build(model, batch, max_len, dtype, options, tokens_per_seq):
  del options, tokens_per_seq
  if not jnp.issubdtype(dtype, jnp.floating) or jnp.dtype(dtype).itemsize < 2:
    raise TypeError(f"dtype must be a float dtype of 16 bits or more for kind 'reversed' (it "
                    f"stores no scales); got {jnp.dtype(dtype).name}")
  return tuple(ReversedKVCache.init(batch, max_len, a.num_kv_heads, a.head_dim, dtype)
               for a in registry.gqa_layers(model))


if "reversed" not in registry.CACHE_KIND_TABLE:  # the one registry line (module reloads skip it)
  registry.register_cache_kind("reversed", registry.CacheKind(
      _build, {}, "test-only: token t in slot S - 1 - t (tests/kvattn/caches/reversed_kind.py)",
      float_only=True))
