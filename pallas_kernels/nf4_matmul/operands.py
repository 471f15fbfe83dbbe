"""The kernels' operands from the stored bitsandbytes layout: the codes viewed as JAX int4 (in
word order for the "word", "lut" and "plut" lookups) and the scales (kernel.py's module docstring
describes them). Plain jnp, no Mosaic GPU; kernel.py re-exports them.
"""

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels import nf4
from pallas_kernels.nf4_matmul.reference import word_bytes


def kernel_operands(
  codes: jax.Array,
  absmax: jax.Array,
  nested_absmax: jax.Array,
  offset: jax.Array,
  *,
  swap_nibbles: bool,
) -> tuple[jax.Array, jax.Array]:
  """(w4 int4 [N, K], scales bf16 [K/64, N]) from the 2-D layout of ``pallas_kernels.nf4``."""
  scales = nf4.dequantize_absmax(absmax, nested_absmax, offset)  # [N, K/64] float32
  return kernel_codes(codes, swap_nibbles=swap_nibbles), scales.T.astype(jnp.bfloat16)


def kernel_codes(codes: jax.Array, *, swap_nibbles: bool) -> jax.Array:
  """w4 int4 [..., N, K]: the codes uint8 [..., N, K/2] viewed as JAX int4 (nibbles swapped
  for the "select" lookup)."""
  if swap_nibbles:
    codes = (codes << 4) | (codes >> 4)
  *lead, half = codes.shape
  return lax.bitcast_convert_type(codes, jnp.int4).reshape(*lead, 2 * half)


def word_codes(codes: jax.Array) -> jax.Array:
  """w4 int4 [..., N, K] for the "word", "lut" and "plut" lookups: the codes uint8
  [..., N, K/2], each row's 16 bytes of every 32 columns transposed as a 4 x 4 matrix
  (byte 4t + b <- byte 4b + t).

  Why: in WGMMA_LAYOUT_UPCAST_4X thread t (of the 4 sharing a row) loads bytes 4t..4t+3 of
  the 32 columns as one 32-bit register; WGMMA_LAYOUT, same thread -> row assignment, gives it
  columns 8b + 2t and 8b + 2t + 1 of each 8-column core matrix b: bitsandbytes' byte 4b + t.
  After the transpose the register holds exactly those bytes, core matrix b in byte b, and
  bitsandbytes' nibble order is kept (even column in the high nibble; the lookup reads it so).
  A pass over the codes: made once where one weight serves many calls (decoding), per call at
  training sizes; x and the scales keep their order."""
  return kernel_codes(word_bytes(codes), swap_nibbles=False)
