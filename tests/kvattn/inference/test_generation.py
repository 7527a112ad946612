"""Tests for kvattn.generate: greedy == full-forward argmax, batch independence, one compile,
EOS semantics, sampling, donation and the up-front ValueErrors."""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import kvattn
from kvattn.training import data
from kvattn.models import transformer
from kvattn.inference.generation import Sampling, sample_logits

GQA = dict(kind="gqa", num_heads=4, num_kv_heads=2, head_dim=8)
MQA = dict(kind="gqa", num_heads=4, num_kv_heads=1, head_dim=8)
MHA = dict(kind="gqa", num_heads=4, num_kv_heads=4, head_dim=8)
MLA = dict(kind="mla", num_heads=4, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
           v_head_dim=8)
MIXED = ({"kind": "gqa", "num_kv_heads": 1, "window": 4}, {"kind": "mla"})


def tiny_model(attention, layers=(), seed=0, **overrides):
  cfg = transformer.model_config(d_model=32, num_layers=2, mlp_dim=64,
                                 attention={**MLA, **attention}, layers=layers, **overrides)
  return transformer.Transformer.from_config(cfg, rngs=nnx.Rngs(seed))


@functools.partial(jax.jit, static_argnums=0)
def _full_logits(graphdef, state, tokens):
  logits, _ = nnx.merge(graphdef, state)(tokens)
  return logits


def reference_greedy(model, prompt, num_new):
  """Step-by-step argmax of a full causal forward recomputed over the growing sequence.

  The sequence lives in a fixed-width buffer (one compile); causality means the
  tokens after the current end cannot change the logits read at `end - 1`.
  """
  graphdef, state = nnx.split(model)
  width = len(prompt) + num_new
  buf = np.full((1, width), data.PAD_ID, np.int32)
  buf[0, :len(prompt)] = prompt
  out = []
  for i in range(num_new):
    end = len(prompt) + i
    logits = _full_logits(graphdef, state, jnp.asarray(buf))
    nxt = int(jnp.argmax(logits[0, end - 1]))
    out.append(nxt)
    if end < width:
      buf[0, end] = nxt
  return out


def right_padded(prompts, width, fill=0):
  arr = np.full((len(prompts), width), fill, np.int32)
  for b, p in enumerate(prompts):
    arr[b, :len(p)] = p
  return arr, np.array([len(p) for p in prompts], np.int32)


RNG = np.random.default_rng(0)
PROMPTS = [list(RNG.integers(0, 256, n)) for n in (7, 3, 1)]
NEW = 6


@pytest.mark.parametrize("name,attention,layers", [  # fast suite: the mixed stack (MLA inside)
    pytest.param("mha", MHA, (), marks=pytest.mark.slow),
    pytest.param("mqa", MQA, (), marks=pytest.mark.slow),
    pytest.param("mla", MLA, (), marks=pytest.mark.slow), ("mixed", GQA, MIXED)])
def test_greedy_equals_full_forward_argmax(name, attention, layers):
  model = tiny_model(attention, layers)
  prompts, lengths = right_padded(PROMPTS, 8, fill=255)  # padding holds real-looking ids
  tokens, out_lengths = kvattn.generate(model, prompts, lengths, NEW)
  assert tokens.shape == (3, NEW) and tokens.dtype == jnp.int32
  np.testing.assert_array_equal(out_lengths, [NEW] * 3)
  for b, p in enumerate(PROMPTS):
    assert tokens[b].tolist() == reference_greedy(model, p, NEW), (name, b)


def test_each_sequence_gets_what_it_gets_alone():
  model = tiny_model(GQA, MIXED)
  prompts, lengths = right_padded(PROMPTS, 9, fill=7)
  batched, batched_lengths = kvattn.generate(model, prompts, lengths, NEW)
  for b, p in enumerate(PROMPTS):
    alone_prompts, alone_lengths = right_padded([p], 9)
    alone, alone_len = kvattn.generate(model, alone_prompts, alone_lengths, NEW)
    np.testing.assert_array_equal(batched[b], alone[0])
    assert int(batched_lengths[b]) == int(alone_len[0])
  # A different pad content and a larger cache do not change anything either.
  prompts2, _ = right_padded(PROMPTS, 9, fill=200)
  again, _ = kvattn.generate(model, prompts2, lengths, NEW, max_len=40)
  np.testing.assert_array_equal(again, batched)


