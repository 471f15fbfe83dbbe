"""A run's output directory: one run at a time, resume against the saved settings, a record of
every start, and a disk that is full or read-only.

The runs here train the built-in model in this process with the settings of test_faults.py's
disk-full run, so they share its compiled step. Disk-full cases use a real small filesystem
(tmpfs) where this machine lets the test mount one; test_faults.py fakes ENOSPC everywhere.
"""

import errno
import hashlib
import json
import logging
import os
import subprocess
import uuid
from pathlib import Path

import pytest

from jaxtune.errors import SaveError
from jaxtune.hf import export
from jaxtune.run import run_dir
from jaxtune.train import main as train_main
from jaxtune.training import checkpoint
from jaxtune.training.log import RunLog

FLAGS = ["--save-every", "2", "--export", "none", "--seq-len", "32", "--lora-rank", "4"]


def _snapshot(root: Path) -> dict:
  return {
    str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
    for p in sorted(root.rglob("*"))
  }


def _one_sentence(err: str) -> str:
  assert "Traceback" not in err and "Event loop is closed" not in err, err
  (line,) = [x for x in err.splitlines() if x.startswith("error:")]
  assert line.endswith(".") and line.count(". ") == 0, line
  return line


def _dead_pid() -> int:
  proc = subprocess.Popen(["true"])
  proc.wait()
  return proc.pid


def test_a_second_run_on_the_same_out_is_refused_and_names_the_first(tmp_path, capsys):
  out = tmp_path / "run"
  with run_dir.Lock(out, command="the first run"):
    before = _snapshot(tmp_path)
    assert train_main(["--out", str(out), "--steps", "2", *FLAGS]) == 2
    line = _one_sentence(capsys.readouterr().err)
    assert f"{out} is in use by another run (pid {os.getpid()} on " in line
    assert ": the first run); wait for it to finish, or choose another --out." in line
    assert _snapshot(tmp_path) == before
  assert not out.exists()  # the lock made the directory, and took it away with itself


@pytest.mark.slow
def test_resume_takes_over_a_stale_lock_compares_settings_and_records_each_start(tmp_path, capsys):
  out = tmp_path / "run"
  out.mkdir()
  stale = {"pid": _dead_pid(), "host": "elsewhere", "started": "then", "command": "killed run"}
  (out / run_dir.LOCK_NAME).write_text(json.dumps(stale))
  run = ["--out", str(out), *FLAGS]

  assert train_main([*run, "--steps", "2"]) == 0
  said = capsys.readouterr()
  assert f"took over {out} from a run that is no longer running (pid {stale['pid']} on " in said.out
  assert not (out / run_dir.LOCK_NAME).exists()

  # Longer: the schedule is rebuilt over 4 steps (warmup min(10, 3) = 3 steps: step 3 gets
  # 3/4 of the default run's 2e-3), and the line says so.
  assert train_main([*run, "--steps", "4", "--resume"]) == 0
  said = capsys.readouterr()
  assert (
    "jaxtune: resuming from step 2 of 4; the cosine schedule continues at learning rate "
    "0.0015 (the run was for 2 steps, where step 3 had 0: the schedule now spans 4 steps)."
  ) in said.err
  assert "trained steps 3-4 of 4" in said.out
  history = sorted((out / "config-history").iterdir())
  assert [p.name for p in history] == ["001.yaml", "002.yaml"]
  assert history[0].read_text().startswith("# started ")
  assert "# changed steps: 2 -> 4\n" in history[1].read_text()

  # Another seed and batch: refused, and nothing in the run directory changes.
  before = _snapshot(tmp_path)
  assert train_main([*run, "--resume", "--seed", "1", "--batch-size", "4"]) == 2
  line = _one_sentence(capsys.readouterr().err)
  assert line == (
    f"error: --resume: the checkpoints in {out} were trained with batch_size 8 (now 4), seed 0 "
    "(now 1); resume with the settings in its config.yaml, or pass --allow-changes to continue "
    "with these."
  )
  assert _snapshot(tmp_path) == before

  # --allow-changes continues (nothing is left to train at step 4 of 4) and records it.
  assert train_main([*run, "--steps", "4", "--resume", "--seed", "1", "--allow-changes"]) == 0
  said = capsys.readouterr()
  assert "resuming from step 4 of 4; nothing left to train." in said.err
  third = (out / "config-history" / "003.yaml").read_text()
  assert "with --allow-changes\n" in third and "# changed seed: 0 -> 1\n" in third
  assert "seed: 1\n" in (out / "config.yaml").read_text()


def test_allow_changes_needs_resume(tmp_path, capsys):
  assert train_main(["--out", str(tmp_path / "r"), "--allow-changes"]) == 2
  assert "--allow-changes is for --resume" in _one_sentence(capsys.readouterr().err)


