"""Several processes, one run: ``jax.distributed`` from the launcher's environment.

A run is multi-process when one of these says there is more than one process:

- jaxtune's own variables: ``JAXTUNE_COORDINATOR`` (host:port of process 0),
  ``JAXTUNE_NUM_PROCESSES``, ``JAXTUNE_PROCESS_ID`` and optionally ``JAXTUNE_LOCAL_DEVICE_IDS``
  (e.g. ``0,1,2,3``: the local GPUs this process drives; default all it sees);
- SLURM (``srun``: ``SLURM_STEP_NUM_TASKS``/``SLURM_NTASKS``, ``SLURM_PROCID``), one task per
  GPU, the coordinator on the first node of the step;
- Open MPI (``mpirun``: ``OMPI_COMM_WORLD_SIZE``, ``OMPI_COMM_WORLD_RANK``).

``initialize`` must run before anything asks JAX for its devices. After it, ``jax.devices()``
lists every process's devices, so the mesh spans them all; each process feeds only the rows of
the batch its own devices hold, and process 0 alone writes metrics and exports.
"""

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxtune.errors import DistributedError


@dataclasses.dataclass(frozen=True)
class Launch:
  num_processes: int
  process_id: int
  coordinator: str | None  # None: JAX finds it from the cluster (SLURM, Open MPI)
  local_device_ids: tuple[int, ...] | None
  source: str  # which variables said so, for messages
  cluster: str | None = None  # JAX's cluster detection method, when it finds the coordinator


def _int(env: Mapping[str, str], name: str) -> int:
  text = env[name]
  try:
    return int(text)
  except ValueError:
    raise DistributedError(f"{name}={text!r} is not a whole number.") from None


