"""``--embeddings host``: the input embedding table in host memory, its rows sent with each
batch."""

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jaxtune.parallel import distributed
from jaxtune.parallel.runtime import Runtime


class HostRows:
  """``--embeddings host``: the input embedding table moved to host memory (its place in the
  frozen state holds an empty array on the devices, which the step never reads) and each
  batch's rows gathered from it there, as ``inputs_embeds``.

  The table's device buffer is freed: the model given to ``train`` no longer holds it (the
  model ``train`` returns does)."""

  def __init__(self, frozen: nnx.State, runtime: Runtime):
    table = frozen["embed_tokens"]["embedding"][...]
    self._sharding = table.sharding
    self.table = np.asarray(distributed.local_copy(table, runtime.mesh))
    mesh = runtime.mesh
    empty = np.zeros((0, table.shape[1]), table.dtype)
    where = NamedSharding(mesh, PartitionSpec()) if mesh is not None else self._sharding
    self.frozen = self._with(frozen, jax.device_put(empty, where))
    table.delete()

  def add(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The host batch with the embedding rows of its ``input_ids`` ([..., T] -> [..., T, D])."""
    return {**batch, "inputs_embeds": self.table[batch["input_ids"]]}

  def restore(self, frozen: nnx.State) -> nnx.State:
    """``frozen`` with the whole table back on the devices."""
    return self._with(frozen, distributed.global_batch(self.table, self._sharding))

  @staticmethod
  def _with(frozen: nnx.State, table: jax.Array) -> nnx.State:
    frozen = jax.tree.map(lambda x: x, frozen)  # new containers, the same arrays
    variable = frozen["embed_tokens"]["embedding"]
    frozen["embed_tokens"]["embedding"] = variable.replace(table)
    return frozen
