"""Per-step cost of choosing a step's rows in ``Dataset.batch``: the old order (a full
permutation rebuilt for every row of every step) against the new one (``Dataset.order``: one
seeded permutation per epoch, cached), on CPU.

For each dataset size (``--rows``, unpacked: one example per row) and global batch
(``--batch``, accum 1):

- order alone: the index selection exactly as ``Dataset.batch`` does it (``new_indices``
  repeats its lines) against ``old_indices`` (the code it replaced). New: the first step of an
  epoch (a fresh cache: it pays the permutation; median of ``--first-reps``), the median of
  ``--steps`` steps after it, and the mean over one whole epoch measured (every step of epoch
  0, the first included); amortized = first-step time / steps per epoch + median lookup.
  Old: median of ``--old-steps`` steps (its cost does not depend on the step).
- the whole batch: ``Dataset.batch`` (indices + assembling the rows) against the old batch
  (``old_indices`` + the same ``Dataset.rows``), medians as above.

Both orders visit the same rows (the permutation of epoch e is ``default_rng([seed,
e]).permutation(n)`` in both); the script checks it on its first steps and checks that
``new_indices`` gives the rows ``Dataset.batch`` returns (each row's first token is its index).

Fractions of a training step use the one-H100 Llama-3.1-8B step of experiments/RESULTS.md
(``STEP_8B_MS``, below); the data order runs on the step's critical path (trainer.py builds
each step's host batch synchronously), so its time adds to the step's.

  PYTHONPATH=. python experiments/bench_data_order.py --rows 1000000 100000 --batch 8 32
"""

import argparse
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # record.py imports jax; nothing here needs a GPU

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from experiments.record import record  # noqa: E402
from jaxtune.data.rows import IGNORE, Dataset  # noqa: E402

# experiments/RESULTS.md, "Session 6: the 8B step before and after the architecture refactor
# (issue 18)" (2026-11-24, NVIDIA H100 80GB HBM3): llama-3.1-8b, NF4 + LoRA r=16, batch 2 x seq
# 2048, --remat activations, cudnn attention, the current tree: 287.6 and 288.5 ms/step in two
# runs (mean 14,221 tokens/s; 2 * 2048 / 14,221 = 288.0 ms).
STEP_8B_MS = 2 * 2048 / 14221 * 1e3
STEP_8B_SOURCE = (
  "Llama-3.1-8B, NF4 + LoRA r=16, batch 2 x 2048 tokens, --remat activations, one H100: "
  "14,221 tokens/s = 288.0 ms/step (mean of 287.6 and 288.5 ms, RESULTS.md 'Session 6', "
  "2026-11-24)"
)


def old_indices(n: int, step: int, global_batch: int, seed: int) -> np.ndarray:
  """The order ``Dataset.batch`` used before: a full permutation for every row of the step."""
  idx = []
  for i in range(step * global_batch, (step + 1) * global_batch):
    epoch, pos = divmod(i, n)
    idx.append(np.random.default_rng([seed, epoch]).permutation(n)[pos])
  return np.asarray(idx)


def new_indices(ds: Dataset, step: int, global_batch: int, seed: int) -> np.ndarray:
  """The index selection of ``Dataset.batch`` as it is now (its lines, without ``rows``)."""
  n = len(ds)
  epoch, within = np.divmod(np.arange(step * global_batch, (step + 1) * global_batch), n)
  idx = np.empty_like(within)
  for e in np.unique(epoch):
    here = epoch == e
    idx[here] = ds.order(seed, int(e))[within[here]]
  return idx


