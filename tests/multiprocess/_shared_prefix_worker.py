"""One worker of a shared prefix cache on localhost, for tests/multiprocess/test_shared_prefix.py.

    python -m tests.multiprocess._shared_prefix_worker ROLE DIR

Both ROLEs (`a`, `b`) run a `ContinuousBatcher` with a `SharedPrefixStore` over DIR, started
at the same time: first both serve the same prompt (both may miss and publish the same pages:
racing writers); then `a` serves a prompt and marks DIR/a.done, and `b`, once the mark is
there, serves another prompt with the same first 3 pages (a hit on `a`'s pages). Each prints
one JSON line: its tokens per prompt, those of one `generate`, and its counters. The two are
independent JAX runtimes (no `jax.distributed`).
"""

from __future__ import annotations

import os
import sys

os.environ["JAX_PLATFORMS"] = "cpu"

# pylint: disable=g-import-not-at-top,wrong-import-position
import faulthandler
import json
import time
import traceback

import jax.numpy as jnp
import numpy as np
from flax import nnx

from kvattn.inference.batching import ContinuousBatcher
from kvattn.inference.generation import generate
from kvattn.models import transformer
from kvattn.paging.shared import SharedPrefixStore, namespace

PS, MAX_PROMPT, MAX_NEW = 4, 16, 4


def make_model():
  cfg = transformer.model_config(d_model=32, num_layers=2, mlp_dim=64,
                                 attention=dict(num_heads=4, num_kv_heads=2, head_dim=8))
  return transformer.Transformer.from_config(cfg, rngs=nnx.Rngs(0))


def prompts() -> dict[str, np.ndarray]:
  """`race` (both workers), `a` and `b` (16 tokens; the same first 13: 3 full pages)."""
  rng = np.random.default_rng(11)
  prefix = rng.integers(3, 250, 13)
  return {"race": rng.integers(3, 250, 16).astype(np.int32),
          "a": np.concatenate([prefix, rng.integers(3, 250, 3)]).astype(np.int32),
          "b": np.concatenate([prefix, rng.integers(3, 250, 3)]).astype(np.int32)}


def reference(model, prompt) -> list[int]:
  padded = np.zeros((1, MAX_PROMPT), np.int32)
  padded[0, :len(prompt)] = prompt
  tokens, _ = generate(model, padded, np.array([len(prompt)], np.int32), MAX_NEW)
  return np.asarray(tokens)[0].tolist()


def run(role: str, directory: str) -> dict:
  model = make_model()
  store = SharedPrefixStore(directory, namespace(model, page_size=PS, dtype=jnp.float32))
  batcher = ContinuousBatcher(model, num_slots=1, num_pages=12, page_size=PS,
                              max_len=MAX_PROMPT + MAX_NEW, max_prompt_len=MAX_PROMPT,
                              prefix_cache=True, offload=store)
  todo = prompts()
  out = {"role": role, "tokens": {}, "reference": {}}
  mark = os.path.join(directory, "a.done")
  for name in ("race", role):
    if name == "b":  # after a's pages are published
      deadline = time.time() + float(os.environ.get("KVATTN_WORKER_TIMEOUT", "300"))
      while not os.path.exists(mark):
        if time.time() > deadline:
          raise TimeoutError(f"worker a did not mark {mark}")
        time.sleep(0.05)
    cached = batcher.allocator.counters["shared_pages"]
    done = batcher.run([(name, todo[name], MAX_NEW)])[name]
    out["tokens"][name] = done.tokens.tolist()
    out["reference"][name] = reference(model, todo[name])
    out[f"shared_pages_{name}"] = batcher.allocator.counters["shared_pages"] - cached
    if name == "a":
      open(mark + ".tmp", "w").close()
      os.replace(mark + ".tmp", mark)
  batcher.allocator.check()
  out["store"] = dict(store.counters)
  out["ok"] = True
  return out


def main() -> int:
  faulthandler.dump_traceback_later(float(os.environ.get("KVATTN_WORKER_TIMEOUT", "300")),
                                    exit=True)
  role, directory = sys.argv[1], sys.argv[2]
  try:
    print(json.dumps(run(role, directory)), flush=True)
  except Exception:  # pylint: disable=broad-except
    print(json.dumps({"role": role, "ok": False, "error": traceback.format_exc()}), flush=True)
    return 1
  return 0


if __name__ == "__main__":
  sys.exit(main())
