"""Reward functions for --method grpo: loading the user's, and a few built in.

A reward function takes ``(prompts, completions, **columns)`` (lists of equal length: the
prompt text and the completion text of each rollout, and every other column of the prompt's
data row, e.g. ``answer``) and returns one number per completion. ``--reward`` names them
as ``MODULE:FUNCTION`` (the module importable from the working directory or PYTHONPATH) or
by a built-in name; several, comma-separated, are summed.
"""

import importlib
import math
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from jaxtune.errors import RunConfigError

RewardFn = Callable[..., Sequence[float]]

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")
_MARKED = re.compile(r"(?:####|answer\s*(?:is|:))\s*(.+)", re.IGNORECASE)
_THINK = re.compile(r"^\s*<think>.*?</think>\s*<answer>.*?</answer>\s*$", re.DOTALL)


def _normalise(text: str) -> str:
  text = text.strip().strip(".").strip()
  if _NUMBER.fullmatch(text):
    return text.replace(",", "")
  return text.lower()


def _final_answer(completion: str) -> str:
  """The final answer of a completion: after the last "####" or "answer is/answer:", inside
  <answer>...</answer>, else its last number, else its last line."""
  tagged = re.findall(r"<answer>(.*?)</answer>", completion, re.DOTALL)
  if tagged:
    return _normalise(tagged[-1])
  marked = _MARKED.findall(completion)
  if marked:
    return _normalise(marked[-1].splitlines()[0] if marked[-1].strip() else marked[-1])
  numbers = _NUMBER.findall(completion)
  if numbers:
    return _normalise(numbers[-1])
  lines = [line for line in completion.strip().splitlines() if line.strip()]
  return _normalise(lines[-1]) if lines else ""


def final_answer(prompts: list, completions: list[str], answer: list, **_: Any) -> list[float]:
  """1.0 where the completion's final answer (``_final_answer``) equals the row's ``answer``
  column (numbers without thousands separators, text without case), else 0.0."""
  return [
    float(_final_answer(c) == _normalise(str(a))) for c, a in zip(completions, answer, strict=True)
  ]


def think_format(prompts: list, completions: list[str], **_: Any) -> list[float]:
  """1.0 for a completion of the form <think>...</think> <answer>...</answer>, else 0.0."""
  return [float(bool(_THINK.match(c))) for c in completions]


def length_penalty(prompts: list, completions: list[str], **_: Any) -> list[float]:
  """-(characters / 1000): shorter completions score higher."""
  return [-len(c) / 1000 for c in completions]


BUILT_IN: dict[str, RewardFn] = {
  "final_answer": final_answer,
  "think_format": think_format,
  "length_penalty": length_penalty,
}


def load(spec: str) -> list[tuple[str, RewardFn]]:
  """--reward "mod:fn,final_answer" -> [(name, callable)], or a RunConfigError naming the
  one that cannot be imported or called."""
  out = []
  for part in (p.strip() for p in spec.split(",")):
    if not part:
      continue
    if part in BUILT_IN:
      out.append((part, BUILT_IN[part]))
      continue
    module_name, _, attr = part.partition(":")
    if not module_name or not attr:
      raise RunConfigError(
        f"--reward {part!r} is neither MODULE:FUNCTION nor a built-in reward "
        f"({', '.join(BUILT_IN)})."
      )
    if str(Path.cwd()) not in sys.path and "" not in sys.path:
      sys.path.insert(0, str(Path.cwd()))
    try:
      module = importlib.import_module(module_name)
    except ImportError as e:
      raise RunConfigError(
        f"--reward {part}: module {module_name!r} cannot be imported ({e}); put it in the "
        "working directory or on PYTHONPATH."
      ) from e
    fn = getattr(module, attr, None)
    if not callable(fn):
      what = "has no" if fn is None else "has a non-callable"
      raise RunConfigError(f"--reward {part}: module {module_name!r} {what} {attr!r}.")
    out.append((part, fn))
  if not out:
    raise RunConfigError("--reward names no reward function.")
  return out


def score(
  fns: list[tuple[str, RewardFn]], prompts: list, completions: list[str], columns: dict, step: int
) -> dict[str, list[float]]:
  """Each function's rewards {name: [float per completion]}; a wrong length or a value that
  is not a finite number is a RunConfigError naming the function and the step."""
  out = {}
  for name, fn in fns:
    values = fn(prompts, completions, **columns)
    try:
      values = [float(v) for v in values]
    except (TypeError, ValueError) as e:
      raise RunConfigError(
        f"reward {name} returned a value that is not a number at step {step}; it must "
        "return one float per completion."
      ) from e
    if len(values) != len(completions):
      raise RunConfigError(
        f"reward {name} returned {len(values)} values for {len(completions)} completions at "
        f"step {step}; it must return one per completion."
      )
    if not all(math.isfinite(v) for v in values):
      raise RunConfigError(f"reward {name} returned a NaN or infinite value at step {step}.")
    out[name] = values
  return out
