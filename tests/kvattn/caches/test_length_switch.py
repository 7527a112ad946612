"""kvattn.caches.length_switch: K KV heads up to `switch_length` tokens, mean-pooled heads after."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import kvattn
from kvattn import memory, ops
from kvattn.caches import registry as cache_factories
from kvattn.models import convert
from kvattn.models import transformer as transformer_lib
from kvattn.caches.dense import KVCache
from kvattn.caches.length_switch import LengthSwitchKVCache, pool_heads

V = 64


def _model(num_heads=4, num_kv_heads=2, head_dim=8, num_layers=1, seed=0):
  cfg = transformer_lib.model_config(
      vocab_size=V, d_model=32, num_layers=num_layers, mlp_dim=64,
      attention=dict(num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                     rope_theta=100.0))
  return transformer_lib.Transformer.from_config(cfg, rngs=nnx.Rngs(seed))


@pytest.fixture(scope="module")
def model():
  return _model()


@pytest.fixture(scope="module")
def step(model):
  """The jitted forward `(caches, tokens, new_lengths) -> (logits, caches)` all tests share."""
  return jax.jit(lambda c, t, n: model(t, caches=c, new_lengths=n))


def _switch_caches(model, batch, max_len, switch_length, after=1, dtype=jnp.float32):
  return model.init_caches(batch, max_len, dtype, cache={
      "kind": "length_switch", "switch_length": switch_length, "num_kv_heads_after": after})


def _decode(model, caches, tokens, step=None):
  """Feeds `tokens [B, T]` one at a time (eager without `step`); returns (logits [B, T, V],
  caches)."""
  step = step or (lambda c, t, n: model(t, caches=c, new_lengths=n))
  out = []
  ones = jnp.ones((tokens.shape[0],), jnp.int32)
  for t in range(tokens.shape[1]):
    logits, caches = step(caches, tokens[:, t:t + 1], ones)
    out.append(np.asarray(logits[:, 0]))
  return np.stack(out, axis=1), caches


TOKENS = jax.random.randint(jax.random.key(1), (2, 9), 0, V)


def test_before_the_switch_outputs_equal_the_dense_cache_exactly(model, step, monkeypatch):
  """Bit for bit (jitted, the phase chosen by lax.switch) against a dense cache of
  switch_length slots that writes, then attends (the same reductions; against another
  capacity the sums are ordered differently: 1e-6). The dense cache's own decode step
  attends the new token apart from the cache (`KVCache.update_attend`): the same softmax
  summed in another order, 1e-6."""
  sl = 3
  switch, caches = _decode(model, _switch_caches(model, 2, 9, sl), TOKENS, step)
  dense, _ = _decode(model, model.init_caches(2, sl), TOKENS[:, :sl], step)
  np.testing.assert_allclose(switch[:, :sl], dense, atol=1e-6, rtol=0)
  monkeypatch.setattr(kvattn.ops.dispatch, "appends_newest", lambda implementation: False)
  write_then_attend = jax.jit(lambda c, t, n: model(t, caches=c, new_lengths=n))
  dense, _ = _decode(model, model.init_caches(2, sl), TOKENS[:, :sl], write_then_attend)
  np.testing.assert_array_equal(switch[:, :sl], dense)
  monkeypatch.undo()
  # Past the switch the outputs change (the pooled heads are an approximation).
  dense, _ = _decode(model, model.init_caches(2, 9), TOKENS, step)
  np.testing.assert_allclose(switch[:, :sl], dense[:, :sl], atol=1e-6, rtol=0)
  assert np.max(np.abs(switch[:, sl:] - dense[:, sl:])) > 1e-3
  assert np.all(np.asarray(caches[0].switched))


def test_after_the_switch_outputs_equal_the_regrouped_model_fed_the_pooled_cache(model, step):
  sl, n = 4, TOKENS.shape[1]
  switch, caches = _decode(model, _switch_caches(model, 2, n, sl), TOKENS, step)
  # Reference: the dense cache over the first sl tokens, pooled (mean of each group of the
  # cached K and V) into a K' = 1 cache that the regrouped model (mean-pooled K/V
  # projections, kvattn.models.convert) continues from.
  _, dense = _decode(model, model.init_caches(2, n), TOKENS[:, :sl], step)
  pooled = []
  for c in dense:
    k, v = (jnp.zeros((2, 1, n, 8)).at[:, :, :sl].set(pool_heads(x[:, :, :sl], 1, 1))
            for x in (c.k, c.v))
    pooled.append(KVCache(k, v, c.lengths))
  regrouped = convert.regroup_kv_heads(model, 1)
  ref, _ = _decode(regrouped, tuple(pooled), TOKENS[:, sl:],
                   jax.jit(lambda c, t, n: regrouped(t, caches=c, new_lengths=n)))
  np.testing.assert_allclose(switch[:, sl:], ref, atol=1e-5, rtol=0)
  # The pooled segment's first sl slots are the group means of the full segment.
  for c in caches:
    np.testing.assert_array_equal(np.asarray(c.k_pooled[:, :, :sl]),
                                  np.asarray(pool_heads(c.k, 1, 1)))
    np.testing.assert_array_equal(np.asarray(c.v_pooled[:, :, :sl]),
                                  np.asarray(pool_heads(c.v, 1, 1)))


def test_two_head_toy_after_the_switch_matches_a_hand_computation():
  """N = K = 2 heads pooled to 1 at switch_length 2: the third token's output by hand."""
  attn = kvattn.GroupedQueryAttention(d_model=6, num_heads=2, num_kv_heads=2, head_dim=4,
                                      rope_theta=100.0, rngs=nnx.Rngs(3))
  x = np.asarray(jax.random.normal(jax.random.key(4), (1, 3, 6)), np.float32)
  cache = LengthSwitchKVCache.init(1, 3, 2, 4, switch_length=2, num_kv_heads_after=1)
  step = jax.jit(lambda c, x: attn(x, cache=c))
  for t in range(3):
    y, cache = step(cache, jnp.asarray(x[:, t:t + 1]))
  wq, wk, wv, wo = (np.asarray(p[...]) for p in (attn.q_proj, attn.k_proj, attn.v_proj,
                                                 attn.o_proj))
  pos = jnp.arange(3)[None]
  rope = lambda a: np.asarray(ops.apply_rope(jnp.asarray(a)[None], pos, rope_theta=100.0))[0]
  q = rope(np.einsum("td,dnh->tnh", x[0], wq))[2]  # [N, H], token 2
  k = rope(np.einsum("td,dkh->tkh", x[0], wk))  # [T, K, H]
  v = np.einsum("td,dkh->tkh", x[0], wv)
  k1, v1 = (k[:, 0] + k[:, 1]) / 2, (v[:, 0] + v[:, 1]) / 2  # the one pooled head, [T, H]
  out = np.zeros((2, 4))
  for n in range(2):  # both query heads read the pooled head
    s = k1 @ q[n] / 2.0
    p = np.exp(s - s.max())
    out[n] = (p / p.sum()) @ v1
  want = np.einsum("nh,nhd->d", out, wo)
  np.testing.assert_allclose(np.asarray(y[0, 0]), want, atol=1e-5, rtol=0)


