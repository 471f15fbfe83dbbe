"""kill -9 at ten moments of a run, then start it again: does it finish as if never killed?

    python experiments/kill_trials.py [--work DIR] [--record]

One uninterrupted run of the built-in model (the reference), then one trial per moment: the
same command line, killed with SIGKILL (its whole process group) at that moment, then started
again (``--resume`` when a checkpoint exists, else afresh), until it exits 0. A trial passes
when its per-step losses (the last row of each step in metrics.jsonl) are bit-identical to the
reference's and the exported weights (model.safetensors, config.json) byte-identical, and
nothing is left behind (no lock, no temporaries). Prints one row per trial and a total; with
``--record`` appends them to experiments/results.jsonl.

Runs on CPU (one device); takes about two runs' time per trial.
"""

import argparse
import hashlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FLAGS = ["--steps", "12", "--save-every", "4", "--seq-len", "64", "--lora-rank", "4"]
FLAGS += ["--export", "merged", "--report-to", "none"]


def _rows(out: Path) -> int:
  path = out / "metrics.jsonl"
  return len(path.read_text().splitlines()) if path.is_file() else 0


def _saving(step: int):
  return lambda out, text: any((out / "checkpoints").glob(f"{step}.orbax-checkpoint-tmp*"))


# Each moment: a predicate over (run directory, the stdout so far) that is true once the run
# has reached it. Checked every 5 ms; the kill follows at once.
MOMENTS = {
  "imports": lambda out, text: True,  # at once: Python still importing
  "load": lambda out, text: (out / ".jaxtune.lock").is_file(),  # locked, loading data + model
  # config.yaml is written once the model is loaded; the step compiles next (the start line
  # follows the compile): 0.3 s after it appears.
  "compile": lambda out, text: _older_than(out / "config.yaml", 0.3),
  "step 2": lambda out, text: _rows(out) >= 2,
  "save 4": _saving(4),
  "step 6": lambda out, text: _rows(out) >= 6,
  "save 8": _saving(8),
  "step 10": lambda out, text: _rows(out) >= 10,
  "save 12": _saving(12),
  "export": lambda out, text: any(out.glob(".export.*.tmp")),
}


def _older_than(path: Path, seconds: float) -> bool:
  try:
    return time.time() - path.stat().st_mtime > seconds
  except FileNotFoundError:
    return False


def _command(out: Path, resume: bool) -> list[str]:
  return [sys.executable, "-m", "jaxtune.train", "--out", str(out), *FLAGS] + (
    ["--resume"] if resume else []
  )


def _env() -> dict:
  env = dict(os.environ)
  env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
  env["JAX_PLATFORMS"] = "cpu"
  env.pop("XLA_FLAGS", None)
  # The trials' own compilation cache (the reference run fills it): a kill may land while an
  # entry is read or written, as it would for a user.
  env.setdefault("JAXTUNE_COMPILE_CACHE", os.path.join(tempfile.gettempdir(), "kill-trials-xla"))
  return env


def _run(out: Path, resume: bool) -> subprocess.CompletedProcess:
  return subprocess.run(_command(out, resume), capture_output=True, text=True, env=_env())


def _kill_at(out: Path, reached) -> bool:
  """Start the run and SIGKILL it once ``reached``; False when it finished first."""
  log = out.parent / f"{out.name}.stdout"
  with open(log, "w") as sink:
    proc = subprocess.Popen(
      _command(out, resume=False),
      stdout=sink,
      stderr=subprocess.DEVNULL,
      env=_env(),
      start_new_session=True,
    )
    while proc.poll() is None:
      if reached(out, log.read_text()):
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return True
      time.sleep(0.005)
  return False


def _losses(out: Path) -> dict[int, float]:
  by_step = {}
  for line in (out / "metrics.jsonl").read_text().splitlines():
    row = json.loads(line)
    if "loss" in row:
      by_step[row["step"]] = row["loss"]
  return by_step


def _export_hashes(out: Path) -> dict[str, str]:
  return {
    name: hashlib.sha256((out / "export" / name).read_bytes()).hexdigest()
    for name in ("model.safetensors", "config.json")
  }


def _leftovers(out: Path) -> list[str]:
  left = [p.name for p in out.glob(".export.*")] + [p.name for p in out.glob(".jaxtune.lock")]
  left += [p.name for p in (out / "checkpoints").glob("*.orbax-checkpoint-tmp*")]
  return left


def main() -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--work", default=None, help="directory for the runs (default: a temporary one)")
  p.add_argument("--record", action="store_true", help="append the rows to results.jsonl")
  args = p.parse_args()
  work = Path(args.work or tempfile.mkdtemp(prefix="kill-trials-"))
  work.mkdir(parents=True, exist_ok=True)

  ref = work / "reference"
  proc = _run(ref, resume=False)
  if proc.returncode != 0:
    print(proc.stderr[-3000:], file=sys.stderr)
    return 1
  want_losses, want_export = _losses(ref), _export_hashes(ref)

  rows = []
  for moment, reached in MOMENTS.items():
    out = work / moment.replace(" ", "-")
    killed = _kill_at(out, reached)
    restarts = 0
    while True:
      resume = (out / "checkpoints").is_dir() and any(
        p.name.isdigit() for p in (out / "checkpoints").iterdir()
      )
      proc = _run(out, resume)
      restarts += 1
      if proc.returncode == 0 or restarts >= 3:
        break
    same_losses = proc.returncode == 0 and _losses(out) == want_losses
    same_export = proc.returncode == 0 and _export_hashes(out) == want_export
    left = _leftovers(out)
    rows.append(
      {
        "moment": moment,
        "killed": killed,
        "restarts": restarts,
        "exit": proc.returncode,
        "losses_bit_identical": same_losses,
        "export_byte_identical": same_export,
        "left_behind": left,
        "resumed_from": next(
          (
            x.split("resuming from step ")[1].split(" ")[0]
            for x in proc.stderr.splitlines()
            if "resuming from step" in x
          ),
          None,
        ),  # fmt: skip
      }
    )
    print(json.dumps(rows[-1]), flush=True)

  keys = ("killed", "losses_bit_identical", "export_byte_identical")
  passed = sum(all(r[k] for k in keys) and not r["left_behind"] for r in rows)
  print(f"\n{'moment':<10} {'killed':<7} {'resumed from':<13} losses  export  left behind")
  for r in rows:
    print(
      f"{r['moment']:<10} {str(r['killed']):<7} {str(r['resumed_from'] or 'start'):<13} "
      f"{'same' if r['losses_bit_identical'] else 'DIFF':<7} "
      f"{'same' if r['export_byte_identical'] else 'DIFF':<7} {r['left_behind'] or '-'}"
    )
  print(f"\n{passed}/{len(rows)} trials bit-identical to the uninterrupted run")
  if args.record:
    sys.path.insert(0, str(REPO))
    from experiments.record import record

    table = [
      {
        "moment": r["moment"],
        "killed": r["killed"],
        "resumed from": r["resumed_from"] or "start",
        "losses bit-identical": r["losses_bit_identical"],
        "export byte-identical": r["export_byte_identical"],
        "left behind": ",".join(r["left_behind"]) or "-",
      }
      for r in rows
    ]
    record(
      "kill_trials",
      table,
      "kill -9 at ten moments, then start again (CPU, built-in model)",
      note=f"{passed}/{len(rows)} bit-identical to the uninterrupted run; flags: {' '.join(FLAGS)}",
      device="cpu",
    )
  return 0 if passed == len(rows) else 1


if __name__ == "__main__":
  sys.exit(main())
