"""Fused Pallas kernels with pure-jnp references. Imports only jax."""

from pallas_kernels.paged_attention import (paged_decode_attention,
                                            paged_decode_attention_reference)
