"""Write a random checkpoint in HF format (config.json + sharded safetensors), no torch.

Used by the benchmarks to produce full-size shapes on the machine that runs them; tensors are
generated and written one at a time so writing never holds the model in memory either.
A shape names its family ("llama" unless it says otherwise); ``hf_config`` writes the
config.json that family's transformers class writes, so the converter reads it as it would
read the released checkpoint's.
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from converters.synthetic import tensor_shapes, write_random_checkpoint  # noqa: E402

__all__ = ["FAMILIES", "SHAPES", "hf_config", "tensor_shapes", "write"]

# What the released checkpoints' config.json hold beyond the shape.
FAMILIES = {
  "llama": dict(
    model_type="llama",
    architectures=["LlamaForCausalLM"],
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    max_position_embeddings=8192,
    hidden_act="silu",
    bos_token_id=1,
    eos_token_id=2,
  ),
  "qwen2": dict(
    model_type="qwen2",
    architectures=["Qwen2ForCausalLM"],
    rms_norm_eps=1e-6,
    rope_theta=1000000.0,
    max_position_embeddings=32768,
    hidden_act="silu",
    use_sliding_window=False,
    bos_token_id=151643,
    eos_token_id=151643,
  ),
  "gemma2": dict(
    model_type="gemma2",
    architectures=["Gemma2ForCausalLM"],
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    max_position_embeddings=8192,
    hidden_act="gelu_pytorch_tanh",
    hidden_activation="gelu_pytorch_tanh",
    attention_bias=False,
    bos_token_id=2,
    eos_token_id=1,
    pad_token_id=0,
  ),
}

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
  "llama-3.1-70b": dict(
    hidden_size=8192,
    intermediate_size=28672,
    num_hidden_layers=80,
    num_attention_heads=64,
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
  "qwen2.5-7b": dict(
    family="qwen2",
    hidden_size=3584,
    intermediate_size=18944,
    num_hidden_layers=28,
    num_attention_heads=28,
    num_key_value_heads=4,
    vocab_size=152064,
    tie_word_embeddings=False,
  ),
  "gemma-2-9b": dict(
    family="gemma2",
    hidden_size=3584,
    intermediate_size=14336,
    num_hidden_layers=42,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=256,
    vocab_size=256000,
    query_pre_attn_scalar=256,
    attn_logit_softcapping=50.0,
    final_logit_softcapping=30.0,
    sliding_window=4096,
    layer_types=["sliding_attention", "full_attention"] * 21,
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
# CPU smoke shapes, one per family (Gemma's window shorter than a smoke run's sequence).
_TINY = dict(
  hidden_size=128,
  intermediate_size=256,
  num_hidden_layers=2,
  num_attention_heads=4,
  num_key_value_heads=2,
  head_dim=32,
  vocab_size=512,
  bos_token_id=1,
  eos_token_id=2,
)
SHAPES["tiny-llama"] = dict(_TINY, tie_word_embeddings=False)
SHAPES["tiny-qwen2"] = dict(_TINY, family="qwen2", tie_word_embeddings=False)
SHAPES["tiny-gemma2"] = dict(
  _TINY,
  family="gemma2",
  query_pre_attn_scalar=24,
  attn_logit_softcapping=50.0,
  final_logit_softcapping=30.0,
  sliding_window=16,
  layer_types=["sliding_attention", "full_attention"],
  tie_word_embeddings=True,
)


def hf_config(shape: dict) -> dict:
  """config.json of a shape: its family's fields, then the shape's own."""
  shape = dict(shape)
  return {**FAMILIES[shape.pop("family", "llama")], **shape}


def write(
  out: Path,
  shape_name: str,
  seed: int = 0,
  shard_bytes: int = 2 << 30,
  bnb_4bit: bool = False,
  positions: int = 0,
) -> Path:
  """``positions``: at least this many in max_position_embeddings (long-context runs)."""
  cfg = hf_config(SHAPES[shape_name])
  cfg["max_position_embeddings"] = max(cfg["max_position_embeddings"], positions)
  return write_random_checkpoint(out, cfg, seed=seed, shard_bytes=shard_bytes, bnb_4bit=bnb_4bit)


if __name__ == "__main__":
  ap = argparse.ArgumentParser(description=__doc__)
  ap.add_argument("--shape", choices=sorted(SHAPES), required=True)
  ap.add_argument("--out", type=Path, required=True)
  ap.add_argument("--shard-bytes", type=int, default=2 << 30)
  ap.add_argument("--bnb-4bit", action="store_true", help="projections as a *-bnb-4bit repo")
  args = ap.parse_args()
  print(write(args.out, args.shape, shard_bytes=args.shard_bytes, bnb_4bit=args.bnb_4bit))
