"""README's "Try it on a laptop" on this machine's CPUs: time to the first step and per step.

    python experiments/laptop_first_step.py [--steps 10] [--record]

Writes a checkpoint of SmolLM2-135M's shape (its config: 30 layers, hidden 576, 9 heads of 64,
3 KV heads, vocabulary 49,152, tied embeddings; random weights, the built-in tokenizer: this
machine cannot download) and runs README's command on it, `python -m jaxtune.train --model
DIR --steps N` with the CPU defaults (no --batch-size or --seq-len), twice: cold (a new
compilation cache) and warm (the same cache, as a second run). Reports the seconds from the
process start to the first step's progress line, and the median time of a later step, from
metrics.jsonl (processed tokens / tok/s). The built-in default run (`python -m jaxtune.train`,
README's main job) is timed the same way.
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SMOLLM2_135M = {
  "hidden_size": 576,
  "intermediate_size": 1536,
  "num_hidden_layers": 30,
  "num_attention_heads": 9,
  "num_key_value_heads": 3,
  "head_dim": 64,
  "vocab_size": 49152,
  "tie_word_embeddings": True,
  "rope_theta": 100000.0,
  "max_position_embeddings": 8192,
}


def _checkpoint(directory: Path) -> Path:
  sys.path.insert(0, str(REPO))
  from converters.synthetic import write_random_checkpoint
  from jaxtune.run import default_model

  out = directory / "smollm2-135m-shape"
  write_random_checkpoint(out, {**default_model.CONFIG, **SMOLLM2_135M}, seed=0, dtype="bfloat16")
  src = default_model.ensure_default_checkpoint()
  for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
    shutil.copy2(src / name, out / name)
  return out


def _time(argv: list[str], out: Path, cache: Path) -> dict:
  """Seconds to the first step line, and the median later step (s) from metrics.jsonl."""
  env = {**os.environ, "JAXTUNE_COMPILE_CACHE": str(cache), "PYTHONPATH": str(REPO)}
  t0 = time.perf_counter()
  proc = subprocess.Popen(
    [sys.executable, "-m", "jaxtune.train", *argv, "--out", str(out), "--export", "none"],
    stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd=REPO,
  )  # fmt: skip
  first = None
  for line in proc.stderr:
    if first is None and line.startswith("step 1/"):
      first = time.perf_counter() - t0
  stdout = proc.stdout.read()
  if proc.wait() != 0:
    raise SystemExit(f"{argv} failed:\n{stdout[-2000:]}")
  total = time.perf_counter() - t0
  rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
  steps = [r["processed_tokens"] / r["tokens_per_s"] for r in rows if "tokens_per_s" in r]
  start = next(x for x in stdout.splitlines() if " layers, " in x)
  return {
    "first_step_s": round(first, 1),
    "step_s_median": round(statistics.median(steps[1:] or steps), 2),
    "total_s": round(total, 1),
    "rows_of": start.split(" rows of ")[1].split(" tokens")[0] if " rows of " in start else "",
    "cpu_note": "CPU only" in start,
  }


def main() -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--steps", type=int, default=10)
  p.add_argument("--record", action="store_true", help="append the rows to results.jsonl")
  args = p.parse_args()
  work = Path(tempfile.mkdtemp(prefix="laptop-"))
  model = _checkpoint(work)
  rows = []
  for name, argv in (
    ("default run (README's main job)", []),
    ("SmolLM2-135M shape, CPU defaults", ["--model", str(model), "--steps", str(args.steps)]),
  ):
    cache = work / f"cache-{len(rows)}"
    for kind in ("cold", "warm"):
      got = _time(argv, work / f"run-{len(rows)}", cache)
      rows.append({"run": name, "cache": kind, **got})
      print(json.dumps(rows[-1]), flush=True)
  print(f"\n{'run':<34} {'cache':<5} {'first step s':>12} {'step s':>7} {'total s':>8}")
  for r in rows:
    print(
      f"{r['run']:<34} {r['cache']:<5} {r['first_step_s']:>12} {r['step_s_median']:>7} "
      f"{r['total_s']:>8}"
    )
  if args.record:
    sys.path.insert(0, str(REPO))
    from experiments.record import record

    record(
      "laptop_first_step",
      rows,
      f"README's laptop path on this machine's CPUs ({os.cpu_count()} cores)",
      note="process start to the first step's line; step: median of the later steps",
      device=f"cpu x{os.cpu_count()}",
    )
  shutil.rmtree(work, ignore_errors=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
