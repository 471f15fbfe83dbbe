"""Several processes, one run: ``jax.distributed`` from the launcher's environment.

A run is multi-process when the first of these that applies says there is more than one
process:

- jaxtune's own variables, which override everything below: ``JAXTUNE_COORDINATOR`` (host:port
  of process 0), ``JAXTUNE_NUM_PROCESSES``, ``JAXTUNE_PROCESS_ID`` (or the launcher's rank:
  ``SLURM_PROCID``, ``OMPI_COMM_WORLD_RANK``, ``PMI_RANK``, ``JOB_COMPLETION_INDEX``) and
  optionally ``JAXTUNE_LOCAL_DEVICE_IDS`` (e.g. ``0,1,2,3``: the local GPUs this process drives;
  default all it sees). ``JAXTUNE_NUM_PROCESSES=1`` runs one process whatever the launcher says;
- SLURM (``srun``: ``SLURM_STEP_NUM_TASKS``/``SLURM_NTASKS``, ``SLURM_PROCID``), one task per
  GPU, the coordinator on the first node of the step;
- Open MPI (``mpirun``: ``OMPI_COMM_WORLD_SIZE``, ``OMPI_COMM_WORLD_RANK``);
- other MPIs (MPICH, Intel MPI: ``PMI_SIZE``/``PMI_RANK``; MVAPICH: ``MV2_COMM_WORLD_*``),
  bootstrapped through ``mpi4py``, which JAX uses only when asked;
- any other cluster ``jax.distributed.initialize`` detects by itself (Kubernetes indexed Jobs,
  Cloud TPU, ...): jaxtune asks JAX's own cluster classes whether their environment is present
  and how many processes it has. They are private JAX API (``jax._src.clusters``, as in jax
  0.11.2); a JAX without them leaves only the launchers above, with one line saying so.

``initialize`` must run before anything asks JAX for its devices. After it, ``jax.devices()``
lists every process's devices, so the mesh spans them all; each process feeds only the rows of
the batch its own devices hold, and process 0 alone writes metrics and exports. A launch of N
processes that JAX initialises as another number is an error, never N unrelated runs.
"""

import dataclasses
import functools
import os
import sys
from collections.abc import Mapping, Sequence
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
  coordinator: str | None  # None: JAX finds it from the cluster
  local_device_ids: tuple[int, ...] | None
  source: str  # which variables (or which of JAX's clusters) said so, for messages
  cluster: str | None = None  # JAX's cluster detection method; None: JAX's own choice


