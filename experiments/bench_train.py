"""Training-step throughput of QLoRA on full-size shapes, on the GPU it runs on.

For each shape (Llama, Qwen 2.5, Gemma 2: experiments/write_checkpoint.py SHAPES) it writes a
random-weight HF checkpoint to local disk, loads it through the real converter (NF4 on the
GPU), adds LoRA r=16 on all seven projections, and times the jitted train step at seq 2048
for each micro-batch size. In the same run it times a bf16 8192x8192x8192 matmul, the rate
both utilisation figures are quoted against:

  MFU-6N = 6 * all parameters * tokens/s / matmul rate            (the peers' formula)
  MFU-4N = (4 * matmul parameters + attention FLOPs) * tokens/s / matmul rate
           matmul parameters: the seven projections of every layer plus the output head;
           4 = forward 2 + input-gradient 2 (the base is frozen, so no weight gradient);
           attention FLOPs per token (causal, forward + backward) = 12 * heads * head_dim
           * (keys a query sees on average: T/2, fewer on sliding-window layers), summed
           over layers (6 * L * T * heads * head_dim without windows).
Recomputation under remat is not counted as useful work in either.

Each row also has:
  load_s        start of loading the checkpoint to the NF4 model on the device
  first_step_s  start of loading to the first finished optimizer step of this row's setting:
                load + LoRA + (set up, compile and run the first step of this setting); the
                first row measures exactly that, later rows add their own set-up and first
                step to the shape's load (the random checkpoint's writing, write_s, excluded)
  compile_s     compiling the step; step_gib: XLA's memory plan for it
  peak_gib      the process's peak device memory so far (never reset, so over every row
                before it too; batches run in ascending order)
  attention     the implementation timed; --attention default is the model's own choice on
                this device (run.resolve.resolve_attention). Each is first checked against the
                float32 reference (attention_check_rel_err)
  status        ok, oom, error, or skipped (a smaller batch of the same setting ran out of
                memory, or the attention check failed); such rows keep their note in
                ``error`` and no figures

Every row is appended to <results-dir>/train_partial.jsonl when measured (a run cut off by
its time limit keeps them); the table goes to results.jsonl / RESULTS.md at the end.

  python experiments/bench_train.py --shape llama-3.2-1b --results-dir DIR
  python experiments/bench_train.py --shape gemma-2-9b --batches 1,2 --loss-chunk 0,1024
  python experiments/bench_train.py --tiny      # CPU smoke run (tiny Llama, seq 64, 2 steps)
"""

import argparse
import gc
import itertools
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

if "--tiny" in sys.argv and "JAX_PLATFORMS" not in os.environ:  # before jax initialises
  os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flax import nnx  # noqa: E402

import jaxtune  # noqa: E402
from experiments.measure import host_peak, matmul_tflops, reset_host_peak, step_gib  # noqa: E402
from experiments.record import record, run_meta  # noqa: E402
from experiments.write_checkpoint import SHAPES, write  # noqa: E402
from jaxtune.errors import UserError  # noqa: E402
from jaxtune.models import attention  # noqa: E402
from jaxtune.models.config import SLIDING  # noqa: E402
from jaxtune.parallel import runtime
from jaxtune.run import resolve as resolver
from jaxtune.run_config import RunConfig  # noqa: E402
from jaxtune.training import step as trainer_step  # noqa: E402

LORA_RANK = 16


def peak_gib() -> float:
  stats = jax.devices()[0].memory_stats() or {}  # None on CPU
  return stats.get("peak_bytes_in_use", 0) / 2**30


def is_oom(e: Exception) -> bool:
  text = str(e)
  return "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower()


def error_line(e: Exception) -> str:
  lines = str(e).strip().splitlines() or [""]
  return f"{type(e).__name__}: {lines[0][:300]}"


def attention_flops_per_token(cfg, seq: int) -> float:
  """Causal attention, forward + backward (3x forward), averaged over a row of ``seq``."""
  total = 0.0
  for i in range(cfg.num_layers):
    window = cfg.sliding_window if cfg.layer_types and cfg.layer_types[i] == SLIDING else 0
    if window and window < seq:  # every query past the first window sees ``window`` keys
      keys = (window * window / 2 + (seq - window) * window) / seq
    else:
      keys = seq / 2
    total += 12 * cfg.num_heads * cfg.head_dim * keys
  return total


def utilisation(cfg, seq: int, tokens_per_s: float, tflops: float) -> dict:
  matmul_params = cfg.num_layers * sum(o * i for o, i in cfg.linear_shapes().values())
  matmul_params += cfg.vocab_size * cfg.hidden_size
  flops_4n = 4 * matmul_params + attention_flops_per_token(cfg, seq)
  return {
    "mfu_6n": 6 * cfg.num_params() * tokens_per_s / (tflops * 1e12),
    "mfu_4n": flops_4n * tokens_per_s / (tflops * 1e12),
  }


