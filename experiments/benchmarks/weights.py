r"""How fast XLA:CPU streams a decode step's weights, by storage dtype and dot form.

    python -m experiments.benchmarks.weights                  # batch 1 and 8, default XLA flags
    python -m experiments.benchmarks.weights --flag_sets=",--xla_cpu_use_xnnpack=true"
    python -m experiments.benchmarks.weights --decode_floor --batches=1,8   # the step vs its weights

A decode step multiplies a few activation rows (one per sequence) by every
weight matrix, so it is bound by how fast the weights are read. Issue 15 asks
for bf16 weights (half the bytes of f32) to decode faster on CPU. This script
measures, on weights shaped like SmolLM2-135M's MLP (30 layers of `f32[576,
3072]`, 212 MB in f32: more than any cache level, as in a real step), one
`lax.fori_loop` over the layers per call, each layer `h += (h @ W[l])[:, :576]`,
for each form:

  f32_dot           W stored f32, `h @ W`: what the model runs today
  bf16_dot          W stored bf16, `dot(bf16(h), W, preferred_element_type=f32)`
  bf16_convert      W stored bf16, `h @ W.astype(f32)` (XLA materialises the f32 copy)
  bf16_bits_reduce  W stored as the u16 bits of bf16, transposed `[l, 3072, 576]`;
                    `sum(h[:, None, :] * f32(bits << 16), -1)`: the widening is
                    a shift XLA fuses into the multiply-reduce loop, so the f32
                    weights are never written

and prints one JSON line per (form, batch) with `ms` (best of `--repeats`
samples of `--calls` back-to-back calls), `weight_gbps` (stored weight bytes /
time, 1e9 B/s), `of_read` (that over the read bandwidth of a jitted f32 sum of
the same bytes measured in the same process, `timing.read_bandwidth`), and
`vs_f32_dot` (this form's time over f32_dot's at the same batch; < 1 is
faster). All forms agree with f32_dot within bf16 rounding (checked, not
timed). Each entry of `--flag_sets` runs in its own subprocess with that
`XLA_FLAGS` (XLA reads it once per process), so ratios across flag sets come
from back-to-back processes, not one.

`--decode_floor` instead compares, in one process, kvattn's decode step on
SmolLM2-135M's shapes (random weights, f32, `bench_real.ours`, a `--prompt_len`
prompt then 16 tokens; best of 3 runs) with the same weights' matmuls alone:
per layer the fused q/k/v, o, gate/up and down projections of the batch's rows,
then the tied LM head, in one `fori_loop` (`weights_floor_ms`; no attention, no
norms, no cache). `step_ms - weights_floor_ms` bounds what attention, norms and
the cache cost; `floor_gbps` is the weight bytes over the floor's time.

Raises (one line on stderr and exit 2, `experiments.framework.cli`): `--batches` not positive integers.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Callable, Sequence

from absl import app
from absl import flags
import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

from experiments.benchmarks import real as bench_real
from experiments.framework import cli
from experiments.framework import timing
from experiments.evals import models

FLAGS = flags.FLAGS
D_MODEL, D_OUT, LAYERS = 576, 3072, 30  # SmolLM2-135M: d_model, 2 x intermediate, layers
FORMS = ("f32_dot", "bf16_dot", "bf16_convert", "bf16_bits_reduce")


def _define_flags() -> None:
  flags.DEFINE_list("batches", ["1", "8"], "Activation rows (sequences decoded at once).")
  flags.DEFINE_integer("repeats", 5, "Timed samples per form and batch (best is kept).")
  flags.DEFINE_integer("calls", 5, "Back-to-back calls per sample.")
  flags.DEFINE_list("flag_sets", [""], "XLA_FLAGS values, one subprocess each ('' = default).")
  flags.DEFINE_bool("decode_floor", False, "Compare kvattn's decode step with its weights' "
                    "matmuls alone (module doc) instead of the weight forms.")
  flags.DEFINE_integer("prompt_len", 512, "With --decode_floor: prompt tokens before decoding.")
  flags.DEFINE_bool("child", False, "Internal: measure in this process and print JSON lines.")


def _up(bits: jax.Array) -> jax.Array:
  """bf16 bit patterns (u16) -> the same values in f32: bf16 is the top half of an f32."""
  return lax.bitcast_convert_type(bits.astype(jnp.uint32) << 16, jnp.float32)


def make_forms(w32: np.ndarray) -> dict[str, tuple[Callable, jax.Array]]:
  """`{form: (layer matmul h f32[M, D] x stored W -> f32[M, D_OUT], stored weights)}`."""
  w16 = jnp.asarray(w32, jnp.bfloat16)
  bits_t = lax.bitcast_convert_type(jnp.swapaxes(w16, 1, 2), jnp.uint16)
  return {
      "f32_dot": (lambda h, w: h @ w, jnp.asarray(w32)),
      "bf16_dot": (lambda h, w: jnp.dot(h.astype(jnp.bfloat16), w,
                                        preferred_element_type=jnp.float32), w16),
      "bf16_convert": (lambda h, w: h @ w.astype(jnp.float32), w16),
      "bf16_bits_reduce": (lambda h, w: jnp.sum(h[:, None, :] * _up(w)[None], axis=-1), bits_t),
  }


def stack(matmul: Callable) -> Callable:
  """Jitted `h -> h` through all layers: `h += (h @ W[l])[:, :D_MODEL]` for l = 0..L-1."""
  def run(h, w):
    return lax.fori_loop(0, w.shape[0], lambda i, x: x + matmul(x, w[i])[:, :D_MODEL], h)
  return jax.jit(run)


def measure(batches: Sequence[int], calls: int, repeats: int) -> list[dict]:
  """One record per (form, batch), forms timed round-robin within each batch."""
  rng = np.random.default_rng(0)
  w32 = (rng.standard_normal((LAYERS, D_MODEL, D_OUT), np.float32) / np.sqrt(D_MODEL))
  forms = make_forms(w32)
  fns = {name: stack(mm) for name, (mm, _) in forms.items()}
  read = timing.read_bandwidth(w32.nbytes)
  records = []
  for batch in batches:
    h = jnp.asarray(rng.standard_normal((batch, D_MODEL), np.float32) * 0.1)
    want = np.asarray(fns["f32_dot"](h, forms["f32_dot"][1]))
    timers = {name: timing.Timer(fns[name], h, w, calls=calls) for name, (_, w) in forms.items()}
    for timer in timers.values():
      timer.warm()
    timing.round_robin(timers.values(), repeats)
    best = {name: min(timer.samples) for name, timer in timers.items()}
    for name, (_, w) in forms.items():
      got = np.asarray(fns[name](h, w))
      err = float(np.max(np.abs(got - want)) / np.max(np.abs(want)))
      records.append(dict(
          form=name, batch=batch, weight_dtype=str(w.dtype), weight_bytes=int(w.nbytes),
          ms=best[name] * 1e3, weight_gbps=w.nbytes / best[name] / 1e9,
          of_read=w.nbytes / best[name] / read, read_gbps=read / 1e9,
          vs_f32_dot=best[name] / best["f32_dot"], max_rel_err=err,
          xla_flags=os.environ.get("XLA_FLAGS", "")))
      if name != "f32_dot" and err > 0.05:
        raise AssertionError(f"{name} disagrees with f32_dot: max relative error {err:.3g}")
  return records


def decode_floor(batch: int, prompt_len: int, repeats: int) -> dict:
  """kvattn's decode step on SmolLM2's shapes vs its weights' matmuls alone (module doc)."""
  model, _ = models.load_model("smollm2-135m-instruct", random_weights=True)
  new_tokens = 16
  prompts = np.random.default_rng(0).integers(0, 40000, (batch, prompt_len)).astype(np.int32)
  run = bench_real.ours(model, prompts, new_tokens, jnp.float32)
  run()
  step = min(run().decode_s for _ in range(3)) / (new_tokens - 1)
  spec = model.spec
  d, f, layers = spec.d_model, spec.mlp_dim, spec.num_layers
  att = spec.attention
  hq, hkv = att.num_heads * att.head_dim, att.num_kv_heads * att.head_dim
  rng = np.random.default_rng(1)
  weights = [jnp.asarray(rng.standard_normal((layers,) + shape, np.float32) * 0.02)
             for shape in [(d, hq + 2 * hkv), (hq, d), (d, 2 * f), (f, d)]]
  table = jnp.asarray(rng.standard_normal((spec.vocab_size, d), np.float32) * 0.02)

  @jax.jit
  def floor(x, weights, table):
    def layer(i, h):
      h = h + (h @ weights[0][i])[:, :hq] @ weights[1][i]
      gate_up = h @ weights[2][i]
      return h + (jax.nn.silu(gate_up[:, :f]) * gate_up[:, f:]) @ weights[3][i]
    return jnp.einsum("bd,vd->bv", lax.fori_loop(0, layers, layer, x), table)

  x = jnp.full((batch, d), 0.01, jnp.float32)
  nbytes = sum(w.nbytes for w in weights) + table.nbytes
  timer = timing.Timer(floor, x, weights, table, calls=10)
  timer.warm()
  timing.round_robin([timer], repeats)
  floor_s = min(timer.samples)
  read = timing.read_bandwidth(nbytes)
  return dict(batch=batch, prompt_len=prompt_len, step_ms=step * 1e3,
              weights_floor_ms=floor_s * 1e3, floor_share=floor_s / step,
              weight_bytes=int(nbytes), floor_gbps=nbytes / floor_s / 1e9,
              floor_of_read=nbytes / floor_s / read, read_gbps=read / 1e9,
              xla_flags=os.environ.get("XLA_FLAGS", ""))


