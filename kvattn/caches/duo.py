"""DuoAttention-style head split: retrieval heads keep every token, streaming heads a sink + ring.

DuoAttention (Xiao et al. 2024, "DuoAttention: Efficient Long-Context LLM Inference with
Retrieval and Streaming Heads", arXiv 2410.10819): only some KV heads ("retrieval heads") need
the whole context; the others ("streaming heads") do as well with StreamingLLM's attention sinks
plus a window of recent tokens. `DuoKVCache` stores the two kinds apart, so the bytes fall with
the streaming fraction: a full `[B, Kr, S, H]` cache for the retrieval KV heads and a
`[B, Ks, num_sinks + window, H]` sink + ring for the streaming ones. Keys keep the RoPE of
their original positions (DuoAttention's streaming heads drop the middle tokens; they do not
re-rotate as StreamingLLM's `SinkKVCache` does), and a streaming head's query at token p
attends the tokens `< num_sinks` and those in `(p - window, p]`, for any chunking.

Head roles. DuoAttention learns a gate per KV head on synthetic passkey retrieval; here the
roles come from a short calibration on the model itself (`calibrate`): per KV head, the
attention mass its query heads put outside the sinks and the window (what restricting it to a
streaming head would lose; it bounds the change of the output, `|o - o'| <= 2 lost max|v|`),
averaged over the queries past `num_sinks + window`. The `streaming_fraction` of all the
model's KV heads with the smallest loss become streaming (one global quantile, as the paper
sparsifies its gates). The default sample needs no tokenizer: seeded random token ids, repeated
once -- the second copy can only be predicted by attending back to the first, which is what
retrieval (induction) heads do; `calibrate(model, tokens)` takes real text instead.
"""

from __future__ import annotations

import weakref
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from kvattn import _checks
from kvattn.caches import _slots
from kvattn.caches import capabilities
from kvattn.caches import dense as cache_lib
from kvattn.caches import registry
from kvattn.caches._bounded import (CheckedStep, check_implementation, concat, encode_new,
                                    min_window, new_positions, scale_kwargs, scatter_slots)
from kvattn.caches._layers import cache_owners, gqa_layers
from kvattn.ops.positional import positional_attention
from kvattn.ops.rope import apply_rope

CALIBRATION_TOKENS = 256
"""Tokens of the default calibration sample (two copies of 128 random ids)."""


def ring_slots(lengths, new_lengths, num_tokens: int, num_sinks: int, ring: int) -> jax.Array:
  """`i32[B, T]`: the sink + ring slot of each new token (token p < num_sinks in slot p, later
  ones in `num_sinks + (p - num_sinks) % ring`), or `num_sinks + ring` (dropped) for padding
  and for tokens a later token of the chunk overwrites."""
  t = jnp.arange(num_tokens, dtype=jnp.int32)[None, :]
  p = lengths[:, None] + t
  end = (lengths + new_lengths)[:, None]
  sink = p < num_sinks
  keep = (t < new_lengths[:, None]) & (sink | (p >= end - ring))
  return jnp.where(keep, jnp.where(sink, p, num_sinks + (p - num_sinks) % ring),
                   num_sinks + ring)


