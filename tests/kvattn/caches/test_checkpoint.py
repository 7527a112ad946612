"""Saving and restoring caches: bit-exact per kind, atomic, resumable, clear mismatch errors."""

import functools
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx, struct

import kvattn
from kvattn import KVCache, LatentCache, PageAllocator, PagedKVCache
from kvattn.caches import checkpoint as cache_io
from kvattn.inference import reuse as resume_lib
from kvattn.models import transformer
from kvattn.inference.generation import decode, generate, prefill
from kvattn.paging.prefix import PrefixCachingAllocator


@functools.lru_cache(maxsize=None)
def _model():
  cfg = transformer.model_config(d_model=32, num_layers=2, mlp_dim=64,
                                 attention=dict(num_heads=4, num_kv_heads=2, head_dim=8))
  return transformer.Transformer.from_config(cfg, rngs=nnx.Rngs(0))


def _fill(cache, seed):
  """`cache` with every leaf replaced by random bits (NaNs and all), lengths in range."""
  rng = np.random.default_rng(seed)
  leaves, treedef = jax.tree_util.tree_flatten(cache)
  out = []
  for x in leaves:
    x = np.asarray(x)
    if np.issubdtype(x.dtype, np.integer):
      out.append(jnp.asarray(rng.integers(0, 3, x.shape).astype(x.dtype)))
    else:
      raw = rng.integers(0, 256, x.size * x.dtype.itemsize, dtype=np.uint8)
      out.append(jnp.asarray(raw.view(x.dtype).reshape(x.shape)))
  return jax.tree_util.tree_unflatten(treedef, out)


def _bits_equal(a, b):
  la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
  assert len(la) == len(lb)
  for x, y in zip(la, lb):
    x, y = np.asarray(x), np.asarray(y)
    assert x.dtype == y.dtype and x.shape == y.shape
    np.testing.assert_array_equal(x.view(f"u{x.dtype.itemsize}"), y.view(f"u{y.dtype.itemsize}"))


@struct.dataclass
class _ToyRingCache:
  """A stand-in for a cache kind kvattn does not know: saved through the generic pytree path."""
  buf: jax.Array
  pos: jax.Array
  lengths: jax.Array


KINDS = {
    "dense_f32": lambda: KVCache.init(2, 8, 2, 4),
    "dense_bf16": lambda: KVCache.init(2, 8, 2, 4, jnp.bfloat16),
    "dense_int8": lambda: KVCache.init(2, 8, 2, 4, jnp.int8),
    "dense_fp8": lambda: KVCache.init(2, 8, 2, 4, jnp.float8_e4m3fn),
    "latent": lambda: LatentCache.init(2, 8, 6, 4),
    "latent_int8": lambda: LatentCache.init(2, 8, 6, 4, jnp.int8),
    "paged": lambda: PagedKVCache.init(2, num_pages=5, page_size=4, pages_per_seq=3,
                                       num_kv_heads=2, head_dim=4),
    "paged_fp8": lambda: PagedKVCache.init(2, num_pages=5, page_size=4, pages_per_seq=3,
                                           num_kv_heads=2, head_dim=4, dtype=jnp.float8_e5m2),
    "generic": lambda: _ToyRingCache(jnp.zeros((2, 5, 3)), jnp.zeros((2,), jnp.int32),
                                     jnp.zeros((2,), jnp.int32)),
}


# The long-context kinds (kvattn.caches.window / eviction), when that module is present.
if hasattr(kvattn, "RingKVCache"):
  KINDS.update({
      "ring": lambda: kvattn.RingKVCache.init(2, 5, 2, 4),
      "ring_int8": lambda: kvattn.RingKVCache.init(2, 5, 2, 4, jnp.int8),
      "sink": lambda: kvattn.SinkKVCache.init(2, 2, 4, 2, 4),
      "evicting": lambda: kvattn.EvictingKVCache.init(2, 6, 2, 4, policy="h2o"),
  })


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_round_trip_is_bit_exact_per_kind(kind, tmp_path):
  caches = (_fill(KINDS[kind](), 0), _fill(KINDS[kind](), 1))
  cache_io.save_caches(tmp_path / "ckpt", caches, tokens=[[1, 2], [3]])
  restored, alloc, tokens = cache_io.restore_caches(tmp_path / "ckpt", (KINDS[kind](),) * 2)
  _bits_equal(restored, caches)
  assert type(restored[0]) is type(caches[0])
  assert alloc is None and tokens == [[1, 2], [3]]


def test_single_cache_restores_as_a_single_cache(tmp_path):
  cache = _fill(KINDS["dense_int8"](), 3)
  cache_io.save_caches(tmp_path / "c", cache)
  restored, _, _ = cache_io.restore_caches(tmp_path / "c", KINDS["dense_int8"]())
  assert isinstance(restored, KVCache)
  _bits_equal(restored, cache)


