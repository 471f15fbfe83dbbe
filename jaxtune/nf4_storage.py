"""The Flax variable type that holds frozen NF4 weights.

Apart from nf4.py so that the NF4 format (and the kernels built on it) need JAX alone.
"""

from flax import nnx


class NF4Storage(nnx.Variable):
  """Frozen NF4 bytes and scales. Not an ``nnx.Param``: no optimizer filter can select it."""
