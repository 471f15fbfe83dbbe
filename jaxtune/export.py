"""python -m jaxtune.export: a training run's adapters -> merged HF checkpoint (the default),
PEFT adapter, bnb-4bit checkpoint or GGUF file, with a model card; --push-to-hub uploads it.

The export is written into a temporary directory beside ``--out`` and renamed into place when
complete, so a failed or interrupted export never leaves a half-written model; an existing,
non-empty ``--out`` is replaced only with ``--overwrite``.
"""

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

if __name__ == "__main__":  # the command line: XLA's C++ warnings only when asked (before jax)
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from converters import export, hub, model_card
from converters.gguf_out import check_gguf_type
from jaxtune import plan, run_log
from jaxtune.errors import ExportError, UserError
from jaxtune.session import load_trained


class _Parser(argparse.ArgumentParser):
  def error(self, message):
    self.exit(2, f"error: {message}; see {self.prog} --help.\n")


def main(argv: Sequence[str] | None = None) -> int:
  p = _Parser(prog="python -m jaxtune.export", description=__doc__)
  p.add_argument("--checkpoint", required=True, help="run directory of jaxtune.train (its --out)")
  p.add_argument(
    "--format", default="merged", choices=export.FORMATS, help="what to write (default: merged)"
  )
  p.add_argument("--out", required=True, help="directory to write")
  p.add_argument("--dtype", default="bfloat16", help="dtype of unquantized weights in the export")
  p.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
  p.add_argument("--push-to-hub", metavar="ORG/NAME", help="then upload the export to this repo")
  p.add_argument("--hub-private", action="store_true", help="create the Hub repo private")
  p.add_argument(
    "--gguf-type",
    default="f16",
    help="with --format gguf: f16, bf16, f32, q8_0, q5_1, q5_0, "
    "q4_1 or q4_0 (written as OUT/model-TYPE.gguf)",
  )
  run_log.quiet_third_party()
  p.add_argument("--no-compile-cache", action="store_true", help=plan.CACHE_HELP)
  args = p.parse_args(argv)
  plan.use_compile_cache(not args.no_compile_cache)
  try:
    out = Path(args.out)
    export.check_destination(out, args.overwrite)  # before loading anything
    if args.dtype not in ("bfloat16", "float16", "float32"):
      raise ExportError(f"--dtype must be bfloat16, float16 or float32, got {args.dtype!r}.")
    check_gguf_type(args.gguf_type)
    model, step = load_trained(Path(args.checkpoint))
    card = model_card.render(Path(args.checkpoint), args.format)
    out = export.write(
      model, args.format, out, args.dtype, args.overwrite, gguf_type=args.gguf_type, card=card
    )
    print(f"exported step {step} as {args.format} to {Path(out).resolve()}")
    if args.push_to_hub:
      url = hub.push(out, args.push_to_hub, private=args.hub_private)
      print(f"pushed to {url}")
  except UserError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  return 0


if __name__ == "__main__":
  sys.exit(main())
