"""int8 weights as stored (packed uint8, u8 x s8 dots) against the same int8 values in the
previous layout (int8 [in, out], s8 x s8 dots), interleaved in one process (issue 31).

    python -m experiments.benchmarks.int8_layout --steps=64 --rounds=5

SmolLM2-135M-Instruct, batch 1, a 512-token prompt, --steps greedy decode steps through
generate's compiled loop, then prefill of the prompt; every round times each model once.
Prints whether the two decode the same tokens, wall and process-CPU times per step / token,
and the per-round ratios (docs/benchmarks.md, issue 31, second round).
"""

import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from experiments.framework import cli
import kvattn
from kvattn.inference import generation as g
from kvattn.models import int8


def main(argv=None) -> None:
  """Prints the packed vs unpacked int8 timings (module doc); `argv`: the flags (--steps,
  --rounds), else `sys.argv`."""
  parser = cli.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--steps", type=int, default=64, help="greedy decode steps per sample")
  parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds")
  args = parser.parse_args(argv)
  STEPS, ROUNDS, P = args.steps, args.rounds, 512  # pylint: disable=invalid-name
  model, tok = kvattn.from_pretrained("smollm2-135m-instruct", param_dtype="int8")
  models = {"packed u8 (new)": model, "unpacked s8 (old)": int8.unpacked_model(model)}
  prompts = jnp.asarray(np.random.RandomState(0).randint(100, 20000, (1, P)), jnp.int32)
  lens = jnp.array([P], jnp.int32)
  state = {}
  for k, m in models.items():
    caches = m.init_caches(1, P + STEPS + 8)
    first, caches, rng = g.prefill(m, prompts, lens, caches)
    gd, st = nnx.split(m)
    state[k] = (m, gd, st, caches, first, rng)
  def decode(k):
    m, gd, st, caches, first, rng = state[k]
    c = jax.tree.map(lambda x: x.copy(), caches)
    toks, _, _ = g._decode(gd, st, c, first, rng, sampling=g.Sampling(), max_new_tokens=STEPS + 1, eos_id=None, pad_id=np.int32(0))
    return toks
  def prefill(k):
    m = state[k][0]
    return g.prefill(m, prompts, lens, m.init_caches(1, P + STEPS + 8))[0]
  outs = {k: np.asarray(decode(k)) for k in models}
  print("tokens identical:", np.array_equal(*outs.values()), "first/last:", list(outs.values())[0][0, :6])
  for k in models: prefill(k).block_until_ready()
  res = {("decode", k): [] for k in models}; res.update({("prefill", k): [] for k in models})
  for r in range(ROUNDS):
    for what, f in (("decode", decode), ("prefill", prefill)):
      for k in models:
        t, c = time.perf_counter(), time.process_time(); f(k).block_until_ready()
        res[(what, k)].append((time.perf_counter() - t, time.process_time() - c))
  print("load", os.getloadavg(), "steps", STEPS, "rounds", ROUNDS)
  for (what, k), v in res.items():
    n = STEPS if what == "decode" else P
    unit = "ms/step" if what == "decode" else "ms/token"
    ws = sorted(a for a, _ in v); cs = sorted(b for _, b in v)
    print(f"{what:7s} {k:18s} wall {unit} min {ws[0]/n*1e3:6.2f} median {ws[len(ws)//2]/n*1e3:6.2f}  cpu {unit} median {cs[len(cs)//2]/n*1e3:6.2f}")
  for what in ("decode", "prefill"):
    a, b = res[(what, "packed u8 (new)")], res[(what, "unpacked s8 (old)")]
    print(what, "per-round wall ratio new/old:", [round(x[0] / y[0], 3) for x, y in zip(a, b)],
          "cpu:", [round(x[1] / y[1], 3) for x, y in zip(a, b)])


if __name__ == "__main__":
  cli.run_plain(main)
