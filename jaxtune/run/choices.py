"""The choices ``resolve`` takes one concern at a time: attention, ring attention's blocks,
the NF4 matmul of the training step and generation's operands. Each is a pure function of the
settings, the model config and the device, measured where it says."""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax

from jaxtune.errors import MeshError, UserError
from jaxtune.models.decoding import WIDE_ROWS
from jaxtune.parallel import runtime
from jaxtune.parallel.runtime import Decode, operand_bytes
from pallas_kernels.flash_attention import mosaic_supports

if TYPE_CHECKING:
  from jaxtune.models.config import ModelConfig


# Training on the Pallas NF4 kernels by default (``resolve_nf4_matmul``) where they measured
# faster than XLA's dequantize-then-dot in the step, on one H100 (experiments/RESULTS.md,
# sessions 30-31): Llama-3.1-8B at 2 x 2,048 tokens a call 1.026-1.044x XLA's tokens/s over
# four run pairs (1.044x since the grid order of session 31; 1.017x in session 29), in 31.7 GiB
# at the peak against 37.9; Llama-3.2-1B at 8 x 2,048 0.971x. XLA's dequantization is a cost
# per weight that a call's tokens share (its time over cuBLAS bf16: 1.11-1.13 at 4,096 tokens,
# 1.00-1.04 at 16,384, 1.04-1.07 at 8,192), while the kernels' (codes made once) was
# 0.77-1.08 on the 8B's shapes at 4,096 tokens and 0.86-1.15 forward, 1.11-1.43 input gradient
# on the 1B's at 16,384. Supervised fine-tuning only: DPO on the kernels (8B, 2 rows of 2,304
# tokens) ran 0.89x XLA's tokens/s. From ``TRAIN_KERNEL_MIN_TOKENS`` the input gradient is the
# forward kernel on W^T's codes (made once with the rest), as measured; below, another kernel.
TRAIN_KERNEL_MIN_TOKENS = 2048  # a call's tokens (rows x positions of a micro-batch)
TRAIN_KERNEL_MAX_TOKENS = 4096
TRAIN_KERNEL_MIN_HIDDEN = 4096  # the model's width, the K of most of its products


def resolve_grouped_matmul(cfg: ModelConfig, device: jax.Device) -> str:
  """How a mixture of experts' grouped products run: "tiles" (groups padded to tiles of one
  group, XLA's batched matmul) on a GPU, where XLA's ragged_dot lowers to a slow loop (H200,
  Qwen3-30B-A3B's expert shapes, experiments/bench_moe.py: the products 6.1x faster at 4,096
  tokens, 11.1x at 16,384; a sparse layer's LoRA step 28 ms against 218, and ragged_dot's
  backward needed ~100 GiB); "ragged_dot" elsewhere (CPUs: no padding)."""
  return "tiles" if cfg.is_moe and device.platform == "gpu" else "ragged_dot"


def resolve_nf4_matmul(
  requested: str | None, cfg: ModelConfig, *, method: str, quantized: bool, tokens: int | None,
  devices: int, device: jax.Device, dtype: str, free: int | None,
) -> str:  # fmt: skip
  """``requested`` where set; else "kernel" for supervised fine-tuning of an NF4 model on one
  Hopper GPU in bfloat16 where a call has ``TRAIN_KERNEL_MIN_TOKENS`` to
  ``TRAIN_KERNEL_MAX_TOKENS`` tokens, the model is at least ``TRAIN_KERNEL_MIN_HIDDEN`` wide
  and the kernels' operands, made once for the run (``step.kernel_operands``), fit beside the
  loaded model in half of what is left of ``free`` bytes (the device's, before loading): where
  the kernels measured faster. Else, on one Hopper GPU, "few-tokens" (the kernel for the
  shapes it measured faster on, ``pallas_kernels.nf4_matmul.kernel_pays``: decoding's few
  tokens), and "xla" elsewhere. ``tokens`` None: not known yet (no --seq-len before the data
  is read)."""
  if requested is not None:
    return requested
  if (
    method == "sft"
    and quantized
    and devices == 1
    and runtime.on_hopper(device)
    and dtype == "bfloat16"
    and tokens is not None
    and TRAIN_KERNEL_MIN_TOKENS <= tokens <= TRAIN_KERNEL_MAX_TOKENS
    and cfg.hidden_size >= TRAIN_KERNEL_MIN_HIDDEN
    and free is not None
    and kernel_operand_bytes(cfg) <= (free - loaded_bytes(cfg)) // 2
  ):
    return "kernel"
  return few_tokens_or_xla(devices, device)


def few_tokens_or_xla(devices: int, device: jax.Device) -> str:
  """ "few-tokens" where the NF4 kernel runs (one Hopper GPU), else "xla"."""
  return "few-tokens" if devices == 1 and runtime.on_hopper(device) else "xla"


