"""Softmax attention in plain jnp, with the options of the kernel. Materialises [T, T] scores."""

import jax
import jax.numpy as jnp


def visible(
  t: int,
  *,
  segment_ids: jax.Array | None = None,
  causal: bool = True,
  window: int | jax.Array = 0,
  batch: int = 1,
) -> jax.Array:
  """[B, T, T] boolean: may query i see key j.

  causal: j <= i. window > 0: i - j < window (keys fewer than ``window`` positions back; 0 is
  no limit; it may be a traced scalar). segment_ids [B, T]: only equal ids (0 is padding, which
  therefore sees only padding).
  """
  i = jnp.arange(t)[:, None]
  j = jnp.arange(t)[None, :]
  ok = jnp.ones((t, t), jnp.bool_)
  if causal:
    ok &= j <= i
  window = jnp.asarray(window)
  ok &= (window <= 0) | (i - j < window)
  ok = jnp.broadcast_to(ok, (batch, t, t))
  if segment_ids is not None:
    ok &= segment_ids[:, :, None] == segment_ids[:, None, :]
  return ok


def attention(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  *,
  segment_ids: jax.Array | None = None,
  causal: bool = True,
  window: int | jax.Array = 0,
  softcap: float | None = None,
  scale: float | None = None,
) -> jax.Array:
  """q [B, T, N, H], k/v [B, T, K, H] (N a multiple of K) -> [B, T, N, H] in q's dtype.

  Scores, softmax and the weighted sum in float32.
  """
  b, t, n, h = q.shape
  kv = k.shape[2]
  scale = h**-0.5 if scale is None else scale
  qg = q.reshape(b, t, kv, n // kv, h).astype(jnp.float32)  # [B, T, K, G, H]
  s = jnp.einsum("btkgh,bskh->bkgts", qg, k.astype(jnp.float32)) * scale
  if softcap is not None:
    s = softcap * jnp.tanh(s / softcap)
  mask = visible(t, segment_ids=segment_ids, causal=causal, window=window, batch=b)
  s = jnp.where(mask[:, None, None], s, -jnp.inf)
  # A row that sees nothing (never with causal or segments, which keep the diagonal) gives 0.
  p = jax.nn.softmax(s, axis=-1)
  p = jnp.where(jnp.isnan(p), 0.0, p)
  out = jnp.einsum("bkgts,bskh->btkgh", p, v.astype(jnp.float32))
  return out.reshape(b, t, n, h).astype(q.dtype)
