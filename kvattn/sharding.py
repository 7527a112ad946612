"""Parameters and KV caches sharded over a device mesh, on JAX's own sharding machinery."""

from __future__ import annotations

import math
from typing import Any, Callable, Mapping, Sequence

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P


MESH_AXES = ("data", "model", "seq")

# Logical axis name -> mesh axis (str), axes (tuple) or None (replicated).
DEFAULT_RULES: dict[str, Any] = {
    # Parameters.
    # "mlp" is replicated by default: the SwiGLU concatenates gate and up along F, so an F
    # split over `model` would reshuffle both weights (all-to-all) in every step.
    "vocab": None, "embed": None, "norm": None, "mlp": None,
    "heads": "model", "kv_heads": "model", "head_dim": None,
    "latent": None, "q_latent": None,
    # Caches.
    "cache_batch": "data", "cache_sequence": "seq", "cache_kv_heads": "model",
    "cache_head_dim": None, "cache_pages": ("data", "seq"), "cache_page_slots": None,
    "cache_table": None, "cache_latent": None, "cache_rope": None,
}

# Parameter name (the attribute of its module) -> logical names of its dimensions.
PARAM_AXES: dict[str, tuple[str, ...]] = {
    "embedding": ("vocab", "embed"),  # [V, D]
    "lm_head": ("embed", "vocab"),  # [D, V]
    "scale": ("norm",),  # RMSNorm [D]
    "gate": ("embed", "mlp"), "up": ("embed", "mlp"), "down": ("mlp", "embed"),
    "q_proj": ("embed", "heads", "head_dim"),  # [D, N, H]
    "k_proj": ("embed", "kv_heads", "head_dim"),  # [D, K, H]
    "v_proj": ("embed", "kv_heads", "head_dim"),
    "o_proj": ("heads", "head_dim", "embed"),  # [N, H, D] (MLA: [N, Hv, D])
    "q_bias": ("heads", "head_dim"), "k_bias": ("kv_heads", "head_dim"),
    "v_bias": ("kv_heads", "head_dim"),
    # GQA qk-norm (Gemma 3, Qwen3): `k_norm: [H]`, replicated; its `q_norm: [H]` takes MLA's
    # entry below (rank 1, "q_latent", also replicated by default).
    "k_norm": ("head_dim",),
    # MLA (kvattn.models.mla).
    "q_down_proj": ("embed", "q_latent"),  # [D, Cq]
    "q_norm": ("q_latent",),
    "q_up_proj": ("q_latent", "heads", "head_dim"),  # [Cq, N, Hq]
    "kv_down_proj": ("embed", "latent"),  # [D, C + R]
    "kv_norm": ("latent",),
    "k_up_proj": ("latent", "heads", "head_dim"),  # [C, N, Hn]
    "v_up_proj": ("latent", "heads", "head_dim"),  # [C, N, Hv]
}


# ----------------------------------------------------------------------------------------------
# Meshes and rules.


def make_mesh(shape: Sequence[int], *, devices: Sequence[Any] | None = None) -> Mesh:
  """A `(data, model, seq)` mesh of `shape` over the first `prod(shape)` devices.

  Args:
    shape: three positive ints, the sizes of `MESH_AXES`.
    devices: the devices to use (default `jax.devices()`, every host's under `jax.distributed`).

  Raises:
    ValueError: not three positive ints, or more devices asked than exist.
  """
  shape = tuple(shape) if isinstance(shape, (tuple, list)) else shape
  if (not isinstance(shape, tuple) or len(shape) != len(MESH_AXES)
      or not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in shape)):
    raise ValueError(f"mesh.shape must be three positive ints (sizes of {MESH_AXES}); "
                     f"got {shape!r}")
  devices = list(jax.devices() if devices is None else devices)
  need = math.prod(shape)
  if need > len(devices):
    raise ValueError(f"mesh.shape {shape} needs {need} devices; {len(devices)} available")
  return jax.make_mesh(shape, MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * 3,
                       devices=devices[:need])


def mesh_config():
  """The `mesh` section of an experiment config (ml_collections): `shape` None (one
  device) or `(data, model, seq)` sizes; `rules` None (`DEFAULT_RULES`) or a dict of
  logical name -> mesh axis overrides."""
  from ml_collections import config_dict  # pylint: disable=g-import-not-at-top
  cfg = config_dict.ConfigDict()
  cfg.shape = config_dict.placeholder(tuple)  # None: single device; else (data, model, seq).
  # None: DEFAULT_RULES; else (logical name, mesh axis or None) pairs overriding them, e.g.
  # (("mlp", "model"),).
  cfg.rules = config_dict.placeholder(tuple)
  return cfg


def mesh_from_config(cfg: Mapping[str, Any] | None) -> tuple[Mesh | None, dict[str, Any]]:
  """`(mesh or None, rules)` from a config's `mesh` section (None or shape None: one device).

  Raises:
    ValueError: a bad shape or rule, naming `mesh.shape` / `mesh.rules`.
  """
  rules = resolve_rules(None if cfg is None else cfg.get("rules"))
  if cfg is None or cfg.get("shape") is None:
    return None, rules
  return make_mesh(tuple(cfg["shape"])), rules


