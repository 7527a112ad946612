"""GGUF checkpoints (llama.cpp's format): hyperparameters, f32 weights and tokenizer.

`load_gguf(path)` reads a `.gguf` file with the `gguf` package and returns a
`GGUFCheckpoint` in HF's vocabulary, ready for `kvattn.pretrained.build_model`:

  * `config`: a HF `config.json`-style dict (`model_type`, `hidden_size`,
    `num_attention_heads`, `num_key_value_heads`, `head_dim`,
    `intermediate_size`, `num_hidden_layers`, `rms_norm_eps`, `rope_theta`,
    `vocab_size`, `tie_word_embeddings`, `max_position_embeddings`, and
    `rope_scaling` / `sliding_window` when the file sets them).
  * `tensors`: HF names (`model.layers.0.self_attn.q_proj.weight`, ...) ->
    `f32` arrays in torch layout `[out_features, in_features]`, dequantized
    (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K) and, for `llama`, with
    llama.cpp's row permutation of the Q and K projections undone.
    `lm_head.weight` is present only when the file has `output.weight`
    (otherwise the head is tied to the embedding).
  * `tokenizer`: a `kvattn.tokenizer.Tokenizer` from the file's metadata, or
    None when the file has none or one `kvattn.tokenizer` cannot build (a
    sentencepiece vocabulary, `tokenizer.ggml.model == "llama"`: a warning
    says so; pass a `tokenizer.json` to `Tokenizer.from_file` instead).

The file is untrusted: its header is parsed inside a guard, every tensor's
byte extent is checked against the file size and against its shape and type
before it is read, and a file that fails a check raises ValueError naming it.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import warnings
from typing import Any, Mapping

import numpy as np

from kvattn import tokenizer as tokenizer_lib

SUPPORTED_ARCHITECTURES = ("llama", "qwen2")
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K")

# GGUF tensor name -> HF name; "{i}" is the layer index.
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}


@dataclasses.dataclass(frozen=True)
class GGUFCheckpoint:
  """A GGUF file's contents in HF's vocabulary.

  Attributes:
    config: HF `config.json`-style hyperparameters (see the module docstring).
    tensors: HF parameter name -> f32 array, torch layout `[out, in]` for
      matrices, `[D]` for norms.
    tokenizer: the file's tokenizer, or None when it has none or an
      unsupported kind (with a warning).
    path: the file read.
  """

  config: dict[str, Any]
  tensors: dict[str, np.ndarray]
  tokenizer: tokenizer_lib.Tokenizer | None
  path: pathlib.Path


def load_gguf(path: str | os.PathLike[str]) -> GGUFCheckpoint:
  """Reads, checks and dequantizes a GGUF checkpoint.

  Memory: the dequantized f32 weights (540 MB for SmolLM2-135M) plus one tensor's
  temporaries; the file itself is memory-mapped.

  Args:
    path: a `.gguf` file.

  Returns:
    A `GGUFCheckpoint`.

  Raises:
    FileNotFoundError: `path` does not exist.
    ValueError: the file is truncated or malformed (the message names the file
      and, where one is at fault, the tensor or key).
    NotImplementedError: the architecture, a tensor type, a tensor name or a
      hyperparameter (mixture of experts, partial RoPE, a RoPE scaling type) is
      one kvattn cannot represent; the message names the key and value.
  """
  import gguf  # pylint: disable=g-import-not-at-top

  path = pathlib.Path(path)
  if not path.is_file():
    raise FileNotFoundError(f"GGUF file {str(path)!r} does not exist")
  file_size = path.stat().st_size
  try:
    reader = gguf.GGUFReader(path)
    metadata = read_metadata(reader)
  except (ValueError, IndexError, KeyError, TypeError, OverflowError, UnicodeDecodeError,
          MemoryError) as e:
    raise ValueError(f"{path}: not a readable GGUF file (truncated or malformed): {e}") from e
  infos = {t.name: t for t in reader.tensors}
  if len(infos) != len(reader.tensors):
    raise ValueError(f"{path}: a tensor name appears twice")
  shapes = {name: tuple(int(n) for n in reversed(info.shape)) for name, info in infos.items()}
  config = gguf_config(metadata, shapes, where=str(path))
  names = {name: hf_tensor_name(name, config["num_hidden_layers"], where=str(path))
           for name in infos}
  tensors = {}
  for name, info in infos.items():
    array = _read_tensor(info, file_size, where=f"{path}: tensor {name!r}")
    if name.startswith("blk.") and name.endswith((".attn_q.weight", ".attn_k.weight",
                                                  ".attn_q.bias", ".attn_k.bias")):
      if config["model_type"] == "llama":
        heads = config["num_attention_heads" if ".attn_q." in name else "num_key_value_heads"]
        array = unpermute_rope_rows(array, heads, where=f"{path}: tensor {name!r}")
    tensors[names[name]] = array
  del reader, infos
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
  """HF `config.json`-style hyperparameters from GGUF metadata (llama.cpp key names).

  Args:
    metadata: GGUF key -> value (`read_metadata`).
    tensor_shapes: the file's tensor names -> numpy-order shapes (decide
      `tie_word_embeddings` and, as a fallback, `vocab_size`).
    where: what to name in error messages (the file).

  Raises:
    ValueError: a required key is missing or has a bad value.
    NotImplementedError: an architecture, RoPE scaling type, partial RoPE or
      mixture-of-experts setting kvattn cannot represent.
  """
  arch = metadata.get("general.architecture")
  if arch not in SUPPORTED_ARCHITECTURES:
    raise NotImplementedError(f"{where}: general.architecture={arch!r} is not supported; "
                              f"expected one of {SUPPORTED_ARCHITECTURES}")

  def get(key, default=None, *, kind=int):
    value = metadata.get(f"{arch}.{key}", default)
    if value is None:
      raise ValueError(f"{where}: metadata key {arch}.{key} is missing")
    if kind is int and not (isinstance(value, int) and not isinstance(value, bool) and value > 0):
      raise ValueError(f"{where}: {arch}.{key} must be a positive integer; got {value!r}")
    if kind is float and not (isinstance(value, (int, float)) and value > 0):
      raise ValueError(f"{where}: {arch}.{key} must be a positive number; got {value!r}")
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
  head_dim = get("attention.key_length", hidden // heads)
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
      "model_type": arch,
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
  return config


def hf_tensor_name(name: str, num_layers: int, *, where: str = "GGUF") -> str:
  """The HF name of GGUF tensor `name` ("blk.3.attn_q.weight" -> "model.layers.3....").

  Raises:
    NotImplementedError: `name` is not a tensor kvattn knows.
    ValueError: its layer index is outside [0, num_layers).
  """
  if name in _GLOBAL_NAMES:
    return _GLOBAL_NAMES[name]
  parts = name.split(".", 2)
  if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_NAMES:
    layer = int(parts[1])
    if layer >= num_layers:
      raise ValueError(f"{where}: tensor {name!r} has layer {layer}; the file declares "
                       f"{num_layers} layers")
    return f"model.layers.{layer}.{_LAYER_NAMES[parts[2]]}"
  raise NotImplementedError(f"{where}: tensor {name!r} is not supported")


def unpermute_rope_rows(w: np.ndarray, num_heads: int, *, where: str = "tensor") -> np.ndarray:
  """Undoes llama.cpp's row permutation of a Q or K projection (`convert_hf_to_gguf.permute`).

  llama.cpp stores each head's rows in interleaved RoPE order: HF row
  `h*H + i*(H/2) + j` (half i of head h, offset j) is GGUF row
  `h*H + 2*j + i`. This maps GGUF back to HF's half-split order.

  Args:
    w: `[num_heads * H, D]` weight (or `[num_heads * H]` bias) in GGUF row order.
    num_heads: heads of this projection (query heads N for Q, KV heads K for K).
    where: what to name in error messages.

  Returns:
    A new array of `w`'s shape and dtype, rows in HF order.

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
  """f32 values of one tensor's raw GGUF bytes.

  Args:
    data: `u8[..., row_bytes]` raw blocks (or the typed F32/F16/BF16 array) as
      `gguf.GGUFReader` maps them.
    type_name: GGML type name, one of `SUPPORTED_TYPES`.
    shape: the tensor's shape in numpy order (`[out, in]` for a matrix).
    where: what to name in error messages.

  Returns:
    `f32[shape]`, a new array (never a view of the file).

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
