"""Everything about a run (not the architecture), in SECTIONS: a YAML file (its settings flat or
under their sections), overridden by command-line flags."""

import dataclasses
import difflib
from pathlib import Path
from typing import Any

import yaml

from jaxtune.errors import RunConfigError, size_text
from jaxtune.setting_values import (  # noqa: F401 (each setting's values, named here too)
  ATTENTION_CHOICES,
  AUTO_LOSS_CHUNK,
  AUTO_REMAT,
  CHOICES,
  DEFAULT_BETA,
  INT32_MAX,
  METHODS,
  OPTIONAL_NUMBERS,
  REMAT,
  checked_value,
  shown,
)

# The built-in default run (no --model): settings fit for its small model, under the user's.
DEFAULT_RUN = Path(__file__).parent / "configs" / "default-run.yaml"
# A --config file is a few lines of settings: past these it is no run config (and an error
# sentence must never format what a huge or alias-expanded value holds).
MAX_YAML_BYTES = 2**20
MAX_YAML_DEPTH = 8


# The sections of a run's settings, in the order of RunConfig's fields, --help and to_yaml: a
# YAML file may name each setting at the top level (the flat layout) or under its section.
SECTIONS = (
  ("model", "the base checkpoint and how its frozen weights are held"),
  ("data", "the training examples and how they become rows of tokens"),
  ("method", "what the run optimises: sft, preference pairs (dpo, ipo, orpo) or grpo rollouts"),
  ("optimizer", "how long the run trains, on what batches, and how each step updates the adapters"),
  ("evaluation", "held-out loss and generations during the run"),
  ("adapters", "the LoRA adapters: rank, scale, targets, or a PEFT adapter to continue"),
  ("performance", "how the step runs on the devices (same results, other speed and memory)"),
  ("output", "what the run writes: checkpoints, metrics, the export and its upload"),
)
SECTION_NAMES = tuple(name for name, _ in SECTIONS)


def _in(section: str, default: Any) -> Any:
  """A setting of ``section`` (one of SECTION_NAMES) with this default."""
  return dataclasses.field(default=default, metadata={"section": section})


