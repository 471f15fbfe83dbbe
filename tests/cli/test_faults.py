"""Things going wrong mid-run: signals, kills during a save, a full disk, a corrupt checkpoint.

Each must leave a checkpoint that loads and a sentence that says what happened.
"""

import errno
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import background_run, run_cli

from jaxtune.run import resolve as resolver
from jaxtune.run_config import RunConfig
from jaxtune.training import checkpoint

REPO = Path(__file__).resolve().parents[2]


def _metrics(out):
  by_step = {}
  for line in (out / "metrics.jsonl").read_text().splitlines():
    row = json.loads(line)
    by_step[row["step"]] = row["loss"]  # a resumed run rewrites the steps after the checkpoint
  return [by_step[s] for s in sorted(by_step)]


# The run the SIGTERM test interrupts and resumes, and the same run uninterrupted.
_SIGTERM_FLAGS = ["--steps", "12", "--save-every", "5", "--export", "none", "--lora-dropout", "0.1"]
_SIGTERM_FLAGS += ["--seq-len", "64", "--lora-rank", "4"]


# Runs the command line given after the metrics file as its child and sends it SIGTERM once
# step 6 is logged (so the stop lands between save points); exits as the child did. A process
# of its own, not a thread of this one: a thread here may wait on the GIL (tests tracing and
# compiling beside it) past the next save point, the steps being ~0.1 s apart.
_INTERRUPT_AT_STEP_6 = textwrap.dedent(
  """
  import os, signal, subprocess, sys, time
  metrics, argv = sys.argv[1], sys.argv[2:]
  proc = subprocess.Popen(argv)
  deadline = time.time() + 600
  while time.time() < deadline and proc.poll() is None:
    if os.path.isfile(metrics) and len(open(metrics).read().splitlines()) >= 6:
      proc.send_signal(signal.SIGTERM)
      break
    time.sleep(0.02)
  code = proc.wait()
  if code < 0:  # killed by a signal: die of it too
    signal.signal(-code, signal.SIG_DFL)
    os.kill(os.getpid(), -code)
  sys.exit(code)
  """
)


@background_run("sigterm_and_resume")
def _sigterm_and_resume(directory, runs):
  """The command-line run, sent SIGTERM once step 6 is logged, then again with --resume, then
  the same run uninterrupted: (the first's --out, the stopped process, the checkpoints it
  left, the resumed process, the uninterrupted run's --out and process)."""
  cut, full = directory / "cut", directory / "full"
  train = [sys.executable, "-m", "jaxtune.train", *_SIGTERM_FLAGS]
  interrupt = [sys.executable, "-c", _INTERRUPT_AT_STEP_6, str(cut / "metrics.jsonl")]
  stopped = run_cli([*interrupt, *train, "--out", str(cut)], timeout=600, cwd=REPO)
  left = os.listdir(cut / "checkpoints") if (cut / "checkpoints").is_dir() else []
  resumed = run_cli([*train, "--out", str(cut), "--resume"], timeout=600, cwd=REPO)
  return cut, stopped, left, resumed, full, run_cli([*train, "--out", str(full)], cwd=REPO)


@pytest.mark.slow
@pytest.mark.late
def test_sigterm_saves_then_resume_reproduces_the_run(sigterm_and_resume):
  """Preemption: SIGTERM mid-run saves a checkpoint at the step it reached (not a --save-every
  multiple) and exits; --resume then gives exactly the losses of an uninterrupted run."""
  cut, proc, checkpoints_after_the_stop, resumed, full, whole = sigterm_and_resume
  assert whole.returncode == 0, whole.stderr[-3000:]
  err = proc.stderr
  assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
  assert "Traceback" not in err
  stopped = int(err.split("stopped by SIGTERM after step ")[1].split(";")[0])
  assert 6 <= stopped < 12 and stopped != 10
  assert f"checkpoint {stopped} is in" in err and "continue with --resume" in err
  assert str(stopped) in checkpoints_after_the_stop

  assert resumed.returncode == 0, resumed.stderr[-3000:]
  assert f"jaxtune: resuming from step {stopped} of 12; the cosine schedule continues" in (
    resumed.stderr
  )
  # The same step as the stopped run's: read from the command line's compilation cache.
  assert re.search(r"compiled in [\d.]+s \(from the compilation cache\)", resumed.stdout), (
    resumed.stdout
  )
  assert len(_metrics(full)) == 12
  np.testing.assert_allclose(_metrics(cut), _metrics(full), rtol=1e-6)


