"""JSONL datasets -> fixed-length token batches with a loss mask.

Each line is either ``{"text": ...}`` (continued pretraining: loss on every token) or
``{"messages": [{"role": ..., "content": ...}, ...]}`` rendered with the tokenizer's own chat
template, loss on the assistant turns only (unless ``train_on_prompt``). Everything is read
and checked before any compute, so a bad line fails in a second, not after compiling.

Packing (the default): several examples share one row of ``seq_len`` tokens, each with its own
segment id (1, 2, ...; 0 is padding) and positions restarting at 0, so attention never crosses
documents (attention.py masks by segment) and little compute goes to padding. Rows are filled
best-fit, longest example first. Labels are shifted inside each example before packing, so no
token learns to predict the next document's first token.
"""

import bisect
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from jaxtune.errors import DataError

IGNORE = -100


@dataclass
class Dataset:
  input_ids: np.ndarray  # int32 [N, T]
  labels: np.ndarray  # int32 [N, T], IGNORE where no loss
  segment_ids: np.ndarray  # int32 [N, T], example number within its row (1, 2, ...), 0: padding
  positions: np.ndarray | None = None  # int32 [N, T], position in its example; None: 0..T-1
  examples: int = 0  # examples read (several per row when packed); 0: one per row

  def __post_init__(self):
    if self.positions is None:
      self.positions = np.broadcast_to(
        np.arange(self.input_ids.shape[1], dtype=np.int32), self.input_ids.shape
      )
    self.examples = self.examples or len(self)

  def __len__(self) -> int:
    """Rows (sequences of T tokens)."""
    return self.input_ids.shape[0]

  @property
  def packed(self) -> bool:
    """Whether some row holds more than one example."""
    return bool(np.any(self.segment_ids > 1))

  @property
  def packing_efficiency(self) -> float:
    """Fraction of the rows' token slots that hold real tokens (not padding)."""
    return float(np.count_nonzero(self.segment_ids)) / self.segment_ids.size

  def batch(self, step: int, global_batch: int, accum: int, seed: int) -> dict[str, np.ndarray]:
    """The batch of a step: [accum, global_batch // accum, T], a pure function of step.

    Examples are visited in a seeded order, reshuffled every epoch, so resuming at a step
    gives exactly the batches an uninterrupted run would have seen.
    """
    n = len(self)
    per_step = global_batch
    start = step * per_step
    idx = []
    for i in range(start, start + per_step):
      epoch, pos = divmod(i, n)
      idx.append(np.random.default_rng([seed, epoch]).permutation(n)[pos])
    idx = np.asarray(idx)
    shape = (accum, global_batch // accum, -1)
    return {
      "input_ids": self.input_ids[idx].reshape(shape),
      "labels": self.labels[idx].reshape(shape),
      "segment_ids": self.segment_ids[idx].reshape(shape),
      "positions": self.positions[idx].reshape(shape),
    }


def load_jsonl(
  path: str | Path, tokenizer: Any, seq_len: int, train_on_prompt: bool = False, pack: bool = True
) -> Dataset:
  if seq_len < 2:
    raise DataError(f"--seq-len {seq_len} is too short; a sequence needs at least 2 tokens.")
  path = Path(path)
  if path.is_dir():
    raise DataError(f"data file {path} is a directory; pass a .jsonl file.")
  if not path.is_file():
    raise DataError(f"data file {path} does not exist; pass --data FILE.jsonl.")
  rows, labels = [], []
  with open(path, "rb") as f:
    for lineno, raw in enumerate(f, 1):
      try:
        line = raw.decode("utf-8")
      except UnicodeDecodeError:
        raise DataError(f"{path}:{lineno} is not UTF-8 text; save the file as UTF-8.") from None
      if not line.strip():
        continue
      try:
        record = json.loads(line)
      except json.JSONDecodeError as e:
        raise DataError(f"{path}:{lineno} is not valid JSON ({e.msg}).") from e
      if isinstance(record, dict) and isinstance(record.get("text"), str):
        ids = _encode_text(tokenizer, record["text"])
        lab = list(ids)
      elif isinstance(record, dict) and isinstance(record.get("messages"), list):
        _check_messages(record["messages"], path, lineno)
        ids, lab = _encode_chat(tokenizer, record["messages"], train_on_prompt, path, lineno)
      else:
        raise DataError(
          f'{path}:{lineno} has neither a "text" string nor a "messages" list; '
          'each line must be {"text": ...} or {"messages": [...]}.'
        )
      # Next-token prediction: the label at t is the token at t + 1.
      ids, lab = ids[: seq_len + 1], lab[: seq_len + 1]
      rows.append(ids[:-1])
      labels.append(lab[1:])
  if not rows:
    raise DataError(f"{path} holds no examples; it is empty.")
  dataset = to_rows(rows, labels, seq_len, pack)
  if not np.any(dataset.labels != IGNORE):
    raise DataError(
      f"every label in {path} is masked (no assistant tokens within --seq-len {seq_len}); "
      "raise --seq-len, check the chat roles, or use --train-on-prompt."
    )
  return dataset


def to_rows(examples: list, labels: list, seq_len: int, pack: bool = True) -> Dataset:
  """Token lists of at most ``seq_len`` each -> rows of ``seq_len`` (see the module docstring).

  Unpacked, each example gets a row of its own.
  """
  rows = (
    pack_rows([len(e) for e in examples], seq_len) if pack else [[i] for i in range(len(examples))]
  )
  n = len(rows)
  input_ids = np.zeros((n, seq_len), np.int32)
  label_arr = np.full((n, seq_len), IGNORE, np.int32)
  segments = np.zeros((n, seq_len), np.int32)
  positions = np.zeros((n, seq_len), np.int32)
  for r, members in enumerate(rows):
    at = 0
    for seg, i in enumerate(members, 1):
      ids, lab = examples[i], labels[i]
      input_ids[r, at : at + len(ids)] = ids
      label_arr[r, at : at + len(lab)] = lab
      segments[r, at : at + len(ids)] = seg
      positions[r, at : at + len(ids)] = np.arange(len(ids))
      at += len(ids)
  return Dataset(input_ids, label_arr, segments, positions, len(examples))


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


ROLES = ("system", "user", "assistant", "tool")


def _check_messages(messages: list, path: Path, lineno: int) -> None:
  if not messages:
    raise DataError(f'{path}:{lineno} has an empty "messages" list.')
  for i, m in enumerate(messages, 1):
    if not isinstance(m, dict) or "role" not in m or "content" not in m:
      raise DataError(
        f'{path}:{lineno}: message {i} must be an object with "role" and "content", got {m!r:.60}.'
      )
    if m["role"] not in ROLES:
      raise DataError(
        f"{path}:{lineno}: message {i} has the unknown role {m['role']!r}; "
        f"use one of {', '.join(ROLES)}."
      )
    if not isinstance(m["content"], str):
      raise DataError(f"{path}:{lineno}: message {i} has content that is not a string.")


def _encode_text(tokenizer, text: str) -> list[int]:
  ids = tokenizer(text, add_special_tokens=True)["input_ids"]
  if tokenizer.eos_token_id is not None:
    ids = ids + [tokenizer.eos_token_id]
  return ids


def _encode_chat(tokenizer, messages, train_on_prompt, path, lineno):
  if getattr(tokenizer, "chat_template", None) is None:
    raise DataError(
      f'{path}:{lineno} is a "messages" example, but the tokenizer has no chat template; '
      'use {"text": ...} lines or a checkpoint whose tokenizer has one.'
    )
  try:
    full = tokenizer.apply_chat_template(messages, tokenize=False)
    # Character spans of the assistant turns: the text each turn adds after the prompt that
    # precedes it (templates render prefixes stably, which this relies on and checks).
    spans = []
    for i, m in enumerate(messages):
      if m.get("role") != "assistant":
        continue
      before = tokenizer.apply_chat_template(
        messages[:i], tokenize=False, add_generation_prompt=True
      )
      upto = tokenizer.apply_chat_template(messages[: i + 1], tokenize=False)
      if not full.startswith(upto) or not upto.startswith(before):
        raise DataError(f"{path}:{lineno}: the chat template does not render prefixes stably.")
      spans.append((len(before), len(upto)))
  except DataError:
    raise
  except Exception as e:  # jinja errors from a template that rejects this conversation
    raise DataError(
      f"{path}:{lineno}: the chat template cannot render these messages ({e})."
    ) from e
  enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
  ids = list(enc["input_ids"])
  if train_on_prompt:
    return ids, list(ids)
  labels = []
  for tok, (start, _) in zip(ids, enc["offset_mapping"], strict=True):
    inside = any(a <= start < b for a, b in spans)
    labels.append(tok if inside else IGNORE)
  return ids, labels