def launch_from_env(env: Mapping[str, str] = os.environ) -> Launch | None:
  """The launch the environment describes, or None for a single process."""
  ours = [k for k in ("JAXTUNE_COORDINATOR", "JAXTUNE_NUM_PROCESSES") if k in env]
  if ours:
    if "JAXTUNE_NUM_PROCESSES" not in env:
      raise DistributedError(
        "JAXTUNE_COORDINATOR is set but JAXTUNE_NUM_PROCESSES is not; set both (and "
        "JAXTUNE_PROCESS_ID) on every process."
      )
    n = _int(env, "JAXTUNE_NUM_PROCESSES")
    if n < 1:
      raise DistributedError(f"JAXTUNE_NUM_PROCESSES={n} must be at least 1.")
    if n == 1:
      return None
    if "JAXTUNE_COORDINATOR" not in env:
      raise DistributedError(
        f"JAXTUNE_NUM_PROCESSES={n} needs JAXTUNE_COORDINATOR=host:port, the address process 0 "
        "listens on, on every process."
      )
    for rank_var in ("JAXTUNE_PROCESS_ID", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK"):
      if rank_var in env:
        pid = _int(env, rank_var)
        break
    else:
      raise DistributedError(
        f"JAXTUNE_NUM_PROCESSES={n} needs JAXTUNE_PROCESS_ID (0 to {n - 1}) on every process."
      )
    if not 0 <= pid < n:
      raise DistributedError(f"process id {pid} is outside 0..{n - 1} (JAXTUNE_NUM_PROCESSES={n}).")
    local = None
    if env.get("JAXTUNE_LOCAL_DEVICE_IDS"):
      try:
        local = tuple(int(x) for x in env["JAXTUNE_LOCAL_DEVICE_IDS"].split(","))
      except ValueError:
        raise DistributedError(
          f"JAXTUNE_LOCAL_DEVICE_IDS={env['JAXTUNE_LOCAL_DEVICE_IDS']!r} must be device numbers "
          "separated by commas, e.g. 0,1,2,3."
        ) from None
    return Launch(n, pid, env["JAXTUNE_COORDINATOR"], local, "JAXTUNE_* variables")
  if "SLURM_PROCID" in env and "SLURM_STEP_NODELIST" in env:
    count = "SLURM_STEP_NUM_TASKS" if "SLURM_STEP_NUM_TASKS" in env else "SLURM_NTASKS"
    n = _int(env, count) if count in env else 1
    if n > 1:
      return Launch(n, _int(env, "SLURM_PROCID"), None, None, "SLURM", cluster="slurm")
  if "OMPI_COMM_WORLD_SIZE" in env and "OMPI_COMM_WORLD_RANK" in env:
    n = _int(env, "OMPI_COMM_WORLD_SIZE")
    if n > 1:
      return Launch(n, _int(env, "OMPI_COMM_WORLD_RANK"), None, None, "Open MPI", cluster="ompi")
  return None


def initialize(env: Mapping[str, str] = os.environ) -> Launch | None:
  """``jax.distributed.initialize`` when the environment says several processes; else nothing.

  Call it before anything touches JAX's devices.
  """
  launch = launch_from_env(env)
  if launch is None:
    return None
  try:
    jax.distributed.initialize(
      coordinator_address=launch.coordinator,
      num_processes=launch.num_processes,
      process_id=launch.process_id,
      local_device_ids=launch.local_device_ids,
      cluster_detection_method=launch.cluster if launch.coordinator is None else None,
    )
  except RuntimeError as e:  # XlaRuntimeError is one; timeouts and refused connections
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    where = launch.coordinator or f"the coordinator {launch.source} names"
    raise DistributedError(
      f"process {launch.process_id} of {launch.num_processes} ({launch.source}) could not join "
      f"the run at {where} ({first}); start every process with the same coordinator and "
      "check that process 0 runs and its port is reachable."
    ) from e
  return launch


def is_main() -> bool:
  """True on the process that writes metrics, config and exports (process 0)."""
  return jax.process_index() == 0


def global_batch(host: np.ndarray, sharding: NamedSharding | None) -> jax.Array:
  """A global array from the full host batch, each process transferring only its own rows.

  Every process computes the same host batch (a pure function of the step); the rows its
  devices hold are cut out here and handed to ``make_array_from_process_local_data``.
  """
  if sharding is None:
    return jax.device_put(host)
  if jax.process_count() == 1:
    return jax.device_put(host, sharding)
  index = sharding.addressable_devices_indices_map(host.shape).values()
  # This process's devices hold one contiguous block along each dimension.
  block = tuple(
    slice(min(ix[d].start or 0 for ix in index), max(ix[d].stop or host.shape[d] for ix in index))
    for d in range(host.ndim)
  )
  return jax.make_array_from_process_local_data(sharding, host[block], host.shape)


def replicated(mesh: Mesh | None) -> NamedSharding | None:
  return None if mesh is None else NamedSharding(mesh, PartitionSpec())


def local_copy(tree: Any, mesh: Mesh | None) -> Any:
  """Every array of ``tree`` whole on this process's first device (for writing files).

  With several processes an array spans devices this process cannot read; it is first
  replicated over the mesh (every process takes part), then taken from a local device.
  """
  if mesh is None or jax.process_count() == 1:
    return tree
  tree = jax.jit(lambda t: t, out_shardings=replicated(mesh))(tree)
  return jax.tree.map(lambda x: x.addressable_data(0), tree)


def local_model(model: nnx.Module, mesh: Mesh | None) -> nnx.Module:
  """The model with every array whole on this process (a no-op with one process)."""
  graphdef, state = nnx.split(model)
  return nnx.merge(graphdef, local_copy(state, mesh))


def any_process(flag: bool) -> bool:
  """True when ``flag`` is true on any process (every process must call this together)."""
  if jax.process_count() == 1:
    return flag
  from jax.experimental import multihost_utils

  flags = multihost_utils.process_allgather(np.asarray([flag], np.int32))
  return bool(np.any(flags))


def barrier(name: str) -> None:
  """Wait until every process reaches the same point (a no-op with one process)."""
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils

    multihost_utils.sync_global_devices(name)
