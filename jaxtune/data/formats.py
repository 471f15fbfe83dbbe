"""Dataset formats: which one a table holds, and each row -> (token ids, loss labels).

A format is recognised by its columns (``detect``) or forced (``--data-format``):

  text               {"text"}: loss on every token (continued pretraining)
  messages           {"messages": [{"role", "content"}]} (OpenAI style; ``content`` a string
                     or a list of {"type": "text", "text"} parts), rendered with the
                     tokenizer's chat template, loss on the assistant turns
  conversations      {"conversations": [{"from", "value"}]} (ShareGPT: human, gpt, system,
                     tool), turned into messages
  alpaca             {"instruction", "input" (optional), "output"}: through the chat template
                     when the tokenizer has one (instruction and input as the user turn), else
                     ``ALPACA_PROMPT``; loss on the output
  prompt_completion  {"prompt", "completion"}: strings (concatenated, loss on the completion
                     and EOS) or message lists (chat template, loss on the completion turns)
  preference         {"prompt" (optional), "chosen", "rejected"}: a preference pair (--method
                     dpo, ipo, orpo), each side encoded as prompt_completion is; without a
                     prompt, chosen and rejected are message lists whose shared first messages
                     are the prompt (TRL's implicit prompt). Two examples per row: chosen, then
                     rejected

Labels are per token and not shifted: the token's own id where it is trained, ``IGNORE``
elsewhere (data.py shifts them). Spans to train are found in characters of the rendered text
and mapped to tokens through the tokenizer's offsets, so a template's own markers belong to
whichever side renders them.
"""

from collections.abc import Callable, Sequence
from typing import Any

from jaxtune.errors import DataError

IGNORE = -100
FORMATS = ("text", "messages", "conversations", "alpaca", "prompt_completion", "preference")
# Formats whose rows are preference pairs (two examples each), for --method dpo/ipo/orpo.
PAIRED = ("preference",)
# Columns each format needs (and may have); the first format (in this order) whose columns
# every row fills is the one detected.
REQUIRED = {
  "preference": ("chosen", "rejected"),
  "messages": ("messages",),
  "conversations": ("conversations",),
  "prompt_completion": ("prompt", "completion"),
  "alpaca": ("instruction", "output"),
  "text": ("text",),
}
OPTIONAL = {"alpaca": ("input",), "preference": ("prompt",)}
COLUMNS = (
  "text",
  "messages",
  "conversations",
  "instruction",
  "input",
  "output",
  "prompt",
  "completion",
  "chosen",
  "rejected",
)
ROLES = ("system", "user", "assistant", "tool")
# ShareGPT speakers -> chat roles.
SHAREGPT_ROLES = {
  "human": "user",
  "user": "user",
  "gpt": "assistant",
  "assistant": "assistant",
  "system": "system",
  "tool": "tool",
  "function_response": "tool",
  "observation": "tool",
}
# Alpaca's own prompt, for tokenizers without a chat template (Stanford Alpaca, 2023).
ALPACA_PROMPT = (
  "Below is an instruction that describes a task. Write a response that appropriately "
  "completes the request.\n\n### Instruction:\n{instruction}\n\n### Response:\n"
)
ALPACA_PROMPT_INPUT = (
  "Below is an instruction that describes a task, paired with an input that provides further "
  "context. Write a response that appropriately completes the request.\n\n"
  "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
)


def parse_columns(spec: str | None) -> dict[str, str]:
  """``--data-columns prompt=question,completion=answer`` -> {"question": "prompt", ...}
  (the dataset's column -> the format's column)."""
  if not spec:
    return {}
  mapping = {}
  for part in spec.split(","):
    ours, _, theirs = part.partition("=")
    ours, theirs = ours.strip(), theirs.strip()
    if not ours or not theirs:
      raise DataError(
        f"--data-columns takes FORMAT_COLUMN=DATASET_COLUMN pairs separated by commas, e.g. "
        f"prompt=question,completion=answer; got {part!r}."
      )
    if ours not in COLUMNS:
      raise DataError(
        f"--data-columns maps onto {ours!r}, which no format reads; use one of "
        f"{', '.join(COLUMNS)}."
      )
    mapping[theirs] = ours
  return mapping