def test_paged_round_trip_keeps_allocator_state(tmp_path):
  alloc = PageAllocator(9, 4, 3, seed=1)
  alloc.allocate("a", 6)
  alloc.allocate(7, 9)
  alloc.free("a")
  alloc.allocate("b", 3)
  cache = _fill(KINDS["paged"](), 5)
  cache_io.save_caches(tmp_path / "p", cache, allocator=alloc, tokens={"b": [4, 5, 6]})
  _, back, tokens = cache_io.restore_caches(tmp_path / "p", KINDS["paged"]())
  assert cache_io.allocator_state(back) == cache_io.allocator_state(alloc)
  assert back.pages(7) == alloc.pages(7) and back.num_tokens("b") == 3
  assert tokens == {"b": [4, 5, 6]}
  # The free list order is kept: the next allocation gets the same pages.
  assert back.allocate("c", 4) == alloc.allocate("c", 4)


def test_prefix_caching_allocator_round_trip_keeps_shared_pages_and_refcounts(tmp_path):
  alloc = PrefixCachingAllocator(10, 4)
  shared = list(range(8))
  alloc.allocate_prompt("a", shared + [1])
  alloc.register("a", shared + [1])
  alloc.allocate_prompt("b", shared + [2])
  alloc.allocate_prompt("gone", [7, 7, 7, 7, 7])
  alloc.free("gone", tokens=[7, 7, 7, 7, 7])  # one cached unreferenced page
  cache_io.save_caches(tmp_path / "p", KINDS["paged"](), allocator=alloc)
  _, back, _ = cache_io.restore_caches(tmp_path / "p", KINDS["paged"]())
  assert isinstance(back, PrefixCachingAllocator)
  assert back.pages("a") == alloc.pages("a") and back.pages("b") == alloc.pages("b")
  assert [back.refcount(p) for p in back.pages("b")] == [2, 2, 1]
  assert back.num_free == alloc.num_free and back.num_cached == 0  # the cached page is free
  back.register("a", shared + [1])  # the index is rebuilt from live sequences on demand
  assert back.match(shared + [5]) == 8


def test_interrupted_save_leaves_nothing_that_restores(tmp_path):
  cache = _fill(KINDS["dense_f32"](), 0)
  with pytest.raises(TypeError):  # metadata that cannot be serialised fails mid-save
    cache_io.save_caches(tmp_path / "x", cache, extra={"bad": object()})
  assert not cache_io.is_complete(tmp_path / "x")
  leftovers = [p for p in os.listdir(tmp_path) if p.startswith("x.orbax-checkpoint-tmp")]
  assert leftovers  # orbax's temporary directory, never renamed into place
  for name in leftovers + ["x"]:
    with pytest.raises(ValueError, match="never finalized"):
      cache_io.restore_caches(tmp_path / name, KINDS["dense_f32"]())
  # A checkpoint whose commit marker never got written (killed before orbax's finalize).
  cache_io.save_caches(tmp_path / "ok", cache)
  assert cache_io.is_complete(tmp_path / "ok")
  torn = tmp_path / "torn"
  shutil.copytree(tmp_path / "ok", torn)
  for name in os.listdir(torn):
    if "commit_success" in name or name == "_CHECKPOINT_METADATA":
      os.remove(torn / name)
  assert not cache_io.is_complete(torn)
  with pytest.raises(ValueError, match="never finalized"):
    cache_io.restore_caches(torn, KINDS["dense_f32"]())


@struct.dataclass
class _WithPolicy:
  x: jax.Array
  lengths: jax.Array
  policy: str = struct.field(pytree_node=False, default="h2o")


def test_restoring_into_other_static_fields_names_them(tmp_path):
  cache = _WithPolicy(jnp.ones((2, 3)), jnp.zeros((2,), jnp.int32))
  cache_io.save_caches(tmp_path / "c", cache)
  with pytest.raises(ValueError, match="static fields differ: .*h2o.*template has .*tova"):
    cache_io.restore_caches(tmp_path / "c", cache.replace(policy="tova"))
  restored, _, _ = cache_io.restore_caches(tmp_path / "c", cache)
  _bits_equal(restored, cache)


def test_save_never_overwrites(tmp_path):
  cache_io.save_caches(tmp_path / "c", KINDS["dense_f32"]())
  with pytest.raises(ValueError, match="must not exist"):
    cache_io.save_caches(tmp_path / "c", KINDS["dense_f32"]())


@pytest.mark.parametrize("template,match", [
    (lambda: KINDS["latent"](), "holds a kvattn.caches.dense.KVCache but the template is a "
                                "kvattn.caches.dense.LatentCache"),
    (lambda: KVCache.init(2, 16, 2, 4), r"shape mismatch: .* has \[2, 2, 8, 4\], template has "
                                        r"\[2, 2, 16, 4\]"),
    (lambda: KINDS["dense_bf16"](), "dtype mismatch: .* has float32, template has bfloat16"),
    (lambda: KINDS["dense_int8"](), "k_scale is only in the template"),
    (lambda: (KINDS["dense_f32"](),) * 2, "holds 1 caches but the template has 2"),
])
def test_restoring_into_another_kind_shape_or_dtype_names_the_mismatch(template, match, tmp_path):
  cache_io.save_caches(tmp_path / "c", KINDS["dense_f32"]())
  with pytest.raises(ValueError, match=match):
    cache_io.restore_caches(tmp_path / "c", template())


