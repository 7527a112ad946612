"""Rotary position embeddings (RoPE, Su et al., arXiv 2104.09864, eq. 34) at explicit
integer positions, in the rotate-half layout of Llama checkpoints (HF
`LlamaRotaryEmbedding`), with the context-extension scalings of transformers'
`modeling_rope_utils` (`RopeScaling`): "linear" (Chen et al. 2023, arXiv 2306.15595),
"llama3" (Llama 3.1 bands) and "yarn" (Peng et al. 2023, arXiv 2309.00071, eq. 17-20).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from kvattn import _checks

ROPE_SCALINGS = ("linear", "llama3", "yarn")


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
  """YaRN's magnitude correction `0.1 * mscale * ln(factor) + 1` (1.0 when factor <= 1)."""
  return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


@dataclasses.dataclass(frozen=True)
class RopeScaling:
  """A context-extension scaling of the RoPE frequencies (`ROPE_SCALINGS`).

  Raises (at construction):
    ValueError: an unknown kind, a non-positive value, a parameter the kind needs
      missing or one it does not use set (naming the keyword).
  """

  kind: str
  factor: float
  original_max_position: int | None = None
  low_freq_factor: float | None = None
  high_freq_factor: float | None = None
  beta_fast: float | None = None
  beta_slow: float | None = None
  attention_factor: float | None = None

  def __post_init__(self):
    if self.kind not in ROPE_SCALINGS:
      raise ValueError(f"rope_scaling must be one of {ROPE_SCALINGS} or None; got {self.kind!r}")
    needs = {"linear": (), "llama3": ("original_max_position", "low_freq_factor",
                                      "high_freq_factor"),
             "yarn": ("original_max_position",)}[self.kind]
    uses = needs + {"yarn": ("beta_fast", "beta_slow", "attention_factor")}.get(self.kind, ())
    _checks.positive_float("rope_factor", self.factor)
    for name in ("original_max_position", "low_freq_factor", "high_freq_factor", "beta_fast",
                 "beta_slow", "attention_factor"):
      value = getattr(self, name)
      if value is None:
        if name in needs:
          raise ValueError(f"rope_{name} must be set for rope_scaling {self.kind!r}")
        continue
      if name not in uses:
        raise ValueError(f"rope_{name} is not used by rope_scaling {self.kind!r}; got {value!r} "
                         f"(set it to None)")
      if name == "original_max_position":
        _checks.positive_int(f"rope_{name}", value)
      else:
        _checks.positive_float(f"rope_{name}", value)
    if self.kind == "llama3" and not self.high_freq_factor > self.low_freq_factor:
      raise ValueError(f"rope_high_freq_factor must exceed rope_low_freq_factor; got "
                       f"{self.high_freq_factor} and {self.low_freq_factor}")

  @property
  def cos_sin_factor(self) -> float:
    """The multiplier of cos and sin (YaRN's attention factor; 1.0 for the other kinds)."""
    if self.kind != "yarn":
      return 1.0
    return yarn_mscale(self.factor) if self.attention_factor is None else self.attention_factor

  def scale(self, inv_freq: np.ndarray, head_dim: int, rope_theta: float) -> np.ndarray:
    """The scaled inverse frequencies `f32[H // 2]` of plain ones `inv_freq`."""
    f = self.factor
    if self.kind == "linear":
      return (inv_freq / f).astype(np.float32)
    if self.kind == "llama3":
      old = self.original_max_position
      low_wavelen, high_wavelen = old / self.low_freq_factor, old / self.high_freq_factor
      wavelen = 2 * math.pi / inv_freq
      scaled = np.where(wavelen > low_wavelen, inv_freq / f, inv_freq)
      smooth = (old / wavelen - self.low_freq_factor) / (
          self.high_freq_factor - self.low_freq_factor)
      smoothed = (1 - smooth) * scaled / f + smooth * scaled
      medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
      return np.where(medium, smoothed, scaled).astype(np.float32)
    # yarn: the dims whose rotations within the original context fall between the betas ramp.
    beta_fast = 32.0 if self.beta_fast is None else self.beta_fast
    beta_slow = 1.0 if self.beta_slow is None else self.beta_slow

    def correction_dim(rotations):
      return (head_dim * math.log(self.original_max_position / (rotations * 2 * math.pi))
              / (2 * math.log(rope_theta)))

    low = max(math.floor(correction_dim(beta_fast)), 0)
    high = min(math.ceil(correction_dim(beta_slow)), head_dim - 1)
    if low == high:
      high += 0.001  # as transformers: avoid a zero-width ramp
    ramp = np.clip((np.arange(head_dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp  # 1: keep the original frequency, 0: interpolate (divide by f)
    return (inv_freq / f * (1 - extrapolation) + inv_freq * extrapolation).astype(np.float32)


def check_scaling(value):
  """`value` if it is a `RopeScaling` or None; TypeError naming `rope_scaling` else."""
  if value is not None and not isinstance(value, RopeScaling):
    raise TypeError(f"rope_scaling must be a kvattn.ops.RopeScaling or None; got {value!r}")
  return value


def rope_scaling_from_fields(rope_scaling: str | None, *, rope_factor: float | None = None,
                             rope_original_max_position: int | None = None,
                             rope_low_freq_factor: float | None = None,
                             rope_high_freq_factor: float | None = None,
                             rope_beta_fast: float | None = None,
                             rope_beta_slow: float | None = None,
                             rope_attention_factor: float | None = None) -> RopeScaling | None:
  """A `RopeScaling` from the attention modules' flat `rope_*` keywords (None: plain RoPE).

  Raises:
    ValueError: as `RopeScaling`; a `rope_*` parameter set without `rope_scaling`.
  """
  params = dict(factor=rope_factor, original_max_position=rope_original_max_position,
                low_freq_factor=rope_low_freq_factor, high_freq_factor=rope_high_freq_factor,
                beta_fast=rope_beta_fast, beta_slow=rope_beta_slow,
                attention_factor=rope_attention_factor)
  if rope_scaling is None:
    set_ = [k for k, v in params.items() if v is not None]
    if set_:
      raise ValueError(f"rope_{set_[0]} is set but rope_scaling is None; got "
                       f"{params[set_[0]]!r}")
    return None
  if rope_factor is None:
    raise ValueError(f"rope_factor must be set for rope_scaling {rope_scaling!r}")
  return RopeScaling(rope_scaling, **params)


def rope_frequencies(head_dim: int, rope_theta: float = 10000.0,
                     scaling: RopeScaling | None = None) -> jax.Array:
  """Inverse frequencies `f32[H // 2]`: theta^(-2i / H) for i in [0, H/2), then `scaling`.

  Raises:
    ValueError: if `head_dim` is not a positive even int or `rope_theta` <= 0.
  """
  head_dim = _checks.positive_int("head_dim", head_dim)
  if head_dim % 2:
    raise ValueError(f"head_dim must be even for RoPE; got {head_dim}")
  rope_theta = _checks.positive_float("rope_theta", rope_theta)
  if scaling is None:
    exponents = jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim
    return 1.0 / (rope_theta ** exponents)
  exponents = np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim)
  inv_freq = (1.0 / (np.float32(rope_theta) ** exponents)).astype(np.float32)
  return jnp.asarray(scaling.scale(inv_freq, head_dim, rope_theta))


def apply_rope(x: jax.Array, positions: jax.Array, *, rope_theta: float = 10000.0,
               scaling: RopeScaling | None = None) -> jax.Array:
  """`x: [B, T, ..., H]` (H even) rotated at `positions: i32[B, T]`, in x's dtype (f32
  inside); `scaling` a `RopeScaling` or None.

  Raises:
    ValueError, TypeError: a non-float x, non-integer positions, positions not of shape
      `x.shape[:2]`.
  """
  _checks.floating("x", x)
  _checks.integer("positions", positions)
  if x.ndim < 3 or positions.shape != x.shape[:2]:
    raise ValueError(
        "positions must have shape x.shape[:2] = [B, T]; got positions "
        f"{tuple(positions.shape)} for x {tuple(x.shape)}")
  factor = 1.0 if scaling is None else scaling.cos_sin_factor
  return _rotate(x, positions, rope_theta, scaling, factor)


def shift_rope(x: jax.Array, shift: jax.Array, *, rope_theta: float = 10000.0,
               scaling: RopeScaling | None = None) -> jax.Array:
  """Vectors already rotated by `apply_rope`, moved by `shift` positions: `x: [B, T, ..., H]`
  rotated at positions p becomes (up to rounding) x rotated at `p + shift[b, t]`
  (`shift: i32[B, T]`, negative moves back), in x's dtype. RoPE is a rotation, so this is
  `apply_rope` at `shift` without YaRN's magnitude factor (applied once, at p).

  Raises:
    ValueError, TypeError: as `apply_rope`.
  """
  _checks.floating("x", x)
  _checks.integer("shift", shift)
  if x.ndim < 3 or shift.shape != x.shape[:2]:
    raise ValueError(f"shift must have shape x.shape[:2] = [B, T]; got shift "
                     f"{tuple(shift.shape)} for x {tuple(x.shape)}")
  return _rotate(x, shift, rope_theta, scaling, 1.0)


def _rotate(x, positions, rope_theta, scaling, factor):
  """`x: [B, T, ..., H]` rotated by `positions: [B, T]` times RoPE's frequencies, then
  `factor` (YaRN's magnitude)."""
  inv_freq = rope_frequencies(x.shape[-1], rope_theta, scaling)  # [H/2]
  angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, H/2]
  angles = angles.reshape(angles.shape[:2] + (1,) * (x.ndim - 3) + angles.shape[-1:])
  cos, sin = jnp.cos(angles), jnp.sin(angles)
  if factor != 1.0:
    cos, sin = cos * factor, sin * factor
  xf = x.astype(jnp.float32)
  x1, x2 = jnp.split(xf, 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x.dtype)
