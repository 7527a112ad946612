"""Decoder-only Transformer LM whose layers take their attention from a config.

Architecture (Llama-style, Touvron et al. 2023): token embedding, L pre-norm
blocks `x += attn(rmsnorm(x)); x += mlp(rmsnorm(x))` with RMSNorm (Zhang &
Sennrich 2019) and a SwiGLU MLP (Shazeer 2020, "GLU Variants Improve
Transformer", eq. 6: `W2 (silu(x W1) * (x W3))`), a final RMSNorm and an LM
head (optionally tied to the embedding). Each layer's attention is a
`kvattn.GroupedQueryAttention` (MHA / GQA / MQA) or a
`kvattn.MultiHeadLatentAttention` (DeepSeek-V2 MLA), chosen per layer by the
config, so a model may mix variants.

Config schema (`model` section of an ml_collections config; build one with
`model_config(...)`; every key is checked by `resolve_config`, unknown keys and
bad values raise ValueError naming the dotted key):

  model.vocab_size        int   vocabulary size V (259: kvattn.data's bytes
                                + BOS/EOS/PAD).
  model.d_model           int   model width D.
  model.num_layers        int   number of blocks L.
  model.mlp_dim           int   SwiGLU hidden width F.
  model.tie_embeddings    bool  LM head = embedding transposed.
  model.norm_eps          float RMSNorm epsilon.
  model.dtype             str   compute dtype ("float32", "bfloat16", ...).
  model.param_dtype       str   parameter storage dtype.
  model.attention         ConfigDict, the attention of every layer:
    kind                  str   "gqa" (MHA/GQA/MQA) or "mla".
    num_heads             int   query heads N (both kinds).
    rope_theta            float RoPE base (both kinds).
    window                int|None  sliding window in tokens (both kinds;
                                the cache keeps full capacity).
    decode_implementation str|None  `kvattn.ops` backend for T == 1 decode
                                (None = best available; else a registered
                                name: "gqa" `kvattn.gqa.decode_implementations()`,
                                "mla" `kvattn.mla.decode_implementations()`,
                                e.g. "xla", "pallas").
    rope_scaling          str|None  RoPE context extension (both kinds):
                                None, "linear", "llama3" or "yarn"
                                (`kvattn.ops.RopeScaling`); its parameters
                                (None when the kind does not use them):
    rope_factor           float|None  extension factor (every kind).
    rope_original_max_position int|None  pretraining context ("llama3", "yarn").
    rope_low_freq_factor  float|None  "llama3" band edge.
    rope_high_freq_factor float|None  "llama3" band edge (> low).
    rope_beta_fast        float|None  "yarn" ramp bound (None: 32).
    rope_beta_slow        float|None  "yarn" ramp bound (None: 1).
    rope_attention_factor float|None  "yarn" cos/sin factor (None: 0.1 ln f + 1).
    -- "gqa" only --
    num_kv_heads          int   KV heads K, divides N (N: MHA, 1: MQA).
    head_dim              int   H, even.
    soft_cap              float|None  attention logit soft cap.
    qkv_bias              bool  biases on the q/k/v projections (Qwen2).
    -- "mla" only (DeepSeek-V2 names) --
    kv_lora_rank          int   latent width C.
    qk_nope_head_dim      int   no-RoPE query/key head width.
    qk_rope_head_dim      int   decoupled RoPE width R, even.
    v_head_dim            int   value head width.
    q_lora_rank           int|None  query low-rank width (None: full-rank).
    softmax_scale_factor  float multiplies the softmax scale (DeepSeek YaRN mscale^2).
  model.layers            tuple, empty (every layer uses `attention`) or one
                          entry per layer: None / {} (use `attention`) or a
                          dict of `attention` keys overriding it for that
                          layer, e.g. `({}, {"kind": "mla"})` or
                          `({"window": 128}, {})`.

Fields of the variant a layer does not use are ignored (they stay in the
config so that command-line overrides such as
`--config.model.attention.kind=mla` find every key).
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from ml_collections import config_dict

from kvattn import _checks
from kvattn import memory
from kvattn import gqa as gqa_lib
from kvattn.ops import rope as ops_rope
from kvattn.gqa import GroupedQueryAttention

ATTENTION_KINDS = ("gqa", "mla")
_ROPE_SCALING_KEYS = ("rope_scaling", "rope_factor", "rope_original_max_position",
                      "rope_low_freq_factor", "rope_high_freq_factor", "rope_beta_fast",
                      "rope_beta_slow", "rope_attention_factor")
_COMMON_ATTENTION_KEYS = ("kind", "num_heads", "rope_theta", "window",
                          "decode_implementation") + _ROPE_SCALING_KEYS
_GQA_KEYS = ("num_kv_heads", "head_dim", "soft_cap", "qkv_bias")
_MLA_KEYS = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "q_lora_rank",
             "softmax_scale_factor")
_MODEL_KEYS = ("vocab_size", "d_model", "num_layers", "mlp_dim", "tie_embeddings", "norm_eps",
               "dtype", "param_dtype", "attention", "layers")


def attention_config(**overrides: Any) -> config_dict.ConfigDict:
  """The default `model.attention` ConfigDict (GQA, N = K = 8, H = 32) with overrides.

  Raises:
    ValueError: an override names a key that is not in the schema.
  """
  cfg = config_dict.ConfigDict()
  cfg.kind = "gqa"  # "gqa" (MHA/GQA/MQA through num_kv_heads) or "mla".
  cfg.num_heads = 8  # Query heads N.
  cfg.rope_theta = 10000.0  # RoPE base.
  cfg.window = config_dict.placeholder(int)  # Sliding window in tokens; None = full.
  cfg.decode_implementation = config_dict.placeholder(str)  # kvattn.ops backend; None = best.
  cfg.rope_scaling = config_dict.placeholder(str)  # None, "linear", "llama3" or "yarn".
  cfg.rope_factor = config_dict.placeholder(float)  # Context extension factor.
  cfg.rope_original_max_position = config_dict.placeholder(int)  # Pretraining context.
  cfg.rope_low_freq_factor = config_dict.placeholder(float)  # "llama3" band edge.
  cfg.rope_high_freq_factor = config_dict.placeholder(float)  # "llama3" band edge.
  cfg.rope_beta_fast = config_dict.placeholder(float)  # "yarn" ramp bound; None = 32.
  cfg.rope_beta_slow = config_dict.placeholder(float)  # "yarn" ramp bound; None = 1.
  cfg.rope_attention_factor = config_dict.placeholder(float)  # "yarn" cos/sin factor.
  cfg.num_kv_heads = 8  # GQA: KV heads K (N: MHA, 1: MQA).
  cfg.head_dim = 32  # GQA: head width H (even).
  cfg.soft_cap = config_dict.placeholder(float)  # GQA: logit soft cap; None = off.
  cfg.qkv_bias = False  # GQA: biases on the q/k/v projections (Qwen2).
  cfg.kv_lora_rank = 64  # MLA: latent width C.
  cfg.qk_nope_head_dim = 32  # MLA: no-RoPE query/key head width.
  cfg.qk_rope_head_dim = 16  # MLA: decoupled RoPE width R (even).
  cfg.v_head_dim = 32  # MLA: value head width.
  cfg.q_lora_rank = config_dict.placeholder(int)  # MLA: query low rank; None = full rank.
  cfg.softmax_scale_factor = 1.0  # MLA: multiplies the softmax scale (DeepSeek YaRN mscale^2).
  _apply_overrides(cfg, overrides, "model.attention")
  return cfg


def model_config(**overrides: Any) -> config_dict.ConfigDict:
  """The default `model` ConfigDict, with top-level overrides.

  `attention=` takes a dict of `model.attention` overrides (merged into the
  defaults of `attention_config`) or a full ConfigDict. Example:

      model_config(d_model=64, num_layers=2, mlp_dim=128,
                   attention=dict(num_heads=4, num_kv_heads=1, head_dim=16))

  Raises:
    ValueError: an override names a key that is not in the schema.
  """
  cfg = config_dict.ConfigDict()
  cfg.vocab_size = 259  # V: 256 bytes + BOS/EOS/PAD (kvattn.data).
  cfg.d_model = 256  # Model width D.
  cfg.num_layers = 4  # Blocks L.
  cfg.mlp_dim = 768  # SwiGLU hidden width F.
  cfg.tie_embeddings = True  # LM head shares the embedding matrix.
  cfg.norm_eps = 1e-6  # RMSNorm epsilon.
  cfg.dtype = "float32"  # Compute dtype.
  cfg.param_dtype = "float32"  # Parameter dtype.
  attention = overrides.pop("attention", None)
  if isinstance(attention, config_dict.ConfigDict):
    cfg.attention = attention
  else:
    cfg.attention = attention_config(**dict(attention or {}))
  cfg.layers = ()  # Per-layer attention overrides: () or one dict/None per layer.
  _apply_overrides(cfg, overrides, "model")
  return cfg


def _apply_overrides(cfg: config_dict.ConfigDict, overrides: Mapping[str, Any], where: str):
  for key, value in overrides.items():
    if key not in cfg:
      raise ValueError(f"{where}.{key} is not a known key; expected one of {sorted(cfg.keys())}")
    # Placeholders are typed; assigning through the FieldReference keeps the type check.
    setattr(cfg, key, value)


# ----------------------------------------------------------------------------------------------
# Validation: config -> ModelSpec (plain, hashable, validated values).


@dataclasses.dataclass(frozen=True)
class AttentionSpec:
  """One layer's validated attention settings (fields of the other kind are None)."""

  kind: str
  num_heads: int
  rope_theta: float
  decode_implementation: str | None = None
  num_kv_heads: int | None = None
  head_dim: int | None = None
  window: int | None = None
  soft_cap: float | None = None
  kv_lora_rank: int | None = None
  qk_nope_head_dim: int | None = None
  qk_rope_head_dim: int | None = None
  v_head_dim: int | None = None
  q_lora_rank: int | None = None
  qkv_bias: bool | None = None
  softmax_scale_factor: float | None = None
  rope_scaling: str | None = None
  rope_factor: float | None = None
  rope_original_max_position: int | None = None
  rope_low_freq_factor: float | None = None
  rope_high_freq_factor: float | None = None
  rope_beta_fast: float | None = None
  rope_beta_slow: float | None = None
  rope_attention_factor: float | None = None

  def rope(self) -> ops_rope.RopeScaling | None:
    """The `rope_*` fields as the attention modules' `rope_scaling` (None: plain RoPE)."""
    return ops_rope.rope_scaling_from_fields(
        **{k: getattr(self, k) for k in _ROPE_SCALING_KEYS})

  def bytes_per_token(self, dtype: Any) -> int:
    """Analytic cache bytes per token of this layer (`kvattn.memory`)."""
    if self.kind == "gqa":
      return memory.gqa_bytes_per_token(self.num_kv_heads, self.head_dim, dtype)
    return memory.mla_bytes_per_token(self.kv_lora_rank, self.qk_rope_head_dim, dtype)


