"""Training-step throughput of QLoRA on full-size Llama shapes, on the GPU it runs on.

Writes a random-weight HF checkpoint of the shape to local disk, loads it through the real
converter (NF4 on the GPU), adds LoRA r=16 on all seven projections, and times the jitted
train step at seq 2048 for each micro-batch size. In the same run it times a bf16
8192x8192x8192 matmul, the rate both utilisation figures are quoted against:

  MFU-6N = 6 * all parameters * tokens/s / matmul rate            (the peers' formula)
  MFU-4N = (4 * matmul parameters + attention FLOPs) * tokens/s / matmul rate
           matmul parameters: the seven projections of every layer plus the output head;
           4 = forward 2 + input-gradient 2 (the base is frozen, so no weight gradient);
           attention FLOPs per token (causal, forward + backward) = 6 * L * T * heads * head_dim.
Recomputation under remat is not counted as useful work in either.

  python experiments/bench_train.py --shape llama-3.2-1b --batches 1,4 [--results-dir DIR]
"""

import argparse
import itertools
import statistics
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flax import nnx  # noqa: E402

import jaxtune  # noqa: E402
from experiments.record import record  # noqa: E402
from experiments.write_checkpoint import write  # noqa: E402
from jaxtune import attention, trainer  # noqa: E402
from jaxtune.run_config import RunConfig  # noqa: E402


def matmul_tflops(n: int = 8192, reps: int = 20) -> float:
  keys = jax.random.split(jax.random.key(0), 2)
  a = jax.random.normal(keys[0], (n, n), jnp.bfloat16)
  b = jax.random.normal(keys[1], (n, n), jnp.bfloat16)
  f = jax.jit(jnp.dot)
  f(a, b).block_until_ready()
  times = []
  for _ in range(reps):
    t = time.perf_counter()
    f(a, b).block_until_ready()
    times.append(time.perf_counter() - t)
  return 2 * n**3 / statistics.median(times) / 1e12


def reset_host_peak() -> None:
  """Linux: reset VmHWM so the next reading is the peak from here on."""
  Path("/proc/self/clear_refs").write_text("5")


def host_peak_gib() -> float:
  for line in Path("/proc/self/status").read_text().splitlines():
    if line.startswith("VmHWM:"):
      return int(line.split()[1]) / 2**20  # kB -> GiB
  return float("nan")


def peak_gib() -> float:
  stats = jax.devices()[0].memory_stats() or {}
  return stats.get("peak_bytes_in_use", 0) / 2**30


def time_steps(model, b: int, args, attention: str, remat: str, nf4_matmul: str = "auto") -> dict:
  """Median step time of the jitted train step at micro-batch b (compilation excluded)."""
  cfg = model.config
  run = RunConfig(steps=args.steps, batch_size=b, seq_len=args.seq, lora_rank=16, lora_alpha=16)
  model.set_runtime(remat=remat, attention_impl=attention, nf4_matmul=nf4_matmul)
  graphdef, lora, frozen = trainer.place(model, None)
  tx, _ = trainer.make_optimizer(run)
  opt_state = tx.init(lora)
  step = trainer.make_train_step(graphdef, tx)
  rng = np.random.default_rng(b)
  times = []
  for i in range(args.steps + 2):
    ids = rng.integers(0, cfg.vocab_size, (1, b, args.seq + 1)).astype(np.int32)
    batch = {
      "input_ids": jnp.asarray(ids[..., :-1]),
      "labels": jnp.asarray(ids[..., 1:]),
      "segment_ids": jnp.ones((1, b, args.seq), jnp.int32),
    }
    t = time.perf_counter()
    lora, opt_state, m = step(lora, opt_state, frozen, batch, jax.random.key(i))
    loss = float(m["loss"])
    if i >= 2:  # the first two include compilation
      times.append(time.perf_counter() - t)
  ms = statistics.median(times) * 1e3
  # The train step donated the adapters; put the updated ones back into the model.
  nnx.update(model, lora)
  return {
    "model": args.shape,
    "batch": b,
    "seq": args.seq,
    "remat": remat,
    "attention": attention,
    "nf4_matmul": nf4_matmul,
    "lora_rank": 16,
    "tokens_per_s": b * args.seq / (ms / 1e3),
    "ms_per_step": ms,
    "peak_gib": peak_gib(),
    "loss": loss,
  }


