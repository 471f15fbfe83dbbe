"""Attention in plain XLA: causal, grouped-query, packed segments.

This is the fallback path; the Pallas kernel of pallas_kernels/flash_attention plugs in here.
"""

import jax
import jax.numpy as jnp


def make_mask(segment_ids: jax.Array) -> jax.Array:
  """[B, T] segment ids -> [B, 1, 1, T, T] boolean: causal and within one document.

  Segment id 0 marks padding, which attends only to itself so its row stays finite.
  """
  t = segment_ids.shape[-1]
  causal = jnp.tril(jnp.ones((t, t), jnp.bool_))
  same = segment_ids[:, :, None] == segment_ids[:, None, :]
  return (causal[None] & same)[:, None, None]


def attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, scale: float):
  """q [B, T, N, H], k/v [B, S, K, H] with N a multiple of K -> [B, T, N, H]."""
  b, t, n, h = q.shape
  kv = k.shape[2]
  q = q.reshape(b, t, kv, n // kv, h)  # [B, T, K, G, H]
  scores = jnp.einsum("btkgh,bskh->bkgts", q, k).astype(jnp.float32) * scale
  scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
  probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
  out = jnp.einsum("bkgts,bskh->btkgh", probs, v)
  return out.reshape(b, t, n, h)
