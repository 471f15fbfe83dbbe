"""The "word" lookup's per-call permutation of NF4 codes, two ways, in one run: a transpose
of bytes (how reference.word_bytes did it before, ``byte_transpose`` below) and shifts on
32-bit words (reference.word_bytes now).
Device time (CUPTI) per call over copies that outgrow L2, median of --reps; checks they agree.

  python experiments/bench_word_order.py --results-dir $OUT
"""

import argparse
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from experiments.bench_nf4_matmul import time_per_call  # noqa: E402
from experiments.record import record  # noqa: E402
from pallas_kernels.nf4_matmul import reference  # noqa: E402


def byte_transpose(codes):
  *lead, half = codes.shape
  return codes.reshape(*lead, half // 16, 4, 4).swapaxes(-1, -2).reshape(*lead, half)


def main():
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  ap.add_argument("--shapes", default="4096x4096,4096x14336,14336x4096", help="KxN,...")
  ap.add_argument("--reps", type=int, default=10)
  ap.add_argument("--results-dir", default=None)
  args = ap.parse_args()
  rng = np.random.default_rng(0)
  rows = []
  for kn in args.shapes.split(","):
    k, n = (int(v) for v in kn.split("x"))
    copies = [jnp.asarray(rng.integers(0, 256, (n, k // 2)), jnp.uint8) for _ in range(4)]
    same = bool((byte_transpose(copies[0]) == reference.word_bytes(copies[0])).all())
    t = {}
    for name, fn in (("bytes", byte_transpose), ("u32", reference.word_bytes)):
      f = jax.jit(fn)
      t[name] = time_per_call(lambda _, c, f=f: f(c), jnp.zeros(()), copies, args.reps)
    gb = 2 * n * k // 2 / 1e9  # read + write
    row = {
      "K": k, "N": n, "same": same, "bytes_ms": t["bytes"], "u32_ms": t["u32"],
      "u32_vs_bytes": t["u32"] / t["bytes"], "u32_tb_per_s": gb / t["u32"],
    }  # fmt: skip
    rows.append(row)
    print(row, flush=True)
  record(
    "bench_word_order",
    rows,
    "The word lookup's permutation of NF4 codes: byte transpose vs 32-bit shifts",
    note="Device time per call (CUPTI, median), over copies that outgrow L2; same: both give "
    "the same bytes; u32_tb_per_s counts the codes read and written.",
    out_dir=args.results_dir,
  )


if __name__ == "__main__":
  main()
