"""Pure-jnp twins of the NF4 matmul kernel: the float32 reference and the XLA fallback."""

import jax
import jax.numpy as jnp

from jaxtune import nf4


def nf4_matmul_reference(
  x: jax.Array,
  codes: jax.Array,
  absmax: jax.Array,
  nested_absmax: jax.Array,
  offset: jax.Array,
) -> jax.Array:
  """float32 x @ dequant(W)^T; W [N, K] in the 2-D NF4 layout of ``jaxtune.nf4``. -> [..., N]."""
  w = nf4.dequantize_linear(codes, absmax, nested_absmax, offset, jnp.float32)
  return jnp.einsum("...k,nk->...n", x.astype(jnp.float32), w)


def dequantize_then_dot(
  x: jax.Array,
  codes: jax.Array,
  absmax: jax.Array,
  nested_absmax: jax.Array,
  offset: jax.Array,
) -> jax.Array:
  """What XLA runs without the kernel: W dequantized to x.dtype, then one dot."""
  w = nf4.dequantize_linear(codes, absmax, nested_absmax, offset, x.dtype)
  return jnp.einsum("...k,nk->...n", x, w)


def dequantize_then_dot_t(
  dy: jax.Array,
  codes: jax.Array,
  absmax: jax.Array,
  nested_absmax: jax.Array,
  offset: jax.Array,
) -> jax.Array:
  """The backward product dy @ dequant(W): [..., N] -> [..., K]."""
  w = nf4.dequantize_linear(codes, absmax, nested_absmax, offset, dy.dtype)
  return jnp.einsum("...n,nk->...k", dy, w)
