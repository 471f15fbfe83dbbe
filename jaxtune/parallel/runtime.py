"""How a run computes, decided once: the frozen ``Runtime`` and the one function that resolves it.

A run's settings (``RunConfig``) say what the user asked for; a model config says what the
network is; the devices and the data say where and on what it runs. ``resolve`` turns those
into a ``Runtime`` (mesh, compute dtype, remat policy, attention implementation, NF4 matmul,
loss/MLP chunks, pipeline micro-batches, sequence parallelism) and raises every refusal of an
impossible combination there, as one ``UserError`` sentence, before anything is built. The
model reads its choices from the ``Runtime`` passed to it; nothing changes them afterwards.

Attention, as resolved (``Runtime.attention``), names exactly the code that runs:
  "xla"        jaxtune.models.attention's masked einsum ([T, T] mask; packing, windows, softcaps)
  "cudnn"      cuDNN's fused kernel (jax.nn.dot_product_attention): causal, one document per
               row, no softcap or window
  "mosaic"     the Pallas flash kernel (Mosaic GPU, Hopper), per (data, tensor) shard
  "interpret"  the same kernel in Mosaic GPU's CPU interpreter (tests)
  "flash_xla"  the flash op's own jnp reference, per shard: ``--attention pallas`` where the
               kernel cannot run (no Hopper GPU, or a dtype/head size it does not take)
  "ring"       a ``context`` mesh axis: ring attention over the pieces of each sequence
               (context.py), each block by XLA
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxtune.errors import MeshError, UserError
from jaxtune.parallel import mesh as meshlib
from jaxtune.parallel import pipeline, sharding
from jaxtune.parallel import ring_attention as context
from jaxtune.run_config import AUTO_LOSS_CHUNK, AUTO_REMAT, REMAT, RunConfig
from pallas_kernels.flash_attention import mosaic_supports

if TYPE_CHECKING:
  from jaxtune.models.config import ModelConfig

ATTENTION = ("xla", "cudnn", "mosaic", "interpret", "flash_xla", "ring")
NF4_MATMUL = ("auto", "kernel", "xla", "interpret")  # interpret: the kernel on CPU (tests)
FLASH = ("mosaic", "interpret", "flash_xla")  # run per shard through the flash op
GROUPED_REMAT = ("full", "lean", "offload")  # those --remat-group applies to
# With --loss-chunk, vocabularies larger than this (Gemma's 256k) are also cut into pieces
# (losses._vocab); up to it, a frozen output layer's pieces take their own gradient
# (losses.fused_loss_sums).
LARGE_VOCAB = 200_000
# --loss-chunk unset, supervised fine-tuning on GPUs with a frozen output layer: the loss in
# pieces of about this many tokens (rows x tokens per row) through losses.fused_loss_sums,
# which is faster than the whole float32 logits as well as leaner (8B on an H100: 1.02x at
# batch 2, 1.01x at batch 4; experiments/RESULTS.md, session 23).
FUSED_PIECE_TOKENS = 4096


@dataclasses.dataclass(frozen=True)
class Runtime:
  """Every run-time choice that changes how, not what, the model computes.

  The default is one device, no remat, XLA attention: what a plain forward pass (export,
  generation, tests) runs. ``mesh`` is None on one device.
  """

  mesh: Mesh | None = None
  dtype: str = "float32"  # the compute dtype the model is built in
  remat: str = "none"
  attention: str = "xla"
  # "ring" attention's chunk pairs: "xla" (tiles, any mask) or a FLASH name (models without a
  # sliding window: the flash op per pair, merged by its log-sum-exp)
  ring_blocks: str = "xla"
  nf4_matmul: str = "auto"  # "auto": the kernel for few tokens on one Hopper GPU (nf4_matmul)
  loss_chunk: int = 0  # > 0: float32 logits for this many tokens per row at a time
  mlp_chunk: int = 0  # > 0: the MLP runs this many tokens per row at a time
  # > 1: remat keeps the input of every group of this many layers only (models/decoder.py
  # GROUP_POLICIES: full, lean, offload)
  remat_group: int = 1
  # > 0 (remat full): the first this many layers keep their activations as remat
  # "activations" does, the others keep only their inputs (models/decoder.py)
  kept_layers: int = 0
  # > 0: plan.choose may keep the activations of some of these first layers under full
  # remat where remat activations does not fit and full does (the model's layer count)
  keep_up_to: int = 0
  microbatches: int = 1  # pipeline micro-batches per step (1 without a pipe axis)
  sequence_parallel: bool = False  # the residual stream's tokens split over tensor
  shard_frozen: bool = False  # NF4 storage also split over data, gathered per layer
  host_embeddings: bool = False  # the input embedding rows come with the batch (trainer.py)
  scan_layers: bool = True  # False: a Python loop over the layers (--layer-loop unrolled)
  # plan.choose compiles remat "activations" with the layers unrolled first, and keeps that
  # program where its memory plan fits (--layer-loop auto, one GPU)
  try_unrolled: bool = False
  # (remat, loss_chunk) settings to choose from by their memory plan, fastest first (plan.py);
  # remat and loss_chunk hold the first until the choice. Empty: nothing to choose.
  candidates: tuple[tuple[str, int], ...] = ()
  memory_limit: float | None = None  # GiB per device the choice must fit; None: the device's
  notes: tuple[str, ...] = ()  # why a choice differs from what was asked

  def __post_init__(self):
    if self.remat not in REMAT:
      raise ValueError(f"remat must be one of {REMAT}, got {self.remat!r}")
    if self.attention not in ATTENTION:
      raise ValueError(f"attention must be one of {ATTENTION}, got {self.attention!r}")
    if self.ring_blocks not in ("xla", *FLASH):
      raise ValueError(f"ring_blocks must be xla or one of {FLASH}, got {self.ring_blocks!r}")
    if self.nf4_matmul not in NF4_MATMUL:
      raise ValueError(f"nf4_matmul must be one of {NF4_MATMUL}, got {self.nf4_matmul!r}")
    if self.remat_group < 1:
      raise ValueError(f"remat_group must be at least 1, got {self.remat_group}")
    if self.remat_group > 1 and self.remat not in GROUPED_REMAT:
      raise ValueError(f"remat_group > 1 needs remat in {GROUPED_REMAT}, got {self.remat!r}")
    if self.remat_group > 1 and self.pipelined:
      raise ValueError("remat_group > 1 does not run inside a pipeline (a pipe axis)")
    if not self.scan_layers and self.pipelined:
      raise ValueError("unrolled layers do not run inside a pipeline (a pipe axis)")
    if self.kept_layers < 0:
      raise ValueError(f"kept_layers must be at least 0, got {self.kept_layers}")
    if self.kept_layers and (self.remat != "full" or self.remat_group > 1 or self.pipelined):
      raise ValueError(
        "kept_layers > 0 needs remat full, remat_group 1 and no pipe axis, got "
        f"remat {self.remat!r}, remat_group {self.remat_group}, pipelined {self.pipelined}"
      )

  def replace(self, **changes: Any) -> Runtime:
    return dataclasses.replace(self, **changes)

  def size(self, axis: str) -> int:
    """The mesh's size along ``axis`` (1 without a mesh or without that axis)."""
    return 1 if self.mesh is None else self.mesh.shape.get(axis, 1)

  @property
  def mesh_shape(self) -> dict[str, int]:
    """Every mesh axis with its size (all 1 on one device)."""
    return {axis: self.size(axis) for axis in meshlib.AXES}

  @property
  def pipelined(self) -> bool:
    return self.size(pipeline.AXIS) > 1

  @property
  def manual_stages(self) -> bool:
    """Whether the pipeline's stages run manual over every mesh axis: a pipe axis with no
    tensor axis (nothing for the partitioner to split inside a stage), no --shard-frozen and
    no context axis. Custom calls (the Pallas kernels) then run inside the stages, each on
    its device's rows."""
    return manual_stages(self.mesh_shape, self.shard_frozen)

  @property
  def dequantize_again(self) -> bool:
    """Whether the NF4 products' input gradients dequantize their weights anew instead of
    sharing the dequantized weight of the forward that remat recomputes beside them: remat
    "lean", which spends one more dequantization per weight and step for less memory
    (pallas_kernels.nf4_matmul's ``dequantize_again``). Not under "offload": on an H100
    (8B, batch 2) it planned 0.2 GiB less there but peaked no lower, 3% slower."""
    return self.remat == "lean"

  @property
  def context(self) -> int:
    """The context group's size: each row's tokens split that many ways (1: whole)."""
    return self.size(context.AXIS)

  @property
  def rules(self) -> dict[str, str | None]:
    """Logical axis -> mesh axis for activations under this runtime (sharding.RULES, with the
    residual stream's tokens over tensor under sequence parallelism)."""
    if self.sequence_parallel:
      return {**sharding.RULES, "norm_length": "tensor"}
    return sharding.RULES

  def spec(self, *names: str | None) -> PartitionSpec:
    """The PartitionSpec of an activation whose dimensions have these logical names."""
    return sharding.logical_spec(names, self.rules, self.mesh)

  def sharding(self, *names: str | None) -> NamedSharding | None:
    return None if self.mesh is None else NamedSharding(self.mesh, self.spec(*names))

  def constrain(self, x: jax.Array, *names: str | None) -> jax.Array:
    """``x`` constrained to the layout of ``names`` (a no-op on one device). Inside a
    ``shard_map`` (the pipeline) the constraint is stated on its abstract mesh, for the axes
    it leaves automatic (none: a no-op)."""
    if self.mesh is None:
      return x
    here = jax.sharding.get_abstract_mesh()
    spec = self.spec(*names)
    if here.empty:
      return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, spec))
    if here.are_all_axes_manual:  # each device's own piece: nothing left to lay out
      return x
    manual = set(here.manual_axes)
    kept = PartitionSpec(*(None if _names(a) & manual else a for a in spec))
    return jax.lax.with_sharding_constraint(x, NamedSharding(here, kept))

  @property
  def setting(self) -> str:
    """The remat setting in words ("auto" while candidates remain): the start line's, and the
    name plan.choose gives a setting that did not fit."""
    remat = "auto" if self.candidates else self.remat
    if self.loss_chunk and not self.candidates:
      remat += f", loss chunk {self.loss_chunk}"
    if self.remat_group > 1:
      remat += f", groups of {self.remat_group} layers"
    if self.kept_layers:
      remat += f", activations kept in the first {self.kept_layers} layers"
    if not self.scan_layers:
      remat += ", layers unrolled"
    return remat

  def describe(self, remat_note: str = "") -> str:
    """The start line's account of the runtime; ``remat_note``: how the remat setting was
    chosen (plan.Plan.note), in brackets after it."""
    remat = self.setting + (f" ({remat_note})" if remat_note else "")
    attention = self.attention
    if attention == "ring":
      attention += f" ({self.ring_blocks} blocks)" if self.ring_blocks != "xla" else " (xla tiles)"
    parts = [f"attention {attention}", f"remat {remat}", f"dtype {self.dtype}"]
    if self.nf4_matmul != "auto":
      parts.append(f"nf4 matmul {self.nf4_matmul}")
    if self.mlp_chunk:
      parts.append(f"mlp chunk {self.mlp_chunk}")
    if self.sequence_parallel:
      parts.append("sequence parallel")
    if self.context > 1:
      parts.append(f"each sequence split over {self.context} devices (zigzag)")
    if self.shard_frozen:
      parts.append("frozen weights sharded over data")
    if self.host_embeddings:
      parts.append("embeddings on the host")
    if self.pipelined:
      parts.append(f"{self.microbatches} pipeline micro-batches")
    return ", ".join(parts + list(self.notes))


