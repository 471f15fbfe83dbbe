"""Flash attention with a custom VJP, run by the implementation its caller names.

"mosaic":    the Hopper kernels of kernel.py (forward saves the output and log-sum-exp only;
             the backward recomputes the probabilities block by block).
"interpret": the same kernels in Mosaic GPU's CPU interpreter (tests).
"cudnn":     jax.nn.dot_product_attention's cuDNN kernel; no segments, softcap, traced window
             or log-sum-exp.
"xla":       reference.py under XLA autodiff ([T, T] scores: small shapes only).
Nothing here chooses: the caller decides once (jaxtune's runtime), with ``mosaic_supports``
and ``cudnn_supports`` saying what each kernel can compute. kernel.py and kernel_backward.py
import Mosaic GPU, so they are loaded the first time "mosaic" or "interpret" runs.

Interpret mode runs each kernel's three warpgroups as concurrent CPU computations that wait on
each other: it needs at least three XLA CPU threads (several CPU devices, as the tests fake,
or more than two cores).
"""

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
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
  kv_segment_ids: jax.Array | None = None,
  causal: bool = True,
  window: int | jax.Array = 0,
  softcap: float | None = None,
  scale: float | None = None,
  return_lse: bool = False,
  implementation: str,
  blocks: Blocks | None = None,
) -> jax.Array | tuple[jax.Array, jax.Array]:
  """Softmax attention. q [B, T, N, H], k/v [B, T, K, H] with N a multiple of K -> [B, T, N, H].

  segment_ids [B, T] int: tokens see only keys of their own id. kv_segment_ids [B, T] int: the
  keys' ids where they differ from the queries' (default: ``segment_ids``), as for a block of
  keys from another device in ring attention. window (int or traced int32 scalar): keys fewer
  than ``window`` positions back (0: no limit). softcap: scores become cap * tanh(s / cap).
  scale: default 1/sqrt(H). return_lse: return (out, lse) with lse [B, N, T] float32, the
  natural log of the sum of exp(score) over the keys a query sees, to merge blocks of keys by.
  A query that sees no key gets out 0, lse -inf and no gradient. implementation: one of
  ``IMPLEMENTATIONS``.
  """
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(
      f"implementation must be one of {', '.join(IMPLEMENTATIONS)}, got {implementation!r}."
    )
  b, t, n, h = q.shape
  if k.shape != v.shape or k.shape[:2] != (b, t) or k.shape[3] != h or n % k.shape[2]:
    raise ValueError(f"q {q.shape}, k {k.shape}, v {v.shape}: want [B,T,N,H], [B,T,K,H], K | N")
  if kv_segment_ids is not None and segment_ids is None:
    raise ValueError("kv_segment_ids are the keys' ids beside the queries' segment_ids: pass both.")
  scale = h**-0.5 if scale is None else float(scale)
  softcap = None if softcap is None else float(softcap)
  static_window = _static_int(window)
  if implementation == "xla":
    return reference.attention(
      q, k, v, segment_ids=segment_ids, kv_segment_ids=kv_segment_ids, causal=causal,
      window=window, softcap=softcap, scale=scale, return_lse=return_lse,
    )  # fmt: skip
  if implementation == "cudnn":
    segmented = segment_ids is not None
    if not cudnn_supports(
      segmented=segmented, softcap=softcap, window=window, return_lse=return_lse
    ):
      raise ValueError(
        "cudnn attention takes neither segment ids, softcap, a traced window nor return_lse."
      )
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
    kv_segmented=kv_segment_ids is not None,
  )
  interpret = _gpu.interpret_params() if implementation == "interpret" else None
  pad = -t % blocks.multiple
  unread = jnp.zeros((1, 2, 16), jnp.int32)
  if segment_ids is None:
    segs = (*(unread[0],) * 4, unread)  # never read
  else:
    # Padded queries and keys both get -1: they match each other, nothing real sees them.
    ids = lambda x: jnp.pad(x.astype(jnp.int32), ((0, 0), (0, pad)), constant_values=-1)
    q_seg = ids(segment_ids)
    q_uni = _uniform_segments(q_seg)
    if kv_segment_ids is None:
      segs = (q_seg, q_uni, q_seg, q_uni, _segment_spans(q_seg))
    else:  # the keys' own ids: no spans (Options.kv_segmented)
      kv_seg = ids(kv_segment_ids)
      segs = (q_seg, q_uni, kv_seg, _uniform_segments(kv_seg), unread)
  win = jnp.asarray(window, jnp.int32).reshape(1)
  rows = ((0, 0), (0, pad), (0, 0), (0, 0))
  q, k, v = (jnp.pad(x, rows) for x in (q, k, v))
  if not return_lse:
    return _flash(q, k, v, segs, win, opts, blocks, interpret, False)[:, :t]
  out, lse = _flash(q, k, v, segs, win, opts, blocks, interpret, True)
  return out[:, :t], lse[:, :, :t]


