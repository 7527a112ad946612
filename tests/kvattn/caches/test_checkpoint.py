"""Saving and restoring caches: bit-exact per kind, atomic, resumable, clear mismatch errors."""

import functools
import json
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


LENGTHS = np.array([7, 2], np.int32)  # tokens written per row by `_written`
BLOCK_TABLES = np.array([[0, 4, 2], [3, -1, -1]], np.int32)  # the "paged" kinds' pages


def _written(cache, seed=0):
  """`cache` after `LENGTHS` tokens per row went in through its own `update` (so its
  bookkeeping -- lengths, ring and eviction positions, block tables -- is a real state)."""
  if isinstance(cache, _ToyRingCache):
    return cache.replace(lengths=jnp.asarray(LENGTHS), pos=jnp.asarray([3, 1], jnp.int32))
  keys = jax.random.split(jax.random.key(seed), 2)
  T = int(LENGTHS.max())
  if isinstance(cache, LatentCache):
    new = (jax.random.normal(keys[0], (2, T, cache.kv_lora_rank)),
           jax.random.normal(keys[1], (2, T, cache.qk_rope_head_dim)))
  else:
    new = tuple(jax.random.normal(key, (2, T, cache.num_kv_heads, cache.head_dim))
                for key in keys)
  return cache.update(*new, new_lengths=jnp.asarray(LENGTHS))


def _fill(cache, seed):
  """`cache` holding `LENGTHS` tokens with every float leaf replaced by random bits (NaNs
  and all); the integer bookkeeping stays the valid state `update` left."""
  rng = np.random.default_rng(seed)
  leaves, treedef = jax.tree_util.tree_flatten(_written(cache, seed))
  out = []
  for x in leaves:
    x = np.asarray(x)
    if np.issubdtype(x.dtype, np.integer):
      out.append(jnp.asarray(x))
    else:
      raw = rng.integers(0, 256, x.size * x.dtype.itemsize, dtype=np.uint8)
      out.append(jnp.asarray(raw.view(x.dtype).reshape(x.shape)))
  return jax.tree_util.tree_unflatten(treedef, out)


HELD = [list(range(n)) for n in LENGTHS]  # token ids matching LENGTHS


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
                                       num_kv_heads=2, head_dim=4, block_tables=BLOCK_TABLES),
    "paged_fp8": lambda: PagedKVCache.init(2, num_pages=5, page_size=4, pages_per_seq=3,
                                           num_kv_heads=2, head_dim=4, dtype=jnp.float8_e5m2,
                                           block_tables=BLOCK_TABLES),
    "generic": lambda: _ToyRingCache(jnp.zeros((2, 5, 3)), jnp.zeros((2,), jnp.int32),
                                     jnp.zeros((2,), jnp.int32)),
}


# The long-context kinds (kvattn.caches.window / eviction), when that module is present.
if hasattr(kvattn, "RingKVCache"):
  KINDS.update({
      "ring": lambda: kvattn.RingKVCache.init(2, 5, 2, 4),
      "ring_int8": lambda: kvattn.RingKVCache.init(2, 5, 2, 4, jnp.int8),
      "sink": lambda: kvattn.SinkKVCache.init(2, 2, 4, 2, 4),
      "evicting": lambda: kvattn.EvictingKVCache.init(2, 6, 2, 4, policy="h2o", num_sinks=1),
    "length_switch": lambda: kvattn.LengthSwitchKVCache.init(2, 8, 2, 4, switch_length=3,
                                                             num_kv_heads_after=1),
  })


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_round_trip_is_bit_exact_per_kind(kind, tmp_path):
  caches = (_fill(KINDS[kind](), 0), _fill(KINDS[kind](), 1))
  cache_io.save_caches(tmp_path / "ckpt", caches, tokens=HELD)
  restored, alloc, tokens = cache_io.restore_caches(tmp_path / "ckpt", (KINDS[kind](),) * 2)
  _bits_equal(restored, caches)
  assert type(restored[0]) is type(caches[0])
  assert alloc is None and tokens == HELD


def test_single_cache_restores_as_a_single_cache(tmp_path):
  cache = _fill(KINDS["dense_int8"](), 3)
  cache_io.save_caches(tmp_path / "c", cache)
  restored, _, _ = cache_io.restore_caches(tmp_path / "c", KINDS["dense_int8"]())
  assert isinstance(restored, KVCache)
  _bits_equal(restored, cache)


