"""A mixture of experts' products on the GPU, as jaxtune computes them today (issue 54) and
what issue 59's grouped kernel must beat, in one run: Qwen3-30B-A3B's expert shapes (128
experts, top 8, hidden 2048, expert width 768), tokens routed at random (uniformly, or skewed
so a few experts get most of them).

  (a) ``ragged_dot``: the grouped product jaxtune's experts ran first (jax.lax.ragged_dot),
      and ``tiles`` (groups padded to 64-row tiles of one group, XLA's batched matmul);
      and, for at most 1,024 rows, ``reference`` (each row's expert weight gathered: decoding);
  (b) dense: every token through every expert, a batched einsum (E times the useful FLOPs);
  (c) bf16 dense matmul of the useful size (tokens*k x D x I): the FLOP-rate ceiling;
  (d) the whole sparse layer (router, sort, gate/up/down with NF4 experts dequantized per
      step, unsort) forward and backward with LoRA on the experts, as jaxtune's training runs it.

Each timing is the median of --reps calls after a warmup (wall time around
block_until_ready). Checks (a) against the jnp reference in the same run.

  python experiments/bench_moe.py --results-dir $OUT
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from experiments.record import record  # noqa: E402
from jaxtune.models import moe  # noqa: E402
from pallas_kernels import nf4  # noqa: E402
from pallas_kernels.grouped_matmul import grouped_matmul  # noqa: E402

SHAPES = {"qwen3-30b-a3b": (128, 8, 2048, 768), "tiny": (8, 2, 128, 64)}  # E, k, D, I
E, K, D, I = SHAPES["qwen3-30b-a3b"]


def timed(fn, *args, reps: int) -> float:
  """Median ms per call."""
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(reps):
    t = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append((time.perf_counter() - t) * 1e3)
  return statistics.median(times)


def sizes_for(tokens: int, skew: bool, rng) -> np.ndarray:
  """Rows per expert for tokens * K assignments: uniform, or Zipf-like (a few hot experts)."""
  p = 1.0 / np.arange(1, E + 1) ** 1.2 if skew else np.ones(E)
  p = p / p.sum()
  return rng.multinomial(tokens * K, p).astype(np.int32)


def main() -> None:
  ap = argparse.ArgumentParser()
  ap.add_argument("--tokens", default="4096,16384")
  ap.add_argument("--reps", type=int, default=20)
  ap.add_argument("--results-dir", default=None)
  ap.add_argument("--shape", default="qwen3-30b-a3b", choices=SHAPES)  # tiny: a CPU dry run
  args = ap.parse_args()
  global E, K, D, I
  E, K, D, I = SHAPES[args.shape]
  rng = np.random.default_rng(0)
  key = jax.random.key(0)
  w = (jax.random.normal(key, (E, D, I), jnp.float32) * D**-0.5).astype(jnp.bfloat16)
  rows_out = []
  for tokens in [int(t) for t in args.tokens.split(",")]:
    for skew in (False, True):
      sizes = jnp.asarray(sizes_for(tokens, skew, rng))
      m = tokens * K
      x = (jax.random.normal(jax.random.fold_in(key, 1), (m, D), jnp.float32)).astype(jnp.bfloat16)
      ragged = jax.jit(lambda x, w, s: grouped_matmul(x, w, s, impl="ragged_dot"))
      ref = jax.jit(lambda x, w, s: grouped_matmul(x, w, s, impl="reference"))
      err = float(
        jnp.max(
          jnp.abs(ragged(x, w, sizes).astype(jnp.float32) - ref(x, w, sizes).astype(jnp.float32))
        )
      )
      t_ragged = timed(ragged, x, w, sizes, reps=args.reps)
      tiled = jax.jit(lambda x, w, s: grouped_matmul(x, w, s, impl="tiles"))
      diff = tiled(x, w, sizes).astype(jnp.float32) - ref(x, w, sizes).astype(jnp.float32)
      err_tiles = float(jnp.max(jnp.abs(diff)))
      t_tiles = timed(tiled, x, w, sizes, reps=args.reps)
      # The per-row product (each row's expert weight gathered: k * D * I bytes a token), what
      # decoding's few rows could take instead; its gathered weights outgrow memory past ~1k rows.
      t_ref = timed(ref, x, w, sizes, reps=args.reps) if m <= 1024 else None
      xe = x[:tokens].reshape(1, tokens, D)
      dense = jax.jit(lambda x, w: jnp.einsum("btd,edi->ebti", x, w))
      t_dense = timed(dense, xe, w, reps=args.reps)
      useful = jax.jit(lambda x, w: x @ w)
      t_useful = timed(useful, x, w[0], reps=args.reps)
      flops = 2 * m * D * I
      row = dict(
        tokens=tokens, skew=skew, experts=E, top_k=K, hidden=D, expert_width=I,
        max_abs_err=err, max_abs_err_tiles=err_tiles,
        ragged_ms=t_ragged, tiles_ms=t_tiles, reference_ms=t_ref,
        tiles_tflops=flops / t_tiles / 1e9,
        tiles_vs_ragged=t_ragged / t_tiles,
        dense_all_experts_ms=t_dense, bf16_same_flops_ms=t_useful,
        ragged_tflops=flops / t_ragged / 1e9, ceiling_tflops=flops / t_useful / 1e9,
        ragged_vs_ceiling=t_useful / t_ragged, ragged_vs_dense=t_dense / t_ragged,
      )  # fmt: skip
      rows_out.append(row)
      print(row, flush=True)

  # (d) one sparse layer forward + backward, NF4 experts, LoRA r=16 on them.
  tokens = int(args.tokens.split(",")[0])
  ws = [jax.random.normal(jax.random.fold_in(key, i), s, jnp.float32) * 0.02
        for i, s in enumerate([(E, I, D), (E, I, D), (E, D, I)])]  # fmt: skip
  q = [nf4.quantize_experts(x) for x in ws]
  router = jax.random.normal(jax.random.fold_in(key, 9), (D, E), jnp.float32) * 0.02
  lora = {
    n: moe.ExpertLora(
      jnp.zeros((E, i, 16), jnp.float32) + 0.01, jnp.zeros((E, 16, o), jnp.float32) + 0.01, 1.0
    )
    for n, (i, o) in (("gate", (D, I)), ("up", (D, I)), ("down", (I, D)))
  }
  x = jax.random.normal(jax.random.fold_in(key, 3), (tokens, D), jnp.float32).astype(jnp.bfloat16)
  routing = moe.Routing(E, K, "softmax_topk", normalize=True)

  def layer(lora, x, impl):
    weights, experts = moe.route(x @ router.astype(x.dtype), routing)
    g, u, d = (jnp.swapaxes(nf4.dequantize_experts(*p, jnp.bfloat16), -1, -2) for p in q)
    y = moe.experts_mlp(x, weights, experts, g, u, d, impl=impl, lora=lora)
    return jnp.sum(y.astype(jnp.float32) ** 2)

  useful = 3 * 2 * tokens * K * D * I * 3  # forward + two backward products, 3 projections
  grads = {}
  for impl in ("tiles", "ragged_dot"):
    step = jax.jit(jax.value_and_grad(lambda lo, x, impl=impl: layer(lo, x, impl)))
    row = dict(
      tokens=tokens, experts=E, top_k=K, hidden=D, expert_width=I,
      what="sparse layer fwd+bwd", impl=impl,
    )  # fmt: skip
    try:
      grads[impl] = jax.block_until_ready(step(lora, x))
      t_layer = timed(step, lora, x, reps=args.reps)
      row.update(layer_ms=t_layer, layer_tflops=useful / t_layer / 1e9)
    except jax.errors.JaxRuntimeError as e:  # ragged_dot's backward: ~100 GiB at 4096 tokens
      row.update(error=str(e).splitlines()[0][:200])
    rows_out.append(row)
    print(row, flush=True)
  if len(grads) == 2:
    a, b = (jax.tree.leaves(grads[i]) for i in ("ragged_dot", "tiles"))
    rel = max(
      float(jnp.max(jnp.abs(p - q)) / (jnp.max(jnp.abs(p)) + 1e-30))
      for p, q in zip(a, b, strict=True)
    )
    rows_out[-1]["grads_rel_tiles_vs_ragged"] = rel
    print("tiles vs ragged_dot, loss and LoRA gradients: max rel", rel, flush=True)

  print(f"\n{'tokens':>7} {'skew':>5} {'ragged ms':>10} {'tiles ms':>9} {'dense ms':>9} "
        f"{'ceiling ms':>10} {'tiles x':>8} {'tiles TF/s':>10} {'ref ms':>8}")  # fmt: skip
  for r in rows_out:
    if "ragged_ms" in r:
      ref = "-" if r["reference_ms"] is None else f"{r['reference_ms']:.3f}"
      print(f"{r['tokens']:>7} {r['skew']!s:>5} {r['ragged_ms']:>10.3f} {r['tiles_ms']:>9.3f} "
            f"{r['dense_all_experts_ms']:>9.3f} {r['bf16_same_flops_ms']:>10.3f} "
            f"{r['tiles_vs_ragged']:>8.1f} {r['tiles_tflops']:>10.1f} "
            f"{ref:>8}")  # fmt: skip
    elif "layer_ms" in r:
      print(f"sparse layer fwd+bwd, {r['tokens']} tokens, {r['impl']}: {r['layer_ms']:.2f} ms, "
            f"{r['layer_tflops']:.1f} TF/s useful")  # fmt: skip
    else:
      print(f"sparse layer fwd+bwd, {r['tokens']} tokens, {r['impl']}: {r['error']}")
  record("bench_moe", rows_out, "MoE expert products (Qwen3-30B-A3B shapes)",
         out_dir=args.results_dir)  # fmt: skip


if __name__ == "__main__":
  main()
