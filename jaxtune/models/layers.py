"""The building blocks of every model: linear (dense or NF4, with optional LoRA), norm, embedding.

Every variable carries ``axes``: one logical name per dimension (DESIGN.md, Mesh). Layers that
live inside the scanned stack are built with ``layers=L`` and get a leading ``layers`` axis;
inside the scan each sees its own slice and the code below reads as if there were one layer.
Weights keep PyTorch's [out, in] orientation so that the converter table is an identity on
layout and bitsandbytes' bytes can be stored as they are.
"""

import itertools
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from jax.typing import DTypeLike

from jaxtune.errors import ConfigError
from jaxtune.nf4_storage import NF4Storage
from pallas_kernels import nf4
from pallas_kernels.nf4_matmul import kernel_pays, nf4_matmul, prepared_matmul


def _stacked(layers: int | None, shape: tuple[int, ...], axes: tuple) -> tuple[tuple, tuple]:
  if layers is None:
    return shape, axes
  return (layers, *shape), ("layers", *axes)


def dense(frozen: tuple[jax.Array, ...], dtype: DTypeLike) -> jax.Array:
  """A weight [out, in] in ``dtype`` from one layer's ``Linear.frozen_arrays``."""
  if len(frozen) == 4:
    return nf4.dequantize_linear(*frozen, dtype)
  return frozen[0].astype(dtype)


