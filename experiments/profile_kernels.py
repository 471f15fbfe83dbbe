"""Where one QLoRA training step's device time goes, kernel by kernel (CUPTI, GPU only).

Loads a random-weight checkpoint of the shape through the real converter, adds LoRA r=16 on
all seven projections, and runs the jitted loss-and-LoRA-gradient of one micro-batch (the
train step without its tiny AdamW update) once under Mosaic GPU's CUPTI profiler. Every kernel
launch is put in a category by its name:

  matmul      cuBLAS (nvjet) / CUTLASS / XLA-Triton GEMMs (projections, LoRA, output layer)
  attention   cuDNN fused attention or the Pallas (Mosaic GPU) flash kernels
  fusion      XLA's own fused kernels: NF4 dequantization, norms, rope, SiLU, residuals,
              softmax cross-entropy, casts
  copy        copies, transposes, dynamic slices/updates
  other       the rest

and the table gives each category's milliseconds per step and per layer, its share, and the
20 costliest kernels (by name, all launches summed). The matmul floor is the FLOPs the step
must do (4 x matmul parameters x tokens, plus attention) at the bf16 matmul rate timed in the
same run.

  python experiments/profile_kernels.py --shape llama-3.1-8b --batch 2 --results-dir $OUT
"""

import argparse
import collections
import sys
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jaxtune  # noqa: E402
from experiments.measure import matmul_tflops  # noqa: E402
from experiments.record import record  # noqa: E402
from experiments.write_checkpoint import write  # noqa: E402
from jaxtune import trainer  # noqa: E402

CATEGORIES = (  # first match wins
  ("attention", ("fmha", "flash", "cudnn", "mosaic", "attention")),
  ("matmul", ("gemm", "nvjet", "cutlass", "xmma", "cublas", "wgmma", "matmul", "dot")),
  ("copy", ("copy", "transpose", "dynamic", "memcpy", "memset", "concatenate")),
  ("fusion", ("fusion", "loop_", "input_", "reduce", "convert", "multiply", "add")),
)


def category(name: str) -> str:
  low = name.lower()
  for cat, keys in CATEGORIES:
    if any(k in low for k in keys):
      return cat
  return "other"


def main():
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  ap.add_argument("--shape", default="llama-3.2-1b")
  ap.add_argument("--batch", type=int, default=2)
  ap.add_argument("--seq", type=int, default=2048)
  ap.add_argument("--remat", default="dots_no_batch")
  ap.add_argument("--attention", default=None, help="xla, fused or pallas (default: the model's)")
  ap.add_argument("--checkpoint-dir", default=None, help="reuse or keep the checkpoint here")
  ap.add_argument("--results-dir", default=None)
  args = ap.parse_args()
  from jax.experimental.mosaic.gpu import profiler  # noqa: PLC0415 (GPU only)

  rate = matmul_tflops()
  with tempfile.TemporaryDirectory(dir="/tmp") as tmp:
    ckpt = Path(args.checkpoint_dir or tmp) / args.shape
    if not (ckpt / "config.json").is_file():
      ckpt = write(ckpt, args.shape)
    model = jaxtune.from_pretrained(ckpt, quantization="nf4", dtype="bfloat16")
  model = jaxtune.apply_lora(model, rank=16, alpha=16)
  attention = args.attention or model.default_attention()
  model.set_runtime(remat=args.remat, attention_impl=attention)
  cfg = model.config
  graphdef, lora, frozen = nnx.split(model, nnx.LoRAParam, ...)
  lora = trainer.fp32_master(lora)
  rng = np.random.default_rng(0)
  ids = rng.integers(0, cfg.vocab_size, (args.batch, args.seq + 1)).astype(np.int32)
  batch = {
    "input_ids": jnp.asarray(ids[:, :-1]),
    "labels": jnp.asarray(ids[:, 1:]),
    "segment_ids": jnp.ones((args.batch, args.seq), jnp.int32),
  }

  def mean_loss(lora, frozen, batch):
    s, n = trainer.loss_sums(graphdef, lora, frozen, batch, None)
    return s / n

  step = jax.jit(jax.value_and_grad(mean_loss))
  jax.block_until_ready(step(lora, frozen, batch))  # compile, warm up
  _, kernels = profiler.measure(step, aggregate=False)(lora, frozen, batch)
  kernels = kernels or []
  total = sum(ms for _, ms in kernels)
  by_cat, by_name = collections.Counter(), collections.Counter()
  for name, ms in kernels:
    by_cat[category(name)] += ms
    by_name[name] += ms
  tokens = args.batch * args.seq
  d, f, layers = cfg.hidden_size, cfg.intermediate_size, cfg.num_layers
  per_layer = d * (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
  per_layer += cfg.num_heads * cfg.head_dim * d + 3 * d * f
  matmul_params = layers * per_layer + d * cfg.vocab_size
  attn_flops = 6 * layers * args.seq * cfg.num_heads * cfg.head_dim * tokens
  floor_ms = (4 * matmul_params * tokens + attn_flops) / (rate * 1e12) * 1e3
  rows = []
  for cat in ("matmul", "attention", "fusion", "copy", "other"):
    rows.append({
      "model": args.shape, "batch": args.batch, "seq": args.seq, "remat": args.remat,
      "attention": attention, "category": cat, "ms_per_step": by_cat[cat],
      "ms_per_layer": by_cat[cat] / layers, "share": by_cat[cat] / total if total else 0.0,
    })  # fmt: skip
  top = [
    {"kernel": name[:90], "ms_per_step": ms, "share": ms / total}
    for name, ms in by_name.most_common(20)
  ]
  note = (
    f"Device time of one loss-and-LoRA-gradient call (CUPTI, all {len(kernels)} kernel launches):"
    f" {total:.1f} ms for {tokens} tokens ({tokens / total * 1e3:.0f} tokens/s on the device). "
    f"Matmul floor at the {rate:.0f} TFLOP/s bf16 rate of this run: {floor_ms:.1f} ms "
    f"(4 x {matmul_params / 1e9:.2f}B matmul parameters x tokens + causal attention). "
    "Costliest kernels: " + "; ".join(f"{t['kernel']} {t['ms_per_step']:.1f} ms" for t in top)
  )
  record(
    "profile_kernels",
    rows,
    f"Where a train step's device time goes, {args.shape}, batch {args.batch}, seq {args.seq}",
    note=note,
    out_dir=args.results_dir,
  )
  print(f"\n{note}\n")
  print("| category | ms/step | ms/layer | share |\n|---|---|---|---|")
  for r in rows:
    print(
      f"| {r['category']} | {r['ms_per_step']:.1f} | {r['ms_per_layer']:.2f} | {r['share']:.0%} |"
    )
  print("\n| kernel | ms/step | share |\n|---|---|---|")
  for t in top:
    print(f"| {t['kernel']} | {t['ms_per_step']:.2f} | {t['share']:.1%} |")


if __name__ == "__main__":
  main()
