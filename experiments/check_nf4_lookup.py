"""The NF4 forward kernel's "word" lookup on the GPU: right answers, then speed against "prmt".

(a) Correctness through ops.nf4_matmul(..., impl="kernel", lookup="word"), scales prepared as
decoding passes them, dispatch's decode configurations (ops._forward_config: split K, k blocks
a step), M in --ms, the 8B projections: relative error against the float32 reference, beside
"prmt" and XLA's dequantize-then-dot, and whether "word" equals "prmt" bit for bit (the same
bf16 tile reaches wgmma in the same order, so it should). One PASS/FAIL line per case: a wrong
register mapping or permutation gives errors near 1, not 1e-3.

(b) Device time (CUPTI, median of --reps, each call over weight copies that outgrow L2, as
sweep_nf4_decode.py): the kernel alone with "prmt" and with "word" (codes, scales prepared
once; x padded to the tile), cuBLAS on a bf16 copy of W, and ops' "word" call (which permutes
the codes on every call). Prints a table last.

  PYTHONPATH=. python experiments/check_nf4_lookup.py [--results-dir $OUT]
"""

import argparse
import sys
import traceback
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from experiments.bench_nf4_matmul import LLAMA_8B, rel_err, time_per_call, weights  # noqa: E402
from pallas_kernels.nf4_matmul import kernel, kernel_scales, ops, reference  # noqa: E402

TOLERANCE = 1e-2  # relative error against the float32 reference (tests: the same bound)


def check(m, k, n, x, q, scales):
  """Correctness through ops.nf4_matmul; returns (row fields, passed)."""
  ref = np.asarray(reference.nf4_matmul_reference(x, *q))
  out = {}
  for lookup in ("prmt", "word"):
    f = jax.jit(lambda a, q, s, lookup=lookup: ops.nf4_matmul(
      a, *q, impl="kernel", scales=s, lookup=lookup))  # fmt: skip
    out[lookup] = f(x, q, scales)
  xla = jax.jit(lambda a, q: reference.dequantize_then_dot(a, *q))(x, q)
  errs = {name: rel_err(y, ref) for name, y in (*out.items(), ("xla", xla))}
  same = bool(jnp.array_equal(out["word"], out["prmt"]))
  diff = float(jnp.max(jnp.abs(out["word"].astype(jnp.float32) - out["prmt"].astype(jnp.float32))))
  passed = errs["word"] < TOLERANCE
  cfg = ops._forward_config(m, n, k, False)
  print(
    f"{'PASS' if passed else 'FAIL'} M={m} N={n} K={k} (split_k={cfg.split_k}, "
    f"k_sub={cfg.k_sub}, block_m={cfg.block_m}): err word {errs['word']:.2e}, "
    f"prmt {errs['prmt']:.2e}, xla {errs['xla']:.2e}; word == prmt bitwise: {same} "
    f"(max |diff| {diff:.3g})",
    flush=True,
  )
  fields = {
    "split_k": cfg.split_k, "k_sub": cfg.k_sub, "err_word": errs["word"],
    "err_prmt": errs["prmt"], "err_xla": errs["xla"], "word_eq_prmt": same,
  }  # fmt: skip
  return fields, passed


def timings(m, k, n, x, qs, dense, reps):
  """Median device ms per call: cuBLAS bf16, the kernel with each lookup, ops' word call."""
  cfg = ops._forward_config(m, n, k, False)
  xp = ops._kernel_input(x, cfg)
  scales = [kernel_scales(*q[1:]) for q in qs]
  codes = {
    "prmt": [kernel.kernel_codes(q[0], swap_nibbles=False) for q in qs],
    "word": [kernel.word_codes(q[0]) for q in qs],
  }
  ms = {"bf16": time_per_call(jax.jit(lambda a, w: a @ w.T), x, dense, reps)}
  for lookup, c in codes.items():
    f = jax.jit(lambda a, w4, s, lookup=lookup: kernel.forward(a, w4, s, config=cfg, lookup=lookup))
    operands = list(zip(c, scales, strict=True))
    ms[lookup] = time_per_call(lambda a, w, f=f: f(a, *w), xp, operands, reps)
  ops_word = jax.jit(lambda a, q, s: ops.nf4_matmul(a, *q, impl="kernel", scales=s, lookup="word"))
  operands = list(zip(qs, scales, strict=True))
  ms["ops_word"] = time_per_call(lambda a, w: ops_word(a, *w), x, operands, reps)
  return ms


