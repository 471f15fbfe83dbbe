"""Write a model out in one of the export formats, atomically.

The export is written into a temporary directory beside ``out`` and renamed into place when
complete, so a failed or interrupted export never leaves a half-written model; an existing,
non-empty ``out`` is replaced only with ``overwrite``. A killed export's temporary directory
is removed by the next export into the same place.
"""

import errno
import glob
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from safetensors import SafetensorError

from jaxtune.errors import ExportError
from jaxtune.hf.gguf import export_gguf
from jaxtune.hf.write import MERGE_INTO, export_bnb4, export_merged, export_peft

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


def _first_line(e: BaseException) -> str:
  return (str(e).strip().splitlines() or [type(e).__name__])[0][:200]


def _alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    return True
  return True


def remove_stale_temporaries(out: Path) -> list[Path]:
  """Remove what exports into ``out`` that were killed left beside it (``.NAME.PID-*.tmp``
  and their ``.old`` copies) when their process is gone; returns what was removed."""
  removed = []
  for tmp in out.parent.glob(f".{glob.escape(out.name)}.*.tmp*"):
    pid = tmp.name[len(out.name) + 2 :].split("-")[0]
    if not tmp.name.endswith((".tmp", ".tmp.old")) or (pid.isdigit() and _alive(int(pid))):
      continue
    shutil.rmtree(tmp, ignore_errors=True)
    removed.append(tmp)
  return removed


def check_destination(out: Path, overwrite: bool) -> None:
  """Refuse ``out`` before anything is loaded: a symbolic link, a file, or a non-empty
  directory without ``overwrite``."""
  if out.is_symlink():  # replacing it would rename the link, then fail to remove it
    raise ExportError(
      f"--out {out} is a symbolic link (to {os.readlink(out)}); pass the directory it points "
      "to, or another --out."
    )
  if out.exists() and not out.is_dir():
    raise ExportError(f"--out {out} is a file; pass a directory.")
  base = out.absolute()
  while not base.exists() and base != base.parent:
    base = base.parent
  if not base.is_dir():
    raise ExportError(f"--out {out} is under {base}, which is a file; pass a directory.")
  if not os.access(base, os.W_OK | os.X_OK):
    raise ExportError(f"--out {out}: {base} is not writable; choose another --out.")
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
  merge_into: str = "original",
) -> Path:
  """Export ``model`` as ``fmt`` (one of FORMATS) into ``out``, atomically; returns ``out``.

  ``card``: the model card, written as README.md beside the weights. Files get the modes a
  new file gets here (0644 under the usual umask), directories 0755. ``merge_into`` (merged,
  bnb4 and gguf): the base the LoRA update is added to, "original" (the checkpoint's own
  weights, read again from its files: the model its PEFT adapter gives) or "dequantized"
  (the model's NF4 weights: the model as it trained).
  """
  out = Path(out)
  check_destination(out, overwrite)
  if merge_into not in MERGE_INTO:
    raise ExportError(f"--merge-into must be original or dequantized, got {merge_into!r}.")
  try:
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(out)
    tmp = Path(
      tempfile.mkdtemp(prefix=f".{out.name}.{os.getpid()}-", suffix=".tmp", dir=out.parent)
    )
  except OSError as e:
    raise ExportError(
      f"cannot write into {out.parent} ({e.strerror}); choose another --out."
    ) from e
  old = None
  try:
    if fmt == "merged":
      export_merged(model, tmp, dtype=dtype, merge_into=merge_into)
    elif fmt == "bnb4":
      export_bnb4(model, tmp, dtype=dtype, merge_into=merge_into)
    elif fmt == "peft":
      export_peft(model, tmp)
    elif fmt == "gguf":
      export_gguf(model, tmp, gguf_type=gguf_type, merge_into=merge_into)
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
    except BaseException:  # an interrupt too: the previous export goes back in place
      if old is not None:
        old.rename(out)
        old = None
      raise
  except (OSError, SafetensorError) as e:
    if isinstance(e, SafetensorError) and "I/O error" not in str(e):
      raise  # not the disk: a bug
    full = getattr(e, "errno", None) == errno.ENOSPC or "No space left" in str(e)
    why = "the disk is full" if full else (getattr(e, "strerror", None) or _first_line(e))
    raise ExportError(
      f"writing the export to {out} failed ({why}); nothing was changed there: free some "
      "space or choose another --out."
    ) from e
  finally:
    if tmp.exists():
      shutil.rmtree(tmp, ignore_errors=True)
  if old is not None:
    try:
      shutil.rmtree(old)
    except OSError as e:  # the export is in place; only the copy of the one it replaced stays
      print(
        f"jaxtune: the previous export, moved to {old}, could not be removed "
        f"({e.strerror or _first_line(e)}); remove it yourself",
        file=sys.stderr,
        flush=True,
      )
  return out
