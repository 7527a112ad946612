"""The dense cache's decode step attends the cache from before the write plus the new token.

`KVCache.update_attend` at T == 1 on an XLA backend passes the new token's key and value
apart (`ops.decode_attention(..., k_new=, v_new=)`), so nothing reads the buffer the write
updates in place. Checked against the reference (write, then attend the written cache) and,
structurally, on the compiled decode loop: no copy of a cache-shaped buffer at batch 1.
"""

import importlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kvattn import KVCache, ops

from kvattn.models import transformer
from pallas_kernels import dense_decode

generate_lib = importlib.import_module("kvattn.inference.generation")

S, K, H = 16, 2, 8
# One row per edge: empty before the write, one token, one slot left, and (ops only) a row
# that had overflowed (its token dropped: it attends the cache alone).
OLD_LENGTHS = (0, 1, S - 1)


def _old_cache(old_lengths, dtype=jnp.float32, seed=0):
  """A cache holding `old_lengths` tokens, NaN in every unused slot (the new token's included)."""
  batch = len(old_lengths)
  keys = jax.random.split(jax.random.key(seed), 2)
  k, v = (jax.random.normal(key, (batch, K, S, H)) for key in keys)
  used = (jnp.arange(S)[None, :] < jnp.asarray(old_lengths)[:, None])[:, None, :, None]
  c = KVCache.init(batch, S, K, H, dtype)
  if c.quantized:
    c = c.update(k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), jnp.asarray(old_lengths))
    nan = jnp.asarray(jnp.nan, jnp.float32)
    return c.replace(k_scale=jnp.where(used[..., 0], c.k_scale, nan),
                     v_scale=jnp.where(used[..., 0], c.v_scale, nan))
  return c.replace(k=jnp.where(used, k, jnp.nan).astype(dtype),
                   v=jnp.where(used, v, jnp.nan).astype(dtype),
                   lengths=jnp.asarray(old_lengths, jnp.int32))


def _qkv(batch, num_heads, seed=1):
  keys = jax.random.split(jax.random.key(seed), 3)
  return (jax.random.normal(keys[0], (batch, 1, num_heads, H)),
          jax.random.normal(keys[1], (batch, 1, K, H)),
          jax.random.normal(keys[2], (batch, 1, K, H)))


def _reference(cache, q, k, v, **options):
  """RoPE, write, then the f32 reference over the written cache: `([B, 1, N, H], cache)`."""
  positions = cache.lengths[:, None]
  q, k = ops.apply_rope(q, positions, rope_theta=1e4), ops.apply_rope(k, positions, rope_theta=1e4)
  written = cache.update(k, v)
  kd, vd = written.dequantized(jnp.float32)
  out = dense_decode.decode_attention_reference(q[:, 0], kd, vd, written.lengths, **options)
  return out[:, None], written


