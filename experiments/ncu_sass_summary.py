"""Summarize an Nsight Compute SASS page (``ncu -i REP --page source --print-source sass --csv``):
executed instructions and stall samples by opcode, and the SASS lines with the most samples.

  python experiments/ncu_sass_summary.py sass.csv [WEIGHTS]

WEIGHTS (the launch's weight count) adds thread instructions per weight.
"""

import collections
import csv
import sys


def num(s: str) -> float:
  try:
    return float(s.replace(",", ""))
  except ValueError:
    return 0.0


def main():
  path = sys.argv[1]
  weights = float(sys.argv[2]) if len(sys.argv) > 2 else 0.0
  with open(path, newline="") as f:
    lines = [ln for ln in f if ln.strip()]
  start = next(i for i, ln in enumerate(lines) if ln.startswith('"#"') or "Source" in ln)
  rows = list(csv.DictReader(lines[start:]))
  cols = list(rows[0].keys())
  print("columns:", cols)
  exe = next(c for c in cols if c.startswith("Instructions Executed"))
  thr = next((c for c in cols if c.startswith("Thread Instructions Executed")), None)
  samp = next((c for c in cols if c.startswith("Warp Stall Sampling (All")), None)
  by_op, by_op_t, by_op_s = collections.Counter(), collections.Counter(), collections.Counter()
  for r in rows:
    op = r["Source"].strip().split()
    if not op:
      continue
    o = op[0] if not op[0].startswith("@") else op[1]
    o = o.split(".")[0]
    by_op[o] += num(r[exe])
    if thr:
      by_op_t[o] += num(r[thr])
    if samp:
      by_op_s[o] += num(r[samp])
  tot, tot_t, tot_s = sum(by_op.values()), sum(by_op_t.values()), sum(by_op_s.values())
  print(f"warp instructions {tot:.4g}, thread instructions {tot_t:.4g}, stall samples {tot_s:.4g}")
  if weights:
    print(f"thread instructions per weight {tot_t / weights:.3f}, warp {32 * tot / weights:.3f}")
  print("| opcode | warp instr % | per weight (x32) | stall samples % |")
  for o, v in by_op.most_common(25):
    pw = 32 * v / weights if weights else 0
    print(f"| {o} | {100 * v / tot:.1f} | {pw:.3f} | {100 * by_op_s[o] / max(tot_s, 1):.1f} |")
  if samp:
    print("top sampled lines:")
    top = sorted(rows, key=lambda r: -num(r[samp]))[:25]
    for r in top:
      print(f"  {num(r[samp]):8.0f} {num(r[exe]):10.0f}  {r['Source'].strip()[:90]}")


if __name__ == "__main__":
  main()