@dataclasses.dataclass(frozen=True)
class ModelSpec:
  """A validated `model` config: sizes, dtypes and one AttentionSpec per layer."""

  vocab_size: int
  d_model: int
  num_layers: int
  mlp_dim: int
  tie_embeddings: bool
  norm_eps: float
  dtype: Any
  param_dtype: Any
  layers: tuple[AttentionSpec, ...]


def _as_dict(cfg: Any, where: str) -> dict[str, Any]:
  if isinstance(cfg, (config_dict.ConfigDict, config_dict.FrozenConfigDict)):
    return cfg.to_dict()
  if isinstance(cfg, Mapping):
    return dict(cfg)
  raise TypeError(f"{where} must be a ConfigDict or a mapping; got {type(cfg).__name__}")


def _check_keys(d: Mapping[str, Any], allowed: Sequence[str], where: str):
  unknown = sorted(set(d) - set(allowed))
  if unknown:
    raise ValueError(
        f"{where}.{unknown[0]} is not a known key; expected one of {sorted(allowed)}")


def _int(where: str, value: Any, *, even: bool = False) -> int:
  if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
    raise ValueError(f"{where} must be a positive int; got {value!r}")
  if even and value % 2:
    raise ValueError(f"{where} must be even (RoPE rotates pairs); got {value}")
  return value


