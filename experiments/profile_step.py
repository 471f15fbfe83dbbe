"""Where a QLoRA training step spends its time: forward, loss, backward, separately timed.

python experiments/profile_step.py --shape llama-3.2-1b --batch 4
"""

import argparse
import sys
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jaxtune  # noqa: E402
from experiments.measure import wall_ms  # noqa: E402
from experiments.write_checkpoint import write  # noqa: E402
from jaxtune.parallel import runtime  # noqa: E402

bench = wall_ms  # its name in this script


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--shape", default="llama-3.2-1b")
  ap.add_argument("--batch", type=int, default=4)
  ap.add_argument("--seq", type=int, default=2048)
  ap.add_argument("--remat", default="dots_no_batch")
  ap.add_argument("--hlo-out", default=None, help="write the forward's optimized HLO here")
  args = ap.parse_args()
  with tempfile.TemporaryDirectory(dir="/tmp") as tmp:
    model = jaxtune.from_pretrained(write(Path(tmp) / "c", args.shape), dtype="bfloat16")
  model = jaxtune.apply_lora(model, rank=16, alpha=16)
  rt = runtime.Runtime(dtype="bfloat16", remat=args.remat, attention="cudnn")
  graphdef, lora, frozen = nnx.split(model, nnx.LoRAParam, ...)
  cfg = model.config
  ids = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (args.batch, args.seq)))

  def hidden(lora, frozen, ids):
    return nnx.merge(graphdef, lora, frozen).hidden_states(ids, runtime=rt)

  def loss(lora, frozen, ids):
    m = nnx.merge(graphdef, lora, frozen)
    logits = m(ids, runtime=rt)
    return optax.softmax_cross_entropy_with_integer_labels(logits, ids).mean()

  def loss_bf16_logits(lora, frozen, ids):
    m = nnx.merge(graphdef, lora, frozen)
    logits = m.logits_from_hidden(m.hidden_states(ids, runtime=rt))
    return optax.softmax_cross_entropy_with_integer_labels(logits, ids).mean()

  def sum_hidden(lora, frozen, ids):
    return hidden(lora, frozen, ids).astype(jnp.float32).sum()

  h = jax.jit(hidden)(lora, frozen, ids)
  head = jax.jit(lambda lora, frozen, h: nnx.merge(graphdef, lora, frozen).logits_from_hidden(h))
  rows = {
    "forward hidden (layers only)": bench(jax.jit(hidden), lora, frozen, ids),
    "lm_head matmul": bench(head, lora, frozen, h),
    "forward + fp32 loss": bench(jax.jit(loss), lora, frozen, ids),
    "grad, layers only (sum of hidden)": bench(jax.jit(jax.grad(sum_hidden)), lora, frozen, ids),
    "grad, fp32 logits loss": bench(jax.jit(jax.grad(loss)), lora, frozen, ids),
    "grad, bf16 logits loss": bench(jax.jit(jax.grad(loss_bf16_logits)), lora, frozen, ids),
  }
  # Variants of the forward that isolate one suspect each.
  loop, xla = rt.replace(scan_layers=False), rt.replace(attention="xla")
  rows["forward hidden, python loop over layers"] = bench(
    jax.jit(lambda lo, fr, ids: nnx.merge(graphdef, lo, fr).hidden_states(ids, runtime=loop)),
    lora, frozen, ids,
  )  # fmt: skip
  rows["forward hidden, xla attention"] = bench(
    jax.jit(lambda lo, fr, ids: nnx.merge(graphdef, lo, fr).hidden_states(ids, runtime=xla)),
    lora, frozen, ids,
  )  # fmt: skip
  d, f = cfg.hidden_size, cfg.intermediate_size
  x = jnp.ones((args.batch, args.seq, d), jnp.bfloat16)
  wg = jnp.ones((f, d), jnp.bfloat16) * 0.01
  wd = jnp.ones((d, f), jnp.bfloat16) * 0.01

  def mlp_only(x, wg, wd):
    for _ in range(cfg.num_layers):
      h = jnp.einsum("...i,oi->...o", x, wg)
      h = jax.nn.silu(h) * jnp.einsum("...i,oi->...o", x, wg)
      x = x + jnp.einsum("...i,oi->...o", h, wd)
    return x

  mlp_flops = 2 * 3 * d * f * args.batch * args.seq * cfg.num_layers
  ms = bench(jax.jit(mlp_only), x, wg, wd)
  rows[f"bare MLP matmuls x{cfg.num_layers} ({mlp_flops / ms / 1e9:.0f} TFLOP/s)"] = ms
  if args.hlo_out:
    text = jax.jit(hidden).lower(lora, frozen, ids).compile().as_text()
    Path(args.hlo_out).write_text(text)
  tokens = args.batch * args.seq
  print(
    f"\n{args.shape} batch {args.batch} seq {args.seq} remat {args.remat} on "
    f"{jax.devices()[0].device_kind}"
  )
  for k, v in rows.items():
    print(f"| {k} | {v:.1f} ms | {tokens / v * 1e3:.0f} tok/s |")


if __name__ == "__main__":
  main()
