"""Checks of kvattn.sharding on 8 simulated CPU devices, run as their own process.

    python -m tests.sharding._mesh_checks fast|full|batcher|real_model|layers|lowbit

XLA reads `--xla_force_host_platform_device_count` once, when JAX starts, and the
pytest process has started it with one device; test_sharding.py therefore runs this
module in a subprocess. Each check prints one JSON line `{"check": ..., "ok": ...,
...}`; the exit status is 1 if any failed. `fast` is the compact grid of the default
suite (with `ContinuousBatcher` on (2,2,1)), `batcher` the batcher on (2,1,1) and
(2,2,1) alone, `layers` the batcher with the per-layer layout (rings for Gemma 3's local
layers) on (2,1,1) and (2,2,1), `lowbit` the 2/4-bit KIVI caches (generate and the batcher)
on (2,2,1), `real_model` the main job's family on (1,2,1) and (1,1,2), `full` the
grid of issue 17 (meshes (1,8,1), (2,4,1), (2,2,2), (1,1,8) x K in {1, 2, 8} x dense /
paged / MLA) and the rest.
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# pylint: disable=g-import-not-at-top,wrong-import-position
import functools
import json
import math
import re
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import kvattn
from kvattn.caches import dense as cache_lib
from kvattn.caches import registry
from kvattn import sharding
from kvattn.caches import sharded as sharded_caches
from kvattn.inference.speculative import PromptLookup
from kvattn.models import transformer

BATCH, MAX_LEN, PAGE_SIZE, NEW_TOKENS = 4, 64, 4, 4
D_MODEL = 48  # no model dimension equals MAX_LEN or the page pool (64), see _cache_gathers
MESHES = ((1, 8, 1), (2, 4, 1), (2, 2, 2), (1, 1, 8))


def make_model_fn(kind: str, num_kv_heads: int = 2):
  """A one-layer model constructor (GQA with N = 8, or MLA)."""
  if kind == "mla":
    attention = dict(kind="mla", num_heads=8, kv_lora_rank=32, qk_nope_head_dim=16,
                     qk_rope_head_dim=8, v_head_dim=16)
  else:
    attention = dict(num_heads=8, num_kv_heads=num_kv_heads, head_dim=16)
  cfg = transformer.model_config(d_model=D_MODEL, num_layers=1, mlp_dim=96, attention=attention)
  return lambda: transformer.Transformer.from_config(cfg, rngs=nnx.Rngs(0))


def _prompts():
  tokens = jax.random.randint(jax.random.key(1), (BATCH, 6), 0, 259, dtype=jnp.int32)
  return tokens, jnp.array([6, 3, 1, 5], jnp.int32)


@functools.partial(jax.jit, static_argnums=0)
def _step(graphdef, state, tokens, caches, new_lengths):
  model = nnx.merge(graphdef, state)
  return model(tokens, caches, new_lengths=new_lengths)


_LAST_HLO = [""]


def _decode_logits(model, caches, inspect: bool = False):
  """Logits of one decode step after a right-padded prefill; with `inspect` the decode
  step is compiled once through `lower().compile()` and its HLO kept in `_LAST_HLO`."""
  tokens, lengths = _prompts()
  graphdef, state = nnx.split(model)
  _, caches = _step(graphdef, state, tokens, caches, lengths)
  args = (state, tokens[:, :1], caches, jnp.ones((BATCH,), jnp.int32))
  if inspect:
    compiled = _step.lower(graphdef, *args).compile()
    _LAST_HLO[0] = compiled.as_text()
    logits, caches = compiled(*args)
  else:
    logits, caches = _step(graphdef, *args)
  return logits, caches, tokens[:, :1]


def _cache_gathers(hlo: str) -> list[str]:
  """all-gather instructions of `hlo` whose result has a cache-sized dimension."""
  out = []
  for line in hlo.splitlines():
    if "all-gather(" not in line and "all-gather-start(" not in line:
      continue
    dims = [int(d) for shape in re.findall(r"\[([\d,]+)\]", line.split("=", 1)[-1][:200])
            for d in shape.split(",") if d]
    if MAX_LEN in dims:
      out.append(line.strip()[:160])
  return out


def _expected_share(cache, mesh_shape) -> int:
  """Bytes one device should hold of `cache`'s storage arrays."""
  d, m, s = mesh_shape
  total = sum(a.nbytes for a in cache.storage_arrays())
  if isinstance(cache, cache_lib.LatentCache):
    return total // (d * s)
  heads = min(cache.num_kv_heads, m)  # KV-head shards; the rest of the axis replicates
  return total // (d * s * heads)


