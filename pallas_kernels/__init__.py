"""The NF4 format itself (``nf4``, ``nf4_maps``: code books, pack, quantize, dequantize) and
the Pallas kernels, each beside its pure-jnp reference (layer 1): JAX and numpy only."""
