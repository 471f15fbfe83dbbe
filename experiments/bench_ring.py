"""Ring attention over a ``context`` axis on several GPUs: right answers, then speed of its two
ways of computing a block (XLA's tiles, the flash op per chunk pair) against one GPU.

Shape: Llama 3.1 8B attention (32 query heads, 8 KV heads, head dim 128), bf16, one row of T
tokens packed with documents of mixed lengths (positions restart per document), in zigzag
order over C devices (jaxtune.parallel.ring_attention).

(a) Correctness at --check-seq tokens, per C and way: the output and the q/k/v gradients of
sum(out * r) (r random) against one device's float32 reference (the flash op's jnp
reference on the natural order), relative L2 errors; PASS/FAIL per case.

(b) Time of one forward + backward (jit, wall clock, median of --reps after a warm-up) at each
of --seqs: one GPU with the flash kernel on the whole row (the baseline), then the ring per C
and way. speedup = one GPU's time / the ring's; efficiency = speedup / C.

  PYTHONPATH=. python experiments/bench_ring.py --seqs 32768,131072 --results-dir $OUT
  python experiments/bench_ring.py --cpu     # 8 fake CPU devices, the op's jnp reference, tiny
"""

import argparse
import os
import sys
from pathlib import Path

if "--cpu" in sys.argv:
  os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
  os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from experiments.bench_nf4_matmul import rel_err  # noqa: E402
from experiments.measure import wall_ms  # noqa: E402
from experiments.record import record  # noqa: E402
from jaxtune.parallel import ring_attention as context  # noqa: E402
from pallas_kernels.flash_attention import flash_attention  # noqa: E402

TOLERANCE = 2e-2  # bf16 inputs against a float32 reference


def packed_row(t: int, rng) -> tuple[np.ndarray, np.ndarray]:
  """Segment ids and positions [1, T] of documents of mixed lengths filling T tokens."""
  seg, pos, start, doc = np.zeros(t, np.int32), np.zeros(t, np.int32), 0, 1
  while start < t:
    n = min(int(rng.integers(t // 16, t // 3)), t - start)
    seg[start : start + n], pos[start : start + n] = doc, np.arange(n)
    start, doc = start + n, doc + 1
  return seg[None], pos[None]


def make_inputs(t, heads, kv_heads, dim, seed):
  rng = np.random.default_rng(seed)
  q = rng.standard_normal((1, t, heads, dim), np.float32)
  k = rng.standard_normal((1, t, kv_heads, dim), np.float32)
  v = rng.standard_normal((1, t, kv_heads, dim), np.float32)
  r = rng.standard_normal((1, t, heads, dim), np.float32)
  seg, pos = packed_row(t, rng)
  return q, k, v, r, seg, pos


def ring_fn(mesh, kernel, scale):
  heads, tokens = P(None, context.AXIS, None, None), P(None, context.AXIS)

  def loss(q, k, v, r, pos, seg):
    out = context.ring_attention(
      q, k, v, pos, seg, scale=scale, window=0, softcap=None, mesh=mesh,
      specs=(heads, tokens), kernel=kernel,
    )  # fmt: skip
    return jnp.sum(out.astype(jnp.float32) * r), out

  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))


def one_device_fn(impl, scale):
  def loss(q, k, v, r, seg):
    out = flash_attention(q, k, v, segment_ids=seg, causal=True, scale=scale, implementation=impl)
    return jnp.sum(out.astype(jnp.float32) * r), out

  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))


