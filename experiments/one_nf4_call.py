"""One NF4 forward kernel call at dispatch's configuration, run a few times: a target for
Nsight Compute (the instruction mix and stall reasons of the decode kernel).

  ncu --kernel-name regex:mosaic --launch-skip 2 --launch-count 1 --section SourceCounters \\
      --section SchedulerStats -o /tmp/rep python experiments/one_nf4_call.py 4096 28672 16 lut
  ncu -i /tmp/rep.ncu-rep --page source --print-source sass --csv > sass.csv

Arguments: K N M [LOOKUP (word, lut, plut, prmt; default word)] [BLOCK_M (default dispatch's)].
"""

import dataclasses
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from experiments.bench_nf4_matmul import weights  # noqa: E402
from pallas_kernels.nf4_matmul import kernel, kernel_scales, ops  # noqa: E402


def main():
  k, n, m = (int(v) for v in sys.argv[1:4])
  lookup = sys.argv[4] if len(sys.argv) > 4 else "word"
  cfg = ops._forward_config(m, n, k, False)
  if len(sys.argv) > 5:  # a padded tile (one token: as dispatched before session 28)
    cfg = dataclasses.replace(ops._forward_config(max(m, 2), n, k, False), block_m=int(sys.argv[5]))
  print(cfg, lookup, flush=True)
  rng = np.random.default_rng(0)
  (q,), _ = weights(rng, k, n, 1)
  codes = (
    kernel.word_codes(q[0])
    if lookup in ops.WORD_ORDER
    else kernel.kernel_codes(q[0], swap_nibbles=False)
  )
  scales = kernel_scales(*q[1:])
  x = ops._kernel_input(jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16), cfg)
  f = jax.jit(lambda a, w, s: kernel.forward(a, w, s, config=cfg, lookup=lookup))
  for _ in range(4):
    jax.block_until_ready(f(x, codes, scales))


if __name__ == "__main__":
  main()
