"""Everything about a run (not the architecture): YAML file, overridden by command-line flags."""

import dataclasses
from pathlib import Path
from typing import Any

import yaml


@dataclasses.dataclass
class RunConfig:
  model: str | None = None  # HF checkpoint dir or hub id; None: the built-in default
  data: str | None = None  # JSONL file; None: the bundled default dataset
  out: str = "runs/default"
  mesh: str | None = None  # e.g. "2x4"; None: all visible devices data-parallel
  steps: int = 60
  seed: int = 0
  # Optimisation
  learning_rate: float = 2e-3
  schedule: str = "cosine"  # cosine | linear | constant
  warmup_steps: int = 5
  weight_decay: float = 0.0
  max_grad_norm: float = 1.0
  # Batch: batch_size sequences per optimizer step, in grad_accum micro-batches.
  batch_size: int = 8
  grad_accum: int = 1
  seq_len: int = 128
  train_on_prompt: bool = False
  # Evaluation
  eval_data: str | None = None  # held-out JSONL, same format as data
  eval_every: int = 0  # 0: only at the end (when eval_data is set)
  eval_prompts: str | None = None  # text file, one prompt per line, generated at each eval
  # Model and adapters
  quantization: str | None = "nf4"
  dtype: str = "bfloat16"
  lora_rank: int = 16
  lora_alpha: float = 16.0
  lora_dropout: float = 0.0
  lora_targets: tuple[str, ...] = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
  )
  rslora: bool = False
  skip_nonfinite: bool = False  # skip (count) steps with NaN/inf/zero loss instead of stopping
  remat: str = "full"  # none | full | dots | dots_no_batch
  attention: str | None = None  # xla | fused; None: fused on GPU, xla elsewhere
  # Output
  log_every: int = 1
  save_every: int = 50
  keep_checkpoints: int = 2
  export: str | None = "merged"  # merged | peft | none, written to OUT/export at the end

  @classmethod
  def from_yaml(cls, path: str | Path) -> "RunConfig":
    data = yaml.safe_load(Path(path).read_text()) or {}
    if not isinstance(data, dict):
      raise ValueError(f"{path} must hold a mapping of run settings.")
    return cls().replace(**data)

  def replace(self, **changes: Any) -> "RunConfig":
    names = {f.name for f in dataclasses.fields(self)}
    unknown = sorted(set(changes) - names)
    if unknown:
      raise ValueError(f"unknown run setting(s) {unknown}; valid ones: {sorted(names)}.")
    if "lora_targets" in changes and isinstance(changes["lora_targets"], str):
      changes["lora_targets"] = tuple(t.strip() for t in changes["lora_targets"].split(","))
    elif "lora_targets" in changes:
      changes["lora_targets"] = tuple(changes["lora_targets"])
    return dataclasses.replace(self, **changes)

  def to_yaml(self) -> str:
    data = dataclasses.asdict(self)
    data["lora_targets"] = list(self.lora_targets)
    return yaml.safe_dump(data, sort_keys=False)