def time_steps(model, b: int, args, setting: dict) -> dict:
  """Median step time of the train step at micro-batch b (compilation excluded)."""
  t_start = time.perf_counter()
  cfg = model.config
  run = RunConfig(
    steps=args.steps, batch_size=b, seq_len=args.seq, lora_rank=LORA_RANK, lora_alpha=LORA_RANK
  )
  rt = runtime.Runtime(
    dtype="bfloat16",
    remat=setting["remat"],
    attention=setting["attention"],
    nf4_matmul=setting["nf4_matmul"],
    loss_chunk=setting["loss_chunk"],
    mlp_chunk=setting["mlp_chunk"],
  )
  graphdef, lora, frozen = trainer_step.place(model, rt)
  # The step donates the adapters: it gets copies, so the model's own survive a failed row.
  lora = jax.tree.map(jnp.copy, lora)
  tx, _ = trainer_step.make_optimizer(run)
  opt_state = tx.init(lora)
  step = trainer_step.make_train_step(graphdef, tx, rt)
  rng = np.random.default_rng(b)

  def make_batch():
    ids = rng.integers(0, cfg.vocab_size, (1, b, args.seq + 1)).astype(np.int32)
    return {
      "input_ids": jnp.asarray(ids[..., :-1]),
      "labels": jnp.asarray(ids[..., 1:]),
      "segment_ids": jnp.ones((1, b, args.seq), jnp.int32),
    }

  batch = make_batch()
  t = time.perf_counter()
  compiled = step.lower(lora, opt_state, frozen, batch, jax.random.key(0)).compile()
  compile_s = time.perf_counter() - t
  times = []
  for i in range(args.steps + 2):
    if i:
      batch = make_batch()
    t = time.perf_counter()
    lora, opt_state, m = compiled(lora, opt_state, frozen, batch, jax.random.key(i))
    loss = float(m["loss"])  # waits for the step
    if i == 0:
      to_first_step_s = time.perf_counter() - t_start
    if i >= 2:  # the first two warm up allocations
      times.append(time.perf_counter() - t)
  ms = statistics.median(times) * 1e3
  tokens_per_s = b * args.seq / (ms / 1e3)
  return {
    "tokens_per_s": tokens_per_s,
    "ms_per_step": ms,
    "peak_gib": peak_gib(),
    "step_gib": step_gib(compiled),
    "compile_s": compile_s,
    "to_first_step_s": to_first_step_s,
    "loss": loss,
  }


