"""kvattn.checkpoints.gguf: dequantization by hand, Q/K un-permutation, tiny GGUF files, bad files."""

from __future__ import annotations

import pathlib
import re
import struct

import gguf
import numpy as np
import pytest

from kvattn.checkpoints import gguf as gguf_lib

Q = gguf.GGMLQuantizationType


def _close(w):
  """Writes a `gguf.GGUFWriter`'s header, metadata and tensors, and closes it."""
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()

def _f16_bytes(x: float) -> np.ndarray:
  return np.frombuffer(np.float16(x).tobytes(), np.uint8)


# ------------------------------------------------------------------------------------------------
# Dequantization of hand-built blocks (one block = 32 values).


def test_q4_1_block_by_hand():
  # Q4_1: f16 scale d, f16 min m, 16 bytes of nibbles; value = d * q + m. The low nibbles are
  # values 0..15, the high nibbles values 16..31. 0xF0: low 0 -> 1.0, high 15 -> 0.5 * 15 + 1.
  block = np.concatenate([_f16_bytes(0.5), _f16_bytes(1.0), np.full(16, 0xF0, np.uint8)])
  out = gguf_lib.dequantize(block[None], "Q4_1", (1, 32))
  np.testing.assert_array_equal(out, [[1.0] * 16 + [8.5] * 16])
  assert out.dtype == np.float32


def test_q4_0_block_by_hand():
  # Q4_0: f16 scale d, 16 bytes of nibbles; value = d * (q - 8). 0x3A: low 10 -> 0.25 * 2,
  # high 3 -> 0.25 * -5.
  block = np.concatenate([_f16_bytes(0.25), np.full(16, 0x3A, np.uint8)])
  out = gguf_lib.dequantize(block[None], "Q4_0", (1, 32))
  np.testing.assert_array_equal(out, [[0.5] * 16 + [-1.25] * 16])


def test_q8_0_two_blocks_by_hand():
  # Q8_0: f16 scale d, 32 int8; value = d * q. Two blocks of one row, different scales.
  q = np.arange(-16, 16, dtype=np.int8)
  row = np.concatenate([_f16_bytes(0.5), q.view(np.uint8), _f16_bytes(-2.0), q.view(np.uint8)])
  out = gguf_lib.dequantize(row[None], "Q8_0", (1, 64))
  expected = np.concatenate([0.5 * np.arange(-16, 16), -2.0 * np.arange(-16, 16)])
  np.testing.assert_array_equal(out[0], expected)


def test_q5_0_block_by_hand():
  # Q5_0 (Gemma 3 270M's projections): f16 scale d, 4 bytes qh (the fifth bit of value j is bit
  # j), 16 bytes of nibbles; value = d * (q - 16). 0x31 with every fifth bit set: low 1 | 16,
  # high 3 | 16.
  nibbles = np.full(16, 0x31, np.uint8)
  block = np.concatenate([_f16_bytes(0.5), np.full(4, 0xFF, np.uint8), nibbles])
  out = gguf_lib.dequantize(block[None], "Q5_0", (1, 32))
  np.testing.assert_array_equal(out, [[0.5] * 16 + [1.5] * 16])
  qh = np.frombuffer(np.uint32(0x0000FFFF).tobytes(), np.uint8)  # fifth bits of the low half only
  block = np.concatenate([_f16_bytes(0.5), qh, nibbles])
  out = gguf_lib.dequantize(block[None], "Q5_0", (1, 32))
  np.testing.assert_array_equal(out, [[0.5] * 16 + [-6.5] * 16])


