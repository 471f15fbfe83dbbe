"""Decoding's split-K sum inside the kernel (``Config.cluster_sum``) against XLA's sum of the
kernel's float32 partials, on the 8B launches that split K, at M = 1 and 16: the two outputs
(and the float32 reference), and the device time of the whole op (kernel plus XLA's sum and
transpose where there is one), each call over weight copies that outgrow L2.

  python experiments/check_cluster_sum.py
"""

import dataclasses
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from experiments.bench_nf4_matmul import kernel_breakdown, rel_err, time_per_call, weights  # noqa: E402
from pallas_kernels.nf4_matmul import kernel, kernel_scales, ops, reference  # noqa: E402


def main():
  rng = np.random.default_rng(0)
  rows = []
  for k, n in ((4096, 6144), (4096, 4096), (14336, 4096)):
    copies = max(2, -(-64 * 2**20 // (k * n // 2)))
    qs, _ = weights(rng, k, n, copies)
    ops_ = [(kernel.word_codes(q[0]), kernel_scales(*q[1:])) for q in qs]
    for m in (1, 16):
      x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
      ref = np.asarray(reference.nf4_matmul_reference(x, *qs[0]))
      cfg = ops._forward_config(m, n, k, False)
      outs = {}
      for summed in (False, True):
        c = dataclasses.replace(cfg, cluster_sum=summed)

        def op(x, w, c=c):
          word, scales = w
          y = kernel.forward(ops._pad_rows(x, c.block_m), word, scales, config=c, lookup="word")
          return y[: x.shape[0]]

        f = jax.jit(op)
        y = np.asarray(f(x, ops_[0]).astype(jnp.float32))
        outs[summed] = y
        ms = time_per_call(f, x, ops_, 20)
        print(
          f"M={m} K={k} N={n} split={c.split_k} wgs={c.compute_wgs} cluster_sum={summed}: "
          f"{ms * 1e3:.1f} us, rel err {rel_err(jnp.asarray(y), ref):.2e}; "
          f"{kernel_breakdown(f, (x, ops_[0]))}",
          flush=True,
        )
        rows.append((m, k, n, c.split_k, summed, ms * 1e3))
      d = np.abs(outs[True] - outs[False])
      print(
        f"  summed vs partials: max |diff| {d.max():.3g}, differing {np.mean(d > 0):.4f}",
        flush=True,
      )
  print(
    "\n| M | K | N | split | XLA sum us | in-kernel sum us | ratio |\n|---|---|---|---|---|---|---|"
  )
  for i in range(0, len(rows), 2):
    a, b = rows[i], rows[i + 1]
    print(f"| {a[0]} | {a[1]} | {a[2]} | {a[3]} | {a[5]:.1f} | {b[5]:.1f} | {b[5] / a[5]:.3f} |")


if __name__ == "__main__":
  main()
