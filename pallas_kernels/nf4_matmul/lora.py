"""y = x @ dequant(W)^T + scale * (x @ A) @ B with the adapter's down-projection in W's dot.

Unfused, LoRA reads the activations a second time for x @ A [..., r] and, in the backward,
adds dy @ W and g @ A^T, a second pass over dx. Here A^T rides along as r extra rows of the
weight: the forward is one dot of x against [W ; A^T] ([N + r, K]) whose last r columns are
h = x @ A, and the backward's dx is one dot of [dy, g] against the same stacked weight. Only
h ([..., r]) is kept besides the inputs; the dequantized W is rebuilt in the backward, as in
``ops.nf4_matmul``. Always XLA's dequantize-then-dot (the Mosaic kernel has no LoRA rows).
"""

import functools

import jax
import jax.numpy as jnp

from jaxtune import nf4


def _stacked_weight(codes, absmax, nested_absmax, offset, a, dtype) -> jax.Array:
  """[W ; A^T]: [N + r, K] in ``dtype``."""
  w = nf4.dequantize_linear(codes, absmax, nested_absmax, offset, dtype)
  return jnp.concatenate([w, a.T.astype(dtype)], axis=0)


def _forward(scale, x, codes, absmax, nested_absmax, offset, a, b):
  n = codes.shape[0]
  wa = _stacked_weight(codes, absmax, nested_absmax, offset, a, x.dtype)
  yh = jnp.einsum("...k,nk->...n", x, wa)  # [..., N + r]
  y, h = yh[..., :n], yh[..., n:]
  y = y + (scale * (h @ b.astype(x.dtype))).astype(y.dtype)
  return y, h


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _nf4_lora_matmul(scale, x, codes, absmax, nested_absmax, offset, a, b):
  return _forward(scale, x, codes, absmax, nested_absmax, offset, a, b)[0]


def _vjp_fwd(scale, x, codes, absmax, nested_absmax, offset, a, b):
  y, h = _forward(scale, x, codes, absmax, nested_absmax, offset, a, b)
  return y, (x, codes, absmax, nested_absmax, offset, a, b, h)


def _vjp_bwd(scale, res, dy):
  x, codes, absmax, nested_absmax, offset, a, b, h = res
  dy = dy.astype(x.dtype)
  db = scale * jnp.einsum("...r,...n->rn", h, dy)  # [r, N], summed over all leading dims
  g = scale * (dy @ b.T.astype(x.dtype))  # [..., r]
  da = jnp.einsum("...k,...r->kr", x, g)  # [K, r]
  wa = _stacked_weight(codes, absmax, nested_absmax, offset, a, x.dtype)
  dx = jnp.einsum("...n,nk->...k", jnp.concatenate([dy, g], axis=-1), wa)
  return dx, None, None, None, None, da.astype(a.dtype), db.astype(b.dtype)


_nf4_lora_matmul.defvjp(_vjp_fwd, _vjp_bwd)


def nf4_lora_matmul(x, codes, absmax, nested_absmax, offset, a, b, scale: float) -> jax.Array:
  """x [..., K] @ dequant(W)^T + scale * (x @ a) @ b -> [..., N].

  W [N, K] in the 2-D layout of ``jaxtune.nf4`` (frozen: no gradient), a [K, r], b [r, N];
  the products run in x.dtype. Gradients for x, a and b.
  """
  k, r = a.shape
  if x.shape[-1] != k or b.shape != (r, codes.shape[0]):
    raise ValueError(
      f"nf4_lora_matmul: x {x.shape}, a {a.shape}, b {b.shape} do not fit W "
      f"[{codes.shape[0]}, {2 * codes.shape[1]}]."
    )
  return _nf4_lora_matmul(float(scale), x, codes, absmax, nested_absmax, offset, a, b)
