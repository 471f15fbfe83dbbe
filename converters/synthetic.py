"""Random-weight decoder checkpoints in HF format, written tensor by tensor (no torch needed).

For the built-in default model and for benchmarks that need full-size shapes on a machine
without downloads. Layout and names are exactly what transformers' save_pretrained writes for
the config's model_type: Llama, plus Qwen's q/k/v biases, Qwen 3's and Gemma 3's q/k norms and
Gemma 2's and 3's sandwich norms.
"""

import json
from collections.abc import Iterator
from pathlib import Path

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

_NP_DTYPES = {"bfloat16": ml_dtypes.bfloat16, "float32": np.float32, "float16": np.float16}


def tensor_shapes(cfg: dict) -> Iterator[tuple[str, tuple[int, ...]]]:
  """(name, PyTorch shape) of every tensor of a checkpoint with this config.json."""
  model_type = cfg.get("model_type", "llama")
  d, f = cfg["hidden_size"], cfg["intermediate_size"]
  h = cfg.get("head_dim") or d // cfg["num_attention_heads"]
  q, kv = (
    cfg["num_attention_heads"] * h,
    cfg.get("num_key_value_heads", cfg["num_attention_heads"]) * h,
  )
  attention_bias = cfg.get("attention_bias", False)
  qkv_bias = attention_bias or model_type == "qwen2"
  norms = ["input_layernorm", "post_attention_layernorm"]
  if model_type in ("gemma2", "gemma3_text"):
    norms += ["pre_feedforward_layernorm", "post_feedforward_layernorm"]
  yield "model.embed_tokens.weight", (cfg["vocab_size"], d)
  for i in range(cfg["num_hidden_layers"]):
    p = f"model.layers.{i}."
    for norm in norms:
      yield p + f"{norm}.weight", (d,)
    attn = (("q_proj", (q, d)), ("k_proj", (kv, d)), ("v_proj", (kv, d)), ("o_proj", (d, q)))
    for name, shape in attn:
      yield p + f"self_attn.{name}.weight", shape
      if (qkv_bias and name != "o_proj") or (attention_bias and name == "o_proj"):
        yield p + f"self_attn.{name}.bias", shape[:1]
    if model_type in ("qwen3", "gemma3_text"):
      yield p + "self_attn.q_norm.weight", (h,)
      yield p + "self_attn.k_norm.weight", (h,)
    for name, shape in (("gate_proj", (f, d)), ("up_proj", (f, d)), ("down_proj", (d, f))):
      yield p + f"mlp.{name}.weight", shape
      if cfg.get("mlp_bias"):
        yield p + f"mlp.{name}.bias", shape[:1]
  yield "model.norm.weight", (d,)
  if not cfg.get("tie_word_embeddings", model_type.startswith("gemma")):
    yield "lm_head.weight", (cfg["vocab_size"], d)


def write_random_checkpoint(
  out: Path,
  cfg: dict,
  *,
  seed: int = 0,
  dtype: str = "bfloat16",
  shard_bytes: int = 2 << 30,
  bnb_4bit: bool = False,
) -> Path:
  """config.json + safetensors shards (+ index when more than one) with seeded random weights.

  ``bnb_4bit``: the decoder layers' projections stored as a ``*-bnb-4bit`` repository stores
  them (NF4 with double quantization, the six tensors of converters/bnb.py), random codes
  whose weights have absmax 0.05 per block of 64; embeddings, norms and lm_head in ``dtype``.
  Written straight in that layout, not quantized from a full-precision file, so a 70B one
  takes about a minute.
  """
  out = Path(out)
  out.mkdir(parents=True, exist_ok=True)
  config = {**cfg, "torch_dtype": dtype}
  if bnb_4bit:
    from converters import bnb

    config["quantization_config"] = bnb.quantization_config(dtype)
  (out / "config.json").write_text(json.dumps(config, indent=2))
  rng = np.random.default_rng(seed)
  # Drawing billions of normals takes minutes; tensors instead take rotated copies of one
  # pool, which is as good for loading and timing (random, never zeros) and seconds to make.
  largest = max(int(np.prod(s)) for _, s in tensor_shapes(cfg))
  pool = rng.standard_normal(min(largest, 1 << 24), dtype=np.float32)
  np_dtype = _NP_DTYPES[dtype]
  shards: list[dict] = [{}]
  size = 0
  files: dict[str, str] = {}

  def flush(last: bool):
    nonlocal size
    if not shards[-1]:
      return
    n = len(shards)
    name = "model.safetensors" if last and n == 1 else f"model-{n:05d}.safetensors"
    save_file(shards[-1], str(out / name), metadata={"format": "pt"})
    files.update({k: name for k in shards[-1]})
    shards[-1] = {}
    shards.append({})
    size = 0

  # Gemma's norms scale by (1 + w): a weight near 0 is the identity there, near 1 elsewhere.
  norm_one = np.float32(0.0 if cfg.get("model_type", "llama").startswith("gemma") else 1.0)
  code_pool = rng.integers(0, 256, 1 << 26, dtype=np.uint8) if bnb_4bit else None
  for name, shape in tensor_shapes(cfg):
    if bnb_4bit and ".layers." in name and name.endswith("_proj.weight"):
      parts = _random_bnb(code_pool, shape, dtype, rng)
      for suffix, t in parts.items():
        key = name if suffix == "weight" else name + suffix
        shards[-1][key] = t
        size += t.nbytes
      if size >= shard_bytes:
        flush(last=False)
      continue
    t = np.resize(np.roll(pool, int(rng.integers(pool.size))), shape)
    if name.endswith(".bias"):
      t = np.float32(0.1) * t
    elif len(shape) == 1:
      t = norm_one + np.float32(0.1) * t
    else:
      t = t * np.float32(shape[-1] ** -0.5)
    shards[-1][name] = t.astype(np_dtype)
    size += shards[-1][name].nbytes
    if size >= shard_bytes:
      flush(last=False)
  flush(last=True)
  if len(set(files.values())) > 1:
    (out / "model.safetensors.index.json").write_text(
      json.dumps({"metadata": {}, "weight_map": files}, indent=2)
    )
  return out


def _random_bnb(pool: np.ndarray, shape: tuple[int, int], dtype: str, rng) -> dict:
  """The six bitsandbytes tensors of a random NF4 Linear of PyTorch ``shape`` [out, in]:
  codes from ``pool`` (rotated), every block's absmax the dynamic map's 1.0 times
  nested_absmax 0.02 plus the offset 0.03."""
  from converters import bnb
  from pallas_kernels import nf4
  from pallas_kernels.nf4_maps import DYNAMIC_MAP

  n = int(np.prod(shape))
  blocks = -(-n // nf4.BLOCKSIZE)
  codes = np.resize(np.roll(pool, int(rng.integers(pool.size))), (n + 1) // 2)
  one = np.uint8(np.argmax(DYNAMIC_MAP))  # the code of 1.0
  nested = -(-blocks // nf4.NESTED_BLOCKSIZE)
  q = nf4.NF4Quantized(
    codes,
    np.full(blocks, one, np.uint8),
    np.full(nested, 0.02, np.float32),
    np.float32(0.03),
  )
  return bnb.pack(q, shape, dtype)