class _CompileCounter:
  """Counts jaxpr traces and XLA backend compiles (jax.monitoring events)."""

  def __init__(self):
    self.active = False
    self.events = []
    jax.monitoring.register_event_duration_secs_listener(self._listen)

  def _listen(self, event, duration, **kwargs):
    del duration, kwargs
    if self.active and event in ("/jax/core/compile/backend_compile_duration",
                                 "/jax/core/compile/jaxpr_trace_duration"):
      self.events.append(event)

  def __enter__(self):
    self.events, self.active = [], True
    return self

  def __exit__(self, *exc):
    self.active = False


_COUNTER = _CompileCounter()


def test_second_call_with_same_shapes_does_not_compile():
  jax.clear_caches()  # an earlier test in this process may have compiled these shapes
  model = tiny_model(GQA)
  prompts, lengths = right_padded(PROMPTS, 8)
  with _COUNTER as first:
    t1, _ = kvattn.generate(model, prompts, lengths, NEW, temperature=0.7, top_k=20, rng=1)
  assert first.events, "the counter must see the first call compile"
  # Same shapes and settings, different prompt contents, lengths and rng: nothing compiles.
  prompts2, lengths2 = right_padded([p[::-1] for p in PROMPTS[::-1]], 8)
  with _COUNTER as second:
    t2, _ = kvattn.generate(model, prompts2, lengths2[[0, 1, 2]], NEW, temperature=0.7, top_k=20,
                            rng=2)
    jax.block_until_ready(t2)
  assert second.events == []
  assert t1.shape == t2.shape


def test_eos_stops_each_sequence_and_pads_after_it():
  model = tiny_model(GQA)
  prompts, lengths = right_padded(PROMPTS, 8)
  free, _ = kvattn.generate(model, prompts, lengths, 10)
  free = np.asarray(free)
  # Pick as EOS the token sequence 0 emits at step 3 (if it appeared earlier, stop there).
  eos = int(free[0, 3])
  tokens, out_lengths = kvattn.generate(model, prompts, lengths, 10, eos_id=eos, pad_id=-1)
  tokens = np.asarray(tokens)
  for b in range(3):
    hits = np.nonzero(free[b] == eos)[0]
    n = int(hits[0]) + 1 if hits.size else 10  # generated tokens, EOS included
    assert int(out_lengths[b]) == n
    np.testing.assert_array_equal(tokens[b, :n], free[b, :n])  # same tokens up to its EOS
    assert (tokens[b, n:] == -1).all()  # then pad_id
  assert int(out_lengths[0]) <= 4


def test_all_sequences_done_at_prefill():
  model = tiny_model(GQA)
  prompts, lengths = right_padded(PROMPTS, 8)
  first, _ = kvattn.generate(model, prompts, lengths, 1)
  first = np.asarray(first)[:, 0]
  # eos = sequence 0's first token: it stops at once, the others run on.
  tokens, out_lengths = kvattn.generate(model, prompts, lengths, 5, eos_id=int(first[0]))
  assert int(out_lengths[0]) == 1 and tokens[0, 0] == first[0]
  assert (np.asarray(tokens[0, 1:]) == data.PAD_ID).all()