def _state(value: float) -> dict:
  return {
    "lora": {"a": jnp.full((4, 2), value), "b": jnp.full((2, 4), -value)},
    "opt_state": {"count": jnp.int32(int(value)), "mu": jnp.full((4, 2), value / 10)},
    "key": jax.random.key(int(value)),
  }


def _assert_state(state: dict, value: float):
  np.testing.assert_array_equal(np.asarray(state["lora"]["a"]), np.full((4, 2), value))
  assert int(state["opt_state"]["count"]) == int(value)
  key_data = jax.random.key_data(state["key"])
  np.testing.assert_array_equal(
    np.asarray(key_data), jax.random.key_data(jax.random.key(int(value)))
  )


# Runs in a subprocess that dies (SIGKILL, as the OOM killer or a node failure would) in the
# middle of writing checkpoint 3: `finalize` is where orbax renames a complete checkpoint into
# place; `meta` is while its files are still being written.
_KILL_SCRIPT = textwrap.dedent(
  """
  import os, signal, sys
  sys.path[:0] = {tests!r}  # this folder and tests/ (conftest)
  import orbax.checkpoint as ocp
  from orbax.checkpoint._src.path import atomicity
  from test_faults import _state
  from jaxtune.training.checkpoint import Checkpoints

  ckpts = Checkpoints({directory!r}, keep=5)
  ckpts.save(1, _state(1.0))
  ckpts.save(2, _state(2.0))

  async def die(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGKILL)

  if {point!r} == "finalize":
    atomicity.AtomicRenameTemporaryPath.finalize = die
  else:
    ocp.JsonCheckpointHandler._save_fn = die
  ckpts.save(3, _state(3.0))
  print("not killed")
  """
)


@pytest.mark.slow
@pytest.mark.parametrize("point", ["meta", "finalize"])
def test_kill_during_a_checkpoint_write_leaves_the_previous_one(tmp_path, point):
  directory = tmp_path / "checkpoints"
  script = _KILL_SCRIPT.format(
    tests=[str(Path(__file__).parent), str(Path(__file__).parents[1])],
    directory=str(directory),
    point=point,
  )
  proc = subprocess.run(
    [sys.executable, "-c", script],
    capture_output=True,
    text=True,
    timeout=300,
    env={**os.environ, "JAX_PLATFORMS": "cpu"},
  )
  assert proc.returncode == -signal.SIGKILL, proc.stdout + proc.stderr[-2000:]
  assert any(".orbax-checkpoint-tmp" in p for p in os.listdir(directory))  # killed mid-write

  ckpts = checkpoint.Checkpoints(directory, keep=5)
  state, step = ckpts.restore_latest(_state(0.0))
  assert step == 2
  _assert_state(state, 2.0)
  ckpts.save(3, _state(3.0))  # the run goes on saving
  assert not any(".orbax-checkpoint-tmp" in p for p in os.listdir(directory))  # cleaned up
  state, step = checkpoint.Checkpoints(directory).restore_latest(_state(0.0))
  assert step == 3
  _assert_state(state, 3.0)


def test_disk_full_keeps_the_previous_checkpoint_and_says_so(tmp_path, monkeypatch):
  import orbax.checkpoint as ocp

  directory = tmp_path / "checkpoints"
  ckpts = checkpoint.Checkpoints(directory)
  ckpts.save(1, _state(1.0))

  async def full(self, *args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(directory))

  with monkeypatch.context() as m:
    m.setattr(ocp.JsonCheckpointHandler, "_save_fn", full)
    with pytest.raises(checkpoint.SaveError) as info:
      ckpts.save(2, _state(2.0))
  message = str(info.value)
  assert message.startswith("the disk is full: checkpoint 2 could not be written")
  assert "checkpoint 1 is intact; free some space, then continue with --resume." in message
  state, step = checkpoint.Checkpoints(directory).restore_latest(_state(0.0))
  assert step == 1
  _assert_state(state, 1.0)


@pytest.mark.slow
def test_disk_full_during_training_stops_with_one_sentence(tmp_path, monkeypatch, capsys):
  """Through the command line: the run stops at the failed save, the earlier checkpoint
  resumes, and the run then finishes."""
  import orbax.checkpoint as ocp

  from jaxtune.train import main as train_main

  out = tmp_path / "run"
  flags = ["--out", str(out), "--steps", "4", "--save-every", "2", "--export", "none"]
  flags += ["--seq-len", "32", "--lora-rank", "4"]
  saves = []
  real = ocp.JsonCheckpointHandler._save_fn

  async def full_on_second(self, x, directory):
    saves.append(directory)
    if len(saves) == 2:
      raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(directory))
    return await real(self, x, directory)

  with monkeypatch.context() as m:
    m.setattr(ocp.JsonCheckpointHandler, "_save_fn", full_on_second)
    assert train_main(flags) == 2
  err = capsys.readouterr().err.strip().splitlines()[-1]
  assert err.startswith("error: the disk is full: checkpoint 4 could not be written")
  assert err.endswith("checkpoint 2 is intact; free some space, then continue with --resume.")
  assert train_main([*flags, "--resume"]) == 0
  steps = [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()]
  assert steps == [1, 2, 3, 4, 3, 4]  # resumed after checkpoint 2