# The launcher's rank, for JAXTUNE_COORDINATOR + JAXTUNE_NUM_PROCESSES without JAXTUNE_PROCESS_ID.
_RANKS = ("JAXTUNE_PROCESS_ID", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK")
_RANKS += ("MV2_COMM_WORLD_RANK", "JOB_COMPLETION_INDEX")
# MPI launchers other than Open MPI: (size, rank) variables; JAX reaches them through mpi4py.
_MPI = (("PMI_SIZE", "PMI_RANK"), ("MV2_COMM_WORLD_SIZE", "MV2_COMM_WORLD_RANK"))


def _int(env: Mapping[str, str], name: str) -> int:
  text = env[name]
  try:
    return int(text)
  except ValueError:
    raise DistributedError(f"{name}={text!r} is not a whole number.") from None


@functools.cache
def jax_clusters() -> tuple[type, ...] | None:
  """The cluster environments ``jax.distributed.initialize`` tries, in its order; None (said once
  on stderr) when this JAX keeps them elsewhere than jax 0.11.2 did."""
  try:
    from jax._src.clusters import ClusterEnv  # private: pinned to jax 0.11.2's layout

    found = tuple(ClusterEnv._cluster_types)
  except (ImportError, AttributeError):
    found = ()
  needed = ("name", "opt_in_only_method", "is_env_present", "get_process_count", "get_process_id")
  if found and all(hasattr(c, m) for c in found for m in needed):
    return found
  print(
    f"jaxtune: jax {jax.__version__} has no jax._src.clusters.ClusterEnv as jax 0.11.2 had, so "
    "only JAXTUNE_*, SLURM and MPI variables can say this run has several processes.",
    file=sys.stderr,
  )
  return None


def _ours(env: Mapping[str, str]) -> Launch | None:
  """The launch jaxtune's own variables describe (the caller checked one is set)."""
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
  rank_var = next((v for v in _RANKS if v in env), None)
  if rank_var is None:
    raise DistributedError(
      f"JAXTUNE_NUM_PROCESSES={n} needs JAXTUNE_PROCESS_ID (0 to {n - 1}) on every process."
    )
  pid = _int(env, rank_var)
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


def _mpi(env: Mapping[str, str], clusters: Sequence[type] | None) -> Launch | None:
  """An MPI launch other than Open MPI's, which JAX bootstraps through mpi4py."""
  for size_var, rank_var in _MPI:
    if size_var not in env:
      continue
    n = _int(env, size_var)
    if n <= 1:
      return None
    mpi4py = next((c for c in clusters or () if c.name == "mpi4py"), None)
    if mpi4py is None or not mpi4py.is_env_present():
      why = "mpi4py is not installed" if mpi4py else "this JAX has no mpi4py detection"
      raise DistributedError(
        f"{size_var}={n} says the MPI launcher started {n} processes, but JAX can join them only "
        f"through mpi4py and {why}; pip install mpi4py, or give every process "
        f"JAXTUNE_COORDINATOR=host:port and JAXTUNE_NUM_PROCESSES={n}."
      )
    pid = _int(env, rank_var) if rank_var in env else mpi4py.get_process_id()
    return Launch(n, pid, None, None, f"MPI ({size_var}) through mpi4py", cluster="mpi4py")
  return None


def _detected_by_jax(clusters: Sequence[type]) -> Launch | None:
  """The first cluster JAX would detect by itself, when it has several processes.

  SLURM and Open MPI are read above (a batch script outside ``srun`` is one process even when
  SLURM_NTASKS says more), and opt-in methods (mpi4py) only when a launcher asks for them.
  """
  for cluster in clusters:
    if cluster.opt_in_only_method or cluster.name in ("slurm", "ompi"):
      continue
    what = f"JAX's {cluster.__name__}"
    try:
      if not cluster.is_env_present():
        continue
      n = int(cluster.get_process_count())
      pid = int(cluster.get_process_id()) if n > 1 else 0
    except Exception as e:  # the cluster's own client (kubernetes, metadata server): any error
      text = str(e).strip()
      first = text.splitlines()[0] if text else type(e).__name__
      raise DistributedError(
        f"{what} sees this process in its cluster but cannot read the launch ({first}); fix the "
        "job as that says, or run one process with JAXTUNE_NUM_PROCESSES=1, or give every "
        "process JAXTUNE_COORDINATOR, JAXTUNE_NUM_PROCESSES and JAXTUNE_PROCESS_ID."
      ) from e
    if n <= 1:
      return None
    return Launch(n, pid, None, None, what, cluster=cluster.name or None)
  return None


def launch_from_env(
  env: Mapping[str, str] = os.environ, clusters: Sequence[type] | None = None
) -> Launch | None:
  """The launch the environment describes, or None for a single process.

  ``clusters``: JAX's cluster environments to ask after jaxtune's own reading of ``env``
  (default: all JAX has, see ``jax_clusters``; they read ``os.environ``, not ``env``).
  """
  if "JAXTUNE_COORDINATOR" in env or "JAXTUNE_NUM_PROCESSES" in env:
    return _ours(env)
  if "SLURM_PROCID" in env and "SLURM_STEP_NODELIST" in env:
    count = "SLURM_STEP_NUM_TASKS" if "SLURM_STEP_NUM_TASKS" in env else "SLURM_NTASKS"
    n = _int(env, count) if count in env else 1
    if n > 1:
      return Launch(n, _int(env, "SLURM_PROCID"), None, None, "SLURM", cluster="slurm")
  if "OMPI_COMM_WORLD_SIZE" in env and "OMPI_COMM_WORLD_RANK" in env:
    n = _int(env, "OMPI_COMM_WORLD_SIZE")
    if n > 1:
      return Launch(n, _int(env, "OMPI_COMM_WORLD_RANK"), None, None, "Open MPI", cluster="ompi")
  if clusters is None:
    clusters = jax_clusters()
  launch = _mpi(env, clusters)
  if launch is None and clusters:
    launch = _detected_by_jax(clusters)
  return launch


def initialize(
  env: Mapping[str, str] = os.environ, clusters: Sequence[type] | None = None
) -> Launch | None:
  """``jax.distributed.initialize`` when the environment says several processes; else nothing.

  Call it before anything touches JAX's devices.
  """
  launch = launch_from_env(env, clusters)
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
  if jax.process_count() != launch.num_processes:
    raise DistributedError(
      f"the launcher says {launch.num_processes} processes ({launch.source}) but JAX "
      f"initialised {jax.process_count()}, so each would train alone; use a JAX backend that "
      "spans processes (JAX_PLATFORMS cuda, rocm, tpu or cpu), or run one process with "
      "JAXTUNE_NUM_PROCESSES=1."
    )
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