@pytest.mark.parametrize("implementation", ["xla", "xla_blocked"])
@pytest.mark.parametrize("num_heads", [K, 3 * K], ids=["G1", "G3"])
@pytest.mark.parametrize("options", [{}, {"window": 3, "soft_cap": 2.0}], ids=["full", "window"])
def test_update_attend_equals_reference(implementation, num_heads, options):
  cache = _old_cache(OLD_LENGTHS)
  q, k, v = _qkv(len(OLD_LENGTHS), num_heads)
  assert ops.dispatch.appends_newest(implementation)
  out, new_cache = jax.jit(lambda c, q, k, v: c.update_attend(
      q, k, v, positions=c.lengths[:, None], rope_theta=1e4, new_lengths=None,
      implementation=implementation, **options))(cache, q, k, v)
  want, written = _reference(cache, q, k, v, **options)
  np.testing.assert_allclose(np.asarray(out), np.asarray(want), atol=1e-5, rtol=1e-5)
  np.testing.assert_array_equal(np.asarray(new_cache.lengths), np.asarray(written.lengths))
  for got, ref in ((new_cache.k, written.k), (new_cache.v, written.v)):  # same slots written
    # (jitted RoPE vs eager: an ulp apart; NaN stays where nothing was written)
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.int8])
def test_update_attend_low_precision_cache(dtype):
  """The new token enters as the cache stores it (rounded, or quantized and dequantized)."""
  cache = _old_cache(OLD_LENGTHS, dtype)
  q, k, v = _qkv(len(OLD_LENGTHS), 2 * K)
  out, _ = cache.update_attend(q, k, v, positions=cache.lengths[:, None], rope_theta=1e4,
                               new_lengths=None, implementation="xla")
  want, _ = _reference(cache, q, k, v)
  np.testing.assert_allclose(np.asarray(out), np.asarray(want), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("implementation", ["xla", "xla_blocked"])
def test_decode_attention_new_token_apart(implementation):
  """ops level: the cache before the write (NaN at the new slot) plus `k_new, v_new` equals
  the reference over the written cache; under jit an overflowed row (lengths S + 1) attends
  the cache (eager, such a length is refused)."""
  old = (0, 1, S - 1, S)
  cache = _old_cache(old)
  cache = cache.replace(k=cache.k.at[3].set(1.0), v=cache.v.at[3].set(2.0))  # row 3 is full
  q = jax.random.normal(jax.random.key(2), (len(old), 3 * K, H))
  _, k_new, v_new = (x[:, 0] for x in _qkv(len(old), K, seed=3))
  lengths = jnp.asarray(old) + 1
  decode = lambda lengths: ops.decode_attention(q, cache.k, cache.v, lengths, k_new=k_new,
                                                v_new=v_new, implementation=implementation)
  with pytest.raises(ValueError, match=rf"lengths\[3\] = {S + 1} must lie in \[0, {S}\]"):
    decode(lengths)
  got = jax.jit(decode)(lengths)
  written = jax.jit(KVCache.update)(cache, k_new[:, None], v_new[:, None])  # row 3: dropped
  want = dense_decode.decode_attention_reference(q, written.k, written.v, lengths)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5)


def test_decode_attention_new_token_validation():
  cache = _old_cache((1,))
  q = jnp.zeros((1, K, H))
  with pytest.raises(ValueError, match="k_new and v_new must be given together"):
    ops.decode_attention(q, cache.k, cache.v, cache.lengths, k_new=jnp.zeros((1, K, H)))
  with pytest.raises(ValueError, match=r"k_new must have shape \[B, K, K\]"):
    ops.decode_attention(q, cache.k, cache.v, cache.lengths, k_new=jnp.zeros((1, K, 1)),
                         v_new=jnp.zeros((1, K, H)))
  with pytest.raises(NotImplementedError, match="pallas"):  # the kernel reads the cache
    ops.decode_attention(q, cache.k, cache.v, cache.lengths, k_new=jnp.zeros((1, K, H)),
                         v_new=jnp.zeros((1, K, H)), implementation="pallas")


def test_the_dispatcher_says_which_requests_append_the_newest_token(monkeypatch):
  appends = ops.dispatch.appends_newest
  assert appends("xla") and appends(("xla_blocked", "xla"))
  assert not appends("pallas") and not appends(("pallas", "xla"))
  assert appends(None) == (jax.default_backend() == "cpu")  # "pallas" runs on GPU / TPU
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  assert not appends(None)
  monkeypatch.undo()
  with pytest.raises(ValueError, match="implementation must be one of"):
    appends("cuda")
  # A backend from outside kvattn declares whether it takes the token apart.
  monkeypatch.setitem(ops.dispatch.IMPLEMENTATIONS, "decode_attention",
                      dict(ops.dispatch.IMPLEMENTATIONS["decode_attention"]))
  monkeypatch.setitem(ops.dispatch.APPENDS_NEWEST, "decode_attention",
                      set(ops.dispatch.APPENDS_NEWEST["decode_attention"]))
  ran = []
  mine = lambda *args, explicit, **options: ran.append(sorted(options)) or args[0]
  ops.register_implementation("decode_attention", "mine", mine)
  assert not appends(None) and not appends("mine")
  cache = _old_cache((1,))
  q, new = jnp.zeros((1, K, H)), jnp.zeros((1, K, H))
  with pytest.raises(NotImplementedError, match="mine reads the newest token from the cache"):
    ops.decode_attention(q, cache.k, cache.v, cache.lengths + 1, k_new=new, v_new=new,
                         implementation="mine")
  ops.register_implementation("decode_attention", "mine", mine, preferred=True,
                              appends_newest=True)
  assert appends("mine") and appends(None) == (jax.default_backend() == "cpu")
  ops.decode_attention(q, cache.k, cache.v, cache.lengths + 1, k_new=new, v_new=new)
  assert ran == [["k_new", "sm_scale", "soft_cap", "v_new", "window"]]


