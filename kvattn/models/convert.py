r"""Converting a pretrained GQA checkpoint to fewer KV heads, to MLA, or to cross-layer KV
sharing (no training); each returns a new `kvattn.Transformer` and leaves the source intact.

* `regroup_kv_heads`: GQA, Ainslie et al. 2023 (arXiv 2305.13245) §2.1 -- duplicate heads
  (exact) or mean-pool / keep the first of each group.
* `to_mla`: MHA2MLA, Ji et al. 2025 (arXiv 2502.14837) -- partial RoPE (§3.2, the only
  approximation; `partial_rope`), then an SVD of the stacked no-RoPE K and V projections
  (§3.3): `M = U S V^T`, `W_DKV = U_C S_C: [D, C]`, `[W_UK | W_UV] = V_C^T: [C, F]`, exact at
  C = F = K (2H - w). Cache: `C + R` numbers per token and layer instead of `2 K H`.
* `to_cla`: cross-layer attention, Brandon et al. 2024 (arXiv 2405.12981) -- groups of s
  layers of one type share the first layer's K/V projection (mean or first).

The derivations: docs/models.md, "The conversions step by step".
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kvattn import ops
from kvattn.models import transformer as transformer_lib
from kvattn.models.gqa import GroupedQueryAttention, check_input, resolve_positions
from kvattn.ops import rope as rope_lib

REGROUP_METHODS = ("mean", "first")
CLA_METHODS = ("mean", "first")
MLA_METHODS = ("joint", "split")
ROPE_SELECTIONS = ("high", "uniform")


def _gqa_layers(model: Any, where: str) -> list[GroupedQueryAttention]:
  if not isinstance(model, transformer_lib.Transformer):
    raise TypeError(f"model must be a kvattn.Transformer; got {type(model).__name__}")
  attns = []
  for i, layer in enumerate(model.layers):
    if not isinstance(layer.attn, GroupedQueryAttention):
      raise ValueError(f"{where} converts GQA layers (MHA/GQA/MQA); model layer {i} is "
                       f"{type(layer.attn).__name__}")
    if layer.attn.kv_source is not None:
      raise ValueError(f"{where} converts layers with their own K/V projections; model layer "
                       f"{i} reads layer {layer.attn.kv_source}'s (cross-layer KV sharing): "
                       f"convert before sharing")
    attns.append(layer.attn)
  return attns


def _value(param: Any) -> np.ndarray:
  return np.asarray(jax.device_get(param[...]), np.float64)


def _rebuild(model: transformer_lib.Transformer, spec: transformer_lib.ModelSpec,
             attn_params: Sequence[Mapping[str, np.ndarray]]) -> transformer_lib.Transformer:
  """A Transformer of `spec` holding `model`'s non-attention parameters and, for layer i,
  the attention parameters `attn_params[i]` (name -> array), cast to the param dtype."""
  abstract = nnx.eval_shape(lambda: transformer_lib.Transformer(spec, rngs=nnx.Rngs(0)))
  graphdef, state = nnx.split(abstract)
  source = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
  flat = nnx.to_flat_state(state)
  for path, var in flat:
    want = var.get_value()
    if len(path) == 4 and path[0] == "layers" and path[2] == "attn":
      value = jnp.asarray(attn_params[path[1]][path[3]], want.dtype)
    else:
      value = jnp.array(source[path].get_value(), want.dtype)  # a copy: the source stays intact
    if value.shape != want.shape:  # a bug here, not the caller's
      raise RuntimeError(f"parameter {path}: converted shape {value.shape} != {want.shape}")
    var.set_value(value)
  return nnx.merge(graphdef, nnx.from_flat_state(flat))


def _replace_layers(spec: transformer_lib.ModelSpec, layers: Sequence[Any],
                    **attention: Any) -> transformer_lib.ModelSpec:
  """`spec` with per-layer attention specs `layers` (and `attention` overrides on the base)."""
  base = dataclasses.replace(spec.attention, **attention)
  return transformer_lib.resolve_config(dataclasses.replace(spec, attention=base,
                                                            layers=tuple(layers)))


# ----------------------------------------------------------------------------------------------
# Regrouping KV heads (GQA paper §2.1).


def check_regroup(model: transformer_lib.Transformer, num_kv_heads: int, *,
                  method: str = "mean") -> list[GroupedQueryAttention]:
  """The checks of `regroup_kv_heads` (same errors), without converting; returns the layers."""
  if method not in REGROUP_METHODS:
    raise ValueError(f"method must be one of {REGROUP_METHODS}; got {method!r}")
  if isinstance(num_kv_heads, bool) or not isinstance(num_kv_heads, int) or num_kv_heads <= 0:
    raise ValueError(f"num_kv_heads must be a positive int; got {num_kv_heads!r}")
  attns = _gqa_layers(model, "regroup_kv_heads")
  for i, attn in enumerate(attns):
    K, N = attn.num_kv_heads, attn.num_heads
    if N % num_kv_heads:
      raise ValueError(f"num_kv_heads must divide num_heads = {N} (layer {i}); got {num_kv_heads}")
    if num_kv_heads % K and K % num_kv_heads:
      raise ValueError(f"num_kv_heads must be a multiple or a divisor of the current number of "
                       f"KV heads {K} (layer {i}); got {num_kv_heads}")
  return attns


def regroup_kv_heads(model: transformer_lib.Transformer, num_kv_heads: int, *,
                     method: str = "mean") -> transformer_lib.Transformer:
  """A copy of `model` with `num_kv_heads` KV heads per layer.

  Args:
    model: a `kvattn.Transformer` whose layers are all GQA (K KV heads each).
    num_kv_heads: K', a multiple of K dividing N (exact copies) or a divisor of K.
    method: "mean" (mean-pool each group's K/V projections and biases) or "first".

  Raises:
    TypeError: `model` is not a Transformer.
    ValueError: a layer that is not GQA; a K' neither a multiple nor a divisor of K, or
      not dividing N; an unknown method.
  """
  attns = check_regroup(model, num_kv_heads, method=method)
  layers, params = [], []
  for attn, layer_spec in zip(attns, model.spec.layers):
    K = attn.num_kv_heads
    if num_kv_heads % K == 0:
      f = num_kv_heads // K
      merge = lambda w, f=f: np.repeat(w, f, axis=-2)  # [..., K, H] -> [..., K f, H]
    else:
      f = K // num_kv_heads
      def merge(w, f=f, K=K):  # [..., K, H] -> [..., K / f, H]
        groups = w.reshape(w.shape[:-2] + (K // f, f, w.shape[-1]))
        return groups.mean(axis=-2) if method == "mean" else groups[..., 0, :]
    p = {"q_proj": _value(attn.q_proj), "o_proj": _value(attn.o_proj),
         "k_proj": merge(_value(attn.k_proj)), "v_proj": merge(_value(attn.v_proj))}
    if attn.qkv_bias:
      p.update(q_bias=_value(attn.q_bias), k_bias=merge(_value(attn.k_bias)),
               v_bias=merge(_value(attn.v_bias)))
    if attn.qk_norm:  # one [H] scale shared by the heads (pooling a normed key approximates)
      p.update(q_norm=_value(attn.q_norm), k_norm=_value(attn.k_norm))
    params.append(p)
    layers.append(dataclasses.replace(layer_spec, num_kv_heads=num_kv_heads))
  spec = _replace_layers(model.spec, layers, num_kv_heads=num_kv_heads)
  return _rebuild(model, spec, params)


# ----------------------------------------------------------------------------------------------
# GQA -> MLA (MHA2MLA): partial RoPE, then a joint SVD of the no-RoPE K and V projections.


def rope_pairs(head_dim: int, num_pairs: int, selection: str = "high") -> np.ndarray:
  """Indices `i32[num_pairs]` of the RoPE pairs `(i, i + H/2)` partial RoPE keeps: "high"
  `0 .. r-1` (S_high), "uniform" `0, s, 2s, ..` with `s = H / (2r)` (S_uniform).

  Raises:
    ValueError: `num_pairs` not in [1, H/2), an unknown selection, or for "uniform" an r
      that does not divide H / 2.
  """
  half = head_dim // 2
  if isinstance(num_pairs, bool) or not isinstance(num_pairs, int) or not 0 < num_pairs < half:
    raise ValueError(f"RoPE pairs kept per head must lie in [1, head_dim / 2 = {half}) (the rest "
                     f"of the head is the no-RoPE part MLA factorises); got {num_pairs}")
  if selection not in ROPE_SELECTIONS:
    raise ValueError(f"rope_selection must be one of {ROPE_SELECTIONS}; got {selection!r}")
  if selection == "high":
    return np.arange(num_pairs)
  if half % num_pairs:
    raise ValueError(f"rope_selection 'uniform' needs the kept pairs per head to divide "
                     f"head_dim / 2 = {half}; got {num_pairs}")
  return np.arange(num_pairs) * (half // num_pairs)


def _rope_dims(head_dim: int, pairs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """`(rope, nope)` dim indices of a head: rope = [pairs, pairs + H/2] (the rotate-half layout
  of a chunk of width 2r), nope = the other dims in order."""
  rope = np.concatenate([pairs, pairs + head_dim // 2])
  nope = np.setdiff1d(np.arange(head_dim), rope)
  return rope, nope


def _per_head_rope_width(qk_rope_head_dim: Any, attn: GroupedQueryAttention) -> int:
  K, H = attn.num_kv_heads, attn.head_dim
  R = qk_rope_head_dim
  if isinstance(R, bool) or not isinstance(R, int) or R <= 0 or R % (2 * K):
    raise ValueError(f"qk_rope_head_dim must be a positive multiple of 2 * num_kv_heads = {2 * K} "
                     f"(w = qk_rope_head_dim / num_kv_heads rotated dims per KV head, in pairs); "
                     f"got {R!r}")
  if R // K >= H:
    raise ValueError(f"qk_rope_head_dim / num_kv_heads (RoPE dims kept per head) must be below "
                     f"head_dim = {H}; got {R} / {K} = {R // K}")
  return R // K


class PartialRopeAttention(nnx.Module):
  """A cacheless GQA layer with RoPE on `rope_pairs` only (step 1 of `to_mla`), wrapping the
  source `GroupedQueryAttention` (`self.attn`)."""

  def __init__(self, attn: GroupedQueryAttention, rope_pairs: Sequence[int]):
    self.attn = attn
    self.rope_pairs = tuple(int(i) for i in rope_pairs)

  def __call__(self, x: jax.Array, cache: Any = None, positions: jax.Array | None = None,
               new_lengths: jax.Array | None = None) -> tuple[jax.Array, None]:
    """`(y [B, T, D], None)`; ValueError for a cache (this reference has none)."""
    if cache is not None:
      raise ValueError("cache must be None: the partial-RoPE model is a cacheless reference "
                       "(convert it with to_mla to decode)")
    a = self.attn
    check_input(x, a.d_model)
    batch, num_tokens, _ = x.shape
    positions = resolve_positions(positions, None, batch, num_tokens)
    biases = (a.q_bias, a.k_bias, a.v_bias) if a.qkv_bias else (None,) * 3
    q = a._project(x, "BTD,DNH->BTNH", "q_proj", biases[0])  # pylint: disable=protected-access
    k = a._project(x, "BTD,DKH->BTKH", "k_proj", biases[1])  # pylint: disable=protected-access
    v = a._project(x, "BTD,DKH->BTKH", "v_proj", biases[2])  # pylint: disable=protected-access
    rope, _ = _rope_dims(a.head_dim, np.asarray(self.rope_pairs))
    mask = np.zeros((a.head_dim,), bool)
    mask[rope] = True
    rot = dict(rope_theta=a.rope_theta, scaling=a.rope_scaling)
    q = jnp.where(mask, ops.apply_rope(q, positions, **rot), q)
    k = jnp.where(mask, ops.apply_rope(k, positions, **rot), k)
    out = ops.attention(q, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3),
                        kv_lengths=new_lengths, window=a.window, soft_cap=a.soft_cap)
    return a._project(out, "BTNH,NHD->BTD", "o_proj"), None  # pylint: disable=protected-access


def partial_rope(model: transformer_lib.Transformer, qk_rope_head_dim: int, *,
                 rope_selection: str = "high") -> transformer_lib.Transformer:
  """Step 1 of `to_mla` alone: a cacheless copy of `model` with RoPE on `qk_rope_head_dim / K`
  dims per head (`PartialRopeAttention`), the model full-rank MLA reproduces.

  Raises:
    TypeError/ValueError: as `to_mla`.
  """
  attns = _gqa_layers(model, "partial_rope")
  new = nnx.clone(model)
  for layer, attn in zip(new.layers, attns):
    w = _per_head_rope_width(qk_rope_head_dim, attn)
    layer.attn = PartialRopeAttention(layer.attn, rope_pairs(attn.head_dim, w // 2,
                                                             rope_selection))
  return new


def _svd_factors(m: np.ndarray, rank: int) -> tuple[np.ndarray, np.ndarray]:
  """`(A [D, rank], B [rank, F])`, `A B` the best rank-`rank` approximation of `m [D, F]`:
  `B = V_rank^T` (from `m^T m` in f64), `A = m V_rank`, so `A B = m` at rank F."""
  eigvals, vecs = np.linalg.eigh(m.T @ m)  # ascending
  v = vecs[:, np.argsort(eigvals)[::-1][:rank]]  # [F, rank]
  return m @ v, v.T


def mla_full_rank(model: transformer_lib.Transformer, qk_rope_head_dim: int) -> int:
  """The largest `kv_lora_rank` of `to_mla`: the stacked no-RoPE K/V width
  `F = K (H - w) + K H` (w = qk_rope_head_dim / K), the smallest over layers."""
  attns = _gqa_layers(model, "to_mla")
  return min(a.num_kv_heads * (2 * a.head_dim - _per_head_rope_width(qk_rope_head_dim, a))
             for a in attns)


def _mla_layer(attn: GroupedQueryAttention, kv_lora_rank: int, w: int, pairs: np.ndarray,
               method: str) -> dict[str, np.ndarray]:
  """The MLA parameters of one GQA layer (module doc, step 2)."""
  N, K, H, G = attn.num_heads, attn.num_kv_heads, attn.head_dim, attn.num_groups
  Hn, R, C = H - w, K * w, kv_lora_rank
  rope, nope = _rope_dims(H, pairs)
  wq, wk, wv = _value(attn.q_proj), _value(attn.k_proj), _value(attn.v_proj)
  D = wq.shape[0]
  group = np.arange(N) // G  # the KV head of each query head
  q = np.zeros((D, N, Hn + R))
  q[:, :, :Hn] = wq[:, :, nope]
  for n in range(N):
    q[:, n, Hn + group[n] * w:Hn + (group[n] + 1) * w] = wq[:, n, rope]
  k_rope = wk[:, :, rope].reshape(D, R)  # chunk k = KV head k
  mk = wk[:, :, nope].reshape(D, K * Hn)
  mv = wv.reshape(D, K * H)
  if method == "joint":
    down, up = _svd_factors(np.concatenate([mk, mv], axis=1), C)
    up_k, up_v = up[:, :K * Hn], up[:, K * Hn:]
  else:  # split: separate factors, stacked latents [c_k | c_v]
    ck = round(C * K * Hn / (K * Hn + K * H))
    dk, uk = _svd_factors(mk, ck)
    dv, uv = _svd_factors(mv, C - ck)
    down = np.concatenate([dk, dv], axis=1)
    up_k = np.concatenate([uk, np.zeros((C - ck, K * Hn))])
    up_v = np.concatenate([np.zeros((ck, K * H)), uv])
  return {"q_proj": q, "kv_down_proj": np.concatenate([down, k_rope], axis=1),
          "k_up_proj": up_k.reshape(C, K, Hn)[:, group],
          "v_up_proj": up_v.reshape(C, K, H)[:, group],
          "o_proj": _value(attn.o_proj)}


def check_to_mla(model: transformer_lib.Transformer, kv_lora_rank: int, qk_rope_head_dim: int,
                 *, method: str = "joint", rope_selection: str = "high"
                 ) -> list[tuple[GroupedQueryAttention, int, np.ndarray, float]]:
  """The checks of `to_mla` (same errors), without converting; returns per layer `(attn, w,
  kept pairs, RoPE base of the chunks)`."""
  if method not in MLA_METHODS:
    raise ValueError(f"method must be one of {MLA_METHODS}; got {method!r}")
  attns = _gqa_layers(model, "to_mla")
  full = mla_full_rank(model, qk_rope_head_dim)  # validates qk_rope_head_dim
  C = kv_lora_rank
  if isinstance(C, bool) or not isinstance(C, int) or C <= 0:
    raise ValueError(f"kv_lora_rank must be a positive int; got {C!r}")
  if C > full:
    raise ValueError(f"kv_lora_rank must be at most the full rank (the stacked no-RoPE K/V width "
                     f"K (2 head_dim - qk_rope_head_dim / K)) = {full}; got {C}")
  plan = []
  for i, attn in enumerate(attns):
    if attn.qkv_bias:
      raise NotImplementedError(f"to_mla: layer {i} has qkv biases, which MLA's projections lack")
    if attn.soft_cap is not None:
      raise NotImplementedError(f"to_mla: layer {i} has a soft cap, which MLA lacks")
    if attn.qk_norm or attn.sm_scale is not None:
      raise NotImplementedError(f"to_mla: layer {i} has a qk-norm or its own sm_scale (Gemma, "
                                f"Qwen3), which the MLA conversion does not carry over")
    H = attn.head_dim
    w = _per_head_rope_width(qk_rope_head_dim, attn)
    pairs = rope_pairs(H, w // 2, rope_selection)
    stride = int(pairs[1] - pairs[0]) if pairs.size > 1 else 1
    theta = float(attn.rope_theta) ** (stride * w / H)
    want = np.asarray(rope_lib.rope_frequencies(H, attn.rope_theta, attn.rope_scaling))[pairs]
    got = np.asarray(rope_lib.rope_frequencies(w, theta, attn.rope_scaling))
    if not np.allclose(got, want, rtol=1e-5, atol=0):
      raise NotImplementedError(
          f"to_mla: layer {i}'s rope scaling {attn.rope_scaling} gives the kept pairs frequencies "
          f"that a RoPE base of width {w} cannot reproduce (rope_selection {rope_selection!r})")
    plan.append((attn, w, pairs, theta))
  return plan


def to_mla(model: transformer_lib.Transformer, kv_lora_rank: int, qk_rope_head_dim: int, *,
           method: str = "joint", rope_selection: str = "high") -> transformer_lib.Transformer:
  """A copy of `model` whose layers are `MultiHeadLatentAttention` (MHA2MLA).

  Args:
    model: a `kvattn.Transformer` of GQA layers without qkv biases or soft cap.
    kv_lora_rank: latent width C, at most `mla_full_rank(model, qk_rope_head_dim)`.
    qk_rope_head_dim: cached rope-key width R = K w (w < H rotated dims per KV head).
    method: "joint" (SVD_joint) or "split" (SVD_split: K and V apart).
    rope_selection: "high" or "uniform" (`rope_pairs`).

  Raises:
    TypeError: `model` is not a Transformer.
    ValueError: a layer that is not GQA; R not a positive multiple of 2K or R / K >= H; C
      not a positive int or above the full rank; an unknown method or rope_selection.
    NotImplementedError: qkv biases, a soft cap, or a rope scaling the chunked RoPE base
      cannot reproduce.
  """
  C = kv_lora_rank
  layers, params = [], []
  plan = check_to_mla(model, kv_lora_rank, qk_rope_head_dim, method=method,
                      rope_selection=rope_selection)
  for (attn, w, pairs, theta), layer_spec in zip(plan, model.spec.layers):
    H, K = attn.head_dim, attn.num_kv_heads
    params.append(_mla_layer(attn, C, w, pairs, method))
    layers.append(transformer_lib.AttentionSpec(
        kind="mla", num_heads=attn.num_heads, rope_theta=theta, window=attn.window,
        decode_implementation=None, kv_lora_rank=C, qk_nope_head_dim=H - w,
        qk_rope_head_dim=qk_rope_head_dim, v_head_dim=H, q_lora_rank=None,
        softmax_scale_factor=math.sqrt((H - w + qk_rope_head_dim) / H), num_rope_heads=K,
        latent_norm=False, **{name: getattr(layer_spec, name)
                              for name in transformer_lib.ROPE_SCALING_FIELDS}))
  spec = _replace_layers(model.spec, layers, **dataclasses.asdict(layers[0]))
  return _rebuild(model, spec, params)


# ----------------------------------------------------------------------------------------------
# Cross-layer KV sharing (CLA, Brandon et al. 2024).


def check_cla(model: transformer_lib.Transformer, cla_factor: int, *,
              method: str = "mean") -> list[int | None]:
  """The checks of `to_cla` (same errors), without converting; returns each layer's source
  (`kvattn.models.config.cla_sources`: None for the layers that keep their K/V)."""
  if method not in CLA_METHODS:
    raise ValueError(f"method must be one of {CLA_METHODS}; got {method!r}")
  if isinstance(cla_factor, bool) or not isinstance(cla_factor, int) or cla_factor <= 0:
    raise ValueError(f"cla_factor must be a positive int; got {cla_factor!r}")
  _gqa_layers(model, "to_cla")
  return transformer_lib.cla_sources(model.spec.layers, cla_factor)


def to_cla(model: transformer_lib.Transformer, cla_factor: int = 2, *,
           method: str = "mean") -> transformer_lib.Transformer:
  """A copy of `model` with cross-layer KV sharing at factor `cla_factor`.

  Args:
    model: a `kvattn.Transformer` of GQA layers with their own K/V.
    cla_factor: s, layers per group of one type sharing a K/V projection (1: a copy).
    method: "mean" (the group's K/V projections, biases and k-norm averaged) or "first".

  Raises:
    TypeError: `model` is not a Transformer.
    ValueError: a layer that is not GQA or already shares; a bad `cla_factor`; an unknown
      method.
  """
  sources = check_cla(model, cla_factor, method=method)
  attns = [layer.attn for layer in model.layers]
  groups: dict[int, list[int]] = {}
  for i, j in enumerate(sources):
    groups.setdefault(i if j is None else j, []).append(i)
  def kv_param(m, name, like):  # a member without a bias / k-norm: the identity (0 / 1)
    if hasattr(attns[m], name):
      return _value(getattr(attns[m], name))
    return np.ones_like(like) if name == "k_norm" else np.zeros_like(like)

  params = []
  for i, attn in enumerate(attns):
    p = {"q_proj": _value(attn.q_proj), "o_proj": _value(attn.o_proj)}
    if attn.qkv_bias:
      p["q_bias"] = _value(attn.q_bias)
    if attn.qk_norm:
      p["q_norm"] = _value(attn.q_norm)
    if sources[i] is None:
      members = groups[i] if method == "mean" else [i]
      names = ("k_proj", "v_proj") + (("k_bias", "v_bias") if attn.qkv_bias else ()) + (
          ("k_norm",) if attn.qk_norm else ())
      for name in names:
        own = _value(getattr(attn, name))
        p[name] = np.mean([kv_param(m, name, own) for m in members], axis=0)
    params.append(p)
  spec = transformer_lib.resolve_config(dataclasses.replace(model.spec, cla_factor=cla_factor))
  return _rebuild(model, spec, params)
