"""NF4 with double quantization, value-for-value what bitsandbytes produces, in pure JAX.

A weight is quantized in blocks of 64 consecutive values of its row-major flattening (for a
PyTorch Linear weight [out, in], 64 consecutive input features of one output row):

  absmax[b] = max |w| over block b                               (float32)
  code[i]   = nearest NF4 level to w[i] / absmax[i // 64]         (4 bits; two per byte, the
                                                                   even element in the high nibble)

and the float32 absmax values are quantized once more ("double quantization"):

  offset          = mean(absmax)
  nested_absmax   = max |absmax - offset| over blocks of 256      (float32)
  absmax_q[j]     = nearest dynamic-map level to (absmax[j] - offset) / nested_absmax[j // 256]

Dequantization is then

  absmax[j] = DYNAMIC_MAP[absmax_q[j]] * nested_absmax[j // 256] + offset
  w[i]      = NF4_CODE[code[i]] * absmax[i // 64]

The rounding rules are bitsandbytes' own (CPU backend, 0.50.2): the 4-bit step picks levels
by comparing with the float32 midpoints of neighbouring levels, the 8-bit step goes through
bitsandbytes' 65536-entry lookup table. The one quantity we cannot reproduce bit for bit is
the offset: bitsandbytes takes torch's float32 mean, whose rounding depends on torch's SIMD
width and thread count; we take the correctly rounded mean (float64 accumulation), which
agrees with torch's to within an ulp or two. Given the same offset every byte is identical.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxtune.nf4_maps import DYNAMIC_MAP, NF4_CODE

BLOCKSIZE = 64
NESTED_BLOCKSIZE = 256

# Decision boundaries of the 4-bit step, in float32 as bitsandbytes computes them.
_NF4_BOUNDS = ((NF4_CODE[:-1] + NF4_CODE[1:]) / np.float32(2)).astype(np.float32)
# bitsandbytes' 8-bit quantizer maps a normalized value to one of 65536 grid points and the
# grid point to the level whose float32 midpoints bracket it.
_LUT_SIZE = 65536
_DYNAMIC_MIDPOINTS = (np.float32(0.5) * (DYNAMIC_MAP[:-1] + DYNAMIC_MAP[1:])).astype(np.float32)


class NF4Storage(nnx.Variable):
  """Frozen NF4 bytes and scales. Not an ``nnx.Param``: no optimizer filter can select it."""


class NF4Quantized(NamedTuple):
  """One tensor in bitsandbytes' flat layout (the storage keys of a ``*-bnb-4bit`` file)."""

  codes: jax.Array  # uint8 [ceil(n / 2)], two 4-bit codes per byte
  absmax: jax.Array  # uint8 [ceil(n / 64)]
  nested_absmax: jax.Array  # float32 [ceil(ceil(n / 64) / 256)]
  offset: jax.Array  # float32 []


