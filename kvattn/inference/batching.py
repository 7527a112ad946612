"""Continuous batching over a paged KV cache (Orca-style iteration-level scheduling).

Yu et al., "Orca" (OSDI 2022) schedule at the granularity of one decode
iteration: a finished sequence leaves the batch and a waiting one joins
before the next step, instead of the whole batch waiting for its longest
member. PagedAttention (Kwon et al., SOSP 2023) makes that cheap in memory:
a sequence holds only the pages it has filled, so freed pages go straight to
the next request.

`ContinuousBatcher` keeps everything the device sees at static shapes, so
joining and leaving never recompile:

  * `num_slots` fixed batch rows. Each layer's cache is one `PagedKVCache`
    with `num_slots` block-table rows over a shared pool of `num_pages`
    pages; an inactive slot has an empty row and length 0, feeds
    `new_lengths = 0` (writes nothing) and its output is ignored.
  * join (`add`): the host `PageAllocator` gives the prompt its pages, the
    slot's block-table row is set, and one jitted prefill runs the prompt
    (right-padded to the static `max_prompt_len`) for that slot alone: a
    batch-1 view of the cache (the slot's row and length over the shared
    pool) goes through the model and its pool writes land in the slot's pages.
  * decode (`step`): before each step a sequence about to write into a new
    page gets one more page (`PageAllocator.grow`, one jitted row update);
    then one jitted step decodes every slot (`kvattn.ops.paged_decode_attention`).
  * retire: on EOS or `max_new_tokens` the pages go back to the allocator and
    the slot's row is cleared (jitted, slot index traced). `cancel` retires a
    live sequence the same way at any time between calls.

The slot index is always a traced argument, so every jitted function compiles
once (`traces` counts the traces; the tests assert one each).

Greedy decoding gives each sequence exactly the tokens it gets alone
(`kvattn.generate`), whatever joins or leaves around it; with sampling one
key per step is shared by the batch, so samples depend on the schedule.

Prefix cache (`prefix_cache=True`, opt-in): the allocator is a
`kvattn.paging.prefix.PrefixCachingAllocator`. A joining prompt takes the
cached pages of its longest cached prefix of whole pages (never the whole
prompt: its last token is always evaluated) and prefills only the rest,
right-padded to a power-of-two bucket (one compile per bucket used); its
full prompt pages are registered right after its prefill, so requests that
join later share them, and the pages it filled while decoding when it
retires. With `offload=` (a `kvattn.paging.offload.TieredStore`) evicted cached
pages move to host memory / disk and are copied back on a hit. A shared page
sits in several block-table rows, so decode steps use a backend that reads
each row's pages through its own row: layers left at the default
(`decode_implementation=None`) get "pallas" then "xla" where Pallas compiles,
"xla" elsewhere, never "xla_pool" (it inverts the tables into one owner per
page, `kvattn.ops.xla_paged`, and the default picks it when
`num_pages < num_slots * pages_per_seq`); a layer set to "xla_pool" is refused.

On a mesh (`mesh=`): parameters are placed by `kvattn.sharding`'s rules, each
layer's pool is a `kvattn.caches.sharded.ShardedPagedKVCache` split over KV heads on
`model` and, data parallel, over `data`: the slots are split into `d` equal
groups (slot s belongs to data shard `s // (num_slots / d)`) and the pool into
`d` ranges of `num_pages / d` pages, one host allocator per range
(`allocators[j]`), so a slot's rows only ever name pages its own devices hold.
A joining prompt goes to the first data shard with a free slot that can take
it (with the prefix cache: the shard holding its longest cached prefix). The
`seq` axis is not used (the pool is replicated over it).

Per-layer layout (`local_layers="ring"`, for models with sliding-window layers such as
Gemma 2/3's local layers): those layers get a `RingKVCache` of `window` slots per batch slot
instead of pages (a local layer never needs more than W tokens of a sequence, so a fixed
ring is its whole need: no pages, no allocator, nothing to grow); the other layers keep one
page pool each, all under the one block table the allocator fills. Joining resets the
slot's ring row and prefills through its batch-1 view; retiring empties the row. Decided
against pooling local-layer pages (vLLM's sliding-window manager frees pages that slide out
of the window): at W = 512 a ring costs the same bytes as the window's pages and needs no
host bookkeeping per step.

Prefix cache with rings: a hit of m cached tokens needs, besides the global layers' pages,
each local layer's KV of tokens `[m - W, m)`, which no page holds (recomputing it is not
exact: each local layer widens what must be recomputed by W - 1 tokens). So a cached prefix
keeps a snapshot of the rings at its end (`RingSnapshots`: W tokens per local layer, the
allocator's boundary state of the block ending at m, `kvattn.paging.prefix`), and a match
ends at the deepest matched block holding one; the join restores the slot's rings from it
and prefills the rest. Snapshots are taken where a later hit is likely: at the last page
boundary of each prompt (after its prefill) and of each retired sequence (a second turn
hits the whole first conversation); and where a prompt shares cached pages beyond the last
snapshot (a prefix shared with an earlier prompt that diverged there: a common system
prompt), its prefill is split at that boundary and the rings snapshotted there, so the
*next* prompt sharing it hits (the first one that reveals the shared prefix pays it in
full). To snapshot at the last page boundary after the fact, the rings hold
`W + page_size - 1` slots (attention still sees W). At most `max_ring_snapshots` are kept
(LRU; a prefix whose snapshot was dropped no longer ends a match there); `stats()` reports
their count and device bytes. With `offload=` a snapshot leaves with its block: its bytes
follow the page's in the tier payload (counted in the tier's `used_bytes`) and come back
bit-exact on a hit. One device only (a mesh is refused).

Speculative decoding (`speculative=PromptLookup(k, ...)` or `DraftModel(model, k)`, greedy
only): each step drafts k tokens per live slot by prompt lookup over the slot's text
(prompt and output, `kvattn.inference.speculative.prompt_lookup_drafts`) or with the draft
model (dense caches, one row per slot, prefilled with the prompt at join; one device),
verifies `[last, d_1..d_k]` in one
pass through a cache transaction (`kvattn.caches.transaction`; paged caches roll back by
lengths, rings (`local_layers="ring"`) from the transaction's undo log: the slots rejected
drafts overwrote get their old keys, values and positions back, then the kept tokens are
rewritten) and keeps, per slot, the last token and its accepted drafts: each sequence
emits 1..k + 1 tokens per step, token for token what the batcher without speculation
emits. A slot writes at most `min(k + 1, tokens it still owes)` tokens (so the cache never
exceeds `max_len`); before the step its allocation grows to hold them, and after it
shrinks back to the tokens kept (`PageAllocator.shrink`): pages only rejected drafts used
go back to the allocator, so between steps a sequence holds the pages it holds without
speculation. With the prefix cache a slot's pages from its write position on pass
through `PrefixCachingAllocator.prepare_write` first (copy-on-write), so a shared or
registered page is never written; a rejected draft's tokens lie past the row's length,
in pages the row owns alone. `spec_stats` counts slot passes, drafted and accepted
tokens and the pages `shrink` returned.

Low-bit pools (`cache="paged_kivi2"` / `"paged_kivi4"` or a registry spec with KIVI's options,
`kvattn.caches.paged_kivi.PagedKIVICache`): the packed 2/4-bit store lives in the pool, the
full-precision residual ring per slot. The allocator counts store tokens (`g * max(0, (n -
residual) // g)` of n tokens): a sequence gets a page when a flush needs one. With the prefix
cache prompts are prefilled a page at a time, so the state after m pages depends only on
those pages' tokens and a hit restores it bit for bit; only prompt pages are registered. With
a residual R > 0 the shared pages hold the packed store of tokens `[0, m - R)` only: the
newest R tokens of every layer, in full precision, are the block's boundary state
(`ResidualSnapshots`, as the rings' snapshots above: bounded by `max_ring_snapshots`, counted
in `stats()`), restored into the slot's ring on a hit. A flush drops a group's full precision,
so the prefill is split at the prompt's last page boundary and snapshotted there. A hit row
flushes the prefix's last R tokens into the shared pages, the bytes any row continuing that
prefix writes there. Refused with low-bit pools (ValueError naming the option): a mesh with
`prefix_cache` and R > 0, `speculative`, `local_layers="ring"`, `offload`.

Exhaustion: `add` raises `OutOfPagesError` (or `NoFreeSlotError`) before
anything changes; check `can_add` first. If a running sequence cannot get its
next page it is finished early with reason "out_of_pages" (its pages are
freed; a scheduler may resubmit prompt + tokens later). Nothing cached for
other sequences is touched in either case.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any, Hashable, Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kvattn import _checks
from kvattn.training import data as data_lib
from kvattn.paging.allocator import NO_PAGE, OutOfPagesError, PageAllocator, pages_for
from kvattn.caches.registry import LOCAL_LAYER_LAYOUTS, cache_options, gqa_layers
from kvattn.caches import kivi as kivi_lib
from kvattn.caches import paged_kivi
from kvattn.caches.window import RingKVCache
from kvattn.caches import transaction
from kvattn.caches._slots import LengthsRollback
from kvattn.inference import speculative as speculative_lib
from kvattn.inference.generation import Sampling, sample_logits
from kvattn.paging.offload import PageCodec
from kvattn.caches.paged import PagedKVCache
from kvattn.paging.prefix import PrefixCachingAllocator, copy_pages

FINISH_REASONS = ("eos", "length", "out_of_pages", "cancelled")

BATCHER_CACHE_KINDS = ("paged", "paged_kivi2", "paged_kivi4")
"""Registry kinds `ContinuousBatcher(cache=)` takes: the page pools it schedules."""


def batcher_cache(cache: Any, *, page_size: int, seed: int | None) -> tuple[str, dict[str, Any]]:
  """`(kind, options)` of `ContinuousBatcher(cache=)`: None (the paged pool), a kind name or
  a registry spec (`kvattn.caches.registry.cache_options`) of a kind in `BATCHER_CACHE_KINDS`.
  The spec's `page_size` and `seed`, when set, must equal the batcher's (it owns the pool).

  Raises:
    ValueError: another kind, an unknown option, or a `page_size` / `seed` other than the
      batcher's, naming `cache.<key>`.
  """
  if cache is None:
    return "paged", {}
  spec = {"kind": cache} if isinstance(cache, str) else cache
  kind, options = cache_options(spec, "cache")
  if kind not in BATCHER_CACHE_KINDS:
    raise ValueError(f"cache.kind must be one of {BATCHER_CACHE_KINDS} for a ContinuousBatcher "
                     f"(it schedules page pools); got {kind!r}")
  given = spec.to_dict() if hasattr(spec, "to_dict") else dict(spec)
  for key, value in (("page_size", page_size), ("seed", seed)):
    if given.get(key) is not None and given[key] != value:
      raise ValueError(f"cache.{key} must be unset or the batcher's {key} = {value!r} (the "
                       f"batcher owns the pool); got {given[key]!r}")
  options = {k: v for k, v in options.items() if k not in ("page_size", "seed")}
  return kind, options


# Where Pallas kernels compile (kvattn.ops.pallas); elsewhere naming "pallas" runs it interpreted.
_PALLAS_PLATFORMS = ("gpu", "cuda", "rocm", "tpu")


def _shared_page_decoding(model: nnx.Module) -> nnx.Module:
  """`model`, or a copy sharing its parameter arrays whose default-backend GQA layers decode
  paged caches with backends that read each row's pages through its own block-table row
  (module doc: prefix cache). The caller's model is not changed."""
  if all(a.decode_implementation is not None for a in _attending_layers(model)):
    return model
  safe = ("pallas", "xla") if jax.default_backend() in _PALLAS_PLATFORMS else "xla"
  model = nnx.merge(*nnx.split(model))
  for a in _attending_layers(model):
    if a.decode_implementation is None:
      a.decode_implementation = safe
  return model


