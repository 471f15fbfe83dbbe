"""NF4 dequant-matmul kernel against a bf16 matmul and XLA's dequantize-then-dot, in one run.

For M in --ms and (K, N) from Llama-3.1-8B's projections, times forward y = x @ W^T and
backward dx = dy @ W three ways: (a) bf16 jnp.dot on a bf16 copy of W, (b) XLA
dequantize-then-dot on the NF4 weight, (c) the Mosaic GPU kernel. Checks the kernel against the
float32 reference in the same run. Each timing rotates over weight copies (more bytes than the L2
cache holds) and counts device time only (CUPTI), median of --reps.

  python experiments/bench_nf4_matmul.py --results-dir $OUT
"""

import argparse
import functools
import statistics
import sys
import traceback
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from experiments.record import record  # noqa: E402
from pallas_kernels import nf4  # noqa: E402
from pallas_kernels.nf4_matmul import kernel, ops, reference  # noqa: E402

LLAMA_8B = [(4096, 4096), (4096, 1024), (4096, 14336), (14336, 4096)]


def time_per_call(fn, a, operands, reps):
  """Median device time per call (CUPTI: the kernels' own times, no host gaps), the calls
  rotating over weight copies that together outgrow the L2 cache."""
  from jax.experimental.mosaic.gpu import profiler  # noqa: PLC0415 (GPU only)

  def all_copies(a, operands):  # operands as arguments: captured, they become constants
    return [fn(a, w) for w in operands]

  jax.block_until_ready(all_copies(a, operands))
  _, times = profiler.measure(all_copies, aggregate=True, iterations=reps)(a, operands)
  return statistics.median(times) / len(operands)  # ms


def kernel_breakdown(fn, args) -> str:
  """Each kernel one call launches, with its device time: where the time goes."""
  from jax.experimental.mosaic.gpu import profiler  # noqa: PLC0415

  _, per_kernel = profiler.measure(fn, aggregate=False)(*args)
  return ", ".join(f"{name[:40]} {ms * 1e3:.1f}us" for name, ms in per_kernel or [])


def rel_err(got, ref) -> float:
  got = np.asarray(got.astype(jnp.float32))
  if not np.all(np.isfinite(got)):
    return float("inf")
  return float(np.linalg.norm(got - ref) / np.linalg.norm(ref))


def weights(rng, k, n, copies):
  w = jnp.asarray(rng.standard_normal((n, k)), jnp.float32) * 0.02
  q = nf4.quantize_linear(w)
  # Copies differ by a permutation of rows, enough to defeat the cache, cheap to make.
  qs, dense = [], []
  for i in range(copies):
    perm = np.roll(np.arange(n), i * 64)
    qi = tuple(
      a[perm] if a.ndim == 2 else a for a in (q.codes, q.absmax, q.nested_absmax, q.offset)
    )
    qs.append(qi)
    dense.append(nf4.dequantize_linear(*qi, jnp.bfloat16))
  return qs, dense


def record_rows(rows, out_dir):
  """One table per row, written as soon as it is measured (a run cut short keeps its rows)."""
  record(
    "bench_nf4_matmul",
    rows,
    "NF4 dequant-matmul kernel vs bf16 dot and XLA dequantize-then-dot (Llama-3.1-8B shapes)",
    note="ms per call (CUPTI device time, median); *_kernel_vs_bf16 = kernel / bf16 time (target "
    "<= 1.10 at M >= 4096, <= 0.33 at M <= 16); *_xla_vs_kernel = XLA / kernel (target >= 1.2).",
    out_dir=out_dir,
  )


