"""Disaggregated prefill and decode (`kvattn.inference.disaggregated`): the page round trip
from one pool into another, bit-exact (fast); two processes, a prefill worker and a decode
worker joined only by JAX's transfer server and a shared directory, give the tokens of one
`generate` (slow: `_disagg_worker.py`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvattn.caches.paged import PagedKVCache
from kvattn.caches.paged_kivi import PagedKIVICache
from kvattn.inference import disaggregated as dg
from kvattn.paging.allocator import NO_PAGE

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
K, H, PAGE, PPS, POOL = 2, 8, 4, 3, 8


def _random_bits(rng, x):
  """`x` filled with random bit patterns (NaNs and infs among them for floats)."""
  width = jnp.dtype(x.dtype).itemsize
  bits = rng.integers(0, 256, x.size * width, dtype=np.uint8).view(f"u{width}")
  return jax.lax.bitcast_convert_type(jnp.asarray(bits.reshape(x.shape)), x.dtype)


def _fill(rng, cache, lengths):
  fields = {f: _random_bits(rng, getattr(cache, f)) for f in dg._pool_fields(cache)}
  fields.update({f: _random_bits(rng, getattr(cache, f)) for f in dg._row_fields(cache)
                 if f != "lengths"})
  return cache.replace(lengths=jnp.asarray(lengths, jnp.int32), **fields)


def _paged(dtype, table):
  return PagedKVCache.init(len(table), num_pages=POOL, page_size=PAGE, pages_per_seq=PPS,
                           num_kv_heads=K, head_dim=H, dtype=dtype, block_tables=table)


def _kivi(table):
  return PagedKIVICache.init_paged(len(table), PPS * PAGE + 4, K, H, jnp.float32,
                                   num_pages=POOL, page_size=PAGE, block_tables=table, bits=4,
                                   group_size=4, residual=4)


def _bits(x):
  return np.asarray(jax.lax.bitcast_convert_type(x, dg._uint(x.dtype)))


SRC = [[5, 1, 7], [0, 2, 3]]  # row 0 of the source: pages 5, 1, 7
DST = [[4, NO_PAGE, NO_PAGE], [6, 0, 2]]  # row 1 of the destination: pages 6, 0, 2


LENGTHS = [0, 1, PAGE - 1, PAGE, PAGE + 1, PPS * PAGE]
# f32 and KIVI over every length; bf16 and int8 (one more compile per page count) at one in
# the fast suite, the rest slow.
GRID = [(k, n) for k in ("f32", "kivi4") for n in LENGTHS] + [
    pytest.param(k, n, marks=() if n == PAGE + 1 else pytest.mark.slow)
    for k in ("bf16", "int8") for n in LENGTHS]


@pytest.mark.parametrize("kind,length", GRID)
def test_page_round_trip_is_bit_exact_into_other_pages(kind, length):
  rng = np.random.default_rng(length)
  make = _kivi if kind == "kivi4" else _maker(kind)
  length = min(length, PPS * PAGE + 4 if kind == "kivi4" else PPS * PAGE)
  src = [_fill(rng, make(SRC), [length, 3]) for _ in range(2)]  # two layers
  dst = [_fill(rng, make(DST), [0, 0]) for _ in range(2)]
  before = [{f: _bits(getattr(c, f)) for f in dg._pool_fields(c)} for c in dst]
  seq = dg.gather_sequence(src, 0)
  n = dg.stored_pages(src[0], 0)
  assert seq.nbytes == sum(a.nbytes for a in map(np.asarray, seq.arrays()))
  out = dg.install_sequence(dst, seq, 1)
  for layer, (s, d, old) in enumerate(zip(src, out, before)):
    for f in dg._pool_fields(s):
      want = _bits(getattr(s, f))[:, SRC[0][:n]]  # the numpy reference
      np.testing.assert_array_equal(_bits(seq.pools[layer][f]), want)
      got = _bits(getattr(d, f))
      np.testing.assert_array_equal(got[:, DST[1][:n]], want)
      untouched = [p for p in range(POOL) if p not in DST[1][:n]]
      np.testing.assert_array_equal(got[:, untouched], old[f][:, untouched])
    for f in dg._row_fields(s):
      np.testing.assert_array_equal(_bits(getattr(d, f))[1], _bits(getattr(s, f))[0])
    np.testing.assert_array_equal(np.asarray(d.block_tables), DST)


def _maker(kind):
  dtype = {"f32": jnp.float32, "bf16": jnp.bfloat16, "int8": jnp.int8}[kind]
  return lambda table: _paged(dtype, table)


def test_install_refuses_a_sequence_of_other_shapes_and_unassigned_pages():
  src = [_paged(jnp.float32, SRC).replace(lengths=jnp.array([PAGE + 1, 0], jnp.int32))]
  seq = dg.gather_sequence(src, 0)
  with pytest.raises(ValueError, match="seq arrays must have the shapes and dtypes"):
    dg.install_sequence([_paged(jnp.bfloat16, DST)], seq, 1)
  with pytest.raises(ValueError, match=r"block_tables\[0, 1\] must be a page"):
    dg.install_sequence([_paged(jnp.float32, DST)], seq, 0)
  with pytest.raises(ValueError, match="slot must be an int in"):
    dg.gather_sequence(src, 2)
  with pytest.raises(TypeError, match="must be a paged cache"):
    dg.gather_sequence([object()], 0)


def run_disaggregated(kinds: list[str], directory: str, timeout: int = 400) -> dict[str, dict]:
  """Runs a prefill and a decode `_disagg_worker` over `kinds`; the decode worker's rows."""
  env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
             JAX_PLATFORMS="cpu", KVATTN_WORKER_TIMEOUT=str(timeout - 30))
  procs = [subprocess.Popen(
      [sys.executable, "-m", "tests.multiprocess._disagg_worker", role, directory,
       ",".join(kinds)], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
      text=True) for role in ("prefill", "decode")]
  outputs = []
  for proc in procs:
    try:
      outputs.append((proc.returncode,) + proc.communicate(timeout=timeout))
    except subprocess.TimeoutExpired:
      for p in procs:
        p.kill()
      raise
  outputs = [(p.returncode, out, err) for p, (_, out, err) in zip(procs, outputs)]
  rows = [json.loads(line) for _, out, _ in outputs for line in out.splitlines()
          if line.startswith("{")]
  assert all(code == 0 for code, _, _ in outputs) and all(r["ok"] for r in rows), (
      json.dumps(rows, indent=1)[-4000:] + "\n" + "\n".join(e[-2000:] for _, _, e in outputs))
  assert len(rows) == 2 * len(kinds)
  return {r["kind"]: r for r in rows if r["role"] == "decode"}


