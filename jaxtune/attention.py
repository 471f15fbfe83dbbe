"""Attention: causal, grouped-query, packed segments.

Three implementations:
  "xla":   plain einsums with the full [T, T] mask; handles packed segments. The reference.
  "pallas": pallas_kernels.flash_attention: the Mosaic GPU flash kernel on Hopper (segments,
           sliding window as a traced per-layer value, softcap; nothing [T, T]); elsewhere that
           op's own fallback (cuDNN where the options allow, else its jnp reference).
  "fused": jax.nn.dot_product_attention, causal only: cuDNN's fused kernel on NVIDIA GPUs
           (asked for explicitly: left to choose, JAX picks its XLA version, which
           materialises float32 scores), jax.nn's XLA version elsewhere. Exact when each
           row holds one document followed by padding, since causal attention never lets
           a real token see the padding after it; it does NOT separate
           several packed documents, so packing must use "xla" until the kernel lands.
"""

import jax
import jax.numpy as jnp

from pallas_kernels.flash_attention import flash_attention


def make_mask(segment_ids: jax.Array) -> jax.Array:
  """[B, T] segment ids -> [B, 1, 1, T, T] boolean: causal and within one document.

  Segment id 0 marks padding, which attends only to itself so its row stays finite.
  """
  t = segment_ids.shape[-1]
  causal = jnp.tril(jnp.ones((t, t), jnp.bool_))
  same = segment_ids[:, :, None] == segment_ids[:, None, :]
  return (causal[None] & same)[:, None, None]


IMPLEMENTATIONS = ("xla", "fused", "pallas")


def default_implementation() -> str:
  return "fused" if jax.default_backend() == "gpu" else "xla"


def attention(
  q,
  k,
  v,
  *,
  segment_ids,
  scale: float,
  window=0,
  softcap=None,
  implementation: str = "xla",
):
  """Causal self-attention within documents. q [B, T, N, H], k/v [B, T, K, H] -> [B, T, N, H].

  N is a multiple of K (GQA/MQA). ``segment_ids`` [B, T] int: tokens attend only within their
  segment (0 = padding). ``window`` (int or traced scalar, 0 = none): keys fewer than that many
  positions back. ``softcap``: cap * tanh(scores / cap) (Gemma 2). "fused" reads neither
  segments, window nor softcap (the caller checks it may use it).
  """
  if implementation == "pallas":
    return flash_attention(
      q, k, v, segment_ids=segment_ids, causal=True, window=window, softcap=softcap, scale=scale
    )
  if implementation == "fused":
    impl = "cudnn" if jax.default_backend() == "gpu" else "xla"
    return jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=True, implementation=impl)
  mask = window_mask(make_mask(segment_ids), window)
  return masked_attention(q, k, v, mask, scale, softcap)


def window_mask(mask: jax.Array, window: jax.Array) -> jax.Array:
  """Restrict [B, 1, 1, T, T] to keys fewer than ``window`` tokens back (0: no limit)."""
  t, s = mask.shape[-2:]
  distance = jnp.arange(t)[:, None] - jnp.arange(s)[None, :]
  return mask & ((window == 0) | (distance < window))


def masked_attention(q, k, v, mask, scale, softcap=None):
  """Attention under an explicit boolean ``mask`` [B, 1, 1, T, S] (the KV-cache path)."""
  b, t, n, h = q.shape
  kv = k.shape[2]
  q = q.reshape(b, t, kv, n // kv, h)  # [B, T, K, G, H]
  scores = jnp.einsum("btkgh,bskh->bkgts", q, k).astype(jnp.float32) * scale
  if softcap is not None:
    scores = softcap * jnp.tanh(scores / softcap)
  scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
  probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
  out = jnp.einsum("bkgts,bskh->btkgh", probs, v)
  return out.reshape(b, t, n, h)
