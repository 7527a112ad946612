"""Cross-layer KV sharing (CLA, Brandon et al. 2024): config, forward, caches, conversion."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import kvattn
from kvattn import memory
from kvattn import ops
from kvattn.models import convert
from kvattn.models import transformer
from tests.kvattn.models import cached_forward

V = 61
LLAMA = dict(vocab_size=V, d_model=32, num_layers=4, mlp_dim=48,
             attention=dict(num_heads=4, num_kv_heads=2, head_dim=8))
LOCAL = {"window": 4, "rope_theta": 10000.0}
GLOBAL = {"rope_theta": 1e6}
# Gemma 3 in small: local, local, global, twice; qk-norm, four norms, GeGLU, scaled embeddings.
GEMMA = dict(vocab_size=V, d_model=32, num_layers=6, mlp_dim=48, mlp_activation="gelu_tanh",
             scale_embeddings=True, post_norms=True,
             attention=dict(num_heads=4, num_kv_heads=1, head_dim=16, qk_norm=True,
                            sm_scale=0.2),
             layers=(LOCAL, LOCAL, GLOBAL, LOCAL, LOCAL, GLOBAL))


def _model(cfg, seed=0, **overrides):
  model = kvattn.Transformer.from_config(transformer.model_config(**{**cfg, **overrides}),
                                         rngs=nnx.Rngs(seed))
  # Random norm scales and biases so the reference checks which layer's are used.
  leaves = jax.tree.leaves(nnx.state(model, nnx.Param))
  keys = jax.random.split(jax.random.key(seed + 7), len(leaves))
  _, state = nnx.split(model, nnx.Param)
  state = jax.tree.map(lambda x, k: x + 0.1 * jax.random.normal(k, x.shape, x.dtype)
                       if x.ndim == 1 else x, state, jax.tree.unflatten(
                           jax.tree.structure(state), list(keys)))
  nnx.update(model, state)
  return model


@functools.partial(jax.jit, static_argnums=0)
def _apply(graphdef, state, tokens, caches, new_lengths):
  return nnx.merge(graphdef, state)(tokens, caches=caches, new_lengths=new_lengths)


def _rms(x, scale, eps):
  return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + eps) * scale


def reference_logits(model, tokens):
  """The forward pass in plain jnp, each layer reading the keys and values of its
  `kv_source` (or its own), causal with the layer's window: `f32[B, T, V]`."""
  spec, eps = model.spec, model.spec.norm_eps
  B, T = tokens.shape
  x = model.embedding[...][tokens]
  if spec.scale_embeddings:
    x = x * spec.d_model ** 0.5
  positions = jnp.broadcast_to(jnp.arange(T), (B, T))
  t, s = jnp.arange(T)[:, None], jnp.arange(T)[None, :]
  kv = {}
  for i, layer in enumerate(model.layers):
    attn, layer_spec = layer.attn, spec.layers[i]
    a = _rms(x, layer.attn_norm.scale[...], eps)
    rope = dict(rope_theta=attn.rope_theta, scaling=attn.rope_scaling)
    q = jnp.einsum("btd,dnh->btnh", a, attn.q_proj[...])
    if attn.qk_norm:
      q = _rms(q, attn.q_norm[...], eps)
    if layer_spec.kv_source is None:
      k = jnp.einsum("btd,dkh->btkh", a, attn.k_proj[...])
      v = jnp.einsum("btd,dkh->btkh", a, attn.v_proj[...])
      if attn.qk_norm:
        k = _rms(k, attn.k_norm[...], eps)
      kv[i] = (ops.apply_rope(k, positions, **rope), v)
    k, v = kv[i if layer_spec.kv_source is None else layer_spec.kv_source]
    q = ops.apply_rope(q, positions, **rope)
    G = attn.num_heads // attn.num_kv_heads
    k, v = jnp.repeat(k, G, axis=2), jnp.repeat(v, G, axis=2)
    scale = attn.sm_scale or attn.head_dim ** -0.5
    scores = jnp.einsum("btnh,bsnh->bnts", q, k) * scale
    visible = (s <= t) & ((s > t - attn.window) if attn.window else True)
    p = jax.nn.softmax(jnp.where(visible, scores, -jnp.inf), axis=-1)
    h = jnp.einsum("btnh,nhd->btd", jnp.einsum("bnts,bsnh->btnh", p, v), attn.o_proj[...])
    if spec.post_norms:
      h = _rms(h, layer.post_attn_norm.scale[...], eps)
    x = x + h
    m = _rms(x, layer.mlp_norm.scale[...], eps)
    act = jax.nn.silu if spec.mlp_activation == "silu" else \
        (lambda g: jax.nn.gelu(g, approximate=True))
    h = (act(m @ layer.mlp.gate[...]) * (m @ layer.mlp.up[...])) @ layer.mlp.down[...]
    if spec.post_norms:
      h = _rms(h, layer.post_mlp_norm.scale[...], eps)
    x = x + h
  x = _rms(x, model.final_norm.scale[...], eps)
  return x @ model.embedding[...].T


