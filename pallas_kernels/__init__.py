"""Fused Pallas kernels with pure-jnp references. Imports only jax.

Modules: `dense_decode` (GQA/MHA/MQA and absorbed-MLA decode against a dense
cache), `paged_decode` (decode against a page pool), `lowbit_decode` (decode
against a packed 2/4-bit KIVI store, dense or paged), `rotated_decode` (decode against a
rotated 3/4-bit codebook store), `attention_common` (the
attended range, constants and argument checks every attention path shares,
kvattn's included) and `_common` (what the two kernels share).
"""

from pallas_kernels.dense_decode import (decode_attention, decode_attention_reference,
                                         mla_decode_attention, mla_decode_attention_reference)
from pallas_kernels.lowbit_decode import (kivi_decode_attention,
                                          kivi_decode_attention_reference)
from pallas_kernels.rotated_decode import (rotated_decode_attention,
                                           rotated_decode_attention_reference)
from pallas_kernels.paged_decode import (paged_decode_attention,
                                         paged_decode_attention_reference)
