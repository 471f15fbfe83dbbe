"""The mistakes a user can fix, as one hierarchy (``UserError`` and its kinds).

Defined in converters/errors.py, the lowest layer that raises them (file formats below the
models); this is their public home, re-exported as ``jaxtune.UserError`` and the rest.
"""

from converters.errors import (
  CheckpointError,
  ConfigError,
  DataError,
  DistributedError,
  ExportError,
  MeshError,
  RestoreError,
  RunConfigError,
  SaveError,
  TrainingError,
  UserError,
  size_text,
)

__all__ = [
  "CheckpointError",
  "ConfigError",
  "DataError",
  "DistributedError",
  "ExportError",
  "MeshError",
  "RestoreError",
  "RunConfigError",
  "SaveError",
  "TrainingError",
  "UserError",
  "size_text",
]
