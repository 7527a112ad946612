"""Configs and sweeps as data: dotted-key overrides, schema checks, point hashes, sweep files.

`apply_overrides` applies one sweep entry on a locked copy of a config (ml_collections'
`update_from_flattened_dict`, so an unknown key fails as on the command line, with the
nearest known key suggested); `check_schema` checks a family's sections and keys;
`digest` hashes what changes a measurement (point ids); `load_sweep` /
`load_config_defaults` read a config file's `get_sweep()` / `get_config()`;
`check_overrides_kept` refuses a command-line override the sweep would replace.
"""

from __future__ import annotations

import copy
import difflib
import hashlib
import importlib
import importlib.util
import json
import os
from typing import Any, Mapping, Sequence

from ml_collections import config_dict


def to_dict(config: Any) -> dict[str, Any]:
  """A deep plain-dict copy of a ConfigDict / mapping (tuples kept)."""
  if hasattr(config, "to_dict"):
    return copy.deepcopy(config.to_dict())
  if isinstance(config, Mapping):
    return {k: to_dict(v) if isinstance(v, Mapping) or hasattr(v, "to_dict") else copy.deepcopy(v)
            for k, v in config.items()}
  raise TypeError(f"config must be a ConfigDict or a mapping; got {type(config).__name__}")


def flat_keys(d: Mapping[str, Any], prefix: str = "") -> list[str]:
  """The dotted keys of the leaves of a nested mapping (`{"a": {"b": 1}}` -> `["a.b"]`)."""
  out = []
  for key, value in d.items():
    if isinstance(value, Mapping):
      out += flat_keys(value, f"{prefix}{key}.")
    else:
      out.append(f"{prefix}{key}")
  return out


def _nearest(key: str, keys: Sequence[str]) -> str:
  close = difflib.get_close_matches(key, keys, n=1)
  return f" (did you mean {close[0]}?)" if close else ""


def check_schema(d: Mapping[str, Any], schema: Mapping[str, Sequence[str]], where: str = "config"
                 ) -> None:
  """Checks that `d` has exactly the sections and keys of `schema`.

  Args:
    d: the config as a nested plain dict.
    schema: section -> the dotted keys below it (`"model"` -> `("d_model", ...,
      "attention.kind", ...)`).
    where: prefix of the error messages.

  Raises:
    ValueError: an unknown or missing section or key, named by its dotted path.
  """
  for section in d:
    if section not in schema:
      raise ValueError(f"{where}: {section} is not a known section; expected one of "
                       f"{sorted(schema)}")
  for section, keys in schema.items():
    if section not in d:
      raise ValueError(f"{where}: section {section} is missing; expected keys {sorted(keys)}")
    if not isinstance(d[section], Mapping):
      raise ValueError(f"{where}: {section} must be a section (ConfigDict); got {d[section]!r}")
    given = flat_keys(d[section])
    for key in given:
      if key not in keys:
        raise ValueError(f"{where}: {section}.{key} is not a known key"
                         f"{_nearest(key, keys)}; expected one of {sorted(keys)}")
    for key in keys:
      if key not in given:
        raise ValueError(f"{where}: {section}.{key} is missing")


def apply_overrides(config: Any, overrides: Mapping[str, Any], where: str) -> dict[str, Any]:
  """`config` with dotted-key `overrides` (`{"model.attention.num_kv_heads": 2}`) applied.

  The overrides go through ml_collections' `update_from_flattened_dict` on a
  locked deep copy of `config`, so a key that is not in the config is refused
  and a value is type-checked against the field (typed placeholders of a
  ConfigDict included) exactly as a `--config.<key>=` override would be.

  Returns:
    The overridden config as a nested plain dict (`config` is not changed).

  Raises:
    ValueError: a key that is not in the config or a value of the wrong type,
      named with `where`.
    TypeError: `overrides` is not a mapping.
  """
  if not isinstance(overrides, Mapping):
    raise TypeError(f"{where} must be a dict of dotted-key overrides; got {overrides!r}")
  if isinstance(config, config_dict.ConfigDict):
    cfg = copy.deepcopy(config)
  else:
    cfg = config_dict.ConfigDict(to_dict(config))
  cfg.lock()
  for dotted, value in overrides.items():
    try:
      cfg.update_from_flattened_dict({str(dotted): copy.deepcopy(value)})
    except (KeyError, AttributeError):
      keys = flat_keys(cfg.to_dict())
      raise ValueError(f"{where}: {dotted} is not a known key{_nearest(str(dotted), keys)}"
                       ) from None
    except TypeError as e:
      raise ValueError(f"{where}: {dotted} = {value!r} has the wrong type: {e}") from None
  return cfg.to_dict()


