"""Reward functions for --method grpo: loading the user's, and a few built in.

A reward function takes ``(prompts, completions, **columns)`` (lists of equal length: the
prompt text and the completion text of each rollout, and every other column of the prompt's
data row, e.g. ``answer``) and returns one number per completion. ``--reward`` names them
as ``MODULE:FUNCTION`` (the module importable from the working directory or PYTHONPATH, or a
file, ``path/to/my_rewards.py:FUNCTION``) or by a built-in name; several, comma-separated, are
summed.

A reward that raises, or returns anything but a list of one number per completion, stops the
run with a ``RewardError``: one sentence naming the reward, the step and what happened, and
the reward's own traceback frames to print below it.
"""

import importlib
import importlib.util
import math
import numbers
import re
import reprlib
import sys
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from jaxtune.errors import RunConfigError, TrainingError

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


class RewardError(TrainingError):
  """A reward function that raised, or returned something other than one number per
  completion, during the run. ``frames``: the reward's own traceback frames (text, empty where
  none), for the command line to print below the sentence."""

  def __init__(self, message: str, frames: str = ""):
    super().__init__(message)
    self.frames = frames


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
    module_name, _, attr = part.rpartition(":")  # a file's path may hold a colon (C:\)
    if not module_name or not attr:
      raise RunConfigError(
        f"--reward {part!r} is neither MODULE:FUNCTION nor a built-in reward "
        f"({', '.join(BUILT_IN)})."
      )
    module = _import(part, module_name)
    fn = getattr(module, attr, None)
    if not callable(fn):
      what = "has no" if fn is None else "has a non-callable"
      raise RunConfigError(f"--reward {part}: module {module_name!r} {what} {attr!r}.")
    out.append((part, fn))
  if not out:
    raise RunConfigError("--reward names no reward function.")
  return out


def _import(part: str, module_name: str) -> Any:
  """The module of --reward ``part``: a file (``path/x.py``) or an importable name. Whatever
  its code raises is a RunConfigError naming the module, the error and its line."""
  file = module_name.endswith(".py") or "/" in module_name or "\\" in module_name
  if file and not Path(module_name).is_file():
    raise RunConfigError(
      f"--reward {part}: {module_name} is not a file; name a Python file or an importable module."
    )
  if not file and str(Path.cwd()) not in sys.path and "" not in sys.path:
    sys.path.insert(0, str(Path.cwd()))
  try:
    return _import_file(Path(module_name)) if file else importlib.import_module(module_name)
  except SyntaxError as e:
    raise RunConfigError(
      f"--reward {part}: module {module_name!r} has a syntax error at line {e.lineno} of "
      f"{e.filename} ({_said(e.msg)}); fix it."
    ) from e
  except ModuleNotFoundError as e:
    # The module itself (or its package) is not found, rather than one that it imports.
    if e.name and (module_name + ".").startswith(e.name + "."):
      raise RunConfigError(
        f"--reward {part}: module {module_name!r} cannot be imported ({e}); put it in the "
        "working directory or on PYTHONPATH."
      ) from e
    raise _import_failed(part, module_name, e, "install what it imports, or fix the module") from e
  except Exception as e:  # the module's own code: reported with its line, never passed over
    raise _import_failed(part, module_name, e, "fix the module") from e


def _import_file(path: Path) -> Any:
  """The module in the file ``path``, run once per process (kept in sys.modules by its path)."""
  key = (
    f"jaxtune.training.rewards:{path.resolve()}"  # no importable name: the file's own stays free
  )
  if key not in sys.modules:
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules[key] = module
  return sys.modules[key]


def _import_failed(part: str, module_name: str, e: Exception, fix: str) -> RunConfigError:
  """The sentence for a reward module whose code raised ``e`` while it was imported, at the
  line of the module (the first frame outside jaxtune and importlib) that was running."""
  importlib_dir = str(Path(importlib.__file__).parent)
  frames = [
    f
    for f in traceback.extract_tb(e.__traceback__)
    if f.filename != __file__ and not f.filename.startswith(("<frozen ", importlib_dir))
  ]
  where = f" at line {frames[0].lineno} of {frames[0].filename}" if frames else ""
  return RunConfigError(
    f"--reward {part}: importing module {module_name!r} raised {type(e).__name__} "
    f"({_said(e)}){where}; {fix}."
  )


def score(
  fns: list[tuple[str, RewardFn]], prompts: list, completions: list[str], columns: dict, step: int
) -> dict[str, list[float]]:
  """Each function's rewards {name: [float per completion]}. A function that raises, or
  returns anything but a list (or 1-D array) of one finite number per completion, is a
  RewardError naming the function and the step."""
  out = {}
  for name, fn in fns:
    try:
      returned = fn(prompts, completions, **columns)
    except Exception as e:  # the user's code: stops the run, said with its own frames
      own = traceback.extract_tb(e.__traceback__)[1:]  # below this frame's call
      raise RewardError(
        f"reward {name} raised {type(e).__name__} at step {step} ({_said(e)}); fix the "
        "reward, then run again or --resume.",
        "".join(traceback.format_list(own)),
      ) from e
    out[name] = _numbers(name, returned, len(completions), step)
  return out


def _numbers(name: str, returned: Any, n: int, step: int) -> list[float]:
  """What reward ``name`` returned for ``n`` completions, as floats, or a RewardError."""
  values = returned
  if hasattr(returned, "__array__") and not isinstance(returned, list | tuple):
    array = np.asarray(returned)  # numpy, JAX and torch arrays
    if array.ndim == 1:
      values = array.tolist()
  if not isinstance(values, list | tuple):
    raise RewardError(
      f"reward {name} returned {_shown(returned)} at step {step}, not a list; it must return "
      "one number per completion."
    )
  if len(values) != n:
    raise RewardError(
      f"reward {name} returned {len(values)} values for {n} completions at step {step}; it "
      "must return one per completion."
    )
  for i, v in enumerate(values):
    if not isinstance(v, numbers.Real):
      raise RewardError(
        f"reward {name} returned a value that is not a number at step {step} (for completion "
        f"{i + 1}: {_shown(v)}); it must return one number per completion."
      )
    if not math.isfinite(v):
      raise RewardError(
        f"reward {name} returned a NaN or infinite value at step {step} (for completion "
        f"{i + 1}: {v}); it must return finite numbers."
      )
  return [float(v) for v in values]


_REPR = reprlib.Repr(maxstring=40, maxother=40)


def _shown(value: Any) -> str:
  """A value as a sentence names it: its kind and a short repr."""
  if hasattr(value, "shape") and hasattr(value, "dtype"):
    return f"an array of shape {tuple(value.shape)}"
  kind = type(value).__name__
  article = "an" if kind[:1].lower() in "aeiou" else "a"
  return f"{article} {kind} ({_said(_REPR.repr(value))})" if value is not None else "None"


def _said(e: BaseException | str) -> str:
  """The first line of an error message (or text), as part of one sentence: ". X" -> "; X"."""
  text = str(e).strip()
  text = text.splitlines()[0][:200] if text else type(e).__name__
  return re.sub(r"\.\s+(?=[A-Z])", "; ", text)