def test_sampling_reproducible_and_restricted():
  model = tiny_model(GQA)
  prompts, lengths = right_padded(PROMPTS, 8)
  greedy, _ = kvattn.generate(model, prompts, lengths, NEW)
  a, _ = kvattn.generate(model, prompts, lengths, NEW, temperature=1.0, rng=jax.random.key(3))
  b, _ = kvattn.generate(model, prompts, lengths, NEW, temperature=1.0, rng=jax.random.key(3))
  c, _ = kvattn.generate(model, prompts, lengths, NEW, temperature=1.0, rng=jax.random.key(4))
  np.testing.assert_array_equal(a, b)
  assert not np.array_equal(a, c)  # 18 draws from ~uniform 259-way: a clash is ~impossible
  # top_k = 1 and a tiny top_p keep only the argmax: sampling equals greedy.
  k1, _ = kvattn.generate(model, prompts, lengths, NEW, temperature=2.0, top_k=1, rng=5)
  p0, _ = kvattn.generate(model, prompts, lengths, NEW, temperature=2.0, top_p=1e-6, rng=5)
  np.testing.assert_array_equal(k1, greedy)
  np.testing.assert_array_equal(p0, greedy)


def test_sample_logits_top_k_and_top_p_supports():
  logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]] * 4000))
  keys = jax.random.key(0)
  draws = np.asarray(sample_logits(logits, keys, Sampling(1.0, top_k=2)))
  assert set(draws.tolist()) == {0, 1}
  assert abs((draws == 0).mean() - 0.5 / 0.8) < 0.03  # renormalised over the top 2
  draws = np.asarray(sample_logits(logits, keys, Sampling(1.0, top_p=0.85)))
  assert set(draws.tolist()) == {0, 1, 2}  # 0.5 + 0.3 < 0.85 <= 0.5 + 0.3 + 0.15
  draws = np.asarray(sample_logits(logits, keys, Sampling(1.0)))
  assert set(draws.tolist()) == {0, 1, 2, 3}
  np.testing.assert_array_equal(sample_logits(logits[:2], keys, Sampling()), [0, 0])


def test_prebuilt_caches_are_donated_and_cache_factory_is_used():
  model = tiny_model(GQA)
  prompts, lengths = right_padded(PROMPTS, 8)
  expected, _ = kvattn.generate(model, prompts, lengths, NEW)
  caches = model.init_caches(3, 20)
  tokens, _ = kvattn.generate(model, prompts, lengths, NEW, caches=caches)
  np.testing.assert_array_equal(tokens, expected)
  # Donated: the cache buffers were handed to XLA and updated in place. (The tiny `lengths`
  # vectors of different layers are equal, XLA may return one buffer for them, so one of those
  # donations can go unused; only the storage arrays are checked.)
  assert all(a.is_deleted() for c in caches for a in c.storage_arrays())
  calls = []

  def factory(batch, max_len, dtype):
    calls.append((batch, max_len, dtype))
    return model.init_caches(batch, max_len, dtype)

  tokens, _ = kvattn.generate(model, prompts, lengths, NEW, cache_factory=factory, max_len=30)
  np.testing.assert_array_equal(tokens, expected)
  assert calls == [(3, 30, None)]


def test_invalid_inputs_raise_before_compute():
  model = tiny_model(GQA)
  prompts, lengths = right_padded(PROMPTS, 8)
  with pytest.raises(ValueError, match="prompt_lengths must be >= 1"):
    kvattn.generate(model, prompts, np.array([7, 0, 1], np.int32), 4)
  with pytest.raises(ValueError, match="must fit the cache"):
    kvattn.generate(model, prompts, lengths, 1, max_len=5)  # longest prompt is 7
  with pytest.raises(ValueError, match="would overflow the cache"):
    kvattn.generate(model, prompts, lengths, 6, max_len=11)  # 7 + 6 - 1 = 12 > 11
  kvattn.generate(model, prompts, lengths, 5, max_len=11)  # 7 + 5 - 1 = 11 fits exactly
  with pytest.raises(ValueError, match="would overflow the cache"):
    kvattn.generate(model, prompts, lengths, 6, caches=model.init_caches(3, 11))
  with pytest.raises(ValueError, match="prompt_lengths must be <= T"):
    kvattn.generate(model, prompts, np.array([9, 1, 1], np.int32), 2)
  with pytest.raises(ValueError, match=r"token ids in \[0, 259\)"):
    kvattn.generate(model, np.where(prompts == prompts[1, 2], 300, prompts), lengths, 2)
  with pytest.raises(ValueError, match="max_new_tokens must be a positive int"):
    kvattn.generate(model, prompts, lengths, 0)
  with pytest.raises(ValueError, match="temperature"):
    kvattn.generate(model, prompts, lengths, 2, temperature=-1.0)
  with pytest.raises(ValueError, match="top_p"):
    kvattn.generate(model, prompts, lengths, 2, temperature=1.0, top_p=1.5)
  with pytest.raises(ValueError, match="eos_id"):
    kvattn.generate(model, prompts, lengths, 2, eos_id=259)
  with pytest.raises(ValueError, match="caches must be empty"):
    used = model.init_caches(3, 20)
    used = tuple(c.replace(lengths=c.lengths + 1) for c in used)
    kvattn.generate(model, prompts, lengths, 2, caches=used)
  with pytest.raises(TypeError, match="prompts must have an integer dtype"):
    kvattn.generate(model, prompts.astype(np.float32), lengths, 2)


