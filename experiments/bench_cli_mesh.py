"""The headline command, as a user runs it: `python -m jaxtune.train --mesh M` on one host.

Writes a random-weight HF checkpoint of --shape (with the built-in model's tokenizer) and a
JSONL of synthetic documents of mixed lengths, then runs the CLI once per entry of --runs, each
in a process of its own, exactly as a user would (packing on, the default attention for the
mesh, LoRA r=16 on all seven projections, plus --flags, by default the speed setting
`--remat dots_no_batch`; `--flags=` runs the CLI's own default, `--remat auto`). Per run it
records:

  tokens_per_s      median over the steps after --warmup of the CLI's own tokens/s (global:
                    all rows of the step, over the step's wall time, host batching included)
  peak_gib          the busiest GPU's peak memory (metrics.jsonl's memory_gib, last step)
  load_s            the CLI's "loaded in" figure: safetensors to NF4 on the mesh
  first_step_s      process start to the first finished optimizer step (import, load,
                    compile and one step), read off the progress line as it appears
  efficiency        tokens_per_s / (GPUs x tokens_per_s of the 1-GPU run with the same
                    attention in this script's run; where there is none, the first 1-GPU run)

Every run is one entry of --runs: environment variables (NAME=value) if any, a mesh, then
extra CLI flags, e.g. "1 --attention xla" or "XLA_FLAGS=--xla_dump_to=/tmp/d 2x4"
("BENCH_PROFILE=FILE 1": that run under cProfile, its statistics in FILE).
With --pairs N a second file of N synthetic preference pairs (prompt ~100 tokens, chosen
and rejected ~900 each) is written too; "{pairs}" in an entry stands for its path, e.g.
"1 --method dpo --data={pairs}". With --prompts N, N prompts of ~100 tokens for GRPO,
"{prompts}", e.g. "1 --method grpo --data={prompts} --reward length_penalty --batch-size 8"
(the row then also has the median rollout and update seconds of a step).
Mesh "1" runs on the first GPU only (CUDA_VISIBLE_DEVICES=0) with --base-batch sequences; every
other run takes --batch sequences per step (global), so all multi-GPU runs do the same work.

  python experiments/bench_cli_mesh.py --shape llama-3.1-8b --results-dir $OUT
  python experiments/bench_cli_mesh.py --tiny        # CPU smoke run on 8 fake devices
"""

import argparse
import json
import math
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# NVLink multicast stays off on the lent multi-GPU machines, also in the runs' processes.
MULTICAST_OFF = {
  "NCCL_NVLS_ENABLE": "0",
  "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
  "NVSHMEM_DISABLE_NVLS": "1",
}
DEFAULT_RUNS = "1; 2x4; 8; 1x8; 2x2x2; 1 --attention xla"
TINY = dict(  # CPU smoke shape: 8 heads and 8 KV heads so tensor=8 divides, 4 layers for pipe
  hidden_size=128,
  intermediate_size=256,
  num_hidden_layers=4,
  num_attention_heads=8,
  num_key_value_heads=8,
  head_dim=16,
  vocab_size=512,
  max_position_embeddings=4096,
  tie_word_embeddings=False,
)
START_LINE = re.compile(
  r"(?:(?P<fill>\d+)% tokens|prompts x).*attention (?P<attention>\w+(?: \([\w ]+\))?), "
  r"remat (?P<remat>\w+(?:, loss chunk \d+)?(?:, groups of \d+ layers)?"
  r"(?:, activations kept in the first \d+ layers)?(?:, layers unrolled)?)"
  r"(?: \((?:auto: )?planned (?P<plan>[\d.]+ [GM]iB))?"
  r"[^;]*; loaded in (?P<load>[\d.]+)s(?:, compiled in (?P<compile>[\d.]+)s"
  r"(?P<cached> \(from the compilation cache\))?)?"
)