def check_case(mesh_shape, kind: str, num_kv_heads: int, *, with_generate: bool,
               with_speculative: bool = True) -> dict:
  make = make_model_fn(kind, num_kv_heads)
  ref_model = make()
  ref_logits, _, _ = _decode_logits(ref_model, ref_model.init_caches(BATCH, MAX_LEN))
  mesh = sharding.make_mesh(mesh_shape)
  model = sharding.shard_model(make, mesh)
  caches = sharded_caches.init_caches(model, BATCH, MAX_LEN, mesh, page_size=PAGE_SIZE,
                                kind="paged" if kind == "paged" else "dense")
  cache = caches[0]
  per_device = sharding.per_device_bytes(cache.storage_arrays())
  share = _expected_share(cache, mesh_shape)
  logits, new_caches, nxt = _decode_logits(model, caches, inspect=True)
  diff = float(jnp.max(jnp.abs(logits - ref_logits)))
  hlo = _LAST_HLO[0]
  gathers = _cache_gathers(hlo)
  result = dict(mesh=list(mesh_shape), kind=kind, num_kv_heads=num_kv_heads,
                max_abs_diff=diff, share=share, per_device=sorted(set(per_device.values())),
                devices=len(per_device), cache_all_gathers=gathers,
                all_reduces=hlo.count(" all-reduce("),
                sharded_type=type(new_caches[0]).__name__)
  ok = (diff <= 1e-5 and set(per_device.values()) == {share} and len(per_device) == 8
        and not gathers and type(new_caches[0]) is type(cache))
  if with_generate:
    prompts, lengths = _prompts()
    want, _ = kvattn.generate(ref_model, prompts, lengths, NEW_TOKENS)
    factory = sharded_caches.cache_factory(model, mesh, page_size=PAGE_SIZE,
                                     kind="paged" if kind == "paged" else "dense")
    got, _ = kvattn.generate(model, prompts, lengths, NEW_TOKENS, cache_factory=factory)
    result["tokens_equal"] = bool(jnp.array_equal(got, want))
    ok = ok and result["tokens_equal"]
  if with_generate and with_speculative:
    # Speculative decoding rolls the sharded caches back too (7 drafts: capacity 16, which
    # every mesh's seq axis divides).
    spec, _ = kvattn.generate(model, prompts, lengths, NEW_TOKENS, cache_factory=factory,
                              speculative=PromptLookup(num_draft_tokens=7))
    result["speculative_tokens_equal"] = bool(jnp.array_equal(spec, want))
    ok = ok and result["speculative_tokens_equal"]
  result["ok"] = bool(ok)
  return result


def _poisoned(x, lengths, slot_axis):
  slots = np.arange(x.shape[slot_axis])
  shape = [1] * x.ndim
  shape[0], shape[slot_axis] = len(lengths), x.shape[slot_axis]
  unused = (slots[None, :] >= np.asarray(lengths)[:, None]).reshape(shape)
  return jnp.where(unused, jnp.nan, x)


