"""Where a run's examples come from, read through Hugging Face ``datasets``.

``open_source`` takes what ``--data`` / ``jaxtune.train(data=...)`` may be: a local
``.jsonl``/``.json``/``.parquet``/``.csv``/``.arrow`` file, a directory or glob of them, a
directory written by ``datasets.save_to_disk``, a Hub dataset id (``org/name``), a
``datasets.Dataset`` or an iterable of dicts, and returns a ``datasets.Dataset`` (or an
``IterableDataset`` when streaming). Every way it can fail is a ``DataError`` sentence.
"""

import codecs
import functools
import glob
import os
import re
import sys
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
  # A path that exists is the file or directory it names, before any glob: data[1].jsonl is a
  # file, not a pattern matching data1.jsonl.
  if path.is_file():
    return _load_files(ds, [path], name, streaming), name
  if path.is_dir():
    if (path / "dataset_dict.json").is_file() or (path / "state.json").is_file():
      saved = _load_saved(ds, path, name)
      if isinstance(saved, ds.DatasetDict):
        saved = _pick_split(saved, split, name)
      _check_rows(saved, name)
      return (saved.to_iterable_dataset() if streaming else saved), name
    if glob.escape(str(path)) != str(path):  # datasets finds a directory's files by pattern
      raise DataError(
        f"the directory {data} has *, ? or [ in its path, which datasets reads as a pattern; "
        "rename it, or pass one of its data files."
      )
    return _load_repo(ds, str(path), config, split, streaming, name, local=True), name
  if any(c in data for c in "*?["):
    files = sorted(glob.glob(str(path), recursive=True))
    if not files:
      raise DataError(f"--data {data} matches no file.")
    folder = next((f for f in files if os.path.isdir(f)), None)
    if folder is not None:
      raise DataError(
        f"--data {data} matches the directory {folder}, not a data file; narrow the pattern "
        "to files (such as *.jsonl), or pass the directory itself."
      )
    return _load_files(ds, [Path(f) for f in files], name, streaming), name
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
  # Zero bytes or blank lines: datasets' JSON reader fails on them with a bare StopIteration
  # (a list, not a generator: every file is checked, all of them may be empty).
  if not any([_check_text_file(f, builder) for f in files]):
    raise DataError(f"{name} holds no examples; it is empty.")
  # Escaped: datasets reads data_files as patterns, where [ ] * ? in a file's name are not.
  data_files = [glob.escape(str(f)) for f in files]
  try:
    table = _read_files(ds, builder, data_files, name, streaming)
  except ValueError as e:
    if "corresponds to no data" in str(e) or "no data" in str(e).lower():
      raise DataError(f"{name} holds no examples; it is empty.") from e
    raise DataError(f"{name} cannot be read as {builder} ({_first_line(e)}).") from e
  except ds.exceptions.DatasetGenerationError as e:
    bad = _bad_line(files)
    if bad is not None:
      raise DataError(f"{bad}.") from e
    parse = _in_chain(e, "ParserError")  # pandas' (CSV), beside datasets' "no example" after it
    if parse is None and _empty(e):
      raise DataError(f"{name} holds no examples; it is empty.") from e
    why = _first_line(parse or e.__cause__ or e.__context__ or e)
    raise DataError(f"{name} cannot be read as {builder} ({why}).") from e
  if not streaming:
    _check_rows(table, name)
  return table


def _read_files(ds, builder: str, data_files: list[str], name: str, streaming: bool):
  """load_dataset of the files; where datasets' cache of them (the Arrow file it made of them
  in an earlier run) is damaged, said on stderr and made anew: it is a copy of the files."""
  read = functools.partial(ds.load_dataset, builder, data_files=data_files, split="train")
  try:
    table = read(streaming=streaming)
  except (OSError, ValueError):
    damage = None if streaming else _cache_damage(ds, builder, data_files)
    if damage is None:
      raise
  else:
    damage = None if streaming else _rows_lost(table)
    if damage is None:
      return table
  print(
    f"jaxtune: datasets' cache of {name} is damaged ({damage}); reading it anew", file=sys.stderr
  )
  return read(download_mode="force_redownload")


