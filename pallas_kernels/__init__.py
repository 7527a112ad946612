"""Fused Pallas kernels with pure-jnp references. Imports only jax."""