def _opt_int(where: str, value: Any) -> int | None:
  return None if value is None else _int(where, value)


def _opt_float(where: str, value: Any) -> float | None:
  return None if value is None else _float(where, value)


def _rope_scaling(d: Mapping[str, Any], where: str) -> dict[str, Any]:
  """The validated `rope_*` keys of an attention section (ValueError naming the dotted key)."""
  kind = d.get("rope_scaling")
  if kind is not None and kind not in ops_rope.ROPE_SCALINGS:
    raise ValueError(f"{where}.rope_scaling must be one of {ops_rope.ROPE_SCALINGS} or None; "
                     f"got {kind!r}")
  values = {"rope_scaling": kind}
  for key in _ROPE_SCALING_KEYS[1:]:
    check = _opt_int if key == "rope_original_max_position" else _opt_float
    values[key] = check(f"{where}.{key}", d.get(key))
  try:
    ops_rope.rope_scaling_from_fields(**values)
  except ValueError as e:
    raise ValueError(f"{where}: {e}") from None
  return values


def _float(where: str, value: Any) -> float:
  if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 \
      or value == float("inf"):
    raise ValueError(f"{where} must be a positive finite float; got {value!r}")
  return float(value)


def _dtype(where: str, value: Any):
  try:
    dtype = jnp.dtype(value)
  except TypeError:
    raise ValueError(
        f"{where} must name a floating dtype such as 'float32'; got {value!r}") from None
  if not jnp.issubdtype(dtype, jnp.floating):
    raise ValueError(f"{where} must name a floating dtype such as 'float32'; got {value!r}")
  return dtype