def check_empty_shards(kind: str) -> dict:
  """Context-parallel merge on (1, 1, 8): rows whose tokens sit in one shard (the other
  seven empty), NaN in every unused slot, an all-empty row -> zeros."""
  mesh = sharding.make_mesh((1, 1, 8))
  lengths = jnp.array([0, 3, 9, MAX_LEN], jnp.int32)
  keys = jax.random.split(jax.random.key(2), 5)
  if kind == "dense":
    shape = (BATCH, 2, MAX_LEN, 16)
    k = _poisoned(jax.random.normal(keys[0], shape), lengths, 2)
    v = _poisoned(jax.random.normal(keys[1], shape), lengths, 2)
    single = cache_lib.KVCache(k=k, v=v, lengths=lengths)
    layout = sharded_caches.cache_layout(mesh, None, kind="dense", batch=BATCH, max_len=MAX_LEN,
                                   num_kv_heads=2, num_heads=8)
    cls, q = sharded_caches.ShardedKVCache, (jax.random.normal(keys[2], (BATCH, 1, 8, 16)),)
    opts = {}
  else:
    c_kv = _poisoned(jax.random.normal(keys[0], (BATCH, MAX_LEN, 32)), lengths, 1)
    k_rope = _poisoned(jax.random.normal(keys[1], (BATCH, MAX_LEN, 8)), lengths, 1)
    single = cache_lib.LatentCache(c_kv=c_kv, k_rope=k_rope, lengths=lengths)
    layout = sharded_caches.cache_layout(mesh, None, kind="latent", batch=BATCH, max_len=MAX_LEN)
    cls = sharded_caches.ShardedLatentCache
    q = (jax.random.normal(keys[2], (BATCH, 1, 8, 32)),
         jax.random.normal(keys[3], (BATCH, 1, 8, 8)))
    opts = dict(sm_scale=0.25)
  fields = {f: getattr(single, f) for f in ("k", "v", "c_kv", "k_rope", "lengths")
            if hasattr(single, f)}
  sharded = cls(**fields, layout=layout)
  sharded = jax.device_put(sharded, sharded.shardings())
  offsets = jnp.maximum(lengths - 1, 0)
  want = single.attend(*q, q_offsets=offsets, implementation="xla", **opts)
  got = jax.jit(lambda c, *q: c.attend(*q, q_offsets=offsets, **opts))(sharded, *q)
  diff = float(jnp.max(jnp.abs(got - want)))
  ok = (diff <= 1e-5 and bool(jnp.all(jnp.isfinite(got))) and bool(jnp.all(got[0] == 0)))
  return dict(kind=kind, max_abs_diff=diff, finite=bool(jnp.all(jnp.isfinite(got))), ok=ok)


def check_bad_meshes() -> dict:
  """Axis sizes that do not divide B, S or the page pool -> ValueError naming the axis."""
  model = make_model_fn("gqa")()
  cases = {
      "batch over data": (lambda: sharded_caches.init_caches(
          model, 3, MAX_LEN, sharding.make_mesh((2, 2, 2))), "'data'"),
      "slots over seq": (lambda: sharded_caches.init_caches(
          model, BATCH, 60, sharding.make_mesh((1, 1, 8))), "'seq'"),
      "pool over data, seq": (lambda: sharded_caches.cache_layout(
          sharding.make_mesh((2, 1, 4)), None, kind="paged", batch=BATCH, max_len=MAX_LEN,
          num_kv_heads=2, num_pages=12), "('data', 'seq')"),
      "kv heads over model": (lambda: sharded_caches.cache_layout(
          sharding.make_mesh((1, 8, 1)), None, kind="dense", batch=BATCH, max_len=MAX_LEN,
          num_kv_heads=3), "'model'"),
      "mesh shape": (lambda: sharding.make_mesh((2, 2, 4)), "16 devices"),
  }
  failures = {}
  for name, (fn, needle) in cases.items():
    try:
      fn()
      failures[name] = "no error"
    except ValueError as e:
      if needle not in str(e):
        failures[name] = str(e)
  return dict(failures=failures, ok=not failures)