def main():
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  ap.add_argument("--ms", default="1,16,64")
  ap.add_argument("--reps", type=int, default=10)
  ap.add_argument("--results-dir", default=None, help="record rows there (results.jsonl)")
  args = ap.parse_args()
  print(jax.devices()[0].device_kind, "jax", jax.__version__, flush=True)
  rng = np.random.default_rng(0)
  rows, failed = [], 0
  for k, n in LLAMA_8B:
    copies = max(2, -(-64 * 2**20 // (k * n // 2)))  # NF4 bytes of all copies >= 64 MiB
    qs, dense = weights(rng, k, n, copies)
    scales0 = kernel_scales(*qs[0][1:])
    for m in (int(v) for v in args.ms.split(",")):
      x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
      row = {"M": m, "K": k, "N": n}
      try:
        fields, passed = check(m, k, n, x, qs[0], scales0)
        row.update(fields)
        failed += not passed
        ms = timings(m, k, n, x, qs, dense, args.reps)
      except Exception:  # a failing case is reported, the others still run
        traceback.print_exc(limit=4)
        failed += 1
        continue
      nf4_bytes = n * k // 2 + (k // 64) * n * 2  # codes + bf16 scales: what the kernel streams
      row.update({f"{name}_us": v * 1e3 for name, v in ms.items()})
      row.update(
        word_vs_prmt=ms["word"] / ms["prmt"], word_vs_bf16=ms["word"] / ms["bf16"],
        prmt_gbs=nf4_bytes / ms["prmt"] / 1e6, word_gbs=nf4_bytes / ms["word"] / 1e6,
        bf16_gbs=n * k * 2 / ms["bf16"] / 1e6,
      )  # fmt: skip
      rows.append(row)
      print({a: f"{b:.4g}" if isinstance(b, float) else b for a, b in row.items()}, flush=True)
  if args.results_dir:
    from experiments.record import record  # noqa: PLC0415

    record(
      "check_nf4_lookup",
      rows,
      'NF4 forward kernel at decoding sizes: "word" lookup against "prmt" and cuBLAS bf16',
      note="Kernel alone (codes, scales prepared; x padded), CUPTI device time per call over "
      "weight copies that outgrow L2, median; ops_word = ops.nf4_matmul(lookup='word'), which "
      "permutes the codes on every call; GB/s = weight bytes read (NF4 codes + bf16 scales, or "
      "the bf16 W) per second.",
      out_dir=args.results_dir,
    )
  print("\n|  M |     N |     K | bf16 us | prmt us | word us | ops word us | word/prmt "
        "| word/bf16 | GB/s bf16 prmt word | check (word == prmt bitwise) |")  # fmt: skip
  for r in rows:
    ok = "PASS" if r["err_word"] < TOLERANCE else "FAIL"
    ok += " (==)" if r["word_eq_prmt"] else " (differs)"
    print(
      f"| {r['M']:>2} | {r['N']:>5} | {r['K']:>5} | {r['bf16_us']:>7.1f} | {r['prmt_us']:>7.1f} "
      f"| {r['word_us']:>7.1f} | {r['ops_word_us']:>11.1f} | {r['word_vs_prmt']:>9.3f} "
      f"| {r['word_vs_bf16']:>9.3f} | {r['bf16_gbs']:>5.0f} {r['prmt_gbs']:>5.0f} "
      f"{r['word_gbs']:>5.0f} | {ok} |"
    )
  print(f"\n{'ALL PASS' if not failed else f'{failed} FAILED'} ({len(rows)} cases timed)")
  sys.exit(1 if failed else 0)


if __name__ == "__main__":
  main()