def test_a_decode_step_with_the_token_apart_tries_only_the_backends_that_take_it(monkeypatch):
  """`implementation=None` on CPU: the step's request goes to "xla_blocked" / "xla", and
  "pallas" (which reads the token from the cache) is not called at all."""
  called = []
  pallas_decode = ops.dispatch.IMPLEMENTATIONS["decode_attention"]["pallas"]
  monkeypatch.setitem(ops.dispatch.IMPLEMENTATIONS, "decode_attention",
                      dict(ops.dispatch.IMPLEMENTATIONS["decode_attention"],
                           pallas=lambda *a, **kw: called.append(1) or pallas_decode(*a, **kw)))
  cache = _old_cache(OLD_LENGTHS)
  q, k, v = _qkv(len(OLD_LENGTHS), K)
  out, _ = cache.update_attend(q, k, v, positions=cache.lengths[:, None], rope_theta=1e4,
                               new_lengths=None)
  want, _ = _reference(cache, q, k, v)
  np.testing.assert_allclose(np.asarray(out), np.asarray(want), atol=1e-5, rtol=1e-5)
  assert not called


def _cache_copies(decode_implementation, batch, capacity):
  """`(copies of a cache-shaped buffer, cache shape)` in the compiled decode loop of a tiny
  2-layer GQA model."""
  cfg = transformer.model_config(
      d_model=32, num_layers=2, mlp_dim=64, vocab_size=64,
      attention=dict(kind="gqa", num_heads=6, num_kv_heads=2, head_dim=8,
                     decode_implementation=decode_implementation))
  model = transformer.Transformer.from_config(cfg, rngs=nnx.Rngs(0))
  caches = tuple(model.init_caches(batch, capacity))
  graphdef, state = nnx.split(model)
  text = generate_lib._decode.lower(  # pylint: disable=protected-access
      graphdef, state, caches, jnp.zeros((batch,), jnp.int32), jax.random.key(0),
      sampling=generate_lib.Sampling(), max_new_tokens=4, eos_id=None,
      pad_id=np.int32(0)).compile().as_text()
  shape = "f32[%s]" % ",".join(map(str, caches[0].k.shape))
  copies = re.findall(r"= (f32\[[0-9,]+\])\{[^}]*\} copy\(", text)
  return sum(c == shape for c in copies), shape


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="an XLA:CPU layout finding")
@pytest.mark.parametrize("decode_implementation,capacity", [(None, 64), ("xla_blocked", 320)])
def test_batch1_decode_loop_copies_no_cache(decode_implementation, capacity):
  """The batch-1 decode loop updates the caches in place: no copy of `[1, K, S, H]`.

  (Attending the written cache, XLA:CPU fused the write twice at batch 1 and copied each
  layer's K and V four times per step on the plain path; docs/benchmarks.md.)
  """
  copies, shape = _cache_copies(decode_implementation, 1, capacity)
  assert copies == 0, f"{copies} copies of {shape} in the decode loop"
