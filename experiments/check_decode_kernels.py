"""Decode speed with session 28's one-token kernel dispatch against session 27's, NF4,
alternated in one process.

  python experiments/check_decode_kernels.py --shape llama-3.1-8b --batches 1,16

"s27": decoding's prepared codes through the "lut" lookup and one token padded to a 16-token
tile with wgmmas in flight (ops._forward_config called with two tokens gives that tile).
"s28": dispatch as it is ("plut", and one token as kernel.Config.blocks_as_columns). For each
batch and setting, in the order given, times generate_ids with 1 and 1 + N new tokens (decode
tokens/s = batch * N / difference), each setting compiled anew; checks the tokens generated.
"""

import sys
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from experiments.check_decode_unroll import (  # noqa: E402
  decode_parser,
  load,
  on_checkpoint,
  time_turns,
)
from experiments.record import record  # noqa: E402
from pallas_kernels.nf4_matmul import ops  # noqa: E402

NOW = (ops.PREPARED_LOOKUP, ops._forward_config)


def use(setting: str) -> None:
  lookup, config = NOW
  if setting == "s27":
    lookup, config = "lut", lambda m, n, k, interp, f=config: f(max(m, 2), n, k, interp)
  ops.PREPARED_LOOKUP, ops._forward_config = lookup, config
  jax.clear_caches()  # both are read when the decode loop is traced


def main():
  on_checkpoint(decode_parser(__doc__, "s27,s28,s27,s28").parse_args(), compare)


def compare(args, path):
  model, lookup, order = load(args, path)
  vocab = model.config.vocab_size
  rows = []
  for b in map(int, args.batches.split(",")):
    prompts = np.random.default_rng(b).integers(3, vocab, (b, args.prompt_len)).tolist()
    tokens, first, speeds = time_turns(model, prompts, order, use, args.new_tokens, lookup)
    same = [np.mean(np.asarray(tokens["s27"][i]) == np.asarray(tokens["s28"][i])) for i in range(b)]
    for name in speeds:
      rows.append({
        "model": args.shape, "quantization": "nf4", "batch": b, "dispatch": name,
        "decode_tokens_per_s": float(np.median(speeds[name])),
        "runs": [round(x, 1) for x in speeds[name]], "lookup": args.lookup,
        "tokens_equal_fraction": float(np.mean(same)), "first_call_s": round(first[name], 1),
        "ratio_to_s27": float(np.median(speeds[name]) / np.median(speeds["s27"])),
      })  # fmt: skip
  use("s28")
  record("check_decode_kernels", rows, f"Decode, kernel dispatch s27 vs s28, {args.shape}, NF4",
         out_dir=args.results_dir)  # fmt: skip
  print("\n| batch | dispatch | decode tok/s | runs | ratio to s27 | same tokens | first call s |")
  for r in rows:
    print(
      f"| {r['batch']} | {r['dispatch']} | {r['decode_tokens_per_s']:.0f} | {r['runs']} | "
      f"{r['ratio_to_s27']:.3f} | {r['tokens_equal_fraction']:.3f} | {r['first_call_s']} |"
    )


if __name__ == "__main__":
  main()
