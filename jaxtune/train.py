"""python -m jaxtune.train: QLoRA fine-tuning from the command line.

With no --model and no --data it fine-tunes the built-in default (a small Llama written
locally in HF format, on a bundled chat dataset) through the same path as a real run.

Several processes (hosts) form one run when launched with JAXTUNE_COORDINATOR=host:port,
JAXTUNE_NUM_PROCESSES and JAXTUNE_PROCESS_ID, under srun (SLURM) or mpirun/mpiexec (Open MPI;
other MPIs through mpi4py), or in any other cluster jax.distributed.initialize detects
(Kubernetes indexed Jobs, Cloud TPU); see jaxtune/parallel/distributed.py.
SIGTERM or Ctrl-C saves a checkpoint after the current step, then exits; --resume continues.
"""

import argparse
import contextlib
import dataclasses
import importlib
import os
import shlex
import sys
import threading
from collections.abc import MutableMapping, Sequence
from pathlib import Path
from typing import Any

if __name__ == "__main__":  # the command line: XLA's C++ warnings only when asked (before jax)
  # (3: ERROR too, where XLA prints banners such as "Very slow compile?"; a failure still
  # raises in Python with its traceback)
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

# Only light modules here: --help and a bad flag answer before JAX and the trainer import
# (~0.1 s against ~28 s); main imports the rest once the arguments parse.
from jaxtune.cli import CACHE_HELP, Parser  # noqa: E402
from jaxtune.errors import UserError  # noqa: E402
from jaxtune.run import run_dir  # noqa: E402
from jaxtune.run_config import OPTIONAL_NUMBERS, SECTIONS, RunConfig  # noqa: E402

