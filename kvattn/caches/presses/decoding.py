"""Compression during decoding: evict only when the storage is full, back to a target size.

kvpress's `DecodingPress` compresses the cache every `compression_interval` decoding steps back
to `target_size` tokens, the cache growing in between. Here any eviction policy runs that way as
its own kind "decoding_<policy>" (`DecodingKVCache`): `budget` slots per row and KV head hold
`target = budget - compression_interval` tokens plus a buffer of `compression_interval`; a write
that fits keeps every token (nothing is scored away), a write that does not fit keeps the policy's
best `target` of the kept and new tokens (the protected sinks and recent window among them), so
storage is `target + compression_interval` and a decode loop compresses once every
`compression_interval + 1` tokens (kvpress: every `compression_interval`, its buffer held past
the target before compressing; a prefill chunk larger than the budget is compressed here too,
where kvpress leaves prefill to another press). A kind rather than an option: the policy table's
options are the policies' own, and the kind's capacity is the storage.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from kvattn import _checks
from kvattn.caches import eviction, registry
from kvattn.caches._layers import gqa_layers

PREFIX = "decoding_"


@struct.dataclass
class DecodingKVCache(eviction.EvictingKVCache):
  """An `EvictingKVCache` that evicts only when full, back to `budget - compression_interval`.

  Attributes:
    compression_interval: static, the buffer of slots above the target size.
  """

  compression_interval: int = struct.field(pytree_node=False, default=1)

  CONTEXT_REPLAYABLE = False  # capabilities.context_replayable: evicts inside its prefill

  @classmethod
  def init(cls, batch: int, budget: int, num_kv_heads: int, head_dim: int, dtype=jnp.float32,
           *, policy: str, compression_interval: int | None = None,
           **policy_options) -> "DecodingKVCache":
    """An empty cache of `budget` slots (target `budget - compression_interval`).

    Raises:
      ValueError: compression_interval not in `[1, budget - 1]`, protected sinks and window
        larger than the target; the `EvictingKVCache` errors.
    """
    budget = _checks.positive_int("budget", budget)
    interval = max(1, budget // 5) if compression_interval is None else compression_interval
    if isinstance(interval, bool) or not isinstance(interval, (int, np.integer)) or not \
        1 <= interval < budget:
      raise ValueError(f"compression_interval must be an int in [1, budget - 1 = {budget - 1}]; "
                       f"got {interval!r}")
    cache = super().init(batch, budget, num_kv_heads, head_dim, dtype, policy=policy,
                         **policy_options)
    protected = eviction.POLICY_TABLE[policy].protected
    held = cache.option("num_sinks") + (cache.option(protected) if protected else 0)
    if held > budget - interval:
      raise ValueError(f"num_sinks + the recent/observation window ({held}) must fit the target "
                       f"budget - compression_interval = {budget - interval}")
    return cache.replace(compression_interval=int(interval))

  @property
  def target(self) -> int:
    """Tokens kept per row and KV head after a compression."""
    return self.budget - self.compression_interval

  def _select(self, k, v, ks, vs, new_lengths, mass, queries=None, keep_best=None):
    del keep_best
    held = (self.pos[:, 0] >= 0).sum(axis=-1)  # [B]: every KV head holds as many
    full = held + new_lengths > self.budget
    keep = jnp.where(full, self.target, self.budget).astype(jnp.int32)
    return super()._select(k, v, ks, vs, new_lengths, mass, queries, keep_best=keep)

  def check_state(self, name: str = "cache") -> None:
    """Eager check of the bookkeeping: as `EvictingKVCache.check_state` (tokens below
    `lengths`, distinct and sorted, empty slots last, the sinks kept, finite scores), except
    that a row holds between `min(lengths, target)` and `min(lengths, budget)` tokens, as many
    per KV head. Traced: no check.

    Raises:
      ValueError: naming the leaf and slot.
    """
    _checks.values_in_range(f"{name} lengths", self.lengths, 0)
    if not all(_checks.is_concrete(x) for x in (self.lengths, self.pos, self.scores)):
      return
    lengths, pos = np.asarray(self.lengths).astype(np.int64), np.asarray(self.pos)
    count = (pos >= 0).sum(axis=-1)  # [B, K]
    low, high = np.minimum(lengths, self.target)[:, None], np.minimum(lengths, self.budget)[:, None]
    bad = (count < low) | (count > high) | (count != count[:, :1])
    if bad.any():
      b, k = (int(x) for x in np.argwhere(bad)[0])
      raise ValueError(f"{name} pos[{b}, {k}] keeps {int(count[b, k])} tokens; after "
                       f"{int(lengths[b])} tokens a row holds between {int(low[b, 0])} and "
                       f"{int(high[b, 0])}, as many per KV head")
    # Every row as a full EvictingKVCache of its own count: the base checks the rest.
    for b in range(pos.shape[0]):
      held = int(count[b, 0])
      if held:
        row = eviction.EvictingKVCache(
            k=self.k[b:b + 1, :, :held], v=self.v[b:b + 1, :, :held], pos=self.pos[b:b + 1, :, :held],
            scores=self.scores[b:b + 1, :, :held], lengths=self.lengths[b:b + 1],
            policy=self.policy, options=self.options)
        if (pos[b, :, held:] != -1).any():
          raise ValueError(f"{name} pos[{b}] must hold its {held} tokens first, empty slots "
                           f"(-1) last; got {pos[b].tolist()}")
        eviction.EvictingKVCache.check_state(row, f"{name} row {b} of")


def decoding_kind(policy: str) -> registry.CacheKind:
  """The `CacheKind` of `DecodingKVCache(policy=policy)`: `budget` slots per KV head, evicting
  to `budget - compression_interval` when full."""
  options = eviction.policy_options(policy)

  def build(model, batch, max_len, dtype, o, tokens_per_seq):
    del max_len, tokens_per_seq  # bounded: the capacity is the budget
    opts = {k: v for k, v in o.items() if k != "budget" and v is not None}
    return tuple(DecodingKVCache.init(batch, o["budget"], a.num_kv_heads, a.head_dim, dtype,
                                      policy=policy, **opts)
                 for a in gqa_layers(model))

  return registry.CacheKind(
      build, {"budget": registry.REQUIRED, "num_sinks": None, "compression_interval": None,
              **{o: None for o in options}},
      f"DecodingKVCache(policy={policy!r}): `budget` slots per KV head, compressed to "
      "budget - compression_interval when full",
      at_budget=lambda budget, num_sinks: {"budget": budget})


def register(policy: str) -> str:
  """Registers the kind `decoding_<policy>` (once; a second call returns the name).

  Raises:
    ValueError: an unregistered policy.
  """
  name = PREFIX + policy
  if name not in registry.CACHE_KIND_TABLE:
    registry.register_cache_kind(name, decoding_kind(policy))
  return name


register("knorm")