@struct.dataclass
class DuoKVCache(CheckedStep, _slots.Slots, capabilities.Rows):
  """One layer: a full cache for the retrieval KV heads, a sink + ring for the streaming ones.

  Attributes:
    k_full, v_full: `[B, Kr, S, H]` retrieval heads' keys (RoPE'd) and values, token t in slot t.
    k_ring, v_ring: `[B, Ks, C, H]` streaming heads', C = num_sinks + ring slots.
    pos: `i32[B, C]` the token each ring slot holds, -1 for none.
    lengths: `i32[B]` tokens written per sequence (at most S: the retrieval heads' capacity).
    k_full_scale, v_full_scale, k_ring_scale, v_ring_scale: `f32[B, Kr|Ks, S|C]` scales of an
      int8 / fp8 cache, else None.
    streaming: static `tuple[bool]` per KV head, True for a streaming head.
    num_sinks, window: static; a streaming head attends tokens `< num_sinks` and the last
      `window` (the ring holds `min(window, S - num_sinks)` of them: it never needs more).
  """

  k_full: jax.Array
  v_full: jax.Array
  k_ring: jax.Array
  v_ring: jax.Array
  pos: jax.Array
  lengths: jax.Array
  k_full_scale: jax.Array | None = None
  v_full_scale: jax.Array | None = None
  k_ring_scale: jax.Array | None = None
  v_ring_scale: jax.Array | None = None
  streaming: tuple = struct.field(pytree_node=False, default=())
  num_sinks: int = struct.field(pytree_node=False, default=4)
  window: int = struct.field(pytree_node=False, default=64)

  _SIZES = {"batch": ("k_full", 0), "capacity": ("k_full", 2), "head_dim": ("k_full", 3)}
  _VALUES = ("k_full", "v_full", "k_ring", "v_ring")
  _SCALES = ("k_full_scale", "v_full_scale", "k_ring_scale", "v_ring_scale")
  ATTENDS_AFTER_UPDATE = False
  chunk_equals_steps = True
  """Both parts are exact for any chunking (full attention; sinks + window by position)."""

  @classmethod
  def init(cls, batch: int, max_len: int, streaming, head_dim: int, dtype=jnp.float32, *,
           num_sinks: int = 4, window: int = 64) -> "DuoKVCache":
    """An empty cache; `streaming: bool[K]` says which KV heads stream.

    Raises:
      ValueError: naming a bad size, `streaming` that is not a non-empty sequence of bools,
        `num_sinks` < 0 or `window` < 1. TypeError: a dtype neither floating nor int8 / fp8.
    """
    batch = _checks.positive_int("batch", batch)
    max_len = _checks.positive_int("max_len", max_len)
    head_dim = _checks.positive_int("head_dim", head_dim)
    streaming = check_streaming(streaming)
    if isinstance(num_sinks, bool) or not isinstance(num_sinks, (int, np.integer)) or \
        num_sinks < 0:
      raise ValueError(f"num_sinks must be an int >= 0; got {num_sinks!r}")
    window = _checks.positive_int("window", window)
    dtype = cache_lib.check_storage_dtype(dtype)
    ring = min(window, max(max_len - int(num_sinks), 1))
    kr = sum(not s for s in streaming)
    ks = len(streaming) - kr
    full, rings = (batch, kr, max_len), (batch, ks, int(num_sinks) + ring)
    zeros = lambda shape: jnp.zeros(shape + (head_dim,), dtype)
    return cls(k_full=zeros(full), v_full=zeros(full), k_ring=zeros(rings), v_ring=zeros(rings),
               pos=jnp.full((batch, rings[2]), -1, jnp.int32), lengths=jnp.zeros((batch,), jnp.int32),
               k_full_scale=cache_lib.scale_init(full, dtype),
               v_full_scale=cache_lib.scale_init(full, dtype),
               k_ring_scale=cache_lib.scale_init(rings, dtype),
               v_ring_scale=cache_lib.scale_init(rings, dtype),
               streaming=streaming, num_sinks=int(num_sinks), window=window)

  @property
  def num_kv_heads(self) -> int:
    return len(self.streaming)

  @property
  def head_dim(self) -> int:
    return self.k_full.shape[3]

  @property
  def ring(self) -> int:
    """Ring slots after the sinks."""
    return self.k_ring.shape[2] - self.num_sinks

  @property
  def overflowed(self) -> jax.Array:
    """`bool[B]`: rows written past the retrieval heads' capacity under jit."""
    return self.lengths > self.capacity

  def analytic_bytes_per_token(self) -> float:
    """Bytes per token slot of S: `(Kr S + Ks C) (2 H itemsize + 2 scale bytes) / S`."""
    per_head = 2 * (self.head_dim * self.dtype.itemsize
                    + (4 if self.quantized else 0))
    kr = self.k_full.shape[1]
    return (kr * self.capacity + (self.num_kv_heads - kr) * self.k_ring.shape[2]) * per_head \
        / self.capacity

  def slot_positions(self) -> jax.Array:
    """`i32[B, K, S]`: per KV head the token of each slot (a streaming head's C ring slots
    first, the rest -1)."""
    full = _slots.slot_positions(self.lengths, self.capacity)
    ring = jnp.pad(self.pos, [(0, 0), (0, max(0, self.capacity - self.pos.shape[1]))],
                   constant_values=-1)[:, :self.capacity]
    return jnp.stack([ring if s else full for s in self.streaming], axis=1)

  def check_state(self, name: str = "cache") -> None:
    """Eager check: `lengths` in `[0, S]` and the ring's `pos` exactly what it keeps then.

    Raises:
      ValueError: naming the leaf and slot.
    """
    _checks.values_in_range(f"{name} lengths", self.lengths, 0, self.capacity)
    if not (_checks.is_concrete(self.lengths) and _checks.is_concrete(self.pos)):
      return
    lengths = np.asarray(self.lengths).astype(np.int64)
    slots = np.asarray(ring_slots(jnp.zeros_like(self.lengths), self.lengths, self.capacity,
                                  self.num_sinks, self.ring))
    want = np.full(self.pos.shape, -1)
    for b in range(want.shape[0]):
      held = slots[b] < want.shape[1]
      want[b, slots[b][held]] = np.arange(self.capacity)[held]
    pos = np.asarray(self.pos)
    if (pos != want).any():
      b, s = (int(x) for x in np.argwhere(pos != want)[0])
      raise ValueError(f"{name} pos[{b}, {s}] = {pos[b, s]}, but a ring holding {lengths[b]} "
                       f"tokens keeps token {want[b, s]} there (-1: none)")

  def _heads(self, x: jax.Array, retrieval: bool) -> jax.Array:
    """The query heads `[B, T, N, H]` of the retrieval (or streaming) KV heads, in order."""
    groups = x.shape[2] // self.num_kv_heads
    parts = [x[:, :, i * groups:(i + 1) * groups] for i, s in enumerate(self.streaming)
             if s != retrieval]
    return jnp.concatenate(parts, axis=2)

  def _merge(self, out_full, out_ring, like):
    groups = like.shape[2] // self.num_kv_heads
    parts, i_full, i_ring = [], 0, 0
    for s in self.streaming:
      if s:
        parts.append(out_ring[:, :, i_ring * groups:(i_ring + 1) * groups])
        i_ring += 1
      else:
        parts.append(out_full[:, :, i_full * groups:(i_full + 1) * groups])
        i_full += 1
    return jnp.concatenate(parts, axis=2).astype(like.dtype)

  def _write(self, kq, vq, ks, vs, new_lengths) -> "DuoKVCache":
    """Encoded new tokens `[B, K, T, ...]` into both parts; `lengths` advanced (eager overflow
    raises, as the dense cache)."""
    retrieval = [i for i, s in enumerate(self.streaming) if not s]
    streams = [i for i, s in enumerate(self.streaming) if s]
    pick = lambda x, idx: None if x is None else x[:, jnp.asarray(idx, jnp.int32)]
    lengths = cache_lib.advance_lengths(self.lengths, new_lengths, self.capacity)
    num_tokens = kq.shape[2]
    slots = ring_slots(self.lengths, new_lengths, num_tokens, self.num_sinks, self.ring)
    rows = jnp.broadcast_to(jnp.arange(self.batch, dtype=jnp.int32)[:, None], slots.shape)
    new_pos = new_positions(self.lengths, new_lengths, num_tokens)
    ring = lambda buf, new: None if buf is None else scatter_slots(buf, new, slots)
    full = lambda buf, new: None if buf is None else cache_lib.write_tokens(
        buf, jnp.swapaxes(new, 1, 2), self.lengths, new_lengths, slot_axis=2)
    return self.replace(
        k_full=full(self.k_full, pick(kq, retrieval)), v_full=full(self.v_full, pick(vq, retrieval)),
        k_full_scale=full(self.k_full_scale, pick(ks, retrieval)),
        v_full_scale=full(self.v_full_scale, pick(vs, retrieval)),
        k_ring=ring(self.k_ring, pick(kq, streams)), v_ring=ring(self.v_ring, pick(vq, streams)),
        k_ring_scale=ring(self.k_ring_scale, pick(ks, streams)),
        v_ring_scale=ring(self.v_ring_scale, pick(vs, streams)),
        pos=self.pos.at[rows, slots].set(new_pos, mode="drop"), lengths=lengths)

  def _attend_parts(self, q, q_pos, full_pos, ring_parts, *, sm_scale, window, soft_cap):
    """Retrieval query heads against the full part (`full_pos i32[B, S']`), streaming ones
    against `ring_parts = (k, v, k_scale, v_scale, pos)` with sinks + window."""
    out_full = out_ring = None
    if not all(self.streaming):
      out_full, _ = positional_attention(
          self._heads(q, True), self.k_full, self.v_full, q_pos, full_pos, sm_scale=sm_scale,
          window=window, soft_cap=soft_cap, **scale_kwargs(self.k_full_scale, self.v_full_scale))
    if any(self.streaming):
      k, v, k_scale, v_scale, pos = ring_parts
      sinks = (pos >= 0) & (pos < self.num_sinks) if window is None else None
      out_ring, _ = positional_attention(
          self._heads(q, False), k, v, q_pos, pos, sm_scale=sm_scale,
          window=min_window(window, self.window), soft_cap=soft_cap, always_visible=sinks,
          **scale_kwargs(k_scale, v_scale))
    return self._merge(out_full, out_ring, q)

  def update_attend_unchecked(self, q, k, v, *, positions, rope_theta, rope_scaling=None,
                              new_lengths, sm_scale=None, window=None, soft_cap=None,
                              implementation=None):
    """RoPE at `positions`; the chunk is written into the full part and attends it there; the
    streaming heads attend their ring plus the chunk (before the chunk may overwrite the
    ring), then the ring is written. Returns `(out [B, T, N, H], new cache)`."""
    check_implementation(self, implementation)
    _checks.values_in_range("cache lengths", self.lengths, 0, self.capacity)
    rope = dict(rope_theta=rope_theta, scaling=rope_scaling)
    q, k = apply_rope(q, positions, **rope), apply_rope(k, positions, **rope)
    kq, vq, ks, vs = encode_new(self, k, v)
    num_tokens = k.shape[1]
    new = self._write(kq, vq, ks, vs, new_lengths)
    q_pos = self.lengths[:, None] + jnp.arange(num_tokens, dtype=jnp.int32)[None, :]
    streams = jnp.asarray([i for i, s in enumerate(self.streaming) if s], jnp.int32)
    pick = lambda x: None if x is None else x[:, streams]
    new_pos = new_positions(self.lengths, new_lengths, num_tokens)
    ring_parts = (concat(self.k_ring, pick(kq)), concat(self.v_ring, pick(vq)),
                  concat(self.k_ring_scale, pick(ks)), concat(self.v_ring_scale, pick(vs)),
                  jnp.concatenate([self.pos, new_pos], axis=1))
    out = new._attend_parts(  # pylint: disable=protected-access
        q, q_pos, _slots.slot_positions(new.lengths, self.capacity), ring_parts,
        sm_scale=sm_scale, window=window, soft_cap=soft_cap)
    return out, new

  def update(self, k_new, v_new, new_lengths=None) -> "DuoKVCache":
    """Writes `k_new, v_new: [B, T, K, H]` (RoPE'd) for `t < new_lengths[b]`."""
    return self.update_unchecked(k_new, v_new,
                                 cache_lib.check_new_kv(self, k_new, v_new, new_lengths))

  def update_unchecked(self, k_new, v_new, new_lengths) -> "DuoKVCache":
    _checks.values_in_range("cache lengths", self.lengths, 0, self.capacity)
    return self._write(*encode_new(self, k_new, v_new), new_lengths)

  def attend(self, q, *, q_offsets, sm_scale=None, window=None, soft_cap=None,
             implementation=None) -> jax.Array:
    """Queries `q: [B, T, N, H]` (RoPE'd) at tokens `q_offsets[b] + t` after `update`."""
    check_implementation(self, implementation)
    q_pos = q_offsets[:, None] + jnp.arange(q.shape[1], dtype=jnp.int32)[None, :]
    ring_parts = (self.k_ring, self.v_ring, self.k_ring_scale, self.v_ring_scale, self.pos)
    return self._attend_parts(q, q_pos, _slots.slot_positions(self.lengths, self.capacity),
                              ring_parts, sm_scale=sm_scale, window=window, soft_cap=soft_cap)


