"""jaxtune model -> one GGUF file for llama.cpp and Ollama, LoRA merged in.

``export_gguf(model, out_dir, gguf_type)`` writes ``out_dir/model-<gguf_type>.gguf`` (for
example ``model-q8_0.gguf``) the way llama.cpp's convert_hf_to_gguf.py writes the same
checkpoint: its tensor names (``token_embd.weight``, ``blk.N.attn_q.weight``, ...), Llama's
q/k rows permuted for llama.cpp's rope, Gemma's norm weights stored as ``1 + w``, Llama 3's
rope scaling as a ``rope_freqs`` tensor, and the tokenizer (converters/gguf_vocab.py). Weights
are the merged ones ``export_merged`` writes (the LoRA update added to the ``merge_into`` base:
the dequantized NF4 weights, or the checkpoint's original ones), computed and written one
tensor at a time: the header goes first, then each tensor's data as it is made, so host memory
holds one tensor.

Types: f16, bf16, f32, q8_0, q5_1, q5_0, q4_1, q4_0 (the ones gguf-py can quantize). Norms,
biases and other 1-D tensors stay f32. A matrix whose rows do not split into the type's
blocks is written as f16, as llama.cpp's converter does (logged once); with the 4- and 5-bit
types the output layer is q8_0, as llama-quantize keeps it at higher precision. A model none
of whose projections can take the type is refused.
"""

import contextlib
import dataclasses
import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import jax
import numpy as np

from converters.gguf_vocab import tokenizer_writer
from jaxtune.errors import ExportError
from jaxtune.hf.write import (
  OriginalWeights,
  linear_weight,
  merge_source,
  model_tensors,
  param_value,
)
from jaxtune.models import rope as ropes
from jaxtune.models.config import SLIDING, ModelConfig, RopeConfig

if TYPE_CHECKING:
  import gguf
  from flax import nnx

log = logging.getLogger(__name__)

# --gguf-type -> (tensor type name, llama.cpp file type name), as gguf-py spells them.
GGUF_TYPES = {
  "f16": ("F16", "MOSTLY_F16"),
  "bf16": ("BF16", "MOSTLY_BF16"),
  "f32": ("F32", "ALL_F32"),
  "q8_0": ("Q8_0", "MOSTLY_Q8_0"),
  "q5_1": ("Q5_1", "MOSTLY_Q5_1"),
  "q5_0": ("Q5_0", "MOSTLY_Q5_0"),
  "q4_1": ("Q4_1", "MOSTLY_Q4_1"),
  "q4_0": ("Q4_0", "MOSTLY_Q4_0"),
}
# jaxtune model_type -> llama.cpp architecture.
ARCHITECTURES = {
  "llama": "llama",
  "qwen2": "qwen2",
  "qwen3": "qwen3",
  "gemma": "gemma",
  "gemma2": "gemma2",
  "gemma3_text": "gemma3",
}


def refusal(model_type: str) -> str:
  """The sentence for a family GGUF export does not write yet."""
  return (
    f"GGUF export does not support model_type {model_type!r} yet; export merged "
    "(--export merged) and convert that with llama.cpp's convert_hf_to_gguf.py."
  )


def gguf_file_name(gguf_type: str) -> str:
  """The file export_gguf writes: ``model-<gguf_type>.gguf``."""
  return f"model-{gguf_type}.gguf"


@dataclasses.dataclass(frozen=True)
class _Tensor:
  name: str  # GGUF name
  shape: tuple[int, ...]  # numpy order: [rows, row size]
  qtype: "gguf.GGMLQuantizationType"
  read: Callable[[], np.ndarray]  # float32 values in GGUF's layout


@contextlib.contextmanager
def _quiet_gguf() -> Iterator[None]:
  """gguf-py's own notes off the terminal while exporting (its crude reading of a tokenizer's
  post-processor warns "Unknown separator token" for Llama 3's and SmolLM2's, as llama.cpp's
  converter does): they say nothing a user can act on, and what jaxtune checks itself it says
  (this module's and gguf_vocab's loggers). gguf-py's errors still show."""
  logger = logging.getLogger("gguf")
  level = logger.level
  logger.setLevel(logging.ERROR)
  try:
    yield
  finally:
    logger.setLevel(level)