_HELP = {
  "model": "HF checkpoint directory or Hub id (default: the built-in small Llama)",
  "data": "examples: a .jsonl/.json/.parquet/.csv/.arrow file, a directory or glob of them, a "
  "datasets.save_to_disk directory, or a Hub dataset id (org/name) (default: bundled dataset)",
  "data_config": "the Hub dataset's config (subset), when it has several",
  "data_split": "the split of --data to train on",
  "data_format": "text, messages, conversations (ShareGPT), alpaca or prompt_completion "
  "(default: detected from the columns)",
  "data_columns": "map your column names onto a format's, e.g. prompt=question,completion=answer",
  "data_streaming": "read, tokenize and pack the data a buffer at a time, for datasets larger "
  "than memory (needs --steps; resumes at the same example)",
  "long_examples": "examples longer than --seq-len: truncate or drop (counted on the start line)",
  "epochs": "passes over the data, instead of --steps (default: 1 when neither is given)",
  "eval_data_split": "the split of --eval-data (default: test when it is --data itself, else "
  "train)",
  "eval_split": "hold out this fraction of --data (0 to 0.5, seeded) for eval loss",
  "out": "output directory: checkpoints/, metrics.jsonl, config.yaml, export/",
  "mesh": "device mesh: 8 (data), 2x4 (data x tensor), data=2,tensor=4 (default: all data)",
  "steps": "optimizer steps (default: one epoch)",
  "seed": "seed of adapter init, data order and dropout",
  "method": "sft (next-token loss), or on preference pairs (prompt, chosen, rejected): dpo, "
  "ipo or orpo (the reference policy is the model with its adapters off)",
  "beta": "dpo/ipo: the strength of the pull towards the reference (DPO's beta, IPO's tau; "
  "default 0.1); grpo: the weight of the KL penalty to it (default 0: no reference forward)",
  "label_smoothing": "dpo: the assumed probability that a pair's preference is flipped "
  "(conservative DPO), 0 to 0.5",
  "orpo_lambda": "orpo: the weight of the odds-ratio term beside the chosen responses' NLL",
  "reward": "grpo: reward functions, comma-separated: MODULE:FUNCTION or FILE.py:FUNCTION "
  "taking (prompts, completions, **columns) and returning a float per completion, or final_answer, "
  "think_format, length_penalty (built in); summed",
  "num_generations": "grpo: completions sampled per prompt (the group their rewards are "
  "normalised in)",
  "max_new_tokens": "grpo: the longest completion, in tokens",
  "temperature": "grpo: sampling temperature of the rollouts",
  "top_p": "grpo: nucleus sampling of the rollouts (1: off)",
  "epsilon": "grpo: clip the policy ratio to [1 - epsilon, 1 + epsilon]",
  "num_iterations": "grpo: optimizer steps per batch of rollouts (the ratio to the rollout "
  "policy is then live)",
  "learning_rate": "peak learning rate",
  "schedule": "learning-rate decay after warmup: cosine, linear or constant",
  "warmup_steps": "linear warmup steps",
  "weight_decay": "AdamW weight decay",
  "max_grad_norm": "clip the global gradient norm to this",
  "batch_size": "sequences per optimizer step (global, over all devices)",
  "grad_accum": "micro-batches per step (batch_size must divide by it)",
  "seq_len": "tokens per sequence (default: the smallest multiple of 256 that holds 99%% of "
  "the examples, at most 4096 and the model's positions)",
  "train_on_prompt": "also train on user/system tokens of chat data",
  "packing": "pack several examples into each row of --seq-len tokens, attention kept within "
  "each example (--no-packing: one example per row, padded)",
  "eval_data": "held-out examples (any source --data takes) for eval loss and perplexity",
  "eval_every": "evaluate every N steps (0: only at the end)",
  "eval_prompts": "text file, one prompt per line, whose generations are logged at each eval",
  "quantization": "frozen weights: nf4 or none",
  "dtype": "compute dtype: bfloat16, float32, or float16 (dynamic loss scaling; chosen "
  "automatically on GPUs without bfloat16)",
  "router_aux_loss_coef": "weight of a mixture of experts' load-balancing loss in the loss "
  "(default: the model's router_aux_loss_coef, 0.001 for Qwen3-MoE, Mixtral and gpt-oss); "
  "reported as router_balance",
  "lora_rank": "LoRA rank r",
  "lora_alpha": "LoRA alpha (scale alpha/r, or alpha/sqrt(r) with --rslora)",
  "lora_dropout": "dropout on the LoRA input",
  "lora_targets": "comma-separated projections, HF names (q_proj,...,down_proj)",
  "rslora": "rank-stabilised LoRA scaling",
  "train_router": "a mixture of experts' routers train too (their full weights; exported "
  "merged, or as PEFT's modules_to_save)",
  "lora_rank_pattern": "ranks by projection and layer over --lora-rank, e.g. "
  "down_proj=64,layers.0-7=32,layers.0-7.down_proj=16 (the most specific key wins; exported "
  "as PEFT's rank_pattern)",
  "lora_alpha_pattern": "alphas by projection and layer over --lora-alpha, same keys",
  "init_adapter": "PEFT adapter directory (adapter_config.json, as --export peft or peft's "
  "save_pretrained writes it) to continue training; its rank, alpha, targets, dropout and "
  "rslora replace the --lora-* settings",
  "skip_nonfinite": "skip steps whose loss is NaN, inf or exactly 0 (counted in metrics) "
  "instead of stopping the run",
  "remat": "activation checkpointing per layer: auto (the fastest of activations, "
  "dots_no_batch, full, lean and offload whose compiled memory plan fits the device; where "
  "activations misses and full fits, full keeping the activations of as many first layers as "
  "fit: the start line names the choice), activations (fastest: keeps what each layer's "
  "backward reads, recomputes only norms, rope and the activation), full (keeps only each "
  "layer's input), lean (full, and each NF4 weight dequantized again for its backward product: "
  "less memory, ~3%% slower than full), none, dots, dots_no_batch, offload (full, with layer "
  "inputs kept in host memory)",
  "remat_group": "with --remat full, lean or offload (or auto, then among those): keep only "
  "the input of every group of N layers (in host memory under offload), recomputing a group's "
  "layers in its backward pass: N times fewer kept inputs, for each layer's forward once more "
  "(8B at 2,048 tokens, N=2: 0.75x the speed; for long contexts, where the kept inputs fill "
  "device or host memory); 1: every layer's",
  "layer_loop": "how the layers run: auto (unrolled for remat activations on one GPU where "
  "its memory plan fits, else scan: the start line says which), scan (one compiled layer "
  "looped: least memory and compile time), unrolled (every layer in the program: no copies of "
  "the saved activations into per-layer stacks; 8B at batch 2 on an H100 1.05x the speed for "
  "1.9x the memory)",
  "microbatches": "pipeline micro-batches per step when the mesh has pipe > 1 (0: one per "
  "sequence of a data shard)",
  "shard_frozen": "also split the frozen NF4 weights over the data axis, gathered per layer "
  "(for models that do not fit one copy per data shard)",
  "sequence_parallel": "with tensor > 1: split the residual stream's tokens over tensor "
  "between the projections (norms on 1/tensor of the tokens, reduce-scatter + all-gather "
  "instead of all-reduce)",
  "attention": "xla, fused (cuDNN on GPU, exact only for one example per row: use it with "
  "--no-packing) or pallas (Mosaic GPU flash attention on Hopper: packing, windows, "
  "softcaps); unset: fused where it is exact, else pallas on Hopper, else xla (xla under a "
  "pipe axis)",
  "nf4_matmul": "NF4 linear layers: kernel (Pallas, Hopper GPUs) or xla (dequantize then "
  "dot); unset, on one Hopper GPU in bfloat16: the kernel for at most 64 tokens, and for "
  "supervised fine-tuning too where a micro-batch has 2048-4096 tokens, the model is at least "
  "4096 wide and the kernels' operands fit (8B-size: measured faster there, slower at 1B and "
  "in DPO); XLA otherwise",
  "loss_chunk": "compute the loss N tokens per row at a time (the float32 logits of the "
  "whole sequence never exist; where the output layer has LoRA, it runs twice); 0: all at "
  "once; unset: on GPUs, pieces of ~4096 tokens a device where the output layer is frozen "
  "(sft), else all at once where that fits the device, else 1024",
  "memory_limit": "GiB of device memory per device the training step may plan for (--remat "
  "auto and an unset --loss-chunk choose within it); unset: what the device can allocate",
  "mlp_chunk": "run each MLP N tokens per row at a time, recomputed in the backward pass, so "
  "its [tokens, intermediate] temporaries exist for one piece at a time (long contexts); "
  "0: all at once",
  "embeddings": "host: the input embedding table stays in host memory and each batch's rows "
  "are gathered there (saves vocabulary x hidden x 2 bytes per device; models with an "
  "lm_head of their own); device: on the devices",
  "log_every": "write metrics every N steps",
  "report_to": "trackers, comma-separated: tensorboard (OUT/tensorboard), wandb (Weights & "
  "Biases; WANDB_MODE=offline works without network), or none",
  "save_every": "checkpoint every N steps",
  "keep_checkpoints": "how many checkpoints to keep",
  "push_to_hub": "then upload OUT/export to the Hub model repo ORG/NAME (needs `hf auth login`)",
  "hub_private": "create the --push-to-hub repo private",
  "export": "at the end write OUT/export as merged, peft, bnb4, gguf or none (with a model card)",
  "merge_into": "with --export merged, bnb4 or gguf: add the LoRA update to the checkpoint's "
  "original weights (the model its PEFT adapter gives) or to the NF4-dequantized ones the run "
  "trained with (dequantized)",
  "gguf_type": "with --export gguf: f16, bf16, f32, q8_0, q5_1, q5_0, q4_1 or q4_0 (the file "
  "OUT/export/model-TYPE.gguf)",
}