def test_float_types_are_exact():
  x = np.array([[1.5, -2.25, 3.0e-3, 65504.0]], np.float32)
  np.testing.assert_array_equal(gguf_lib.dequantize(x, "F32", (1, 4)), x)
  np.testing.assert_array_equal(gguf_lib.dequantize(x.astype(np.float16), "F16", (1, 4)),
                                x.astype(np.float16).astype(np.float32))
  # bf16 = the high 16 bits of the f32; these values are exact in bf16.
  y = np.array([[1.5, -2.25, 0.0078125, 256.0]], np.float32)
  bf16 = (y.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
  np.testing.assert_array_equal(gguf_lib.dequantize(bf16, "BF16", (1, 4)), y)


# K-quants: 256 values per block in 8 sub-blocks of 32. Q4_K/Q5_K: f16 d, f16 dmin, 12 bytes of
# 6-bit sub-block scales and mins (sub-block j < 4: scale = byte j & 63, min = byte j + 4 & 63;
# j >= 4: low / high nibble of byte j + 4), then the quants; value = d * scale * q - dmin * min.
_K_SCALES = np.array([1, 1, 1, 1, 2, 2, 2, 2, 0x21, 0x21, 0x21, 0x21], np.uint8)  # scale 1, min 2


def test_q4_k_block_by_hand():
  # 128 bytes of nibbles, 32 bytes per pair of sub-blocks: low nibbles first, then high ones.
  # 0x21: low 1 -> 0.5 * 1 - 2, high 2 -> 0.5 * 2 - 2.
  block = np.concatenate([_f16_bytes(0.5), _f16_bytes(1.0), _K_SCALES,
                          np.full(128, 0x21, np.uint8)])
  out = gguf_lib.dequantize(block[None], "Q4_K", (1, 256))
  np.testing.assert_array_equal(out[0], np.tile([-1.5] * 32 + [-1.0] * 32, 4))


def test_q5_k_block_by_hand():
  # Q5_K adds a fifth bit per value (32 bytes qh before the nibbles). All fifth bits set and
  # nibbles 0 -> q = 16 -> 0.5 * 16 - 2.
  block = np.concatenate([_f16_bytes(0.5), _f16_bytes(1.0), _K_SCALES,
                          np.full(32, 0xFF, np.uint8), np.zeros(128, np.uint8)])
  out = gguf_lib.dequantize(block[None], "Q5_K", (1, 256))
  np.testing.assert_array_equal(out[0], np.full(256, 6.0))


@pytest.mark.parametrize("fill,expected", [(0x00, -8.0), (0xFF, 7.75)])
def test_q6_k_block_by_hand(fill, expected):
  # Q6_K: 128 bytes low nibbles, 64 bytes of 2-bit highs, 16 int8 scales, f16 d;
  # value = d * scale * (q - 32). q = 0 or 63, scales 1, d = 0.25.
  block = np.concatenate([np.full(192, fill, np.uint8), np.ones(16, np.uint8),
                          _f16_bytes(0.25)])
  out = gguf_lib.dequantize(block[None], "Q6_K", (1, 256))
  np.testing.assert_array_equal(out[0], np.full(256, expected))


def test_unsupported_type_names_it():
  with pytest.raises(NotImplementedError, match="Q2_K"):
    gguf_lib.dequantize(np.zeros((1, 84), np.uint8), "Q2_K", (1, 256))


def test_dequantize_checks_the_element_count():
  with pytest.raises(ValueError, match="my tensor: 32 values for shape"):
    gguf_lib.dequantize(np.zeros((1, 20), np.uint8), "Q4_1", (1, 64), where="my tensor")


# ------------------------------------------------------------------------------------------------
# llama.cpp's row permutation of Q and K.


def _llama_cpp_permute(w: np.ndarray, num_heads: int) -> np.ndarray:
  # convert_hf_to_gguf.py: reshape(n_head, 2, rows // n_head // 2, ...).swapaxes(1, 2).
  return w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:]).swapaxes(
      1, 2).reshape(w.shape)


def test_unpermute_numbered_gqa_rows():
  # K projection of a GQA layer: K = 2 KV heads of H = 4 (N = 6 query heads elsewhere).
  # llama.cpp stores each head's rows interleaved: HF rows (0, 1 | 2, 3) become (0, 2, 1, 3).
  hf = np.arange(8, dtype=np.float32)[:, None] * np.ones((1, 3), np.float32)
  stored = hf[[0, 2, 1, 3, 4, 6, 5, 7]]
  np.testing.assert_array_equal(gguf_lib.unpermute_rope_rows(stored, 2), hf)
  # With the query head count (the classic GQA bug) the rows come out wrong.
  with pytest.raises(ValueError, match="cannot be 6 heads"):
    gguf_lib.unpermute_rope_rows(stored, 6)
  assert not np.array_equal(gguf_lib.unpermute_rope_rows(stored, 1), hf)


@pytest.mark.parametrize("num_heads,head_dim", [(1, 2), (3, 64), (9, 64)])
def test_unpermute_round_trips_llama_cpp_permute(num_heads, head_dim):
  rng = np.random.default_rng(num_heads)
  w = rng.normal(size=(num_heads * head_dim, 5)).astype(np.float32)
  np.testing.assert_array_equal(
      gguf_lib.unpermute_rope_rows(_llama_cpp_permute(w, num_heads), num_heads), w)
  b = rng.normal(size=(num_heads * head_dim,)).astype(np.float32)  # a bias (qwen2-style)
  np.testing.assert_array_equal(
      gguf_lib.unpermute_rope_rows(_llama_cpp_permute(b, num_heads), num_heads), b)


# ------------------------------------------------------------------------------------------------
# Tiny GGUF files written with gguf.GGUFWriter.