def _paged_for(alloc, seq_ids, lengths):
  """A paged cache whose rows are the block-table rows `alloc` gave `seq_ids`."""
  cache = PagedKVCache.init(len(seq_ids), num_pages=alloc.num_pages, page_size=alloc.page_size,
                            pages_per_seq=3, num_kv_heads=2, head_dim=4,
                            block_tables=alloc.block_tables(seq_ids, 3))
  return cache.replace(lengths=jnp.asarray(lengths, jnp.int32))


def test_paged_round_trip_keeps_allocator_state(tmp_path):
  alloc = PageAllocator(9, 4, 3, seed=1)
  alloc.allocate("a", 6)
  alloc.allocate(7, 9)
  alloc.free("a")
  alloc.allocate("b", 3)
  cache = _paged_for(alloc, [7, "b"], [9, 3])
  cache_io.save_caches(tmp_path / "p", cache, allocator=alloc, tokens={"b": [4, 5, 6]})
  _, back, tokens = cache_io.restore_caches(tmp_path / "p", _paged_for(alloc, [7, "b"], [0, 0]))
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
  cache = _paged_for(alloc, ["a", "b"], [9, 9])  # two rows share pages, as the allocator says
  cache_io.save_caches(tmp_path / "p", cache, allocator=alloc)
  _, back, _ = cache_io.restore_caches(tmp_path / "p", cache)
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


def _edit_meta(path, edit):
  """Tampers with the saved JSON metadata of checkpoint `path` in place (`edit(meta)`)."""
  meta_file = path / "meta" / "metadata"
  meta = json.loads(meta_file.read_text())
  edit(meta)
  meta_file.write_text(json.dumps(meta))


def _set(field, index, value):
  """A cache editor: `field[index] = value` (a crafted state, as a tampered file holds)."""
  return lambda c: c.replace(**{field: getattr(c, field).at[index].set(value)})


# Each crafted cache state (kind, edit of a valid state) and the error naming its leaf.
CRAFTED = {
    "dense negative length": ("dense_f32", _set("lengths", 1, -2),
                              r"layer 1 lengths\[1\] = -2 must lie in \[0, 8\]"),
    "dense length past capacity": ("dense_int8", _set("lengths", 0, 9),
                                   r"layer 1 lengths\[0\] = 9 must lie in \[0, 8\]"),
    "latent length past capacity": ("latent", _set("lengths", 1, 12),
                                    r"layer 1 lengths\[1\] = 12 must lie in \[0, 8\]"),
    "length switch negative": ("length_switch", _set("lengths", 0, -1),
                               r"layer 1 lengths\[0\] = -1 must lie in \[0, 8\]"),
    "ring slot holds another token": ("ring", _set("pos", (0, 1), 1),
                                      r"layer 1 pos\[0, 1\] = 1, but a RingKVCache of 5 slots "
                                      r"holding 7 tokens keeps token 6 there"),
    "ring length without its tokens": ("ring", _set("lengths", 1, 4),
                                       r"layer 1 pos\[1, 2\] = -1, .* keeps token 2 there"),
    "sink lost its sink": ("sink", _set("pos", (1, 0), -1),
                           r"layer 1 pos\[1, 0\] = -1, but a SinkKVCache"),
    "evicting duplicate token": ("evicting", _set("pos", (0, 1, 2), 1),
                                 r"layer 1 pos\[0, 1, 2\] = 1 must be larger than the slot "
                                 r"before it"),
    "evicting token not yet written": ("evicting", _set("pos", (1, 0, 1), 5),
                                       r"layer 1 pos\[1, 0, 1\] = 5 must be a token below "
                                       r"lengths\[1\] = 2"),
    "evicting lost slots": ("evicting", _set("pos", (0, 0, 5), -1),
                            r"layer 1 pos\[0, 0\] keeps 5 tokens, but a budget of 6 after 7"),
    "evicting NaN score": ("evicting", _set("scores", (0, 0, 0), np.nan),
                           r"layer 1 scores\[0, 0, 0\] must be finite"),
    "page outside the pool": ("paged", _set("block_tables", (0, 2), 7),
                              r"layer 1 block_tables\[0, 2\] = 7 must be a page in \[0, 5\) "
                              r"or NO_PAGE"),
    "tokens on no page": ("paged", _set("block_tables", (0, 1), -1),
                          r"layer 1 block_tables\[0, 1\] = NO_PAGE, but row 0 holds 7 tokens"),
    "length past the assigned pages": ("paged", _set("lengths", 1, 5),
                                       r"layer 1 block_tables\[1, 1\] = NO_PAGE, but row 1 "
                                       r"holds 5 tokens"),
    "two rows share a page": ("paged_fp8", _set("block_tables", (1, 0), 4),
                              r"layer 1 block_tables\[0, 1\] and \[1, 0\] both hold page 4"),
}


