"""Fused Pallas kernels with pure-jnp references. Imports only jax.

`pallas_kernels.decode_attention` is the function (DESIGN.md); the module of
the same name is `importlib.import_module("pallas_kernels.decode_attention")`.
"""

from pallas_kernels.paged_attention import (paged_decode_attention,
                                            paged_decode_attention_reference)
from pallas_kernels.decode_attention import (decode_attention, decode_attention_reference,
                                             mla_decode_attention,
                                             mla_decode_attention_reference)
