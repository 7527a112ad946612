"""The per-layer cache layout (`local_layers="ring"`): a layer with a sliding window W shorter
than the capacity gets a `RingKVCache` of W slots, the other layers the chosen kind.

Runs on the tiny random Gemma 3 checkpoint of tests/fixtures/hf/gemma3 (a local layer with
window 4, then a global layer), whose transformers greedy tokens pin the results.
"""

from __future__ import annotations

import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import kvattn
from kvattn import memory
from kvattn.caches import checkpoint
from kvattn.caches import registry

FIXTURE = pathlib.Path(__file__).resolve().parents[2] / "fixtures" / "hf" / "gemma3"


@pytest.fixture(scope="module")
def gemma3():
  model, _ = kvattn.from_pretrained(FIXTURE)
  arrays = np.load(FIXTURE / "expected.npz")
  meta = json.loads((FIXTURE / "expected.json").read_text())
  lengths = meta["prompt_lengths"]
  tokens = [arrays[f"tokens_{i}"] for i in range(len(lengths))]
  prompts = np.zeros((len(lengths), max(lengths)), np.int32)
  for b, n in enumerate(lengths):
    prompts[b, :n] = tokens[b][:n]
  return model, prompts, np.asarray(lengths, np.int32), tokens, meta["new_tokens"]


def test_local_layers_get_a_ring_of_their_window(gemma3):
  model, *_ = gemma3
  assert [layer.attn.window for layer in model.layers] == [4, None]
  caches = model.init_caches(2, 19, local_layers="ring")
  assert [type(c).__name__ for c in caches] == ["RingKVCache", "KVCache"]
  assert [c.capacity for c in caches] == [4, 19]
  # Storage: the ring holds W slots whatever the capacity; K = 1, H = 16, f32 keys + values.
  assert [memory.tree_bytes(c.storage_arrays()) for c in caches] == [
      2 * 4 * 2 * 16 * 4, 2 * 19 * 2 * 16 * 4]
  full = model.init_caches(2, 19, local_layers="full")
  assert [type(c).__name__ for c in full] == ["KVCache", "KVCache"]
  # A window no shorter than the capacity keeps the chosen kind; quantized rings; paged pools
  # for the global layers only.
  assert [type(c).__name__ for c in model.init_caches(1, 4, local_layers="ring")] == [
      "KVCache", "KVCache"]
  ring, dense = model.init_caches(1, 9, jnp.int8, local_layers="ring")
  assert ring.quantized and ring.k.dtype == jnp.int8 and dense.k.dtype == jnp.int8
  paged = registry.build_caches(model, 2, 19, None, {"kind": "paged", "page_size": 4},
                                local_layers="ring")
  assert [type(c).__name__ for c in paged] == ["RingKVCache", "PagedKVCache"]
  with pytest.raises(ValueError, match=r"local_layers must be one of \('full', 'ring'\); got 'x'"):
    model.init_caches(1, 9, local_layers="x")
  # A context-compressing kind holds fewer slots (3) than its sequences see: the local layer
  # keeps its exact ring of 4 (before, a capacity under the window compressed it too).
  squeezed = registry.build_caches(model, 1, 3, None, {"kind": "knorm", "compress": "context",
                                                       "compression_ratio": 0.5},
                                   local_layers="ring")
  assert [type(c).__name__ for c in squeezed] == ["RingKVCache", "EvictingKVCache"]
  assert [c.capacity for c in squeezed] == [4, 3]


def test_generate_with_the_ring_layout_gives_transformers_greedy_tokens(gemma3):
  model, prompts, lengths, tokens, new = gemma3
  factory = registry.cache_factory_from_config(model, {"kind": "dense"}, local_layers="ring")
  out, _ = kvattn.generate(model, prompts, lengths, new, cache_factory=factory)
  for b, n in enumerate(lengths):
    assert np.asarray(out[b]).tolist() == tokens[b][n:n + new].tolist(), f"prompt {b}"


@pytest.mark.slow  # the dense global layer above covers the layout; this adds the paged pool
def test_generate_with_rings_and_a_paged_global_layer(gemma3):
  model, prompts, lengths, tokens, new = gemma3
  factory = registry.cache_factory_from_config(model, {"kind": "paged", "page_size": 4},
                                               local_layers="ring")
  out, _ = kvattn.generate(model, prompts, lengths, new, cache_factory=factory)
  for b, n in enumerate(lengths):
    assert np.asarray(out[b]).tolist() == tokens[b][n:n + new].tolist(), f"prompt {b}"


