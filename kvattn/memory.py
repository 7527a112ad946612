"""KV-cache bytes: analytic per token and layer (GQA `2 K H itemsize`, Ainslie et al. 2023; MLA
`(C + R) itemsize`, DeepSeek-V2 §2.1.2; int8 / fp8 add f32 scales) and measured from arrays."""

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
  """`(C + R) / (2 N H)`, MLA's cached elements over MHA's (DeepSeek-V2, Table 1); ValueError
  or TypeError for a size that is not a positive int."""
  mla = mla_bytes_per_token(kv_lora_rank, qk_rope_head_dim, jnp.float32)
  return mla / mha_bytes_per_token(num_heads, head_dim, jnp.float32)


def host_available_bytes() -> int:
  """Bytes of host RAM available to new allocations without swapping
  (`psutil.virtual_memory().available`; Linux: `MemAvailable`)."""
  return int(psutil.virtual_memory().available)


def available_bytes(device: Any = None) -> int | None:
  """Bytes free for new arrays on `device` (default `jax.local_devices()[0]`), or None if unknown:
  `bytes_limit - bytes_in_use`, or `host_available_bytes()` on CPU."""
  device = jax.local_devices()[0] if device is None else device
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
  """Bytes per token slot of one cache: `cache.storage_arrays()` bytes over
  `cache.storage_slots` (bookkeeping such as `lengths` left out; `tree_bytes` counts all).

  Raises:
    TypeError: `cache` does not implement `storage_arrays()` / `storage_slots`.
  """
  if not hasattr(cache, "storage_arrays") or not hasattr(cache, "storage_slots"):
    raise TypeError(f"cache must be a kvattn cache with storage_arrays() and storage_slots; "
                    f"got {type(cache).__name__}")
  return sum(a.nbytes for a in cache.storage_arrays()) / cache.storage_slots
