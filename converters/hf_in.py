"""Hugging Face safetensors checkpoint -> jaxtune model, one tensor at a time.

The model is first built abstractly (``nnx.eval_shape``: shapes only, no memory). Each tensor
is then read on its own from the safetensors files, checked against the shape the config
implies, quantized to NF4 on the accelerator if it is a frozen linear weight, and written into
its (layer-stacked, sharded) buffer on the devices. Host memory therefore peaks near the
largest single tensor, never near the model.
"""

import functools
import json
import logging
from collections.abc import Iterator
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from converters import bnb
from converters import table as tables
from jaxtune import nf4, sharding
from jaxtune.config import SUPPORTED_MODEL_TYPES, ConfigError, ModelConfig
from jaxtune.models.decoder import Decoder

log = logging.getLogger("jaxtune")

DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32, "float16": jnp.float16}
MODELS = dict.fromkeys(SUPPORTED_MODEL_TYPES, Decoder)


class CheckpointError(ValueError):
  """A checkpoint jaxtune cannot load; the message names the file or tensor and the fix."""


def resolve_checkpoint(path_or_hub_id: str | Path) -> Path:
  """A local checkpoint directory, downloading from the Hub when given a repo id."""
  path = Path(path_or_hub_id).expanduser()
  if path.is_dir():
    return path
  text = str(path_or_hub_id)
  looks_like_hub_id = text.count("/") == 1 and not text.startswith((".", "/", "~"))
  if not looks_like_hub_id:
    raise CheckpointError(f"checkpoint directory {text} does not exist; check the path.")
  try:
    from huggingface_hub import snapshot_download

    return Path(
      snapshot_download(
        text,
        allow_patterns=["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt", "*.jinja"],
      )
    )
  except Exception as e:  # the hub raises many types; all mean "could not fetch"
    raise CheckpointError(
      f"{text} is neither a local directory nor a reachable Hugging Face repo "
      f"({type(e).__name__}); "
      "check the id, log in with `hf auth login` for gated models, or pass a local directory."
    ) from e


def safetensors_files(ckpt: Path) -> list[Path]:
  """The checkpoint's safetensors files, from model.safetensors.index.json when sharded."""
  index = ckpt / "model.safetensors.index.json"
  if index.is_file():
    try:
      weight_map = json.loads(index.read_text())["weight_map"]
    except (json.JSONDecodeError, KeyError) as e:
      raise CheckpointError(f"{index} is not a valid safetensors index; re-download it.") from e
    files = [ckpt / name for name in dict.fromkeys(weight_map.values())]
    missing = [f.name for f in files if not f.is_file()]
    if missing:
      raise CheckpointError(
        f"{ckpt} lacks {', '.join(missing)} listed in its index; the download is incomplete."
      )
    return files
  files = sorted(ckpt.glob("*.safetensors"))
  if not files:
    raise CheckpointError(
      f"no *.safetensors files in {ckpt}; jaxtune reads safetensors checkpoints only "
      "(convert .bin files with transformers' save_pretrained(safe_serialization=True))."
    )
  return files


_ST_DTYPES = {
  "F32": np.float32,
  "F16": np.float16,
  "BF16": ml_dtypes.bfloat16,
  "F64": np.float64,
  "I64": np.int64,
  "I32": np.int32,
  "I16": np.int16,
  "I8": np.int8,
  "U8": np.uint8,
  "BOOL": np.bool_,
}


def iter_tensors(files: list[Path]) -> Iterator[tuple[str, Path, np.ndarray]]:
  """(name, file, array) one at a time, read with plain file reads.

  Not memory-mapped on purpose: a mapped multi-GB shard shows up whole in the process's
  resident memory while it is open. Here only the tensor being converted is ever resident.
  """
  for file in files:
    size = file.stat().st_size
    with open(file, "rb") as f:
      header = _read_header(f, file, size)
      for name, info in header.items():
        if name == "__header_size__":
          continue
        try:
          dtype = _ST_DTYPES[info["dtype"]]
          begin, end = (int(x) for x in info["data_offsets"])
          shape = tuple(int(x) for x in info["shape"])
        except (KeyError, TypeError, ValueError) as e:
          raise CheckpointError(
            f"{file} is truncated or corrupt (bad entry {name}); re-download it."
          ) from e
        start = 8 + header["__header_size__"] + begin
        nbytes = end - begin
        if start + nbytes > size or nbytes != int(np.prod(shape)) * np.dtype(dtype).itemsize:
          raise CheckpointError(
            f"{file} is truncated or corrupt (tensor {name} runs past the end of the file or has "
            "the wrong size); re-download it."
          )
        buffer = np.empty(nbytes, np.uint8)
        f.seek(start)
        if f.readinto(buffer) != nbytes:
          raise CheckpointError(f"{file} is truncated or corrupt (short read); re-download it.")
        yield name, file, buffer.view(dtype).reshape(shape)
        del buffer


