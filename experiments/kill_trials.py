"""kill -9 (or SIGTERM) at ten moments of a run, then start it again: does it finish as if
never interrupted?

    python experiments/kill_trials.py [--method sft|dpo|grpo] [--signal KILL|TERM]
        [--work DIR] [--record]
    python experiments/kill_trials.py --gguf [--work DIR] [--record]

One uninterrupted run of the built-in model (the reference), then one trial per moment: the
same command line, sent the signal (its whole process group) at that moment, then started
again (``--resume`` when a checkpoint exists, else afresh), until it exits 0. A trial passes
when its per-step losses (the last row of each step in metrics.jsonl) are bit-identical to the
reference's and the exported weights byte-identical, and nothing is left behind (no lock, no
temporaries). ``--method dpo`` trains on preference pairs, ``--method grpo`` on a toy reward
with two updates a rollout (--num-iterations 2: moments fall between a rollout's updates).
``--gguf``: a GGUF export of a finished run, killed at moments of its write, then run again:
the file byte-identical to an uninterrupted export, nothing left beside it. Prints one row per
trial and a total; with ``--record`` appends them to experiments/results.jsonl.

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
COMMON = ["--save-every", "4", "--seq-len", "64", "--lora-rank", "4", "--report-to", "none"]
FLAGS = {
  "sft": ["--steps", "12", *COMMON, "--export", "merged"],
  "dpo": [
    "--steps", "12", *COMMON, "--export", "peft", "--method", "dpo", "--data",
    "{work}/pairs.jsonl",
  ],
  "grpo": [
    "--steps", "12", *COMMON, "--export", "peft", "--method", "grpo", "--data",
    "{work}/prompts.jsonl", "--reward", "toy_rewards:has_a", "--num-generations", "4",
    "--batch-size", "4", "--max-new-tokens", "8", "--num-iterations", "2",
  ],
}  # fmt: skip
EXPORTED = {"sft": ("model.safetensors", "config.json"), "dpo": ("adapter_model.safetensors",)}
EXPORTED["grpo"] = EXPORTED["dpo"]


def _write_inputs(work: Path) -> None:
  """The DPO pairs and GRPO prompts and reward the trials train on."""
  pairs = [
    {"prompt": f"What is {i} plus {i}?", "chosen": f" {2 * i}.", "rejected": f" {2 * i + 1}."}
    for i in range(64)
  ]
  (work / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in pairs))
  prompts = [
    {"prompt": [{"role": "user", "content": f"Question {i}: is it good?"}]} for i in range(32)
  ]
  (work / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in prompts))
  (work / "toy_rewards.py").write_text(
    "def has_a(prompts, completions, **columns):\n"
    "  return [1.0 if 'a' in c else 0.0 for c in completions]\n"
  )


def _rows(out: Path) -> int:
  path = out / "metrics.jsonl"
  return len(path.read_text().splitlines()) if path.is_file() else 0


def _saving(step: int):
  return lambda out, text: any((out / "checkpoints").glob(f"{step}.orbax-checkpoint-tmp*"))


# Each moment: a predicate over (run directory, the stdout so far) that is true once the run
# has reached it. Checked every 5 ms; the signal follows at once.
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


def _part(out: Path, fraction: float):
  """The GGUF file being written has reached ``fraction`` of the reference's size."""

  def reached(target: Path, text: str) -> bool:
    parts = [p for p in target.parent.glob(f".{target.name}.*") if p.is_dir()]
    sizes = [f.stat().st_size for d in parts for f in d.glob("*.gguf") if f.is_file()]
    return bool(sizes) and max(sizes) >= fraction * _part.size

  return reached


GGUF_MOMENTS = {
  "imports": lambda out, text: True,
  "load": lambda out, text: any(out.parent.glob(f".{out.name}.*")),
  **{f"write {int(f * 100)}%": _part(None, f) for f in (0.01, 0.1, 0.25, 0.4, 0.5, 0.6, 0.75)},
  "rename": lambda out, text: (
    (out / "README.md").exists() or any(out.parent.glob(f".{out.name}.*.old"))
  ),
}


def _older_than(path: Path, seconds: float) -> bool:
  try:
    return time.time() - path.stat().st_mtime > seconds
  except FileNotFoundError:
    return False


def _command(out: Path, resume: bool, method: str = "sft") -> list[str]:
  flags = [f.format(work=out.parent) for f in FLAGS[method]]
  return [sys.executable, "-m", "jaxtune.train", "--out", str(out), *flags] + (
    ["--resume"] if resume else []
  )


def _export_command(run: Path, out: Path) -> list[str]:
  return [sys.executable, "-m", "jaxtune.export", "--checkpoint", str(run), "--format", "gguf",
          "--gguf-type", "q8_0", "--out", str(out), "--overwrite"]  # fmt: skip


def _env() -> dict:
  env = dict(os.environ)
  env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
  env["JAX_PLATFORMS"] = "cpu"
  env.pop("XLA_FLAGS", None)
  # The trials' own compilation cache (the reference run fills it): a kill may land while an
  # entry is read or written, as it would for a user.
  env.setdefault("JAXTUNE_COMPILE_CACHE", os.path.join(tempfile.gettempdir(), "kill-trials-xla"))
  return env


def _run(command: list[str], cwd: Path) -> subprocess.CompletedProcess:
  return subprocess.run(command, capture_output=True, text=True, env=_env(), cwd=cwd)