def nf4_storage(shape: tuple[int, ...], axes: tuple) -> tuple[NF4Storage, ...]:
  """(codes, absmax, nested_absmax, offset) of NF4 weights [..., out, in] (leading stacked
  dims as ``shape`` has them, logical ``axes`` per dim), starting as exact zeros (code 7 is
  0.0); from_pretrained fills them from a checkpoint."""
  *lead, out_features, in_features = shape
  return (
    NF4Storage(jnp.full((*lead, out_features, in_features // 2), 0x77, jnp.uint8), axes=axes),
    NF4Storage(
      jnp.zeros((*lead, out_features, in_features // nf4.BLOCKSIZE), jnp.uint8), axes=axes
    ),
    NF4Storage(
      jnp.zeros((*lead, nf4.nested_size(out_features, in_features)), jnp.float32),
      axes=axes[:-2] + (None,),
    ),
    NF4Storage(jnp.zeros(lead, jnp.float32), axes=axes[:-2]),
  )


class Linear(nnx.Module):
  """y = x W^T (+ b) (+ scale * dropout(x) A B). W is frozen: NF4 storage or a dense Param."""

  def __init__(
    self,
    in_features: int,
    out_features: int,
    *,
    axes: tuple[str | None, str | None],
    quantized: bool,
    use_bias: bool = False,
    layers: int | None = None,
    param_dtype: DTypeLike = jnp.float32,
    rngs: nnx.Rngs,
  ):
    self.in_features = in_features
    self.out_features = out_features
    self.axes = axes
    self.layers = layers
    self.quantized = quantized
    shape, vaxes = _stacked(layers, (out_features, in_features), axes)
    if quantized:
      if in_features % nf4.BLOCKSIZE:
        raise ConfigError(
          f"NF4 needs the input size of a linear layer to be a multiple of {nf4.BLOCKSIZE}, "
          f"got {in_features}; load this model with quantization=None."
        )
      self.codes, self.absmax, self.nested_absmax, self.offset = nf4_storage(shape, vaxes)
    else:
      std = 1.0 / math.sqrt(in_features)
      weight = std * jax.random.truncated_normal(rngs.params(), -2.0, 2.0, shape, jnp.float32)
      self.weight = nnx.Param(weight.astype(param_dtype), axes=vaxes)
    if use_bias:
      bshape, baxes = _stacked(layers, (out_features,), axes[:1])
      self.bias = nnx.Param(jnp.zeros(bshape, param_dtype), axes=baxes)
    else:
      self.bias = None
    self.lora_a = nnx.data(None)  # LoRAParam once apply_lora runs
    self.lora_b = nnx.data(None)
    self.lora_scale = 0.0  # a float, or a LoRAConstant [layers] when ranks differ by layer
    self.lora_mask = nnx.data(None)  # LoRAConstant [layers, rank]: 1 below each layer's rank
    self.lora_dropout = 0.0
    # The NF4 kernel's operands made once instead of on each call: its bf16 scales, and its
    # codes in "word" lookup order where memory allows (kernel_operands.prepare_kernel_operands, for
    # every token step); W^T's codes in that order too for the input gradient (a training
    # run on the kernels, step.place).
    self.kernel_scales = nnx.data(None)
    self.kernel_codes = nnx.data(None)
    self.kernel_codes_t = nnx.data(None)

  def frozen_arrays(self) -> tuple[jax.Array, ...]:
    """The frozen weight as stored: (codes, absmax, nested_absmax, offset) if NF4, else
    (weight,); stacked over layers where the layers are."""
    if self.quantized:
      return tuple(v[...] for v in (self.codes, self.absmax, self.nested_absmax, self.offset))
    return (self.weight[...],)

  def dense_weight(self, dtype: DTypeLike, layer: int | None = None) -> jax.Array:
    """The frozen weight [out, in] in ``dtype`` (dequantized if NF4); one layer if stacked."""
    held = self.frozen_arrays()
    return dense(held if layer is None else tuple(x[layer] for x in held), dtype)

  def __call__(
    self,
    x: jax.Array,
    dropout_key: jax.Array | None = None,
    nf4_impl: str = "xla",
    frozen_out: jax.Array | None = None,
    dequantize_again: bool = False,
    lora_in: tuple[jax.Array, int] | None = None,
  ) -> jax.Array:
    """``nf4_impl``: how an NF4 weight multiplies (``Runtime.nf4_matmul``: "xla", "kernel",
    "interpret", or "few-tokens": ``call_impl``).
    ``frozen_out``: x W^T computed already (decoding runs several weights of one input in
    one kernel launch, ``Fused``); the bias and LoRA are added here.
    ``dequantize_again``: the input gradient dequantizes an NF4 weight anew
    (``Runtime.dequantize_again``, nf4_matmul's argument).
    ``lora_in`` = (inputs [..., E], start): the LoRA's scaled x A (``lora_input``) of this
    layer and of others that read the same x, this layer's in columns start .. start + rank;
    an NF4 layer then folds its LoRA into the frozen product (``lora_inputs``)."""
    extra = None  # the LoRA's pair folded into the NF4 product
    if frozen_out is not None:
      y = frozen_out
    elif self.quantized:
      if lora_in is not None and self.lora_a is not None:
        inputs, start = lora_in
        bt = jnp.swapaxes(self.lora_b[...], -1, -2).astype(x.dtype)  # [N, rank] at start
        extra = (inputs, jnp.pad(bt, ((0, 0), (start, inputs.shape[-1] - start - bt.shape[1]))))
      parts = (self.codes[...], self.absmax[...], self.nested_absmax[...], self.offset[...])
      scales = None if self.kernel_scales is None else self.kernel_scales[...]
      word = None if self.kernel_codes is None else self.kernel_codes[...]
      word_t = None if self.kernel_codes_t is None else self.kernel_codes_t[...]
      impl = call_impl(nf4_impl, x.size // x.shape[-1], self.in_features * self.out_features)
      with jax.named_scope("nf4_matmul"):
        y = nf4_matmul(
          x,
          *parts,
          impl=impl,
          scales=scales,
          word_codes=word,
          word_codes_t=word_t,
          dequantize_again=dequantize_again,
          extra=extra,
        )
    else:
      y = jnp.einsum("...i,oi->...o", x, self.dense_weight(x.dtype))
    if self.bias is not None:
      y = y + self.bias[...].astype(y.dtype)
    if self.lora_a is not None and extra is None:
      y = y + self._lora_term(x, self.lora_b[...], dropout_key).astype(y.dtype)
    return y

  def lora_input(self, x: jax.Array, dropout_key: jax.Array | None = None) -> jax.Array:
    """scale * dropout(x) @ A [..., rank] in x's dtype (the columns past a layer's rank zero):
    what B multiplies."""
    h = x
    if self.lora_dropout > 0.0 and dropout_key is not None:
      keep = jax.random.bernoulli(dropout_key, 1.0 - self.lora_dropout, x.shape)
      h = jnp.where(keep, x / (1.0 - self.lora_dropout), 0).astype(x.dtype)
    with jax.named_scope("lora"):
      ha = checkpoint_name(h @ self.lora_a[...].astype(h.dtype), "lora_a")
      scale = self.lora_scale
      if self.lora_mask is not None:  # ranks per layer: columns past this layer's rank are off
        ha = ha * self.lora_mask[...].astype(ha.dtype)
        scale = scale[...].astype(h.dtype)
      return (scale * ha).astype(h.dtype)

  def _lora_term(
    self, x: jax.Array, b: jax.Array, dropout_key: jax.Array | None = None
  ) -> jax.Array:
    """scale * (dropout(x) @ A) @ b, in x's dtype (b: B or some of its output columns)."""
    h = self.lora_input(x, dropout_key)
    with jax.named_scope("lora"):
      return h @ b.astype(x.dtype)

  def rows(self, x: jax.Array, start: jax.Array, size: int) -> jax.Array:
    """Outputs ``start .. start + size - 1`` only (a dense, unstacked layer, no dropout): the
    output layer one vocabulary piece at a time."""
    if self.quantized:
      raise NotImplementedError("rows() reads a dense weight; NF4 output layers are not built.")
    w = jax.lax.dynamic_slice_in_dim(self.weight[...], start, size, 0).astype(x.dtype)
    y = jnp.einsum("...i,oi->...o", x, w)
    if self.bias is not None:
      y = y + jax.lax.dynamic_slice_in_dim(self.bias[...], start, size, 0).astype(y.dtype)
    if self.lora_a is not None:
      b = jax.lax.dynamic_slice_in_dim(self.lora_b[...], start, size, 1)
      y = y + self._lora_term(x, b).astype(y.dtype)
    return y


def lora_inputs(
  x: jax.Array, layers: Sequence["Linear"], keys: Sequence[jax.Array | None]
) -> list[tuple[jax.Array, int] | None]:
  """Each layer's ``lora_in`` for NF4 layers that read the same ``x`` (gate and up): their
  LoRA inputs side by side, one array, so the products' concatenation of x with them is one
  copy that every layer's folded product shares. None for a layer without LoRA or NF4."""
  takes = [lyr.quantized and lyr.lora_a is not None for lyr in layers]
  if not any(takes):
    return [None] * len(layers)
  parts = [lyr.lora_input(x, k) for lyr, k, t in zip(layers, keys, takes, strict=True) if t]
  inputs = jnp.concatenate(parts, axis=-1)
  starts = iter(itertools.accumulate([0, *(p.shape[-1] for p in parts)]))
  return [(inputs, next(starts)) if t else None for t in takes]


def call_impl(nf4_matmul: str, tokens: int, weights: int) -> str:
  """The ``impl`` of one NF4 product of ``tokens`` rows times ``weights`` values under a run's
  ``nf4_matmul`` (``Runtime.nf4_matmul``, decided by the run's resolve): "few-tokens" sends the
  shapes the kernel measured faster on (``kernel_pays``: decoding) to it, the rest to XLA; any
  other setting is the impl itself."""
  if nf4_matmul == "few-tokens":
    return "kernel" if kernel_pays(tokens, weights) else "xla"
  return nf4_matmul


class Fused(nnx.Module):
  """Decoding only (kernel_operands.prepare_kernel_operands): the NF4 kernel's operands of several
  linear layers that read one input (q/k/v, gate/up), their output rows concatenated, so one
  kernel launch computes all of them: codes in "word" order [..., N, K/2] and bf16 scales
  [..., K/64, N], N the sum of the layers' outputs (stacked over layers where they are)."""

  def __init__(self, codes: jax.Array, scales: jax.Array, sizes: tuple[int, ...]):
    self.codes = nnx.data(codes)
    self.scales = nnx.data(scales)
    self.sizes = sizes

  def __call__(self, x: jax.Array, nf4_impl: str = "xla") -> list[jax.Array]:
    """Each layer's x W^T (no bias, no LoRA: ``Linear(..., frozen_out=)`` adds them)."""
    impl = call_impl(nf4_impl, x.size // x.shape[-1], x.shape[-1] * sum(self.sizes))
    with jax.named_scope("nf4_matmul"):
      y = prepared_matmul(x, self.codes[...], self.scales[...], impl=impl)
    ends = [sum(self.sizes[: i + 1]) for i in range(len(self.sizes) - 1)]
    return jnp.split(y, ends, axis=-1)


class LoRAConstant(nnx.Variable):
  """Per-layer LoRA constants when ranks (or alphas) differ by layer: the scale [layers] and
  the rank mask [layers, max rank]. Frozen: not a LoRAParam, no optimizer sees it."""


class RMSNorm(nnx.Module):
  """x / rms(x) scaled by w (or by 1 + w, Gemma), in float32, as transformers computes it:
  cast to x's dtype before the scale (Llama) or after it (Gemma, gpt-oss)."""

  def __init__(
    self,
    dim: int,
    *,
    eps: float,
    layers: int | None = None,
    plus_one: bool = False,
    f32_scale: bool = False,
    param_dtype: DTypeLike = jnp.float32,
  ):
    shape, axes = _stacked(layers, (dim,), ("embed",))
    init = jnp.zeros if plus_one else jnp.ones  # both start as the identity scale
    self.weight = nnx.Param(init(shape, param_dtype), axes=axes)
    self.eps = eps
    self.plus_one = plus_one
    self.f32_scale = f32_scale  # w times the float32 normalised x, then cast (gpt-oss)

  def __call__(self, x: jax.Array) -> jax.Array:
    with jax.named_scope("rms_norm"):
      h = x.astype(jnp.float32)
      h = h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + self.eps)
      if self.plus_one:  # Gemma scales in float32, then casts
        return (h * (1.0 + self.weight[...].astype(jnp.float32))).astype(x.dtype)
      if self.f32_scale:
        return (self.weight[...].astype(jnp.float32) * h).astype(x.dtype)
      return self.weight[...].astype(x.dtype) * h.astype(x.dtype)


class Embed(nnx.Module):
  def __init__(self, vocab: int, dim: int, *, param_dtype: DTypeLike = jnp.float32, rngs: nnx.Rngs):
    table = jax.random.normal(rngs.params(), (vocab, dim), jnp.float32) * 0.02
    self.embedding = nnx.Param(table.astype(param_dtype), axes=("vocab", "embed"))

  def __call__(self, ids: jax.Array, dtype: DTypeLike) -> jax.Array:
    return jnp.take(self.embedding[...], ids, axis=0).astype(dtype)

  def attend(
    self, x: jax.Array, start: int | jax.Array | None = None, size: int | None = None
  ) -> jax.Array:
    """Logits through the tied embedding: [..., D] -> [..., V], or only entries
    ``start .. start + size - 1`` of the vocabulary."""
    table = self.embedding[...]
    if size is not None:
      table = jax.lax.dynamic_slice_in_dim(table, start, size, 0)
    return jnp.einsum("...d,vd->...v", x, table.astype(x.dtype))