def _read_header(f, file: Path, size: int) -> dict:
  raw = f.read(8)
  if len(raw) < 8:
    raise CheckpointError(f"{file} is truncated or corrupt (no header); re-download it.")
  n = int.from_bytes(raw, "little")
  if n <= 0 or 8 + n > size or n > 100_000_000:
    raise CheckpointError(f"{file} is truncated or corrupt (bad header size); re-download it.")
  try:
    header = json.loads(f.read(n))
    if not isinstance(header, dict):
      raise ValueError("header is not a JSON object")
  except (ValueError, UnicodeDecodeError) as e:
    raise CheckpointError(
      f"{file} is truncated or corrupt (unreadable header); re-download it."
    ) from e
  header.pop("__header_size__", None)
  header["__header_size__"] = n
  # Entries in file order, so reads move forward through the file.
  ordered = sorted(
    (k for k in header if not k.startswith("__")),
    key=lambda k: header[k].get("data_offsets", [0])[0] if isinstance(header[k], dict) else 0,
  )
  return {"__header_size__": n, **{k: header[k] for k in ordered}}


def from_pretrained(
  path_or_hub_id: str | Path,
  quantization: str | None = "nf4",
  dtype: str = "bfloat16",
  mesh: Mesh | None = None,
) -> nnx.Module:
  """Load a HF checkpoint (dir or hub id) as a jaxtune model, NF4 frozen linears by default."""
  if quantization not in ("nf4", None, "none"):
    raise ValueError(f"quantization must be 'nf4' or None, got {quantization!r}.")
  if dtype not in DTYPES:
    raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}.")
  quantized = quantization == "nf4"
  ckpt = resolve_checkpoint(path_or_hub_id)
  cfg = ModelConfig.from_hf(ckpt)
  files = safetensors_files(ckpt)
  try:
    prequantized_file = bnb.is_bnb_4bit(json.loads((ckpt / "config.json").read_text()))
  except bnb.BnbError as e:
    raise CheckpointError(str(e)) from e
  compute = DTYPES[dtype]

  abstract = nnx.eval_shape(
    lambda: MODELS[cfg.model_type](cfg, quantized=quantized, dtype=compute, rngs=nnx.Rngs(0))
  )
  graphdef, state = nnx.split(abstract)
  variables = dict(state.flat_state())
  loader = _Loader(variables, mesh)
  table = tables.TABLES[cfg.model_type]

  pending: dict[str, dict] = {}  # pieces of bnb-4bit Linears until all six have been read
  for name, file, tensor in iter_tensors(files):
    prequantized = None
    piece = bnb.split_name(name, tensor) if prequantized_file else None
    if piece is not None:
      base, part = piece
      parts = pending.setdefault(base, {})
      parts[part] = tensor
      if len(parts) < len(bnb.PARTS):
        continue
      del pending[base]
      try:
        prequantized = bnb.unpack(base, parts)
      except bnb.BnbError as e:
        raise CheckpointError(f"{file.name}: {e}") from e
      name, tensor = base, None
    m = tables.match(table, name)
    if m is None:
      if tables.IGNORED.match(name) or (name == "lm_head.weight" and cfg.tie_word_embeddings):
        continue
      raise CheckpointError(
        f"tensor {name} in {file.name} is not part of a {cfg.model_type} model as its "
        "config.json describes it; the checkpoint and config do not belong together."
      )
    if tensor is not None and not jnp.issubdtype(tensor.dtype, jnp.floating):
      raise CheckpointError(
        f"tensor {name} in {file.name} is stored as {tensor.dtype}, but model weights are "
        "floating point; the file is corrupt or not a model checkpoint."
      )
    if m.layer is not None and m.layer >= cfg.num_layers:
      raise CheckpointError(
        f"tensor {name} in {file.name} is for layer {m.layer}, but config.json says "
        f"num_hidden_layers={cfg.num_layers}."
      )
    if m.entry.kind == "linear":
      loader.put_linear(name, m.target, m.layer, tensor, quantized, prequantized)
    elif prequantized is not None:
      raise CheckpointError(f"{name} is 4-bit quantized, but jaxtune keeps it unquantized.")
    else:
      loader.put(name, m.target, m.layer, tensor)

  if pending:
    some = sorted(pending)[0]
    raise CheckpointError(
      f"4-bit tensor {some} lacks {sorted(set(bnb.PARTS) - set(pending[some]))} in {ckpt}; "
      "the checkpoint is incomplete."
    )
  missing = loader.missing()
  if missing:
    shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
    raise CheckpointError(f"{ckpt} lacks weights for {shown}; the checkpoint is incomplete.")
  model = nnx.merge(graphdef, nnx.from_flat_state(loader.state()))
  model.checkpoint_dir = str(ckpt)
  return model


