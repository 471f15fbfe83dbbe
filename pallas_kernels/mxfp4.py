"""MXFP4, the storage of gpt-oss's expert weights (OCP microscaling): 32 values share one
power-of-two scale (a byte, its exponent + 127, E8M0), each value a 4-bit E2M1 code, two to a
byte (the low nibble first). A checkpoint keeps them as ``*_blocks`` [..., G, 16] uint8 and
``*_scales`` [..., G] uint8 for a last axis of G * 32 values; transformers' gpt-oss code
transposes the dequantized [E, out, in] to its experts' [E, in, out] afterwards.

Dequantization is a table lookup (CODE) and an exact multiply by a power of two, so it is
bit-exact in float32 and bfloat16 (every E2M1 value times 2^k is representable there for the
scales checkpoints hold).
"""

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import DTypeLike

# The 16 E2M1 values by code: sign bit 3, then 0, 0.5, 1, 1.5, 2, 3, 4, 6.
CODE = np.array(
  [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
  np.float32,
)
BLOCK = 32  # values per scale
SCALE_BIAS = 127


def check_shapes(blocks_shape: tuple[int, ...], scales_shape: tuple[int, ...]) -> str | None:
  """Why ``*_blocks`` and ``*_scales`` of these shapes are not one MXFP4 tensor, or None."""
  if len(blocks_shape) < 2 or blocks_shape[-1] != BLOCK // 2:
    return f"blocks must be [..., G, {BLOCK // 2}] bytes, got {list(blocks_shape)}"
  if tuple(blocks_shape[:-1]) != tuple(scales_shape):
    return f"blocks {list(blocks_shape)} and scales {list(scales_shape)} disagree in shape"
  return None


def dequantize(blocks: jax.Array, scales: jax.Array, dtype: DTypeLike = jnp.float32) -> jax.Array:
  """[..., G, 16] uint8 codes and [..., G] uint8 scales -> [..., G * 32] in ``dtype``."""
  problem = check_shapes(blocks.shape, scales.shape)
  if problem is not None:
    raise ValueError(f"MXFP4: {problem}.")
  code = jnp.asarray(CODE)
  b = blocks.astype(jnp.uint8)
  low, high = code[b & 0x0F], code[b >> 4]
  values = jnp.stack([low, high], axis=-1).reshape(*b.shape[:-1], BLOCK)  # low nibble first
  exponent = scales.astype(jnp.int32) - SCALE_BIAS
  out = jnp.ldexp(values, exponent[..., None])
  return out.reshape(*b.shape[:-2], -1).astype(dtype)


def quantize(w: jax.Array) -> tuple[jax.Array, jax.Array]:
  """[..., K] (K a multiple of 32) -> (blocks [..., K/32, 16] uint8, scales [..., K/32] uint8):
  each block's scale the smallest power of two that brings its largest magnitude to at most
  6, each value rounded to the nearest E2M1 value (ties to the even code). Dequantizing
  gives back any tensor ``dequantize`` made, value for value."""
  if w.shape[-1] % BLOCK:
    raise ValueError(f"MXFP4: the last axis must be a multiple of {BLOCK}, got {w.shape[-1]}.")
  x = w.astype(jnp.float32).reshape(*w.shape[:-1], -1, BLOCK)
  amax = jnp.max(jnp.abs(x), axis=-1, keepdims=True)
  # amax / 2^k <= 6 for the least k: ceil(log2(amax / 6)).
  k = jnp.where(amax > 0, jnp.ceil(jnp.log2(jnp.where(amax > 0, amax, 1.0) / 6.0)), 0.0)
  k = jnp.clip(k, -SCALE_BIAS, 255 - SCALE_BIAS).astype(jnp.int32)
  # log2 and the division round: corrected exactly, either way.
  k = jnp.where(jnp.ldexp(amax, -k) > 6.0, k + 1, k)
  k = jnp.where((amax > 0) & (jnp.ldexp(amax, 1 - k) <= 6.0) & (k > -SCALE_BIAS), k - 1, k)
  scaled = jnp.ldexp(x, -k)
  magnitudes = jnp.asarray(CODE[:8])
  distance = jnp.abs(jnp.abs(scaled)[..., None] - magnitudes)  # [..., 32, 8]
  # Nearest magnitude; a tie goes to the even code (argmin's first of two is the lower code,
  # so prefer the even one explicitly).
  best = jnp.argmin(distance, axis=-1)
  nxt = jnp.minimum(best + 1, 7)
  tie = (jnp.take_along_axis(distance, nxt[..., None], -1)[..., 0] == jnp.min(distance, -1)) & (
    best % 2 == 1
  )
  best = jnp.where(tie, nxt, best)
  codes = (best | jnp.where(jnp.signbit(scaled), 8, 0)).astype(jnp.uint8)
  pairs = codes.reshape(*codes.shape[:-1], BLOCK // 2, 2)
  blocks = pairs[..., 0] | (pairs[..., 1] << 4)
  return blocks.astype(jnp.uint8), (k[..., 0] + SCALE_BIAS).astype(jnp.uint8)
