"""The `model` config schema: `ModelSpec` and `AttentionSpec`, `model_config`, `resolve_config`.

The two frozen dataclasses are the single source of the `model` ConfigDict (`model_config`)
and its validation (`resolve_config`, errors naming the dotted key, e.g.
"model.attention.num_kv_heads must divide model.attention.num_heads; got 3 and 4"). A
setting is `model.<field>` or `model.attention.<field>` in code, config files, the command
line and sweeps; a new field is one line in its dataclass. `model.layers` is empty or has
one entry per layer: None / {} or a dict of `AttentionSpec` overrides for that layer.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from typing import Any, Mapping, Sequence

import jax.numpy as jnp
from ml_collections import config_dict

from kvattn import memory
from kvattn.models import gqa as gqa_lib
from kvattn.models import mla as mla_lib
from kvattn.models.gqa import GroupedQueryAttention
from kvattn.models.mla import MultiHeadLatentAttention
from kvattn.ops import rope as rope_lib

ATTENTION_KINDS = ("gqa", "mla")
MLP_ACTIVATIONS = ("silu", "gelu_tanh")
_ATTENTION_MODULES = {"gqa": GroupedQueryAttention, "mla": MultiHeadLatentAttention}
_DECODE_IMPLEMENTATIONS = {"gqa": gqa_lib.decode_implementations,
                           "mla": mla_lib.decode_implementations}


def _field(default: Any, *, kinds: Sequence[str] = ATTENTION_KINDS, even: bool = False,
           choices: Sequence[str] | None = None, dtype: bool = False,
           int8: bool = False, minimum: int = 1) -> Any:
  """A schema field: its default and the checks beyond its type (`kinds`: the attention
  kinds that use it; `even`; `choices`; `dtype`: names a float dtype, `int8` allowing int8;
  `minimum` of an int)."""
  return dataclasses.field(default=default, metadata=dict(
      kinds=tuple(kinds), even=even, choices=None if choices is None else tuple(choices),
      dtype=dtype, int8=int8, minimum=minimum))


@dataclasses.dataclass(frozen=True)
class AttentionSpec:
  """The `model.attention` section (or a `model.layers[i]` override): one layer's attention.
  Optional fields admit None (off). Resolved instances hold None in the fields of the kinds
  a layer does not use."""

  kind: str = _field("gqa", choices=ATTENTION_KINDS)  # "gqa" (MHA/GQA/MQA) or "mla".
  num_heads: int = 8  # Query heads N.
  rope_theta: float = 10000.0  # RoPE base.
  window: int | None = None  # Sliding window in tokens (the cache keeps full capacity).
  # kvattn.ops backend of T = 1 decode steps, a name of `kvattn.models.gqa.decode_implementations()`
  # or `kvattn.models.mla.decode_implementations()` (e.g. "xla", "pallas"); None = the best available.
  decode_implementation: str | None = None
  num_kv_heads: int = _field(8, kinds=("gqa",))  # KV heads K, divides N (N: MHA, 1: MQA).
  head_dim: int = _field(32, kinds=("gqa",), even=True)  # Head width H.
  soft_cap: float | None = _field(None, kinds=("gqa",))  # Attention logit soft cap.
  # MLA sizes (DeepSeek-V2 names).
  kv_lora_rank: int = _field(64, kinds=("mla",))  # Latent width C.
  qk_nope_head_dim: int = _field(32, kinds=("mla",))  # No-RoPE query/key head width.
  qk_rope_head_dim: int = _field(16, kinds=("mla",), even=True)  # Decoupled RoPE width R.
  v_head_dim: int = _field(32, kinds=("mla",))  # Value head width.
  q_lora_rank: int | None = _field(None, kinds=("mla",))  # Query low-rank width; None = full.
  # Multiplies the MLA softmax scale (DeepSeek's YaRN: mscale(factor, mscale_all_dim)^2).
  softmax_scale_factor: float = _field(1.0, kinds=("mla",))
  # RoPE on the R rope dims as this many chunks of width R / num_rope_heads (1: DeepSeek-V2; > 1:
  # one rope key per source KV head of a GQA checkpoint converted by kvattn.models.convert.to_mla).
  num_rope_heads: int = _field(1, kinds=("mla",))
  latent_norm: bool = _field(True, kinds=("mla",))  # RMSNorm on the MLA latent (DeepSeek-V2).
  qkv_bias: bool = _field(False, kinds=("gqa",))  # Biases on the q/k/v projections (Qwen2).
  # RMSNorm over each head's query and key before RoPE (qk-norm: Qwen3, Gemma 3), epsilon
  # `model.norm_eps`; parameters `q_norm, k_norm: [H]`.
  qk_norm: bool = _field(False, kinds=("gqa",))
  # Softmax scale of the attention logits; None = 1 / sqrt(head_dim) (Gemma:
  # query_pre_attn_scalar ** -0.5).
  sm_scale: float | None = _field(None, kinds=("gqa",))
  # Cross-layer KV sharing (CLA, Brandon et al. 2024; Gemma 3n's `kv_shared_layer_index`, vLLM's
  # `kv_sharing_target_layer_name`): this layer has no K/V projections and reads the K/V cache of
  # layer `kv_source` (an earlier layer of the same type that owns its cache). Set per layer in
  # `model.layers[i]` (or for the whole model by `model.cla_factor`); None = its own cache.
  kv_source: int | None = _field(None, kinds=("gqa",), minimum=0)
  # RoPE context extension (`kvattn.ops.RopeScaling`, as transformers computes it): None or
  # "linear", "llama3", "yarn"; the modules get the rope_* fields as one `rope_scaling` object.
  rope_scaling: str | None = _field(None, choices=rope_lib.ROPE_SCALINGS)
  rope_factor: float | None = None  # Context extension factor (every scaling).
  rope_original_max_position: int | None = None  # Pretraining context ("llama3", "yarn").
  rope_low_freq_factor: float | None = None  # "llama3" low band edge.
  rope_high_freq_factor: float | None = None  # "llama3" high band edge (> low).
  rope_beta_fast: float | None = None  # "yarn" ramp bound in rotations; None = 32.
  rope_beta_slow: float | None = None  # "yarn" ramp bound in rotations; None = 1.
  rope_attention_factor: float | None = None  # "yarn" cos/sin factor; None = 0.1 ln(f) + 1.

  def rope(self) -> rope_lib.RopeScaling | None:
    """The `rope_*` fields as the modules' `rope_scaling` (None: plain RoPE).

    Raises:
      ValueError: a parameter the scaling needs missing, or one it does not use set.
    """
    return rope_lib.rope_scaling_from_fields(
        **{name: getattr(self, name) for name in ROPE_SCALING_FIELDS})

  def bytes_per_token(self, dtype: Any) -> int:
    """Analytic cache bytes per token of this layer (`kvattn.memory`)."""
    if self.kind == "gqa":
      return memory.gqa_bytes_per_token(self.num_kv_heads, self.head_dim, dtype)
    return memory.mla_bytes_per_token(self.kv_lora_rank, self.qk_rope_head_dim, dtype)


@dataclasses.dataclass(frozen=True)
class ModelSpec:
  """The `model` section: sizes, dtypes and the attention of every layer; resolved, its
  dtypes are `jnp.dtype`s and `layers` holds one AttentionSpec per layer."""

  vocab_size: int = 259  # V: 256 bytes + BOS/EOS/PAD (kvattn.training.data).
  d_model: int = 256  # Model width D.
  num_layers: int = 4  # Blocks L.
  mlp_dim: int = 768  # SwiGLU hidden width F.
  # The gated MLP's activation: "silu" (SwiGLU, Llama) or "gelu_tanh" (GeGLU with tanh GELU, Gemma).
  mlp_activation: str = _field("silu", choices=MLP_ACTIVATIONS)
  scale_embeddings: bool = False  # Multiply the embeddings by sqrt(d_model) (Gemma).
  # RMSNorm also on the attention and MLP outputs before the residual add (Gemma 2/3's four norms).
  post_norms: bool = False
  final_soft_cap: float | None = None  # Soft cap of the output logits, cap tanh(x / cap) (Gemma 2).
  tie_embeddings: bool = True  # LM head shares the embedding matrix.
  # Cross-layer attention (CLA, Brandon et al. 2024, arXiv 2405.12981) sharing factor s: the GQA
  # layers of each type (same window, RoPE, KV heads and head dim: Gemma's local and global
  # layers apart), in layer order, form groups of s; the first layer of a group computes and
  # caches K/V, the others read its cache (`kv_source`, no K/V projections). None or 1: off.
  cla_factor: int | None = None
  norm_eps: float = 1e-6  # RMSNorm epsilon.
  dtype: str = _field("float32", dtype=True)  # Compute dtype (and default cache dtype).
  # Parameter storage dtype: a float dtype, or "int8" for W8A8 (int8 weights with per-channel
  # scales, per-token int8 activations, int32 accumulation; `kvattn.models.int8`).
  param_dtype: str = _field("float32", dtype=True, int8=True)
  attention: AttentionSpec = AttentionSpec()  # The attention of every layer.
  # Per-layer overrides of `attention`: () or one entry per layer, each None / {} (no change) or
  # a dict of AttentionSpec fields, e.g. `({}, {"kind": "mla"})`.
  layers: tuple[Any, ...] = ()


_HINTS = {cls: typing.get_type_hints(cls) for cls in (AttentionSpec, ModelSpec)}
ROPE_SCALING_FIELDS = tuple(f.name for f in dataclasses.fields(AttentionSpec)
                             if f.name.startswith("rope_") and f.name != "rope_theta")


def attention_fields(kind: str) -> tuple[str, ...]:
  """The `AttentionSpec` fields that layers of attention `kind` use (`kind` itself included)."""
  return tuple(f.name for f in dataclasses.fields(AttentionSpec)
               if kind in f.metadata.get("kinds", ATTENTION_KINDS))


def _optional_type(hint: Any) -> tuple[Any, bool]:
  """`(T, True)` for `T | None`, `(hint, False)` otherwise."""
  args = typing.get_args(hint)
  if type(None) in args:
    return next(a for a in args if a is not type(None)), True
  return hint, False


def _config_dict(spec: Any) -> config_dict.ConfigDict:
  """The ConfigDict of a schema dataclass: every field, None defaults as typed placeholders."""
  cfg = config_dict.ConfigDict()
  hints = _HINTS[type(spec)]
  for f in dataclasses.fields(spec):
    value = getattr(spec, f.name)
    if dataclasses.is_dataclass(value):
      value = _config_dict(value)
    elif value is None:
      value = config_dict.placeholder(_optional_type(hints[f.name])[0])
    setattr(cfg, f.name, value)
  return cfg


def _replace(cls: type, defaults: Any, overrides: Mapping[str, Any], where: str) -> Any:
  names = [f.name for f in dataclasses.fields(cls)]
  for key in overrides:
    if key not in names:
      raise ValueError(f"{where}.{key} is not a known key; expected one of {sorted(names)}")
  return dataclasses.replace(defaults, **overrides)


def attention_config(**overrides: Any) -> config_dict.ConfigDict:
  """The `model.attention` ConfigDict of `AttentionSpec`'s defaults with `overrides`.

  Raises:
    ValueError: an override names a key that is not an `AttentionSpec` field.
  """
  return _config_dict(_replace(AttentionSpec, AttentionSpec(), overrides, "model.attention"))


def model_config(**overrides: Any) -> config_dict.ConfigDict:
  """The `model` ConfigDict of `ModelSpec`'s defaults with top-level overrides; `attention=`
  takes a dict of overrides, an AttentionSpec or a ConfigDict.

  Raises:
    ValueError: an override that is not a `ModelSpec` / `AttentionSpec` field.
  """
  attention = overrides.pop("attention", None)
  cfg = _config_dict(_replace(ModelSpec, ModelSpec(), overrides, "model"))
  if isinstance(attention, (config_dict.ConfigDict, AttentionSpec)):
    cfg.attention = attention if isinstance(attention, config_dict.ConfigDict) else \
        _config_dict(attention)
  elif attention is not None:
    cfg.attention = attention_config(**dict(attention))
  return cfg


# ----------------------------------------------------------------------------------------------
# Validation: config -> ModelSpec (plain, hashable, validated values), driven by the fields.


def _as_dict(cfg: Any, where: str) -> dict[str, Any]:
  if isinstance(cfg, (config_dict.ConfigDict, config_dict.FrozenConfigDict)):
    return cfg.to_dict()
  if isinstance(cfg, (AttentionSpec, ModelSpec)):
    return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}
  if isinstance(cfg, Mapping):
    return dict(cfg)
  raise TypeError(f"{where} must be a ConfigDict or a mapping; got {type(cfg).__name__}")


def _check_keys(d: Mapping[str, Any], cls: type, where: str):
  names = [f.name for f in dataclasses.fields(cls)]
  unknown = sorted(set(d) - set(names))
  if unknown:
    raise ValueError(f"{where}.{unknown[0]} is not a known key; expected one of {sorted(names)}")


def _int(where: str, value: Any, *, even: bool = False, minimum: int = 1) -> int:
  if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
    kind = "a positive int" if minimum == 1 else f"an int >= {minimum}"
    raise ValueError(f"{where} must be {kind}; got {value!r}")
  if even and value % 2:
    raise ValueError(f"{where} must be even (RoPE rotates pairs); got {value}")
  return value


def _float(where: str, value: Any) -> float:
  if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 \
      or not math.isfinite(value):
    raise ValueError(f"{where} must be a positive finite float; got {value!r}")
  return float(value)


def _dtype(where: str, value: Any, int8: bool = False):
  try:
    dtype = jnp.dtype(value)
  except TypeError:
    dtype = None
  if int8 and dtype == jnp.int8:
    return dtype
  if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
    also = " (or 'int8')" if int8 else ""
    raise ValueError(f"{where} must name a floating dtype such as 'float32'{also}; got {value!r}")
  return dtype


def _check_field(f: dataclasses.Field, hint: Any, value: Any, where: str) -> Any:
  """`value` checked against the field's type and metadata (ValueError naming `where`)."""
  if f.metadata.get("dtype"):
    return _dtype(where, value, f.metadata.get("int8", False))
  hint, optional = _optional_type(hint)
  if value is None and optional:
    return None
  if hint is bool:
    if not isinstance(value, bool):
      raise ValueError(f"{where} must be a bool; got {value!r}")
    return value
  if hint is int:
    return _int(where, value, even=f.metadata.get("even", False),
                minimum=f.metadata.get("minimum", 1))
  if hint is float:
    return _float(where, value)
  if hint is str:
    choices = f.metadata.get("choices")
    if choices is not None and value not in choices:
      raise ValueError(f"{where} must be one of {choices}; got {value!r}")
    if not isinstance(value, str):
      raise ValueError(f"{where} must be a str{' or None' if optional else ''}; got {value!r}")
    return value
  raise TypeError(f"{where}: the schema has no check for type {hint!r}")  # a schema bug


