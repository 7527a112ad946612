"""GGUF checkpoints (llama.cpp's format): hyperparameters, f32 weights and tokenizer.

`load_gguf(path)` returns a `GGUFCheckpoint` in HF's vocabulary for
`kvattn.checkpoints.pretrained.build_model`: an HF `config.json`-style dict, HF-named f32
tensors in torch layout `[out, in]` (dequantized: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0,
Q5_1, Q4_K, Q5_K, Q6_K; the family's storage quirks undone, `kvattn.checkpoints.families`)
and the tokenizer (or None, with a warning, when the file has none kvattn can build). The
file is untrusted: `gguf_header`'s walk checks every length, type and offset, and every
tensor's shape and byte extent is checked before it is read.
"""

from __future__ import annotations

import dataclasses
import math
import os
import pathlib
import warnings
from typing import Any, Mapping

import numpy as np

from kvattn.checkpoints import families
from kvattn.checkpoints import tokenizer as tokenizer_lib
# Re-exported: the header walk lives in gguf_header.
from kvattn.checkpoints.gguf_header import TensorInfo, check_header, read_header  # noqa: F401

SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K",
                   "Q6_K")

# GGUF tensor name -> HF name of the tensors outside the layers (each family's
# `gguf_layer_names` maps those of a layer, "blk.{i}.<name>").
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def _required_tensors(family: families.Family) -> tuple[str, ...]:
  """Tensors every file of `family` needs ("{i}": each layer); output.weight is optional (tied
  head) and the attention biases too."""
  return ("token_embd.weight", "output_norm.weight",
          *(f"blk.{{i}}.{name}" for name in family.gguf_layer_names if name.endswith(".weight")))



@dataclasses.dataclass(frozen=True)
class GGUFCheckpoint:
  """A GGUF file's contents in HF's vocabulary: `config` (HF hyperparameters), `tensors` (HF
  name -> f32 array, `[out, in]` for matrices), `tokenizer` (or None), `path`."""

  config: dict[str, Any]
  tensors: dict[str, np.ndarray]
  tokenizer: tokenizer_lib.Tokenizer | None
  path: pathlib.Path


def load_gguf(path: str | os.PathLike[str]) -> GGUFCheckpoint:
  """Reads, checks and dequantizes a GGUF checkpoint (memory: the f32 weights plus one
  tensor's temporaries; the file is memory-mapped).

  Raises:
    FileNotFoundError: `path` does not exist.
    ValueError: a truncated or malformed file (naming the file and tensor or key).
    NotImplementedError: an architecture, tensor type, tensor name or hyperparameter
      kvattn cannot represent (naming the key and value).
  """
  path = pathlib.Path(path)
  if not path.is_file():
    raise FileNotFoundError(f"GGUF file {str(path)!r} does not exist")
  file_size = path.stat().st_size
  # The checked walk of the header reads the metadata and tensor records itself: gguf's
  # GGUFReader builds numpy views per array item (a minute for Gemma's 262k-token vocabulary).
  metadata, infos, data = read_header(path)
  shapes = {name: tuple(int(n) for n in reversed(info.shape)) for name, info in infos.items()}
  config = gguf_config(metadata, shapes, where=str(path))
  arch = metadata["general.architecture"]
  family = families.by_gguf_architecture(arch)
  names = {name: hf_tensor_name(name, config["num_hidden_layers"], where=str(path), arch=arch)
           for name in infos}
  check_tensor_shapes(shapes, config, where=str(path))
  tensors = {}
  for name, info in infos.items():
    array = _read_tensor(info, file_size, where=f"{path}: tensor {name!r}")
    if name.startswith("blk.") and name.endswith((".attn_q.weight", ".attn_k.weight",
                                                  ".attn_q.bias", ".attn_k.bias")):
      if family.gguf_rope_rows_permuted:
        heads = config["num_attention_heads" if ".attn_q." in name else "num_key_value_heads"]
        array = unpermute_rope_rows(array, heads, where=f"{path}: tensor {name!r}")
    if family.norm_plus_one and name.endswith("norm.weight"):
      array = array - np.float32(1.0)  # llama.cpp stores Gemma's 1 + w; HF (and weights.py) w
    tensors[names[name]] = array
  del data, infos
  tok = None
  if "tokenizer.ggml.model" in metadata:
    try:
      tok = tokenizer_lib.Tokenizer.from_gguf_metadata(metadata, source=str(path))
    except ValueError as e:
      raise ValueError(f"{path}: {e}") from e
    except NotImplementedError as e:  # e.g. a sentencepiece vocabulary: the model still loads.
      warnings.warn(f"{path}: no tokenizer: {e}", stacklevel=2)
  return GGUFCheckpoint(config=config, tensors=tensors, tokenizer=tok, path=path)


