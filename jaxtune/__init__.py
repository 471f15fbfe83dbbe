"""jaxtune: QLoRA fine-tuning of Llama-family models in JAX / Flax NNX.

The public surface is small on purpose: load, add adapters, (train), export, generate.
Each name is imported on first use: ``import jaxtune`` loads nothing (not even JAX), so that
importing one submodule loads only what that submodule needs.
"""

import importlib
import sys
import types

# Public name -> "module:attribute".
_PUBLIC = {
  "CheckpointError": "jaxtune.errors:CheckpointError",
  "ConfigError": "jaxtune.errors:ConfigError",
  "ModelConfig": "jaxtune.models.config:ModelConfig",
  "UserError": "jaxtune.errors:UserError",
  "apply_lora": "jaxtune.models.lora:apply_lora",
  "export_bnb4": "jaxtune.hf.write:export_bnb4",
  "export_merged": "jaxtune.hf.write:export_merged",
  "export_peft": "jaxtune.hf.write:export_peft",
  "from_pretrained": "jaxtune.hf.load:from_pretrained",
  "generate": "jaxtune.run.api:generate",
  "load_adapter": "jaxtune.hf.adapters:load_adapter",
  "DataError": "jaxtune.errors:DataError",
  "RunConfig": "jaxtune.run_config:RunConfig",
  "train": "jaxtune.run.api:train",
}

__all__ = sorted(_PUBLIC)


def __getattr__(name: str):
  if name not in _PUBLIC:
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
  module, attr = _PUBLIC[name].split(":")
  value = getattr(importlib.import_module(module), attr)
  globals()[name] = value  # later lookups skip this function
  return value


def __dir__() -> list[str]:
  return sorted(set(globals()) | set(__all__))


class _Package(types.ModuleType):
  def __setattr__(self, name: str, value) -> None:
    # Importing the submodules jaxtune.generate and jaxtune.train (the command lines) binds
    # them here; the public functions of those names must keep them.
    if name in _PUBLIC and isinstance(value, types.ModuleType):
      return
    super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
