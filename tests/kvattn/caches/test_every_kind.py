"""Conformance: every registered cache kind keeps the cache protocol's invariants.

One list, `SETTINGS`, gives each kind of `kvattn.caches.registry.CACHE_KIND_TABLE`
an easy setting (room for every token: results equal the dense cache's) and a
hard one (small windows, budgets and pages: wrapping, eviction, page boundaries).
A kind registered without settings fails `test_every_registered_kind_has_settings`,
so a new kind cannot skip the invariants (kvpress's `default_presses` is the
model). The test-only kind of `reversed_kind.py` and the policy of a module outside the
package, `tests/experiments/user_policy.py`, are registered by importing them: a kind of
your own joins by one import line and one `SETTINGS` entry here.

Invariants (DESIGN.md, "Cache protocol"):
  * room for every token: prefill logits and greedy tokens equal the dense cache's;
  * NaN / garbage in unused slots never changes a result (bit for bit);
  * per-sequence lengths: a row of a ragged batch equals that row beside another partner;
  * a donated cache is updated in place: every storage buffer of the jitted decode
    step's output is the input's buffer (XLA aliased the donation);
  * save / restore round-trips every leaf bit for bit;
  * measured bytes per token equal the analytic count.

The latent cache (kind "dense" of an MLA model) runs the same invariants below; the
sharded kinds need a device mesh and are checked against one device in tests/sharding.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kvattn import memory
from kvattn.caches import checkpoint
from kvattn.caches import eviction
from kvattn.caches import registry
from kvattn.caches import transaction
from kvattn.caches.dense import KVCache, LatentCache
from kvattn.caches.length_switch import LengthSwitchKVCache
from kvattn.caches.paged import PagedKVCache
from kvattn.inference import speculative
from kvattn.inference.generation import generate, prefill
from kvattn.models import transformer
from tests.experiments import user_policy  # noqa: F401  (registers policy "keydiff-lite")
from tests.kvattn.caches import reversed_kind  # noqa: F401  (registers kind "reversed")
from tests.kvattn.caches import toy_paged_kind  # noqa: F401  (registers kind "toy_paged")

_POLICY = ({"budget": 64}, {"budget": 6})
SETTINGS = {
    "dense": ({}, {}),
    "paged": ({"page_size": 4}, {"page_size": 3, "seed": 1}),
    "ring": ({"window": 64}, {"window": 5}),
    "sink": ({"num_sinks": 2, "window": 62}, {"num_sinks": 1, "window": 4}),
    "h2o": _POLICY, "snapkv": _POLICY, "tova": _POLICY, "tova_per_head": _POLICY, "recent": _POLICY,
    "random": _POLICY, "knorm": _POLICY, "keydiff-lite": _POLICY,
    # The presses (kvattn/caches/presses/): hard = budget 6 with their own windows and chunks.
    "keydiff": _POLICY, "qfilter": _POLICY,
    "expected_attention": ({"budget": 64}, {"budget": 6, "num_sinks": 1, "n_future_positions": 4}),
    "chunkkv": ({"budget": 64}, {"budget": 6, "chunk_size": 2, "window_size": 2}),
    "criticalkv": ({"budget": 64}, {"budget": 6, "window_size": 2, "first_keep": 2}),
    "snapkv+knorm": ({"budget": 64}, {"budget": 6, "window_size": 2, "first_keep": 8}),
    "decoding_knorm": ({"budget": 64}, {"budget": 6, "compression_interval": 2}),
    "length_switch": ({"switch_length": 64, "num_kv_heads_after": 1},
                      {"switch_length": 5, "num_kv_heads_after": 1}),
    "reversed": ({}, {}),
    "pyramidkv": ({"budget": 64}, {"budget": 6}),  # layers (94, 34) / (9, 3) slots
    "duo": ({"num_sinks": 2, "window": 62}, {"num_sinks": 1, "window": 3, "pattern": "RS,SR"}),
    "think": ({"keep_channels": 8}, {"keep_channels": 3, "window_size": 2}),  # of head_dim 8
    "adakv": ({"budget": 16}, {"budget": 3, "kernel_size": 3, "window_size": 1}),
    # AdaKV under kvpress's protocol: easy = ratio 0 (every token kept); hard = half the prompt.
    "adakv_keydiff": ({"compression_ratio": 0.0}, {"compression_ratio": 0.5}),
    "adakv_knorm": ({"compression_ratio": 0.0}, {"compression_ratio": 0.5, "alpha": 0.0}),
    "adakv_snapkv": ({"compression_ratio": 0.0},
                     {"compression_ratio": 0.5, "window_size": 2, "kernel_size": 3}),
    "adakv_expected_attention": ({"compression_ratio": 0.0},
                                 {"compression_ratio": 0.5, "num_sinks": 1,
                                  "n_future_positions": 4}),
    "toy_paged": ({"page_size": 4}, {"page_size": 3, "seed": 1}),
    # KIVI: easy = every token in the residual; hard = groups of 2 flushed behind 2 residual
    # tokens (kivi2), and behind none with keys before RoPE and f32 scales (kivi4).
    "kivi2": ({"group_size": 4, "residual": 16}, {"group_size": 2, "residual": 2}),
    "kivi4": ({"group_size": 4, "residual": 16},
              {"group_size": 2, "residual": 0, "pre_rope": True, "scale_dtype": "float32"}),
    # Rotated codebook: easy = every token in the residual; hard = 2 or no residual tokens.
    "rotated3": ({"residual": 16}, {"residual": 2, "codebook": "uniform"}),
    "rotated4": ({"residual": 16}, {"residual": 0, "seed": 3, "scale_dtype": "float32"}),
    # Paged KIVI: hard = groups of 2 in pages of 6 (3 groups) or 4, shuffled pages.
    "paged_kivi2": ({"group_size": 4, "residual": 16, "page_size": 8},
                    {"group_size": 2, "residual": 0, "pre_rope": True, "page_size": 4,
                     "seed": 2}),
    "paged_kivi4": ({"group_size": 4, "residual": 16, "page_size": 8},
                    {"group_size": 2, "residual": 2, "page_size": 6, "seed": 1}),
}
"""Cache kind -> (easy options, hard options)."""
FLOAT_ONLY = {k for k, v in registry.CACHE_KIND_TABLE.items() if v.float_only}
"""Kinds that store no quantization scales (`CacheKind.float_only`): int8 is a TypeError."""

KINDS = sorted(SETTINGS)
SLOW_KINDS = {"snapkv", "tova", "tova_per_head", "recent", "random", "knorm", "keydiff-lite", "kivi2", "rotated3",
              "paged_kivi2", "paged_kivi4", "rotated4", "toy_paged",
              # PyramidKV shares h2o's class; DuoKVCache and ThinKCache are checked against
              # numpy references step by step in test_duo.py / test_think.py.
              "pyramidkv", "duo", "think",
              # AdaKVCache: every step against a numpy reference of the pool in test_adakv.py.
              "adakv",
              # AdaKVContextCache (~15 CPU-s per kind here): its selection, append, overflow
              # and NaN in empty slots are checked in test_adakv_context.py's fast tests.
              "adakv_keydiff", "adakv_knorm", "adakv_snapkv", "adakv_expected_attention",
              # The presses (~20 CPU-s each here): EvictingKVCache (and two subclasses: a filters
              # leaf; eviction only when full) with another score, each checked against its numpy
              # reference over ragged rows, NaN slots and budget +-1 in tests/kvattn/caches/presses.
              "keydiff", "expected_attention", "qfilter", "chunkkv", "criticalkv", "snapkv+knorm",
              "decoding_knorm"}
"""Kinds that share another kind's class and differ in a setting: the eviction policies
share h2o's (only the score differs; each score has its own tests in test_eviction.py,
the test-only keydiff-lite's in tests/experiments: the main job and chat run it),
kivi2, rotated3 and paged_kivi2 share kivi4's, rotated4's and paged_kivi4's (other bit
widths: test_kivi.py, test_rotated.py, test_paged_kivi.py); paged_kivi4 is kivi4's class
with the store in pages, which test_paged_kivi.py checks against kivi4 bit for bit in the
fast suite (with garbage in free pages; its conformance runs cost ~45 CPU-s); rotated4
shares kivi4's base (`caches._residual`: the full-precision window, its flush into the
store, per-sequence lengths and rollback are that base's code, which kivi4 runs here), and
its rotation and codebook have their own reference tests in test_rotated.py (~25 CPU-s
saved). Every kind-parametrized test runs them under `-m slow`; every other kind, a new one
included, runs in the fast suite (toy_paged, the test-only pageable kind, is paged's class
under another name: tests/kvattn/caches/test_toy_paged_kind.py runs it fast)."""
HEAVY_KINDS = [pytest.param(k, marks=pytest.mark.slow) if k in SLOW_KINDS else k for k in KINDS]
PROMPT_LENGTHS = np.array([9, 5], np.int32)
NEW_TOKENS = 6


@pytest.fixture(scope="module")
def model():
  cfg = transformer.model_config(d_model=32, num_layers=2, mlp_dim=64,
                                 attention=dict(num_heads=4, num_kv_heads=2, head_dim=8))
  return transformer.Transformer.from_config(cfg, rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def prompts():
  rng = np.random.default_rng(0)
  out = rng.integers(0, 256, (2, int(PROMPT_LENGTHS.max())), dtype=np.int32)
  out[1, PROMPT_LENGTHS[1]:] = 0
  return out


def _spec(kind, hard):
  return {"kind": kind, **SETTINGS[kind][hard]}


def _poison(caches):
  """The caches with every storage array's every slot replaced by garbage (all slots of an
  empty cache are unused): NaN for floats, 77 for int8."""

  def poison_one(cache):
    storage = {id(a) for a in cache.storage_arrays()}

    def garbage(x):
      if id(x) not in storage:
        return x
      return jnp.full_like(x, 77 if jnp.issubdtype(x.dtype, jnp.integer) else jnp.nan)

    return jax.tree.map(garbage, cache)

  return tuple(poison_one(c) for c in caches)


@functools.partial(jax.jit, static_argnums=0)
def _jitted_logits(graphdef, state, caches, prompts, lengths):
  return nnx.merge(graphdef, state)(prompts, caches, new_lengths=lengths)[0]


def _prefill_logits(model, caches, prompts):
  """The model's logits over `prompts` through `caches`, jitted (an eager call compiles every
  operation on its own: ~5x the CPU time of one compile for the low-bit kinds)."""
  graphdef, state = nnx.split(model)
  return np.asarray(_jitted_logits(graphdef, state, caches, jnp.asarray(prompts),
                                   jnp.asarray(PROMPT_LENGTHS)))


def test_every_registered_kind_has_settings():
  assert set(registry.CACHE_KIND_TABLE) <= set(SETTINGS), (
      "add an easy and a hard setting for the new kind to SETTINGS")


@pytest.mark.parametrize("kind", HEAVY_KINDS)
def test_with_room_for_every_token_results_equal_the_dense_cache(model, prompts, kind):
  max_len = int(PROMPT_LENGTHS.max()) + NEW_TOKENS
  dense = model.init_caches(2, max_len)
  caches = registry.build_caches(model, 2, max_len, None, _spec(kind, 0))
  np.testing.assert_allclose(_prefill_logits(model, caches, prompts),
                             _prefill_logits(model, dense, prompts), atol=1e-5, rtol=1e-5)
  want, _ = generate(model, prompts, PROMPT_LENGTHS, NEW_TOKENS)
  got, _ = generate(model, prompts, PROMPT_LENGTHS, NEW_TOKENS,
                    cache_factory=registry.cache_factory_from_config(model, _spec(kind, 0)))
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("kind", HEAVY_KINDS)
def test_garbage_in_unused_slots_and_per_sequence_lengths(model, prompts, kind):
  spec = _spec(kind, 1)
  factory = registry.cache_factory_from_config(model, spec)
  clean, _ = generate(model, prompts, PROMPT_LENGTHS, NEW_TOKENS, cache_factory=factory)
  dirty, _ = generate(model, prompts, PROMPT_LENGTHS, NEW_TOKENS,
                      cache_factory=lambda b, n, d=None: _poison(factory(b, n, d)))
  np.testing.assert_array_equal(np.asarray(dirty), np.asarray(clean))
  max_len = int(PROMPT_LENGTHS.max()) + NEW_TOKENS
  np.testing.assert_array_equal(
      _prefill_logits(model, _poison(registry.build_caches(model, 2, max_len, None, spec)),
                      prompts),
      _prefill_logits(model, registry.build_caches(model, 2, max_len, None, spec), prompts))
  # Row 1 of the ragged batch equals the same prompt beside another partner, of a third
  # length (7: a row that read its partner's length, or the batch's longest, would change);
  # the batch keeps its shape, so nothing recompiles.
  partner = np.random.default_rng(1).integers(0, 256, prompts.shape[1], dtype=np.int32)
  partner[7:] = 0
  swapped, _ = generate(model, np.stack([prompts[1], partner]),
                        np.array([PROMPT_LENGTHS[1], 7], np.int32), NEW_TOKENS,
                        cache_factory=factory)
  np.testing.assert_array_equal(np.asarray(swapped)[0], np.asarray(clean)[1])


@pytest.mark.parametrize("kind", HEAVY_KINDS)
def test_a_donated_cache_is_updated_in_place(model, prompts, kind):
  caches = registry.build_caches(model, 2, 16, None, _spec(kind, 1))
  first, caches, _ = prefill(model, prompts, PROMPT_LENGTHS, caches)
  graphdef, state = nnx.split(model)

  @jax.jit
  def _step(state, caches, tokens):
    _, caches = nnx.merge(graphdef, state)(tokens, caches)
    return caches

  step = jax.jit(_step, donate_argnums=1)
  before = [a.unsafe_buffer_pointer() for c in caches for a in c.storage_arrays()]
  after = step(state, caches, first[:, None])
  assert all(a.is_deleted() for c in caches for a in c.storage_arrays())
  assert [a.unsafe_buffer_pointer() for c in after for a in c.storage_arrays()] == before


@pytest.mark.parametrize("kind", HEAVY_KINDS)
def test_save_and_restore_round_trip_bit_for_bit(model, prompts, kind, tmp_path):
  spec = _spec(kind, 1)
  dtype = jnp.float32 if kind in FLOAT_ONLY else jnp.int8
  caches = registry.build_caches(model, 2, 16, dtype, spec)
  _, caches, _ = prefill(model, prompts, PROMPT_LENGTHS, caches)
  checkpoint.save_caches(tmp_path / "ckpt", caches)
  like = registry.build_caches(model, 2, 16, dtype, spec)
  restored, _, _ = checkpoint.restore_caches(tmp_path / "ckpt", like)
  for a, b in zip(jax.tree.leaves(caches), jax.tree.leaves(restored)):
    assert a.dtype == b.dtype and a.shape == b.shape
    np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.int8])
@pytest.mark.parametrize("kind", KINDS)
def test_measured_bytes_per_token_equal_the_analytic_count(model, kind, dtype):
  spec = _spec(kind, 1)
  if kind in FLOAT_ONLY and dtype == jnp.int8:
    with pytest.raises(TypeError, match="dtype"):
      registry.build_caches(model, 2, 16, dtype, spec)
    return
  caches = registry.build_caches(model, 2, 16, dtype, spec)
  measured = sum(memory.measured_bytes_per_token(c) for c in caches)
  attn = model.layers[0].attn
  per_layer = memory.gqa_bytes_per_token(attn.num_kv_heads, attn.head_dim, dtype)
  if kind == "length_switch":  # a full segment of switch_length slots + a pooled one of S
    after, switch = spec["num_kv_heads_after"], spec["switch_length"]
    full = per_layer * switch // 16  # K heads, switch_length of the 16 slots
    pooled = memory.gqa_bytes_per_token(after, attn.head_dim, dtype)
    per_layer = full + pooled
  if hasattr(caches[0], "analytic_bytes_per_token"):  # kinds with their own count (KIVI)
    per_layer = caches[0].analytic_bytes_per_token()
  assert measured == pytest.approx(model.num_layers * per_layer), kind


# ----------------------------------------------------------------------------------------------
# Every eviction policy as kvpress's protocol (`compress="context"`, an option of each eviction
# kind rather than a kind of its own): its reference tests are test_context_compression.py.

CONTEXT_LENGTHS = np.array([6, 3], np.int32)


@pytest.mark.parametrize("kind", [pytest.param(k, marks=pytest.mark.slow) if k in SLOW_KINDS
                                  else k for k in sorted(eviction.POLICY_TABLE)])
def test_every_policy_compresses_the_context_then_grows(model, prompts, kind):
  # Ratio 0 keeps every token: generate's greedy tokens are the dense cache's.
  spec = {"kind": kind, "compress": "context", "compression_ratio": 0.0}
  want, _ = generate(model, prompts, PROMPT_LENGTHS, NEW_TOKENS)
  got, _ = generate(model, prompts, PROMPT_LENGTHS, NEW_TOKENS, context_lengths=CONTEXT_LENGTHS,
                    cache_factory=registry.cache_factory_from_config(model, spec))
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  # Half the context, prefill only (one program): NaN in unused slots changes nothing; a row
  # equals itself beside another partner (another context and prompt, the same widths); each
  # KV head keeps int(c / 2) context tokens plus the rest of the prompt.
  factory = registry.cache_factory_from_config(model, dict(spec, compression_ratio=0.5))
  partner = np.random.default_rng(1).integers(0, 256, prompts.shape[1], dtype=np.int32)
  runs = [(factory(2, 16), prompts, PROMPT_LENGTHS, CONTEXT_LENGTHS),
          (_poison(factory(2, 16)), prompts, PROMPT_LENGTHS, CONTEXT_LENGTHS),
          (factory(2, 16), np.stack([prompts[1], partner]), np.array([5, 9], np.int32),
           np.array([3, 6], np.int32))]
  (first, clean), (dirty_first, dirty), (swapped_first, swapped) = [
      prefill(model, p, n, c, context_lengths=ctx)[:2] for c, p, n, ctx in runs]
  np.testing.assert_array_equal(np.asarray(dirty_first), np.asarray(first))
  np.testing.assert_array_equal(np.asarray(swapped_first)[0], np.asarray(first)[1])
  for a, b, c in zip(clean, dirty, swapped):
    pos = np.asarray(a.slot_positions())
    np.testing.assert_array_equal(np.asarray(b.slot_positions()), pos)
    np.testing.assert_array_equal(np.asarray(c.slot_positions())[0], pos[1])
    held = (pos >= 0)[..., None]
    np.testing.assert_array_equal(np.where(held, np.asarray(b.k), 0), np.where(held, a.k, 0))
    np.testing.assert_array_equal(np.where(held[1], np.asarray(c.k)[0], 0),
                                  np.where(held[1], a.k[1], 0))
    kept = (pos >= 0).sum(-1)  # [B, K]
    want = CONTEXT_LENGTHS // 2 + PROMPT_LENGTHS - CONTEXT_LENGTHS
    np.testing.assert_array_equal(kept, want[:, None].repeat(kept.shape[1], 1))


# ----------------------------------------------------------------------------------------------
# The latent cache: kind "dense" of an MLA model builds `LatentCache`s.

MLA = dict(kind="mla", num_heads=4, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
           v_head_dim=8)


@pytest.fixture(scope="module")
def mla_model():
  cfg = transformer.model_config(d_model=32, num_layers=2, mlp_dim=64, attention=MLA)
  return transformer.Transformer.from_config(cfg, rngs=nnx.Rngs(0))


def test_the_latent_cache_keeps_the_invariants(mla_model, prompts, tmp_path):
  model, max_len = mla_model, int(PROMPT_LENGTHS.max()) + NEW_TOKENS
  caches = registry.build_caches(model, 2, max_len, None, {"kind": "dense"})
  assert all(type(c).__name__ == "LatentCache" for c in caches)
  # Garbage in unused slots changes nothing, bit for bit.
  np.testing.assert_array_equal(_prefill_logits(model, _poison(caches), prompts),
                                _prefill_logits(model, caches, prompts))
  factory = registry.cache_factory_from_config(model, {"kind": "dense"})
  clean, _ = generate(model, prompts, PROMPT_LENGTHS, NEW_TOKENS, cache_factory=factory)
  dirty, _ = generate(model, prompts, PROMPT_LENGTHS, NEW_TOKENS,
                      cache_factory=lambda b, n, d=None: _poison(factory(b, n, d)))
  np.testing.assert_array_equal(np.asarray(dirty), np.asarray(clean))
  # A row of a ragged batch equals the row alone.
  alone, _ = generate(model, prompts[1:, :PROMPT_LENGTHS[1]], PROMPT_LENGTHS[1:], NEW_TOKENS)
  np.testing.assert_array_equal(np.asarray(alone)[0], np.asarray(clean)[1])
  # Save / restore bit for bit (int8 latents with their scales).
  caches = registry.build_caches(model, 2, 16, jnp.int8, {"kind": "dense"})
  _, caches, _ = prefill(model, prompts, PROMPT_LENGTHS, caches)
  checkpoint.save_caches(tmp_path / "ckpt", caches)
  restored, _, _ = checkpoint.restore_caches(
      tmp_path / "ckpt", registry.build_caches(model, 2, 16, jnp.int8, {"kind": "dense"}))
  for a, b in zip(jax.tree.leaves(caches), jax.tree.leaves(restored)):
    np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
  # Measured bytes per token: C + R numbers per layer (+ one f32 scale per part when int8).
  for dtype, per_layer in ((jnp.float32, (16 + 4) * 4), (jnp.int8, 16 + 4 + 2 * 4)):
    built = registry.build_caches(model, 2, 16, dtype, {"kind": "dense"})
    assert sum(memory.measured_bytes_per_token(c) for c in built) == 2 * per_layer


def test_the_donated_latent_cache_is_updated_in_place(mla_model, prompts):
  model = mla_model
  caches = registry.build_caches(model, 2, 16, None, {"kind": "dense"})
  first, caches, _ = prefill(model, prompts, PROMPT_LENGTHS, caches)
  graphdef, state = nnx.split(model)

  def _step(state, caches, tokens):
    _, caches = nnx.merge(graphdef, state)(tokens, caches)
    return caches

  step = jax.jit(_step, donate_argnums=1)
  before = [a.unsafe_buffer_pointer() for c in caches for a in c.storage_arrays()]
  after = step(state, caches, first[:, None])
  assert [a.unsafe_buffer_pointer() for c in after for a in c.storage_arrays()] == before


# ----------------------------------------------------------------------------------------------
# Speculative decoding: drafts written through a transaction (kvattn.caches.transaction), the
# rejected ones rolled back. DRAFT_TOKENS + 1 = 5 tokens per pass: the hard ring (window 5)
# and sinks (window 4) wrap inside one pass, and every token of a full hard eviction cache
# (budget 6 < the 9-token prompt) evicts one, so rejected tokens trigger evictions.

DRAFT_TOKENS = 4
KEEP = np.array([2, 4], np.int32)
"""Draft tokens kept per row in the rollback test (of DRAFT_TOKENS + 1 written)."""


def _defined(cache):
  """`cache` with every slot that holds no token zeroed, for the kinds that roll back by
  lengths (the rejected tokens stay behind as unused slots, which the protocol lets hold
  anything); other kinds as they are (compared bit for bit, every leaf)."""

  def masked(x, lengths, axis):
    slots = jnp.arange(x.shape[axis]).reshape((-1,) + (1,) * (x.ndim - axis - 1))
    held = slots < lengths.reshape((-1,) + (1,) * (x.ndim - 1))
    return None if x is None else jnp.where(held, x, jnp.zeros((), x.dtype))

  if isinstance(cache, PagedKVCache):
    cache = cache.to_dense()
  if isinstance(cache, LengthSwitchKVCache):
    full = jnp.minimum(cache.lengths, cache.switch_length)
    return cache.replace(**{f: masked(getattr(cache, f), full, 2) for f in ("k", "v")},
                         **{f: masked(getattr(cache, f), full, 2) for f in ("k_scale", "v_scale")
                            if getattr(cache, f) is not None},
                         **{f: masked(getattr(cache, f), cache.lengths, 2)
                            for f in ("k_pooled", "v_pooled", "k_pooled_scale", "v_pooled_scale")
                            if getattr(cache, f) is not None})
  if isinstance(cache, (KVCache, LatentCache)):
    axis = 2 if isinstance(cache, KVCache) else 1
    fields = cache._VALUES + (cache._SCALES if cache.quantized else ())  # pylint: disable=protected-access
    return cache.replace(**{f: masked(getattr(cache, f), cache.lengths, axis) for f in fields})
  return cache


def _assert_bits_equal(a, b):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    assert x.dtype == y.dtype and x.shape == y.shape
    np.testing.assert_array_equal(np.asarray(x).view(np.uint8), np.asarray(y).view(np.uint8))


def _check_rollback(model, prompts, spec, dtype=None):
  """Drafts `[B, T]` through a transaction, kept per row up to KEEP: (1) the cache and the
  kept tokens' logits equal, bit for bit, those of the same pass with other rejected
  tokens; (2) the cache holds the tokens of token-by-token decoding of the kept tokens
  (`slot_positions`, `lengths`) and gives the same next logits."""
  graphdef, state = nnx.split(model)
  num_tokens = DRAFT_TOKENS + 1

  @jax.jit
  def draft(state, caches, tokens, keep):
    logits, drafts = nnx.merge(graphdef, state)(tokens, transaction.begin_all(caches))
    return logits, transaction.commit_all(drafts, keep)

  @jax.jit
  def step(state, caches, tokens, new_lengths):
    return nnx.merge(graphdef, state)(tokens, caches, new_lengths=new_lengths)

  def prefilled():
    caches = registry.build_caches(model, 2, 16, dtype, spec)
    return prefill(model, prompts, PROMPT_LENGTHS, caches)[1]

  rng = np.random.default_rng(2)
  tokens = rng.integers(0, 256, (2, num_tokens), dtype=np.int32)
  rejected = np.arange(num_tokens)[None, :] >= KEEP[:, None]
  other = np.where(rejected, (tokens + 1 + rng.integers(0, 255, tokens.shape)) % 256, tokens)
  logits, kept = draft(state, prefilled(), tokens, KEEP)
  other_logits, other_kept = draft(state, prefilled(), other.astype(np.int32), KEEP)
  for b, n in enumerate(KEEP):
    np.testing.assert_array_equal(np.asarray(logits)[b, :n], np.asarray(other_logits)[b, :n])
  _assert_bits_equal(tuple(map(_defined, kept)), tuple(map(_defined, other_kept)))

  steps = prefilled()
  for t in range(num_tokens):
    _, steps = step(state, steps, tokens[:, t:t + 1], (t < KEEP).astype(np.int32))
  for a, b in zip(kept, steps):
    np.testing.assert_array_equal(np.asarray(a.lengths), np.asarray(b.lengths))
    np.testing.assert_array_equal(np.asarray(a.slot_positions()), np.asarray(b.slot_positions()))
  nxt = rng.integers(0, 256, (2, 1), dtype=np.int32)
  ones = np.ones(2, np.int32)
  np.testing.assert_allclose(np.asarray(step(state, kept, nxt, ones)[0]),
                             np.asarray(step(state, steps, nxt, ones)[0]), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", HEAVY_KINDS)
def test_a_rolled_back_draft_leaves_no_trace(model, prompts, kind):
  _check_rollback(model, prompts, _spec(kind, 1))


@pytest.mark.slow  # the fast suite rolls back every kind in f32; scales are per token
@pytest.mark.parametrize("kind", KINDS)
def test_a_rolled_back_quantized_draft_leaves_no_trace(model, prompts, kind):
  if kind in FLOAT_ONLY:
    pytest.skip("stores no scales")
  _check_rollback(model, prompts, _spec(kind, 1), jnp.int8)


@pytest.fixture(scope="module")
def repeating_prompts(prompts):
  """The module's prompts with row 0 repeating its first tokens (prompt lookup drafts
  there; row 1's random tokens give mostly rejected drafts: acceptance differs per row)."""
  out = prompts.copy()
  out[0, 4:8] = out[0, :4]
  return out


