"""Does a program with Mosaic GPU kernels, serialized in one process (the step store's
format: jax.experimental.serialize_executable), load and run in a fresh one, and what must
that process import first? One GPU.

  python experiments/check_step_store.py            # writes, then loads in three children
Prints one line per child: what it imported, whether the program loaded, and the largest
difference of its output against the writing process's.
"""

import os
import pickle
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
SHAPE = (1, 1024, 8, 128)


def inputs():
  import jax

  keys = jax.random.split(jax.random.key(0), 3)
  return [jax.random.normal(k, SHAPE, "bfloat16") for k in keys]


def program():
  import jax

  from pallas_kernels.flash_attention.ops import flash_attention

  def f(q, k, v):
    out = flash_attention(q, k, v, implementation="mosaic")
    return out, jax.grad(lambda q: flash_attention(q, k, v, implementation="mosaic").sum())(q)

  return jax.jit(f)


def write(path: Path) -> None:
  from jax.experimental import serialize_executable

  args = inputs()
  compiled = program().lower(*args).compile()
  blob, in_tree, out_tree = serialize_executable.serialize(compiled)
  out = [np.asarray(x, np.float32) for x in compiled(*args)]
  path.write_bytes(pickle.dumps((blob, in_tree, out_tree, out)))


def load(path: Path, imports: str) -> None:
  import importlib

  import jax
  from jax.experimental import serialize_executable

  for name in filter(None, imports.split(",")):
    importlib.import_module(name)
  blob, in_tree, out_tree, want = pickle.loads(path.read_bytes())
  try:
    compiled = serialize_executable.deserialize_and_load(blob, in_tree, out_tree)
    got = [np.asarray(x, np.float32) for x in compiled(*inputs())]
  except Exception as e:  # noqa: BLE001
    print(f"imports [{imports}]: FAILED {type(e).__name__}: {str(e)[:160]}")
    return
  diff = max(float(np.abs(g - w).max()) for g, w in zip(got, want, strict=True))
  print(f"imports [{imports}]: loaded, max |diff| {diff:.3g}, mosaic gpu imported: "
        f"{'jax.experimental.mosaic.gpu' in sys.modules}; jax {jax.__version__}")  # fmt: skip


if __name__ == "__main__":
  if len(sys.argv) == 3:
    load(Path(sys.argv[1]), sys.argv[2])
    sys.exit(0)
  path = Path(tempfile.mkdtemp()) / "program.pkl"
  write(path)
  env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
  for imports in ("", "jax.experimental.mosaic.gpu", "pallas_kernels.flash_attention.kernel"):
    proc = subprocess.run([sys.executable, __file__, str(path), imports], env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    print(proc.stdout.strip() or f"imports [{imports}]: rc {proc.returncode} {proc.stderr[-300:]}")