# ----------------------------------------------------------------------------------------------
# Config.


def test_cla_factor_groups_layers_of_one_type():
  spec = transformer.resolve_config(transformer.model_config(**LLAMA, cla_factor=2))
  assert [layer.kv_source for layer in spec.layers] == [None, 0, None, 2]
  spec = transformer.resolve_config(transformer.model_config(**{**LLAMA, "num_layers": 5},
                                                             cla_factor=3))
  assert [layer.kv_source for layer in spec.layers] == [None, 0, 0, None, 3]
  # Gemma: locals (0, 1), (3, 4); globals (2, 5) -- never a local with a global.
  spec = transformer.resolve_config(transformer.model_config(**GEMMA, cla_factor=2))
  assert [layer.kv_source for layer in spec.layers] == [None, 0, None, None, 3, 2]
  # Gemma 3's real pattern (five local, one global) x 3: locals pair across a global.
  pattern = ([LOCAL] * 5 + [GLOBAL]) * 3
  layers = transformer.resolve_config(transformer.model_config(
      **{**GEMMA, "num_layers": 18, "layers": tuple(pattern)})).layers
  sources = transformer.cla_sources(layers, 2)
  assert sources[:7] == [None, 0, None, 2, None, None, 4] and sources[11] == 5
  assert sources[17] is None and sum(j is None for j in sources) == 10
  assert transformer.resolve_config(spec) == spec  # idempotent
  # cla_factor 1 and None: no sharing.
  for factor in (1, None):
    spec = transformer.resolve_config(transformer.model_config(**LLAMA, cla_factor=factor))
    assert all(layer.kv_source is None for layer in spec.layers)


@pytest.mark.parametrize("overrides, message", [
    (dict(cla_factor=0), r"model\.cla_factor must be a positive int; got 0"),
    (dict(layers=({}, {"kv_source": 1}, {}, {})),
     r"model\.layers\[1\]\.kv_source must name an earlier layer \(< 1\); got 1"),
    (dict(layers=({}, {"kv_source": -1}, {}, {})),
     r"model\.layers\[1\]\.kv_source must be an int >= 0; got -1"),
    (dict(layers=({}, {"kv_source": 0}, {"kv_source": 1}, {})),
     r"model\.layers\[2\]\.kv_source = 1 names a layer that reads layer 0's cache"),
    (dict(layers=({}, {"kv_source": 0, "window": 8}, {}, {})),
     r"model\.layers\[1\]\.kv_source = 0 needs layers of one type .*window is 8 here and None"),
    (dict(layers=({}, {"kv_source": 0, "num_kv_heads": 1}, {}, {})), r"num_kv_heads is 1 here"),
    (dict(cla_factor=2, layers=({}, {}, {}, {"kv_source": 0})),
     r"model\.layers\[3\]\.kv_source = 0 conflicts with model\.cla_factor = 2, which gives "
     r"layer 3 the source 2"),
    (dict(attention=dict(num_heads=4, num_kv_heads=2, head_dim=8, kv_source=0)),
     r"model\.attention\.kv_source must be None"),
    (dict(layers=({}, {"kind": "mla", "kv_source": 0}, {}, {})),
     r"model\.layers\[1\]\.kv_source must be None for attention kind 'mla'"),
    (dict(cla_factor=2, layers=({}, {"kind": "mla"}, {}, {})),
     r"model\.cla_factor shares GQA caches; model\.layers\[1\] is 'mla'"),
])
def test_bad_sharing_config_raises_naming_the_key(overrides, message):
  cfg = {**LLAMA, **overrides}
  with pytest.raises(ValueError, match=message):
    transformer.resolve_config(transformer.model_config(**cfg))


