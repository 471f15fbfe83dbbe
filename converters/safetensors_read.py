"""Reading safetensors checkpoints: the files of a checkpoint, and their tensors one at a time.

Tensors are read with plain positioned reads, not memory-mapped: a mapped multi-GB shard shows
up whole in the process's resident memory while it is open. The chunks of a large tensor are
read by several threads at once (a copy out of the page cache is bound per thread), and
:class:`Prefetcher` keeps reading (and copying to the device) on background threads while the
caller converts earlier tensors, at most ``PREFETCH_BYTES`` (or one tensor) ahead of it.
"""

import contextlib
import json
import math
import os
import queue
import stat
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

import ml_dtypes
import numpy as np

from converters.errors import CheckpointError


def safetensors_files(ckpt: Path) -> list[Path]:
  """The checkpoint's safetensors files, from model.safetensors.index.json when sharded."""
  index = ckpt / "model.safetensors.index.json"
  if index.is_file():
    invalid = CheckpointError(f"{index} is not a valid safetensors index; re-download it.")
    try:
      content = json.loads(index.read_text())
    except OSError as e:
      raise _unreadable(index, e) from e
    except ValueError as e:  # not JSON, or not UTF-8
      raise invalid from e
    weight_map = content.get("weight_map") if isinstance(content, dict) else None
    if not isinstance(weight_map, dict) or not all(
      isinstance(name, str) and "/" not in name for name in weight_map.values()
    ):  # an index names files beside it
      raise invalid
    files = [ckpt / name for name in dict.fromkeys(weight_map.values())]
    # A link or a directory in a listed file's place is not missing: opening it says what it is.
    missing = [f.name for f in files if not (f.exists() or f.is_symlink())]
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


READ_THREADS = min(8, os.cpu_count() or 1)
PREFETCH_BYTES = 256 << 20  # about two of an 8B model's largest layer weights
_CHUNK = 16 << 20


class _Entry(NamedTuple):
  name: str
  start: int  # byte offset in the file
  nbytes: int
  dtype: np.dtype
  shape: tuple[int, ...]


def iter_tensors(
  files: list[Path], threads: int = READ_THREADS
) -> Iterator[tuple[str, Path, np.ndarray]]:
  """(name, file, array) one at a time; only the tensor being read is resident."""
  with ThreadPoolExecutor(threads) as pool, contextlib.closing(_entries(files)) as entries:
    for file, fd, entry in entries:
      yield entry.name, file, _read(fd, file, entry, pool)


def _entries(files: list[Path]) -> Iterator[tuple[Path, int, _Entry]]:
  """(file, open descriptor, entry) of every tensor, in file order, each entry checked."""
  for file in files:
    with _open(file) as f:
      for entry in _read_header(f, file, os.fstat(f.fileno()).st_size):
        yield file, f.fileno(), entry


def _open(file: Path):
  """The file opened for reading; a directory, a device, a link loop or a file without read
  permission is refused with one sentence (and a FIFO is never opened: that would block)."""
  try:
    if not stat.S_ISREG(file.stat().st_mode):
      kind = "a directory" if file.is_dir() else "not a regular file"
      raise CheckpointError(
        f"cannot read {file} (it is {kind}); replace it with the checkpoint's file."
      )
    return open(file, "rb")
  except OSError as e:
    raise _unreadable(file, e) from e


def _unreadable(file: Path, e: OSError) -> CheckpointError:
  return CheckpointError(
    f"cannot read {file} ({e.strerror or type(e).__name__}); make it a readable file "
    "(fix its permissions or link, or re-download it)."
  )


def _read(fd: int, file: Path, entry: _Entry, pool: ThreadPoolExecutor | None) -> np.ndarray:
  buffer = np.empty(entry.nbytes, np.uint8)
  view = memoryview(buffer)
  spans = [(i, min(i + _CHUNK, entry.nbytes)) for i in range(0, entry.nbytes, _CHUNK)]

  def read(span):
    return _pread_into(fd, view[span[0] : span[1]], entry.start + span[0])

  done = pool.map(read, spans) if pool is not None and len(spans) > 1 else map(read, spans)
  try:
    complete = all(list(done))
  except OSError as e:  # an I/O error of the disk or a network file system
    raise _unreadable(file, e) from e
  if not complete:
    raise CheckpointError(f"{file} is truncated or corrupt (short read); re-download it.")
  return buffer.view(entry.dtype).reshape(entry.shape)


