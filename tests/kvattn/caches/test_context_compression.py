"""Context compression (`EvictingKVCache(compress="context")`): kvpress's "compress the context
at prefill, then grow".

The cache is checked against a numpy reference of the protocol: full causal attention over the
context, the policy's score of each context token from the context's own queries (h2o: every
query's mass; snapkv: the last `window_size` queries' mass, average-pooled; tova: the last
query's mass averaged over the heads; knorm: minus the key norm), the protected sinks and
recent window, the top `max(1, int(n * (1 - ratio)))` kept per KV head, then the question and the
answer appended and attending the kept tokens plus themselves.
"""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvattn.caches import _context
from kvattn.caches import eviction
from kvattn.caches import protocol as cache_protocol
from kvattn.caches import registry
from kvattn.inference.generation import generate

B, K, N, H = 2, 2, 4, 8
G = N // K
THETA = 10000.0
CONTEXT = np.array([9, 5], np.int32)
QUESTION = np.array([3, 4], np.int32)
DECODE = 2
POLICIES = {  # policy -> options: small windows, so the protected and scored tokens differ
    "h2o": {"recent_size": 1},
    "snapkv": {"window_size": 2, "kernel_size": 3},
    "tova": {},
    "knorm": {"num_sinks": 1},
}


# ----------------------------------------------------------------------------------------------
# The numpy reference of the protocol, one row at a time.


