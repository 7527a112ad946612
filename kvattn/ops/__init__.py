"""Reference attention ops, RoPE and the decode-attention dispatch point."""

from kvattn.ops.reference import attention, decode_attention_xla
from kvattn.ops.dispatch import available_implementations, decode_attention
from kvattn.ops.rope import apply_rope, rope_frequencies

__all__ = [
    "apply_rope",
    "attention",
    "available_implementations",
    "decode_attention",
    "decode_attention_xla",
    "rope_frequencies",
]
