"""Conformance: every registered cache kind keeps the cache protocol's invariants.

One list, `SETTINGS`, gives each kind of `kvattn.caches.registry.CACHE_KIND_TABLE`
an easy setting (room for every token: results equal the dense cache's) and a
hard one (small windows, budgets and pages: wrapping, eviction, page boundaries).
A kind registered without settings fails `test_every_registered_kind_has_settings`,
so a new kind cannot skip the invariants (kvpress's `default_presses` is the
model). The test-only kind of `reversed_kind.py` is registered by importing it.

Invariants (DESIGN.md, "Cache protocol"):
  * room for every token: prefill logits and greedy tokens equal the dense cache's;
  * NaN / garbage in unused slots never changes a result (bit for bit);
  * per-sequence lengths: a row of a ragged batch equals that row decoded alone;
  * a donated cache is updated in place: every storage buffer of the jitted decode
    step's output is the input's buffer (XLA aliased the donation);
  * save / restore round-trips every leaf bit for bit;
  * measured bytes per token equal the analytic count.

The latent cache (kind "dense" of an MLA model) runs the same invariants below; the
sharded kinds need a device mesh and are checked against one device in tests/sharding.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kvattn import memory
from kvattn.caches import checkpoint
from kvattn.caches import registry
from kvattn.inference.generation import generate, prefill
from kvattn.models import transformer
from tests.kvattn.caches import reversed_kind  # noqa: F401  (registers kind "reversed")

_POLICY = ({"budget": 64}, {"budget": 6})
SETTINGS = {
    "dense": ({}, {}),
    "paged": ({"page_size": 4}, {"page_size": 3, "seed": 1}),
    "ring": ({"window": 64}, {"window": 5}),
    "sink": ({"num_sinks": 2, "window": 62}, {"num_sinks": 1, "window": 4}),
    "h2o": _POLICY, "snapkv": _POLICY, "tova": _POLICY, "recent": _POLICY,
    "random": _POLICY, "knorm": _POLICY,
    "length_switch": ({"switch_length": 64, "num_kv_heads_after": 1},
                      {"switch_length": 5, "num_kv_heads_after": 1}),
    "reversed": ({}, {}),
    # KIVI: easy = every token in the residual; hard = groups of 2 flushed behind 2 residual
    # tokens (kivi2), and behind none with keys before RoPE and f32 scales (kivi4).
    "kivi2": ({"group_size": 4, "residual": 16}, {"group_size": 2, "residual": 2}),
    "kivi4": ({"group_size": 4, "residual": 16},
              {"group_size": 2, "residual": 0, "pre_rope": True, "scale_dtype": "float32"}),
    # Rotated codebook: easy = every token in the residual; hard = 2 or no residual tokens.
    "rotated3": ({"residual": 16}, {"residual": 2, "codebook": "uniform"}),
    "rotated4": ({"residual": 16}, {"residual": 0, "seed": 3, "scale_dtype": "float32"}),
}
"""Cache kind -> (easy options, hard options)."""
FLOAT_ONLY = {"reversed", "kivi2", "kivi4", "rotated3", "rotated4"}
"""Kinds that store no quantization scales: building them int8 is a TypeError."""

KINDS = sorted(SETTINGS)
SLOW_KINDS = {"snapkv", "tova", "recent", "random", "knorm"}
"""Eviction policies that share h2o's cache class (only the score differs; each score has its
own tests in test_eviction.py): the two generate-heavy tests run them under `-m slow`."""
SLOW_KINDS |= {"kivi2", "rotated3"}  # share kivi4's / rotated4's class (other bits: test_kivi.py,
# test_rotated.py)
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


def _prefill_logits(model, caches, prompts):
  logits, _ = model(jnp.asarray(prompts), caches, new_lengths=jnp.asarray(PROMPT_LENGTHS))
  return np.asarray(logits)


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
  # Row 1 of the ragged batch equals row 1 decoded alone.
  alone, _ = generate(model, prompts[1:, :PROMPT_LENGTHS[1]], PROMPT_LENGTHS[1:], NEW_TOKENS,
                      cache_factory=factory)
  np.testing.assert_array_equal(np.asarray(alone)[0], np.asarray(clean)[1])


@pytest.mark.parametrize("kind", KINDS)
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


@pytest.mark.parametrize("kind", KINDS)
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
