"""Pre-quantized bitsandbytes 4-bit checkpoints (the ``*-bnb-4bit`` repos): read and write.

A quantized Linear X is stored as six tensors (DESIGN.md, NF4):
  X.weight                               uint8 [n / 2, 1]   packed codes
  X.weight.absmax                        uint8 [n / 64]     double-quantized block scales
  X.weight.nested_absmax                 float32            scales of the scales
  X.weight.quant_map                     float32 [16]       the NF4 code book
  X.weight.nested_quant_map              float32 [256]      the dynamic map
  X.weight.quant_state.bitsandbytes__nf4 uint8              JSON: quant_type, blocksize, dtype,
                                                            shape, nested_blocksize, nested_offset
jaxtune's NF4 storage holds exactly these bytes (reshaped), so nothing passes through bf16.
"""

import json
from pathlib import Path

import numpy as np

from converters.safetensors_read import CheckpointError
from pallas_kernels import nf4
from pallas_kernels.nf4_maps import DYNAMIC_MAP, NF4_CODE

STATE_SUFFIX = ".quant_state.bitsandbytes__nf4"
SUFFIXES = (".absmax", ".nested_absmax", ".quant_map", ".nested_quant_map", STATE_SUFFIX)
PARTS = ("weight", *SUFFIXES)


class BnbError(ValueError):
  """A 4-bit checkpoint jaxtune cannot read; the message names the tensor."""


def is_bnb_4bit(config: dict) -> bool:
  q = config.get("quantization_config") or {}
  if q.get("quant_method") != "bitsandbytes":
    return False
  if q.get("load_in_8bit") or q.get("_load_in_8bit"):
    raise BnbError("8-bit bitsandbytes checkpoints are not supported; use the 4-bit (nf4) one.")
  if q.get("bnb_4bit_quant_type", "nf4") != "nf4":
    raise BnbError(
      f"bnb_4bit_quant_type {q.get('bnb_4bit_quant_type')!r} is not supported; jaxtune reads nf4."
    )
  return True


def split_name(name: str, tensor: np.ndarray) -> tuple[str, str] | None:
  """(base "X.weight", part) when ``name`` is a piece of a quantized Linear, else None."""
  for suffix in SUFFIXES:
    if name.endswith(suffix):
      return name[: -len(suffix)], suffix
  if name.endswith(".weight") and tensor.dtype == np.uint8:
    return name, "weight"
  return None