def _pad_to_blocks(x: jax.Array, blocksize: int, fill: float) -> jax.Array:
  n = x.shape[0]
  nb = -(-n // blocksize)
  return jnp.pad(x, (0, nb * blocksize - n), constant_values=fill).reshape(nb, blocksize)


@jax.jit
def quantize_4bit_blocks(w: jax.Array) -> tuple[jax.Array, jax.Array]:
  """First stage: packed 4-bit codes and float32 absmax of ``w`` (any shape, flattened)."""
  x = w.reshape(-1).astype(jnp.float32)
  n = x.shape[0]
  blocks = _pad_to_blocks(x, BLOCKSIZE, 0.0)  # [nb, 64]
  absmax = jnp.max(jnp.abs(blocks), axis=1)
  safe = jnp.maximum(absmax, 1e-38)[:, None]
  full = jnp.clip(blocks * (1.0 / safe), -1.0, 1.0)
  if n % BLOCKSIZE:
    # bitsandbytes divides (instead of multiplying by the reciprocal) in the partial block.
    last = jnp.clip(blocks[-1:] / safe[-1:], -1.0, 1.0)
    full = jnp.concatenate([full[:-1], last], axis=0)
  scaled = full.reshape(-1)[:n]
  if n % 2:
    scaled = jnp.pad(scaled, (0, 1))  # a zero, code 7, fills the last low nibble
  # Index of the first boundary >= value, i.e. torch.bucketize(right=False).
  q = jnp.sum(scaled[:, None] > jnp.asarray(_NF4_BOUNDS)[None, :], axis=1).astype(jnp.uint8)
  packed = (q[0::2] << 4) | q[1::2]
  return packed, absmax


@jax.jit
def quantize_blockwise_8bit(x: jax.Array) -> tuple[jax.Array, jax.Array]:
  """bitsandbytes' 8-bit blockwise quantization (blocks of 256) with its dynamic map."""
  n = x.shape[0]
  blocks = _pad_to_blocks(x.astype(jnp.float32), NESTED_BLOCKSIZE, 0.0)
  absmax = jnp.max(jnp.abs(blocks), axis=1)
  inv = 1.0 / absmax
  v = jnp.clip(blocks * inv[:, None], -1.0, 1.0)
  grid = jnp.floor(((v + 1.0) * 0.5) * float(_LUT_SIZE - 1) + 0.5).astype(jnp.int32)
  grid_value = -1.0 + (2.0 * grid.astype(jnp.float32)) / float(_LUT_SIZE - 1)
  q = jnp.sum(grid_value[..., None] > jnp.asarray(_DYNAMIC_MIDPOINTS), axis=-1)
  q = jnp.where(absmax[:, None] == 0.0, 0, q).astype(jnp.uint8)
  return q.reshape(-1)[:n], absmax


def mean_offset(absmax: jax.Array) -> jax.Array:
  """The double-quantization offset: the float32 mean of absmax, correctly rounded."""
  host = np.asarray(jax.device_get(absmax), dtype=np.float64)
  return jnp.asarray(np.float32(host.sum() / host.size))


def double_quantize(absmax: jax.Array, offset: jax.Array | None = None):
  """Second stage: (absmax_u8, nested_absmax, offset) from float32 absmax."""
  if offset is None:
    offset = mean_offset(absmax)
  offset = jnp.asarray(offset, jnp.float32)
  absmax_q, nested = quantize_blockwise_8bit(absmax - offset)
  return absmax_q, nested, offset


def quantize(w: jax.Array) -> NF4Quantized:
  """NF4 + double quantization of ``w`` (any shape; flattened row-major as bitsandbytes does)."""
  codes, absmax = quantize_4bit_blocks(w)
  absmax_q, nested, offset = double_quantize(absmax)
  return NF4Quantized(codes, absmax_q, nested, offset)


def dequantize_absmax(absmax_q: jax.Array, nested_absmax: jax.Array, offset: jax.Array):
  """float32 absmax from its 8-bit codes; works on any shape whose flattening is bnb's order."""
  flat_index = _flat_iota(absmax_q.shape)
  scale = jnp.asarray(nested_absmax)[flat_index // NESTED_BLOCKSIZE]
  return jnp.asarray(DYNAMIC_MAP)[absmax_q] * scale + offset


def _flat_iota(shape: tuple[int, ...]) -> jax.Array:
  """Row-major flat index of every element of ``shape``, built from iotas (shard-friendly)."""
  index = jnp.zeros(shape, jnp.int32)
  stride = 1
  for axis in reversed(range(len(shape))):
    index = index + jax.lax.broadcasted_iota(jnp.int32, shape, axis) * stride
    stride *= shape[axis]
  return index


def _unpack(codes: jax.Array) -> jax.Array:
  """[..., k] bytes -> [..., 2k] 4-bit codes, high nibble first."""
  pair = jnp.stack([codes >> 4, codes & 0xF], axis=-1)
  return pair.reshape(*codes.shape[:-1], codes.shape[-1] * 2)


def dequantize(q: NF4Quantized, shape: tuple[int, ...], dtype=jnp.float32) -> jax.Array:
  """Inverse of :func:`quantize` in bitsandbytes' flat layout, for any ``shape``."""
  n = int(np.prod(shape))
  values = jnp.asarray(NF4_CODE)[_unpack(q.codes)[:n]]
  absmax = dequantize_absmax(q.absmax, q.nested_absmax, q.offset)
  blocks = _pad_to_blocks(values, BLOCKSIZE, 0.0) * absmax[:, None]
  return blocks.reshape(-1)[:n].reshape(shape).astype(dtype)


# --- The 2-D layout used inside jaxtune's linear layers ------------------------------------
# A Linear weight [out, in] with in % 64 == 0 keeps bnb's bytes, only reshaped so that rows
# stay rows: codes [out, in / 2], absmax [out, in / 64]. Sharding either axis keeps every
# block whole; nested_absmax (tiny) is replicated and indexed by the flat block number.


def quantize_linear(w: jax.Array) -> NF4Quantized:
  """Quantize a PyTorch-layout weight [out, in] into the 2-D layout (in % 64 == 0)."""
  out_features, in_features = w.shape
  if in_features % BLOCKSIZE:
    raise ValueError(
      f"NF4 needs the input size of a linear layer to be a multiple of {BLOCKSIZE}, got "
      f"{in_features}; load this model with quantization=None."
    )
  q = quantize(w)
  return NF4Quantized(
    q.codes.reshape(out_features, in_features // 2),
    q.absmax.reshape(out_features, in_features // BLOCKSIZE),
    q.nested_absmax,
    q.offset,
  )


def dequantize_linear(
  codes: jax.Array, absmax: jax.Array, nested_absmax: jax.Array, offset: jax.Array, dtype
) -> jax.Array:
  """[out, in] weight from the 2-D layout, bit-identical to bitsandbytes' dequantize_4bit."""
  out_features, half = codes.shape
  scale = dequantize_absmax(absmax, nested_absmax, offset)  # [out, in / 64]
  values = jnp.asarray(NF4_CODE)[_unpack(codes)].reshape(out_features, -1, BLOCKSIZE)
  return (values * scale[..., None]).reshape(out_features, 2 * half).astype(dtype)


def nested_size(out_features: int, in_features: int) -> int:
  blocks = out_features * in_features // BLOCKSIZE
  return -(-blocks // NESTED_BLOCKSIZE)