@pytest.fixture
def small_disk(tmp_path):
  """mount(size, read_only=False) -> a directory on a tmpfs of that many bytes; skips where
  this machine does not let the test mount one (not root, or no CAP_SYS_ADMIN)."""
  mounted = []

  def mount(size: int, read_only: bool = False) -> Path:
    where = tmp_path / f"disk{len(mounted)}"
    where.mkdir()
    options = f"size={size}" + (",ro" if read_only else "")
    proc = subprocess.run(
      ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)], capture_output=True
    )
    if proc.returncode != 0:
      pytest.skip(f"cannot mount a small tmpfs here: {proc.stderr.decode().strip()}")
    mounted.append(where)
    return where

  yield mount
  for where in mounted:
    subprocess.run(["umount", "-l", str(where)], check=False)


def _fill(directory: Path) -> Path:
  """Write a file until the disk has no page left; returns it."""
  filler = directory / f"filler-{uuid.uuid4().hex}"
  fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o644)
  try:
    for chunk in (1 << 20, 4096):
      try:
        while True:
          os.write(fd, b"\0" * chunk)
      except OSError as e:
        assert e.errno == errno.ENOSPC
  finally:
    os.close(fd)
  return filler


def test_a_run_that_cannot_fit_is_refused_before_it_starts(small_disk, capsys):
  disk = small_disk(1 << 20)
  argv = ["--out", str(disk / "run"), "--steps", "4", *FLAGS, "--export", "merged"]
  assert train_main(argv) == 2
  line = _one_sentence(capsys.readouterr().err)
  assert (
    f"error: the disk holding {disk / 'run'} has 1.0 MiB free and this run writes more " in line
  )
  assert "(checkpoints about " in line and ", the export about " in line
  assert list(disk.iterdir()) == []


@pytest.mark.slow
def test_disk_filling_up_mid_run_is_one_sentence_and_leaves_nothing_half_written(
  small_disk, capsys, caplog, monkeypatch
):
  disk = small_disk(48 << 20)
  out = disk / "run"
  # Compiled here, not read from the compilation cache: in the whole suite's order (CI of
  # eb091b2, twice; never alone) the step read back from it lacked a function on XLA:CPU
  # ("NOT_FOUND: Function add_select_fusion.42 not found"; NOTES.md, session 23).
  argv = ["--out", str(out), "--steps", "4", "--no-compile-cache", *FLAGS]
  real_save, saves, filler = checkpoint.Checkpoints.save, [], []

  def fill_then_save(self, step, state, data=None, rollout=None):
    saves.append(step)
    if len(saves) == 2:
      filler.append(_fill(disk))
    return real_save(self, step, state, data, rollout)

  caplog.set_level(logging.WARNING)
  with monkeypatch.context() as m:
    m.setattr(checkpoint.Checkpoints, "save", fill_then_save)
    assert train_main(argv) == 2
  line = _one_sentence(capsys.readouterr().err)
  assert line.startswith(f"error: the disk is full: checkpoint 4 could not be written to {out}")
  assert "checkpoint 2 is intact; free some space, then continue with --resume." in line
  assert not [r for r in caplog.records if r.levelno >= logging.ERROR]  # orbax's are filtered
  names = os.listdir(out / "checkpoints")
  assert names == ["2"], names  # no partial checkpoint 4 left behind
  assert not (out / run_dir.LOCK_NAME).exists()
  steps = [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()]
  assert steps == [1, 2, 3, 4]

  # The metrics log on a full disk: one sentence too, raised by close() only when nothing
  # else is on its way out.
  log = RunLog(out, 4, report_to="none")
  with pytest.raises(SaveError, match=r"the disk is full: .*metrics\.jsonl could not be written"):
    row = {"step": 5, "loss": 1.0, "lr": 0.1, "grad_norm": 1.0, "tokens_per_s": 1.0}
    log.train({**row, "note": "x" * 65536})  # more than the page the file ends in holds
  try:
    raise KeyError("the real error")
  except KeyError:
    log.close()  # must not replace the KeyError

  filler[0].unlink()
  assert train_main([*argv, "--resume"]) == 0
  assert sorted(os.listdir(out / "checkpoints")) == ["2", "4"]


def test_a_read_only_out_is_refused_before_loading(small_disk, tmp_path, capsys):
  if os.geteuid() == 0:
    disk = small_disk(1 << 20, read_only=True)
  else:
    disk = tmp_path / "ro"
    disk.mkdir()
    disk.chmod(0o555)
  assert train_main(["--out", str(disk / "run"), "--steps", "2", *FLAGS]) == 2
  line = _one_sentence(capsys.readouterr().err)
  assert f"error: --out {disk / 'run'}: {disk} is " in line and "choose another --out." in line
  assert list(disk.iterdir()) == []


