"""Peak host memory while loading a checkpoint, against its largest tensor and its total size.

Runs the load in a child process and samples its RSS, so nothing else counts. On CPU the
loaded model itself lives in host memory; its bytes are subtracted to get the loader's own
overhead, which is what must stay near the largest single tensor.

  python experiments/load_memory.py --shape small-500mb
"""

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CHILD = r"""
import gc, json, sys, time
import jax, jax.numpy as jnp, numpy as np
from flax import nnx
import jaxtune
jnp.zeros(1).block_until_ready()
# Load once so the loader's programs are compiled and compile memory is not counted.
model = jaxtune.from_pretrained(sys.argv[1], quantization="nf4", dtype="bfloat16")
jax.block_until_ready(nnx.state(model))
del model
gc.collect()
print("READY", flush=True)
sys.stdin.readline()
t = time.perf_counter()
model = jaxtune.from_pretrained(sys.argv[1], quantization="nf4", dtype="bfloat16")
jax.block_until_ready(nnx.state(model))
dt = time.perf_counter() - t
nbytes = sum(x.nbytes for x in jax.tree.leaves(nnx.state(model)))
print("DONE", json.dumps({"load_s": dt, "model_bytes": nbytes}), flush=True)
sys.stdin.readline()
"""


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--shape", default="small-500mb")
  args = ap.parse_args()
  from experiments.record import record
  from experiments.write_checkpoint import tensor_shapes, write

  with tempfile.TemporaryDirectory() as tmp:
    ckpt = write(Path(tmp) / "ckpt", args.shape, shard_bytes=200 << 20)
    cfg = json.loads((ckpt / "config.json").read_text())
    sizes = [2 * int(__import__("math").prod(s)) for _, s in tensor_shapes(cfg)]
    ckpt_bytes = sum(f.stat().st_size for f in ckpt.glob("*.safetensors"))
    child = subprocess.Popen(
      [sys.executable, "-c", CHILD, str(ckpt)],
      stdin=subprocess.PIPE,
      stdout=subprocess.PIPE,
      text=True,
      env={**__import__("os").environ, "JAX_PLATFORMS": "cpu"},
    )
    assert child.stdout.readline().strip() == "READY"
    proc = psutil.Process(child.pid)
    base = proc.memory_info().rss
    peak = [base]
    done = threading.Event()

    def sample():
      while not done.is_set():
        peak[0] = max(peak[0], proc.memory_info().rss)
        time.sleep(0.002)

    threading.Thread(target=sample, daemon=True).start()
    child.stdin.write("\n")
    child.stdin.flush()
    line = child.stdout.readline()
    done.set()
    after = proc.memory_info().rss
    child.stdin.write("\n")
    child.stdin.flush()
    child.wait()
    info = json.loads(line.split(" ", 1)[1])
  mib = 1 << 20
  row = {
    "model": args.shape,
    "checkpoint_mib": ckpt_bytes / mib,
    "largest_tensor_mib": max(sizes) / mib,
    "nf4_model_mib": info["model_bytes"] / mib,
    "peak_rss_increase_mib": (peak[0] - base) / mib,
    "loader_overhead_mib": (peak[0] - base - info["model_bytes"]) / mib,
    "rss_after_mib": (after - base) / mib,
    "load_s": info["load_s"],
  }
  print(json.dumps(row, indent=1))
  record(
    "load_memory",
    [row],
    "Host memory while loading (from_pretrained, NF4)",
    note="loader_overhead = peak RSS increase during the load minus the loaded model's own bytes "
    "(on CPU the model lives in host RAM); it should stay near largest_tensor, not checkpoint.",
  )


if __name__ == "__main__":
  main()
