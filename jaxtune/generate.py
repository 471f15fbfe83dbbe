"""Generate text from a checkpoint, optionally with adapters (a training run's, or PEFT's).

  python -m jaxtune.generate --model DIR|HUB_ID [--adapter RUN_DIR|PEFT_DIR] --prompt TEXT [--chat]

Greedy at temperature 0 (the default), else top-k / top-p sampling; several prompts run as
one batch, each generating what it would alone.
"""

import argparse
import os
import sys
from collections.abc import Sequence

if __name__ == "__main__":  # the command line: XLA's C++ warnings only when asked (before jax)
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")  # ERROR too: XLA's banners (train.py)

# Only light modules here: --help and a bad flag answer before JAX and the model code import;
# main imports the rest once the arguments parse.
from jaxtune.cli import CACHE_HELP, Parser  # noqa: E402
from jaxtune.errors import UserError  # noqa: E402
from jaxtune.run_config import CHOICES  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
  p = Parser(
    prog="python -m jaxtune.generate",
    description=__doc__,
    formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  p.add_argument("--model", help="HF checkpoint dir or hub id (or take it from --adapter's run)")
  p.add_argument(
    "--adapter",
    help="adapters to apply: a jaxtune.train run directory, or a PEFT adapter directory "
    "(adapter_config.json; on --model, default the base model it names)",
  )
  p.add_argument("--prompt", action="append", help="prompt text; repeat for a batch")
  p.add_argument("--chat", action="store_true", help="interactive chat with the chat template")
  p.add_argument("--max-new-tokens", type=int, default=128, help="the longest completion (tokens)")
  p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
  p.add_argument("--top-k", type=int, default=0, help="sample from the k likeliest (0: off)")
  p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling, in (0, 1] (1: off)")
  p.add_argument("--seed", type=int, default=0, help="seed of the sampling, 0 to 2**32-1")
  p.add_argument("--quantization", default="nf4", choices=("nf4", "none"), help="frozen weights")
  p.add_argument("--dtype", default="bfloat16", choices=CHOICES["dtype"], help="compute dtype")
  p.add_argument("--no-compile-cache", action="store_true", help=CACHE_HELP)
  return p


def main(argv: Sequence[str] | None = None) -> int:
  args = build_parser().parse_args(argv)  # --help and a bad flag end here, before JAX
  import jax

  from jaxtune.models.decoding import check_sampling, generate, generate_ids
  from jaxtune.parallel.runtime import free_device_bytes
  from jaxtune.run.choices import resolve_decode
  from jaxtune.run.loading import load_run_model, load_tokenizer
  from jaxtune.training import compile_cache
  from jaxtune.training import log as run_log

  run_log.quiet_third_party()
  compile_cache.use_compile_cache(not args.no_compile_cache)
  try:
    if not args.model and not args.adapter:
      raise UserError("pass --model DIR|HUB_ID, or --adapter RUN_DIR|PEFT_DIR.")
    if not args.prompt and not args.chat:
      raise UserError("pass --prompt TEXT (repeatable) or --chat.")
    check_sampling(args.max_new_tokens, args.temperature, args.top_k, args.top_p, args.seed)
    quant = None if args.quantization == "none" else args.quantization
    free = free_device_bytes()  # before loading: what resolve_decode weighs the model against
    model, ckpt = load_run_model(args.adapter, args.model, quant, args.dtype)
    tokenizer = load_tokenizer(ckpt)
    # This command owns the model: where no copy of the kernel's codes fits, its own permuted.
    one = jax.devices()[0]
    decode = resolve_decode(model.config, devices=jax.device_count(), device=one, free=free,
                            owns_model=True)  # fmt: skip
    kw = dict(
      decode=decode,
      max_new_tokens=args.max_new_tokens,
      temperature=args.temperature,
      top_k=args.top_k,
      top_p=args.top_p,
      seed=args.seed,
      # Past its positions a model runs on, less well: the command line refuses instead.
      max_positions=model.config.max_position_embeddings,
    )
    if args.prompt:
      texts = generate(model, tokenizer, args.prompt, chat=args.chat, **kw)
      for prompt, text in zip(args.prompt, texts, strict=True):
        print(f"### {prompt}\n{text}\n")
      return 0
    history = []  # the whole conversation goes back in each turn, as chat templates expect
    eos = tokenizer.eos_token_id
    while True:
      try:
        line = input("you> ")
      except EOFError:
        return 0
      if line.strip() in ("", "/exit", "/quit"):
        return 0
      history.append({"role": "user", "content": line})
      ids = tokenizer.apply_chat_template(
        history, add_generation_prompt=True, tokenize=True, return_dict=True
      )["input_ids"]
      new = generate_ids(model, [list(ids)], eos_token_ids=[] if eos is None else [eos], **kw)[0]
      reply = tokenizer.decode(new, skip_special_tokens=True)
      history.append({"role": "assistant", "content": reply})
      print("model>", reply)
  except UserError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2


if __name__ == "__main__":
  sys.exit(main())