def manual_stages(sizes: dict[str, int], shard_frozen: bool) -> bool:
  """Runtime.manual_stages for a mesh of these axis sizes."""
  return (
    sizes.get(pipeline.AXIS, 1) > 1
    and sizes.get("tensor", 1) == 1
    and sizes.get(context.AXIS, 1) == 1
    and not shard_frozen
  )


def _names(axis: str | tuple | None) -> set[str]:
  """The mesh axes of one PartitionSpec entry."""
  return set() if axis is None else {axis} if isinstance(axis, str) else set(axis)


# What a model computes with when given no runtime: one device, no remat, XLA attention.
DEFAULT = Runtime()


def compute_dtype(requested: str, devices: Sequence) -> tuple[str, str | None]:
  """(dtype to train in, a note saying why it differs from ``requested``, or None).

  GPUs before compute capability 8.0 (V100, T4) have no bfloat16: float16 with dynamic loss
  scaling there.
  """
  if requested != "bfloat16":
    return requested, None
  for d in devices:
    cc = getattr(d, "compute_capability", None)
    if d.platform == "gpu" and cc is not None and float(cc) < 8.0:
      return "float16", (
        f"{d.device_kind} (compute capability {cc}) has no bfloat16: float16 with dynamic "
        "loss scaling"
      )
  return requested, None


