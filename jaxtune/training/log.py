"""What a run reports: metrics.jsonl, a progress line, and the trackers of --report-to:
TensorBoard event files (OUT/tensorboard) and Weights & Biases (its own client; offline mode,
WANDB_MODE=offline, works without network). Every tracker gets the same scalars and eval
generations; W&B also the resolved config and the hardware.

Process 0 of a multi-host run is the only writer (other processes get a quiet RunLog).
"""

import contextlib
import json
import math
import os
import secrets
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import jax

from jaxtune.training.files import open_append, write_error


def quiet_third_party() -> None:
  """For the command lines: no advice from transformers on a normal run (e.g. "PyTorch was not
  found", which is expected: jaxtune uses it for tokenizers only). orbax's noise is filtered in
  checkpoint.py."""
  os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")


def device_memory_gib() -> float | None:
  """The peak memory of this process's busiest device so far (None where not kept, e.g. CPU)."""
  peaks = [(d.memory_stats() or {}).get("peak_bytes_in_use") for d in jax.local_devices()]
  peaks = [p for p in peaks if p is not None]
  return max(peaks) / 2**30 if peaks else None


TRACKERS = ("tensorboard", "wandb")
# GRPO's figures beside its rewards (rl.py), logged to the trackers.
RL_FIGURES = (
  "kl",
  "clip_fraction",
  "completion_length",
  "rollout_s",
  "rollout_tokens_per_s",
  "update_s",
)
# Figures of preference objectives a training row may carry (preference.METRICS), logged
# to the trackers beside the loss.
FIGURES = (
  "rewards_chosen",
  "rewards_rejected",
  "reward_accuracy",
  "reward_margin",
  "logps_chosen",
  "logps_rejected",
)


def trackers(report_to: str) -> tuple[str, ...]:
  """--report-to "tensorboard,wandb" -> the trackers named ("none": no tracker)."""
  names = tuple(n.strip() for n in report_to.split(",") if n.strip())
  return () if names == ("none",) else names


@contextlib.contextmanager
def torch_hidden() -> Iterator[None]:
  """While open (and torch is not imported yet), ``import torch`` raises ImportError and
  ``importlib.util.find_spec("torch")`` is None: libraries that import torch when they find it
  installed (tensorboardX; transformers 5.17 and datasets as the command lines load them)
  import without it. Seconds of a run's start; jaxtune never uses torch. Closed, torch is
  importable again (datasets' hashing imports it once it is in sys.modules, even as None)."""
  hide = "torch" not in sys.modules
  if hide:
    sys.modules["torch"] = None
  try:
    yield
  finally:
    if hide and sys.modules.get("torch", False) is None:
      del sys.modules["torch"]


def _summary_writer():
  """tensorboardX's SummaryWriter, imported with torch hidden (for torch tensors, which
  jaxtune never logs)."""
  with torch_hidden():
    from tensorboardX import SummaryWriter
  return SummaryWriter


class _TensorBoard:
  def __init__(self, out: Path, config: dict):
    SummaryWriter = _summary_writer()  # noqa: N806
    self.writer = SummaryWriter(logdir=str(out / "tensorboard"), flush_secs=10)

  def scalars(self, values: dict, step: int) -> None:
    for key, value in values.items():
      self.writer.add_scalar(key, value, step)

  def generations(self, pairs: list[tuple[str, str]], step: int) -> None:
    text = "\n\n".join(f"**{p}**\n\n{o}" for p, o in pairs)
    self.writer.add_text("eval/generations", text, step)

  def close(self) -> None:
    self.writer.close()


class _WandB:
  """One W&B run per run directory: its id is kept in OUT/wandb-run-id, so --resume continues
  the same W&B run. Project from WANDB_PROJECT (default "jaxtune"), files under OUT/wandb."""

  def __init__(self, out: Path, config: dict):
    import wandb

    id_file = out / "wandb-run-id"
    run_id = id_file.read_text().strip() if id_file.is_file() else secrets.token_hex(4)
    id_file.write_text(run_id + "\n")
    self.wandb = wandb
    self.run = wandb.init(
      project=os.environ.get("WANDB_PROJECT", "jaxtune"),
      name=out.name,
      id=run_id,
      resume="allow",
      dir=str(out),
      config=config,
    )

  def scalars(self, values: dict, step: int) -> None:
    self.run.log(values, step=step)

  def generations(self, pairs: list[tuple[str, str]], step: int) -> None:
    table = self.wandb.Table(columns=["prompt", "output"], data=[list(p) for p in pairs])
    self.run.log({"eval/generations": table}, step=step)

  def close(self) -> None:
    self.run.finish()


