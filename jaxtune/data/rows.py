"""Examples as token rows of ``seq_len`` with a loss mask, in a seeded order (``Dataset``).

Tokens stay in two flat int32 arrays (ids, labels; memory-mapped from the cache) with each
example's start and length; a batch is assembled from them when asked for, so host memory
holds the row layout, not a copy of every row.

Packing (the default): several examples share one row of ``seq_len`` tokens, each with its own
segment id (1, 2, ...; 0 is padding) and positions restarting at 0, so attention never crosses
documents (attention.py masks by segment) and little compute goes to padding. Rows are filled
best-fit, longest example first. Labels are shifted inside each example, so no token learns
to predict the next document's first token.

Reading and tokenizing a source into a ``Dataset`` is ``tokenize.load``; data larger than
host memory, a buffer at a time, ``streaming.StreamingDataset``.
"""

import bisect
import hashlib

import numpy as np

from jaxtune.data.formats import IGNORE

__all__ = ["IGNORE", "Dataset", "pack_rows", "to_rows"]


class Dataset:
  """Examples laid out in rows of ``seq_len`` tokens; ``batch(step, ...)`` is a pure function.

  ``tokens``/``labels`` are flat (not shifted); example e's inputs are
  ``tokens[starts[e] : starts[e] + lengths[e]]`` and its targets the labels one further on.
  """

  def __init__(
    self,
    tokens: np.ndarray,
    labels: np.ndarray,
    starts: np.ndarray,
    lengths: np.ndarray,
    seq_len: int,
    pack: bool = True,
    pairs: bool = False,
  ):
    self.seq_len, self.pairs = seq_len, pairs
    self._tokens, self._labels = tokens, labels
    self._starts = np.asarray(starts, np.int64)
    self._lengths = np.asarray(lengths, np.int64)
    # Pairs: examples 2p and 2p + 1 (chosen, rejected) are one unit, never split over rows.
    units = self._lengths[0::2] + self._lengths[1::2] if pairs else self._lengths
    if np.any(units > seq_len):
      raise ValueError("an example (or pair) is longer than seq_len; truncate or drop it first")
    rows = (
      pack_rows(units.tolist(), seq_len)
      if pack
      else [[i] for i in range(len(units)) if units[i] > 0]
    )
    if pairs:
      rows = [[e for u in r for e in (2 * u, 2 * u + 1)] for r in rows]
    self._members = np.fromiter((i for r in rows for i in r), np.int64)
    self._ptr = np.zeros(len(rows) + 1, np.int64)
    np.cumsum([len(r) for r in rows], out=self._ptr[1:])
    self.examples = int(np.count_nonzero(units))
    # The most examples one row holds (segments 1..max_segments; a pair's are 2p+1, 2p+2).
    self.max_segments = int(np.max(np.diff(self._ptr), initial=0))
    self._orders: dict[tuple[int, int], np.ndarray] = {}
    self._all: dict[str, np.ndarray] | None = None

  @classmethod
  def from_rows(cls, input_ids: np.ndarray, labels: np.ndarray) -> "Dataset":
    """One example per row: ``input_ids`` and their (shifted) ``labels``, [N, T] each."""
    return to_rows(list(input_ids), list(labels), input_ids.shape[1], pack=False)

  def __len__(self) -> int:
    """Rows (sequences of seq_len tokens)."""
    return len(self._ptr) - 1

  def fingerprint(self) -> str:
    """A digest of every token and label and of the rows' layout: what the batches are made
    of, so a resumed run can tell whether its data is still the data its checkpoint saw."""
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{self.seq_len} {self.pairs}".encode())
    for a in (self._tokens, self._labels, self._starts, self._lengths, self._members, self._ptr):
      a = np.ascontiguousarray(a)
      h.update(f"{a.dtype} {a.shape}".encode())
      h.update(memoryview(a).cast("B"))
    return h.hexdigest()

  @property
  def packed(self) -> bool:
    """Whether some row holds more than one example."""
    return bool(np.any(np.diff(self._ptr) > 1))

  @property
  def packing_efficiency(self) -> float:
    """Fraction of the rows' token slots that hold real tokens (not padding)."""
    return float(self._lengths.sum()) / max(1, len(self) * self.seq_len)

  def rows(self, idx: np.ndarray) -> dict[str, np.ndarray]:
    """Rows ``idx`` as int32 arrays [len(idx), seq_len]: input_ids, labels, segment_ids
    (example number within its row, 0: padding), positions (within its example)."""
    n, t = len(idx), self.seq_len
    ids = np.zeros((n, t), np.int32)
    labels = np.full((n, t), IGNORE, np.int32)
    segments = np.zeros((n, t), np.int32)
    positions = np.zeros((n, t), np.int32)
    for b, r in enumerate(np.asarray(idx)):
      at = 0
      for seg, e in enumerate(self._members[self._ptr[r] : self._ptr[r + 1]], 1):
        s, k = self._starts[e], self._lengths[e]
        ids[b, at : at + k] = self._tokens[s : s + k]
        labels[b, at : at + k] = self._labels[s + 1 : s + 1 + k]
        segments[b, at : at + k] = seg
        positions[b, at : at + k] = np.arange(k)
        at += k
    return {"input_ids": ids, "labels": labels, "segment_ids": segments, "positions": positions}

  def order(self, seed: int, epoch: int) -> np.ndarray:
    """The rows of an epoch in the order they are visited: one seeded permutation per epoch,
    kept while the run is in it (the last two are kept)."""
    key = (seed, epoch)
    if key not in self._orders:
      if len(self._orders) >= 2:
        self._orders.pop(next(iter(self._orders)))
      self._orders[key] = np.random.default_rng([seed, epoch]).permutation(len(self))
    return self._orders[key]

  def batch(self, step: int, global_batch: int, accum: int, seed: int) -> dict[str, np.ndarray]:
    """The batch of a step: [accum, global_batch // accum, T], a pure function of step.

    Rows are visited in a seeded order, reshuffled every epoch, so resuming at a step gives
    exactly the batches an uninterrupted run would have seen.
    """
    n = len(self)
    epoch, within = np.divmod(np.arange(step * global_batch, (step + 1) * global_batch), n)
    idx = np.empty_like(within)
    for e in np.unique(epoch):
      here = epoch == e
      idx[here] = self.order(seed, int(e))[within[here]]
    shape = (accum, global_batch // accum, -1)
    return {k: v.reshape(shape) for k, v in self.rows(idx).items()}

  def _rows_all(self) -> dict[str, np.ndarray]:
    if self._all is None:
      self._all = self.rows(np.arange(len(self)))
    return self._all

  # Every row at once (small datasets: tests, evaluation).
  input_ids = property(lambda self: self._rows_all()["input_ids"])
  labels = property(lambda self: self._rows_all()["labels"])
  segment_ids = property(lambda self: self._rows_all()["segment_ids"])
  positions = property(lambda self: self._rows_all()["positions"])


def to_rows(examples: list, labels: list, seq_len: int, pack: bool = True) -> Dataset:
  """Shifted token lists (inputs and their targets, at most ``seq_len`` each) -> a Dataset.

  Unpacked, each example gets a row of its own.
  """
  lengths = np.array([len(e) for e in examples], np.int64)
  starts = np.concatenate([[0], np.cumsum(lengths + 1)[:-1]]).astype(np.int64)
  tokens = np.zeros(int((lengths + 1).sum()), np.int32)
  flat_labels = np.full_like(tokens, IGNORE)
  for s, ids, lab in zip(starts, examples, labels, strict=True):
    tokens[s : s + len(ids)] = ids
    flat_labels[s + 1 : s + 1 + len(lab)] = lab
  return Dataset(tokens, flat_labels, starts, lengths, seq_len, pack)


def pack_rows(lengths: list[int], seq_len: int) -> list[list[int]]:
  """Best-fit decreasing: example indices per row, no row over ``seq_len`` tokens.

  Each example, longest first, goes into the open row it fills most tightly; a new row when
  none has room. Within a row, examples keep their file order.
  """
  rows: list[list[int]] = []
  free: list[tuple[int, int]] = []  # sorted (room left, row) of rows with room
  for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
    need = lengths[i]
    if need == 0:  # a one-token example has no next-token pair
      continue
    j = bisect.bisect_left(free, (need, -1))
    if j < len(free):
      room, r = free.pop(j)
    else:
      room, r = seq_len, len(rows)
      rows.append([])
    rows[r].append(i)
    if room - need > 0:
      bisect.insort(free, (room - need, r))
  return [sorted(members) for members in rows]
