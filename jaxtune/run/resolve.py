"""The one resolve: a run's settings, its model config, the devices and a summary of its data
-> the ``Plan`` (jaxtune.parallel.runtime: the training step's ``Runtime`` with the memory
plan's candidates, the held-out step's, generation's), with every refusal of an impossible
combination raised here, as one ``UserError`` sentence, before anything is built.

A run calls ``check`` first, before it reads its data (the refusals that need none of it:
a mistake costs no tokenizing), then ``resolve`` once, with the data's summary: it checks
again with the length the data chose, and takes every decision. Nothing below this module
decides again."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING

import jax

from jaxtune.errors import MeshError, UserError
from jaxtune.parallel import mesh as meshlib
from jaxtune.parallel import pipeline, runtime, sharding
from jaxtune.parallel import ring_attention as context
from jaxtune.parallel.runtime import (
  FUSED_PIECE_TOKENS,
  GROUPED_REMAT,
  LARGE_VOCAB,
  Plan,
  Runtime,
)
from jaxtune.run.choices import (  # noqa: F401 (the plan's choices, named here too)
  kernel_operand_bytes,
  loaded_bytes,
  resolve_attention,
  resolve_decode,
  resolve_grouped_matmul,
  resolve_nf4_matmul,
  resolve_ring_blocks,
)
from jaxtune.run_config import AUTO_LOSS_CHUNK, AUTO_REMAT, RunConfig

if TYPE_CHECKING:
  from jaxtune.models.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class DataSummary:
  """What ``resolve`` needs of a run's data once it is read: whether any training or
  held-out row holds several examples (attention must keep them apart). Its length is the
  run's ``seq_len`` by then."""

  packed: bool = False


def check(run: RunConfig, cfg: ModelConfig, devices: Sequence | None = None) -> None:
  """Raise every refusal of ``run`` for model ``cfg`` on ``devices`` that needs none of the
  data but its length (a ``UserError`` sentence); ``resolve`` runs it too."""
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
  if pp > 1:
    pipeline.num_microbatches(max(1, micro_batch // mesh.shape["data"]), run.microbatches)
  cp = mesh.shape[context.AXIS]
  if cp > 1:
    _check_context(run, cp, pp, seq_len)
  if cfg.is_moe and (pp > 1 or run.remat_group > 1 or run.mlp_chunk):
    what = "a pipe axis" if pp > 1 else "--remat-group" if run.remat_group > 1 else "--mlp-chunk"
    raise MeshError(
      f"{what} does not run with a mixture-of-experts model ({cfg.model_type}) yet; drop it."
    )
  if cfg.attention_sinks and cp > 1:
    raise MeshError(
      f"--mesh {run.mesh} splits each sequence over context={cp}, but ring attention does not "
      f"apply {cfg.model_type}'s attention sinks yet; drop the context axis."
    )
  if run.remat_group > 1:
    _check_remat_group(run, cfg.num_layers, pp)
  if run.layer_loop == "unrolled" and pp > 1:
    raise MeshError(
      f"--layer-loop unrolled does not run inside a pipeline (the pipe axis of --mesh "
      f"{run.mesh}) yet; drop it or the pipe axis."
    )
  if run.embeddings == "host":
    _check_host_embeddings(run, cfg)
  if cp == 1:  # the attention's own refusals, --packing taken as packing
    resolve_attention(
      run.attention, cfg, dtype=runtime.compute_dtype(run.dtype, devices)[0],
      packed=run.packing, pipelined=pp > 1, device=devices[0],
    )  # fmt: skip


def resolve(
  run: RunConfig,
  cfg: ModelConfig,
  data: DataSummary | None = None,
  *,
  devices: Sequence | None = None,
) -> Plan:
  """The plan of ``run`` for model ``cfg`` on ``devices`` (default: all of JAX's) and data
  summarised by ``data`` (None: rows of one example each).

  Raises a ``UserError`` (one sentence) for every combination that cannot run.
  """
  devices = list(devices if devices is not None else jax.devices())
  data = data if data is not None else DataSummary()
  check(run, cfg, devices)
  mesh = meshlib.make_mesh(run.mesh, devices)
  micro_batch = run.batch_size // run.grad_accum
  pp, cp = mesh.shape[pipeline.AXIS], mesh.shape[context.AXIS]
  microbatches = 1
  if pp > 1:
    per_shard = max(1, micro_batch // mesh.shape["data"])
    microbatches = pipeline.num_microbatches(per_shard, run.microbatches)
  dtype, dtype_note = runtime.compute_dtype(run.dtype, devices)
  fused = fused_loss_chunk(run, cfg, micro_batch, mesh.size, devices[0], dtype)
  candidates = remat_candidates(run, pipelined=pp > 1, whole_logits=cp > 1, fused_chunk=fused)
  try_unrolled = unrolled_first(run, mesh.size, devices[0], candidates)
  keep_up_to = cfg.num_layers if keeps_layers(run, pp, candidates) else 0
  ring_blocks = "xla"
  if cp > 1:
    attention = "ring"
    ring_blocks, attention_note = resolve_ring_blocks(
      run.attention, cfg, dtype=dtype, device=devices[0]
    )
  else:
    attention, attention_note = resolve_attention(
      run.attention, cfg, dtype=dtype, packed=data.packed, pipelined=pp > 1, device=devices[0]
    )
  free = runtime.free_device_bytes(run.memory_limit) if runtime.on_hopper(devices[0]) else None
  step = Runtime(
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
      free=free,
    ),
    grouped_matmul=resolve_grouped_matmul(cfg, devices[0]),
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
  decode = resolve_decode(cfg, devices=mesh.size, device=devices[0], free=free)
  return Plan(step, decode=decode, eval_scan=run.layer_loop != "unrolled")


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