def write_inputs(
  root: Path,
  shape: str,
  tiny: bool,
  docs: int,
  seed: int = 0,
  bnb_4bit: bool = False,
  positions: int = 0,
):
  """(checkpoint dir, data file): random weights + the built-in tokenizer, mixed-length docs."""
  import numpy as np

  from converters.synthetic import write_random_checkpoint
  from experiments.write_checkpoint import hf_config, write
  from jaxtune.run import default_model

  t = time.perf_counter()
  ckpt = root / shape
  if tiny:
    write_random_checkpoint(ckpt, hf_config(TINY), bnb_4bit=bnb_4bit)
  else:
    write(ckpt, shape, bnb_4bit=bnb_4bit, positions=positions)
  default = default_model.ensure_default_checkpoint()
  for f in default.iterdir():  # the tokenizer files, not the default model's weights/config
    if f.is_file() and f.name != "config.json" and not f.name.endswith(".safetensors"):
      shutil.copy(f, ckpt / f.name)
  print(f"wrote {shape} in {time.perf_counter() - t:.0f}s", flush=True)
  # Words of the bundled dataset, drawn at random into documents of 50 to 2,400 words
  # (log-uniform), so packing has short and long examples to fit together.
  words = _words()
  rng = np.random.default_rng(seed)
  data = root / "docs.jsonl"
  with open(data, "w") as f:
    for _ in range(docs):
      n = int(np.exp(rng.uniform(np.log(50), np.log(2400))))
      f.write(json.dumps({"text": " ".join(rng.choice(words, n))}) + "\n")
  return ckpt, data


def _ms_per_step(steps: list, args, batch: int, timed: list) -> float | None:
  """The median step time: rollout + update where the run generates (GRPO), else the packed
  tokens of a step over its tokens/s (None without a set --seq)."""
  later = [r for r in steps if r["step"] > args.warmup]
  if later and all("rollout_s" in r and "update_s" in r for r in later):
    return 1e3 * statistics.median(r["rollout_s"] + r["update_s"] for r in later)
  return 1e3 * batch * args.seq / statistics.median(timed) if args.seq else None


def _words():
  """Every word of the bundled dataset's messages, as a numpy array."""
  import numpy as np

  from jaxtune.run import default_model

  text = " ".join(
    m["content"]
    for line in default_model.DATASET.read_text().splitlines()
    for m in json.loads(line).get("messages", [])
  )
  return np.asarray(text.split())


def write_pairs(root: Path, n: int, seed: int = 1) -> Path:
  """n preference pairs of the bundled dataset's words: a prompt of 60-80 words, chosen and
  rejected responses of 600-680 words each (about 1,000 tokens a side with the built-in
  tokenizer, so a pair fills most of a 2,048-token row)."""
  import numpy as np

  words = _words()
  rng = np.random.default_rng(seed)
  path = root / "pairs.jsonl"
  with open(path, "w") as f:
    for _ in range(n):
      prompt = " ".join(rng.choice(words, rng.integers(60, 81)))
      sides = [" " + " ".join(rng.choice(words, rng.integers(600, 681))) for _ in range(2)]
      f.write(json.dumps({"prompt": prompt, "chosen": sides[0], "rejected": sides[1]}) + "\n")
  return path


def write_prompts(root: Path, n: int, seed: int = 2) -> Path:
  """n prompts of 60-80 words of the bundled dataset (about 100 tokens each)."""
  import numpy as np

  words = _words()
  rng = np.random.default_rng(seed)
  path = root / "prompts.jsonl"
  with open(path, "w") as f:
    for _ in range(n):
      f.write(json.dumps({"prompt": " ".join(rng.choice(words, rng.integers(60, 81)))}) + "\n")
  return path


