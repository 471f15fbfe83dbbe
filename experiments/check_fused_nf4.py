"""Decoding's fused NF4 launches on the GPU: right answers, then device time against one
launch per weight.

(a) Correctness: x [M, K] times the 8B layer's q/k/v (and gate/up) weights, as decoding runs
them (ops.prepared_matmul over the weights' word-order codes and bf16 scales concatenated
along N, one kernel launch), against each weight's float32 reference and against the same
weights one launch each (ops.nf4_matmul with the same prepared operands). One PASS/FAIL line
per case and weight: a wrong column offset or tile gives errors near 1, not 1e-3.

(b) Device time (CUPTI, median of --reps, calls rotating over weight copies that outgrow L2):
the fused launch, the separate launches, cuBLAS on the concatenated bf16 weight. Table last.

  PYTHONPATH=. python experiments/check_fused_nf4.py [--results-dir $OUT]
"""

import argparse
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from experiments.bench_nf4_matmul import rel_err, time_per_call, weights  # noqa: E402
from experiments.record import record  # noqa: E402
from pallas_kernels.nf4_matmul import kernel_scales, ops, reference  # noqa: E402

TOLERANCE = 1e-2  # relative error against the float32 reference (tests: the same bound)
GROUPS = {"qkv": (4096, 1024, 1024), "gate_up": (14336, 14336)}  # Llama 3.1 8B, K = 4096


fused_fn = jax.jit(lambda a, w, s: ops.prepared_matmul(a, w, s, impl="kernel"))
alone_fn = jax.jit(
  lambda a, qs, ws, ss: [
    ops.nf4_matmul(a, *q, impl="kernel", scales=s, word_codes=w)
    for q, w, s in zip(qs, ws, ss, strict=True)
  ]
)


def main():
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  ap.add_argument("--ms", default="1,16,64")
  ap.add_argument("--k", type=int, default=4096)
  ap.add_argument("--copies", type=int, default=4)
  ap.add_argument("--reps", type=int, default=20)
  ap.add_argument("--results-dir", default=None)
  args = ap.parse_args()
  rng = np.random.default_rng(0)
  rows, failed = [], 0
  for group, ns in GROUPS.items():
    made = [weights(rng, args.k, n, args.copies) for n in ns]  # per weight: (qs, dense)
    copies = []
    for c in range(args.copies):
      qs = [made[i][0][c] for i in range(len(ns))]
      word = [ops.word_codes(q[0]) for q in qs]
      scales = [kernel_scales(*q[1:]) for q in qs]
      dense = jnp.concatenate([made[i][1][c] for i in range(len(ns))])
      fused = (jnp.concatenate(word), jnp.concatenate(scales, axis=-1))
      copies.append(dict(qs=qs, word=word, scales=scales, dense=dense, fused=fused))
    for m in (int(x) for x in args.ms.split(",")):
      x = jnp.asarray(rng.standard_normal((m, args.k)), jnp.bfloat16)
      c0 = copies[0]
      refs = [np.asarray(reference.nf4_matmul_reference(x, *q)) for q in c0["qs"]]
      got = fused_fn(x, *c0["fused"])
      alone = alone_fn(x, c0["qs"], c0["word"], c0["scales"])
      ends = np.cumsum(ns)[:-1]
      parts = jnp.split(got, ends, axis=-1)
      errs = [rel_err(p, r) for p, r in zip(parts, refs, strict=True)]
      errs_alone = [rel_err(p, r) for p, r in zip(alone, refs, strict=True)]
      ok = max(errs) < TOLERANCE
      failed += not ok
      cfg = ops._forward_config(m, sum(ns), args.k, False)
      print(
        f"{'PASS' if ok else 'FAIL'} {group} M={m} N={sum(ns)} (split_k={cfg.split_k}, "
        f"k_sub={cfg.k_sub}): fused err {', '.join(f'{e:.2e}' for e in errs)}; "
        f"alone {', '.join(f'{e:.2e}' for e in errs_alone)}",
        flush=True,
      )
      ms = {
        "fused": time_per_call(lambda a, c: fused_fn(a, *c["fused"]), x, copies, args.reps),
        "alone": time_per_call(
          lambda a, c: alone_fn(a, c["qs"], c["word"], c["scales"]), x, copies, args.reps
        ),
        "bf16": time_per_call(jax.jit(lambda a, c: a @ c["dense"].T), x, copies, args.reps),
      }
      rows.append({
        "group": group, "m": m, "k": args.k, "n": sum(ns), "err_fused_max": max(errs),
        "err_alone_max": max(errs_alone), "fused_ms": ms["fused"], "alone_ms": ms["alone"],
        "bf16_ms": ms["bf16"], "fused_vs_alone": ms["fused"] / ms["alone"],
        "fused_vs_bf16": ms["fused"] / ms["bf16"],
      })  # fmt: skip
  record(
    "check_fused_nf4",
    rows,
    "Decoding's fused NF4 launches (q/k/v, gate/up) against one launch per weight",
    note="Device time (CUPTI) per call; fused = ops.prepared_matmul over concatenated word-order "
    "codes and bf16 scales, alone = ops.nf4_matmul per weight with the same prepared operands; "
    "bf16 = cuBLAS on the concatenated bf16 weight, same run.",
    out_dir=args.results_dir,
  )
  print(
    "\n| group | M | N | fused err | fused ms | alone ms | bf16 ms | fused/alone | fused/bf16 |"
  )
  for r in rows:
    print(
      f"| {r['group']} | {r['m']} | {r['n']} | {r['err_fused_max']:.1e} | {r['fused_ms']:.4f} | "
      f"{r['alone_ms']:.4f} | {r['bf16_ms']:.4f} | {r['fused_vs_alone']:.2f} | "
      f"{r['fused_vs_bf16']:.2f} |"
    )
  sys.exit(1 if failed else 0)


if __name__ == "__main__":
  main()
