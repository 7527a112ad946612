"""Decoder-only Transformer LM whose layers take their attention from a config.

Architecture (Llama-style, Touvron et al. 2023): token embedding, L pre-norm
blocks `x += attn(rmsnorm(x)); x += mlp(rmsnorm(x))` with RMSNorm (Zhang &
Sennrich 2019) and a SwiGLU MLP (Shazeer 2020, "GLU Variants Improve
Transformer", eq. 6: `W2 (silu(x W1) * (x W3))`), a final RMSNorm and an LM
head (optionally tied to the embedding). Each layer's attention is a
`kvattn.GroupedQueryAttention` (MHA / GQA / MQA) or a
`kvattn.MultiHeadLatentAttention` (DeepSeek-V2 MLA), chosen per layer by the
config, so a model may mix variants.

Gemma 2/3 and Qwen3 options (`ModelSpec` / `AttentionSpec` fields): GeGLU with tanh GELU
(`mlp_activation`), embeddings times sqrt(D) (`scale_embeddings`), RMSNorm also on the
attention and MLP outputs (`post_norms`, Gemma's four norms per block), a final logit soft
cap (`final_soft_cap`), qk-norm (`qk_norm`), the query scale (`sm_scale`), and per-layer
windows and RoPE bases through `model.layers` (local / global layers).

Cross-layer KV sharing (CLA, Brandon et al. 2024, arXiv 2405.12981; Gemma 3n's KV sharing):
`model.cla_factor` (groups of that many layers of one type share the first one's K/V) or
`model.layers[i].kv_source = j`: layer i has no K/V projections and no cache; it attends its
queries to layer j's keys and values of the same pass. `init_caches` builds caches for
`cache_layers` only and the model takes them in that order; `cache_bytes_per_token` counts
them only.

Config schema: `kvattn.models.config` (`ModelSpec`, `AttentionSpec`, `model_config`,
`resolve_config`, `cache_bytes_per_token`), whose names this module re-exports.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from kvattn import _checks
from kvattn.caches import registry as cache_registry
from kvattn.models import gqa as gqa_lib
from kvattn.models import int8 as int8_lib

# Re-exported: `kvattn.transformer.model_config` etc. keep working.
from kvattn.models.config import (  # noqa: F401
    ATTENTION_KINDS, AttentionSpec, ModelSpec, ROPE_SCALING_FIELDS, attention_config,
    attention_fields, cache_bytes_per_token, cla_sources, kv_type, model_config, resolve_config,
    _ATTENTION_MODULES)


# ----------------------------------------------------------------------------------------------
# Modules.


class RMSNorm(nnx.Module):
  """RMSNorm (Zhang & Sennrich 2019): `x / sqrt(mean(x^2) + eps) * scale`, computed in f32."""

  def __init__(self, dim: int, *, eps: float, param_dtype: Any = jnp.float32):
    self.eps = eps
    param_dtype = jnp.float32 if int8_lib.is_int8(param_dtype) else param_dtype
    self.scale = nnx.Param(jnp.ones((dim,), param_dtype))

  def __call__(self, x: jax.Array) -> jax.Array:  # [..., D]
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
    return (y * self.scale[...].astype(jnp.float32)).astype(x.dtype)


def _dense_init(in_axis=0, out_axis=-1):
  return nnx.initializers.variance_scaling(1.0, "fan_in", "truncated_normal",
                                           in_axis=in_axis, out_axis=out_axis)


# Gate activations of the gated MLP: SwiGLU and GeGLU with tanh GELU (Shazeer 2020, eq. 5-6).
_ACTIVATIONS = {"silu": jax.nn.silu, "gelu_tanh": lambda g: jax.nn.gelu(g, approximate=True)}


class SwiGLU(nnx.Module):
  """SwiGLU MLP (Shazeer 2020, eq. 6): `down(silu(x @ gate) * (x @ up))`; with
  `activation="gelu_tanh"` GeGLU (eq. 5, tanh-approximated GELU, Gemma).

  Parameters `gate, up: [D, F]`, `down: [F, D]`; matmuls accumulate in f32.
  With `param_dtype` int8 (W8A8, `kvattn.models.int8`) the three are stored packed
  (`int8.pack_weight`: `uint8`, output-major: `gate, up: [F, D]`, `down: [D, F]`) with
  f32 per-output-channel scales `gate_scale, up_scale: [F]`, `down_scale: [D]`.
  """

  def __init__(self, d_model: int, mlp_dim: int, *, dtype: Any, param_dtype: Any, rngs: nnx.Rngs,
               activation: str = "silu"):
    self.dtype = dtype
    if activation not in _ACTIVATIONS:
      raise ValueError(f"activation must be one of {sorted(_ACTIVATIONS)}; got {activation!r}")
    self.activation = activation
    key = rngs.params
    quantized = int8_lib.is_int8(param_dtype)
    param_dtype = jnp.float32 if quantized else param_dtype
    self.gate = nnx.Param(_dense_init()(key(), (d_model, mlp_dim), param_dtype))
    self.up = nnx.Param(_dense_init()(key(), (d_model, mlp_dim), param_dtype))
    self.down = nnx.Param(_dense_init()(key(), (mlp_dim, d_model), param_dtype))
    if quantized:
      int8_lib.quantize_module(self)

  def __call__(self, x: jax.Array) -> jax.Array:  # [B, T, D]
    dt = self.dtype
    x = x.astype(dt)
    if hasattr(self, "gate_scale"):  # W8A8: the same products through int8_dot
      g, u = int8_lib.int8_dots(x, ((self.gate[...], self.gate_scale[...]),
                                    (self.up[...], self.up_scale[...])))  # one quantization
      h = (_ACTIVATIONS[self.activation](g) * u).astype(dt)
      return int8_lib.project("BTF,FD->BTD", h, self.down, getattr(self, "down_scale", None),
                              dt).astype(dt)
    # Two products, not one of the weights concatenated: XLA:CPU copies the concatenation
    # on every call (7 MB per layer at SmolLM2's shapes; docs/benchmarks.md, "Decode step
    # cost").
    g, u = (jnp.einsum("BTD,DF->BTF", x, w[...].astype(dt), preferred_element_type=jnp.float32)
            for w in (self.gate, self.up))
    h = (_ACTIVATIONS[self.activation](g) * u).astype(dt)
    return jnp.einsum("BTF,FD->BTD", h, self.down[...].astype(dt),
                      preferred_element_type=jnp.float32).astype(dt)


def make_attention(spec: AttentionSpec, *, d_model: int, dtype: Any, param_dtype: Any,
                   rngs: nnx.Rngs, norm_eps: float = 1e-6) -> nnx.Module:
  """Builds one layer's attention module from its resolved AttentionSpec (the layer factory).

  "gqa" -> `kvattn.GroupedQueryAttention`, "mla" ->
  `kvattn.MultiHeadLatentAttention`; every field the kind uses (`kind` aside)
  is passed as the keyword of the same name, but the `rope_*` scaling fields,
  which are passed as one `rope_scaling=spec.rope()`; a GQA layer with
  `qk_norm` also gets `norm_eps` (the model's).
  """
  kwargs = {name: getattr(spec, name) for name in attention_fields(spec.kind)
            if name != "kind" and name not in ROPE_SCALING_FIELDS}
  kwargs["rope_scaling"] = spec.rope()
  if spec.kind == "gqa" and spec.qk_norm:
    kwargs["norm_eps"] = norm_eps
  return _ATTENTION_MODULES[spec.kind](d_model=d_model, dtype=dtype, param_dtype=param_dtype,
                                       rngs=rngs, **kwargs)


def _value(v):
  return None if v is None else v[...]


def quantize_embeddings(model: "Transformer") -> None:
  """W8A8 (`kvattn.models.int8`) of the embedding table and LM head, in place.

  A tied table `[V, D]` gets one scale per token row (`embedding_scale: f32[V]`) and
  is stored packed (`int8.pack_weight`: `uint8[V, D]`, its layout kept): the rows
  are the LM head's output channels, and the gather dequantizes the rows it reads.
  An untied `lm_head [D, V]` is stored packed as `uint8[V, D]` with
  `lm_head_scale: f32[V]`, and the embedding keeps one scale per row as well.
  """
  w_q, scale = int8_lib.quantize_weight(model.embedding[...].T, 1)
  model.embedding = nnx.Param(int8_lib.pack_weight(w_q, 1))
  model.embedding_scale = nnx.Param(scale)
  if model.lm_head is not None:
    int8_lib.quantize_param(model, "lm_head", 1)


def quantize_model(model: "Transformer") -> "Transformer":
  """Turns a float `Transformer` into its W8A8 form in place (`kvattn.models.int8`) and returns it.

  The same as building it with `param_dtype="int8"` from these float weights:
  every weight `int8.QUANTIZED_WEIGHTS` lists, the LM head and the embedding
  (`quantize_embeddings`) become int8 with f32 scales; `model.spec.param_dtype`
  becomes int8. Norm scales and biases are cast to f32.

  Raises:
    ValueError: the model is already int8, or a weight is not finite.
  """
  if int8_lib.is_int8(model.spec.param_dtype):
    raise ValueError("model is already int8 (spec.param_dtype = int8)")
  modules = [node for _, node in nnx.iter_graph(model) if isinstance(node, nnx.Module)]
  for module in modules:
    int8_lib.quantize_module(module)
  quantize_embeddings(model)
  _, params = nnx.split(model, nnx.Param)
  for var in jax.tree.leaves(params, is_leaf=lambda v: isinstance(v, nnx.Variable)):
    if jnp.issubdtype(var[...].dtype, jnp.floating):
      var.set_value(var[...].astype(jnp.float32))
  model.spec = dataclasses.replace(model.spec, param_dtype=int8_lib.INT8)
  return model


def head_logits(h: jax.Array, table: jax.Array, table_scale: jax.Array | None,
                head: jax.Array | None, head_scale: jax.Array | None) -> jax.Array:
  """f32 logits `[..., V]` of hidden states `h [..., D]`: against the tied `table [V, D]`
  when `head` is None, else against `head [D, V]` (packed int8: `uint8[V, D]`); through
  `int8_dot` for int8 weights."""
  if head is None:
    if table_scale is not None:  # packed uint8 [V, D], or an unpacked int8 [V, D] table
      return int8_lib.int8_dot(h, table, table_scale, transposed=True)
    return jnp.einsum("...D,VD->...V", h, table.astype(h.dtype),
                      preferred_element_type=jnp.float32)
  if head_scale is not None:
    return int8_lib.int8_dot(h, head, head_scale)
  return jnp.einsum("...D,DV->...V", h, head.astype(h.dtype), preferred_element_type=jnp.float32)


class Block(nnx.Module):
  """Pre-norm block: `x += attn(norm(x)); x += mlp(norm(x))`; with `model.post_norms`
  (Gemma 2/3) `x += post_attn_norm(attn(norm(x))); x += post_mlp_norm(mlp(norm(x)))`."""

  def __init__(self, spec: AttentionSpec, model: ModelSpec, *, rngs: nnx.Rngs):
    def norm():
      return RMSNorm(model.d_model, eps=model.norm_eps, param_dtype=model.param_dtype)
    self.attn_norm = norm()
    self.attn = make_attention(spec, d_model=model.d_model, dtype=model.dtype,
                               param_dtype=model.param_dtype, rngs=rngs, norm_eps=model.norm_eps)
    self.mlp_norm = norm()
    self.mlp = SwiGLU(model.d_model, model.mlp_dim, dtype=model.dtype,
                      param_dtype=model.param_dtype, rngs=rngs, activation=model.mlp_activation)
    self.post_attn_norm = norm() if model.post_norms else None
    self.post_mlp_norm = norm() if model.post_norms else None

  def __call__(self, x, cache, positions, new_lengths):
    x, cache, _ = self.step(x, cache, positions, new_lengths)
    return x, cache

  def step(self, x, cache, positions, new_lengths, *, shared_kv=None, share=False):
    """`(x, new_cache, kv)`: the block; with cross-layer KV sharing a layer with a `kv_source`
    takes its owner's `shared_kv` (no cache), and with `share` a layer that owns its K/V
    returns its `gqa.SharedKV` as `kv` (else None)."""
    a = self.attn_norm(x)
    kv = None
    if shared_kv is not None:
      h, cache = self.attn(a, cache=None, positions=positions, new_lengths=new_lengths,
                           shared_kv=shared_kv)
    elif share:
      h, cache, kv = self.attn.call_sharing_kv(a, cache, positions, new_lengths)
    else:
      h, cache = self.attn(a, cache=cache, positions=positions, new_lengths=new_lengths)
    x = self._rest(x, h)
    return x, cache, kv

  def _rest(self, x, h):
    if self.post_attn_norm is not None:
      h = self.post_attn_norm(h)
    x = x + h.astype(x.dtype)
    h = self.mlp(self.mlp_norm(x))
    if self.post_mlp_norm is not None:
      h = self.post_mlp_norm(h)
    return x + h.astype(x.dtype)


def embed(embedding: jax.Array, scale: jax.Array | None, tokens: jax.Array,
          spec: ModelSpec) -> jax.Array:
  """`[B, T, D]` embeddings: rows `tokens` of `embedding [V, D]` (times their `scale f32[V]`
  for an int8 table: packed `uint8` minus its offset, or plain `int8`) in the compute dtype,
  times sqrt(D) when `spec.scale_embeddings` (Gemma; the factor rounded to the compute dtype,
  as Gemma does)."""
  x = jnp.take(embedding, tokens, axis=0)
  if jnp.dtype(x.dtype) == int8_lib.UINT8:  # a packed int8 table (`int8.pack_weight`)
    x = x.astype(jnp.int32) - int8_lib.WEIGHT_OFFSET
  if scale is not None:
    x = x.astype(jnp.float32) * jnp.take(scale, tokens, axis=0)[..., None]
  x = x.astype(spec.dtype)
  if spec.scale_embeddings:
    x = x * jnp.asarray(spec.d_model ** 0.5, spec.dtype)
  return x


def soft_cap_logits(logits: jax.Array, cap: float | None) -> jax.Array:
  """`cap * tanh(logits / cap)` (Gemma 2's final logit soft cap), or `logits` when cap is None."""
  return logits if cap is None else cap * jnp.tanh(logits / cap)


class Transformer(nnx.Module):
  """Decoder-only LM; each layer's attention variant comes from the config.

  Call: `logits, caches = model(tokens, caches=None, positions=None, new_lengths=None)`
    * `tokens: i32[B, T]`.
    * `caches`: None (training: causal over T, returned caches are None) or a
      sequence of per-layer caches (one per layer that owns one, `cache_layers`:
      all L without cross-layer KV sharing), e.g. from `init_caches` (one `KVCache`
      per GQA layer, one `LatentCache` per MLA layer) or a cache factory
      (`kvattn.caches.registry`; any `kvattn.caches.protocol` implementer of
      the layer's kind); a tuple of updated caches is returned.
    * `positions: i32[B, T]`, `new_lengths: i32[B]`: as in the attention
      modules (DESIGN.md) -- RoPE positions (default: the first cache's
      length + arange(T), computed once for all layers) and real tokens per
      sequence (right padding).
    * `logits: f32[B, T, V]` (computed in f32 whatever the compute dtype).

  `hidden(...)` returns the final-normed hidden states `[B, T, D]` instead of
  logits and `logits_from_hidden(h)` projects them, so generation can project
  only the positions it samples from.
  """

  def __init__(self, spec: ModelSpec, *, rngs: nnx.Rngs):
    """Builds the model from a validated ModelSpec (see `from_config`)."""
    if not isinstance(spec, ModelSpec):
      raise TypeError(f"spec must be a ModelSpec (use Transformer.from_config); got "
                      f"{type(spec).__name__}")
    spec = resolve_config(spec)  # idempotent; resolves a ModelSpec built by hand
    self.spec = spec
    self.vocab_size = spec.vocab_size
    self.d_model = spec.d_model
    self.num_layers = spec.num_layers
    self.dtype = spec.dtype
    quantized = int8_lib.is_int8(spec.param_dtype)
    param_dtype = jnp.float32 if quantized else spec.param_dtype
    self.embedding = nnx.Param(nnx.initializers.normal(stddev=0.02)(
        rngs.params(), (spec.vocab_size, spec.d_model), param_dtype))
    self.layers = nnx.List([Block(layer, spec, rngs=rngs) for layer in spec.layers])
    self.final_norm = RMSNorm(spec.d_model, eps=spec.norm_eps, param_dtype=param_dtype)
    if spec.tie_embeddings:
      self.lm_head = None
    else:
      self.lm_head = nnx.Param(_dense_init()(
          rngs.params(), (spec.d_model, spec.vocab_size), param_dtype))
    if quantized:
      quantize_embeddings(self)
    # Cross-layer KV sharing: layer i reads the cache of layer kv_sources[i] (None: its own);
    # the layers that own a cache, in order: caches[c] is layer cache_layers[c]'s.
    self.kv_sources = tuple(layer.kv_source for layer in spec.layers)
    self.cache_layers = tuple(i for i, j in enumerate(self.kv_sources) if j is None)

  def truncated(self, num_layers: int) -> "Transformer":
    """A copy with the first `num_layers` layers, the same embedding, final norm
    and head (e.g. a draft model for speculative decoding, or layer-dropping
    studies); parameters are copied (`nnx.clone`), not shared.

    Raises:
      ValueError: `num_layers` not an int in [1, L].
    """
    if (isinstance(num_layers, bool) or not isinstance(num_layers, int)
        or not 1 <= num_layers <= self.num_layers):
      raise ValueError(f"num_layers must be an int in [1, {self.num_layers}]; got {num_layers!r}")
    out = nnx.clone(self)
    out.spec = dataclasses.replace(self.spec, num_layers=num_layers,
                                   layers=tuple(self.spec.layers[:num_layers]))
    out.num_layers = num_layers
    out.layers = nnx.List(list(out.layers)[:num_layers])
    out.kv_sources = self.kv_sources[:num_layers]  # sources are earlier layers: still valid
    out.cache_layers = tuple(i for i in self.cache_layers if i < num_layers)
    return out

  @property
  def num_caches(self) -> int:
    """Caches the model takes: one per layer that owns its K/V (`cache_layers`)."""
    return len(self.cache_layers)

  @classmethod
  def from_config(cls, cfg: Any, *, rngs: nnx.Rngs) -> "Transformer":
    """Builds a Transformer from the `model` section of a config (schema in the module doc).

    Raises:
      ValueError: unknown key or invalid value, naming the dotted key.
    """
    return cls(resolve_config(cfg), rngs=rngs)

  def cache_bytes_per_token(self, dtype: Any = None) -> int:
    """Analytic cache bytes per token summed over layers (see `cache_bytes_per_token`)."""
    return cache_bytes_per_token(self.spec, dtype)

  def init_caches(self, batch: int, max_len: int, dtype: Any = None, *,
                  cache: Any = None, local_layers: str = "ring") -> tuple[Any, ...]:
    """One empty cache per layer that owns one (`cache_layers`: every layer, but those that
    read another layer's cache under cross-layer KV sharing), as a tuple pytree.

    Args:
      batch: B.
      max_len: capacity S in tokens (the bounded kinds ignore it).
      dtype: cache storage dtype; default the model's compute dtype. A float
        dtype, or a quantized KV format (int8, float8_e4m3fn, float8_e5m2)
        stored with f32 per-token scales (`kvattn.ops.quantize_kv`).
      cache: None (dense caches of `max_len`, `layer.attn.init_cache`) or a cache
        spec `{"kind": ..., **options}` of `kvattn.caches.registry`, e.g.
        `{"kind": "sink", "num_sinks": 4, "window": 252}` or
        `{"kind": "h2o", "budget": 256}`.
      local_layers: "ring" (default, the per-layer layout, as HF and llama.cpp
        allocate): layers with a sliding window W < max_len (Gemma 2/3's local layers)
        get a `RingKVCache` of W slots, exact for their attention, the others the
        chosen kind (`kvattn.caches.registry.build_caches`); a model without such
        layers gets the same caches as "full". "full": every layer the chosen kind at
        `max_len`.

    Raises:
      ValueError: non-positive sizes; an unknown kind or a bad option.
      TypeError: a dtype that is neither floating nor a quantized KV format.
    """
    dtype = self.dtype if dtype is None else dtype
    if cache is None and (local_layers == "full" or (
        local_layers == "ring" and not cache_registry.ring_layers(self, max_len))):
      return tuple(self.layers[i].attn.init_cache(batch, max_len, dtype)
                   for i in self.cache_layers)
    return cache_registry.build_caches(self, batch, max_len, dtype, cache,
                                       local_layers=local_layers)

  def _check_tokens(self, tokens):
    _checks.rank("tokens", tokens, 2, "[B, T]")
    _checks.integer("tokens", tokens)

  def hidden(
      self,
      tokens: jax.Array,  # i32[B, T]
      caches: Sequence[Any] | None = None,
      positions: jax.Array | None = None,  # i32[B, T]
      new_lengths: jax.Array | None = None,  # i32[B]
  ) -> tuple[jax.Array, tuple[Any, ...] | None]:
    """Final-normed hidden states `[B, T, D]` (compute dtype) and the updated caches."""
    tokens = jnp.asarray(tokens)
    self._check_tokens(tokens)
    if caches is not None and len(caches) != self.num_caches:
      shared = "" if self.num_caches == self.num_layers else (
          f" that owns one ({self.num_caches} of {self.num_layers}: cross-layer KV sharing)")
      raise ValueError(f"caches must hold one cache per layer{shared} ({self.num_caches}); got "
                       f"{len(caches)}")
    # Positions once for every layer: each layer's cache holds the same tokens.
    first = caches[0] if caches and hasattr(caches[0], "lengths") else None
    positions = gqa_lib.resolve_positions(positions, first, *tokens.shape)
    x = embed(self.embedding[...], _value(getattr(self, "embedding_scale", None)), tokens,
              self.spec)  # [B, T, D]
    new_caches = []
    read = set(j for j in self.kv_sources if j is not None)  # layers whose K/V others read
    shared = {}  # owner layer -> its SharedKV of this pass
    for i, layer in enumerate(self.layers):
      j = self.kv_sources[i]
      if j is not None:
        x, _, _ = layer.step(x, None, positions, new_lengths, shared_kv=shared[j])
        continue
      cache = None if caches is None else caches[len(new_caches)]
      x, cache, shared[i] = layer.step(x, cache, positions, new_lengths, share=i in read)
      new_caches.append(cache)
    return self.final_norm(x), (None if caches is None else tuple(new_caches))

  def logits_from_hidden(self, h: jax.Array) -> jax.Array:  # [..., D] -> f32[..., V]
    """Projects hidden states onto the vocabulary in f32 (then `final_soft_cap`, if set)."""
    logits = head_logits(h, self.embedding[...], _value(getattr(self, "embedding_scale", None)),
                         _value(self.lm_head), _value(getattr(self, "lm_head_scale", None)))
    return soft_cap_logits(logits, self.spec.final_soft_cap)

  def __call__(
      self,
      tokens: jax.Array,  # i32[B, T]
      caches: Sequence[Any] | None = None,
      positions: jax.Array | None = None,  # i32[B, T]
      new_lengths: jax.Array | None = None,  # i32[B]
  ) -> tuple[jax.Array, tuple[Any, ...] | None]:
    h, caches = self.hidden(tokens, caches, positions, new_lengths)
    return self.logits_from_hidden(h), caches


def smooth_model(model: "Transformer", tokens: jax.Array, *, alpha: float = 0.5
                 ) -> "Transformer":
  """SmoothQuant's scale migration (Xiao et al. 2023, eq. 4), in place on a float model.

  For the input channels j of three products of every GQA block -- the
  attention input (q/k/v), the MLP input (gate/up) and the down projection's
  input -- `s_j = max|X_j|^alpha / max|W_j|^(1 - alpha)` from the activations
  `X` of the calibration `tokens`; `X / s` is folded into what produces `X`
  (the RMSNorm scale before q/k/v and gate/up; the up projection's output
  column j before down) and `W * s` into the weight rows, so the float model
  computes the same function while activation outliers move into the weights,
  which `quantize_model` then quantizes per output channel. MLA layers are
  left as they are. Call before `quantize_model`.

  Args:
    model: a float `Transformer`.
    tokens: `i32[B, T]` calibration tokens (text apart from any evaluation text).
    alpha: migration strength in [0, 1] (0.5: the paper's default).

  Raises:
    ValueError: an int8 model, or alpha outside [0, 1].
  """
  if int8_lib.is_int8(model.spec.param_dtype):
    raise ValueError("smooth_model needs float weights; call it before quantize_model")
  if model.num_caches != model.num_layers:
    raise NotImplementedError("smooth_model of a model with cross-layer KV sharing "
                              "(model.cla_factor / kv_source) is not implemented")
  if not 0.0 <= alpha <= 1.0:
    raise ValueError(f"alpha must lie in [0, 1]; got {alpha!r}")
  tokens = jnp.asarray(tokens, jnp.int32)
  positions = gqa_lib.resolve_positions(None, None, *tokens.shape)
  x = embed(model.embedding[...], None, tokens, dataclasses.replace(model.spec, dtype=jnp.float32))

  def absmax(a):  # per channel over every token: [..., C] -> [C]
    return jnp.max(jnp.abs(a.reshape(-1, a.shape[-1]).astype(jnp.float32)), axis=0)

  def factors(act_max, w_max):
    s = act_max ** alpha / jnp.maximum(w_max, 1e-8) ** (1 - alpha)
    return jnp.where((act_max > 0) & jnp.isfinite(s), jnp.clip(s, 1e-4, 1e4), 1.0)

  def scale_rows(param, s):
    param.set_value(param[...] * s.reshape((-1,) + (1,) * (param[...].ndim - 1)))

  for layer in model.layers:
    a = layer.attn_norm(x)
    new_x, _ = layer(x, None, positions, None)  # before this layer's weights change
    h, _ = layer.attn(a, None, positions, None)
    x_mid = x + h.astype(x.dtype)
    mlp_in = layer.mlp_norm(x_mid)
    mlp = layer.mlp
    g = mlp_in @ mlp.gate[...]
    u = mlp_in @ mlp.up[...]
    hidden = jax.nn.silu(g) * u
    if isinstance(layer.attn, gqa_lib.GroupedQueryAttention):
      attn = layer.attn
      w_max = jnp.max(jnp.stack([jnp.max(jnp.abs(p[...].reshape(p[...].shape[0], -1)), axis=1)
                                 for p in (attn.q_proj, attn.k_proj, attn.v_proj)]), axis=0)
      s = factors(absmax(a), w_max)
      layer.attn_norm.scale.set_value(layer.attn_norm.scale[...] / s)
      for p in (attn.q_proj, attn.k_proj, attn.v_proj):
        scale_rows(p, s)
    w_max = jnp.maximum(jnp.max(jnp.abs(mlp.gate[...]), axis=1), jnp.max(jnp.abs(mlp.up[...]),
                                                                          axis=1))
    s = factors(absmax(mlp_in), w_max)
    layer.mlp_norm.scale.set_value(layer.mlp_norm.scale[...] / s)
    scale_rows(mlp.gate, s)
    scale_rows(mlp.up, s)
    s = factors(absmax(hidden), jnp.max(jnp.abs(mlp.down[...]), axis=1))
    mlp.up.set_value(mlp.up[...] / s)
    scale_rows(mlp.down, s)
    x = new_x
  return model