@dataclasses.dataclass
class RunConfig:
  # [model] the base checkpoint and how its frozen weights are held
  model: str | None = _in("model", None)  # HF checkpoint dir or hub id; None: the built-in default
  quantization: str | None = _in("model", "nf4")
  # float16: dynamic loss scaling; chosen on GPUs without bfloat16
  dtype: str = _in("model", "bfloat16")

  # [data] the training examples and how they become rows of tokens
  # A file (.jsonl .json .parquet .csv .arrow), directory, glob, save_to_disk directory or Hub
  # dataset id, read through HF datasets (data.py); None: the bundled default dataset
  data: str | None = _in("data", None)
  data_config: str | None = _in("data", None)  # the Hub dataset's config (subset)
  data_split: str = _in("data", "train")
  data_format: str | None = _in("data", None)  # None: detected from the columns (formats.py)
  data_columns: str | None = _in("data", None)  # e.g. "prompt=question,completion=answer"
  # read, tokenize and pack a buffer at a time (needs --steps)
  data_streaming: bool = _in("data", False)
  long_examples: str = _in("data", "truncate")  # examples longer than seq_len: truncate | drop
  # None: the smallest multiple of 256 holding 99% of the examples
  seq_len: int | None = _in("data", None)
  train_on_prompt: bool = _in("data", False)
  packing: bool = _in("data", True)  # several examples per row (segment ids, positions restart)

  # [method] what the run optimises: sft, preference pairs (dpo, ipo, orpo) or grpo rollouts
  # sft; on preference pairs (prompt, chosen, rejected) dpo | ipo | orpo; or grpo, on rewards of
  # the model's own completions of prompts
  method: str = _in("method", "sft")
  # dpo/ipo: how far the policy may move from the reference (adapters off); grpo: the weight
  # of the KL penalty to it. None: DEFAULT_BETA of the method
  beta: float | None = _in("method", None)
  # dpo: probability that a pair's preference is flipped (cDPO)
  label_smoothing: float = _in("method", 0.0)
  orpo_lambda: float = _in("method", 0.1)  # orpo: weight of the odds-ratio term beside the NLL
  # grpo: reward functions MODULE:FUNCTION (or built-in names), comma-separated
  reward: str | None = _in("method", None)
  num_generations: int = _in("method", 8)  # grpo: completions sampled per prompt (the group)
  max_new_tokens: int = _in("method", 256)  # grpo: longest completion
  temperature: float = _in("method", 1.0)  # grpo: sampling temperature of the rollouts
  top_p: float = _in("method", 1.0)  # grpo: nucleus sampling of the rollouts
  # grpo: the policy ratio is clipped to [1 - epsilon, 1 + epsilon]
  epsilon: float = _in("method", 0.2)
  num_iterations: int = _in("method", 1)  # grpo: optimizer steps per batch of rollouts

  # [optimizer] how long the run trains, on what batches, and how each step updates the adapters
  steps: int | None = _in("optimizer", None)  # None: from epochs
  epochs: float | None = _in("optimizer", None)  # None (and no steps): one epoch
  seed: int = _in("optimizer", 0)
  learning_rate: float = _in("optimizer", 2e-4)
  schedule: str = _in("optimizer", "cosine")  # cosine | linear | constant
  warmup_steps: int = _in("optimizer", 5)
  weight_decay: float = _in("optimizer", 0.0)
  max_grad_norm: float = _in("optimizer", 1.0)
  # a mixture of experts' load-balancing loss weight (None: the family's router_aux_loss_coef)
  router_aux_loss_coef: float | None = _in("optimizer", None)
  # batch_size sequences per optimizer step, in grad_accum micro-batches
  batch_size: int = _in("optimizer", 8)
  grad_accum: int = _in("optimizer", 1)
  # skip (count) steps with NaN/inf/zero loss instead of stopping
  skip_nonfinite: bool = _in("optimizer", False)

  # [evaluation] held-out loss and generations during the run
  eval_data: str | None = _in("evaluation", None)  # held-out examples, any source --data takes
  # None: "test" when eval_data is data, else "train"
  eval_data_split: str | None = _in("evaluation", None)
  # hold out this fraction of data instead (seeded)
  eval_split: float | None = _in("evaluation", None)
  eval_every: int = _in("evaluation", 0)  # 0: only at the end (when eval_data is set)
  # text file, one prompt per line, generated at each eval
  eval_prompts: str | None = _in("evaluation", None)

  # [adapters] the LoRA adapters: rank, scale, targets, or a PEFT adapter to continue
  lora_rank: int = _in("adapters", 16)
  lora_alpha: float = _in("adapters", 16.0)
  lora_dropout: float = _in("adapters", 0.0)
  lora_targets: tuple[str, ...] = _in(
    "adapters",
    ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
  )
  rslora: bool = _in("adapters", False)
  # a mixture of experts' routers trained too (full weights, float32), not only adapters
  train_router: bool = _in("adapters", False)
  # e.g. "down_proj=64,layers.0-7=32" (lora.py keys)
  lora_rank_pattern: str | None = _in("adapters", None)
  lora_alpha_pattern: str | None = _in("adapters", None)  # the same keys, alphas
  # PEFT adapter dir to continue training (sets the lora_*)
  init_adapter: str | None = _in("adapters", None)

  # [performance] how the step runs on the devices (same results, other speed and memory)
  mesh: str | None = _in("performance", None)  # e.g. "2x4"; None: all devices data-parallel
  # REMAT (what each keeps: models/decoder.py), or "auto": the fastest whose memory plan fits
  remat: str = _in("performance", "auto")
  # > 1: full, lean and offload keep only the input of every group of this many layers; a
  # group's backward recomputes its layers (long contexts, where layer inputs fill memory)
  remat_group: int = _in("performance", 1)
  # How the layers run: "scan" (one compiled layer, looped), "unrolled" (each layer in the
  # program: no per-layer copies of what the backward reads, faster on a GPU, more memory and
  # compile time) or "auto" (unrolled where remat activations fits that way on one GPU)
  layer_loop: str = _in("performance", "auto")
  # pipeline micro-batches per step (mesh pipe > 1); 0: automatic
  microbatches: int = _in("performance", 0)
  # also split the frozen NF4 weights over data (FSDP-style)
  shard_frozen: bool = _in("performance", False)
  # residual stream's tokens split over tensor between matmuls
  sequence_parallel: bool = _in("performance", False)
  # xla | fused | pallas; None: the fastest exact one here
  attention: str | None = _in("performance", None)
  # NF4 linear layers: the Pallas kernel or XLA's dequantize-then-dot; None: where the kernel
  # measured faster on one Hopper GPU (at most 64 tokens a call; and 8B-wide SFT at 2,048-4,096
  # tokens a call where its operands fit: run.resolve.resolve_nf4_matmul)
  nf4_matmul: str | None = _in("performance", None)
  # > 0: float32 logits for this many tokens per row at a time; 0: all at once; None: all at
  # once unless that does not fit (then AUTO_LOSS_CHUNK)
  loss_chunk: int | None = _in("performance", None)
  # GiB per device the step may plan for; None: the device's
  memory_limit: float | None = _in("performance", None)
  # > 0: the MLP runs this many tokens per row at a time (long contexts)
  mlp_chunk: int = _in("performance", 0)
  # host: the input embedding table stays in host memory, each batch's rows gathered there
  embeddings: str = _in("performance", "device")

  # [output] what the run writes: checkpoints, metrics, the export and its upload
  out: str = _in("output", "runs/default")
  log_every: int = _in("output", 1)
  # trackers, comma-separated: tensorboard, wandb; or none
  report_to: str = _in("output", "tensorboard")
  save_every: int = _in("output", 50)
  keep_checkpoints: int = _in("output", 2)
  # merged | peft | bnb4 | gguf | none, to OUT/export at the end
  export: str | None = _in("output", "merged")
  # with export gguf: f16 | bf16 | f32 | q8_0 | q5_1 | q5_0 | q4_1 | q4_0
  gguf_type: str = _in("output", "f16")
  # merged, bnb4, gguf: the LoRA update added to the checkpoint's original weights (read again
  # from its files: the PEFT adapter's model) or to the NF4-dequantized ones it trained with
  merge_into: str = _in("output", "original")
  push_to_hub: str | None = _in("output", None)  # ORG/NAME: upload OUT/export there at the end
  hub_private: bool = _in("output", False)

  @property
  def method_beta(self) -> float:
    """--beta, or the usual value of --method when unset (DEFAULT_BETA; 0 for sft/orpo)."""
    return DEFAULT_BETA.get(self.method, 0.0) if self.beta is None else self.beta

  @classmethod
  def from_yaml(cls, path: str | Path) -> "RunConfig":
    return cls.from_settings(cls.read_yaml(path))

  @staticmethod
  def read_yaml(path: str | Path) -> dict[str, Any]:
    """The settings a YAML file holds, flat (name -> value), or a RunConfigError. The file may
    name each setting at the top level, under its section (``optimizer: {learning_rate: ...}``,
    as to_yaml writes) or mix the two."""
    path = Path(path)
    if not path.is_file():
      raise RunConfigError(f"config file {path} does not exist.")
    try:
      size = path.stat().st_size
      raw = path.read_bytes() if size <= MAX_YAML_BYTES else b""
    except OSError as e:
      raise RunConfigError(
        f"cannot read {path} ({e.strerror or type(e).__name__}); make it a readable file."
      ) from e
    if size > MAX_YAML_BYTES:
      raise RunConfigError(
        f"{path} is {size_text(size)}, too large for a file of run settings (at most "
        f"{size_text(MAX_YAML_BYTES)}); pass a YAML file of name: value lines."
      )
    try:
      text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
      raise RunConfigError(
        f"{path} is not UTF-8 text (byte {e.start} is {raw[e.start]:#04x}); pass a YAML file "
        "of run settings."
      ) from e
    try:
      _refuse_aliases_and_depth(path, text)
      data = yaml.safe_load(text)
    except yaml.YAMLError as e:
      mark = getattr(e, "problem_mark", None)
      where = f" at line {mark.line + 1}" if mark is not None else ""
      raise RunConfigError(f"{path} is not valid YAML{where}; fix the file.") from e
    except ValueError as e:  # PyYAML's int() of a number over 4,300 digits, a bad date
      raise RunConfigError(
        f"{path} holds a value YAML cannot read ({str(e).split(':')[0][:80]}); fix the file."
      ) from e
    if data is None:
      data = {}
    if not isinstance(data, dict):
      raise RunConfigError(f"{path} must hold a mapping of run settings (name: value lines).")
    data = _flattened(data, f"{path}: ")
    _check_names(data, f"{path}: ")
    return data

  @classmethod
  def from_settings(cls, settings: dict[str, Any]) -> "RunConfig":
    """A run of these settings over the defaults; without a model, over the built-in default
    run's own settings (configs/default-run.yaml) first. ``settings``: flat, sectioned or
    both, as read_yaml reads a file."""
    settings = _flattened(settings)
    _check_names(settings)  # before ** (which takes only text keys)
    base = cls()
    if settings.get("model") is None:
      base = base.replace(**_flattened(yaml.safe_load(DEFAULT_RUN.read_text()) or {}))
    return base.replace(**settings)

  def replace(self, **changes: Any) -> "RunConfig":
    _check_names(changes)
    if "lora_targets" in changes and isinstance(changes["lora_targets"], str):
      changes["lora_targets"] = tuple(t.strip() for t in changes["lora_targets"].split(","))
    elif "lora_targets" in changes and isinstance(changes["lora_targets"], list | tuple):
      changes["lora_targets"] = tuple(changes["lora_targets"])
    return dataclasses.replace(self, **changes)

  def checked(self) -> "RunConfig":
    """This config with numbers read from strings (YAML reads 1e-4 as text), or an error
    naming the first setting of the wrong type or out of range. A config this returned is
    returned as it is (checked once; ``replace`` makes one to check again)."""
    if self.__dict__.get("_checked"):
      return self
    values = {}
    for f in dataclasses.fields(self):
      values[f.name] = checked_value(
        f.name, getattr(self, f.name), getattr(RunConfig, f.name, None)
      )
    valid = dataclasses.replace(self, **values)
    object.__setattr__(valid, "_checked", True)  # not a field: equality and repr ignore it
    return valid

  def section(self, name: str) -> dict[str, Any]:
    """The settings of section ``name`` (one of SECTION_NAMES): flat name -> value."""
    if name not in SECTION_NAMES:
      raise RunConfigError(f"unknown section {shown(name)}; the sections are {_SECTIONS_LISTED}.")
    return {k: getattr(self, k) for k, home in SECTION_OF.items() if home == name}

  def to_yaml(self) -> str:
    """Every setting, one mapping per section under a comment line saying what it holds
    (read_yaml reads it back, as it reads the flat files of older runs)."""
    parts = []
    for name, about in SECTIONS:
      values = self.section(name)
      if "lora_targets" in values:
        values["lora_targets"] = list(self.lora_targets)
      parts.append(f"# {about}\n" + yaml.safe_dump({name: values}, sort_keys=False))
    return "\n".join(parts)