def _attention_spec(d: Mapping[str, Any], where: str) -> AttentionSpec:
  """A validated AttentionSpec of one layer from its merged `attention` fields."""
  _check_keys(d, AttentionSpec, where)
  hints = _HINTS[AttentionSpec]
  fields = {f.name: f for f in dataclasses.fields(AttentionSpec)}
  kind = _check_field(fields["kind"], hints["kind"], d.get("kind", "gqa"), f"{where}.kind")
  used = attention_fields(kind)
  values = {name: _check_field(f, hints[name], d.get(name, f.default), f"{where}.{name}")
                  if name in used else None for name, f in fields.items()}
  if kind not in fields["kv_source"].metadata["kinds"] and d.get("kv_source") is not None:
    raise ValueError(f"{where}.kv_source must be None for attention kind {kind!r} (cross-layer "
                     f"KV sharing reads GQA caches); got {d['kv_source']!r}")
  impl = values["decode_implementation"]
  if impl is not None and impl not in _DECODE_IMPLEMENTATIONS[kind]():
    raise ValueError(
        f"{where}.decode_implementation must be one of {list(_DECODE_IMPLEMENTATIONS[kind]())} "
        f"or None for attention kind {kind!r}; got {impl!r}")
  if kind == "gqa" and values["num_heads"] % values["num_kv_heads"]:
    raise ValueError(
        f"{where}.num_kv_heads must divide {where}.num_heads; got {values['num_kv_heads']} and "
        f"{values['num_heads']}")
  spec = AttentionSpec(**values)
  try:
    spec.rope()
  except ValueError as e:
    raise ValueError(f"{where}: {e}") from None
  return spec


