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
20 costliest kernels (by name, all launches summed). A second table puts every XLA kernel under
the model operation it came from (the jax.named_scope of the model code, read from the compiled
HLO: NF4 matmul incl. dequantization, LoRA, norms, rope, MLP activation, output layer, loss,
attention) and its pass (forward incl. remat's recomputation, or backward). The matmul floor
is the FLOPs the step must do (4 x matmul parameters x tokens, plus attention) at the bf16
matmul rate timed in the same run.

  python experiments/profile_kernels.py --shape llama-3.1-8b --batch 2 --results-dir $OUT
"""

import argparse
import collections
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jaxtune  # noqa: E402
from experiments.measure import matmul_tflops  # noqa: E402
from experiments.record import record  # noqa: E402
from experiments.write_checkpoint import write  # noqa: E402
from jaxtune.parallel import runtime
from jaxtune.run import resolve as resolver
from jaxtune.training import losses, plan  # noqa: E402
from jaxtune.training import step as trainer_step  # noqa: E402

CATEGORIES = (  # first match wins
  ("attention", ("fmha", "flash", "cudnn", "mosaic", "attention")),
  ("matmul", ("gemm", "nvjet", "cutlass", "xmma", "cublas", "wgmma", "matmul", "dot")),
  ("copy", ("copy", "transpose", "dynamic", "memcpy", "memset", "concatenate")),
  ("fusion", ("fusion", "loop_", "input_", "reduce", "convert", "multiply", "add")),
)


# Named scopes the model's code opens (jax.named_scope), most specific first: XLA writes them
# into every HLO instruction's op_name, so a fused kernel can be traced back to them.
SCOPES = (
  "attention",
  "nf4_matmul",
  "lora",
  "rms_norm",
  "rope",
  "mlp_activation",
  "output_layer",
  "loss",
)
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_CALLS = re.compile(r"calls=%?([\w.\-]+)")


def kernel_key(name: str) -> str:
  """An HLO instruction or GPU kernel name in the form XLA gives its kernels."""
  return re.sub(r"[.\-]", "_", name)


def scopes_by_kernel(hlo_text: str) -> dict[str, tuple[str, str]]:
  """kernel_key(instruction) -> (scope, pass) for every instruction of compiled HLO text.

  scope: the first of SCOPES named in the op_name of the instruction or of anything it fuses
  ("other" if none); pass: "backward" where an op_name is under transpose(...), else
  "forward" (remat's recomputation included, as XLA names it).
  """
  op_names: dict[str, list[str]] = collections.defaultdict(list)  # computation -> op_names
  instructions = []  # (computation, name, own op_name, called computation)
  current = None
  for line in hlo_text.splitlines():
    m = _COMPUTATION.match(line)
    if m and not _INSTRUCTION.match(line):  # a computation's header (its params may hold "=")
      current = m.group(1)
      continue
    m = _INSTRUCTION.match(line)
    if not m or current is None:
      continue
    op = _OP_NAME.search(line)
    calls = _CALLS.search(line)
    if op:
      op_names[current].append(op.group(1))
    instructions.append((m.group(1), op and op.group(1), calls and calls.group(1)))
  out = {}
  for name, op, calls in instructions:
    names = ([op] if op else []) + (op_names.get(calls, []) if calls else [])
    parts = {w for n in names for w in re.findall(r"\w+", n)}  # "transpose(jvp(loss))" too
    scope = next((s for s in SCOPES if s in parts), "other")
    backward = any("transpose(" in n for n in names)
    out[kernel_key(name)] = (scope, "backward" if backward else "forward")
  return out


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
  ap.add_argument("--remat", default="activations")
  ap.add_argument("--attention", default=None, help="xla, fused or pallas (default: the model's)")
  ap.add_argument(
    "--nf4-matmul", default="auto",
    help="auto, kernel or xla; kernel makes its operands once, as a run does (step.place)",
  )  # fmt: skip
  ap.add_argument("--checkpoint-dir", default=None, help="reuse or keep the checkpoint here")
  ap.add_argument("--results-dir", default=None)
  ap.add_argument("--hlo-out", default=None, help="write the compiled step's HLO text here")
  ap.add_argument("--top", type=int, default=20, help="kernels listed by name")
  ap.add_argument("--no-scan", action="store_true", help="the layers as a Python loop")
  ap.add_argument(
    "--dequantize-again", action="store_true",
    help="NF4 input gradients dequantize anew (as remat lean does) under any remat",
  )  # fmt: skip
  ap.add_argument("--docs-per-row", type=int, default=1, help="packed rows: segments per row")
  ap.add_argument(
    "--scan-outputs", default="empty", choices=("zeros", "empty"),
    help="the layer scan's stacked outputs: JAX's zeros or unwritten (plan.scan_outputs_unwritten)",
  )  # fmt: skip
  args = ap.parse_args()
  from jax.experimental.mosaic.gpu import profiler  # noqa: PLC0415 (GPU only)

  rate = matmul_tflops()
  with tempfile.TemporaryDirectory(dir="/tmp") as tmp:
    ckpt = Path(args.checkpoint_dir or tmp) / args.shape
    if not (ckpt / "config.json").is_file():
      ckpt = write(ckpt, args.shape)
    model = jaxtune.from_pretrained(ckpt, quantization="nf4", dtype="bfloat16")
  model = jaxtune.apply_lora(model, rank=16, alpha=16)
  cfg = model.config
  packed = args.docs_per_row > 1
  attention, _ = resolver.resolve_attention(args.attention, cfg, dtype="bfloat16", packed=packed)
  if args.dequantize_again:
    runtime.Runtime.dequantize_again = property(lambda self: True)
  rt = runtime.Runtime(
    dtype="bfloat16", remat=args.remat, attention=attention, nf4_matmul=args.nf4_matmul,
    scan_layers=not args.no_scan,
  )  # fmt: skip
  graphdef, lora, frozen = trainer_step.place(model, rt)
  lora = trainer_step.fp32_master(lora)
  rng = np.random.default_rng(0)
  ids = rng.integers(0, cfg.vocab_size, (args.batch, args.seq + 1)).astype(np.int32)
  batch = {
    "input_ids": jnp.asarray(ids[:, :-1]),
    "labels": jnp.asarray(ids[:, 1:]),
    "segment_ids": jnp.broadcast_to(
      1 + jnp.arange(args.seq, dtype=jnp.int32) * args.docs_per_row // args.seq,
      (args.batch, args.seq),
    ),
  }

  def mean_loss(lora, frozen, batch):
    s, n = losses.loss_sums(graphdef, lora, frozen, batch, None, rt)
    return s / n

  step = jax.jit(jax.value_and_grad(mean_loss))
  with plan.scan_outputs_unwritten(args.scan_outputs == "empty"):
    t0 = time.perf_counter()
    compiled = step.lower(lora, frozen, batch).compile()
    compile_s = time.perf_counter() - t0
    hlo = compiled.as_text()
    planned = plan.planned_bytes(compiled) / 2**30
    scopes = scopes_by_kernel(hlo)
    if args.hlo_out:
      Path(args.hlo_out).write_text(hlo)
    jax.block_until_ready(step(lora, frozen, batch))  # compile, warm up
    walls = []
    for _ in range(5):
      t = time.perf_counter()
      jax.block_until_ready(step(lora, frozen, batch))
      walls.append((time.perf_counter() - t) * 1e3)
    wall = statistics.median(walls)
    _, kernels = profiler.measure(step, aggregate=False)(lora, frozen, batch)
  kernels = kernels or []
  total = sum(ms for _, ms in kernels)
  by_cat, by_name = collections.Counter(), collections.Counter()
  by_scope = collections.Counter()  # (model operation, pass) -> ms
  for name, ms in kernels:
    by_cat[category(name)] += ms
    by_name[name] += ms
    # Kernels XLA names after an HLO instruction map to the model's scopes; library kernels
    # (cuBLAS, cuDNN) and Pallas kernels keep their category.
    by_scope[scopes.get(kernel_key(name), (category(name), "unmapped"))] += ms
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
      "attention": attention, "nf4_matmul": args.nf4_matmul, "scan_outputs": args.scan_outputs,
      "scan_layers": not args.no_scan, "dequantize_again": args.dequantize_again,
      "docs_per_row": args.docs_per_row, "wall_ms": wall, "compile_s": compile_s,
      "planned_gib": planned, "category": cat,
      "ms_per_step": by_cat[cat],
      "ms_per_layer": by_cat[cat] / layers, "share": by_cat[cat] / total if total else 0.0,
    })  # fmt: skip
  top = [
    {"kernel": name[:90], "ms_per_step": ms, "share": ms / total}
    for name, ms in by_name.most_common(args.top)
  ]
  note = (
    f"Device time of one loss-and-LoRA-gradient call (CUPTI, all {len(kernels)} kernel launches):"
    f" {total:.1f} ms for {tokens} tokens ({tokens / total * 1e3:.0f} tokens/s on the device); "
    f"wall time of the call {wall:.1f} ms (median of 5); compiled in {compile_s:.0f} s, "
    f"planned {planned:.1f} GiB. "
    f"Matmul floor at the {rate:.0f} TFLOP/s bf16 rate of this run: {floor_ms:.1f} ms "
    f"(4 x {matmul_params / 1e9:.2f}B matmul parameters x tokens + causal attention). "
    "Costliest kernels: " + "; ".join(f"{t['kernel']} {t['ms_per_step']:.1f} ms" for t in top[:20])
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
  scope_rows = [
    {"model": args.shape, "batch": args.batch, "nf4_matmul": args.nf4_matmul, "scope": scope,
     "pass": phase,
     "ms_per_step": ms, "ms_per_layer": ms / layers, "share": ms / total if total else 0.0}
    for (scope, phase), ms in by_scope.most_common()
  ]  # fmt: skip
  record(
    "profile_kernels_scopes",
    scope_rows,
    f"The same step's device time by model operation and pass, {args.shape}, batch {args.batch}",
    note="scope: the jax.named_scope of the model code each XLA kernel came from (read from the "
    "compiled HLO's op_name metadata; kernels not named after an HLO instruction, i.e. cuBLAS, "
    "cuDNN and Pallas, keep their category, pass 'unmapped'); backward = under transpose(), "
    "forward includes remat's recomputation.",
    out_dir=args.results_dir,
  )
  print("\n| scope | pass | ms/step | ms/layer | share |\n|---|---|---|---|---|")
  for r in scope_rows:
    print(
      f"| {r['scope']} | {r['pass']} | {r['ms_per_step']:.1f} | {r['ms_per_layer']:.2f} | "
      f"{r['share']:.0%} |"
    )
  print("\n| kernel | scope, pass | ms/step | share |\n|---|---|---|---|")
  for t in top:
    where = ", ".join(scopes.get(kernel_key(t["kernel"]), (category(t["kernel"]), "unmapped")))
    print(f"| {t['kernel']} | {where} | {t['ms_per_step']:.2f} | {t['share']:.1%} |")


if __name__ == "__main__":
  main()
