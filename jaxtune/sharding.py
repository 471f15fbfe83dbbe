"""Every parallelism decision in one place: logical axis names -> mesh axes.

Parameters carry logical names (``axes`` metadata, see layers.py). Tensor parallelism is
Megatron-style: the column-parallel projections (q/k/v/gate/up) split their output features
over ``tensor``, the row-parallel ones (o/down) their input features, so each block needs one
all-reduce after attention and one after the MLP. The batch is split over ``data``.
"""

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

# logical axis -> mesh axis (None: replicated).
RULES: dict[str, str | None] = {
  "layers": None,
  "embed": None,
  "heads": "tensor",
  "kv_heads": "tensor",
  "mlp": "tensor",
  "vocab": "tensor",
  "batch": "data",
}


def spec_for(axes: tuple, shape: tuple[int, ...], mesh: Mesh) -> PartitionSpec:
  """PartitionSpec of an array with logical ``axes``; an axis that does not divide stays whole."""
  spec = []
  for name, dim in zip(axes, shape, strict=True):
    mesh_axis = RULES.get(name) if name else None
    if mesh_axis is not None and (mesh.shape[mesh_axis] == 1 or dim % mesh.shape[mesh_axis]):
      mesh_axis = None
    spec.append(mesh_axis)
  return PartitionSpec(*spec)


def sharding_for(axes: tuple, shape: tuple[int, ...], mesh: Mesh | None):
  if mesh is None:
    return jax.sharding.SingleDeviceSharding(jax.devices()[0])
  return NamedSharding(mesh, spec_for(axes, shape, mesh))


def state_shardings(state, mesh: Mesh | None):
  """A pytree of shardings matching an ``nnx.State`` whose Variables carry ``axes``."""

  def one(variable):
    value = variable.get_value()
    axes = variable.get_metadata().get("axes") or (None,) * value.ndim
    return sharding_for(tuple(axes), value.shape, mesh)

  return jax.tree.map(one, state, is_leaf=lambda x: hasattr(x, "get_metadata"))
