"""jaxtune model -> Hugging Face: merged safetensors for transformers, or a PEFT adapter dir.

Merged weights are a base plus scale * (A B)^T, written through the same name table the loader
reads, as sharded safetensors with the original config and tokenizer. The base (``merge_into``)
is either the checkpoint's original weights, read again from the files the model was loaded
from one tensor at a time ("original": the model a PEFT adapter on that checkpoint gives), or
the model's own frozen weights, NF4 dequantized ("dequantized": the model jaxtune computed with
while training).
"""

import functools
import json
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from converters import bnb
from converters import table as tables
from converters.safetensors_read import safetensors_files
from jaxtune.errors import ExportError, UserError
from jaxtune.hf import write_experts
from jaxtune.models.layers import dense
from jaxtune.models.lora import layer_scale
from pallas_kernels import nf4

if TYPE_CHECKING:
  from jaxtune.models.layers import Linear

_NP = {"bfloat16": ml_dtypes.bfloat16, "float32": np.float32, "float16": np.float16}
_JNP = {"bfloat16": jnp.bfloat16, "float32": jnp.float32, "float16": jnp.float16}
_TOKENIZER_FILES = (
  "tokenizer.json",
  "tokenizer_config.json",
  "special_tokens_map.json",
  "tokenizer.model",
  "chat_template.jinja",
  "generation_config.json",
  "vocab.json",
  "merges.txt",
)


_EXPERT_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def _module(model, path: tuple[str, ...]):
  node = model
  for name in path:
    node = getattr(node, name)
  return node


def _layer(x, layer):
  return x if layer is None else x[layer]


def model_tensors(model: nnx.Module) -> Iterator[tuple[str, tuple[str, ...], int | None, Any, Any]]:
  """(HF name, target, layer, table entry, what holds it) for every tensor the model has, in
  the checkpoint table's order: the Linear for a linear weight, else the Variable (a model
  without that tensor, e.g. a bias or a tied lm_head, is skipped)."""
  cfg = model.config
  table = tables.TABLES[cfg.model_type]
  for name, target, layer, entry in tables.hf_names(table, cfg.num_layers, cfg.num_experts):
    if target == ("lm_head",) and model.lm_head is None:
      continue
    if entry.kind.startswith("mxfp4_"):  # read only: exports write the experts dense
      continue
    try:
      node = _module(model, target[:-1] if entry.kind == "param" else target)
    except AttributeError:
      continue
    if entry.kind == "param":
      node = getattr(node, target[-1], None)
      if node is None:
        continue
    yield name, target, layer, entry, node


MERGE_INTO = ("original", "dequantized")


def merged_weight(
  linear: "Linear", layer: int | None, original: np.ndarray | None = None
) -> jax.Array:
  """float32 [out, in]: frozen weight plus the LoRA update, of one layer if stacked.

  ``original``: the checkpoint's weight [out, in] to add the update to instead of the
  frozen (NF4-dequantized) one.
  """
  frozen = linear.frozen_arrays() if original is None else (original,)
  lora = ()
  if linear.lora_a is not None:
    scale = jnp.float32(layer_scale(linear, layer))
    lora = (linear.lora_a[...], linear.lora_b[...], scale)
  at = None if layer is None else jnp.int32(layer)
  return _merged(frozen, lora, at, original is None)


@functools.partial(jax.jit, static_argnums=3)
def _merged(frozen: tuple, lora: tuple, layer: jax.Array | None, stacked: bool) -> jax.Array:
  """merged_weight as one program per weight shape (the layer traced), not op by op: a
  tiny model's export compiled for seconds eagerly. ``stacked``: ``frozen`` holds every
  layer (the model's own arrays), else this layer's only (an original weight)."""
  pick = (lambda x: x) if layer is None else (lambda x: x[layer])  # noqa: E731
  w = dense(tuple(pick(x) if stacked else x for x in frozen), jnp.float32)
  if lora:
    a, b, scale = lora
    w = w + scale * (pick(a) @ pick(b)).T  # columns past a layer's rank are zero
  return w


