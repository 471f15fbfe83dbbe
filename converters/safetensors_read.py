"""Reading safetensors checkpoints: the files of a checkpoint, and their tensors one at a time.

Tensors are read with plain positioned reads, not memory-mapped: a mapped multi-GB shard shows
up whole in the process's resident memory while it is open. The chunks of a large tensor are
read by several threads at once (a copy out of the page cache is bound per thread), and
:class:`Prefetcher` keeps reading (and copying to the device) on background threads while the
caller converts earlier tensors, at most ``PREFETCH_BYTES`` (or one tensor) ahead of it.
"""

import contextlib
import json
import os
import queue
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

import ml_dtypes
import numpy as np

from jaxtune.errors import CheckpointError


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
    size = file.stat().st_size
    with open(file, "rb") as f:
      header = _read_header(f, file, size)
      for name, info in header.items():
        if name == "__header_size__":
          continue
        try:
          dtype = np.dtype(_ST_DTYPES[info["dtype"]])
          begin, end = (int(x) for x in info["data_offsets"])
          shape = tuple(int(x) for x in info["shape"])
        except (KeyError, TypeError, ValueError) as e:
          raise CheckpointError(
            f"{file} is truncated or corrupt (bad entry {name}); re-download it."
          ) from e
        start = 8 + header["__header_size__"] + begin
        nbytes = end - begin
        if start + nbytes > size or nbytes != int(np.prod(shape)) * dtype.itemsize:
          raise CheckpointError(
            f"{file} is truncated or corrupt (tensor {name} runs past the end of the file or has "
            "the wrong size); re-download it."
          )
        yield file, f.fileno(), _Entry(name, start, nbytes, dtype, shape)


def _read(fd: int, file: Path, entry: _Entry, pool: ThreadPoolExecutor | None) -> np.ndarray:
  buffer = np.empty(entry.nbytes, np.uint8)
  view = memoryview(buffer)
  spans = [(i, min(i + _CHUNK, entry.nbytes)) for i in range(0, entry.nbytes, _CHUNK)]

  def read(span):
    return _pread_into(fd, view[span[0] : span[1]], entry.start + span[0])

  done = pool.map(read, spans) if pool is not None and len(spans) > 1 else map(read, spans)
  if not all(list(done)):
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
