"""Write a random Llama checkpoint in HF format (config.json + sharded safetensors), no torch.

Used by the benchmarks to produce full-size shapes on the machine that runs them; tensors are
generated and written one at a time so writing never holds the model in memory either.
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from converters.synthetic import tensor_shapes, write_random_checkpoint  # noqa: E402

__all__ = ["SHAPES", "hf_config", "tensor_shapes", "write"]

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
    "bos_token_id": 1,
    "eos_token_id": 2,
    **shape,
  }


def write(out: Path, shape_name: str, seed: int = 0, shard_bytes: int = 2 << 30) -> Path:
  return write_random_checkpoint(
    out, hf_config(SHAPES[shape_name]), seed=seed, shard_bytes=shard_bytes
  )


if __name__ == "__main__":
  ap = argparse.ArgumentParser(description=__doc__)
  ap.add_argument("--shape", choices=sorted(SHAPES), required=True)
  ap.add_argument("--out", type=Path, required=True)
  ap.add_argument("--shard-bytes", type=int, default=2 << 30)
  args = ap.parse_args()
  print(write(args.out, args.shape, shard_bytes=args.shard_bytes))