def check_streaming(streaming) -> tuple[bool, ...]:
  """`streaming` as a tuple of bools (one per KV head); ValueError naming it otherwise."""
  try:
    out = tuple(streaming)
  except TypeError:
    out = None
  if not out or not all(isinstance(s, (bool, np.bool_)) for s in out):
    raise ValueError(f"streaming must be a non-empty sequence of bools (one per KV head, True: "
                     f"a streaming head); got {streaming!r}")
  return tuple(bool(s) for s in out)


# ----------------------------------------------------------------------------------------------
# Calibration.


@struct.dataclass
class _Probe(_slots.Slots, _slots.KVHeads, capabilities.Rows):
  """A one-chunk stand-in cache recording, per KV head, the attention mass a streaming head
  would lose (`loss f32[B, K]`); attention itself is exact (the dense causal result)."""

  k: jax.Array
  lengths: jax.Array
  loss: jax.Array
  num_sinks: int = struct.field(pytree_node=False, default=4)
  window: int = struct.field(pytree_node=False, default=64)

  _SIZES = {"batch": ("k", 0), "num_kv_heads": ("k", 1), "capacity": ("k", 2),
            "head_dim": ("k", 3)}
  _VALUES, _SCALES = ("k",), (None,)

  @property
  def quantized(self) -> bool:
    return False

  def slot_positions(self):
    return _slots.slot_positions(self.lengths, self.capacity)

  def update(self, k_new, v_new, new_lengths=None):
    raise NotImplementedError("a calibration probe runs through update_attend only")

  def attend(self, q, **options):
    raise NotImplementedError("a calibration probe runs through update_attend only")

  def update_attend_unchecked(self, q, k, v, *, positions, rope_theta, rope_scaling=None,
                              new_lengths, sm_scale=None, window=None, soft_cap=None,
                              implementation=None):
    del implementation
    rope = dict(rope_theta=rope_theta, scaling=rope_scaling)
    q, k = apply_rope(q, positions, **rope), apply_rope(k, positions, **rope)
    num_tokens = k.shape[1]
    pos = new_positions(jnp.zeros_like(new_lengths), new_lengths, num_tokens)  # [B, T]
    kh, vh = jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)
    out, _ = positional_attention(q, kh, vh, pos, pos, sm_scale=sm_scale, window=window,
                                  soft_cap=soft_cap)
    batch, _, num_heads, head_dim = q.shape
    groups = num_heads // self.num_kv_heads
    qg = q.reshape(batch, num_tokens, self.num_kv_heads, groups, head_dim)
    scale = head_dim ** -0.5 if sm_scale is None else sm_scale
    logits = jnp.einsum("BTKGH,BKSH->BKGTS", qg, kh, preferred_element_type=jnp.float32) * scale
    if soft_cap is not None:
      logits = soft_cap * jnp.tanh(logits / soft_cap)
    qp, kp = pos[:, None, None, :, None], pos[:, None, None, None, :]
    mask = (kp >= 0) & (kp <= qp) & (qp >= 0)
    if window is not None:
      mask &= kp > qp - window
    probs = jax.nn.softmax(jnp.where(mask, logits, -jnp.inf), axis=-1)
    probs = jnp.where(mask, probs, 0.0)
    kept = (kp < self.num_sinks) | (kp > qp - self.window)
    lost = jnp.sum(jnp.where(kept, 0.0, probs), axis=-1)  # [B, K, G, T]
    counted = (pos >= self.num_sinks + self.window)[:, None, None, :]
    loss = jnp.sum(lost * counted, axis=(2, 3)) / jnp.maximum(
        jnp.sum(counted, axis=(2, 3)) * groups, 1)
    return out, self.replace(loss=loss, lengths=self.lengths + new_lengths)


