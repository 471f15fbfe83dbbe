"""The NF4 kernels' configurations at training sizes, against cuBLAS bf16 and XLA in one run.

For M in --ms and (K, N) of Llama-3.1-8B's projections, times the forward y = x @ W^T and the
input gradient dx = dy @ W: cuBLAS on a bf16 copy of W, XLA's dequantize-then-dot on the NF4
weight (what training runs today), and the Mosaic GPU kernels over a grid of configurations:
lookups (--lookups; "word" reads codes permuted once, ``kernel.word_codes``), tokens per tile
(--bms), pipeline stages (--stages), 64-wide k blocks per step (--subs), wgmmas left in
flight across steps (--delays), and the output stored as y or as y^T for XLA to transpose
(--out-rows; in chunks of tokens: --out-chunks), and the order the grid walks its tiles
(--groups). The kernel rows include that transpose, so every row is one op's time. --bwd-rs
also times the input gradient as the forward kernel on W^T's codes over the same grid; --ops
the op as training calls it; --extra the forward op with a LoRA pair, in the kernel or added
after, against XLA's one folded dot.
Device time (CUPTI), each call over weight copies that outgrow L2, median of --reps. Checks
each configuration against the float32 reference. One line per configuration, a table last.

  python experiments/sweep_nf4_train.py --results-dir $OUT
"""

import argparse
import dataclasses
import functools
import itertools
import sys
import traceback
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from experiments.bench_nf4_matmul import rel_err, time_per_call, weights  # noqa: E402
from experiments.record import record  # noqa: E402
from pallas_kernels import nf4  # noqa: E402
from pallas_kernels.nf4_matmul import kernel, kernel_scales, ops, reference  # noqa: E402


def _ints(text):
  return [int(v) for v in text.split(",")]


