"""A cache that switches a sequence from K KV heads to fewer pooled heads past a length.

The "hybrid attention" of this project's source material: short sequences attend with all K KV
heads, long ones with `num_kv_heads_after` = K' heads, each the mean of a group of K / K' heads --
the GQA paper's conversion (Ainslie et al. 2023, arXiv 2305.13245, §2.1,
`kvattn.models.convert.regroup_kv_heads`) applied to the cache at run time. Query head n reads KV
head n // G before the switch and pooled head n // G' after it (G = N / K, G' = N / K'; contiguous
groups, so pooled head j merges heads `[j f, (j + 1) f)`, f = K / K', and the query groups line up).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from kvattn import _checks
from kvattn.caches import _slots
from kvattn.caches import capabilities
from kvattn.caches import registry
from kvattn.caches._layers import gqa_layers
from kvattn.caches import dense as cache_lib

# Phases of a step (the lax.switch index): which segment the queries read.
FULL, POOLED, MIXED = 0, 1, 2
BRANCHES = ("attend_full", "attend_pooled", "attend_mixed")
"""The attention of each phase (methods of `LengthSwitchKVCache`), by index."""


def check_switch(num_kv_heads: int, num_kv_heads_after: Any,
                 switch_length: Any) -> tuple[int, int]:
  """Validates the switch settings of a cache of `num_kv_heads` heads.

  Returns:
    `(num_kv_heads_after, switch_length)` as ints.

  Raises:
    ValueError: `num_kv_heads_after` not a positive int dividing `num_kv_heads`
      (pooling merges whole groups), `switch_length` not a positive int.
  """
  if isinstance(num_kv_heads_after, bool) or not isinstance(
      num_kv_heads_after, (int, np.integer)) or num_kv_heads_after <= 0 or \
      num_kv_heads % num_kv_heads_after:
    raise ValueError(f"num_kv_heads_after must be a positive int dividing num_kv_heads = "
                     f"{num_kv_heads} (each pooled head is the mean of a group of heads); got "
                     f"{num_kv_heads_after!r}")
  if isinstance(switch_length, bool) or not isinstance(switch_length, (int, np.integer)) or \
      switch_length <= 0:
    raise ValueError(f"switch_length must be a positive int (tokens a sequence holds with all "
                     f"KV heads); got {switch_length!r}")
  return int(num_kv_heads_after), int(switch_length)


def pool_heads(x: jax.Array, num_groups: int, axis: int) -> jax.Array:
  """Mean of each contiguous group of heads along `axis` (K -> `num_groups` heads), in f32."""
  axis = axis % x.ndim
  shape = x.shape[:axis] + (num_groups, x.shape[axis] // num_groups) + x.shape[axis + 1:]
  return jnp.mean(x.astype(jnp.float32).reshape(shape), axis=axis + 1)


@struct.dataclass
class LengthSwitchKVCache(_slots.TokenSlots, _slots.KVHeads, _slots.LengthsRollback,
                          capabilities.Rows):
  """K KV heads for the first `switch_length` tokens of a sequence, K' pooled heads after.

  Attributes:
    k: `[B, K, switch_length, H]` the full segment's keys (RoPE'd), token t in slot t for t <
      switch_length.
    v: `[B, K, switch_length, H]` its values.
    k_pooled: `[B, K', S, H]` every token's pooled key (mean of its group's RoPE'd keys), token t in
      slot t.
    v_pooled: `[B, K', S, H]` pooled values.
    lengths: `i32[B]` tokens written per sequence (> `switch_length`: the sequence has switched);
      exceeds S only after an overflow under jit.
    k_scale, v_scale: `f32[B, K, switch_length]` scales of an int8/fp8 cache, else None.
    k_pooled_scale, v_pooled_scale: `f32[B, K', S]` likewise.
  """

  k: jax.Array
  v: jax.Array
  k_pooled: jax.Array
  v_pooled: jax.Array
  lengths: jax.Array
  k_scale: jax.Array | None = None
  v_scale: jax.Array | None = None
  k_pooled_scale: jax.Array | None = None
  v_pooled_scale: jax.Array | None = None

  @classmethod
  def init(cls, batch: int, max_len: int, num_kv_heads: int, head_dim: int,
           dtype=jnp.float32, *, switch_length: int,
           num_kv_heads_after: int) -> "LengthSwitchKVCache":
    """An empty cache: zeros, `lengths == 0`.

    Args:
      batch: sequences B.
      max_len: tokens one sequence can hold (S, the pooled segment's slots).
      num_kv_heads: K, the layer's KV heads (the full segment's).
      head_dim: H.
      dtype: storage dtype: floating, or int8 / float8_e4m3fn / float8_e5m2 (values plus f32
        scales).
      switch_length: tokens a sequence holds with all K heads; its token `switch_length` and later
        ones read the pooled heads. A positive int; from `max_len` on the sequences never switch
        (the full segment has `min(switch_length, max_len)` slots).
      num_kv_heads_after: K' pooled heads; must divide K.

    Raises:
      ValueError: a size (switch_length included) that is not a positive int; `num_kv_heads_after`
        not dividing `num_kv_heads`.
      TypeError: a dtype that is neither floating nor a quantized format.
    """
    batch = _checks.positive_int("batch", batch)
    max_len = _checks.positive_int("max_len", max_len)
    num_kv_heads = _checks.positive_int("num_kv_heads", num_kv_heads)
    head_dim = _checks.positive_int("head_dim", head_dim)
    after, switch_length = check_switch(num_kv_heads, num_kv_heads_after, switch_length)
    dtype = cache_lib.check_storage_dtype(dtype)
    full = (batch, num_kv_heads, min(switch_length, max_len), head_dim)
    pooled = (batch, after, max_len, head_dim)
    return cls(k=jnp.zeros(full, dtype), v=jnp.zeros(full, dtype),
               k_pooled=jnp.zeros(pooled, dtype), v_pooled=jnp.zeros(pooled, dtype),
               lengths=jnp.zeros((batch,), jnp.int32),
               k_scale=cache_lib.scale_init(full[:3], dtype),
               v_scale=cache_lib.scale_init(full[:3], dtype),
               k_pooled_scale=cache_lib.scale_init(pooled[:3], dtype),
               v_pooled_scale=cache_lib.scale_init(pooled[:3], dtype))

  # -- sizes and the protocol's bookkeeping (`_slots`, from this layout) ---------------------

  _SIZES = {"batch": ("k", 0), "num_kv_heads": ("k", 1), "head_dim": ("k", 3),
            "capacity": ("k_pooled", 2)}  # K: the heads the layer projects (full segment)
  _VALUES = ("k", "v", "k_pooled", "v_pooled")
  _SCALES = ("k_scale", "v_scale", "k_pooled_scale", "v_pooled_scale")
  max_len = _slots.Slots.capacity  # S, the pooled segment's slots

  @property
  def num_kv_heads_after(self) -> int:
    """K': the pooled heads read after the switch."""
    return self.k_pooled.shape[1]

  @property
  def switch_length(self) -> int:
    """Tokens a sequence holds with all K heads (the full segment's slots)."""
    return self.k.shape[2]

  @property
  def switched(self) -> jax.Array:
    """`bool[B]`: rows holding more than `switch_length` tokens (their queries read the
    pooled heads)."""
    return self.lengths > self.switch_length

  def storage_bytes(self) -> int:
    """The two-segment formula: `B (K switch_length + K' S) 2 (H itemsize + scale bytes)`.
    (`storage_slots` is B * S, the tokens the cache can hold: the full segment is extra
    bytes per token, so `kvattn.memory.measured_bytes_per_token` reports
    `(K switch_length / S + K') 2 H itemsize`.)"""
    scale = 4 if self.quantized else 0
    per_head_token = 2 * (self.head_dim * self.dtype.itemsize + scale)
    return self.batch * (self.num_kv_heads * self.switch_length +
                         self.num_kv_heads_after * self.capacity) * per_head_token

  def full_view(self, lengths: jax.Array) -> cache_lib.KVCache:
    """The full segment as a `KVCache` holding `lengths` tokens (`i32[B]`, <= switch_length)."""
    return cache_lib.KVCache(self.k, self.v, lengths, self.k_scale, self.v_scale)

  def pooled_view(self, lengths: jax.Array) -> cache_lib.KVCache:
    """The pooled segment as a K'-head `KVCache` holding `lengths` tokens."""
    return cache_lib.KVCache(self.k_pooled, self.v_pooled, lengths, self.k_pooled_scale,
                             self.v_pooled_scale)

  # -- writes ---------------------------------------------------------------------------------

  def update(self, k_new: jax.Array, v_new: jax.Array,
             new_lengths: jax.Array | None = None) -> "LengthSwitchKVCache":
    """Writes `k_new, v_new: [B, T, K, H]` (keys RoPE'd) for `t < new_lengths[b]`.

    Raises:
      ValueError: wrong shapes, `new_lengths` outside [0, T], or (concrete
        lengths) a write past `capacity`, before anything is written.
      TypeError: non-floating `k_new` / `v_new`.
    """
    return self.update_unchecked(k_new, v_new,
                                 cache_lib.check_new_kv(self, k_new, v_new, new_lengths))

  def update_unchecked(self, k_new: jax.Array, v_new: jax.Array,
                       new_lengths: jax.Array) -> "LengthSwitchKVCache":
    """`update` for callers that checked its arguments (the module, through
    `cache_protocol.update_attend`); the cache's own state is still checked (eager
    `lengths` and overflow)."""
    lengths = cache_lib.advance_lengths(self.lengths, new_lengths, self.capacity)
    groups = self.num_kv_heads_after

    def write(buffer, new):  # [B, K, S, ...] <- [B, T, K, ...]
      return cache_lib.write_tokens(buffer, new, self.lengths, new_lengths, slot_axis=2)

    # Full segment: only tokens below switch_length (write_tokens drops slots >= its S);
    # pooled segment: the group means of the same keys and values.
    new = (k_new, v_new, pool_heads(k_new, groups, 2), pool_heads(v_new, groups, 2))
    return self.replace(lengths=lengths, **self.written(new, write))

  # -- attention ------------------------------------------------------------------------------

  def phase(self, q_offsets: jax.Array) -> jax.Array:
    """`i32[]` the step's phase, called on the updated cache with the lengths before
    the update: FULL (every row holds <= switch_length tokens after it: every query
    reads the full heads), POOLED (every row held >= switch_length before it: every
    query reads the pooled heads), else MIXED."""
    sl = self.switch_length
    full = jnp.all(self.lengths <= sl)
    pooled = jnp.all(q_offsets >= sl)
    return jnp.where(full, FULL, jnp.where(pooled, POOLED, MIXED)).astype(jnp.int32)

  def attend_full(self, q, q_offsets, **opts) -> jax.Array:
    """Every query against the full segment (valid when no row has switched)."""
    view = self.full_view(jnp.minimum(self.lengths, self.switch_length))
    return view.attend(q, q_offsets=q_offsets, **opts)

  def attend_pooled(self, q, q_offsets, **opts) -> jax.Array:
    """Every query against the pooled segment alone (valid when every row had switched)."""
    return self.pooled_view(self.lengths).attend(q, q_offsets=q_offsets, **opts)

  def attend_mixed(self, q, q_offsets, **opts) -> jax.Array:
    """Query t of row b (token `q_offsets[b] + t`) against the full segment when its
    token is below `switch_length`, else against the pooled segment."""
    sl = self.switch_length
    full = self.full_view(jnp.minimum(self.lengths, sl)).attend(q, q_offsets=q_offsets, **opts)
    # Rows that have not switched read nothing of the pooled segment (length 0: zeros).
    pooled = self.pooled_view(jnp.where(self.lengths > sl, self.lengths, 0)).attend(
        q, q_offsets=q_offsets, **opts)
    token = q_offsets[:, None] + jnp.arange(q.shape[1], dtype=jnp.int32)[None, :]
    return jnp.where((token >= sl)[:, :, None, None], pooled, full)

  def attend(self, q: jax.Array, *, q_offsets: jax.Array, sm_scale: float | None = None,
             window: int | None = None, soft_cap: float | None = None,
             implementation: str | None = None) -> jax.Array:
    """`GQACache.attend`: queries `q: [B, T, N, H]` (RoPE'd) at tokens `q_offsets[b] + t`, after
    `update` wrote them; a query below `switch_length` reads the K full heads, a later one the K'
    pooled heads (through the dense dispatch points, `ops.decode_attention` for T == 1 with
    `implementation`). Returns `[B, T, N, H]` in q's dtype.
    """
    _checks.rank("q", q, 4, "[B, T, N, H]")
    _checks.head_layout(q.shape[2], self.num_kv_heads)
    q_offsets = jnp.asarray(q_offsets, jnp.int32)
    opts = dict(sm_scale=sm_scale, window=window, soft_cap=soft_cap,
                implementation=implementation)
    # Looked up by name on the class, so a subclass or a test's wrapper is what runs.
    branches = [functools.partial(getattr(type(self), name), **opts) for name in BRANCHES]
    if _checks.is_concrete(self.lengths) and _checks.is_concrete(q_offsets):
      return branches[int(self.phase(q_offsets))](self, q, q_offsets)
    return jax.lax.switch(self.phase(q_offsets), branches, self, q, q_offsets)


def _build(model, batch, max_len, dtype, o, tokens_per_seq):
  del tokens_per_seq
  return tuple(LengthSwitchKVCache.init(
      batch, max_len, a.num_kv_heads, a.head_dim, dtype, switch_length=o["switch_length"],
      num_kv_heads_after=o["num_kv_heads_after"]) for a in gqa_layers(model))


registry.register_cache_kind("length_switch", registry.CacheKind(
    _build, {"switch_length": registry.REQUIRED, "num_kv_heads_after": registry.REQUIRED},
    "LengthSwitchKVCache: K heads up to switch_length, then num_kv_heads_after pooled heads"))