def _attention_spec(d: Mapping[str, Any], where: str) -> AttentionSpec:
  _check_keys(d, _COMMON_ATTENTION_KEYS + _GQA_KEYS + _MLA_KEYS, where)
  kind = d.get("kind")
  if kind not in ATTENTION_KINDS:
    raise ValueError(f"{where}.kind must be one of {ATTENTION_KINDS}; got {kind!r}")
  impl = d.get("decode_implementation")
  if impl is not None and not isinstance(impl, str):
    raise ValueError(f"{where}.decode_implementation must be a str or None; got {impl!r}")
  if impl is not None:
    if kind == "gqa":
      choices = gqa_lib.decode_implementations()
    else:
      choices = importlib.import_module("kvattn.mla").decode_implementations()
    if impl not in choices:
      raise ValueError(f"{where}.decode_implementation must be one of {list(choices)} or None "
                       f"for attention kind {kind!r}; got {impl!r}")
  common = dict(kind=kind, num_heads=_int(f"{where}.num_heads", d.get("num_heads")),
                rope_theta=_float(f"{where}.rope_theta", d.get("rope_theta")),
                window=_opt_int(f"{where}.window", d.get("window")),
                decode_implementation=impl, **_rope_scaling(d, where))
  if kind == "gqa":
    num_kv_heads = _int(f"{where}.num_kv_heads", d.get("num_kv_heads"))
    if common["num_heads"] % num_kv_heads:
      raise ValueError(
          f"{where}.num_kv_heads must divide {where}.num_heads; got {num_kv_heads} and "
          f"{common['num_heads']}")
    soft_cap = d.get("soft_cap")
    qkv_bias = d.get("qkv_bias", False)
    if not isinstance(qkv_bias, bool):
      raise ValueError(f"{where}.qkv_bias must be a bool; got {qkv_bias!r}")
    return AttentionSpec(
        **common, num_kv_heads=num_kv_heads,
        head_dim=_int(f"{where}.head_dim", d.get("head_dim"), even=True),
        soft_cap=None if soft_cap is None else _float(f"{where}.soft_cap", soft_cap),
        qkv_bias=qkv_bias)
  return AttentionSpec(
      **common,
      kv_lora_rank=_int(f"{where}.kv_lora_rank", d.get("kv_lora_rank")),
      qk_nope_head_dim=_int(f"{where}.qk_nope_head_dim", d.get("qk_nope_head_dim")),
      qk_rope_head_dim=_int(f"{where}.qk_rope_head_dim", d.get("qk_rope_head_dim"), even=True),
      v_head_dim=_int(f"{where}.v_head_dim", d.get("v_head_dim")),
      q_lora_rank=_opt_int(f"{where}.q_lora_rank", d.get("q_lora_rank")),
      softmax_scale_factor=_float(f"{where}.softmax_scale_factor",
                                  d.get("softmax_scale_factor", 1.0)))


