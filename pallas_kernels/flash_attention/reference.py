"""Softmax attention in plain jnp, with the options of the kernel. Materialises [T, T] scores."""

import jax
import jax.numpy as jnp


def visible(
  t: int,
  *,
  segment_ids: jax.Array | None = None,
  kv_segment_ids: jax.Array | None = None,
  causal: bool = True,
  window: int | jax.Array = 0,
  batch: int = 1,
) -> jax.Array:
  """[B, T, T] boolean: may query i see key j.

  causal: j <= i. window > 0: i - j < window (keys fewer than ``window`` positions back; 0 is
  no limit; it may be a traced scalar). segment_ids [B, T]: only equal ids (0 is padding, which
  therefore sees only padding). kv_segment_ids [B, T]: the keys' ids where they differ from the
  queries' (``segment_ids``): query i sees key j only where segment_ids[i] == kv_segment_ids[j].
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
    kv_ids = segment_ids if kv_segment_ids is None else kv_segment_ids
    ok &= segment_ids[:, :, None] == kv_ids[:, None, :]
  return ok


def attention(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  *,
  segment_ids: jax.Array | None = None,
  kv_segment_ids: jax.Array | None = None,
  causal: bool = True,
  window: int | jax.Array = 0,
  softcap: float | None = None,
  scale: float | None = None,
  return_lse: bool = False,
  sinks: jax.Array | None = None,
) -> jax.Array | tuple[jax.Array, jax.Array]:
  """q [B, T, N, H], k/v [B, T, K, H] (N a multiple of K) -> [B, T, N, H] in q's dtype.

  Scores, softmax and the weighted sum in float32. return_lse: also the log-sum-exp of each
  query's visible scores, [B, N, T] float32. A query that sees no key gets out 0 and lse -inf,
  and passes no gradient. ``sinks`` [N] (gpt-oss): a learned logit per head in every row's
  softmax denominator, attending to nothing (the lse includes it; a row that sees no key
  then gets out 0 and lse = its sink).
  """
  b, t, n, h = q.shape
  kv = k.shape[2]
  scale = h**-0.5 if scale is None else scale
  qg = q.reshape(b, t, kv, n // kv, h).astype(jnp.float32)  # [B, T, K, G, H]
  s = jnp.einsum("btkgh,bskh->bkgts", qg, k.astype(jnp.float32)) * scale
  if softcap is not None:
    s = softcap * jnp.tanh(s / softcap)
  mask = visible(
    t, segment_ids=segment_ids, kv_segment_ids=kv_segment_ids, causal=causal, window=window,
    batch=b,
  )  # fmt: skip
  s = jnp.where(mask[:, None, None], s, -jnp.inf)
  m = s.max(axis=-1, keepdims=True)
  if sinks is not None:
    sink = sinks.astype(jnp.float32).reshape(1, kv, n // kv, 1, 1)
    m = jnp.maximum(m, sink)
  # Rows that see nothing take m = 0 and l = 1, which no gradient reaches: no inf - inf, no 1/0.
  seen = m > -jnp.inf
  m = jax.lax.stop_gradient(jnp.where(seen, m, 0.0))
  e = jnp.exp(s - m)  # 0 at masked keys
  l = jnp.where(seen, e.sum(axis=-1, keepdims=True), 1.0)
  if sinks is not None:
    l = l + jnp.exp(sink - m)  # seen everywhere: m >= sink > -inf
  out = jnp.einsum("bkgts,bskh->btkgh", e / l, v.astype(jnp.float32))
  out = out.reshape(b, t, n, h).astype(q.dtype)
  if not return_lse:
    return out
  lse = jnp.where(seen, m + jnp.log(l), -jnp.inf)[..., 0]  # [B, K, G, T]
  return out, lse.reshape(b, n, t)
