"""A rotated codebook KV cache: random Hadamard rotation, then 3- or 4-bit scalar codes per token.

The TurboQuant / QuIP# family (Zandieh et al. 2025, arXiv 2504.19874; Tseng et al. 2024,
arXiv 2402.04396; vLLM's 2-4-bit presets): a fixed random orthogonal rotation spreads each
key's and value's energy evenly over the coordinates, which then look Gaussian, so one scalar
codebook quantizes every coordinate well with one scale per token (no per-channel outliers
left to handle). Here:
"""

from __future__ import annotations

import functools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from kvattn import _checks
from kvattn.caches import _residual
from kvattn.caches import registry
from kvattn.caches._layers import gqa_layers
from kvattn.ops import lowbit

BITS = (3, 4)
CODEBOOKS = ("lloyd-max", "uniform")
SCALE_DTYPES = _residual.SCALE_DTYPES


# ------------------------------------------------------------------------------ codebooks

def _normal_grid():
  x = np.linspace(-8.0, 8.0, 32001)
  w = np.exp(-0.5 * x * x)
  return x, w / w.sum()


def lloyd_max(samples: np.ndarray, bits: int, *, weights: np.ndarray | None = None,
              iters: int = 200, init: np.ndarray | None = None) -> tuple[float, ...]:
  """Lloyd-Max levels (1-D k-means, Lloyd 1982 / Max 1960) of `2^bits` levels for `samples`
  (optionally weighted): alternately cut at the midpoints and move each level to its cell's
  mean. Returns the sorted levels."""
  x = np.asarray(samples, np.float64).ravel()
  w = np.ones_like(x) if weights is None else np.asarray(weights, np.float64).ravel()
  keep = np.isfinite(x)
  x, w = x[keep], w[keep]
  n = 1 << bits
  levels = (np.quantile(x, (np.arange(n) + 0.5) / n) if init is None
            else np.sort(np.asarray(init, np.float64)))
  for _ in range(iters):
    cells = np.searchsorted((levels[1:] + levels[:-1]) / 2, x)
    mass = np.bincount(cells, w, n)
    sums = np.bincount(cells, w * x, n)
    levels = np.where(mass > 0, sums / np.where(mass > 0, mass, 1), levels)
  return tuple(float(v) for v in np.sort(levels))


CODEBOOK_TABLE = {
    ("lloyd-max", 3): (-2.15331, -1.3454, -0.75718, -0.24554, 0.24554, 0.75718, 1.3454, 2.15331),
    ("lloyd-max", 4): (-2.72756, -2.06328, -1.61203, -1.25035, -0.937, -0.65235, -0.38503,
                       -0.1273, 0.1273, 0.38503, 0.65235, 0.937, 1.25035, 1.61203, 2.06328,
                       2.72756),
    ("uniform", 3): (-2.051, -1.465, -0.879, -0.293, 0.293, 0.879, 1.465, 2.051),
    ("uniform", 4): (-2.5125, -2.1775, -1.8425, -1.5075, -1.1725, -0.8375, -0.5025, -0.1675,
                     0.1675, 0.5025, 0.8375, 1.1725, 1.5075, 1.8425, 2.1775, 2.5125),
}
"""The named codebooks for N(0, 1): `compute_codebook`'s result, symmetrised and rounded to
5 decimals (computing them takes seconds; Max 1960's 3-bit table: +-0.2451, 0.7560, 1.344,
2.152)."""


def named_codebook(name: str, bits: int) -> tuple[float, ...]:
  """The codebook `name` ("lloyd-max" or "uniform") of `2^bits` levels (`CODEBOOK_TABLE`)."""
  if (name, bits) not in CODEBOOK_TABLE:
    raise ValueError(f"codebook must be one of {CODEBOOKS} or a tuple of 2^bits increasing "
                     f"floats; got {name!r}")
  return CODEBOOK_TABLE[(name, bits)]


@functools.lru_cache(maxsize=None)
def compute_codebook(name: str, bits: int) -> tuple[float, ...]:
  """Computes the codebook `name` of `2^bits` levels for N(0, 1) on a fine grid: Lloyd-Max
  (`lloyd_max` of the normal density), or the uniform levels of the MSE-optimal step."""
  x, w = _normal_grid()
  n = 1 << bits
  if name == "lloyd-max":
    init = np.linspace(-2.0, 2.0, n)
    return lloyd_max(x, bits, weights=w, iters=500, init=init)
  if name == "uniform":
    best = None
    for step in np.linspace(0.05, 1.5, 1451):  # the MSE-optimal step of a mid-rise quantizer
      levels = (np.arange(n) - (n - 1) / 2) * step
      q = np.clip(np.round(x / step + (n - 1) / 2), 0, n - 1)
      mse = float(np.sum(w * (x - levels[q.astype(int)]) ** 2))
      if best is None or mse < best[0]:
        best = (mse, tuple(float(v) for v in levels))
    return best[1]
  raise ValueError(f"codebook must be one of {CODEBOOKS} or a tuple of 2^bits increasing "
                   f"floats; got {name!r}")