def resolve_config(cfg: Any) -> ModelSpec:
  """Validates a `model` config (ConfigDict, mapping or ModelSpec) and returns its ModelSpec.

  Raises:
    ValueError: an unknown key or invalid value, naming the dotted key.
    TypeError: `cfg` is not a ConfigDict, mapping or ModelSpec.
  """
  d = _as_dict(cfg, "model")
  _check_keys(d, ModelSpec, "model")
  hints = _HINTS[ModelSpec]
  values = {}
  for f in dataclasses.fields(ModelSpec):
    if f.name not in ("attention", "layers"):
      values[f.name] = _check_field(f, hints[f.name], d.get(f.name, f.default), f"model.{f.name}")
  base = _as_dict(d.get("attention", AttentionSpec()), "model.attention")
  values["attention"] = _attention_spec(base, "model.attention")  # valid on its own too
  num_layers = values["num_layers"]
  per_layer = d.get("layers") or ()
  if not isinstance(per_layer, (tuple, list)):
    raise ValueError(f"model.layers must be a tuple of per-layer overrides; got {per_layer!r}")
  if per_layer and len(per_layer) != num_layers:
    raise ValueError(
        f"model.layers must be empty or have model.num_layers = {num_layers} entries; got "
        f"{len(per_layer)}")
  layers = []
  for i in range(num_layers):
    override = per_layer[i] if per_layer else None
    override = {} if override is None else _as_dict(override, f"model.layers[{i}]")
    _check_keys(override, AttentionSpec, f"model.layers[{i}]")
    where = f"model.layers[{i}]" if override else "model.attention"
    layers.append(_attention_spec({**base, **override}, where))
  if values["attention"].kv_source is not None:
    raise ValueError(f"model.attention.kv_source must be None (it would make every layer read "
                     f"one layer's cache); set it per layer in model.layers[i] or use "
                     f"model.cla_factor; got {values['attention'].kv_source}")
  layers = _resolve_kv_sharing(layers, values["cla_factor"])
  return ModelSpec(**values, layers=tuple(layers))