def read_metadata(reader) -> dict[str, Any]:
  """GGUF key -> value (str, int, float, bool or list of them) of a `gguf.GGUFReader`."""
  return {key: field.contents() for key, field in reader.fields.items()
          if not key.startswith("GGUF.")}


def gguf_config(metadata: Mapping[str, Any], tensor_shapes: Mapping[str, tuple[int, ...]], *,
                where: str = "GGUF") -> dict[str, Any]:
  """HF `config.json`-style hyperparameters from GGUF `metadata` (llama.cpp key names);
  `tensor_shapes` decide `tie_word_embeddings` (and `vocab_size` as a fallback).

  Raises:
    ValueError: a required key is missing or has a bad value.
    NotImplementedError: an architecture or setting kvattn cannot represent.
  """
  arch = metadata.get("general.architecture")
  family = families.by_gguf_architecture(arch, where=where)

  def get(key, default=None, *, kind=int):
    value = metadata.get(f"{arch}.{key}", default)
    if value is None:
      raise ValueError(f"{where}: metadata key {arch}.{key} is missing")
    if kind is int and not (isinstance(value, int) and not isinstance(value, bool) and value > 0):
      raise ValueError(f"{where}: {arch}.{key} must be a positive integer; got {value!r}")
    if kind is float and not (isinstance(value, (int, float)) and not isinstance(value, bool)
                              and value > 0 and math.isfinite(value)):
      raise ValueError(f"{where}: {arch}.{key} must be a positive finite number; got {value!r}")
    return value

  experts = metadata.get(f"{arch}.expert_count", 0)
  if experts:
    raise NotImplementedError(f"{where}: {arch}.expert_count={experts!r}: mixture-of-experts "
                              "layers are not supported")
  hidden = get("embedding_length")
  heads = get("attention.head_count")
  kv_heads = get("attention.head_count_kv", heads)
  if heads % kv_heads:
    raise ValueError(f"{where}: {arch}.attention.head_count ({heads}) must be divisible by "
                     f"{arch}.attention.head_count_kv ({kv_heads})")
  if f"{arch}.attention.key_length" not in metadata and hidden < heads:
    raise ValueError(f"{where}: {arch}.embedding_length ({hidden}) must be at least "
                     f"{arch}.attention.head_count ({heads}) when "
                     f"{arch}.attention.key_length is not set")
  head_dim = get("attention.key_length", hidden // heads)
  if head_dim % 2:
    raise ValueError(f"{where}: the head dim ({arch}.attention.key_length, else "
                     f"{arch}.embedding_length / {arch}.attention.head_count) must be even "
                     f"(RoPE rotates pairs); got {head_dim}")
  value_dim = get("attention.value_length", head_dim)
  if value_dim != head_dim:
    raise NotImplementedError(f"{where}: {arch}.attention.value_length={value_dim} differs from "
                              f"the key length {head_dim}")
  rope_dim = get("rope.dimension_count", head_dim)
  if rope_dim != head_dim:
    raise NotImplementedError(f"{where}: {arch}.rope.dimension_count={rope_dim}: partial RoPE "
                              f"(head_dim {head_dim}) is not supported")
  if f"{arch}.vocab_size" in metadata:
    vocab = get("vocab_size")
  elif "token_embd.weight" in tensor_shapes:  # llama.cpp writes the key only sometimes.
    vocab = tensor_shapes["token_embd.weight"][0]
  else:
    raise ValueError(f"{where}: neither {arch}.vocab_size nor tensor token_embd.weight is present")
  config = {
      "model_type": family.model_type,
      "hidden_size": hidden,
      "num_attention_heads": heads,
      "num_key_value_heads": kv_heads,
      "head_dim": head_dim,
      "intermediate_size": get("feed_forward_length"),
      "num_hidden_layers": get("block_count"),
      "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", kind=float)),
      "rope_theta": float(get("rope.freq_base", 10000.0, kind=float)),
      "vocab_size": vocab,
      "tie_word_embeddings": "output.weight" not in tensor_shapes,
      "max_position_embeddings": get("context_length"),
  }
  scaling = metadata.get(f"{arch}.rope.scaling.type", "none")
  if scaling == "linear":
    config["rope_scaling"] = {"rope_type": "linear",
                              "factor": float(get("rope.scaling.factor", kind=float))}
  elif scaling != "none":
    raise NotImplementedError(f"{where}: {arch}.rope.scaling.type={scaling!r} is not supported; "
                              "expected 'none' or 'linear'")
  if "rope_freqs.weight" in tensor_shapes:
    raise NotImplementedError(f"{where}: tensor 'rope_freqs.weight' (per-frequency RoPE factors, "
                              "llama3 rope scaling) is not supported in GGUF files")
  window = metadata.get(f"{arch}.attention.sliding_window")
  if window:
    config["sliding_window"] = get("attention.sliding_window")
  if family.gguf_config is not None:
    config.update(family.gguf_config(get, metadata, config, where))
  return config


