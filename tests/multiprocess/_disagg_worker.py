"""One worker of a disaggregated run on localhost, for tests/multiprocess/test_disaggregated.py.

    python -m tests.multiprocess._disagg_worker ROLE DIR KIND[,KIND...]

ROLE `prefill` prefills a prompt per KIND into its paged caches and offers the pages over its
transfer server (handshake files in DIR); ROLE `decode` pulls them into its own pool (other
page ids), decodes, and prints one JSON line per KIND with its tokens and those of one
`generate` with the same kind. The two are independent JAX runtimes (no `jax.distributed`).
"""

from __future__ import annotations

import os
import sys

os.environ["JAX_PLATFORMS"] = "cpu"

# pylint: disable=g-import-not-at-top,wrong-import-position
import faulthandler
import json
import traceback

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import kvattn
from kvattn.caches import registry
from kvattn.inference import disaggregated as dg
from kvattn.inference import generation
from kvattn.models import transformer

PROMPT, NEW_TOKENS = 21, 6
KINDS = {  # name -> (cache spec, dtype); page_size 4 puts the prompt on 6 pages (KIVI: 3)
    "f32": ({"kind": "paged", "page_size": 4}, jnp.float32),
    "bf16": ({"kind": "paged", "page_size": 4}, jnp.bfloat16),
    "int8": ({"kind": "paged", "page_size": 4}, jnp.int8),
    "kivi2": ({"kind": "paged_kivi2", "page_size": 4, "group_size": 4, "residual": 8},
              jnp.float32),
    "kivi4": ({"kind": "paged_kivi4", "page_size": 4, "group_size": 4, "residual": 8},
              jnp.float32),
}


def make_model():
  """The one-layer GQA model of tests/multiprocess/_worker.py (N = 8 heads of 16, K = 2)."""
  cfg = transformer.model_config(d_model=48, num_layers=1, mlp_dim=96, attention=dict(
      num_heads=8, num_kv_heads=2, head_dim=16))
  return transformer.Transformer.from_config(cfg, rngs=nnx.Rngs(0))


def _caches(model, kind: str, seed: int):
  spec, dtype = KINDS[kind]
  max_len = PROMPT + NEW_TOKENS - 1
  return registry.build_caches(model, 1, max_len, dtype, dict(spec, seed=seed),
                               tokens_per_seq=[max_len])


def _prompt():
  return np.random.default_rng(3).integers(3, 259, (1, PROMPT)).astype(np.int32)


def prefill(directory: str, kinds: list[str]) -> list[dict]:
  model, server, rdv = make_model(), dg.start_server(), dg.Rendezvous(directory)
  out = []
  for uuid, kind in enumerate(kinds, 1):
    caches = _caches(model, kind, seed=1)
    first, caches, _ = generation.prefill(model, _prompt(), np.array([PROMPT]), caches)
    seq = dg.gather_sequence(caches, 0)
    pages = np.asarray(caches[0].block_tables)[0, :dg.stored_pages(caches[0], 0)].tolist()
    dg.offer_sequence(server, rdv, uuid, seq, first_token=int(first[0]), pages=pages)
    rdv.wait_done(uuid, timeout_s=300)
    out.append(dict(kind=kind, role="prefill", ok=True, pages=pages))
  return out


def decode(directory: str, kinds: list[str]) -> list[dict]:
  model, server, rdv = make_model(), dg.start_server(), dg.Rendezvous(directory)
  out = []
  for uuid, kind in enumerate(kinds, 1):
    want, _ = kvattn.generate(model, _prompt(), np.array([PROMPT]), NEW_TOKENS,
                              caches=_caches(model, kind, seed=1))
    caches = _caches(model, kind, seed=7)  # a shuffled free list: other page ids
    offer = rdv.wait_offer(uuid, timeout_s=300)
    seq = dg.pull_sequence(server, offer, caches, timeout_s=120)
    rdv.done(uuid)
    caches = dg.install_sequence(caches, seq, 0)
    pages = np.asarray(caches[0].block_tables)[0, :offer["num_pages"]].tolist()
    tokens, _, _ = generation.decode(model, np.array([offer["first_token"]]), caches,
                                     NEW_TOKENS)
    out.append(dict(kind=kind, role="decode", ok=True, tokens=np.asarray(tokens).tolist(),
                    reference=np.asarray(want).tolist(), pages=pages,
                    prefill_pages=offer["pages"], nbytes=offer["nbytes"]))
  return out


def main() -> int:
  faulthandler.dump_traceback_later(int(os.environ.get("KVATTN_WORKER_TIMEOUT", "300")),
                                    exit=True)  # a hung pull: print where, exit 1
  role, directory, kinds = sys.argv[1], sys.argv[2], sys.argv[3].split(",")
  try:
    rows = {"prefill": prefill, "decode": decode}[role](directory, kinds)
  except Exception:  # pylint: disable=broad-except
    print(json.dumps(dict(role=role, ok=False, error=traceback.format_exc()[-3000:])),
          flush=True)
    return 1
  for row in rows:
    print(json.dumps(row), flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
