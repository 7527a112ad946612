"""The cache protocol: every cache kind implements it, and a new kind plugs into the modules.

`ReversedKVCache` (reversed_kind.py, registered as kind "reversed") and
`ReversedLatentCache` below are cache kinds that exist only in the tests: they store token t of a sequence in slot S - 1 - t. Nothing
in kvattn knows them, yet `GroupedQueryAttention`, `Transformer` and `generate`
run over the first, `MultiHeadLatentAttention` over the second, and give the
results of `KVCache` / `LatentCache` (DESIGN.md, "Cache protocol").
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx, struct

import kvattn
from kvattn.caches import dense as cache_lib
from kvattn import memory, ops
from kvattn.caches import protocol as cache_protocol
from kvattn.models import transformer
from tests.kvattn.caches.reversed_kind import ReversedKVCache, _write_reversed, _reversed_slot_positions  # noqa: F401


@struct.dataclass
class ReversedLatentCache:
  """Test-only `MLACache`: token t of sequence b sits in slot `S - 1 - t` of
  `c_kv: [B, S, C]` and `k_rope: [B, S, R]`."""

  c_kv: jax.Array
  k_rope: jax.Array
  lengths: jax.Array

  @classmethod
  def init(cls, batch, max_len, kv_lora_rank, qk_rope_head_dim, fill=0.0):
    return cls(c_kv=jnp.full((batch, max_len, kv_lora_rank), fill),
               k_rope=jnp.full((batch, max_len, qk_rope_head_dim), fill),
               lengths=jnp.zeros((batch,), jnp.int32))

  batch = property(lambda self: self.c_kv.shape[0])
  capacity = property(lambda self: self.c_kv.shape[1])
  kv_lora_rank = property(lambda self: self.c_kv.shape[2])
  qk_rope_head_dim = property(lambda self: self.k_rope.shape[2])
  storage_slots = property(lambda self: self.batch * self.capacity)

  def storage_arrays(self):
    return self.c_kv, self.k_rope

  def slot_positions(self):
    return _reversed_slot_positions(self.lengths, self.capacity)

  def update(self, c_kv_new, k_rope_new, new_lengths=None):
    new_lengths = cache_lib.resolve_new_lengths(new_lengths, *c_kv_new.shape[:2])
    return ReversedLatentCache(
        c_kv=_write_reversed(self.c_kv, c_kv_new, self.lengths, new_lengths, slot_axis=1),
        k_rope=_write_reversed(self.k_rope, k_rope_new, self.lengths, new_lengths, slot_axis=1),
        lengths=cache_lib.advance_lengths(self.lengths, new_lengths, self.capacity))

  def attend(self, q_latent, q_rope, *, q_offsets, sm_scale, window=None, implementation=None):
    c_kv, k_rope = self.c_kv[:, ::-1], self.k_rope[:, ::-1]  # token order
    if q_latent.shape[1] == 1:
      return ops.mla_decode_attention(q_latent[:, 0], q_rope[:, 0], c_kv, k_rope, self.lengths,
                                      sm_scale=sm_scale, window=window,
                                      implementation=implementation)[:, None]
    return ops.mla_attention(q_latent, q_rope, c_kv, k_rope, sm_scale=sm_scale,
                             q_offsets=q_offsets, kv_lengths=self.lengths, window=window)

  def attend_expanded(self, q, expand, *, dtype, q_offsets, sm_scale, window=None):
    k, v = expand(self.c_kv[:, ::-1], self.k_rope[:, ::-1])
    return ops.attention(q, k, v, q_offsets=q_offsets, kv_lengths=self.lengths,
                         sm_scale=sm_scale, window=window)


def test_every_cache_kind_implements_its_protocol():
  dense = kvattn.KVCache.init(2, 8, 2, 4)
  paged = kvattn.PagedKVCache.contiguous(2, 8, 2, 4, page_size=4)
  latent = kvattn.LatentCache.init(2, 8, 6, 2)
  toy = ReversedKVCache.init(2, 8, 2, 4)
  for c in (dense, paged, toy, kvattn.KVCache.init(2, 8, 2, 4, jnp.int8)):
    assert isinstance(c, cache_protocol.GQACache) and not isinstance(c, cache_protocol.MLACache)
  for c in (latent, ReversedLatentCache.init(2, 8, 6, 2)):
    assert isinstance(c, cache_protocol.MLACache) and not isinstance(c, cache_protocol.GQACache)
  assert not isinstance({"k": 1}, cache_protocol.Cache)
  assert (dense.capacity, paged.capacity, latent.capacity) == (8, 8, 8)
  assert (dense.storage_slots, paged.storage_slots, latent.storage_slots) == (16, 16, 16)
  # A pool smaller than B * max_len: storage_slots counts the pool's slots.
  small = kvattn.PagedKVCache.init(4, num_pages=3, page_size=4, pages_per_seq=2,
                                   num_kv_heads=2, head_dim=4)
  assert (small.capacity, small.storage_slots) == (8, 12)
  assert memory.measured_bytes_per_token(toy) == memory.gqa_bytes_per_token(2, 4, jnp.float32)


# kvattn's kinds with int8 storage: (cache, B, capacity, storage_slots, K, H, storage arrays,
# has `overflowed`). The members come from `kvattn.caches._slots`; these are their values.
def _int8_kinds():
  i8 = jnp.int8
  return {
      "dense": (kvattn.KVCache.init(2, 8, 3, 4, i8), 2, 8, 16, 3, 4, 4, True),
      "latent": (kvattn.LatentCache.init(2, 8, 6, 2, i8), 2, 8, 16, None, None, 4, True),
      "paged": (kvattn.PagedKVCache.init(3, num_pages=5, page_size=4, pages_per_seq=2,
                                         num_kv_heads=3, head_dim=4, dtype=i8),
                3, 8, 20, 3, 4, 4, True),
      "ring": (kvattn.RingKVCache.init(2, 5, 3, 4, i8), 2, 5, 10, 3, 4, 4, False),
      "sink": (kvattn.SinkKVCache.init(2, 1, 4, 3, 4, i8), 2, 5, 10, 3, 4, 4, False),
      "h2o": (kvattn.EvictingKVCache.init(2, 6, 3, 4, i8, policy="h2o"), 2, 6, 12, 3, 4, 4,
              False),
      "length_switch": (kvattn.LengthSwitchKVCache.init(2, 8, 3, 4, i8, switch_length=3,
                                                        num_kv_heads_after=1),
                        2, 8, 16, 3, 4, 8, True),
  }


@pytest.mark.parametrize("kind", sorted(_int8_kinds()))
def test_every_kind_reports_its_bookkeeping(kind):
  cache, batch, capacity, slots, heads, head_dim, arrays, overflows = _int8_kinds()[kind]
  assert (cache.batch, cache.capacity, cache.storage_slots) == (batch, capacity, slots)
  assert cache.dtype == jnp.int8 and cache.quantized
  stored = cache.storage_arrays()
  assert len(stored) == arrays and all(a.dtype in (jnp.int8, jnp.float32) for a in stored)
  assert set(cache.scale_kwargs()) <= {"k_scale", "v_scale", "c_kv_scale", "k_rope_scale",
                                       "k_pooled_scale", "v_pooled_scale"}
  if heads is None:  # an MLA cache has no GQA sizes, so it never passes for a GQACache
    assert not hasattr(cache, "num_kv_heads") and not hasattr(cache, "head_dim")
    assert isinstance(cache, cache_protocol.MLACache)
  else:
    assert (cache.num_kv_heads, cache.head_dim) == (heads, head_dim)
    assert isinstance(cache, cache_protocol.GQACache)
  assert hasattr(cache, "overflowed") == overflows  # bounded kinds never overflow
  if overflows:
    assert not np.asarray(cache.overflowed).any()
  float_cache = dict(dense=kvattn.KVCache.init(2, 8, 3, 4), latent=kvattn.LatentCache.init(
      2, 8, 6, 2)).get(kind)
  if float_cache is not None:
    assert not float_cache.quantized and float_cache.scale_kwargs() == {}
    assert len(float_cache.storage_arrays()) == 2
    np.testing.assert_array_equal(np.asarray(cache.dequantized()[0]), 0)
  cache.check_state()  # the empty state is valid


def test_slot_positions_say_which_token_each_slot_holds():
  k = jax.random.normal(jax.random.key(0), (2, 3, 2, 4))
  new = jnp.array([3, 1])
  dense = kvattn.KVCache.init(2, 5, 2, 4).update(k, k, new)
  latent = kvattn.LatentCache.init(2, 5, 6, 2).update(k[..., 0, :3].repeat(2, -1),
                                                      k[..., 0, :2], new)
  expected = [[0, 1, 2, -1, -1], [0, -1, -1, -1, -1]]
  np.testing.assert_array_equal(np.asarray(dense.slot_positions()), expected)
  np.testing.assert_array_equal(np.asarray(latent.slot_positions()), expected)
  tables = np.array([[2, -1], [0, 1]], np.int32)  # row 0 owns one page: 3 readable slots
  paged = kvattn.PagedKVCache.init(2, num_pages=3, page_size=3, pages_per_seq=2,
                                   num_kv_heads=2, head_dim=4, block_tables=tables)
  np.testing.assert_array_equal(np.asarray(paged.update(k, k, new).slot_positions()),
                                [[0, 1, 2, -1, -1, -1], [0, -1, -1, -1, -1, -1]])
  toy = ReversedKVCache.init(2, 5, 2, 4).update(k, k, new)
  np.testing.assert_array_equal(np.asarray(toy.slot_positions()),
                                [[-1, -1, 2, 1, 0], [-1, -1, -1, -1, 0]])
  np.testing.assert_array_equal(np.asarray(toy.k[0, :, 4]), np.asarray(k[0, 0]))  # token 0


def test_a_cache_that_implements_no_protocol_is_a_type_error_naming_cache():
  gqa = kvattn.GroupedQueryAttention(d_model=16, num_heads=4, num_kv_heads=2, head_dim=8,
                                     rngs=nnx.Rngs(0))
  mla = kvattn.MultiHeadLatentAttention(d_model=16, num_heads=2, kv_lora_rank=8,
                                        qk_nope_head_dim=4, qk_rope_head_dim=2, v_head_dim=4,
                                        rngs=nnx.Rngs(0))
  x = jnp.zeros((2, 1, 16))
  with pytest.raises(TypeError, match=r"cache must be a kvattn.KVCache, kvattn.PagedKVCache or "
                     r"None; got LatentCache \(GroupedQueryAttention reads caches that "
                     r"implement kvattn.caches.protocol.GQACache\)"):
    gqa(x, cache=kvattn.LatentCache.init(2, 4, 8, 2))
  with pytest.raises(TypeError, match=r"cache must be a kvattn.LatentCache or None; got "
                     r"ReversedKVCache \(MultiHeadLatentAttention reads caches that implement "
                     r"kvattn.caches.protocol.MLACache\)"):
    mla(x, cache=ReversedKVCache.init(2, 4, 2, 8))


def _prefill_then_decode(layer, x, prompt_lengths, *, prefill, steps):
  """A jitted `cache -> (prefill outputs, decode outputs [B, steps, D], lengths)`:
  one padded prefill of `x[:, :prefill]`, then `steps` one-token steps."""

  @jax.jit
  def run(cache):
    y0, cache = layer(x[:, :prefill], cache=cache, new_lengths=prompt_lengths)
    ys = []
    for t in range(steps):
      xt = jnp.take_along_axis(x, (prompt_lengths + t)[:, None, None], axis=1)
      yt, cache = layer(xt, cache=cache)
      ys.append(yt[:, 0])
    return y0, jnp.stack(ys, 1), cache.lengths

  return run


# No window is layer 0 of the transformer tests below; the slow run adds it here.
@pytest.mark.parametrize("window", [pytest.param(None, marks=pytest.mark.slow), 3])
def test_gqa_layer_over_the_toy_cache_equals_dense(window):
  layer = kvattn.GroupedQueryAttention(d_model=16, num_heads=4, num_kv_heads=2, head_dim=8,
                                       window=window, rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(1), (3, 10, 16))
  prompt_lengths = jnp.array([5, 1, 6], jnp.int32)
  run = _prefill_then_decode(layer, x, prompt_lengths, prefill=6, steps=3)
  # The toy's unused slots hold NaN: they must never reach a result.
  toy = run(ReversedKVCache.init(3, 12, 2, 8, fill=jnp.nan))
  dense = run(layer.init_cache(3, 12))
  real = np.arange(6)[None, :] < np.asarray(prompt_lengths)[:, None]  # padded outputs unspecified
  np.testing.assert_allclose(np.asarray(toy[0])[real], np.asarray(dense[0])[real], atol=1e-5)
  np.testing.assert_allclose(np.asarray(toy[1]), np.asarray(dense[1]), atol=1e-5)
  np.testing.assert_array_equal(np.asarray(toy[2]), [8, 4, 9])
  np.testing.assert_array_equal(np.asarray(toy[2]), np.asarray(dense[2]))


# "auto" prefills through `attend_expanded` (naive) and decodes through `attend` (absorbed):
# both protocol methods. The single-path runs are in the slow suite.
@pytest.mark.parametrize("path", ["auto", pytest.param("naive", marks=pytest.mark.slow),
                                  pytest.param("absorbed", marks=pytest.mark.slow)])
def test_mla_layer_over_the_toy_latent_cache_equals_latent_cache(path):
  layer = kvattn.MultiHeadLatentAttention(d_model=16, num_heads=2, kv_lora_rank=8,
                                          qk_nope_head_dim=4, qk_rope_head_dim=2, v_head_dim=4,
                                          window=4, path=path, rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(3), (2, 8, 16))
  prompt_lengths = jnp.array([5, 2], jnp.int32)
  run = _prefill_then_decode(layer, x, prompt_lengths, prefill=5, steps=2)
  toy = run(ReversedLatentCache.init(2, 10, 8, 2, fill=jnp.nan))
  latent = run(layer.init_cache(2, 10))
  real = np.arange(5)[None, :] < np.asarray(prompt_lengths)[:, None]
  np.testing.assert_allclose(np.asarray(toy[0])[real], np.asarray(latent[0])[real], atol=1e-5)
  np.testing.assert_allclose(np.asarray(toy[1]), np.asarray(latent[1]), atol=1e-5)
  np.testing.assert_array_equal(np.asarray(toy[2]), [7, 4])


def _model():
  cfg = transformer.model_config(d_model=32, num_layers=2, mlp_dim=64,
                                 layers=({}, {"window": 4}),
                                 attention=dict(num_heads=4, num_kv_heads=2, head_dim=8))
  return transformer.Transformer.from_config(cfg, rngs=nnx.Rngs(0))


def _toy_factory(model):
  def factory(batch, max_len, dtype=None):
    dtype = model.dtype if dtype is None else dtype
    return tuple(ReversedKVCache.init(batch, max_len, layer.attn.num_kv_heads,
                                      layer.attn.head_dim, dtype) for layer in model.layers)
  return factory


def test_transformer_logits_over_the_toy_cache_equal_dense():
  model = _model()
  tokens = jax.random.randint(jax.random.key(2), (2, 7), 0, 256)

  graphdef, state = nnx.split(model)

  @jax.jit
  def run(caches):
    m = nnx.merge(graphdef, state)
    prefill, caches = m(tokens[:, :5], caches, new_lengths=jnp.array([5, 3]))
    step, caches = m(tokens[:, 5:6], caches)
    return prefill, step, caches

  toy = run(_toy_factory(model)(2, 8))
  dense = run(model.init_caches(2, 8))
  np.testing.assert_allclose(np.asarray(toy[0][0]), np.asarray(dense[0][0]), atol=1e-5)
  np.testing.assert_allclose(np.asarray(toy[0][1, :3]), np.asarray(dense[0][1, :3]), atol=1e-5)
  np.testing.assert_allclose(np.asarray(toy[1]), np.asarray(dense[1]), atol=1e-5)
  assert all(isinstance(c, ReversedKVCache) for c in toy[2])


def test_generate_over_the_toy_cache_gives_the_dense_tokens():
  model = _model()
  prompts = np.random.default_rng(0).integers(0, 256, (3, 6)).astype(np.int32)
  lengths = np.array([6, 1, 4], np.int32)
  dense_tokens, dense_lengths = kvattn.generate(model, prompts, lengths, 8)
  toy_tokens, toy_lengths = kvattn.generate(model, prompts, lengths, 8,
                                            cache_factory=_toy_factory(model))
  np.testing.assert_array_equal(np.asarray(toy_tokens), np.asarray(dense_tokens))
  np.testing.assert_array_equal(np.asarray(toy_lengths), np.asarray(dense_lengths))
  # Prebuilt toy caches (`caches=`) work too: generate reads only lengths and capacity.
  prebuilt, _ = kvattn.generate(model, prompts, lengths, 8, caches=_toy_factory(model)(3, 13))
  np.testing.assert_array_equal(np.asarray(prebuilt), np.asarray(dense_tokens))
