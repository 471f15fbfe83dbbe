"""Flash attention with a custom VJP, run by the implementation its caller names.

"mosaic":    the Hopper kernels of kernel.py (forward saves the output and log-sum-exp only;
             the backward recomputes the probabilities block by block).
"interpret": the same kernels in Mosaic GPU's CPU interpreter (tests).
"cudnn":     jax.nn.dot_product_attention's cuDNN kernel; no segments, softcap or traced window.
"xla":       reference.py under XLA autodiff ([T, T] scores: small shapes only).
Nothing here chooses: the caller decides once (jaxtune's runtime), with ``mosaic_supports``
and ``cudnn_supports`` saying what each kernel can compute. kernel.py and kernel_backward.py
import Mosaic GPU, so they are loaded the first time "mosaic" or "interpret" runs.

Interpret mode runs each kernel's three warpgroups as concurrent CPU computations that wait on
each other: it needs at least three XLA CPU threads (several CPU devices, as the tests fake,
or more than two cores).
"""

import functools

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.typing import DTypeLike

from pallas_kernels import _gpu
from pallas_kernels.flash_attention import reference
from pallas_kernels.flash_attention.options import MIXED, SEGMENT_BLOCK, Blocks, Options

IMPLEMENTATIONS = ("mosaic", "interpret", "cudnn", "xla")
_KERNEL_DTYPES = (jnp.bfloat16, jnp.float16)


def flash_attention(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  *,
  segment_ids: jax.Array | None = None,
  causal: bool = True,
  window: int | jax.Array = 0,
  softcap: float | None = None,
  scale: float | None = None,
  implementation: str,
  blocks: Blocks | None = None,
) -> jax.Array:
  """Softmax attention. q [B, T, N, H], k/v [B, T, K, H] with N a multiple of K -> [B, T, N, H].

  segment_ids [B, T] int: tokens see only keys of their own id. window (int or traced int32
  scalar): keys fewer than ``window`` positions back (0: no limit). softcap: scores become
  cap * tanh(s / cap). scale: default 1/sqrt(H). implementation: one of ``IMPLEMENTATIONS``.
  """
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(
      f"implementation must be one of {', '.join(IMPLEMENTATIONS)}, got {implementation!r}."
    )
  b, t, n, h = q.shape
  if k.shape != v.shape or k.shape[:2] != (b, t) or k.shape[3] != h or n % k.shape[2]:
    raise ValueError(f"q {q.shape}, k {k.shape}, v {v.shape}: want [B,T,N,H], [B,T,K,H], K | N")
  scale = h**-0.5 if scale is None else float(scale)
  softcap = None if softcap is None else float(softcap)
  static_window = _static_int(window)
  if implementation == "xla":
    return reference.attention(
      q, k, v, segment_ids=segment_ids, causal=causal, window=window, softcap=softcap,
      scale=scale,
    )  # fmt: skip
  if implementation == "cudnn":
    if not cudnn_supports(segmented=segment_ids is not None, softcap=softcap, window=window):
      raise ValueError("cudnn attention takes neither segment ids, softcap nor a traced window.")
    local = (static_window - 1, 0 if causal else t) if static_window > 0 else None
    return jax.nn.dot_product_attention(
      q, k, v, scale=scale, is_causal=causal, local_window_size=local, implementation="cudnn"
    )
  if q.dtype not in _KERNEL_DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
    raise ValueError(f"the kernel takes bf16 or f16 q, k, v; got {q.dtype}, {k.dtype}, {v.dtype}.")
  if h % 64 or h > 256:
    raise ValueError(f"the kernel takes head_dim 64, 128, 192 or 256; got {h}.")

  blocks = blocks or Blocks.for_head_dim(h)
  opts = Options(
    seq_len=t,
    scale=scale,
    causal=causal,
    softcap=softcap,
    windowed=static_window != 0,
    segmented=segment_ids is not None,
  )
  interpret = _gpu.interpret_params() if implementation == "interpret" else None
  pad = -t % blocks.multiple
  if segment_ids is None:
    seg = uniform = jnp.zeros((1, 16), jnp.int32)  # never read
  else:
    seg = jnp.pad(segment_ids.astype(jnp.int32), ((0, 0), (0, pad)), constant_values=-1)
    uniform = _uniform_segments(seg)
  win = jnp.asarray(window, jnp.int32).reshape(1)
  rows = ((0, 0), (0, pad), (0, 0), (0, 0))
  q, k, v = (jnp.pad(x, rows) for x in (q, k, v))
  return _flash(q, k, v, seg, uniform, win, opts, blocks, interpret)[:, :t]


def mosaic_supports(dtype: DTypeLike, head_dim: int) -> bool:
  """Whether the Mosaic kernels take q, k, v of this dtype and head dim (on a Hopper GPU:
  ``pallas_kernels._gpu.on_hopper``)."""
  return jnp.dtype(dtype) in _KERNEL_DTYPES and head_dim % 64 == 0 and head_dim <= 256


def cudnn_supports(*, segmented: bool, softcap: float | None, window: int | jax.Array) -> bool:
  """Whether "cudnn" computes this attention: no segment ids, no softcap, and a window that is
  a Python int (cuDNN compiles it in; a traced per-layer window it cannot take)."""
  return not segmented and softcap is None and _static_int(window) is not None


@functools.cache
def _kernels():
  """(kernel, kernel_backward), imported on first use: importing them loads Mosaic GPU."""
  from pallas_kernels.flash_attention import kernel, kernel_backward

  return kernel, kernel_backward


def _uniform_segments(seg):
  """[B, T] ids -> [B, T / 64]: each block's id where all its 64 tokens share one, else MIXED.

  The kernels skip the per-element segment compare for pairs of blocks with the same id.
  """
  b, t = seg.shape
  blocks = seg.reshape(b, t // SEGMENT_BLOCK, SEGMENT_BLOCK)
  lo, hi = blocks.min(axis=-1), blocks.max(axis=-1)
  return jnp.where(lo == hi, lo, MIXED).astype(jnp.int32)


def _static_int(x):
  """The Python int behind ``x``, or None when it is traced."""
  try:
    return int(x)
  except (jax.errors.ConcretizationTypeError, TypeError):
    return None


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8))
def _flash(q, k, v, seg, uniform, win, opts, blocks, interpret):
  kernel, _ = _kernels()
  out, _ = kernel.forward(q, k, v, seg, uniform, win, opts, blocks, interpret)
  return out


def _flash_fwd(q, k, v, seg, uniform, win, opts, blocks, interpret):
  kernel, _ = _kernels()
  out, lse = kernel.forward(q, k, v, seg, uniform, win, opts, blocks, interpret)
  # Named for remat policies that keep the attention (jaxtune's remat="activations").
  out, lse = checkpoint_name(out, "attention_out"), checkpoint_name(lse, "attention_lse")
  return out, (q, k, v, seg, uniform, win, out, lse)


def _flash_bwd(opts, blocks, interpret, res, do):
  q, k, v, seg, uniform, win, out, lse = res
  do = do.astype(q.dtype)
  delta = jnp.einsum("btnh,btnh->bnt", out.astype(jnp.float32), do.astype(jnp.float32))
  args = (q, k, v, do, lse, delta, seg, uniform, win, opts, blocks, interpret)
  _, kernel_backward = _kernels()
  dq = kernel_backward.backward_dq(*args)
  dk, dv = kernel_backward.backward_dkv(*args)
  return dq, dk, dv, None, None, None


_flash.defvjp(_flash_fwd, _flash_bwd)
