"""The longest sequence (batch 1) that trains on one GPU, per remat policy.

Each trial is a fresh subprocess (an out-of-memory can leave a JAX process unusable) that
builds the model of the shape with random NF4 weights directly on the device (writing and
loading the 8B checkpoint would take over a minute per trial; the model, its layers and
kernels are the ones a loaded checkpoint gets), adds LoRA r=16 on all seven projections,
compiles the real train step (step.make_train_step, AdamW, --loss-chunk) at seq T and
runs --steps steps of it.

Search, per remat policy: start at --start, double while the trial trains (up to --cap),
halve while it does not; then bisect between the longest that trained and the shortest that
did not, to --granularity tokens. The whole search keeps to --budget-s (default 540 s, so a
run fits a 10-minute command): each policy gets an equal share of what is left, unused time
passes on, and a trial's timeout is the smaller of --trial-timeout and its policy's time left.
A trial killed by its timeout ("timeout", with the phase it reached: a step that started
running has passed the allocation, so it most likely fits) bounds the search like a failure,
so max_seq is always a length that finished a step. For the longest lengths, run one policy
per command (--remat offload) to give it the whole budget.

Rows (one per trial): seq, status (ok, oom, error, timeout, crash), step_s, tokens_per_s,
peak_gib (device peak of the trial's process), step_gib (XLA's plan), compile_s, trial_s.
Summary rows: max_seq per policy and the shortest failure above it. Trials are appended to
<results-dir>/max_context_partial.jsonl as they finish.

  python experiments/max_context.py --results-dir $OUT                  # llama-3.1-8b
  python experiments/max_context.py --remat offload --results-dir $OUT  # one policy, 540 s
  python experiments/max_context.py --tiny     # CPU smoke run (tiny-llama, 64..256 tokens)
  python experiments/max_context.py --context 4 --remat offload  # the sequence over 4 GPUs

--context C: each sequence split over the first C devices (a ``context`` mesh axis, ring
attention, zigzag layout, as ``--mesh context=C`` trains); peak_gib is the busiest device's.
"""

import argparse
import functools
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if "--tiny" in sys.argv and "JAX_PLATFORMS" not in os.environ:  # inherited by the trials
  os.environ["JAX_PLATFORMS"] = "cpu"

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# The parent never starts JAX on a device (the GPU's memory is its trials'); it passes the
# device name the trials report to record().
from experiments.record import record, run_meta  # noqa: E402
from experiments.write_checkpoint import SHAPES, hf_config  # noqa: E402

LORA_RANK = 16
TRIAL = "TRIAL "  # prefix of the trial's JSON lines on its stdout


def random_nf4_model(cfg, seed: int = 0):
  """The NF4 model of ``cfg`` on the default device, random weights, no checkpoint.

  The decoder builds its NF4 storage as zeros for a checkpoint to fill; here each Linear
  gets random 4-bit codes and absmax codes, with scales near those of a normal weight of
  std in_features**-0.5 (block absmax about 2.4 std), so the numbers stay finite.
  """
  import jax.numpy as jnp
  from flax import nnx

  from jaxtune.models.decoder import Decoder
  from jaxtune.models.lora import iter_linears

  model = Decoder(cfg, quantized=True, dtype=jnp.bfloat16, rngs=nnx.Rngs(seed))
  for i, (_, linear) in enumerate(iter_linears(model)):
    if not linear.quantized:
      continue
    absmax = 2.4 * linear.in_features**-0.5
    linear.codes.set_value(_random_bytes(linear.codes[...], 2 * i + seed))
    linear.absmax.set_value(_random_bytes(linear.absmax[...], 2 * i + 1 + seed))
    # absmax = dynamic map value in [-1, 1] * nested + offset, within [0.5, 1.5] * absmax.
    linear.nested_absmax.set_value(jnp.full(linear.nested_absmax.shape, absmax / 2, jnp.float32))
    linear.offset.set_value(jnp.full(linear.offset.shape, absmax, jnp.float32))
  return model


