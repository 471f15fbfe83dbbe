"""A source's examples -> a ``rows.Dataset`` (``load``).

``load`` reads any source ``sources.open_source`` takes, recognises its format
(formats.py), tokenizes it once through ``datasets.map`` (worker processes; the result is kept
in the datasets cache, so a second run on the same data and tokenizer skips it; a damaged
cache file is made anew), then decides what to do with long examples, holds out an eval
fraction, and packs rows. What it did is in the returned ``Report`` (the start line).
"""

import dataclasses
import hashlib
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from jaxtune.data import formats, sources
from jaxtune.data.damage import arrow_damage
from jaxtune.data.formats import IGNORE
from jaxtune.data.rows import Dataset
from jaxtune.data.settings import DataSettings
from jaxtune.errors import DataError

# Bumped when tokenization changes what it writes, so old cache entries are not reused.
TOKENIZATION_VERSION = "1"
AUTO_SEQ_MULTIPLE, AUTO_SEQ_MAX, AUTO_SEQ_QUANTILE = 256, 4096, 99.0
# Examples at or above which tokenization runs in worker processes.
PARALLEL_FROM = 8192


@dataclasses.dataclass
class Report:
  """What ``load`` read and did, for the start line."""

  name: str
  format: str
  examples: int  # read from the source
  seq_len: int
  seq_len_auto: bool = False
  seq_len_capped: bool = False  # chosen, but below what 99% of the examples need
  tokenized: str = ""  # "cached" / "tokenized in 3.1s (8 processes)" / "streamed"
  long: int = 0  # examples longer than seq_len
  long_action: str = "truncate"
  no_labels: int = 0  # dropped: no trained token (left after truncation, or none at all)
  eval_examples: int = 0  # held out by --eval-split
  pairs: bool = False  # preference pairs: the counts above are of pairs
  identical: int = 0  # pairs dropped: chosen and rejected tokenize the same

  def line(self) -> str:
    unit = "pairs" if self.pairs else "examples"
    count = f"{self.examples:,} {unit}, " if self.examples else ""
    parts = [f"data {self.name}: {self.format}, {count}{self.tokenized}"]
    how = "chosen: 99% of examples fit" if self.seq_len_auto else "set"
    if self.seq_len_capped:
      how = "chosen: capped by the model's positions or 4096, 99% of examples need more"
    parts.append(f"seq-len {self.seq_len} ({how})")
    if self.long:
      done = "truncated" if self.long_action == "truncate" else "dropped"
      what = "pairs longer than seq-len" if self.pairs else "longer than seq-len"
      parts.append(f"{self.long} {what} {done} (--long-examples)")
    if self.no_labels and self.pairs:
      parts.append(
        f"{self.no_labels} pairs whose prompt leaves no room for a response within seq-len dropped"
      )
    elif self.no_labels:
      parts.append(f"{self.no_labels} without a trained token dropped")
    if self.identical:
      parts.append(f"{self.identical} pairs with identical chosen and rejected dropped")
    if self.eval_examples:
      parts.append(f"{self.eval_examples} {'pairs ' if self.pairs else ''}held out for eval")
    return "; ".join(parts)


@dataclasses.dataclass
class Tokenized:
  """Every example's tokens, flat: ids and unshifted labels, each example's start and length."""

  tokens: np.ndarray
  labels: np.ndarray
  starts: np.ndarray
  lengths: np.ndarray
  format: str
  how: str


