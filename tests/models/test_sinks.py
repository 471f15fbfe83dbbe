"""gpt-oss's attention sinks (a learned logit per head in the softmax's denominator) in the
cached path (jaxtune.models.attention.masked_attention) and in the flash op's jnp reference
(pallas_kernels.flash_attention.reference), against transformers' gpt-oss
eager_attention_forward: values, and the reference's gradients of q, k, v and the sinks
against autodiff of a direct softmax over [scores, sink]."""

from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jaxtune.models import attention
from pallas_kernels.flash_attention import reference


def _case(seed=0, b=2, t=7, n=4, kv=2, h=16):
  rng = np.random.default_rng(seed)
  q, k, v = (rng.standard_normal((b, t, x, h)).astype(np.float32) for x in (n, kv, kv))
  sinks = (rng.standard_normal(n) * 2).astype(np.float32)
  return q, k, v, sinks


def _transformers(q, k, v, sinks, scale, causal_mask):
  from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

  module = SimpleNamespace(
    sinks=torch.from_numpy(sinks), num_key_value_groups=q.shape[2] // k.shape[2], training=False
  )
  bias = torch.from_numpy(np.where(causal_mask, 0.0, -np.inf).astype(np.float32))[None, None]
  t = lambda a: torch.from_numpy(a).transpose(1, 2)  # noqa: E731  [B, heads, T, H]
  out, _ = eager_attention_forward(module, t(q), t(k), t(v), bias, scale)
  return out.numpy()  # [B, T, N, H]


def test_sinks_match_transformers_in_both_paths():
  q, k, v, sinks = _case()
  scale = 16**-0.5
  t = q.shape[1]
  causal = np.tril(np.ones((t, t), bool))
  want = _transformers(q, k, v, sinks, scale, causal)
  got = attention.masked_attention(
    jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(causal)[None, None, None],
    scale, sinks=jnp.asarray(sinks),
  )  # fmt: skip
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  ref = reference.attention(
    jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), scale=scale, sinks=jnp.asarray(sinks)
  )
  np.testing.assert_allclose(ref, want, rtol=1e-5, atol=1e-6)
  plain = reference.attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), scale=scale)
  assert np.abs(np.asarray(plain) - want).max() > 1e-2  # the sinks change the output


@pytest.mark.slow
def test_reference_gradients_with_sinks_over_packed_segments_and_padding():
  q, k, v, sinks = _case(1)
  scale = 0.3
  seg = jnp.asarray([[1, 1, 1, 2, 2, 2, 0], [1, 1, 1, 1, 1, 1, 1]], jnp.int32)  # 0: padding
  probe = jnp.asarray(np.random.default_rng(2).standard_normal(q.shape), jnp.float32)

  def flash(q, k, v, s):
    out = reference.attention(q, k, v, segment_ids=seg, scale=scale, sinks=s)
    return jnp.sum(out * probe)

  def direct(q, k, v, s):
    b, t, n, h = q.shape
    kv = k.shape[2]
    kk, vv = (jnp.repeat(a, n // kv, axis=2) for a in (k, v))
    scores = jnp.einsum("btnh,bsnh->bnts", q, kk) * scale
    mask = reference.visible(t, segment_ids=seg, batch=b)[:, None]
    scores = jnp.where(mask, scores, -jnp.inf)
    sink = jnp.broadcast_to(s[None, :, None, None], (b, n, t, 1))
    probs = jax.nn.softmax(jnp.concatenate([scores, sink], -1), -1)[..., :-1]
    return jnp.sum(jnp.einsum("bnts,bsnh->btnh", probs, vv) * probe)

  args = tuple(jnp.asarray(a) for a in (q, k, v, sinks))
  np.testing.assert_allclose(flash(*args), direct(*args), rtol=1e-5)
  got = jax.grad(flash, argnums=(0, 1, 2, 3))(*args)
  want = jax.grad(direct, argnums=(0, 1, 2, 3))(*args)
  for a, b in zip(got, want, strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
  assert np.all(np.isfinite(np.asarray(got[3]))) and np.any(np.asarray(got[3]))
