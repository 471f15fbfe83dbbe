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

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike, DTypeLike

from pallas_kernels.nf4_maps import DYNAMIC_MAP, NF4_CODE

BLOCKSIZE = 64
NESTED_BLOCKSIZE = 256

# Decision boundaries of the 4-bit step, in float32 as bitsandbytes computes them.
_NF4_BOUNDS = ((NF4_CODE[:-1] + NF4_CODE[1:]) / np.float32(2)).astype(np.float32)
# bitsandbytes' 8-bit quantizer maps a normalized value to one of 65536 grid points and the
# grid point to the level whose float32 midpoints bracket it.
_LUT_SIZE = 65536
_DYNAMIC_MIDPOINTS = (np.float32(0.5) * (DYNAMIC_MAP[:-1] + DYNAMIC_MAP[1:])).astype(np.float32)


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
  full, absmax = _scale_blocks(blocks)
  if n % BLOCKSIZE:
    # bitsandbytes divides (instead of multiplying by the reciprocal) in the partial block.
    last = jnp.clip(blocks[-1:] / jnp.maximum(absmax[-1:], 1e-38)[:, None], -1.0, 1.0)
    full = jnp.concatenate([full[:-1], last], axis=0)
  scaled = full.reshape(-1)[:n]
  if n % 2:
    scaled = jnp.pad(scaled, (0, 1))  # a zero, code 7, fills the last low nibble
  return _pack(_nf4_level(scaled)), absmax


def _scale_blocks(blocks: jax.Array) -> tuple[jax.Array, jax.Array]:
  """[..., 64] float32 blocks -> (values / absmax clipped to [-1, 1], absmax [...])."""
  absmax = jnp.max(jnp.abs(blocks), axis=-1)
  safe = jnp.maximum(absmax, 1e-38)[..., None]
  return jnp.clip(blocks * (1.0 / safe), -1.0, 1.0), absmax


def _nf4_level(scaled: jax.Array) -> jax.Array:
  """Index of the first boundary >= value, i.e. torch.bucketize(right=False)."""
  return jnp.sum(scaled[..., None] > jnp.asarray(_NF4_BOUNDS), axis=-1).astype(jnp.uint8)