def test_sequences_of_one_batch_switch_at_their_own_lengths(model, step):
  """Right-padded prefill of 3 and 6 tokens (switch_length 4), then 4 decode steps: row 0
  switches during decode, row 1 at prefill; each row equals its own run alone."""
  sl, lengths = 4, np.array([3, 6], np.int32)
  toks = np.asarray(TOKENS)
  prompt = np.where(np.arange(6)[None] < lengths[:, None], toks[:, :6], 0).astype(np.int32)
  logits, caches = step(_switch_caches(model, 2, 10, sl), jnp.asarray(prompt), lengths)
  np.testing.assert_array_equal(np.asarray(caches[0].switched), [False, True])
  nxt = np.stack([toks[0, 3:7], toks[1, 5:9]])
  got, caches = _decode(model, caches, jnp.asarray(nxt), step)
  np.testing.assert_array_equal(np.asarray(caches[0].lengths), [7, 10])
  np.testing.assert_array_equal(np.asarray(caches[0].switched), [True, True])
  for b in range(2):  # each row alone, token by token (batch 1)
    seq = np.concatenate([prompt[b, :lengths[b]], nxt[b]])[None]
    alone, _ = _decode(model, _switch_caches(model, 1, 10, sl), jnp.asarray(seq), step)
    np.testing.assert_allclose(np.asarray(logits[b, :lengths[b]]), alone[0, :lengths[b]],
                               atol=1e-5, rtol=0)
    np.testing.assert_allclose(got[b], alone[0, lengths[b]:], atol=1e-5, rtol=0)