def unpack(base: str, parts: dict[str, np.ndarray]) -> tuple[nf4.NF4Quantized, tuple[int, int]]:
  """The flat NF4 tensors of one Linear and its [out, in] shape, after checking the format."""
  try:
    state = json.loads(bytes(parts[STATE_SUFFIX].astype(np.uint8)).decode())
    shape = tuple(int(x) for x in state["shape"])
    offset = np.float32(state["nested_offset"])
  except (KeyError, ValueError, TypeError) as e:
    raise BnbError(f"{base}{STATE_SUFFIX} is not a valid bitsandbytes quant state ({e}).") from e
  if state.get("quant_type") != "nf4" or int(state.get("blocksize", 0)) != nf4.BLOCKSIZE:
    raise BnbError(
      f"{base} is quantized as {state.get('quant_type')} with blocksize "
      f"{state.get('blocksize')}; jaxtune reads nf4 with blocksize {nf4.BLOCKSIZE}."
    )
  if int(state.get("nested_blocksize", 0)) != nf4.NESTED_BLOCKSIZE:
    raise BnbError(f"{base} uses nested blocksize {state.get('nested_blocksize')}, not 256.")
  if not np.array_equal(parts[".quant_map"].reshape(-1), NF4_CODE) or not np.array_equal(
    parts[".nested_quant_map"].reshape(-1), DYNAMIC_MAP
  ):
    raise BnbError(f"{base} uses a code book other than bitsandbytes' NF4 and dynamic maps.")
  n = int(np.prod(shape))
  q = nf4.NF4Quantized(
    parts["weight"].reshape(-1),
    parts[".absmax"].reshape(-1),
    parts[".nested_absmax"].reshape(-1).astype(np.float32),
    offset,
  )
  if q.codes.size != -(-n // 2) or q.absmax.size != -(-n // nf4.BLOCKSIZE):
    raise BnbError(f"{base}: its bytes do not match its quant state shape {list(shape)}.")
  return q, shape


class Assembler:
  """Gathers the six tensors of each quantized Linear as a file streams them past, in any order,
  and hands the Linear on once all six have arrived."""

  def __init__(self):
    self.pending: dict[str, dict[str, np.ndarray]] = {}  # base name -> the parts read so far

  def add(
    self, name: str, file: Path, tensor: np.ndarray
  ) -> tuple[str, np.ndarray | None, tuple[nf4.NF4Quantized, tuple[int, int]] | None] | None:
    """-> (name, tensor, None) for a tensor that is no part of a quantized Linear; None while
    a Linear's parts are still arriving; ("X.weight", None, (flat NF4, [out, in])) with its
    last part."""
    piece = split_name(name, tensor)
    if piece is None:
      return name, tensor, None
    base, part = piece
    parts = self.pending.setdefault(base, {})
    parts[part] = tensor
    if len(parts) < len(PARTS):
      return None
    del self.pending[base]
    try:
      return base, None, unpack(base, parts)
    except BnbError as e:
      raise CheckpointError(f"{file.name}: {e}") from e

  def check_complete(self, ckpt: Path) -> None:
    """Raise if a Linear's parts never all arrived (once every file has been read)."""
    if self.pending:
      some = sorted(self.pending)[0]
      raise CheckpointError(
        f"4-bit tensor {some} lacks {sorted(set(PARTS) - set(self.pending[some]))} in {ckpt}; "
        "the checkpoint is incomplete."
      )


def linear_layout(flat: nf4.NF4Quantized, out_features: int) -> nf4.NF4Quantized:
  """bitsandbytes' flat tensors of a Linear [out, in] -> jaxtune's NF4 layout of it: codes
  [out, in / 2], absmax [out, in / 64] (the same bytes: blocks of 64 never cross a row when
  in is a multiple of 64)."""
  return nf4.NF4Quantized(
    flat.codes.reshape(out_features, -1),
    flat.absmax.reshape(out_features, -1),
    flat.nested_absmax,
    np.asarray(flat.offset, np.float32),
  )


def pack(q: nf4.NF4Quantized, shape: tuple[int, int], dtype: str) -> dict[str, np.ndarray]:
  """The six tensors of one Linear in bitsandbytes' layout (suffixes relative to X.weight)."""
  state = {
    "quant_type": "nf4",
    "blocksize": nf4.BLOCKSIZE,
    "dtype": dtype,
    "shape": list(shape),
    "nested_blocksize": nf4.NESTED_BLOCKSIZE,
    "nested_dtype": "float32",
    "nested_offset": float(np.float32(q.offset)),
  }
  return {
    "weight": np.asarray(q.codes, np.uint8).reshape(-1, 1),
    ".absmax": np.asarray(q.absmax, np.uint8).reshape(-1),
    ".nested_absmax": np.asarray(q.nested_absmax, np.float32).reshape(-1),
    ".quant_map": NF4_CODE.copy(),
    ".nested_quant_map": DYNAMIC_MAP.copy(),
    STATE_SUFFIX: np.frombuffer(json.dumps(state).encode(), np.uint8).copy(),
  }


def quantization_config(compute_dtype: str) -> dict:
  """config.json's quantization_config as transformers writes it for nf4 + double quant."""
  return {
    "quant_method": "bitsandbytes",
    "load_in_4bit": True,
    "load_in_8bit": False,
    "bnb_4bit_quant_type": "nf4",
    "bnb_4bit_use_double_quant": True,
    "bnb_4bit_compute_dtype": compute_dtype,
    "bnb_4bit_quant_storage": "uint8",
    "llm_int8_skip_modules": None,
    "llm_int8_threshold": 6.0,
    "llm_int8_has_fp16_weight": False,
    "llm_int8_enable_fp32_cpu_offload": False,
  }