def run_cli(entry: str, ckpt: Path, data: Path, out: Path, args) -> dict:
  """One CLI run; returns its row (raises RuntimeError with the CLI's last lines if it fails)."""
  words = shlex.split(entry)
  run_env = {}
  while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):
    name, value = words.pop(0).split("=", 1)
    run_env[name] = value
  if not words:
    raise RuntimeError(f"run {entry!r} names no mesh")
  mesh, *extra = words
  for key, path in (("{pairs}", args.pairs_path), ("{prompts}", args.prompts_path)):
    if path is not None:
      extra = [w.replace(key, str(path)) for w in extra]
  single = mesh == "1"
  batch = args.base_batch if single else args.batch
  # BENCH_PROFILE=FILE (in the entry): the run under cProfile, its statistics written to FILE.
  profile = run_env.pop("BENCH_PROFILE", None)
  cmd = [
    sys.executable,
    *(["-m", "cProfile", "-o", profile] if profile else []),
    "-m",
    "jaxtune.train",
    f"--model={ckpt}",
    f"--data={data}",
    f"--out={out}",
    f"--mesh={mesh}",
    f"--steps={args.steps}",
    f"--batch-size={batch}",
    *([f"--seq-len={args.seq}"] if args.seq else []),
    "--log-every=1",
    f"--save-every={args.steps}",
    "--export=none",
    *shlex.split(args.flags),
    *extra,
  ]
  path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
  env = {**os.environ, **MULTICAST_OFF, "PYTHONPATH": path, **run_env}
  if single and not args.tiny:
    env["CUDA_VISIBLE_DEVICES"] = "0"
  if args.tiny:
    env["JAX_PLATFORMS"] = "cpu"
    n = 1 if single else 8
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={n}"
  print("$ " + " ".join(shlex.quote(c) for c in cmd), flush=True)
  t0 = time.perf_counter()
  proc = subprocess.Popen(
    cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
  )
  lines, timed_lines, first_step = [], [], []

  def read():
    for line in proc.stdout:
      lines.append(line.rstrip())
      timed_lines.append(f"[{time.perf_counter() - t0:6.1f}s] {line.rstrip()}")
      if not first_step and line.startswith("step 1/"):
        first_step.append(time.perf_counter() - t0)
      if line.startswith(("jaxtune:", "pipeline:", "error", "step")):
        print("  " + line.rstrip(), flush=True)

  reader = threading.Thread(target=read, daemon=True)
  reader.start()
  try:
    rc = proc.wait(timeout=args.run_timeout)
  except subprocess.TimeoutExpired:
    proc.kill()
    rc = "timeout"
  reader.join(timeout=10)
  wall = time.perf_counter() - t0
  if args.results_dir:  # the whole output of every run, kept beside the rows
    log = entry + "\n" + "\n".join(timed_lines) + "\n"
    Path(args.results_dir, f"{out.name}.log").write_text(log)
  if rc != 0:
    raise RuntimeError(f"exit {rc} after {wall:.0f}s: " + " | ".join(lines[-4:])[-600:])
  start = next((m for m in map(START_LINE.search, lines) if m), None)
  metrics = [json.loads(s) for s in (out / "metrics.jsonl").read_text().splitlines()]
  steps = [r for r in metrics if "tokens_per_s" in r]
  timed = [r["tokens_per_s"] for r in steps if r["step"] > args.warmup]
  if not timed:
    raise RuntimeError(f"no step after the {args.warmup} warm-up steps; raise --steps")
  from jaxtune.parallel import mesh as meshlib

  sizes = meshlib.parse_mesh(mesh, 1 if single else args.devices)
  devices = math.prod(sizes.values())
  return {
    "mesh": mesh,
    "flags": " ".join([*(f"{k}={v}" for k, v in run_env.items()), *extra]),
    "devices": devices,
    "batch": batch,
    "seq": args.seq or None,
    "attention": start and start["attention"],
    "packing_fill": start and start["fill"] and int(start["fill"]) / 100,
    "tokens_per_s": statistics.median(timed),
    "tokens_per_s_per_gpu": statistics.median(timed) / devices,
    "ms_per_step": _ms_per_step(steps, args, batch, timed),
    "peak_gib": steps[-1].get("memory_gib"),
    "load_s": start and float(start["load"]),
    "remat": start and start["remat"],
    "planned": start and start["plan"],
    "compile_s": start and start["compile"] and float(start["compile"]),
    "compile_cached": bool(start and start["cached"]),
    "first_step_s": first_step[0] if first_step else None,
    "wall_s": wall,
    "loss_first": steps[0]["loss"],
    "loss_last": steps[-1]["loss"],
    "timed_steps": len(timed),
    **{
      f"{k}_median": statistics.median(r[k] for r in steps if r["step"] > args.warmup)
      for k in ("rollout_s", "update_s", "rollout_tokens_per_s")
      if all(k in r for r in steps)
    },
  }