def main(argv: Sequence[str]) -> None:
  """Prints the JSON lines and table of the module doc.

  Raises:
    app.UsageError: `--batches` not positive integers (one line, exit status 2).
    subprocess.CalledProcessError: a `--flag_sets` child failed (e.g. XLA rejected a flag).
  """
  del argv
  try:
    batches = [int(b) for b in FLAGS.batches]
  except ValueError:
    raise app.UsageError(f"--batches must be integers; got {FLAGS.batches}") from None
  if any(b < 1 for b in batches):
    raise app.UsageError(f"--batches must be positive; got {batches}")
  if FLAGS.decode_floor:
    for batch in batches:
      print(json.dumps(decode_floor(batch, FLAGS.prompt_len, FLAGS.repeats)), flush=True)
    return
  if FLAGS.child:
    for record in measure(batches, FLAGS.calls, FLAGS.repeats):
      print(json.dumps(record), flush=True)
    return
  rows = []
  for flag_set in FLAGS.flag_sets:
    env = {**os.environ, "XLA_FLAGS": flag_set}
    out = subprocess.run(
        [sys.executable, "-m", "experiments.benchmarks.weights", "--child",
         f"--batches={','.join(map(str, batches))}", f"--calls={FLAGS.calls}",
         f"--repeats={FLAGS.repeats}"], env=env, check=True, capture_output=True, text=True)
    for line in out.stdout.splitlines():
      if line.startswith("{"):
        print(line, flush=True)
        rows.append(json.loads(line))
  print("\n| XLA_FLAGS | batch | form | stored | ms | weight GB/s | of read bw | vs f32_dot |")
  print("|---|---:|---|---|---:|---:|---:|---:|")
  for r in rows:
    print(f"| {r['xla_flags'] or 'default'} | {r['batch']} | {r['form']} | {r['weight_dtype']} | "
          f"{r['ms']:.1f} | {r['weight_gbps']:.1f} | {r['of_read']:.2f} | {r['vs_f32_dot']:.2f}x |")


if __name__ == "__main__":
  _define_flags()
  cli.run(main)