def main():
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  ap.add_argument("--contexts", default="2,4")
  ap.add_argument("--seqs", default="32768,131072")
  ap.add_argument("--check-seq", type=int, default=8192)
  ap.add_argument("--ways", default="xla,flash", help="xla: XLA's tiles; flash: the flash op")
  ap.add_argument("--reps", type=int, default=5)
  ap.add_argument("--results-dir", default=None)
  ap.add_argument("--cpu", action="store_true", help="smoke: 8 CPU devices, tiny, jnp reference")
  args = ap.parse_args()
  heads, kv_heads, dim = (4, 2, 16) if args.cpu else (32, 8, 128)
  kernel = "xla" if args.cpu else "mosaic"  # the flash op's implementation per chunk pair
  if args.cpu:
    args.check_seq, args.seqs = 256, "512"
  scale = dim**-0.5
  contexts = [int(c) for c in args.contexts.split(",") if int(c) <= len(jax.devices())]
  ways = {"xla": None, "flash": kernel}
  ways = {w: ways[w] for w in args.ways.split(",")}
  meshes = {c: jax.make_mesh((c,), (context.AXIS,), devices=jax.devices()[:c]) for c in contexts}
  bf16 = lambda a: jnp.asarray(a, jnp.bfloat16)  # noqa: E731
  dev0 = jax.devices()[0]

  def on_ring(c, q, k, v, r, seg, pos):
    """Zigzag order, split over the first c devices."""
    order = context.zigzag_order(q.shape[1], c)
    put = lambda a, spec: jax.device_put(np.take(a, order, axis=1), NamedSharding(meshes[c], spec))  # noqa: E731
    h, tk = P(None, context.AXIS, None, None), P(None, context.AXIS)
    return (
      bf16(put(q, h)), bf16(put(k, h)), bf16(put(v, h)), put(r, h), put(pos, tk), put(seg, tk)
    ), order  # fmt: skip

  failed = 0
  q, k, v, r, seg, pos = make_inputs(args.check_seq, heads, kv_heads, dim, 0)
  ref_fn = one_device_fn("xla", scale)
  on0 = lambda a: jax.device_put(a, dev0)  # noqa: E731
  (_, ref_out), ref_grads = ref_fn(*(on0(a) for a in (q, k, v, r, seg)))
  refs = [np.asarray(a, np.float64) for a in (ref_out, *ref_grads)]
  del ref_out, ref_grads
  checks = {}
  for c in contexts:
    ring_args, order = on_ring(c, q, k, v, r, seg, pos)
    undo = np.argsort(order)
    for way, kern in ways.items():
      (_, out), grads = ring_fn(meshes[c], kern, scale)(*ring_args)
      got = [np.take(np.asarray(a, np.float32), undo, axis=1) for a in (out, *grads)]
      errs = [rel_err(g, ref) for g, ref in zip(got, refs, strict=True)]
      ok = max(errs) < TOLERANCE
      failed += not ok
      checks[(c, way)] = max(errs)
      print(
        f"{'PASS' if ok else 'FAIL'} context={c} {way}: out {errs[0]:.2e}, dq {errs[1]:.2e}, "
        f"dk {errs[2]:.2e}, dv {errs[3]:.2e}",
        flush=True,
      )
  del refs
  rows = []
  for t in (int(s) for s in args.seqs.split(",")):
    q, k, v, r, seg, pos = make_inputs(t, heads, kv_heads, dim, 1)
    base_impl = kernel if not args.cpu else "xla"
    one = one_device_fn(base_impl, scale)
    base_ms = wall_ms(
      one, on0(bf16(q)), on0(bf16(k)), on0(bf16(v)), on0(r), on0(seg), reps=args.reps
    )
    rows.append({"seq": t, "context": 1, "way": f"one GPU, flash {base_impl}", "ms": base_ms})
    print(rows[-1], flush=True)
    for c in contexts:
      ring_args, _ = on_ring(c, q, k, v, r, seg, pos)
      for way, kern in ways.items():
        ms = wall_ms(ring_fn(meshes[c], kern, scale), *ring_args, reps=args.reps)
        rows.append(
          {"seq": t, "context": c, "way": way, "ms": ms, "check_rel_err": checks[(c, way)]}
        )
        print(rows[-1], flush=True)
    for row in rows:
      if row["seq"] == t:
        row["speedup_vs_one"] = base_ms / row["ms"]
        row["efficiency"] = row["speedup_vs_one"] / row["context"]
  if not args.cpu:
    record(
      "bench_ring",
      [{"heads": heads, "kv_heads": kv_heads, "head_dim": dim, **row} for row in rows],
      "Ring attention over a context axis: XLA tiles vs the flash kernel per block, vs one GPU",
      note="One forward + backward of packed causal attention (Llama 3.1 8B heads, bf16, one row), "
      "wall-clock median; speedup = one GPU's flash kernel on the whole row / the ring's time; "
      "check_rel_err: the worst of out/dq/dk/dv against a float32 one-device reference at "
      f"{args.check_seq} tokens.",
      out_dir=args.results_dir,
    )
  print("\n| seq | context | way | ms | speedup vs one GPU | efficiency |")
  for row in rows:
    print(
      f"| {row['seq']} | {row['context']} | {row['way']} | {row['ms']:.1f} | "
      f"{row['speedup_vs_one']:.2f} | {row['efficiency']:.2f} |"
    )
  sys.exit(1 if failed else 0)


if __name__ == "__main__":
  main()
