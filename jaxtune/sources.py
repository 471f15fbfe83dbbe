"""Where a run's examples come from, read through Hugging Face ``datasets``.

``open_source`` takes what ``--data`` / ``jaxtune.train(data=...)`` may be: a local
``.jsonl``/``.json``/``.parquet``/``.csv``/``.arrow`` file, a directory or glob of them, a
directory written by ``datasets.save_to_disk``, a Hub dataset id (``org/name``), a
``datasets.Dataset`` or an iterable of dicts, and returns a ``datasets.Dataset`` (or an
``IterableDataset`` when streaming). Every way it can fail is a ``DataError`` sentence.
"""

import codecs
import glob
import os
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from jaxtune.errors import DataError

# File suffix -> datasets' packaged builder.
BUILDERS = {
  ".jsonl": "json",
  ".json": "json",
  ".parquet": "parquet",
  ".csv": "csv",
  ".arrow": "arrow",
}
# The deepest a row may nest [ and { : Arrow, where datasets keeps the examples, holds 64
# levels (datasets 4 / pyarrow: a row of 63 reads, 64 fails with "Recursion level in
# ArrowSchema struct exceeded", and around 10,000 pyarrow's JSON reader crashes the process).
MAX_DEPTH = 63
# An escape of half a UTF-16 surrogate pair, \uD800-\uDBFF (high) or \uDC00-\uDFFF (low).
_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")
_LOW = re.compile(rb"\\u[dD][c-fC-F][0-9a-fA-F]{2}")


def _datasets():
  try:
    import datasets
  except ImportError as e:
    raise DataError("reading datasets needs the data extra: pip install 'jaxtune[data]'.") from e
  datasets.disable_progress_bars()
  datasets.logging.set_verbosity(datasets.logging.CRITICAL)  # our errors say what failed
  return datasets


def open_source(
  data: Any,
  config: str | None = None,
  split: str = "train",
  streaming: bool = False,
) -> tuple[Any, str]:
  """(dataset, a short name for messages) for ``data`` (see the module docstring)."""
  ds = _datasets()
  if isinstance(data, ds.Dataset):
    return (data.to_iterable_dataset() if streaming else data), "the given dataset"
  if isinstance(data, ds.IterableDataset):
    if not streaming:  # read whole, as a file would be
      data = ds.Dataset.from_list(list(data))
      _check_rows(data, "the given dataset")
    return data, "the given dataset"
  if isinstance(data, ds.DatasetDict | ds.IterableDatasetDict):
    return _pick_split(data, split, "the given dataset"), "the given dataset"
  if isinstance(data, Path):
    data = str(data)
  if not isinstance(data, str):
    if isinstance(data, Mapping) or not isinstance(data, Iterable):
      raise DataError(
        "data must be a path, a Hub dataset id, a datasets.Dataset or an iterable of dicts, "
        f"got {type(data).__name__}."
      )
    rows = list(data)
    if not all(isinstance(r, Mapping) for r in rows):
      raise DataError("data given as an iterable must yield dicts (one example each).")
    if not rows:
      raise DataError("the given examples are empty.")
    table = ds.Dataset.from_list([dict(r) for r in rows])
    return (table.to_iterable_dataset() if streaming else table), "the given examples"
  path = Path(data).expanduser()
  name = str(data)
  if any(c in data for c in "*?["):
    files = sorted(glob.glob(str(path), recursive=True))
    if not files:
      raise DataError(f"--data {data} matches no file.")
    return _load_files(ds, [Path(f) for f in files], name, streaming), name
  if path.is_file():
    return _load_files(ds, [path], name, streaming), name
  if path.is_dir():
    if (path / "dataset_dict.json").is_file() or (path / "state.json").is_file():
      saved = ds.load_from_disk(str(path))
      if isinstance(saved, ds.DatasetDict):
        saved = _pick_split(saved, split, name)
      _check_rows(saved, name)
      return (saved.to_iterable_dataset() if streaming else saved), name
    return _load_repo(ds, str(path), config, split, streaming, name, local=True), name
  if data.endswith(tuple(BUILDERS)) or data.startswith((".", "/", "~")) or data.count("/") > 1:
    raise DataError(f"data file {data} does not exist; pass --data FILE, a directory or a Hub id.")
  return _load_repo(ds, data, config, split, streaming, name, local=False), name


