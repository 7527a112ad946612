"""Attention ops: the decode dispatch points, the XLA paths, RoPE and KV quantization.

`kvattn.ops.dispatch` declares every decode backend and its default order.
"""

from kvattn.ops.dispatch import (available_implementations, decode_attention,
                                 mla_decode_attention, paged_decode_attention,
                                 register_implementation)
from kvattn.ops.xla import (attention, decode_attention_xla, mla_attention,
                            mla_decode_attention_xla)
from kvattn.ops.xla_paged import paged_decode_attention_xla
from kvattn.ops.rope import RopeScaling, apply_rope, rope_frequencies, rope_scaling_from_fields
from kvattn.ops.quant import QUANT_DTYPES, dequantize_kv, quantize_kv

__all__ = [
    "QUANT_DTYPES",
    "RopeScaling",
    "apply_rope",
    "attention",
    "available_implementations",
    "decode_attention",
    "decode_attention_xla",
    "dequantize_kv",
    "mla_attention",
    "mla_decode_attention",
    "mla_decode_attention_xla",
    "paged_decode_attention",
    "paged_decode_attention_xla",
    "quantize_kv",
    "register_implementation",
    "rope_frequencies",
    "rope_scaling_from_fields",
]
