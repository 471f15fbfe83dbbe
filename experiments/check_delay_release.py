"""Are decoding's wgmmas left in flight across pipeline steps (``Config.delay_release``) exact?

At 256-token tiles they gave non-finite sums on an H100 (session 16), and the review of that
run pointed at the register operand: the next step's dequantized tile is made while the last
step's wgmma may still read its registers. Decoding's tiles (at most 16 tokens) are dispatched
with them. Both configurations accumulate the same products in the same order, so their
outputs must be bit-identical: this runs dispatch's configuration and the same one without
wgmmas in flight on --rounds random inputs per shape (each round --calls launches in one
program, back to back, over weight copies) and counts the outputs that differ in any bit or
are not finite. Exit status 1 if any does.

  PYTHONPATH=. python experiments/check_delay_release.py
"""

import argparse
import dataclasses
import functools
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from experiments.bench_nf4_matmul import weights  # noqa: E402
from pallas_kernels.nf4_matmul import kernel, kernel_scales, ops  # noqa: E402

# Llama 3.1 8B's decoding launches (K, N): fused q/k/v, o, fused gate/up, down.
SHAPES = [(4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096)]


def main():
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  ap.add_argument("--ms", default="1,8,16")
  ap.add_argument("--rounds", type=int, default=20)
  ap.add_argument("--calls", type=int, default=8)
  args = ap.parse_args()
  rng = np.random.default_rng(0)
  bad = 0
  for (k, n), m in ((s, int(m)) for s in SHAPES for m in args.ms.split(",")):
    cfg = ops._forward_config(m, n, k, interpret=False)
    if not cfg.delay_release:
      print(f"M={m} K={k} N={n}: dispatch leaves nothing in flight, skipped")
      continue
    qs, _ = weights(rng, k, n, args.calls)
    operands = [(kernel.word_codes(q[0]), kernel_scales(*q[1:])) for q in qs]
    rows = dataclasses.replace(cfg, delay_release=0)

    def launches(x, operands, config):
      pad = -x.shape[0] % config.block_m
      xp = jnp.pad(x, ((0, pad), (0, 0)))
      f = functools.partial(kernel.forward, config=config, lookup="word")
      return jnp.stack([f(xp, w, s)[: x.shape[0]] for w, s in operands])

    held = jax.jit(functools.partial(launches, config=cfg))
    plain = jax.jit(functools.partial(launches, config=rows))
    differ = nonfinite = 0
    for _ in range(args.rounds):
      x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
      a, b = np.asarray(held(x, operands)), np.asarray(plain(x, operands))
      differ += int(np.sum(np.any(a.view(np.uint16) != b.view(np.uint16), axis=(1, 2))))
      nonfinite += int(np.sum(~np.all(np.isfinite(a.astype(np.float32)), axis=(1, 2))))
    total = args.rounds * args.calls
    bad += differ + nonfinite
    print(
      f"M={m} K={k} N={n} {cfg}: {differ} of {total} outputs differ from delay_release 0, "
      f"{nonfinite} not finite",
      flush=True,
    )
  print("FAIL" if bad else "PASS: every output bit-identical")
  sys.exit(1 if bad else 0)


if __name__ == "__main__":
  main()