def resolve_config(cfg: Any) -> ModelSpec:
  """Validates a `model` config (ConfigDict or mapping) and returns its ModelSpec.

  Raises:
    ValueError: an unknown key or an invalid value, naming the dotted key
      (e.g. "model.layers[1].num_kv_heads must divide ...").
    TypeError: `cfg` is not a ConfigDict or mapping.
  """
  d = _as_dict(cfg, "model")
  _check_keys(d, _MODEL_KEYS, "model")
  missing = [k for k in _MODEL_KEYS if k not in d]
  if missing:
    raise ValueError(f"model.{missing[0]} is missing; build the config with model_config()")
  base = _as_dict(d["attention"], "model.attention")
  _attention_spec(base, "model.attention")  # the shared section must be valid on its own
  num_layers = _int("model.num_layers", d["num_layers"])
  per_layer = d["layers"]
  if per_layer is None:
    per_layer = ()
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
    _check_keys(override, _COMMON_ATTENTION_KEYS + _GQA_KEYS + _MLA_KEYS, f"model.layers[{i}]")
    where = f"model.layers[{i}]" if override else "model.attention"
    layers.append(_attention_spec({**base, **override}, where))
  tie = d["tie_embeddings"]
  if not isinstance(tie, bool):
    raise ValueError(f"model.tie_embeddings must be a bool; got {tie!r}")
  return ModelSpec(
      vocab_size=_int("model.vocab_size", d["vocab_size"]),
      d_model=_int("model.d_model", d["d_model"]),
      num_layers=num_layers,
      mlp_dim=_int("model.mlp_dim", d["mlp_dim"]),
      tie_embeddings=tie,
      norm_eps=_float("model.norm_eps", d["norm_eps"]),
      dtype=_dtype("model.dtype", d["dtype"]),
      param_dtype=_dtype("model.param_dtype", d["param_dtype"]),
      layers=tuple(layers))


def cache_bytes_per_token(cfg: Any, dtype: Any = None) -> int:
  """Analytic KV-cache bytes per token of the whole model (sum over layers).

  Per layer `kvattn.memory.gqa_bytes_per_token` (`2 K H itemsize`) or
  `mla_bytes_per_token` (`(C + R) itemsize`); batch 1, so a cache of batch B
  and capacity S holds `B * S *` this many bytes (lengths bookkeeping aside).

  Args:
    cfg: a `model` config (ConfigDict/mapping) or a `ModelSpec`.
    dtype: cache dtype; default the model's compute dtype.

  Raises:
    ValueError: an invalid config (see `resolve_config`).
  """
  spec = cfg if isinstance(cfg, ModelSpec) else resolve_config(cfg)
  dtype = spec.dtype if dtype is None else dtype
  return sum(layer.bytes_per_token(dtype) for layer in spec.layers)


# ----------------------------------------------------------------------------------------------
# Modules.


class RMSNorm(nnx.Module):
  """RMSNorm (Zhang & Sennrich 2019): `x / sqrt(mean(x^2) + eps) * scale`, computed in f32."""

  def __init__(self, dim: int, *, eps: float, param_dtype: Any = jnp.float32):
    self.eps = eps
    self.scale = nnx.Param(jnp.ones((dim,), param_dtype))

  def __call__(self, x: jax.Array) -> jax.Array:  # [..., D]
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
    return (y * self.scale[...].astype(jnp.float32)).astype(x.dtype)


def _dense_init(in_axis=0, out_axis=-1):
  return nnx.initializers.variance_scaling(1.0, "fan_in", "truncated_normal",
                                           in_axis=in_axis, out_axis=out_axis)


