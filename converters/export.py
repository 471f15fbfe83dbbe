"""Write a model out in one of the export formats, atomically.

The export is written into a temporary directory beside ``out`` and renamed into place when
complete, so a failed or interrupted export never leaves a half-written model; an existing,
non-empty ``out`` is replaced only with ``overwrite``.
"""

import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from converters.gguf_out import export_gguf
from converters.hf_out import export_bnb4, export_merged, export_peft
from jaxtune.errors import ExportError

if TYPE_CHECKING:
  from flax import nnx

FORMATS = ("merged", "peft", "bnb4", "gguf")


def _usual_modes(root: Path) -> None:
  """mkdtemp makes 0700 directories (and some writers 0600 files): give the export the modes
  files and directories get by default under the process's umask."""
  umask = os.umask(0)
  os.umask(umask)
  root.chmod(0o777 & ~umask)
  for path in root.rglob("*"):
    path.chmod((0o777 if path.is_dir() else 0o666) & ~umask)


# Bytes per parameter of each export (GGUF by --gguf-type: llama.cpp's block sizes), for the
# free-space check before a run starts; close enough for that, not exact.
_BYTES_PER_PARAM = {"merged": 2.0, "bnb4": 0.53}
_GGUF_BYTES = {"f32": 4.0, "f16": 2.0, "bf16": 2.0, "q8_0": 34 / 32, "q5_1": 24 / 32,
               "q5_0": 22 / 32, "q4_1": 20 / 32, "q4_0": 18 / 32}  # fmt: skip


def estimated_bytes(fmt: str, num_params: int, lora_params: int, gguf_type: str = "f16") -> int:
  """About how many bytes exporting a model of ``num_params`` (``lora_params`` of them
  adapters) as ``fmt`` writes."""
  if fmt == "peft":
    return 4 * lora_params
  if fmt == "gguf":
    return int(_GGUF_BYTES.get(gguf_type, 2.0) * num_params)
  return int(_BYTES_PER_PARAM.get(fmt, 2.0) * num_params)


def check_destination(out: Path, overwrite: bool) -> None:
  """Refuse ``out`` before anything is loaded: a file, or a non-empty directory without
  ``overwrite``."""
  if out.exists() and not out.is_dir():
    raise ExportError(f"--out {out} is a file; pass a directory.")
  if out.is_dir() and any(out.iterdir()) and not overwrite:
    raise ExportError(
      f"--out {out} is not empty; pass --overwrite to replace it, or choose another directory."
    )


def write(
  model: "nnx.Module",
  fmt: str,
  out: str | Path,
  dtype: str = "bfloat16",
  overwrite: bool = False,
  card: str | None = None,
  gguf_type: str = "f16",
) -> Path:
  """Export ``model`` as ``fmt`` (one of FORMATS) into ``out``, atomically; returns ``out``.

  ``card``: the model card, written as README.md beside the weights. Files get the modes a
  new file gets here (0644 under the usual umask), directories 0755.
  """
  out = Path(out)
  check_destination(out, overwrite)
  try:
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
  except OSError as e:
    raise ExportError(
      f"cannot write into {out.parent} ({e.strerror}); choose another --out."
    ) from e
  old = None
  try:
    if fmt == "merged":
      export_merged(model, tmp, dtype=dtype)
    elif fmt == "bnb4":
      export_bnb4(model, tmp, dtype=dtype)
    elif fmt == "peft":
      export_peft(model, tmp)
    elif fmt == "gguf":
      export_gguf(model, tmp, gguf_type=gguf_type)
    else:
      raise ValueError(f"export format must be one of {FORMATS}, got {fmt!r}")
    if card is not None:
      (tmp / "README.md").write_text(card)
    _usual_modes(tmp)
    if out.exists():
      old = out.with_name(tmp.name + ".old")
      out.rename(old)
    try:
      tmp.rename(out)
    except OSError:
      if old is not None:
        old.rename(out)
      raise
  except OSError as e:
    raise ExportError(
      f"writing the export to {out} failed ({e.strerror or e}); nothing was changed there: "
      "free some space or choose another --out."
    ) from e
  finally:
    if tmp.exists():
      shutil.rmtree(tmp)
  if old is not None:
    shutil.rmtree(old)
  return out