class _Loader:
  """Device buffers for every variable, filled one tensor (one layer slice) at a time."""

  def __init__(self, variables: dict, mesh: Mesh | None):
    self.variables = variables
    self.mesh = mesh
    self.buffers: dict[tuple, jax.Array] = {}
    self.filled: dict[tuple, set] = {path: set() for path in variables}

  def _sharding(self, path, drop_layer=False):
    var = self.variables[path]
    value = var.get_value()
    axes = tuple(var.get_metadata().get("axes") or (None,) * value.ndim)
    shape = value.shape
    if drop_layer:
      axes, shape = axes[1:], shape[1:]
    return sharding.sharding_for(axes, shape, self.mesh)

  def _write(self, path, layer, value, hf_name: str):
    """Place one tensor (numpy from the file, or a jax array) into its variable's buffer."""
    var = self.variables[path]
    abstract = var.get_value()
    stacked = "layers" in (var.get_metadata().get("axes") or ())
    expected = abstract.shape[1:] if stacked else abstract.shape
    if tuple(value.shape) != tuple(expected):
      raise CheckpointError(
        f"tensor {hf_name} has shape {tuple(value.shape)}, but config.json implies "
        f"{tuple(expected)}; the checkpoint and config do not belong together."
      )
    if isinstance(value, np.ndarray):
      value = value.astype(abstract.dtype, copy=False)  # one host copy at most, then to device
    else:
      value = value.astype(abstract.dtype)
    if not stacked:
      self.buffers[path] = jax.device_put(value, self._sharding(path))
      self.filled[path].add(None)
      return
    if path not in self.buffers:
      self.buffers[path] = _zeros(abstract.shape, abstract.dtype, self._sharding(path))
    slice_value = jax.device_put(value, self._sharding(path, drop_layer=True))
    self.buffers[path] = _set_layer(self.buffers[path], slice_value, layer)
    self.filled[path].add(layer)

  def put(self, hf_name, target, layer, tensor):
    path = tuple(target)
    if path not in self.variables:
      raise CheckpointError(f"tensor {hf_name} has no place in this model's configuration.")
    self._write(path, layer, tensor, hf_name)

  def put_linear(self, hf_name, target, layer, tensor, quantized, prequantized=None):
    """A Linear's weight: dense ``tensor``, or ``prequantized`` = (flat NF4, [out, in]) from a
    bnb-4bit file, whose bytes are kept as they are when the model is NF4 too."""
    if not quantized or target == ("lm_head",):
      if prequantized is not None:
        q, shape = prequantized
        tensor = np.asarray(nf4.dequantize(q, shape, jnp.float32))
      self.put(hf_name, (*target, "weight"), layer, tensor)
      return
    codes_path = (*target, "codes")
    if codes_path not in self.variables:
      raise CheckpointError(f"tensor {hf_name} has no place in this model's configuration.")
    out_features, half = self.variables[codes_path].get_value().shape[-2:]
    expected = (out_features, half * 2)
    shape = prequantized[1] if prequantized is not None else tuple(tensor.shape)
    if tuple(shape) != expected:
      raise CheckpointError(
        f"tensor {hf_name} has shape {tuple(shape)}, but config.json implies "
        f"{expected}; the checkpoint and config do not belong together."
      )
    if prequantized is None:
      q = nf4.quantize_linear(jnp.asarray(tensor))
    else:
      flat = prequantized[0]
      q = nf4.NF4Quantized(
        flat.codes.reshape(out_features, half),
        flat.absmax.reshape(out_features, -1),
        flat.nested_absmax,
        np.asarray(flat.offset, np.float32),
      )
    for field, value in zip(("codes", "absmax", "nested_absmax", "offset"), q, strict=True):
      self._write((*target, field), layer, value, hf_name)

  def missing(self) -> list[str]:
    out = []
    for path, var in self.variables.items():
      stacked = "layers" in (var.get_metadata().get("axes") or ())
      want = set(range(var.get_value().shape[0])) if stacked else {None}
      if not want <= self.filled[path]:
        out.append(".".join(path))
    return out

  def state(self):
    return [(path, var.replace(self.buffers[path])) for path, var in self.variables.items()]


def _zeros(shape, dtype, out_sharding):
  return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=out_sharding)()


@functools.partial(jax.jit, donate_argnums=0)
def _set_layer(buffer: jax.Array, value: jax.Array, layer) -> jax.Array:
  return jax.lax.dynamic_update_index_in_dim(buffer, value, layer, axis=0)


__all__ = ["CheckpointError", "ConfigError", "from_pretrained"]
