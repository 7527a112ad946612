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
- `transfer_gbps`: bytes pulled / pull seconds (connect and checksum verification included);
  `pull_s`, `install_s`; `checksum_s`: the CRC-32 of the pulled arrays alone (the
  verification's share of `pull_s`).
- `decode_tok_s` and `colocated_decode_tok_s`: `--new_tokens - 1` decode steps over the
  installed pages, and over a local prefill's.
- `tokens_equal`: the disaggregated tokens equal the colocated ones.

Prints one JSON line per record and a markdown table.

    python -m experiments.benchmarks.disaggregated --probe --probe_mb=256 --rounds=5

`--probe` measures the transfer server alone against copies of the same bytes in the same
process, interleaved per round (issue 40's >= 1 GB/s goal): a child process offers
`--probe_mb` MiB of u32 as one contiguous array or as `--probe_arrays` arrays (the sequence's
shape: one per pool per layer), under each server setting of `PROBE_SETTINGS`; per round this
process pulls it (`pull_gbps`, connection included), then copies the same bytes on the host
into a fresh buffer (`memcpy_gbps`, `numpy.copy`) and onto the device (`device_put_gbps`), and
takes the checksum of the pulled arrays (`checksum_s`, `kvattn.inference.disaggregated.
checksums`) (`zlib.crc32` of the host bytes) and, for comparison, a jitted on-device reduction over the
same words (`device_sum_s`: wrapping u32 sums, a Fletcher-style pair). One JSON line per setting,
medians over the rounds after the first.
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
    dg.checksums(seq)  # again, timed alone: the verification's share of pull_s
    checksum_s = time.time() - t1
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
                       pull_s=t1 - t0 - checksum_s, install_s=t2 - t1, nbytes=offer["nbytes"],
                       checksum_s=checksum_s,
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


# Transfer-server settings the probe compares (`jax.experimental.transfer.start_transfer_server`'s
# keywords): the defaults, raw buffers, and smaller chunks copied more in parallel.
PROBE_SETTINGS = {
    "default": {},
    "raw_buffers": {"use_raw_buffers": True},
    "16x16MiB": {"max_num_parallel_copies": 16, "transfer_size": 16 * 2**20},
}


def _probe_server(setting: str):
  from jax.experimental import transfer  # pylint: disable=g-import-not-at-top
  return transfer.start_transfer_server(jax.local_devices()[0].client, "localhost:0",
                                        ["localhost:0"], **PROBE_SETTINGS[setting])


def _probe_shapes(args) -> list[tuple[int]]:
  words = args.probe_mb * 2**20 // 4
  return [(words // args.probe_arrays,)] * args.probe_arrays if args.probe_arrays > 1 else [
      (words,)]


@jax.jit
def _device_sums(arrays):
  """`u32[len(arrays), 2]`: per array of u32 words w (n of them), `(sum w_i, sum (n - i) w_i)`
  wrapping (Fletcher's pair modulo 2^32): the on-device alternative to CRC-32 the probe
  times."""
  out = []
  for a in arrays:
    weight = jnp.uint32(a.size) - jnp.arange(a.size, dtype=jnp.uint32)
    out.append(jnp.stack([jnp.sum(a, dtype=jnp.uint32), jnp.sum(a * weight, dtype=jnp.uint32)]))
  return jnp.stack(out)


def probe_offer(args) -> None:
  """The probe's offering role: `args.rounds + 1` offers of the probe's arrays."""
  server, rdv = _probe_server(args.setting), dg.Rendezvous(args.dir)
  arrays = [jnp.arange(n, dtype=jnp.uint32) * jnp.uint32(2654435761) + jnp.uint32(i)
            for i, (n,) in enumerate(_probe_shapes(args))]
  jax.block_until_ready(arrays)
  for uuid in range(args.rounds + 1):
    server.await_pull(uuid, arrays)
    rdv.offer(uuid, dict(address=server.address()))
    rdv.wait_done(uuid, timeout_s=args.timeout)


def probe_pull(args) -> dict:
  """The probe's pulling role (module doc); one record of medians."""
  server, rdv = _probe_server(args.setting), dg.Rendezvous(args.dir)
  device = jax.local_devices()[0]
  sharding = jax.sharding.SingleDeviceSharding(device)
  specs = [jax.ShapeDtypeStruct(s, jnp.uint32, sharding=sharding) for s in _probe_shapes(args)]
  nbytes = sum(s[0] for s in _probe_shapes(args)) * 4
  host = np.arange(nbytes // 4, dtype=np.uint32)
  rounds = []
  for uuid in range(args.rounds + 1):
    offer = rdv.wait_offer(uuid, timeout_s=args.timeout)
    t0 = time.perf_counter()
    pulled = jax.block_until_ready(server.connect(offer["address"]).pull(uuid, specs))
    t1 = time.perf_counter()
    rdv.done(uuid)
    copied = host.copy()
    t2 = time.perf_counter()
    put = jax.block_until_ready(jax.device_put(host, device))
    t3 = time.perf_counter()
    seq = dg.SequencePages(pools=({str(i): a[None] for i, a in enumerate(pulled)},), rows=({},))
    dg.checksums(seq)
    t4 = time.perf_counter()
    jax.block_until_ready(_device_sums(pulled))
    t5 = time.perf_counter()
    rounds.append(dict(pull_s=t1 - t0, memcpy_s=t2 - t1, device_put_s=t3 - t2,
                       checksum_s=t4 - t3, device_sum_s=t5 - t4))
    del pulled, copied, put
  med = lambda k: float(np.median([r[k] for r in rounds[1:]]))
  return dict(record="transfer_probe", setting=args.setting, mb=args.probe_mb,
              arrays=len(specs), rounds=args.rounds,
              pull_gbps=nbytes / med("pull_s") / 1e9, memcpy_gbps=nbytes / med("memcpy_s") / 1e9,
              device_put_gbps=nbytes / med("device_put_s") / 1e9,
              pull_over_memcpy=med("memcpy_s") / med("pull_s"),
              checksum_s=med("checksum_s"), device_sum_s=med("device_sum_s"),
              pull_s=med("pull_s"),
              load_avg_1min=round(os.getloadavg()[0], 2))


def probe(args, argv) -> list[dict]:
  """Runs `probe_pull` here against a `--role=probe_offer` child, per setting and per array
  count (1 and `--probe_arrays`)."""
  out = []
  for setting in PROBE_SETTINGS:
    for arrays in sorted({1, args.probe_arrays}):
      with tempfile.TemporaryDirectory() as directory:
        args.dir, args.setting, args.probe_arrays = directory, setting, arrays
        flags = [a for a in argv if not a.startswith(("--role", "--dir", "--setting",
                                                      "--probe_arrays", "--probe"))]
        child = subprocess.Popen([sys.executable, "-m", "experiments.benchmarks.disaggregated",
                                  "--role=probe_offer", f"--dir={directory}",
                                  f"--setting={setting}", f"--probe_arrays={arrays}",
                                  f"--probe_mb={args.probe_mb}", *flags])
        try:
          record = probe_pull(args)
        finally:
          child.wait(timeout=args.timeout)
      print(json.dumps(record), flush=True)
      out.append(record)
  return out


def main(argv=None) -> int:
  """Runs the decode role here and the prefill role as a child process, then the colocated
  baseline; prints one JSON record and a table. Returns the exit status."""
  p = cli.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--role", default="decode", choices=("decode", "prefill", "probe_offer"))
  p.add_argument("--probe", action="store_true", help="the transfer probe (module doc)")
  p.add_argument("--probe_mb", type=int, default=256, help="MiB the probe moves")
  p.add_argument("--probe_arrays", type=int, default=60, help="arrays the probe's bytes span")
  p.add_argument("--setting", default="default", choices=tuple(PROBE_SETTINGS))
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
  if args.role == "probe_offer":
    probe_offer(args)
    return 0
  if args.probe:
    probe(args, list(argv if argv is not None else sys.argv[1:]))
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
      install_s=med(disagg, "install_s"), checksum_s=med(disagg, "checksum_s"),
      transfer_bytes=disagg[0]["nbytes"],
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
