"""Q-Filters: score keys by their projection on the main direction of the model's queries.

Godey et al. 2025, "Q-Filters: Leveraging QK Geometry for Efficient KV Cache Compression",
arXiv 2503.02812 (kvpress's `QFilterPress`). Per layer and KV head the filter `u: f32[H]` is the
first right singular vector of the matrix of the head's queries (after RoPE, the G query heads of
the KV head stacked), its sign fixed so that the queries project positively (`sum_q <q, u> > 0`).
Queries then carry a positive component along u, so `<q, k>` grows with `<k, u>`: the score of a
stored key is `<k, u>` (higher kept). kvpress stores the opposite sign (its filters, downloaded
from the Hugging Face hub, score `-<k, filter>`); the ranking is the same.

The filters are computed HERE from the model: `calibrate(model, tokens)` runs the model over
`tokens` once, with caches that record each layer's queries (their Gram matrix), and keeps the
result for that model's attention modules. The kind "qfilter" (`QFilterKVCache`, an
`EvictingKVCache` with a `filters: f32[B, K, H]` leaf, batch-major so every row operation,
checkpoint and mesh placement treats it as any other leaf) builds from those filters. A model it
has not seen is calibrated on the spot on `calibration_tokens()` (a sample of the default
corpus, the standard library's sources) as bytes -- the right tokens for the byte vocabulary
(`kvattn.vocab`); any other vocabulary gets the byte ids folded into it, with a warning: calibrate
a model with its own tokenizer first, `calibrate(model, calibration_tokens(tokenizer))`. Filters
stay with the modules they were computed for: after changing the weights, calibrate again.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import weakref
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from kvattn import _checks, vocab
from kvattn.caches import _context, dense, eviction, registry
from kvattn.caches._layers import cache_owners, gqa_layers
from kvattn.caches.presses._common import dequantized, live
from kvattn.ops.rope import apply_rope

NAME = "qfilter"
CALIBRATION_FILES = ("functools.py", "textwrap.py", "string.py")
"""Standard-library modules whose text is the calibration sample (the default corpus's source)."""

_FILTERS: dict[int, tuple[weakref.ref, np.ndarray]] = {}
"""id(attention module) -> (weak reference to it, its filters `f32[K, H]`)."""


@struct.dataclass
class _QueryRecorder(dense.KVCache):
  """A dense cache that also sums its layer's RoPE'd queries' outer products per KV head."""

  gram: jax.Array | None = None  # f32[K, H, H]
  total: jax.Array | None = None  # f32[K, H]

  def update_attend_unchecked(self, q, k, v, *, positions, rope_theta, rope_scaling=None,
                              new_lengths, **options):
    num_kv_heads, head_dim = self.k.shape[1], self.k.shape[3]
    qr = apply_rope(q, positions, rope_theta=rope_theta, scaling=rope_scaling)
    real = jnp.arange(q.shape[1])[None, :] < new_lengths[:, None]  # [B, T]
    qr = jnp.where(real[..., None, None], qr.astype(jnp.float32), 0.0)
    qr = qr.reshape(q.shape[0], q.shape[1], num_kv_heads, -1, head_dim)  # [B, T, K, G, H]
    out, new = super().update_attend_unchecked(
        q, k, v, positions=positions, rope_theta=rope_theta, rope_scaling=rope_scaling,
        new_lengths=new_lengths, **options)
    return out, new.replace(gram=self.gram + jnp.einsum("BTKGI,BTKGJ->KIJ", qr, qr),
                            total=self.total + qr.sum(axis=(0, 1, 3)))


def _fields(cache) -> dict[str, Any]:
  return {f.name: getattr(cache, f.name) for f in dataclasses.fields(cache)}


def filters_from_gram(gram: np.ndarray, total: np.ndarray) -> np.ndarray:
  """`f32[K, H]`: per KV head the unit eigenvector of the largest eigenvalue of `gram: [K, H,
  H]` (the first right singular vector of the queries), signed so that `<total, u> >= 0`."""
  _, vectors = np.linalg.eigh(np.asarray(gram, np.float64))
  u = vectors[..., -1]  # [K, H]
  sign = np.where(np.einsum("KH,KH->K", np.asarray(total, np.float64), u) < 0, -1.0, 1.0)
  return (u * sign[:, None]).astype(np.float32)


def calibrate(model, tokens: Any, lengths: Any = None) -> tuple[np.ndarray, ...]:
  """Computes the Q-Filters of `model` from its queries over `tokens` and keeps them for its
  attention modules (the kind "qfilter" then builds from them).

  Args:
    model: a `kvattn.Transformer` of GQA-family layers.
    tokens: `i32[B, T]` token ids (e.g. `calibration_tokens(tokenizer)`).
    lengths: `i32[B]` real tokens per row (right padding); None: all T.

  Returns:
    One `f32[K, H]` per layer owning a cache (`model.cache_layers`), unit rows.

  Raises:
    ValueError: tokens not of rank 2 or empty, lengths outside `[1, T]`, an MLA layer.
  """
  tokens = np.asarray(tokens)
  if tokens.ndim != 2 or tokens.shape[1] == 0 or not np.issubdtype(tokens.dtype, np.integer):
    raise ValueError(f"tokens must be integer ids i32[B, T] with T >= 1; got shape "
                     f"{tokens.shape} of {tokens.dtype}")
  batch, num_tokens = tokens.shape
  lengths = np.full(batch, num_tokens, np.int32) if lengths is None else np.asarray(lengths)
  if lengths.shape != (batch,) or (lengths < 1).any() or (lengths > num_tokens).any():
    raise ValueError(f"lengths must be i32[B] = ({batch},) in [1, {num_tokens}]; got {lengths}")
  attns = gqa_layers(model)
  caches = tuple(
      _QueryRecorder(**_fields(dense.KVCache.init(batch, num_tokens, a.num_kv_heads, a.head_dim,
                                                  jnp.float32)),
                     gram=jnp.zeros((a.num_kv_heads, a.head_dim, a.head_dim), jnp.float32),
                     total=jnp.zeros((a.num_kv_heads, a.head_dim), jnp.float32))
      for a in attns)
  graphdef, state = nnx.split(model)
  run = jax.jit(lambda s, c, t, n: nnx.merge(graphdef, s)(t, c, new_lengths=n)[1])
  recorded = run(state, caches, jnp.asarray(tokens, jnp.int32), jnp.asarray(lengths, jnp.int32))
  filters = tuple(filters_from_gram(c.gram, c.total) for c in recorded)
  for key in [key for key, (ref, _) in _FILTERS.items() if ref() is None]:
    del _FILTERS[key]  # modules gone: their ids may be reused
  for attn, f in zip(attns, filters):
    _FILTERS[id(attn)] = (weakref.ref(attn), f)
  return filters


def calibration_tokens(tokenizer=None, num_tokens: int = 256) -> np.ndarray:
  """`i32[1, num_tokens]`: the start of `CALIBRATION_FILES` (standard-library sources, the
  default corpus's text), tokenized by `tokenizer.encode` or, for None, as UTF-8 bytes (the
  byte vocabulary).

  Raises:
    ValueError: num_tokens < 1, or the text gives fewer tokens.
  """
  num_tokens = _checks.positive_int("num_tokens", num_tokens)
  stdlib = os.path.dirname(os.__file__)
  text = "".join(open(os.path.join(stdlib, name), encoding="utf-8").read()
                 for name in CALIBRATION_FILES)
  ids = list(text.encode("utf-8")) if tokenizer is None else list(tokenizer.encode(text))
  if len(ids) < num_tokens:
    raise ValueError(f"num_tokens must be at most {len(ids)} (the calibration text); got "
                     f"{num_tokens}")
  return np.asarray(ids[:num_tokens], np.int32)[None]


def _known(attn) -> np.ndarray | None:
  entry = _FILTERS.get(id(attn))
  return entry[1] if entry is not None and entry[0]() is attn else None


def model_filters(model) -> tuple[np.ndarray, ...]:
  """The filters kept for `model`'s cache-owning layers. A model `calibrate` has not seen is
  calibrated now on `calibration_tokens()`: as bytes for the byte vocabulary, else folded into
  its vocabulary (`ids % vocab_size`, with a warning: a model with its own tokenizer should be
  calibrated first with it).

  Raises:
    ValueError: an uncalibrated model given as a stand-in of some of its layers (the per-layer
      layout of a model with local layers) -- it cannot be run.
  """
  attns = gqa_layers(model)
  known = [_known(a) for a in attns]
  if all(f is not None for f in known):
    return tuple(known)
  vocab_size = getattr(model, "vocab_size", None)
  if cache_owners(model) is not model or not callable(model) or vocab_size is None:
    raise ValueError(
        "cache kind 'qfilter' needs the model's Q-Filters: call kvattn.caches.presses.qfilter."
        "calibrate(model, calibration_tokens(tokenizer)) before building its caches")
  tokens = calibration_tokens()
  if vocab_size != vocab.VOCAB_SIZE:
    logging.getLogger(__name__).warning(
        "Q-Filters of a model of vocabulary %d calibrated on byte ids folded into it; for "
        "filters from real text call qfilter.calibrate(model, calibration_tokens(tokenizer))",
        vocab_size)
    tokens = tokens % vocab_size
  return calibrate(model, tokens)


def score(c: eviction.Candidates, options: dict[str, int]) -> jax.Array:
  """`f32[B, K, S + T]`: each key's projection on its KV head's filter (`c.state`)."""
  del options
  k = dequantized(c.k, c.k_scale, live(c))
  return jnp.einsum("BKSH,BKH->BKS", k, c.state.astype(jnp.float32))


POLICY = eviction.EvictionPolicy(score=score, options={"recent_size": (lambda budget: 0, 0)},
                                 protected="recent_size")


@struct.dataclass
class QFilterKVCache(eviction.EvictingKVCache):
  """An `EvictingKVCache` of policy "qfilter" holding its layer's filters.

  Attributes:
    filters: `f32[B, K, H]` unit filter per KV head (the same for every row).
  """

  filters: jax.Array | None = None

  @classmethod
  def init(cls, batch: int, budget: int, num_kv_heads: int, head_dim: int, dtype=jnp.float32,
           *, filters: Any = None, policy: str = NAME, **policy_options) -> "QFilterKVCache":
    """An empty cache of `budget` slots per row and KV head scored by `filters: f32[K, H]`.

    Raises:
      ValueError: filters missing, of another shape or not finite; the `EvictingKVCache`
        errors (budget, options).
    """
    if policy != NAME:
      raise ValueError(f"policy must be {NAME!r} for a QFilterKVCache; got {policy!r}")
    cache = super().init(batch, budget, num_kv_heads, head_dim, dtype, policy=NAME,
                         **policy_options)
    f = None if filters is None else np.asarray(filters, np.float32)
    if f is None or f.shape != (num_kv_heads, head_dim) or not np.isfinite(f).all():
      raise ValueError(f"filters must be finite f32[K, H] = ({num_kv_heads}, {head_dim}); got "
                       f"{None if f is None else f.shape}")
    return cache.replace(filters=jnp.broadcast_to(jnp.asarray(f), (batch,) + f.shape))

  def policy_state(self) -> jax.Array:
    return self.filters


def _build(model, batch, max_len, dtype, o, tokens_per_seq):
  del tokens_per_seq  # fixed: the capacity is the budget; compress="context": max_len slots
  budget, mode, options = _context.split_options(o, max_len)
  return tuple(QFilterKVCache.init(batch, budget, a.num_kv_heads, a.head_dim, dtype,
                                   filters=f, **mode, **options)
               for a, f in zip(gqa_layers(model), model_filters(model)))


eviction.POLICY_TABLE[NAME] = POLICY
registry.register_cache_kind(NAME, registry.CacheKind(
    _build, {**_context.SPEC_OPTIONS, "num_sinks": None, "recent_size": None},
    "QFilterKVCache: `budget` slots per KV head, kept by their Q-Filter projection",
    at_budget=lambda budget, num_sinks: {"budget": budget}, check=_context.check_spec,
    slots=_context.kind_slots))
