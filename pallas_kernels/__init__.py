"""Fused Pallas decode kernels with pure-jnp references. Imports only jax.

`dense_decode` (GQA/MHA/MQA and absorbed MLA against a dense cache),
`paged_decode` (a page pool), `lowbit_decode` / `lowbit_paged_decode` (a packed
2/4-bit KIVI store, dense or paged), `rotated_decode` (a rotated 3/4-bit codebook
store); `_common` holds the online-softmax skeleton they share and
`attention_common` the attended range and the kernels' argument checks.
"""

from pallas_kernels.dense_decode import (decode_attention, decode_attention_reference,
                                         mla_decode_attention, mla_decode_attention_reference)
from pallas_kernels.lowbit_decode import (kivi_decode_attention,
                                          kivi_decode_attention_reference)
from pallas_kernels.lowbit_paged_decode import (paged_kivi_decode_attention,
                                                paged_kivi_decode_attention_reference)
from pallas_kernels.rotated_decode import (rotated_decode_attention,
                                           rotated_decode_attention_reference)
from pallas_kernels.paged_decode import (paged_decode_attention,
                                         paged_decode_attention_reference)