def _corrupt(step_dir: Path) -> None:
  for f in step_dir.rglob("*"):
    if f.is_file() and f.parent.name == "d":  # array data chunks
      f.write_bytes(b"")


def _truncate(step_dir: Path) -> None:
  for f in step_dir.rglob("*"):
    if f.is_file() and f.parent.name == "d":
      f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


def _drop_chunks(step_dir: Path) -> None:
  for d in [d for d in step_dir.rglob("d") if d.is_dir()]:
    shutil.rmtree(d)


def _drop_metadata(step_dir: Path) -> None:
  for f in step_dir.rglob("_METADATA"):
    f.unlink()


DAMAGE = {"emptied": _corrupt, "truncated": _truncate, "chunks-deleted": _drop_chunks,
          "metadata-deleted": _drop_metadata}  # fmt: skip


@pytest.mark.parametrize("damage", DAMAGE)
def test_damaged_checkpoint_is_moved_aside_and_the_run_goes_on(tmp_path, capsys, damage):
  directory = tmp_path / "checkpoints"
  ckpts = checkpoint.Checkpoints(directory, keep=3)
  for v in (1.0, 2.0, 3.0):
    ckpts.save(int(v), _state(v))
  ckpts.close()
  DAMAGE[damage](directory / "3")
  before = sorted(p.relative_to(directory / "3") for p in (directory / "3").rglob("*"))
  # A reader (export, generate) falls back too, and moves nothing.
  reader = checkpoint.Checkpoints(directory, read_only=True)
  assert reader.restore_latest(_state(0.0))[1] == 2 and (directory / "3").is_dir()
  ckpts = checkpoint.Checkpoints(directory, keep=3)
  state, step = ckpts.restore_latest(_state(0.0))
  assert step == 2
  _assert_state(state, 2.0)
  err = capsys.readouterr().err
  (moved,) = (tmp_path / "checkpoints.damaged").iterdir()
  assert f"jaxtune: checkpoint 3 in {directory} cannot be read (" in err
  assert f"; moved it to {moved}; using checkpoint 2 instead." in err
  assert sorted(p.relative_to(moved) for p in moved.rglob("*")) == before  # kept, whole
  # The run saves step 3 again, and resumes from it.
  ckpts.save(3, _state(3.5))
  state, step = checkpoint.Checkpoints(directory).restore_latest(_state(0.0))
  assert step == 3
  _assert_state(state, 3.5)


def test_every_checkpoint_damaged_is_one_sentence(tmp_path):
  directory = tmp_path / "checkpoints"
  ckpts = checkpoint.Checkpoints(directory, keep=3)
  for v in (1.0, 2.0):
    ckpts.save(int(v), _state(v))
  for s in ("1", "2"):
    _corrupt(directory / s)
  with pytest.raises(
    checkpoint.RestoreError,
    match=r"none of the checkpoints .* \(steps 2, 1\) can be read \(they are kept in "
    r"checkpoints\.damaged\); train again without --resume\.",
  ):
    checkpoint.Checkpoints(directory).restore_latest(_state(0.0))
  assert sorted(p.name.split("-")[0] for p in (tmp_path / "checkpoints.damaged").iterdir()) == [
    "1",
    "2",
  ]


def test_checkpoint_of_other_shapes_is_refused(tmp_path):
  directory = tmp_path / "checkpoints"
  checkpoint.Checkpoints(directory).save(1, _state(1.0))
  other = _state(0.0)
  other["lora"]["a"] = jnp.zeros((4, 8))  # another rank
  with pytest.raises(checkpoint.RestoreError, match="adapters of other shapes"):
    checkpoint.Checkpoints(directory).restore_latest(other)
  other = _state(0.0)
  other["opt_state"]["scale"] = jnp.float32(1.0)  # float16's loss scale
  with pytest.raises(checkpoint.RestoreError, match="another --dtype"):
    checkpoint.Checkpoints(directory).restore_latest(other)


