"""The model-family record (`Family`) and its registry (`register`, `lookup`, ...), the only
place `kvattn.checkpoints` learns a `model_type`'s quirks (docs/DESIGN.md, "Recipes")."""

from __future__ import annotations

import dataclasses
import types
from typing import Any, Callable, Mapping, NamedTuple


class ModelParts(NamedTuple):
  """What a family reads from config.json beyond the shared keys: `attention` (the
  `model.attention` fields), `model` (extra `model` fields), `layers` (per-layer overrides)."""

  attention: dict[str, Any]
  model: dict[str, Any]
  layers: tuple[dict[str, Any], ...]


class UnsupportedError(ValueError, NotImplementedError):
  """A `model_type` or GGUF architecture no registered family reads (a ValueError and a
  NotImplementedError naming the value and the supported ones)."""


# kvattn norm module -> HF module under "model.layers.{i}.", as Llama lays a block out.
LLAMA_NORMS = (("attn_norm", "input_layernorm"), ("mlp_norm", "post_attention_layernorm"))


def _frozen(mapping: Mapping[str, Any] | None) -> Mapping[str, Any]:
  return types.MappingProxyType(dict(mapping or {}))


@dataclasses.dataclass(frozen=True)
class Family:
  """One model family (one config.json `model_type`).

  Attributes:
    model_type: the config.json `model_type` it reads.
    model_config: config.json mapping -> `ModelParts`; raises ValueError (malformed) or
      NotImplementedError (unrepresentable), naming the key.
    hf_layer_norms: `(kvattn norm module, HF module)` pairs of each block.
    norm_plus_one: RMSNorm scales applied as 1 + w (Gemma).
    gguf_architecture: the GGUF `general.architecture` that loads as it (None: none).
    gguf_layer_names: GGUF layer tensor -> HF name after "model.layers.{i}.".
    gguf_config: `(get, metadata, config, where) -> extra config.json keys`.
    gguf_rope_rows_permuted: Q/K rows stored in interleaved-RoPE order (Llama).
    gguf_attention_bias: the file may hold q/k/v biases (Qwen2).
    sentencepiece_architectures: GGUF architectures whose "llama" vocabulary is Gemma's.
    pre_tokenizer_splits: `tokenizer.ggml.pre` -> split regex.
  """

  model_type: str
  model_config: Callable[[Mapping[str, Any]], ModelParts]
  hf_layer_norms: tuple[tuple[str, str], ...] = LLAMA_NORMS
  norm_plus_one: bool = False
  gguf_architecture: str | None = None
  gguf_layer_names: Mapping[str, str] = dataclasses.field(default_factory=dict)
  gguf_config: Callable[..., dict[str, Any]] | None = None
  gguf_rope_rows_permuted: bool = False
  gguf_attention_bias: bool = False
  sentencepiece_architectures: tuple[str, ...] = ()
  pre_tokenizer_splits: Mapping[str, str] = dataclasses.field(default_factory=dict)

  def __post_init__(self):
    object.__setattr__(self, "gguf_layer_names", _frozen(self.gguf_layer_names))
    object.__setattr__(self, "pre_tokenizer_splits", _frozen(self.pre_tokenizer_splits))


_FAMILIES: dict[str, Family] = {}  # model_type -> family, in registration order


def register(family: Family) -> Family:
  """Adds `family` to the registry and returns it.

  Raises:
    ValueError: its `model_type`, GGUF architecture or a pre-tokenizer name is taken.
  """
  if family.model_type in _FAMILIES:
    raise ValueError(f"model_type {family.model_type!r} is already registered")
  for other in _FAMILIES.values():
    if family.gguf_architecture and family.gguf_architecture == other.gguf_architecture:
      raise ValueError(f"GGUF architecture {family.gguf_architecture!r} is already registered "
                       f"by model_type {other.model_type!r}")
    shared = sorted(set(family.pre_tokenizer_splits) & set(other.pre_tokenizer_splits))
    if shared:
      raise ValueError(f"pre-tokenizer {shared[0]!r} is already registered by model_type "
                       f"{other.model_type!r}")
  _FAMILIES[family.model_type] = family
  return family


def model_types() -> tuple[str, ...]:
  """The registered config.json `model_type`s, in registration order."""
  return tuple(_FAMILIES)


def lookup(model_type: Any) -> Family:
  """The family of config.json `model_type`.

  Raises:
    UnsupportedError: no family reads `model_type` (names it and the supported ones).
  """
  if isinstance(model_type, str) and model_type in _FAMILIES:
    return _FAMILIES[model_type]
  raise UnsupportedError(f"config model_type={model_type!r} is not supported: supported: "
                         f"{list(_FAMILIES)}")


def gguf_architectures() -> tuple[str, ...]:
  """The GGUF `general.architecture`s some family loads."""
  return tuple(f.gguf_architecture for f in _FAMILIES.values() if f.gguf_architecture)


def by_gguf_architecture(arch: Any, *, where: str = "GGUF") -> Family:
  """The family a GGUF file of `general.architecture` `arch` loads as.

  Raises:
    UnsupportedError: no family loads `arch` (names it and the supported ones).
  """
  for family in _FAMILIES.values():
    if family.gguf_architecture is not None and family.gguf_architecture == arch:
      return family
  raise UnsupportedError(f"{where}: general.architecture={arch!r} is not supported; expected "
                         f"one of {gguf_architectures()}")


def sentencepiece_architectures() -> tuple[str, ...]:
  """GGUF architectures whose "llama" vocabulary is Gemma's SentencePiece one."""
  return tuple(a for f in _FAMILIES.values() for a in f.sentencepiece_architectures)


def pre_tokenizer_split(pre: Any) -> str | None:
  """The split regex of GGUF pre-tokenizer `pre` (`tokenizer.ggml.pre`); None: GPT-2's."""
  for family in _FAMILIES.values():
    if pre in family.pre_tokenizer_splits:
      return family.pre_tokenizer_splits[pre]
  return None