def _load_files(ds, files: list[Path], name: str, streaming: bool):
  kinds = {BUILDERS.get(_suffix(f)) for f in files}
  if None in kinds:
    bad = next(f for f in files if BUILDERS.get(_suffix(f)) is None)
    raise DataError(
      f"{bad} is not a data file jaxtune reads; use {', '.join(BUILDERS)} (or a directory "
      "written by datasets.save_to_disk)."
    )
  if len(kinds) > 1:
    raise DataError(f"--data {name} mixes file types ({', '.join(sorted(kinds))}); use one.")
  builder = kinds.pop()
  for f in files:
    _check_text_file(f, builder)
  try:
    table = ds.load_dataset(builder, data_files=[str(f) for f in files], split="train",
                            streaming=streaming)  # fmt: skip
  except ValueError as e:
    if "corresponds to no data" in str(e) or "no data" in str(e).lower():
      raise DataError(f"{name} holds no examples; it is empty.") from e
    raise DataError(f"{name} cannot be read as {builder} ({_first_line(e)}).") from e
  except ds.exceptions.DatasetGenerationError as e:
    bad = _bad_line(files, builder)
    if bad is None and _empty(e):
      raise DataError(f"{name} holds no examples; it is empty.") from e
    if bad is not None:
      raise DataError(f"{bad}; fix that line (one JSON object per line).") from e
    why = _first_line(e.__cause__ or e.__context__ or e)
    raise DataError(f"{name} cannot be read as {builder} ({why}).") from e
  if not streaming:
    _check_rows(table, name)
  return table


def _check_text_file(path: Path, builder: str) -> None:
  """UTF-8, and for JSON no lone surrogate and no row nested deeper than Arrow holds: checked
  here so that the error names the line (arrow's reader names neither, reads some invalid UTF-8
  without a word, and crashes on very deep nesting before any error can be caught)."""
  if builder not in ("json", "csv"):
    return
  decoder = codecs.getincrementaldecoder("utf-8")()
  nesting = _Nesting(per_line=_suffix(path) == ".jsonl") if builder == "json" else None
  line = 1
  with open(path, "rb") as f:
    while chunk := f.read(1 << 24) + f.readline():  # whole lines: no escape is cut in two
      try:
        decoder.decode(chunk)
      except UnicodeDecodeError as e:
        line += chunk[: e.start].count(b"\n")
        raise DataError(f"{path}:{line} is not UTF-8 text; save the file as UTF-8.") from None
      if nesting is not None:
        if (at := _lone_surrogate(chunk)) is not None:
          escape = chunk[at : at + 6].decode()
          line += chunk[:at].count(b"\n")
          raise DataError(
            f"{path}:{line} holds {escape}, half of a UTF-16 surrogate pair without its other "
            "half, which is no character (often a string cut inside an emoji); remove it or "
            "complete the pair."
          )
        if (at := nesting.too_deep(chunk)) is not None:
          line += chunk[:at].count(b"\n")
          raise DataError(
            f"{path}:{line} nests [ and {{ more than {MAX_DEPTH} levels deep, more than datasets "
            "can hold; flatten that row, keep its deep part as a JSON string, or remove it."
          )
      line += chunk.count(b"\n")


