"""One process of a multi-process kvattn run on localhost, for tests/multiprocess.

    python -m tests.multiprocess._worker PROCESS_ID NUM_PROCESSES PORT CHECK[,CHECK...] [DIR]

Each process sees `8 // NUM_PROCESSES` simulated CPU devices, joins the run with
`jax.distributed.initialize` (CPU collectives over gloo) and runs the checks on the global
mesh of all 8 devices. With NUM_PROCESSES = 1 it is the single-process run of the same
program. Each check prints one JSON line `{"check": ..., "process": ..., "tokens": ...}`;
the test compares the lines of every process with the single-process ones.
"""

from __future__ import annotations

import os
import sys

_PROCESS_ID, _NUM_PROCESSES, _PORT = (int(x) for x in sys.argv[1:4])
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           f" --xla_force_host_platform_device_count={8 // _NUM_PROCESSES}")
os.environ["JAX_PLATFORMS"] = "cpu"

# pylint: disable=g-import-not-at-top,wrong-import-position
import faulthandler
import json
import traceback

import jax

jax.config.update("jax_cpu_collectives_implementation", "gloo")
if _NUM_PROCESSES > 1:
  jax.distributed.initialize(f"localhost:{_PORT}", _NUM_PROCESSES, _PROCESS_ID,
                             initialization_timeout=120)

import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

import kvattn
from kvattn import sharding
from kvattn.caches import checkpoint
from kvattn.caches import sharded as sharded_caches
from kvattn.inference import generation
from kvattn.models import transformer
from flax import nnx

BATCH, MAX_LEN, NEW_TOKENS, PAGE_SIZE = 4, 32, 4, 4


def make_model_fn(num_kv_heads: int = 2):
  """A one-layer GQA model constructor (N = 8 heads of 16)."""
  cfg = transformer.model_config(d_model=48, num_layers=1, mlp_dim=96, attention=dict(
      num_heads=8, num_kv_heads=num_kv_heads, head_dim=16))
  return lambda: transformer.Transformer.from_config(cfg, rngs=nnx.Rngs(0))


def _host(x) -> list:
  """A global array's values on every process."""
  return np.asarray(multihost_utils.process_allgather(x, tiled=True)).tolist()


def _prompts():
  rng = np.random.default_rng(1)
  return rng.integers(0, 259, (BATCH, 6)).astype(np.int32), np.array([6, 3, 1, 5], np.int32)


def check_generate(kind: str, mesh) -> dict:
  """Sharded `generate` with caches from `cache_factory` and with prebuilt
  `sharded.init_caches`: tokens of both ways, and of the unsharded model on one device."""
  make = make_model_fn(2)
  prompts, lengths = _prompts()
  with jax.default_device(jax.local_devices()[0]):
    want, _ = kvattn.generate(make(), prompts, lengths, NEW_TOKENS)
  model = sharding.shard_model(make, mesh)
  options = dict(page_size=PAGE_SIZE, kind=kind)
  factory = sharded_caches.cache_factory(model, mesh, **options)
  by_factory, _ = kvattn.generate(model, prompts, lengths, NEW_TOKENS, cache_factory=factory)
  caches = sharded_caches.init_caches(model, BATCH, 16, mesh,
                                      **options)
  prebuilt, _ = kvattn.generate(model, prompts, lengths, NEW_TOKENS, caches=caches)
  return dict(reference=np.asarray(want).tolist(), tokens=_host(by_factory),
              prebuilt=_host(prebuilt))


def check_batcher(mesh) -> dict:
  """`ContinuousBatcher` with the prefix cache on the global mesh: 6 requests sharing a
  prefix on 2 slots; tokens per request and the prefix hits."""
  make = make_model_fn(2)
  rng = np.random.default_rng(2)
  shared = rng.integers(3, 259, 8).tolist()
  requests = [(i, shared + rng.integers(3, 259, 1 + i % 3).tolist(), 3) for i in range(6)]
  opts = dict(num_slots=2, num_pages=32, page_size=PAGE_SIZE, max_len=24, max_prompt_len=16,
              prefix_cache=True)
  with jax.default_device(jax.local_devices()[0]):
    single = kvattn.ContinuousBatcher(make(), **opts)
    want = single.run(requests)
  batcher = kvattn.ContinuousBatcher(make(), mesh=mesh, **opts)
  got = batcher.run(requests)
  return dict(reference=[[int(t) for t in want[i].tokens] for i in sorted(want)],
              tokens=[[int(t) for t in got[i].tokens] for i in sorted(got)],
              prompt_tokens=sum(len(r[1]) for r in requests),
              prefill_tokens=int(batcher.stats()["prefill_tokens"]),
              reference_prefill_tokens=int(single.stats()["prefill_tokens"]))


def check_checkpoint(mesh, directory: str) -> dict:
  """Save sharded caches after a prefill on the global mesh and restore them: every leaf
  equal, and the restored caches keep the mesh placement."""
  make = make_model_fn(2)
  model = sharding.shard_model(make, mesh)
  prompts, lengths = _prompts()
  caches = sharded_caches.init_caches(model, BATCH, MAX_LEN, mesh, kind="dense")
  _, caches, _ = generation.prefill(model, prompts, lengths, caches)
  path = os.path.join(directory, "caches")
  checkpoint.save_caches(path, caches)
  like = sharded_caches.init_caches(model, BATCH, MAX_LEN, mesh, kind="dense")
  restored = checkpoint.restore_caches(path, like)
  leaves = jax.tree.leaves(caches)
  back = jax.tree.leaves(restored)
  same = all(_host(a) == _host(b) for a, b in zip(leaves, back, strict=True))
  placed = all(b.sharding.is_equivalent_to(a.sharding, a.ndim)
               for a, b in zip(jax.tree.leaves(like), back, strict=True))
  return dict(tokens=_host(caches[0].lengths), leaves_equal=same, placement_kept=placed)


CHECKS = {
    "generate_dense": lambda mesh, d: check_generate("dense", mesh),
    "generate_paged": lambda mesh, d: check_generate("paged", mesh),
    "batcher": lambda mesh, d: check_batcher(mesh),
    "checkpoint": check_checkpoint,
}


def main() -> int:
  faulthandler.dump_traceback_later(int(os.environ.get("KVATTN_WORKER_TIMEOUT", "300")),
                                    exit=True)  # a hung collective: print where, exit 1
  names = sys.argv[4].split(",")
  directory = sys.argv[5] if len(sys.argv) > 5 else "."
  mesh = sharding.make_mesh((2, 2, 2))
  failed = 0
  for name in names:
    try:
      result = dict(check=name, process=jax.process_index(), ok=True, **CHECKS[name](mesh,
                                                                                   directory))
    except Exception:  # pylint: disable=broad-except
      result = dict(check=name, process=jax.process_index(), ok=False,
                    error=traceback.format_exc()[-3000:])
      failed += 1
    print(json.dumps(result), flush=True)
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