def _attending_layers(model: nnx.Module) -> list[Any]:
  """Every GQA attention module that reads a paged cache: the layers owning a cache and,
  under cross-layer KV sharing, the layers reading their owner's (`kv_source`)."""
  return [layer.attn for layer in model.layers if hasattr(layer.attn, "decode_implementation")]


def _reset_ring_row(ring: RingKVCache, slot) -> RingKVCache:
  """`ring` with row `slot` empty (no token: `pos` -1, length 0); its keys and values are
  left as they are (slots with `pos` -1 are never read)."""
  return ring.replace(pos=ring.pos.at[slot].set(-1), lengths=ring.lengths.at[slot].set(0))


class _BoundarySnapshots:
  """What `RingSnapshots` and `ResidualSnapshots` share: a snapshot is a tuple of arrays per
  layer (None where a layer stores no such array) whose `(shape, dtype)`s, in leaf order, are
  `layouts`; a subclass sets `layers` and `layouts` and defines `_snapshot_of(caches, slot,
  end)` (traceable) and `restore`, then calls `_setup`. `take` runs `_snapshot_of` jitted;
  `encode` / `decode` turn a snapshot into its `nbytes` raw bytes and back, bit-exact, for
  the offload tiers."""

  layers: tuple
  layouts: list

  def _setup(self, caches: Sequence[Any], home: Any) -> None:
    self.home = home
    self.nbytes = sum(int(np.prod(sh)) * jnp.dtype(d).itemsize for sh, d in self.layouts)
    self.empty = jax.tree.map(jnp.zeros_like,
                              jax.device_put(self._snapshot_of(caches, 0, 0), home))
    self._take = jax.jit(self._snapshot_of)

  def _snapshot_of(self, caches, slot, end):
    raise NotImplementedError

  def take(self, caches: Sequence[Any], slot: int, end: int) -> tuple:
    """The snapshot at token `end` of slot `slot` (what each kind needs of the row: its
    class docstring)."""
    return self._take(tuple(caches), np.int32(slot), np.int32(end))

  def encode(self, snapshot) -> np.ndarray:
    """`u8[nbytes]`: the snapshot's raw bytes (host)."""
    leaves = [np.asarray(a) for a in jax.tree.leaves(snapshot)]
    return np.concatenate([a.reshape(-1).view(np.uint8) for a in leaves])

  def decode(self, data: Any) -> tuple:
    """The snapshot `encode` gave these bytes of, on the batcher's device.

    Raises:
      ValueError: `data` does not hold exactly `nbytes` bytes.
    """
    data = np.asarray(data, np.uint8).reshape(-1)
    if data.size != self.nbytes:
      raise ValueError(f"data must hold {self.nbytes} bytes; got {data.size}")
    arrays, offset = [], 0
    for shape, dtype in self.layouts:
      size = int(np.prod(shape)) * jnp.dtype(dtype).itemsize
      arrays.append(np.ascontiguousarray(data[offset:offset + size]).view(
          jnp.dtype(dtype)).reshape(shape))
      offset += size
    return jax.device_put(jax.tree.unflatten(jax.tree.structure(self.empty), arrays), self.home)


def _tokens_before(end, count: int, capacity: int) -> tuple[jax.Array, jax.Array]:
  """`(p i32[count], idx i32[count])`: tokens `[end - count, end)` and their slots in a ring
  of `capacity` slots (token p in slot p % capacity)."""
  p = end - count + jnp.arange(count, dtype=jnp.int32)
  return p, jnp.mod(p, capacity)


def _row_tokens(a: jax.Array | None, slot, p: jax.Array, idx: jax.Array) -> jax.Array | None:
  """Row `slot` of a ring array `a: [B, K, C, ...]` at slots `idx` (axis 1 of the row), zeros
  where the token `p` is < 0; None for None."""
  if a is None:
    return None
  row = jnp.take(jax.lax.dynamic_index_in_dim(a, slot, keepdims=False), idx, axis=1)
  valid = (p >= 0).reshape((1, -1) + (1,) * (row.ndim - 2))
  return jnp.where(valid, row, jnp.zeros_like(row))