def mosaic_supports(dtype: DTypeLike, head_dim: int) -> bool:
  """Whether the Mosaic kernels take q, k, v of this dtype and head dim (on a Hopper GPU:
  ``pallas_kernels._gpu.on_hopper``)."""
  return jnp.dtype(dtype) in _KERNEL_DTYPES and head_dim % 64 == 0 and head_dim <= 256


def cudnn_supports(
  *, segmented: bool, softcap: float | None, window: int | jax.Array, return_lse: bool = False
) -> bool:
  """Whether "cudnn" computes this attention: no segment ids (of queries or keys), no softcap,
  no log-sum-exp returned, and a window that is a Python int (cuDNN compiles it in; a traced
  per-layer window it cannot take)."""
  return not segmented and softcap is None and not return_lse and _static_int(window) is not None


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


def _segment_spans(seg):
  """[B, T] ids -> [B, 2, T / 64] int32: for each block of 64 rows, the first position that
  holds any of its rows' ids, and one past the last such position.

  A query sees no key outside its rows' span, nor a key any query outside its span: the
  kernels skip those blocks rather than mask them (in packed rows, the other documents).
  Exact for any ids: a stable sort groups each id's positions in order.
  """
  b, t = seg.shape
  order = jnp.argsort(seg, axis=1, stable=True)
  ids = jnp.take_along_axis(seg, order, axis=1)
  step = ids[:, 1:] != ids[:, :-1]
  edge = jnp.ones((b, 1), jnp.bool_)
  at = jnp.arange(t, dtype=jnp.int32)
  starts = lax.cummax(jnp.where(jnp.concatenate([edge, step], 1), at, 0), axis=1)
  ends = lax.cummin(jnp.where(jnp.concatenate([step, edge], 1), at, t), axis=1, reverse=True)
  first = jnp.take_along_axis(order, starts, axis=1)  # each sorted row's id's first position
  last = jnp.take_along_axis(order, ends, axis=1)
  back = jnp.argsort(order, axis=1)  # sorted index of each position
  first = jnp.take_along_axis(first, back, axis=1).reshape(b, -1, SEGMENT_BLOCK).min(-1)
  last = jnp.take_along_axis(last, back, axis=1).reshape(b, -1, SEGMENT_BLOCK).max(-1)
  return jnp.stack([first, last + 1], axis=1).astype(jnp.int32)


def _static_int(x):
  """The Python int behind ``x``, or None when it is traced."""
  try:
    return int(x)
  except (jax.errors.ConcretizationTypeError, TypeError):
    return None


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8))
def _flash(q, k, v, segs, win, opts, blocks, interpret, with_lse):
  """out, or (out, lse) with with_lse. segs: the queries' ids and ``_uniform_segments``, then
  the keys'."""
  kernel, _ = _kernels()
  out, lse = kernel.forward(q, k, v, *segs, win, opts, blocks, interpret)
  return (out, _natural_lse(lse)) if with_lse else out


def _flash_fwd(q, k, v, segs, win, opts, blocks, interpret, with_lse):
  kernel, _ = _kernels()
  out, lse = kernel.forward(q, k, v, *segs, win, opts, blocks, interpret)
  # Named for remat policies that keep the attention (jaxtune's remat="activations").
  out, lse = checkpoint_name(out, "attention_out"), checkpoint_name(lse, "attention_lse")
  res = (q, k, v, segs, win, out, lse)
  return ((out, _natural_lse(lse)) if with_lse else out), res


def _natural_lse(lse):
  """The kernel's log2-based lse, +inf where a query sees no key (its P is then 0), -> natural
  log, -inf there."""
  return jnp.where(lse == jnp.inf, -jnp.inf, lse * math.log(2))


def _flash_bwd(opts, blocks, interpret, with_lse, res, g):
  q, k, v, segs, win, out, lse = res
  do, dlse = g if with_lse else (g, None)
  do = do.astype(q.dtype)
  delta = jnp.einsum("btnh,btnh->bnt", out.astype(jnp.float32), do.astype(jnp.float32))
  if dlse is not None:
    # d lse_i / d s_ij = P_ij (natural units, as the kernels' dS): dS = P * (dP - delta + dlse).
    # A row that sees nothing (lse +inf here) has P = 0: its dlse (a merge may send a huge one,
    # e.g. logaddexp's exp(-total)) must not make 0 * inf.
    delta = delta - jnp.where(lse == jnp.inf, 0.0, dlse)
  args = (q, k, v, do, lse, delta, *segs, win, opts, blocks, interpret)
  _, kernel_backward = _kernels()
  dq = kernel_backward.backward_dq(*args)
  dk, dv = kernel_backward.backward_dkv(*args)
  return dq, dk, dv, None, None


_flash.defvjp(_flash_fwd, _flash_bwd)
