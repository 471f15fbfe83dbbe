"""Flash attention speed: the Mosaic GPU kernel against cuDNN and XLA, forward and fwd+bwd.

Cases (batch 1, bf16, causal):
  gqa128:   32 query heads, 8 K/V heads, head_dim 128, seq 2048 / 8192 / 32768.
  gemma256: 16 query heads, 8 K/V heads, head_dim 256, scale 256**-0.5; plain, softcap 50,
            window 4096, softcap + window (the window passed as a traced value, as in the
            model's layer scan).
Implementations: "mosaic" (ours), "cudnn" (jax.nn.dot_product_attention, when it can express
the variant), "xla" (jax.nn.dot_product_attention's XLA version, or our jnp reference for
softcap; skipped where its [T, T] float32 scores would not fit).

Before timing, each case is checked against the float32 reference at seq 2048 (output and
dq, dk, dv, relative error), and a padded, packed (segment ids) shape is checked per head dim.
Times are medians over repeats of a loop of calls (block_until_ready after each loop, warm).

  python experiments/bench_attention.py --results-dir $OUT
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from experiments.record import record  # noqa: E402
from pallas_kernels.flash_attention import kernel, kernel_backward, ops, reference  # noqa: E402

CASES = {
  "gqa128": dict(heads=32, kv_heads=8, head_dim=128, scale=None),
  "gemma256": dict(heads=16, kv_heads=8, head_dim=256, scale=256**-0.5),
}
VARIANTS = {
  "gqa128": {"plain": {}},
  "gemma256": {
    "plain": {},
    "softcap": {"softcap": 50.0},
    "window": {"window": 4096},
    "softcap+window": {"softcap": 50.0, "window": 4096},
  },
}
XLA_SCORE_BYTES = 12e9  # skip XLA past this size of one float32 [B, N, T, T] tensor
MOSAIC = "mosaic"  # "interpret" with --interpret: a CPU smoke test of this script


def attention_fn(impl, case, variant):
  """-> f(q, k, v, window) for one implementation, or None where it cannot do the variant."""
  scale = case["scale"] or case["head_dim"] ** -0.5
  softcap = variant.get("softcap")
  windowed = "window" in variant
  if impl == "mosaic":
    blocks = kernel.Blocks.for_head_dim(case["head_dim"])
    return lambda q, k, v, w: ops.flash_attention(
      q, k, v, window=w if windowed else 0, softcap=softcap, scale=scale, implementation=MOSAIC,
      blocks=blocks,
    )  # fmt: skip
  if softcap is not None and impl == "cudnn":
    return None
  if impl == "cudnn" or (impl == "xla" and softcap is None):
    local = (variant["window"] - 1, 0) if windowed else None
    return lambda q, k, v, w: jax.nn.dot_product_attention(
      q, k, v, scale=scale, is_causal=True, local_window_size=local, implementation=impl
    )
  return reference_fn(case, variant)


def reference_fn(case, variant):
  scale = case["scale"] or case["head_dim"] ** -0.5
  window = "window" in variant
  return lambda q, k, v, w: reference.attention(
    q, k, v, window=w if window else 0, softcap=variant.get("softcap"), scale=scale
  )


def inputs(case, batch, seq, seed=0):
  ks = jax.random.split(jax.random.key(seed), 4)
  n, kv, h = case["heads"], case["kv_heads"], case["head_dim"]
  q = jax.random.normal(ks[0], (batch, seq, n, h), jnp.bfloat16)
  k = jax.random.normal(ks[1], (batch, seq, kv, h), jnp.bfloat16)
  v = jax.random.normal(ks[2], (batch, seq, kv, h), jnp.bfloat16)
  do = jax.random.normal(ks[3], (batch, seq, n, h), jnp.bfloat16)
  return q, k, v, do


def fwd_and_grad(f):
  fwd = jax.jit(f)

  @jax.jit
  def fwd_bwd(q, k, v, w, do):
    out, vjp = jax.vjp(lambda q, k, v: f(q, k, v, w), q, k, v)
    return out, *vjp(do)

  return fwd, fwd_bwd


def timed(f, *args, reps=10, min_loop_s=0.01):
  jax.block_until_ready(f(*args))  # compile and warm up
  t = time.perf_counter()
  jax.block_until_ready(f(*args))
  loop = max(1, int(min_loop_s / max(time.perf_counter() - t, 1e-6)))
  times = []
  for _ in range(reps):
    t = time.perf_counter()
    for _ in range(loop):
      out = f(*args)
    jax.block_until_ready(out)
    times.append((time.perf_counter() - t) / loop)
  return statistics.median(times)


def rel_err(x, ref):
  x, ref = x.astype(jnp.float32), ref.astype(jnp.float32)
  return float(jnp.linalg.norm(x - ref) / jnp.linalg.norm(ref))


def check(f, ref_f, q, k, v, w, do):
  """Max relative error of (out, dq, dk, dv) against the float32 reference."""
  _, fb = fwd_and_grad(f)
  up = lambda x: x.astype(jnp.float32)
  _, rb = fwd_and_grad(lambda q, k, v, w: ref_f(up(q), up(k), up(v), w))
  got = fb(q, k, v, w, do)
  want = rb(q, k, v, w, up(do))
  return max(rel_err(a, b) for a, b in zip(got, want, strict=True))


def visible_pairs(seq, window):
  """Query-key pairs a causal (windowed) attention computes."""
  if not window or window >= seq:
    return seq * (seq + 1) // 2
  return window * (window + 1) // 2 + (seq - window) * window


def temp_gib(f, *args):
  try:
    return f.lower(*args).compile().memory_analysis().temp_size_in_bytes / 2**30
  except Exception:  # noqa: BLE001  (memory analysis is optional on some backends)
    return None


def matmul_tflops(n=8192):
  a = jax.random.normal(jax.random.key(1), (n, n), jnp.bfloat16)
  b = jax.random.normal(jax.random.key(2), (n, n), jnp.bfloat16)
  return 2 * n**3 / timed(jax.jit(jnp.dot), a, b) / 1e12


def packed_checks(lengths=(1000,)):
  """GPU lowering of the paths the timed cases skip: segments, padding (T % 128), GQA 4:1."""
  out = []
  for h in (64, 128, 256):
    case = dict(heads=8, kv_heads=2, head_dim=h, scale=0.1)
    (t,) = lengths
    q, k, v, do = inputs(case, 2, t, seed=h)
    seg = jnp.sort(jax.random.randint(jax.random.key(h), (2, t), 0, 5), axis=1)
    for kw in ({}, {"softcap": 20.0, "window": 300}):
      blocks = kernel.Blocks.for_head_dim(h)
      f = lambda q, k, v, w, kw=kw, seg=seg, blocks=blocks: ops.flash_attention(
        q, k, v, segment_ids=seg, window=w if "window" in kw else 0,
        softcap=kw.get("softcap"), scale=0.1, implementation=MOSAIC, blocks=blocks,
      )  # fmt: skip
      r = lambda q, k, v, w, kw=kw, seg=seg: reference.attention(
        q, k, v, segment_ids=seg, window=w if "window" in kw else 0,
        softcap=kw.get("softcap"), scale=0.1,
      )  # fmt: skip
      w = jnp.int32(kw.get("window", 0))
      try:
        err = check(f, r, q, k, v, w, do)
      except Exception as e:  # noqa: BLE001  (report and go on to the timings)
        print(f"FAILED check head_dim {h} packed {kw}: {str(e)[:3000]}", flush=True)
        err = float("nan")
      out.append((h, "+".join(["seg", *kw]), err))
      print(f"check head_dim {h} T={t} packed {kw}: max rel err {err:.2e}", flush=True)
  return out


SWEEP = [
  kernel.Blocks(),
  kernel.Blocks(defer_dk=False),
  kernel.Blocks(dq_kv=128),
  kernel.Blocks(dkv_stages=3),
]


def sweep(batch, seq, results_dir):
  """gqa128 Mosaic times per block choice, split into forward, dQ and dK/dV kernels.

  Each kernel is timed alone on the same inputs (the backward ones on the forward's lse and
  delta), next to cuDNN's forward and forward+backward in the same run.
  """
  case = CASES["gqa128"]
  q, k, v, do = inputs(case, batch, seq)
  w = jnp.int32(0)
  scale = case["head_dim"] ** -0.5
  rows = []
  cud_f, cud_fb = fwd_and_grad(attention_fn("cudnn", case, VARIANTS["gqa128"]["plain"]))
  cudnn = {"fwd": timed(cud_f, q, k, v, w), "fwd_bwd": timed(cud_fb, q, k, v, w, do)}
  print(f"sweep cudnn seq {seq}: fwd {cudnn['fwd'] * 1e3:.3f} ms, "
        f"fwd+bwd {cudnn['fwd_bwd'] * 1e3:.3f} ms", flush=True)  # fmt: skip
  opts = kernel.Options(seq_len=seq, scale=scale)
  # The kernels' segment arguments when there are none (never read): ids and their summaries
  # for queries and keys, then the spans.
  unread = (*(jnp.zeros((1, 16), jnp.int32),) * 4, jnp.zeros((1, 2, 16), jnp.int32))
  win = jnp.zeros((1,), jnp.int32)
  for blocks in SWEEP:
    f = lambda q, k, v, w, b=blocks: ops.flash_attention(
      q, k, v, scale=scale, implementation=MOSAIC, blocks=b
    )
    fwd, fwd_bwd = fwd_and_grad(f)
    try:
      row = {"seq": seq, "blocks": str(blocks).removeprefix("Blocks")}
      row["fwd_ms"] = timed(fwd, q, k, v, w) * 1e3
      row["fwd_bwd_ms"] = timed(fwd_bwd, q, k, v, w, do) * 1e3
      out, lse = jax.jit(lambda q, k, v, b=blocks: kernel.forward(
        q, k, v, *unread, win, opts, b, None))(q, k, v)  # fmt: skip
      delta_f = jax.jit(lambda o, d: jnp.einsum(
        "btnh,btnh->bnt", o.astype(jnp.float32), d.astype(jnp.float32)))  # fmt: skip
      delta = delta_f(out, do)
      row["delta_ms"] = timed(delta_f, out, do) * 1e3
      bargs = (q, k, v, do, lse, delta)
      rest = (*unread, win, opts, blocks, None)
      dq_f = jax.jit(lambda *a, r=rest: kernel_backward.backward_dq(*a, *r))
      row["dq_ms"] = timed(dq_f, *bargs) * 1e3
      dkv_f = jax.jit(lambda *a, r=rest: kernel_backward.backward_dkv(*a, *r))
      row["dkv_ms"] = timed(dkv_f, *bargs) * 1e3
      row["vs_cudnn_fwd"] = cudnn["fwd"] * 1e3 / row["fwd_ms"]
      row["vs_cudnn_fwd_bwd"] = cudnn["fwd_bwd"] * 1e3 / row["fwd_bwd_ms"]
      print("sweep", {k_: (round(x, 4) if isinstance(x, float) else x) for k_, x in row.items()},
            flush=True)  # fmt: skip
      rows.append(row)
      if results_dir:
        with open(Path(results_dir) / "attention_partial.jsonl", "a") as fh:
          fh.write(json.dumps(row) + "\n")
    except Exception as e:  # noqa: BLE001
      print(f"sweep FAILED {blocks}: {str(e)[:1500]}", flush=True)
  if rows:
    record(
      "bench_attention_sweep",
      rows,
      f"Flash attention block sweep, gqa128 (32 q / 8 kv heads, head_dim 128), causal, seq {seq}",
      note=f"cuDNN in the same run: fwd {cudnn['fwd'] * 1e3:.3f} ms, fwd+bwd "
      f"{cudnn['fwd_bwd'] * 1e3:.3f} ms. dq_ms, dkv_ms, delta_ms: each kernel timed alone.",
      out_dir=results_dir,
    )


def main():
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  ap.add_argument("--seqs", default="2048,8192,32768")
  ap.add_argument("--batch", type=int, default=1)
  ap.add_argument("--cases", default="gqa128,gemma256")
  ap.add_argument("--impls", default="mosaic,cudnn,xla")
  ap.add_argument("--no-checks", action="store_true")
  ap.add_argument("--sweep", action="store_true", help="also time a few block-size choices")
  ap.add_argument("--sweep-only", action="store_true", help="only the block sweep")
  ap.add_argument("--results-dir", default=None)
  ap.add_argument("--interpret", action="store_true", help="CPU smoke test (interpret mode)")
  args = ap.parse_args()
  global MOSAIC
  if args.interpret:
    MOSAIC = "interpret"
  seqs = [int(s) for s in args.seqs.split(",")]
  impls = args.impls.split(",")
  print(jax.devices()[0].device_kind, "jax", jax.__version__, flush=True)
  peak = matmul_tflops(256 if args.interpret else 8192)
  print(f"bf16 matmul 8192^3: {peak:.0f} TFLOP/s", flush=True)

  if args.sweep_only:
    sweep(args.batch, 8192, args.results_dir)
    return
  checks = [] if args.no_checks else packed_checks((200,) if args.interpret else (1000,))
  rows = []
  for case_name in args.cases.split(","):
    case = CASES[case_name]
    for var_name, variant in VARIANTS[case_name].items():
      errs = {}
      for impl in ("mosaic",):
        f = attention_fn(impl, case, variant)
        if args.no_checks or impl not in impls or f is None:
          continue
        q, k, v, do = inputs(case, 1, 256 if args.interpret else 2048, seed=7)
        w = jnp.int32(variant.get("window", 0))
        try:
          errs[impl] = check(f, reference_fn(case, variant), q, k, v, w, do)
        except Exception as e:  # noqa: BLE001  (report and go on to the timings)
          print(f"FAILED check {impl} {case_name} {var_name}: {str(e)[:3000]}", flush=True)
          errs[impl] = float("nan")
        print(f"check {impl} {case_name} {var_name} seq 2048: max rel err {errs[impl]:.2e}")
      for seq in seqs:
        q, k, v, do = inputs(case, args.batch, seq)
        w = jnp.int32(variant.get("window", 0))
        n, h = case["heads"], case["head_dim"]
        flops = 4 * args.batch * n * h * visible_pairs(seq, variant.get("window"))
        for impl in impls:
          f = attention_fn(impl, case, variant)
          if f is None:
            continue
          if impl == "xla" and args.batch * n * seq * seq * 4 > XLA_SCORE_BYTES:
            print(f"skip xla {case_name} {var_name} seq {seq}: [T, T] scores too large")
            continue
          fwd, fwd_bwd = fwd_and_grad(f)
          try:
            t_f = timed(fwd, q, k, v, w)
            t_fb = timed(fwd_bwd, q, k, v, w, do)
          except Exception as e:  # noqa: BLE001  (one impl failing must not lose the run)
            print(f"FAILED {impl} {case_name} {var_name} seq {seq}: {str(e)[:2000]}", flush=True)
            continue
          row = {
            "case": case_name,
            "variant": var_name,
            "impl": impl,
            "seq": seq,
            "batch": args.batch,
            "heads": n,
            "kv_heads": case["kv_heads"],
            "head_dim": h,
            "fwd_ms": t_f * 1e3,
            "fwd_bwd_ms": t_fb * 1e3,
            "fwd_tflops": flops / t_f / 1e12,
            "fwd_bwd_tflops": 3.5 * flops / t_fb / 1e12,
            "temp_gib": temp_gib(fwd_bwd, q, k, v, w, do),
            "check_rel_err": errs.get(impl),
          }
          rows.append(row)
          print({k_: (round(x, 4) if isinstance(x, float) else x) for k_, x in row.items()})
          if args.results_dir:  # a run cut short by its time limit keeps what it measured
            with open(Path(args.results_dir) / "attention_partial.jsonl", "a") as fh:
              fh.write(json.dumps(row) + "\n")

  def find(r, impl=None, variant=None):
    for o in rows:
      if (o["case"], o["seq"]) == (r["case"], r["seq"]) and o["impl"] == (impl or r["impl"]):
        if o["variant"] == (variant or r["variant"]):
          return o
    return None

  for r in rows:
    for other in ("cudnn", "xla"):
      o = find(r, impl=other)
      for key in ("fwd", "fwd_bwd"):
        r[f"speedup_vs_{other}_{key}"] = o[f"{key}_ms"] / r[f"{key}_ms"] if o else None
    plain = find(r, variant="plain")
    r["time_vs_plain_fwd_bwd"] = r["fwd_bwd_ms"] / plain["fwd_bwd_ms"] if plain else None

  note = (
    f"bf16 matmul in the same run: {peak:.0f} TFLOP/s. speedup_vs_X = X's time / this time "
    "(> 1: faster than X). TFLOP/s count causal (windowed) pairs only, fwd+bwd as 3.5x fwd. "
    f"temp_gib: XLA's temp allocation for fwd+bwd. Blocks: {kernel.Blocks()} (head_dim <= 128), "
    f"{kernel.Blocks.for_head_dim(256)} (256)."
  )
  if checks:
    note += " Packed/padded GPU checks (max rel err of out, dq, dk, dv vs f32 reference): " + (
      ", ".join(f"h{h} {name} {e:.1e}" for h, name, e in checks)
    )
  if rows:
    record(
      "bench_attention",
      rows,
      "Flash attention (Mosaic GPU) vs cuDNN and XLA",
      note=note,
      out_dir=args.results_dir,
    )
  print(f"\n{jax.devices()[0].device_kind}, jax {jax.__version__}; matmul {peak:.0f} TFLOP/s")
  print("| case | variant | seq | impl | fwd ms | fwd+bwd ms | fwd+bwd TFLOP/s | "
        "vs cuDNN fwd | vs cuDNN f+b | vs XLA f+b | vs plain f+b |")  # fmt: skip
  print("|---|---|---|---|---|---|---|---|---|---|---|")
  fmt = lambda x: "-" if x is None else f"{x:.2f}"
  for r in rows:
    print(
      f"| {r['case']} | {r['variant']} | {r['seq']} | {r['impl']} | {r['fwd_ms']:.3f} | "
      f"{r['fwd_bwd_ms']:.3f} | {r['fwd_bwd_tflops']:.0f} | {fmt(r['speedup_vs_cudnn_fwd'])} | "
      f"{fmt(r['speedup_vs_cudnn_fwd_bwd'])} | {fmt(r['speedup_vs_xla_fwd_bwd'])} | "
      f"{fmt(r['time_vs_plain_fwd_bwd'])} |"
    )
  if args.sweep:  # last: recorded rows are safe whatever happens here
    sweep(args.batch, 8192, args.results_dir)


if __name__ == "__main__":
  main()
