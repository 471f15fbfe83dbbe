"""How a run computes: the frozen ``Runtime`` value, which jaxtune.run.resolve makes once.

A run's settings (``RunConfig``) say what the user asked for; a model config says what the
network is; the devices and the data say where and on what it runs. ``run.resolve.resolve``
turns those into a ``Runtime`` (mesh, compute dtype, remat policy, attention implementation,
NF4 matmul, loss/MLP chunks, pipeline micro-batches, sequence parallelism) and raises every
refusal of an impossible combination there, as one ``UserError`` sentence, before anything
is built. The model reads its choices from the ``Runtime`` passed to it; nothing changes
them afterwards.

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
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxtune.parallel import mesh as meshlib
from jaxtune.parallel import pipeline, sharding
from jaxtune.parallel import ring_attention as context
from jaxtune.run_config import REMAT

ATTENTION = ("xla", "cudnn", "mosaic", "interpret", "flash_xla", "ring")
GROUPED_MATMUL = ("ragged_dot", "tiles")

# How NF4 layers multiply (pallas_kernels.nf4_matmul's ``impl``, or "few-tokens": the kernel for
# calls whose shape it measured faster on, ``kernel_pays``, XLA for the rest; resolve picks it
# on one Hopper GPU). interpret: the kernel on CPU (tests).
NF4_MATMUL = ("xla", "few-tokens", "kernel", "interpret")
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
  nf4_matmul: str = "xla"  # one of NF4_MATMUL
  # how a mixture of experts' grouped products run (pallas_kernels.grouped_matmul's impl)
  grouped_matmul: str = "ragged_dot"
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
    if self.grouped_matmul not in GROUPED_MATMUL:
      raise ValueError(
        f"grouped_matmul must be one of {GROUPED_MATMUL}, got {self.grouped_matmul!r}"
      )
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
    if self.nf4_matmul not in ("xla", "few-tokens"):
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


@dataclasses.dataclass(frozen=True)
class Decode:
  """How generation computes: a run's samples (--eval-prompts) and GRPO's rollouts, and
  ``python -m jaxtune.generate``. ``word_codes``: the NF4 kernel's codes in its faster
  lookup's order for the decode loop: True a copy, made once a loop; "inplace" the model's own
  codes permuted for the loop and put back (a caller that owns the model, where no copy fits);
  False neither (also where the kernel never runs: off a single Hopper GPU). ``nf4_matmul``:
  how its NF4 layers multiply (``NF4_MATMUL``; "few-tokens" on one Hopper GPU). ``wide_rows``:
  from this many rows the loop is compiled with the options of wide batches on a GPU
  (decoding.WIDE_OPTIONS); None never."""

  word_codes: bool | str = False
  nf4_matmul: str = "xla"
  wide_rows: int | None = None

  def __post_init__(self):
    if self.word_codes not in (True, False, "inplace"):
      raise ValueError(f"word_codes must be True, False or 'inplace', got {self.word_codes!r}")
    if self.nf4_matmul not in NF4_MATMUL:
      raise ValueError(f"nf4_matmul must be one of {NF4_MATMUL}, got {self.nf4_matmul!r}")
    if self.word_codes and self.nf4_matmul == "xla":
      raise ValueError("word_codes are the NF4 kernel's: they need nf4_matmul other than xla")


@dataclasses.dataclass
class Plan:
  """Every decision of a run, taken once by jaxtune.run.resolve.resolve: the training step's
  ``runtime`` (with the memory plan's ``candidates``), the held-out step's and generation's.
  The memory plan (training.plan.choose) compiles the candidates resolve listed and records
  the one it keeps here (``record``), once; nothing else changes a plan."""

  runtime: Runtime
  decode: Decode = Decode()
  # The held-out step's layers in a scan (its forward saves nothing for a backward pass: the
  # scan costs it nothing), unless --layer-loop unrolled asks for them unrolled.
  eval_scan: bool = True
  memory: Any = None  # training.plan.MemoryPlan: the choice among the candidates, once made

  def record(self, memory: Any) -> None:
    """The memory plan's choice among ``runtime.candidates``: recorded once."""
    if self.memory is not None:
      raise ValueError("a plan records its memory plan's choice once")
    rt = memory.runtime
    if self.runtime.candidates and (rt.remat, rt.loss_chunk) not in self.runtime.candidates:
      raise ValueError(f"the memory plan chose {rt.setting!r}, not among the plan's candidates")
    self.memory = memory

  @property
  def step(self) -> Runtime:
    """The training step's runtime: the memory plan's choice once recorded."""
    return self.runtime if self.memory is None else self.memory.runtime

  @property
  def eval(self) -> Runtime:
    """The held-out step's runtime: the training step's, every layer alike (no kept layers),
    in a scan where ``eval_scan``."""
    step = self.step
    return step.replace(kept_layers=0, scan_layers=self.eval_scan or step.scan_layers)

  @property
  def mesh(self) -> Mesh | None:
    return self.runtime.mesh

  @property
  def dtype(self) -> str:
    return self.runtime.dtype


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
# How generation computes when given no plan: XLA's products, no copy of the kernel's codes.
NO_WORD_CODES = Decode()


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


def on_hopper(device: jax.Device) -> bool:
  return device.platform == "gpu" and str(getattr(device, "compute_capability", "")) == "9.0"


def operand_bytes(codes: int) -> int:
  """The training kernels' operands made for ``codes`` bytes of NF4 codes
  (``step.kernel_operands``): W's and W^T's codes in word order, twice the codes' bytes, and
  bf16 scales (2 bytes per 64 weights)."""
  return 2 * codes + codes // 16
