"""Where a model came from: the checkpoint directory it was loaded from and its Hub id.

A frozen value carried by the model as one static attribute (``model.provenance``): NNX
keeps it in the graphdef, not in the state, so it passes through split / merge and jit
unchanged and adds no array. Set once where a checkpoint is loaded (hf/load.py); a model
built directly (tests, synthetic runs) carries the empty ``Provenance()``. Its readers are
the writers that copy or consult the checkpoint's own files (merged export, GGUF, the PEFT
base model name) and the adapter loader's base-model checks.
"""

import dataclasses
from pathlib import Path


@dataclasses.dataclass(frozen=True)
class Provenance:
  checkpoint_dir: str | None = None  # the local directory the weights were read from
  hub_id: str | None = None  # its Hugging Face repo id; None for a plain local directory

  def file(self, name: str) -> Path | None:
    """The checkpoint's file ``name`` (which may not exist); None without a checkpoint."""
    return None if not self.checkpoint_dir else Path(self.checkpoint_dir) / name

  @property
  def base_name(self) -> str:
    """The base model as PEFT records it: the Hub id when known, else the local directory
    ("" for a model loaded from no checkpoint)."""
    return self.hub_id or self.checkpoint_dir or ""


# A model built directly, from no checkpoint.
EMPTY = Provenance()
