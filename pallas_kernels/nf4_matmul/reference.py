"""Pure-jnp twins of the NF4 matmul kernel: the float32 reference and the XLA fallback."""

import functools

import jax
import jax.numpy as jnp
from jax.typing import DTypeLike

from pallas_kernels import nf4
from pallas_kernels.nf4_maps import NF4_CODE


def nf4_matmul_reference(
  x: jax.Array,
  codes: jax.Array,
  absmax: jax.Array,
  nested_absmax: jax.Array,
  offset: jax.Array,
) -> jax.Array:
  """float32 x @ dequant(W)^T -> [..., N]; W [N, K] in the 2-D NF4 layout of ``nf4``."""
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


def dequantize_then_dot_folded(
  x: jax.Array,
  extra_x: jax.Array,
  extra_w: jax.Array,
  codes: jax.Array,
  absmax: jax.Array,
  nested_absmax: jax.Array,
  offset: jax.Array,
) -> jax.Array:
  """x @ W^T + extra_x @ extra_w^T as ONE dot: [x, extra_x] @ [W, extra_w]^T, the extra
  columns appended along K (a LoRA's scaled x A and B^T), so no [..., N] product of the
  extra pair is written and read back to be added. ``extra_x`` [..., E], ``extra_w`` [N, E]."""
  w = nf4.dequantize_linear(codes, absmax, nested_absmax, offset, x.dtype)
  xe = jnp.concatenate([x, extra_x.astype(x.dtype)], axis=-1)
  # W^T with the extra rows below rather than [W, extra_w] with the columns appended: in one
  # call (H100, experiments/profile_kernels.py, one loss-and-gradient call each; RESULTS.md)
  # 0.4% / 0.7% less device time at 8B / 1B, within the spread between repeats, where XLA
  # made [W, extra_w] with an extra transposing pass.
  wt = jnp.concatenate([w.T, extra_w.T.astype(x.dtype)], axis=0)
  return jnp.einsum("...k,kn->...n", xe, wt)


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


def word_bytes(codes: jax.Array) -> jax.Array:
  """The codes uint8 [..., N, K/2] in the forward kernel's "word" order: each row's 16 bytes
  of every 32 columns transposed as a 4 x 4 matrix (byte 4t + b <- byte 4b + t; why:
  kernel.word_codes). A transpose, so applied twice it gives the codes back.

  Done on 32-bit words (shifts and masks): 0.59-0.64x the time of the same transpose on bytes
  (H100, experiments/bench_word_order.py; 2.8 TB/s on the 8B MLP's codes), which matters
  where training tiles permute the codes on every call."""
  *lead, half = codes.shape
  if half % 16:
    raise ValueError(f"word_codes: K = {2 * half} is not a multiple of 32")
  # Little-endian words (every JAX backend): byte i of a word is bits 8i..8i+7.
  words = jax.lax.bitcast_convert_type(codes.reshape(*lead, half // 4, 4), jnp.uint32)
  words = words.reshape(*lead, half // 16, 4)  # word b of a group: its bytes 4b..4b+3
  # Word t of the result takes byte t of every word b, into its byte b.
  out = [
    functools.reduce(
      jnp.bitwise_or, [((words[..., b] >> (8 * t)) & 0xFF) << (8 * b) for b in range(4)]
    )
    for t in range(4)
  ]
  out = jnp.stack(out, axis=-1).reshape(*lead, half // 4)
  return jax.lax.bitcast_convert_type(out, codes.dtype).reshape(*lead, half)


def transposed_codes(codes: jax.Array) -> jax.Array:
  """W^T's codes uint8 [..., K, N/2] from W's [..., N, K/2], in bitsandbytes' packing (element
  2j in byte j's high nibble): the operand ``Config.transposed`` takes. One transpose of bytes:
  rows 2j and 2j + 1 of W (bytes a, b) give W^T's byte j of rows 2i (the high nibbles, a's
  first) and 2i + 1 (the low ones), so no array of single codes is made."""
  a, b = codes[..., 0::2, :], codes[..., 1::2, :]  # [..., N/2, K/2]
  even = (a & 0xF0) | (b >> 4)
  odd = (a << 4) | (b & 0x0F)
  pairs = jnp.stack([even, odd], axis=-1)  # [..., N/2, K/2, 2]: byte j of W^T rows 2i, 2i + 1
  return pairs.reshape(*codes.shape[:-2], codes.shape[-2] // 2, -1).swapaxes(-1, -2)


def prepared_weight(word: jax.Array, scales: jax.Array, dtype: DTypeLike) -> jax.Array:
  """W [N, K] from the forward kernel's prepared operands, as the kernel forms it: the NF4
  level (bf16) times the block's bf16 scale, a bf16 product. ``word``: codes [N, K/2] in
  "word" order; ``scales``: bf16 [K/64, N] (ops.kernel_scales)."""
  codes = word_bytes(word)  # back in bitsandbytes' order
  n, half = codes.shape
  levels = jnp.asarray(NF4_CODE, jnp.bfloat16)[nf4.unpack(codes)].reshape(n, -1, nf4.BLOCKSIZE)
  w = levels * scales.astype(jnp.bfloat16).T[..., None]
  return w.reshape(n, 2 * half).astype(dtype)


def prepared_dot(x: jax.Array, word: jax.Array, scales: jax.Array) -> jax.Array:
  """x [..., K] @ W^T from the prepared operands (``prepared_weight``): XLA's twin of
  ``ops.prepared_matmul``'s kernel, float32 accumulation, x's dtype out."""
  w = prepared_weight(word, scales, x.dtype)
  y = jnp.einsum("...k,nk->...n", x, w, preferred_element_type=jnp.float32)
  return y.astype(x.dtype)