def _random_bytes(old, seed: int):
  """Pseudo-random uint8 in place of ``old`` (donated, so no second copy of a 70B model's
  9.4 GB code arrays exists): an integer hash of each element's index and ``seed``, computed
  in one elementwise kernel (jax.random.bits in uint8 makes 32-bit values first)."""
  import jax
  import jax.numpy as jnp

  @functools.partial(jax.jit, donate_argnums=0)
  def fill(old, seed):
    h = jnp.zeros(old.shape, jnp.uint32) + seed.astype(jnp.uint32) * jnp.uint32(0x9E3779B9)
    for axis in range(old.ndim):
      h = (h + jax.lax.broadcasted_iota(jnp.uint32, old.shape, axis)) * jnp.uint32(0x85EBCA77)
      h = h ^ (h >> 13)
    h = (h ^ (h >> 16)) * jnp.uint32(0xC2B2AE3D)
    return (h >> 24).astype(jnp.uint8)

  return fill(old, jnp.uint32(seed))


def _peak_gib(devices: int) -> float:
  """The busiest of the trial's first ``devices`` devices: its peak bytes in use, in GiB."""
  import jax

  stats = [d.memory_stats() or {} for d in jax.devices()[:devices]]
  return max(s.get("peak_bytes_in_use", 0) for s in stats) / 2**30


