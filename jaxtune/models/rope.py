"""Rotary position embeddings as transformers computes them (rotate-half layout)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import DTypeLike

from jaxtune.models.config import RopeConfig


def inverse_frequencies(rope: RopeConfig, head_dim: int) -> np.ndarray:
  """float32 [head_dim / 2], with llama3 frequency scaling where configured."""
  exponents = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
  inv = (1.0 / (np.float32(rope.theta) ** exponents)).astype(np.float32)
  if rope.kind == "linear":
    inv = (inv / np.float32(rope.factor)).astype(np.float32)
  if rope.kind == "llama3":
    old_len = rope.original_max_position_embeddings
    low_wavelen = old_len / rope.low_freq_factor
    high_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = np.where(wavelen > low_wavelen, inv / rope.factor, inv)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (
      rope.high_freq_factor - rope.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    inv = np.where(medium, smoothed, scaled).astype(np.float32)
  return inv


def cos_sin(
  positions: jax.Array, inv_freq: np.ndarray, dtype: DTypeLike
) -> tuple[jax.Array, jax.Array]:
  """[B, T] integer positions -> cos, sin of shape [B, T, head_dim] in ``dtype``."""
  freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)  # [B, T, H/2]
  emb = jnp.concatenate([freqs, freqs], axis=-1)
  return jnp.cos(emb).astype(dtype), jnp.sin(emb).astype(dtype)


def apply(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
  """x [B, T, N, H] rotated by cos/sin [B, T, H]."""
  with jax.named_scope("rope"):
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos[:, :, None, :] + rotated * sin[:, :, None, :]
