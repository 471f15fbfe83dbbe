"""Decode speed of jaxtune.models.decoding's KV-cache path, NF4 against the same model in bf16.

Writes a random-weight checkpoint of the shape, loads it twice (NF4 base, and bf16 without
NF4), and for each batch size times generate_ids with 1 and with 1 + N new tokens after a
warm-up; decode tokens/s = batch * N / (difference), so prefill and compilation drop out.

  python experiments/bench_decode.py --shape llama-3.2-1b --batches 1,32
"""

import argparse
import functools
import sys
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jaxtune  # noqa: E402
from experiments.measure import wall_ms  # noqa: E402
from experiments.record import record  # noqa: E402
from experiments.write_checkpoint import write  # noqa: E402
from jaxtune.models import decoding, kernel_operands  # noqa: E402
from jaxtune.models.decoding import generate_ids  # noqa: E402
from jaxtune.parallel.runtime import Decode  # noqa: E402
from pallas_kernels.nf4_matmul import ops  # noqa: E402

# What a run's plan gives decoding on one Hopper GPU (run.choices.resolve_decode).
NF4 = "few-tokens"


def timed(model, prompts, n, word=None, fuse=True, reps=3):
  """Median seconds of generate_ids (after a compiling call)."""
  decode = Decode(word_codes=bool(word) and word, nf4_matmul=NF4)
  call = lambda: generate_ids(model, prompts, max_new_tokens=n, decode=decode, fuse=fuse)  # noqa: E731
  return wall_ms(call, reps=reps) / 1e3


# --lookups names -> (Decode.word_codes, generate_ids' fuse)
LOOKUPS = {
  "prmt": (False, False),
  "word": (True, False),
  "fused": (True, True),
  "inplace": ("inplace", True),  # the model's own codes permuted in place (no copy)
}


def kernel_operand_errors(model, b: int, lookups) -> dict:
  """One token step's logits (empty cache, one token a row) with the decode loop's kernel
  operands (``lookups`` of word, fused, inplace) against the model as loaded: relative L2
  errors; beside them the distance of XLA's dequantize-then-dot (no kernel) from the same
  logits, which is how far two right answers drift apart through the layers."""
  ids = jnp.asarray(np.random.default_rng(b).integers(0, model.config.vocab_size, (b, 1)))
  pos, valid = jnp.zeros((b, 1), jnp.int32), jnp.ones((b, 64), bool)
  graphdef = nnx.graphdef(model)

  @functools.partial(jax.jit, static_argnums=0)
  def step(how, state):
    m = nnx.merge(graphdef, state)
    if how in ("word", "fused"):
      kernel_operands.prepare_kernel_operands(m, b, True, fuse=how == "fused", nf4_matmul=NF4)
    elif how == "inplace":
      kernel_operands.prepare_kernel_operands(m, b, word="inplace", nf4_matmul=NF4)
    nf4 = "xla" if how == "xla" else NF4
    cache = decoding.init_cache(m, b, 64)
    return decoding.forward_cached(m, ids, pos, cache, 0, valid, nf4)[0]

  plain = np.asarray(step(None, nnx.state(model)), np.float64)
  rel = lambda y: float(np.linalg.norm(np.asarray(y) - plain) / np.linalg.norm(plain))  # noqa: E731
  errors = {}
  for how in ("word", "fused"):
    if how in lookups:
      errors[f"{how}_rel_err"] = rel(step(how, nnx.state(model)))
  if "inplace" in lookups:
    with kernel_operands.codes_in_word_order(model, b, nf4_matmul=NF4):
      errors["inplace_rel_err"] = rel(step("inplace", nnx.state(model)))
  errors["xla_rel_err"] = rel(step("xla", nnx.state(model)))
  return errors


