"""Pretrained checkpoints as `kvattn.Transformer`s (`from_pretrained`): a source becomes an HF
config mapping (`hf_config.model_config_from_hf`) and HF-named tensors (`weights.build_model`)."""

from __future__ import annotations

import json
import os
import pathlib
from typing import Any, Iterator, Mapping

import jax

from kvattn.models import transformer as transformer_lib

from kvattn.checkpoints.hf_config import model_config_from_hf  # noqa: F401  (re-exported)
from kvattn.checkpoints.weights import WeightEntry, build_model, weight_map  # noqa: F401

CONFIG_FILE = "config.json"
SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX_FILE = "model.safetensors.index.json"
TOKENIZER_FILE = "tokenizer.json"


# ----------------------------------------------------------------------------------------------
# HF checkpoint directories.


class SafetensorsCheckpoint(Mapping[str, jax.Array]):
  """The tensors of `model.safetensors` or of the shards of `model.safetensors.index.json`,
  read lazily; `shape(name)` and `origin(name)` need no read."""

  def __init__(self, directory: str | os.PathLike):
    """Opens the checkpoint's safetensors file(s) and reads their headers.

    Raises:
      FileNotFoundError: no `model.safetensors` nor index, or a missing shard (named).
      ValueError: an index without `weight_map`, a misplaced tensor, an unreadable file.
    """
    from safetensors import safe_open  # pylint: disable=g-import-not-at-top
    self._open = safe_open
    directory = pathlib.Path(directory)
    single, index = directory / SAFETENSORS_FILE, directory / SAFETENSORS_INDEX_FILE
    if single.is_file():
      files, wanted = [single], None
    elif index.is_file():
      try:
        weight_map_ = json.loads(index.read_text())["weight_map"]
      except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise ValueError(f"{index}: not a safetensors index with a 'weight_map' ({e!r})") from e
      wanted = {name: directory / shard for name, shard in weight_map_.items()}
      files = sorted(set(wanted.values()))
    else:
      raise FileNotFoundError(f"{directory}: no {SAFETENSORS_FILE} or {SAFETENSORS_INDEX_FILE}")
    self._file: dict[str, pathlib.Path] = {}
    self._shape: dict[str, tuple[int, ...]] = {}
    for path in files:
      if not path.is_file():
        raise FileNotFoundError(f"{path}: shard listed in {index} is missing")
      try:
        with safe_open(path, framework="flax") as f:
          for name in f.keys():
            self._file[name] = path
            self._shape[name] = tuple(f.get_slice(name).get_shape())
      except Exception as e:  # safetensors raises its own SafetensorError for a bad header
        raise ValueError(f"{path}: not a readable safetensors file ({e})") from e
    if wanted is not None:
      for name, path in wanted.items():
        if self._file.get(name) != path:
          raise ValueError(f"{path}: tensor {name!r} listed in {index} is not in this shard")

  def __getitem__(self, name: str) -> jax.Array:
    with self._open(self._file[name], framework="flax") as f:
      return f.get_tensor(name)

  def __iter__(self) -> Iterator[str]:
    return iter(self._file)

  def __len__(self) -> int:
    return len(self._file)

  def __contains__(self, name: object) -> bool:
    return name in self._file

  def shape(self, name: str) -> tuple[int, ...]:
    """The stored shape of tensor `name` (no read)."""
    return self._shape[name]

  def origin(self, name: str) -> str:
    """The file holding tensor `name` (for a missing tensor: the checkpoint's file or index)."""
    if name in self._file:
      return str(self._file[name])
    files = sorted({str(p) for p in self._file.values()})
    return files[0] if len(files) == 1 else str(pathlib.Path(files[0]).parent /
                                                SAFETENSORS_INDEX_FILE)


def read_config(directory: str | os.PathLike) -> dict[str, Any]:
  """config.json of a checkpoint directory as a dict.

  Raises:
    FileNotFoundError: no config.json (names the path).
    ValueError: config.json is not a JSON object.
  """
  path = pathlib.Path(directory) / CONFIG_FILE
  if not path.is_file():
    raise FileNotFoundError(f"{path}: a HF checkpoint directory needs {CONFIG_FILE}")
  try:
    config = json.loads(path.read_text())
  except json.JSONDecodeError as e:
    raise ValueError(f"{path}: not valid JSON ({e})") from e
  if not isinstance(config, dict):
    raise ValueError(f"{path}: expected a JSON object; got {type(config).__name__}")
  return config


def _load_tokenizer(directory: pathlib.Path):
  path = directory / TOKENIZER_FILE
  if not path.is_file():
    return None
  from kvattn.checkpoints import tokenizer as tokenizer_lib  # pylint: disable=g-import-not-at-top
  return tokenizer_lib.Tokenizer.from_file(path)


def from_pretrained(source: str | os.PathLike, *, dtype: Any = None,
                    param_dtype: Any = None) -> tuple[transformer_lib.Transformer, Any]:
  """Loads a pretrained checkpoint as `(kvattn.Transformer, Tokenizer or None)`.

  Args:
    source: a HF checkpoint directory (config.json + safetensors, tokenizer.json
      optional), a `.gguf` file, or a name registered in `kvattn.checkpoints.hub`.
    dtype: compute dtype; default float32.
    param_dtype: the weights' dtype; default `dtype` ("int8": W8A8).

  Raises:
    FileNotFoundError: a missing path that is no registered name, or a directory without
      config.json or safetensors (naming the path).
    NotImplementedError: a setting the model cannot represent (naming key and value).
    ValueError: a missing or misshapen tensor (naming file and tensor); a bad GGUF file.
    TypeError: `source` is not a str or path.
  """
  if not isinstance(source, (str, os.PathLike)):
    raise TypeError(f"source must be a path or a registered name; got {type(source).__name__}")
  path = pathlib.Path(source)
  if path.is_dir():
    config = read_config(path)
    model = build_model(config, SafetensorsCheckpoint(path), dtype=dtype, param_dtype=param_dtype,
                        where=str(path / CONFIG_FILE))
    return model, _load_tokenizer(path)
  if path.suffix == ".gguf" or path.exists():
    if not path.is_file():
      raise FileNotFoundError(f"{path}: no such file")
    if path.suffix != ".gguf":
      raise ValueError(f"source {str(path)!r} is a file but not a .gguf file; pass a .gguf "
                       f"file or a HF checkpoint directory")
  else:
    from kvattn.checkpoints import hub  # pylint: disable=g-import-not-at-top
    path = hub.resolve(source)
  from kvattn.checkpoints import gguf  # pylint: disable=g-import-not-at-top
  checkpoint = gguf.load_gguf(path)  # checks the metadata and tensors in the file's own names
  model = build_model(checkpoint.config, checkpoint.tensors, dtype=dtype, param_dtype=param_dtype,
                      where=f"the config derived from {path}")
  return model, checkpoint.tokenizer
