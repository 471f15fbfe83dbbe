"""Streaming (``--data-streaming``, ``StreamingDataset``): for data larger than host memory;
examples are read in order, tokenized and packed a buffer at a time, and the position (how
many examples came before the buffer, how many of its rows were served) is saved with each
checkpoint, so a resumed run continues at the same example.
"""

from typing import Any

import numpy as np

from jaxtune.data import formats, sources
from jaxtune.data.formats import IGNORE
from jaxtune.data.rows import Dataset
from jaxtune.data.settings import DataSettings
from jaxtune.data.tokenize import Report, Tokenized, auto_seq_len, detect_format, fit_examples
from jaxtune.errors import DataError


class StreamingDataset:
  """Rows from a stream too large for host memory, a buffer of examples at a time.

  Each buffer of ``buffer`` examples (in the source's order) is tokenized, fitted to
  ``settings.seq_len`` and packed on its own; its rows are served in a seeded order.
  ``state()`` is where the next batch starts (examples before the buffer, rows of it already
  served); ``seek(state)`` resumes there. Batches must be asked for in step order. A stream is
  never read whole, so ``settings.eval_split`` is refused (the run layer refuses it first).
  """

  def __init__(self, data: Any, tokenizer: Any, settings: DataSettings, buffer: int = 4096):
    if settings.eval_split:
      raise DataError(
        "--eval-split needs the whole dataset, which --data-streaming does not read; pass "
        "--eval-data instead."
      )
    # seq_len None is chosen from the first buffer (``_fill``); the rest stays as given.
    self.settings, self.seq_len, self.buffer = settings, settings.seq_len, buffer
    source, name = sources.open_source(data, settings.config, settings.split, streaming=True)
    self._source, fmt = detect_format(source, name, settings.data_format, settings.columns)
    self._encoder = formats.Encoder(fmt, tokenizer, settings.train_on_prompt, name)
    self.report = Report(name, fmt, 0, self.seq_len or 0, long_action=settings.long_examples)
    self.report.seq_len_auto = self.seq_len is None
    self.report.tokenized = f"streamed ({buffer} examples at a time)"
    self._before = 0  # examples of the source before the current buffer
    self._epoch = 0
    self._served = 0  # rows of the current buffer already in batches
    self._iter = None
    self._rows: Dataset | None = None
    self._read = 0  # examples in the current buffer
    self._next_chunk_start = 0
    if self._fill() is None:
      raise DataError(f"{name} holds no examples; it is empty.")

  def state(self) -> dict:
    return {"epoch": self._epoch, "examples": self._before, "rows": self._served}

  def seek(self, state: dict) -> None:
    """Continue where ``state()`` was taken: the same buffer, its next row."""
    self._epoch, self._before = int(state["epoch"]), int(state["examples"])
    self._iter = None
    self._next_chunk_start = self._before
    self._fill()
    self._served = int(state["rows"])

  def _fill(self) -> Dataset | None:
    """Read, tokenize and pack the next buffer (from ``_next_chunk_start``); None at the end
    of the source."""
    if self._iter is None:
      self._iter = iter(self._source.skip(self._next_chunk_start))
    self._before = self._next_chunk_start
    examples = []
    for row in self._iter:
      examples.append(self._encoder(row, self._before + len(examples)))
      if len(examples) == self.buffer:
        break
    if not examples:
      return None
    self._read = len(examples)
    self._next_chunk_start = self._before + len(examples)
    ids = [e[0] for e in examples]
    lengths = np.array([len(i) for i in ids], np.int64)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    tok = Tokenized(
      np.append(np.concatenate(ids).astype(np.int32), np.int32(0)),
      np.append(np.concatenate([e[1] for e in examples]).astype(np.int32), np.int32(IGNORE)),
      starts,
      lengths,
      self._encoder.fmt,
      "streamed",
    )
    pairs = np.maximum(lengths - 1, 0)
    if self.seq_len is None:  # from the first buffer
      self.seq_len = self.report.seq_len = auto_seq_len(pairs, self.settings.max_positions)
      self.report.seq_len_capped = self.seq_len < auto_seq_len(pairs, None)
    try:
      keep, fitted, report = fit_examples(
        tok, pairs, self.seq_len, self.settings.long_examples, self.report.name
      )
    except DataError:  # a buffer with nothing to train on: skip it
      keep, fitted, report = np.zeros(len(pairs), bool), pairs, None
    if report is not None:
      self.report.long += report.long
      self.report.no_labels += report.no_labels
    kept = np.flatnonzero(keep)
    self._rows = Dataset(
      tok.tokens, tok.labels, starts[kept], fitted[kept], self.seq_len, self.settings.pack
    )
    self._served = 0
    return self._rows

  def _next_rows(self, n: int) -> list[dict[str, np.ndarray]]:
    out, need = [], n
    while need:
      rows = self._rows
      left = len(rows) - self._served
      if left <= 0:
        if self._fill() is None:  # the end of the source: the next epoch from its start
          self._epoch += 1
          self._iter, self._next_chunk_start = None, 0
          if self._fill() is None:
            raise DataError(f"{self.report.name} ran out of examples.")
        continue
      take = min(left, need)
      order = rows.order(self.settings.seed + self._epoch, self._before)
      out.append(rows.rows(order[self._served : self._served + take]))
      self._served += take
      need -= take
    return out

  def batch(self, step: int, global_batch: int, accum: int, seed: int) -> dict[str, np.ndarray]:
    """The next batch (``step`` must follow the previous call's; ``seed`` is the dataset's)."""
    parts = self._next_rows(global_batch)
    shape = (accum, global_batch // accum, -1)
    return {k: np.concatenate([p[k] for p in parts]).reshape(shape) for k in parts[0]}

  # A stream has no length: these describe the current buffer.
  packed = property(lambda self: self.settings.pack)
  packing_efficiency = property(lambda self: self._rows.packing_efficiency)

  def __len__(self) -> int:
    return len(self._rows)