def kernel_operand_bytes(cfg: ModelConfig) -> int:
  """The training kernels' operands of an NF4 model (``operand_bytes`` of its codes)."""
  return operand_bytes(cfg.linear_params() // 2)


def loaded_bytes(cfg: ModelConfig) -> int:
  """About what an NF4 model takes on the device: the linear layers' codes and absmax (a byte
  per 64 weights) and the rest (embeddings, output layer, norms) in bf16."""
  linear = cfg.linear_params()
  return linear // 2 + linear // 64 + 2 * (cfg.num_params() - linear)


def resolve_attention(
  requested: str | None,
  cfg: ModelConfig,
  *,
  dtype: str,
  packed: bool,
  pipelined: bool = False,
  device: jax.Device | None = None,
) -> tuple[str, str | None]:
  """(the attention implementation that runs, a note when it is not what was asked).

  Unset: cuDNN on a GPU where it computes the model's function (one document per row, no
  softcap or window: measured 2.5% faster than the Pallas kernel in the 1B train step on an
  H100, and compiles in seconds), else the Pallas kernel on Hopper, else XLA. Under a
  pipeline (cuDNN does not run inside the stages) the Pallas kernel on Hopper, else XLA: on
  each stage's rows where the stages run manual over every axis (8B on 4 H200s, `--mesh
  1x1x4`: 1.50x XLA's tokens/s), split by the partitioner through custom_partitioning where
  they are manual over pipe only (a tensor axis or --shard-frozen; `1x2x2`: 1.37x).
  Refuses what cannot compute the model's function.
  """
  device = device or jax.devices()[0]
  gpu, hopper = device.platform == "gpu", runtime.on_hopper(device)
  special = bool(cfg.attn_logit_softcap) or cfg.has_sliding_layers
  cudnn_exact = gpu and not (special or packed)
  kernel_ok = hopper and mosaic_supports(dtype, cfg.head_dim)
  if cfg.attention_sinks:  # only XLA's attention adds the sinks to the softmax yet
    if requested in ("fused", "pallas"):
      raise UserError(
        f"--attention {requested} cannot apply {cfg.model_type}'s attention sinks; use "
        "--attention xla (the default for this model)."
      )
    return "xla", None
  if requested == "fused" and pipelined:
    raise MeshError(
      "--attention fused (cuDNN) cannot run inside the pipeline yet; use --attention xla or "
      "pallas with a pipe axis in --mesh."
    )
  if requested == "fused":
    if special:
      raise UserError(
        f"--attention fused cannot apply {cfg.model_type}'s logit softcap or sliding window; "
        "use --attention pallas or xla."
      )
    if packed:
      raise UserError(
        "--attention fused (cuDNN, causal only) would let packed examples attend to each "
        "other; use --attention pallas or xla, or --no-packing."
      )
    return ("cudnn", None) if gpu else ("xla", "xla attention (fused is cuDNN, GPU only)")
  if requested == "pallas":
    if kernel_ok:
      return "mosaic", None
    return "flash_xla", "flash attention's jnp reference (the kernel needs a Hopper GPU)"
  if requested == "xla":
    return "xla", None
  if cudnn_exact and not pipelined:
    return "cudnn", None
  return ("mosaic", None) if kernel_ok else ("xla", None)


def resolve_ring_blocks(
  requested: str | None, cfg: ModelConfig, *, dtype: str, device: jax.Device
) -> tuple[str, str | None]:
  """(how ring attention computes its chunk pairs, a note when it is not what was asked).

  Unset or --attention pallas: the flash op per chunk pair, the Pallas kernel on Hopper (16-bit
  inputs). Measured on 4 H200s (experiments/RESULTS.md, bench_ring and bench_cli_mesh): 8-16x
  faster than XLA's tiles, which ran the 8B 32k-token step at 0.13 of linear against 0.94.
  Unset elsewhere, or --attention xla: XLA's tiles; --attention pallas off Hopper: the op's jnp
  reference (tests). The flash op needs a model without sliding windows (it masks by index, and
  a window reaching across two chunks would need their distance): XLA's tiles there.
  """
  if requested not in (None, "pallas"):
    return "xla", None
  if cfg.has_sliding_layers:
    note = "ring attention by XLA tiles (sliding windows span chunks)"
    return "xla", note if requested == "pallas" else None
  if runtime.on_hopper(device) and mosaic_supports(dtype, cfg.head_dim):
    return "mosaic", None
  if requested is None:
    return "xla", None
  note = "ring blocks by flash attention's jnp reference (the kernel: Hopper, 16-bit inputs)"
  return "flash_xla", note


def resolve_decode(
  cfg: ModelConfig, *, devices: int, device: jax.Device, free: int | None, owns_model: bool = False
) -> Decode:
  """How generation computes for model ``cfg`` (``Decode``): where the NF4 kernel runs (a
  single Hopper GPU), its codes in word order where that copy of an NF4 model's codes takes at
  most half of what ``free`` bytes (the device's, before loading) leave beside the loaded model
  (the kernel 0.61-0.87x the time with them; the loop's own temporaries need the rest); else,
  for a caller that ``owns_model`` (``python -m jaxtune.generate``), the model's own codes
  permuted for the loop; else none. Its NF4 products "few-tokens" there, else XLA's; on a GPU
  the loop of at least ``decoding.WIDE_ROWS`` rows compiled with the wide batches' options."""
  wide = WIDE_ROWS if device.platform == "gpu" else None
  nf4 = few_tokens_or_xla(devices, device)
  if nf4 == "xla":
    return Decode(word_codes=False, nf4_matmul=nf4, wide_rows=wide)
  fits = free is not None and cfg.linear_params() // 2 <= (free - loaded_bytes(cfg)) // 2
  word = True if fits else "inplace" if owns_model else False
  return Decode(word_codes=word, nf4_matmul=nf4, wide_rows=wide)
