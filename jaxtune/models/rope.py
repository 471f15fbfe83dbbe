"""Rotary position embeddings as transformers computes them (rotate-half layout)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import DTypeLike

from jaxtune.models.config import RopeConfig


def inverse_frequencies(rope: RopeConfig, head_dim: int) -> np.ndarray:
  """float32 [head_dim / 2], with linear, llama3 or YaRN frequency scaling where configured."""
  if rope.kind == "yarn":
    return _yarn(rope, head_dim)[0]
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


def yarn_frequencies(
  theta: float,
  head_dim: int,
  factor: float,
  original_max_position_embeddings: int,
  *,
  beta_fast: float = 32.0,
  beta_slow: float = 1.0,
  truncate: bool = True,
  attention_factor: float | None = None,
  mscale: float | None = None,
  mscale_all_dim: float | None = None,
) -> tuple[np.ndarray, float]:
  """YaRN (arXiv 2309.00071) as transformers' ``_compute_yarn_parameters`` computes it: the
  inverse frequencies float32 [head_dim / 2], interpolated by ``factor`` below the correction
  range (the dimensions that turn fewer than ``beta_slow`` times over the original context),
  kept above it (more than ``beta_fast`` turns) and blended linearly between, and the factor
  that scales cos and sin (0.1 ln(factor) + 1 unless given, or the ratio of the two mscales).
  ``truncate``: the range's ends rounded outwards (gpt-oss turns it off)."""

  def get_mscale(scale: float, m: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

  if attention_factor is None:
    if mscale and mscale_all_dim:
      attention_factor = float(get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim))
    else:
      attention_factor = get_mscale(factor)

  def correction_dim(rotations: float) -> float:
    turns = original_max_position_embeddings / (rotations * 2 * math.pi)
    return head_dim * math.log(turns) / (2 * math.log(theta))

  low, high = correction_dim(beta_fast), correction_dim(beta_slow)
  if truncate:
    low, high = math.floor(low), math.ceil(high)
  low, high = max(low, 0), min(high, head_dim - 1)
  if low == high:
    high += 0.001  # as transformers: no zero-width ramp
  exponents = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
  pos_freqs = (np.float32(theta) ** exponents).astype(np.float32)
  extrapolation = (np.float32(1.0) / pos_freqs).astype(np.float32)
  interpolation = (np.float32(1.0) / (np.float32(factor) * pos_freqs)).astype(np.float32)
  ramp = np.clip(
    (np.arange(head_dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1
  ).astype(np.float32)
  keep = (np.float32(1.0) - ramp).astype(np.float32)  # 1: extrapolate (high frequencies)
  inv = interpolation * (np.float32(1.0) - keep) + extrapolation * keep
  return inv.astype(np.float32), float(attention_factor)


def attention_scaling(rope: RopeConfig, head_dim: int) -> float:
  """What cos and sin are multiplied by (YaRN's attention factor; 1 otherwise)."""
  return _yarn(rope, head_dim)[1] if rope.kind == "yarn" else 1.0


def _yarn(rope: RopeConfig, head_dim: int) -> tuple[np.ndarray, float]:
  return yarn_frequencies(
    rope.theta,
    head_dim,
    rope.factor,
    rope.original_max_position_embeddings,
    beta_fast=rope.beta_fast,
    beta_slow=rope.beta_slow,
    truncate=rope.truncate,
    attention_factor=rope.attention_factor,
    mscale=rope.mscale,
    mscale_all_dim=rope.mscale_all_dim,
  )


def cos_sin(
  positions: jax.Array, inv_freq: np.ndarray, dtype: DTypeLike, scale: float = 1.0
) -> tuple[jax.Array, jax.Array]:
  """[B, T] integer positions -> cos, sin of shape [B, T, head_dim] in ``dtype``, times
  ``scale`` in float32 first (``attention_scaling``)."""
  freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)  # [B, T, H/2]
  emb = jnp.concatenate([freqs, freqs], axis=-1)
  cos, sin = jnp.cos(emb), jnp.sin(emb)
  if scale != 1.0:
    cos, sin = cos * np.float32(scale), sin * np.float32(scale)
  return cos.astype(dtype), sin.astype(dtype)


def apply(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
  """x [B, T, N, H] rotated by cos/sin [B, T, H]."""
  with jax.named_scope("rope"):
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos[:, :, None, :] + rotated * sin[:, :, None, :]