KV_TYPE_FIELDS = ("kind", "num_kv_heads", "head_dim", "window", "rope_theta") + tuple(
    f.name for f in dataclasses.fields(AttentionSpec)
    if f.name.startswith("rope_") and f.name != "rope_theta")
"""The `AttentionSpec` fields that make a layer's K/V cache: a layer reads another's cache
(`kv_source`) only when these are equal (its "type": Gemma's local and global layers differ
in window and RoPE base)."""


def kv_type(layer: AttentionSpec) -> tuple[Any, ...]:
  """The layer's cache type (`KV_TYPE_FIELDS`' values): layers of one type may share a cache."""
  return tuple(getattr(layer, name) for name in KV_TYPE_FIELDS)


def cla_sources(layers: Sequence[AttentionSpec], cla_factor: int | None) -> list[int | None]:
  """Per layer, the layer whose cache it reads under `cla_factor` (None: its own). CLA
  (Brandon et al. 2024): each `kv_type`'s GQA layers in groups of `cla_factor`, the first
  owning the cache (Gemma 3: locals (0, 1), (2, 3), (4, 6), ..., globals (5, 11), ...).

  Raises:
    ValueError: `cla_factor` > 1 on a model with MLA layers.
  """
  sources: list[int | None] = [None] * len(layers)
  if cla_factor is None or cla_factor == 1:
    return sources
  groups: dict[tuple[Any, ...], list[int]] = {}
  for i, layer in enumerate(layers):
    if layer.kind != "gqa":
      raise ValueError(f"model.cla_factor shares GQA caches; model.layers[{i}] is "
                       f"{layer.kind!r} (set model.cla_factor to None)")
    groups.setdefault(kv_type(layer), []).append(i)
  for members in groups.values():
    for start in range(0, len(members), cla_factor):
      for i in members[start + 1:start + cla_factor]:
        sources[i] = members[start]
  return sources