@pytest.mark.parametrize("name", sorted(CRAFTED))
def test_a_crafted_cache_state_is_rejected_naming_its_leaf(name, tmp_path):
  kind, edit, match = CRAFTED[name]
  caches = (_fill(KINDS[kind](), 0), edit(_fill(KINDS[kind](), 1)))
  cache_io.save_caches(tmp_path / "c", caches)
  with pytest.raises(ValueError, match=f"checkpoint {tmp_path / 'c'}: {match}"):
    cache_io.restore_caches(tmp_path / "c", (KINDS[kind](),) * 2)


def test_a_crafted_state_of_an_unknown_kind_needs_lengths_of_at_least_zero(tmp_path):
  cache = _written(KINDS["generic"]()).replace(lengths=jnp.array([3, -1], jnp.int32))
  cache_io.save_caches(tmp_path / "c", cache)
  with pytest.raises(ValueError, match=r"layer 0 lengths\[1\] = -1 must be >= 0"):
    cache_io.restore_caches(tmp_path / "c", KINDS["generic"]())


def _plain_allocator():
  alloc = PageAllocator(5, 4, 3)
  alloc.allocate("x", 7)  # pages 0, 1
  alloc.allocate("y", 2)  # page 2
  return alloc


# Tampered allocator states (edit of the saved JSON) and the error naming the key.
ALLOCATOR_EDITS = {
    "free page twice": (lambda a: a["free"].append(a["free"][0]),
                        r"allocator.free\[2\] = 4 is already at allocator.free\[0\]"),
    "free page outside the pool": (lambda a: a["free"].__setitem__(0, 9),
                                   r"allocator.free\[0\] = 9 must be in \[0, 4\]"),
    "held page also free": (lambda a: a["free"].__setitem__(0, 2),
                            r"allocator.live\[1\] \('y'\) pages\[0\] = 2 is already at "
                            r"allocator.free\[0\]"),
    "plain allocator shares": (lambda a: a["live"][1][1].__setitem__(0, 1),
                               r"allocator.live\[1\] \('y'\) pages\[0\] = 1 is already at "
                               r"allocator.live\[0\] \('x'\) pages\[1\]"),
    "lost page": (lambda a: a["free"].pop(),
                  r"allocator pages \[3\] are neither free nor held"),
    "pages for the tokens": (lambda a: a["live"][0].__setitem__(2, 9),
                             r"allocator.live\[0\] \('x'\) holds 2 pages for 9 tokens"),
    "negative token count": (lambda a: a["live"][0].__setitem__(2, -1),
                             r"allocator.live\[0\] \('x'\) tokens = -1 must be in"),
    "unknown kind": (lambda a: a.__setitem__("kind", "magic"),
                     r"allocator.kind must be 'plain' or 'prefix'"),
}


@pytest.mark.parametrize("name", sorted(ALLOCATOR_EDITS))
def test_a_tampered_allocator_state_is_rejected_naming_its_key(name, tmp_path):
  alloc = _plain_allocator()
  cache = _paged_for(alloc, ["x", "y"], [7, 2])
  cache_io.save_caches(tmp_path / "p", cache, allocator=alloc)
  cache_io.restore_caches(tmp_path / "p", cache)  # the untampered file restores
  edit, match = ALLOCATOR_EDITS[name]
  shutil.copytree(tmp_path / "p", tmp_path / "t")
  _edit_meta(tmp_path / "t", lambda meta: edit(meta["allocator"]))
  with pytest.raises(ValueError, match=match):
    cache_io.restore_caches(tmp_path / "t", cache)