def _rope(x):
  """`[T, ..., H]` rotated at positions arange(T): RoPE with the halves of H paired (the
  Llama / NeoX layout kvattn uses)."""
  angles = np.arange(x.shape[0])[:, None] * THETA ** (-np.arange(0, H, 2) / H)  # [T, H/2]
  angles = angles.reshape((x.shape[0],) + (1,) * (x.ndim - 2) + (H // 2,))
  x1, x2 = np.split(x.astype(np.float64), 2, axis=-1)
  return np.concatenate([x1 * np.cos(angles) - x2 * np.sin(angles),
                         x2 * np.cos(angles) + x1 * np.sin(angles)], axis=-1)


def _probs(q, k, keys):
  """Softmax of `q: [N, H]` against the keys `k[keys]: [S, K, H]`, per head: `[N, S]`."""
  logits = np.einsum("nh,snh->ns", q, np.repeat(k[keys], G, axis=1)) / np.sqrt(H)
  p = np.exp(logits - logits.max(-1, keepdims=True))
  return p / p.sum(-1, keepdims=True)


def _avg_pool(x, size):
  """Zero-padded average pooling of `[K, S]` over S (stride 1, `size // 2` on the left)."""
  left = size // 2
  padded = np.pad(x, [(0, 0), (left, size - 1 - left)])
  return np.stack([padded[:, i:i + size].sum(-1) for i in range(x.shape[1])], -1) / size


def _kept_reference(q, k, c, kept, policy, options):
  """`[K, kept]` sorted tokens each KV head keeps of a context of `c` tokens (RoPE'd q, k)."""
  if c == 0 or kept == 0:
    return [np.zeros(0, np.int64) for _ in range(K)]
  mass = np.zeros((c, K, c))  # [query, KV head, key]: the group sum of the probabilities
  for t in range(c):
    mass[t, :, :t + 1] = _probs(q[t], k, np.arange(t + 1)).reshape(K, G, t + 1).sum(1)
  if policy == "h2o":
    score, recent = mass.sum(0), options["recent_size"]
  elif policy == "snapkv":
    window = options["window_size"]
    score = _avg_pool(mass[max(0, c - window):].sum(0), options["kernel_size"])
    recent = window
  elif policy == "tova":
    score, recent = np.broadcast_to(mass[c - 1].mean(0, keepdims=True), (K, c)), 0
  else:  # knorm
    score, recent = -np.linalg.norm(k[:c], axis=-1).T, 0
  token = np.arange(c)[None]
  protect = (token < options.get("num_sinks", 0)) | (token > c - 1 - recent)
  priority = np.where(protect, np.inf, score)
  return [np.sort(np.argsort(-priority[h], kind="stable")[:kept]) for h in range(K)]


def _reference(q, k, v, c, n, kept, policy, options):
  """One row: `(out [n, N, H], kept per KV head)` for tokens `[0, n)` whose first `c` are the
  context (q, k before RoPE)."""
  q, k = _rope(q[:n]), _rope(k[:n])
  keep = _kept_reference(q, k, c, kept, policy, options)
  out = np.zeros((n, N, H))
  for t in range(n):
    for h in range(K):
      keys = np.arange(t + 1) if t < c else np.concatenate([keep[h], np.arange(c, t + 1)])
      p = _probs(q[t], k, keys)[h * G:(h + 1) * G]  # [G, S]
      out[t, h * G:(h + 1) * G] = p @ v[keys, h]
  return out, keep


# ----------------------------------------------------------------------------------------------
# The jitted cache.


@jax.jit
def _step(cache, q, k, v, new_lengths):
  pos = cache.lengths[:, None] + jnp.arange(q.shape[1], dtype=jnp.int32)[None]
  return cache_protocol.update_attend(cache, q, k, v, positions=pos, rope_theta=THETA,
                                      new_lengths=new_lengths)


def _chunks(x, context, question):
  """`x: [B, T, ...]` split per row into the context (`[B, 9]`), the question (`[B, 6]`,
  left-aligned) and the DECODE tokens after it (`[B, DECODE]`), zero-padded (fixed widths:
  one compile per cache configuration)."""
  ctx = np.zeros((B, 9) + x.shape[2:], x.dtype)
  qst = np.zeros((B, 6) + x.shape[2:], x.dtype)
  dec = np.zeros((B, DECODE) + x.shape[2:], x.dtype)
  for b in range(B):
    c, m = context[b], question[b]
    ctx[b, :c], qst[b, :m], dec[b] = x[b, :c], x[b, c:c + m], x[b, c + m:c + m + DECODE]
  return ctx, qst, dec


def _run(cache, q, k, v, context=CONTEXT, question=QUESTION):
  """Context, question, then DECODE one-token steps through the jitted step: `(outputs per row
  [n_b, N, H], the caches after each write)`."""
  parts = list(zip(*(_chunks(x, context, question) for x in (q, k, v))))
  outs, caches = [], []
  for (qc, kc, vc), lengths in zip(parts[:2], (context, question)):
    out, cache = _step(cache, qc, kc, vc, jnp.asarray(lengths))
    outs.append(np.asarray(out))
    caches.append(cache)
  for t in range(DECODE):
    qd, kd, vd = (x[:, t:t + 1] for x in parts[2])
    out, cache = _step(cache, qd, kd, vd, jnp.ones((B,), jnp.int32))
    outs.append(np.asarray(out))
    caches.append(cache)
  rows = [np.concatenate([outs[0][b, :context[b]], outs[1][b, :question[b]],
                          *[o[b] for o in outs[2:]]]) for b in range(B)]
  return rows, caches


def _qkv(seed, num_tokens=int((CONTEXT + QUESTION).max()) + DECODE + 1):
  rng = np.random.default_rng(seed)
  return (rng.normal(size=(B, num_tokens, N, H)).astype(np.float32),
          rng.normal(size=(B, num_tokens, K, H)).astype(np.float32),
          rng.normal(size=(B, num_tokens, K, H)).astype(np.float32))


def _cache(policy, ratio=0.5, budget=None, capacity=None, **extra):
  """A context-compressing cache; `capacity` None: exactly what CONTEXT, QUESTION and DECODE
  need (9 slots at ratio 0.5: row 0 keeps 4 + 3 + 2)."""
  options = {**POLICIES[policy], **extra}
  spec_options = {"compression_ratio": ratio, "budget": budget}
  capacity = capacity or _context.slots_needed(spec_options, CONTEXT, CONTEXT + QUESTION + DECODE)
  return eviction.EvictingKVCache.init(B, budget, K, H, policy=policy, compress="context",
                                       compression_ratio=ratio, capacity=capacity, **options)


@pytest.mark.parametrize("policy", ["h2o", "snapkv", *[  # the fast suite: h2o's mass over every
    # query and recent window, snapkv's observation window and pooling; the other scores are
    # tested in test_long_context.py, the protocol is the same code for every policy.
    pytest.param(p, marks=pytest.mark.slow) for p in ("tova", "knorm")]])
def test_context_compressed_then_grown_equals_the_numpy_reference(policy):
  q, k, v = _qkv(0)
  cache = _cache(policy)
  rows, caches = _run(cache, q, k, v)
  for b in range(B):
    c, n = int(CONTEXT[b]), int(CONTEXT[b] + QUESTION[b]) + DECODE
    kept = int(c * 0.5)
    want, keep = _reference(q[b], k[b], v[b], c, n, kept, policy, POLICIES[policy])
    np.testing.assert_allclose(rows[b], want, atol=1e-5, rtol=1e-5, err_msg=f"row {b}")
    after_context = np.asarray(caches[0].slot_positions())[b]  # [K, capacity]
    for h in range(K):
      held = after_context[h][after_context[h] >= 0]
      np.testing.assert_array_equal(held, keep[h], err_msg=f"row {b}, KV head {h}")
      final = np.asarray(caches[-1].slot_positions())[b, h]
      np.testing.assert_array_equal(final[final >= 0], np.concatenate([keep[h],
                                                                       np.arange(c, n)]))
    assert int(caches[-1].context_lengths[b]) == c
  # The capacity is exactly full for row 0 (kept 4 + 3 + 2 = 9 slots), and the state checks.
  assert caches[-1].capacity == 9 and (np.asarray(caches[-1].pos)[0] >= 0).all()
  caches[-1].check_state()


def test_a_ragged_row_equals_the_row_alone_and_nan_in_unused_slots_changes_nothing():
  q, k, v = _qkv(1)
  rows, _ = _run(_cache("snapkv"), q, k, v)
  poisoned = _cache("snapkv")
  poisoned = poisoned.replace(k=jnp.full_like(poisoned.k, jnp.nan),
                              v=jnp.full_like(poisoned.v, jnp.nan))
  dirty, _ = _run(poisoned, q, k, v)
  for b in range(B):
    np.testing.assert_array_equal(dirty[b], rows[b])
  # Row 1 beside a partner of another context and question length (row 0 swapped for it).
  partner = (np.array([3, 5], np.int32), np.array([6, 4], np.int32))
  q2, k2, v2 = (np.concatenate([x[:1] * 0.5, x[1:]]) for x in (q, k, v))
  q2[0], k2[0], v2[0] = _qkv(2)[0][0], _qkv(2)[1][0], _qkv(2)[2][0]
  alone, _ = _run(_cache("snapkv"), q2, k2, v2, context=partner[0], question=partner[1])
  np.testing.assert_allclose(alone[1], rows[1], atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("context,ratio,budget,kept", [
    (np.array([0, 1]), 0.5, None, [0, 1]),  # an empty context; max(1, int(1 * 0.5)) = 1
    pytest.param(np.array([1, 4]), 0.0, None, [1, 4],  # ratio 0: every token kept (fast:
                 marks=pytest.mark.slow),  # generate at ratio 0 equals the dense cache)
    (np.array([6, 4]), None, 5, [5, 4]),  # budget = context - 1, = context + 1
    pytest.param(np.array([5, 0]), None, 5, [5, 0],  # budget = context; the program above
                 marks=pytest.mark.slow),  # (the fast suite keeps every token at ratio 0)
])
def test_edges_of_the_kept_count(context, ratio, budget, kept):
  context = context.astype(np.int32)
  q, k, v = _qkv(3)
  cache = _cache("h2o", ratio=ratio, budget=budget, capacity=None if budget is None else 16)
  rows, caches = _run(cache, q, k, v, context=context)
  for b in range(B):
    c, n = int(context[b]), int(context[b] + QUESTION[b]) + DECODE
    counts = (np.asarray(caches[0].slot_positions())[b] >= 0).sum(-1)
    np.testing.assert_array_equal(counts, [kept[b]] * K)
    want, _ = _reference(q[b], k[b], v[b], c, n, kept[b], "h2o", POLICIES["h2o"])
    np.testing.assert_allclose(rows[b], want, atol=1e-5, rtol=1e-5)


def test_past_the_capacity_the_policy_evicts_and_the_state_stays_valid():
  q, k, v = _qkv(4)
  _, caches = _run(_cache("h2o"), q, k, v)
  cache = caches[-1]  # row 0 exactly full
  for t in range(2):
    _, cache = _step(cache, q[:, -1:] + t, k[:, -1:], v[:, -1:], jnp.ones((B,), jnp.int32))
  cache.check_state()
  pos = np.asarray(cache.slot_positions())
  lengths = np.asarray(cache.lengths)
  assert lengths.tolist() == [16, 13]
  assert ((pos >= 0).sum(-1) == [[9, 9], [9, 9]]).all()  # row 1: 2 + 4 + 2 + 2 = 10 > 9
  assert (pos.max(-1) == (lengths - 1)[:, None]).all()  # h2o's recent token is kept


def test_the_kept_count_is_pythons_float64_int_of_n_times_one_minus_ratio():
  n = np.arange(0, 41, dtype=np.int32)
  for ratio in (0.0, 0.1, 0.25, 0.3, 0.5, 0.7, 0.9, 0.99):
    got = np.asarray(_context.kept_counts(jnp.asarray(n), 40, ratio, None))
    want = [max(1, int(int(x) * (1 - ratio))) if x else 0 for x in n]  # kvpress's
    np.testing.assert_array_equal(got, want, err_msg=ratio)
  assert int(_context.kept_counts(jnp.asarray([10]), 10, 0.3, None)[0]) == 7  # f32 gives 6
  np.testing.assert_array_equal(np.asarray(_context.kept_counts(jnp.asarray(n), 40, 0.5, 8)),
                                np.minimum(np.maximum(n // 2, n > 0), 8))


def test_bad_options_raise_naming_the_argument():
  cases = [
      (dict(budget=4, compress="ctx"), "compress must be one of"),
      (dict(budget=None, compress="context", capacity=8), "budget or compression_ratio"),
      (dict(budget=None, compress="context", compression_ratio=1.0, capacity=8),
       r"compression_ratio must be a float in \[0, 1\)"),
      (dict(budget=4, compression_ratio=0.5), "compression_ratio needs compress='context'"),
      (dict(budget=9, compress="context", capacity=8), "budget must be <= capacity = 8"),
      (dict(budget=None, compress="context", compression_ratio=0.5), "capacity must be"),
  ]
  for kwargs, match in cases:
    with pytest.raises(ValueError, match=match):
      eviction.EvictingKVCache.init(B, kwargs.pop("budget"), K, H, policy="h2o", **kwargs)
  for spec, match in [({"kind": "h2o", "compress": "context"}, r"cache.budget or cache."),
                      ({"kind": "h2o", "budget": 4, "compression_ratio": 0.5},
                       r"cache.compression_ratio is an option of compress='context'"),
                      ({"kind": "tova", "compress": "fixed"}, r"cache.budget must be set")]:
    with pytest.raises(ValueError, match=match):
      registry.cache_options(spec)


# ----------------------------------------------------------------------------------------------
# generate's sizing and checks (no program is compiled; tests/kvattn/caches/test_every_kind.py
# runs every policy through generate against the dense cache).


@pytest.fixture(scope="module")
def model():
  """What `generate` and the builders read before compiling: layers of K heads of H dims."""
  attn = types.SimpleNamespace(num_kv_heads=K, head_dim=H, window=None)
  return types.SimpleNamespace(layers=[types.SimpleNamespace(attn=attn)] * 2, vocab_size=256,
                               dtype=jnp.float32)


@pytest.fixture(scope="module")
def prompts():
  rng = np.random.default_rng(0)
  return rng.integers(0, 256, (2, 12), dtype=np.int32), np.array([12, 7], np.int32)


def test_generate_sizes_the_cache_to_the_kept_context_and_checks_context_lengths(model, prompts):
  tokens, lengths = prompts
  spec = {"kind": "knorm", "compress": "context", "compression_ratio": 0.5}
  built = []

  class Built(Exception):
    pass

  def recording(batch, max_len, dtype=None):
    built.append(max_len)
    raise Built  # stop before compiling anything

  factory = registry.cache_factory_from_config(model, spec)
  recording.spec = factory.spec
  with pytest.raises(Built):
    generate(model, tokens, lengths, 4, cache_factory=recording, context_lengths=[8, 6])
  with pytest.raises(Built):  # no context_lengths: the whole prompt is the context
    generate(model, tokens, lengths, 4, cache_factory=recording)
  assert built == [max(4 + 4 + 3, 3 + 1 + 3), max(6 + 3, 3 + 3)]  # kept + the rest + 4 - 1
  for bad, match in [([8, 8], r"context_lengths\[1\] = 8 must lie in \[0, prompt_lengths"),
                     ([8], r"context_lengths must have shape"),
                     ([-1, 0], r"context_lengths\[0\] = -1")]:
    with pytest.raises(ValueError, match=match):
      generate(model, tokens, lengths, 4, cache_factory=factory, context_lengths=bad)
  caches = factory(2, 9)
  with pytest.raises(ValueError, match=r"would overflow the cache: the kept context"):
    generate(model, tokens, lengths, 4, caches=caches, context_lengths=[8, 6])


def test_the_batcher_refuses_context_compression_by_name():
  from kvattn.inference.batching import options  # pylint: disable=g-import-not-at-top
  with pytest.raises(ValueError, match=r"cache.compress = 'context' is not supported by the "
                     r"ContinuousBatcher"):
    options.batcher_cache({"kind": "snapkv", "compress": "context", "compression_ratio": 0.5},
                          page_size=16, seed=None)
  assert options.batcher_cache({"kind": "snapkv", "budget": 8}, page_size=16, seed=None)[0] == \
      "snapkv"


def test_random_scores_depend_on_the_token_not_on_the_capacity_or_padding():
  # The same tokens among 3 or 6 stored slots and 2 or 4 new ones get the same scores.
  score = eviction.POLICY_TABLE["random"].score
  tokens = np.array([[[0, 2, 5], [1, 2, 4]]], np.int32)  # [B, K, 3]
  def scores(slots, width):
    pos = np.full((1, K, slots + width), -1, np.int32)
    pos[..., :3] = tokens
    pos[..., slots:slots + 2] = [7, 8]
    c = eviction.Candidates(pos=jnp.asarray(pos), k=None, k_scale=None, carried=None,
                            mass=None, end=jnp.full((1, 1, 1), 9, jnp.int32))
    out = np.asarray(score(c, {"seed": 3}))
    return np.concatenate([out[..., :3], out[..., slots:slots + 2]], -1)
  np.testing.assert_array_equal(scores(3, 2), scores(6, 4))
  assert len(np.unique(scores(3, 2))) == 2 * 5  # one draw per KV head and token


# ----------------------------------------------------------------------------------------------
# Through the other paths (slow: each compiles a model's prefill and decode loop).


@pytest.fixture(scope="module")
def tiny():
  from flax import nnx  # pylint: disable=g-import-not-at-top
  from kvattn.models import transformer  # pylint: disable=g-import-not-at-top
  cfg = transformer.model_config(d_model=32, num_layers=2, mlp_dim=64,
                                 attention=dict(num_heads=N, num_kv_heads=K, head_dim=H))
  return transformer.Transformer.from_config(cfg, rngs=nnx.Rngs(0))


@pytest.mark.slow  # the fast suite runs generate at ratio 0 in test_every_kind.py
def test_chat_with_compress_context_at_ratio_zero_equals_the_dense_cache(tiny, prompts):
  from experiments import chat  # pylint: disable=g-import-not-at-top
  tokens, lengths = prompts
  dense = chat.run(tiny, tokens, lengths, 5, cache="dense")
  got = chat.run(tiny, tokens, lengths, 5, cache="tova",
                 options={"compress": "context", "compression_ratio": 0.0})
  np.testing.assert_array_equal(got.tokens, dense.tokens)
  half = chat.run(tiny, tokens, lengths, 5, cache="tova",
                  options={"compress": "context", "compression_ratio": 0.5})
  assert half.cache_bytes < got.cache_bytes  # the kept prompt + the reply: 6 + 4 of 16 slots


@pytest.mark.slow  # save / restore and rollback of the fixed mode run in test_every_kind.py
def test_save_restore_and_speculative_decoding_keep_the_context_state(tiny, prompts, tmp_path):
  from kvattn.caches import checkpoint  # pylint: disable=g-import-not-at-top
  from kvattn.inference import speculative  # pylint: disable=g-import-not-at-top
  from kvattn.inference.generation import generate, prefill  # pylint: disable=g-import-not-at-top
  tokens, lengths = prompts
  tokens = tokens.copy()
  tokens[0, 8:12] = tokens[0, 4:8]  # prompt lookup drafts there
  spec = {"kind": "h2o", "compress": "context", "compression_ratio": 0.5}
  factory = registry.cache_factory_from_config(tiny, spec)
  context = np.array([8, 3], np.int32)
  _, caches, _ = prefill(tiny, tokens, lengths, factory(2, 24), context_lengths=context)
  checkpoint.save_caches(tmp_path / "ckpt", caches)
  restored, _, _ = checkpoint.restore_caches(tmp_path / "ckpt", factory(2, 24))
  for a, b in zip(jax.tree.leaves(caches), jax.tree.leaves(restored)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert np.asarray(restored[0].context_lengths).tolist() == [8, 3]
  bad = restored[0].replace(context_lengths=jnp.array([13, 3], jnp.int32))
  with pytest.raises(ValueError, match=r"context_lengths\[0\] = 13 must lie in"):
    bad.check_state()
  want, _ = generate(tiny, tokens, lengths, 12, cache_factory=factory, context_lengths=context)
  got, _ = generate(tiny, tokens, lengths, 12, cache_factory=factory, context_lengths=context,
                    speculative=speculative.PromptLookup(3, max_ngram_size=2))
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