@pytest.mark.slow  # two processes compiling five cache kinds: ~40 s alone
def test_decode_worker_continues_with_the_tokens_of_one_generate(tmp_path):
  kinds = ["f32", "bf16", "int8", "kivi2", "kivi4"]
  rows = run_disaggregated(kinds, str(tmp_path))
  for kind in kinds:
    row = rows[kind]
    assert row["tokens"] == row["reference"], kind
    # The pages landed elsewhere in the decode worker's pool.
    assert row["pages"] != row["prefill_pages"] and len(row["pages"]) == len(
        row["prefill_pages"]), kind
    assert row["nbytes"] > 0


def test_rendezvous_hands_over_whole_files_and_times_out(tmp_path):
  rdv = dg.Rendezvous(tmp_path)
  rdv.offer(3, {"address": "localhost:1", "specs": [[[2, 1], "uint32"]]})
  assert rdv.wait_offer(3, timeout_s=1) == {"address": "localhost:1", "specs": [[[2, 1], "uint32"]]}
  assert sorted(os.listdir(tmp_path)) == ["3.offer.json"]  # no temporary left behind
  with pytest.raises(TimeoutError, match="acknowledgement of transfer 3"):
    rdv.wait_done(3, timeout_s=0.02)
  rdv.done(3)
  rdv.wait_done(3, timeout_s=1)


def test_offer_and_pull_through_the_transfer_server_in_one_process(tmp_path):
  # The wire path of the 2-process test (offer, handshake, pull, install) on one runtime, one
  # server pulling from itself (a second server on the same client hangs the pull): an int8
  # pool with its scale pools, pulled into other pages.
  rng = np.random.default_rng(0)
  src = [_fill(rng, _paged(jnp.int8, SRC), [PAGE + 1, 3])]
  dst = [_fill(rng, _paged(jnp.int8, DST), [0, 0])]
  seq = dg.gather_sequence(src, 0)
  rdv = dg.Rendezvous(tmp_path)
  server = dg.start_server()
  dg.offer_sequence(server, rdv, 7, seq, first_token=5)
  offer = rdv.wait_offer(7, timeout_s=10)
  assert offer["first_token"] == 5 and offer["num_pages"] == 2 and offer["nbytes"] == seq.nbytes
  pulled = dg.pull_sequence(server, offer, dst, timeout_s=60)
  for a, b in zip(pulled.arrays(), seq.arrays(), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  out = dg.install_sequence(dst, pulled, 1)
  np.testing.assert_array_equal(_bits(out[0].k_scale_pages)[:, [6, 0]],
                                _bits(src[0].k_scale_pages)[:, [5, 1]])
  with pytest.raises(ValueError, match="offer specs must match"):
    dg.pull_sequence(None, dict(offer, num_pages=3), dst)
