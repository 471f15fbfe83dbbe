"""Multi-GPU scaling of the QLoRA train step: data, tensor and pipeline axes against one GPU.

Loads a random-weight checkpoint of the shape once (bench_train's writer and the real NF4
converter), keeps the loaded state on the host, and for each mesh puts it onto that mesh's
shardings and times the jitted train step (step.make_train_step, LoRA r=16 on all seven
projections, AdamW) at seq 2048. Every data replica takes --batch sequences per step, so the
global batch is --batch x data. Per mesh it records:

  tokens_per_s           global tokens per second (median step, compilation excluded)
  tokens_per_s_per_gpu   that over the mesh's device count
  efficiency             tokens_per_s / (devices x tokens_per_s of the 1-GPU row of this run);
                         1.0 is perfect scaling (for tensor and pipe: the same global batch run
                         on more GPUs, for data: more batch on more GPUs)
  predicted_bubble       pipeline meshes: (P - 1) / (M + P - 1), M micro-batches per step
  efficiency_vs_bubble   pipeline meshes: tokens_per_s / (devices x 1-GPU tokens/s at the
                         micro-batch size) / (1 - predicted_bubble); 1.0 = the stages run as
                         fast as one GPU on a micro-batch, losing exactly the bubble. The
                         1-GPU row at that batch is timed too when it differs from --batch.
  step_gib               per-GPU memory XLA planned for the step (arguments, outputs and
                         temporaries of the compiled program, donated buffers counted once)
  process_peak_gib       the busiest GPU's peak so far in this process (cumulative over rows)

Meshes that need more devices than present are skipped.

  python experiments/bench_scaling.py --shape llama-3.1-8b --results-dir $OUT
  python experiments/bench_scaling.py --tiny          # CPU smoke run (8 fake devices)
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

# NVLink multicast stays off on the lent multi-GPU machines (set before NCCL starts).
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
if "--tiny" in sys.argv and "JAX_PLATFORMS" not in os.environ:  # before jax initialises
  os.environ["JAX_PLATFORMS"] = "cpu"
  os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"

import jax  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flax import nnx  # noqa: E402

import jaxtune  # noqa: E402
from converters.synthetic import write_random_checkpoint  # noqa: E402
from experiments.measure import step_gib  # noqa: E402
from experiments.record import record  # noqa: E402
from experiments.write_checkpoint import hf_config, write  # noqa: E402
from jaxtune.parallel import mesh as meshlib  # noqa: E402
from jaxtune.parallel import pipeline, sharding  # noqa: E402
from jaxtune.run import resolve as resolver
from jaxtune.run_config import RunConfig  # noqa: E402
from jaxtune.training import step as trainer  # noqa: E402

# name -> --mesh string (data x tensor x pipe)
MESHES = {
  "1": "1",
  "2 data": "2",
  "2 tensor": "1x2",
  "2 pipe": "1x1x2",
  "4 data": "4",
  "2 data x 2 tensor": "2x2",
  "4 tensor": "1x4",
  "4 pipe": "1x1x4",
}
TINY = dict(  # a CPU smoke shape: 4 layers so pipe=4 divides, 4 heads so tensor=4 does
  hidden_size=128,
  intermediate_size=256,
  num_hidden_layers=4,
  num_attention_heads=4,
  num_key_value_heads=4,
  head_dim=32,
  vocab_size=512,
  tie_word_embeddings=False,
)


def process_peak_gib(devices) -> float:
  peaks = [(d.memory_stats() or {}).get("peak_bytes_in_use", 0) for d in devices]
  return max(peaks) / 2**30  # 0 where the platform keeps no statistics (CPU)


def time_mesh(name, host_state, graphdef, cfg, args, per_replica=None) -> dict:
  """One row: the train step under mesh ``name`` at ``per_replica`` (default --batch)
  sequences per data replica."""
  spec = MESHES[name]
  sizes = meshlib.parse_mesh(spec, 1)
  n = sizes["data"] * sizes["tensor"] * sizes["pipe"]
  devices = jax.devices()[:n]
  mesh = meshlib.make_mesh(spec, devices)
  batch = (per_replica or args.batch) * sizes["data"]
  plan = pipeline.plan(mesh, cfg.num_layers, batch, args.microbatches)
  model = nnx.merge(graphdef, *host_state)
  run = RunConfig(
    steps=args.steps, batch_size=batch, seq_len=args.seq, lora_rank=16, mesh=spec,
    remat=args.remat, attention=args.attention, microbatches=args.microbatches,
    shard_frozen=args.shard_frozen, dtype="bfloat16",
  )  # fmt: skip
  rt = resolver.resolve(run, cfg, devices=devices)
  graphdef, lora, frozen = nnx.split(model, nnx.LoRAParam, ...)
  if n > 1:
    lora = jax.device_put(lora, sharding.state_shardings(lora, mesh))
    frozen = jax.device_put(frozen, sharding.state_shardings(frozen, mesh, args.shard_frozen))
    batch_shard = rt.sharding("accum", "batch", "length")
  else:
    lora, frozen = jax.device_put((lora, frozen), devices[0])
    batch_shard = devices[0]
  tx, _ = trainer.make_optimizer(run)
  opt_state = tx.init(lora)
  step = trainer.make_train_step(graphdef, tx, rt)
  rng = np.random.default_rng(0)

  def make_batch():
    ids = rng.integers(0, cfg.vocab_size, (1, batch, args.seq + 1)).astype(np.int32)
    host = {
      "input_ids": ids[..., :-1],
      "labels": ids[..., 1:],
      "segment_ids": np.ones((1, batch, args.seq), np.int32),
    }
    return jax.device_put(host, batch_shard)

  t = time.perf_counter()
  compiled = step.lower(lora, opt_state, frozen, make_batch(), jax.random.key(0)).compile()
  compile_s = time.perf_counter() - t
  times = []
  for i in range(args.steps + 1):
    b = make_batch()
    t = time.perf_counter()
    lora, opt_state, m = compiled(lora, opt_state, frozen, b, jax.random.key(i))
    loss = float(m["loss"])  # waits for the step
    if i >= 1:  # the first run warms up allocations
      times.append(time.perf_counter() - t)
  ms = statistics.median(times) * 1e3
  tps = batch * args.seq / (ms / 1e3)
  row = {
    "model": args.shape,
    "mesh": name,
    "mesh_spec": spec,
    "devices": n,
    "batch": batch,
    "seq": args.seq,
    "remat": args.remat,
    "shard_frozen": args.shard_frozen,
    "microbatches": plan.microbatches if plan.stages > 1 else 0,
    "tokens_per_s": tps,
    "tokens_per_s_per_gpu": tps / n,
    "ms_per_step": ms,
    "predicted_bubble": plan.bubble,
    "step_gib": step_gib(compiled),
    "process_peak_gib": process_peak_gib(devices),
    "compile_s": compile_s,
    "loss": loss,
  }
  jax.tree.map(lambda a: a.delete(), (lora, opt_state, frozen))
  return row


def load_host_state(ckpt, args):
  """(graphdef, (lora, frozen) as host numpy): loaded once, placed anew for every mesh."""
  t = time.perf_counter()
  model = jaxtune.from_pretrained(ckpt, quantization="nf4", dtype=args.dtype)
  model = jaxtune.apply_lora(model, rank=16, alpha=16)
  graphdef, lora, frozen = nnx.split(model, nnx.LoRAParam, ...)
  host = jax.device_get((lora, frozen))
  jax.tree.map(lambda a: a.delete(), (lora, frozen))
  print(f"loaded {args.shape} in {time.perf_counter() - t:.1f}s", flush=True)
  return graphdef, host


def main():
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  ap.add_argument("--shape", default="llama-3.1-8b")
  ap.add_argument("--tiny", action="store_true", help="a tiny shape on 8 CPU devices (smoke)")
  ap.add_argument("--meshes", default=",".join(MESHES), help=f"subset of: {', '.join(MESHES)}")
  ap.add_argument("--batch", type=int, default=4, help="sequences per data replica per step")
  ap.add_argument("--seq", type=int, default=2048)
  ap.add_argument("--steps", type=int, default=5, help="timed steps per mesh")
  ap.add_argument("--remat", default="dots_no_batch")
  ap.add_argument("--attention", default=None, help="xla or fused (default: the model's)")
  ap.add_argument("--microbatches", type=int, default=0, help="pipeline; 0: one per sequence")
  ap.add_argument("--shard-frozen", action="store_true", help="NF4 weights split over data")
  ap.add_argument("--dtype", default="bfloat16")
  ap.add_argument("--results-dir", default=None)
  args = ap.parse_args()
  if args.tiny:
    args.shape, args.seq, args.steps = "tiny", min(args.seq, 64), min(args.steps, 2)
    # A smoke run is not a measurement: its rows go to a temporary folder unless asked.
    args.results_dir = args.results_dir or tempfile.mkdtemp(prefix="bench_scaling_tiny.")

  names = [m.strip() for m in args.meshes.split(",") if m.strip()]
  unknown = [m for m in names if m not in MESHES]
  if unknown:
    raise SystemExit(f"unknown mesh {unknown[0]!r}; choose from {', '.join(MESHES)}.")
  if "1" not in names:
    names.insert(0, "1")  # efficiency is against one GPU of the same run
  rows, failed, micro_base = [], [], {}

  def attempt(name, per_replica=None):
    """Time one mesh and append its row; None (and a note) if it fails."""
    try:
      row = time_mesh(name, host, graphdef, cfg, args, per_replica)
    except Exception as e:  # one mesh failing (e.g. out of memory) is a result too
      failed.append(f"{name}: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
      print(f"mesh {name} failed: {failed[-1]}", flush=True)
      return None
    base = rows[0]["tokens_per_s"] if rows else row["tokens_per_s"]
    row["efficiency"] = row["tokens_per_s"] / (row["devices"] * base)
    row["efficiency_vs_bubble"] = row["efficiency"]
    rows.append(row)
    if args.results_dir:  # a run cut short by its time limit keeps what it measured
      with open(Path(args.results_dir) / "scaling_partial.jsonl", "a") as f:
        f.write(json.dumps({k: v for k, v in row.items() if not callable(v)}) + "\n")
    print(
      f"{name} (batch {row['batch']}): {row['tokens_per_s']:.0f} tokens/s, "
      f"{row['ms_per_step']:.1f} ms/step, {row['step_gib']:.2f} GiB, "
      f"compiled in {row['compile_s']:.0f}s",
      flush=True,
    )
    return row

  with tempfile.TemporaryDirectory(dir="/tmp") as tmp:
    if args.tiny:
      ckpt = write_random_checkpoint(Path(tmp) / "tiny", hf_config(TINY))
    else:
      ckpt = write(Path(tmp) / args.shape, args.shape)
    cfg = jaxtune.ModelConfig.from_hf(ckpt)
    graphdef, host = load_host_state(ckpt, args)
    for name in names:
      sizes = meshlib.parse_mesh(MESHES[name], 1)
      need = sizes["data"] * sizes["tensor"] * sizes["pipe"]
      if need > jax.device_count():
        print(f"skip mesh {name}: needs {need} devices, {jax.device_count()} present", flush=True)
        continue
      row = attempt(name)
      if row is None:
        continue
      micro = row["batch"] // sizes["data"] // max(1, row["microbatches"])
      if row["microbatches"] and micro != args.batch and micro not in micro_base:
        # A stage works on micro-batches: its ideal is one GPU at that batch size.
        base_row = attempt("1", micro)
        micro_base[micro] = base_row and base_row["tokens_per_s"]
      ideal = micro_base.get(micro) if row["microbatches"] else None
      ideal = ideal or rows[0]["tokens_per_s"]
      row["efficiency_vs_bubble"] = row["tokens_per_s"] / (row["devices"] * ideal)
      row["efficiency_vs_bubble"] /= 1 - row["predicted_bubble"]
  if not rows:
    raise SystemExit("no mesh ran: " + "; ".join(failed))
  if rows[0]["mesh"] != "1":
    raise SystemExit("the 1-GPU baseline failed, so no efficiency can be given: " + failed[0])
  record(
    "bench_scaling",
    rows,
    f"Scaling of the train step, {args.shape}, seq {args.seq}, NF4 + LoRA r=16 (7 proj), "
    f"{args.batch} sequences per data replica",
    note="efficiency = tokens/s / (GPUs x tokens/s on 1 GPU in the same run); "
    "efficiency_vs_bubble (pipe) = tokens/s / (GPUs x tokens/s on 1 GPU at the micro-batch "
    "size) / (1 - predicted GPipe bubble); step_gib is XLA's "
    "per-GPU plan for the step, process_peak_gib the process's peak so far."
    + "".join(f" Failed: {f}." for f in failed),
    out_dir=args.results_dir,
  )
  print("\n| mesh | GPUs | batch | tokens/s | per GPU | efficiency | bubble | vs bubble | GiB |")
  print("|---|---|---|---|---|---|---|---|---|")
  for r in rows:
    print(
      f"| {r['mesh']} | {r['devices']} | {r['batch']} | {r['tokens_per_s']:.0f} | "
      f"{r['tokens_per_s_per_gpu']:.0f} | {r['efficiency']:.3f} | {r['predicted_bubble']:.3f} | "
      f"{r['efficiency_vs_bubble']:.3f} | {r['step_gib']:.1f} |"
    )


if __name__ == "__main__":
  main()