D, N, K, H, F, L, V = 32, 4, 2, 8, 64, 2, 6


def _hf_tensors(seed: int = 0, *, untied: bool = False) -> dict[str, np.ndarray]:
  rng = np.random.default_rng(seed)
  t = {"model.embed_tokens.weight": rng.normal(size=(V, D)),
       "model.norm.weight": rng.normal(size=(D,))}
  if untied:
    t["lm_head.weight"] = rng.normal(size=(V, D))
  for i in range(L):
    p = f"model.layers.{i}."
    t[p + "input_layernorm.weight"] = rng.normal(size=(D,))
    t[p + "post_attention_layernorm.weight"] = rng.normal(size=(D,))
    t[p + "self_attn.q_proj.weight"] = rng.normal(size=(N * H, D))
    t[p + "self_attn.k_proj.weight"] = rng.normal(size=(K * H, D))
    t[p + "self_attn.v_proj.weight"] = rng.normal(size=(K * H, D))
    t[p + "self_attn.o_proj.weight"] = rng.normal(size=(D, N * H))
    t[p + "mlp.gate_proj.weight"] = rng.normal(size=(F, D))
    t[p + "mlp.up_proj.weight"] = rng.normal(size=(F, D))
    t[p + "mlp.down_proj.weight"] = rng.normal(size=(D, F))
  return {k: v.astype(np.float32) for k, v in t.items()}


