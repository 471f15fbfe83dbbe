"""How a run's examples are read, tokenized and laid out in rows (``DataSettings``).

One frozen value, built once by the caller (the run layer builds it from the ``RunConfig``) and
handed to ``tokenize.load`` or ``streaming.StreamingDataset``, which pass it on inward. It
refuses settings that cannot work when it is made, before any data is read.
"""

import dataclasses

from jaxtune.errors import DataError

LONG_EXAMPLES = ("truncate", "drop")


@dataclasses.dataclass(frozen=True)
class DataSettings:
  """What ``load`` and ``StreamingDataset`` do with a source; every field but ``seq_len`` has
  the default a run has.

  ``seq_len`` None: the smallest multiple of 256 that holds 99% of the examples, at most
  ``max_positions`` and 4096 (a stream: of its first buffer). A stream reads no ``eval_split``
  (it never holds the whole source) and tokenizes in its own process (``num_proc`` unused).
  """

  seq_len: int | None
  data_format: str | None = None  # None: detected from the columns (formats.py)
  columns: str | None = None  # --data-columns, e.g. "prompt=question,completion=answer"
  config: str | None = None  # the Hub dataset's config (subset)
  split: str = "train"
  train_on_prompt: bool = False
  pack: bool = True  # several examples per row
  long_examples: str = "truncate"  # examples longer than seq_len: truncate | drop
  max_positions: int | None = None  # the longest row the model allows (caps an unset seq_len)
  eval_split: float = 0.0  # the fraction of examples held out, 0: none
  seed: int = 0  # which examples eval_split holds out
  num_proc: int | None = None  # tokenizing processes; None: up to 8 from tokenize.PARALLEL_FROM

  def __post_init__(self):
    if self.eval_split and not 0 < self.eval_split < 0.5:
      raise DataError(f"--eval-split must be a fraction between 0 and 0.5, got {self.eval_split}.")
    if self.long_examples not in LONG_EXAMPLES:
      raise DataError(f"--long-examples must be truncate or drop, got {self.long_examples!r}.")
