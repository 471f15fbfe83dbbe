"""python -m jaxtune.export: a training run's adapters -> merged HF checkpoint or PEFT adapter.

The export is written into a temporary directory beside ``--out`` and renamed into place when
complete, so a failed or interrupted export never leaves a half-written model; an existing,
non-empty ``--out`` is replaced only with ``--overwrite``.
"""

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

FORMATS = ("merged", "peft", "bnb4")


class ExportError(ValueError):
  """The export cannot be written where asked; the message says what to do."""


def local_model(model, mesh):
  """The model with every array whole on this process (a no-op with one process)."""
  from flax import nnx

  from jaxtune import distributed

  graphdef, state = nnx.split(model)
  return nnx.merge(graphdef, distributed.local_copy(state, mesh))


def write(model, fmt: str, out: str | Path, dtype: str = "bfloat16", overwrite: bool = False):
  """Export ``model`` as ``fmt`` into ``out``, atomically; returns ``out``."""
  import jaxtune

  out = Path(out)
  if out.exists() and not out.is_dir():
    raise ExportError(f"--out {out} is a file; pass a directory.")
  if out.is_dir() and any(out.iterdir()) and not overwrite:
    raise ExportError(
      f"--out {out} is not empty; pass --overwrite to replace it, or choose another directory."
    )
  out.parent.mkdir(parents=True, exist_ok=True)
  tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
  try:
    if fmt == "merged":
      jaxtune.export_merged(model, tmp, dtype=dtype)
    elif fmt == "bnb4":
      jaxtune.export_bnb4(model, tmp, dtype=dtype)
    else:
      jaxtune.export_peft(model, tmp)
    old = None
    if out.exists():
      old = out.with_name(tmp.name + ".old")
      out.rename(old)
    try:
      tmp.rename(out)
    except OSError:
      if old is not None:
        old.rename(out)
      raise
  finally:
    if tmp.exists():
      shutil.rmtree(tmp)
  if old is not None:
    shutil.rmtree(old)
  return out


class _Parser(argparse.ArgumentParser):
  def error(self, message):
    self.exit(2, f"error: {message}; see {self.prog} --help.\n")


def main(argv=None) -> int:
  p = _Parser(prog="python -m jaxtune.export", description=__doc__)
  p.add_argument("--checkpoint", required=True, help="run directory of jaxtune.train (its --out)")
  p.add_argument("--format", required=True, choices=FORMATS, help="what to write")
  p.add_argument("--out", required=True, help="directory to write")
  p.add_argument("--dtype", default="bfloat16", help="dtype of unquantized weights in the export")
  p.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
  args = p.parse_args(argv)

  from jaxtune.session import UserError, load_trained

  try:
    out = Path(args.out)
    if out.is_dir() and any(out.iterdir()) and not args.overwrite:  # before loading anything
      raise ExportError(
        f"--out {out} is not empty; pass --overwrite to replace it, or choose another directory."
      )
    if args.dtype not in ("bfloat16", "float16", "float32"):
      raise ExportError(f"--dtype must be bfloat16, float16 or float32, got {args.dtype!r}.")
    model, step = load_trained(Path(args.checkpoint))
    out = write(model, args.format, out, args.dtype, args.overwrite)
  except (UserError, ValueError, OSError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  print(f"exported step {step} as {args.format} to {Path(out).resolve()}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