def check_tensor_shapes(shapes: Mapping[str, tuple[int, ...]], config: Mapping[str, Any], *,
                        where: str = "GGUF") -> None:
  """Checks a file's tensor `shapes` (GGUF names, `[out, in]`) against `config`.

  Raises:
    ValueError: a missing tensor, or a shape the metadata does not imply (naming both).
    NotImplementedError: attention biases in a `llama` file.
  """
  family = families.lookup(config["model_type"])
  arch = family.gguf_architecture
  d, f, v = (f"{arch}.embedding_length", f"{arch}.feed_forward_length", f"{arch}.vocab_size")
  n, k = f"{arch}.attention.head_count", f"{arch}.attention.head_count_kv"
  h = f"head dim ({arch}.attention.key_length)"
  D, F, V = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
  N, K, H = (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"])
  expected = {  # name -> (shape, what it is made of)
      "token_embd.weight": ((V, D), f"[{v}, {d}]"),
      "output.weight": ((V, D), f"[{v}, {d}]"),
      "output_norm.weight": ((D,), f"[{d}]"),
      "attn_norm.weight": ((D,), f"[{d}]"),
      "ffn_norm.weight": ((D,), f"[{d}]"),
      "attn_q.weight": ((N * H, D), f"[{n} x {h}, {d}]"),
      "attn_k.weight": ((K * H, D), f"[{k} x {h}, {d}]"),
      "attn_v.weight": ((K * H, D), f"[{k} x {h}, {d}]"),
      "attn_output.weight": ((D, N * H), f"[{d}, {n} x {h}]"),
      "attn_q.bias": ((N * H,), f"[{n} x {h}]"),
      "attn_q_norm.weight": ((H,), f"[{h}]"),
      "attn_k_norm.weight": ((H,), f"[{h}]"),
      "post_attention_norm.weight": ((D,), f"[{d}]"),
      "post_ffw_norm.weight": ((D,), f"[{d}]"),
      "attn_k.bias": ((K * H,), f"[{k} x {h}]"),
      "attn_v.bias": ((K * H,), f"[{k} x {h}]"),
      "ffn_gate.weight": ((F, D), f"[{f}, {d}]"),
      "ffn_up.weight": ((F, D), f"[{f}, {d}]"),
      "ffn_down.weight": ((D, F), f"[{d}, {f}]"),
  }
  for name, shape in shapes.items():
    kind = name.split(".", 2)[2] if name.startswith("blk.") else name
    if kind.endswith(".bias") and not family.gguf_attention_bias:
      raise NotImplementedError(f"{where}: tensor {name!r}: attention biases in a {arch} file "
                                "are not supported")
    if kind not in expected:  # hf_tensor_name names what kvattn does not know
      continue
    want, why = expected[kind]
    if tuple(shape) != want:
      raise ValueError(f"{where}: tensor {name!r} has shape {list(shape)}; expected "
                       f"{list(want)} = {why} from the file's metadata")
  layer_kinds = ", ".join(n.split(".")[0] for n in family.gguf_layer_names
                          if n.endswith(".weight"))
  for template in _required_tensors(family):
    for i in range(config["num_hidden_layers"]) if "{i}" in template else (None,):
      name = template.format(i=i)
      if name not in shapes:
        raise ValueError(f"{where}: tensor {name!r} is missing (a {arch} file needs token_embd, "
                         f"output_norm and, in each of its {config['num_hidden_layers']} layers, "
                         f"{layer_kinds})")


def hf_tensor_name(name: str, num_layers: int, *, where: str = "GGUF", arch: str = "llama") -> str:
  """The HF name of GGUF tensor `name` ("blk.3.attn_q.weight" -> "model.layers.3....") in a
  file of architecture `arch` (one of `families.gguf_architectures()`).

  Raises:
    NotImplementedError: `name` is not a tensor kvattn knows.
    ValueError: its layer index is outside [0, num_layers).
  """
  if name in _GLOBAL_NAMES:
    return _GLOBAL_NAMES[name]
  parts = name.split(".", 2)
  layer_names = families.by_gguf_architecture(arch, where=where).gguf_layer_names
  if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in layer_names:
    layer = int(parts[1])
    if layer >= num_layers:
      raise ValueError(f"{where}: tensor {name!r} has layer {layer}; the file declares "
                       f"{num_layers} layers")
    return f"model.layers.{layer}.{layer_names[parts[2]]}"
  raise NotImplementedError(f"{where}: tensor {name!r} is not supported")


def unpermute_rope_rows(w: np.ndarray, num_heads: int, *, where: str = "tensor") -> np.ndarray:
  """Undoes llama.cpp's interleaved RoPE row order of a Q or K projection
  (`convert_hf_to_gguf.permute`): GGUF row `h*H + 2*j + i` -> HF row `h*H + i*(H/2) + j`.
  `w: [num_heads * H, D]` (or a bias); returns a new array.

  Raises:
    ValueError: the row count is not num_heads times an even head dim.
  """
  rows = w.shape[0]
  if num_heads <= 0 or rows % (2 * num_heads):
    raise ValueError(f"{where}: {rows} rows cannot be {num_heads} heads of an even head dim")
  half = rows // num_heads // 2
  return np.ascontiguousarray(
      w.reshape(num_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape))


def dequantize(data: np.ndarray, type_name: str, shape: tuple[int, ...], *,
               where: str = "tensor") -> np.ndarray:
  """`f32[shape]` (a new array) of one tensor's raw GGUF `data` of GGML type `type_name`.

  Raises:
    NotImplementedError: `type_name` is not in `SUPPORTED_TYPES`.
    ValueError: `data` does not hold exactly `shape`'s elements.
  """
  from gguf import quants  # pylint: disable=g-import-not-at-top
  import gguf  # pylint: disable=g-import-not-at-top

  if type_name not in SUPPORTED_TYPES:
    raise NotImplementedError(f"{where}: tensor type {type_name} is not supported; expected one "
                              f"of {SUPPORTED_TYPES}")
  qtype = gguf.GGMLQuantizationType[type_name]
  if type_name == "F32":
    out = np.array(data, dtype=np.float32)  # A copy: the file's pages stay unpinned.
  else:
    out = quants.dequantize(np.asarray(data), qtype)
  if out.size != int(np.prod(shape)):
    raise ValueError(f"{where}: {out.size} values for shape {shape}")
  return out.reshape(shape).astype(np.float32, copy=False)


def _read_tensor(info, file_size: int, *, where: str) -> np.ndarray:
  """One tensor's f32 values after checking its byte extent against shape, type and file."""
  import gguf  # pylint: disable=g-import-not-at-top

  type_name = info.tensor_type.name
  if type_name not in SUPPORTED_TYPES:
    raise NotImplementedError(f"{where}: tensor type {type_name} is not supported; expected one "
                              f"of {SUPPORTED_TYPES}")
  shape = tuple(int(n) for n in reversed(info.shape))  # GGUF lists the fastest axis first.
  if not shape or any(n <= 0 for n in shape):
    raise ValueError(f"{where}: bad shape {shape}")
  block, block_bytes = gguf.GGML_QUANT_SIZES[info.tensor_type]
  if shape[-1] % block:
    raise ValueError(f"{where}: row length {shape[-1]} is not a multiple of the {type_name} "
                     f"block size {block}")
  expected = int(np.prod(shape, dtype=np.int64)) // block * block_bytes
  start = int(info.data_offset)
  if start < 0 or start + expected > file_size or int(info.n_bytes) != expected:
    raise ValueError(f"{where}: {type_name} {shape} needs bytes [{start}, {start + expected}) "
                     f"but the file has {file_size} bytes (truncated or malformed)")
  if np.asarray(info.data).nbytes != expected:
    raise ValueError(f"{where}: mapped {np.asarray(info.data).nbytes} bytes; expected {expected}")
  return dequantize(info.data, type_name, shape, where=where)