def head_losses(model, tokens, *, num_sinks: int, window: int) -> np.ndarray:
  """`f32[L, K]`: per layer owning a cache and KV head, the attention mass its queries put
  outside the first `num_sinks` tokens and the last `window` (mean over the queries past
  `num_sinks + window` and the rows of `tokens: i32[B, T]`).

  Raises:
    ValueError: `tokens` not `[B, T]` ints with T > num_sinks + window.
  """
  tokens = jnp.asarray(tokens)
  if tokens.ndim != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer):
    raise ValueError(f"tokens must be i32[B, T]; got {tokens.dtype}{list(tokens.shape)}")
  if tokens.shape[1] <= num_sinks + window:
    raise ValueError(f"tokens must be longer than num_sinks + window = {num_sinks + window} "
                     f"(no query would lose anything); got T = {tokens.shape[1]}")
  batch, num_tokens = tokens.shape
  probes = tuple(_Probe(k=jnp.zeros((batch, a.num_kv_heads, num_tokens, a.head_dim)),
                        lengths=jnp.zeros((batch,), jnp.int32),
                        loss=jnp.zeros((batch, a.num_kv_heads)), num_sinks=num_sinks,
                        window=window) for a in gqa_layers(model))
  graphdef, state = nnx.split(model)
  forward = jax.jit(lambda state, tokens, probes: nnx.merge(graphdef, state)(tokens, probes)[1])
  probes = forward(state, tokens, probes)
  return np.stack([np.asarray(p.loss).mean(0) for p in probes])