def load(
  data: Any, tokenizer: Any, settings: DataSettings
) -> tuple[Dataset, Dataset | None, Report]:
  """(training rows, rows held out by ``settings.eval_split`` or None, report).

  ``settings.seq_len`` None: the smallest multiple of 256 that holds 99% of the examples, at
  most ``settings.max_positions`` and 4096 (``auto_seq_len``).
  """
  tok = tokenize(data, tokenizer, settings)
  name = _name(data)
  paired = tok.format in formats.PAIRED
  pairs = np.maximum(tok.lengths - 1, 0)  # next-token pairs of each example
  units = pairs[0::2] + pairs[1::2] if paired else pairs  # what one row must hold whole
  seq_len, auto = settings.seq_len, settings.seq_len is None
  if auto:
    seq_len = auto_seq_len(units, settings.max_positions)
  fit = _fit_pairs if paired else fit_examples
  keep, lengths, report = fit(tok, pairs, seq_len, settings.long_examples, name)
  report.seq_len_auto, report.tokenized = auto, tok.how
  report.seq_len_capped = auto and seq_len < auto_seq_len(units, None)
  kept = np.flatnonzero(keep)  # examples, or with pairs the pairs
  held = np.zeros(0, np.int64)
  if eval_split := settings.eval_split:
    k = max(1, round(eval_split * len(kept)))
    if k >= len(kept):
      raise DataError(
        f"--eval-split {eval_split} of {len(kept)} examples leaves none to train on; "
        "use more data or a smaller fraction."
      )
    # Seeded by the run's seed alone: the same examples are held out when the run resumes.
    chosen = np.random.default_rng([settings.seed, 0xE7A1]).permutation(len(kept))[:k]
    held = np.sort(kept[chosen])
    kept = np.setdiff1d(kept, held)
    report.eval_examples = k

  def subset(idx):
    if paired:  # pair p -> its examples 2p, 2p + 1
      idx = np.stack([2 * idx, 2 * idx + 1], axis=1).reshape(-1)
    starts = tok.starts[idx]
    return Dataset(tok.tokens, tok.labels, starts, lengths[idx], seq_len, settings.pack, paired)

  return subset(kept), (subset(held) if len(held) else None), report


def auto_seq_len(pairs: np.ndarray, max_positions: int | None) -> int:
  """The smallest multiple of 256 holding 99% of the examples, capped (module docstring)."""
  need = float(np.percentile(pairs, AUTO_SEQ_QUANTILE, method="inverted_cdf")) if len(pairs) else 1
  seq = max(1, math.ceil(need / AUTO_SEQ_MULTIPLE)) * AUTO_SEQ_MULTIPLE
  cap = min(AUTO_SEQ_MAX, max_positions or AUTO_SEQ_MAX)
  return max(2, min(seq, cap))


def fit_examples(
  tok: Tokenized, pairs: np.ndarray, seq_len: int, long_examples: str, name: str
) -> tuple[np.ndarray, np.ndarray, Report]:
  """Which examples train and at what length; counts for the report. ``long_examples`` comes
  from a ``DataSettings``, which checked it."""
  long = pairs > seq_len
  lengths = np.minimum(pairs, seq_len)
  keep = pairs > 0
  if long_examples == "drop":
    keep &= ~long
  # Trained tokens among each example's targets (labels[start + 1 : start + 1 + length]).
  trained = np.concatenate([[0], np.cumsum(tok.labels != IGNORE)])
  first = tok.starts + 1
  within = trained[first + lengths] - trained[first]
  no_labels = keep & (within == 0)
  keep &= ~no_labels
  report = Report(name, tok.format, len(pairs), seq_len, long=int(long.sum()))
  report.long_action, report.no_labels = long_examples, int(no_labels.sum())
  if not keep.any():
    raise DataError(
      f"no example of {name} has a trained token within seq-len {seq_len} (every label is "
      "masked: no assistant/completion tokens fit); raise --seq-len, check the chat roles, or "
      "use --train-on-prompt."
    )
  return keep, lengths, report


