"""What of a data file or of datasets' cache is damaged, named before datasets reads it.

Arrow, where datasets keeps the examples, reads some invalid UTF-8 without a word, names no
line of a bad JSON or CSV row, crashes on very deep nesting before any error can be caught,
and reads a cache file cut between two record batches as if it were whole. The checks here
find those first, so that ``sources`` can say in one sentence which file (and line) is at fault
and how to fix it, or make a damaged cache anew.
"""

import codecs
import re
from pathlib import Path
from typing import Any

import numpy as np

from jaxtune.errors import DataError

# The deepest a row may nest [ and { : Arrow, where datasets keeps the examples, holds 64
# levels (datasets 4 / pyarrow: a row of 63 reads, 64 fails with "Recursion level in
# ArrowSchema struct exceeded", and around 10,000 pyarrow's JSON reader crashes the process).
MAX_DEPTH = 63
# An escape of half a UTF-16 surrogate pair, \uD800-\uDBFF (high) or \uDC00-\uDFFF (low).
_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")
_LOW = re.compile(rb"\\u[dD][c-fC-F][0-9a-fA-F]{2}")


def rows_lost(table: Any) -> str | None:
  """Whether the cache ``table`` was read from holds fewer rows than datasets wrote there (an
  Arrow stream cut between two record batches reads without an error)."""
  split = (table.info.splits or {}).get("train")
  if split is None or not split.num_examples or split.num_examples == len(table):
    return None
  files = ", ".join(f["filename"] for f in table.cache_files)
  return f"{files} holds {len(table):,} of its {split.num_examples:,} rows"


def cache_damage(ds: Any, builder: str, data_files: list[str]) -> str | None:
  """What of datasets' prepared copy of ``data_files`` cannot be read (None: nothing, or there
  is no copy yet); its map caches beside it (tokenize.py's rows) are not looked at."""
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
    return f"{path} is truncated or damaged ({first_line(e)})"
  if end != _ARROW_END:
    return f"{path} is truncated (its Arrow stream has no end)"
  return None


def saved_damage(directory: Path) -> str | None:
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
      return None, f"{f} is not valid JSON ({first_line(e)})"

  index = directory / "dataset_dict.json"
  if index.is_file():
    splits, damage = read(index)
    if damage is not None:
      return damage
    if not isinstance(splits, dict) or not isinstance(splits.get("splits"), list):
      return f"{index} does not list the splits"
    return next(filter(None, (saved_damage(directory / str(s)) for s in splits["splits"])), None)
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


def check_text_file(path: Path, builder: str) -> bool:
  """UTF-8, and for JSON no lone surrogate and no row nested deeper than Arrow holds: checked
  here so that the error names the line (arrow's reader names neither, reads some invalid UTF-8
  without a word, and crashes on very deep nesting before any error can be caught). Returns
  whether the file holds more than blank space (a binary file: True)."""
  if builder not in ("json", "csv"):
    return True
  decoder = codecs.getincrementaldecoder("utf-8")()
  nesting = _Nesting(per_line=path.suffix.lower() == ".jsonl") if builder == "json" else None
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
    on_first_line = ~np.maximum.accumulate(newline)
    inside = (since_newline + (on_first_line & self.inside)) % 2 == 1
    depth = np.cumsum(np.where(inside, 0, _STEP[a]), dtype=np.int32) + self.depth
    if self.per_line:  # each line from 0 (a damaged line does not shift the next)
      last_newline = np.maximum.accumulate(np.where(newline, i, -1))
      depth -= np.where(last_newline < 0, 0, depth[last_newline])
    self.depth, self.inside = int(depth[-1]), bool(inside[-1])
    self.backslashes = int(run[-1] + 1) if backslash[-1] else 0
    deeper = np.flatnonzero(depth > MAX_DEPTH + (self.outer or 0))
    return int(deeper[0]) if len(deeper) else None


def bad_line(files: list[Path]) -> str | None:
  """Where the first line that datasets cannot read is, with how to fix it (None: none found):
  a line of a JSON-lines file that is not JSON, a CSV row with more fields than its header."""
  import json

  for f in files:
    if f.suffix.lower() == ".csv" and (ragged := _ragged_row(f)) is not None:
      return ragged
    if f.suffix.lower() != ".jsonl":
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


def first_line(e: BaseException) -> str:
  """The first line of ``e``'s message, as part of one sentence (". X" becomes "; X"); here,
  below ``sources``, because what is damaged is said with it too."""
  text = str(e).strip()
  return re.sub(r"\.\s+(?=[A-Z])", "; ", text.splitlines()[0][:200]) if text else type(e).__name__