def detect(
  columns: Sequence[str],
  filled: Callable[[str], int],
  rows: int,
  name: str,
  first_missing: Callable[[str], int] | None = None,
) -> str:
  """The format of a table with ``columns``; ``filled(column)`` counts its non-null rows,
  ``first_missing(column)`` the index of the first row without a value (named in the error).

  A column present but empty in some rows (a JSON file mixing formats reads that way) makes
  that format cover only some rows: rows of two formats in one table are refused.
  """
  present = [f for f, need in REQUIRED.items() if all(c in columns for c in need)]
  if not present:
    raise DataError(
      f"{name} has the columns {', '.join(columns) or '(none)'}, which match no format; "
      f"jaxtune reads {_accepted()}; map other names with --data-columns, "
      "e.g. prompt=question,completion=answer."
    )
  counts = {f: min(filled(c) for c in REQUIRED[f]) for f in present}
  for f in present:
    if counts[f] == rows:
      return f
  partial = [f for f in present if counts[f]]
  if len(partial) > 1:
    shown = " and ".join(f"{counts[f]} in format {f}" for f in partial)
    raise DataError(
      f"{name} mixes formats: of its {rows} rows, {shown}; put each format in its own "
      "dataset, or force one with --data-format."
    )
  f = present[0]
  missing = next(c for c in REQUIRED[f] if filled(c) < rows)
  first = f" (the first: row {first_missing(missing) + 1})" if first_missing else ""
  raise DataError(
    f"{name}: {rows - filled(missing)} of its {rows} rows have no {missing!r} value{first}; "
    f"every row of format {f} needs {', '.join(REQUIRED[f])}."
  )


def check_forced(fmt: str, columns: Sequence[str], name: str) -> None:
  """--data-format FMT: the table must have that format's columns."""
  missing = [c for c in REQUIRED[fmt] if c not in columns]
  if missing:
    raise DataError(
      f"--data-format {fmt} needs the column(s) {', '.join(missing)}, but {name} has "
      f"{', '.join(columns) or 'none'}; map yours with --data-columns, e.g. "
      f"{missing[0]}=YOUR_COLUMN."
    )


def _accepted() -> str:
  return "; ".join(f"{f} ({', '.join(REQUIRED[f] + OPTIONAL.get(f, ()))})" for f in FORMATS)