def _while_body_arrays(hlo_text):
  """(instruction, op, element count) of every array made in the decode while loop's body."""
  import re  # pylint: disable=g-import-not-at-top
  body = re.search(r"while\(.*?body=(%[\w.\-]+)", hlo_text).group(1)
  start = hlo_text.index("\n" + body + " ")
  text = hlo_text[start:hlo_text.index("\n}\n", start)]
  out = []
  for m in re.finditer(r"\n\s*(?:ROOT )?(%[\w.\-]+) = \w+\[([\d,]*)\]\{[^}]*\} ([\w\-]+)\(", text):
    name, shape, op = m.groups()
    out.append((name, op, int(np.prod([int(d) for d in shape.split(",") if d]))))
  return out


@pytest.mark.parametrize("attention", [GQA, MQA, MLA])
def test_decode_loop_updates_caches_in_place(attention):
  """The compiled decode loop never makes a cache-sized array other than the cache update.

  Structural check of the optimized HLO: inside the while body the only instructions whose
  result is as large as a layer's cache buffer are the scatters writing the new token (which
  XLA performs in place on the loop-carried, donated buffer). A per-step copy or transpose of
  a cache (as XLA once made for the PV product) would show up here.
  """
  from kvattn.inference.generation import _decode  # pylint: disable=g-import-not-at-top
  model = tiny_model(attention)
  caches = model.init_caches(3, 64)
  graphdef, state = nnx.split(model)
  hlo = _decode.lower(graphdef, state, caches, jnp.zeros((3,), jnp.int32), jax.random.key(0),
                      sampling=Sampling(), max_new_tokens=8, eos_id=None,
                      pad_id=data.PAD_ID).compile().as_text()
  largest_buffer = max(a.size for c in caches for a in c.storage_arrays())  # MLA: c_kv
  arrays = _while_body_arrays(hlo)
  assert arrays, "expected the decode loop to compile to an XLA while loop"
  big = [(name, op) for name, op, size in arrays
         if size >= largest_buffer and op not in ("get-tuple-element", "parameter", "tuple",
                                                   "bitcast")]
  assert big, "the cache updates must be in the loop body"
  assert all("scatter" in name or "dynamic-update-slice" in name for name, _ in big), big


def test_eos_and_pad_are_traced_a_new_value_does_not_recompile():
  model = tiny_model(GQA)
  prompts, lengths = right_padded(PROMPTS, 8)
  free = np.asarray(kvattn.generate(model, prompts, lengths, NEW)[0])
  kvattn.generate(model, prompts, lengths, NEW, eos_id=int(free[0, 2]))  # compiles the EOS program
  with _COUNTER as counter:
    tokens, out_lengths = kvattn.generate(model, prompts, lengths, NEW, eos_id=int(free[1, 1]),
                                          pad_id=-5)
    jax.block_until_ready(tokens)
  assert counter.events == []
  tokens = np.asarray(tokens)
  n = int(np.nonzero(free[1] == free[1, 1])[0][0]) + 1
  assert int(out_lengths[1]) == n and (tokens[1, n:] == -5).all()
  np.testing.assert_array_equal(tokens[1, :n], free[1, :n])


