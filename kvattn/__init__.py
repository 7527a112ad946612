"""kvattn: attention variants and their KV caches in JAX, Flax NNX and Pallas.

Public names (`__all__`; DESIGN.md has the contract):

  Attention modules (flax.nnx):
    `GroupedQueryAttention`     MHA / GQA / MQA through `num_kv_heads`.
    `MultiHeadLatentAttention`  DeepSeek-V2 MLA (latent cache, absorbed decode).
  Caches (registered pytrees, pure updates; `kvattn.cache_protocol` is their interface):
    `KVCache`          dense cache of one layer, `k, v: [B, K, S, H]`.
    `LatentCache`      MLA cache of one layer, `c_kv: [B, S, C]`, `k_rope: [B, S, R]`.
    `PagedKVCache`     paged cache of one layer, page pools + block tables.
    `PageAllocator`    host-side page allocator of a paged pool.
    `RingKVCache`      sliding-window cache of one layer: W slots, writes wrap.
    `SinkKVCache`      StreamingLLM cache: attention sinks + a ring of recent tokens.
    `EvictingKVCache`  fixed-budget cache filled by an eviction policy (H2O,
                       SnapKV, TOVA, recent, random, key norm).
    `LengthSwitchKVCache`  K KV heads up to `switch_length` tokens, then heads pooled
                       to `num_kv_heads_after` (mean of each group), per sequence.
    `OutOfPagesError`  raised when the pool has too few free pages.
    `PrefixCachingAllocator`  a `PageAllocator` that shares cached prompt prefixes
                       (refcounted pages, chained sha256 keys, LRU eviction, offload tiers).
  Model, generation, serving:
    `Transformer`         decoder-only LM, attention variant per layer from a config.
    `generate`            batched prefill + one compiled decode loop.
    `ContinuousBatcher`   continuous batching over paged caches.
    `from_pretrained`     a pretrained checkpoint (HF safetensors directory, .gguf file or
                          registered name) as `(Transformer, tokenizer or None)`.
  Modules:
    `ops`          reference attention, RoPE, quantization, decode dispatch points.
    `memory`       analytic and measured KV-cache bytes.
    `data`         byte tokenizer and the default text corpus.
    `train`        training loop, evaluation, checkpoints (imported on first use).
    `transformer`  model config schema (`model_config`, `resolve_config`).
  Submodules to import by name: `kvattn.cache_protocol` (the interface every
  cache kind implements), `kvattn.cache_factories` (caches of a whole model
  for `generate(cache_factory=)`), `kvattn.allocator` (host-side pages),
  `kvattn.cache_io` (save / restore any cache with orbax, resume generation),
  `kvattn.prefix_cache` (prefix sharing), `kvattn.offload` (host and disk tiers).
"""

from kvattn import memory, ops
from kvattn.cache import KVCache, LatentCache
from kvattn.gqa import GroupedQueryAttention
from kvattn.mla import MultiHeadLatentAttention
from kvattn.allocator import OutOfPagesError, PageAllocator
from kvattn.paged import PagedKVCache
from kvattn.prefix_cache import PrefixCachingAllocator
from kvattn.long_context import EvictingKVCache, RingKVCache, SinkKVCache
from kvattn.length_switch import LengthSwitchKVCache
from kvattn import data, transformer
from kvattn.transformer import Transformer
from kvattn.generate import generate  # the function; helpers: `from kvattn.generate import ...`
from kvattn.batching import ContinuousBatcher
from kvattn.pretrained import from_pretrained

__version__ = "0.1.0"

__all__ = [
    "ContinuousBatcher",
    "EvictingKVCache",
    "GroupedQueryAttention",
    "KVCache",
    "LatentCache",
    "LengthSwitchKVCache",
    "MultiHeadLatentAttention",
    "OutOfPagesError",
    "PageAllocator",
    "PagedKVCache",
    "PrefixCachingAllocator",
    "RingKVCache",
    "SinkKVCache",
    "Transformer",
    "data",
    "from_pretrained",
    "generate",
    "memory",
    "ops",
    "train",
    "transformer",
]


def __getattr__(name):
  # `kvattn.train` imports orbax-checkpoint (~0.2 s); load it on first use.
  if name == "train":
    import importlib  # pylint: disable=g-import-not-at-top
    return importlib.import_module("kvattn.train")
  raise AttributeError(f"module 'kvattn' has no attribute {name!r}")