def test_an_export_onto_a_full_disk_is_one_sentence(small_disk, tmp_path):
  import jaxtune
  from converters.synthetic import write_random_checkpoint
  from jaxtune.run import default_model

  config = {**default_model.CONFIG, "hidden_size": 64, "intermediate_size": 128}
  path = write_random_checkpoint(tmp_path / "model", config, dtype="float32")
  model = jaxtune.apply_lora(jaxtune.from_pretrained(path, dtype="float32"), rank=4)
  disk = small_disk(64 << 10)
  with pytest.raises(export.ExportError) as info:
    export.write(model, "merged", disk / "export")
  assert str(info.value) == (
    f"writing the export to {disk / 'export'} failed (the disk is full); nothing was changed "
    "there: free some space or choose another --out."
  )
  assert list(disk.iterdir()) == []


def test_temporaries_of_killed_exports_are_removed(tmp_path):
  out = tmp_path / "export"
  dead, alive = _dead_pid(), os.getpid()
  for name in (f".export.{dead}-a1.tmp", f".export.{dead}-b2.tmp.old", f".export.{alive}-c3.tmp"):
    (tmp_path / name).mkdir()
    (tmp_path / name / "model.safetensors").write_bytes(b"half")
  (tmp_path / ".other.1-x.tmp").mkdir()  # another export's
  removed = export.remove_stale_temporaries(out)
  assert sorted(p.name for p in removed) == [f".export.{dead}-a1.tmp", f".export.{dead}-b2.tmp.old"]
  assert sorted(p.name for p in tmp_path.iterdir()) == [f".export.{alive}-c3.tmp", ".other.1-x.tmp"]


def test_metrics_and_lock_never_follow_a_link_made_after_the_check(tmp_path):
  """The start's check_links aside, the lock and metrics.jsonl are opened refusing to follow
  a symbolic link (O_NOFOLLOW): a link made later still writes nothing through it."""
  from jaxtune.errors import UserError

  victim = tmp_path / "victim.txt"
  victim.write_text("theirs\n")
  out = tmp_path / "run"
  out.mkdir()
  (out / "metrics.jsonl").symlink_to(victim)
  with pytest.raises(UserError, match=r"metrics\.jsonl is a symbolic link \(to .*victim\.txt\)"):
    RunLog(out, total_steps=1, report_to="none")
  (out / "metrics.jsonl").unlink()
  lock = run_dir.Lock(out)
  (out / run_dir.LOCK_NAME).symlink_to(victim)
  with pytest.raises(UserError, match=r"\.jaxtune\.lock is a symbolic link"):
    lock._locked_fd()
  assert victim.read_text() == "theirs\n"


@pytest.mark.slow
def test_resume_reads_the_runs_config_and_knows_its_data(tmp_path, capsys):
  """`--out RUN --resume` alone continues a run started with --model and --data (their values
  from OUT/config.yaml); the same data path with other content is refused (its tokens differ)
  with nothing changed, and --allow-changes continues on it and records the change."""
  from jaxtune.run import default_model

  data = tmp_path / "data.jsonl"
  lines = default_model.DATASET.read_text().splitlines()
  data.write_text("\n".join(lines) + "\n")
  out = tmp_path / "run"
  model = str(default_model.ensure_default_checkpoint())
  assert train_main(["--out", str(out), "--model", model, "--data", str(data), *FLAGS,
                     "--steps", "2", "--export", "peft"]) == 0  # fmt: skip
  capsys.readouterr()
  assert train_main(["--out", str(out), "--resume", "--steps", "3", "--export", "none"]) == 0
  said = capsys.readouterr()
  assert "resuming from step 2 of 3" in said.err and "trained steps 3-3 of 3" in said.out
  assert "resuming with changed settings: steps 2 -> 3, export peft -> none\n" in said.out
  assert f"data {data}:" in said.out

  data.write_text("\n".join(reversed(lines)) + "\n")  # the same path, the lines reversed
  before = _snapshot(tmp_path)
  assert train_main(["--out", str(out), "--resume", "--steps", "4"]) == 2
  line = _one_sentence(capsys.readouterr().err)
  assert line == (
    f"error: --resume: the data {data} is not what checkpoint 3 in {out / 'checkpoints'} "
    "trained on (its tokens differ: the file changed, or its tokenizer, format or layout did); "
    "resume with that data, or pass --allow-changes to continue on this data."
  )
  assert _snapshot(tmp_path) == before

  assert train_main(["--out", str(out), "--resume", "--steps", "4", "--allow-changes"]) == 0
  capsys.readouterr()
  history = sorted((out / "config-history").iterdir())[-1].read_text()
  assert "# changed data content: '" in history
