"""Research example: how LoRA rank changes held-out loss, on the built-in model and data.

Splits the bundled chat dataset into train (540) and held-out (60) examples, fine-tunes the
built-in small Llama with r = 4, 16, 64 (alpha fixed at 16, so the update scale alpha/r
shrinks as r grows, as in a plain PEFT sweep), evaluates every 10 steps, records the final
held-out loss of each run, and draws all curves into one plot.

  python experiments/sweep_lora_rank.py [--steps 60] [--out runs/rank_sweep]
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from experiments.plot_runs import plot, read_metrics  # noqa: E402
from experiments.record import record  # noqa: E402
from jaxtune.run.default_model import DATASET  # noqa: E402
from jaxtune.run.session import run_training  # noqa: E402
from jaxtune.run_config import RunConfig  # noqa: E402


def main():
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  ap.add_argument("--ranks", default="4,16,64")
  ap.add_argument("--steps", type=int, default=60)
  ap.add_argument("--out", type=Path, default=Path("runs/rank_sweep"))
  ap.add_argument(
    "--plot", type=Path, default=Path(__file__).parent / "plots" / "lora_rank_sweep.png"
  )
  args = ap.parse_args()
  args.out.mkdir(parents=True, exist_ok=True)
  lines = DATASET.read_text().splitlines()
  train, held_out = args.out / "train.jsonl", args.out / "eval.jsonl"
  train.write_text("\n".join(lines[:-60]) + "\n")
  held_out.write_text("\n".join(lines[-60:]) + "\n")
  rows, dirs = [], []
  for rank in (int(r) for r in args.ranks.split(",")):
    run_dir = args.out / f"rank{rank}"
    run = RunConfig(
      out=str(run_dir),
      data=str(train),
      eval_data=str(held_out),
      eval_every=10,
      steps=args.steps,
      lora_rank=rank,
      lora_alpha=16,
      export=None,
    )
    run_training(run, resume=(run_dir / "checkpoints").exists())
    train_curve, eval_curve = read_metrics(run_dir)
    rows.append(
      {
        "model": "built-in default (4 layers, d=256)",
        "lora_rank": rank,
        "lora_alpha": 16,
        "steps": args.steps,
        "final_train_loss": train_curve[-1][1],
        "final_eval_loss": eval_curve[-1][1],
        "best_eval_loss": min(v for _, v in eval_curve),
      }
    )
    dirs.append(run_dir)
  args.plot.parent.mkdir(parents=True, exist_ok=True)
  plot(dirs, args.plot)
  record(
    "sweep_lora_rank",
    rows,
    "LoRA rank sweep on the built-in model (CPU)",
    note=f"Plot: {args.plot.name} (experiments/plots/ by default).",
  )
  for r in rows:
    print(r)


if __name__ == "__main__":
  main()