def run_trial(args) -> None:
  """One trial (in its own process): build, compile and run the step at --trial-seq."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  import jaxtune
  from jaxtune.parallel import mesh as meshlib
  from jaxtune.parallel import ring_attention as context
  from jaxtune.parallel import runtime
  from jaxtune.run import resolve as resolver
  from jaxtune.run_config import RunConfig
  from jaxtune.training import step as trainer

  def say(**fields):
    print(TRIAL + json.dumps(fields), flush=True)

  seq, t0 = args.trial_seq, time.perf_counter()
  device = jax.devices()[0]
  stats = device.memory_stats() or {}
  say(
    phase="start",
    device=getattr(device, "device_kind", device.platform),
    device_memory_gib=stats.get("bytes_limit", 0) / 2**30,
  )
  try:
    cfg = jaxtune.ModelConfig.from_hf(hf_config(SHAPES[args.shape]))
    model = jaxtune.apply_lora(random_nf4_model(cfg), rank=LORA_RANK, alpha=LORA_RANK)
    asked = None if args.attention == "default" else args.attention
    impl, _ = resolver.resolve_attention(asked, cfg, dtype="bfloat16", packed=False)
    mesh, blocks, chunks = None, "xla", (args.loss_chunk, args.mlp_chunk)
    if args.context > 1:  # the sequence split over the first --context devices, ring attention
      mesh = meshlib.make_mesh(f"context={args.context}", jax.devices()[: args.context])
      impl = "ring"  # its blocks as a run resolves them (the flash kernel on Hopper)
      blocks, _ = resolver.resolve_ring_blocks(
        asked, cfg, dtype="bfloat16", device=jax.devices()[0]
      )
      chunks = (0, 0)  # pieces of the loss or MLP would gather the sequence (a run refuses them)
    rt = runtime.Runtime(
      mesh=mesh, dtype="bfloat16", remat=args.remat, attention=impl, ring_blocks=blocks,
      loss_chunk=chunks[0], mlp_chunk=chunks[1], remat_group=args.remat_group,
    )  # fmt: skip
    graphdef, lora, frozen = trainer.place(model, rt)
    del model
    run = RunConfig(steps=args.steps, batch_size=1, seq_len=seq, lora_rank=LORA_RANK)
    tx, _ = trainer.make_optimizer(run)
    opt_state = tx.init(lora)
    step = trainer.make_train_step(graphdef, tx, rt)
    rng = np.random.default_rng(0)
    ids = rng.integers(0, cfg.vocab_size, (1, 1, seq + 1)).astype(np.int32)
    host = {
      "input_ids": ids[..., :-1],
      "labels": ids[..., 1:],
      "segment_ids": np.ones((1, 1, seq), np.int32),
    }
    host = context.zigzag_batch(host, args.context, 2)  # as the trainer lays a row out
    at = rt.sharding("accum", "batch", "length")
    batch = {k: jnp.asarray(v) if at is None else jax.device_put(v, at) for k, v in host.items()}
    jax.block_until_ready((jax.tree.leaves(frozen), batch))
    say(phase="built", attention=impl, ring_blocks=blocks, build_s=time.perf_counter() - t0)
    t = time.perf_counter()
    compiled = step.lower(lora, opt_state, frozen, batch, jax.random.key(0)).compile()
    m = compiled.memory_analysis()
    step_gib = None
    if m is not None:
      planned = m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
      step_gib = (planned - m.alias_size_in_bytes) / 2**30
    say(phase="compiled", compile_s=time.perf_counter() - t, step_gib=step_gib)
    for i in range(args.steps):
      say(phase="running", step=i)
      t = time.perf_counter()
      lora, opt_state, metrics = compiled(lora, opt_state, frozen, batch, jax.random.key(i))
      loss = float(metrics["loss"])  # waits for the step
      step_s = time.perf_counter() - t
    peak = _peak_gib(args.context)
    say(phase="done", status="ok", step_s=step_s, loss=loss, peak_gib=peak)
  except Exception as e:  # the parent records it; an out-of-memory is the expected answer
    text = str(e)
    oom = "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower()
    first = (text.strip().splitlines() or [""])[0][:300]
    peak = _peak_gib(args.context)
    say(phase="failed", status="oom" if oom else "error", error=f"{type(e).__name__}: {first}",
        peak_gib=peak)  # fmt: skip


def launch(args, seq: int, remat: str, timeout: float) -> dict:
  """Run one trial in a subprocess; its fields merged, plus status, trial_s and phase."""
  cmd = [
    sys.executable,
    str(Path(__file__).resolve()),
    *("--trial-seq", str(seq), "--remat", remat, "--shape", args.shape),
    *("--loss-chunk", str(args.loss_chunk), "--attention", args.attention),
    *("--mlp-chunk", str(args.mlp_chunk), "--remat-group", str(args.remat_group)),
    *("--steps", str(args.steps), "--context", str(args.context)),
  ]
  env = dict(os.environ)
  env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", str(args.mem_fraction))
  t = time.perf_counter()
  with tempfile.TemporaryFile("w+") as out:
    # Its own session, so a timeout ends the trial and anything it started, and nothing else.
    proc = subprocess.Popen(
      cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
    )
    try:
      code = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
      os.killpg(proc.pid, signal.SIGKILL)
      proc.wait()
      code = None
    out.seek(0)
    lines = out.read().splitlines()
  fields: dict = {}
  for line in lines:
    if line.startswith(TRIAL):
      try:
        fields.update(json.loads(line[len(TRIAL) :]))
      except json.JSONDecodeError:  # a line cut by the kill or mixed with stderr
        pass
  fields["trial_s"] = time.perf_counter() - t
  if code is None:
    fields.update(status="timeout", error=f"killed after {timeout:.0f}s in {fields.get('phase')}")
  elif "status" not in fields:  # died without a word: a crash (or the host's OOM killer)
    tail = " | ".join(lines[-3:])[-300:]
    oom = "RESOURCE_EXHAUSTED" in tail or "out of memory" in tail.lower() or code == -9
    fields.update(status="oom" if oom else "crash", error=f"exit {code}: {tail}")
  return fields


def trial_row(args, seq: int, remat: str, fields: dict) -> dict:
  step_s = fields.get("step_s")
  return {
    "model": args.shape,
    "batch": 1,
    "context": args.context,
    "seq": seq,
    "remat": remat,
    "loss_chunk": args.loss_chunk,
    "mlp_chunk": args.mlp_chunk,
    "remat_group": args.remat_group,
    "attention": fields.get("attention", args.attention),
    "status": fields["status"],
    "step_s": step_s,
    "tokens_per_s": seq / step_s if step_s else None,
    "loss": fields.get("loss"),
    "peak_gib": fields.get("peak_gib"),
    "step_gib": fields.get("step_gib"),
    "device_memory_gib": fields.get("device_memory_gib"),
    "compile_s": fields.get("compile_s"),
    "trial_s": fields["trial_s"],
    "phase": fields.get("phase"),
    "error": fields.get("error"),
  }


def search(trial, start: int, cap: int, granularity: int, time_left) -> tuple[int, int | None]:
  """(longest seq that trained or 0, shortest that did not above it or None).

  ``trial(seq) -> bool``; ``time_left()`` > 0 while another trial may start. Doubles from
  ``start`` to ``cap`` while trials pass, halves while they fail, then bisects to
  ``granularity`` (every length tried is a multiple of it).
  """
  lo, hi = 0, None
  seq = start
  while time_left() > 0:
    if trial(seq):
      lo = seq
      if hi is not None or seq >= cap:
        break
      seq = min(2 * seq, cap)
    else:
      hi = seq
      if lo or seq <= granularity:
        break
      seq = max(granularity, seq // 2 // granularity * granularity)
  while hi is not None and lo and hi - lo > granularity and time_left() > 0:
    mid = (lo + hi) // 2 // granularity * granularity
    if trial(mid):
      lo = mid
    else:
      hi = mid
  return lo, hi


def main():
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  ap.add_argument("--shape", default=None, help=f"default llama-3.1-8b; one of {', '.join(SHAPES)}")
  ap.add_argument("--remat", default="offload,full", help="comma-separated remat policies")
  ap.add_argument("--loss-chunk", type=int, default=1024, help="tokens per loss piece (0: off)")
  ap.add_argument("--mlp-chunk", type=int, default=0, help="tokens per MLP piece (0: off)")
  ap.add_argument(
    "--remat-group", type=int, default=1, help="layers per kept input (--remat-group)"
  )
  ap.add_argument(
    "--attention", default="default", help="default (the model's choice), xla, fused, pallas"
  )
  ap.add_argument("--start", type=int, default=65536)
  ap.add_argument("--cap", type=int, default=524288)
  ap.add_argument("--granularity", type=int, default=8192)
  ap.add_argument("--steps", type=int, default=1, help="train steps per trial (the last timed)")
  ap.add_argument("--trial-timeout", type=float, default=420, help="seconds, at most, per trial")
  ap.add_argument("--budget-s", type=float, default=540, help="seconds for the whole search")
  ap.add_argument("--min-trial-s", type=float, default=30, help="start no trial with less left")
  ap.add_argument("--mem-fraction", type=float, default=0.95, help="of GPU memory JAX may use")
  ap.add_argument("--results-dir", default=None, help="default: experiments/ (--tiny: a temp dir)")
  ap.add_argument("--tiny", action="store_true", help="CPU smoke run: tiny-llama, 64..256 tokens")
  ap.add_argument(
    "--context", type=int, default=1, help="split each sequence over this many devices (ring)"
  )
  ap.add_argument("--trial-seq", type=int, default=None, help=argparse.SUPPRESS)  # a trial
  args = ap.parse_args()
  if "offload" in args.remat.split(","):  # as the CLI does: trials inherit the environment
    from jaxtune.run_config import RunConfig
    from jaxtune.train import allow_host_memory_for_offload

    allow_host_memory_for_offload(RunConfig(remat="offload"))
  if args.tiny:
    if args.context > 1:  # trials inherit this: that many CPU devices
      os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={args.context}"
    args.shape = args.shape or "tiny-llama"
    args.start, args.cap, args.granularity, args.loss_chunk = 64, 256, 32, 16
    args.min_trial_s = min(args.min_trial_s, 5)
    args.results_dir = args.results_dir or tempfile.mkdtemp(prefix="max_context_tiny.")
  args.shape = args.shape or "llama-3.1-8b"
  if args.shape not in SHAPES:
    raise SystemExit(f"unknown shape {args.shape!r}; choose from {', '.join(SHAPES)}.")
  if args.trial_seq is not None:
    run_trial(args)
    return
  if args.start % args.granularity or args.cap % args.granularity:
    raise SystemExit("--start and --cap must be multiples of --granularity.")
  if args.results_dir:
    Path(args.results_dir).mkdir(parents=True, exist_ok=True)

  t_start = time.perf_counter()
  deadline = t_start + args.budget_s
  remats = [r.strip() for r in args.remat.split(",") if r.strip()]
  trials, summary, device = [], [], {"name": None}
  for n, remat in enumerate(remats):
    share_end = time.perf_counter() + (deadline - time.perf_counter()) / (len(remats) - n)
    time_left = lambda end=share_end: end - time.perf_counter() - args.min_trial_s  # noqa: E731
    t_policy = time.perf_counter()
    statuses = {}

    def trial(seq, remat=remat, share_end=share_end, statuses=statuses):
      fields = launch(args, seq, remat, min(args.trial_timeout, share_end - time.perf_counter()))
      device["name"] = fields.get("device") or device.get("name")
      row = trial_row(args, seq, remat, fields)
      trials.append(row)
      statuses[seq] = row["status"]
      if args.results_dir:  # a run cut short keeps the trials it finished
        meta = run_meta("max_context_trial", device["name"] or "unknown")
        with open(Path(args.results_dir) / "max_context_partial.jsonl", "a") as f:
          f.write(json.dumps({**meta, **row}) + "\n")
      print({k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()}, flush=True)
      return row["status"] == "ok"

    lo, hi = search(trial, args.start, args.cap, args.granularity, time_left)
    # A timeout bounds the search but proves nothing about memory.
    bounded = hi is not None and hi - lo <= args.granularity and statuses[hi] != "timeout"
    resolved = bounded or lo >= args.cap
    summary.append(
      {
        "model": args.shape,
        "batch": 1,
        "context": args.context,
        "remat": remat,
        "loss_chunk": args.loss_chunk,
        "mlp_chunk": args.mlp_chunk,
        "remat_group": args.remat_group,
        "attention": next((r["attention"] for r in trials if r["remat"] == remat), None),
        "max_seq": lo,
        "first_failed_seq": hi,
        "first_failed_status": statuses.get(hi),
        "resolved": resolved,
        "granularity": args.granularity,
        "cap": args.cap,
        "trials": len(statuses),
        "search_s": time.perf_counter() - t_policy,
      }
    )
    print(summary[-1], flush=True)

  name = device["name"] or "unknown"
  setting = (
    f"{args.shape}, batch 1, NF4 + LoRA r={LORA_RANK} (7 proj), loss chunk {args.loss_chunk}"
  )
  fraction = os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", args.mem_fraction)
  note = (
    f"Each trial a fresh process, random NF4 weights built on the device, {args.steps} real "
    f"train step(s); XLA_PYTHON_CLIENT_MEM_FRACTION={fraction}. timeout: killed by the "
    "per-trial limit (phase running: the step had started, past its allocation)."
  )
  if trials:
    record("max_context_trial", trials, f"Max context trials, {setting}", note,
           args.results_dir, device=name)  # fmt: skip
  record(
    "max_context",
    summary,
    f"Longest trainable sequence on one GPU, {setting}",
    "max_seq: the longest that finished its step(s); first_failed_seq: the shortest that did "
    "not, above it (None: none up to the cap); resolved: the two are within the granularity "
    "and that one failed for memory or an error, not the timeout (or the cap trained). " + note,
    args.results_dir,
    device=name,
  )
  print(f"\nrecorded to {args.results_dir or 'experiments/'}")
  print("\n| remat | max seq | first failed | status | resolved | trials | search s |")
  print("|---|---|---|---|---|---|---|")
  for s in summary:
    print(
      f"| {s['remat']} | {s['max_seq']} | {s['first_failed_seq']} | {s['first_failed_status']} "
      f"| {s['resolved']} | {s['trials']} | {s['search_s']:.0f} |"
    )


if __name__ == "__main__":
  main()
