"""y = x @ dequant(W)^T as a differentiable op (gradient for x only: W is frozen; and for an
optional extra pair of columns, ``nf4_matmul(extra=)``).

``impl``: "xla" (the default: dequantize, then XLA's dot), "kernel" (the Mosaic GPU kernels),
or "interpret" (the kernels under Mosaic GPU's CPU interpreter, with the lookup and data path
the interpreter supports; what the tests run). This package decides nothing about devices:
the caller (jaxtune's ``run.choices``, once a run) picks ``impl``; ``kernel_pays`` is the
shape rule it applies per call where it sends decoding's few tokens to the kernel. Where the
kernel measured faster than XLA (experiments/RESULTS.md, bench_nf4_matmul): bfloat16 inputs
of at most ``KERNEL_MAX_TOKENS`` rows (decoding, short prompts) and weights of at least
``KERNEL_MIN_WEIGHTS`` values, on a single Hopper GPU, 1.6-2.4x faster than XLA, which
materialises the bf16 weight on every call. At training sizes XLA dequantizes once per call
into a bf16 weight and runs cuBLAS, which measured 1.11-1.13x a bf16 matmul on the 8B shapes
at 4096 tokens; the kernels (plut lookup, operands made once for the run:
``training_operands``) measured 0.84-1.08x forward and 0.87-1.10x for the input gradient
(session 29, experiments/sweep_nf4_train.py, H100), 0.89-1.22x with their codes permuted and
transposed per call. In the 8B batch-2 step (H100): 1.000x XLA's tokens/s with the LoRA's
product added after the kernel's (session 29), 1.029x with gate/up's LoRA pair inside the
kernel (``extra``; session 30, two runs each), 6.2 GiB less at the peak; the 1B at 8 x 2,048
tokens 0.971x (XLA's dequantization shared by 4x the tokens; the kernels 0.86-1.15x cuBLAS
forward, 1.11-1.43x dx on its shapes); 8B DPO 0.89x. Under a multi-device mesh the kernel
would need a shard_map wrapper that is not written yet. kernel.py imports Mosaic GPU, so it
is loaded the first time "kernel" or "interpret" runs.

The forward kernel's table lookup on the GPU: where the caller passes the codes in word order
(``word_codes``, made once for many calls: jaxtune's decode loop does where the copy fits)
``PREPARED_LOOKUP`` ("plut", 0.92-1.02x the kernel time of "lut", which ran 0.85-0.92x "word",
which ran 0.61-0.87x "prmt", all on an H100) at tiles of at most ``LUT_MAX_TILE`` tokens where
its table fits ("lut" where only that one fits), and at training's ``TRAIN_TILE``-token tiles,
"word" at other widths; for calls of at least ``WORD_PER_CALL_MIN_TOKENS`` tokens (training)
``TRAIN_LOOKUP`` ("plut") on codes permuted per call (or made once for the run:
``word_codes``/``word_codes_t``), forward and input gradient; else "prmt" (``lookup``
forces one for the forward, but a "plut" whose table does not fit runs "lut", and a "lut" that
does not apply runs "word": the same products, only the speed differs; the permutation is a pass
over the codes whatever the tokens, so below that it costs more than the lookup saves).
"""

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import _gpu, nf4
from pallas_kernels.nf4_matmul import reference
from pallas_kernels.nf4_matmul.configs import (
  PREPARED_LOOKUP,
  TRAIN_LOOKUP,
  WORD_PER_CALL_MIN_TOKENS,
  _backward_config,
  _forward_config,
  _kernel,
  _table_lookup,
)

IMPLS = ("kernel", "xla", "interpret")
LOOKUPS = ("prmt", "word", "lut", "plut")  # the forward kernel's on the GPU
WORD_ORDER = ("word", "lut", "plut")  # the lookups that read the codes in word order (word_codes)


KERNEL_MAX_TOKENS = 64
# Below this many weights XLA fuses the dequantization into its small GEMV and wins
# (4096 x 1024 at one token: 4.5 us against the kernel's 8.7 us on an H100).
KERNEL_MIN_WEIGHTS = 2**23