def _fit_pairs(tok: Tokenized, pairs, seq_len: int, long_examples: str, name: str):
  """``_fit`` for preference pairs (examples 2p, 2p + 1): a pair's two sequences share a row.

  (which pairs train, the length of every example, report). A pair longer than ``seq_len``
  is dropped, or truncated: a side within half the row keeps its length and the other gets
  the rest, else each gets half, responses cut at their end. Dropped and counted: pairs
  whose prompt leaves a side no response token (truncation), and pairs whose chosen and
  rejected tokenize the same.
  """
  c, r = pairs[0::2], pairs[1::2]
  long = c + r > seq_len
  half = seq_len // 2
  fit_c = np.where(c <= half, c, np.where(r <= half, seq_len - r, half))
  fit_r = np.where(r <= half, r, np.where(c <= half, seq_len - c, seq_len - half))
  fit_c, fit_r = np.where(long, fit_c, c), np.where(long, fit_r, r)
  keep = (c > 0) & (r > 0)
  if long_examples == "drop":
    keep &= ~long
  lengths = np.stack([fit_c, fit_r], axis=1).reshape(-1)
  trained = np.concatenate([[0], np.cumsum(tok.labels != IGNORE)])
  first = tok.starts + 1
  within = (trained[first + lengths] - trained[first]).reshape(-1, 2)
  no_room = keep & (within.min(axis=1) == 0)
  keep &= ~no_room
  same = keep & (c == r)
  for p in np.flatnonzero(same):  # equal lengths: compare the tokens
    a, b = tok.starts[2 * p], tok.starts[2 * p + 1]
    same[p] = np.array_equal(tok.tokens[a : a + c[p] + 1], tok.tokens[b : b + r[p] + 1])
  keep &= ~same
  report = Report(name, tok.format, len(c), seq_len, long=int(long.sum()), pairs=True)
  report.long_action, report.no_labels = long_examples, int(no_room.sum())
  report.identical = int(same.sum())
  if not keep.any():
    raise DataError(
      f"no preference pair of {name} fits seq-len {seq_len} with a response on both sides "
      "(or every pair's chosen and rejected are the same); raise --seq-len or check the data."
    )
  return keep, lengths, report


def _name(data: Any) -> str:
  return str(data) if isinstance(data, str | Path) else "the given dataset"


def tokenize(data: Any, tokenizer: Any, settings: DataSettings | None = None) -> Tokenized:
  """Read ``data`` and tokenize every example (``datasets.map``; cached across runs). Of
  ``settings`` (None: the defaults) it reads where the examples are, their format and
  columns, ``train_on_prompt`` and ``num_proc``."""
  if settings is None:
    settings = DataSettings(seq_len=None)
  train_on_prompt, num_proc = settings.train_on_prompt, settings.num_proc
  table, name = sources.open_source(data, settings.config, settings.split)
  table, fmt = detect_format(table, name, settings.data_format, settings.columns)
  encoder = formats.Encoder(fmt, tokenizer, train_on_prompt, name)
  import datasets

  features = datasets.Features(
    {
      "input_ids": datasets.List(datasets.Value("int32")),
      "labels": datasets.List(datasets.Value("int32")),
    }
  )
  fingerprint = _fingerprint(table._fingerprint, fmt, train_on_prompt, tokenizer)
  hit = _cache_intact(_cache_files(table, fingerprint), name)
  if num_proc is None and len(table) >= PARALLEL_FROM:
    num_proc = min(8, os.cpu_count() or 1)
  if num_proc and num_proc > 1:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # the workers are the parallelism
  t0 = time.perf_counter()
  out = table.map(
    _encode_batch,
    fn_kwargs={"encoder": encoder},
    batched=True,
    with_indices=True,
    remove_columns=table.column_names,
    features=features,
    num_proc=num_proc if num_proc and num_proc > 1 else None,
    new_fingerprint=fingerprint,
  )
  seconds = time.perf_counter() - t0
  if hit:
    how = "tokenized earlier (datasets cache)"
  else:
    procs = f", {num_proc} processes" if num_proc and num_proc > 1 else ""
    how = f"tokenized in {seconds:.1f}s{procs}" + ("" if table.cache_files else " (not cached)")
  ids, labels = out.data.column("input_ids"), out.data.column("labels")
  lengths = np.asarray(ids.combine_chunks().value_lengths(), np.int64) if len(out) else np.zeros(0)
  starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
  flat = lambda col: np.asarray(col.combine_chunks().flatten(), np.int32)  # noqa: E731
  # One slot past the end, so the last example's shifted labels stay in bounds.
  tokens = np.append(flat(ids), np.int32(0))
  flat_labels = np.append(flat(labels), np.int32(IGNORE))
  return Tokenized(tokens, flat_labels, starts, lengths, fmt, how)


