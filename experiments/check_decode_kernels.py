"""Decode speed with session 28's one-token kernel dispatch against session 27's, NF4,
alternated in one process.

  python experiments/check_decode_kernels.py --shape llama-3.1-8b --batches 1,16

"s27": decoding's prepared codes through the "lut" lookup and one token padded to a 16-token
tile with wgmmas in flight (ops._forward_config called with two tokens gives that tile).
"s28": dispatch as it is ("plut", and one token as kernel.Config.blocks_as_columns). For each
batch and setting, in the order given, times generate_ids with 1 and 1 + N new tokens (decode
tokens/s = batch * N / difference), each setting compiled anew; checks the tokens generated.
"""

import argparse
import sys
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jaxtune  # noqa: E402
from experiments.bench_decode import timed  # noqa: E402
from experiments.record import record  # noqa: E402
from experiments.write_checkpoint import write  # noqa: E402
from jaxtune import decoding  # noqa: E402
from pallas_kernels.nf4_matmul import ops  # noqa: E402

NOW = (ops.PREPARED_LOOKUP, ops._forward_config)


def use(setting: str) -> None:
  lookup, config = NOW
  if setting == "s27":
    lookup, config = "lut", lambda m, n, k, interp, f=config: f(max(m, 2), n, k, interp)
  ops.PREPARED_LOOKUP, ops._forward_config = lookup, config
  jax.clear_caches()  # both are read when the decode loop is traced


def main():
  ap = argparse.ArgumentParser(description=__doc__)
  ap.add_argument("--shape", default="llama-3.2-1b")
  ap.add_argument("--batches", default="1,16")
  ap.add_argument("--prompt-len", type=int, default=128)
  ap.add_argument("--new-tokens", type=int, default=128)
  ap.add_argument("--bnb-4bit", action="store_true", help="write the checkpoint as *-bnb-4bit")
  ap.add_argument("--lookup", default=None, help="generate_ids' word_lookup: none, inplace, word")
  ap.add_argument("--order", default="s27,s28,s27,s28", help="settings, timed in turn")
  ap.add_argument("--results-dir", default=None)
  args = ap.parse_args()
  path = write(Path(tempfile.mkdtemp()) / args.shape, args.shape, bnb_4bit=args.bnb_4bit)
  lookup = {None: None, "none": None, "inplace": "inplace", "word": True}[args.lookup]
  order = args.order.split(",")
  model = jaxtune.from_pretrained(path, quantization="nf4")
  vocab = model.config.vocab_size
  rows = []
  for b in map(int, args.batches.split(",")):
    prompts = np.random.default_rng(b).integers(3, vocab, (b, args.prompt_len)).tolist()
    tokens, first, speeds = {}, {}, {name: [] for name in dict.fromkeys(order)}
    for name in order:
      use(name)
      t = time.perf_counter()
      tokens[name] = decoding.generate_ids(
        model, prompts, max_new_tokens=args.new_tokens, word_lookup=lookup
      )
      first.setdefault(name, time.perf_counter() - t)
      t1 = timed(model, prompts, 1, word=lookup)
      tn = timed(model, prompts, 1 + args.new_tokens, word=lookup)
      speeds[name].append(b * args.new_tokens / (tn - t1))
      print(b, name, round(speeds[name][-1], 1), flush=True)
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