def check_layouts() -> dict:
  """Every place a cache layout is made checks it up front. On (1, 8, 1) a layer with
  N = 4 query heads over K = 2 KV heads (the KV heads replicated 4x, fewer query heads
  than the model axis) gives the single-device logits through `place_caches(num_heads=)`,
  `init_caches` and, for paged caches, `ContinuousBatcher(mesh=)`'s tokens; `place_caches`
  without `num_heads`, a `num_heads` that K does not divide, and a layout made for another
  N raise ValueError naming the axis and the head counts before any attention runs."""
  cfg = transformer.model_config(d_model=D_MODEL, num_layers=1, mlp_dim=96,
                                 attention=dict(num_heads=4, num_kv_heads=2, head_dim=16))
  make = lambda: transformer.Transformer.from_config(cfg, rngs=nnx.Rngs(0))
  ref = make()
  want, _, _ = _decode_logits(ref, ref.init_caches(BATCH, MAX_LEN))
  mesh = sharding.make_mesh((1, 8, 1))
  model = sharding.shard_model(make, mesh)
  diffs = {}
  for name, build in (
      ("place_caches", lambda: sharded_caches.place_caches(
          ref.init_caches(BATCH, MAX_LEN), mesh, num_heads=[4])),
      ("init_caches", lambda: sharded_caches.init_caches(model, BATCH, MAX_LEN, mesh))):
    got, _, _ = _decode_logits(model, build())
    diffs[name] = float(jnp.max(jnp.abs(got - want)))
  errors = {}
  plain = ref.init_caches(BATCH, MAX_LEN)
  for name, fn, needles in (
      ("no num_heads", lambda: sharded_caches.place_caches(plain, mesh),
       ("caches[0]: num_heads is required", "num_kv_heads = 2", "'model' of size 8",
        "('model', 'model_rep') (8 devices)", "('model',) (2 devices)")),
      ("num_heads not a multiple of K", lambda: sharded_caches.place_caches(
          plain, mesh, num_heads=3), ("num_heads must be divisible by num_kv_heads",)),
      ("layout for another N", lambda: _decode_logits(model, sharded_caches.place_caches(
          plain, mesh, num_heads=8)), ("query heads (4)", "('model', 'model_rep') (8 devices",
                                       "KV heads (2)", "num_heads=4")),
  ):
    try:
      fn()
      errors[name] = "no error"
    except ValueError as e:
      if not all(n in str(e) for n in needles):
        errors[name] = str(e)
  prompts, lengths = _prompts()
  requests = [(i, np.asarray(prompts[i, :lengths[i]]).tolist(), 3) for i in range(2)]
  opts = dict(num_slots=2, num_pages=16, page_size=PAGE_SIZE, max_len=16, max_prompt_len=8)
  single = kvattn.ContinuousBatcher(ref, **opts).run(requests)
  on_mesh = kvattn.ContinuousBatcher(make(), mesh=mesh, **opts).run(requests)
  batcher_equal = all(list(single[i].tokens) == list(on_mesh[i].tokens) for i in single)
  return dict(max_abs_diff=diffs, errors=errors, batcher_tokens_equal=batcher_equal,
              ok=max(diffs.values()) <= 1e-5 and not errors and batcher_equal)


def check_batcher(mesh_shape, prefix_cache: bool = False) -> dict:
  """ContinuousBatcher on a mesh gives the single-device tokens; slots and pools split
  over `data`, pools over K on `model`; each device holds its share of the pool bytes;
  a `data` axis that does not divide the slots -> ValueError naming it."""
  model = make_model_fn("gqa", 2)()
  prompts, lengths = _prompts()
  # Four requests on two slots: both data shards serve, and slots are reused.
  requests = [(i, np.asarray(prompts[i, :lengths[i]]).tolist(), 3) for i in range(BATCH)]
  opts = dict(num_slots=2, num_pages=16, page_size=PAGE_SIZE, max_len=16, max_prompt_len=8,
              prefix_cache=prefix_cache)
  want = kvattn.ContinuousBatcher(model, **opts).run(requests)
  mesh = sharding.make_mesh(mesh_shape)
  batcher = kvattn.ContinuousBatcher(model, mesh=mesh, **opts)
  got = batcher.run(requests)
  same = all(list(got[i].tokens) == list(want[i].tokens) for i in want)
  d, m, _ = mesh_shape
  slots_used = sorted({f.slot for f in got.values()})
  cache = batcher.caches[0]
  share = sum(a.nbytes for a in cache.storage_arrays()) // (d * min(2, m))
  per_device = set(sharding.per_device_bytes(cache.storage_arrays()).values())
  bad_error = ""
  if d > 1:
    try:
      kvattn.ContinuousBatcher(model, mesh=mesh, **dict(opts, num_slots=d + 1))
      bad_error = "no error"
    except ValueError as e:
      bad_error = "" if "'data'" in str(e) and "num_slots" in str(e) else str(e)
  return dict(mesh=list(mesh_shape), prefix_cache=prefix_cache, tokens_equal=same,
              slots_used=slots_used, per_device=sorted(per_device), share=share,
              bad_mesh_error=bad_error, ok=same and per_device == {share} and not bad_error
              and slots_used == [0, 1] and batcher.stats()["used_pages"] == 0
              and isinstance(cache, sharded_caches.ShardedPagedKVCache))


