"""HF-named tensors in torch layout -> a `kvattn.Transformer` (`weight_map`, `build_model`).

DeepSeek rotates interleaved rope pairs, kvattn rotate-half pairs: the rope columns of the
query and rope-key projections are permuted at load (evens, then odds), which leaves every
logit unchanged (the cached `k_rope` holds the permuted order).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kvattn.models import int8 as int8_lib
from kvattn.models import transformer as transformer_lib

from kvattn.checkpoints import families
from kvattn.checkpoints.hf_config import _IGNORED_SUFFIXES, model_config_from_hf


@dataclasses.dataclass(frozen=True)
class WeightEntry:
  """One parameter (`param`: its state path) and its HF `tensor` name, expected `shape` and
  `convert` (torch layout -> kvattn's)."""

  param: tuple[Any, ...]
  tensor: str
  shape: tuple[int, ...]
  convert: Callable[[jax.Array], jax.Array]


def _same(x):
  return x


def _linear(in_shape: tuple[int, ...], out_shape: tuple[int, ...],
            perm: np.ndarray | None = None) -> tuple[tuple[int, ...], Callable]:
  """A torch Linear weight `[prod(out), prod(in)]` -> kvattn `[*in, *out]` (einsum layout).

  `perm` (optional) reorders the last output axis (the DeepSeek rope de-interleave).
  """
  shape = (math.prod(out_shape), math.prod(in_shape))

  def convert(w):
    w = w.reshape(out_shape + in_shape)
    w = jnp.transpose(w, tuple(range(len(out_shape), w.ndim)) + tuple(range(len(out_shape))))
    return w if perm is None else w[..., perm]

  return shape, convert


def _rope_deinterleave(width: int, rope_dim: int) -> np.ndarray:
  """Index permutation of a last axis of `width` whose last `rope_dim` entries are rope dims:
  the non-rope prefix stays, the rope dims go evens first, then odds."""
  rope = np.arange(width - rope_dim, width)
  return np.concatenate([np.arange(width - rope_dim), rope[0::2], rope[1::2]])


def weight_map(spec: transformer_lib.ModelSpec, family: families.Family) -> list[WeightEntry]:
  """Every parameter of a `Transformer(spec)` with its HF tensor, shape and conversion:
  `LlamaForCausalLM` names with `family`'s block norms (1 + w in f32 when
  `family.norm_plus_one`), `DeepseekV2ForCausalLM` names for MLA layers."""
  D, F, V = spec.d_model, spec.mlp_dim, spec.vocab_size
  norm = _plus_one if family.norm_plus_one else _same
  entries = [WeightEntry(("embedding",), "model.embed_tokens.weight", (V, D), _same),
             WeightEntry(("final_norm", "scale"), "model.norm.weight", (D,), norm)]
  if not spec.tie_embeddings:
    entries.append(WeightEntry(("lm_head",), "lm_head.weight", *_linear((D,), (V,))))
  for i, layer in enumerate(spec.layers):
    pre, at = f"model.layers.{i}.", ("layers", i, "attn")
    entries += [WeightEntry(("layers", i, ours, "scale"), pre + f"{theirs}.weight", (D,), norm)
                for ours, theirs in family.hf_layer_norms]
    entries += [
        WeightEntry(("layers", i, "mlp", "gate"), pre + "mlp.gate_proj.weight",
                    *_linear((D,), (F,))),
        WeightEntry(("layers", i, "mlp", "up"), pre + "mlp.up_proj.weight", *_linear((D,), (F,))),
        WeightEntry(("layers", i, "mlp", "down"), pre + "mlp.down_proj.weight",
                    *_linear((F,), (D,))),
    ]
    pre += "self_attn."
    if layer.kind == "gqa":
      entries += _gqa_entries(layer, D, pre, at, norm)
    else:
      entries += _mla_entries(layer, D, pre, at)
  return entries


def _plus_one(w):
  """A stored RMSNorm weight w -> the scale 1 + w (f32; Gemma's)."""
  return 1.0 + w.astype(jnp.float32)


def _gqa_entries(layer, D: int, pre: str, at: tuple, norm=_same) -> list[WeightEntry]:
  N, K, H = layer.num_heads, layer.num_kv_heads, layer.head_dim
  entries = [
      WeightEntry(at + ("q_proj",), pre + "q_proj.weight", *_linear((D,), (N, H))),
      WeightEntry(at + ("k_proj",), pre + "k_proj.weight", *_linear((D,), (K, H))),
      WeightEntry(at + ("v_proj",), pre + "v_proj.weight", *_linear((D,), (K, H))),
      WeightEntry(at + ("o_proj",), pre + "o_proj.weight", *_linear((N, H), (D,))),
  ]
  if layer.qkv_bias:
    for name, heads in (("q", N), ("k", K), ("v", K)):
      entries.append(WeightEntry(at + (f"{name}_bias",), pre + f"{name}_proj.bias",
                                 (heads * H,), lambda b, s=(heads, H): b.reshape(s)))
  if layer.qk_norm:
    entries += [WeightEntry(at + (f"{name}_norm",), pre + f"{name}_norm.weight", (H,), norm)
                for name in ("q", "k")]
  return entries


def _mla_entries(layer, D: int, pre: str, at: tuple) -> list[WeightEntry]:
  N, C, R = layer.num_heads, layer.kv_lora_rank, layer.qk_rope_head_dim
  Hn, Hv = layer.qk_nope_head_dim, layer.v_head_dim
  q_perm = _rope_deinterleave(Hn + R, R)
  entries = []
  if layer.q_lora_rank is None:
    entries.append(WeightEntry(at + ("q_proj",), pre + "q_proj.weight",
                               *_linear((D,), (N, Hn + R), q_perm)))
  else:
    Cq = layer.q_lora_rank
    entries += [
        WeightEntry(at + ("q_down_proj",), pre + "q_a_proj.weight", *_linear((D,), (Cq,))),
        WeightEntry(at + ("q_norm",), pre + "q_a_layernorm.weight", (Cq,), _same),
        WeightEntry(at + ("q_up_proj",), pre + "q_b_proj.weight",
                    *_linear((Cq,), (N, Hn + R), q_perm)),
    ]
  kv_b_shape = (N * (Hn + Hv), C)

  def kv_b_part(lo, hi):  # [N*(Hn+Hv), C] -> [C, N, hi-lo]
    return lambda w: jnp.transpose(w.reshape(N, Hn + Hv, C)[:, lo:hi], (2, 0, 1))

  entries += [
      WeightEntry(at + ("kv_down_proj",), pre + "kv_a_proj_with_mqa.weight",
                  *_linear((D,), (C + R,), _rope_deinterleave(C + R, R))),
      WeightEntry(at + ("kv_norm",), pre + "kv_a_layernorm.weight", (C,), _same),
      WeightEntry(at + ("k_up_proj",), pre + "kv_b_proj.weight", kv_b_shape, kv_b_part(0, Hn)),
      WeightEntry(at + ("v_up_proj",), pre + "kv_b_proj.weight", kv_b_shape,
                  kv_b_part(Hn, Hn + Hv)),
      WeightEntry(at + ("o_proj",), pre + "o_proj.weight", *_linear((N, Hv), (D,))),
  ]
  return entries


def _origin(tensors: Mapping[str, Any], name: str) -> str:
  """Where tensor `name` lives, for error messages ('' when the mapping cannot tell)."""
  where = getattr(tensors, "origin", None)
  return f"{where(name)}: " if callable(where) else ""


def _shape_of(tensors: Mapping[str, Any], name: str) -> tuple[int, ...]:
  shape_fn = getattr(tensors, "shape", None)
  if callable(shape_fn):
    return tuple(shape_fn(name))
  return tuple(np.shape(tensors[name]))


def build_model(config: Mapping[str, Any], tensors: Mapping[str, Any], *, dtype: Any = None,
                param_dtype: Any = None, where: str | None = None) -> transformer_lib.Transformer:
  """A `kvattn.Transformer` holding a checkpoint's weights (`model(tokens)`: f32 logits).

  Args:
    config: HF config.json keys (`model_config_from_hf`).
    tensors: HF name -> float array in torch layout; every `weight_map` tensor present
      (a tied head ignores `lm_head.weight`).
    dtype: compute dtype; default float32.
    param_dtype: the weights' dtype; default `dtype`; "int8": W8A8.
    where: the file `config` came from; errors start with it.

  Raises:
    NotImplementedError: a setting the model cannot represent (naming key and value).
    ValueError: a missing, misshapen, non-float or unread tensor (naming it).
  """
  cfg = model_config_from_hf(config, dtype=dtype, param_dtype=param_dtype, where=where)
  spec = transformer_lib.resolve_config(cfg)
  quantize = int8_lib.is_int8(spec.param_dtype)
  if quantize:  # W8A8: fill the f32 model, then quantize it (kvattn.models.int8)
    spec = dataclasses.replace(spec, param_dtype=jnp.dtype(jnp.float32))
  entries = weight_map(spec, families.lookup(config["model_type"]))
  for e in entries:
    if e.tensor not in tensors:
      raise ValueError(f"{_origin(tensors, e.tensor)}tensor {e.tensor!r} is missing from the "
                       f"checkpoint (expected shape {list(e.shape)})")
    got = _shape_of(tensors, e.tensor)
    if got != e.shape:
      raise ValueError(f"{_origin(tensors, e.tensor)}tensor {e.tensor!r} has shape {list(got)}; "
                       f"expected {list(e.shape)} from config.json")
  used = {e.tensor for e in entries}
  if spec.tie_embeddings:
    used.add("lm_head.weight")  # transformers ties it to the embedding whatever the file holds
  unused = sorted(n for n in tensors if n not in used and not n.endswith(_IGNORED_SUFFIXES))
  if unused:
    raise ValueError(f"{_origin(tensors, unused[0])}tensor {unused[0]!r} is not read by the "
                     f"model config.json describes ({len(unused)} unread tensors: "
                     f"{unused[:5]}{' ...' if len(unused) > 5 else ''})")

  abstract = nnx.eval_shape(lambda: transformer_lib.Transformer(spec, rngs=nnx.Rngs(0)))
  graphdef, state = nnx.split(abstract)
  readers = {}  # tensor -> parameters still to fill from it, so each is read and freed once
  for e in entries:
    readers[e.tensor] = readers.get(e.tensor, 0) + 1
  values, loaded = {}, {}
  for e in entries:
    if e.tensor not in loaded:
      raw = tensors[e.tensor]
      if not jnp.issubdtype(raw.dtype, jnp.floating):
        raise ValueError(f"{_origin(tensors, e.tensor)}tensor {e.tensor!r} has dtype "
                         f"{raw.dtype}; expected a float dtype")
      loaded[e.tensor] = jnp.asarray(raw)
    values[e.param] = e.convert(loaded[e.tensor]).astype(spec.param_dtype)
    readers[e.tensor] -= 1
    if not readers[e.tensor]:
      del loaded[e.tensor]
  flat = nnx.to_flat_state(state)
  missing = [p for p, _ in flat if p not in values]
  if missing:  # a parameter weight_map does not cover: a bug here, not in the checkpoint
    raise RuntimeError(f"no checkpoint tensor is mapped to parameter {missing[0]}")
  for path, var in flat:
    want = var.get_value().shape
    if values[path].shape != want:
      raise RuntimeError(f"parameter {path}: converted shape {values[path].shape} != {want}")
    var.set_value(values[path])
  model = nnx.merge(graphdef, nnx.from_flat_state(flat))
  return transformer_lib.quantize_model(model) if quantize else model
