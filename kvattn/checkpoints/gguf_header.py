"""The checked walk of a GGUF file's header (`read_header`, `check_header`).

The header is the magic and version, the metadata key/value pairs, and one record per
tensor (name, dimensions, type, data offset). The file is untrusted: every length, value
type, tensor type and tensor extent is checked against the file as the walk goes, and a
failure raises ValueError naming the file and the key or tensor at fault. The walk reads
values itself, not through `gguf.GGUFReader`, which builds numpy views per array item (60 s
for Gemma 3's 262k-token vocabulary on the shared machine, against 5 s here).
"""

from __future__ import annotations

import dataclasses
import math
import mmap
import os
import pathlib
import struct
from typing import Any

import numpy as np

# GGUF metadata value types, numbered as gguf.GGUFValueType: id -> (name, bytes per value; 0
# for the variable-length STRING and ARRAY).
_VALUE_TYPES = {0: ("UINT8", 1), 1: ("INT8", 1), 2: ("UINT16", 2), 3: ("INT16", 2),
                4: ("UINT32", 4), 5: ("INT32", 4), 6: ("FLOAT32", 4), 7: ("BOOL", 1),
                8: ("STRING", 0), 9: ("ARRAY", 0), 10: ("UINT64", 8), 11: ("INT64", 8),
                12: ("FLOAT64", 8)}
_STRING, _ARRAY, _UINT32, _BOOL = 8, 9, 4, 7
_NUMPY_TYPES = {0: "uint8", 1: "int8", 2: "uint16", 3: "int16", 4: "uint32", 5: "int32",
                6: "float32", 7: "uint8", 10: "uint64", 11: "int64", 12: "float64"}
_READABLE_VERSIONS = (2, 3)  # those gguf.GGUFReader reads
_MAX_DIMS = 4  # GGML_MAX_DIMS
_MAX_ARRAY_NESTING = 8  # arrays of arrays; llama.cpp writes none


@dataclasses.dataclass(frozen=True)
class TensorInfo:
  """One tensor record of a GGUF header (the fields of `gguf.ReaderTensor` kvattn reads).

  Attributes:
    name: the tensor's GGUF name.
    tensor_type: its `gguf.GGMLQuantizationType`.
    shape: its dimensions in GGUF order (the fastest axis first).
    data_offset: absolute byte offset of its data in the file.
    n_bytes: bytes of its data.
    data: the data, memory-mapped: typed `[numpy shape]` for F32 / F16, else
      `u8[..., row_bytes]` (as `gguf.GGUFReader` maps it).
  """

  name: str
  tensor_type: Any
  shape: tuple[int, ...]
  data_offset: int
  n_bytes: int
  data: np.ndarray


def read_header(path: str | os.PathLike[str]) -> tuple[dict[str, Any], dict[str, TensorInfo],
                                                       np.ndarray]:
  """`(metadata, tensors, data)` of a GGUF file: its header walked and checked as
  `check_header` does, the metadata as `read_metadata` returns it, each tensor's
  `TensorInfo` by name, and the memory-mapped file they view.

  Raises:
    ValueError: the header is truncated or malformed (see `check_header`).
  """
  path = pathlib.Path(path)
  if path.stat().st_size == 0:
    raise ValueError(f"{path}: the file is empty; expected a GGUF file")
  data = np.memmap(path, np.uint8, mode="r")
  walk = _HeaderWalk(data, str(path), keep=True)
  walk.walk()
  return walk.metadata, walk.infos, data


def check_header(path: str | os.PathLike[str]) -> None:
  """Walks a GGUF file's header and checks it against the file before anything parses it.

  The header is the magic and version, the metadata key/value pairs, and one
  record per tensor (name, dimensions, type, data offset). The `gguf` package
  reads past the end of a truncated or crafted header and fails in numpy's
  words ("index 0 is out of bounds for axis 0 with size 0"); this walk checks
  every length, value type, tensor type and tensor extent first.

  Args:
    path: a `.gguf` file.

  Raises:
    ValueError: the header is truncated or malformed; the message names the
      file, the metadata key or tensor at fault (or its position when its name
      cannot be read) and what was expected.
  """
  path = pathlib.Path(path)
  with open(path, "rb") as f:
    if path.stat().st_size == 0:
      raise ValueError(f"{path}: the file is empty; expected a GGUF file")
    with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
      _HeaderWalk(data, str(path)).walk()