def default_sample(model, *, seed: int = 0) -> np.ndarray:
  """`i32[1, CALIBRATION_TOKENS]`: seeded random token ids below the model's vocabulary, the
  first half repeated (module docstring)."""
  vocab = int(getattr(model, "vocab_size", 256))
  half = np.random.default_rng(seed).integers(0, vocab, CALIBRATION_TOKENS // 2)
  return np.concatenate([half, half])[None].astype(np.int32)


def streaming_pattern(losses, streaming_fraction: float) -> tuple[tuple[bool, ...], ...]:
  """Per layer `tuple[bool]` (True: streaming) for `losses: f32[L, K]`: the
  `round(streaming_fraction * L * K)` heads of smallest loss (ties: lower layer, then head).

  Raises:
    ValueError: `streaming_fraction` outside [0, 1].
  """
  if isinstance(streaming_fraction, bool) or not isinstance(
      streaming_fraction, (int, float, np.integer, np.floating)) or not \
      0 <= float(streaming_fraction) <= 1:
    raise ValueError(f"streaming_fraction must be a number in [0, 1]; got "
                     f"{streaming_fraction!r}")
  losses = np.asarray(losses, np.float64)
  count = int(round(float(streaming_fraction) * losses.size))
  order = np.lexsort((np.arange(losses.size), losses.ravel()))[:count]
  flat = np.zeros(losses.size, bool)
  flat[order] = True
  return tuple(tuple(bool(x) for x in row) for row in flat.reshape(losses.shape))


_CALIBRATED: dict[int, tuple[Any, dict]] = {}
"""id(attention module) -> (a weak reference to the module, {(num_sinks, window): its loss
f32[K]}), filled by `calibrate`: the builder reads it for the layers it is given (a stand-in of
some layers, too). Weak, so a calibrated model is still freed."""


def calibrate(model, tokens=None, *, num_sinks: int = 4, window: int = 64,
              streaming_fraction: float = 0.5) -> tuple[tuple[bool, ...], ...]:
  """Head roles for `model` (a `kvattn.Transformer`): per layer owning a cache, `bool[K]`,
  True for a streaming head (`head_losses` on `tokens`, default `default_sample`, then
  `streaming_pattern`). The losses are remembered per attention module for the builder.

  Raises:
    ValueError: bad `tokens`, `streaming_fraction`, `num_sinks` or `window`.
  """
  window = _checks.positive_int("window", window)
  if isinstance(num_sinks, bool) or not isinstance(num_sinks, (int, np.integer)) or num_sinks < 0:
    raise ValueError(f"num_sinks must be an int >= 0; got {num_sinks!r}")
  losses = head_losses(model, default_sample(model) if tokens is None else tokens,
                       num_sinks=int(num_sinks), window=window)
  for attn, row in zip(gqa_layers(model), losses):
    entry = _CALIBRATED.get(id(attn))
    if entry is None or entry[0]() is not attn:  # new, or an id reused by a freed module
      entry = _CALIBRATED[id(attn)] = (weakref.ref(attn), {})
    entry[1][(int(num_sinks), window)] = row
  return streaming_pattern(losses, streaming_fraction)


def _parse_pattern(pattern, num_layers: int) -> tuple[tuple[bool, ...], ...]:
  """A pattern option: per layer a string of 'S' (streaming) / 'R' (retrieval) joined by ',',
  or a sequence of per-layer bool sequences."""
  if isinstance(pattern, str):
    rows = pattern.split(",")
    if not all(row and set(row) <= {"S", "R"} for row in rows):
      raise ValueError(f"pattern must be per-layer strings of 'S' (streaming) and 'R' "
                       f"(retrieval) joined by ','; got {pattern!r}")
    out = tuple(tuple(c == "S" for c in row) for row in rows)
  else:
    out = tuple(check_streaming(row) for row in pattern)
  if len(out) != num_layers:
    raise ValueError(f"pattern must give {num_layers} layers; got {len(out)}")
  return out


def build(model, batch, max_len, dtype, o, tokens_per_seq) -> tuple[DuoKVCache, ...]:
  """The "duo" kind's builder: the pattern option, or roles calibrated on `model` (once per
  model and sinks / window; `calibrate` may have run on the full model before)."""
  del tokens_per_seq
  num_sinks = 4 if o.get("num_sinks") is None else o["num_sinks"]
  window = 64 if o.get("window") is None else o["window"]
  attns = gqa_layers(model)
  if o.get("pattern") is not None:
    pattern = _parse_pattern(o["pattern"], len(attns))
  else:
    key = (num_sinks, window)
    known = [_CALIBRATED.get(id(a)) for a in attns]
    if not all(entry and entry[0]() is a and key in entry[1] for entry, a in zip(known, attns)):
      if not callable(model) or cache_owners(model) is not model:
        raise ValueError("pattern must be set, or calibrate(model) run first, for a subset of "
                         "a model's layers (local_layers='ring', cross-layer sharing)")
      calibrate(model, num_sinks=num_sinks, window=window)
      known = [_CALIBRATED[id(a)] for a in attns]
    losses = np.stack([entry[1][key] for entry in known])
    fraction = 0.5 if o.get("streaming_fraction") is None else o["streaming_fraction"]
    pattern = streaming_pattern(losses, fraction)
  for i, (a, row) in enumerate(zip(attns, pattern)):
    if len(row) != a.num_kv_heads:
      raise ValueError(f"pattern layer {i} must give {a.num_kv_heads} KV heads; got {len(row)}")
  return tuple(DuoKVCache.init(batch, max_len, row, a.head_dim, dtype, num_sinks=num_sinks,
                               window=window) for a, row in zip(attns, pattern))


registry.register_cache_kind("duo", registry.CacheKind(
    build, {"num_sinks": None, "window": None, "streaming_fraction": None, "pattern": None},
    "DuoKVCache: retrieval heads keep every token, streaming heads num_sinks + window "
    "(roles calibrated on the model, or `pattern`)"))
