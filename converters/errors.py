"""The mistakes a user can fix, as one hierarchy.

Every error a user can cause (a wrong flag, a mesh that does not fit, a bad data file, a
damaged checkpoint, an export into the wrong place) is a ``UserError`` whose message is one
sentence saying what is wrong and how to fix it. The command lines catch ``UserError`` only
and print that sentence; any other exception is a bug and keeps its traceback.

This module imports nothing, so every layer can raise these.
"""


def size_text(n: float) -> str:
  """A byte count as user-facing sentences write it: GiB to a tenth from 1 GiB, whole MiB from
  10 MiB, MiB to a tenth below."""
  if n >= 2**30:
    return f"{n / 2**30:.1f} GiB"
  return f"{n / 2**20:.0f} MiB" if n >= 10 * 2**20 else f"{n / 2**20:.1f} MiB"


class UserError(Exception):
  """Anything the user can fix; its message is one sentence saying how."""


class ConfigError(UserError):
  """A model's config.json that cannot be read or describes an unsupported model."""


class RunConfigError(UserError):
  """A run setting with a wrong name, type or value; the message names the setting."""


class MeshError(UserError):
  """A mesh or parallel layout that cannot run this model, batch or option."""


class DataError(UserError):
  """A data file that cannot be read or yields no trainable tokens."""


class CheckpointError(UserError):
  """A model checkpoint (safetensors, bnb-4bit) that is missing, incomplete or inconsistent."""


class SaveError(UserError):
  """A training checkpoint that cannot be written (disk full, no permission)."""


class RestoreError(UserError):
  """A training checkpoint that cannot be read back (damaged, or from another model/LoRA)."""


class ExportError(UserError):
  """An export that cannot be written where asked."""


class TrainingError(UserError):
  """The run cannot go on (a non-finite or exactly-zero loss); the message says why."""


class DistributedError(UserError):
  """A multi-process launch whose settings are incomplete or contradictory."""