def main():
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  ap.add_argument("--ms", default="1,16,256,4096,16384")
  ap.add_argument("--shapes", default="all", help="all, or K x N list like 4096x4096,4096x1024")
  ap.add_argument("--reps", type=int, default=10)
  ap.add_argument("--results-dir", default=None)
  ap.add_argument("--variants", action="store_true", help="also time lookup/A-operand variants")
  args = ap.parse_args()
  shapes = LLAMA_8B
  if args.shapes != "all":
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
  rng = np.random.default_rng(0)
  rows, table = [], []
  for k, n in shapes:
    copies = max(2, -(-64 * 2**20 // (k * n // 2)))  # NF4 bytes of all copies >= 64 MiB
    qs, dense = weights(rng, k, n, copies)
    for m in (int(v) for v in args.ms.split(",")):
      x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
      dy = jnp.asarray(rng.standard_normal((m, n)), jnp.bfloat16)
      q0 = qs[0]
      ref_f = np.asarray(reference.nf4_matmul_reference(x, *q0))
      w0 = np.asarray(nf4.dequantize_linear(*q0, jnp.float32))
      ref_b = np.asarray(dy.astype(jnp.float32)) @ w0

      # One compiled op per variant, called once per weight copy; CUPTI sums the kernels.
      fwd = {
        "bf16": jax.jit(lambda x, w: x @ w.T),
        "xla": jax.jit(lambda x, q: reference.dequantize_then_dot(x, *q)),
        "kernel": jax.jit(lambda x, q: ops.nf4_matmul(x, *q, impl="kernel")),
      }
      bwd = {
        "bf16": jax.jit(lambda d, w: d @ w),
        "xla": jax.jit(lambda d, q: reference.dequantize_then_dot_t(d, *q)),
        "kernel": jax.jit(lambda d, q: ops._bwd_impl("kernel", d, q)),
      }
      row = {"M": m, "K": k, "N": n}
      try:
        row["fwd_err"] = rel_err(fwd["kernel"](x, qs[0]), ref_f)
        row["bwd_err"] = rel_err(bwd["kernel"](dy, qs[0]), ref_b)
        for d, fns, a in (("fwd", fwd, x), ("bwd", bwd, dy)):
          for name, fn in fns.items():
            operands = dense if name == "bf16" else qs
            row[f"{d}_{name}_ms"] = time_per_call(fn, a, operands, args.reps)
      except Exception:  # a benchmark reports a failing case and goes on to the next
        traceback.print_exc(limit=3)
        continue
      for d in ("fwd", "bwd"):
        row[f"{d}_kernel_vs_bf16"] = row[f"{d}_kernel_ms"] / row[f"{d}_bf16_ms"]
        row[f"{d}_xla_vs_kernel"] = row[f"{d}_xla_ms"] / row[f"{d}_kernel_ms"]
      rows.append(row)
      record_rows([row], args.results_dir)
      if m in (1, 4096) and (k, n) == shapes[0]:
        for name, fn in fwd.items():
          where = kernel_breakdown(fn, (x, dense[0] if name == "bf16" else qs[0]))
          table.append(f"M={m} K={k} N={n} {name} fwd: {where}")
        print("\n".join(table[-3:]), flush=True)
      print({key: f"{v:.4g}" if isinstance(v, float) else v for key, v in row.items()}, flush=True)

      if args.variants and m in (1, 4096):
        big = m >= 256
        for label, cfg_kw, lookup in (
          ("ksub2", dict(k_sub=2), "prmt"),
          ("ksub4", dict(k_sub=4), "prmt"),
          ("bm128", dict(block_m=128 if big else 16), "prmt"),
          ("bm128-ksub2", dict(block_m=128 if big else 16, k_sub=2), "prmt"),
          ("bm256-ksub2-4stage", dict(k_sub=2, max_concurrent_steps=3), "prmt"),
          ("split8", dict(split_k=8 if not big else 1), "prmt"),
        ):
          try:
            # Variants of the padded tile (one token: as dispatched before session 28).
            cfg = ops._forward_config(max(m, 2), n, k, False)
            cfg = kernel.Config(**{**cfg.__dict__, **cfg_kw})
            w4, s = kernel.kernel_operands(*q0, swap_nibbles=lookup == "select")
            xp = ops._pad_rows(x, cfg.block_m)
            f = jax.jit(functools.partial(kernel.forward, config=cfg, lookup=lookup))
            err = rel_err(f(xp, w4, s)[:m], ref_f)
            ms = time_per_call(lambda a, w, f=f: f(a, *w), xp, [(w4, s)], args.reps)
            table.append(
              f"variant {label} M={m} K={k} N={n}: err {err:.2e}, {ms:.4f} ms (1 copy, with prep)"
            )
            print(table[-1], flush=True)
          except Exception:
            traceback.print_exc(limit=3)
    if args.variants:
      for m in (4096,):
        dy = jnp.asarray(rng.standard_normal((m, n)), jnp.bfloat16)
        ref_b = np.asarray(dy.astype(jnp.float32)) @ np.asarray(
          nf4.dequantize_linear(*qs[0], jnp.float32)
        )
        w4, s = kernel.kernel_operands(*qs[0], swap_nibbles=False)
        for bm, bn, bko in ((128, 128, 64), (128, 64, 128), (128, 128, 128), (64, 128, 128)):
          try:
            cfg = kernel.Config(block_m=bm, block_n=bn, block_k_out=bko)
            f = jax.jit(functools.partial(kernel.backward, config=cfg))
            err = rel_err(f(dy, w4, s), ref_b)
            ms = time_per_call(lambda a, w, f=f: f(a, *w), dy, [(w4, s)], args.reps)
            table.append(f"bwd variant bm={bm} bn={bn} bko={bko} M={m}: err {err:.2e}, {ms:.4f} ms")
            print(table[-1], flush=True)
          except Exception:
            traceback.print_exc(limit=3)
  print("\n".join(table))
  print("     M      K      N | fwd k/bf16  xla/k | bwd k/bf16  xla/k")
  for r in rows:
    print(
      f"{r['M']:>6} {r['K']:>6} {r['N']:>6} | {r['fwd_kernel_vs_bf16']:>10.3f} "
      f"{r['fwd_xla_vs_kernel']:>6.2f} | {r['bwd_kernel_vs_bf16']:>10.3f} "
      f"{r['bwd_xla_vs_kernel']:>6.2f}"
    )


if __name__ == "__main__":
  main()