def _pread_into(fd: int, view: memoryview, offset: int) -> bool:
  """Fill ``view`` from ``offset`` of the file; False at a premature end of file."""
  while view.nbytes:
    n = os.preadv(fd, [view], offset)
    if n <= 0:
      return False
    view, offset = view[n:], offset + n
  return True


class Prefetcher:
  """``iter_tensors(files)`` read, and each array passed through ``place`` (a copy to the
  device), on background threads from construction on, while the caller converts earlier
  tensors; iterate it once, inside ``with``, so the threads stop when the caller stops.

  Reading waits while the tensors read but not yet finished by the caller would exceed
  ``budget`` bytes (one tensor always goes ahead); a tensor counts until the caller asks for
  the next one.
  """

  def __init__(self, files: list[Path], place: Callable, budget: int = PREFETCH_BYTES):
    self._files, self._place, self._budget = files, place, budget
    self._cond = threading.Condition()
    self._ahead = 0  # bytes read and not yet released by the caller
    self._stop = False
    self._out: queue.Queue = queue.Queue()
    self._thread = threading.Thread(target=self._produce, name="jaxtune-reader", daemon=True)
    self._thread.start()

  def __iter__(self) -> Iterator[tuple[str, Path, object]]:
    while (item := self._out.get()) is not None:
      if isinstance(item, BaseException):
        raise item
      name, file, placed, nbytes = item
      yield name, file, placed.result()
      self._release(nbytes)

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    with self._cond:
      self._stop = True
      self._cond.notify_all()
    self._thread.join()

  def _reserve(self, n: int) -> bool:
    with self._cond:
      self._cond.wait_for(lambda: self._stop or self._ahead == 0 or self._ahead + n <= self._budget)
      self._ahead += n
      return not self._stop

  def _release(self, n: int) -> None:
    with self._cond:
      self._ahead -= n
      self._cond.notify_all()

  def _produce(self):
    try:
      with (
        ThreadPoolExecutor(READ_THREADS) as readers,
        ThreadPoolExecutor(2) as placers,
        contextlib.closing(_entries(self._files)) as entries,
      ):
        for file, fd, entry in entries:
          if not self._reserve(entry.nbytes):
            return
          tensor = _read(fd, file, entry, readers)
          self._out.put((entry.name, file, placers.submit(self._place, tensor), entry.nbytes))
    except BaseException as e:  # handed to the caller's thread, which raises it
      self._out.put(e)
    else:
      self._out.put(None)


HEADER_LIMIT = 100_000_000  # bytes, the limit of the safetensors library


def _read_header(f, file: Path, size: int) -> list[_Entry]:
  """The tensors of an open safetensors file of ``size`` bytes, in file order.

  Every field is checked before any tensor is read: a damaged or hostile header (offsets
  outside the data, overlapping or leaving gaps, a shape that does not match its bytes, an
  unknown dtype) is refused with one sentence naming the file and the tensor, as the
  safetensors library itself refuses it, so header bytes are never read as weights.
  """

  def corrupt(detail: str) -> CheckpointError:
    return CheckpointError(f"{file} is truncated or corrupt ({detail}); re-download it.")

  raw = f.read(8)
  if len(raw) < 8:
    raise corrupt(f"it holds {size} bytes, too few for the 8-byte header length")
  n = int.from_bytes(raw, "little")
  if n == 0 or n > size - 8 or n > HEADER_LIMIT:
    raise corrupt(
      f"its header length field says {n} bytes, but {size - 8} bytes follow it"
      if n > size - 8
      else f"its header length field says {n} bytes, outside 1..{HEADER_LIMIT}"
    )
  try:  # JSONDecodeError and UnicodeDecodeError are ValueErrors; deep nesting recurses
    header = json.loads(f.read(n))
  except (ValueError, RecursionError) as e:
    raise corrupt("its header is not valid JSON") from e
  if not isinstance(header, dict):
    raise corrupt(f"its header is a JSON {_json_kind(header)}, not an object")
  metadata = header.pop("__metadata__", {})
  if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
    raise corrupt("its __metadata__ is not an object of strings")
  data = size - 8 - n  # bytes of tensor data after the header
  entries = sorted(
    (_entry(file, name, info, 8 + n, data, corrupt) for name, info in header.items()),
    key=lambda e: (e.start, e.nbytes),
  )
  # The tensors must tile the data exactly, as the safetensors library requires: an overlap
  # or a gap means a damaged (or deliberately crafted) file.
  end, before = 8 + n, None
  for entry in entries:
    if entry.start < end:
      raise corrupt(
        f"tensor {_shown(entry.name)}'s data_offsets {_span(entry, 8 + n)} overlap tensor "
        f"{_shown(before.name)}'s {_span(before, 8 + n)}"
      )
    if entry.start > end:
      where = f"before tensor {_shown(entry.name)}"
      raise corrupt(f"{entry.start - end} bytes {where} belong to no tensor")
    end, before = entry.start + entry.nbytes, entry
  if end != size:
    raise corrupt(f"its last {size - end} bytes belong to no tensor")
  return entries