@pytest.mark.slow
def test_signals_ask_the_loop_to_stop_after_saving(hf_llama_dir, tmp_path, capsys):
  """SIGINT (Ctrl-C) as SIGTERM: the handler only records it; the loop saves and raises."""
  from test_train import _dataset, _tiny_dir

  import jaxtune
  from jaxtune.training import loop as trainer

  previous = signal.getsignal(signal.SIGINT)
  with trainer.StopSignals() as stop:
    os.kill(os.getpid(), signal.SIGINT)
    assert stop.signum == signal.SIGINT
  assert signal.getsignal(signal.SIGINT) is previous

  path, _ = _tiny_dir(hf_llama_dir)
  model = jaxtune.apply_lora(jaxtune.from_pretrained(path, dtype="float32"), rank=4)
  run = RunConfig(out=str(tmp_path), steps=5, batch_size=4, dtype="float32", lora_rank=4)
  ckpts = checkpoint.Checkpoints(tmp_path / "checkpoints")
  with pytest.raises(trainer.Stopped, match="stopped by SIGINT after step 1") as info:
    one = resolver.resolve(run, model.config, devices=jax.devices()[:1])
    trainer.train(model, _dataset(), run, one, ckpts, stop=stop)  # the signal already came
  assert info.value.saved and ckpts.latest_step() == 1

  # Mid-run (Ctrl-C while a batch is made): the message names the step in progress, and the
  # run stops right after it, not a step later.
  dataset, batch = _dataset(), None
  batch = dataset.batch

  def batch_then_signal(i, *args):
    if i == 3:
      os.kill(os.getpid(), signal.SIGINT)
    return batch(i, *args)

  dataset.batch = batch_then_signal
  model = jaxtune.apply_lora(jaxtune.from_pretrained(path, dtype="float32"), rank=4)
  ckpts = checkpoint.Checkpoints(tmp_path / "again")
  with trainer.StopSignals() as stop, pytest.raises(trainer.Stopped) as info:
    trainer.train(model, dataset, run, one, ckpts, stop=stop)
  said = capsys.readouterr().err
  named = int(re.search(r"saving a checkpoint after step (\d+), in progress", said)[1])
  assert info.value.step == named and ckpts.latest_step() == named


def test_export_is_atomic_and_replaces_only_when_asked(hf_llama_dir, tmp_path, monkeypatch):
  import jaxtune
  from jaxtune.hf import export

  path, _ = hf_llama_dir()
  model = jaxtune.apply_lora(jaxtune.from_pretrained(path, dtype="float32"), rank=4)
  root = tmp_path / "exports"
  out = root / "export"
  export.write(model, "peft", out)

  def listing():
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}

  first = listing()
  with pytest.raises(export.ExportError, match="is not empty; pass --overwrite"):
    export.write(model, "peft", out)

  def fails_halfway(model, out_dir):
    (Path(out_dir) / "adapter_model.safetensors").write_bytes(b"half")
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

  with monkeypatch.context() as m:
    m.setattr(export, "export_peft", fails_halfway)
    with pytest.raises(export.ExportError, match="the disk is full.*nothing was changed"):
      export.write(model, "peft", out, overwrite=True)
  assert listing() == first  # the previous export untouched, nothing half-written beside it
  assert sorted(os.listdir(root)) == ["export"]

  export.write(model, "merged", out, overwrite=True)
  assert (out / "model.safetensors").is_file() and not (out / "adapter_model.safetensors").exists()
  assert sorted(os.listdir(root)) == ["export"]


def test_a_checkpoint_that_reads_back_other_values_is_not_trusted(tmp_path, capsys):
  """Damage that still decodes (here checkpoint 3's arrays replaced by another save's, a
  well-formed checkpoint of other values) is caught by the checksum saved in its metadata."""
  directory = tmp_path / "checkpoints"
  ckpts = checkpoint.Checkpoints(directory, keep=5)
  for v in (1.0, 2.0, 3.0, 9.0):
    ckpts.save(int(v), _state(v))
  ckpts.close()
  shutil.rmtree(directory / "3" / "state")
  shutil.move(directory / "9" / "state", directory / "3" / "state")
  shutil.rmtree(directory / "9")
  state, step = checkpoint.Checkpoints(directory, keep=5).restore_latest(_state(0.0))
  assert step == 2
  _assert_state(state, 2.0)
  err = capsys.readouterr().err
  assert f"checkpoint 3 in {directory} reads back other values than were saved (its" in err
  assert "; using checkpoint 2 instead." in err
  assert (tmp_path / "checkpoints.damaged").is_dir()