def _resolve_kv_sharing(layers: list[AttentionSpec], cla_factor: int | None
                        ) -> list[AttentionSpec]:
  """`layers` with every `kv_source` set (from `cla_factor`, or as given) and checked: an
  earlier layer that owns its cache and has the same `kv_type` (ValueError naming the key)."""
  implied = cla_sources(layers, cla_factor)
  out = []
  for i, layer in enumerate(layers):
    j = layer.kv_source
    if implied[i] is not None or (cla_factor not in (None, 1) and j is not None):
      if j is not None and j != implied[i]:
        raise ValueError(f"model.layers[{i}].kv_source = {j} conflicts with model.cla_factor = "
                         f"{cla_factor}, which gives layer {i} the source {implied[i]}")
      j = implied[i]
    if j is not None:
      if j >= i:
        raise ValueError(f"model.layers[{i}].kv_source must name an earlier layer (< {i}); "
                         f"got {j}")
      if layers[j].kv_source is not None:
        raise ValueError(f"model.layers[{i}].kv_source = {j} names a layer that reads layer "
                         f"{layers[j].kv_source}'s cache; name the layer that owns it")
      for name, mine, theirs in zip(KV_TYPE_FIELDS, kv_type(layer), kv_type(layers[j])):
        if mine != theirs:
          raise ValueError(f"model.layers[{i}].kv_source = {j} needs layers of one type (equal "
                           f"{KV_TYPE_FIELDS}); {name} is {mine!r} here and {theirs!r} in "
                           f"layer {j}")
    out.append(dataclasses.replace(layer, kv_source=j))
  return out


def cache_bytes_per_token(cfg: Any, dtype: Any = None) -> int:
  """Analytic cache bytes per token summed over the layers that own a cache: `2 K H itemsize`
  (GQA) or `(C + R) itemsize` (MLA); a batch-B cache of capacity S holds `B * S *` this.

  Raises:
    ValueError: an invalid config (see `resolve_config`).
  """
  spec = resolve_config(cfg)
  dtype = spec.dtype if dtype is None else dtype
  return sum(layer.bytes_per_token(dtype) for layer in spec.layers if layer.kv_source is None)
