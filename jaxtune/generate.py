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
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from jaxtune import plan, run_log
from jaxtune.decoding import generate, generate_ids
from jaxtune.errors import UserError
from jaxtune.session import load_run_model, load_tokenizer


def main(argv: Sequence[str] | None = None) -> int:
  run_log.quiet_third_party()
  p = argparse.ArgumentParser(
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
  p.add_argument("--max-new-tokens", type=int, default=128)
  p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
  p.add_argument("--top-k", type=int, default=0)
  p.add_argument("--top-p", type=float, default=1.0)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--quantization", default="nf4", help="nf4 or none")
  p.add_argument("--dtype", default="bfloat16")
  p.add_argument("--no-compile-cache", action="store_true", help=plan.CACHE_HELP)
  args = p.parse_args(argv)
  plan.use_compile_cache(not args.no_compile_cache)
  try:
    if not args.model and not args.adapter:
      raise UserError("pass --model DIR|HUB_ID, or --adapter RUN_DIR|PEFT_DIR.")
    if not args.prompt and not args.chat:
      raise UserError("pass --prompt TEXT (repeatable) or --chat.")
    quant = None if args.quantization == "none" else args.quantization
    model, ckpt = load_run_model(args.adapter, args.model, quant, args.dtype)
    tokenizer = load_tokenizer(ckpt)
  except UserError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  kw = dict(
    word_lookup="inplace",  # this command owns the model: the kernel's order without a copy
    max_new_tokens=args.max_new_tokens,
    temperature=args.temperature,
    top_k=args.top_k,
    top_p=args.top_p,
    seed=args.seed,
  )
  if args.prompt:
    for prompt, text in zip(
      args.prompt, generate(model, tokenizer, args.prompt, chat=args.chat, **kw), strict=True
    ):
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


if __name__ == "__main__":
  sys.exit(main())