def check_attention(cfg, seq: int, impl: str) -> float | None:
  """Relative L2 error of ``impl`` in bf16 against the float32 XLA reference on this model's
  head layout, softcap and (shortened to half the sequence, so it bites) window; None where
  nothing is checked. Over 1e-2 (bf16 rounding is ~3e-3), the implementation is not timed.

  Checked on the op, not through the model: a random-weight model in bf16 amplifies rounding
  over its layers (a 2% relative logits difference over 32 layers was seen), which would
  hide nothing and prove nothing.
  """
  softcap = cfg.attn_logit_softcap
  window = min(cfg.sliding_window, seq // 2) if cfg.has_sliding_layers else 0
  if impl == "xla" or (impl == "cudnn" and (softcap or window)):
    return None  # the reference itself; cuDNN refuses this model (its rows say so)
  keys = jax.random.split(jax.random.key(1), 3)
  q = jax.random.normal(keys[0], (1, seq, cfg.num_heads, cfg.head_dim), jnp.float32)
  k = jax.random.normal(keys[1], (1, seq, cfg.num_kv_heads, cfg.head_dim), jnp.float32)
  v = jax.random.normal(keys[2], (1, seq, cfg.num_kv_heads, cfg.head_dim), jnp.float32)
  kw = dict(segment_ids=jnp.ones((1, seq), jnp.int32), scale=cfg.attention_scale)
  if impl != "cudnn":
    kw.update(window=window, softcap=softcap)
  ref = np.asarray(attention.attention(q, k, v, **kw))
  bf = [x.astype(jnp.bfloat16) for x in (q, k, v)]
  rt = runtime.Runtime(attention=impl)
  got = np.asarray(attention.attention(*bf, **kw, runtime=rt).astype(jnp.float32))
  err = float(np.linalg.norm(got - ref) / np.linalg.norm(ref))
  print(f"attention check: {impl} (bf16) vs xla (fp32), relative L2 error {err:.2e}", flush=True)
  return err


def csv(text: str, kind=str) -> list:
  return [kind(x.strip()) for x in text.split(",") if x.strip()]


def reuse_or_write(path: Path, shape: str) -> Path:
  """The random checkpoint of ``shape`` at ``path``: written unless a finished one is there."""
  if (path / "config.json").is_file():
    return path
  return write(path, shape)


def bench_shape(shape: str, args, rate: float, emit) -> None:
  """Every row of one shape, each passed to ``emit`` as soon as it is measured."""
  batches = sorted(csv(args.batches, int))
  with tempfile.TemporaryDirectory(dir="/tmp") as tmp:
    t = time.perf_counter()
    ckpt = reuse_or_write(Path(args.checkpoint_dir or tmp) / shape, shape)
    write_s = time.perf_counter() - t
    print(f"{shape}: wrote checkpoint in {write_s:.1f}s", flush=True)
    cfg = jaxtune.ModelConfig.from_hf(ckpt)
    for quantization in csv(args.quantization):
      rss0 = reset_host_peak() / 2**30
      t_shape = time.perf_counter()
      model = jaxtune.from_pretrained(
        ckpt, quantization=None if quantization == "none" else quantization, dtype="bfloat16"
      )
      jax.block_until_ready(jax.tree.leaves(nnx.state(model)))
      load_s = time.perf_counter() - t_shape
      model = jaxtune.apply_lora(model, rank=LORA_RANK, alpha=LORA_RANK)
      jax.block_until_ready(jax.tree.leaves(nnx.state(model, nnx.LoRAParam)))
      setup_s = time.perf_counter() - t_shape
      print(f"{shape} {quantization}: loaded in {load_s:.1f}s", flush=True)
      base = {
        "model": shape,
        "seq": args.seq,
        "lora_rank": LORA_RANK,
        "quantization": quantization,
        "write_s": write_s,
        "load_s": load_s,
        "host_rss_before_load_gib": rss0,
        "host_peak_rss_load_gib": host_peak() / 2**30,
        "matmul_tflops": rate,
      }
      checks, refused = {}, {}  # refused: why an implementation is not timed
      impls = []
      for asked in csv(args.attention):
        try:  # what the run would resolve --attention to on this device (default: unset)
          impl, _ = resolver.resolve_attention(
            None if asked == "default" else asked, cfg, dtype="bfloat16", packed=False
          )
        except UserError as e:
          impl, refused[asked] = asked, str(e)
        impls.append(impl)
      impls = list(dict.fromkeys(impls))  # "default" may name one asked for explicitly too
      for impl in impls:
        if impl in refused:
          checks[impl] = None
          continue
        try:
          checks[impl] = check_attention(cfg, args.seq, impl)
        except Exception as e:  # its rows say why; the other implementations still run
          checks[impl], refused[impl] = None, f"attention check failed: {error_line(e)}"
        if checks[impl] is not None and not checks[impl] < 1e-2:
          refused[impl] = f"{impl} differs from the reference by {checks[impl]:.2e}"
      settings = itertools.product(
        impls, csv(args.remat), csv(args.loss_chunk, int), csv(args.nf4_matmul),
        csv(args.mlp_chunk, int),
      )  # fmt: skip
      for impl, remat, loss_chunk, nf4_matmul, mlp_chunk in settings:
        setting = dict(
          attention=impl,
          remat=remat,
          loss_chunk=loss_chunk,
          nf4_matmul=nf4_matmul,
          mlp_chunk=mlp_chunk,
        )
        failed = refused.get(impl)  # once a batch runs out of memory, the larger ones skip
        for b in batches:
          row = {**base, "batch": b, **setting, "attention_check_rel_err": checks[impl]}
          if failed:
            emit({**row, "status": "skipped", "error": failed})
            continue
          figures, status, message = None, "ok", None
          try:
            figures = time_steps(model, b, args, setting)
          except Exception as e:  # a row that fails (out of memory, say) is a result too
            status = "oom" if is_oom(e) else "error"
            message = error_line(e)
          if figures is None:
            gc.collect()  # the failed step's buffers, before the next row
            emit({**row, "status": status, "error": message})
            failed = f"batch {b} ran out of memory" if status == "oom" else None
            continue
          figures["first_step_s"] = setup_s + figures.pop("to_first_step_s")
          figures.update(utilisation(cfg, args.seq, figures["tokens_per_s"], rate))
          emit({**row, "status": "ok", **figures, "error": None})
      del model
      gc.collect()


def main():
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  ap.add_argument(
    "--shape", default=None, help=f"comma-separated, default llama-3.2-1b: {', '.join(SHAPES)}"
  )
  ap.add_argument("--batches", default=None, help="comma-separated micro-batch sizes (1,2,4)")
  ap.add_argument("--seq", type=int, default=2048)
  ap.add_argument("--steps", type=int, default=8, help="timed steps (after 2 warm-up steps)")
  ap.add_argument("--remat", default="activations", help="comma-separated policies")
  ap.add_argument(
    "--attention",
    default="default",
    help="comma-separated: default (the model's choice on this device), xla, fused, pallas",
  )
  ap.add_argument(
    "--loss-chunk", default="0", help="comma-separated loss chunk sizes in tokens (0: off)"
  )
  ap.add_argument(
    "--mlp-chunk", default="0", help="comma-separated MLP chunk sizes in tokens (0: off)"
  )
  ap.add_argument("--quantization", default="nf4", help="comma-separated: nf4, none")
  ap.add_argument("--nf4-matmul", default="auto", help="comma-separated: auto, kernel, xla")
  ap.add_argument("--results-dir", default=None, help="default: experiments/ (--tiny: a temp dir)")
  ap.add_argument("--matmul-n", type=int, default=8192, help="size of the reference matmul")
  ap.add_argument(
    "--checkpoint-dir", default=None, help="keep the random checkpoints here, reusing any found"
  )
  ap.add_argument("--tiny", action="store_true", help="CPU smoke run: tiny-llama, seq 64, 2 steps")
  args = ap.parse_args()
  if args.tiny:
    args.shape, args.batches = args.shape or "tiny-llama", args.batches or "1,2"
    args.seq, args.steps, args.matmul_n = min(args.seq, 64), min(args.steps, 2), 256
    # A smoke run's rows do not belong in experiments/results.jsonl.
    args.results_dir = args.results_dir or tempfile.mkdtemp(prefix="bench_train_tiny.")
  args.shape, args.batches = args.shape or "llama-3.2-1b", args.batches or "1,2,4"
  if args.results_dir:
    Path(args.results_dir).mkdir(parents=True, exist_ok=True)
  shapes = csv(args.shape)
  unknown = [s for s in shapes if s not in SHAPES]
  if unknown:
    raise SystemExit(f"unknown shape {unknown[0]!r}; choose from {', '.join(SHAPES)}.")

  rate = matmul_tflops(args.matmul_n)
  print(f"bf16 matmul {args.matmul_n}^3: {rate:.1f} TFLOP/s", flush=True)
  meta = run_meta("bench_train")
  rows = []

  def emit(row):
    rows.append(row)
    if args.results_dir:  # a run cut short by its time limit keeps what it measured
      with open(Path(args.results_dir) / "train_partial.jsonl", "a") as f:
        f.write(json.dumps({**meta, **row}) + "\n")
    print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)

  for shape in shapes:
    bench_shape(shape, args, rate, emit)

  keys = list(dict.fromkeys(k for r in rows for k in r))  # failed rows lack the figures
  rows = [{k: r.get(k) for k in keys} for r in rows]
  failed = [r for r in rows if r["status"] != "ok"]
  record(
    "bench_train",
    rows,
    f"Training step, {', '.join(shapes)}, seq {args.seq}, NF4 + LoRA r={LORA_RANK} (7 proj)",
    note="peak_gib is the process's peak GPU memory so far (batches run in ascending order), "
    "step_gib XLA's plan for the step; MFU figures against the bf16 matmul rate of the same "
    "run; first_step_s from the start of loading (see the script's docstring)."
    + "".join(f" {r['model']} batch {r['batch']}: {r['status']} ({r['error']})." for r in failed),
    out_dir=args.results_dir,
  )
  print(f"\nrecorded to {args.results_dir or 'experiments/'}")
  print(
    "\n| model | attention | remat | loss chunk | mlp chunk | nf4 matmul | batch | "
    "tokens/s | ms/step | peak GiB | MFU-6N | MFU-4N | load s | first step s |"
  )
  print("|---" * 14 + "|")
  for r in rows:
    setting = (
      f"| {r['model']} | {r['attention']} | {r['remat']} | {r['loss_chunk']} | "
      f"{r.get('mlp_chunk', 0)} | {r['nf4_matmul']} | {r['batch']} "
    )
    if r["status"] != "ok":
      print(setting + f"| {r['status']} | | | | | {r['load_s']:.1f} | |")
      continue
    print(
      setting + f"| {r['tokens_per_s']:.0f} | {r['ms_per_step']:.1f} | {r['peak_gib']:.1f} | "
      f"{r['mfu_6n']:.3f} | {r['mfu_4n']:.3f} | {r['load_s']:.1f} | {r['first_step_s']:.1f} |"
    )


if __name__ == "__main__":
  main()
