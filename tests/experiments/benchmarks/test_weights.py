"""experiments/benchmarks/weights.py: every weight form computes the f32 stack's result."""

import jax.numpy as jnp
import numpy as np

from experiments.benchmarks import weights as bench_weights


def test_bits_widen_exactly_to_the_bf16_values():
  x = jnp.asarray([0.0, -0.0, 1.0, -2.5, 3.1415, 1e-30, np.inf, -np.inf], jnp.bfloat16)
  bits = jnp.asarray(np.asarray(x).view(np.uint16))
  np.testing.assert_array_equal(np.asarray(bench_weights._up(bits)), np.asarray(x, np.float32))


def test_every_form_matches_the_f32_stack_within_bf16_rounding():
  rng = np.random.default_rng(0)
  layers, d_in = 3, bench_weights.D_MODEL
  w32 = rng.standard_normal((layers, d_in, d_in + 8), np.float32) / np.sqrt(d_in)
  forms = bench_weights.make_forms(w32)
  assert set(forms) == set(bench_weights.FORMS)
  h = jnp.asarray(rng.standard_normal((2, d_in), np.float32))
  # Hand-computed reference of the stack: h += (h @ W[l])[:, :d_in], in f64.
  want = np.asarray(h, np.float64)
  for l in range(layers):
    want = want + (want @ w32[l].astype(np.float64))[:, :d_in]
  for name, (matmul, w) in forms.items():
    got = np.asarray(bench_weights.stack(matmul)(h, w))
    tol = 1e-4 if name == "f32_dot" else 3e-2  # bf16 weights: 8 mantissa bits
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol * np.abs(want).max(), err_msg=name)
  assert forms["bf16_bits_reduce"][1].dtype == jnp.uint16
  assert forms["bf16_dot"][1].nbytes * 2 == forms["f32_dot"][1].nbytes