def test_save_and_restore_a_mixed_layout(gemma3, tmp_path):
  # Prefill past the window (the ring has wrapped), save, restore, decode one step: the same
  # logits as decoding from the caches that were never saved.
  model, prompts, lengths, *_ = gemma3
  graphdef, state = nnx.split(model)

  @jax.jit
  def forward(tokens, caches, new_lengths=None):  # eager, the ring's chunk path is slow
    return nnx.merge(graphdef, state)(tokens, caches=caches, new_lengths=new_lengths)

  caches = model.init_caches(2, 19, local_layers="ring")
  _, caches = forward(jnp.asarray(prompts), caches, jnp.asarray(lengths))
  assert int(caches[0].lengths.max()) > caches[0].capacity
  checkpoint.save_caches(tmp_path / "ckpt", caches,
                         tokens=[p[:n].tolist() for p, n in zip(prompts, lengths)])
  restored, _, _ = checkpoint.restore_caches(tmp_path / "ckpt",
                                             model.init_caches(2, 19, local_layers="ring"))
  for a, b in zip(jax.tree.leaves(caches), jax.tree.leaves(restored)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  step = jnp.asarray([[5], [7]], jnp.int32)
  want, _ = forward(step, caches)
  got, _ = forward(step, restored)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def _requests(prompts, lengths, new):
  # Three requests over two slots: the third joins a slot the first left (its ring row reset).
  reqs = [(b, prompts[b, :n], new) for b, n in enumerate(lengths)]
  return reqs + [(2, prompts[0, :lengths[0]], new)]


def test_batcher_with_rings_gives_the_full_layouts_tokens(gemma3):
  model, prompts, lengths, tokens, new = gemma3
  opts = dict(num_slots=2, num_pages=16, page_size=4, max_len=19, max_prompt_len=11)
  ringed = kvattn.ContinuousBatcher(model, local_layers="ring", **opts)
  assert [type(c).__name__ for c in ringed.caches] == ["RingKVCache", "PagedKVCache"]
  assert ringed.ring_layers == (0,) and ringed.caches[0].k.shape == (2, 1, 4, 16)
  got = ringed.run(_requests(prompts, lengths, new))
  want = kvattn.ContinuousBatcher(model, **opts).run(_requests(prompts, lengths, new))
  for b, n in enumerate(lengths):
    assert got[b].tokens.tolist() == want[b].tokens.tolist() == tokens[b][n:n + new].tolist()
  assert got[2].tokens.tolist() == got[0].tokens.tolist() and got[2].slot == got[0].slot
  assert dict(ringed.traces) == {"join": 1, "step": 1, "set_row": 1, "release": 1}
  # Retired rows are empty again (no token held), the pool is whole.
  assert np.asarray(ringed.caches[0].pos).max() == -1
  assert ringed.stats()["used_pages"] == 0
  with pytest.raises(ValueError, match="local_layers must be one of"):
    kvattn.ContinuousBatcher(model, local_layers="rings", **opts)


def test_ring_truncate_keeps_only_what_the_window_still_holds():
  ring = kvattn.RingKVCache.init(2, 4, 1, 2)
  ring = ring.update(jnp.ones((2, 6, 1, 2)), jnp.ones((2, 6, 1, 2)), jnp.asarray([3, 6]))
  # Row 0 (3 tokens) never wrapped: any cut; row 1 (6 tokens in 4 slots): all or nothing.
  assert ring.can_truncate(2).tolist() == [True, False]
  assert ring.can_truncate(np.asarray([1, 6])).tolist() == [True, True]
  cut = ring.truncate(jnp.asarray([2, 0]))
  assert cut.lengths.tolist() == [2, 0]
  assert cut.pos.tolist() == [[0, 1, -1, -1], [-1, -1, -1, -1]]
  cut.check_state()  # what a ring of the shorter sequences holds
  with pytest.raises(ValueError, match=r"length\[1\] = 5: row 1 .* holds 6 tokens in 4 slots"):
    ring.truncate(5)


def test_resume_from_a_restored_ring_layout_gives_the_greedy_tokens(gemma3, tmp_path):
  # Cache one prompt (past the window: the ring wraps), save, restore, then resume with a
  # prompt that extends everything cached (the ring keeps it all) and with the first prompt
  # again, a strict prefix of what is cached (a wrapped ring cannot serve it: the prompt is
  # recomputed). Every path gives transformers' greedy tokens (which the full layout gives:
  # test_generate_with_the_ring_layout_gives_transformers_greedy_tokens and its fixture).
  model, prompts, lengths, tokens, _ = gemma3
  n = int(lengths[0])
  prompt, greedy = prompts[0, :n], tokens[0][n:].tolist()
  first, held = kvattn.inference.reuse.resume(
      model, model.init_caches(1, 19, local_layers="ring"), [], prompt, 3)
  assert first.tolist() == greedy[:3]
  cached = np.concatenate([prompt, first[:-1]])  # 13 tokens in a ring of 4: wrapped
  checkpoint.save_caches(tmp_path / "ckpt", held, tokens=[cached.tolist()])
  like = model.init_caches(1, 19, local_layers="ring")
  for new_prompt, want, kept in ((np.concatenate([cached, first[-1:]]), greedy[3:7], True),
                                 (prompt, greedy[:4], False)):
    restored, _, _ = checkpoint.restore_caches(tmp_path / "ckpt", like)
    assert bool(restored[0].can_truncate(len(new_prompt) - 1).all()) == kept
    got, _ = kvattn.inference.reuse.resume(model, restored, cached, new_prompt, 4)
    assert got.tolist() == want
