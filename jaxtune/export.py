"""python -m jaxtune.export: a training run's adapters (--checkpoint RUN) or a checkpoint as it
is (--model PATH|HUB_ID) -> merged HF checkpoint (the default), PEFT adapter (runs only),
bnb-4bit checkpoint or GGUF file, with a model card; --push-to-hub uploads it.

The merged formats (merged, bnb4, gguf) add the LoRA update to the checkpoint's original
weights, read again from its files (--merge-into original: the same model as the PEFT adapter
on that checkpoint), or to the NF4-dequantized weights the run trained with (--merge-into
dequantized); a bnb-4bit checkpoint has only the latter. The export is written into a
temporary directory beside --out and renamed into place when complete, so a failed or
interrupted export never leaves a half-written model; an existing, non-empty --out is replaced
only with --overwrite.
"""

import os
import sys
from collections.abc import Sequence
from pathlib import Path

if __name__ == "__main__":  # the command line: XLA's C++ warnings only when asked (before jax)
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")  # ERROR too: XLA's banners (train.py)

from jaxtune.cli import CACHE_HELP, Parser
from jaxtune.errors import ExportError, UserError

# jaxtune.hf.export.FORMATS and jaxtune.hf.gguf.GGUF_TYPES, which import JAX: --help
# answers without it (tests/cli/test_export_more.py holds them equal).
FORMATS = ("merged", "peft", "bnb4", "gguf")
GGUF_TYPES = ("f16", "bf16", "f32", "q8_0", "q5_1", "q5_0", "q4_1", "q4_0")
DTYPES = ("bfloat16", "float16", "float32")


def parser() -> Parser:
  p = Parser(prog="python -m jaxtune.export", description=__doc__)
  source = p.add_mutually_exclusive_group(required=True)
  source.add_argument("--checkpoint", help="run directory of jaxtune.train (its --out)")
  source.add_argument(
    "--model",
    metavar="PATH|HUB_ID",
    help="a HF checkpoint to export as it is, without a run (merged, bnb4 or gguf)",
  )
  p.add_argument(
    "--format", default="merged", choices=FORMATS, help="what to write (default: merged)"
  )
  p.add_argument("--out", required=True, help="directory to write")
  p.add_argument(
    "--dtype",
    default="bfloat16",
    help=f"dtype of unquantized weights in the export: {', '.join(DTYPES)} (default: bfloat16)",
  )
  p.add_argument(
    "--merge-into",
    choices=("original", "dequantized"),
    help="the weights the LoRA update is added to: the checkpoint's original ones (default) "
    "or the NF4-dequantized ones the run trained with",
  )
  p.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
  p.add_argument("--push-to-hub", metavar="ORG/NAME", help="then upload the export to this repo")
  p.add_argument("--hub-private", action="store_true", help="create the Hub repo private")
  p.add_argument(
    "--gguf-type",
    default="f16",
    help=f"with --format gguf: {', '.join(GGUF_TYPES)} (written as OUT/model-TYPE.gguf)",
  )
  p.add_argument("--no-compile-cache", action="store_true", help=CACHE_HELP)
  return p


def main(argv: Sequence[str] | None = None) -> int:
  args = parser().parse_args(argv)
  # Only now the heavy modules (JAX, the model): --help and a mistyped flag answer at once.
  from converters import hub, model_card
  from jaxtune.hf import export
  from jaxtune.hf.gguf import check_gguf_type
  from jaxtune.training import compile_cache
  from jaxtune.training import log as run_log

  run_log.quiet_third_party()
  compile_cache.use_compile_cache(not args.no_compile_cache)
  try:
    out = Path(args.out)
    export.check_destination(out, args.overwrite)  # before loading anything
    if args.dtype not in DTYPES:
      raise ExportError(f"--dtype must be bfloat16, float16 or float32, got {args.dtype!r}.")
    check_gguf_type(args.gguf_type)
    if args.format == "peft" and args.model:
      raise ExportError(
        "--format peft writes a run's adapters, and --model names a checkpoint without any; "
        "pass --checkpoint RUN_DIR, or choose --format merged, bnb4 or gguf."
      )
    if args.format == "peft" and args.merge_into:
      raise ExportError(
        "--format peft merges nothing; drop --merge-into, or choose another --format."
      )
    if args.model:
      model, what = _load_checkpoint(args.model)
      card = model_card.render_base(model.provenance.checkpoint_dir, args.model, args.format)
    else:
      card = model_card.render(Path(args.checkpoint), args.format)  # reads the run's files
      model, what = _load_run(Path(args.checkpoint))
    out = export.write(
      model,
      args.format,
      out,
      args.dtype,
      args.overwrite,
      gguf_type=args.gguf_type,
      card=card,
      merge_into=args.merge_into or "original",
    )
    print(f"exported {what} as {args.format} to {Path(out).resolve()}")
    if args.push_to_hub:
      url = hub.push(out, args.push_to_hub, private=args.hub_private)
      print(f"pushed to {url}")
  except UserError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  return 0


def _load_run(run_dir: Path):
  from jaxtune.run.loading import load_trained

  model, step = load_trained(run_dir)
  return model, f"step {step}"


def _load_checkpoint(path: str):
  """The checkpoint as it is, in NF4 (the least device memory: the merge into the original
  weights reads them again from the files, and bnb4 writes the NF4 codes as stored) with its
  other tensors in float32 (exact, for --merge-into dequantized)."""
  from jaxtune.hf.load import from_pretrained

  model = from_pretrained(path, quantization="nf4", dtype="float32")
  return model, path


if __name__ == "__main__":
  sys.exit(main())
