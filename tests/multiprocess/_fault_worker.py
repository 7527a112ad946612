"""One process of a fault test, for tests/multiprocess/test_faults.py.

    python -m tests.multiprocess._fault_worker offer DIR MODE      # MODE: kill_on_pull, kill_after_offer
    python -m tests.multiprocess._fault_worker pull DIR TIMEOUT_S
    python -m tests.multiprocess._fault_worker coordinated PROCESS_ID PORT HEARTBEAT_S

`offer` fills 4 layers of `paged` f32 caches (256 MiB of pages) with random bits, offers row 0
over its transfer server (handshake files in DIR) and kills itself with SIGKILL: right after
the offer (`kill_after_offer`), or as soon as the puller says it is pulling (`kill_on_pull`:
the file DIR/pulling; the pull takes far longer than the kill). `pull` pulls the offer into
its own caches and prints one JSON line: the error it got (type, message), the seconds from
the start of the pull to the error, and whether its caches kept their bits.

`coordinated` is one of 2 processes of a `jax.distributed` run (process 0 hosts the
coordinator) with a mesh over both: it loops a sharded greedy `generate` and prints one JSON
line per round with the tokens and those of the same model on one local device; the test
kills process 0 and watches process 1 end.
"""

from __future__ import annotations

import os
import sys

os.environ["JAX_PLATFORMS"] = "cpu"

# pylint: disable=g-import-not-at-top,wrong-import-position
import faulthandler
import json
import signal
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

LAYERS, PAGES, PAGE, K, H = 4, 32, 256, 8, 128  # 4 x 32 x 2 MiB of K and V pages


@jax.jit(static_argnums=(0,))
def _scrambled(shape, salt):
  i = jax.lax.iota(jnp.uint32, int(np.prod(shape))) + jnp.uint32(salt) * jnp.uint32(0x9E3779B9)
  i = (i ^ (i >> 15)) * jnp.uint32(2654435761)
  return jax.lax.bitcast_convert_type(i ^ (i >> 13), jnp.float32).reshape(shape)


def _caches(seed: int):
  """4 layers of f32 paged caches, batch 1, every page in row 0 (a permutation of `seed`),
  pools of scrambled bits (a multiplicative hash of the position and `seed`: cheap to make),
  `lengths` = all pages full."""
  from kvattn.caches.paged import PagedKVCache
  table = np.random.default_rng(seed).permutation(PAGES)[None].astype(np.int32)
  out = []
  for layer in range(LAYERS):
    c = PagedKVCache.init(1, num_pages=PAGES, page_size=PAGE, pages_per_seq=PAGES,
                          num_kv_heads=K, head_dim=H, block_tables=table)
    out.append(c.replace(k_pages=_scrambled(c.k_pages.shape, seed * 8 + 2 * layer),
                         v_pages=_scrambled(c.v_pages.shape, seed * 8 + 2 * layer + 1),
                         lengths=jnp.array([PAGES * PAGE], jnp.int32)))
  return jax.block_until_ready(tuple(out))


def offer(directory: str, mode: str) -> None:
  from kvattn.inference import disaggregated as dg
  server, rdv = dg.start_server(), dg.Rendezvous(directory)
  seq = dg.gather_sequence(_caches(1), 0)
  jax.block_until_ready(seq.arrays())
  dg.offer_sequence(server, rdv, 1, seq, first_token=0)
  if mode == "kill_on_pull":
    rdv._wait(os.path.join(directory, "pulling"), 300, "pull")  # pylint: disable=protected-access
  os.kill(os.getpid(), signal.SIGKILL)


def pull(directory: str, timeout_s: float) -> dict:
  from kvattn.inference import disaggregated as dg
  server, rdv = dg.start_server(), dg.Rendezvous(directory)
  caches = _caches(7)
  bits = lambda c: np.asarray(c.k_pages).view(np.uint32)
  before = [bits(c).copy() for c in caches]
  offer_ = rdv.wait_offer(1, timeout_s=300)
  with open(os.path.join(directory, "pulling"), "w", encoding="utf-8"):
    pass
  start = time.monotonic()
  try:
    dg.pull_sequence(server, offer_, caches, timeout_s=timeout_s)
    error, message = None, None
  except dg.TransferError as e:
    error, message = type(e).__name__, str(e)
  seconds = time.monotonic() - start
  kept = all(np.array_equal(bits(c), b) for c, b in zip(caches, before))
  return dict(error=error, message=message, seconds=seconds, caches_kept=kept,
              nbytes=offer_["nbytes"])


def coordinated(process_id: int, port: int, heartbeat_s: int) -> None:
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + " --xla_force_host_platform_device_count=2")
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(f"localhost:{port}", 2, process_id, initialization_timeout=120,
                             heartbeat_timeout_seconds=heartbeat_s,
                             shutdown_timeout_seconds=heartbeat_s)
  import kvattn
  from kvattn import sharding
  from flax import nnx
  from kvattn.models import transformer
  cfg = transformer.model_config(d_model=48, num_layers=1, mlp_dim=96, attention=dict(
      num_heads=8, num_kv_heads=2, head_dim=16))  # tests/multiprocess/_worker.py's model
  make = lambda: transformer.Transformer.from_config(cfg, rngs=nnx.Rngs(0))
  prompts = np.random.default_rng(1).integers(0, 259, (4, 6)).astype(np.int32)
  lengths = np.array([6, 3, 1, 5], np.int32)
  with jax.default_device(jax.local_devices()[0]):
    want, _ = kvattn.generate(make(), prompts, lengths, 4)
  mesh = sharding.make_mesh((2, 2, 1))  # data over the processes, heads over each one's two
  model = sharding.shard_model(make, mesh)
  from kvattn._multihost import host_array
  for rnd in range(10**6):
    got, _ = kvattn.generate(model, prompts, lengths, 4)
    print(json.dumps(dict(round=rnd, process=process_id, tokens=host_array(got).tolist(),
                          reference=np.asarray(want).tolist(), time=time.time())), flush=True)


def main() -> int:
  faulthandler.dump_traceback_later(int(os.environ.get("KVATTN_WORKER_TIMEOUT", "300")),
                                    exit=True)
  role = sys.argv[1]
  if role == "offer":
    offer(sys.argv[2], sys.argv[3])
  elif role == "pull":
    print(json.dumps(pull(sys.argv[2], float(sys.argv[3]))), flush=True)
  elif role == "coordinated":
    try:
      coordinated(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
    except Exception as e:  # pylint: disable=broad-except
      print(json.dumps(dict(error=type(e).__name__, message=str(e)[-2000:],
                            time=time.time())), flush=True)
      traceback.print_exc()
      return 3
  return 0


if __name__ == "__main__":
  sys.exit(main())