def _encode_batch(batch: dict, indices: list[int], encoder: formats.Encoder) -> dict:
  ids, labels = [], []
  names = list(batch)
  for index, values in zip(indices, zip(*(batch[n] for n in names), strict=True), strict=True):
    for i, lab in encoder.examples(dict(zip(names, values, strict=True)), index):
      ids.append(i)
      labels.append(lab)
  return {"input_ids": ids, "labels": labels}


def detect_format(
  table: Any, name: str, data_format: str | None, columns: str | None
) -> tuple[Any, str]:
  """(table with --data-columns applied, its format)."""
  mapping = formats.parse_columns(columns)
  head = None if hasattr(table, "data") else list(table.take(256))  # a stream: its first rows
  have = list(table.column_names or [])
  if not have and head:  # a stream whose features are not declared: the rows' keys
    have = list(dict.fromkeys(k for r in head for k in r))
  missing = [c for c in mapping if c not in have]
  if missing:
    raise DataError(
      f"--data-columns names {', '.join(missing)}, which {name} does not have; its columns "
      f"are {', '.join(have)}."
    )
  if mapping:
    clash = [c for c in mapping.values() if c in have and c not in mapping]
    if clash:
      table = table.remove_columns(clash)
    table = table.rename_columns(mapping)
    have = [mapping.get(c, c) for c in have if c not in clash]
    if head is not None:
      head = [{mapping.get(k, k): v for k, v in r.items() if k not in clash} for r in head]
  if data_format is not None:
    formats.check_forced(data_format, have, name)
    return table, data_format
  if hasattr(table, "data"):  # a Dataset: its arrow table counts the nulls
    filled = lambda c: len(table) - table.data.column(c).null_count  # noqa: E731

    def first_missing(c: str) -> int:
      nulls = table.data.column(c).is_null().to_numpy(zero_copy_only=False)
      return int(np.argmax(nulls))

    return table, formats.detect(have, filled, len(table), name, first_missing)
  filled = lambda c: sum(r.get(c) is not None for r in head)  # noqa: E731
  first = lambda c: next(i for i, r in enumerate(head) if r.get(c) is None)  # noqa: E731
  return table, formats.detect(have, filled, len(head), name, first)


def _fingerprint(source: str, fmt: str, train_on_prompt: bool, tokenizer: Any) -> str:
  """The tokenized table's datasets fingerprint: the source's, the format and the tokenizer's
  content (vocabulary, merges, template, specials), so an equal tokenizer hits the cache."""
  h = hashlib.sha256()
  backend = getattr(tokenizer, "backend_tokenizer", None)
  vocab = backend.to_str() if backend is not None else repr(sorted(tokenizer.get_vocab().items()))
  for part in (
    TOKENIZATION_VERSION,
    source,
    fmt,
    str(train_on_prompt),
    type(tokenizer).__name__,
    vocab,
    str(getattr(tokenizer, "chat_template", None)),
    str(tokenizer.eos_token_id),
    str(tokenizer.bos_token_id),
  ):
    h.update(part.encode())
    h.update(b"\0")
  return "jaxtune-" + h.hexdigest()[:32]


def _cache_files(table, fingerprint: str) -> list[Path]:
  """The files in which datasets holds this map's result already (beside the source's, named
  by the fingerprint); none before the first run."""
  if not table.cache_files:
    return []
  directory = Path(table.cache_files[0]["filename"]).parent
  return sorted(directory.glob(f"cache-{fingerprint}*.arrow"))


def _cache_intact(files: list[Path], name: str) -> bool:
  """Whether the tokenized rows are cached in ``files``, whole. A damaged file (a run killed
  while datasets wrote it, a full disk, a cache cut short by a copy) is said on stderr and
  removed, with the rest of its map's files, so that the rows are tokenized anew: the cache
  is jaxtune's own, and datasets would otherwise fail on it in every run."""
  damage = next(filter(None, map(arrow_damage, files)), None)
  if damage is None:
    return bool(files)
  print(
    f"jaxtune: the tokenized cache of {name} is damaged ({damage}); tokenizing anew",
    file=sys.stderr,
  )
  for f in files:
    f.unlink(missing_ok=True)
  return False