class SwiGLU(nnx.Module):
  """SwiGLU MLP (Shazeer 2020, eq. 6): `down(silu(x @ gate) * (x @ up))`.

  Parameters `gate, up: [D, F]`, `down: [F, D]`; matmuls accumulate in f32.
  """

  def __init__(self, d_model: int, mlp_dim: int, *, dtype: Any, param_dtype: Any, rngs: nnx.Rngs):
    self.dtype = dtype
    key = rngs.params
    self.gate = nnx.Param(_dense_init()(key(), (d_model, mlp_dim), param_dtype))
    self.up = nnx.Param(_dense_init()(key(), (d_model, mlp_dim), param_dtype))
    self.down = nnx.Param(_dense_init()(key(), (mlp_dim, d_model), param_dtype))

  def __call__(self, x: jax.Array) -> jax.Array:  # [B, T, D]
    dt = self.dtype
    x = x.astype(dt)
    # One product for gate and up: in the decode loop the concatenation of the (loop-invariant)
    # weights is hoisted out of the while loop by XLA, and one call beats two (~3% of a K = 1
    # decode step of the bench_generate model).
    w = jnp.concatenate([self.gate[...].astype(dt), self.up[...].astype(dt)], axis=1)  # [D, 2F]
    g, u = jnp.split(jnp.einsum("BTD,DF->BTF", x, w, preferred_element_type=jnp.float32), 2, -1)
    h = (jax.nn.silu(g) * u).astype(dt)
    return jnp.einsum("BTF,FD->BTD", h, self.down[...].astype(dt),
                      preferred_element_type=jnp.float32).astype(dt)


def _accepts(cls, name: str) -> bool:
  params = inspect.signature(cls.__init__).parameters
  return name in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def make_attention(spec: AttentionSpec, *, d_model: int, dtype: Any, param_dtype: Any,
                   rngs: nnx.Rngs) -> nnx.Module:
  """Builds one layer's attention module from its AttentionSpec (the layer factory).

  "gqa" -> `kvattn.GroupedQueryAttention`; "mla" -> `kvattn.MultiHeadLatentAttention`
  (imported lazily from `kvattn.mla`). `dtype`, `param_dtype` and
  `decode_implementation` are passed when the module's constructor takes them.

  Raises:
    ValueError: "mla" requested but `kvattn.mla` is not available.
  """
  if spec.kind == "gqa":
    cls = GroupedQueryAttention
    kwargs = dict(num_heads=spec.num_heads, num_kv_heads=spec.num_kv_heads,
                  head_dim=spec.head_dim, rope_theta=spec.rope_theta, window=spec.window,
                  soft_cap=spec.soft_cap, qkv_bias=spec.qkv_bias, rope_scaling=spec.rope())
  else:
    try:
      cls = importlib.import_module("kvattn.mla").MultiHeadLatentAttention
    except (ImportError, AttributeError) as e:
      raise ValueError(
          f"attention kind 'mla' needs kvattn.mla.MultiHeadLatentAttention: {e}") from e
    kwargs = dict(num_heads=spec.num_heads, kv_lora_rank=spec.kv_lora_rank,
                  qk_nope_head_dim=spec.qk_nope_head_dim, qk_rope_head_dim=spec.qk_rope_head_dim,
                  v_head_dim=spec.v_head_dim, q_lora_rank=spec.q_lora_rank,
                  rope_theta=spec.rope_theta, window=spec.window,
                  softmax_scale_factor=spec.softmax_scale_factor, rope_scaling=spec.rope())
  optional = dict(dtype=dtype, param_dtype=param_dtype,
                  decode_implementation=spec.decode_implementation)
  for name, value in optional.items():
    if _accepts(cls, name):
      kwargs[name] = value
    elif name == "decode_implementation" and value is not None:
      raise ValueError(f"{cls.__name__} does not take decode_implementation; got {value!r}")
  return cls(d_model=d_model, **kwargs, rngs=rngs)


class Block(nnx.Module):
  """Pre-norm block: `x += attn(norm(x)); x += mlp(norm(x))`."""

  def __init__(self, spec: AttentionSpec, model: ModelSpec, *, rngs: nnx.Rngs):
    self.attn_norm = RMSNorm(model.d_model, eps=model.norm_eps, param_dtype=model.param_dtype)
    self.attn = make_attention(spec, d_model=model.d_model, dtype=model.dtype,
                               param_dtype=model.param_dtype, rngs=rngs)
    self.mlp_norm = RMSNorm(model.d_model, eps=model.norm_eps, param_dtype=model.param_dtype)
    self.mlp = SwiGLU(model.d_model, model.mlp_dim, dtype=model.dtype,
                      param_dtype=model.param_dtype, rngs=rngs)

  def __call__(self, x, cache, positions, new_lengths):
    h, cache = self.attn(self.attn_norm(x), cache=cache, positions=positions,
                         new_lengths=new_lengths)
    x = x + h.astype(x.dtype)
    x = x + self.mlp(self.mlp_norm(x)).astype(x.dtype)
    return x, cache