def _interrupt_at(command: list[str], cwd: Path, out: Path, reached, signum: int) -> bool:
  """Start ``command`` and send ``signum`` to its process group once ``reached(out, stdout)``;
  False when it finished first."""
  log = out.parent / f"{out.name}.stdout"
  with open(log, "w") as sink:
    proc = subprocess.Popen(
      command, stdout=sink, stderr=subprocess.DEVNULL, env=_env(), cwd=cwd,
      start_new_session=True,
    )  # fmt: skip
    while proc.poll() is None:
      if reached(out, log.read_text()):
        os.killpg(proc.pid, signum)
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


def _export_hashes(out: Path, names) -> dict[str, str]:
  return {name: hashlib.sha256((out / "export" / name).read_bytes()).hexdigest() for name in names}


def _leftovers(out: Path) -> list[str]:
  left = [p.name for p in out.glob(".export.*")] + [p.name for p in out.glob(".jaxtune.lock")]
  left += [p.name for p in (out / "checkpoints").glob("*.orbax-checkpoint-tmp*")]
  return left


def _train_trials(work: Path, method: str, signum: int) -> list[dict]:
  ref = work / "reference"
  proc = _run(_command(ref, False, method), work)
  if proc.returncode != 0:
    raise SystemExit(proc.stderr[-3000:])
  names = EXPORTED[method]
  want_losses, want_export = _losses(ref), _export_hashes(ref, names)
  rows = []
  for moment, reached in MOMENTS.items():
    out = work / moment.replace(" ", "-")
    killed = _interrupt_at(_command(out, False, method), work, out, reached, signum)
    restarts = 0
    while True:
      resume = (out / "checkpoints").is_dir() and any(
        p.name.isdigit() for p in (out / "checkpoints").iterdir()
      )
      proc = _run(_command(out, resume, method), work)
      restarts += 1
      if proc.returncode == 0 or restarts >= 3:
        break
    rows.append(
      {
        "moment": moment,
        "killed": killed,
        "restarts": restarts,
        "exit": proc.returncode,
        "losses_bit_identical": proc.returncode == 0 and _losses(out) == want_losses,
        "export_byte_identical": proc.returncode == 0 and _export_hashes(out, names) == want_export,
        "left_behind": _leftovers(out),
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
  return rows


def _gguf_trials(work: Path) -> list[dict]:
  run = work / "run"
  proc = _run(_command(run, False, "sft"), work)
  if proc.returncode != 0:
    raise SystemExit(proc.stderr[-3000:])
  ref = work / "reference-gguf"
  proc = _run(_export_command(run, ref), work)
  if proc.returncode != 0:
    raise SystemExit(proc.stderr[-3000:])
  (gguf,) = ref.glob("*.gguf")
  want = hashlib.sha256(gguf.read_bytes()).hexdigest()
  _part.size = gguf.stat().st_size
  rows = []
  for moment, reached in GGUF_MOMENTS.items():
    out = work / ("gguf-" + moment.replace(" ", "-").replace("%", ""))
    killed = _interrupt_at(_export_command(run, out), work, out, reached, signal.SIGKILL)
    proc = _run(_export_command(run, out), work)
    got = [hashlib.sha256(f.read_bytes()).hexdigest() for f in out.glob("*.gguf")]
    left = [p.name for p in work.glob(f".{out.name}*")]
    rows.append(
      {
        "moment": moment,
        "killed": killed,
        "restarts": 1,
        "exit": proc.returncode,
        "losses_bit_identical": True,  # no training in these trials
        "export_byte_identical": proc.returncode == 0 and got == [want],
        "left_behind": left,
        "resumed_from": None,
      }
    )
    print(json.dumps(rows[-1]), flush=True)
  return rows


def main() -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--method", default="sft", choices=sorted(FLAGS))
  p.add_argument("--signal", default="KILL", choices=("KILL", "TERM"))
  p.add_argument("--gguf", action="store_true", help="trials of a GGUF export instead")
  p.add_argument("--work", default=None, help="directory for the runs (default: a temporary one)")
  p.add_argument("--record", action="store_true", help="append the rows to results.jsonl")
  args = p.parse_args()
  work = Path(args.work or tempfile.mkdtemp(prefix="kill-trials-"))
  work.mkdir(parents=True, exist_ok=True)
  _write_inputs(work)
  signum = getattr(signal, f"SIG{args.signal}")
  rows = _gguf_trials(work) if args.gguf else _train_trials(work, args.method, signum)

  keys = ("killed", "losses_bit_identical", "export_byte_identical")
  passed = sum(all(r[k] for k in keys) and not r["left_behind"] for r in rows)
  print(f"\n{'moment':<10} {'killed':<7} {'resumed from':<13} losses  export  left behind")
  for r in rows:
    print(
      f"{r['moment']:<10} {str(r['killed']):<7} {str(r['resumed_from'] or 'start'):<13} "
      f"{'same' if r['losses_bit_identical'] else 'DIFF':<7} "
      f"{'same' if r['export_byte_identical'] else 'DIFF':<7} {r['left_behind'] or '-'}"
    )
  what = "a GGUF export" if args.gguf else f"{args.method} training"
  print(
    f"\n{passed}/{len(rows)} trials of {what} ({args.signal}) identical to the uninterrupted run"
  )
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
    flags = "gguf export q8_0" if args.gguf else " ".join(FLAGS[args.method])
    record(
      "kill_trials",
      table,
      f"SIG{args.signal} at ten moments of {what}, then start again (CPU, built-in model)",
      note=f"{passed}/{len(rows)} identical to the uninterrupted run; flags: {flags}",
      device="cpu",
    )
  return 0 if passed == len(rows) else 1


if __name__ == "__main__":
  sys.exit(main())