def test_block_tables_must_agree_with_the_saved_allocator(tmp_path):
  alloc = _plain_allocator()
  free_page = alloc.block_tables(["x", "y"], 3).copy()
  free_page[1, 1] = 3  # page 3 is on the allocator's free list
  cache = _paged_for(alloc, ["x", "y"], [7, 2]).replace(block_tables=jnp.asarray(free_page))
  cache_io.save_caches(tmp_path / "free", cache, allocator=alloc)
  with pytest.raises(ValueError, match=r"layer 0 block_tables\[1, 1\] = 3, a page the saved "
                                       r"allocator has free"):
    cache_io.restore_caches(tmp_path / "free", cache)
  # A prefix allocator lets rows share a page as often as live sequences hold it, no more.
  prefix = PrefixCachingAllocator(10, 4)
  prompt = list(range(8)) + [1]
  prefix.allocate_prompt("a", prompt)
  prefix.register("a", prompt)
  prefix.allocate_prompt("b", list(range(8)) + [2])
  tables = prefix.block_tables(["a", "b", "b"], 3)
  cache = PagedKVCache.init(3, num_pages=10, page_size=4, pages_per_seq=3, num_kv_heads=2,
                            head_dim=4, block_tables=tables)
  cache_io.save_caches(tmp_path / "shared", cache, allocator=prefix)
  with pytest.raises(ValueError, match=r"layer 0 block_tables hold page 0 3 times .* gives it "
                                       r"to 2 live sequence"):
    cache_io.restore_caches(tmp_path / "shared", cache)
  small = PageAllocator(4, 4, 3)  # a pool of another size than the cache's
  small.allocate("x", 7)
  cache_io.save_caches(tmp_path / "size", _paged_for(alloc, ["x", "y"], [7, 2]), allocator=small)
  with pytest.raises(ValueError, match="allocator num_pages, page_size = 4, 4, but layer 0 has "
                                       "a pool of 5 pages"):
    cache_io.restore_caches(tmp_path / "size", _paged_for(alloc, ["x", "y"], [7, 2]))


def test_saved_tokens_must_match_the_lengths(tmp_path):
  caches = (_fill(KINDS["dense_f32"](), 0),) * 2
  cache_io.save_caches(tmp_path / "c", caches, tokens=HELD)
  for name, edit, match in (
      ("short", lambda m: m["tokens"]["by_row"][0].pop(), r"tokens\[0\] holds 6 ids, but "
                                                          r"layer 0 lengths\[0\] = 7"),
      ("rows", lambda m: m["tokens"]["by_row"].pop(), "tokens holds 1 rows, but layer 0 has "
                                                      "batch 2"),
      ("not an id", lambda m: m["tokens"]["by_row"][1].__setitem__(0, "x"),
       r"tokens\[1\]\[0\] must be an int")):
    shutil.copytree(tmp_path / "c", tmp_path / name)
    _edit_meta(tmp_path / name, edit)
    with pytest.raises(ValueError, match=match):
      cache_io.restore_caches(tmp_path / name, (KINDS["dense_f32"](),) * 2)


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


def test_resume_from_a_tampered_checkpoint_raises_instead_of_generating_other_tokens(tmp_path):
  held, generated = _saved_after_decoding(tmp_path, 4, _dense)
  conversation = np.concatenate([PROMPT, generated])
  caches, _, tokens = cache_io.restore_caches(tmp_path / "ckpt", _dense())
  want, _ = resume_lib.resume(_model(), caches, tokens[0], conversation, 4)
  # A file whose caches claim fewer tokens than its token list: the last five tokens' keys
  # would be missing, and resuming from these caches generates other tokens.
  caches, _, _ = cache_io.restore_caches(tmp_path / "ckpt", _dense())
  tampered = tuple(c.replace(lengths=c.lengths - 5) for c in caches)
  cache_io.save_caches(tmp_path / "tampered", tampered, tokens=[held.tolist()])
  wrong, _ = resume_lib.resume(_model(), tampered, held, conversation, 4)  # consumes them
  assert not np.array_equal(wrong, want)
  with pytest.raises(ValueError, match=r"tokens\[0\] holds 10 ids, but layer 0 lengths\[0\] = "
                                       r"5"):
    cache_io.restore_caches(tmp_path / "tampered", _dense())
  # Token ids edited in the file but not their count: a negative id is refused too.
  shutil.copytree(tmp_path / "ckpt", tmp_path / "ids")
  _edit_meta(tmp_path / "ids", lambda m: m["tokens"]["by_row"][0].__setitem__(3, -5))
  with pytest.raises(ValueError, match=r"tokens\[0\]\[3\] = -5 must be >= 0"):
    cache_io.restore_caches(tmp_path / "ids", _dense())
