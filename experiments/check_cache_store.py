"""Does a program JAX read back from its persistent compilation cache survive being
serialized again (the step store's format) and loaded in a fresh process? On XLA:CPU
(jax 0.11.2) it does not: the loaded program fails when it runs ("Function ... not found"),
so compile_cache.StepStore skips such programs (compile_cache.FROM_CACHE) on every backend.
This checks the GPU, with the Mosaic GPU flash attention of check_step_store.py and an XLA MLP step.

  python experiments/check_cache_store.py --results-dir DIR
Three children share one cache directory: (1) compiles and runs, filling the cache; (2)
compiles each program again (a cache hit, counted) and, as the control, once more with the
cache off (no hit), serializes both and keeps their outputs; (3) imports
jax.experimental.mosaic.gpu first (as _StepStore.load does), then loads each and runs it.
Prints and records, per program and compile, whether it loaded, whether it ran, and the
largest difference of (3)'s output against (2)'s.
"""

import argparse
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def programs():
  import jax
  import jax.numpy as jnp

  from experiments import check_step_store

  def mlp_step(w1, w2, x):
    def loss(ws):
      h = jax.nn.gelu(x @ ws[0])
      return jnp.mean((h @ ws[1]).astype(jnp.float32) ** 2)

    g = jax.grad(loss)((w1, w2))
    return w1 - 1e-3 * g[0], w2 - 1e-3 * g[1]

  keys = jax.random.split(jax.random.key(1), 3)
  mlp_args = [jax.random.normal(keys[0], (1024, 4096), "bfloat16"),
              jax.random.normal(keys[1], (4096, 1024), "bfloat16"),
              jax.random.normal(keys[2], (512, 1024), "bfloat16")]  # fmt: skip
  return {
    "flash (mosaic gpu)": (check_step_store.program(), check_step_store.inputs()),
    "mlp step (xla)": (jax.jit(mlp_step), mlp_args),
  }


def child(stage: str, cache: str, blob_path: str) -> None:
  import jax
  from jax.experimental import serialize_executable

  jax.config.update("jax_compilation_cache_dir", cache)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
  hits = [0]

  def listen(event, **kwargs):
    if event == "/jax/compilation_cache/cache_hits":
      hits[0] += 1

  jax.monitoring.register_event_listener(listen)
  if stage == "load":
    import importlib

    importlib.import_module("jax.experimental.mosaic.gpu")  # as _StepStore.load
    saved, rows = pickle.loads(Path(blob_path).read_bytes()), []
    for name, (_, args) in programs().items():
      for how in ("read from the cache", "compiled (cache off)"):
        blob, in_tree, out_tree, want, n = saved[name, how]
        row = {"program": name, "compile": how, "cache_hits": n, "loaded": False, "ran": False}
        try:
          compiled = serialize_executable.deserialize_and_load(blob, in_tree, out_tree)
          row["loaded"] = True
          got = [np.asarray(x, np.float32) for x in compiled(*args)]
          row["ran"] = True
          row["max_abs_diff"] = max(
            float(np.abs(g - w).max()) for g, w in zip(got, want, strict=True)
          )
        except Exception as e:  # noqa: BLE001 (reported, not raised: the figure is the point)
          row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
        rows.append(row)
        print(row, flush=True)
    Path(blob_path).with_suffix(".rows").write_bytes(pickle.dumps(rows))
    return
  saved = {}
  for name, (fn, args) in programs().items():
    before = hits[0]
    compiled = fn.lower(*args).compile()
    out = [np.asarray(x, np.float32) for x in compiled(*args)]
    if stage != "serialize":
      continue
    saved[name, "read from the cache"] = (
      *serialize_executable.serialize(compiled),
      out,
      hits[0] - before,
    )
    jax.config.update("jax_enable_compilation_cache", False)
    before = hits[0]
    fresh = fn.lower(*args).compile()
    out = [np.asarray(x, np.float32) for x in fresh(*args)]
    saved[name, "compiled (cache off)"] = (
      *serialize_executable.serialize(fresh),
      out,
      hits[0] - before,
    )
    jax.config.update("jax_enable_compilation_cache", True)
  if stage == "serialize":
    Path(blob_path).write_bytes(pickle.dumps(saved))


def main():
  ap = argparse.ArgumentParser(description=__doc__)
  ap.add_argument("--results-dir", default=None)
  args = ap.parse_args()
  work = Path(tempfile.mkdtemp())
  cache, blob = work / "cache", work / "programs.pkl"
  env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
  try:
    for stage in ("fill", "serialize", "load"):
      argv = [sys.executable, __file__, stage, str(cache), str(blob)]
      proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
      print(proc.stdout.strip())
      if proc.returncode:
        raise SystemExit(f"{stage}: rc {proc.returncode} {proc.stderr[-600:]}")
    rows = pickle.loads(blob.with_suffix(".rows").read_bytes())
  finally:
    shutil.rmtree(work, ignore_errors=True)
  from experiments.record import record

  title = "A program read back from the compilation cache, serialized again and loaded"
  record("check_cache_store", rows, title, out_dir=args.results_dir)


if __name__ == "__main__":
  if len(sys.argv) == 4 and sys.argv[1] in ("fill", "serialize", "load"):
    child(*sys.argv[1:])
    sys.exit(0)
  main()
