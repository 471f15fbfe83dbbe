"""Write a random Llama checkpoint in HF format (config.json + sharded safetensors), no torch.

Used by the benchmarks to produce full-size shapes on the machine that runs them; tensors are
generated and written one at a time so writing never holds the model in memory either.
"""

import argparse
import json
from pathlib import Path

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

SHAPES = {
  "llama-3.1-8b": dict(
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=128256,
    tie_word_embeddings=False,
  ),
  "llama-3.2-1b": dict(
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=64,
    vocab_size=128256,
    tie_word_embeddings=True,
  ),
  "small-500mb": dict(
    hidden_size=1536,
    intermediate_size=4096,
    num_hidden_layers=6,
    num_attention_heads=12,
    num_key_value_heads=4,
    vocab_size=32000,
    tie_word_embeddings=False,
  ),
}


def hf_config(shape: dict) -> dict:
  return {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "max_position_embeddings": 8192,
    "hidden_act": "silu",
    "torch_dtype": "bfloat16",
    "bos_token_id": 1,
    "eos_token_id": 2,
    **shape,
  }


def tensor_shapes(cfg: dict):
  d, f = cfg["hidden_size"], cfg["intermediate_size"]
  h = cfg.get("head_dim") or d // cfg["num_attention_heads"]
  q, kv = cfg["num_attention_heads"] * h, cfg["num_key_value_heads"] * h
  yield "model.embed_tokens.weight", (cfg["vocab_size"], d)
  for i in range(cfg["num_hidden_layers"]):
    p = f"model.layers.{i}."
    yield p + "input_layernorm.weight", (d,)
    yield p + "post_attention_layernorm.weight", (d,)
    for name, shape in (
      ("q_proj", (q, d)),
      ("k_proj", (kv, d)),
      ("v_proj", (kv, d)),
      ("o_proj", (d, q)),
    ):
      yield p + f"self_attn.{name}.weight", shape
    for name, shape in (("gate_proj", (f, d)), ("up_proj", (f, d)), ("down_proj", (d, f))):
      yield p + f"mlp.{name}.weight", shape
  yield "model.norm.weight", (d,)
  if not cfg.get("tie_word_embeddings"):
    yield "lm_head.weight", (cfg["vocab_size"], d)


def write(out: Path, shape_name: str, seed: int = 0, shard_bytes: int = 2 << 30) -> Path:
  cfg = hf_config(SHAPES[shape_name])
  out.mkdir(parents=True, exist_ok=True)
  (out / "config.json").write_text(json.dumps(cfg, indent=2))
  rng = np.random.default_rng(seed)
  shard, size, weight_map, n = {}, 0, {}, 0

  def flush():
    nonlocal shard, size, n
    if shard:
      n += 1
      name = f"model-{n:05d}.safetensors"
      save_file(shard, str(out / name), metadata={"format": "pt"})
      weight_map.update({k: name for k in shard})
      shard, size = {}, 0

  for name, shape in tensor_shapes(cfg):
    if len(shape) == 1:
      t = np.ones(shape, np.float32)
    else:
      t = rng.standard_normal(shape, dtype=np.float32) * np.float32(shape[-1] ** -0.5)
    shard[name] = t.astype(ml_dtypes.bfloat16)
    size += shard[name].nbytes
    if size >= shard_bytes:
      flush()
  flush()
  (out / "model.safetensors.index.json").write_text(
    json.dumps({"metadata": {}, "weight_map": weight_map}, indent=2)
  )
  return out


if __name__ == "__main__":
  ap = argparse.ArgumentParser(description=__doc__)
  ap.add_argument("--shape", choices=sorted(SHAPES), required=True)
  ap.add_argument("--out", type=Path, required=True)
  ap.add_argument("--shard-bytes", type=int, default=2 << 30)
  args = ap.parse_args()
  print(write(args.out, args.shape, shard_bytes=args.shard_bytes))