def _rows_lost(table) -> str | None:
  """Whether the cache ``table`` was read from holds fewer rows than datasets wrote there (an
  Arrow stream cut between two record batches reads without an error)."""
  split = (table.info.splits or {}).get("train")
  if split is None or not split.num_examples or split.num_examples == len(table):
    return None
  files = ", ".join(f["filename"] for f in table.cache_files)
  return f"{files} holds {len(table):,} of its {split.num_examples:,} rows"


def _cache_damage(ds, builder: str, data_files: list[str]) -> str | None:
  """What of datasets' prepared copy of ``data_files`` cannot be read (None: nothing, or there
  is no copy yet); its map caches beside it (data.py's tokenized rows) are not looked at."""
  directory = Path(ds.load_dataset_builder(builder, data_files=data_files).cache_dir)
  for f in sorted(directory.glob("*.arrow")):
    if not f.name.startswith("cache-") and (damage := arrow_damage(f)) is not None:
      return damage
  return None


# The last 8 bytes of an Arrow stream file: its end-of-stream marker (datasets writes one).
_ARROW_END = b"\xff\xff\xff\xff\x00\x00\x00\x00"


def arrow_damage(path: Path) -> str | None:
  """Why the Arrow stream file ``path`` (as datasets writes its caches and save_to_disk)
  cannot be read whole, as "PATH is missing" or "PATH is truncated or damaged (...)"; None:
  it reads. A file cut between two record batches reads without error: its missing
  end-of-stream marker tells."""
  import pyarrow as pa

  try:
    with pa.memory_map(str(path)) as mapped:
      pa.ipc.open_stream(mapped).read_all()
      mapped.seek(max(0, mapped.size() - len(_ARROW_END)))
      end = mapped.read()
  except FileNotFoundError:
    return f"{path} is missing"
  except (OSError, pa.ArrowInvalid) as e:
    return f"{path} is truncated or damaged ({_first_line(e)})"
  if end != _ARROW_END:
    return f"{path} is truncated (its Arrow stream has no end)"
  return None


def _load_saved(ds, path: Path, name: str):
  """A datasets.save_to_disk directory; a damaged one is named with what is damaged."""
  try:
    return ds.load_from_disk(str(path))
  except (OSError, ValueError, KeyError) as e:  # pyarrow's ArrowInvalid and JSON's errors too
    damage = _saved_damage(path) or f"datasets cannot read it ({_first_line(e)})"
    raise DataError(
      f"the datasets.save_to_disk directory {name} is damaged: {damage}; save the dataset "
      "there again, or pass its original data files."
    ) from e


def _saved_damage(directory: Path) -> str | None:
  """What of a save_to_disk directory (a Dataset's, or a DatasetDict's with one per split)
  cannot be read: a missing file, a JSON file that is not JSON, a damaged Arrow file; None:
  nothing found."""
  import json

  def read(f: Path):
    try:
      return json.loads(f.read_text(encoding="utf-8")), None
    except FileNotFoundError:
      return None, f"{f} is missing"
    except (OSError, ValueError) as e:
      return None, f"{f} is not valid JSON ({_first_line(e)})"

  index = directory / "dataset_dict.json"
  if index.is_file():
    splits, damage = read(index)
    if damage is not None:
      return damage
    if not isinstance(splits, dict) or not isinstance(splits.get("splits"), list):
      return f"{index} does not list the splits"
    return next(filter(None, (_saved_damage(directory / str(s)) for s in splits["splits"])), None)
  state, damage = read(directory / "state.json")
  if damage is None:
    damage = read(directory / "dataset_info.json")[1]
  if damage is not None:
    return damage
  try:
    names = [entry["filename"] for entry in state["_data_files"]]
  except (KeyError, TypeError):
    return f"{directory / 'state.json'} does not list the data files (_data_files)"
  return next(filter(None, (arrow_damage(directory / n) for n in names)), None)