def kernel_pays(tokens: int, weights: int) -> bool:
  """Whether a call of ``tokens`` rows times a weight of ``weights`` values ran faster on the
  kernel than on XLA where it was measured (one Hopper GPU): few tokens, a large weight. A
  shape rule only: whether the kernel can run at all (the device) is the caller's to know."""
  return tokens <= KERNEL_MAX_TOKENS and weights >= KERNEL_MIN_WEIGHTS


def kernel_scales(absmax: jax.Array, nested_absmax: jax.Array, offset: jax.Array) -> jax.Array:
  """The forward kernel's scales [..., K/64, N] (bf16) of a weight, or of a stack of them
  ([L, N, K/64] absmax), in the layout ``nf4_matmul(..., scales=)`` takes."""
  f = lambda a, nested, o: nf4.dequantize_absmax(a, nested, o).T.astype(jnp.bfloat16)  # noqa: E731
  for _ in range(absmax.ndim - 2):
    f = jax.vmap(f)
  return f(absmax, nested_absmax, offset)


def _pad_rows(a: jax.Array, multiple: int) -> jax.Array:
  pad = -a.shape[0] % multiple
  return jnp.pad(a, ((0, pad), (0, 0))) if pad else a


def _kernel_input(x2: jax.Array, cfg) -> jax.Array:
  """x [m, K] as the forward kernel takes it with ``cfg``: rows padded to the tile, or the one
  token as it is (``blocks_as_columns``: the kernel spreads it)."""
  return x2 if cfg.blocks_as_columns else _pad_rows(x2, cfg.block_m)


def _kernel_args(impl: str, lookup: str | None, tokens: int, cfg, extra_cols: int = 0):
  """kernel.forward's lookup and interpreter arguments for ``cfg``: ``lookup`` as it applies
  (``_table_lookup``), by default ``TRAIN_LOOKUP`` from ``WORD_PER_CALL_MIN_TOKENS`` tokens
  (training) and "prmt" below; the interpreter's "select" always."""
  interpret = impl == "interpret"
  if interpret:
    return dict(lookup="select", interpret=_gpu.interpret_params())
  lookup = lookup or (TRAIN_LOOKUP if tokens >= WORD_PER_CALL_MIN_TOKENS else "prmt")
  return dict(lookup=_table_lookup(cfg, lookup, extra_cols), interpret=None)


def _codes_for(lookup: str, codes: jax.Array) -> jax.Array:
  """The kernels' int4 codes for ``lookup`` from codes in bitsandbytes' order: permuted for
  "word", "lut" and "plut", nibbles swapped for the interpreter's "select", viewed as they are for
  "prmt"."""
  kernel = _kernel()
  if lookup in WORD_ORDER:
    return kernel.word_codes(codes)
  return kernel.kernel_codes(codes, swap_nibbles=lookup == "select")


def word_codes(codes: jax.Array) -> jax.Array:
  """The forward kernel's codes for the "word" lookup (reference.word_bytes), uint8 [..., N, K/2]
  (a stack of layers too): made once where one weight serves many calls (decoding), passed as
  ``nf4_matmul(..., word_codes=)``. As many bytes as the codes."""
  return reference.word_bytes(codes)