def test_sharing_layers_have_no_kv_parameters_nor_caches():
  base, shared = _model(LLAMA), _model(LLAMA, cla_factor=2)
  count = lambda m: sum(x.size for x in jax.tree.leaves(nnx.state(m, nnx.Param)))
  D, K, H = 32, 2, 8
  assert count(base) - count(shared) == 2 * (2 * D * K * H)  # layers 1 and 3
  assert not hasattr(shared.layers[1].attn, "k_proj") and shared.layers[1].attn.kv_source == 0
  assert shared.cache_layers == (0, 2) and shared.num_caches == 2
  with pytest.raises(ValueError, match="reads layer 0's cache"):
    shared.layers[1].attn.init_cache(1, 4)
  x = jnp.ones((1, 3, D))
  with pytest.raises(ValueError, match="call it with shared_kv="):
    shared.layers[1].attn(x)
  with pytest.raises(ValueError, match="shared_kv is for a layer that reads"):
    shared.layers[0].attn(x, shared_kv=shared.layers[0].attn.call_sharing_kv(x)[2])
  with pytest.raises(ValueError, match=r"one cache per layer that owns one \(2 of 4"):
    shared(jnp.ones((1, 3), jnp.int32), base.init_caches(1, 4))


@pytest.mark.parametrize("dtype", ["float32", "int8"])
def test_cache_bytes_are_halved_at_factor_two(dtype):
  for cfg in (LLAMA, GEMMA):
    base, shared = _model(cfg), _model(cfg, cla_factor=2)
    assert shared.cache_bytes_per_token(dtype) * 2 == base.cache_bytes_per_token(dtype)
    assert transformer.cache_bytes_per_token(shared.spec, dtype) == \
        shared.cache_bytes_per_token(dtype)
    caches = shared.init_caches(2, 8, dtype)
    assert len(caches) == shared.num_caches == cfg["num_layers"] // 2
    assert sum(memory.measured_bytes_per_token(c) for c in caches) == \
        shared.cache_bytes_per_token(dtype)
  paged = shared.init_caches(2, 8, cache={"kind": "paged", "page_size": 4})
  rings = shared.init_caches(2, 8, local_layers="ring")  # Gemma: locals as rings of 4
  assert len(paged) == 3 and [type(c).__name__ for c in rings] == [
      "RingKVCache", "KVCache", "RingKVCache"]


# ----------------------------------------------------------------------------------------------
# Forward, caches, generate.

EXPLICIT = dict(LLAMA, layers=({}, {}, {"kv_source": 0}, {"kv_source": 1}))  # Gemma 3n-like


@pytest.mark.parametrize("cfg, factor", [pytest.param(LLAMA, 2, marks=pytest.mark.slow),
                                         (GEMMA, 2), (EXPLICIT, None),
                                         (GEMMA, None)],
                         ids=["llama-cla2", "gemma-cla2", "explicit", "gemma-no-sharing"])
def test_forward_equals_reference(cfg, factor):
  """The model against `reference_logits`; without sharing (the last case) the reference is the
  plain model's forward, which checks the reference itself."""
  model = _model(cfg, cla_factor=factor)
  assert (model.num_caches < model.num_layers) == (cfg is EXPLICIT or factor is not None)
  tokens = jax.random.randint(jax.random.key(1), (2, 9), 0, V, jnp.int32)
  logits, _ = model(tokens)
  np.testing.assert_allclose(logits, reference_logits(model, tokens), atol=2e-5, rtol=1e-5)


