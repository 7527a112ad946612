"""KV-cache memory: analytic bytes per token per layer, and measured bytes.

Analytic figures (per token, per layer, batch 1):
  * MHA/GQA/MQA (Shazeer 2019; Ainslie et al. 2023): keys and values for K
    KV heads of width H: `2 * K * H * itemsize` bytes. MHA has K = N, MQA K = 1.
  * MLA (DeepSeek-V2, arXiv 2405.04434, §2.1.2 and Table 1): one latent of
    width C (`kv_lora_rank`) plus one shared RoPE key of width R
    (`qk_rope_head_dim`): `(C + R) * itemsize` bytes.
  * Quantized caches (int8, float8_e4m3fn, float8_e5m2; `kvattn.ops.quant`)
    add their f32 scales: one per token per KV head for keys and one for
    values (`2 * K * 4` bytes), MLA one for `c_kv` and one for `k_rope`
    (`2 * 4` bytes). With H = 128 an int8/fp8 cache is then `(H + 4) / 2H`
    = 52% of a bf16 one; with H = 16, 62.5%.

Measured figures read the `.nbytes` of the real arrays of a cache pytree, so a
caller can check the analytic model against what is actually allocated.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import psutil

from kvattn import _checks
from kvattn.ops import quant


def itemsize(dtype: Any) -> int:
  """Bytes per element of `dtype` (e.g. 2 for bf16, 1 for int8/fp8)."""
  try:
    return jnp.dtype(dtype).itemsize
  except TypeError as e:
    raise TypeError(f"dtype must be a JAX dtype; got {dtype!r}") from e


def scale_bytes(dtype: Any) -> int:
  """Bytes of one scale of a cache in `dtype`: 4 (f32) when quantized, else 0."""
  return quant.SCALE_DTYPE.itemsize if quant.is_quantized(dtype) else 0


def gqa_bytes_per_token(num_kv_heads: int, head_dim: int, dtype: Any) -> int:
  """Bytes per token per layer of a K-head dense cache: `2 * K * H * itemsize`,
  plus `2 * K * 4` scale bytes for a quantized dtype."""
  k = _checks.positive_int("num_kv_heads", num_kv_heads)
  h = _checks.positive_int("head_dim", head_dim)
  return 2 * k * (h * itemsize(dtype) + scale_bytes(dtype))


def mha_bytes_per_token(num_heads: int, head_dim: int, dtype: Any) -> int:
  """Bytes per token per layer of an MHA cache (K = N): `2 * N * H * itemsize`."""
  return gqa_bytes_per_token(num_heads, head_dim, dtype)


def mla_bytes_per_token(kv_lora_rank: int, qk_rope_head_dim: int, dtype: Any) -> int:
  """Bytes per token per layer of an MLA latent cache: `(C + R) * itemsize`, plus
  `2 * 4` scale bytes (one for c_kv, one for k_rope) for a quantized dtype."""
  c = _checks.positive_int("kv_lora_rank", kv_lora_rank)
  r = _checks.positive_int("qk_rope_head_dim", qk_rope_head_dim)
  return (c + r) * itemsize(dtype) + 2 * scale_bytes(dtype)


def mla_to_mha_cache_ratio(kv_lora_rank: int, qk_rope_head_dim: int, num_heads: int,
                           head_dim: int) -> float:
  """MLA cache size over an MHA layer's with the same N and H: `(C + R) / (2 * N * H)`.

  DeepSeek-V2 (arXiv 2405.04434, Table 1) compares MLA's `(C + R)` cached
  elements per token per layer with MHA's `2 * N * H`; the dtype cancels.

  Raises:
    ValueError/TypeError: a size that is not a positive int.
  """
  mla = mla_bytes_per_token(kv_lora_rank, qk_rope_head_dim, jnp.float32)
  return mla / mha_bytes_per_token(num_heads, head_dim, jnp.float32)


def host_available_bytes() -> int:
  """Bytes of host RAM available to new allocations without swapping
  (`psutil.virtual_memory().available`; Linux: `MemAvailable`)."""
  return int(psutil.virtual_memory().available)


def available_bytes(device: Any = None) -> int | None:
  """Bytes free for new arrays on `device` (default `jax.devices()[0]`), or None if unknown.

  Accelerators: `bytes_limit - bytes_in_use` of `device.memory_stats()`. CPU
  (or no stats): `host_available_bytes()`.
  """
  device = jax.devices()[0] if device is None else device
  if device.platform != "cpu":
    try:
      stats = device.memory_stats() or {}
    except Exception:  # pylint: disable=broad-except  (backends without stats)
      stats = {}
    if "bytes_limit" in stats:
      return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
  return host_available_bytes()


def tree_bytes(tree: Any) -> int:
  """Total bytes of every array leaf of a pytree (caches, params, ...)."""
  return int(sum(leaf.nbytes for leaf in jax.tree_util.tree_leaves(tree)
                 if hasattr(leaf, "nbytes")))


def measured_bytes_per_token(cache: Any) -> float:
  """Bytes per token slot of one layer's cache, read from its real arrays.

  Counts the arrays that grow with the number of token slots (keys, values,
  latents, and scales when a cache stores them: `cache.storage_arrays()`) and
  divides by the token slots they hold (`cache.storage_slots`: B * S for a
  dense cache, P * page_size for a page pool; `kvattn.caches.protocol.Cache`).
  Bookkeeping such as `lengths` is left out; `tree_bytes` counts everything.

  Raises:
    TypeError: `cache` does not implement `storage_arrays()`/`storage_slots`.
  """
  if not hasattr(cache, "storage_arrays") or not hasattr(cache, "storage_slots"):
    raise TypeError(f"cache must be a kvattn cache with storage_arrays() and storage_slots; "
                    f"got {type(cache).__name__}")
  return sum(a.nbytes for a in cache.storage_arrays()) / cache.storage_slots
