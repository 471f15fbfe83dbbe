"""Hugging Face safetensors checkpoint -> jaxtune model, one tensor at a time.

The model is first built abstractly (``nnx.eval_shape``: shapes only, no memory). Each tensor
is then read on its own from the safetensors files, checked against the shape the config
implies, quantized to NF4 on the accelerator if it is a frozen linear weight, and written into
its (layer-stacked, sharded) buffer on the devices. Host memory therefore peaks near the
largest single tensor, never near the model.

The stages overlap: background threads read tensors and copy them to the device
(converters/safetensors_read.py) while this thread dispatches the quantization of earlier
ones (jaxtune/hf/device_put.py), so a load costs about as long as its slowest stage. A
``*-bnb-4bit`` checkpoint's Linears arrive as six tensors each, assembled by converters/bnb.py.
"""

import logging
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from converters import bnb
from converters import table as tables
from converters.hub import hub_id, looks_like_hub_id
from converters.safetensors_read import CheckpointError, Prefetcher, safetensors_files
from jaxtune.errors import ConfigError, UserError
from jaxtune.hf.device_put import DeviceBuffers, put_in_pieces
from jaxtune.models.config import SUPPORTED_MODEL_TYPES, ModelConfig
from jaxtune.models.decoder import Decoder
from jaxtune.models.provenance import Provenance
from pallas_kernels import mxfp4

log = logging.getLogger("jaxtune")

DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32, "float16": jnp.float16}
MODELS = dict.fromkeys(SUPPORTED_MODEL_TYPES, Decoder)


def resolve_checkpoint(path_or_hub_id: str | Path) -> Path:
  """A local checkpoint directory, downloading from the Hub when given a repo id."""
  path = Path(path_or_hub_id).expanduser()
  if path.is_dir():
    return path
  text = str(path_or_hub_id)
  if not looks_like_hub_id(text):
    raise CheckpointError(f"checkpoint directory {text} does not exist; check the path.")
  try:
    from huggingface_hub import snapshot_download

    return Path(
      snapshot_download(
        text,
        allow_patterns=[
          "*.json",
          "*.safetensors",
          "tokenizer*",
          "*.model",
          "*.txt",
          "*.jinja",
          "README.md",
        ],  # README.md: the base model's license, for the export's model card
      )
    )
  except Exception as e:  # the hub raises many types; all mean "could not fetch"
    raise CheckpointError(
      f"{text} is neither a local directory nor a reachable Hugging Face repo "
      f"({type(e).__name__}); "
      "check the id, log in with `hf auth login` for gated models, or pass a local directory."
    ) from e


def from_pretrained(
  path_or_hub_id: str | Path,
  quantization: str | None = "nf4",
  dtype: str = "bfloat16",
  mesh: Mesh | None = None,
  config_read: tuple[ModelConfig, dict] | None = None,
) -> nnx.Module:
  """Load a HF checkpoint (dir or hub id) as a jaxtune model, NF4 frozen linears by default.
  ``config_read``: its config.json as ``ModelConfig.read_hf`` read it already (a run's
  session, which checked the run against it before loading), so it is not read again."""
  if quantization not in ("nf4", None, "none"):
    raise UserError(f"quantization must be 'nf4' or None, got {quantization!r}.")
  if dtype not in DTYPES:
    raise UserError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}.")
  quantized = quantization == "nf4"
  ckpt = resolve_checkpoint(path_or_hub_id)
  cfg, settings = config_read or ModelConfig.read_hf(ckpt)
  files = safetensors_files(ckpt)
  try:
    prequantized_file = bnb.is_bnb_4bit(settings)
  except bnb.BnbError as e:
    raise CheckpointError(str(e)) from e
  compute = DTYPES[dtype]
  # hub_id: None for a local directory
  provenance = Provenance(str(ckpt), hub_id(path_or_hub_id) or hub_id(ckpt))

  abstract = nnx.eval_shape(
    lambda: MODELS[cfg.model_type](
      cfg, quantized=quantized, dtype=compute, provenance=provenance, rngs=nnx.Rngs(0)
    )
  )
  graphdef, state = nnx.split(abstract)
  variables = dict(state.flat_state())
  table = tables.TABLES[cfg.model_type]

  # Tensors go straight to the device from the reader's threads, except where a mesh decides
  # their layout or they are pieces of a bnb-4bit Linear (assembled on the host).
  device = jax.devices()[0]
  to_device = mesh is None and not prequantized_file

  def place(tensor: np.ndarray):
    floating = jnp.issubdtype(tensor.dtype, jnp.floating) and tensor.dtype.itemsize <= 4
    return put_in_pieces(tensor, device) if to_device and floating else tensor

  bnb_linears = bnb.Assembler() if prequantized_file else None
  mxfp4_halves: dict = {}  # (layer, kind) -> (part, tensor): the first of a blocks/scales pair
  with Prefetcher(files, place) as tensors:  # reading starts now, while the buffers compile
    buffers = DeviceBuffers(variables, mesh)
    for name, file, tensor in tensors:
      prequantized = None
      if bnb_linears is not None:
        assembled = bnb_linears.add(name, file, tensor)
        if assembled is None:
          continue
        name, tensor, prequantized = assembled
      m = tables.match(table, name)
      if m is None:
        if tables.IGNORED.match(name) or (name == "lm_head.weight" and cfg.tie_word_embeddings):
          continue
        raise CheckpointError(
          f"tensor {name} in {file.name} is not part of a {cfg.model_type} model as its "
          "config.json describes it; the checkpoint and config do not belong together."
        )
      packed = m.entry.kind.startswith("mxfp4_")  # codes and scales are bytes
      if tensor is not None and not packed and not jnp.issubdtype(tensor.dtype, jnp.floating):
        raise CheckpointError(
          f"tensor {name} in {file.name} is stored as {tensor.dtype}, but model weights are "
          "floating point; the file is corrupt or not a model checkpoint."
        )
      if m.layer is not None and m.layer >= cfg.num_layers:
        raise CheckpointError(
          f"tensor {name} in {file.name} is for layer {m.layer}, but config.json says "
          f"num_hidden_layers={cfg.num_layers}."
        )
      if m.expert is not None and m.expert >= cfg.num_experts:
        raise CheckpointError(
          f"tensor {name} in {file.name} is for expert {m.expert}, but config.json says "
          f"{cfg.num_experts} experts."
        )
      if m.entry.kind == "linear":
        buffers.put_linear(name, m.target, m.layer, tensor, quantized, prequantized)
      elif m.entry.kind == "expert":  # one expert's Linear (a bnb-4bit one's bytes kept)
        at = (m.layer, m.expert)
        buffers.put_linear(name, m.target, at, tensor, quantized, prequantized)
      elif prequantized is not None:
        raise CheckpointError(f"{name} is 4-bit quantized, but jaxtune keeps it unquantized.")
      elif m.entry.kind == "param":
        buffers.put(name, m.target, m.layer, tensor)
      elif m.entry.kind.startswith("mxfp4_"):
        _put_mxfp4(buffers, mxfp4_halves, name, m, tensor, quantized)
      else:
        _put_experts(buffers, name, m, tensor, quantized)
    buffers.finish()

  if bnb_linears is not None:
    bnb_linears.check_complete(ckpt)
  missing = buffers.missing()
  if missing:
    shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
    raise CheckpointError(f"{ckpt} lacks weights for {shown}; the checkpoint is incomplete.")
  return nnx.merge(graphdef, nnx.from_flat_state(buffers.state()))