@pytest.mark.slow  # the fast suite: test_generate_equals_greedy_forward on a sharing model
@pytest.mark.parametrize("local_layers", ["full", "ring"])
def test_cached_prefill_and_decode_match_full_forward(local_layers):
  """Invariant 1 with sharing on the Gemma-like model: dense caches, and rings of the window
  (4) for the local layers, into which the prefill chunk (5 tokens) wraps."""
  model = _model(GEMMA, cla_factor=2)
  lengths = np.array([5, 2], np.int32)
  steps, width = 3, 5
  seqs = jax.random.randint(jax.random.key(0), (2, width + steps), 0, V, jnp.int32)
  caches = model.init_caches(2, 12, local_layers=local_layers)
  caches = cached_forward.assert_cached_steps_match_full(model, caches, seqs, lengths, width, steps)
  assert len(caches) == 3


def test_generate_equals_greedy_forward():
  model = _model(LLAMA, cla_factor=2)
  prompts = jnp.array([[3, 9, 27, 5], [7, 1, 0, 0]], jnp.int32)
  lengths = np.array([4, 2])
  tokens, out_lengths = kvattn.generate(model, prompts, lengths, 5)
  graphdef, state = nnx.split(model)
  seqs = np.zeros((2, 9), np.int32)  # causal: the padding after a row's end changes nothing
  seqs[:, :4] = prompts
  for t in range(5):
    logits, _ = _apply(graphdef, state, jnp.asarray(seqs), None, None)  # one compiled shape
    for b in range(2):
      seqs[b, lengths[b] + t] = int(jnp.argmax(logits[b, lengths[b] + t - 1]))
  for b in range(2):
    assert list(np.asarray(tokens[b])) == list(seqs[b, lengths[b]:lengths[b] + 5])
  np.testing.assert_array_equal(out_lengths, [5, 5])


# ----------------------------------------------------------------------------------------------
# Conversion.


def test_to_cla_averages_each_pairs_kv_projections():
  source = _model(GEMMA)
  model = convert.to_cla(source, 2)
  assert model.spec.cla_factor == 2 and model.cache_layers == (0, 2, 3)
  for owner, members in ((0, (0, 1)), (3, (3, 4)), (2, (2, 5))):
    for name in ("k_proj", "v_proj", "k_norm"):
      want = np.mean([np.asarray(getattr(source.layers[m].attn, name)[...]) for m in members], 0)
      np.testing.assert_allclose(getattr(model.layers[owner].attn, name)[...], want, rtol=1e-6)
  for i in range(6):  # queries, outputs, MLPs copied
    np.testing.assert_array_equal(model.layers[i].attn.q_proj[...],
                                  source.layers[i].attn.q_proj[...])
    np.testing.assert_array_equal(model.layers[i].mlp.down[...], source.layers[i].mlp.down[...])
  first = convert.to_cla(source, 2, method="first")
  np.testing.assert_array_equal(first.layers[3].attn.k_proj[...], source.layers[3].attn.k_proj[...])
  assert source.num_caches == 6 and hasattr(source.layers[1].attn, "k_proj")  # source intact
  # Factor 1: a copy with the same logits.
  tokens = jnp.array([[1, 2, 3, 4]], jnp.int32)
  np.testing.assert_array_equal(convert.to_cla(source, 1)(tokens)[0], source(tokens)[0])


@pytest.mark.parametrize("kwargs, message", [
    (dict(cla_factor=0), r"cla_factor must be a positive int; got 0"),
    (dict(cla_factor=2, method="median"), r"method must be one of \('mean', 'first'\)"),
])
def test_to_cla_rejects_bad_arguments(kwargs, message):
  with pytest.raises(ValueError, match=message):
    convert.to_cla(_model(LLAMA), **kwargs)


def test_conversions_refuse_a_model_that_already_shares():
  shared = _model(LLAMA, cla_factor=2)
  for fn in (lambda: convert.to_cla(shared, 2), lambda: convert.regroup_kv_heads(shared, 1)):
    with pytest.raises(ValueError, match=r"model layer 1 reads layer 0's \(cross-layer KV"):
      fn()