def check_ring_batcher(mesh_shape) -> dict:
  """ContinuousBatcher(local_layers="ring") and `generate` with
  `sharded.cache_factory(local_layers="ring")` on a mesh, on the tiny random Gemma 3 (a local
  layer of window 4, a global one): the single-device full layout's tokens; each device holds
  the rings of its own slots (rows split over `data`)."""
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  model, _ = kvattn.from_pretrained(os.path.join(root, "fixtures", "hf", "gemma3"))
  rng = np.random.default_rng(0)
  requests = [(i, rng.integers(3, model.vocab_size, n).tolist(), 5)
              for i, n in enumerate((11, 6, 9, 3))]
  opts = dict(num_slots=2, num_pages=16, page_size=4, max_len=19, max_prompt_len=11)
  want = kvattn.ContinuousBatcher(model, **opts).run(requests)
  mesh = sharding.make_mesh(mesh_shape)
  batcher = kvattn.ContinuousBatcher(model, mesh=mesh, local_layers="ring", **opts)
  got = batcher.run(requests)
  same = all(list(got[i].tokens) == list(want[i].tokens) for i in want)
  # speculation with rings on the mesh: each ring commits from the transaction's undo log
  spec = kvattn.ContinuousBatcher(model, mesh=mesh, local_layers="ring",
                                  speculative=PromptLookup(4), **opts)
  spec_same = all(list(f.tokens) == list(want[i].tokens) for i, f in spec.run(requests).items())
  ring = batcher.caches[0]
  share = sum(a.nbytes for a in ring.storage_arrays()) // mesh_shape[0]
  per_device = set(sharding.per_device_bytes(ring.storage_arrays()).values())
  # generate on the mesh with the per-layer layout (sharded.cache_factory(local_layers=)).
  prompts = np.zeros((2, 11), np.int32)
  for b, (_, p, _) in enumerate(requests[:2]):
    prompts[b, :len(p)] = p
  lengths = np.array([11, 6], np.int32)
  want_gen, _ = kvattn.generate(model, prompts, lengths, 5)
  factory = sharded_caches.cache_factory(model, mesh, local_layers="ring")
  got_gen, _ = kvattn.generate(sharding.place_model(model, mesh), prompts, lengths, 5,
                               cache_factory=factory)
  kinds_gen = [type(c).__name__ for c in factory(2, 16)]
  gen_same = np.asarray(got_gen).tolist() == np.asarray(want_gen).tolist()
  return dict(mesh=list(mesh_shape), tokens_equal=same, per_device=sorted(per_device),
              share=share, kinds=[type(c).__name__ for c in batcher.caches],
              generate_tokens_equal=gen_same, generate_kinds=kinds_gen,
              speculative_tokens_equal=spec_same,
              ok=same and gen_same and spec_same and per_device == {share}
              and isinstance(ring, kvattn.RingKVCache))


LOWBIT_SPEC = {"group_size": 4, "residual": 4}  # H = 16: value groups of 4 channels