def _pack(q: jax.Array) -> jax.Array:
  """[..., 2k] codes -> [..., k] bytes, the even element in the high nibble."""
  pairs = q.reshape(*q.shape[:-1], q.shape[-1] // 2, 2)
  return (pairs[..., 0] << 4) | pairs[..., 1]


@jax.jit
def quantize_blockwise_8bit(x: jax.Array) -> tuple[jax.Array, jax.Array]:
  """bitsandbytes' 8-bit blockwise quantization (blocks of 256) with its dynamic map."""
  n = x.shape[0]
  blocks = _pad_to_blocks(x.astype(jnp.float32), NESTED_BLOCKSIZE, 0.0)
  absmax = jnp.max(jnp.abs(blocks), axis=1)
  inv = 1.0 / absmax
  v = jnp.clip(blocks * inv[:, None], -1.0, 1.0)
  grid = jnp.floor(((v + 1.0) * 0.5) * float(_LUT_SIZE - 1) + 0.5).astype(jnp.int32)
  q = jnp.take(jnp.asarray(_dynamic_lut()), grid, mode="clip")
  q = jnp.where(absmax[:, None] == 0.0, 0, q).astype(jnp.uint8)
  return q.reshape(-1)[:n], absmax


@functools.cache
def _dynamic_lut() -> np.ndarray:
  """Dynamic-map level of every grid point: one gather instead of 255 comparisons a value.

  Grid point g stands for the float32 value -1 + 2g / 65535 and belongs to the level whose
  midpoints bracket it, i.e. the number of midpoints below it (numpy's float32 arithmetic is
  IEEE, as XLA's is).
  """
  g = np.arange(_LUT_SIZE, dtype=np.float32)
  value = np.float32(-1.0) + (np.float32(2.0) * g) / np.float32(_LUT_SIZE - 1)
  return np.sum(value[:, None] > _DYNAMIC_MIDPOINTS[None, :], axis=1).astype(np.uint8)


def host_mean(absmax: ArrayLike) -> np.float32:
  """The double-quantization offset, computed on the host: the float32 mean of absmax,
  correctly rounded (float64 accumulation). Takes a numpy or jax array of any shape."""
  host = np.asarray(absmax, dtype=np.float64).reshape(-1)
  return np.float32(host.sum() / host.size)


def mean_offset(absmax: jax.Array) -> jax.Array:
  """:func:`host_mean` as a jax scalar."""
  return jnp.asarray(host_mean(jax.device_get(absmax)))


def double_quantize(
  absmax: jax.Array, offset: ArrayLike | None = None
) -> tuple[jax.Array, jax.Array, jax.Array]:
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


def dequantize_absmax(
  absmax_q: jax.Array, nested_absmax: jax.Array, offset: jax.Array
) -> jax.Array:
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


def unpack(codes: jax.Array) -> jax.Array:
  """[..., k] bytes -> [..., 2k] 4-bit codes, high nibble first."""
  pair = jnp.stack([codes >> 4, codes & 0xF], axis=-1)
  return pair.reshape(*codes.shape[:-1], codes.shape[-1] * 2)


def dequantize(
  q: NF4Quantized, shape: tuple[int, ...], dtype: DTypeLike = jnp.float32
) -> jax.Array:
  """Inverse of :func:`quantize` in bitsandbytes' flat layout, for any ``shape``."""
  n = int(np.prod(shape))
  values = jnp.asarray(NF4_CODE)[unpack(q.codes)[:n]]
  absmax = dequantize_absmax(q.absmax, q.nested_absmax, q.offset)
  blocks = _pad_to_blocks(values, BLOCKSIZE, 0.0) * absmax[:, None]
  return blocks.reshape(-1)[:n].reshape(shape).astype(dtype)


# --- The 2-D layout used inside jaxtune's linear layers ------------------------------------
# A Linear weight [out, in] with in % 64 == 0 keeps bnb's bytes, only reshaped so that rows
# stay rows: codes [out, in / 2], absmax [out, in / 64]. Sharding either axis keeps every
# block whole; nested_absmax (tiny) is replicated and indexed by the flat block number.


def quantize_linear(w: jax.Array) -> NF4Quantized:
  """Quantize a PyTorch-layout weight [out, in] into the 2-D layout (in % 64 == 0).

  The three steps are public so that a loader can overlap the host's mean of one weight with
  the device's work on the next (jaxtune/hf/load.py); composed, they are this function.
  """
  check_linear_shape(w.shape)
  codes, absmax = quantize_linear_4bit(w)
  absmax_q, nested, offset = double_quantize_linear(absmax, host_mean(absmax))
  return NF4Quantized(codes, absmax_q, nested, offset)


def check_linear_shape(shape: tuple[int, ...]) -> None:
  """NF4's 2-D layout keeps blocks within rows: the input size must be a multiple of 64."""
  if shape[-1] % BLOCKSIZE:
    raise ValueError(
      f"NF4 needs the input size of a linear layer to be a multiple of {BLOCKSIZE}, got "
      f"{shape[-1]}; load this model with quantization=None."
    )


@jax.jit
def quantize_linear_4bit(w: jax.Array) -> tuple[jax.Array, jax.Array]:
  """First stage in the 2-D layout: codes uint8 [out, in / 2], float32 absmax [out, in / 64].

  The blocks of 64 lie along rows, so this is :func:`quantize_4bit_blocks` without the
  flattening (which would tie a sharded weight's layout in knots).
  """
  out_features, in_features = w.shape
  blocks = w.astype(jnp.float32).reshape(out_features, in_features // BLOCKSIZE, BLOCKSIZE)
  scaled, absmax = _scale_blocks(blocks)  # absmax [out, in / 64]
  codes = _pack(_nf4_level(scaled))  # [out, in / 64, 32]
  return codes.reshape(out_features, in_features // 2), absmax


@jax.jit
def double_quantize_linear(
  absmax: jax.Array, offset: ArrayLike
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Second stage in the 2-D layout: (absmax uint8 [out, in / 64], nested_absmax, offset)
  from the float32 absmax [out, in / 64] and the offset (:func:`host_mean`)."""
  absmax_q, nested, offset = double_quantize(absmax.reshape(-1), offset)
  return absmax_q.reshape(absmax.shape), nested, offset


def dequantize_linear(
  codes: jax.Array, absmax: jax.Array, nested_absmax: jax.Array, offset: jax.Array, dtype: DTypeLike
) -> jax.Array:
  """[out, in] weight from the 2-D layout, bit-identical to bitsandbytes' dequantize_4bit."""
  out_features, half = codes.shape
  scale = dequantize_absmax(absmax, nested_absmax, offset)  # [out, in / 64]
  values = jnp.asarray(NF4_CODE)[unpack(codes)].reshape(out_features, -1, BLOCKSIZE)
  return (values * scale[..., None]).reshape(out_features, 2 * half).astype(dtype)


def quantize_experts(w: jax.Array) -> NF4Quantized:
  """A mixture of experts' weights [E, out, in], each expert quantized as its own linear
  layer (``quantize_linear``: its own double-quantization offset, as bitsandbytes quantizes
  each expert's Linear4bit), stacked: codes [E, out, in / 2], absmax [E, out, in / 64],
  nested_absmax [E, nested], offset [E]."""
  check_linear_shape(w.shape)
  parts = [quantize_linear(w[e]) for e in range(w.shape[0])]
  return NF4Quantized(*(jnp.stack(field) for field in zip(*parts, strict=True)))


def dequantize_experts(
  codes: jax.Array, absmax: jax.Array, nested_absmax: jax.Array, offset: jax.Array, dtype: DTypeLike
) -> jax.Array:
  """[E, out, in] from ``quantize_experts``' stack, each expert as ``dequantize_linear``."""
  return jax.vmap(lambda c, a, n, o: dequantize_linear(c, a, n, o, dtype))(
    codes, absmax, nested_absmax, offset
  )


def nested_size(out_features: int, in_features: int) -> int:
  blocks = out_features * in_features // BLOCKSIZE
  return -(-blocks // NESTED_BLOCKSIZE)