def build_parser() -> argparse.ArgumentParser:
  p = Parser(
    prog="python -m jaxtune.train",
    description=__doc__,
    formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  p.add_argument("--config", help="YAML file of run settings; flags override it")
  p.add_argument("--resume", action="store_true", help="continue from OUT/checkpoints")
  p.add_argument(
    "--allow-changes",
    action="store_true",
    help="with --resume: continue even where the data, model, LoRA, seq-len, batch or seed "
    "settings differ from the run's config.yaml (recorded in OUT/config-history)",
  )
  p.add_argument("--no-compile-cache", action="store_true", help=CACHE_HELP)
  # One group of flags per section of RunConfig (a --config file's sections too).
  groups = {name: p.add_argument_group(name, about) for name, about in SECTIONS}
  defaults = RunConfig()
  for f in dataclasses.fields(RunConfig):
    group = groups[f.metadata["section"]]
    flag = "--" + f.name.replace("_", "-")
    default = getattr(defaults, f.name)
    if isinstance(default, bool):
      group.add_argument(
        flag, action=argparse.BooleanOptionalAction, default=None, help=_HELP[f.name]
      )
    elif f.name == "lora_targets":
      group.add_argument(
        flag, default=None, help=_HELP[f.name] + f" (default: {','.join(default)})"
      )
    else:
      kind = OPTIONAL_NUMBERS.get(f.name) or (type(default) if default is not None else str)
      shown = "" if default is None else f" (default: {default})"
      group.add_argument(flag, type=kind, default=None, help=_HELP[f.name] + shown)
  return p


def given_settings(argv: Sequence[str] | None = None, args: Any = None) -> tuple[dict, bool]:
  """The settings the user gave (a --config file, then flags; for --resume over the run's
  own config.yaml) and whether to resume; RunConfigError if wrong. ``args``: ``argv`` parsed
  already (the command line parses it once)."""
  args = build_parser().parse_args(argv) if args is None else args
  settings = RunConfig.read_yaml(args.config) if args.config else {}
  overrides = {
    f.name: getattr(args, f.name)
    for f in dataclasses.fields(RunConfig)
    if getattr(args, f.name) is not None
  }
  settings = {**settings, **overrides}
  if args.resume:  # the run's own config.yaml first: `--out RUN --resume` is enough
    settings = run_dir.resumed_settings(Path(settings.get("out", RunConfig.out)), settings)
  return settings, args.resume


def resolve_config(argv: Sequence[str] | None = None) -> tuple[RunConfig, bool]:
  """The run's settings (YAML, then flags) and whether to resume; RunConfigError if wrong.
  (``--allow-changes``: ``build_parser().parse_args``.)"""
  settings, resume = given_settings(argv)
  return RunConfig.from_settings(settings).checked(), resume


HOST_LIMIT_VAR = "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"


def allow_host_memory_for_offload(
  run: RunConfig, environ: MutableMapping[str, str] = os.environ
) -> None:
  """--remat offload keeps every layer's input in pinned host memory, a pool that PJRT caps at
  64 GB unless told otherwise (long contexts need more: 32 layers x 409,600 tokens x 4,096 x
  2 bytes is 100 GiB): let it use 90% of the machine's memory (also under --remat auto, which
  may choose offload). Set before the GPU client starts; a limit the user set stays."""
  if run.remat not in ("offload", "auto") or HOST_LIMIT_VAR in environ:
    return
  total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
  environ[HOST_LIMIT_VAR] = str(max(64, int(0.9 * total / 2**30)))


MEMORY_FRACTION_VAR = "XLA_PYTHON_CLIENT_MEM_FRACTION"
# The share of each GPU's memory the command line gives JAX's pool, where the user has not
# chosen one: JAX's own default, 75%, leaves 20 GB of an 80 GB GPU unused, which decides
# whether the fastest setting fits (8B batch 4: remat activations with the layers unrolled
# plans 55 GiB, over --remat auto's margin in 75%; experiments/RESULTS.md, session 23). 95%
# leaves ~4 GiB of an 80 GB GPU outside; 70B batch 1 on an H100 kept the activations of 73
# of 80 layers in it (1,695 tok/s) against 62 at 90% (1,615-1,629; session 25).
MEMORY_FRACTION = "0.95"


def claim_device_memory(environ: MutableMapping[str, str] = os.environ) -> None:
  """Let JAX's GPU memory pool grow to MEMORY_FRACTION of each GPU, unless the user chose a
  fraction or the platform allocator (XLA_PYTHON_CLIENT_ALLOCATOR=platform: no pool). The run
  owns its GPUs; the rest stays with CUDA, cuDNN, cuBLAS and NCCL, outside the pool. Set
  before the GPU client starts."""
  if MEMORY_FRACTION_VAR in environ or environ.get("XLA_PYTHON_CLIENT_ALLOCATOR") == "platform":
    return
  environ[MEMORY_FRACTION_VAR] = MEMORY_FRACTION


def _start_devices_while_importing() -> None:
  """Start JAX's devices (CUDA's start: seconds on a GPU machine) in a thread while this one
  imports the tokenizer and data libraries, which the run needs next (seconds too)."""

  import jax  # noqa: PLC0415 (see the imports at the top)

  from jaxtune.run.loading import PLAIN_TOKENIZERS  # noqa: PLC0415
  from jaxtune.training import log as run_log  # noqa: PLC0415

  def start():
    try:
      jax.devices()
    except Exception:  # noqa: BLE001 - raised again where the run first asks for its devices
      pass

  threading.Thread(target=start, name="jaxtune-devices", daemon=True).start()
  # Imported with torch hidden, which they would otherwise import (5.9 s of a run's start
  # with transformers 5.17 on a GPU machine), tokenizer classes included.
  with run_log.torch_hidden():
    for name in ("transformers", "datasets"):
      with contextlib.suppress(ImportError):
        module = importlib.import_module(name)
        if name == "transformers":
          for cls in PLAIN_TOKENIZERS:
            getattr(module, cls, None)


def main(argv: Sequence[str] | None = None) -> int:
  flags = build_parser().parse_args(argv)  # --help and a bad flag end here, before JAX
  from jaxtune.parallel import distributed  # noqa: PLC0415 (see the imports at the top)
  from jaxtune.run.session import run_training  # noqa: PLC0415
  from jaxtune.training import compile_cache
  from jaxtune.training import log as run_log
  from jaxtune.training.loop import Stopped  # noqa: PLC0415

  run_log.quiet_third_party()
  try:
    given, resume = given_settings(args=flags)
    run = RunConfig.from_settings(given).checked()
    allow_changes = flags.allow_changes
    if allow_changes and not resume:
      raise UserError("--allow-changes is for --resume; pass --resume too, or drop it.")
    allow_host_memory_for_offload(run)  # before the GPU client starts
    compile_cache.use_compile_cache(not flags.no_compile_cache)
    distributed.initialize()  # before anything asks JAX for its devices
    _start_devices_while_importing()
    command = shlex.join(
      ["python", "-m", "jaxtune.train", *(sys.argv[1:] if argv is None else argv)]
    )
    out, _ = run_training(
      run, resume=resume, command=command, allow_changes=allow_changes, given=set(given)
    )
  except UserError as e:
    print(f"error: {e}", file=sys.stderr)
    # Code of the user's that failed (a GRPO reward): its own frames, below the sentence.
    print(getattr(e.__cause__, "frames", ""), end="", file=sys.stderr)
    return 2
  except Stopped as e:
    if e.saved:
      print(
        f"jaxtune: {e}; checkpoint {e.step} is in {Path(run.out, 'checkpoints').resolve()}, "
        "continue with --resume.",
        file=sys.stderr,
      )
    return 128 + e.signum
  return 0


if __name__ == "__main__":
  claim_device_memory()  # the command line's process only (main() may run inside another)
  sys.exit(main())
