"""Flash attention with a custom VJP, and the dispatcher between its implementations.

"mosaic":    the Hopper kernels of kernel.py (forward saves the output and log-sum-exp only;
             the backward recomputes the probabilities block by block).
"interpret": the same kernels in Mosaic GPU's CPU interpreter (tests).
"cudnn":     jax.nn.dot_product_attention's cuDNN kernel; no segments, softcap or traced window.
"xla":       reference.py under XLA autodiff ([T, T] scores: small shapes only).
Left unset: "mosaic" on Hopper when the kernel takes the inputs (bf16/f16, head_dim a multiple
of 64 up to 256); otherwise "cudnn" on an NVIDIA GPU when the options allow it, else "xla".

Interpret mode runs each kernel's three warpgroups as concurrent CPU computations that wait on
each other: it needs at least three XLA CPU threads (several CPU devices, as the tests fake,
or more than two cores).
"""

import functools
import logging

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from pallas_kernels import _gpu
from pallas_kernels.flash_attention import kernel, kernel_backward, reference

IMPLEMENTATIONS = ("mosaic", "interpret", "cudnn", "xla")


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
  implementation: str | None = None,
  blocks: kernel.Blocks | None = None,
) -> jax.Array:
  """Softmax attention. q [B, T, N, H], k/v [B, T, K, H] with N a multiple of K -> [B, T, N, H].

  segment_ids [B, T] int: tokens see only keys of their own id. window (int or traced int32
  scalar): keys fewer than ``window`` positions back (0: no limit). softcap: scores become
  cap * tanh(s / cap). scale: default 1/sqrt(H).
  """
  b, t, n, h = q.shape
  if k.shape != v.shape or k.shape[:2] != (b, t) or k.shape[3] != h or n % k.shape[2]:
    raise ValueError(f"q {q.shape}, k {k.shape}, v {v.shape}: want [B,T,N,H], [B,T,K,H], K | N")
  scale = h**-0.5 if scale is None else float(scale)
  softcap = None if softcap is None else float(softcap)
  static_window = _static_int(window)
  if implementation is None:
    implementation = default_implementation(
      segmented=segment_ids is not None,
      softcap=softcap,
      static_window=static_window,
      dtype=q.dtype,
      head_dim=h,
    )
  if implementation == "xla":
    return reference.attention(
      q, k, v, segment_ids=segment_ids, causal=causal, window=window, softcap=softcap,
      scale=scale,
    )  # fmt: skip
  if implementation == "cudnn":
    if segment_ids is not None or softcap is not None or static_window is None:
      raise ValueError("cudnn attention takes neither segment ids, softcap nor a traced window.")
    local = (static_window - 1, 0 if causal else t) if static_window > 0 else None
    return jax.nn.dot_product_attention(
      q, k, v, scale=scale, is_causal=causal, local_window_size=local, implementation="cudnn"
    )
  if implementation not in ("mosaic", "interpret"):
    raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}.")
  if q.dtype not in (jnp.bfloat16, jnp.float16) or k.dtype != q.dtype or v.dtype != q.dtype:
    raise ValueError(f"the kernel takes bf16 or f16 q, k, v; got {q.dtype}, {k.dtype}, {v.dtype}.")
  if h % 64 or h > 256:
    raise ValueError(f"the kernel takes head_dim 64, 128, 192 or 256; got {h}.")

  blocks = blocks or kernel.Blocks.for_head_dim(h)
  opts = kernel.Options(
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


def default_implementation(
  *, segmented=False, softcap=None, static_window=0, dtype=jnp.bfloat16, head_dim=128
) -> str:
  kernel_ok = dtype in (jnp.bfloat16, jnp.float16) and head_dim % 64 == 0 and head_dim <= 256
  if _gpu.on_hopper():
    if kernel_ok:
      return "mosaic"
    _log_once(f"flash attention: no kernel for {jnp.dtype(dtype).name} head_dim {head_dim}")
  cudnn_ok = not segmented and softcap is None and static_window is not None
  if jax.default_backend() == "gpu" and cudnn_ok:
    return "cudnn"
  return "xla"


@functools.cache
def _log_once(message: str) -> None:
  logging.getLogger(__name__).warning("%s; using the fallback.", message)


def _uniform_segments(seg):
  """[B, T] ids -> [B, T / 64]: each block's id where all its 64 tokens share one, else MIXED.

  The kernels skip the per-element segment compare for pairs of blocks with the same id.
  """
  b, t = seg.shape
  blocks = seg.reshape(b, t // kernel.SEGMENT_BLOCK, kernel.SEGMENT_BLOCK)
  lo, hi = blocks.min(axis=-1), blocks.max(axis=-1)
  return jnp.where(lo == hi, lo, kernel.MIXED).astype(jnp.int32)


def _static_int(x):
  """The Python int behind ``x``, or None when it is traced."""
  try:
    return int(x)
  except (jax.errors.ConcretizationTypeError, TypeError):
    return None


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8))
def _flash(q, k, v, seg, uniform, win, opts, blocks, interpret):
  out, _ = kernel.forward(q, k, v, seg, uniform, win, opts, blocks, interpret)
  return out


def _flash_fwd(q, k, v, seg, uniform, win, opts, blocks, interpret):
  out, lse = kernel.forward(q, k, v, seg, uniform, win, opts, blocks, interpret)
  # Named for remat policies that keep the attention (jaxtune's remat="activations").
  out, lse = checkpoint_name(out, "attention_out"), checkpoint_name(lse, "attention_lse")
  return out, (q, k, v, seg, uniform, win, out, lse)


def _flash_bwd(opts, blocks, interpret, res, do):
  q, k, v, seg, uniform, win, out, lse = res
  do = do.astype(q.dtype)
  delta = jnp.einsum("btnh,btnh->bnt", out.astype(jnp.float32), do.astype(jnp.float32))
  args = (q, k, v, do, lse, delta, seg, uniform, win, opts, blocks, interpret)
  if blocks.fused_dq and q.shape[-1] == 128:
    dq_acc = jax.new_ref(jnp.zeros(q.shape, jnp.float32))
    dk, dv = kernel_backward.backward_dkv(*args, dq_acc=dq_acc)
    dq = (dq_acc[...] * opts.scale).astype(q.dtype)
  else:
    dq = kernel_backward.backward_dq(*args)
    dk, dv = kernel_backward.backward_dkv(*args)
  return dq, dk, dv, None, None, None


_flash.defvjp(_flash_fwd, _flash_bwd)