class RingSnapshots(_BoundarySnapshots):
  """The rings' boundary states for the prefix cache (module docstring, "Prefix cache with
  rings"): the snapshot at token m holds, for each ring layer of window W, the keys and
  values of tokens `[m - W, m)` in token order (`k, v: [K, W, H]` in the cache dtype,
  `k_scale, v_scale: f32[K, W]` for an int8/fp8 ring, else None; entries of tokens < 0 are
  zeros and never read). A tuple with one `(k, v, k_scale, v_scale)` per ring layer.

  The batcher's rings hold `W + page_size - 1` slots, so at any time the ring of a
  sequence of n tokens still holds the window of the last page boundary
  `m = n // page_size * page_size` (`take`); `restore` writes a snapshot back into a
  slot's ring row as the ring of an m-token sequence. `encode` / `decode` turn a snapshot
  into bytes and back (bit-exact) for the offload tiers.
  """

  def __init__(self, caches: Sequence[Any], ring_layers: Sequence[int],
               windows: Sequence[int], home: Any):
    self.layers = tuple(ring_layers)
    self.windows = tuple(int(w) for w in windows)
    rings = [caches[i] for i in self.layers]
    # (shape, dtype) of every array of a snapshot, in leaf order.
    self.layouts = []
    for c, w in zip(rings, self.windows):
      k_heads, _, head_dim = c.k.shape[1:]
      for a in (c.k, c.v):
        self.layouts.append(((k_heads, w, head_dim), a.dtype))
      for a in (c.k_scale, c.v_scale):
        if a is not None:
          self.layouts.append(((k_heads, w), a.dtype))
    self._setup(caches, home)

  def _snapshot_of(self, caches, slot, end):
    out = []
    for i, w in zip(self.layers, self.windows):
      c = caches[i]
      p, idx = _tokens_before(end, w, c.capacity)  # the tokens kept, oldest first
      out.append(tuple(_row_tokens(a, slot, p, idx) for a in (c.k, c.v, c.k_scale, c.v_scale)))
    return tuple(out)

  def restore(self, caches: Sequence[Any], slot, snapshot, end) -> tuple:
    """`caches` with slot `slot`'s ring rows holding what a ring of an `end`-token sequence
    holds, from `snapshot` (`end` 0: empty rows; traceable)."""
    caches = list(caches)
    for (i, w), snap in zip(zip(self.layers, self.windows), snapshot):
      c = caches[i]
      p, idx = _tokens_before(end, w, c.capacity)  # distinct; tokens < 0 take no other's slot
      pos = jnp.full((c.capacity,), -1, jnp.int32).at[idx].set(jnp.where(p >= 0, p, -1))

      def put(a, new):
        if a is None:
          return None
        row = jax.lax.dynamic_index_in_dim(a, slot, keepdims=False).at[:, idx].set(new)
        return jax.lax.dynamic_update_index_in_dim(a, row, slot, 0)

      caches[i] = c.replace(k=put(c.k, snap[0]), v=put(c.v, snap[1]),
                            k_scale=put(c.k_scale, snap[2]), v_scale=put(c.v_scale, snap[3]),
                            pos=c.pos.at[slot].set(pos), lengths=c.lengths.at[slot].set(end))
    return tuple(caches)


class ResidualSnapshots(_BoundarySnapshots):
  """The residual rings' boundary states for the prefix cache over low-bit pools (module
  docstring, "Low-bit pools"): the snapshot at token m (a multiple of `group_size`) holds,
  for each `PagedKIVICache` layer with residual R, the full-precision keys and values of
  tokens `[m - R, m)` in token order (`k, v: [K, R, H]` in the ring's dtype; entries of
  tokens < 0 are zeros and never read): what the ring of an m-token row holds (its store
  holds tokens `[0, m - R)`, in the shared pages). A tuple with one `(k, v)` per layer.

  Unlike `RingSnapshots`, `take` needs the row to hold exactly `end` tokens (the ring keeps
  no slack: a flush drops a group's full-precision copy), so the batcher splits a prefill at
  the page boundary it snapshots. `restore` writes a snapshot back into a slot's ring row as
  the ring of an `end`-token row (`end` a multiple of every layer's `group_size`).
  """

  def __init__(self, caches: Sequence[Any], home: Any):
    self.layers = tuple(i for i, c in enumerate(caches)
                        if isinstance(c, paged_kivi.PagedKIVICache) and c.residual > 0)
    self.layouts = []
    for i in self.layers:
      c = caches[i]
      for a in (c.k_res, c.v_res):
        self.layouts.append(((c.num_kv_heads, c.residual, c.head_dim), a.dtype))
    self._setup(caches, home)

  def _snapshot_of(self, caches, slot, end):
    out = []
    for i in self.layers:
      c = caches[i]
      p, idx = _tokens_before(end, c.residual, c.ring_capacity)
      out.append((_row_tokens(c.k_res, slot, p, idx), _row_tokens(c.v_res, slot, p, idx)))
    return tuple(out)

  def restore(self, caches: Sequence[Any], slot, snapshot, end) -> tuple:
    """`caches` with slot `slot`'s ring rows holding what the ring of an `end`-token row
    holds, from `snapshot`, and its length `end` (`end` 0: an empty row; traceable)."""
    caches = list(caches)
    for i, (k, v) in zip(self.layers, snapshot):
      c = caches[i]
      _, idx = _tokens_before(end, c.residual, c.ring_capacity)  # R distinct slots

      def put(a, new, idx=idx):
        row = jax.lax.dynamic_index_in_dim(a, slot, keepdims=False).at[:, idx].set(new)
        return jax.lax.dynamic_update_index_in_dim(a, row, slot, 0)

      caches[i] = c.replace(k_res=put(c.k_res, k), v_res=put(c.v_res, v),
                            lengths=c.lengths.at[slot].set(end))
    return tuple(caches)


class NoFreeSlotError(RuntimeError):
  """Every slot is busy; retire a sequence (step until one finishes) first."""


@dataclasses.dataclass(frozen=True)
class Finished:
  """A sequence that left the batch.

  Attributes:
    request_id: the id given to `add`.
    tokens: `i32[n]` generated tokens (EOS included when it ended the sequence).
    reason: "eos", "length" (`max_new_tokens` reached), "out_of_pages" or
      "cancelled" (`ContinuousBatcher.cancel`).
    slot: the slot it occupied.
    joined_step, finished_step: values of `ContinuousBatcher.steps` when it
      joined and left.
  """

  request_id: Hashable
  tokens: np.ndarray
  reason: str
  slot: int
  joined_step: int
  finished_step: int


@dataclasses.dataclass
class _Live:
  request_id: Hashable
  tokens: list
  max_new_tokens: int
  cache_len: int  # tokens in the cache (host mirror of lengths[slot])
  joined_step: int
  prompt: Any = None  # the prompt's token ids (kept for the prefix cache)