def training_operands(
  codes: jax.Array, absmax: jax.Array, nested_absmax: jax.Array, offset: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """(word_codes, word_codes_t, scales) of a weight or a stack of them, for ``nf4_matmul``'s
  calls of a training run on the kernels: W's codes and W^T's in word order (as many bytes as
  the codes each) and the bf16 scales, made once instead of on every call."""
  return (
    reference.word_bytes(codes),
    reference.word_bytes(reference.transposed_codes(codes)),
    kernel_scales(absmax, nested_absmax, offset),
  )


def prepared_matmul(
  x: jax.Array, word: jax.Array, scales: jax.Array, *, impl: str = "xla"
) -> jax.Array:
  """x [..., K] @ W^T -> [..., N], forward only (decoding), W [N, K] given as the forward
  kernel's prepared operands: codes uint8 [N, K/2] in "word" order (``word_codes``) and bf16
  scales [K/64, N] (``kernel_scales``). Several weights of one input concatenated along N
  (q/k/v, gate/up) so run as one launch. ``impl`` as in ``nf4_matmul``. Off the kernel, XLA
  forms the weight from the same operands as the kernel does (``reference.prepared_dot``),
  not bitsandbytes' exact values."""
  *lead, k = x.shape
  n = word.shape[0]
  x2 = x.reshape(-1, k)
  if impl not in IMPLS:
    raise ValueError(f"prepared_matmul impl must be one of {', '.join(IMPLS)}, got {impl!r}.")
  use = impl != "xla" and x2.dtype == jnp.bfloat16
  cfg = _forward_config(x2.shape[0], n, k, impl == "interpret") if use else None
  if cfg is None:
    return reference.prepared_dot(x, word, scales)
  y = _forward_kernel(impl, PREPARED_LOOKUP, x2, cfg, scales, word=word)
  return y.astype(x.dtype).reshape(*lead, n)


def _forward_kernel(impl, lookup, x2, cfg, scales, codes=None, word=None, extra=None):
  """kernel.forward of x2 [m, K] (rows padded to the tile and back), the weight as ``codes``
  in bitsandbytes' order or ``word`` in the word lookup's (``word_codes``), whichever the
  lookup (the interpreter: its own) reads; ``extra`` (x_extra [m, E], w_extra [N, E]) added by
  the kernel, its columns zero-padded to a multiple of 16."""
  kernel = _kernel()
  if extra is not None:
    pad = ((0, 0), (0, _extra_width(extra[0].shape[1]) - extra[0].shape[1]))
    ex, ew = (jnp.pad(a.astype(x2.dtype), pad) for a in extra)
    extra = (_kernel_input(ex, cfg), ew)
  kw = _kernel_args(impl, lookup, x2.shape[0], cfg, 0 if extra is None else extra[0].shape[1])
  if kw["lookup"] in WORD_ORDER and word is not None:  # in word order: the int4 view
    w4 = kernel.kernel_codes(word, swap_nibbles=False)
  else:
    w4 = _codes_for(kw["lookup"], reference.word_bytes(word) if codes is None else codes)
  y = kernel.forward(_kernel_input(x2, cfg), w4, scales, config=cfg, extra=extra, **kw)
  return y[: x2.shape[0]]


def _fwd_impl(impl, lookup, x2, weights, scales=None, word=None, extra=None):
  n = weights[0].shape[0]
  use = impl != "xla" and x2.dtype == jnp.bfloat16
  cfg = _forward_config(x2.shape[0], n, x2.shape[1], impl == "interpret") if use else None
  # With ``word``, the codes may be that very array (permuted in place, decoding): every path
  # but the word lookup reads the codes back from it in bitsandbytes' order.
  codes = weights[0] if word is None else None
  if cfg is None:
    codes = reference.word_bytes(word) if codes is None else codes
    if extra is not None:
      return reference.dequantize_then_dot_folded(x2, *extra, codes, *weights[1:])
    return reference.dequantize_then_dot(x2, codes, *weights[1:])
  if scales is None:  # else prepared once for many calls (decoding)
    scales = kernel_scales(*weights[1:])
  fold = extra is not None and _folds(cfg, extra[0].shape[-1])
  y = _forward_kernel(impl, lookup, x2, cfg, scales, codes, word, extra if fold else None)
  if extra is not None and not fold:
    y = y + jnp.einsum("te,ne->tn", extra[0], extra[1].astype(extra[0].dtype)).astype(y.dtype)
  return y


def _folds(cfg, extra_cols: int) -> bool:
  """Whether the forward kernel takes an extra pair ``extra_cols`` wide (padded to 16) into
  its product with ``cfg``: whole products (not split over K, not one token's columns) whose
  shared memory holds its operand tiles beside the pipeline (without a table lookup's table,
  which then falls back: ``_table_lookup``); elsewhere its product is added after."""
  if cfg.split_k > 1 or cfg.blocks_as_columns:
    return False
  kernel = _kernel()
  smem = kernel.forward_smem_bytes(cfg, extra_cols=_extra_width(extra_cols))
  return smem <= kernel.SMEM_BYTES


def _extra_width(cols: int) -> int:
  """An extra pair's columns as the kernel takes them: padded to wgmma's k step of 16."""
  return -(-cols // 16) * 16


def _bwd_impl(impl, dy2, weights, scales=None, word_t=None, dequantize_again=False):
  m, n = dy2.shape
  k = 2 * weights[0].shape[1]
  use = impl != "xla" and dy2.dtype == jnp.bfloat16
  cfg = _backward_config(m, n, k, impl == "interpret") if use else None
  if cfg is None:
    if dequantize_again:
      # The weight is dequantized from its codes once dy exists: XLA can neither merge it with
      # a forward's dequantization (remat recomputes the forward beside this product) nor
      # move it earlier, so no dequantized weight waits from that forward to this product.
      weights, dy2 = jax.lax.optimization_barrier((weights, dy2))
    return reference.dequantize_then_dot_t(dy2, *weights)
  kernel = _kernel()
  # The backward kernel (dy and W's tile both from shared memory) reads no table: word or prmt.
  lookup = None if cfg.transposed else "word" if m >= WORD_PER_CALL_MIN_TOKENS else "prmt"
  kw = _kernel_args(impl, lookup, m, cfg)
  if scales is None:
    scales = kernel_scales(*weights[1:])
  dy2 = _pad_rows(dy2, cfg.block_m)
  if cfg.transposed:
    if word_t is None:  # transposed (and put in word order for its lookup) on every call
      w4 = _codes_for(kw["lookup"], reference.transposed_codes(weights[0]))
    elif kw["lookup"] in WORD_ORDER:  # made once for the run
      w4 = kernel.kernel_codes(word_t, swap_nibbles=False)
    else:  # the interpreter's lookup reads bitsandbytes' order
      w4 = _codes_for(kw["lookup"], reference.word_bytes(word_t))
    return kernel.forward(dy2, w4, scales, config=cfg, **kw)[:m]
  return kernel.backward(dy2, _codes_for(kw["lookup"], weights[0]), scales, config=cfg, **kw)[:m]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _nf4_matmul(
  impl, lookup, again, x2, codes, absmax, nested_absmax, offset, scales, word, word_t, extra
):
  return _fwd_impl(impl, lookup, x2, (codes, absmax, nested_absmax, offset), scales, word, extra)


def _vjp_fwd(
  impl, lookup, again, x2, codes, absmax, nested_absmax, offset, scales, word, word_t, extra
):
  del again  # the backward's
  weights = (codes, absmax, nested_absmax, offset)
  y = _fwd_impl(impl, lookup, x2, weights, scales, word, extra)
  if word is not None and word_t is None:
    # The backward reads bitsandbytes' order (codes may be word order: decoding's in place).
    # With word_t (a training run's operands) the codes are bitsandbytes' own.
    weights = (reference.word_bytes(word), *weights[1:])
  return y, (weights, scales, word_t, extra)


def _vjp_bwd(impl, lookup, again, res, dy2):
  del lookup  # the backward kernel keeps its own
  weights, scales, word_t, extra = res
  dx = _bwd_impl(impl, dy2, weights, scales, word_t, again)
  d_extra = None
  if extra is not None:  # the extra pair's gradients, from dy as they are
    ex, ew = extra
    d_extra = (
      jnp.einsum("tn,ne->te", dy2, ew.astype(dy2.dtype)).astype(ex.dtype),
      jnp.einsum("tn,te->ne", dy2, ex.astype(dy2.dtype)).astype(ew.dtype),
    )
  return (dx, *[None] * 7, d_extra)


_nf4_matmul.defvjp(_vjp_fwd, _vjp_bwd)


def nf4_matmul(
  x: jax.Array,
  codes: jax.Array,
  absmax: jax.Array,
  nested_absmax: jax.Array,
  offset: jax.Array,
  *,
  impl: str = "xla",
  scales: jax.Array | None = None,
  lookup: str | None = None,
  word_codes: jax.Array | None = None,
  word_codes_t: jax.Array | None = None,
  dequantize_again: bool = False,
  extra: tuple[jax.Array, jax.Array] | None = None,
) -> jax.Array:
  """x [..., K] @ dequant(W)^T -> [..., N]; W [N, K] in the 2-D layout of ``pallas_kernels.nf4``.

  ``extra`` = (extra_x [..., E], extra_w [N, E]): adds extra_x @ extra_w^T, differentiable in
  both (a LoRA's scaled x A and B^T, jaxtune.models.layers). XLA's path appends them to x and W
  along K, one dot for both products (``reference.dequantize_then_dot_folded``); the forward kernel
  takes them in by one more wgmma into each tile where its product is whole and their tiles
  fit in its shared memory (``_folds``), else (K split, one token) their product is added to
  its own. The input gradient's kernel leaves them out: their gradients come from dy alone.

  ``scales``: the kernel's bf16 scales [K/64, N] (``kernel_scales``), made once where one
  weight serves many calls (decoding); the forward kernel then reads them instead of
  dequantizing absmax on every call. The XLA path ignores them (it keeps bitsandbytes'
  exact values).

  ``lookup``: the forward kernel's table lookup, one of ``LOOKUPS``, where the kernel runs on the
  GPU (``impl`` "kernel"): where ``word_codes`` (the codes in word
  order, ``word_codes(codes)``, made once for many calls) are given, ``PREPARED_LOOKUP`` ("plut")
  at tiles of at most ``LUT_MAX_TILE`` tokens or of ``TRAIN_TILE`` where its table fits, else
  "lut" where that table fits, else "word" (an asked-for "plut" or "lut" falls back the same
  way); ``TRAIN_LOOKUP`` (the same fallback) where the call has at least
  ``WORD_PER_CALL_MIN_TOKENS`` tokens (then permuted per call); else "prmt"
  (measured on an H100, experiments/log/RESULTS-2026-11.md: "word" 0.61-0.87x the time of "prmt" on
  the 8B shapes at 1-64 tokens, where a per-call permutation costs more than it saves). Every
  path but the kernel's word, lut and plut lookups (XLA's, the interpreter's, "prmt", the
  backward) reads the codes from ``word_codes`` where they are given, put back in bitsandbytes'
  order, so ``codes`` may be the same word-order array (decoding's in-place order,
  ``decoding.codes_in_word_order``).

  ``word_codes_t``: W^T's codes in word order (``training_operands``, made once for a
  training run, with ``word_codes`` and ``scales``): the input gradient's kernel (from
  ``WORD_PER_CALL_MIN_TOKENS`` tokens) reads them instead of transposing the codes on every
  call; ``codes`` must then be in bitsandbytes' order.

  ``dequantize_again``: XLA's input gradient dequantizes W from the codes after dy exists,
  never sharing the dequantized W of a forward product that remat recomputes beside it. That
  is one more dequantization per weight and step for less memory at the backward's peak
  (Llama-3.1-8B, batch 2 x 2,048, full remat: 0.13 GiB less, 3% slower on an H100). The
  kernels hold no dequantized W, so it changes nothing there."""
  lead = x.shape[:-1]
  if lookup is not None and (lookup not in LOOKUPS or impl in ("xla", "interpret")):
    raise ValueError(
      f"nf4_matmul lookup must be one of {', '.join(LOOKUPS)}, for the kernel on the GPU; "
      f"got {lookup!r} with impl {impl!r}."
    )
  if impl not in IMPLS:
    raise ValueError(f"nf4_matmul impl must be one of {', '.join(IMPLS)}, got {impl!r}.")
  x2 = x.reshape(-1, x.shape[-1])
  if extra is not None:
    ex, ew = extra
    if ex.shape[:-1] != lead or ew.shape != (codes.shape[-2], ex.shape[-1]):
      raise ValueError(
        f"nf4_matmul extra: expected x_extra [{', '.join(map(str, lead))}, E] and w_extra "
        f"[{codes.shape[-2]}, E], got {ex.shape} and {ew.shape}."
      )
    extra = (ex.reshape(-1, ex.shape[-1]), ew)
  if lookup is None and word_codes is not None:
    lookup = PREPARED_LOOKUP
  y = _nf4_matmul(
    impl,
    lookup,
    dequantize_again,
    x2,
    codes,
    absmax,
    nested_absmax,
    offset,
    scales,
    word_codes,
    word_codes_t,
    extra,
  )
  return y.reshape(*lead, y.shape[-1])
