"""Several processes: jax.distributed from the environment, one run over every process's devices.

On CPU each process fakes its own devices (XLA_FLAGS) and the processes talk through gloo, as
GPU processes would through NCCL.
"""

import importlib.util
import itertools
import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import TEST_XLA_FLAGS, background_run, compile_cache_env, finish, start_cli

from jaxtune.parallel import distributed
from jaxtune.run.session import run_training
from jaxtune.run_config import RunConfig

REPO = Path(__file__).resolve().parents[2]


_LANES = itertools.count()


def _env(devices: int, **extra) -> dict:
  """The environment of a process started beside others: its compilation cache of its own.
  TEST_XLA_FLAGS stay (unlike other command lines, conftest.command_line_env): the losses are
  compared with a run in this process at rtol 1e-6."""
  env = {k: v for k, v in os.environ.items() if not k.startswith(("JAXTUNE_", "SLURM_", "OMPI_"))}
  env.update(
    XLA_FLAGS=f"--xla_force_host_platform_device_count={devices} {TEST_XLA_FLAGS}",
    JAX_PLATFORMS="cpu",
    **extra,
  )
  return compile_cache_env(env, f"multihost-{next(_LANES)}")


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _train(out: Path, env: dict, *flags: str) -> subprocess.Popen:
  argv = [sys.executable, "-m", "jaxtune.train", "--out", str(out), *flags]
  return start_cli(argv, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def _losses(out: Path) -> list[float]:
  return [json.loads(x)["loss"] for x in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize(
  "env,want",
  [
    ({}, None),
    ({"JAXTUNE_NUM_PROCESSES": "1"}, None),
    (
      {"JAXTUNE_COORDINATOR": "h0:1234", "JAXTUNE_NUM_PROCESSES": "2", "JAXTUNE_PROCESS_ID": "1"},
      (2, 1, "h0:1234", None),
    ),
    (
      {
        "JAXTUNE_COORDINATOR": "h0:1234",
        "JAXTUNE_NUM_PROCESSES": "4",
        "JAXTUNE_PROCESS_ID": "3",
        "JAXTUNE_LOCAL_DEVICE_IDS": "6,7",
      },
      (4, 3, "h0:1234", (6, 7)),
    ),
    # Our coordinator, the rank from the launcher.
    (
      {"JAXTUNE_COORDINATOR": "h0:1", "JAXTUNE_NUM_PROCESSES": "16", "SLURM_PROCID": "9"},
      (16, 9, "h0:1", None),
    ),
    (
      {"SLURM_PROCID": "3", "SLURM_STEP_NUM_TASKS": "16", "SLURM_STEP_NODELIST": "gpu[01-02]"},
      (16, 3, None, None),
    ),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_STEP_NODELIST": "gpu01"}, None),
    ({"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "1"}, (2, 1, None, None)),
    # A Kubernetes indexed Job with our coordinator (no kubernetes package needed).
    (
      {
        "JAXTUNE_COORDINATOR": "job-0.svc:1",
        "JAXTUNE_NUM_PROCESSES": "4",
        "JOB_COMPLETION_INDEX": "2",
      },
      (4, 2, "job-0.svc:1", None),
    ),
    # JAXTUNE_NUM_PROCESSES=1 overrides the launcher: one process.
    (
      {
        "JAXTUNE_NUM_PROCESSES": "1",
        "SLURM_PROCID": "3",
        "SLURM_STEP_NUM_TASKS": "16",
        "SLURM_STEP_NODELIST": "gpu[01-02]",
      },
      None,
    ),
  ],
)
def test_launch_from_env(env, want):
  launch = distributed.launch_from_env(env, clusters=())
  if want is None:
    assert launch is None
  else:
    got = (launch.num_processes, launch.process_id, launch.coordinator, launch.local_device_ids)
    assert got == want


@pytest.mark.parametrize(
  "env,match",
  [
    ({"JAXTUNE_COORDINATOR": "h0:1"}, "JAXTUNE_NUM_PROCESSES is not"),
    ({"JAXTUNE_NUM_PROCESSES": "2", "JAXTUNE_PROCESS_ID": "0"}, "needs JAXTUNE_COORDINATOR"),
    ({"JAXTUNE_NUM_PROCESSES": "2", "JAXTUNE_COORDINATOR": "h:1"}, "needs JAXTUNE_PROCESS_ID"),
    ({"JAXTUNE_NUM_PROCESSES": "two", "JAXTUNE_COORDINATOR": "h:1"}, "not a whole number"),
    (
      {"JAXTUNE_NUM_PROCESSES": "2", "JAXTUNE_COORDINATOR": "h:1", "JAXTUNE_PROCESS_ID": "2"},
      "outside 0..1",
    ),
  ],
)
def test_incomplete_launch_is_one_sentence(env, match):
  with pytest.raises(distributed.DistributedError, match=match):
    distributed.launch_from_env(env, clusters=())


# Launches JAX detects by itself, asked through its cluster classes (private: jax 0.11.2).


def test_jax_clusters_are_jax_own():
  """The classes jax.distributed.initialize tries, in its order, are the ones jaxtune asks."""
  from jax._src import clusters

  got = distributed.jax_clusters()
  assert got == tuple(clusters.ClusterEnv._cluster_types)
  assert {clusters.K8sCluster, clusters.Mpi4pyCluster, clusters.GkeTpuCluster} <= set(got)


def _fake(monkeypatch, cluster, present=True, **methods):
  """Make one of JAX's cluster classes answer as it would inside its cluster."""
  monkeypatch.setattr(cluster, "is_env_present", classmethod(lambda cls: present))
  for name, value in methods.items():
    monkeypatch.setattr(cluster, name, classmethod(lambda cls, v=value: v))


class _Calls(list):
  """jax.distributed.initialize's keyword arguments, call by call, and the process count JAX
  then reports."""

  process_count = 1


@pytest.fixture
def calls(monkeypatch):
  """A JAX whose distributed.initialize only records its arguments."""
  got = _Calls()
  monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: got.append(kw))
  monkeypatch.setattr(jax, "process_count", lambda: got.process_count)
  return got


def test_kubernetes_job_through_jax(monkeypatch, calls):
  """A Kubernetes indexed Job of 4 pods: JAX's K8sCluster says so (its API answers faked, the
  pod's index read by JAX from JOB_COMPLETION_INDEX), and JAX finds the coordinator itself."""
  from jax._src.clusters import K8sCluster

  monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.0.0.1")
  monkeypatch.setenv("JOB_COMPLETION_INDEX", "2")
  _fake(monkeypatch, K8sCluster, get_process_count=4)
  calls.process_count = 4
  launch = distributed.initialize({})
  assert (launch.num_processes, launch.process_id, launch.coordinator) == (4, 2, None)
  assert launch.source == "JAX's K8sCluster"
  want = dict(
    coordinator_address=None,
    num_processes=4,
    process_id=2,
    local_device_ids=None,
    cluster_detection_method=None,  # K8sCluster has no name in jax 0.11.2: JAX picks it
  )
  assert calls == [want]


def test_one_pod_is_one_process(monkeypatch, calls):
  from jax._src.clusters import K8sCluster

  _fake(monkeypatch, K8sCluster, get_process_count=1)
  assert distributed.initialize({}) is None
  assert calls == []


def test_our_variables_override_jax_detection(monkeypatch, calls):
  from jax._src.clusters import K8sCluster

  _fake(monkeypatch, K8sCluster, get_process_count=4, get_process_id=0)
  assert distributed.initialize({"JAXTUNE_NUM_PROCESSES": "1"}) is None
  env = {"JAXTUNE_COORDINATOR": "h0:9", "JAXTUNE_NUM_PROCESSES": "2", "JAXTUNE_PROCESS_ID": "1"}
  calls.process_count = 2
  assert distributed.initialize(env).source == "JAXTUNE_* variables"
  assert calls == [
    dict(
      coordinator_address="h0:9",
      num_processes=2,
      process_id=1,
      local_device_ids=None,
      cluster_detection_method=None,
    )
  ]


def test_cluster_that_cannot_be_read_is_one_sentence(monkeypatch, calls):
  """A pod that is not in a Job (JAX's own error) fails before training, saying how out."""
  from jax._src.clusters import K8sCluster

  def no_job(cls):
    raise RuntimeError("In K8s, cluster automatic bootstrap only supports Job/JobSet.")

  _fake(monkeypatch, K8sCluster)
  monkeypatch.setattr(K8sCluster, "get_process_count", classmethod(no_job))
  with pytest.raises(distributed.DistributedError) as e:
    distributed.initialize({})
  assert str(e.value) == (
    "JAX's K8sCluster sees this process in its cluster but cannot read the launch (In K8s, "
    "cluster automatic bootstrap only supports Job/JobSet.); fix the job as that says, or run "
    "one process with JAXTUNE_NUM_PROCESSES=1, or give every process JAXTUNE_COORDINATOR, "
    "JAXTUNE_NUM_PROCESSES and JAXTUNE_PROCESS_ID."
  )
  assert calls == []


@pytest.mark.skipif(importlib.util.find_spec("kubernetes") is not None, reason="kubernetes")
def test_kubernetes_without_its_package_warns(monkeypatch, calls):
  """JAX cannot read a Kubernetes launch without the kubernetes package; its warning says so
  and the run is one process (a Job of parallelism 1 is common, so no error)."""
  monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.0.0.1")
  with pytest.warns(UserWarning, match="kubernetes"):
    assert distributed.initialize({}) is None
  assert calls == []


def test_mpi_through_mpi4py(monkeypatch, calls):
  """mpiexec of MPICH or Intel MPI: JAX bootstraps through mpi4py (opt-in, so asked for)."""
  from jax._src.clusters import Mpi4pyCluster

  _fake(monkeypatch, Mpi4pyCluster)
  calls.process_count = 4
  launch = distributed.initialize({"PMI_SIZE": "4", "PMI_RANK": "1"})
  assert (launch.num_processes, launch.process_id, launch.cluster) == (4, 1, "mpi4py")
  assert calls == [
    dict(
      coordinator_address=None,
      num_processes=4,
      process_id=1,
      local_device_ids=None,
      cluster_detection_method="mpi4py",
    )
  ]
  assert distributed.initialize({"PMI_SIZE": "1", "PMI_RANK": "0"}) is None
  assert len(calls) == 1


def test_mpi_without_mpi4py_is_one_sentence(monkeypatch, calls):
  from jax._src.clusters import Mpi4pyCluster

  _fake(monkeypatch, Mpi4pyCluster, present=False)
  with pytest.raises(distributed.DistributedError) as e:
    distributed.initialize({"MV2_COMM_WORLD_SIZE": "8", "MV2_COMM_WORLD_RANK": "0"})
  assert str(e.value) == (
    "MV2_COMM_WORLD_SIZE=8 says the MPI launcher started 8 processes, but JAX can join them "
    "only through mpi4py and mpi4py is not installed; pip install mpi4py, or give every process "
    "JAXTUNE_COORDINATOR=host:port and JAXTUNE_NUM_PROCESSES=8."
  )
  assert calls == []


def test_slurm_initialize_arguments(calls):
  calls.process_count = 16
  env = {"SLURM_PROCID": "3", "SLURM_STEP_NUM_TASKS": "16", "SLURM_STEP_NODELIST": "gpu[01-02]"}
  assert distributed.initialize(env, clusters=()).source == "SLURM"
  assert calls == [
    dict(
      coordinator_address=None,
      num_processes=16,
      process_id=3,
      local_device_ids=None,
      cluster_detection_method="slurm",
    )
  ]


def test_several_processes_initialised_as_one_is_an_error(calls):
  """The launcher says 2 processes but JAX came up with 1: an error, not 2 unrelated runs."""
  calls.process_count = 1
  env = {"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "0"}
  with pytest.raises(distributed.DistributedError) as e:
    distributed.initialize(env, clusters=())
  assert str(e.value) == (
    "the launcher says 2 processes (Open MPI) but JAX initialised 1, so each would train alone; "
    "use a JAX backend that spans processes (JAX_PLATFORMS cuda, rocm, tpu or cpu), or run one "
    "process with JAXTUNE_NUM_PROCESSES=1."
  )
  assert len(calls) == 1


def test_jax_without_its_cluster_classes(monkeypatch, capsys, calls):
  """A JAX that moved jax._src.clusters: one line says so; jaxtune's own readings still work."""
  monkeypatch.setitem(sys.modules, "jax._src.clusters", None)  # its import now fails
  distributed.jax_clusters.cache_clear()
  try:
    assert distributed.jax_clusters() is None
    assert distributed.jax_clusters() is None  # said once
    assert capsys.readouterr().err.count("has no jax._src.clusters.ClusterEnv") == 1
    env = {"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "1"}
    assert distributed.launch_from_env(env).cluster == "ompi"
    assert distributed.launch_from_env({}) is None
    with pytest.raises(distributed.DistributedError, match="this JAX has no mpi4py detection"):
      distributed.launch_from_env({"PMI_SIZE": "2", "PMI_RANK": "0"})
  finally:
    distributed.jax_clusters.cache_clear()


@background_run("two_processes")
def _two_processes(directory, runs):
  """The run of the test below as 2 processes x 4 devices: (its --out, the finished processes)."""
  flags = ["--mesh", "2x4", "--steps", "3", "--seq-len", "64", "--save-every", "2"]
  flags += ["--export", "peft", "--lora-rank", "4"]
  port = _free_port()
  multi = directory / "multi"
  procs = [
    _train(
      multi,
      _env(
        4,
        JAXTUNE_COORDINATOR=f"127.0.0.1:{port}",
        JAXTUNE_NUM_PROCESSES="2",
        JAXTUNE_PROCESS_ID=str(i),
      ),
      *flags,
    )
    for i in range(2)
  ]
  return multi, [finish(p, timeout=600) for p in procs]


@pytest.mark.slow
def test_two_processes_train_like_one(two_processes, tmp_path):
  """2 processes x 4 devices under --mesh 2x4 give the losses, checkpoints and export of one
  process with 8 devices; only process 0 writes metrics and the export."""
  # The same run in this process (8 fake devices, see conftest.py).
  one = tmp_path / "one"
  run = RunConfig.from_settings(  # as the command line builds it (the default run's settings)
    dict(out=str(one), mesh="2x4", steps=3, seq_len=64, save_every=2, export="peft", lora_rank=4)
  )
  run_training(run)
  multi, procs = two_processes
  outputs = [p.stdout for p in procs]
  for i, (p, text) in enumerate(zip(procs, outputs, strict=True)):
    assert p.returncode == 0, f"process {i}:\n{text[-3000:]}"
  assert "on 8 cpu device(s) in 2 processes" in outputs[0]
  assert "step 3/3" in outputs[0] and "step 1/3" not in outputs[1]  # only process 0 reports

  # Two processes sum the gradients over gloo, one process inside XLA: another order of the
  # same sums, which Adam's normalised steps carry into the next losses (3e-5 at step 3 since
  # the warmup's first step trains; 1e-6 when it had a learning rate of 0).
  np.testing.assert_allclose(_losses(multi), _losses(one), rtol=2e-4)
  assert len(_losses(multi)) == 3  # one writer
  assert sorted(os.listdir(multi / "checkpoints")) == ["2", "3"]
  from safetensors.numpy import load_file

  a = load_file(multi / "export" / "adapter_model.safetensors")
  b = load_file(one / "export" / "adapter_model.safetensors")
  assert a.keys() == b.keys() and len(a) > 0
  for k in a:
    # Adam's steps are about the learning rate whatever a gradient's size, so an entry whose
    # gradient is near 0 (lora_A's while B is near 0) takes the sums' rounding into the sign
    # of its step (one entry of 1,024 seen a step of 1.3e-3 apart): on the whole the same,
    # none further apart than the steps' sum (2 x (6.7e-4 + 1.3e-3 + 2e-3)).
    apart = np.abs(a[k] - b[k])
    assert apart.mean() < 0.05 * np.abs(b[k]).mean(), k
    assert apart.max() < 8e-3, k


@background_run("concurrent_runs")
def _concurrent_runs(directory, runs):
  """Two runs at once, on 2 and on 3 devices: (their --out directories, finished processes)."""
  flags = ["--steps", "2", "--seq-len", "32", "--export", "none", "--lora-rank", "4"]
  outs = directory / "a", directory / "b"
  a = _train(outs[0], _env(2), *flags, "--batch-size", "4")
  b = _train(outs[1], _env(3), *flags, "--batch-size", "6")
  return outs, (finish(a, timeout=600), finish(b, timeout=600))


@pytest.mark.slow
def test_concurrent_runs_see_only_their_own_devices(concurrent_runs):
  """Two jobs at once, each limited to its devices (CUDA_VISIBLE_DEVICES on a GPU machine; a
  device count here): each trains on exactly what it was given, and the mesh defaults to it."""
  (dir_a, dir_b), (a, b) = concurrent_runs
  out_a, out_b = a.stdout, b.stdout
  assert a.returncode == 0, out_a[-3000:]
  assert b.returncode == 0, out_b[-3000:]
  assert re.search(r"mesh \{'data': 2, .*\} on 2 cpu device\(s\);", out_a)
  assert re.search(r"mesh \{'data': 3, .*\} on 3 cpu device\(s\);", out_b)
  assert len(_losses(dir_a)) == len(_losses(dir_b)) == 2


def test_no_nvidia_smi():
  """Devices come from JAX (what the process may use), never from nvidia-smi (all GPUs)."""
  for package in ("jaxtune", "converters"):
    for path in (REPO / package).rglob("*.py"):
      text = path.read_text()
      assert "nvidia-smi" not in text and "subprocess" not in text, path
