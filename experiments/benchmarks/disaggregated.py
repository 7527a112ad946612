"""Disaggregated prefill and decode against the colocated path: TTFT, transfer GB/s, decode tok/s.

    python -m experiments.benchmarks.disaggregated                      # 2048-token prompt, f32
    python -m experiments.benchmarks.disaggregated --cache_dtype=bfloat16 --rounds=5
    python -m experiments.benchmarks.disaggregated --prompt=256 --new_tokens=8   # quick

This process is the decode worker; it starts a prefill worker (this module, `--role=prefill`)
as a second process, a separate JAX runtime. Both hold `--model` with random weights
(SmolLM2-135M's shapes by default) and batch-1 `paged` caches of `--cache_dtype`. Per round
the prefill worker prefills a random `--prompt`-token prompt, gathers its pages
(`kvattn.inference.disaggregated.gather_sequence`) and offers them on its transfer server; the
decode worker pulls them (`pull_sequence`), writes them into its own pool (`install_sequence`)
and runs one decode step. Round 0 compiles both sides and is not counted.

Measured (medians over `--rounds`; wall clock `time.time()`, one host, so both processes
read the same clock):
- `ttft_s`: from the prefill worker starting the prefill to the decode worker holding the
  token of its first decode step (prefill + gather + offer + handshake + pull + install +
  one step). `colocated_ttft_s`: prefill + one step in this process, the same programs
  (`kvattn.prefill`, `kvattn.decode`), run after the prefill worker has exited.
- `transfer_gbps`: bytes pulled / pull seconds (connect included); `pull_s`, `install_s`.
- `decode_tok_s` and `colocated_decode_tok_s`: `--new_tokens - 1` decode steps over the
  installed pages, and over a local prefill's.
- `tokens_equal`: the disaggregated tokens equal the colocated ones.

Prints one JSON line per record and a markdown table.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from experiments.framework import cli

from kvattn.caches import registry
from kvattn.inference import disaggregated as dg
from kvattn.inference import generation


def _setup(args):
  from experiments.evals import models  # pylint: disable=g-import-not-at-top
  model, _ = models.load_model(args.model, random_weights=True)
  prompt = np.random.default_rng(0).integers(3, model.vocab_size, (1, args.prompt))
  return model, prompt.astype(np.int32)


def _caches(model, args, seed: int):
  max_len = args.prompt + args.new_tokens - 1
  return registry.build_caches(model, 1, max_len, jnp.dtype(args.cache_dtype),
                               {"kind": "paged", "page_size": args.page_size, "seed": seed},
                               tokens_per_seq=[max_len])


def prefill_worker(args) -> None:
  """The prefill role: prefills `args.prompt` random tokens each round and offers the row's
  pages over the transfer server (handshake files in `args.dir`)."""
  model, prompt = _setup(args)
  server, rdv = dg.start_server(), dg.Rendezvous(args.dir)
  for uuid in range(args.rounds + 1):
    caches = jax.block_until_ready(_caches(model, args, seed=1))
    start = time.time()
    first, caches, _ = generation.prefill(model, prompt, np.array([args.prompt]), caches)
    seq = dg.gather_sequence(caches, 0)
    jax.block_until_ready(seq.arrays())
    prefill_s = time.time() - start
    dg.offer_sequence(server, rdv, uuid, seq, first_token=int(first[0]), start=start,
                      prefill_s=prefill_s)
    rdv.wait_done(uuid, timeout_s=args.timeout)
    del seq, caches


def _decode(model, first, caches, steps: int):
  tokens, _, _ = generation.decode(model, np.array([first]), caches, steps)
  return np.asarray(tokens)[0]


def decode_worker(args) -> list[dict]:
  """The decode role: pulls each round's pages, installs them and decodes; per timed round
  `{ttft_s, prefill_s, pull_s, install_s, nbytes, decode_s, tokens}` (seconds, bytes)."""
  model, prompt = _setup(args)
  server, rdv = dg.start_server(), dg.Rendezvous(args.dir)
  rounds = []
  for uuid in range(args.rounds + 1):
    caches = jax.block_until_ready(_caches(model, args, seed=7))
    again = jax.block_until_ready(_caches(model, args, seed=7))
    offer = rdv.wait_offer(uuid, timeout_s=args.timeout)
    t0 = time.time()
    seq = dg.pull_sequence(server, offer, caches, timeout_s=args.timeout)
    t1 = time.time()
    caches = jax.block_until_ready(dg.install_sequence(caches, seq, 0))
    t2 = time.time()
    _decode(model, offer["first_token"], caches, 2)
    end = time.time()
    again = dg.install_sequence(again, seq, 0)
    t3 = time.time()
    tokens = _decode(model, offer["first_token"], again, args.new_tokens)
    decode_s = time.time() - t3
    rdv.done(uuid)  # after the round: the prefill worker's next round starts on an idle machine
    rounds.append(dict(ttft_s=end - offer["start"], prefill_s=offer["prefill_s"],
                       pull_s=t1 - t0, install_s=t2 - t1, nbytes=offer["nbytes"],
                       decode_s=decode_s, tokens=tokens.tolist()))
  return rounds[1:]  # round 0 compiled


def colocated(model, prompt, args) -> list[dict]:
  """The same prefill and decode programs in this process; per timed round `{ttft_s,
  decode_s, tokens}` (seconds)."""
  rounds = []
  for _ in range(args.rounds + 1):
    caches = jax.block_until_ready(_caches(model, args, seed=1))
    again = jax.block_until_ready(_caches(model, args, seed=1))
    start = time.time()
    first, caches, _ = generation.prefill(model, prompt, np.array([args.prompt]), caches)
    _decode(model, int(first[0]), caches, 2)
    ttft = time.time() - start
    first, again, _ = generation.prefill(model, prompt, np.array([args.prompt]), again)
    jax.block_until_ready(again)
    t3 = time.time()
    tokens = _decode(model, int(first[0]), again, args.new_tokens)
    rounds.append(dict(ttft_s=ttft, decode_s=time.time() - t3, tokens=tokens.tolist()))
  return rounds[1:]


def main(argv=None) -> int:
  """Runs the decode role here and the prefill role as a child process, then the colocated
  baseline; prints one JSON record and a table. Returns the exit status."""
  p = cli.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--role", default="decode", choices=("decode", "prefill"))
  p.add_argument("--dir", default=None, help="handshake directory (set for the prefill role)")
  p.add_argument("--model", default="smollm2-135m-instruct")
  p.add_argument("--prompt", type=int, default=2048, help="prompt tokens")
  p.add_argument("--new_tokens", type=int, default=32, help="tokens generated per round")
  p.add_argument("--page_size", type=int, default=16)
  p.add_argument("--cache_dtype", default="float32")
  p.add_argument("--rounds", type=int, default=3, help="timed rounds (after one compiling)")
  p.add_argument("--timeout", type=float, default=900.0, help="seconds a handshake may wait")
  args = p.parse_args(argv)
  if args.role == "prefill":
    prefill_worker(args)
    return 0
  with tempfile.TemporaryDirectory() as directory:
    args.dir = directory
    flags = [a for a in (argv if argv is not None else sys.argv[1:]) if not a.startswith(
        ("--role", "--dir"))]
    child = subprocess.Popen([sys.executable, "-m", "experiments.benchmarks.disaggregated",
                              "--role=prefill", f"--dir={directory}", *flags],
                             env=dict(os.environ))
    try:
      disagg = decode_worker(args)
    finally:
      if child.wait(timeout=args.timeout) != 0:
        raise RuntimeError(f"prefill worker exited with {child.returncode}")
  model, prompt = _setup(args)
  local = colocated(model, prompt, args)
  med = lambda rows, k: float(np.median([r[k] for r in rows]))
  steps = args.new_tokens - 1
  record = dict(
      record="disaggregated", model=args.model, prompt=args.prompt, new_tokens=args.new_tokens,
      cache_dtype=args.cache_dtype, page_size=args.page_size, rounds=args.rounds,
      ttft_s=med(disagg, "ttft_s"), colocated_ttft_s=med(local, "ttft_s"),
      prefill_s=med(disagg, "prefill_s"), pull_s=med(disagg, "pull_s"),
      install_s=med(disagg, "install_s"), transfer_bytes=disagg[0]["nbytes"],
      transfer_gbps=disagg[0]["nbytes"] / med(disagg, "pull_s") / 1e9,
      decode_tok_s=steps / med(disagg, "decode_s"),
      colocated_decode_tok_s=steps / med(local, "decode_s"),
      tokens_equal=all(r["tokens"] == local[0]["tokens"] for r in disagg + local))
  record["ttft_ratio"] = record["ttft_s"] / record["colocated_ttft_s"]
  print(json.dumps(record), flush=True)
  print("| path | TTFT s | transfer GB/s | decode tok/s |\n|---|---|---|---|")
  print(f"| disaggregated | {record['ttft_s']:.3f} | {record['transfer_gbps']:.2f} "
        f"| {record['decode_tok_s']:.1f} |")
  print(f"| colocated | {record['colocated_ttft_s']:.3f} | - "
        f"| {record['colocated_decode_tok_s']:.1f} |")
  return 0


if __name__ == "__main__":
  cli.run_plain(main)