NAMES = tuple(f.name for f in dataclasses.fields(RunConfig))
SECTION_OF = {f.name: f.metadata["section"] for f in dataclasses.fields(RunConfig)}
_SECTIONS_LISTED = ", ".join(SECTION_NAMES)


def _flattened(settings: dict, where: str = "") -> dict:
  """``settings`` with each section (a section name holding a mapping) replaced by the settings
  it holds: each one of that section's, and none also given at the top level. The sections
  model, data and method share their names with settings, which never hold a mapping."""
  flat, section_of = {}, {}  # setting -> the section it was given under (None: top level)
  for key, value in settings.items():
    if _is_section(key, value):
      given = [(name, v, key) for name, v in (value or {}).items()]
    elif isinstance(key, str) and key in SECTION_NAMES and key not in NAMES:
      raise RunConfigError(
        f"{where}the section {key} must hold its settings as name: value lines, got {shown(value)}."
      )
    elif isinstance(key, str) and key not in NAMES and isinstance(value, dict):
      raise RunConfigError(f"{where}unknown section {shown(key)}; {_section_hint(key, value)}.")
    else:
      given = [(key, value, None)]  # a flat setting (_check_names checks its name)
    for name, v, section in given:
      if section is not None:
        _check_in_section(name, section, where)
      if name in flat:
        raise RunConfigError(
          f"{where}{name} is given twice, at the top level and under "
          f"{section or section_of[name]}; keep one."
        )
      flat[name], section_of[name] = v, section
  return flat