class ContinuousBatcher:
  """Fixed-slot continuous batching of a `kvattn.Transformer` over paged caches.

  Example:
    batcher = ContinuousBatcher(model, num_slots=4, num_pages=64, page_size=16,
                                max_len=256, max_prompt_len=64)
    results = batcher.run([("a", prompt_a, 32), ("b", prompt_b, 8), ...])
    results["a"].tokens  # what generate(model, prompt_a[None], ...) gives alone
  """

  def __init__(self, model: nnx.Module, *, num_slots: int, num_pages: int, page_size: int,
               max_len: int, max_prompt_len: int, temperature: float = 0.0,
               top_k: int | None = None, top_p: float | None = None,
               eos_id: int | None = None, pad_id: int = data_lib.PAD_ID, dtype: Any = None,
               seed: int | None = None, rng: Any = None, prefix_cache: bool = False,
               offload: Any = None, mesh: Any = None, speculative: Any = None,
               local_layers: str = "full", max_ring_snapshots: int | None = None,
               cache: Any = None):
    """Builds the caches, the allocator and the jitted programs.

    Args:
      model: a `kvattn.Transformer` whose layers are MHA/GQA/MQA.
      num_slots: batch rows B decoded together.
      num_pages: pages P in each layer's pool.
      page_size: tokens per page.
      max_len: per-sequence capacity in tokens (prompt + generated - 1).
      max_prompt_len: static prefill length; prompts are right-padded to it.
      temperature, top_k, top_p: sampling (`kvattn.inference.generation.Sampling`).
      eos_id: token that ends a sequence, or None.
      pad_id: token reported for inactive slots (never returned to callers).
      dtype: cache dtype (default the model's compute dtype).
      seed: shuffles the allocator's free list (None: ascending pages).
      rng: jax key (`jax.random.key`) or int seed for sampling (None: 0).
      prefix_cache: share cached prompt prefixes between requests
        (`kvattn.paging.prefix.PrefixCachingAllocator`): a prompt whose first
        whole pages are cached prefills only the rest; prefills are padded
        to power-of-two buckets instead of `max_prompt_len` (one compile per
        bucket).
      offload: a `kvattn.paging.offload.TieredStore` where evicted cached pages go
        (host memory, disk) and come back from on a hit; needs `prefix_cache`.
      mesh: a `kvattn.sharding.make_mesh` mesh, or None (one device): parameters
        placed by the sharding rules, page pools split over KV heads on `model`
        and over `data` with the slots (`kvattn.caches.sharded.BATCHER_RULES`; module
        docstring).
      speculative: a `kvattn.inference.speculative.PromptLookup` or `DraftModel`: every
        step verifies its k drafted tokens per slot in one pass (module docstring);
        greedy only.
      local_layers: "full" (every layer a paged cache over its pool) or "ring": the
        per-layer layout (`kvattn.caches.registry.build_caches`): each layer with a sliding
        window W < max_len (`registry.ring_layers`) gets a `RingKVCache` of W slots per
        batch slot (`num_slots` rows, no pages: a local layer never holds more than W
        tokens), the other (global) layers the paged pools of `num_pages` pages, one block
        table for all of them. With `prefix_cache` the rings hold `W + page_size - 1`
        slots and each cached prefix keeps a snapshot of them (module docstring).
      max_ring_snapshots: with `prefix_cache` and rings (or low-bit pools with a residual:
        their residual rings' snapshots, `ResidualSnapshots`), the most ring snapshots kept
        (least recently used dropped first; a prefix whose snapshot is gone no longer
        hits at that length). Default `4 * num_slots`. Their bytes: `stats()`.
      cache: the pools' kind (`BATCHER_CACHE_KINDS`): None or "paged" (`PagedKVCache`, in
        `dtype`), or "paged_kivi2" / "paged_kivi4" (a name or a registry spec with KIVI's
        options; `kvattn.caches.paged_kivi.PagedKIVICache`: the 2/4-bit store in the pool,
        `dtype` the residual ring's): module docstring, "Low-bit pools".

    Raises:
      ValueError/TypeError: bad sizes, an MLA layer, `max_prompt_len > max_len`;
        a mesh whose `data` axis does not divide `num_slots` or `num_pages`, whose
        `model` axis does not fit the layers' heads (`sharded.cache_layout`),
        `offload` with more than one data shard, or `prefix_cache` with a layer
        whose `decode_implementation` is "xla_pool"; `speculative` that is not a
        drafter (TypeError), with `temperature` > 0, a draft model on another
        vocabulary or with dense-incompatible caches, or a `DraftModel` with a mesh;
        `local_layers` not in ("full", "ring"), or "ring" with `prefix_cache` and a mesh,
        when some layer gets a ring; `max_ring_snapshots` not a
        positive int; a `cache` kind the batcher does not schedule, or a low-bit kind with
        `prefix_cache`, a residual and a mesh, or with `speculative`, `offload` or
        `local_layers="ring"` (each naming the option).
    """
    self.num_slots = _checks.positive_int("num_slots", num_slots)
    self.page_size = _checks.positive_int("page_size", page_size)
    self.max_len = _checks.positive_int("max_len", max_len)
    self.max_prompt_len = _checks.positive_int("max_prompt_len", max_prompt_len)
    if self.max_prompt_len > self.max_len:
      raise ValueError(f"max_prompt_len must be <= max_len = {self.max_len}; got "
                       f"{max_prompt_len}")
    self.sampling = Sampling(float(temperature), top_k, top_p)
    self.vocab_size = int(model.vocab_size)
    if eos_id is not None and not 0 <= int(eos_id) < self.vocab_size:
      raise ValueError(f"eos_id must lie in [0, {self.vocab_size}); got {eos_id}")
    self.eos_id = None if eos_id is None else int(eos_id)
    self.pad_id = int(pad_id)
    if speculative is not None:
      speculative = speculative_lib.check(speculative, self.vocab_size)
      if isinstance(speculative, speculative_lib.DraftModel) and mesh is not None:
        raise ValueError("speculative=DraftModel(...) runs on one device: mesh must be None; "
                         f"got a mesh of shape {dict(mesh.shape)}")
      if self.sampling.temperature != 0.0:
        raise ValueError(f"speculative decoding is greedy: temperature must be 0; got "
                         f"{temperature}")
    self.speculative = speculative
    self.spec_stats = collections.Counter(passes=0, drafted=0, accepted=0, pages_returned=0)
    # The text of each slot (prompt, then generated tokens) for prompt lookup: at most
    # max_len + 1 tokens (the last generated one is not in the cache).
    self._history = np.zeros((self.num_slots, self.max_len + 1), np.int32)
    self._ends = np.zeros((self.num_slots,), np.int32)
    attns = gqa_layers(model)
    # Low-bit pools with the prefix cache prefill a page at a time (module docstring).
    self._chunked_prefill = False
    residual_states = False
    self.cache_kind, kind_options = batcher_cache(cache, page_size=self.page_size, seed=seed)
    lowbit = self.cache_kind != "paged"
    if lowbit:
      g = kind_options["group_size"]
      residual = kind_options["residual"]
      for name, value, why in (
          ("speculative", speculative is not None, "a verify pass may flush a group of drafted "
           "tokens into the quantized store, which rollback by lengths cannot undo"),
          ("local_layers", local_layers != "full", "rings for local layers are float caches"),
          ("offload", offload is not None, "the tiers move float pages (PageCodec)")):
        if value:
          raise ValueError(f"{name} is not supported with cache kind {self.cache_kind!r}: {why}; "
                           f"got {name}={speculative if name == 'speculative' else local_layers if name == 'local_layers' else offload!r}")
      if prefix_cache and residual and mesh is not None:
        raise ValueError(
            f"prefix_cache=True with cache kind {self.cache_kind!r} and a residual runs on one "
            f"device: mesh must be None (residual snapshots are not placed on a mesh); got "
            f"cache.residual = {residual} and a mesh of shape {dict(mesh.shape)}")
      # With the prefix cache a hit restores each layer's residual ring from a snapshot
      # (`ResidualSnapshots`, module docstring).
      residual_states = bool(prefix_cache and residual)
      if prefix_cache:  # module docstring: token units, prompts prefilled a page at a time
        self._chunked_prefill = True
        self._pool_tokens = lambda n: n
        pps = pages_for(self.max_len, self.page_size)
      else:
        self._pool_tokens = lambda n: paged_kivi.store_tokens(n, residual=residual, group_size=g)
        pps = max(1, pages_for(kivi_lib.store_slots(self.max_len, residual, g), self.page_size))
    else:
      self._pool_tokens = lambda n: n
      pps = pages_for(self.max_len, self.page_size)
    if prefix_cache and any(a.decode_implementation == "xla_pool"
                            for a in _attending_layers(model)):
      raise ValueError("decode_implementation must not be 'xla_pool' with prefix_cache=True "
                       "(shared pages have several owners; that backend allows one); got "
                       f"{[a.decode_implementation for a in _attending_layers(model)]}")
    if offload is not None and not prefix_cache:
      raise ValueError("offload needs prefix_cache=True (only cached prefixes are offloaded)")
    self.prefix_cache = bool(prefix_cache)
    if local_layers not in LOCAL_LAYER_LAYOUTS:
      raise ValueError(f"local_layers must be one of {LOCAL_LAYER_LAYOUTS}; got {local_layers!r}")
    # Indices into `attns` (the layers that own a cache): a window shorter than max_len, as
    # `registry.ring_layers` decides, read from each attention module.
    rings = {i for i, a in enumerate(attns) if local_layers == "ring" and
             getattr(a, "window", None) is not None and a.window < self.max_len}
    if rings and self.prefix_cache and mesh is not None:
      raise ValueError(
          "prefix_cache=True with local_layers='ring' runs on one device: mesh must be None "
          f"(ring snapshots are not placed on a mesh); got a mesh of shape {dict(mesh.shape)}")
    self.ring_layers = tuple(sorted(rings))
    num_pages = _checks.positive_int("num_pages", num_pages)
    shards = 1 if mesh is None else int(mesh.shape["data"])  # data-parallel groups
    for name, value in (("num_slots", self.num_slots), ("num_pages", num_pages)):
      if value % shards:
        raise ValueError(f"mesh axis 'data' of size {shards} must divide {name} (each data "
                         f"shard holds an equal part); got {name} = {value}")
    if offload is not None and shards > 1:
      raise ValueError(f"offload needs one data shard (one page allocator); got mesh axis "
                       f"'data' of size {shards}")
    self._slots_per_shard = self.num_slots // shards
    self._pages_per_shard = num_pages // shards
    if max_ring_snapshots is None:
      max_ring_snapshots = 4 * self.num_slots
    max_ring_snapshots = _checks.positive_int("max_ring_snapshots", max_ring_snapshots)
    if self.prefix_cache:
      make = lambda: PrefixCachingAllocator(
          self._pages_per_shard, self.page_size, pps, seed=seed, offload=offload,
          boundary_states=bool(rings) or residual_states,
          max_states=max_ring_snapshots if rings or residual_states else None)
    else:
      make = lambda: PageAllocator(self._pages_per_shard, self.page_size, pps, seed=seed)
    # allocators[j] hands out the pages [j * P / d, (j + 1) * P / d) of data shard j (its
    # local ids; `_row` adds the offset).
    self.allocators = tuple(make() for _ in range(shards))
    self.prefill_tokens = 0  # prompt tokens run through the model (the rest came from the cache)
    dtype = getattr(model, "dtype", jnp.float32) if dtype is None else dtype

    def pool(a):
      if lowbit:
        return paged_kivi.PagedKIVICache.init_paged(
            self.num_slots, self.max_len, a.num_kv_heads, a.head_dim, dtype,
            num_pages=shards * self._pages_per_shard, page_size=self.page_size,
            pages_per_seq=pps, bits=int(self.cache_kind[-1]), rope_theta=a.rope_theta,
            rope_scaling=a.rope_scaling, **kind_options)
      return PagedKVCache.init(self.num_slots, num_pages=shards * self._pages_per_shard,
                               page_size=self.page_size, pages_per_seq=pps,
                               num_kv_heads=a.num_kv_heads, head_dim=a.head_dim, dtype=dtype)
    self.caches = tuple(
        # With the prefix cache, page_size - 1 slots more: the window of the last page
        # boundary stays in the ring until the next (`RingSnapshots`).
        RingKVCache.init(self.num_slots, a.window + (self.page_size - 1 if self.prefix_cache
                                                     else 0), a.num_kv_heads, a.head_dim, dtype)
        if i in rings else pool(a) for i, a in enumerate(attns))
    # Committed, as the jitted programs' outputs are: the first call then reuses the executable
    # later calls run, instead of compiling once more for uncommitted inputs.
    home = jax.devices()[0]
    if mesh is not None:
      from kvattn import sharding  # pylint: disable=g-import-not-at-top
      from kvattn.caches import sharded
      model = sharding.place_model(model, mesh)
      paged = [i for i in range(len(attns)) if i not in rings]
      if lowbit:  # plain caches with placed arrays: XLA partitions their ops (GSPMD)
        placed = {i: sharded.place_lowbit(self.caches[i], mesh, sharded.BATCHER_RULES)
                  for i in paged}
      else:
        placed = dict(zip(paged, sharded.place_caches(
            [self.caches[i] for i in paged], mesh, sharded.BATCHER_RULES,
            num_heads=[attns[i].num_heads for i in paged])))
      self.caches = tuple(placed[i] if i in placed else
                          sharded.place_ring(c, mesh, sharded.BATCHER_RULES)
                          for i, c in enumerate(self.caches))
      home = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    else:
      self.caches = jax.device_put(self.caches, home)
    self._snapshots = None
    if self.prefix_cache and rings:
      self._snapshots = RingSnapshots(self.caches, self.ring_layers,
                                      [attns[i].window for i in self.ring_layers], home)
    elif residual_states:
      self._snapshots = ResidualSnapshots(self.caches, home)
    if prefix_cache:
      model = _shared_page_decoding(model)
    self._graphdef, self._state = nnx.split(model)
    self._draft_graphdef, self._draft_state, self._draft_caches = None, None, ()
    if isinstance(speculative, speculative_lib.DraftModel):
      draft = speculative.model
      self._draft_graphdef, self._draft_state = nnx.split(draft)
      # One dense row per slot; room for a pass that drafts k past the last kept token.
      self._draft_caches = tuple(draft.init_caches(
          self.num_slots, self.max_len + speculative.num_draft_tokens + 1))
      if not all(isinstance(c, LengthsRollback) for c in self._draft_caches):
        raise ValueError("speculative.model must build caches that roll back by lengths "
                         "(dense, latent, paged); got "
                         f"{sorted({type(c).__name__ for c in self._draft_caches})}")
      self._draft_caches = jax.device_put(self._draft_caches, home)
      self._draft_state = jax.device_put(self._draft_state, home)
    if rng is None or (isinstance(rng, int) and not isinstance(rng, bool)):
      rng = jax.random.key(0 if rng is None else rng)
    self._rng = jax.device_put(rng, home)  # committed, like self.caches
    self._slots: list[_Live | None] = [None] * self.num_slots
    self._last = np.full((self.num_slots,), self.pad_id, np.int32)
    self.steps = 0
    self.traces: collections.Counter = collections.Counter()
    self._build_programs()
    if offload is not None:
      codec = PageCodec(self.caches)
      self.allocator.bind_device(lambda pages: codec.read(self.caches, pages),
                                 self._offload_writer(codec), state_codec=self._snapshots)

  def _offload_writer(self, codec):
    def write(pages, payloads):
      self.caches = codec.write(self.caches, pages, payloads)
    return write

  # Jitted programs (each traced once: shapes are static, the slot is traced).
  def _build_programs(self):
    graphdef, sampling, pad_id, traces = self._graphdef, self.sampling, self.pad_id, self.traces

    def row_view(c, slot):
      """A batch-1 view (a ring: the slot's row of every array). For a paged cache: a batch-1 view: the slot's row and length over the shared pools. On a mesh the
      row is replicated and the pool stays split: the data shard holding the row's
      pages writes them, and attention merges the shards' partials (LSE) over `data`,
      like a sequence split (the other shards see no key)."""
      if isinstance(c, RingKVCache):
        return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, slot, keepdims=True), c)
      if isinstance(c, paged_kivi.PagedKIVICache):
        return c.slot_view(slot)
      view = c.replace(
          block_tables=jax.lax.dynamic_index_in_dim(c.block_tables, slot, keepdims=True),
          lengths=jax.lax.dynamic_index_in_dim(c.lengths, slot, keepdims=True))
      layout = getattr(c, "layout", None)
      if layout is not None:
        view = view.replace(layout=dataclasses.replace(
            layout, batch=None, seq=layout.pages[0] if layout.pages else None))
      return view

    snapshots = self._snapshots
    page_size, chunked = self.page_size, self._chunked_prefill

    def prefill(model, views, prompt, prompt_len):
      """`(views, last [1, D])`: the prompt `i32[T]` (`prompt_len` real tokens) written into
      the batch-1 views and the hidden state of its last token. Chunked: a page of tokens at
      a time (a `fori_loop` over the pages the prompt fills; T a multiple of page_size)."""
      if not chunked:
        h, views = model.hidden(prompt[None], views, new_lengths=prompt_len[None])
        return views, jax.lax.dynamic_index_in_dim(h[0], prompt_len - 1, keepdims=True)

      def chunk(i, views, last):
        n = jnp.clip(prompt_len - i * page_size, 0, page_size)
        tokens = jax.lax.dynamic_slice_in_dim(prompt, i * page_size, page_size)
        h, views = model.hidden(tokens[None], views, new_lengths=n[None])
        here = jax.lax.dynamic_index_in_dim(h[0], jnp.maximum(n - 1, 0), keepdims=True)
        return views, jnp.where(prompt_len <= (i + 1) * page_size, here.astype(last.dtype), last)

      last = jnp.zeros((1, model.d_model), model.dtype)
      return jax.lax.fori_loop(0, (prompt_len + page_size - 1) // page_size,
                               lambda i, carry: chunk(i, *carry), (views, last))

    def join(state, caches, slot, row, prompt, prompt_len, rng, start, snapshot):
      # prompt: the tokens after the `start` already cached (0 without a prefix cache);
      # snapshot: the rings' state at `start` (prefix cache with rings), else None.
      traces["join"] += 1
      model = nnx.merge(graphdef, state)
      caches = tuple(_reset_ring_row(c, slot) if isinstance(c, RingKVCache) else
                     c.assign_slot(slot, row, start) for c in caches)
      if snapshots is not None:
        caches = snapshots.restore(caches, slot, snapshot, start)
      views = tuple(row_view(c, slot) for c in caches)
      views, last = prefill(model, views, prompt, prompt_len)
      caches = tuple(
          jax.tree.map(lambda a, r: jax.lax.dynamic_update_index_in_dim(a, r, slot, 0), c, v)
          if isinstance(c, RingKVCache) else c.with_slot_view(slot, v)
          if isinstance(c, paged_kivi.PagedKIVICache) else
          c.replace(k_pages=v.k_pages, v_pages=v.v_pages, k_scale_pages=v.k_scale_pages,
                    v_scale_pages=v.v_scale_pages,
                    lengths=c.lengths.at[slot].set(v.lengths[0]))
          for c, v in zip(caches, views))
      rng, key = jax.random.split(rng)
      first = sample_logits(model.logits_from_hidden(last), key, sampling)[0]
      return caches, first, rng

    def step(state, caches, tokens, active, rng):
      traces["step"] += 1
      model = nnx.merge(graphdef, state)
      h, caches = model.hidden(tokens[:, None], caches, new_lengths=active.astype(jnp.int32))
      rng, key = jax.random.split(rng)
      nxt = sample_logits(model.logits_from_hidden(h[:, 0]), key, sampling)
      return caches, jnp.where(active, nxt, pad_id), rng

    def set_row(caches, slot, row):
      traces["set_row"] += 1
      return tuple(c if isinstance(c, RingKVCache) else
                   c.replace(block_tables=c.block_tables.at[slot].set(row)) for c in caches)

    def release(caches, slot):
      traces["release"] += 1
      return tuple(_reset_ring_row(c, slot) if isinstance(c, RingKVCache) else
                   c.release_slot(slot) for c in caches)

    spec, draft_graphdef = self.speculative, self._draft_graphdef

    def spec_step(state, caches, history, ends, new_lengths, draft_state, draft_caches):
      """Drafts k tokens per slot, verifies `[last, drafts]` (`new_lengths[b]` of them, 0
      for an empty slot) in one pass and keeps, per slot, the last token and the accepted
      drafts. Returns `(caches, greedy i32[S, k + 1], emit i32[S], draft_caches)`: slot b
      emits `greedy[b, :emit[b]]` (its cache holds all but the last)."""
      traces["spec_step"] += 1
      model = nnx.merge(graphdef, state)
      rows = jnp.arange(history.shape[0])
      ends = jnp.maximum(ends, 1)
      active = new_lengths > 0
      if isinstance(spec, speculative_lib.PromptLookup):
        drafts = speculative_lib.prompt_lookup_drafts(history, ends, spec)  # [S, k]
      else:  # the draft caches catch up on the text and draft greedily
        drafts, draft_caches = speculative_lib._draft_model_drafts(  # pylint: disable=protected-access
            draft_graphdef, draft_state, draft_caches, history, ends, active,
            spec.num_draft_tokens)
      fed = jnp.concatenate([history[rows, ends - 1][:, None], drafts], axis=1)
      h, drafted = model.hidden(fed, transaction.begin_all(caches), new_lengths=new_lengths)
      greedy = jnp.argmax(model.logits_from_hidden(h), axis=-1).astype(jnp.int32)
      accepted = jnp.sum(jnp.cumprod(drafts == greedy[:, :-1], axis=1), axis=1)
      emit = jnp.minimum(accepted + 1, new_lengths).astype(jnp.int32)  # 0 when empty
      if draft_caches:  # the draft caches keep what the text confirms (rolled back by lengths)
        held = jnp.where(active, ends + jnp.minimum(emit, spec.num_draft_tokens) - 1,
                         draft_caches[0].lengths)
        draft_caches = tuple(c.replace(lengths=jnp.minimum(c.lengths, held))
                             for c in draft_caches)
      return transaction.commit_all(drafted, emit), greedy, emit, draft_caches

    def draft_join(draft_state, draft_caches, slot, prompt, prompt_len):
      """Prefills slot `slot`'s row of the draft caches with the whole prompt."""
      traces["draft_join"] += 1
      draft = nnx.merge(draft_graphdef, draft_state)
      rows = tuple(jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, slot, 0), c)
                   for c in draft_caches)
      rows = tuple(c.replace(lengths=jnp.zeros_like(c.lengths)) for c in rows)
      _, rows = draft.hidden(prompt[None], rows, new_lengths=prompt_len[None])
      return tuple(jax.tree.map(lambda x, r: jax.lax.dynamic_update_index_in_dim(x, r, slot, 0),
                                c, r) for c, r in zip(draft_caches, rows))

    self._join = jax.jit(join, donate_argnums=(1,))
    self._step = jax.jit(step, donate_argnums=(1,))
    if spec is not None:
      self._spec_step = jax.jit(spec_step, donate_argnums=(1, 6))
    if draft_graphdef is not None:
      self._draft_join = jax.jit(draft_join, donate_argnums=(1,))
    self._set_row = jax.jit(set_row, donate_argnums=(0,))
    self._release = jax.jit(release, donate_argnums=(0,))

  # Queries.
  @property
  def free_slots(self) -> list[int]:
    return [i for i, s in enumerate(self._slots) if s is None]

  @property
  def active(self) -> dict[Hashable, int]:
    """Live request ids -> slot."""
    return {s.request_id: i for i, s in enumerate(self._slots) if s is not None}

  @property
  def allocator(self) -> PageAllocator:
    """The page allocator of the whole pool (one data shard; else see `allocators`).

    Raises:
      AttributeError: the pool is split over a `data` axis of size > 1.
    """
    if len(self.allocators) > 1:
      raise AttributeError(
          f"the pool is split over mesh axis 'data' into {len(self.allocators)} shards: use "
          f"allocators[j] (its page i is page j * {self._pages_per_shard} + i of the pool)")
    return self.allocators[0]

  def can_add(self, prompt_len: int) -> bool:
    """True if a prompt of `prompt_len` tokens would be admitted now."""
    return any(self.allocators[self._shard(s)].can_allocate(self._pool_tokens(int(prompt_len)))
               for s in self.free_slots)

  def stats(self) -> dict[str, Any]:
    """Slot occupancy and the allocators' `PoolStats` (summed over data shards) as a dict."""
    pools = [dataclasses.asdict(a.stats()) for a in self.allocators]
    total = {k: v if k == "page_size" else sum(p[k] for p in pools)
             for k, v in pools[0].items() if k != "waste_fraction"}
    reserved = total["reserved_slots"]
    total["waste_fraction"] = total["internal_waste_slots"] / reserved if reserved else 0.0
    out = {"steps": self.steps, "active_slots": self.num_slots - len(self.free_slots),
           "prefill_tokens": self.prefill_tokens, **total}
    if self._snapshots is not None:  # device bytes besides the pools and the rings
      out["ring_snapshots"] = sum(a.num_states for a in self.allocators)
      out["ring_snapshot_bytes"] = sum(a.state_bytes for a in self.allocators)
    return out

  # Scheduling.
  def add(self, request_id: Hashable, prompt: Sequence[int], max_new_tokens: int) -> int | Finished:
    """Joins a sequence: allocates its prompt pages and prefills it into a free slot.

    Args:
      request_id: any hashable id not currently live.
      prompt: token ids, `1 <= len <= max_prompt_len`, each in `[0, V)`.
      max_new_tokens: tokens to generate (>= 1); `len(prompt) + max_new_tokens
        - 1` must fit `max_len`.

    Returns:
      The slot it occupies; or, when it finished at once (first token EOS, or
      `max_new_tokens == 1`), its `Finished` record (the slot is free again).

    Raises:
      ValueError/TypeError: a bad prompt, length or id (nothing changes).
      NoFreeSlotError: every slot is busy (nothing changes).
      OutOfPagesError: too few free pages for the prompt (nothing changes).
    """
    prompt = np.asarray(prompt)
    if prompt.ndim == 1 and prompt.shape[0] == 0:  # np.asarray([]) is float64: check first
      raise ValueError(f"prompt of {request_id!r} must hold at least one token (an empty prompt "
                       f"cannot be continued; start it with BOS); got []")
    if prompt.ndim != 1 or not np.issubdtype(prompt.dtype, np.integer):
      raise TypeError(f"prompt must be a 1-D sequence of int token ids; got "
                      f"{prompt.dtype}{list(prompt.shape)}")
    n = int(prompt.shape[0])
    if not 1 <= n <= self.max_prompt_len:
      raise ValueError(f"prompt length must lie in [1, max_prompt_len] = [1, "
                       f"{self.max_prompt_len}]; got {n}")
    if prompt.min() < 0 or prompt.max() >= self.vocab_size:
      raise ValueError(f"prompt must hold token ids in [0, {self.vocab_size}); got "
                       f"{int(prompt.min())}..{int(prompt.max())}")
    max_new_tokens = _checks.positive_int("max_new_tokens", max_new_tokens)
    if n + max_new_tokens - 1 > self.max_len:
      raise ValueError(f"max_new_tokens = {max_new_tokens} would overflow the cache: {n} + "
                       f"{max_new_tokens} - 1 > max_len = {self.max_len}")
    if request_id in self.active:
      raise ValueError(f"request_id must not be live already; got {request_id!r}")
    free = self.free_slots
    if not free:
      raise NoFreeSlotError(f"no free slot for {request_id!r}: all {self.num_slots} are busy")
    slot = self._choose_slot(free, prompt)
    shard = self._shard(slot)
    allocator = self.allocators[shard]
    if self.prefix_cache:  # both raise OutOfPagesError before any change
      start = allocator.allocate_prompt(request_id, prompt)
    else:
      start = 0
      allocator.allocate(request_id, self._pool_tokens(n))
    row = self._row(request_id, shard)
    snapshot = None
    if self._snapshots is not None:
      snapshot = allocator.state_of(request_id) if start else self._snapshots.empty
      if snapshot is None:
        raise RuntimeError(f"the prefix cache matched {start} tokens of {request_id!r} "
                           "without a ring snapshot at their end")
      # Cached pages reach further than the last snapshot (a prefix shared with an earlier
      # prompt, which diverged there): prefill up to that boundary first and snapshot the
      # rings there, so later prompts sharing it hit (module docstring).
      mark = allocator.match(prompt[:(n - 1) // self.page_size * self.page_size],
                             with_state=False)
      if mark > start:
        self.caches, _, _ = self._prefill(slot, row, prompt[start:mark], start, snapshot)
        snapshot = self._snapshots.take(self.caches, slot, mark)
        allocator.register(request_id, prompt[:mark])
        allocator.set_state(request_id, mark, snapshot, self._snapshots.nbytes)
        self.prefill_tokens += mark - start
        start = mark
      end = n // self.page_size * self.page_size
      if isinstance(self._snapshots, ResidualSnapshots) and start < end < n:
        # A residual ring drops a group's full precision when it flushes, so it cannot be
        # snapshotted at the last page boundary after the fact: prefill up to it first
        # (the same page-by-page chunks, so the same state).
        self.caches, _, _ = self._prefill(slot, row, prompt[start:end], start, snapshot)
        snapshot = self._snapshots.take(self.caches, slot, end)
        allocator.register(request_id, prompt[:end])
        allocator.set_state(request_id, end, snapshot, self._snapshots.nbytes)
        self.prefill_tokens += end - start
        start = end
    self.caches, first, self._rng = self._prefill(slot, row, prompt[start:], start, snapshot)
    self.prefill_tokens += n - start
    if self.prefix_cache:
      allocator.register(request_id, prompt)  # full prompt pages: prefilled, so exact
      self._keep_snapshot(slot, request_id, n)
    first = int(first)
    self._slots[slot] = _Live(request_id, [first], max_new_tokens, n, self.steps, prompt)
    self._last[slot] = first
    self._history[slot, :n] = prompt
    if self._draft_caches:
      full = np.zeros((self.max_prompt_len,), np.int32)
      full[:n] = prompt
      self._draft_caches = self._draft_join(self._draft_state, self._draft_caches,
                                            np.int32(slot), full, np.int32(n))
    self._history[slot, n] = first
    self._ends[slot] = n + 1
    reason = self._reason(self._slots[slot], first)
    return self._finish(slot, reason) if reason else slot

  def step(self) -> list[Finished]:
    """One decode iteration for every live slot; returns the sequences that left. With
    `speculative`, one verify pass: each live sequence gains 1..k + 1 tokens."""
    if self.speculative is not None:
      return self._speculative_step()
    finished = []
    for slot, live in enumerate(self._slots):
      if live is None:
        continue
      shard = self._shard(slot)
      try:  # the token fed this step lands in slot live.cache_len
        added = self.allocators[shard].grow(live.request_id, self._pool_tokens(live.cache_len + 1))
      except OutOfPagesError:
        finished.append(self._finish(slot, "out_of_pages"))
        continue
      if added:
        self.caches = self._set_row(self.caches, np.int32(slot),
                                    self._row(live.request_id, shard))
    active = np.array([s is not None for s in self._slots])
    if not active.any():
      return finished
    self.caches, nxt, self._rng = self._step(self._state, self.caches, self._last, active,
                                             self._rng)
    nxt = np.asarray(nxt)
    self.steps += 1
    for slot, live in enumerate(self._slots):
      if live is None:
        continue
      token = int(nxt[slot])
      live.cache_len += 1
      live.tokens.append(token)
      self._last[slot] = token
      reason = self._reason(live, token)
      if reason:
        finished.append(self._finish(slot, reason))
    return finished

  def _speculative_step(self) -> list[Finished]:
    """`step` with speculation (module docstring)."""
    finished = []
    k = self.speculative.num_draft_tokens
    new_lengths = np.zeros((self.num_slots,), np.int32)
    for slot, live in enumerate(self._slots):
      if live is None:
        continue
      shard = self._shard(slot)
      allocator = self.allocators[shard]
      written = min(k + 1, live.max_new_tokens - len(live.tokens))  # >= 1 while live
      try:
        copies = []
        if self.prefix_cache:  # copy-on-write: never write a shared or registered page
          copies = allocator.prepare_write(live.request_id, live.cache_len)
        added = allocator.grow(live.request_id, live.cache_len + written)
      except OutOfPagesError:
        finished.append(self._finish(slot, "out_of_pages"))
        continue
      if copies:
        self.caches = copy_pages(self.caches, copies)
      if added or copies:
        self.caches = self._set_row(self.caches, np.int32(slot),
                                    self._row(live.request_id, shard))
      new_lengths[slot] = written
    if not new_lengths.any():
      return finished
    self.caches, greedy, emit, self._draft_caches = self._spec_step(
        self._state, self.caches, self._history, self._ends, new_lengths, self._draft_state,
        self._draft_caches)
    greedy, emit = np.asarray(greedy), np.asarray(emit)
    self.steps += 1
    for slot, live in enumerate(self._slots):
      if live is None or not new_lengths[slot]:
        continue
      self.spec_stats["passes"] += 1
      self.spec_stats["drafted"] += k
      self.spec_stats["accepted"] += int(emit[slot]) - 1
      reason = None
      for token in greedy[slot, :emit[slot]]:  # stop at EOS or the budget, as `step` does
        token = int(token)
        live.cache_len += 1
        live.tokens.append(token)
        self._history[slot, self._ends[slot]] = token
        self._ends[slot] += 1
        reason = self._reason(live, token)
        if reason:
          break
      self._last[slot] = live.tokens[-1]
      shard = self._shard(slot)
      if reason:
        finished.append(self._finish(slot, reason))
        continue
      returned = self.allocators[shard].shrink(live.request_id, live.cache_len)
      if returned:  # the pages only rejected drafts used went back; the row stops naming them
        self.spec_stats["pages_returned"] += len(returned)
        self.caches = self._set_row(self.caches, np.int32(slot),
                                    self._row(live.request_id, shard))
    return finished

  def cancel(self, request_id: Hashable) -> Finished:
    """Retires a live sequence now, as `step` retires a finished one.

    Its slot is free and its pages go back to the allocator; with the prefix
    cache its full pages are registered first and stay cached (they hold the
    KV of its prompt and of the tokens fed back so far, like a retirement's).
    It runs the retirement's jitted program (no new trace).

    Args:
      request_id: the id of a live sequence (`active`).

    Returns:
      Its `Finished` record with reason "cancelled" and the tokens generated
      so far (at least the prefill's first one).

    Raises:
      ValueError: `request_id` is not live (never added, finished, or
        cancelled already); nothing changes.
    """
    slot = self.active.get(request_id)
    if slot is None:
      raise ValueError(f"request_id must be a live request to cancel; got {request_id!r} "
                       f"({len(self.active)} live)")
    return self._finish(slot, "cancelled")

  def run(self, requests: Iterable[tuple[Hashable, Sequence[int], int]]
          ) -> dict[Hashable, Finished]:
    """Serves `requests` (id, prompt, max_new_tokens) first-come first-served.

    Before every step, waiting requests join while a slot and their prompt
    pages are free (in order: a request that does not fit blocks those
    behind it). Returns every request's `Finished` record.

    Raises:
      OutOfPagesError: a prompt needs more pages than the whole pool has.
    """
    queue = collections.deque(requests)
    done: dict[Hashable, Finished] = {}
    while queue or self.active:
      while queue and self.can_add(len(queue[0][1])):
        rid, prompt, max_new = queue.popleft()
        result = self.add(rid, prompt, max_new)
        if isinstance(result, Finished):
          done[rid] = result
      if queue and not self.active:
        rid, prompt, _ = queue[0]
        raise OutOfPagesError(rid, self.allocators[0].pages_needed(self._pool_tokens(len(prompt))),
                              max(a.num_free for a in self.allocators))
      for f in self.step():
        done[f.request_id] = f
    return done

  # Helpers.
  def _shard(self, slot: int) -> int:
    """The data shard of `slot` (0 without a data-parallel mesh)."""
    return slot // self._slots_per_shard

  def _row(self, request_id: Hashable, shard: int) -> np.ndarray:
    """`i32[pages_per_seq]`: the block-table row of `request_id` in pool page ids."""
    row = self.allocators[shard].block_table_row(request_id)
    return np.where(row == NO_PAGE, NO_PAGE, row + shard * self._pages_per_shard).astype(np.int32)

  def _choose_slot(self, free: list[int], prompt: np.ndarray) -> int:
    """The slot a joining prompt takes: the first free slot whose data shard can take it
    (with the prefix cache, shards holding a longer cached prefix first); if none can,
    the first free slot (whose allocator then raises OutOfPagesError). One data shard:
    always `free[0]`."""
    if len(self.allocators) == 1:
      return free[0]
    firsts = {}
    for s in free:
      firsts.setdefault(self._shard(s), s)
    order = list(firsts)
    if self.prefix_cache:
      order.sort(key=lambda j: -self.allocators[j].match(prompt))
    for j in order:
      if self.allocators[j].can_allocate(self._pool_tokens(len(prompt))):
        return firsts[j]
    return free[0]

  def _bucket(self, n: int) -> int:
    """Padded prefill width: `max_prompt_len`, or with the prefix cache the
    next power of two >= n (at most `max_prompt_len`)."""
    if self._chunked_prefill:  # one width: whole pages
      return pages_for(self.max_prompt_len, self.page_size) * self.page_size
    if not self.prefix_cache:
      return self.max_prompt_len
    return min(self.max_prompt_len, 1 << max(0, int(n) - 1).bit_length())

  def _prefill(self, slot: int, row: np.ndarray, rest: np.ndarray, start: int, snapshot):
    """Runs the join program: `rest` (the prompt after its `start` cached tokens) into slot
    `slot`. Returns `(caches, first token, rng)`."""
    padded = np.zeros((self._bucket(len(rest)),), np.int32)
    padded[:len(rest)] = rest
    return self._join(self._state, self.caches, np.int32(slot), row, padded,
                      np.int32(len(rest)), self._rng, np.int32(start), snapshot)

  def _keep_snapshot(self, slot: int, request_id: Hashable, held: int) -> None:
    """With rings and the prefix cache: snapshots the slot's rings at the last page boundary
    of its `held` tokens when the registered chain ends there without one."""
    if self._snapshots is None:
      return
    end = held // self.page_size * self.page_size
    if isinstance(self._snapshots, ResidualSnapshots) and end != held:
      return  # only at the row's exact length (`add` split the prefill there)
    allocator = self.allocators[self._shard(slot)]
    if allocator.needs_state(request_id, end):
      allocator.set_state(request_id, end, self._snapshots.take(self.caches, slot, end),
                          self._snapshots.nbytes)

  def _reason(self, live: _Live, token: int) -> str | None:
    if self.eos_id is not None and token == self.eos_id:
      return "eos"
    if len(live.tokens) >= live.max_new_tokens:
      return "length"
    return None

  def _finish(self, slot: int, reason: str) -> Finished:
    live = self._slots[slot]
    if self.prefix_cache and not self._chunked_prefill:
      # The cache holds the prompt and the generated tokens fed back. (Low-bit pools register
      # only their prompt pages, at join: a page a decode step filled holds what attention
      # over the quantized store computed, not what a prefill of the same text writes.)
      held = np.concatenate([live.prompt, np.asarray(live.tokens[:live.cache_len - len(
          live.prompt)], np.int64)])
      allocator = self.allocators[self._shard(slot)]
      allocator.register(live.request_id, held)
      self._keep_snapshot(slot, live.request_id, live.cache_len)  # before the rings are reset
      allocator.free(live.request_id)
    else:
      self.allocators[self._shard(slot)].free(live.request_id)
    self.caches = self._release(self.caches, np.int32(slot))
    self._slots[slot] = None
    self._last[slot] = self.pad_id
    self._ends[slot] = 0
    return Finished(live.request_id, np.asarray(live.tokens, np.int32), reason, slot,
                    live.joined_step, self.steps)
