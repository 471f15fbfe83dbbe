"""Decode speed with forward_cached's layer loop as a scan (one layer a loop iteration) against
the layers unrolled (``decoding.UNROLL_LAYERS_UP_TO``), NF4, alternated in one process.

  python experiments/check_decode_unroll.py --shape llama-3.1-8b --batches 1,16
Writes a random checkpoint, loads it in NF4, and for each batch and setting times
generate_ids with 1 and 1 + N new tokens (decode tokens/s = batch * N / difference), in the
order scan, unrolled, scan, unrolled (each compiled anew); checks that both settings generate
the same tokens.
"""

import argparse
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jaxtune  # noqa: E402
from experiments.bench_decode import timed  # noqa: E402
from experiments.record import record  # noqa: E402
from experiments.write_checkpoint import write  # noqa: E402
from jaxtune.models import decoding  # noqa: E402

# decoding.UNROLL_LAYERS_UP_TO for each setting. (Session 27 also timed 4 and 8 layers an
# iteration, jax.lax.scan's unroll=4 / 8, with this script at commit 8ce8f56.)
SETTINGS = {"scan": 0, "unrolled": 1 << 20}


UNROLL_DEFAULT = decoding.UNROLL_LAYERS_UP_TO


def prompt_logits(model, prompts) -> np.ndarray:
  """Logits [B, V] after the prompts (one forward_cached call), float64, as the setting now
  in decoding.UNROLL_LAYERS_UP_TO computes them."""
  b, t = len(prompts), len(prompts[0])
  graphdef = nnx.graphdef(model)

  @jax.jit
  def f(state, ids):
    m = nnx.merge(graphdef, state)
    pos = jnp.broadcast_to(jnp.arange(t), (b, t))
    cache, valid = decoding.init_cache(m, b, t), jnp.ones((b, t), bool)
    return decoding.forward_cached(m, ids, pos, cache, 0, valid)[0]

  return np.asarray(f(nnx.state(model), jnp.asarray(prompts, jnp.int32)), np.float64)


def decode_parser(doc: str, order: str) -> argparse.ArgumentParser:
  """The options the decode comparisons share (settings timed in turn: ``order``)."""
  ap = argparse.ArgumentParser(description=doc)
  ap.add_argument("--shape", default="llama-3.2-1b")
  ap.add_argument("--batches", default="1,16")
  ap.add_argument("--prompt-len", type=int, default=128)
  ap.add_argument("--new-tokens", type=int, default=128)
  ap.add_argument("--bnb-4bit", action="store_true", help="write the checkpoint as *-bnb-4bit")
  ap.add_argument("--lookup", default=None, help="generate_ids' word_lookup: none, inplace, word")
  ap.add_argument("--order", default=order, help="settings, timed in turn")
  ap.add_argument("--results-dir", default=None)
  return ap


def time_turns(model, prompts, order, use, new_tokens, lookup):
  """For each setting of ``order`` in turn, ``use(setting)`` then generate_ids (its first call
  timed: compiling included) and decode tokens/s = batch * N / (time of 1 + N new tokens - time
  of 1). Returns (tokens, first-call seconds, speeds), each by setting."""
  b = len(prompts)
  tokens, first, speeds = {}, {}, {name: [] for name in dict.fromkeys(order)}
  for name in order:
    use(name)
    t = time.perf_counter()
    tokens[name] = decoding.generate_ids(
      model, prompts, max_new_tokens=new_tokens, word_lookup=lookup
    )
    first.setdefault(name, time.perf_counter() - t)
    t1 = timed(model, prompts, 1, word=lookup)
    tn = timed(model, prompts, 1 + new_tokens, word=lookup)
    speeds[name].append(b * new_tokens / (tn - t1))
    print(b, name, round(speeds[name][-1], 1), flush=True)
  return tokens, first, speeds