def free_device_bytes(limit_gib: float | None = None) -> int | None:
  """Bytes the first device can still allocate (its limit, or ``limit_gib`` where lower, less
  what is in use); None where the backend keeps no memory statistics (CPU)."""
  stats = jax.devices()[0].memory_stats()
  if stats is None:
    return None
  limit = stats.get("bytes_limit", 0)
  if limit_gib is not None:
    limit = min(limit, int(limit_gib * 2**30))
  return limit - stats.get("bytes_in_use", 0)


def _on_hopper(device) -> bool:
  return device.platform == "gpu" and str(getattr(device, "compute_capability", "")) == "9.0"


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


def resolve_nf4_matmul(
  requested: str | None, cfg: ModelConfig, *, method: str, quantized: bool, tokens: int | None,
  devices: int, device: jax.Device, dtype: str, free: int | None,
) -> str:  # fmt: skip
  """``requested`` where set; else "kernel" for supervised fine-tuning of an NF4 model on one
  Hopper GPU in bfloat16 where a call has ``TRAIN_KERNEL_MIN_TOKENS`` to
  ``TRAIN_KERNEL_MAX_TOKENS`` tokens, the model is at least ``TRAIN_KERNEL_MIN_HIDDEN`` wide
  and the kernels' operands, made once for the run (``step.kernel_operands``), fit beside the
  loaded model in half of what is left of ``free`` bytes (the device's, before loading): where
  the kernels measured faster. Else "auto" (pallas_kernels.nf4_matmul's choice per call: the
  kernel for decoding's few tokens). ``tokens`` None: not known yet (no --seq-len before the
  data is read)."""
  if requested is not None:
    return requested
  if (
    method == "sft"
    and quantized
    and devices == 1
    and _on_hopper(device)
    and dtype == "bfloat16"
    and tokens is not None
    and TRAIN_KERNEL_MIN_TOKENS <= tokens <= TRAIN_KERNEL_MAX_TOKENS
    and cfg.hidden_size >= TRAIN_KERNEL_MIN_HIDDEN
    and free is not None
    and kernel_operand_bytes(cfg) <= (free - loaded_bytes(cfg)) // 2
  ):
    return "kernel"
  return "auto"