_TO_GGUF = {"model.embed_tokens.weight": "token_embd.weight",
            "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}
_LAYER_TO_GGUF = {"input_layernorm.weight": "attn_norm.weight",
                  "post_attention_layernorm.weight": "ffn_norm.weight",
                  "self_attn.q_proj.weight": "attn_q.weight",
                  "self_attn.k_proj.weight": "attn_k.weight",
                  "self_attn.v_proj.weight": "attn_v.weight",
                  "self_attn.o_proj.weight": "attn_output.weight",
                  "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
                  "mlp.down_proj.weight": "ffn_down.weight"}


def _gguf_name(hf: str) -> str:
  if hf in _TO_GGUF:
    return _TO_GGUF[hf]
  _, _, layer, rest = hf.split(".", 3)
  return f"blk.{layer}.{_LAYER_TO_GGUF[rest]}"


def write_tiny_gguf(path: pathlib.Path, tensors: dict[str, np.ndarray], *, arch: str = "llama",
                    q8_names: tuple[str, ...] = (), extra: dict[str, tuple] | None = None,
                    extra_tensors: dict[str, np.ndarray] | None = None,
                    tokenizer: bool = True) -> pathlib.Path:
  """Writes HF-named `tensors` as llama.cpp would (Q/K rows permuted, GGUF names)."""
  w = gguf.GGUFWriter(str(path), arch)
  w.add_block_count(L)
  w.add_context_length(128)
  w.add_embedding_length(D)
  w.add_feed_forward_length(F)
  w.add_head_count(N)
  w.add_head_count_kv(K)
  w.add_rope_freq_base(5000.0)
  w.add_layer_norm_rms_eps(1e-5)
  w.add_rope_dimension_count(H)
  w.add_vocab_size(V)
  for key, (value, vtype) in (extra or {}).items():
    w.add_key_value(key, value, vtype)
  if tokenizer:
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(["<|end|>", "a", "b", "ab", "\u0120", "\u0120ab"])
    w.add_token_types([3, 1, 1, 1, 1, 1])
    w.add_token_merges(["a b", "\u0120 ab"])
    w.add_bos_token_id(0)
    w.add_eos_token_id(0)
    w.add_chat_template("{% for m in messages %}{{ m['content'] }}<|end|>{% endfor %}")
  for name, array in tensors.items():
    if name.endswith(("q_proj.weight", "k_proj.weight")):
      array = _llama_cpp_permute(array, N if "q_proj" in name else K)
    gname = _gguf_name(name)
    if gname in q8_names:
      w.add_tensor(gname, gguf.quants.quantize(array, Q.Q8_0), raw_dtype=Q.Q8_0)
    else:
      w.add_tensor(gname, array)
  for gname, array in (extra_tensors or {}).items():
    w.add_tensor(gname, array)
  _close(w)
  return path


def test_tiny_llama_gguf_loads(tmp_path):
  tensors = _hf_tensors()
  q8 = ("blk.0.attn_k.weight", "blk.1.ffn_up.weight")
  path = write_tiny_gguf(tmp_path / "tiny.gguf", tensors, q8_names=q8)
  ck = gguf_lib.load_gguf(path)
  assert ck.path == path
  assert ck.config == {
      "model_type": "llama", "hidden_size": D, "num_attention_heads": N,
      "num_key_value_heads": K, "head_dim": H, "intermediate_size": F,
      "num_hidden_layers": L, "rms_norm_eps": pytest.approx(1e-5), "rope_theta": 5000.0,
      "vocab_size": V, "tie_word_embeddings": True, "max_position_embeddings": 128}
  assert set(ck.tensors) == set(tensors)  # no lm_head: the file has no output.weight
  for name, expected in tensors.items():
    got = ck.tensors[name]
    assert got.dtype == np.float32 and got.shape == expected.shape, name
    if _gguf_name(name) in q8:  # Q8_0: half a step (absmax / 127) + the step's f16 rounding.
      step = np.abs(expected).max(axis=-1, keepdims=True) / 127
      assert np.all(np.abs(got - expected) <= 0.6 * step), name
    else:
      np.testing.assert_array_equal(got, expected, err_msg=name)
  tok = ck.tokenizer
  assert tok.bos_id == 0 and tok.eos_id == 0 and tok.source == str(path)  # named by its errors
  assert tok.encode("ab ab<|end|>") == [3, 5, 0]
  assert tok.apply_chat_template([{"role": "user", "content": "ab"}]) == "ab<|end|>"


def test_untied_head_and_no_tokenizer(tmp_path):
  tensors = _hf_tensors(1, untied=True)
  ck = gguf_lib.load_gguf(write_tiny_gguf(tmp_path / "t.gguf", tensors, tokenizer=False))
  assert ck.config["tie_word_embeddings"] is False
  np.testing.assert_array_equal(ck.tensors["lm_head.weight"], tensors["lm_head.weight"])
  assert ck.tokenizer is None


def test_unsupported_tokenizer_warns_and_loads(tmp_path):
  extra = {"tokenizer.ggml.model": ("llama", gguf.GGUFValueType.STRING)}
  path = write_tiny_gguf(tmp_path / "sp.gguf", _hf_tensors(), tokenizer=False, extra=extra)
  with pytest.warns(UserWarning, match=r"sp.gguf: no tokenizer.*tokenizer.ggml.model='llama'"):
    ck = gguf_lib.load_gguf(path)
  assert ck.tokenizer is None and len(ck.tensors) == len(_hf_tensors())


def test_qwen2_rows_are_not_permuted(tmp_path):
  # llama.cpp permutes Q/K only for the llama architecture: a qwen2 file stores HF order.
  tensors = _hf_tensors(2)
  path = tmp_path / "q.gguf"
  w = gguf.GGUFWriter(str(path), "qwen2")
  for key, value in [("block_count", L), ("context_length", 64), ("embedding_length", D),
                     ("feed_forward_length", F), ("attention.head_count", N),
                     ("attention.head_count_kv", K)]:
    w.add_uint32(f"qwen2.{key}", value)
  w.add_float32("qwen2.attention.layer_norm_rms_epsilon", 1e-6)
  for name, array in tensors.items():
    w.add_tensor(_gguf_name(name), array)
  w.add_tensor("blk.0.attn_q.bias", np.arange(N * H, dtype=np.float32))
  _close(w)
  ck = gguf_lib.load_gguf(path)
  assert ck.config["model_type"] == "qwen2" and ck.config["rope_theta"] == 10000.0
  assert ck.config["vocab_size"] == V  # no qwen2.vocab_size key: the embedding's rows
  np.testing.assert_array_equal(ck.tensors["model.layers.0.self_attn.q_proj.weight"],
                                tensors["model.layers.0.self_attn.q_proj.weight"])
  np.testing.assert_array_equal(ck.tensors["model.layers.0.self_attn.q_proj.bias"],
                                np.arange(N * H))


def test_linear_rope_scaling_and_window(tmp_path):
  extra = {"llama.rope.scaling.type": ("linear", gguf.GGUFValueType.STRING),
           "llama.rope.scaling.factor": (4.0, gguf.GGUFValueType.FLOAT32),
           "llama.attention.sliding_window": (16, gguf.GGUFValueType.UINT32)}
  ck = gguf_lib.load_gguf(write_tiny_gguf(tmp_path / "t.gguf", _hf_tensors(), extra=extra))
  assert ck.config["rope_scaling"] == {"rope_type": "linear", "factor": 4.0}
  assert ck.config["sliding_window"] == 16


# ------------------------------------------------------------------------------------------------
# Bad files: clear errors naming the file / tensor / key.


def test_missing_file(tmp_path):
  with pytest.raises(FileNotFoundError, match="nope.gguf"):
    gguf_lib.load_gguf(tmp_path / "nope.gguf")


@pytest.mark.parametrize("keep", [0, 10, 200, -100, -1])
def test_truncated_file(tmp_path, keep):
  good = write_tiny_gguf(tmp_path / "good.gguf", _hf_tensors())
  data = good.read_bytes()
  bad = tmp_path / "cut.gguf"
  bad.write_bytes(data[:keep] if keep >= 0 else data[:len(data) + keep])
  with pytest.raises(ValueError, match="cut.gguf"):
    gguf_lib.load_gguf(bad)


def test_not_a_gguf(tmp_path):
  bad = tmp_path / "text.gguf"
  bad.write_text("hello, I am not a GGUF file at all" * 10)
  with pytest.raises(ValueError, match=r"text.gguf: starts with b'hell'; expected b'GGUF' "
                                       r"\(not a GGUF file\)"):
    gguf_lib.load_gguf(bad)


def test_tensor_past_the_end_names_it(tmp_path, monkeypatch):
  # A header whose offsets point past the end: the extent check fires before any read.
  path = write_tiny_gguf(tmp_path / "t.gguf", _hf_tensors())
  reader = gguf.GGUFReader(path)
  info = next(t for t in reader.tensors if t.name == "blk.1.ffn_down.weight")
  with pytest.raises(ValueError, match=r"'blk.1.ffn_down.weight'.*truncated or malformed"):
    gguf_lib._read_tensor(info, int(info.data_offset) + 10, where="t.gguf: tensor "
                          "'blk.1.ffn_down.weight'")


def test_unsupported_architecture_names_key(tmp_path):
  path = write_tiny_gguf(tmp_path / "falcon.gguf", _hf_tensors(), arch="falcon")
  with pytest.raises(NotImplementedError, match=r"falcon.gguf.*general.architecture='falcon'"):
    gguf_lib.load_gguf(path)


def test_mixture_of_experts_names_key(tmp_path):
  extra = {"llama.expert_count": (8, gguf.GGUFValueType.UINT32)}
  path = write_tiny_gguf(tmp_path / "moe.gguf", _hf_tensors(), extra=extra)
  with pytest.raises(NotImplementedError, match="llama.expert_count=8"):
    gguf_lib.load_gguf(path)


def test_unknown_rope_scaling_names_key(tmp_path):
  extra = {"llama.rope.scaling.type": ("yarn", gguf.GGUFValueType.STRING)}
  path = write_tiny_gguf(tmp_path / "y.gguf", _hf_tensors(), extra=extra)
  with pytest.raises(NotImplementedError, match="llama.rope.scaling.type='yarn'"):
    gguf_lib.load_gguf(path)


def test_unknown_tensor_names_it(tmp_path):
  path = write_tiny_gguf(tmp_path / "x.gguf", _hf_tensors(),
                         extra_tensors={"blk.0.attn_q_norm.weight": np.ones(H, np.float32)})
  with pytest.raises(NotImplementedError, match="'blk.0.attn_q_norm.weight'"):
    gguf_lib.load_gguf(path)


def test_missing_key_names_it(tmp_path):
  path = tmp_path / "nokey.gguf"
  w = gguf.GGUFWriter(str(path), "llama")
  w.add_block_count(1)
  w.add_tensor("output_norm.weight", np.ones(4, np.float32))
  _close(w)
  with pytest.raises(ValueError, match="nokey.gguf: metadata key llama.embedding_length"):
    gguf_lib.load_gguf(path)


# ------------------------------------------------------------------------------------------------
# Crafted headers: the error names the file, the metadata key or tensor and what was expected,
# never the gguf package's own words ("index 0 is out of bounds for axis 0 with size 0").


def _corrupt(good: pathlib.Path, kind: str) -> bytes:
  """The bytes of `good` with one header field overwritten (offsets found by gguf's reader)."""
  data = bytearray(good.read_bytes())
  reader = gguf.GGUFReader(good)

  def key_offset(key):  # offset of key's length, of its value type, of its value
    field = reader.fields[key]
    value_type = field.offset + 8 + len(key)
    return field.offset, value_type, value_type + 4

  def tensor_offset(name):  # offset of the name's length, of n_dims, of the dims
    field = next(t for t in reader.tensors if t.name == name).field
    n_dims = field.offset + 8 + len(name)
    return field.offset, n_dims, n_dims + 4

  def put(offset, fmt, value):
    data[offset:offset + struct.calcsize(fmt)] = struct.pack(fmt, value)

  if kind == "key count":
    put(16, "<Q", 2**40)
  elif kind == "key name length":
    put(key_offset("llama.context_length")[0], "<Q", 2**50)
  elif kind == "key name not UTF-8":
    data[key_offset("llama.context_length")[0] + 8] = 0xFF
  elif kind == "value type":
    put(key_offset("llama.context_length")[1], "<I", 99)
  elif kind == "string length":
    put(key_offset("tokenizer.chat_template")[2], "<Q", 2**50)
  elif kind == "array length":
    put(key_offset("tokenizer.ggml.tokens")[2] + 4, "<Q", 2**40)
  elif kind == "array item type":
    put(key_offset("tokenizer.ggml.tokens")[2], "<I", 77)
  elif kind == "duplicate key":  # a key renamed to an earlier one of the same length
    offset = key_offset("llama.context_length")[0] + 8
    data[offset:offset + len("general.architecture")] = b"general.architecture"
  elif kind == "tensor count":
    put(8, "<Q", 2**40)
  elif kind == "tensor dimension count":
    put(tensor_offset("blk.0.attn_q.weight")[1], "<I", 2**31)
  elif kind == "tensor dimension":
    put(tensor_offset("blk.0.attn_q.weight")[2], "<Q", 2**62)
  elif kind == "tensor type":
    put(tensor_offset("blk.0.attn_q.weight")[2] + 16, "<I", 99)
  elif kind == "tensor offset":
    put(tensor_offset("blk.0.attn_q.weight")[2] + 20, "<Q", 2**40)
  elif kind == "duplicate tensor":
    offset = tensor_offset("blk.0.attn_k.weight")[0] + 8
    data[offset:offset + len("blk.0.attn_v.weight")] = b"blk.0.attn_v.weight"
  elif kind == "version":
    put(4, "<I", 99)
  return bytes(data)


@pytest.mark.parametrize("kind, match", [
    ("version", r"GGUF version 99; expected one of \(2, 3\)"),
    ("key count", r"the name of metadata key #\d+ \(of 1,099,511,627,776\), [\d,]+ bytes, "
                  r"needs bytes"),
    ("key name length", r"the name of metadata key #\d+ \(of \d+\), 1,125,899,906,842,624 "
                        r"bytes, needs bytes \[[\d,]+, [\d,]+\) but the file ends at byte"),
    ("key name not UTF-8", r"the name of metadata key #\d+ \(of \d+\) is not UTF-8 text"),
    ("value type", r"metadata key 'llama.context_length' has value type 99; expected a GGUF value "
                   r"type \(0 to 12\)"),
    ("string length", r"metadata key 'tokenizer.chat_template', 1,125,899,906,842,624 bytes, "
                      r"needs bytes"),
    ("array length", r"metadata key 'tokenizer.ggml.tokens' holds 1,099,511,627,776 STRING "
                     r"values, which need at least"),
    ("array item type", r"metadata key 'tokenizer.ggml.tokens' is an array of value type 77"),
    ("duplicate key", r"metadata key 'general.architecture' appears twice"),
    ("tensor count", r"tensor #20 \(of 1,099,511,627,776\) has an empty name"),
    ("tensor dimension count", r"tensor 'blk.0.attn_q.weight' has 2,147,483,648 dimensions; "
                               r"expected 1 to 4"),
    ("tensor dimension", r"tensor 'blk.0.attn_q.weight' \(F32 \[32, 4611686018427387904\]\) "
                         r"needs bytes \[[\d,]+, [\d,]+\) but the file has [\d,]+ bytes"),
    ("tensor type", r"tensor 'blk.0.attn_q.weight' has type id 99; expected a GGML type"),
    ("tensor offset", r"tensor 'blk.0.attn_q.weight' \(F32 \[32, 32\]\) needs bytes "
                      r"\[1,099,511,"),
    ("duplicate tensor", r"tensor 'blk.0.attn_v.weight' appears twice"),
])
def test_crafted_header_names_the_file_and_the_field(tmp_path, kind, match):
  good = write_tiny_gguf(tmp_path / "good.gguf", _hf_tensors())
  bad = tmp_path / "crafted.gguf"
  bad.write_bytes(_corrupt(good, kind))
  with pytest.raises(ValueError, match=rf"^{re.escape(str(bad))}: {match}"):
    gguf_lib.load_gguf(bad)


def test_every_truncation_names_the_file_and_what_it_cut(tmp_path):
  # Every cut inside the header and at a few points in the tensor data: the field (or tensor)
  # whose bytes are missing is named, never numpy's words.
  good = write_tiny_gguf(tmp_path / "good.gguf", _hf_tensors())
  data = good.read_bytes()
  header_end = gguf.GGUFReader(good).data_offset
  bad = tmp_path / "cut.gguf"
  for keep in [*range(1, header_end + 1), len(data) - 4096, len(data) - 1]:
    bad.write_bytes(data[:keep])
    with pytest.raises(ValueError) as info:
      gguf_lib.load_gguf(bad)
    message = str(info.value)
    assert message.startswith(f"{bad}: "), (keep, message)
    assert re.search(r"needs bytes \[[\d,]+, [\d,]+\) but the file (ends at byte|has) "
                     rf"{keep:,}( bytes)?|values, which need at least [\d,]+ bytes, but [\d,]+ "
                     r"bytes are left", message), (keep, message)
    assert re.search(r"metadata key|tensor|magic|version|count", message), (keep, message)


def test_tensor_shape_names_the_tensor_and_the_metadata_keys(tmp_path):
  tensors = _hf_tensors()
  tensors["model.layers.1.self_attn.k_proj.weight"] = np.zeros((3 * H, D), np.float32)
  path = write_tiny_gguf(tmp_path / "shape.gguf", {
      k: v for k, v in tensors.items() if k != "model.layers.1.self_attn.k_proj.weight"},
      extra_tensors={"blk.1.attn_k.weight": tensors["model.layers.1.self_attn.k_proj.weight"]})
  with pytest.raises(ValueError, match=r"shape.gguf: tensor 'blk.1.attn_k.weight' has shape "
                                       r"\[24, 32\]; expected \[16, 32\] = "
                                       r"\[llama.attention.head_count_kv x head dim "
                                       r"\(llama.attention.key_length\), llama.embedding_length\]"):
    gguf_lib.load_gguf(path)


def test_missing_tensor_is_named_in_the_files_names(tmp_path):
  path = write_tiny_gguf(tmp_path / "gap.gguf", {
      k: v for k, v in _hf_tensors().items() if k != "model.layers.1.mlp.down_proj.weight"})
  with pytest.raises(ValueError, match=r"gap.gguf: tensor 'blk.1.ffn_down.weight' is missing "
                                       r"\(a llama file needs token_embd, output_norm"):
    gguf_lib.load_gguf(path)


def test_llama_attention_bias_is_named(tmp_path):
  path = write_tiny_gguf(tmp_path / "bias.gguf", _hf_tensors(),
                         extra_tensors={"blk.0.attn_q.bias": np.zeros(N * H, np.float32)})
  with pytest.raises(NotImplementedError, match=r"bias.gguf: tensor 'blk.0.attn_q.bias': "
                                                r"attention biases in a llama file"):
    gguf_lib.load_gguf(path)


@pytest.mark.parametrize("extra, match", [
    ({"llama.attention.key_length": (7, gguf.GGUFValueType.UINT32)},
     r"the head dim \(llama.attention.key_length, else llama.embedding_length / "
     r"llama.attention.head_count\) must be even \(RoPE rotates pairs\); got 7"),
    ({"llama.attention.layer_norm_rms_epsilon": (float("inf"), gguf.GGUFValueType.FLOAT32)},
     r"llama.attention.layer_norm_rms_epsilon must be a positive finite number; got inf"),
])
def test_bad_metadata_value_names_the_key(tmp_path, extra, match):
  path = tmp_path / "md.gguf"
  w = gguf.GGUFWriter(str(path), "llama")
  for key, value in [("block_count", L), ("context_length", 64), ("embedding_length", D),
                     ("feed_forward_length", F), ("attention.head_count", N),
                     ("vocab_size", V)]:
    w.add_uint32(f"llama.{key}", value)
  extra = {"llama.attention.layer_norm_rms_epsilon": (1e-5, gguf.GGUFValueType.FLOAT32), **extra}
  for key, (value, vtype) in extra.items():
    w.add_key_value(key, value, vtype)
  w.add_tensor("output_norm.weight", np.ones(D, np.float32))
  _close(w)
  with pytest.raises(ValueError, match=rf"md.gguf: {match}"):
    gguf_lib.load_gguf(path)


def test_from_pretrained_reports_a_bad_file_in_its_own_names(tmp_path):
  # End to end: a GGUF error names GGUF tensors and keys, never the HF names build_model uses.
  import kvattn  # pylint: disable=g-import-not-at-top
  tensors = _hf_tensors()
  path = write_tiny_gguf(tmp_path / "v.gguf", {
      k: v for k, v in tensors.items() if k != "model.layers.0.self_attn.v_proj.weight"},
      extra_tensors={"blk.0.attn_v.weight": np.zeros((K * H, D + 1), np.float32)})
  with pytest.raises(ValueError, match=r"v.gguf: tensor 'blk.0.attn_v.weight' has shape "
                                       r"\[16, 33\]; expected \[16, 32\]") as info:
    kvattn.from_pretrained(path)
  assert "model.layers" not in str(info.value)


# ------------------------------------------------------------------------------------------------
# gemma3 and qwen3 files: the tiny transformers checkpoints of tests/fixtures/hf written as
# llama.cpp writes them, loaded to the same model as the safetensors checkpoint.

_FIXTURES = pathlib.Path(__file__).resolve().parents[2] / "fixtures" / "hf"
_GEMMA3_NAMES = {"input_layernorm.weight": "attn_norm.weight",
                 "post_attention_layernorm.weight": "post_attention_norm.weight",
                 "pre_feedforward_layernorm.weight": "ffn_norm.weight",
                 "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
                 "self_attn.q_norm.weight": "attn_q_norm.weight",
                 "self_attn.k_norm.weight": "attn_k_norm.weight"}


def _write_fixture_gguf(path: pathlib.Path, name: str, arch: str) -> pathlib.Path:
  import json  # pylint: disable=g-import-not-at-top
  from kvattn.checkpoints import pretrained  # pylint: disable=g-import-not-at-top
  config = json.loads((_FIXTURES / name / "config.json").read_text())
  tensors = pretrained.SafetensorsCheckpoint(_FIXTURES / name)
  w = gguf.GGUFWriter(str(path), arch)
  w.add_block_count(config["num_hidden_layers"])
  w.add_context_length(config["max_position_embeddings"])
  w.add_embedding_length(config["hidden_size"])
  w.add_feed_forward_length(config["intermediate_size"])
  w.add_head_count(config["num_attention_heads"])
  w.add_head_count_kv(config["num_key_value_heads"])
  w.add_key_length(config["head_dim"])
  w.add_value_length(config["head_dim"])
  w.add_layer_norm_rms_eps(config["rms_norm_eps"])
  w.add_vocab_size(config["vocab_size"])
  rope = config["rope_parameters"]
  if arch == "gemma3":
    w.add_rope_freq_base(rope["full_attention"]["rope_theta"])
    w.add_key_value("gemma3.rope.freq_base_swa", rope["sliding_attention"]["rope_theta"],
                    gguf.GGUFValueType.FLOAT32)
    w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
    w.add_rope_scaling_factor(rope["full_attention"]["factor"])
    w.add_sliding_window(config["sliding_window"])
    w.add_key_value("gemma3.attention.sliding_window_pattern",
                    [t == "sliding_attention" for t in config["layer_types"]],
                    gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType.BOOL)
  else:
    w.add_rope_freq_base(rope["rope_theta"])
  for hf in tensors:
    array = np.asarray(tensors[hf].astype("float32"))
    if hf in _TO_GGUF:
      gname = _TO_GGUF[hf]
    else:
      _, _, layer, rest = hf.split(".", 3)
      names = {**_LAYER_TO_GGUF, **_GEMMA3_NAMES} if arch == "gemma3" else \
          {**_GEMMA3_NAMES, **_LAYER_TO_GGUF}  # Gemma: ffn_norm is the pre-MLP norm
      gname = f"blk.{layer}.{names[rest]}"
    if arch == "gemma3" and gname.endswith("norm.weight"):
      array = array + 1.0  # llama.cpp's Gemma converter stores 1 + w
    w.add_tensor(gname, array)
  _close(w)
  return path


@pytest.mark.parametrize("name, arch", [
    ("gemma3", "gemma3"),
    pytest.param("qwen3", "qwen3", marks=pytest.mark.slow),  # gemma3's names and norms cover more
])
def test_gemma3_and_qwen3_files_load_the_safetensors_model(tmp_path, name, arch):
  import dataclasses  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  from flax import nnx  # pylint: disable=g-import-not-at-top
  import kvattn  # pylint: disable=g-import-not-at-top
  path = _write_fixture_gguf(tmp_path / f"{name}.gguf", name, arch)
  ours, tok = kvattn.from_pretrained(path)
  want, _ = kvattn.from_pretrained(_FIXTURES / name)
  assert tok is None
  expected = want.spec
  if arch == "gemma3":  # llama.cpp's Gemma 3 query scale is 1 / sqrt(head_dim); the fixture's 24
    assert want.spec.layers[0].sm_scale == 24 ** -0.5
    scale = lambda a: dataclasses.replace(a, sm_scale=16 ** -0.5)  # noqa: E731
    expected = dataclasses.replace(expected, attention=scale(expected.attention),
                                   layers=tuple(scale(a) for a in expected.layers))
  np.testing.assert_allclose(ours.spec.norm_eps, want.spec.norm_eps, rtol=1e-7)  # f32 in GGUF
  assert ours.spec == dataclasses.replace(expected, norm_eps=ours.spec.norm_eps)
  a, b = nnx.state(ours, nnx.Param), nnx.state(want, nnx.Param)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=0, atol=1e-6)