def on_checkpoint(args, compare) -> None:
  """``compare(args, path)`` on a random checkpoint of ``args.shape``, deleted afterwards (a 70B
  one is ~40 GB)."""
  with tempfile.TemporaryDirectory(dir="/tmp") as tmp:
    compare(args, write(Path(tmp) / args.shape, args.shape, bnb_4bit=args.bnb_4bit))


def load(args, path):
  """(the NF4 model, generate_ids' word_lookup, the settings in turn) from ``args``."""
  lookup = {None: None, "none": None, "inplace": "inplace", "word": True}[args.lookup]
  return jaxtune.from_pretrained(path, quantization="nf4"), lookup, args.order.split(",")


def use_layers(name: str) -> None:
  decoding.UNROLL_LAYERS_UP_TO = SETTINGS[name]
  jax.clear_caches()  # the setting is read when the loop is traced


def main():
  ap = decode_parser(__doc__, "scan,unrolled,scan,unrolled")
  ap.add_argument("--skip-logits", action="store_true", help="no prompt-logits comparison")
  ap.add_argument(
    "--logits-only",
    action="store_true",
    help="only the prompt logits of both settings against the float32 model (same NF4 codes)",
  )
  on_checkpoint(ap.parse_args(), compare)


def compare(args, path):
  model, lookup, order = load(args, path)
  vocab = model.config.vocab_size
  rows = []
  for b in map(int, args.batches.split(",")):
    rng = np.random.default_rng(b)
    prompts = rng.integers(3, vocab, (b, args.prompt_len)).tolist()
    logits = {name: np.ones(1) for name in SETTINGS}
    for name in () if args.skip_logits else ("scan", "unrolled"):
      use_layers(name)
      logits[name] = prompt_logits(model, prompts)
    err = np.linalg.norm(logits["unrolled"] - logits["scan"]) / np.linalg.norm(logits["scan"])
    err = None if args.skip_logits else err
    print(b, "prompt logits, unrolled against scan: relative L2", err, flush=True)
    if args.logits_only:
      ref_model = jaxtune.from_pretrained(path, quantization="nf4", dtype="float32")
      ref = prompt_logits(ref_model, prompts)
      del ref_model
      for name in ("scan", "unrolled"):
        rel = np.linalg.norm(logits[name] - ref) / np.linalg.norm(ref)
        print(b, f"prompt logits, {name} (bfloat16) against float32: relative L2 {rel:.4g}")
        rows.append({"model": args.shape, "batch": b, "layers": name, "against": "float32",
                     "prompt_logits_rel_err": float(rel),
                     "prompt_logits_rel_err_unrolled_vs_scan": float(err)})  # fmt: skip
      continue
    tokens, first, speeds = time_turns(model, prompts, order, use_layers, args.new_tokens, lookup)
    both = {"scan", "unrolled"} <= set(tokens)
    same = tokens["scan"] == tokens["unrolled"] if both else None
    for name in speeds:
      rows.append({
        "model": args.shape, "quantization": "nf4", "batch": b, "layers": name,
        "decode_tokens_per_s": float(np.median(speeds[name])),
        "runs": [round(x, 1) for x in speeds[name]], "same_tokens": same,
        "prompt_logits_rel_err_unrolled_vs_scan": err and float(err), "lookup": args.lookup,
        "first_call_s": round(first[name], 1),
        "ratio_to_scan": float(np.median(speeds[name]) / np.median(speeds.get("scan", [np.nan]))),
      })  # fmt: skip
  decoding.UNROLL_LAYERS_UP_TO = UNROLL_DEFAULT
  title = f"Decode, layers scanned vs unrolled, {args.shape}, NF4"
  record("check_decode_unroll", rows, title, out_dir=args.results_dir)
  if args.logits_only:
    return
  print("\n| batch | layers | decode tok/s | runs | ratio to scan | same tokens | first call s |")
  for r in rows:
    print(f"| {r['batch']} | {r['layers']} | {r['decode_tokens_per_s']:.0f} | {r['runs']} | "
          f"{r['ratio_to_scan']:.3f} | {r['same_tokens']} | {r['first_call_s']} |")  # fmt: skip


if __name__ == "__main__":
  main()
