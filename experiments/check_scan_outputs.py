"""Does a scan's stacked output start from written zeros? (plan.scan_outputs_unwritten)

A 32-step scan over a carry [4096, 4096] whose body saves three same-shape values for its
gradient (so the stacks are residuals, as in a training step). For each way of making the
stacks ("zeros": JAX's broadcast; "empty": jax.lax.empty, i.e. XLA's AllocateBuffer), the
compiled HLO's counts of broadcasts, copies and AllocateBuffer calls, the median time of
the call, and whether its outputs equal the first run's.

  python experiments/check_scan_outputs.py
"""

import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jaxtune.training import plan  # noqa: E402

L, N = (4, 256) if jax.default_backend() == "cpu" else (32, 4096)


def loss(w, x):
  def body(h, wi):
    a = jnp.tanh(h @ wi)
    b = jnp.sin(a) * h
    c = a * b
    return c.astype(h.dtype), None

  body = jax.checkpoint(body, policy=jax.checkpoint_policies.everything_saveable)
  h, _ = jax.lax.scan(body, x, w)
  return jnp.sum(h.astype(jnp.float32))


def main():
  kw, kx = jax.random.split(jax.random.key(0))
  w = (jax.random.normal(kw, (L, N, N), jnp.float32) * N**-0.5).astype(jnp.bfloat16)
  x = jax.random.normal(kx, (N, N), jnp.bfloat16)
  rows, ref = [], None
  for kind in ("zeros", "empty", "zeros", "empty"):
    with plan.scan_outputs_unwritten(kind == "empty"):
      f = jax.jit(jax.value_and_grad(loss)).lower(w, x).compile()
    text = f.as_text()
    out = jax.block_until_ready(f(w, x))
    times = []
    for _ in range(10):
      t = time.perf_counter()
      jax.block_until_ready(f(w, x))
      times.append((time.perf_counter() - t) * 1e3)
    ref = ref or out
    same = all(
      bool(jnp.array_equal(a, b))
      for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(ref), strict=True)
    )
    rows.append(
      (
        kind,
        text.count(" broadcast("),
        text.count(" copy("),
        text.count("AllocateBuffer"),
        statistics.median(times),
        same,
        f.memory_analysis().temp_size_in_bytes / 2**30,
      )
    )
  print("| kind | broadcasts | copies | AllocateBuffer | ms | equal | temp GiB |")
  print("|---|---|---|---|---|---|---|")
  for r in rows:
    print(f"| {r[0]} | {r[1]} | {r[2]} | {r[3]} | {r[4]:.2f} | {r[5]} | {r[6]:.2f} |")


if __name__ == "__main__":
  main()
