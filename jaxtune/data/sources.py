"""Where a run's examples come from, read through Hugging Face ``datasets``.

``open_source`` takes what ``--data`` / ``jaxtune.train(data=...)`` may be: a local
``.jsonl``/``.json``/``.parquet``/``.csv``/``.arrow`` file, a directory or glob of them, a
directory written by ``datasets.save_to_disk``, a Hub dataset id (``org/name``), a
``datasets.Dataset`` or an iterable of dicts, and returns a ``datasets.Dataset`` (or an
``IterableDataset`` when streaming). Every way it can fail is a ``DataError`` sentence.
"""

import functools
import glob
import os
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from jaxtune.data.damage import (
  bad_line,
  cache_damage,
  check_text_file,
  first_line,
  rows_lost,
  saved_damage,
)
from jaxtune.errors import DataError

# File suffix -> datasets' packaged builder.
BUILDERS = {
  ".jsonl": "json",
  ".json": "json",
  ".parquet": "parquet",
  ".csv": "csv",
  ".arrow": "arrow",
}


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
  if not any([check_text_file(f, builder) for f in files]):
    raise DataError(f"{name} holds no examples; it is empty.")
  # Escaped: datasets reads data_files as patterns, where [ ] * ? in a file's name are not.
  data_files = [glob.escape(str(f)) for f in files]
  try:
    table = _read_files(ds, builder, data_files, name, streaming)
  except ValueError as e:
    if "corresponds to no data" in str(e) or "no data" in str(e).lower():
      raise DataError(f"{name} holds no examples; it is empty.") from e
    raise DataError(f"{name} cannot be read as {builder} ({first_line(e)}).") from e
  except ds.exceptions.DatasetGenerationError as e:
    bad = bad_line(files)
    if bad is not None:
      raise DataError(f"{bad}.") from e
    parse = _in_chain(e, "ParserError")  # pandas' (CSV), beside datasets' "no example" after it
    if parse is None and _empty(e):
      raise DataError(f"{name} holds no examples; it is empty.") from e
    why = first_line(parse or e.__cause__ or e.__context__ or e)
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
    damage = None if streaming else cache_damage(ds, builder, data_files)
    if damage is None:
      raise
  else:
    damage = None if streaming else rows_lost(table)
    if damage is None:
      return table
  print(
    f"jaxtune: datasets' cache of {name} is damaged ({damage}); reading it anew", file=sys.stderr
  )
  return read(download_mode="force_redownload")


def _load_saved(ds, path: Path, name: str):
  """A datasets.save_to_disk directory; a damaged one is named with what is damaged."""
  try:
    return ds.load_from_disk(str(path))
  except (OSError, ValueError, KeyError) as e:  # pyarrow's ArrowInvalid and JSON's errors too
    damage = saved_damage(path) or f"datasets cannot read it ({first_line(e)})"
    raise DataError(
      f"the datasets.save_to_disk directory {name} is damaged: {damage}; save the dataset "
      "there again, or pass its original data files."
    ) from e


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
      f"the Hub dataset {path} cannot be reached ({first_line(e)}); check the network "
      "(HF_HUB_OFFLINE unset), or pass a local file."
    ) from e
  except FileNotFoundError as e:
    raise DataError(
      f"the {where} {path} holds no data files jaxtune reads ({first_line(e)})."
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
    raise DataError(f"the {where} {path} cannot be read ({first_line(e)}).") from e
  except StopIteration as e:  # datasets' JSON reader, on files of zero bytes
    raise DataError(
      f"the {where} {path} holds no examples in split {split!r}; fill it, or pick another "
      "with --data-split."
    ) from e
  except ds.exceptions.DatasetGenerationError as e:
    bad = bad_line(sorted(p for p in Path(path).rglob("*") if p.is_file())) if local else None
    if bad is not None:
      raise DataError(f"{bad}.") from e
    parse = _in_chain(e, "ParserError")
    if parse is None and _empty(e):
      raise DataError(
        f"the {where} {path} holds no examples in split {split!r}; fill it, or pick another "
        "with --data-split."
      ) from e
    why = first_line(parse or e.__cause__ or e)
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


def cache_root() -> str:
  """Where datasets keeps its cache (HF_DATASETS_CACHE)."""
  return os.environ.get("HF_DATASETS_CACHE") or str(_datasets().config.HF_DATASETS_CACHE)