def _is_section(key: Any, value: Any) -> bool:
  """Whether ``key: value`` is a section: its name holding a mapping (or nothing, where the
  name is no setting's)."""
  if not isinstance(key, str) or key not in SECTION_NAMES:
    return False
  return isinstance(value, dict) or (value is None and key not in NAMES)


def _check_in_section(name: Any, section: str, where: str) -> None:
  """A setting given under ``section`` is one of its settings, or a RunConfigError."""
  if not isinstance(name, str) or name not in SECTION_OF:
    _check_names({name: None}, f"{where}{section}: ")  # not a setting: the nearest name
  home = SECTION_OF[name]
  if home != section:
    raise RunConfigError(
      f"{where}{name} is a setting of the section {home}, not {section}; move it under {home} "
      "(or to the top level)."
    )


def _section_hint(key: str, value: dict) -> str:
  """Where the settings of an unknown section belong, or the nearest section's name."""
  homes = list(dict.fromkeys(SECTION_OF[k] for k in value if isinstance(k, str) and k in NAMES))
  close = difflib.get_close_matches(key[:100], SECTION_NAMES, n=1)
  if homes:
    hint = f"its settings belong under {' and '.join(homes)}"
  elif close:
    hint = f"did you mean {close[0]!r}?"
  else:
    hint = "name each setting at the top level or under its section"
  return f"{hint} (the sections are {_SECTIONS_LISTED})"