@pytest.mark.slow  # ~15 CPU-s of compiles; the Python-number settings run in the fast suite
def test_numpy_and_0d_sampling_settings_equal_python_ones():
  model = tiny_model(GQA)
  prompts, lengths = right_padded(PROMPTS, 8)
  want, _ = kvattn.generate(model, prompts, lengths, NEW, temperature=0.8, top_p=0.9, top_k=30,
                            rng=3)
  for t, p, k, seed in ((np.float32(0.8), np.float64(0.9), np.int64(30), np.int64(3)),
                        (jnp.asarray(0.8), jnp.asarray(0.9), 30, np.array(3))):
    got, _ = kvattn.generate(model, prompts, lengths, NEW, temperature=t, top_p=p, top_k=k,
                             rng=seed)
    np.testing.assert_array_equal(got, want)


def test_bad_sampling_values_and_oversized_caches_raise_before_compute():
  model = tiny_model(GQA)
  prompts, lengths = right_padded(PROMPTS, 8)
  with pytest.raises(ValueError, match="f32"):
    kvattn.generate(model, prompts, lengths, 2, temperature=1e300)  # inf once cast to f32
  with pytest.raises(ValueError, match="f32"):
    kvattn.generate(model, prompts, lengths, 2, temperature=1e-300)  # 0 in f32: logits / 0
  with pytest.raises(TypeError, match="temperature"):
    kvattn.generate(model, prompts, lengths, 2, temperature="hot")
  with pytest.raises(TypeError, match="top_p"):
    kvattn.generate(model, prompts, lengths, 2, temperature=1.0, top_p=np.ones(2))
  with pytest.raises(ValueError, match=r"max_len = .* GiB"):
    kvattn.generate(model, prompts, lengths, 2, max_len=2**40)  # petabytes of cache
  with pytest.raises(ValueError, match=r"max_new_tokens = .* GiB"):
    kvattn.generate(model, prompts, lengths, 2**40)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float8_e4m3fn])
def test_decode_loop_copies_no_narrow_float_cache(dtype):
  """The compiled decode loop moves a bf16 / fp8 cache as stored: no f32 copy of a whole cache
  and no whole-cache copy but the writes in place and one bitcast per array at the loop's
  entry and exit (XLA:CPU ran slices and writes of these floats in f32 over the whole cache,
  every step: `kvattn.ops.quant.as_bits`). The cache is longer than the largest single block,
  so no read block spans it either."""
  from kvattn.inference import generation  # pylint: disable=g-import-not-at-top
  model = tiny_model(GQA)
  caches = model.init_caches(3, 9000, dtype=dtype)
  graphdef, state = nnx.split(model)
  text = generation._decode.lower(
      graphdef, state, caches, jnp.zeros((3,), jnp.int32), jax.random.key(0),
      sampling=generation.Sampling(), max_new_tokens=4, eos_id=None, pad_id=0).compile().as_text()
  # `%name = dtype[3,2,9000,8]{layout} opcode(`: a whole-cache array made by a convert or a copy
  # (a bitcast, a write in place or a tuple moves nothing).
  made = re.findall(r"%([\w.-]+) = (\w+)\[3,2,9000,8\]\{[\d,]*\} ([\w-]+)\(", text)
  copies = [(name, dtype, op) for name, dtype, op in made
            if op in ("convert", "bitcast-convert", "copy")
            or (op == "fusion" and re.match(r"(wrapped_)?(convert|bitcast-convert|copy)", name))]
  assert not [c for c in made if c[1] == "f32"], made
  arrays = 2 * len(caches)  # k and v per layer
  assert len(copies) <= 2 * arrays, copies
