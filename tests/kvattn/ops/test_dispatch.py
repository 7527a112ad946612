"""kvattn/ops/dispatch.py: the backend table, `implementation=` forms, validation once."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvattn import ops
from kvattn.ops import dispatch
from kvattn import _checks
from pallas_kernels import attention_common


def _dense(batch=2, num_heads=4, num_kv=2, capacity=32, head_dim=16, seed=0):
  rng = np.random.RandomState(seed)
  return (jnp.asarray(rng.randn(batch, num_heads, head_dim), jnp.float32),
          jnp.asarray(rng.randn(batch, num_kv, capacity, head_dim), jnp.float32),
          jnp.asarray(rng.randn(batch, num_kv, capacity, head_dim), jnp.float32),
          jnp.array([5, 32], jnp.int32))


def test_table_states_every_backend_and_the_default_order():
  assert {op: ops.available_implementations(op) for op in dispatch.IMPLEMENTATIONS} == {
      "decode_attention": ("pallas", "xla_blocked", "xla"),
      "paged_decode_attention": ("pallas", "xla_pool", "xla"),
      "mla_decode_attention": ("pallas", "xla_blocked", "xla"),
      "kivi_store_decode": ("pallas", "xla"),
      "paged_kivi_store_decode": ("pallas", "xla"),
      "rotated_store_decode": ("pallas", "xla"),
  }
  with pytest.raises(ValueError, match=r"op must be one of \[.*\]; got 'prefill'"):
    ops.available_implementations("prefill")


def _declines(*args, explicit, **options):
  del args, options
  raise NotImplementedError(f"declines (explicit={explicit})")


def test_a_sequence_is_tried_in_order_and_a_name_runs_alone(monkeypatch):
  monkeypatch.setitem(dispatch.IMPLEMENTATIONS, "decode_attention",
                      dict(dispatch.IMPLEMENTATIONS["decode_attention"]))
  ops.register_implementation("decode_attention", "declines", _declines, preferred=True)
  assert ops.available_implementations()[:2] == ("declines", "pallas")
  q, k, v, lengths = _dense()
  xla = ops.decode_attention(q, k, v, lengths, implementation="xla")
  # None: "declines" and then "pallas" (CPU) decline, "xla_blocked" declines 32 slots (<= 256).
  np.testing.assert_array_equal(ops.decode_attention(q, k, v, lengths), xla)
  np.testing.assert_array_equal(
      ops.decode_attention(q, k, v, lengths, implementation=("declines", "xla")), xla)
  # Named in a sequence, a backend runs as when named alone ("xla_blocked" takes f32 then).
  np.testing.assert_allclose(
      ops.decode_attention(q, k, v, lengths, implementation=["declines", "xla_blocked"]), xla,
      rtol=1e-5, atol=1e-5)
  with pytest.raises(NotImplementedError,
                     match=r"no decode_attention implementation fits: declines: declines "
                           r"\(explicit=True\)$"):
    ops.decode_attention(q, k, v, lengths, implementation=("declines",))
  with pytest.raises(NotImplementedError, match=r"^declines \(explicit=True\)$"):
    ops.decode_attention(q, k, v, lengths, implementation="declines")
  ops.register_implementation("decode_attention", "declines", _declines)
  assert ops.available_implementations()[-1] == "declines"


@pytest.mark.parametrize("implementation", [(), ("xla", "cuda"), 3, ("xla", None)])
def test_bad_implementation_is_a_caller_error(implementation):
  q, k, v, lengths = _dense()
  with pytest.raises(ValueError, match=r"implementation must be one of \['pallas', "
                                       r"'xla', 'xla_blocked'\], a sequence of them, or None"):
    ops.decode_attention(q, k, v, lengths, implementation=implementation)


def _count_checks(monkeypatch, name):
  calls = []
  original = getattr(attention_common, name)
  counted = lambda *a, **kw: calls.append(1) or original(*a, **kw)
  monkeypatch.setattr(attention_common, name, counted)  # calls inside the kernels' checks
  monkeypatch.setattr(_checks, name, counted)  # kvattn's calls
  return calls


@pytest.mark.parametrize("implementation", ["xla", "xla_blocked", "pallas"])
def test_dense_arguments_are_checked_once(monkeypatch, implementation):
  calls = _count_checks(monkeypatch, "check_dense_args")
  q, k, v, lengths = _dense()
  ops.decode_attention(q, k, v, lengths, implementation=implementation)
  assert len(calls) == 1


@pytest.mark.parametrize("implementation", ["xla", "xla_pool"])
def test_paged_arguments_are_checked_once(monkeypatch, implementation):
  calls = _count_checks(monkeypatch, "check_paged_args")
  dense_calls = _count_checks(monkeypatch, "check_dense_args")
  q = jnp.ones((2, 4, 8))
  pages = jnp.ones((2, 6, 4, 8))
  tables = jnp.array([[0, 1, 2], [3, 4, -1]], jnp.int32)
  ops.paged_decode_attention(q, pages, pages, tables, jnp.array([9, 5]),
                             implementation=implementation)
  assert (len(calls), len(dense_calls)) == (1, 0)


def test_mla_arguments_are_checked_once(monkeypatch):
  calls = _count_checks(monkeypatch, "check_mla_args")
  rng = np.random.RandomState(0)
  args = [jnp.asarray(rng.randn(*s), jnp.float32)
          for s in ((2, 4, 16), (2, 4, 8), (2, 32, 16), (2, 32, 8))]
  ops.mla_decode_attention(*args, jnp.array([3, 32]), sm_scale=0.2, implementation="xla")
  assert len(calls) == 1


def _mla(batch=2, num_heads=4, capacity=32, latent=16, rope=8, seed=0):
  rng = np.random.RandomState(seed)
  f = lambda *shape: jnp.asarray(rng.randn(*shape), jnp.float32)
  return (f(batch, num_heads, latent), f(batch, num_heads, rope), f(batch, capacity, latent),
          f(batch, capacity, rope))


@pytest.mark.parametrize("op", ["decode_attention", "paged_decode_attention",
                                "mla_decode_attention"])
@pytest.mark.parametrize("bad,match", [(-1, r"lengths\[1\] = -1"), (33, r"lengths\[1\] = 33")])
def test_eager_lengths_outside_the_capacity_raise_naming_the_row(op, bad, match):
  lengths = jnp.array([5, bad], jnp.int32)
  if op == "decode_attention":
    q, k, v, _ = _dense()
    call = lambda lengths: ops.decode_attention(q, k, v, lengths)
  elif op == "mla_decode_attention":
    args = _mla()
    call = lambda lengths: ops.mla_decode_attention(*args, lengths, sm_scale=0.25)
  else:  # 4 pages of 8 slots per row: capacity 32, as the dense cache
    q, pages = jnp.ones((2, 4, 16)), jnp.ones((2, 8, 8, 16))
    tables = jnp.arange(8, dtype=jnp.int32).reshape(2, 4)
    call = lambda lengths: ops.paged_decode_attention(q, pages, pages, tables, lengths)
  with pytest.raises(ValueError, match=match) as error:
    call(lengths)
  assert "[0, 32]" in str(error.value)
  # Under jit the documented behaviour stays: a negative length reads nothing (zeros), one
  # past the capacity reads the whole cache (an overflowed row), no error.
  out = np.asarray(jax.jit(call)(lengths))
  want = np.zeros_like(out[1]) if bad < 0 else np.asarray(call(jnp.array([5, 32])))[1]
  np.testing.assert_allclose(out[1], want, rtol=1e-6, atol=1e-6)
