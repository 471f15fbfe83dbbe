"""jaxtune: QLoRA fine-tuning of Llama-family models in JAX / Flax NNX.

The public surface is small on purpose: load, add adapters, (train), export.
"""

from converters.hf_in import CheckpointError, from_pretrained
from converters.hf_out import export_bnb4, export_merged, export_peft
from jaxtune.config import ConfigError, ModelConfig
from jaxtune.generate import generate
from jaxtune.lora import apply_lora

__all__ = [
  "CheckpointError",
  "ConfigError",
  "ModelConfig",
  "apply_lora",
  "export_bnb4",
  "export_merged",
  "export_peft",
  "from_pretrained",
  "generate",
]