def check_attention(model, seq: int) -> None:
  """cuDNN attention equals the float32 XLA reference on this model's head layout.

  Checked on the op, not through the model: a random-weight model in bf16 amplifies rounding
  over its layers (a 2% relative logits difference over 32 layers was seen), which would
  hide nothing and prove nothing.
  """
  cfg = model.config
  keys = jax.random.split(jax.random.key(1), 3)
  q = jax.random.normal(keys[0], (1, seq, cfg.num_heads, cfg.head_dim), jnp.float32)
  k = jax.random.normal(keys[1], (1, seq, cfg.num_kv_heads, cfg.head_dim), jnp.float32)
  v = jax.random.normal(keys[2], (1, seq, cfg.num_kv_heads, cfg.head_dim), jnp.float32)
  seg = jnp.ones((1, seq), jnp.int32)
  scale = cfg.head_dim**-0.5
  ref = np.asarray(attention.attention(q, k, v, segment_ids=seg, scale=scale))
  bf = [x.astype(jnp.bfloat16) for x in (q, k, v)]
  got = attention.attention(*bf, segment_ids=seg, scale=scale, implementation="fused")
  got = np.asarray(got.astype(jnp.float32))
  err = np.linalg.norm(got - ref) / np.linalg.norm(ref)
  print(f"attention check: fused (bf16) vs xla (fp32), relative L2 error {err:.2e}", flush=True)
  assert err < 1e-2, err


def main():
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  ap.add_argument("--shape", default="llama-3.2-1b")
  ap.add_argument("--batches", default="1,4")
  ap.add_argument("--seq", type=int, default=2048)
  ap.add_argument("--steps", type=int, default=8)
  ap.add_argument("--remat", default="dots_no_batch", help="comma-separated policies")
  ap.add_argument("--attention", default="fused", help="comma-separated: xla, fused")
  ap.add_argument("--quantization", default="nf4", help="comma-separated: nf4, none")
  ap.add_argument("--nf4-matmul", default="auto", help="comma-separated: auto, kernel, xla")
  ap.add_argument("--results-dir", default=None)
  ap.add_argument("--matmul-n", type=int, default=8192, help="size of the reference matmul")
  args = ap.parse_args()

  rate = matmul_tflops(args.matmul_n)
  print(f"bf16 matmul {args.matmul_n}^3: {rate:.1f} TFLOP/s", flush=True)
  rows = []
  with tempfile.TemporaryDirectory(dir="/tmp") as tmp:
    t = time.perf_counter()
    ckpt = write(Path(tmp) / args.shape, args.shape)
    print(f"wrote checkpoint in {time.perf_counter() - t:.1f}s", flush=True)
    for quantization in args.quantization.split(","):
      reset_host_peak()
      rss0 = host_peak_gib()
      t = time.perf_counter()
      model = jaxtune.from_pretrained(
        ckpt, quantization=None if quantization == "none" else quantization, dtype="bfloat16"
      )
      jax.block_until_ready(jax.tree.leaves(nnx.state(model)))
      load = {
        "load_s": time.perf_counter() - t,
        "host_rss_before_load_gib": rss0,
        "host_peak_rss_load_gib": host_peak_gib(),
      }
      print(f"{quantization}: loaded in {load['load_s']:.1f}s", flush=True)
      model = jaxtune.apply_lora(model, rank=16, alpha=16)
      check_attention(model, args.seq)
      for attention in args.attention.split(","):
        for remat in args.remat.split(","):
          for b, nf4_matmul in itertools.product(
            (int(x) for x in args.batches.split(",")), args.nf4_matmul.split(",")
          ):
            row = time_steps(model, b, args, attention, remat, nf4_matmul)
            row.update(quantization=quantization, **load, matmul_tflops=rate)
            cfg = model.config
            matmul_params = cfg.num_layers * sum(o * i for o, i in cfg.linear_shapes().values())
            matmul_params += cfg.vocab_size * cfg.hidden_size
            attn_flops = 6 * cfg.num_layers * args.seq * cfg.num_heads * cfg.head_dim
            row["mfu_6n"] = 6 * cfg.num_params() * row["tokens_per_s"] / (rate * 1e12)
            row["mfu_4n"] = (4 * matmul_params + attn_flops) * row["tokens_per_s"] / (rate * 1e12)
            rows.append(row)
            print(
              {k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}, flush=True
            )
      del model
  record(
    "bench_train",
    rows,
    f"Training step, {args.shape}, seq {args.seq}, NF4 + LoRA r=16 (7 proj)",
    note="peak_gib is the process's peak GPU memory so far (batches run in ascending order); "
    "MFU figures against the bf16 matmul rate of the same run (see the script's docstring).",
    out_dir=args.results_dir,
  )
  print(
    "\n| model | quant | attention | remat | batch | tokens/s | ms/step | peak GiB | MFU-6N |"
    " MFU-4N |"
  )
  for r in rows:
    print(
      f"| {r['model']} | {r['quantization']} | {r['attention']} | {r['remat']} | "
      f"{r['batch']} | {r['tokens_per_s']:.0f} | {r['ms_per_step']:.1f} | "
      f"{r['peak_gib']:.1f} | {r['mfu_6n']:.3f} | {r['mfu_4n']:.3f} |"
    )


if __name__ == "__main__":
  main()