@pytest.mark.slow  # the fast suite: dense and rings above (both ways a sharing layer reads)
@pytest.mark.parametrize("spec", [{"kind": "paged", "page_size": 4}, {"kind": "h2o", "budget": 32},
                                  {"kind": "sink", "num_sinks": 2, "window": 30},
                                  {"kind": "kivi4"}, "speculative"],
                         ids=lambda s: s if isinstance(s, str) else s["kind"])
def test_generate_with_sharing_through_every_path_equals_dense(spec):
  """Budgets that hold every token: each kind (and speculative decoding over dense caches)
  gives the dense caches' greedy tokens with the sharing layers reading the owners' caches."""
  from kvattn.caches import registry  # pylint: disable=g-import-not-at-top
  from kvattn.inference import speculative  # pylint: disable=g-import-not-at-top
  model = _model(LLAMA, cla_factor=2)
  prompts = jnp.array([[3, 9, 27, 5, 3, 9, 27], [7, 1, 7, 1, 7, 0, 0]], jnp.int32)
  lengths = np.array([7, 5])
  want, _ = kvattn.generate(model, prompts, lengths, 6)
  if spec == "speculative":
    got, _ = kvattn.generate(model, prompts, lengths, 6,
                             speculative=speculative.PromptLookup(3, 2, 1))
  else:
    got, _ = kvattn.generate(model, prompts, lengths, 6,
                             cache_factory=registry.cache_factory_from_config(model, spec))
  np.testing.assert_array_equal(got, want)


# ----------------------------------------------------------------------------------------------
# The scanned forward and the batcher with sharing.


# Gemma-like with two layers of each type, so factor 2 pairs (0, 1) locals and (2, 3) globals.
GEMMA4 = {**GEMMA, "num_layers": 4, "layers": (LOCAL, LOCAL, GLOBAL, GLOBAL)}


# The default case: dense caches (cheap to compile); rings (the sharing local layer reading
# its owner's wrapping ring) in the slow suite.
@pytest.mark.parametrize("local_layers", ["full", pytest.param("ring", marks=pytest.mark.slow)])
def test_scan_forward_with_sharing_equals_hidden(local_layers):  # pylint: disable=too-many-locals
  """`scan_forward` wires each group's sharing layers as `hidden` does: prefill (a chunk
  wrapping the rings) then a decode step give `hidden`'s states and caches."""
  from kvattn.models import scan  # pylint: disable=g-import-not-at-top
  model = _model(GEMMA4, cla_factor=2)
  defs, params = scan.scan_parts(model)
  # Locals (0, 1) -> 0, globals (2, 3) -> 2: the layers' graph definitions differ (each
  # sharing layer names its source), so one group of the whole model, with 2 caches.
  assert defs[3] == (None, 0, None, 2) and scan.cache_period(defs) == 2
  tokens = jax.random.randint(jax.random.key(2), (2, 7), 0, V, jnp.int32)
  lengths = jnp.asarray([7, 5], jnp.int32)
  caches = model.init_caches(2, 12, local_layers=local_layers)
  graphdef, state = nnx.split(model)
  hidden = jax.jit(lambda state, *a: nnx.merge(graphdef, state).hidden(  # eager rings are slow
      a[0], a[1], new_lengths=a[2]))
  want, want_caches = hidden(state, tokens, caches, lengths)
  forward = jax.jit(scan.scan_forward, static_argnums=0)
  got, stacked = forward(defs, params, scan.stack_caches(caches, 2), tokens, lengths)
  np.testing.assert_allclose(got, want, atol=1e-5)
  for a, b in zip(jax.tree.leaves(scan.unstack_caches(stacked)), jax.tree.leaves(want_caches)):
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), atol=1e-5)
  step = tokens[:, :1]
  want, _ = hidden(state, step, want_caches, jnp.ones(2, jnp.int32))
  got, _ = forward(defs, params, stacked, step, jnp.ones(2, jnp.int32))
  np.testing.assert_allclose(got, want, atol=1e-5)