def _lone_surrogate(chunk: bytes) -> int | None:
  """Where ``chunk`` (whole lines of JSON) has an escape of half a surrogate pair without its
  other half: valid JSON, but no character (pyarrow refuses the file, Python's json reads it).
  None: nowhere. An escape after an escaped backslash (``\\\\ud800``) is text, not an escape."""
  paired = -1  # where the low half of the last pair starts
  for m in _SURROGATE.finditer(chunk):
    at = m.start()
    if at == paired:
      continue
    run = 0  # backslashes just before it (counted in place: no copy of the chunk per match)
    while at - run > 0 and chunk[at - run - 1] == 0x5C:
      run += 1
    if run % 2:
      continue
    if chunk[at + 3] in b"89abAB" and _LOW.match(chunk, at + 6):
      paired = at + 6
      continue
    return at
  return None


# +1 for [ and {, -1 for ] and }, by byte value.
_STEP = np.zeros(256, np.int32)
_STEP[[ord("["), ord("{")]] = 1
_STEP[[ord("]"), ord("}")]] = -1


class _Nesting:
  """How deep a JSON text nests [ and { outside its strings, read a piece at a time with numpy;
  ``per_line``: JSON lines, every line from depth 0.

  The state between pieces: the depth, whether a string is open, and how many backslashes
  ended the last piece. A raw newline is never inside a JSON string, so each line starts
  outside one. A top-level array's own level (a .json file of rows) is not counted.
  """

  def __init__(self, per_line: bool):
    self.per_line, self.depth, self.inside, self.backslashes = per_line, 0, False, 0
    self.outer = None if not per_line else 0  # 1 when the file is one array of rows

  def too_deep(self, chunk: bytes) -> int | None:
    """Where in ``chunk`` (whole lines) a row first nests deeper than MAX_DEPTH; None: nowhere."""
    if not self.per_line:
      if self.outer is None and chunk.strip():
        self.outer = int(chunk.lstrip()[:1] == b"[")
      return self._pieces(chunk)
    # Only a line of more than MAX_DEPTH opening brackets can nest deeper: scan just those.
    start = 0
    for line in chunk.split(b"\n"):
      if line.count(b"[") + line.count(b"{") > MAX_DEPTH:
        at = _Nesting(per_line=True)._pieces(line)
        if at is not None:
          return start + at
      start += len(line) + 1
    return None

  def _pieces(self, text: bytes, piece: int = 1 << 20) -> int | None:
    for start in range(0, len(text), piece):
      at = self._scan(np.frombuffer(text, np.uint8, min(piece, len(text) - start), start))
      if at is not None:
        return start + at
    return None

  def _scan(self, a: np.ndarray) -> int | None:
    i = np.arange(len(a), dtype=np.int32)
    newline = a == ord("\n")
    # A quote opens or closes a string unless an odd run of backslashes escapes it.
    backslash = a == ord("\\")
    last_other = np.maximum.accumulate(np.where(backslash, -1, i))
    run = np.empty_like(i)  # backslashes just before each byte
    run[0] = self.backslashes
    run[1:] = i[:-1] - last_other[:-1] + np.where(last_other[:-1] < 0, self.backslashes, 0)
    quote = (a == ord('"')) & (run % 2 == 0)
    quotes = np.cumsum(quote, dtype=np.int32)
    since_newline = quotes - np.maximum.accumulate(np.where(newline, quotes, 0))
    first_line = ~np.maximum.accumulate(newline)
    inside = (since_newline + (first_line & self.inside)) % 2 == 1
    depth = np.cumsum(np.where(inside, 0, _STEP[a]), dtype=np.int32) + self.depth
    if self.per_line:  # each line from 0 (a damaged line does not shift the next)
      last_newline = np.maximum.accumulate(np.where(newline, i, -1))
      depth -= np.where(last_newline < 0, 0, depth[last_newline])
    self.depth, self.inside = int(depth[-1]), bool(inside[-1])
    self.backslashes = int(run[-1] + 1) if backslash[-1] else 0
    deeper = np.flatnonzero(depth > MAX_DEPTH + (self.outer or 0))
    return int(deeper[0]) if len(deeper) else None