_MISSING = object()


def _get(d: Mapping[str, Any], dotted: str) -> Any:
  """The value at a dotted path of a nested mapping (`_MISSING` if it is not there)."""
  for part in dotted.split("."):
    if not isinstance(d, Mapping) or part not in d:
      return _MISSING
    d = d[part]
  return d


def digest(obj: Any, length: int = 8) -> str:
  """Short stable hash of a JSON-able object (sorted keys; tuples == lists)."""
  text = json.dumps(obj, sort_keys=True, default=str)
  return hashlib.sha1(text.encode("utf-8")).hexdigest()[:length]


def _config_module(config_file: str) -> tuple[Any, list[str], str]:
  """`(module, [arg] or [], path)` of a `--config=path.py[:arg]` value (the file imported)."""
  path, *arg = config_file.split(":", 1)
  if not os.path.exists(path):
    raise FileNotFoundError(f"config file {path!r} does not exist")
  spec = importlib.util.spec_from_file_location(f"_kvattn_sweep_{digest(path)}", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module, arg, path


def load_sweep(config_file: str | None) -> list[dict[str, Any]]:
  """`get_sweep(arg)` of the config file named as in `--config=path.py[:arg]`.

  The sweep takes the same argument as `get_config` (e.g. "smoke"), so a
  small config comes with a small sweep. A file without `get_sweep` (or no
  file) gives one point per base config: `[{}]`.

  Raises:
    FileNotFoundError: the config file does not exist.
    TypeError: `get_sweep` does not return a list of dicts.
  """
  if not config_file:
    return [{}]
  module, arg, path = _config_module(config_file)
  if not hasattr(module, "get_sweep"):
    return [{}]
  sweep = module.get_sweep(*arg)
  if not isinstance(sweep, (list, tuple)) or not all(isinstance(s, Mapping) for s in sweep):
    raise TypeError(f"{path}: get_sweep() must return a list of dicts of dotted-key overrides; "
                    f"got {sweep!r}")
  return [dict(s) for s in sweep] or [{}]


def load_config_defaults(config_file: str | None) -> dict[str, Any] | None:
  """`get_config(arg)` of the config file of `--config=path.py[:arg]` as a plain dict:
  the config before any command-line override (None without a file)."""
  if not config_file:
    return None
  module, arg, _ = _config_module(config_file)
  return to_dict(module.get_config(*arg))


def check_overrides_kept(config: Any, sweep: Sequence[Mapping[str, Any]],
                         defaults: Mapping[str, Any] | None, config_file: str | None = None
                         ) -> None:
  """Fails when a command-line override would be silently replaced by the sweep.

  Every sweep entry's dotted keys replace the base config's values, so an
  override such as `--config.model.attention.num_kv_heads=4` of a key the sweep
  sets would be discarded for every point. Compares `config` (as given on the
  command line) with `defaults` (`get_config(arg)` of the same file) on each
  key some sweep entry sets.

  Raises:
    ValueError: naming the key, its value on the command line and in the
      file, and the values the sweep gives it.
  """
  if defaults is None:
    return
  d = to_dict(config)
  keys = []
  for entry in sweep:
    keys += [str(k) for k in entry if k not in keys]
  for dotted in keys:
    given, default = _get(d, dotted), _get(defaults, dotted)
    if given != default:
      values = list(dict.fromkeys(repr(entry[dotted]) for entry in sweep if dotted in entry))
      source = f" of {config_file}" if config_file else ""
      raise ValueError(
          f"config: {dotted} = {given!r} overrides the config file's {default!r}, but the sweep"
          f"{source} sets {dotted} for its points ({', '.join(values)}), so the override would "
          f"be silently discarded; drop the override, or change the sweep (get_sweep) / the "
          f"keys it sets instead")