class RunLog:
  def __init__(
    self,
    out: Path,
    total_steps: int,
    enabled: bool = True,
    report_to: str = "tensorboard",
    config: dict | None = None,
  ):
    """``config``: what trackers that keep one (W&B) record as the run's config."""
    self.total = total_steps
    self.enabled = enabled
    self.tty = sys.stderr.isatty()
    self.path = Path(out) / "metrics.jsonl"
    self.t0 = time.perf_counter()
    self.first: tuple[int, float] | None = None  # (step, time) of the first step logged
    self.metrics = None
    self.trackers = []
    if enabled:
      try:
        self.metrics = open_append(self.path)
        kinds = {"tensorboard": _TensorBoard, "wandb": _WandB}
        self.trackers = [kinds[n](Path(out), config or {}) for n in trackers(report_to)]
      except OSError as e:
        self.close()
        raise write_error(self.path if self.metrics is None else Path(out), e) from e

  def _write(self, row: dict) -> None:
    try:
      self.metrics.write(json.dumps(row) + "\n")
      self.metrics.flush()
    except OSError as e:
      raise write_error(self.path, e) from e

  def _times(self, step: int) -> str:
    """Elapsed time, and the time left at the pace of the steps since the first one logged
    (which carries the compilation)."""
    now = time.perf_counter()
    text = f"{_clock(now - self.t0)}"
    if self.first is None:
      self.first = (step, now)
    elif step > self.first[0] and step < self.total:
      pace = (now - self.first[1]) / (step - self.first[0])
      text += f" ETA {_clock(pace * (self.total - step))}"
    return text

  def train(self, row: dict) -> None:
    if not self.enabled:
      return
    memory = device_memory_gib()
    if memory is not None:
      row = {**row, "memory_gib": memory}
    self._write(row)
    keys = ("loss", "lr", "grad_norm", "tokens_per_s", "memory_gib", *FIGURES, *RL_FIGURES)
    scalars = {f"train/{k}": row[k] for k in keys if k in row}
    scalars.update({f"train/{k}": v for k, v in row.items() if k.startswith("reward")})
    for t in self.trackers:
      t.scalars(scalars, row["step"])
    width, step = 30, row["step"]
    done = int(width * step / self.total)
    line = (
      f"step {step}/{self.total} [{'#' * done}{'.' * (width - done)}] loss {row['loss']:.4f} "
      f"lr {row['lr']:.2e} {row['tokens_per_s']:.0f} tok/s "
      + (f"reward acc {row['reward_accuracy']:.2f} " if "reward_accuracy" in row else "")
      + (f"reward {row['reward']:.3f} " if "reward" in row else "")
      + self._times(step)
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
    scalars = {f"eval/{k.removeprefix('eval_')}": v for k, v in metrics.items()}
    for t in self.trackers:
      t.scalars(scalars, step)
      if generations:
        t.generations(list(generations), step)
    end = "\n" if self.tty else ""
    if "eval_loss" not in metrics:  # GRPO: generations only
      print(f"{end}eval at step {step}: {len(generations)} samples logged", file=sys.stderr)
      return
    if "eval_ppl" in metrics:
      what = f"perplexity {metrics['eval_ppl']:.2f}"
    else:  # preference pairs
      what = (
        f"reward accuracy {metrics['eval_reward_accuracy']:.3f} "
        f"margin {metrics['eval_reward_margin']:.4f}"
      )
    print(
      f"{end}eval at step {step}: loss {metrics['eval_loss']:.4f} {what}",
      file=sys.stderr,
      flush=True,
    )

  def close(self) -> None:
    """Close the metrics file and the trackers. A failure to do so (a full disk) is raised as
    one sentence, unless another error is already on its way out, which it must not hide."""
    failed = None
    closing_order = [(self.metrics, self.path), *((t, self.path.parent) for t in self.trackers)]
    for closing, what in closing_order:
      try:
        if closing is not None:
          closing.close()
      except OSError as e:
        failed = failed or write_error(what, e)
    self.metrics, self.trackers = None, []
    if failed is not None and sys.exc_info()[1] is None:
      raise failed


def _clock(seconds: float) -> str:
  m, s = divmod(int(round(seconds)), 60)
  h, m = divmod(m, 60)
  return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def perplexity(loss: float) -> float:
  return math.exp(min(loss, 50.0))