def _bad_line(files: list[Path], builder: str) -> str | None:
  """Where the first line of a JSON-lines file that is not JSON is (None: none is)."""
  import json

  if builder == "json":
    for f in files:
      if _suffix(f) != ".jsonl":
        continue
      with open(f, encoding="utf-8") as lines:
        for n, text in enumerate(lines, 1):
          if not text.strip():
            continue
          try:
            json.loads(text)
          except json.JSONDecodeError as bad:
            return f"{f}:{n} is not valid JSON ({bad.msg})"
  return None


def _load_repo(ds, path: str, config, split: str, streaming: bool, name: str, local: bool):
  """A Hub dataset id, or a local directory of data files (its README may name configs)."""
  where = "directory" if local else "Hub dataset"
  try:
    table = ds.load_dataset(path, config, split=split, streaming=streaming)
  except ds.exceptions.DatasetNotFoundError as e:
    raise DataError(
      f"the Hub dataset {path} does not exist or is private (log in with `hf auth login`); "
      "check the id, or pass a local file."
    ) from e
  except ConnectionError as e:
    raise DataError(
      f"the Hub dataset {path} cannot be reached ({_first_line(e)}); check the network "
      "(HF_HUB_OFFLINE unset), or pass a local file."
    ) from e
  except FileNotFoundError as e:
    raise DataError(
      f"the {where} {path} holds no data files jaxtune reads ({_first_line(e)})."
    ) from e
  except ValueError as e:
    text = str(e)
    if "Unknown split" in text:
      splits = _names(lambda: ds.get_dataset_split_names(path, config), text)
      raise DataError(
        f"the {where} {path} has no split {split!r}; its splits are {splits}; pass "
        "--data-split NAME."
      ) from e
    if "Config name is missing" in text or "BuilderConfig" in text:
      configs = _names(lambda: ds.get_dataset_config_names(path), text)
      asked = f"no config {config!r}" if config else "several configs"
      raise DataError(
        f"the {where} {path} has {asked}; its configs are {configs}; pass --data-config NAME."
      ) from e
    if "corresponds to no data" in text:
      raise DataError(f"the {where} {path} holds no examples in split {split!r}.") from e
    raise DataError(f"the {where} {path} cannot be read ({_first_line(e)}).") from e
  except ds.exceptions.DatasetGenerationError as e:
    if _empty(e):
      raise DataError(
        f"the {where} {path} holds no examples in split {split!r}; fill it, or pick another "
        "with --data-split."
      ) from e
    raise DataError(f"the {where} {path} cannot be read ({_first_line(e.__cause__ or e)}).") from e
  if not streaming:
    _check_rows(table, name)
  return table


def _empty(e: BaseException) -> bool:
  """Whether datasets failed because a file or split holds no rows (it cannot build those)."""
  seen, todo = set(), [e]
  while todo:
    e = todo.pop()
    if e is None or id(e) in seen:
      continue
    seen.add(id(e))
    text = str(e)
    if "at least one example" in text or "BatchSize must be greater than 0" in text:
      return True
    todo += [e.__cause__, e.__context__]
  return False


def _pick_split(dd, split: str, name: str):
  if split not in dd:
    raise DataError(
      f"{name} has no split {split!r}; its splits are {', '.join(dd)}; pass --data-split NAME."
    )
  return dd[split]


def _check_rows(table, name: str) -> None:
  if len(table) == 0:
    raise DataError(f"{name} holds no examples; it is empty.")


def _names(get, message: str) -> str:
  try:
    return ", ".join(get())
  except Exception:  # the names are in the original message then
    start, end = message.find("["), message.find("]")
    return message[start + 1 : end].replace("'", "") if 0 <= start < end else "unknown"


def _suffix(path: Path) -> str:
  return path.suffix.lower()


def _first_line(e: BaseException) -> str:
  text = str(e).strip()
  return text.splitlines()[0][:200] if text else type(e).__name__


def cache_root() -> str:
  """Where datasets keeps its cache (HF_DATASETS_CACHE)."""
  return os.environ.get("HF_DATASETS_CACHE") or str(_datasets().config.HF_DATASETS_CACHE)