def main():
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  ap.add_argument("--ms", default="4096")
  ap.add_argument("--shapes", default="4096x4096,4096x14336,14336x4096", help="KxN,...")
  ap.add_argument("--reps", type=int, default=5)
  ap.add_argument("--lookups", default="prmt,word")
  ap.add_argument("--bms", default="256")
  ap.add_argument("--stages", default="4")
  ap.add_argument("--subs", default="1")
  ap.add_argument("--delays", default="0", help="1 is refused beyond 16 tokens")
  ap.add_argument("--out-rows", default="0,1")
  ap.add_argument("--groups", default="1", help="Config.group_m: tile rows a grid group walks")
  ap.add_argument("--out-chunks", default="0", help="Config.out_chunk: tokens stored at a time")
  ap.add_argument("--bwd", default="256x64x64,128x64x128",
                  help="backward tiles bm x bn x bko,... ('' for none)")  # fmt: skip
  ap.add_argument("--bwd-stages", default="4")
  ap.add_argument(
    "--ops", action="store_true",
    help="also time the op as training calls it (dispatch's configuration, codes permuted "
    "per call) with impl kernel and xla",
  )  # fmt: skip
  ap.add_argument(
    "--bwd-rs", action="store_true",
    help="also time the input gradient as the forward kernel on W^T's codes (Config.transposed:"
    " W^T from registers) over the forward's grid, the codes transposed and permuted once",
  )  # fmt: skip
  ap.add_argument(
    "--extra", type=int, default=0,
    help="also time the forward op with a LoRA's extra pair of this rank (x A, B^T) on operands "
    "made once: the kernel taking it in (one more wgmma a tile), the kernel with its product "
    "added after, and XLA's one folded dot",
  )  # fmt: skip
  ap.add_argument("--results-dir", default=None)
  args = ap.parse_args()
  rng = np.random.default_rng(0)
  rows = []
  shapes = [tuple(int(v) for v in kn.split("x")) for kn in args.shapes.split(",")]
  for (k, n), m in itertools.product(shapes, _ints(args.ms)):
    copies = max(2, -(-64 * 2**20 // (k * n // 2)))
    qs, dense = weights(rng, k, n, copies)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    dy = jnp.asarray(rng.standard_normal((m, n)), jnp.bfloat16)
    ref = np.asarray(reference.nf4_matmul_reference(x, *qs[0]))
    w32 = np.asarray(nf4.dequantize_linear(*qs[0], jnp.float32))
    ref_dx = np.asarray(dy, np.float32) @ w32
    base = {
      "fwd_bf16": time_per_call(jax.jit(lambda a, w: a @ w.T), x, dense, args.reps),
      "fwd_xla": time_per_call(
        jax.jit(lambda a, q: reference.dequantize_then_dot(a, *q)), x, qs, args.reps
      ),
      "bwd_bf16": time_per_call(jax.jit(lambda g, w: g @ w), dy, dense, args.reps),
      "bwd_xla": time_per_call(
        jax.jit(lambda g, q: reference.dequantize_then_dot_t(g, *q)), dy, qs, args.reps
      ),
    }
    print(f"M={m} K={k} N={n} " + " ".join(f"{a} {b * 1e3:.1f}us" for a, b in base.items()))
    if args.ops:
      for which, a, want in (("fwd", x, ref), ("bwd", dy, ref_dx)):
        for impl in ("kernel", "xla"):
          if which == "fwd":
            f = jax.jit(functools.partial(ops._fwd_impl, impl, None))
          else:
            f = jax.jit(functools.partial(ops._bwd_impl, impl))
          _run(rows, which, m, k, n, "op", impl, base, f, a, [(q,) for q in qs], want, args.reps)
    if args.extra:
      _extra_rows(rows, args, rng, m, k, n, qs, x, ref, base)
    if args.bwd_rs:  # the op's own (--ops) is dispatch's configuration
      made = [ops.training_operands(*q)[1:] for q in qs]  # W^T's word codes, the scales
      made = [(kernel.kernel_codes(w, swap_nibbles=False), s) for w, s in made]
      for lookup in _word_order(args.lookups.split(",")):
        for cfg in _forward_grid(args, m, lookup):
          cfg = dataclasses.replace(cfg, transposed=True)
          f = jax.jit(functools.partial(kernel.forward, config=cfg, lookup=lookup))
          _run(rows, "bwd", m, k, n, lookup, cfg, base, f, dy, made, ref_dx, args.reps)
    for lookup in args.lookups.split(","):
      if lookup in _word_order([lookup]):
        ops_ = [(kernel.word_codes(q[0]), kernel_scales(*q[1:])) for q in qs]
      else:
        ops_ = [(kernel.kernel_codes(q[0], swap_nibbles=False), kernel_scales(*q[1:])) for q in qs]
      for cfg in _forward_grid(args, m, lookup):
        f = jax.jit(functools.partial(kernel.forward, config=cfg, lookup=lookup))
        _run(rows, "fwd", m, k, n, lookup, cfg, base, f, x, ops_, ref, args.reps)
      # The backward kernel reads no table.
      tiles = args.bwd.split(",") if args.bwd and lookup not in kernel.TABLE_LOOKUPS else []
      for tile, stages in itertools.product(tiles, _ints(args.bwd_stages)):
        bm, bn, bko = (int(v) for v in tile.split("x"))
        cfg = kernel.Config(
          block_m=bm, block_n=bn, block_k_out=bko, compute_wgs=2, max_concurrent_steps=stages
        )
        if m % bm or n % bn or k % (2 * bko):
          continue
        f = jax.jit(functools.partial(kernel.backward, config=cfg, lookup=lookup))
        _run(rows, "bwd", m, k, n, lookup, cfg, base, f, dy, ops_, ref_dx, args.reps)
  record(
    "sweep_nf4_train",
    rows,
    "The NF4 kernels' configurations at training sizes (8B shapes)",
    note="Device time per call over weight copies that outgrow L2 (CUPTI, median); bf16 = "
    "cuBLAS on a bf16 copy of W, xla = XLA's dequantize-then-dot, both in the same run; the "
    "kernel's time includes XLA's transpose of y^T where out_rows is off.",
    out_dir=args.results_dir,
  )
  print("\n| pass | M | K | N | lookup | config | kernel/bf16 | xla/bf16 |")
  for r in rows:
    print(
      f"| {r['pass']} | {r['M']} | {r['K']} | {r['N']} | {r['lookup']} | {r['config']} | "
      f"{r['kernel_vs_bf16']:.3f} | {r['xla_vs_bf16']:.3f} |"
    )


def _extra_rows(rows, args, rng, m, k, n, qs, x, ref, base):
  """The forward op with a LoRA's extra pair (--extra) on operands made once for the run: the
  kernel taking it in, the kernel with its product added after, XLA's one folded dot."""
  ex = jnp.asarray(rng.standard_normal((m, args.extra)) * 0.1, jnp.bfloat16)
  ew = jnp.asarray(rng.standard_normal((n, args.extra)) * 0.1, jnp.float32)
  want = ref + np.asarray(ex, np.float32) @ np.asarray(ew.astype(jnp.bfloat16), np.float32).T
  made = [(q, *ops.training_operands(*q)[::2], ex, ew) for q in qs]  # W's word codes, scales
  cfg = ops._forward_config(m, n, k, interpret=False)

  def in_kernel(a, q, word, scales, ex, ew):
    return ops._fwd_impl("kernel", "plut", a, q, scales, word, (ex, ew))

  def added(a, q, word, scales, ex, ew):
    y = ops._forward_kernel("kernel", "plut", a, cfg, scales, word=word)
    return y + jnp.einsum("te,ne->tn", ex, ew.astype(ex.dtype)).astype(y.dtype)

  def xla(a, q, word, scales, ex, ew):
    return ops._fwd_impl("xla", None, a, q, extra=(ex, ew))

  for name, f in (("extra in kernel", in_kernel), ("extra added", added), ("xla", xla)):
    label = f"op r{args.extra}"
    _run(rows, "fwd", m, k, n, label, name, base, jax.jit(f), x, made, want, args.reps)


def _word_order(lookups):
  """The lookups that read codes in word order (``kernel.word_codes``): the transposed rows'."""
  return [lu for lu in lookups if lu in ops.WORD_ORDER]


def _forward_grid(args, m, lookup):
  """The forward kernel's configurations of the sweep that tile M and fit in shared memory
  beside ``lookup``'s table."""
  grid = itertools.product(
    _ints(args.bms), _ints(args.stages), _ints(args.subs), _ints(args.delays),
    _ints(args.out_rows), _ints(args.groups), _ints(args.out_chunks),
  )  # fmt: skip
  for bm, stages, sub, delay, out_rows, group, chunk in grid:
    if chunk and (not out_rows or chunk >= bm):
      continue
    cfg = kernel.Config(
      block_m=bm, compute_wgs=2, k_sub=sub, max_concurrent_steps=stages,
      delay_release=delay, out_rows=bool(out_rows), group_m=group, out_chunk=chunk,
    )  # fmt: skip
    smem = kernel.forward_smem_bytes(cfg, lookup=lookup)
    if m % (bm * group) == 0 and smem <= kernel.SMEM_BYTES:
      yield cfg


def _run(rows, which, m, k, n, lookup, cfg, base, f, a, operands, ref, reps):
  if isinstance(cfg, str):
    desc = f"op impl={cfg}"
  elif which == "fwd" or cfg.transposed:
    desc = (
      f"{'rs ' if cfg.transposed else ''}bm{cfg.block_m} st{cfg.max_concurrent_steps} "
      f"sub{cfg.k_sub} d{cfg.delay_release} rows{int(cfg.out_rows)} g{cfg.group_m}"
      + (f" c{cfg.out_chunk}" if cfg.out_chunk else "")
    )
  else:
    desc = f"{cfg.block_m}x{cfg.block_n}x{cfg.block_k_out} st{cfg.max_concurrent_steps}"
  try:
    err = rel_err(f(a, *operands[0]), ref)
    ms = time_per_call(lambda a, w, f=f: f(a, *w), a, operands, reps)
  except Exception:  # a configuration that does not lower is reported and skipped
    traceback.print_exc(limit=2)
    return
  bf16, xla = base[f"{which}_bf16"], base[f"{which}_xla"]
  row = {
    "pass": which, "M": m, "K": k, "N": n, "lookup": lookup, "config": desc, "err": err,
    "kernel_ms": ms, "bf16_ms": bf16, "xla_ms": xla, "kernel_vs_bf16": ms / bf16,
    "xla_vs_bf16": xla / bf16,
  }  # fmt: skip
  rows.append(row)
  print(
    f"M={m} K={k} N={n} {which} {lookup} {desc}: {ms * 1e3:.1f} us = {ms / bf16:.3f}x bf16, "
    f"xla {xla / bf16:.3f}x, err {err:.1e}",
    flush=True,
  )


if __name__ == "__main__":
  main()
