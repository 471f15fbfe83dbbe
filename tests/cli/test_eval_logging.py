"""Evaluation during training, TensorBoard event files, and the plot script."""

import json
import struct
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import background_run, run_cli

from jaxtune.run.default_model import DATASET


def _events(path: Path):
  """Parse a TensorBoard event file record by record (TFRecord framing + Event protos)."""
  from tensorboardX.proto import event_pb2

  data = path.read_bytes()
  pos, events = 0, []
  while pos < len(data):
    (length,) = struct.unpack("<Q", data[pos : pos + 8])
    pos += 12  # length + its crc
    event = event_pb2.Event()
    event.ParseFromString(data[pos : pos + length])
    events.append(event)
    pos += length + 4  # payload + its crc
  return events


@background_run("eval_run")
def _eval_run(directory, runs):
  """A run with held-out data and prompts evaluated every 6 of 12 steps, then the plot script
  on it: (run directory, the run's process, the plot, the plot script's process)."""
  lines = DATASET.read_text().splitlines()
  held_out = directory / "eval.jsonl"
  held_out.write_text("\n".join(lines[-40:]) + "\n")
  prompts = directory / "prompts.txt"
  prompts.write_text("What is 3 plus 4?\nCount to 3.\n")
  out = directory / "run"
  flags = ["--out", str(out), "--steps", "12", "--export", "none", "--eval-data", str(held_out)]
  flags += ["--eval-every", "6", "--eval-prompts", str(prompts)]
  proc = run_cli([sys.executable, "-m", "jaxtune.train", *flags])
  png = directory / "runs.png"
  plot = run_cli(
    [sys.executable, "experiments/plot_runs.py", str(out), "--out", str(png)],
    timeout=300,
    cwd=Path(__file__).resolve().parents[2],
  )
  return out, proc, png, plot


@pytest.mark.slow
@pytest.mark.late  # its run goes last in the background, not waited for early
def test_eval_metrics_tensorboard_and_plot(eval_run):
  out, proc, png, plot = eval_run
  assert proc.returncode == 0, proc.stderr[-3000:]
  rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
  evals = [r for r in rows if "eval_loss" in r]
  assert [r["step"] for r in evals] == [6, 12]
  assert evals[-1]["eval_loss"] < evals[0]["eval_loss"]
  assert np.isclose(evals[-1]["eval_ppl"], np.exp(evals[-1]["eval_loss"]), rtol=1e-6)
  assert [g["prompt"] for g in evals[0]["generations"]] == ["What is 3 plus 4?", "Count to 3."]
  assert "eval at step 6" in proc.stderr

  files = list((out / "tensorboard").glob("events.out.tfevents.*"))
  assert len(files) == 1
  tags = {}
  for event in _events(files[0]):
    for value in event.summary.value:
      tags.setdefault(value.tag, []).append(event.step)
  assert tags["train/loss"] == list(range(1, 13))
  assert tags["eval/loss"] == [6, 12] and tags["eval/ppl"] == [6, 12]
  assert "train/lr" in tags and "train/tokens_per_s" in tags
  assert any(t.startswith("eval/generations") for t in tags)

  assert plot.returncode == 0, plot.stderr[-3000:]
  assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000


# --eval-prompts without --eval-data: tests/cli/test_catalogue.py (eval-prompts-without-eval-data).
