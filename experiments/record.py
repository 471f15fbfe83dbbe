"""Append measurements to experiments/results.jsonl and a table to the dated log,
experiments/log/results-log.md (experiments/RESULTS.md is the current page, kept by hand)."""

import datetime
import json
import shlex
import sys
from pathlib import Path

import jax

HERE = Path(__file__).parent


def device_name() -> str:
  d = jax.devices()[0]
  return getattr(d, "device_kind", d.platform)


def run_meta(bench: str, device: str | None = None) -> dict:
  """The fields every row of a run carries (also for rows written as they are measured).

  ``device``: the GPU's name where this process must not start JAX on it (the GPU is its
  subprocesses'); default: this process's first device.
  """
  return {
    "bench": bench,
    "device": device or device_name(),
    "date": datetime.date.today().isoformat(),
    "jax": jax.__version__,
    "command": "python " + " ".join(shlex.quote(a) for a in sys.argv),
  }


def record(
  bench: str, rows: list[dict], title: str, note: str = "", out_dir=None, device=None
) -> None:
  """Rows are dicts of shape/config fields and figures (units in the keys).

  ``out_dir`` (default: this folder) is where results.jsonl is appended, and the table to
  log/results-log.md; on a lent GPU pass $OUT (the table then goes to $OUT/RESULTS.md) and
  append the returned files here afterwards. ``device``: as run_meta's.
  """
  out_dir = Path(out_dir) if out_dir else HERE
  out_dir.mkdir(parents=True, exist_ok=True)
  meta = run_meta(bench, device)
  with open(out_dir / "results.jsonl", "a") as f:
    for row in rows:
      f.write(json.dumps({**meta, **row}) + "\n")
  keys = list(dict.fromkeys(k for row in rows for k in row))  # every row's, first seen first
  lines = [
    f"\n## {title}\n",
    f"{meta['date']}, {meta['device']}, jax {meta['jax']}, `{meta['command']}`\n",
  ]
  if note:
    lines.append(note + "\n")
  lines.append("| " + " | ".join(keys) + " |")
  lines.append("|" + "---|" * len(keys))
  for row in rows:
    lines.append("| " + " | ".join(_fmt(row[k]) if k in row else "" for k in keys) + " |")
  table = out_dir / "log" / "results-log.md" if out_dir == HERE else out_dir / "RESULTS.md"
  table.parent.mkdir(parents=True, exist_ok=True)
  with open(table, "a") as f:
    f.write("\n".join(lines) + "\n")


def _fmt(v) -> str:
  return f"{v:.4g}" if isinstance(v, float) else str(v)
