"""experiments.benchmarks.real: the bytes/roofline arithmetic, the JSON fields, ours and a peer."""

import sys

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from experiments.benchmarks import real as bench_real
from kvattn import generate as generate_fn
from kvattn.models import transformer as transformer_lib


@pytest.fixture(scope="module")
def tiny():
  cfg = transformer_lib.model_config(
      vocab_size=50, d_model=16, num_layers=2, mlp_dim=32, tie_embeddings=False,
      attention=dict(num_heads=4, num_kv_heads=2, head_dim=4))
  return transformer_lib.Transformer.from_config(cfg, rngs=nnx.Rngs(0))


def test_bytes_and_roofline_arithmetic():
  # Steps attend P + 1 .. P + N - 1 tokens: mean P + N / 2.
  assert bench_real.mean_live_tokens(10, 4) == np.mean([11, 12, 13]) == 12.0
  per_step = bench_real.bytes_read_per_step(1000, 10, batch=2, prompt_len=10, new_tokens=4)
  assert per_step == 1000 + 2 * 12.0 * 10
  # 8 tok/s at batch 2 = 4 steps/s; 1240 B/step * 4 / 4960 B/s = 1.0.
  assert bench_real.roofline_fraction(per_step, 8.0, 2, 4960.0) == pytest.approx(1.0)


def test_weight_bytes_leave_out_an_untied_embedding(tiny):
  params = sum(int(np.prod(x.shape)) * 4 for x in
               __import__("jax").tree.leaves(nnx.state(tiny, nnx.Param)))
  assert bench_real.weight_bytes(tiny) == params - 50 * 16 * 4


def test_summary_fields():
  runs = [bench_real.Run(2.0, 4.0, 1.0, 3.0, np.zeros((2, 5), np.int32)),
          bench_real.Run(1.0, 2.0, 1.0, 1.0, np.zeros((2, 5), np.int32)),
          bench_real.Run(3.0, 6.0, 2.0, 2.0, np.zeros((2, 5), np.int32))]
  line = bench_real.summary("x", runs, batch=2, prompt_len=10, new_tokens=5, weight_bytes_=1000,
                            cache_bytes_per_token=10, bandwidth=1e4, extra=1)
  assert line["system"] == "x" and line["extra"] == 1 and line["repeats"] == 3
  assert line["prefill_tokens_per_s"] == 2 * 10 / 2.0  # medians
  assert line["decode_tokens_per_s"] == 2 * 4 / 4.0
  assert line["bytes_read_per_step"] == 1000 + 2 * 12.5 * 10
  assert line["roofline_fraction"] == pytest.approx(1250 * 1.0 / 1e4)
  for key in ("batch", "prompt_len", "prefill_cpu_s", "decode_cpu_s", "weight_bytes",
              "cache_bytes_per_token", "read_bandwidth_bytes_per_s"):
    assert key in line


def test_ours_generates_what_generate_does(tiny):
  prompts = np.arange(12, dtype=np.int32).reshape(2, 6) % 50
  run = bench_real.ours(tiny, prompts, 4, "int8")()
  want, _ = generate_fn(tiny, prompts, np.full((2,), 6), 4, cache_dtype=jnp.int8)
  np.testing.assert_array_equal(run.tokens, want)
  assert run.prefill_s > 0 and run.decode_s > 0


def test_cast_params_and_perplexity(tiny):
  ids = np.arange(20, dtype=np.int32) % 50
  half = bench_real.cast_params(tiny, jnp.bfloat16)
  assert {x.dtype for x in __import__("jax").tree.leaves(nnx.state(half, nnx.Param))} == {
      jnp.dtype(jnp.bfloat16)}
  f32 = bench_real.perplexity(tiny, ids, "float32")
  assert 1.0 < f32 < 1e3
  assert bench_real.perplexity(half, ids, "int8") == pytest.approx(f32, rel=0.05)


def test_peer_protocol_round_trip(monkeypatch):
  monkeypatch.setitem(bench_real.PEERS, "fake", "tests.experiments.fake_peer")
  peer = bench_real.Peer("fake", sys.executable, {"prompts": [[7, 8], [9, 1]], "new_tokens": 3})
  try:
    assert peer.info["ready"] and peer.info["version"] == "0"
    run = peer()
    np.testing.assert_array_equal(run.tokens, [[7, 7, 7], [9, 9, 9]])
    assert (run.prefill_s, run.decode_cpu_s) == (2.0, 3.0)
    assert peer.info["weight_bytes"] == 1000
  finally:
    peer.close()
  assert peer.proc.returncode == 0


def test_a_peer_that_fails_to_start_names_its_error(monkeypatch):
  monkeypatch.setitem(bench_real.PEERS, "broken", "tests.experiments.no_such_peer_module")
  with pytest.raises(RuntimeError, match="peer broken exited: .*No module named"):
    bench_real.Peer("broken", sys.executable, {"prompts": [[1]], "new_tokens": 2})