class Encoder:
  """row -> (ids, labels) for one format and tokenizer. Picklable (datasets.map workers)."""

  def __init__(self, fmt: str, tokenizer: Any, train_on_prompt: bool = False, name: str = "data"):
    if fmt not in FORMATS:
      raise DataError(f"--data-format must be one of {', '.join(FORMATS)}, got {fmt!r}.")
    self.fmt, self.tok, self.train_on_prompt, self.name = fmt, tokenizer, train_on_prompt, name
    self.chat = getattr(tokenizer, "chat_template", None) is not None
    if fmt in ("messages", "conversations") and not self.chat:
      raise DataError(
        f"{name} is chat data ({fmt}), but the tokenizer has no chat template; use a "
        "checkpoint whose tokenizer has one, or text/prompt_completion data."
      )

  def examples(self, row: dict, index: int) -> list[tuple[list[int], list[int]]]:
    """The (ids, labels) examples of a row: one, or two for a preference pair (chosen, then
    rejected)."""
    if self.fmt == "preference":
      return list(self._pair(row, f"{self.name} row {index + 1}"))
    return [self(row, index)]

  def __call__(self, row: dict, index: int) -> tuple[list[int], list[int]]:
    where = f"{self.name} row {index + 1}"
    f = self.fmt
    if f == "preference":
      raise ValueError("a preference row is two examples: use Encoder.examples")
    if f == "text":
      text = row["text"]
      if not isinstance(text, str):
        raise DataError(f'{where}: "text" must be a string, got {type(text).__name__}.')
      ids = self.tok(text, add_special_tokens=True)["input_ids"] + self._eos()
      return ids, list(ids)
    if f == "messages":
      return self._chat(self._messages(row["messages"], where), where)
    if f == "conversations":
      return self._chat(self._sharegpt(row["conversations"], where), where)
    if f == "alpaca":
      return self._alpaca(row, where)
    return self._prompt_completion(row["prompt"], row["completion"], where)

  # ---- the formats

  def _pair(self, row: dict, where: str):
    """(chosen example, rejected example) of a preference row."""
    chosen, rejected, prompt = row.get("chosen"), row.get("rejected"), row.get("prompt")
    for key, value in (("chosen", chosen), ("rejected", rejected)):
      if value is None or (isinstance(value, str | list) and not value):
        raise DataError(f"{where} has no {key!r} response; every preference row needs both.")
    if prompt is None and isinstance(chosen, list) and isinstance(rejected, list):
      shared = 0  # TRL's implicit prompt: the messages both sides share, up to the last user turn
      while shared < min(len(chosen), len(rejected)) - 1 and chosen[shared] == rejected[shared]:
        shared += 1
      if shared == 0:
        raise DataError(
          f"{where} has no 'prompt' and its chosen and rejected messages share no first "
          "turn; add a prompt column."
        )
      prompt, chosen, rejected = chosen[:shared], chosen[shared:], rejected[shared:]
    if prompt is None:
      prompt = "" if isinstance(chosen, str) else []
    return (
      self._prompt_completion(prompt, chosen, where + " (chosen)"),
      self._prompt_completion(prompt, rejected, where + " (rejected)"),
    )

  def _alpaca(self, row: dict, where: str) -> tuple[list[int], list[int]]:
    instruction, output = row["instruction"], row["output"]
    extra = row.get("input") or ""
    for key, value in (("instruction", instruction), ("input", extra), ("output", output)):
      if not isinstance(value, str):
        raise DataError(f"{where}: {key!r} must be a string, got {type(value).__name__}.")
    if self.chat:
      user = instruction + ("\n\n" + extra if extra else "")
      messages = [{"role": "user", "content": user}, {"role": "assistant", "content": output}]
      return self._chat(messages, where)
    template = ALPACA_PROMPT_INPUT if extra else ALPACA_PROMPT
    prompt = template.format(instruction=instruction, input=extra)
    return self._spans(prompt + output, [(len(prompt), len(prompt) + len(output))], True, eos=True)

  def generation_prompt(self, messages: Any, where: str) -> str:
    """A message list rendered by the chat template up to where the assistant's reply starts
    (what a model generates from: GRPO's prompts). ``where`` names the row in errors."""
    return self._render(self._messages(messages, where), where, generation_prompt=True)

  def _prompt_completion(self, prompt: Any, completion: Any, where: str):
    if isinstance(prompt, str) and isinstance(completion, str):
      text = prompt + completion
      return self._spans(text, [(len(prompt), len(text))], True, eos=True)
    if isinstance(prompt, list) and isinstance(completion, list):
      if not self.chat:
        raise DataError(
          f"{where} holds prompt/completion messages, but the tokenizer has no chat template."
        )
      head = self._messages(prompt, where + " (prompt)")
      tail = self._messages(completion, where + " (completion)")
      before = self._render(head, where, generation_prompt=True)
      full = self._render(head + tail, where)
      if not full.startswith(before):
        raise DataError(f"{where}: the chat template does not render the prompt as a prefix.")
      return self._spans(full, [(len(before), len(full))], False)
    raise DataError(
      f'{where}: "prompt" and "completion" must both be strings or both be message lists, '
      f"got {type(prompt).__name__} and {type(completion).__name__}."
    )

  def _chat(self, messages: list[dict], where: str) -> tuple[list[int], list[int]]:
    full = self._render(messages, where)
    # Each assistant turn's span: the text it adds after the prompt that precedes it
    # (templates render prefixes stably, which this relies on and checks).
    spans = []
    for i, m in enumerate(messages):
      if m["role"] != "assistant":
        continue
      before = self._render(messages[:i], where, generation_prompt=True) if i else ""
      upto = self._render(messages[: i + 1], where)
      if not full.startswith(upto) or not upto.startswith(before):
        raise DataError(f"{where}: the chat template does not render prefixes stably.")
      spans.append((len(before), len(upto)))
    return self._spans(full, spans, False)

  # ---- pieces

  def _render(self, messages: list[dict], where: str, generation_prompt: bool = False) -> str:
    try:
      return self.tok.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=generation_prompt
      )
    except Exception as e:  # jinja's raise_exception from a template that rejects the turns
      reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
      roles = ", ".join(m["role"] for m in messages)
      raise DataError(
        f"{where}: the chat template rejects its messages (roles {roles}): "
        f"{reason.rstrip('.')}; fix the row or drop it."
      ) from e

  def _spans(self, text: str, spans, special: bool, eos: bool = False):
    """Tokens of ``text``; a token is trained when it starts inside one of ``spans`` (or
    always, with train_on_prompt). ``eos``: append EOS, trained with the last span."""
    enc = self.tok(text, add_special_tokens=special, return_offsets_mapping=True)
    ids = list(enc["input_ids"])
    if self.train_on_prompt:
      labels = list(ids)
    else:
      labels = [
        t if any(a <= s < b for a, b in spans) and e > s else IGNORE
        for t, (s, e) in zip(ids, enc["offset_mapping"], strict=True)
      ]
    if eos:
      ids += self._eos()
      labels += self._eos()
    return ids, labels

  def _eos(self) -> list[int]:
    return [] if self.tok.eos_token_id is None else [self.tok.eos_token_id]

  def _messages(self, messages: Any, where: str) -> list[dict]:
    if not isinstance(messages, list) or not messages:
      raise DataError(f"{where}: the messages must be a non-empty list.")
    out = []
    for i, m in enumerate(messages, 1):
      if not isinstance(m, dict) or m.get("role") is None or "content" not in m:
        raise DataError(
          f'{where}: message {i} must be an object with "role" and "content", got {m!r:.60}.'
        )
      if m["role"] not in ROLES:
        raise DataError(
          f"{where}: message {i} has the unknown role {m['role']!r}; use one of {', '.join(ROLES)}."
        )
      out.append({"role": m["role"], "content": _content(m["content"], f"{where}: message {i}")})
    return out

  def _sharegpt(self, turns: Any, where: str) -> list[dict]:
    if not isinstance(turns, list) or not turns:
      raise DataError(f'{where}: "conversations" must be a non-empty list.')
    out = []
    for i, t in enumerate(turns, 1):
      if not isinstance(t, dict) or t.get("from") is None or "value" not in t:
        raise DataError(
          f'{where}: turn {i} must be an object with "from" and "value", got {t!r:.60}.'
        )
      role = SHAREGPT_ROLES.get(t["from"])
      if role is None:
        raise DataError(
          f"{where}: turn {i} is from {t['from']!r}; ShareGPT speakers are "
          f"{', '.join(SHAREGPT_ROLES)}."
        )
      out.append({"role": role, "content": _content(t["value"], f"{where}: turn {i}")})
    return out


def _content(content: Any, where: str) -> str:
  """A message's content as text: a string, or the text parts of a list of parts."""
  if isinstance(content, str):
    return content
  if isinstance(content, list):
    texts = []
    for part in content:
      if (
        isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
      ):
        texts.append(part["text"])
      else:
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        raise DataError(f"{where} has a content part of type {kind!r}; only text parts are read.")
    return "".join(texts)
  raise DataError(f"{where} has content that is neither a string nor a list of text parts.")