class _HeaderWalk:
  """One pass over a GGUF header in a byte buffer; every read checked against its end."""

  def __init__(self, data, where: str, *, keep: bool = False):
    self.data, self.where, self.offset, self.order = data, where, 0, "<"
    self.keep = keep  # also keep the metadata values and tensor records
    self.metadata: dict[str, Any] = {}
    self.infos: dict[str, TensorInfo] = {}

  def fail(self, message: str):
    raise ValueError(f"{self.where}: {message}")

  def take(self, n: int, what: str) -> int:
    """Claims the next `n` bytes for `what`; returns their offset."""
    if n > len(self.data) - self.offset:
      self.fail(f"{what} needs bytes [{self.offset:,}, {self.offset + n:,}) but the file ends at "
                f"byte {len(self.data):,} (truncated or malformed)")
    self.offset += n
    return self.offset - n

  def uint(self, nbytes: int, what: str) -> int:
    return struct.unpack_from(self.order + ("I" if nbytes == 4 else "Q"), self.data,
                              self.take(nbytes, what))[0]

  def string(self, what: str) -> str:
    n = self.uint(8, f"the length of {what}")
    start = self.take(n, f"{what}, {n:,} bytes,")
    try:
      return bytes(self.data[start:start + n]).decode("utf-8")
    except UnicodeDecodeError as e:
      self.fail(f"{what} is not UTF-8 text ({e.reason} at byte {start + e.start:,})")

  def numbers(self, vtype: int, count: int, what: str) -> Any:
    """`count` numbers of scalar type `vtype` (a list when `self.keep`, else skipped);
    `what` names them in errors."""
    start = self.take(count * _VALUE_TYPES[vtype][1], what)
    if not self.keep:
      return None
    values = np.frombuffer(self.data, np.dtype(_NUMPY_TYPES[vtype]).newbyteorder(self.order),
                           count, start)
    return values.astype(bool).tolist() if vtype == _BOOL else values.tolist()

  def value(self, vtype: int, what: str, depth: int = 0) -> Any:
    """Reads (when `self.keep`; else skips) one metadata value of type `vtype`."""
    if vtype not in _VALUE_TYPES:
      self.fail(f"{what} has value type {vtype}; expected a GGUF value type (0 to 12)")
    name, size = _VALUE_TYPES[vtype]
    if size:
      value = self.numbers(vtype, 1, f"{what} ({name})")
      return None if value is None else value[0]
    elif vtype == _STRING:
      return self.string(what)
    else:
      item = self.uint(4, f"the item type of {what}")
      count = self.uint(8, f"the length of {what}")
      if item not in _VALUE_TYPES:
        self.fail(f"{what} is an array of value type {item}; expected a GGUF value type "
                  "(0 to 12)")
      item_name, item_size = _VALUE_TYPES[item]
      if item_size:
        return self.numbers(item, count, f"{what} ({count:,} {item_name} values)")
      if item == _ARRAY and depth >= _MAX_ARRAY_NESTING:
        self.fail(f"{what} nests arrays more than {_MAX_ARRAY_NESTING} deep")
      least = count * (8 if item == _STRING else 12)  # each one's length (and item type)
      if least > len(self.data) - self.offset:
        self.fail(f"{what} holds {count:,} {item_name} values, which need at least "
                  f"{least:,} bytes, but {len(self.data) - self.offset:,} bytes are left "
                  "(truncated or malformed)")
      values = [self.value(item, f"{what}[{i}]", depth + 1) for i in range(count)]
      return values if self.keep else None

  def walk(self) -> None:
    import gguf  # pylint: disable=g-import-not-at-top

    magic = bytes(self.data[self.take(4, "the magic number b'GGUF'"):4])
    if magic != b"GGUF":
      self.fail(f"starts with {magic!r}; expected b'GGUF' (not a GGUF file)")
    version = self.uint(4, "the version")
    if not version & 0xFFFF:  # written on a machine of the other byte order (as gguf reads it)
      self.order, version = ">", int.from_bytes(version.to_bytes(4, "little"), "big")
    if version not in _READABLE_VERSIONS:
      self.fail(f"GGUF version {version}; expected one of {_READABLE_VERSIONS}")
    tensor_count = self.uint(8, "the tensor count")
    key_count = self.uint(8, "the metadata key count")
    keys, alignment = set(), gguf.GGUF_DEFAULT_ALIGNMENT
    for i in range(key_count):
      key = self.string(f"the name of metadata key #{i} (of {key_count:,})")
      if key in keys:
        self.fail(f"metadata key {key!r} appears twice")
      keys.add(key)
      vtype = self.uint(4, f"the value type of metadata key {key!r}")
      start = self.offset
      value = self.value(vtype, f"metadata key {key!r}")
      if self.keep:
        self.metadata[key] = value
      if key == "general.alignment":
        if vtype != _UINT32:
          self.fail(f"metadata key 'general.alignment' has value type {vtype}; expected "
                    f"{_UINT32} (UINT32)")
        alignment = struct.unpack_from(self.order + "I", self.data, start)[0]
        if not alignment or alignment & (alignment - 1):
          self.fail(f"metadata key 'general.alignment' is {alignment}; expected a power of two")
    tensors = {}
    for i in range(tensor_count):
      name = self.string(f"the name of tensor #{i} (of {tensor_count:,})")
      what = f"tensor {name!r}"
      if not name:
        self.fail(f"tensor #{i} (of {tensor_count:,}) has an empty name")
      if name in tensors:
        self.fail(f"{what} appears twice")
      n_dims = self.uint(4, f"the dimension count of {what}")
      if not 1 <= n_dims <= _MAX_DIMS:
        self.fail(f"{what} has {n_dims:,} dimensions; expected 1 to {_MAX_DIMS}")
      dims = [self.uint(8, f"dimension {d} of {what}") for d in range(n_dims)]
      type_id = self.uint(4, f"the type of {what}")
      try:
        qtype = gguf.GGMLQuantizationType(type_id)
      except ValueError:
        self.fail(f"{what} has type id {type_id}; expected a GGML type (e.g. 0 = F32, "
                  "1 = F16, 8 = Q8_0)")
      tensors[name] = (dims, qtype, self.uint(8, f"the data offset of {what}"))
    data_start = -(-self.offset // alignment) * alignment
    for name, (dims, qtype, offset) in tensors.items():
      shape = tuple(reversed(dims))  # GGUF lists the fastest axis first
      block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
      if dims[0] % block:
        self.fail(f"tensor {name!r} {list(shape)}: row length {dims[0]:,} is not a multiple of "
                  f"the {qtype.name} block size {block}")
      start = data_start + offset
      end = start + math.prod(dims) // block * block_bytes
      if end > len(self.data):
        self.fail(f"tensor {name!r} ({qtype.name} {list(shape)}) needs bytes [{start:,}, "
                  f"{end:,}) but the file has {len(self.data):,} bytes (truncated or malformed)")
      if self.keep:
        raw = np.asarray(self.data[start:end])
        if qtype.name in ("F32", "F16"):
          typed = raw.view(np.dtype("float32" if qtype.name == "F32" else "float16")
                           .newbyteorder(self.order)).reshape(shape)
        else:
          typed = raw.reshape(shape[:-1] + (shape[-1] // block * block_bytes,))
        self.infos[name] = TensorInfo(name=name, tensor_type=qtype, shape=tuple(dims),
                                      data_offset=start, n_bytes=end - start, data=typed)
