"""Every parallelism decision in one place: logical axis names -> mesh axes.

Parameters carry logical names (``axes`` metadata, see layers.py); activations are named where
they are laid out (``Runtime.spec("batch", "length", "heads", "head_dim")``): one table,
``RULES``, maps both to mesh axes. Tensor parallelism is
Megatron-style: the column-parallel projections (q/k/v/gate/up) split their output features
over ``tensor``, the row-parallel ones (o/down) their input features, so each block needs one
all-reduce after attention and one after the MLP. The batch is split over ``data``. The
stacked ``layers`` axis is split over ``pipe`` into equal contiguous stages (pipeline.py).
Each row's tokens are split over ``context`` (in zigzag order, context.py).

With ``shard_frozen`` the frozen NF4 weights are split over ``data`` as well (FSDP-style,
``FROZEN_RULES``): each data shard stores 1/data of them and the decoder gathers one layer at
a time inside its scan (``gathered``), trading an all-gather per layer for memory.
"""

from collections.abc import Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec, Sharding

from jaxtune.nf4_storage import NF4Storage
from jaxtune.parallel import pipeline

# logical axis -> mesh axis (None: replicated).
RULES: dict[str, str | None] = {
  # parameters (and the activations that share their axes)
  "layers": "pipe",
  "embed": None,
  "heads": "tensor",
  "kv_heads": "tensor",
  "mlp": "tensor",
  "vocab": "tensor",
  # activations only
  "batch": "data",  # sequences of a step
  "accum": None,  # gradient-accumulation micro-batches of a step
  "length": "context",  # tokens of a sequence (context parallelism: context.py)
  "norm_length": "context",  # tokens of the residual stream (tensor under sequence parallelism)
  "head_dim": None,
}
# Added for frozen NF4 storage with shard_frozen: the hidden dimension of every projection,
# the one tensor parallelism leaves whole.
FROZEN_RULES: dict[str, str] = {"embed": "data"}


def logical_spec(
  names: Sequence[str | None], rules: dict[str, str | None], mesh: Mesh | None
) -> PartitionSpec:
  """PartitionSpec for dimensions with logical ``names`` (None: replicated) under ``rules``;
  mesh axes of size 1 (or absent from ``mesh``) are left out."""
  spec = []
  for name in names:
    axis = rules.get(name) if name else None
    if axis is not None and (mesh is None or mesh.shape.get(axis, 1) == 1):
      axis = None
    spec.append(axis)
  return PartitionSpec(*spec)


def spec_for(
  axes: tuple, shape: tuple[int, ...], mesh: Mesh | AbstractMesh, *, shard_frozen: bool = False
) -> PartitionSpec:
  """PartitionSpec of an array with logical ``axes``; an axis that does not divide stays whole.

  The stacked ``layers`` axis is the exception: pipeline stages must be equal, so a layer
  count that the ``pipe`` size does not divide raises MeshError.
  """
  spec = []
  for name, dim in zip(axes, shape, strict=True):
    mesh_axis = RULES.get(name) if name else None
    if shard_frozen and mesh_axis is None and name in FROZEN_RULES:
      mesh_axis = FROZEN_RULES[name]
      shard_frozen = False  # one dimension is enough
    size = mesh.shape.get(mesh_axis, 1) if mesh_axis else 1
    if name == "layers" and size > 1:
      pipeline.check_stages(dim, size)
    if size == 1 or dim % size:
      mesh_axis = None
    spec.append(mesh_axis)
  return PartitionSpec(*spec)


def sharding_for(
  axes: tuple, shape: tuple[int, ...], mesh: Mesh | None, shard_frozen: bool = False
) -> Sharding:
  if mesh is None:
    return jax.sharding.SingleDeviceSharding(jax.devices()[0])
  return NamedSharding(mesh, spec_for(axes, shape, mesh, shard_frozen=shard_frozen))


def _axes(variable, value) -> tuple:
  return tuple(variable.get_metadata().get("axes") or (None,) * value.ndim)


def state_shardings(state: nnx.State, mesh: Mesh | None, shard_frozen: bool = False) -> nnx.State:
  """A pytree of shardings matching an ``nnx.State`` whose Variables carry ``axes``.

  ``shard_frozen``: also split NF4 storage over ``data`` (see FROZEN_RULES).
  """

  def one(variable):
    value = variable.get_value()
    fsdp = shard_frozen and isinstance(variable, NF4Storage)
    return sharding_for(_axes(variable, value), value.shape, mesh, shard_frozen=fsdp)

  return jax.tree.map(one, state, is_leaf=lambda x: hasattr(x, "get_metadata"))


def gathered(layer_state: nnx.State, mesh: Mesh | AbstractMesh) -> nnx.State:
  """One layer's state (a slice inside the layer scan) with its NF4 storage constrained to
  the layout it has without ``shard_frozen``: the per-layer all-gather of FSDP.

  A no-op for weights that were never split over ``data``. ``mesh`` may be the abstract mesh
  inside a ``shard_map``.
  """

  def one(variable):
    if not isinstance(variable, NF4Storage):
      return variable
    value = variable.get_value()
    spec = spec_for(_axes(variable, value)[1:], value.shape, mesh)  # [1:]: no layers axis
    return variable.replace(jax.lax.with_sharding_constraint(value, NamedSharding(mesh, spec)))

  return jax.tree.map(one, layer_state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def after_pipeline(mesh: Mesh, batch: int) -> NamedSharding:
  """The residual stream [B, T, D] leaving the pipeline, which every stage then holds: its
  batch split over ``pipe`` as well as ``data``, so that the final norm, the logits and the
  loss run once rather than on every stage (replicated over ``pipe`` if B does not split)."""
  rows = ("data", "pipe") if batch % (mesh.shape["data"] * mesh.shape["pipe"]) == 0 else "data"
  return NamedSharding(mesh, PartitionSpec(rows))


def can_split_sequence(mesh: Mesh, seq_len: int) -> bool:
  """Whether sequence parallelism applies: tensor > 1 dividing T, and no pipeline."""
  tp = mesh.shape.get("tensor", 1)
  return tp > 1 and seq_len % tp == 0 and mesh.shape.get("pipe", 1) == 1


def incoming(target: NamedSharding, shape: tuple[int, ...]) -> Sharding:
  """Where a host array bound for ``target`` is first put: ``target`` with one more dimension
  split over ``data`` (the first it divides). Each byte then crosses from the host once, not
  once per data replica, and the compiled update that writes it into its buffer all-gathers
  it (4x smaller once NF4) over the devices' own links."""
  if not isinstance(target, NamedSharding):  # one device
    return target
  mesh = target.mesh
  data = mesh.shape.get("data", 1)
  if data == 1:
    return target
  spec = list(target.spec) + [None] * (len(shape) - len(target.spec))
  for d, (axis, size) in enumerate(zip(spec, shape, strict=True)):
    names = () if axis is None else (axis,) if isinstance(axis, str) else tuple(axis)
    if "data" in names:
      return target  # already split over data
    if size % (data * int(np.prod([mesh.shape[n] for n in names]))) == 0:
      spec[d] = (*names, "data") if names else "data"
      return NamedSharding(mesh, PartitionSpec(*spec))
  return target
