"""Scaffolding shared by the kernel tests in tests/pallas_kernels (JAX, numpy, pytest only).

* `KernelTest`: base of the test classes whose cases run the kernel compiled
  (GPU/TPU; skipped on CPU) and, in an `...Interpret` subclass setting
  `INTERPRET = True`, with the Pallas interpreter on CPU. On a GPU,
  `pytest -k "not Interpret"` selects the compiled cases only.
  `fast_when_interpreted` keeps a subset of a case list in the default
  interpreted selection (the rest is `slow` there, default when compiled).
* dtype-dependent tolerances and comparisons against the f32 references;
* length vectors covering a grid of edges;
* per-vector absmax quantization (as kvattn.ops.quantize_kv) and garbage for
  the unused slots of a quantized cache;
* the table-driven check of argument errors;
* `jitted`: a reference or XLA path compiled as one program.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import attention_common

# Tolerances against the f32 reference, by the dtype the kernel computes in: the kernel
# rounds q to the cache dtype and the probabilities to it before the PV dot (as flash
# kernels do).
TOL = {jnp.float32: 2e-5, jnp.bfloat16: 3e-2, jnp.float16: 4e-3}
DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16, "f16": jnp.float16}
COMPILED_PLATFORMS = ("gpu", "cuda", "rocm", "tpu")
# Quantized storage formats by short name: (dtype, largest finite value a token's absmax
# maps onto), from the one list (`attention_common.FORMAT_MAX`).
FORMATS = {dtype.name.replace("float8_", "").replace("fn", ""): (dtype, top)
           for dtype, top in attention_common.FORMAT_MAX.items()}


def lengths_sets(batch, edges):
  """Length vectors (`i32[batch]`) that together cover every edge."""
  if batch == 1:
    return [np.array([e], np.int32) for e in edges]
  edges = tuple(edges)
  return [np.array((edges[i:] + edges)[:batch], np.int32) for i in range(0, len(edges), batch)]


def close(actual, expected, dtype, what=""):
  tol = TOL[dtype]
  np.testing.assert_allclose(np.asarray(actual, np.float32), np.asarray(expected, np.float32),
                             atol=tol, rtol=tol, err_msg=what)


def close_lse(actual, expected, dtype):
  """Same -inf rows (nothing attended); finite entries within the dtype's tolerance
  (lse is f32 in both; the kernel's logits use q rounded to the dot dtype)."""
  actual, expected = np.asarray(actual), np.asarray(expected)
  np.testing.assert_array_equal(np.isneginf(actual), np.isneginf(expected))
  fin = np.isfinite(expected)
  np.testing.assert_allclose(actual[fin], expected[fin], atol=4 * TOL[dtype], rtol=TOL[dtype])


class KernelTest:
  """Compiled kernel (GPU/TPU); a subclass with `INTERPRET = True` runs it on CPU."""

  INTERPRET = False

  @pytest.fixture(autouse=True)
  def _backend(self):
    if not self.INTERPRET and jax.default_backend() not in COMPILED_PLATFORMS:
      pytest.skip("compiled Pallas kernels need a GPU or TPU")

  def _schedule(self, schedule):
    """`schedule` when interpreting; compiled, only the backend's own (else skip)."""
    if self.INTERPRET:
      return schedule
    native = "grid" if jax.default_backend() == "tpu" else "loop"
    if schedule != native:
      pytest.skip(f"schedule {schedule!r} does not compile on {jax.default_backend()}")
    return schedule

  def _require(self, reason):
    """Skips a compiled case the backend does not support (`unsupported_reason(...)`)."""
    if not self.INTERPRET and reason is not None:
      pytest.skip(reason)


def fast_when_interpreted(cases, fast):
  """`cases` as pytest params, all but those in `fast` marked `slow_when_interpreted`
  (see tests/pallas_kernels/conftest.py): the default selection interprets only
  `fast` on CPU and compiles every case on a GPU/TPU."""
  return [case if case in fast else pytest.param(case, marks=pytest.mark.slow_when_interpreted)
          for case in cases]


def assert_errors(call, cases, valid_args):
  """Each `(error, message, args, kwargs)` case raises `error` matching `message`;
  on CPU also `interpret=False` with `valid_args` (compiled needs a GPU/TPU)."""
  cases = list(cases)
  if jax.default_backend() == "cpu":
    cases.append((ValueError, "interpret=False needs a GPU or TPU", valid_args,
                  {"interpret": False}))
  for error, message, args, kwargs in cases:
    with pytest.raises(error, match=message):
      call(*args, **kwargs)


def jitted(fn):
  """`fn` (a kernel's `*_reference`, or a kvattn XLA path) under `jax.jit`, its
  non-array keyword arguments static (one compiled program per set of them).

  Run op by op, every new shape compiles each of the function's ops on its
  own: that was most of these tests' runtime, several times the cost of one
  compiled program. (The kernels' own wrappers are jitted already.)
  """
  programs = {}

  def call(*args, **kwargs):
    static = tuple(sorted((k, v) for k, v in kwargs.items() if not hasattr(v, "shape")))
    arrays = {k: v for k, v in kwargs.items() if hasattr(v, "shape")}
    if static not in programs:
      programs[static] = jax.jit(functools.partial(fn, **dict(static)))
    return programs[static](*args, **arrays)

  return call


@functools.partial(jax.jit, static_argnames="name")
def quantize(x, name):
  """Per-vector absmax quantization (as kvattn.ops.quantize_kv): (values, f32 scales)."""
  dtype, top = FORMATS[name]
  absmax = jnp.max(jnp.abs(x), axis=-1)
  scale = jnp.where(absmax > 0, absmax / top, 1.0)
  y = jnp.clip(x / scale[..., None], -top, top)
  if dtype == jnp.int8:
    y = jnp.round(y)
  return y.astype(dtype), scale


def junk(dtype):
  """The worst value a quantized cache can hold: NaN (fp8), -128 (int8, no NaN)."""
  return jnp.asarray(-128 if dtype == jnp.int8 else jnp.nan, dtype)


def poison(values, scales, lengths, window, slot_axis):
  """Garbage (NaN scales; NaN or -128 values) outside `[max(0, L - W), L)` of each row."""
  unused = ~attention_common.decode_mask(lengths, values.shape[slot_axis], window)  # [B, S]
  s_shape = [1] * scales.ndim
  s_shape[0], s_shape[-1] = unused.shape
  v_shape = [1] * values.ndim
  v_shape[0], v_shape[slot_axis] = unused.shape
  return (jnp.where(unused.reshape(v_shape), junk(values.dtype), values),
          jnp.where(unused.reshape(s_shape), jnp.nan, scales))


def check_store_kernel(run, store, poisoned, ref, ref_lse, dtype, shape, tol):
  """A low-bit store kernel: `(out, lse) = run(store)` matches the reference, row 0 (an
  empty range) gives zeros and lse -inf, and garbage in unused slots (`poisoned`)
  changes no bit."""
  out, lse = run(store)
  assert out.dtype == dtype and out.shape == shape
  np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32),
                             atol=tol, rtol=tol)
  close_lse(lse, ref_lse, dtype)
  assert np.all(np.asarray(out[0]) == 0) and np.all(np.isneginf(np.asarray(lse[0])))
  dirty, dirty_lse = run(poisoned)
  np.testing.assert_array_equal(np.asarray(dirty), np.asarray(out))
  np.testing.assert_array_equal(np.asarray(dirty_lse), np.asarray(lse))