class OriginalWeights:
  """The checkpoint a model was loaded from, read again one tensor at a time for a merge into
  its original weights. Each read opens the file, copies that one tensor out and closes it:
  safe_open maps the file, and a shard kept open shows up whole in the process's resident
  memory as its tensors are read, so host memory would hold the model, not one tensor."""

  def __init__(self, ckpt: Path):
    self.ckpt = ckpt
    if not ckpt.is_dir():
      raise self._unreadable(ckpt, "it is gone")
    try:
      files = safetensors_files(ckpt)
    except UserError as e:
      raise self._unreadable(ckpt, str(e).rstrip(".")) from e
    self._file: dict[str, Path] = {}
    for file in files:
      with self._open(file) as f:
        self._file.update(dict.fromkeys(f.keys(), file))

  def read(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
    """The checkpoint's tensor ``name``, which must have ``shape`` (the model's)."""
    file = self._file.get(name)
    if file is None:
      raise self._unreadable(self.ckpt, f"it holds no {name}")
    with self._open(file) as f:
      try:
        tensor = f.get_tensor(name)
      except (OSError, SafetensorError) as e:
        raise self._unreadable(file, _first_line(e)) from e
    if tuple(tensor.shape) != tuple(shape):
      raise self._unreadable(
        file, f"its {name} has the shape {tuple(tensor.shape)}, the model's {tuple(shape)}"
      )
    return tensor

  def _open(self, file: Path):
    try:
      return safe_open(str(file), framework="np")
    except (OSError, SafetensorError) as e:
      raise self._unreadable(file, _first_line(e)) from e

  @staticmethod
  def _unreadable(where: Path, why: str) -> ExportError:
    return ExportError(
      f"merging into the original weights reads {where} again, and {why}; restore the "
      "checkpoint the model was loaded from, or merge into the dequantized weights "
      "(--merge-into dequantized)."
    )


def _first_line(e: BaseException) -> str:
  return (str(e).strip().splitlines() or [type(e).__name__])[0][:200].rstrip(".")


def merge_source(model: nnx.Module, merge_into: str) -> OriginalWeights | None:
  """Where a merge's base weights come from: the checkpoint's files ("original"), or None for
  the model's own frozen weights ("dequantized"; also for a ``*-bnb-4bit`` checkpoint, which
  holds no others: said on stderr)."""
  if merge_into not in MERGE_INTO:
    raise ExportError(f"--merge-into must be original or dequantized, got {merge_into!r}.")
  if merge_into == "dequantized":
    return None
  src = model.provenance.checkpoint_dir
  if not src:
    raise ExportError(
      "this model was not loaded from a checkpoint, so it has no original weights to merge "
      "into; merge into its dequantized weights (merge_into='dequantized')."
    )
  ckpt = Path(src)
  try:
    config = json.loads((ckpt / "config.json").read_text())
    prequantized = isinstance(config, dict) and (bnb.is_bnb_4bit(config) or _mxfp4(config))
  except (OSError, ValueError):  # gone or damaged since it loaded: OriginalWeights says so
    prequantized = False
  if prequantized:
    kind = "an MXFP4" if _mxfp4(config) else "a bnb-4bit"
    print(
      f"jaxtune: the source {ckpt.name} is {kind} checkpoint, with no original weights: "
      "merged into its dequantized weights",
      file=sys.stderr,
      flush=True,
    )
    return None
  return OriginalWeights(ckpt)


def _mxfp4(config: dict) -> bool:
  return (config.get("quantization_config") or {}).get("quant_method") == "mxfp4"


def linear_weight(
  linear: "Linear", layer: int | None, name: str, source: OriginalWeights | None
) -> jax.Array:
  """float32 [out, in]: the merged weight of HF tensor ``name``, on the original weight when
  ``source`` is given, else on the frozen one."""
  shape = (linear.out_features, linear.in_features)
  return merged_weight(linear, layer, None if source is None else source.read(name, shape))


def param_value(
  var: Any, layer: int | None, name: str, source: OriginalWeights | None
) -> np.ndarray | jax.Array:
  """A tensor of no Linear (a norm, bias or embedding) as a merge writes it: the checkpoint's
  own when ``source`` is given, else the model's."""
  if source is None:
    return _layer(var[...], layer)
  return source.read(name, var[...].shape[0 if layer is None else 1 :])


def _copy_side_files(model, out: Path) -> None:
  for name in _TOKENIZER_FILES:
    src = model.provenance.file(name)
    if src is not None and src.is_file():
      shutil.copy2(src, out / name)


def export_merged(
  model: nnx.Module,
  out_dir: str | Path,
  dtype: str = "bfloat16",
  max_shard_bytes: int = 4 << 30,
  merge_into: str = "dequantized",
) -> Path:
  """Write a checkpoint transformers' from_pretrained loads (LoRA merged in).

  ``merge_into``: "dequantized" (the model as it computes, NF4 base and all) or "original"
  (the update added to the checkpoint's own weights: what its PEFT adapter gives).
  """
  return _export(model, Path(out_dir), dtype, max_shard_bytes, False, merge_into)


def export_bnb4(
  model: nnx.Module,
  out_dir: str | Path,
  dtype: str = "bfloat16",
  max_shard_bytes: int = 4 << 30,
  merge_into: str = "dequantized",
) -> Path:
  """Write a bitsandbytes 4-bit checkpoint (as the ``*-bnb-4bit`` repos hold them).

  NF4 linears without a trained adapter are written byte for byte as stored, so a bnb
  checkpoint loaded and exported again comes back identical; linears with a non-zero LoRA
  update are merged (into ``merge_into``'s base, as export_merged) and quantized anew.
  Unquantized models are quantized here.
  """
  return _export(model, Path(out_dir), dtype, max_shard_bytes, True, merge_into)


def _linear_tensors(
  linear, layer, name: str, dtype: str, bnb4: bool, source: OriginalWeights | None
) -> dict[str, np.ndarray]:
  if not bnb4 or linear.layers is None:  # lm_head stays dense, as bitsandbytes keeps it
    return {name: _host(linear_weight(linear, layer, name, source), dtype)}
  has_update = linear.lora_b is not None and bool(jnp.any(_layer(linear.lora_b[...], layer) != 0))
  if linear.quantized and not has_update:
    stored = (linear.codes, linear.absmax, linear.nested_absmax, linear.offset)
    q = nf4.NF4Quantized(*(_layer(v[...], layer) for v in stored))
  else:
    q = nf4.quantize(linear_weight(linear, layer, name, source).astype(_JNP[dtype]))
  packed = bnb.pack(q, (linear.out_features, linear.in_features), dtype)
  return {name + suffix if suffix != "weight" else name: v for suffix, v in packed.items()}


def _host(value, dtype: str) -> np.ndarray:
  return np.asarray(jax.device_get(value.astype(jnp.float32))).astype(_NP[dtype])


def _export(
  model, out: Path, dtype: str, max_shard_bytes: int, bnb4: bool, merge_into: str
) -> Path:
  if dtype not in _NP:
    raise ExportError(f"--dtype must be bfloat16, float16 or float32, got {dtype!r}.")
  source = merge_source(model, merge_into)
  out.mkdir(parents=True, exist_ok=True)
  shards, current, size = [], {}, 0
  for name, _, layer, entry, node in model_tensors(model):
    if entry.kind == "linear":
      tensors = _linear_tensors(node, layer, name, dtype, bnb4, source)
    elif entry.kind in write_experts.EXPERT_KINDS:  # dense, also in a bnb-4bit export (as
      # bitsandbytes leaves transformers' fused experts)
      tensors = {  # C order: safetensors writes an array's buffer as it lies
        k: np.ascontiguousarray(v.astype(_NP[dtype]))
        for k, v in write_experts.expert_tensors(entry.kind, node, layer, name, source).items()
      }
    else:
      tensors = {name: _host(param_value(node, layer, name, source), dtype)}
    current.update(tensors)
    size += sum(a.nbytes for a in tensors.values())
    if size >= max_shard_bytes:
      shards.append(current)
      current, size = {}, 0
  if current:
    shards.append(current)
  weight_map = {}
  for i, shard in enumerate(shards, 1):
    fname = (
      "model.safetensors" if len(shards) == 1 else f"model-{i:05d}-of-{len(shards):05d}.safetensors"
    )
    save_file(shard, str(out / fname), metadata={"format": "pt"})
    weight_map.update({k: fname for k in shard})
  if len(shards) > 1:
    (out / "model.safetensors.index.json").write_text(
      json.dumps({"metadata": {}, "weight_map": weight_map}, indent=2)
    )
  src_config = model.provenance.file("config.json")
  config = (
    json.loads(src_config.read_text())
    if src_config is not None and src_config.is_file()
    else {"model_type": model.config.model_type}
  )
  config.pop("quantization_config", None)
  if bnb4:
    config["quantization_config"] = bnb.quantization_config(dtype)
  # transformers 5 reads "dtype" (a base saved by it has one, e.g. "float32"), older versions
  # "torch_dtype": both name the weights' dtype, or one loads them as the other.
  config["dtype"] = config["torch_dtype"] = dtype
  (out / "config.json").write_text(json.dumps(config, indent=2))
  _copy_side_files(model, out)
  return out


def base_model_name(model: nnx.Module) -> str:
  """The base model as PEFT records it: its Hub id when known, else its local directory."""
  return model.provenance.base_name


def _peft_pattern(values: dict[str, dict[str, float]], default: float) -> dict[str, float]:
  """PEFT's rank_pattern / alpha_pattern: a projection's name where all its layers share a
  value other than ``default``, else each differing module's full name (PEFT matches keys as
  suffixes of module names)."""
  out = {}
  for proj, per_module in values.items():
    distinct = set(per_module.values())
    if len(distinct) == 1:
      (value,) = distinct
      if value != default:
        out[proj] = value
    else:
      out.update({m: v for m, v in per_module.items() if v != default})
  return out


def export_peft(model: nnx.Module, out_dir: str | Path) -> Path:
  """adapter_model.safetensors + adapter_config.json in PEFT's names and layout."""
  lora_cfg = model.lora_config
  if lora_cfg is None:
    raise ExportError("this model has no LoRA adapters; call jaxtune.apply_lora first.")
  out = Path(out_dir)
  out.mkdir(parents=True, exist_ok=True)
  cfg = model.config
  tensors, ranks, alphas = {}, {}, {}
  for name, target, layer, entry in tables.hf_names(tables.TABLES[cfg.model_type], cfg.num_layers):
    if entry.kind != "linear":
      continue
    linear = _module(model, target)
    if linear is None or linear.lora_a is None:  # a tied lm_head is no module of its own
      continue
    # PEFT's names: the model's own, under base_model.model (lm_head too, beside model.*).
    module = name.removesuffix(".weight")
    prefix = "base_model.model." + module
    r = lora_cfg.rank_of(target[-1], layer)
    ranks.setdefault(target[-1], {})[module] = r
    alphas.setdefault(target[-1], {})[module] = lora_cfg.alpha_of(target[-1], layer)
    a = np.asarray(_layer(linear.lora_a[...], layer), np.float32)[:, :r]  # [in, r]
    b = np.asarray(_layer(linear.lora_b[...], layer), np.float32)[:r]  # [r, out]
    tensors[f"{prefix}.lora_A.weight"] = np.ascontiguousarray(a.T)
    tensors[f"{prefix}.lora_B.weight"] = np.ascontiguousarray(b.T)
  expert_tensors, target_parameters, expert_ranks, expert_alphas = write_experts.peft_experts(model)
  tensors.update(expert_tensors)
  router_tensors, modules_to_save = write_experts.peft_routers(model)
  tensors.update(router_tensors)
  save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
  adapter_config = {
    "peft_type": "LORA",
    "task_type": "CAUSAL_LM",
    "base_model_name_or_path": base_model_name(model),
    "r": lora_cfg.rank,
    "lora_alpha": lora_cfg.alpha,
    "lora_dropout": lora_cfg.dropout,
    # A mixture of experts' MLP projections are PEFT's target_parameters, not modules.
    "target_modules": [
      t for t in lora_cfg.targets if not (target_parameters and t in _EXPERT_PROJECTIONS)
    ],
    "use_rslora": lora_cfg.rslora,
    "rank_pattern": {**_peft_pattern(ranks, lora_cfg.rank), **expert_ranks},
    "alpha_pattern": {**_peft_pattern(alphas, lora_cfg.alpha), **expert_alphas},
    "bias": "none",
    "fan_in_fan_out": False,
    "inference_mode": True,
    "init_lora_weights": True,
    "modules_to_save": modules_to_save or None,
  }
  if target_parameters:
    adapter_config["target_parameters"] = target_parameters
  (out / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2))
  return out
