"""Attention: causal, grouped-query, packed segments.

Three implementations:
  "xla":   plain einsums with the full [T, T] mask; handles packed segments. The reference.
  "pallas": pallas_kernels.flash_attention: the Mosaic GPU flash kernel on Hopper (segments,
           sliding window as a traced per-layer value, softcap; nothing [T, T]); elsewhere that
           op's own fallback (cuDNN where the options allow, else its jnp reference). Under a
           data x tensor mesh the kernel runs per shard in a ``shard_map`` (batch over data,
           heads over tensor): a custom call has no partitioning rule of its own.
  "fused": jax.nn.dot_product_attention, causal only: cuDNN's fused kernel on NVIDIA GPUs
           (asked for explicitly: left to choose, JAX picks its XLA version, which
           materialises float32 scores), jax.nn's XLA version elsewhere. Exact when each
           row holds one document followed by padding, since causal attention never lets
           a real token see the padding after it; it does NOT separate
           several packed documents (the trainer refuses it for packed data).
The default (``default_implementation``): "fused" on a GPU where it computes the same
function, else "pallas" on Hopper (packed rows, softcaps, windows), else "xla".
"""

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from pallas_kernels import _gpu
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
# Tests only: the Pallas kernels in Mosaic GPU's CPU interpreter.
PALLAS_INTERPRET = "pallas_interpret"


def default_implementation(*, softcap=False, window=False, packed=False) -> str:
  """The fastest implementation that computes the model's attention on this device.

  cuDNN where it can (one document per row, no softcap or window): in the 1B train step on an
  H100 it measured 2.5% faster than the Pallas kernel and compiles in seconds, not ~18 s.
  """
  if jax.default_backend() == "gpu" and not (softcap or window or packed):
    return "fused"
  if _gpu.on_hopper():
    return "pallas"
  return "xla"


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
  mesh=None,
):
  """Causal self-attention within documents. q [B, T, N, H], k/v [B, T, K, H] -> [B, T, N, H].

  N is a multiple of K (GQA/MQA). ``segment_ids`` [B, T] int: tokens attend only within their
  segment (0 = padding). ``window`` (int or traced scalar, 0 = none): keys fewer than that many
  positions back. ``softcap``: cap * tanh(scores / cap) (Gemma 2). "fused" reads neither
  segments, window nor softcap (the caller checks it may use it). ``mesh``: the data x tensor
  mesh q, k, v are sharded over ("pallas" runs per shard on it).
  """
  with jax.named_scope("attention"):
    return _attention(q, k, v, segment_ids, scale, window, softcap, implementation, mesh)


def _attention(q, k, v, segment_ids, scale, window, softcap, implementation, mesh):
  if implementation in ("pallas", PALLAS_INTERPRET):
    kernel = "interpret" if implementation == PALLAS_INTERPRET else None
    return _flash_sharded(q, k, v, segment_ids, window, scale, softcap, kernel, mesh)
  if implementation == "fused":
    impl = "cudnn" if jax.default_backend() == "gpu" else "xla"
    return jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=True, implementation=impl)
  mask = window_mask(make_mask(segment_ids), window)
  return masked_attention(q, k, v, mask, scale, softcap)


def _flash_sharded(q, k, v, segment_ids, window, scale, softcap, kernel, mesh):
  """The flash kernel, per (data, tensor) shard of a mesh with more than one device."""

  def flash(q, k, v, segment_ids, window):
    return flash_attention(
      q, k, v, segment_ids=segment_ids, causal=True, window=window, softcap=softcap,
      scale=scale, implementation=kernel,
    )  # fmt: skip

  if mesh is None or mesh.size == 1:
    return flash(q, k, v, segment_ids, window)
  heads = P("data", None, "tensor", None)
  return jax.shard_map(
    flash,
    mesh=mesh,
    in_specs=(heads, heads, heads, P("data", None), P()),
    out_specs=heads,
    check_vma=False,
  )(q, k, v, segment_ids, jnp.asarray(window, jnp.int32))


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