def check_lowbit(mesh_shape) -> dict:
  """Sub-byte caches on a mesh (`sharded.place_lowbit`, GSPMD): `generate` through `kivi4`
  (dense store; and the MLA model's latent store) placed by `sharded.lowbit_cache_factory`, and `ContinuousBatcher(cache=
  "paged_kivi4")` with its pools over KV heads and `data`, give the single-device tokens;
  each device holds 1 / (d * min(K, m)) of the storage (codes, scales, zero points, rings)."""
  model = make_model_fn("gqa", 2)()
  mesh = sharding.make_mesh(mesh_shape)
  d, m, _ = mesh_shape
  prompts, lengths = _prompts()
  spec = {"kind": "kivi4", **LOWBIT_SPEC}
  want, _ = kvattn.generate(model, prompts, lengths, NEW_TOKENS + 8,
                            cache_factory=registry.cache_factory_from_config(model, spec))
  factory = sharded_caches.lowbit_cache_factory(model, mesh, spec)
  got, _ = kvattn.generate(sharding.place_model(model, mesh), prompts, lengths, NEW_TOKENS + 8,
                           cache_factory=factory)
  gen_same = np.asarray(got).tolist() == np.asarray(want).tolist()
  dense = factory(BATCH, 32)[0]
  share = sum(a.nbytes for a in dense.storage_arrays()) // (d * min(2, m))
  dense_per_device = set(sharding.per_device_bytes(dense.storage_arrays()).values())
  # The batcher: four requests on two slots, pages per data shard.
  requests = [(i, np.asarray(prompts[i, :lengths[i]]).tolist(), 10) for i in range(BATCH)]
  opts = dict(num_slots=2, num_pages=8, page_size=4, max_len=16, max_prompt_len=8,
              cache={"kind": "paged_kivi4", **LOWBIT_SPEC})
  want_b = kvattn.ContinuousBatcher(model, **opts).run(requests)
  batcher = kvattn.ContinuousBatcher(model, mesh=mesh, **opts)
  got_b = batcher.run(requests)
  batch_same = all(list(got_b[i].tokens) == list(want_b[i].tokens) for i in want_b)
  pool = batcher.caches[0]
  pool_share = sum(a.nbytes for a in pool.storage_arrays()) // (d * min(2, m))
  pool_per_device = set(sharding.per_device_bytes(pool.storage_arrays()).values())
  # MLA latents (KIVILatentCache): rows over `data`, replicated over `model` (one latent).
  mla = make_model_fn("mla")()
  want_m, _ = kvattn.generate(mla, prompts, lengths, NEW_TOKENS + 8,
                              cache_factory=registry.cache_factory_from_config(mla, spec))
  got_m, _ = kvattn.generate(sharding.place_model(mla, mesh), prompts, lengths, NEW_TOKENS + 8,
                             cache_factory=sharded_caches.lowbit_cache_factory(mla, mesh, spec))
  mla_same = np.asarray(got_m).tolist() == np.asarray(want_m).tolist()
  gen_same = gen_same and mla_same
  return dict(mesh=list(mesh_shape), generate_tokens_equal=gen_same, tokens_equal=batch_same,
              mla_generate_tokens_equal=mla_same,
              dense_per_device=sorted(dense_per_device), dense_share=share,
              pool_per_device=sorted(pool_per_device), pool_share=pool_share,
              kinds=[type(c).__name__ for c in (dense, pool)],
              ok=gen_same and batch_same and dense_per_device == {share}
              and pool_per_device == {pool_share} and batcher.stats()["used_pages"] == 0)


def check_real_model(mesh_shape) -> dict:
  """The main job's family (configs/default.py:smoke on "random-tiny") on a mesh: the
  same perplexity (rel 1e-5) and greedy tokens as on one device, the full cache split;
  meshes that do not fit raise ValueError naming the key before any work."""
  import tempfile  # pylint: disable=g-import-not-at-top
  from configs import default
  from experiments.families import real_model as rme
  config = default.get_config("smoke")
  config.model.name = "random-tiny"
  # f32 full cache (sharded); int8 H2O at K = 1 (no sharded kind); int8 full at K = 1 (the
  # one KV head replicated over `model`).
  sweep = default.get_sweep("smoke") + [
      {"cache.dtype": "int8", "cache.policy": "full", "heads.num_kv_heads": 1}]
  records = []
  with tempfile.TemporaryDirectory() as workdir:
    for shape in (None, mesh_shape):
      config.mesh.shape = shape
      family = rme.RealModelFamily(workdir)
      records.append([family.measure(point) for point in family.points(config, sweep)])
    errors = {}
    for shape, needle in (((2, 1, 1), "mesh.shape (2, 1, 1): the batch axis 'data'"),
                          ((1, 3, 1), "heads.num_kv_heads (layer 0)"),
                          ((1, 1, 3), "text.chunk must be a multiple of the size 3")):
      config.mesh.shape = shape
      try:
        rme.RealModelFamily(workdir).points(config, sweep)
        errors[str(shape)] = "no error"
      except ValueError as e:
        if needle not in str(e):
          errors[str(shape)] = str(e)
  single, sharded = records
  rel = max(abs(a["ppl"] - b["ppl"]) / a["ppl"] for a, b in zip(single, sharded))
  tokens = all(a["greedy_tokens"] == b["greedy_tokens"] for a, b in zip(single, sharded))
  full = sharded[0]  # one layer's K and V split over the model axis: half on each device
  split = full["per_device_cache_bytes"] * math.prod(mesh_shape) == full["cache_bytes_per_seq"]
  return dict(mesh=list(mesh_shape), ppl_max_rel_diff=rel, tokens_equal=tokens,
              per_device_cache_bytes=[r["per_device_cache_bytes"] for r in sharded],
              cache_bytes_per_seq=[r["cache_bytes_per_seq"] for r in sharded],
              bad_mesh_errors=errors,
              ok=rel <= 1e-5 and tokens and split and not errors
              and [r["mesh"] for r in sharded] == [list(mesh_shape)] * 3)