def _entry(file: Path, name: str, info, data_start: int, data: int, corrupt) -> _Entry:
  """One header entry, checked against the ``data`` bytes that start at ``data_start``."""
  tensor = f"tensor {_shown(name)}"
  if not isinstance(info, dict):
    raise corrupt(f"{tensor} is a JSON {_json_kind(info)}, not an object")
  for key in ("dtype", "shape", "data_offsets"):
    if key not in info:
      raise corrupt(f"{tensor} has no {key}")
  dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
  if (
    not isinstance(dtype, str) or dtype not in _ST_DTYPES
  ):  # a damaged entry, or a format (fp8, fp4) jaxtune cannot read
    raise CheckpointError(
      f"{file} holds {tensor} in the dtype {_shown(json.dumps(dtype))}, which jaxtune does not "
      f"read (it reads {', '.join(_ST_DTYPES)}); re-download the file, or convert the "
      "checkpoint to BF16, F16 or F32."
    )
  itemsize = np.dtype(_ST_DTYPES[dtype]).itemsize
  if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
    raise corrupt(f"{tensor} has the shape {_shown(json.dumps(shape))}, not a list of sizes >= 0")
  if math.prod(max(d, 1) for d in shape) * itemsize >= 2**63:
    raise corrupt(f"{tensor} has the shape {_shown(json.dumps(shape))}, too large for any file")
  if not isinstance(offsets, list) or len(offsets) != 2 or not all(map(_is_count, offsets)):
    raise corrupt(
      f"{tensor} has the data_offsets {_shown(json.dumps(offsets))}, not two offsets >= 0"
    )
  begin, end = offsets
  if end < begin:
    raise corrupt(f"{tensor} has the data_offsets [{begin}, {end}], which end before they begin")
  if end > data:
    raise corrupt(
      f"{tensor} runs past the end of the file: its data_offsets end at {end}, the data holds "
      f"{data} bytes"
    )
  if end - begin != math.prod(shape) * itemsize:
    raise corrupt(
      f"{tensor} has {end - begin} bytes, but its shape {tuple(shape)} of {dtype} needs "
      f"{math.prod(shape) * itemsize}"
    )
  return _Entry(name, data_start + begin, end - begin, np.dtype(_ST_DTYPES[dtype]), tuple(shape))


def _span(entry: _Entry, data_start: int) -> list[int]:
  return [entry.start - data_start, entry.start - data_start + entry.nbytes]


def _is_count(x) -> bool:
  """A whole number >= 0 (JSON true is a Python bool, an int; 4.0 and "4" are not counts)."""
  return type(x) is int and x >= 0


def _json_kind(value) -> str:
  return {list: "list", str: "string", bool: "boolean", type(None): "null"}.get(
    type(value), "number"
  )


def _shown(text: str, limit: int = 80) -> str:
  """A name or value from the file as a message can show it: printable, not too long."""
  text = text if text.isprintable() else repr(text)
  return text if len(text) <= limit else text[: limit - 3] + "..."
