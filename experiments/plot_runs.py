"""Training and eval loss of several runs in one PNG.

  python experiments/plot_runs.py RUN_DIR [RUN_DIR ...] [--out runs.png]

Reads each run's metrics.jsonl (written by python -m jaxtune.train); runs are labelled by
their directory name.
"""

import argparse
import json
from pathlib import Path


def read_metrics(run_dir: Path) -> tuple[list, list]:
  train, evals = [], []
  path = Path(run_dir) / "metrics.jsonl"
  if not path.is_file():
    raise SystemExit(f"error: {path} does not exist; pass directories written by jaxtune.train.")
  for line in path.read_text().splitlines():
    row = json.loads(line)
    if "eval_loss" in row and "loss" not in row:
      evals.append((row["step"], row["eval_loss"]))
    elif "loss" in row:
      train.append((row["step"], row["loss"]))
  # A resumed run rewrites steps after its checkpoint: keep the last value of each step.
  return sorted(dict(train).items()), sorted(dict(evals).items())


def plot(run_dirs: list[Path], out: Path) -> Path:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, (ax_train, ax_eval) = plt.subplots(1, 2, figsize=(11, 4))
  for run in run_dirs:
    train, evals = read_metrics(run)
    label = Path(run).name
    if train:
      ax_train.plot(*zip(*train, strict=True), label=label)
    if evals:
      ax_eval.plot(*zip(*evals, strict=True), marker="o", label=label)
  for ax, title in ((ax_train, "training loss"), (ax_eval, "eval loss")):
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
      ax.legend()
  fig.tight_layout()
  fig.savefig(out, dpi=120)
  plt.close(fig)
  return out


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  ap.add_argument("runs", nargs="+", type=Path)
  ap.add_argument("--out", type=Path, default=Path("runs.png"))
  args = ap.parse_args(argv)
  print(plot(args.runs, args.out))


if __name__ == "__main__":
  main()