def _check_text_file(path: Path, builder: str) -> bool:
  """UTF-8, and for JSON no lone surrogate and no row nested deeper than Arrow holds: checked
  here so that the error names the line (arrow's reader names neither, reads some invalid UTF-8
  without a word, and crashes on very deep nesting before any error can be caught). Returns
  whether the file holds more than blank space (a binary file: True)."""
  if builder not in ("json", "csv"):
    return True
  decoder = codecs.getincrementaldecoder("utf-8")()
  nesting = _Nesting(per_line=_suffix(path) == ".jsonl") if builder == "json" else None
  line, filled = 1, False
  try:
    f = open(path, "rb")  # noqa: SIM115 - closed below; only opening it is guarded here
  except OSError as e:
    raise DataError(f"cannot read {path} ({e.strerror}); make it a readable file.") from e
  with f:
    while chunk := f.read(1 << 24) + f.readline():  # whole lines: no escape is cut in two
      filled = filled or bool(chunk.strip())
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
  return filled


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


def _bad_line(files: list[Path]) -> str | None:
  """Where the first line that datasets cannot read is, with how to fix it (None: none found):
  a line of a JSON-lines file that is not JSON, a CSV row with more fields than its header."""
  import json

  for f in files:
    if _suffix(f) == ".csv" and (ragged := _ragged_row(f)) is not None:
      return ragged
    if _suffix(f) != ".jsonl":
      continue
    with open(f, encoding="utf-8") as lines:
      for n, text in enumerate(lines, 1):
        if not text.strip():
          continue
        try:
          json.loads(text)
        except json.JSONDecodeError as bad:
          return f"{f}:{n} is not valid JSON ({bad.msg}); fix that line (one JSON object per line)"
  return None


def _ragged_row(path: Path) -> str | None:
  """The first row of a CSV file with more fields than its header (pandas, which datasets reads
  CSV with, refuses it; fewer it fills with nulls), by the line it starts on; None: none."""
  import csv

  with open(path, encoding="utf-8", newline="") as f:
    rows = csv.reader(f)
    header, end = None, 0
    try:
      for row in rows:
        start, end = end + 1, rows.line_num  # a quoted field may span lines
        if not row:  # a blank line
          continue
        if header is None:
          header = row
        elif len(row) > len(header):
          return (
            f"{path}:{start} has {len(row)} fields, more than the {len(header)} columns of its "
            "header; quote the field that holds a comma, or fix that row"
          )
    except csv.Error:  # pandas' own message says what it could not read then
      return None
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
  except StopIteration as e:  # datasets' JSON reader, on files of zero bytes
    raise DataError(
      f"the {where} {path} holds no examples in split {split!r}; fill it, or pick another "
      "with --data-split."
    ) from e
  except ds.exceptions.DatasetGenerationError as e:
    bad = _bad_line(sorted(p for p in Path(path).rglob("*") if p.is_file())) if local else None
    if bad is not None:
      raise DataError(f"{bad}.") from e
    parse = _in_chain(e, "ParserError")
    if parse is None and _empty(e):
      raise DataError(
        f"the {where} {path} holds no examples in split {split!r}; fill it, or pick another "
        "with --data-split."
      ) from e
    why = _first_line(parse or e.__cause__ or e)
    raise DataError(f"the {where} {path} cannot be read ({why}).") from e
  if not streaming:
    _check_rows(table, name)
  return table


def _chain(e: BaseException) -> list[BaseException]:
  """``e`` and every exception it was raised from or while handling."""
  seen, todo, out = set(), [e], []
  while todo:
    e = todo.pop()
    if e is None or id(e) in seen:
      continue
    seen.add(id(e))
    out.append(e)
    todo += [e.__cause__, e.__context__]
  return out


def _empty(e: BaseException) -> bool:
  """Whether datasets failed because a file or split holds no rows (it cannot build those)."""
  return any(
    "at least one example" in str(x) or "BatchSize must be greater than 0" in str(x)
    for x in _chain(e)
  )


def _in_chain(e: BaseException, type_name: str) -> BaseException | None:
  """The first exception of class ``type_name`` in ``e``'s chain (None: none)."""
  return next((x for x in _chain(e) if type(x).__name__ == type_name), None)


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
  """The first line of ``e``'s message, as part of one sentence (". X" becomes "; X")."""
  text = str(e).strip()
  return re.sub(r"\.\s+(?=[A-Z])", "; ", text.splitlines()[0][:200]) if text else type(e).__name__


def cache_root() -> str:
  """Where datasets keeps its cache (HF_DATASETS_CACHE)."""
  return os.environ.get("HF_DATASETS_CACHE") or str(_datasets().config.HF_DATASETS_CACHE)