SPECULATIVE_FAST = ("dense", "reversed")
"""Rolling back by lengths and the generic copy with stepwise verification (of a kind
kvattn does not know); the rollback test above runs every kind but `SLOW_KINDS` in the fast
suite (the ring and sinks wrapping inside a pass among them), and this generation test every
kind in the slow one."""


@pytest.mark.parametrize("kind", [*SPECULATIVE_FAST, *[pytest.param(k, marks=pytest.mark.slow)
                                                       for k in KINDS
                                                       if k not in SPECULATIVE_FAST]])
def test_speculative_greedy_equals_plain_greedy(model, repeating_prompts, kind):
  factory = registry.cache_factory_from_config(model, _spec(kind, 1))
  want, want_lengths = generate(model, repeating_prompts, PROMPT_LENGTHS, 3 * NEW_TOKENS,
                                cache_factory=factory)
  # (tests/kvattn/inference/test_speculative.py runs the draft model.)
  for drafter in [speculative.PromptLookup(DRAFT_TOKENS, max_ngram_size=2)]:
    got, got_lengths = generate(model, repeating_prompts, PROMPT_LENGTHS, 3 * NEW_TOKENS,
                                cache_factory=factory, speculative=drafter)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=repr(drafter))
    np.testing.assert_array_equal(np.asarray(got_lengths), np.asarray(want_lengths))
