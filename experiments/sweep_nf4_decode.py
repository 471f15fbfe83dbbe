"""The NF4 forward kernel's configurations at decoding sizes, against cuBLAS bf16 in one run.

For M in --ms and (K, N) of Llama-3.1-8B's projections, times y = x @ W^T: cuBLAS on a bf16 copy
of W, and the Mosaic GPU kernel alone (scales prepared once, as decoding now passes them; x
already padded to the tile; --lookup: word, lut (decoding's since session 20) or prmt) over a grid
of configurations: compute warpgroups (--wgs; K split over proportionally more cells where a cell
covers more rows), K split over --split-factors times those cells, --subs 64-wide k blocks per
pipeline step, wgmmas waited for in their step or one step later (--delays), --stages pipeline
stages (default 4), --block-ms token tiles (default dispatch's).
Device time (CUPTI), each call over weight copies that outgrow L2, median of --reps. Checks
each configuration against the float32 reference. Prints the best per shape and how dispatch's
current choice compares.

  python experiments/sweep_nf4_decode.py --results-dir $OUT
"""

import argparse
import itertools
import sys
import traceback
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from experiments.bench_nf4_matmul import LLAMA_8B, rel_err, time_per_call, weights  # noqa: E402
from experiments.record import record  # noqa: E402
from pallas_kernels.nf4_matmul import configs, kernel, kernel_scales, ops, reference  # noqa: E402


