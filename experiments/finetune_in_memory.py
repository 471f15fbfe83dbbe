"""Fine-tune from a `datasets.Dataset` built in memory, from Python (as in a notebook).

    PYTHONPATH=. python experiments/finetune_in_memory.py                 # the built-in model
    PYTHONPATH=. python experiments/finetune_in_memory.py --model Qwen/Qwen2.5-0.5B-Instruct

Builds prompt/completion pairs (sums of two numbers), holds out 10% for evaluation, trains
with `jaxtune.train`, then answers a few held-out prompts with the trained model.
"""

import argparse
import json

import datasets

import jaxtune
from jaxtune.run.loading import load_tokenizer


def examples(n: int, seed: int = 0) -> datasets.Dataset:
  import random

  rng = random.Random(seed)
  rows = []
  for _ in range(n):
    a, b = rng.randint(0, 50), rng.randint(0, 50)
    rows.append({"prompt": f"What is {a} plus {b}?", "completion": f" {a} plus {b} is {a + b}."})
  return datasets.Dataset.from_list(rows)


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  ap.add_argument("--model", default=None, help="HF checkpoint or Hub id (default: built-in)")
  ap.add_argument("--examples", type=int, default=2000)
  ap.add_argument("--epochs", type=float, default=1.0)
  ap.add_argument("--out", default="runs/in-memory")
  args = ap.parse_args()

  data = examples(args.examples)
  settings = {"out": args.out, "epochs": args.epochs, "eval_split": 0.1, "export": None}
  if args.model:
    settings["model"] = args.model
  else:  # the built-in model's own settings (configs/default-run.yaml), by epochs
    settings["steps"] = None
  run_dir, model = jaxtune.train(settings, data=data)

  metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
  train = [m for m in metrics if "loss" in m]
  evals = [m for m in metrics if "eval_loss" in m]
  print(
    f"train loss {train[0]['loss']:.3f} -> {train[-1]['loss']:.3f}; "
    f"eval loss {evals[-1]['eval_loss']:.3f}"
  )
  tokenizer = load_tokenizer(model.provenance.checkpoint_dir)
  prompts = ["What is 12 plus 30?", "What is 7 plus 41?"]
  texts = jaxtune.generate(model, tokenizer, prompts, max_new_tokens=16)
  for prompt, text in zip(prompts, texts, strict=True):
    print(f"{prompt!r} -> {text!r}")


if __name__ == "__main__":
  main()
