"""Pipeline parallelism over the ``pipe`` mesh axis: a GPipe schedule inside ``shard_map``.

The stacked layers [L, ...] are sharded over ``pipe`` in equal contiguous stages (the rules
table maps ``layers`` to ``pipe``), so stage s holds layers s*L/P .. (s+1)*L/P - 1 and no
weight ever moves. The batch is cut into M micro-batches; at tick t stage s runs micro-batch
t - s and hands its output to stage s + 1 with ``ppermute``. After M + P - 1 ticks the last
stage holds every micro-batch's output, which is broadcast back to all stages (the final
norm, logits and loss then run as they do without a pipeline). Each stage idles for P - 1 of
the M + P - 1 ticks: the bubble, ``bubble_fraction(P, M)``.

Only ``pipe`` is manual inside the ``shard_map``: ``data`` and ``tensor`` stay automatic, so
the same Block code, its tensor-parallel weights and the batch split over ``data`` work
unchanged within a stage. Without a tensor axis every axis is manual instead (``manual``):
each stage then runs on its data shard's rows alone, where custom calls such as the Pallas
flash kernel run (they do not partition inside a partly automatic region). Autodiff runs
through the schedule (the transpose of a ``ppermute`` is the reverse ``ppermute``), so the
backward pass is the mirrored schedule.
"""

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from jaxtune.errors import MeshError

AXIS = "pipe"


class Plan(NamedTuple):
  stages: int
  layers_per_stage: int
  microbatches: int
  bubble: float  # expected idle fraction of each stage


def bubble_fraction(stages: int, microbatches: int) -> float:
  """GPipe's expected idle share of each stage, (P - 1) / (M + P - 1); 0 without a pipeline."""
  return (stages - 1) / (microbatches + stages - 1)


def check_stages(num_layers: int, stages: int) -> None:
  if num_layers % stages:
    divisors = [d for d in range(1, num_layers + 1) if num_layers % d == 0]
    raise MeshError(
      f"the model's {num_layers} layers do not split into {stages} equal pipeline stages; "
      f"choose a pipe size that divides {num_layers} ({', '.join(map(str, divisors))})."
    )


def num_microbatches(per_shard_batch: int, requested: int = 0) -> int:
  """Micro-batches per step: ``requested``, or by default one per sequence of a data shard."""
  if not requested:
    return per_shard_batch
  if requested < 1 or per_shard_batch % requested:
    raise MeshError(
      f"{requested} pipeline micro-batches do not divide the {per_shard_batch} sequences "
      "each data shard holds per step; pick a divisor of that number."
    )
  return requested


def plan(mesh: Mesh, num_layers: int, batch: int, microbatches: int = 0) -> Plan:
  """The schedule a step of ``batch`` sequences (one micro-batch of the trainer) runs under
  ``mesh``; raises MeshError (one sentence) when layers or batch do not split."""
  stages = mesh.shape.get(AXIS, 1)
  check_stages(num_layers, stages)
  per_shard = max(1, batch // mesh.shape.get("data", 1))
  m = num_microbatches(per_shard, microbatches) if stages > 1 else 1
  return Plan(stages, num_layers // stages, m, bubble_fraction(stages, m))


def _split(a: jax.Array, m: int) -> jax.Array:
  """[B, ...] -> [M, B/M, ...]; micro-batch j holds rows j, j + M, j + 2M, ... so that each
  keeps an equal share of every data shard's rows (B is split over ``data`` in blocks)."""
  return a.reshape(a.shape[0] // m, m, *a.shape[1:]).swapaxes(0, 1)


def _merge(a: jax.Array) -> jax.Array:
  return a.swapaxes(0, 1).reshape(-1, *a.shape[2:])


def gpipe(
  stage_fn: Callable,
  layer_xs: Any,
  x: jax.Array,
  batch_xs: Any,
  *,
  mesh: Mesh,
  microbatches: int,
  manual: bool = False,
) -> jax.Array:
  """Run ``stage_fn`` over the stages of ``layer_xs`` for every micro-batch of ``x``.

  layer_xs: pytree of per-layer arrays [L, ...] (weights, keys, per-layer switches), sharded
    over ``pipe`` on their first axis; each stage sees its own [L/P, ...].
  x: [B, ...] the residual stream; batch_xs: pytree of [B, ...] inputs every layer reads
    (rope tables, segment ids), cut into micro-batches like x.
  stage_fn(x_mb, local_layer_xs, batch_xs_mb, j) -> x_mb: run this stage's layers on
    micro-batch j.
  manual: the stages run manual over every mesh axis (Runtime.manual_stages: no tensor axis,
    no --shard-frozen), each on its data shard's rows, so custom calls (the Pallas kernels)
    run inside them directly; else only ``pipe`` is manual and the partitioner splits the
    rest inside a stage (the flash kernel then through custom_partitioning, attention.py).
  Returns the last stage's output [B, ...], the same on every stage.
  """
  stages = mesh.shape[AXIS]
  m = microbatches
  check_stages(jax.tree.leaves(layer_xs)[0].shape[0], stages)
  if x.shape[0] % m:
    raise ValueError(f"{m} pipeline micro-batches do not divide the batch of {x.shape[0]}.")
  forward = [(s, s + 1) for s in range(stages - 1)]

  def per_stage(layer_xs, x, batch_xs):
    stage = jax.lax.axis_index(AXIS)
    xs = _split(x[0], m)
    sides = jax.tree.map(lambda a: _split(a, m), batch_xs)

    def tick(received, t):
      j = jnp.clip(t - stage, 0, m - 1)  # outside 0..M-1 the stage idles (the bubble)
      inp = jnp.where(stage == 0, xs[j], received)
      out = stage_fn(inp, layer_xs, jax.tree.map(lambda a: a[j], sides), j)
      return jax.lax.ppermute(out, AXIS, forward), out

    _, ys = jax.lax.scan(tick, jnp.zeros_like(xs[0]), jnp.arange(m + stages - 1))
    # The last stage finished micro-batch j at tick j + P - 1.
    return _merge(ys[stages - 1 :])[None]

  # Every stage gets its own copy of x and returns its own [1, B, ...]; only stage 0's input
  # and the last stage's output matter. Broadcasting and picking outside the shard_map
  # (rather than psum inside) leaves the reductions of the backward pass to XLA, whose
  # collectives keep the input dtype (a bfloat16 psum inside crashes XLA:CPU's compiler).
  x = jnp.broadcast_to(x[None], (stages, *x.shape))
  rows = "data" if manual and mesh.shape.get("data", 1) > 1 else None
  out = jax.shard_map(
    per_stage,
    mesh=mesh,
    in_specs=(PartitionSpec(AXIS), PartitionSpec(AXIS, rows), PartitionSpec(rows)),
    out_specs=PartitionSpec(AXIS, rows),
    axis_names=set(mesh.axis_names) if manual else {AXIS},
    # The stage may hold custom calls (Pallas kernels, directly or split by
    # custom_partitioning), whose outputs carry no true record of the axes they vary over: a
    # kernel's gradient typed varying over pipe met an NF4 input typed invariant and failed
    # the custom VJP's type check (tests/parallel/test_pipeline.py). That bookkeeping is off.
    check_vma=False,
  )(layer_xs, x, batch_xs)
  return out[stages - 1]