def main():
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  ap.add_argument("--shape", default="llama-3.2-1b")
  ap.add_argument("--batches", default="1,32")
  ap.add_argument("--prompt-len", type=int, default=128)
  ap.add_argument("--new-tokens", type=int, default=128)
  ap.add_argument("--results-dir", default=None)
  ap.add_argument("--checkpoint-dir", default=None, help="reuse or keep the checkpoint here")
  ap.add_argument("--bnb-4bit", action="store_true", help="write the checkpoint as *-bnb-4bit")
  ap.add_argument("--no-bf16", action="store_true", help="NF4 only (70B: bf16 does not fit)")
  ap.add_argument(
    "--compare-lookups",
    action="store_true",
    help="NF4 three times: the kernel's prmt lookup, its word lookup with one launch per "
    "layer, then with q/k/v and gate/up fused (decoding's default where the copy of the "
    "codes fits); same as --lookups prmt,word,fused",
  )
  ap.add_argument(
    "--lookups",
    default=None,
    help=f"NF4 once per entry of {','.join(LOOKUPS)} (inplace: the generate command's choice)",
  )
  ap.add_argument(
    "--prepared-lookup",
    default=None,
    choices=("word", "lut"),
    help="the kernel's lookup for codes given in word order (ops.PREPARED_LOOKUP; default: "
    f"{ops.PREPARED_LOOKUP}), e.g. word to time the lookup decoding took before lut",
  )
  args = ap.parse_args()
  if args.prepared_lookup:
    ops.PREPARED_LOOKUP = args.prepared_lookup
  lookups = args.lookups.split(",") if args.lookups else []
  if args.compare_lookups:
    lookups = ["prmt", "word", "fused"]
  rows = []
  with tempfile.TemporaryDirectory(dir="/tmp") as tmp:
    ckpt = Path(args.checkpoint_dir or tmp) / args.shape
    if not (ckpt / "config.json").is_file():
      ckpt = write(ckpt, args.shape, bnb_4bit=args.bnb_4bit)
    for quant in ("nf4",) if args.no_bf16 else ("nf4", None):
      model = jaxtune.from_pretrained(ckpt, quantization=quant, dtype="bfloat16")
      vocab = model.config.vocab_size
      variants = [(name, LOOKUPS[name]) for name in lookups] if quant else []
      variants = variants or [("default", (None, True))]
      if quant and set(lookups) - {"prmt"}:
        for b in (int(x) for x in args.batches.split(",")):
          errors = kernel_operand_errors(model, b, lookups)
          print(f"batch {b}: logits vs the model as loaded: {errors}", flush=True)
          bound = max(1e-2, 2 * errors["xla_rel_err"])
          assert all(v <= bound for k, v in errors.items() if k != "xla_rel_err"), errors
      for b, (name, (word, fuse)) in (
        (int(x), v) for x in args.batches.split(",") for v in variants
      ):
        rng = np.random.default_rng(b)
        prompts = rng.integers(0, vocab, (b, args.prompt_len)).tolist()
        t1 = timed(model, prompts, 1, word, fuse)
        tn = timed(model, prompts, 1 + args.new_tokens, word, fuse)
        row = {
          "model": args.shape,
          "quantization": quant or "bf16",
          "lookup": name if quant else None,
          "prepared_lookup": ops.PREPARED_LOOKUP if quant else None,  # for word-order codes
          "fused_launches": bool(fuse and word is True) if quant else None,
          "batch": b,
          "prompt_len": args.prompt_len,
          "new_tokens": args.new_tokens,
          "decode_tokens_per_s": b * args.new_tokens / (tn - t1),
          "ms_per_token_step": (tn - t1) / args.new_tokens * 1e3,
          "prefill_plus_one_ms": t1 * 1e3,
        }
        rows.append(row)
        print(row, flush=True)
      del model
  for base_name, key in (("bf16", "ratio_vs_bf16"), ("prmt", "ratio_vs_prmt")):
    base = {
      r["batch"]: r["decode_tokens_per_s"]
      for r in rows
      if base_name in (r["quantization"], r["lookup"])
    }
    for r in rows:
      if r["batch"] in base:
        r[key] = r["decode_tokens_per_s"] / base[r["batch"]]
  record(
    "bench_decode",
    rows,
    f"Decode speed, {args.shape}, KV cache, greedy",
    note="NF4 rows: the Pallas kernel where dispatch picks it (one Hopper GPU, at most 64 "
    "rows), else XLA's dequantize-then-dot; ratio_vs_bf16 against the same model loaded "
    "without NF4 in the same run, ratio_vs_prmt against the prmt lookup's row.",
    out_dir=args.results_dir,
  )
  print("\n| quant | lookup | fused | batch | decode tok/s | ms/step | vs bf16 | vs prmt |")
  for r in rows:
    ratios = (r.get("ratio_vs_bf16"), r.get("ratio_vs_prmt"))
    print(
      f"| {r['quantization']} | {r['lookup'] or ''} | {r['fused_launches'] or ''} | {r['batch']} | "
      f"{r['decode_tokens_per_s']:.0f} | {r['ms_per_token_step']:.2f} | "
      + " | ".join("" if x is None else f"{x:.2f}" for x in ratios)
      + " |"
    )


if __name__ == "__main__":
  main()
