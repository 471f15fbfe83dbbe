"""Host memory while exporting: GGUF (streamed tensor by tensor) and merged safetensors.

    PYTHONPATH=. python experiments/export_memory.py --hidden 2048 --layers 8 --vocab 32000

Writes a random Llama checkpoint of that shape with the built-in tokenizer, loads it (NF4,
LoRA r=16 with non-zero B), then exports it in each format in turn while a thread samples the
process's resident memory every 5 ms. Reports the peak rise above the memory before each
export, against the export's size on disk and the largest single tensor. On CPU the model
itself lives in host memory too; the rise is what the export adds.
"""

import argparse
import shutil
import tempfile
import threading
import time
from pathlib import Path

import jax.numpy as jnp

import jaxtune
from converters.synthetic import write_random_checkpoint
from experiments.record import record
from jaxtune.hf import export
from jaxtune.models.lora import iter_linears
from jaxtune.run import default_model


def rss() -> int:
  with open("/proc/self/statm") as f:
    return int(f.read().split()[1]) * 4096


class Peak:
  def __init__(self):
    self.base, self.peak, self.stop = rss(), 0, False
    self.thread = threading.Thread(target=self.run, daemon=True)

  def run(self):
    while not self.stop:
      self.peak = max(self.peak, rss())
      time.sleep(0.005)

  def __enter__(self):
    self.thread.start()
    return self

  def __exit__(self, *exc):
    self.stop = True
    self.thread.join()
    self.peak = max(self.peak, rss())


def main() -> None:
  ap = argparse.ArgumentParser()
  ap.add_argument("--hidden", type=int, default=2048)
  ap.add_argument("--layers", type=int, default=8)
  ap.add_argument("--vocab", type=int, default=32000)
  args = ap.parse_args()
  work = Path(tempfile.mkdtemp(prefix="export-memory-"))
  cfg = {
    **default_model.CONFIG,
    "vocab_size": args.vocab,
    "hidden_size": args.hidden,
    "intermediate_size": args.hidden * 4,
    "num_hidden_layers": args.layers,
    "num_attention_heads": args.hidden // 64,
    "num_key_value_heads": args.hidden // 256,
    "head_dim": 64,
    "max_position_embeddings": 2048,
  }
  ckpt = work / "ckpt"
  write_random_checkpoint(ckpt, cfg, dtype="bfloat16")
  for f in default_model.ensure_default_checkpoint().iterdir():
    if f.name.startswith(("tokenizer", "special", "chat")):
      shutil.copy(f, ckpt / f.name)
  model = jaxtune.apply_lora(jaxtune.from_pretrained(ckpt, quantization="nf4"), rank=16)
  for _, linear in iter_linears(model):
    if linear.lora_b is not None:
      linear.lora_b[...] = jnp.full(linear.lora_b[...].shape, 1e-3, jnp.float32)
  largest = max(
    a * b * 4 for a, b in [(args.vocab, args.hidden), (args.hidden * 4, args.hidden)]
  )  # float32, as merged
  rows = []
  for fmt in ("gguf", "merged"):
    out = work / fmt
    with Peak() as p:
      export.write(model, fmt, out, gguf_type="f16")
    size = sum(f.stat().st_size for f in out.iterdir())
    rows.append(
      {
        "format": fmt,
        "export_bytes": size,
        "peak_rise_bytes": p.peak - p.base,
        "largest_tensor_f32_bytes": largest,
        "rise_over_export": round((p.peak - p.base) / size, 3),
        "rise_over_largest_tensor": round((p.peak - p.base) / largest, 2),
      }
    )
  shutil.rmtree(work)
  shape = f"hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}"
  record(
    "export_memory",
    [{**r, "shape": shape} for r in rows],
    "Export host memory: GGUF (streamed) vs merged safetensors",
    note="peak resident-memory rise over the memory before the export (5 ms samples), CPU; "
    "NF4 + LoRA r=16 model of random weights, f16 GGUF.",
  )
  print(
    f"{'format':8} {'export MB':>10} {'peak rise MB':>13} {'rise/export':>12} {'rise/largest':>13}"
  )
  for r in rows:
    print(
      f"{r['format']:8} {r['export_bytes'] / 2**20:10.0f} {r['peak_rise_bytes'] / 2**20:13.0f} "
      f"{r['rise_over_export']:12.3f} {r['rise_over_largest_tensor']:13.2f}"
    )


if __name__ == "__main__":
  main()