def main():
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  ap.add_argument("--ms", default="1,16")
  ap.add_argument("--reps", type=int, default=10)
  ap.add_argument(
    "--lookup", default="word", help="comma-separated: word, prmt, lut, plut (each timed)"
  )
  ap.add_argument(
    "--columns", default="0",
    help="blocks_as_columns values (0, 1 or both; 1 at M = 1 only: 8-token tile, no wgmmas "
    "in flight across steps)",
  )  # fmt: skip
  ap.add_argument(
    "--wgs", default="2", help="compute warpgroups per cell, comma-separated ('d': dispatch's)"
  )
  ap.add_argument("--split-factors", default="1,0.5,2")
  ap.add_argument("--subs", default="1,2,4")
  ap.add_argument("--delays", default="0", help="delay_release values: 0, 1 or both")
  ap.add_argument("--stages", default="4", help="pipeline stages (max_concurrent_steps)")
  ap.add_argument(
    "--block-ms", default=None, help="token tiles to try (default: dispatch's for each M)"
  )
  ap.add_argument(
    "--shapes", default=None,
    help="KxN,... (default the 8B projections; decoding's launches: 4096x6144,4096x4096,"
    "4096x28672,14336x4096 = fused q/k/v, o, fused gate/up, down)",
  )  # fmt: skip
  ap.add_argument("--results-dir", default=None)
  args = ap.parse_args()
  rng = np.random.default_rng(0)
  rows, best = [], []
  shapes = LLAMA_8B
  if args.shapes:
    shapes = [tuple(int(v) for v in kn.split("x")) for kn in args.shapes.split(",")]
  for k, n in shapes:
    copies = max(2, -(-64 * 2**20 // (k * n // 2)))
    qs, dense = weights(rng, k, n, copies)
    for m in (int(v) for v in args.ms.split(",")):
      x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
      ref = np.asarray(reference.nf4_matmul_reference(x, *qs[0]))
      bf16 = time_per_call(jax.jit(lambda a, w: a @ w.T), x, dense, args.reps)
      base = ops._forward_config(m, n, k, False)
      taken = ops._table_lookup(base, ops.PREPARED_LOOKUP)  # dispatch's lookup for base
      found, seen, operands = [], set(), {}
      block_ms = _ints(args.block_ms) if args.block_ms else [base.block_m]
      grid = itertools.product(
        args.lookup.split(","), _ints(args.columns), _wgs(args.wgs), _floats(args.split_factors),
        _ints(args.subs), _ints(args.delays), _ints(args.stages), block_ms,
      )  # fmt: skip
      grid = [(lk, c, base.compute_wgs if w == "d" else w, *rest) for lk, c, w, *rest in grid]
      for lookup, cols, wgs, split_f, sub, delay, stages, bm in grid:
        if cols:  # one token spread over the 8 columns; nothing in flight across steps
          bm, delay = kernel.COLUMNS, 0
          if m != 1 or kernel.COLUMNS % sub:
            continue
        elif base.blocks_as_columns and not args.block_ms:
          bm = configs._block_m(m)  # one token padded to a tile (as dispatched before session 28)
        if n % (kernel.WG_ROWS * wgs) or bm < m or (delay and bm > 16):
          continue
        word_order = lookup in ops.WORD_ORDER
        if word_order not in operands:
          codes = kernel.word_codes if word_order else kernel.kernel_codes
          kw = {} if word_order else {"swap_nibbles": False}
          operands[word_order] = [(codes(q[0], **kw), kernel_scales(*q[1:])) for q in qs]
        prepared = operands[word_order]
        split = max(1, int(base.split_k * split_f * wgs / base.compute_wgs))
        if k % (64 * sub * split) or k // split < 64 * sub:
          continue
        cfg = kernel.Config(
          block_m=bm, compute_wgs=wgs, split_k=split, k_sub=sub,
          max_concurrent_steps=stages, delay_release=delay, blocks_as_columns=bool(cols),
        )  # fmt: skip
        if kernel.forward_smem_bytes(cfg, lookup=lookup) > kernel.SMEM_BYTES:
          continue
        if (cfg, lookup) in seen:
          continue  # (split factors that round to the same split: timed once)
        seen.add((cfg, lookup))
        xp = x if cols else ops._pad_rows(x, cfg.block_m)  # (the kernel spreads one token)
        f = jax.jit(
          lambda a, w4, s, cfg=cfg, lookup=lookup: kernel.forward(
            a, w4, s, config=cfg, lookup=lookup
          )
        )
        try:
          err = rel_err(f(xp, *prepared[0])[:m], ref)
          ms = time_per_call(lambda a, w, f=f: f(a, *w), xp, prepared, args.reps)
        except Exception:  # a configuration that does not lower is reported and skipped
          traceback.print_exc(limit=2)
          continue
        now = cfg == base and lookup == taken  # dispatch's own configuration and lookup
        row = {
          "M": m, "K": k, "N": n, "lookup": lookup, "columns": cols, "wgs": wgs,
          "split_k": split, "k_sub": sub, "delay_release": delay, "stages": stages, "block_m": bm,
          "dispatch": now, "err": err,
          "kernel_ms": ms, "bf16_ms": bf16, "kernel_vs_bf16": ms / bf16,
        }  # fmt: skip
        rows.append(row)
        found.append(row)
        print(
          f"M={m} K={k} N={n} {lookup} cols={cols} bm={bm} wgs={wgs} split={split} "
          f"k_sub={sub} delay={delay} stages={stages}: "
          f"{ms * 1e3:.1f} us = {ms / bf16:.3f}x bf16, err {err:.1e}"
          + (" (dispatch)" if now else ""),
          flush=True,
        )
      if found:
        top = min(found, key=lambda r: r["kernel_ms"])
        now = next((r for r in found if r["dispatch"]), None)
        best.append((m, k, n, top, now))
  record(
    "sweep_nf4_decode",
    rows,
    "The NF4 forward kernel's configurations at decoding sizes (8B shapes)",
    note="Kernel alone (scales prepared, x padded or one token spread), device time per call "
    "over weight copies that outgrow L2; bf16 = cuBLAS on a bf16 copy of W in the same run; "
    "dispatch = the configuration ops._forward_config picks today.",
    out_dir=args.results_dir,
  )
  print(
    "\n|    M     K     N | dispatch / bf16 | best / bf16 | best (lookup, columns, bm, wgs, "
    "split, k_sub, delay, stages) |"
  )
  for m, k, n, top, now in best:
    cur = f"{now['kernel_vs_bf16']:.3f}" if now else "-"
    print(
      f"| {m:>4} {k:>5} {n:>5} | {cur:>15} | {top['kernel_vs_bf16']:>11.3f} | "
      f"({top['lookup']}, {top['columns']}, {top['block_m']}, {top['wgs']}, "
      f"{top['split_k']}, {top['k_sub']}, {top['delay_release']}, {top['stages']}) |"
    )


def _wgs(text):
  return [v if v == "d" else int(v) for v in text.split(",")]


def _ints(text):
  return [int(v) for v in text.split(",")]


def _floats(text):
  return [float(v) for v in text.split(",")]


if __name__ == "__main__":
  main()