def old_batch(ds: Dataset, step: int, global_batch: int, accum: int, seed: int) -> dict:
  """``Dataset.batch`` with the old order."""
  idx = old_indices(len(ds), step, global_batch, seed)
  shape = (accum, global_batch // accum, -1)
  return {k: v.reshape(shape) for k, v in ds.rows(idx).items()}


def make_dataset(n: int, k: int) -> Dataset:
  """``n`` examples of ``k`` tokens, one per row (seq_len ``k``); example i's first token is i."""
  starts = np.arange(n, dtype=np.int64) * (k + 1)
  tokens = np.zeros(n * (k + 1) + 1, np.int32)
  tokens[starts] = np.arange(n, dtype=np.int32)
  labels = np.full_like(tokens, IGNORE)
  labels[starts + k] = 1  # one trained token per example
  return Dataset(tokens, labels, starts, np.full(n, k, np.int64), k, pack=False)


def clock(fn, *args) -> float:
  t = time.perf_counter()
  fn(*args)
  return (time.perf_counter() - t) * 1e3


def measure(ds: Dataset, gb: int, args) -> dict:
  n, seed = len(ds), args.seed
  spe = n // gb  # steps per epoch (the sizes here divide: no step straddles two epochs)
  med = statistics.median

  # Same rows: new order == old order == what Dataset.batch returns.
  ds._orders.clear()
  for s in (0, 1, spe - 1):
    new = new_indices(ds, s, gb, seed)
    got = ds.batch(s, gb, 1, seed)["input_ids"][..., 0].reshape(-1)
    same = np.array_equal(new, old_indices(n, s, gb, seed)) and np.array_equal(new, got)
    if not same:
      raise SystemExit(f"rows {n} batch {gb} step {s}: the orders differ")

  # Order alone, new: first step of an epoch (fresh cache), then cached lookups.
  first = []
  for _ in range(args.first_reps):
    ds._orders.clear()
    first.append(clock(new_indices, ds, 0, gb, seed))
  # Interleaved (the order, then the whole batch, of the same step), so both see the same load.
  steady, new_b = [], []
  for s in range(1, args.steps + 1):
    steady.append(clock(new_indices, ds, s, gb, seed))
    new_b.append(clock(ds.batch, s, gb, 1, seed))
  perm = []
  for e in range(args.first_reps):
    perm.append(clock(lambda e=e: np.random.default_rng([seed, e]).permutation(n)))
  ds._orders.clear()
  t = time.perf_counter()
  for s in range(spe):
    new_indices(ds, s, gb, seed)
  epoch_mean = (time.perf_counter() - t) * 1e3 / spe

  first_batch = []
  for _ in range(args.first_reps):
    ds._orders.clear()
    first_batch.append(clock(ds.batch, 0, gb, 1, seed))

  # Old: the order alone and the whole old batch, interleaved likewise.
  old, old_b = [], []
  for s in range(args.old_steps):
    old.append(clock(old_indices, n, s, gb, seed))
    old_b.append(clock(old_batch, ds, s, gb, 1, seed))

  first_ms, lookup_ms = med(first), med(steady)
  amortized = first_ms / spe + lookup_ms
  new_batch_ms, old_batch_ms = med(new_b), med(old_b)
  return {
    "rows": n,
    "global_batch": gb,
    "steps_per_epoch": spe,
    "old_order_ms": med(old),
    "new_order_first_ms": first_ms,
    "permutation_ms": med(perm),
    "new_order_ms": lookup_ms,
    "new_order_amortized_ms": amortized,
    "new_order_epoch_mean_ms": epoch_mean,
    "order_old_over_new": med(old) / epoch_mean,
    "old_batch_ms": old_batch_ms,
    "new_batch_first_ms": med(first_batch),
    "new_batch_ms": new_batch_ms,
    "batch_old_over_new": old_batch_ms / new_batch_ms,
    "old_order_pct_of_8b_step": 100 * med(old) / STEP_8B_MS,
    "new_order_pct_of_8b_step": 100 * epoch_mean / STEP_8B_MS,
    "new_first_step_pct_of_8b_step": 100 * first_ms / STEP_8B_MS,
    "new_batch_pct_of_8b_step": 100 * new_batch_ms / STEP_8B_MS,
    "same_rows": True,
  }


def main():
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  ap.add_argument("--rows", type=int, nargs="+", default=[1_000_000, 100_000])
  ap.add_argument("--batch", type=int, nargs="+", default=[8, 32])
  ap.add_argument("--tokens", type=int, default=16, help="tokens per example (= seq_len)")
  ap.add_argument("--steps", type=int, default=200, help="timed steps, new order")
  ap.add_argument("--old-steps", type=int, default=20, help="timed steps, old order")
  ap.add_argument("--first-reps", type=int, default=5, help="first-step-of-epoch repeats")
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--results-dir", default=None, help="default: experiments/")
  ap.add_argument("--no-record", action="store_true")
  args = ap.parse_args()

  head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
  dirty = subprocess.run(
    ["git", "status", "--porcelain", "jaxtune/data/rows.py"], capture_output=True
  )
  tree = head.stdout.strip() + (" (jaxtune/data/rows.py modified)" if dirty.stdout.strip() else "")
  load_before = os.getloadavg()
  rows = []
  for n in args.rows:
    t = time.perf_counter()
    ds = make_dataset(n, args.tokens)
    print(f"{n} rows: dataset built in {time.perf_counter() - t:.1f} s", flush=True)
    for gb in args.batch:
      row = measure(ds, gb, args)
      rows.append(row)
      print(
        f"  batch {gb}: order old {row['old_order_ms']:.3f} ms, new {row['new_order_ms']:.4f} ms"
        f" (first of epoch {row['new_order_first_ms']:.2f}, epoch mean"
        f" {row['new_order_epoch_mean_ms']:.4f}); batch old {row['old_batch_ms']:.3f}, new"
        f" {row['new_batch_ms']:.3f} ms",
        flush=True,
      )
  load_after = os.getloadavg()

  cpu = platform.processor() or platform.machine()
  try:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
      if line.startswith("model name"):
        cpu = line.split(":", 1)[1].strip()
        break
  except OSError:
    pass
  note = (
    f"Tree {tree}; run as `PYTHONPATH=. {' '.join(['python'] + sys.argv)}` from the repo"
    f" root. CPU: {cpu}, {os.cpu_count()} cores (shared; 1-minute load average {load_before[0]:.2f}"
    f" before, {load_after[0]:.2f} after), numpy {np.__version__}. One example of"
    f" {args.tokens} tokens per row (pack=False), seed {args.seed}, accum 1. Times in ms per step:"
    f" old = medians of {args.old_steps} steps (order and batch timed alternately); new ="
    f" median of {args.steps} steps after the first of the epoch (likewise);"
    " new_order_first = the first step of an epoch (builds and caches the"
    f" permutation; median of {args.first_reps}); permutation = the permutation alone;"
    " new_order_amortized = first / steps_per_epoch + new_order; new_order_epoch_mean = every"
    " step of one epoch timed in a loop (measured). order_old_over_new = old_order /"
    " new_order_epoch_mean; batch_old_over_new = old_batch / new_batch (rows assembled by the"
    " same Dataset.rows). Percentages are of " + STEP_8B_SOURCE + "; no CPU step of the"
    " built-in default model is recorded in RESULTS.md or results.jsonl. same_rows: the new"
    " order, the old one and Dataset.batch's rows agree (steps 0, 1 and the epoch's last)."
  )
  if not args.no_record:
    record(
      "bench_data_order",
      rows,
      "Data order: choosing a step's rows in Dataset.batch, old (a permutation per row) vs new"
      " (one permutation per epoch)",
      note,
      out_dir=args.results_dir,
    )

  print(f"\nstep reference: {STEP_8B_SOURCE}")
  print(
    "\n| rows | batch | order old ms | order new ms | first of epoch ms | epoch mean ms"
    " | old/new | batch old ms | batch new ms | old/new | old order % step | new order % step"
    " | first % step"
    " | new batch % step |"
  )
  print("|" + "---|" * 14)
  for r in rows:
    print(
      f"| {r['rows']:,} | {r['global_batch']} | {r['old_order_ms']:.2f} |"
      f" {r['new_order_ms']:.4f} | {r['new_order_first_ms']:.2f} |"
      f" {r['new_order_epoch_mean_ms']:.4f} | {r['order_old_over_new']:,.0f}x |"
      f" {r['old_batch_ms']:.2f} | {r['new_batch_ms']:.3f} | {r['batch_old_over_new']:,.0f}x |"
      f" {r['old_order_pct_of_8b_step']:.1f} | {r['new_order_pct_of_8b_step']:.4f} |"
      f" {r['new_first_step_pct_of_8b_step']:.2f} |"
      f" {r['new_batch_pct_of_8b_step']:.3f} |"
    )


if __name__ == "__main__":
  main()