@pytest.mark.parametrize("chunk", [3, pytest.param(9, marks=pytest.mark.slow)])
def test_chunks_crossing_the_switch_and_nan_in_unused_slots(model, step, chunk):
  """Prefill in chunks (the switch inside a chunk) equals token-by-token decode, with NaN in
  every slot no token was written to."""
  sl = 4
  ref, _ = _decode(model, _switch_caches(model, 2, 9, sl), TOKENS, step)
  caches = tuple(c.replace(**{f: jnp.full_like(getattr(c, f), jnp.nan)
                              for f in ("k", "v", "k_pooled", "v_pooled")})
                 for c in _switch_caches(model, 2, 9, sl))
  out = []
  for s in range(0, 9, chunk):
    logits, caches = step(caches, TOKENS[:, s:s + chunk], jnp.full((2,), chunk, jnp.int32))
    out.append(np.asarray(logits))
  np.testing.assert_allclose(np.concatenate(out, axis=1), ref, atol=1e-5, rtol=0)


@pytest.mark.slow  # two more compilations (int8 caches)
def test_int8_storage_before_the_switch_equals_the_dense_int8_cache(model, step):
  dense, _ = _decode(model, model.init_caches(2, 9, jnp.int8), TOKENS, step)
  switch, caches = _decode(model, _switch_caches(model, 2, 9, 4, dtype=jnp.int8), TOKENS, step)
  np.testing.assert_allclose(switch[:, :4], dense[:, :4], atol=1e-6, rtol=0)
  assert np.all(np.isfinite(switch))
  assert caches[0].k_pooled_scale.shape == (2, 1, 9)


@pytest.mark.parametrize("dtype,scale", [(jnp.float32, 0), (jnp.bfloat16, 0), (jnp.int8, 4)])
def test_bytes_equal_the_two_segment_formula(dtype, scale):
  B, S, K, Kp, H, sl = 3, 40, 4, 2, 16, 12
  cache = LengthSwitchKVCache.init(B, S, K, H, dtype, switch_length=sl, num_kv_heads_after=Kp)
  measured = sum(a.nbytes for a in cache.storage_arrays())
  formula = B * (K * sl + Kp * S) * 2 * (H * jnp.dtype(dtype).itemsize + scale)
  assert measured == formula == cache.storage_bytes()
  assert memory.measured_bytes_per_token(cache) == formula / (B * S)
  # A switch length at or past the capacity: the sequences never switch, S full slots.
  never = LengthSwitchKVCache.init(B, S, K, H, dtype, switch_length=S + 5, num_kv_heads_after=Kp)
  assert never.switch_length == S


def _bytes_accessed(fn, *args) -> float:
  cost = jax.jit(fn).lower(*args).compile().cost_analysis()
  return float((cost[0] if isinstance(cost, (list, tuple)) else cost)["bytes accessed"])


def test_the_post_switch_step_reads_only_the_pooled_segment():
  """XLA's cost analysis of the step every row runs once all have switched (write the token,
  attend the pooled segment) stays flat as the full segment grows; the mixed step's grows by
  at least the full segment. (The whole step's `lax.switch` is costed as its dearest branch,
  so each branch is compiled alone; the next test checks which one runs.)"""
  B, S, K, H = 2, 512, 4, 32
  q = jnp.ones((B, 1, 8, H))
  kv = jnp.ones((B, 1, K, H))

  def costs(switch_length):
    cache = LengthSwitchKVCache.init(B, S, K, H, switch_length=switch_length,
                                     num_kv_heads_after=1)
    cache = cache.replace(lengths=jnp.full((B,), S - 1, jnp.int32))

    def step(branch):
      def fn(c, q, k, v):
        new = c.update(k, v)
        return getattr(new, branch)(q, c.lengths)
      return _bytes_accessed(fn, cache, q, kv, kv)

    return step("attend_pooled"), step("attend_mixed")

  pooled_small, mixed_small = costs(16)
  pooled_big, mixed_big = costs(256)
  assert pooled_big == pooled_small
  full_growth = 2 * B * K * (256 - 16) * H * 4  # k and v of the extra full slots, bytes
  assert mixed_big - mixed_small >= full_growth