PROMPT = np.array([5, 17, 3, 99, 42, 7, 8], np.int32)
MAX_LEN = 32


def _reference(prompt, n):
  tokens, length = generate(_model(), np.asarray(prompt)[None],
                            np.array([len(prompt)], np.int32), n, max_len=MAX_LEN)
  return np.asarray(tokens)[0, :int(np.asarray(length)[0])]


def _saved_after_decoding(tmp_path, steps, cache_factory):
  """Prefills PROMPT, decodes `steps` tokens, saves the caches; returns (tokens held, generated)."""
  model = _model()
  caches = cache_factory()
  first, caches, rng = prefill(model, PROMPT[None], np.array([len(PROMPT)], np.int32), caches)
  tokens, _, caches = decode(model, first, caches, steps, rng=rng)
  generated = np.asarray(tokens)[0]
  held = np.concatenate([PROMPT, generated[:-1]])  # the last sampled token is not in the cache
  assert int(caches[0].lengths[0]) == len(held)
  cache_io.save_caches(tmp_path / "ckpt", caches, tokens=[held.tolist()])
  return held, generated


def _dense():
  return _model().init_caches(1, MAX_LEN)


def _paged():
  return tuple(PagedKVCache.contiguous(1, MAX_LEN, 2, 8, page_size=4) for _ in range(2))


# Dense caches resume in the strict-prefix test below; the slow run adds this one for them.
@pytest.mark.parametrize("factory", [pytest.param(_dense, marks=pytest.mark.slow), _paged],
                         ids=["dense", "paged"])
def test_restore_then_continue_equals_an_uninterrupted_run(factory, tmp_path):
  held, generated = _saved_after_decoding(tmp_path, 4, factory)
  caches, _, tokens = cache_io.restore_caches(tmp_path / "ckpt", factory())
  np.testing.assert_array_equal(tokens[0], held)
  # The conversation so far is PROMPT + the 4 generated tokens; 6 more follow.
  out, _ = resume_lib.resume(_model(), caches, tokens[0], np.concatenate([PROMPT, generated]), 6)
  np.testing.assert_array_equal(np.concatenate([generated, out]), _reference(PROMPT, 10))


@pytest.mark.parametrize("cut", [1, pytest.param(2, marks=pytest.mark.slow),
                                 pytest.param(4, marks=pytest.mark.slow), 6])
def test_prompt_that_is_a_strict_prefix_truncates_and_reevaluates_its_last_token(cut, tmp_path):
  held, _ = _saved_after_decoding(tmp_path, 3, _dense)
  caches, _, tokens = cache_io.restore_caches(tmp_path / "ckpt", _dense())
  prompt = PROMPT[:cut]
  assert resume_lib.reusable_length(tokens[0], prompt) == cut - 1  # never the whole prompt
  out, after = resume_lib.resume(_model(), caches, held, prompt, 5)
  np.testing.assert_array_equal(out, _reference(prompt, 5))
  assert int(after[0].lengths[0]) == cut + 5 - 1


def test_reusable_length_is_the_common_prefix_capped_below_the_prompt():
  assert resume_lib.reusable_length([1, 2, 3, 4], [1, 2, 9, 4, 5]) == 2
  assert resume_lib.reusable_length([1, 2, 3], [1, 2, 3, 4]) == 3
  assert resume_lib.reusable_length([1, 2, 3], [1, 2, 3]) == 2
  assert resume_lib.reusable_length([], [1, 2]) == 0
  assert resume_lib.reusable_length([7], [1]) == 0


def test_truncate_lowers_lengths_and_refuses_unknown_kinds():
  cache = KVCache.init(2, 8, 1, 2).replace(lengths=jnp.array([5, 2], jnp.int32))
  assert resume_lib.truncate(cache, 3).lengths.tolist() == [3, 2]
  with pytest.raises(ValueError, match="length must be >= 0"):
    resume_lib.truncate(cache, -1)
  with pytest.raises(ValueError, match="_ToyRingCache cannot be truncated"):
    resume_lib.truncate(KINDS["generic"](), 1)


def test_resume_rejects_bad_input():
  with pytest.raises(ValueError, match="prompt must hold at least one token"):
    resume_lib.resume(_model(), _dense(), [], [], 2)
  with pytest.raises(ValueError, match="batch 1"):
    resume_lib.resume(_model(), _model().init_caches(2, MAX_LEN), [], [1], 2)
  with pytest.raises(ValueError, match="capacity 32"):
    resume_lib.resume(_model(), _dense(), [], [1] * 30, 4)
