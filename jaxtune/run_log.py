"""What a run reports: metrics.jsonl, TensorBoard event files, and a progress line.

Process 0 of a multi-host run is the only writer (other processes get a quiet RunLog).
"""

import json
import math
import sys
from pathlib import Path

import jax


def device_memory_gib() -> float | None:
  """The peak memory of this process's busiest device so far (None where not kept, e.g. CPU)."""
  peaks = [(d.memory_stats() or {}).get("peak_bytes_in_use") for d in jax.local_devices()]
  peaks = [p for p in peaks if p is not None]
  return max(peaks) / 2**30 if peaks else None


class RunLog:
  def __init__(self, out: Path, total_steps: int, enabled: bool = True):
    self.total = total_steps
    self.enabled = enabled
    self.tty = sys.stderr.isatty()
    self.metrics = open(Path(out) / "metrics.jsonl", "a") if enabled else None
    self.tb = None
    if enabled:
      from tensorboardX import SummaryWriter

      self.tb = SummaryWriter(logdir=str(Path(out) / "tensorboard"), flush_secs=10)

  def _write(self, row: dict) -> None:
    self.metrics.write(json.dumps(row) + "\n")
    self.metrics.flush()

  def train(self, row: dict) -> None:
    if not self.enabled:
      return
    memory = device_memory_gib()
    if memory is not None:
      row = {**row, "memory_gib": memory}
    self._write(row)
    for key in ("loss", "lr", "grad_norm", "tokens_per_s", "memory_gib"):
      if key in row:
        self.tb.add_scalar(f"train/{key}", row[key], row["step"])
    width, step = 30, row["step"]
    done = int(width * step / self.total)
    line = (
      f"step {step}/{self.total} [{'#' * done}{'.' * (width - done)}] loss {row['loss']:.4f} "
      f"lr {row['lr']:.2e} {row['tokens_per_s']:.0f} tok/s"
    )
    if self.tty:
      print("\r" + line, end="" if step < self.total else "\n", file=sys.stderr, flush=True)
    else:
      print(line, file=sys.stderr, flush=True)

  def eval(self, step: int, metrics: dict, generations: list[tuple[str, str]] = ()) -> None:
    if not self.enabled:
      return
    row = {"step": step, **metrics}
    if generations:
      row["generations"] = [{"prompt": p, "output": o} for p, o in generations]
    self._write(row)
    for key, value in metrics.items():
      self.tb.add_scalar(f"eval/{key.removeprefix('eval_')}", value, step)
    if generations:
      text = "\n\n".join(f"**{p}**\n\n{o}" for p, o in generations)
      self.tb.add_text("eval/generations", text, step)
    end = "\n" if self.tty else ""
    print(
      f"{end}eval at step {step}: loss {metrics['eval_loss']:.4f} "
      f"perplexity {metrics['eval_ppl']:.2f}",
      file=sys.stderr,
      flush=True,
    )

  def close(self) -> None:
    if self.enabled:
      self.metrics.close()
      self.tb.close()


def perplexity(loss: float) -> float:
  return math.exp(min(loss, 50.0))