def main():
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  ap.add_argument("--shape", default="llama-3.1-8b")
  ap.add_argument("--tiny", action="store_true", help="a tiny shape on 8 CPU devices (smoke)")
  ap.add_argument("--runs", default=DEFAULT_RUNS, help="';'-separated: MESH [extra CLI flags]")
  ap.add_argument("--flags", default="--remat dots_no_batch", help="CLI flags for every run")
  ap.add_argument("--batch", type=int, default=32, help="global sequences per step, multi-GPU")
  ap.add_argument("--base-batch", type=int, default=4, help="sequences per step on 1 GPU")
  ap.add_argument("--seq", type=int, default=2048, help="--seq-len; 0: the run chooses")
  ap.add_argument("--steps", type=int, default=12)
  ap.add_argument("--warmup", type=int, default=2, help="steps left out of the median")
  ap.add_argument("--docs", type=int, default=3000, help="documents in the synthetic data")
  ap.add_argument("--run-timeout", type=float, default=240, help="seconds per CLI run")
  ap.add_argument("--results-dir", default=None)
  ap.add_argument("--bnb-4bit", action="store_true", help="write the checkpoint as *-bnb-4bit")
  ap.add_argument("--pairs", type=int, default=0, help="also write N preference pairs ({pairs})")
  ap.add_argument("--prompts", type=int, default=0, help="also write N GRPO prompts ({prompts})")
  args = ap.parse_args()
  if args.tiny:
    args.shape, args.steps, args.batch, args.docs = "tiny", 4, 8, 200
    args.seq = 128 if args.seq else 0
    args.warmup = 1
    # A smoke run is not a measurement: its rows go to a temporary folder unless asked.
    args.results_dir = args.results_dir or tempfile.mkdtemp(prefix="bench_cli_mesh_tiny.")
  from experiments.record import record

  if args.tiny:
    args.devices, device = 8, "cpu"
  else:  # not through JAX: this process must leave the GPUs' memory to the runs
    names = subprocess.run(
      ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
      capture_output=True,
      text=True,
      check=True,
    ).stdout.split("\n")
    names = [n.strip() for n in names if n.strip()]
    args.devices, device = len(names), f"{len(names)} x {names[0]}"
  results = Path(args.results_dir) if args.results_dir else None
  if results:
    results.mkdir(parents=True, exist_ok=True)
  rows, failed = [], []
  with tempfile.TemporaryDirectory(dir="/tmp") as tmp:
    ckpt, data = write_inputs(
      Path(tmp), args.shape, args.tiny, args.docs, bnb_4bit=args.bnb_4bit, positions=args.seq
    )
    args.pairs_path = write_pairs(Path(tmp), args.pairs) if args.pairs else None
    args.prompts_path = write_prompts(Path(tmp), args.prompts) if args.prompts else None
    for i, entry in enumerate(e.strip() for e in args.runs.split(";") if e.strip()):
      try:
        row = run_cli(entry, ckpt, data, Path(tmp) / f"run{i}", args)
      except RuntimeError as e:
        failed.append(f"{entry}: {e}")
        print(f"run {entry!r} failed: {e}", flush=True)
        continue
      rows.append(row)
      print(
        f"-> {entry}: {row['tokens_per_s']:.0f} tokens/s, {row['peak_gib']} GiB peak, "
        f"load {row['load_s']}s, first step after {row['first_step_s']:.0f}s",
        flush=True,
      )
      if results:  # a call cut short by its time limit keeps what it measured
        with open(results / "cli_mesh_partial.jsonl", "a") as f:
          f.write(json.dumps(row) + "\n")
  if not rows:
    raise SystemExit("no run finished: " + "; ".join(failed))
  bases = {}
  for r in rows:
    if r["devices"] == 1:
      bases.setdefault(r["attention"], r["tokens_per_s"])
  first_base = next((r["tokens_per_s"] for r in rows if r["devices"] == 1), None)
  for r in rows:
    base = bases.get(r["attention"], first_base)
    r["efficiency"] = base and r["tokens_per_s"] / (r["devices"] * base)
  record(
    "bench_cli_mesh",
    rows,
    f"`python -m jaxtune.train --mesh M` on {device}, {args.shape}, seq {args.seq}, "
    f"global batch {args.batch} ({args.base_batch} on 1 GPU)",
    note="Each row is one CLI process (packing on, default attention for the mesh, LoRA r=16 "
    f"x 7, `{args.flags}` plus the row's flags). tokens_per_s: median of the CLI's per-step "
    "figure after "
    f"{args.warmup} warm-up steps; efficiency: tokens/s / (GPUs x 1-GPU tokens/s with the same "
    "attention, this run); peak_gib: busiest GPU; first_step_s: process start to first step."
    + "".join(f" Failed: {f}." for f in failed),
    out_dir=results,
    device=device,
  )
  print(
    "\n| run | GPUs | batch | attention | remat (plan) | tokens/s | efficiency | peak GiB | "
    "load s | compile s | 1st step s |"
  )
  print("|---|---|---|---|---|---|---|---|---|---|---|")
  for r in rows:
    eff = f"{r['efficiency']:.3f}" if r["efficiency"] else "-"
    cached = " (cache)" if r["compile_cached"] else ""
    print(
      f"| {r['mesh']} {r['flags']} | {r['devices']} | {r['batch']} | {r['attention']} | "
      f"{r['remat']} ({r['planned']}) | {r['tokens_per_s']:.0f} | {eff} | "
      f"{r['peak_gib'] or 0:.1f} | {r['load_s']} | {r['compile_s']}{cached} | "
      f"{r['first_step_s']:.0f} |"
    )


if __name__ == "__main__":
  main()