def resolve_codebook(codebook: Any, bits: int) -> tuple[float, ...]:
  """`codebook` as a tuple of `2^bits` increasing finite floats (a name is looked up).

  Raises:
    ValueError: an unknown name, or a sequence of the wrong length / not increasing.
  """
  if isinstance(codebook, str):
    return named_codebook(codebook, bits)
  try:
    levels = tuple(float(v) for v in codebook)
  except TypeError:
    raise ValueError(f"codebook must be one of {CODEBOOKS} or a tuple of 2^bits increasing "
                     f"floats; got {codebook!r}") from None
  arr = np.asarray(levels)
  if len(levels) != 1 << bits or not np.all(np.isfinite(arr)) or np.any(np.diff(arr) <= 0):
    raise ValueError(f"codebook must hold {1 << bits} increasing finite floats for bits = "
                     f"{bits}; got {codebook!r}")
  return levels


# ------------------------------------------------------------------------------ rotation

def _hadamard(n: int) -> np.ndarray:
  h = np.ones((1, 1))
  while h.shape[0] < n:
    h = np.block([[h, h], [h, -h]])
  return h


@functools.lru_cache(maxsize=32)
def rotation(num_kv_heads: int, head_dim: int, seed: int) -> np.ndarray:
  """`f32[K, H, H]`: head k's `diag(signs_k) Had_H / sqrt(H)`, signs from `seed` (orthogonal)."""
  if head_dim & (head_dim - 1):
    raise ValueError(f"head_dim must be a power of two for the Hadamard rotation; got {head_dim}")
  signs = np.random.default_rng(seed).choice([-1.0, 1.0], (num_kv_heads, head_dim))
  return (signs[:, :, None] * _hadamard(head_dim)[None] / np.sqrt(head_dim)).astype(np.float32)


def quantize_rotated(x: jax.Array, codebook: Sequence[float], scale_dtype=jnp.float16
                     ) -> tuple[jax.Array, jax.Array]:
  """`(codes u8[..., H], scale [...])`: per-vector RMS scale (rounded to `scale_dtype`) and
  the nearest level of the sorted `codebook` for each coordinate of `x / scale`. A zero
  vector gets scale 0 (reads back as zeros); a vector with NaN / inf gets NaN scale."""
  xf = x.astype(jnp.float32)
  scale = jnp.sqrt(jnp.mean(xf * xf, axis=-1)).astype(scale_dtype)
  sf = scale.astype(jnp.float32)[..., None]
  y = jnp.where(sf > 0, xf / jnp.where(sf > 0, sf, 1.0), 0.0)
  levels = jnp.asarray(codebook, jnp.float32)
  codes = jnp.searchsorted((levels[1:] + levels[:-1]) / 2, jnp.nan_to_num(y))
  return codes.astype(jnp.uint8), scale


def dequantize_rotated(codes: jax.Array, scale: jax.Array, codebook: Sequence[float]
                       ) -> jax.Array:
  """f32 `codebook[codes] * scale[..., None]`."""
  return jnp.asarray(codebook, jnp.float32)[codes] * scale.astype(jnp.float32)[..., None]


def analytic_bytes_per_token(*, max_len: int, num_kv_heads: int, head_dim: int, bits: int,
                             residual: int, dtype: Any, scale_dtype: Any = "float16") -> float:
  """Bytes per token slot of one layer's rotated cache of capacity `max_len` (module doc)."""
  h, s = head_dim, jnp.dtype(scale_dtype).itemsize
  sq, rb = _residual.store_slots(max_len, residual, 1), _residual.ring_slots(max_len, residual, 1)
  return num_kv_heads * (sq * (2 * h * bits / 8 + 2 * s)
                         + rb * 2 * h * jnp.dtype(dtype).itemsize) / max_len


