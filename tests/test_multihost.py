"""Several processes: jax.distributed from the environment, one run over every process's devices.

On CPU each process fakes its own devices (XLA_FLAGS) and the processes talk through gloo, as
GPU processes would through NCCL.
"""

import itertools
import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import background_run, compile_cache_env, finish, start_cli

from jaxtune import distributed
from jaxtune.run_config import RunConfig
from jaxtune.session import run_training

REPO = Path(__file__).resolve().parents[1]


_LANES = itertools.count()


def _env(devices: int, **extra) -> dict:
  """The environment of a process started beside others: its compilation cache of its own."""
  env = {k: v for k, v in os.environ.items() if not k.startswith(("JAXTUNE_", "SLURM_", "OMPI_"))}
  env.update(
    XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}", JAX_PLATFORMS="cpu", **extra
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
  ],
)
def test_launch_from_env(env, want):
  launch = distributed.launch_from_env(env)
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
    distributed.launch_from_env(env)


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

  np.testing.assert_allclose(_losses(multi), _losses(one), rtol=1e-6)
  assert len(_losses(multi)) == 3  # one writer
  assert sorted(os.listdir(multi / "checkpoints")) == ["2", "3"]
  from safetensors.numpy import load_file

  a = load_file(multi / "export" / "adapter_model.safetensors")
  b = load_file(one / "export" / "adapter_model.safetensors")
  assert a.keys() == b.keys() and len(a) > 0
  for k in a:
    np.testing.assert_allclose(a[k], b[k], rtol=1e-5, atol=1e-7, err_msg=k)


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