@_quiet_gguf()
def export_gguf(
  model: "nnx.Module",
  out_dir: str | Path,
  gguf_type: str = "f16",
  name: str | None = None,
  merge_into: str = "dequantized",
) -> Path:
  """Write ``out_dir/model-<gguf_type>.gguf`` (LoRA merged in, into ``merge_into``'s base as
  export_merged); returns its path.

  Everything that can be refused (the type, the family, the tokenizer) is checked before the
  file is opened.
  """
  check_gguf_type(gguf_type)
  gguf = _import_gguf()
  cfg = model.config
  if cfg.model_type not in ARCHITECTURES:
    raise ExportError(refusal(cfg.model_type))
  arch = ARCHITECTURES[cfg.model_type]
  src = Path(model.provenance.checkpoint_dir or "")
  vocab = tokenizer_writer(src, cfg.vocab_size)
  tensors = _plan(model, arch, gguf_type, merge_source(model, merge_into))
  out = Path(out_dir)
  out.mkdir(parents=True, exist_ok=True)
  path = out / gguf_file_name(gguf_type)
  writer = gguf.GGUFWriter(path, arch)
  try:
    writer.add_name(name or src.name or cfg.model_type)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.add_file_type(gguf.LlamaFileType[GGUF_TYPES[gguf_type][1]])
    _hyperparameters(writer, cfg, arch)
    vocab(writer)
    for t in tensors:
      writer.add_tensor_info(t.name, t.shape, np.dtype(np.float32), _nbytes(t), raw_dtype=t.qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for t in tensors:
      writer.write_tensor_data(gguf.quants.quantize(t.read(), t.qtype))
  finally:
    writer.close()
  return path


def _import_gguf():
  try:
    import gguf
  except ImportError as e:
    raise ExportError(
      "GGUF export needs the gguf package: pip install 'jaxtune[gguf]' (or gguf)."
    ) from e
  return gguf


def check_gguf_type(gguf_type: str) -> None:
  if gguf_type not in GGUF_TYPES:
    raise ExportError(f"--gguf-type must be one of {', '.join(GGUF_TYPES)}, got {gguf_type!r}.")


def _nbytes(t: _Tensor) -> int:
  import gguf

  block, size = gguf.GGML_QUANT_SIZES[t.qtype]
  return int(np.prod(t.shape)) // block * size


def _hyperparameters(w: "gguf.GGUFWriter", cfg: ModelConfig, arch: str) -> None:
  import gguf

  w.add_context_length(cfg.max_position_embeddings)
  w.add_embedding_length(cfg.hidden_size)
  w.add_block_count(cfg.num_layers)
  w.add_feed_forward_length(cfg.intermediate_size)
  w.add_head_count(cfg.num_heads)
  w.add_head_count_kv(cfg.num_kv_heads)
  w.add_key_length(cfg.head_dim)
  w.add_value_length(cfg.head_dim)
  w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
  w.add_rope_freq_base(cfg.rope.theta)
  if arch == "llama":
    w.add_vocab_size(cfg.vocab_size)
    w.add_rope_dimension_count(cfg.head_dim)
  if cfg.rope.kind == "linear":
    w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
    w.add_rope_scaling_factor(cfg.rope.factor)
  # llama3 rope scaling travels as the rope_freqs tensor (see _plan).
  if cfg.attn_logit_softcap is not None:
    w.add_attn_logit_softcapping(cfg.attn_logit_softcap)
  if cfg.final_logit_softcap is not None:
    w.add_final_logit_softcapping(cfg.final_logit_softcap)
  if cfg.has_sliding_layers:
    w.add_sliding_window(cfg.sliding_window)
    w.add_sliding_window_pattern([t == SLIDING for t in cfg.layer_types])
  if cfg.rope_local is not None:
    w.add_rope_freq_base_swa(cfg.rope_local.theta)
  # llama.cpp derives Gemma 2/3's attention scale (query_pre_attn_scalar) from the model size,
  # which matches every released checkpoint; GGUF has no key for it.


def _plan(model, arch: str, gguf_type: str, source: OriginalWeights | None) -> list[_Tensor]:
  """Every tensor of the file, in order, with its shape and type; no values computed yet."""
  import gguf

  cfg = model.config
  arch_id = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
  names = gguf.get_tensor_name_map(arch_id, cfg.num_layers)
  wanted = gguf.GGMLQuantizationType[GGUF_TYPES[gguf_type][0]]
  block = gguf.GGML_QUANT_SIZES[wanted][0]
  low_bit = gguf_type.startswith(("q4", "q5"))
  tied = model.lm_head is None
  if not tied and gguf.MODEL_TENSOR.OUTPUT not in gguf.MODEL_TENSORS[arch_id]:
    raise ExportError(
      f"llama.cpp's {arch} ties the output layer to the embeddings, but this model has its own "
      "lm_head; GGUF cannot hold it."
    )
  out, fell_back, projections_fit = [], [], False
  for hf_name, target, layer, entry, node in model_tensors(model):
    if entry.kind == "linear":
      shape = (node.out_features, node.in_features)
      read = _linear_reader(node, layer, hf_name, source)
    else:
      shape = tuple(node[...].shape[0 if layer is None else 1 :])
      read = _param_reader(node, layer, hf_name, source)
    base, suffix = hf_name.rsplit(".", 1)
    gguf_name = names.get_name(base)
    if gguf_name is None:
      raise ExportError(f"GGUF's {arch} has no tensor for {hf_name}; this model cannot be written.")
    if cfg.norm_plus_one and hf_name.endswith("norm.weight"):
      read = _plus_one(read)
    if arch == "llama" and base.endswith(("q_proj", "k_proj")):
      heads = cfg.num_heads if base.endswith("q_proj") else cfg.num_kv_heads
      read = _permuted(read, heads)
    is_output = target == ("lm_head",) or (tied and hf_name == "model.embed_tokens.weight")
    if len(shape) == 1:
      qtype = gguf.GGMLQuantizationType.F32
    elif low_bit and is_output:
      qtype = gguf.GGMLQuantizationType.Q8_0
    else:
      qtype = wanted
    if len(shape) == 2 and shape[-1] % gguf.GGML_QUANT_SIZES[qtype][0]:
      fell_back.append(f"{gguf_name}.{suffix}")
      qtype = gguf.GGMLQuantizationType.F16
    elif entry.kind == "linear" and target != ("lm_head",):
      projections_fit = True
    out.append(_Tensor(f"{gguf_name}.{suffix}", shape, qtype, read))
  if not projections_fit:
    raise ExportError(
      f"no projection of this model has rows that split into {gguf_type}'s blocks of {block} "
      "values; choose f16, bf16 or f32."
    )
  if cfg.rope.kind == "llama3":
    if gguf.MODEL_TENSOR.ROPE_FREQS not in gguf.MODEL_TENSORS[arch_id]:
      raise ExportError(f"llama.cpp's {arch} has no llama3 rope scaling; GGUF cannot hold it.")
    factors = _llama3_rope_factors(cfg.rope, cfg.head_dim)
    name = gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight"
    out.insert(0, _Tensor(name, factors.shape, gguf.GGMLQuantizationType.F32, lambda: factors))
  if fell_back:
    log.warning(
      "GGUF %s: %d tensor(s) whose rows do not split into blocks of %d are written as f16: %s",
      gguf_type,
      len(fell_back),
      block,
      ", ".join(fell_back),
    )
  return out


def _host(x) -> np.ndarray:
  return np.asarray(jax.device_get(x), np.float32)


def _linear_reader(linear, layer, name: str, source: OriginalWeights | None):
  return lambda: _host(linear_weight(linear, layer, name, source))


def _param_reader(var, layer, name: str, source: OriginalWeights | None):
  return lambda: _host(param_value(var, layer, name, source))


def _plus_one(read):
  return lambda: read() + np.float32(1.0)


def _permuted(read, heads: int):
  """llama.cpp's rope pairs neighbouring rows; transformers' pairs the two halves of a head."""

  def permuted():
    w = read()
    pairs = w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:])
    return pairs.swapaxes(1, 2).reshape(w.shape)

  return permuted


def _llama3_rope_factors(rope: RopeConfig, head_dim: int) -> np.ndarray:
  """llama.cpp divides each rope frequency by its factor: plain over llama3-scaled."""
  plain = ropes.inverse_frequencies(RopeConfig(theta=rope.theta), head_dim)
  return (plain / ropes.inverse_frequencies(rope, head_dim)).astype(np.float32)
