"""Decoder-only Transformer LM whose layers take their attention from a config.

Llama-style (Touvron et al. 2023): embedding, L pre-norm blocks `x += attn(rmsnorm(x)); x +=
mlp(rmsnorm(x))` (RMSNorm, Zhang & Sennrich 2019; SwiGLU, Shazeer 2020 eq. 6), final RMSNorm
and LM head (optionally tied). Each layer is `GroupedQueryAttention` or
`MultiHeadLatentAttention`, per the config; Gemma 2/3 and Qwen3 options and cross-layer KV
sharing (`kv_source`, `cla_factor`) are fields of `kvattn.models.config`, re-exported here.
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
  """SwiGLU MLP (Shazeer 2020, eq. 6) `down(silu(x @ gate) * (x @ up))`, or GeGLU (eq. 5,
  tanh GELU) with `activation="gelu_tanh"`. Parameters `gate, up: [D, F]`, `down: [F, D]`
  (int8: packed output-major with f32 `*_scale`); matmuls accumulate in f32.
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
  """One layer's attention from its resolved AttentionSpec: "gqa" ->
  `GroupedQueryAttention`, "mla" -> `MultiHeadLatentAttention`, each field as the keyword
  of its name (the `rope_*` fields as one `rope_scaling=`)."""
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
  """W8A8 of the embedding and LM head, in place: a tied table becomes packed `uint8[V, D]`
  with `embedding_scale: f32[V]`; an untied `lm_head` packed `uint8[V, D]` with
  `lm_head_scale: f32[V]`."""
  w_q, scale = int8_lib.quantize_weight(model.embedding[...].T, 1)
  model.embedding = nnx.Param(int8_lib.pack_weight(w_q, 1))
  model.embedding_scale = nnx.Param(scale)
  if model.lm_head is not None:
    int8_lib.quantize_param(model, "lm_head", 1)


def quantize_model(model: "Transformer") -> "Transformer":
  """Turns a float `Transformer` into its W8A8 form in place (as `param_dtype="int8"`)
  and returns it; norms and biases are cast to f32.

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
  """`[B, T, D]` rows `tokens` of `embedding [V, D]` (times `scale f32[V]` for int8) in the
  compute dtype, times sqrt(D) rounded to it when `spec.scale_embeddings` (Gemma)."""
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

  Call: `logits f32[B, T, V], caches = model(tokens i32[B, T], caches=None, positions=None,
  new_lengths=None)`. `caches`: None (causal over T; returns None) or one cache per layer
  that owns one (`cache_layers`), e.g. from `init_caches`. `positions: i32[B, T]` and
  `new_lengths: i32[B]` as in the attention modules. `hidden(...)` returns the normed
  `[B, T, D]` states and `logits_from_hidden(h)` projects them.
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
    """A copy (`nnx.clone`) with the first `num_layers` layers, embedding, norm and head
    (e.g. a draft model).

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
    """Builds a Transformer from a config's `model` section (`kvattn.models.config`).

    Raises:
      ValueError: unknown key or invalid value, naming the dotted key.
    """
    return cls(resolve_config(cfg), rngs=rngs)

  def cache_bytes_per_token(self, dtype: Any = None) -> int:
    """Analytic cache bytes per token summed over layers (see `cache_bytes_per_token`)."""
    return cache_bytes_per_token(self.spec, dtype)

  def init_caches(self, batch: int, max_len: int, dtype: Any = None, *,
                  cache: Any = None, local_layers: str = "ring") -> tuple[Any, ...]:
    """One empty cache per layer that owns one (`cache_layers`), as a tuple.

    Args:
      batch: B.
      max_len: capacity S in tokens (the bounded kinds ignore it).
      dtype: storage dtype (default the compute dtype): float, or int8 / float8_e4m3fn /
        float8_e5m2 with f32 per-token scales.
      cache: None (dense) or a spec `{"kind": ..., **options}` of `kvattn.caches.registry`.
      local_layers: "ring" (default, as HF and llama.cpp allocate): each layer with a
        window W < max_len (Gemma 2/3's local layers) gets a `RingKVCache` of W slots,
        exact for its attention, the others the chosen kind; "full": every layer the
        kind at `max_len`.

    Raises:
      ValueError: non-positive sizes; an unknown kind, option or `local_layers`.
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

  def __call__(self, tokens, caches=None, positions=None, new_lengths=None):
    """`hidden`'s arguments; returns `(logits f32[B, T, V], caches)`."""
    h, caches = self.hidden(tokens, caches, positions, new_lengths)
    return self.logits_from_hidden(h), caches


def smooth_model(model: "Transformer", tokens: jax.Array, *, alpha: float = 0.5
                 ) -> "Transformer":
  """SmoothQuant's scale migration (Xiao et al. 2023, eq. 4), in place on a float model.

  For the inputs of q/k/v, gate/up and down of every GQA block, `s_j = max|X_j|^alpha /
  max|W_j|^(1 - alpha)` from the calibration activations; `X / s` is folded into what
  produces X and `W * s` into the weight rows, so the float function is unchanged. Call
  before `quantize_model`.

  Args:
    model: a float `Transformer`.
    tokens: `i32[B, T]` calibration tokens.
    alpha: migration strength in [0, 1].

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
