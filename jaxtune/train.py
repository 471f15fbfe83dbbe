"""python -m jaxtune.train: QLoRA fine-tuning from the command line.

With no --model and no --data it fine-tunes the built-in default (a small Llama written
locally in HF format, on a bundled chat dataset) through the same path as a real run.
"""

import argparse
import dataclasses
import sys
from pathlib import Path

from jaxtune.run_config import RunConfig

_HELP = {
  "model": "HF checkpoint directory or Hub id (default: the built-in small Llama)",
  "data": 'JSONL file of {"text": ...} or {"messages": [...]} lines (default: bundled dataset)',
  "out": "output directory: checkpoints/, metrics.jsonl, config.yaml, export/",
  "mesh": "device mesh: 8 (data), 2x4 (data x tensor), data=2,tensor=4 (default: all data)",
  "steps": "optimizer steps",
  "seed": "seed of adapter init, data order and dropout",
  "learning_rate": "peak learning rate",
  "schedule": "learning-rate decay after warmup: cosine, linear or constant",
  "warmup_steps": "linear warmup steps",
  "weight_decay": "AdamW weight decay",
  "max_grad_norm": "clip the global gradient norm to this",
  "batch_size": "sequences per optimizer step (global, over all devices)",
  "grad_accum": "micro-batches per step (batch_size must divide by it)",
  "seq_len": "tokens per sequence (longer examples are truncated)",
  "train_on_prompt": "also train on user/system tokens of chat data",
  "eval_data": "held-out JSONL (same format as --data) for eval loss and perplexity",
  "eval_every": "evaluate every N steps (0: only at the end)",
  "eval_prompts": "text file, one prompt per line, whose generations are logged at each eval",
  "quantization": "frozen weights: nf4 or none",
  "dtype": "compute dtype: bfloat16 or float32",
  "lora_rank": "LoRA rank r",
  "lora_alpha": "LoRA alpha (scale alpha/r, or alpha/sqrt(r) with --rslora)",
  "lora_dropout": "dropout on the LoRA input",
  "lora_targets": "comma-separated projections, HF names (q_proj,...,down_proj)",
  "rslora": "rank-stabilised LoRA scaling",
  "skip_nonfinite": "skip steps whose loss is NaN, inf or exactly 0 (counted in metrics) "
  "instead of stopping the run",
  "remat": "activation checkpointing per layer: none, full, dots, dots_no_batch",
  "attention": "xla or fused (jax.nn.dot_product_attention: cuDNN on GPU, exact for one "
  "document per row, which is all jaxtune's data makes today); unset: fused on GPU",
  "log_every": "write metrics every N steps",
  "save_every": "checkpoint every N steps",
  "keep_checkpoints": "how many checkpoints to keep",
  "export": "at the end write OUT/export as merged, peft or none",
}


def build_parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(
    prog="python -m jaxtune.train",
    description=__doc__,
    formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  p.add_argument("--config", help="YAML file of run settings; flags override it")
  p.add_argument("--resume", action="store_true", help="continue from OUT/checkpoints")
  defaults = RunConfig()
  for f in dataclasses.fields(RunConfig):
    flag = "--" + f.name.replace("_", "-")
    default = getattr(defaults, f.name)
    if isinstance(default, bool):
      p.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=_HELP[f.name])
    elif f.name == "lora_targets":
      p.add_argument(flag, default=None, help=_HELP[f.name] + f" (default: {','.join(default)})")
    else:
      kind = type(default) if default is not None else str
      p.add_argument(flag, type=kind, default=None, help=_HELP[f.name] + f" (default: {default})")
  return p


def resolve_config(argv=None) -> tuple[RunConfig, bool]:
  args = build_parser().parse_args(argv)
  run = RunConfig.from_yaml(args.config) if args.config else RunConfig()
  overrides = {
    f.name: getattr(args, f.name)
    for f in dataclasses.fields(RunConfig)
    if getattr(args, f.name) is not None
  }
  run = run.replace(**overrides)
  if run.quantization == "none":
    run = run.replace(quantization=None)
  if run.export == "none":
    run = run.replace(export=None)
  return run, args.resume


def main(argv=None) -> int:
  from jaxtune.session import UserError, run_training

  try:
    run, resume = resolve_config(argv)
    out = run_training(run, resume=resume)
  except UserError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  print(f"done: outputs in {Path(out).resolve()}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