def _put_experts(buffers: DeviceBuffers, name: str, m, tensor, quantized: bool) -> None:
  """gpt-oss's fused experts' tensor (converters/table.py's experts_* kinds) into its
  experts' stacked variables, one expert's [out, in] weight at a time."""
  kind = m.entry.kind
  if tensor.ndim != (2 if kind == "experts_gate_up_bias" else 3):
    raise CheckpointError(
      f"tensor {name} has shape {tuple(tensor.shape)}, but gpt-oss keeps it with "
      f"{2 if kind == 'experts_gate_up_bias' else 3} dimensions; the checkpoint and config do "
      "not belong together."
    )
  if kind == "experts_gate_up_bias":
    for proj, part in (("gate_proj", tensor[:, 0::2]), ("up_proj", tensor[:, 1::2])):
      buffers.put(name, (*m.target, proj, "bias"), m.layer, part)
    return
  if kind == "experts_gate_up":
    parts = (("gate_proj", tensor[:, :, 0::2]), ("up_proj", tensor[:, :, 1::2]))
  else:  # experts_t
    parts = (((), tensor),)
  for proj, part in parts:
    target = (*m.target, proj) if proj else m.target
    for e in range(part.shape[0]):
      buffers.put_linear(name, target, (m.layer, e), part[e].T, quantized)  # [out, in]


def _put_mxfp4(buffers: DeviceBuffers, halves: dict, name: str, m, tensor, quantized: bool):
  """One half of an MXFP4 expert weight; with the other, the experts' weights dequantized
  (exactly: pallas_kernels/mxfp4.py) into the stacked variables, NF4-quantized per expert
  where the model is NF4."""
  part = "blocks" if name.endswith("_blocks") else "scales"
  key = (m.layer, m.entry.kind)
  if key not in halves:
    halves[key] = (part, name, tensor)
    return
  other, other_name, other_tensor = halves.pop(key)
  if other == part:
    raise CheckpointError(f"{name} appears twice in the checkpoint; re-download it.")
  blocks, scales = (tensor, other_tensor) if part == "blocks" else (other_tensor, tensor)
  problem = mxfp4.check_shapes(tuple(blocks.shape), tuple(scales.shape))
  if problem is not None or blocks.ndim != 4:
    raise CheckpointError(
      f"{name} and {other_name} are no MXFP4 experts' weight ({problem or 'not 4-D'}); the "
      "checkpoint is damaged, re-download it."
    )
  w = mxfp4.dequantize(jnp.asarray(blocks), jnp.asarray(scales), jnp.float32)  # [E, out, in]
  if m.entry.kind == "mxfp4_gate_up_proj":
    parts = (((*m.target, "gate_proj"), w[:, 0::2]), ((*m.target, "up_proj"), w[:, 1::2]))
  else:
    parts = ((m.target, w),)
  for target, weights in parts:
    for e in range(weights.shape[0]):
      buffers.put_linear(name, target, (m.layer, e), weights[e], quantized)


__all__ = ["CheckpointError", "ConfigError", "from_pretrained", "hub_id", "safetensors_files"]