@struct.dataclass
class RotatedCache(_residual.ResidualStoreCache):
  """Rotated codebook cache of one GQA layer (module doc).

  Attributes:
    k_codes, v_codes: `u8[B, K, Sq, H * bits / 8]` packed codes of the rotated keys / values.
    k_scale, v_scale: `[B, K, Sq]` per-token RMS of the rotated vector (`scale_dtype`).
    k_res, v_res: `[B, K, Rb, H]` the newest `residual` tokens (not rotated), compute dtype.
    lengths: `i32[B]`.
    bits, codebook, seed, residual, max_len: static settings (`group_size` is 1).
  """

  k_codes: jax.Array
  v_codes: jax.Array
  k_scale: jax.Array
  v_scale: jax.Array
  k_res: jax.Array
  v_res: jax.Array
  lengths: jax.Array
  bits: int = struct.field(pytree_node=False, default=4)
  codebook: tuple = struct.field(pytree_node=False, default=())
  seed: int = struct.field(pytree_node=False, default=0)
  group_size: int = struct.field(pytree_node=False, default=1)
  residual: int = struct.field(pytree_node=False, default=0)
  max_len: int = struct.field(pytree_node=False, default=0)
  pre_rope: bool = struct.field(pytree_node=False, default=False)
  rope_theta: float = struct.field(pytree_node=False, default=10000.0)
  rope_scaling: Any = struct.field(pytree_node=False, default=None)

  @classmethod
  def init(cls, batch: int, max_len: int, num_kv_heads: int, head_dim: int,
           dtype=jnp.float32, *, bits: int = 4, codebook: Any = "lloyd-max", seed: int = 0,
           residual: int = 0, scale_dtype: Any = "float16") -> "RotatedCache":
    """An empty cache (`lengths == 0`).

    Args:
      batch, max_len, num_kv_heads, head_dim: B, S, K, H (a power of two, a multiple of 8
        for 3-bit codes).
      dtype: the residual's (compute) dtype, a float dtype.
      bits: 3 or 4.
      codebook: "lloyd-max", "uniform", or `2^bits` increasing floats (module doc).
      seed: the rotation's signs.
      residual: tokens kept in `dtype` (>= 0).
      scale_dtype: "float16", "bfloat16" or "float32".

    Raises:
      ValueError: bad sizes, bits, codebook, residual or scale dtype.
      TypeError: a `dtype` that is not floating.
    """
    batch = _checks.positive_int("batch", batch)
    max_len = _checks.positive_int("max_len", max_len)
    num_kv_heads = _checks.positive_int("num_kv_heads", num_kv_heads)
    head_dim = _checks.positive_int("head_dim", head_dim)
    if isinstance(bits, bool) or bits not in BITS:
      raise ValueError(f"bits must be one of {BITS}; got {bits!r}")
    levels = resolve_codebook(codebook, bits)
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
      raise ValueError(f"seed must be an int; got {seed!r}")
    residual = _residual.check_residual(residual, 1)
    rotation(num_kv_heads, head_dim, int(seed))  # checks H
    width = lowbit.packed_width(head_dim, bits)
    dtype = _residual.check_float_dtype(dtype)
    if jnp.dtype(scale_dtype).name not in SCALE_DTYPES:
      raise ValueError(f"scale_dtype must be one of {SCALE_DTYPES}; got {scale_dtype!r}")
    sdt = jnp.dtype(scale_dtype)
    sq = _residual.store_slots(max_len, residual, 1)
    rb = _residual.ring_slots(max_len, residual, 1)
    bk = (batch, num_kv_heads)
    return cls(k_codes=jnp.zeros(bk + (sq, width), jnp.uint8),
               v_codes=jnp.zeros(bk + (sq, width), jnp.uint8),
               k_scale=jnp.zeros(bk + (sq,), sdt), v_scale=jnp.zeros(bk + (sq,), sdt),
               k_res=jnp.zeros(bk + (rb, head_dim), dtype),
               v_res=jnp.zeros(bk + (rb, head_dim), dtype),
               lengths=jnp.zeros((batch,), jnp.int32), bits=bits, codebook=levels,
               seed=int(seed), residual=residual, max_len=max_len)

  def storage_arrays(self) -> tuple[jax.Array, ...]:
    """Codes, scales and the residual ring (`lengths` is bookkeeping)."""
    return (self.k_codes, self.v_codes, self.k_scale, self.v_scale, self.k_res, self.v_res)

  def analytic_bytes_per_token(self) -> float:
    """`analytic_bytes_per_token` of this cache's settings (from sizes, not arrays)."""
    return analytic_bytes_per_token(
        max_len=self.max_len, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
        bits=self.bits, residual=self.residual, dtype=self.dtype, scale_dtype=self.k_scale.dtype)

  # ---------------------------------------------------------------------------- the space
  def _m(self) -> jax.Array:
    return jnp.asarray(rotation(self.num_kv_heads, self.head_dim, self.seed))

  def _to_space(self, x):  # [B, K, S, H] -> rotated
    return jnp.einsum("BKSH,KHJ->BKSJ", x.astype(jnp.float32), self._m())

  def _from_space(self, x):
    return jnp.einsum("BKSJ,KHJ->BKSH", x, self._m())

  def _q_to_space(self, q):  # [B, T, N, H]: head n by its KV head's rotation
    m = jnp.repeat(self._m(), q.shape[2] // self.num_kv_heads, axis=0)
    return jnp.einsum("BTNH,NHJ->BTNJ", q.astype(jnp.float32), m)

  def _out_from_space(self, out):
    m = jnp.repeat(self._m(), out.shape[2] // self.num_kv_heads, axis=0)
    return jnp.einsum("BTNJ,NHJ->BTNH", out, m)

  # ---------------------------------------------------------------------------- codes
  def read_block(self, offset: jax.Array, size: int) -> tuple[jax.Array, jax.Array]:
    """Store slots `[offset, offset + size)`: f32 rotated `(k, v)` `[B, K, size, H]`."""
    sl = lambda x: jax.lax.dynamic_slice_in_dim(x, offset, size, axis=2)
    return tuple(dequantize_rotated(lowbit.unpack_codes(sl(c), self.bits), sl(s), self.codebook)
                 for c, s in ((self.k_codes, self.k_scale), (self.v_codes, self.v_scale)))

  def _store_decode(self, q, starts, lengths, implementation, **options):
    """The store by `kvattn.ops.dispatch`'s "rotated_store_decode"; q and the output in
    the rotated space."""
    from kvattn.ops import dispatch  # pylint: disable=g-import-not-at-top
    return dispatch.dispatch(
        "rotated_store_decode", implementation, q, self.k_codes, self.k_scale, self.v_codes,
        self.v_scale, starts, lengths, bits=self.bits, codebook=self.codebook, **options)

  def _encode(self, k: jax.Array, v: jax.Array, num_groups: int) -> dict[str, Any]:
    """Store fields of tokens `k, v: [B, K, n, H]` (f32, not rotated): rotated, coded."""
    del num_groups
    out = {}
    for name, x in (("k", k), ("v", v)):
      codes, scale = quantize_rotated(self._to_space(x), self.codebook, self.k_scale.dtype)
      out[f"{name}_codes"] = (lowbit.pack_codes(codes, self.bits), "token")
      out[f"{name}_scale"] = (scale, "token")
    return out


def calibrate_codebook(model, tokens: np.ndarray, bits: int, *, seed: int = 0,
                       iters: int = 100) -> tuple[float, ...]:
  """A Lloyd-Max codebook fitted on `model`'s keys and values over calibration `tokens`."""
  tokens = jnp.asarray(tokens, jnp.int32)
  caches = model.init_caches(tokens.shape[0], tokens.shape[1], jnp.float32)
  _, caches = model(tokens, caches)
  samples = []
  for c in caches:
    m = rotation(c.num_kv_heads, c.head_dim, seed)
    for x in (c.k, c.v):
      y = np.einsum("bksh,khj->bksj", np.asarray(x, np.float32), m)
      rms = np.sqrt(np.mean(y * y, axis=-1, keepdims=True))
      samples.append((y / np.where(rms > 0, rms, 1.0)).ravel())
  return lloyd_max(np.concatenate(samples), bits, iters=iters,
                   init=np.asarray(named_codebook("lloyd-max", bits)))


def build(bits: int):
  """The registry builder of kind `rotated{bits}`: one `RotatedCache` per GQA layer."""

  def _build(model, batch, max_len, dtype, options, tokens_per_seq):
    del tokens_per_seq
    return tuple(RotatedCache.init(batch, max_len, a.num_kv_heads, a.head_dim, dtype, bits=bits,
                                   codebook=options["codebook"], seed=options["seed"],
                                   residual=options["residual"],
                                   scale_dtype=options["scale_dtype"])
                 for a in gqa_layers(model))

  return _build


OPTIONS = {"residual": 0, "codebook": "lloyd-max", "seed": 0, "scale_dtype": "float16"}
"""The registry options of `rotated3` / `rotated4` and their defaults."""


for _bits in (3, 4):
  registry.register_cache_kind(f"rotated{_bits}", registry.CacheKind(
      build(_bits), OPTIONS, f"RotatedCache: Hadamard-rotated K/V, {_bits}-bit codebook per "
      f"token (+ `residual` newest tokens in full precision)", float_only=True))
