"""Does a program JAX read back from its persistent compilation cache survive being
serialized again (the step store's format) and loaded in a fresh process? On XLA:CPU
(jax 0.11.2) it does not: the loaded program fails when it runs ("Function ... not found"),
so plan._StepStore skips such programs (plan._FROM_CACHE) on every backend. This checks
the GPU, with the Mosaic GPU flash attention of check_step_store.py and an XLA MLP step.

  python experiments/check_cache_store.py
Three children share one cache directory: (1) compiles and runs, filling the cache; (2)
compiles again (a cache hit, counted), serializes the program and keeps its output; (3)
loads it and runs. Prints, per program, the hits of (2) and the largest difference of (3)'s
output against (2)'s.
"""

import os
import pickle
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
    saved = pickle.loads(Path(blob_path).read_bytes())
    for name, (_fn, args) in programs().items():
      blob, in_tree, out_tree, want, n = saved[name]
      try:
        compiled = serialize_executable.deserialize_and_load(blob, in_tree, out_tree)
        got = [np.asarray(x, np.float32) for x in compiled(*args)]
        diff = max(float(np.abs(g - w).max()) for g, w in zip(got, want, strict=True))
        print(f"{name}: cache hits while compiling {n}; loaded, ran, max |diff| {diff:.3g}")
      except Exception as e:  # noqa: BLE001
        print(f"{name}: cache hits while compiling {n}; FAILED {type(e).__name__}: {str(e)[:200]}")
    return
  saved = {}
  for name, (fn, args) in programs().items():
    before = hits[0]
    compiled = fn.lower(*args).compile()
    out = [np.asarray(x, np.float32) for x in compiled(*args)]
    if stage == "serialize":
      blob, in_tree, out_tree = serialize_executable.serialize(compiled)
      saved[name] = (blob, in_tree, out_tree, out, hits[0] - before)
  if stage == "serialize":
    Path(blob_path).write_bytes(pickle.dumps(saved))


if __name__ == "__main__":
  if len(sys.argv) == 4:
    child(*sys.argv[1:])
    sys.exit(0)
  work = Path(tempfile.mkdtemp())
  cache, blob = work / "cache", work / "programs.pkl"
  env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
  for stage in ("fill", "serialize", "load"):
    proc = subprocess.run([sys.executable, __file__, stage, str(cache), str(blob)], env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    if proc.returncode:
      print(f"{stage}: rc {proc.returncode} {proc.stderr[-600:]}")
      break
    if proc.stdout.strip():
      print(proc.stdout.strip())
