"""KIVI cache (kvattn/caches/kivi.py) and its ops (kvattn/ops/lowbit.py).

  * the ops on hand-computed cases: packing, asymmetric group quantization;
  * the cache's stored state equals a numpy KIVI reference (groups flushed behind the
    residual, per-channel keys, per-token values), whatever the chunking;
  * attention (`update_attend`, `attend`) equals the plain reference over the dequantized
    cache, lengths 0, 1, group +- 1, residual + group, capacity, several store blocks with the
    last shifted back, window and soft cap; NaN / garbage in unused slots changes nothing;
  * keys before RoPE (KVQuant) equal the reference with keys rotated at their tokens;
  * the compiled decode loop holds no dequantized copy of the store;
  * bytes: the issue's goals at SmolLM2's shapes and 4k tokens.
(The conformance suite, tests/kvattn/caches/test_every_kind.py, runs kivi2 / kivi4 through
the protocol's invariants: dense parity with room, donation, save / restore, bytes.)
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kvattn import memory
from kvattn.caches import _residual
from kvattn.caches import registry
from kvattn.caches.kivi import KIVICache
from kvattn.models import transformer
from kvattn.ops import apply_rope, lowbit

B, K, H, N = 6, 2, 8, 4
# Eager calls dispatch op by op (slow on CPU): the tests call these compiled.
_update = jax.jit(KIVICache.update)
_dequantized = jax.jit(KIVICache.dequantized, static_argnums=1)
_attend = jax.jit(KIVICache.attend, static_argnames=("sm_scale", "window", "soft_cap",
                                                     "implementation"))


# ------------------------------------------------------------------------------ ops

def test_pack_codes_hand_computed():
  codes = jnp.asarray([[1, 2, 3, 0, 3, 3, 0, 1]], jnp.uint8)
  np.testing.assert_array_equal(lowbit.pack_codes(codes, 2), [[1 | 2 << 2 | 3 << 4, 3 | 3 << 2 | 1 << 6]])
  np.testing.assert_array_equal(lowbit.pack_codes(codes, 4), [[1 | 2 << 4, 3, 3 | 3 << 4, 1 << 4]])
  rng = np.random.default_rng(0)
  for bits in (2, 4):
    c = jnp.asarray(rng.integers(0, 1 << bits, (3, 5, 16)), jnp.uint8)
    packed = lowbit.pack_codes(c, bits)
    assert packed.shape == (3, 5, 16 * bits // 8) and packed.dtype == jnp.uint8
    np.testing.assert_array_equal(lowbit.unpack_codes(packed, bits), c)
  with pytest.raises(ValueError, match="bits must be one of"):
    lowbit.pack_codes(codes, 5)
  with pytest.raises(ValueError, match=r"width must be a multiple of 8 // bits = 4"):
    lowbit.pack_codes(codes[:, :6], 2)


def test_quantize_groups_hand_computed():
  x = jnp.asarray([[0.0, 1.0, 2.0, 3.0], [5.0, 5.0, 5.0, 5.0], [1.0, np.nan, 0.0, 0.0],
                   [-1.0, 0.0, 0.5, 1.0]])
  codes, scale, zero = lowbit.quantize_groups(x, 2, axis=1, scale_dtype=jnp.float32)
  np.testing.assert_array_equal(codes[0], [0, 1, 2, 3])
  np.testing.assert_array_equal(codes[1], [0, 0, 0, 0])  # constant: scale 0, exact
  np.testing.assert_array_equal(codes[3], [0, 2, 2, 3])  # steps of 2/3: 0.5 -> 2.25 -> 2
  np.testing.assert_allclose(scale, [1.0, 0.0, np.nan, 2 / 3], rtol=1e-7)
  np.testing.assert_allclose(zero, [0.0, 5.0, np.nan, -1.0])
  back = lowbit.dequantize_groups(codes, scale, zero, axis=1)
  np.testing.assert_array_equal(back[1], 5.0)
  assert np.isnan(back[2]).all()  # a NaN group dequantizes to NaN, never a plausible vector
  # 4 bits, f16 scales: error at most half a step of the rounded scale.
  y = jax.random.normal(jax.random.key(0), (64, 32)) * 3
  c4, s4, z4 = lowbit.quantize_groups(y, 4, axis=0)
  assert s4.dtype == jnp.float16 and c4.max() <= 15
  err = jnp.abs(lowbit.dequantize_groups(c4, s4, z4, axis=0) - y)
  assert bool(jnp.all(err <= s4.astype(jnp.float32)[None] * 0.5 + 1e-5))


# ------------------------------------------------------------------------------ numpy reference

def _f16(x):
  return np.asarray(x, np.float32).astype(np.float16).astype(np.float32)


def _quant_np(x, bits, axis):
  """numpy KIVI quantize-dequantize (f16 scale and zero point) along `axis`."""
  top = (1 << bits) - 1
  lo = _f16(x.min(axis=axis, keepdims=True))
  scale = _f16((x.max(axis=axis, keepdims=True) - lo) / top)
  codes = np.where(scale > 0, np.round((x - lo) / np.where(scale > 0, scale, 1)), 0)
  return np.clip(codes, 0, top) * scale + lo


def _reference_state(tokens_k, tokens_v, bits, group_size, residual):
  """Dequantized `[K, L, H]` keys and values of one sequence of tokens `[L, K, H]` under KIVI:
  groups `[j g, (j + 1) g)` below `nq = g * max(0, (L - R) // g)` quantized (keys per channel
  over the group, values per token over `min(g, H)` channels), the rest exact."""
  length = tokens_k.shape[0]
  g = group_size
  nq = g * max(0, (length - residual) // g)
  k = tokens_k.transpose(1, 0, 2).astype(np.float32).copy()
  v = tokens_v.transpose(1, 0, 2).astype(np.float32).copy()
  vg = min(g, k.shape[-1])
  for j in range(nq // g):
    k[:, j * g:(j + 1) * g] = _quant_np(k[:, j * g:(j + 1) * g], bits, axis=1)
  shape = v[:, :nq].shape
  if nq:
    v[:, :nq] = _quant_np(v[:, :nq].reshape(shape[:2] + (-1, vg)), bits, axis=3).reshape(shape)
  return k, v


def _chunks(seed, lengths, chunking):
  """Random tokens for rows of `lengths`, and the `(k, v, new_lengths)` chunks of `chunking`
  (chunk sizes; a row takes min(size, what it has left))."""
  rng = np.random.default_rng(seed)
  total = max(lengths)
  k = rng.standard_normal((len(lengths), total, K, H)).astype(np.float32)
  v = rng.standard_normal((len(lengths), total, K, H)).astype(np.float32)
  k[:, :, 1, 3] *= 8.0  # an outlier channel, where per-channel keys matter
  out, done = [], np.zeros(len(lengths), int)
  for size in chunking:
    new = np.minimum(size, np.asarray(lengths) - done)
    ck = np.zeros((len(lengths), size, K, H), np.float32)
    cv = np.zeros_like(ck)
    for b in range(len(lengths)):
      ck[b, :new[b]] = k[b, done[b]:done[b] + new[b]]
      cv[b, :new[b]] = v[b, done[b]:done[b] + new[b]]
    out.append((jnp.asarray(ck), jnp.asarray(cv), jnp.asarray(new, jnp.int32)))
    done += new
  assert list(done) == list(lengths)
  return k, v, out


CASES = [  # (bits, group_size, residual, capacity)
    (2, 4, 8, 40),
    pytest.param(4, 4, 0, 37, marks=pytest.mark.slow),  # fast: the case above; the
    pytest.param(4, 8, 8, 41, marks=pytest.mark.slow),  # conformance suite runs R = 0
]
LENGTHS = (0, 1, 3, 4, 5, 13)  # 0, 1, g - 1, g, g + 1, R + g + 1 (g = 4, R = 8)


@pytest.mark.parametrize("bits,group_size,residual,capacity", CASES)
def test_stored_state_equals_the_numpy_reference_for_any_chunking(bits, group_size, residual,
                                                                   capacity):
  lengths = LENGTHS[:-1] + (capacity,)  # the last row fills the cache
  k, v, chunks = _chunks(0, lengths, (7, 1, 1, 20, 3, capacity))
  _, _, whole = _chunks(0, lengths, (capacity,))
  cache = KIVICache.init(len(lengths), capacity, K, H, bits=bits, group_size=group_size,
                         residual=residual)
  write = jax.jit(KIVICache.update)
  by_chunks = cache
  for ck, cv, nl in chunks:
    by_chunks = write(by_chunks, ck, cv, nl)
  at_once = _update(cache, *whole[0])
  np.testing.assert_array_equal(by_chunks.lengths, lengths)
  for a, b in zip(_dequantized(by_chunks), _dequantized(at_once)):  # chunking changes nothing
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  kd, vd = (np.asarray(x) for x in _dequantized(by_chunks))
  for b, length in enumerate(lengths):
    rk, rv = _reference_state(k[b, :length], v[b, :length], bits, group_size, residual)
    np.testing.assert_allclose(kd[b, :, :length], rk, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(vd[b, :, :length], rv, atol=1e-5, rtol=1e-5)
    np.testing.assert_array_equal(kd[b, :, length:], 0.0)
  nq = np.asarray(by_chunks.num_quantized)
  assert list(nq) == [group_size * max(0, (n - residual) // group_size) for n in lengths]
  ring = np.asarray(by_chunks.ring_tokens())
  for b, length in enumerate(lengths):  # the store then the ring hold every token once
    held = list(range(nq[b])) + ring[b][ring[b] >= 0].tolist()
    assert sorted(held) == list(range(length))


# ------------------------------------------------------------------------------ attention

def _poison(cache):
  """Every unused slot of the store and the ring replaced by garbage: NaN scales / zero
  points / residual rows, codes 0xFF."""
  nq = cache.num_quantized
  g = cache.group_size
  s = jnp.arange(cache.store_capacity)[None, :]
  used = s < nq[:, None]  # [B, Sq]
  used_g = (jnp.arange(cache.store_capacity // g)[None, :] * g) < nq[:, None]
  ring_used = cache.ring_tokens() >= 0
  nan = lambda x, u: jnp.where(u[:, None, :, None], x, jnp.asarray(jnp.nan, x.dtype))
  return cache.replace(
      k_codes=jnp.where(used[:, None, :, None], cache.k_codes, jnp.uint8(255)),
      v_codes=jnp.where(used[:, None, :, None], cache.v_codes, jnp.uint8(255)),
      k_scale=nan(cache.k_scale, used_g), k_zero=nan(cache.k_zero, used_g),
      v_scale=nan(cache.v_scale, used), v_zero=nan(cache.v_zero, used),
      k_res=nan(cache.k_res, ring_used), v_res=nan(cache.v_res, ring_used))


def _filled(lengths, capacity, seed=0, **settings):
  _, _, whole = _chunks(seed, lengths, (capacity,))
  cache = KIVICache.init(len(lengths), capacity, K, H, **settings)
  return _update(cache, *whole[0])


def _step(cache, q, k, v, new_lengths, **options):
  positions = cache.lengths[:, None] + jnp.arange(q.shape[1])[None, :]
  return cache.update_attend(q, k, v, positions=positions, rope_theta=1e4,
                             new_lengths=new_lengths, **options)


def _reference_step(cache, q, k, v, new_lengths, **options):
  """Reference of `update_attend`: the old cache dequantized, the chunk's (RoPE'd) keys and
  values exact, one plain softmax."""
  positions = cache.lengths[:, None] + jnp.arange(q.shape[1])[None, :]
  kd, vd = _dequantized(cache)
  if cache.pre_rope:
    tok = jnp.broadcast_to(jnp.arange(cache.max_len)[None], (cache.batch, cache.max_len))
    kd = jnp.swapaxes(apply_rope(jnp.swapaxes(kd, 1, 2), tok, rope_theta=1e4), 1, 2)
  qr, kr = apply_rope(q, positions, rope_theta=1e4), apply_rope(k, positions, rope_theta=1e4)
  # Put the chunk after each row's tokens (room: the reference cache is wider).
  t = q.shape[1]
  wide_k = jnp.concatenate([kd, jnp.zeros(kd.shape[:2] + (t, H))], axis=2)
  wide_v = jnp.concatenate([vd, jnp.zeros(vd.shape[:2] + (t, H))], axis=2)
  rows = jnp.arange(cache.batch)[:, None]
  slots = jnp.where(jnp.arange(t)[None] < new_lengths[:, None], positions, cache.max_len + t)
  wide_k = wide_k.at[rows, :, slots].set(kr, mode="drop")
  wide_v = wide_v.at[rows, :, slots].set(v, mode="drop")
  return lowbit.blocked_attention_reference(qr, positions, wide_k, wide_v,
                                            cache.lengths + new_lengths, **options)


def _qkv(batch, t, seed=1):
  keys = jax.random.split(jax.random.key(seed), 3)
  return (jax.random.normal(keys[0], (batch, t, N, H)),
          jax.random.normal(keys[1], (batch, t, K, H)),
          jax.random.normal(keys[2], (batch, t, K, H)))


@pytest.mark.parametrize("pre_rope,options", [
    (False, {}),
    (True, {"window": 6, "soft_cap": 3.0}),
    pytest.param(False, {"window": 6, "soft_cap": 3.0}, marks=pytest.mark.slow),  # fast: one
    pytest.param(True, {}, marks=pytest.mark.slow),  # mode each, the window with pre-RoPE
])
def test_decode_step_equals_the_reference_and_ignores_garbage(monkeypatch, pre_rope, options):
  # Blocks of 8 store slots over a store of 20: three blocks, the last shifted back.
  monkeypatch.setattr(_residual, "BLOCK_TOKENS", 8)
  capacity = 33  # Sq = 4 * (33 - 8) // 4 = 24 (not a multiple of 8), ring 11
  lengths = (0, 1, 3, 4, 13, capacity - 1)
  cache = _filled(lengths, capacity, bits=2, group_size=4, residual=8, pre_rope=pre_rope)
  assert cache.store_capacity == 24 and cache.ring_capacity == 11
  q, k, v = _qkv(len(lengths), 1)
  new_lengths = jnp.ones((len(lengths),), jnp.int32)
  step = jax.jit(lambda c, q, k, v: _step(c, q, k, v, new_lengths, **options))
  out, new_cache = step(cache, q, k, v)
  want = _reference_step(cache, q, k, v, new_lengths, **options)
  np.testing.assert_allclose(np.asarray(out), np.asarray(want), atol=2e-5, rtol=2e-5)
  dirty, dirty_cache = step(_poison(cache), q, k, v)
  np.testing.assert_array_equal(np.asarray(dirty), np.asarray(out))
  np.testing.assert_array_equal(np.asarray(new_cache.lengths), np.asarray(lengths) + 1)
  # The written token is where the reference state says (the last row flushes a group).
  for a, b in zip(_dequantized(_poison(new_cache)), _dequantized(dirty_cache)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  # `attend` after `update` reads the same cache back (the new token now as stored).
  pos = cache.lengths[:, None]
  kr = k if pre_rope else apply_rope(k, pos, rope_theta=1e4)
  written = _update(cache, kr, v)
  got = _attend(written, apply_rope(q, pos, rope_theta=1e4), q_offsets=cache.lengths, **options)
  kd, vd = _dequantized(written)
  if pre_rope:
    tok = jnp.broadcast_to(jnp.arange(capacity)[None], (len(lengths), capacity))
    kd = jnp.swapaxes(apply_rope(jnp.swapaxes(kd, 1, 2), tok, rope_theta=1e4), 1, 2)
  ref = lowbit.blocked_attention_reference(apply_rope(q, pos, rope_theta=1e4), pos, kd, vd,
                                           written.lengths, **options)
  np.testing.assert_allclose(np.asarray(got), np.asarray(ref), atol=2e-5, rtol=2e-5)


def test_chunk_step_equals_the_reference():
  """A chunk (T = 5, ragged) over a cache with tokens in the store: the past as stored, the
  chunk exact and causal."""
  lengths = (0, 4, 9, 20)
  cache = _filled(lengths, 30, bits=4, group_size=4, residual=4)
  q, k, v = _qkv(len(lengths), 5, seed=3)
  new_lengths = jnp.asarray([5, 2, 0, 5], jnp.int32)
  out, new_cache = jax.jit(_step)(cache, q, k, v, new_lengths)
  want = _reference_step(cache, q, k, v, new_lengths)
  real = (jnp.arange(5)[None] < new_lengths[:, None])[..., None, None]
  np.testing.assert_allclose(np.asarray(jnp.where(real, out, 0)),
                             np.asarray(jnp.where(real, want, 0)), atol=2e-5, rtol=2e-5)
  np.testing.assert_array_equal(new_cache.lengths, np.asarray(lengths) + new_lengths)


@pytest.mark.slow  # quality is measured on SmolLM2 (docs/benchmarks.md); fast: parity tests
def test_quantization_error_is_small_against_f32_attention():
  """4-bit KIVI decode against attention over the exact f32 keys and values (unit normal,
  an outlier key channel): the quantization error itself, 4 bits tighter than 2."""
  lengths = (40, 64)
  errors = {}
  for bits in (2, 4):
    cache = _filled(lengths, 64, seed=5, bits=bits, group_size=8, residual=8)
    kx, vx, _ = _chunks(5, lengths, (64,))
    q = jax.random.normal(jax.random.key(7), (2, 1, N, H))
    kd, vd = _dequantized(cache)
    exact_k = jnp.asarray(kx.transpose(0, 2, 1, 3))
    exact_v = jnp.asarray(vx.transpose(0, 2, 1, 3))
    qt = cache.lengths[:, None] - 1
    got = _attend(cache, q, q_offsets=cache.lengths - 1)
    exact = lowbit.blocked_attention_reference(q, qt, exact_k, exact_v, cache.lengths)
    np.testing.assert_allclose(got, lowbit.blocked_attention_reference(q, qt, kd, vd,
                                                                       cache.lengths), atol=2e-5)
    errors[bits] = float(jnp.max(jnp.abs(got - exact)))
  assert errors[4] < 0.1 and errors[4] < errors[2] < 0.5, errors


def test_bad_settings_raise():
  with pytest.raises(ValueError, match="bits must be one of"):
    KIVICache.init(1, 16, K, H, bits=3)
  with pytest.raises(ValueError, match="residual must be an int >= 0 and a multiple of"):
    KIVICache.init(1, 16, K, H, group_size=4, residual=6)
  with pytest.raises(ValueError, match="head_dim must be a multiple of"):
    KIVICache.init(1, 16, K, 12, group_size=8)
  with pytest.raises(TypeError, match="dtype must be a float dtype"):
    KIVICache.init(1, 16, K, H, jnp.int8)
  with pytest.raises(ValueError, match="scale_dtype must be one of"):
    KIVICache.init(1, 16, K, H, scale_dtype="int8")
  cache = KIVICache.init(1, 16, K, H, group_size=4, residual=4, pre_rope=True)
  q, k, v = _qkv(1, 2)
  with pytest.raises(ValueError, match="positions must be the token indices"):
    cache.update_attend(q, k, v, positions=jnp.asarray([[3, 4]]), rope_theta=1e4,
                        new_lengths=None)
  with pytest.raises(ValueError, match="cache overflow"):
    cache.update(jnp.zeros((1, 17, K, H)), jnp.zeros((1, 17, K, H)))
  with pytest.raises(NotImplementedError, match="pre_rope=True.*XLA loop only"):
    cache.attend(q[:, :1], q_offsets=cache.lengths, implementation="pallas")
  with pytest.raises(ValueError, match="kind 'kivi4'.*residual must be"):
    registry.build_caches(_model(), 1, 16, None, {"kind": "kivi4", "residual": 5})


# ------------------------------------------------------------------------------ compiled step

def _model():
  cfg = transformer.model_config(d_model=32, num_layers=2, mlp_dim=64, vocab_size=64,
                                 attention=dict(kind="gqa", num_heads=4, num_kv_heads=2,
                                                head_dim=8))
  return transformer.Transformer.from_config(cfg, rngs=nnx.Rngs(0))


def _big_arrays(hlo: str, elements: int) -> list[str]:
  """Instructions of the HLO module (every computation, loop bodies included) whose result
  has at least `elements` elements, other than parameters, tuples and their elements."""
  out = []
  for m in re.finditer(r"\n\s*(?:ROOT )?(%[\w.\-]+) = (\w+)\[([\d,]*)\]\{[^}]*\} ([\w\-]+)\(", hlo):
    name, dtype, shape, op = m.groups()
    size = int(np.prod([int(d) for d in shape.split(",") if d]))
    if size >= elements and op not in ("parameter", "get-tuple-element", "tuple", "bitcast"):
      out.append(f"{name} = {dtype}[{shape}] {op}")
  return out


def test_the_compiled_decode_loop_holds_no_dequantized_copy_of_the_store():
  """The decode loop of `generate` over kivi4 caches: no array as large as the store's
  dequantized keys (`B * K * Sq * H` elements) is made anywhere in the compiled program, loop
  bodies included, except the in-place writes of the packed buffers; a step that
  dequantizes the whole store (the control) does make one."""
  from kvattn.inference import generation  # pylint: disable=g-import-not-at-top
  model = _model()
  batch, capacity = 2, 1024
  spec = {"kind": "kivi4", "group_size": 32, "residual": 32}
  caches = registry.build_caches(model, batch, capacity, None, spec)
  store = caches[0].store_capacity
  elements = batch * K * store * H  # the dequantized keys of one layer's store
  graphdef, state = nnx.split(model)
  hlo = generation._decode.lower(  # pylint: disable=protected-access
      graphdef, state, caches, jnp.zeros((batch,), jnp.int32), jax.random.key(0),
      sampling=generation.Sampling(), max_new_tokens=4, eos_id=None,
      pad_id=np.int32(0)).compile().as_text()
  assert "while" in hlo
  big = _big_arrays(hlo, elements)
  assert big == [], big
  # The packed codes (half the elements at 4 bits) are what the loop carries.
  assert caches[0].k_codes.size == elements // 2

  def dequantize_all(c):
    return c.dequantized()[0].sum()

  control = jax.jit(dequantize_all).lower(caches[0]).compile().as_text()
  assert _big_arrays(control, elements), "the check must catch a whole-store dequantization"


# ------------------------------------------------------------------------------ bytes

def test_bytes_per_token_at_4k_meet_the_goals_at_smollm2_shapes():
  """SmolLM2-135M: K = 3, H = 64. At 4096 tokens, R = 128, G = 32 (f16 scales, f32
  residual): 4-bit <= 0.20x and 2-bit <= 0.13x the f32 cache, measured from the arrays."""
  f32 = memory.gqa_bytes_per_token(3, 64, jnp.float32)
  ratio = {}
  for bits in (2, 4):
    cache = KIVICache.init(1, 4096, 3, 64, jnp.float32, bits=bits, group_size=32, residual=128)
    measured = memory.measured_bytes_per_token(cache)
    assert measured == pytest.approx(cache.analytic_bytes_per_token())
    # Hand count: Sq = 3968 slots of (2 * 64 * bits / 8 codes + 2 * 64 * 2 / 32 key scale and
    # zero + 2 * 2 * 2 value scale and zero) bytes, a ring of 159 f32 slots of 512 bytes.
    hand = 3 * (3968 * (16 * bits + 8 + 8) + 159 * 512) / 4096
    assert measured == pytest.approx(hand)
    ratio[bits] = measured / f32
  assert ratio[4] <= 0.20 and ratio[2] <= 0.13, ratio