def resolve_rules(rules: Mapping[str, Any] | Sequence[tuple[str, Any]] | None
                  ) -> dict[str, Any]:
  """`DEFAULT_RULES` updated by `rules` (a mapping or (name, axes) pairs), checked.

  Raises:
    ValueError: an unknown logical name, or a value that is not None, a mesh axis
      of `MESH_AXES` or a tuple of them.
  """
  out = dict(DEFAULT_RULES)
  for name, value in dict(rules or {}).items():
    if name not in DEFAULT_RULES:
      raise ValueError(f"mesh.rules: unknown logical axis {name!r}; known: "
                       f"{sorted(DEFAULT_RULES)}")
    axes = (value,) if isinstance(value, str) else value
    if value is not None and (not isinstance(axes, (tuple, list))
                              or any(a not in MESH_AXES for a in axes)):
      raise ValueError(f"mesh.rules[{name!r}] must be None, a mesh axis of {MESH_AXES} or a "
                       f"tuple of them; got {value!r}")
    out[name] = value if value is None or isinstance(value, str) else tuple(value)
  return out


def mesh_axes(value: Any) -> tuple[str, ...]:
  """A rules-table value (None, one mesh axis name, or several) as a tuple of axis names."""
  return () if value is None else (value,) if isinstance(value, str) else tuple(value)


def axis_size(mesh: Mesh, axes: Any) -> int:
  """Devices along `axes` (a mesh axis name, a tuple of them, or None = 1)."""
  return math.prod(mesh.shape[a] for a in mesh_axes(axes))


def logical_to_spec(names: Sequence[str | None], rules: Mapping[str, Any]) -> P:
  """`PartitionSpec` of an array whose dimensions have logical `names` (None: replicated)."""
  return P(*(None if n is None else rules[n] for n in names))


# ----------------------------------------------------------------------------------------------
# Parameters.


def _param_name(path) -> str:
  keys = [str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path]
  while keys and keys[-1] == "value":  # the array inside an nnx.Variable
    keys.pop()
  return "/".join(keys)


def param_logical_axes(state: nnx.State) -> dict[str, tuple[str, ...]]:
  """`{parameter path: logical names of its dimensions}` for every array of `state`.

  Raises:
    ValueError: a parameter without an entry in `PARAM_AXES`, or whose rank differs.
  """
  out = {}
  for path, x in jax.tree_util.tree_flatten_with_path(state)[0]:
    where = _param_name(path)
    names = PARAM_AXES.get(where.rsplit("/", 1)[-1])
    if names is None or len(names) != len(x.shape):
      raise ValueError(f"parameter {where} of shape {tuple(x.shape)} has no logical axes "
                       f"in kvattn.sharding.PARAM_AXES")
    out[where] = names
  return out


def param_shardings(state: nnx.State, mesh: Mesh, rules: Mapping[str, Any] | None = None):
  """`NamedSharding` of every parameter of `state` (arrays or abstract shapes), a tree
  like `state`; a dimension its mesh axes do not divide is replicated."""
  rules = resolve_rules(rules)
  logical = param_logical_axes(state)

  def sharding(path, x):
    spec = []
    for dim, name in zip(x.shape, logical[_param_name(path)]):
      axes = rules[name]
      spec.append(axes if axes is not None and dim % axis_size(mesh, axes) == 0 else None)
    return NamedSharding(mesh, P(*spec))
  return jax.tree_util.tree_map_with_path(sharding, state)


def shard_model(make_model: Callable[[], nnx.Module], mesh: Mesh,
                rules: Mapping[str, Any] | None = None) -> nnx.Module:
  """Builds `make_model()` with its parameters created directly sharded over `mesh`.

  Raises:
    ValueError: a parameter without logical axes (`PARAM_AXES`), a bad rule.
  """
  graphdef, abstract = nnx.split(nnx.eval_shape(make_model))
  shardings = param_shardings(abstract, mesh, rules)
  state = jax.jit(lambda: nnx.split(make_model())[1], out_shardings=shardings)()
  return nnx.merge(graphdef, state)


def place_model(model: nnx.Module, mesh: Mesh, rules: Mapping[str, Any] | None = None
                ) -> nnx.Module:
  """Moves an existing model's parameters onto `mesh` (`jax.device_put` with the rules'
  shardings); e.g. for a model read from a checkpoint."""
  graphdef, state = nnx.split(model)
  return nnx.merge(graphdef, jax.device_put(state, param_shardings(state, mesh, rules)))


def per_device_bytes(arrays: Sequence[jax.Array]) -> dict[Any, int]:
  """Bytes each device holds of `arrays`, read from their `addressable_shards`."""
  out: dict[Any, int] = {}
  for a in arrays:
    for shard in a.addressable_shards:
      out[shard.device] = out.get(shard.device, 0) + shard.data.nbytes
  return out
