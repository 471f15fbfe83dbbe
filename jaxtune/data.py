"""JSONL datasets -> fixed-length token batches with a loss mask.

Each line is either ``{"text": ...}`` (continued pretraining: loss on every token) or
``{"messages": [{"role": ..., "content": ...}, ...]}`` rendered with the tokenizer's own chat
template, loss on the assistant turns only (unless ``train_on_prompt``). Everything is read
and checked before any compute, so a bad line fails in a second, not after compiling.
"""

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

IGNORE = -100


class DataError(ValueError):
  """A dataset problem; the message names the file and line."""


@dataclass
class Dataset:
  input_ids: np.ndarray  # int32 [N, T]
  labels: np.ndarray  # int32 [N, T], IGNORE where no loss
  segment_ids: np.ndarray  # int32 [N, T], 1 on tokens, 0 on padding

  def __len__(self) -> int:
    return self.input_ids.shape[0]

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
    }


def load_jsonl(path: str | Path, tokenizer, seq_len: int, train_on_prompt: bool = False):
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
  n = len(rows)
  input_ids = np.zeros((n, seq_len), np.int32)
  label_arr = np.full((n, seq_len), IGNORE, np.int32)
  segments = np.zeros((n, seq_len), np.int32)
  for i, (ids, lab) in enumerate(zip(rows, labels, strict=True)):
    input_ids[i, : len(ids)] = ids
    label_arr[i, : len(lab)] = lab
    segments[i, : len(ids)] = 1
  if not np.any(label_arr != IGNORE):
    raise DataError(
      f"every label in {path} is masked (no assistant tokens within --seq-len {seq_len}); "
      "raise --seq-len, check the chat roles, or use --train-on-prompt."
    )
  return Dataset(input_ids, label_arr, segments)


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