def test_scan_period_keeps_a_source_inside_its_group():
  """Llama with factor 2: layers (0, 1) and (2, 3) share; the sources repeat every 2 layers
  shifted by the group, so the scan may group by 2 (or by the graph definitions' period)."""
  from kvattn.models import scan  # pylint: disable=g-import-not-at-top
  assert scan._sources_periodic((None, 0, None, 2), 2)  # pylint: disable=protected-access
  assert not scan._sources_periodic((None, 0, None, 0), 2)  # pylint: disable=protected-access
  assert not scan._sources_periodic((None, None, 1, None), 2)  # pylint: disable=protected-access
  model = _model(LLAMA, cla_factor=2)
  defs, _ = scan.scan_parts(model)
  assert scan.cache_period(defs) * (4 // len(defs[0])) == model.num_caches == 2


def _batcher_tokens(model, prompts, waves, new, **opts):
  """Serves `prompts` in `waves` (lists of indices joining together) through one batcher."""
  batcher = kvattn.ContinuousBatcher(model, num_slots=2, page_size=2, max_len=20,
                                     max_prompt_len=16, **opts)
  got = {}
  for wave in waves:
    got.update(batcher.run([(i, prompts[i], new) for i in wave]))
  return batcher, [got[i].tokens.tolist() for i in range(len(prompts))]


def _generate_each(model, prompts, new):
  lengths = np.asarray([len(p) for p in prompts])
  padded = np.zeros((len(prompts), lengths.max()), np.int32)
  for b, p in enumerate(prompts):
    padded[b, :len(p)] = p
  out, _ = kvattn.generate(model, padded, lengths, new)
  return [np.asarray(o).tolist() for o in out]


@pytest.mark.slow  # ~12 s; the batcher's prefix cache and rings run fast in test_batching_rings_prefix.py
def test_batcher_with_sharing_prefix_cache_and_rings_gives_generates_tokens():
  """CLA through the batcher: caches for the owning layers only (a ring for the local pair,
  a pool for the global pair), the prefix cache hitting with two live rows sharing pages
  (16 pages < 2 slots x 10 pages per sequence, where the default decode backend of a layer
  reading its owner's pool would otherwise be the one-owner-per-page "xla_pool")."""
  model = _model(GEMMA4, cla_factor=2)
  assert model.kv_sources == (None, 0, None, 2)
  system = np.asarray([5, 17, 33, 2, 40, 8, 9, 11, 60], np.int32)
  # The first prompt leaves a ring snapshot at token 8; the other two hit it together.
  prompts = [np.concatenate([system, t]).astype(np.int32) for t in ([], [3], [4, 5])]
  batcher, got = _batcher_tokens(model, prompts, [[0], [1, 2]], 5, num_pages=16,
                                 prefix_cache=True, local_layers="ring")
  assert [type(c).__name__ for c in batcher.caches] == ["RingKVCache", "PagedKVCache"]
  assert batcher.allocator.counters["cached_tokens"] == 16
  assert got == _generate_each(model, prompts, 5)
  # Every layer, the sharing ones included, decodes with a row-by-row backend ("xla" on CPU).
  assert all(layer.attn.decode_implementation not in (None, "xla_pool")
             for layer in nnx.merge(batcher._graphdef, batcher._state).layers)  # pylint: disable=protected-access
  batcher.allocator.check()


@pytest.mark.slow  # the default test above runs the prefix cache and rings with sharing
@pytest.mark.parametrize("opts", [dict(), dict(local_layers="ring"), dict(prefix_cache=True)],
                         ids=["paged", "rings", "prefix"])
def test_batcher_with_sharing_gives_generates_tokens(opts):
  model = _model(GEMMA4, cla_factor=2)
  prompts = [np.asarray([5, 17, 33, 2, 40, 8, 9, 11, 60, t], np.int32) for t in (1, 2, 3)]
  _, got = _batcher_tokens(model, prompts, [[0], [1, 2]], 5, num_pages=16, **opts)
  assert got == _generate_each(model, prompts, 5)