def test_jitted_steps_take_the_branch_of_their_phase_and_never_recompile(model, monkeypatch):
  calls = []
  for name in ("attend_full", "attend_pooled", "attend_mixed"):
    original = getattr(LengthSwitchKVCache, name)

    def counted(self, q, q_offsets, _name=name, _original=original, **opts):
      jax.debug.callback(lambda: calls.append(_name))
      return _original(self, q, q_offsets, **opts)

    monkeypatch.setattr(LengthSwitchKVCache, name, counted)

  @jax.jit
  @chex.assert_max_traces(n=1)
  def step(caches, tokens, new_lengths):
    return model(tokens, caches=caches, new_lengths=new_lengths)

  caches = _switch_caches(model, 2, 9, 3)
  phases = []
  for t, new in enumerate([[1, 1], [1, 1], [1, 0], [1, 1], [1, 1], [1, 1]]):
    calls.clear()
    _, caches = step(caches, TOKENS[:, t:t + 1], jnp.asarray(new, jnp.int32))
    jax.effects_barrier()
    assert len(set(calls)) == 1 and len(calls) == len(model.layers)
    phases.append(calls[0])
  # Lengths after each step: 1,1 2,2 3,2 4,3 5,4 6,5 (switch_length 3): the queries at
  # tokens 3 and 2 read pooled and full heads; then every row's token is >= 3.
  assert phases == ["attend_full"] * 3 + ["attend_mixed"] + ["attend_pooled"] * 2
  assert step._cache_size() == 1  # pylint: disable=protected-access  (one compilation)


@pytest.mark.slow  # ~4 s of CPU: generate compiles its prefill and decode loop
def test_generate_through_the_cache_kind_switch(model, step):
  """`generate` (one compiled decode loop) with `cache.kind = "length_switch"`: the greedy
  tokens of the step-by-step loop through the same caches (switch inside the decode)."""
  prompts = np.asarray(TOKENS[:, :4])
  lengths = np.array([4, 2], np.int32)
  factory = cache_factories.cache_factory_from_config(
      model, {"kind": "length_switch", "switch_length": 3, "num_kv_heads_after": 1})
  tokens, _ = kvattn.generate(model, prompts, lengths, 4, cache_factory=factory)
  logits, caches = step(_switch_caches(model, 2, 7, 3), jnp.asarray(prompts), lengths)
  want = [np.argmax(np.asarray(logits)[np.arange(2), lengths - 1], axis=-1)]
  for _ in range(3):
    logits, caches = step(caches, jnp.asarray(want[-1][:, None], jnp.int32),
                          jnp.ones((2,), jnp.int32))
    want.append(np.argmax(np.asarray(logits[:, 0]), axis=-1))
  np.testing.assert_array_equal(np.asarray(tokens), np.stack(want, axis=1))


@pytest.mark.parametrize("kwargs,match", [
    (dict(num_kv_heads_after=3), "num_kv_heads_after must be a positive int dividing"),
    (dict(num_kv_heads_after=0), "num_kv_heads_after"),
    (dict(num_kv_heads_after=8), "num_kv_heads_after"),
    (dict(switch_length=0), "switch_length must be a positive int"),
    (dict(switch_length=-4), "switch_length"),
    (dict(switch_length=True), "switch_length"),
])
def test_bad_settings_raise_value_error(model, kwargs, match):
  settings = dict(switch_length=4, num_kv_heads_after=2) | kwargs
  with pytest.raises(ValueError, match=match):
    LengthSwitchKVCache.init(1, 8, 4, 8, **settings)
  with pytest.raises(ValueError, match=match):  # the model's K is 2
    cache_factories.cache_factory_from_config(model, {"kind": "length_switch", **settings})
  with pytest.raises(ValueError, match=match):
    _switch_caches(model, 1, 8, settings["switch_length"], settings["num_kv_heads_after"])


def test_a_write_past_the_capacity_raises_before_writing():
  cache = LengthSwitchKVCache.init(1, 4, 2, 8, switch_length=2, num_kv_heads_after=1)
  kv = jnp.ones((1, 5, 2, 8))
  with pytest.raises(ValueError, match="cache overflow"):
    cache.update(kv, kv)
  with pytest.raises(ValueError, match=r"k_new must have shape \[B, T, K, H\]"):
    cache.update(jnp.ones((1, 1, 1, 8)), jnp.ones((1, 1, 1, 8)))
