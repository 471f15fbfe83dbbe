"""python -m jaxtune.export: a training run's adapters -> merged HF checkpoint or PEFT adapter."""

import argparse
import sys
from pathlib import Path


def main(argv=None) -> int:
  p = argparse.ArgumentParser(prog="python -m jaxtune.export", description=__doc__)
  p.add_argument("--checkpoint", required=True, help="run directory of jaxtune.train (its --out)")
  p.add_argument(
    "--format", required=True, choices=("merged", "peft", "bnb4"), help="what to write"
  )
  p.add_argument("--out", required=True, help="directory to write")
  p.add_argument("--dtype", default="bfloat16", help="dtype of unquantized weights in the export")
  args = p.parse_args(argv)

  import jaxtune
  from jaxtune.session import UserError, load_trained

  try:
    model, step = load_trained(Path(args.checkpoint))
    if args.format == "merged":
      out = jaxtune.export_merged(model, args.out, dtype=args.dtype)
    elif args.format == "bnb4":
      out = jaxtune.export_bnb4(model, args.out, dtype=args.dtype)
    else:
      out = jaxtune.export_peft(model, args.out)
  except (UserError, ValueError, OSError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  print(f"exported step {step} as {args.format} to {Path(out).resolve()}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