def kernel_operand_bytes(cfg: ModelConfig) -> int:
  """The training kernels' operands of an NF4 model (``operand_bytes`` of its codes)."""
  return operand_bytes(cfg.linear_params() // 2)


def operand_bytes(codes: int) -> int:
  """The training kernels' operands made for ``codes`` bytes of NF4 codes
  (``step.kernel_operands``): W's and W^T's codes in word order, twice the codes' bytes, and
  bf16 scales (2 bytes per 64 weights)."""
  return 2 * codes + codes // 16


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
  gpu, hopper = device.platform == "gpu", _on_hopper(device)
  special = bool(cfg.attn_logit_softcap) or cfg.has_sliding_layers
  cudnn_exact = gpu and not (special or packed)
  kernel_ok = hopper and mosaic_supports(dtype, cfg.head_dim)
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
  if _on_hopper(device) and mosaic_supports(dtype, cfg.head_dim):
    return "mosaic", None
  if requested is None:
    return "xla", None
  note = "ring blocks by flash attention's jnp reference (the kernel: Hopper, 16-bit inputs)"
  return "flash_xla", note


def resolve(
  run: RunConfig,
  cfg: ModelConfig,
  *,
  packed: bool = False,
  devices: Sequence | None = None,
) -> Runtime:
  """The runtime of ``run`` for model ``cfg`` on ``devices`` (default: all of JAX's), with
  ``packed`` saying whether any training or held-out row holds several examples.

  Raises a ``UserError`` (one sentence) for every combination that cannot run.
  """
  devices = list(devices if devices is not None else jax.devices())
  if run.batch_size % run.grad_accum:
    raise UserError(
      f"--batch-size {run.batch_size} must be a multiple of --grad-accum {run.grad_accum}."
    )
  mesh = meshlib.make_mesh(run.mesh, devices)
  micro_batch = run.batch_size // run.grad_accum
  meshlib.check_model_fits(mesh, cfg.num_heads, cfg.num_kv_heads, micro_batch, cfg.num_layers)
  if run.seq_len is not None and run.seq_len > cfg.max_position_embeddings:
    raise UserError(
      f"--seq-len {run.seq_len} is longer than the {cfg.max_position_embeddings} positions "
      f"this {cfg.model_type} was trained for (max_position_embeddings); lower --seq-len."
    )
  tp, pp = mesh.shape["tensor"], mesh.shape[pipeline.AXIS]
  seq_len = run.seq_len if run.seq_len is not None else 256  # unset: a multiple of 256
  if run.sequence_parallel and not sharding.can_split_sequence(mesh, seq_len):
    raise MeshError(
      f"--sequence-parallel splits each row's tokens over the tensor axis, but --mesh "
      f"{run.mesh or len(devices)} has tensor={tp}, pipe={pp} for --seq-len {run.seq_len}; "
      "use a tensor axis > 1 that divides --seq-len and no pipe axis, or drop the flag."
    )
  microbatches = 1
  if pp > 1:
    per_shard = max(1, micro_batch // mesh.shape["data"])
    microbatches = pipeline.num_microbatches(per_shard, run.microbatches)
  cp = mesh.shape[context.AXIS]
  if cp > 1:
    _check_context(run, cp, pp, seq_len)
  if run.remat_group > 1:
    _check_remat_group(run, cfg.num_layers, pp)
  dtype, dtype_note = compute_dtype(run.dtype, devices)
  fused = fused_loss_chunk(run, cfg, micro_batch, mesh.size, devices[0], dtype)
  candidates = remat_candidates(run, pipelined=pp > 1, whole_logits=cp > 1, fused_chunk=fused)
  if run.layer_loop == "unrolled" and pp > 1:
    raise MeshError(
      f"--layer-loop unrolled does not run inside a pipeline (the pipe axis of --mesh "
      f"{run.mesh}) yet; drop it or the pipe axis."
    )
  try_unrolled = unrolled_first(run, mesh.size, devices[0], candidates)
  keep_up_to = cfg.num_layers if keeps_layers(run, pp, candidates) else 0
  if run.embeddings == "host":
    _check_host_embeddings(run, cfg)
  ring_blocks = "xla"
  if cp > 1:
    attention = "ring"
    ring_blocks, attention_note = resolve_ring_blocks(
      run.attention, cfg, dtype=dtype, device=devices[0]
    )
  else:
    attention, attention_note = resolve_attention(
      run.attention, cfg, dtype=dtype, packed=packed, pipelined=pp > 1, device=devices[0]
    )
  return Runtime(
    mesh=mesh if mesh.size > 1 else None,
    dtype=dtype,
    remat=candidates[0][0],
    attention=attention,
    ring_blocks=ring_blocks,
    nf4_matmul=resolve_nf4_matmul(
      run.nf4_matmul,
      cfg,
      method=run.method,
      quantized=run.quantization == "nf4",
      tokens=micro_batch * run.seq_len if run.seq_len is not None else None,
      devices=mesh.size,
      device=devices[0],
      dtype=dtype,
      free=free_device_bytes(run.memory_limit) if _on_hopper(devices[0]) else None,
    ),
    loss_chunk=candidates[0][1],
    candidates=candidates if len(candidates) > 1 else (),
    memory_limit=run.memory_limit,
    mlp_chunk=run.mlp_chunk,
    remat_group=run.remat_group,
    keep_up_to=keep_up_to,
    microbatches=microbatches,
    sequence_parallel=run.sequence_parallel,
    shard_frozen=run.shard_frozen,
    host_embeddings=run.embeddings == "host",
    scan_layers=run.layer_loop != "unrolled",
    try_unrolled=try_unrolled,
    notes=tuple(n for n in (dtype_note, attention_note) if n),
  )


def fused_loss_chunk(
  run: RunConfig, cfg: ModelConfig, rows: int, devices: int, device: jax.Device, dtype: str
) -> int:
  """The tokens per row of the loss's pieces that ``--loss-chunk`` unset takes first, where
  each piece's forward can take its own gradient (losses.fused_loss_sums): supervised
  fine-tuning on one GPU, where it was measured (experiments/RESULTS.md, session 23), an
  output layer without LoRA, a vocabulary of at most LARGE_VOCAB, and not in float16 (the
  pieces' gradients are taken before the loss scale multiplies them: they would underflow);
  FUSED_PIECE_TOKENS over the ``rows`` of a micro-batch, at most the row. 0 elsewhere: the
  logits whole where they fit. On a CPU it would only change the tests' numerics."""
  if (
    run.loss_chunk is not None
    or run.method != "sft"
    or devices > 1
    or device.platform != "gpu"
    or dtype == "float16"
    or "lm_head" in run.lora_targets
    or cfg.vocab_size > LARGE_VOCAB
  ):
    return 0
  chunk = max(1, FUSED_PIECE_TOKENS // rows)
  return min(chunk, run.seq_len) if run.seq_len else chunk


def unrolled_first(
  run: RunConfig, devices: int, device: jax.Device, candidates: Sequence[tuple[str, int]]
) -> bool:
  """Whether plan.choose tries remat activations with the layers unrolled before scanned
  (--layer-loop auto): supervised fine-tuning on one GPU, where it was measured faster (8B
  batch 2: 1.05x, 1B batch 4: 1.10x on an H100, experiments/RESULTS.md). Not measured for
  the preference and RL steps (two passes a step), under a mesh or in remat groups; on a CPU
  it would only lengthen compilation."""
  return (
    run.layer_loop == "auto"
    and run.method == "sft"
    and devices == 1
    and device.platform == "gpu"
    and run.remat_group == 1
    and any(remat == "activations" for remat, _ in candidates)
  )


def keeps_layers(run: RunConfig, pp: int, candidates: Sequence[tuple[str, int]]) -> bool:
  """Whether plan.choose may keep the activations of some layers under full remat where
  activations does not fit (``--remat auto``, both settings among the candidates, no remat
  groups, no pipe axis and the layers in a scan: they then run as two scans)."""
  remats = {remat for remat, _ in candidates}
  return (
    run.remat == "auto"
    and run.remat_group == 1
    and pp == 1
    and run.layer_loop != "unrolled"
    and {"activations", "full"} <= remats
  )


def _check_remat_group(run: RunConfig, layers: int, pp: int) -> None:
  """--remat-group N > 1: no pipe axis, a setting that keeps only layer inputs, N dividing
  the layers."""
  n = run.remat_group
  if pp > 1:
    raise MeshError(
      f"--remat-group does not run inside a pipeline (the pipe axis of --mesh {run.mesh}) "
      "yet; drop --remat-group or the pipe axis."
    )
  if run.remat not in ("auto", *GROUPED_REMAT):
    raise UserError(
      f"--remat-group {n} keeps only the input of every group of {n} layers, but --remat "
      f"{run.remat} keeps more of each layer; use --remat {', '.join(GROUPED_REMAT)} or auto, "
      "or drop --remat-group."
    )
  if layers % n:
    fits = [str(d) for d in range(2, layers + 1) if layers % d == 0]
    use = f"use {fits[0]}" if len(fits) == 1 else f"use one of {', '.join(fits)}"
    raise UserError(
      f"--remat-group {n} does not divide the model's {layers} layers; {use}, or drop "
      "--remat-group."
    )


def _check_context(run: RunConfig, cp: int, pp: int, seq_len: int) -> None:
  """What a ``context`` axis does not run with yet, and the lengths it cannot split."""
  where = f"--mesh {run.mesh} splits each sequence over context={cp}"
  if pp > 1:
    raise MeshError(f"{where}, which does not run with a pipe axis yet; drop one of the two.")
  if run.sequence_parallel:
    raise MeshError(f"{where}; drop --sequence-parallel (it splits the tokens over tensor).")
  if run.attention == "fused":
    raise MeshError(
      f"{where} with ring attention, which merges blocks by their softmax statistics that "
      "cuDNN's kernel (--attention fused) does not return; use --attention xla or leave it unset."
    )
  if run.method == "grpo":
    raise MeshError(
      f"{where}, but GRPO generates its rollouts on whole sequences; drop the context axis."
    )
  if run.loss_chunk or run.mlp_chunk:
    flag = "--loss-chunk" if run.loss_chunk else "--mlp-chunk"
    raise MeshError(
      f"{where}, and {flag} would gather each sequence back to cut it into pieces; drop "
      f"{flag} (each device's logits and MLP already hold 1/{cp} of the tokens)."
    )
  if run.seq_len is not None and seq_len % (2 * cp):
    raise MeshError(
      f"{where} in {2 * cp} zigzag chunks, which --seq-len {seq_len} does not divide into; "
      f"make --seq-len a multiple of {2 * cp}."
    )


def _check_host_embeddings(run: RunConfig, cfg: ModelConfig) -> None:
  if cfg.tie_word_embeddings:
    raise UserError(
      f"--embeddings host keeps the input embedding table off the devices, but this "
      f"{cfg.model_type} uses the same table as its output layer (tie_word_embeddings), "
      "which runs on them; drop --embeddings host."
    )


def remat_candidates(
  run: RunConfig, pipelined: bool = False, whole_logits: bool = False, fused_chunk: int = 0
) -> tuple[tuple[str, int], ...]:
  """The (remat, loss_chunk) settings ``run`` leaves open, fastest first: every one of
  AUTO_REMAT under ``--remat auto`` (offload not inside a pipeline), each with the logits
  whole, then in chunks of AUTO_LOSS_CHUNK, where ``--loss-chunk`` is unset (whole only with
  ``whole_logits``: a context axis, whose pieces would gather the sequence). ``fused_chunk``
  (``fused_loss_chunk``) takes the place of the whole logits (and of AUTO_LOSS_CHUNK where
  it is no larger)."""
  remats = [r for r in AUTO_REMAT if not (pipelined and r == "offload")]
  if run.remat_group > 1:  # the settings that keep only layer inputs
    remats = [r for r in remats if r in GROUPED_REMAT]
  remats = remats if run.remat == "auto" else [run.remat]
  chunks = [0, AUTO_LOSS_CHUNK] if run.loss_chunk is None else [run.loss_chunk]
  if fused_chunk and run.loss_chunk is None:
    chunks = [fused_chunk] + ([AUTO_LOSS_CHUNK] if fused_chunk > AUTO_LOSS_CHUNK else [])
  if whole_logits:
    chunks = [0]
  out = []
  for remat in remats:
    # Lean and offload are for the leanest memory: with the logits in pieces only (lean saves
    # less than the pieces do, so where full in pieces did not fit, lean whole would not).
    for chunk in chunks[-1:] if remat in ("lean", "offload") and run.remat == "auto" else chunks:
      out.append((remat, chunk))
  return tuple(out)