class Transformer(nnx.Module):
  """Decoder-only LM; each layer's attention variant comes from the config.

  Call: `logits, caches = model(tokens, caches=None, positions=None, new_lengths=None)`
    * `tokens: i32[B, T]`.
    * `caches`: None (training: causal over T, returned caches are None) or a
      sequence of L per-layer caches from `init_caches` (one `KVCache` per GQA
      layer, one `LatentCache` per MLA layer); a tuple of updated caches is
      returned.
    * `positions: i32[B, T]`, `new_lengths: i32[B]`: as in the attention
      modules (DESIGN.md) -- RoPE positions (default: cache length +
      arange(T)) and real tokens per sequence (right padding).
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
    self.spec = spec
    self.vocab_size = spec.vocab_size
    self.d_model = spec.d_model
    self.num_layers = spec.num_layers
    self.dtype = spec.dtype
    self.embedding = nnx.Param(nnx.initializers.normal(stddev=0.02)(
        rngs.params(), (spec.vocab_size, spec.d_model), spec.param_dtype))
    self.layers = nnx.List([Block(layer, spec, rngs=rngs) for layer in spec.layers])
    self.final_norm = RMSNorm(spec.d_model, eps=spec.norm_eps, param_dtype=spec.param_dtype)
    if spec.tie_embeddings:
      self.lm_head = None
    else:
      self.lm_head = nnx.Param(_dense_init()(
          rngs.params(), (spec.d_model, spec.vocab_size), spec.param_dtype))

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

  def init_caches(self, batch: int, max_len: int, dtype: Any = None) -> tuple[Any, ...]:
    """One empty cache per layer (`layer.attn.init_cache`), as a tuple pytree.

    Args:
      batch: B.
      max_len: capacity S in tokens.
      dtype: cache storage dtype; default the model's compute dtype. A float
        dtype, or a quantized KV format (int8, float8_e4m3fn, float8_e5m2)
        stored with f32 per-token scales (`kvattn.ops.quantize_kv`).

    Raises:
      ValueError: non-positive sizes.
      TypeError: a dtype that is neither floating nor a quantized KV format.
    """
    dtype = self.dtype if dtype is None else dtype
    return tuple(layer.attn.init_cache(batch, max_len, dtype) for layer in self.layers)

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
    if caches is not None and len(caches) != self.num_layers:
      raise ValueError(f"caches must hold one cache per layer ({self.num_layers}); got "
                       f"{len(caches)}")
    x = jnp.take(self.embedding[...], tokens, axis=0).astype(self.dtype)  # [B, T, D]
    new_caches = []
    for i, layer in enumerate(self.layers):
      x, cache = layer(x, None if caches is None else caches[i], positions, new_lengths)
      new_caches.append(cache)
    return self.final_norm(x), (None if caches is None else tuple(new_caches))

  def logits_from_hidden(self, h: jax.Array) -> jax.Array:  # [..., D] -> f32[..., V]
    """Projects hidden states onto the vocabulary in f32."""
    if self.lm_head is None:
      return jnp.einsum("...D,VD->...V", h, self.embedding[...].astype(h.dtype),
                        preferred_element_type=jnp.float32)
    return jnp.einsum("...D,DV->...V", h, self.lm_head[...].astype(h.dtype),
                      preferred_element_type=jnp.float32)

  def __call__(
      self,
      tokens: jax.Array,  # i32[B, T]
      caches: Sequence[Any] | None = None,
      positions: jax.Array | None = None,  # i32[B, T]
      new_lengths: jax.Array | None = None,  # i32[B]
  ) -> tuple[jax.Array, tuple[Any, ...] | None]:
    h, caches = self.hidden(tokens, caches, positions, new_lengths)
    return self.logits_from_hidden(h), caches