def _check_names(settings: dict, where: str = "") -> None:
  """Every key a setting's name; an unknown one is refused with the nearest name."""
  for key in settings:
    if not isinstance(key, str):
      raise RunConfigError(
        f"{where}the key {shown(key)} is not a setting name; name settings in text, e.g. "
        "learning_rate: 2.0e-4."
      )
  unknown = [key for key in settings if key not in NAMES]
  if not unknown:
    return
  more = f" (and {len(unknown) - 1} more)" if len(unknown) > 1 else ""
  close = difflib.get_close_matches(unknown[0][:100], NAMES, n=1)
  listed = "the settings are the flags of python -m jaxtune.train --help, with _ for -"
  hint = f"did you mean {close[0]!r}? ({listed})" if close else listed
  raise RunConfigError(f"{where}unknown setting {shown(unknown[0])}{more}; {hint}.")


def _refuse_aliases_and_depth(path: Path, text: str) -> None:
  """Refuse YAML aliases (a billion-laughs document expands exponentially) and deep nesting
  from the parser's events, before anything is built."""
  depth = 0
  for event in yaml.parse(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader)):
    if isinstance(event, yaml.AliasEvent):
      line = event.start_mark.line + 1
      raise RunConfigError(
        f"{path} uses the YAML alias *{event.anchor[:40]} at line {line}; write the "
        "value out in full (run settings take no anchors and aliases)."
      )
    if isinstance(event, yaml.CollectionStartEvent):
      depth += 1
      if depth > MAX_YAML_DEPTH:
        line = event.start_mark.line + 1
        raise RunConfigError(
          f"{path} nests lists and mappings more than {MAX_YAML_DEPTH} levels deep at line "
          f"{line}; a run setting is a name: value line."
        )
    elif isinstance(event, yaml.CollectionEndEvent):
      depth -= 1