def check_quantized() -> dict:
  """int8 caches: sharded decode logits equal the single-device int8 run."""
  diffs = {}
  for kind, k, mesh_shape in (("dense", 2, (2, 2, 2)), ("paged", 2, (1, 2, 4)),
                              ("mla", 1, (2, 1, 4))):
    make = make_model_fn(kind, k)
    ref = make()
    want, _, _ = _decode_logits(ref, ref.init_caches(BATCH, MAX_LEN, dtype=jnp.int8))
    mesh = sharding.make_mesh(mesh_shape)
    model = sharding.shard_model(make, mesh)
    caches = sharded_caches.init_caches(model, BATCH, MAX_LEN, mesh, dtype=jnp.int8,
                                  page_size=PAGE_SIZE, kind="paged" if kind == "paged" else "dense")
    got, _, _ = _decode_logits(model, caches)
    diffs[kind] = float(jnp.max(jnp.abs(got - want)))
  return dict(max_abs_diff=diffs, ok=max(diffs.values()) <= 1e-5)


def main(argv):
  grid = argv[1] if len(argv) > 1 else "fast"
  # ContinuousBatcher, data parallel: the fast grid runs (2,2,1) with the prefix cache.
  batchers = [("batcher", lambda: check_batcher((2, 2, 1), prefix_cache=True))]
  more_batchers = [("batcher", lambda: check_batcher((2, 1, 1))),
                   ("batcher", lambda: check_batcher((2, 2, 1)))]
  if grid == "fast":
    cases = [((2, 2, 2), "dense", 2, True), ((2, 2, 2), "paged", 1, False)]
  elif grid == "full":
    cases = [(mesh, kind, k, True) for mesh in MESHES for kind in ("dense", "paged")
             for k in (1, 2, 8)] + [(mesh, "mla", 1, True) for mesh in MESHES]
  elif grid not in ("batcher", "real_model", "layers", "lowbit"):
    raise SystemExit(f"usage: python -m tests.sharding._mesh_checks fast|full|batcher|"
                     f"real_model; got {grid!r}")
  if grid == "lowbit":  # sub-byte caches (issue 28): generate and the batcher
    checks = [("lowbit", lambda: check_lowbit((2, 2, 1)))]
  elif grid == "layers":  # the per-layer layout's batcher (rings + paged pools)
    checks = [("ring_batcher", lambda: check_ring_batcher((2, 1, 1))),
              ("ring_batcher", lambda: check_ring_batcher((2, 2, 1)))]
  elif grid == "batcher":  # ContinuousBatcher only
    checks = more_batchers + batchers
  elif grid == "real_model":  # the main job's family
    checks = [("real_model", lambda: check_real_model((1, 2, 1))),
              ("real_model", lambda: check_real_model((1, 1, 2)))]
  else:
    # The fast grid leaves speculative decoding on a mesh to the full grid (~8 CPU-s).
    checks = [("case", lambda c=c: check_case(c[0], c[1], c[2], with_generate=c[3],
                                              with_speculative=grid == "full"))
              for c in cases]
    checks += [("empty_shards", lambda: check_empty_shards("dense")),
               ("empty_shards", lambda: check_empty_shards("mla")),
               ("bad_meshes", check_bad_meshes), ("layouts", check_layouts)] + batchers
  if grid == "full":
    checks += more_batchers + [("quantized", check_quantized),
                               ("real_model", lambda: check_real_model((1, 2, 1))),
                               ("batcher", lambda: check_batcher((2, 2, 2))),
                               ("batcher", lambda: check_batcher((1, 8, 1)))]
  failed = 0
  for name, fn in checks:
    start = time.process_time()
    try:
      result = fn()
    except Exception:  # pylint: disable=broad-except  (reported, and the run fails)
      result = dict(ok=False, error=traceback.format_exc()[-2000:])
    result["cpu_s"] = round(time.process_time() - start, 2)
    failed += not result["ok"]
    print(json.dumps(dict(check=name, **result)), flush=True)
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main(sys.argv))
