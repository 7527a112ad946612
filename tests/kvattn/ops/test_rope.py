"""RoPE: rotate-half convention, relative-position property, validation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvattn import ops


def test_matches_explicit_rotate_half_formula():
  # Llama / HF convention: out = x * cos + rotate_half(x) * sin with
  # rotate_half(x) = [-x2, x1] and cos/sin repeated over both halves.
  H, theta = 8, 500.0
  x = np.asarray(jax.random.normal(jax.random.key(0), (1, 3, 2, H)), np.float64)
  pos = np.array([[0, 5, 1234]])
  inv = theta ** (-np.arange(0, H, 2) / H)
  ang = pos[..., None] * inv  # [1, 3, H/2]
  cos = np.concatenate([np.cos(ang)] * 2, -1)[:, :, None]
  sin = np.concatenate([np.sin(ang)] * 2, -1)[:, :, None]
  rot = np.concatenate([-x[..., H // 2:], x[..., :H // 2]], -1)
  expected = x * cos + rot * sin
  out = ops.apply_rope(jnp.asarray(x, jnp.float32), jnp.asarray(pos), rope_theta=theta)
  np.testing.assert_allclose(np.asarray(out), expected, atol=1e-4)


def test_position_zero_is_identity_and_norm_preserved():
  x = jax.random.normal(jax.random.key(1), (2, 4, 3, 16))
  pos = jnp.zeros((2, 4), jnp.int32)
  np.testing.assert_allclose(np.asarray(ops.apply_rope(x, pos)), np.asarray(x), atol=1e-6)
  pos = jnp.arange(8).reshape(2, 4) * 97
  out = ops.apply_rope(x, pos)
  np.testing.assert_allclose(np.linalg.norm(out, axis=-1), np.linalg.norm(x, axis=-1), rtol=1e-5)


def test_dot_product_depends_only_on_relative_position():
  q = jax.random.normal(jax.random.key(2), (1, 1, 1, 32))
  k = jax.random.normal(jax.random.key(3), (1, 1, 1, 32))

  def score(m, n):
    qm = ops.apply_rope(q, jnp.array([[m]]))
    kn = ops.apply_rope(k, jnp.array([[n]]))
    return float(jnp.sum(qm * kn))

  np.testing.assert_allclose(score(7, 3), score(107, 103), rtol=1e-4)
  np.testing.assert_allclose(score(0, 5), score(20, 25), rtol=1e-4)
  assert abs(score(7, 3) - score(3, 7)) > 1e-3


def test_rank3_input_for_shared_rope_key():
  x = jax.random.normal(jax.random.key(4), (2, 5, 8))  # [B, T, R]
  pos = jnp.arange(10).reshape(2, 5)
  out3 = ops.apply_rope(x, pos)
  out4 = ops.apply_rope(x[:, :, None], pos)[:, :, 0]
  np.testing.assert_allclose(np.asarray(out3), np.asarray(out4), atol=1e-6)


def test_bf16_keeps_dtype():
  x = jnp.ones((1, 2, 1, 4), jnp.bfloat16)
  assert ops.apply_rope(x, jnp.array([[1, 2]])).dtype == jnp.bfloat16


def test_validation():
  x = jnp.ones((1, 2, 1, 4))
  with pytest.raises(ValueError, match=r"positions must have shape x.shape\[:2\]"):
    ops.apply_rope(x, jnp.array([[1, 2, 3]]))
  with pytest.raises(TypeError, match="positions must have an integer dtype"):
    ops.apply_rope(x, jnp.array([[1.0, 2.0]]))
  with pytest.raises(ValueError, match="head_dim must be even for RoPE; got 5"):
    ops.apply_rope(jnp.ones((1, 2, 1, 5)), jnp.array([[1, 2]]))
  with pytest.raises(ValueError, match="rope_theta must be a positive finite float; got -1.0"):
    ops.apply_rope(x, jnp.array([[1, 2]]), rope_theta=-1.0)


# ----------------------------------------------------------------------------------------------
# Context-extension scalings (their values against transformers: tests/kvattn/checkpoints/test_pretrained.py).


def test_linear_scaling_divides_every_frequency():
  plain = np.asarray(ops.rope_frequencies(16, 500.0))
  scaled = ops.rope_frequencies(16, 500.0, ops.RopeScaling("linear", 4.0))
  np.testing.assert_allclose(np.asarray(scaled), plain / 4.0, rtol=1e-6)


def test_llama3_keeps_high_frequencies_divides_low_ones_and_interpolates_between():
  H, theta, old = 16, 10000.0, 64
  s = ops.RopeScaling("llama3", 8.0, original_max_position=old, low_freq_factor=1.0,
                      high_freq_factor=4.0)
  plain = np.asarray(ops.rope_frequencies(H, theta))
  scaled = np.asarray(ops.rope_frequencies(H, theta, s))
  wavelen = 2 * np.pi / plain
  high, low = wavelen < old / 4.0, wavelen > old / 1.0
  assert high.any() and low.any() and (~high & ~low).any()  # all three bands present
  np.testing.assert_allclose(scaled[high], plain[high], rtol=1e-6)
  np.testing.assert_allclose(scaled[low], plain[low] / 8.0, rtol=1e-6)
  mid = ~high & ~low
  smooth = (old / wavelen[mid] - 1.0) / 3.0
  np.testing.assert_allclose(scaled[mid], (1 - smooth) * plain[mid] / 8 + smooth * plain[mid],
                             rtol=1e-5)


def test_yarn_ramps_between_kept_and_interpolated_frequencies_and_scales_cos_sin():
  H, theta, f = 32, 10000.0, 4.0
  s = ops.RopeScaling("yarn", f, original_max_position=64)
  plain = np.asarray(ops.rope_frequencies(H, theta))
  scaled = np.asarray(ops.rope_frequencies(H, theta, s))
  ratio = scaled / plain  # 1 for the fast (kept) dims, 1/f for the slow (interpolated) ones
  assert np.isclose(ratio[0], 1.0) and np.isclose(ratio[-1], 1 / f)
  assert np.all(np.diff(ratio) <= 1e-7)  # monotone ramp in between
  assert s.cos_sin_factor == pytest.approx(0.1 * np.log(f) + 1.0)
  x = jax.random.normal(jax.random.key(5), (1, 3, 2, H))
  out = ops.apply_rope(x, jnp.array([[0, 7, 300]]), scaling=s)
  np.testing.assert_allclose(np.linalg.norm(out, axis=-1),
                             s.cos_sin_factor * np.linalg.norm(x, axis=-1), rtol=1e-5)


@pytest.mark.parametrize("fields, match", [
    (dict(rope_scaling="ntk", rope_factor=2.0), r"rope_scaling must be one of"),
    (dict(rope_scaling="linear"), r"rope_factor must be set"),
    (dict(rope_scaling="llama3", rope_factor=8.0, rope_original_max_position=64,
          rope_low_freq_factor=1.0), r"rope_high_freq_factor must be set"),
    (dict(rope_scaling="linear", rope_factor=2.0, rope_beta_fast=32.0),
     r"rope_beta_fast is not used by rope_scaling 'linear'"),
    (dict(rope_scaling=None, rope_factor=2.0), r"rope_factor is set but rope_scaling is None"),
    (dict(rope_scaling="yarn", rope_factor=-1.0, rope_original_max_position=64),
     r"rope_factor must be a positive finite float"),
    (dict(rope_scaling="llama3", rope_factor=8.0, rope_original_max_position=64,
          rope_low_freq_factor=4.0, rope_high_freq_factor=1.0),
     r"rope_high_freq_factor must exceed rope_low_freq_factor"),
])
def test_bad_rope_scaling_is_named(fields, match):
  with pytest.raises(ValueError, match=match):
    ops.rope_scaling_from_fields(**fields)


@pytest.mark.parametrize("scaling", [None, ops.RopeScaling("yarn", 4.0, original_max_position=64)],
                         ids=["plain", "yarn"])
def test_shift_rope_moves_rotated_keys_to_other_positions(scaling):
  # Keys [B, K, S, H] rotated at their positions, moved back by a per-row shift (the
  # compacted replay cache): equal to rotating at the moved positions, YaRN's magnitude once.
  from kvattn.ops import rope  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.normal(size=(2, 3, 5, 16)), jnp.float32)  # [B, K, S, H]
  pos = jnp.asarray(rng.integers(0, 900, size=(2, 5)), jnp.int32)
  shift = jnp.array([-700, 0], jnp.int32)
  at = lambda p: jnp.moveaxis(ops.apply_rope(jnp.moveaxis(x, 2, 1), p, scaling=scaling), 1, 2)
  moved = rope.shift_rope(at(pos), jnp.broadcast_to(shift[:, None], (2, 3)), scaling=scaling)
  np.testing.assert_allclose(np.asarray(moved), np.asarray(at(pos + shift[:, None])),
                             atol=2e-4, rtol=1e-4)
  np.testing.assert_array_equal(np.asarray(moved[1]), np.asarray(at(pos)[1]))  # shift 0
  with pytest.raises(ValueError, match=r"shift must have shape x.shape\[:2\] = \[B, T\]"):
    rope.shift_rope(x, shift)
  with pytest.raises(TypeError, match="shift"):
    rope.shift_rope(x, jnp.zeros((2, 3), jnp.float32))
