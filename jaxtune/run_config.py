"""Everything about a run (not the architecture): YAML file, overridden by command-line flags."""

import dataclasses
import difflib
import math
import reprlib
from pathlib import Path
from typing import Any

import yaml

from jaxtune.errors import RunConfigError, size_text

# Activation checkpointing per layer (models/decoder.py REMAT_POLICIES holds what each keeps).
REMAT = ("none", "full", "lean", "activations", "dots", "dots_no_batch", "offload")
# --remat auto tries these, fastest first (plan.py keeps the first whose memory plan fits).
AUTO_REMAT = ("activations", "dots_no_batch", "full", "lean", "offload")
# The loss chunk --loss-chunk unset falls back to where the whole logits do not fit.
AUTO_LOSS_CHUNK = 1024
# What --attention may ask for; None lets run.resolve pick the fastest exact one.
ATTENTION_CHOICES = ("xla", "fused", "pallas")

# What a run optimises: next-token cross-entropy (sft), preference pairs (preference.py), or
# rewards of its own generations (grpo, rl.py).
METHODS = ("sft", "dpo", "ipo", "orpo", "grpo")
# --beta unset: the usual value of each method (DPO/IPO's beta; GRPO's KL weight, 0: no
# reference forward, TRL's default).
DEFAULT_BETA = {"dpo": 0.1, "ipo": 0.1, "grpo": 0.0}

CHOICES = {
  "method": METHODS,
  "schedule": ("cosine", "linear", "constant"),
  "quantization": ("nf4", None),
  "dtype": ("bfloat16", "float32", "float16"),
  "export": ("merged", "peft", "bnb4", "gguf", None),
  # jaxtune/hf/gguf.GGUF_TYPES (checked here, so a run never fails at its export)
  "gguf_type": ("f16", "bf16", "f32", "q8_0", "q5_1", "q5_0", "q4_1", "q4_0"),
  "merge_into": ("original", "dequantized"),  # jaxtune/hf/write.MERGE_INTO
  "nf4_matmul": ("kernel", "xla", None),
  "data_format": (
    "text",
    "messages",
    "conversations",
    "alpaca",
    "prompt_completion",
    "preference",
    None,
  ),
  "long_examples": ("truncate", "drop"),
  "remat": (*REMAT, "auto"),
  "attention": (*ATTENTION_CHOICES, None),
  "embeddings": ("device", "host"),
  "layer_loop": ("auto", "scan", "unrolled"),
}
# Smallest allowed value of numeric settings (None: any value).
MINIMUM = {
  "steps": 1,
  "epochs": 0.0,  # exclusive
  "learning_rate": 0.0,  # exclusive: must be > 0
  "warmup_steps": 0,
  "weight_decay": 0.0,
  "max_grad_norm": 0.0,  # exclusive
  "batch_size": 1,
  "grad_accum": 1,
  "seq_len": 2,
  "loss_chunk": 0,
  "memory_limit": 0.0,  # exclusive
  "mlp_chunk": 0,
  "remat_group": 1,
  "microbatches": 0,
  "eval_every": 0,
  "lora_rank": 1,
  "lora_alpha": 0.0,  # exclusive
  "lora_dropout": 0.0,
  "log_every": 1,
  "save_every": 1,
  "keep_checkpoints": 1,
  "beta": 0.0,
  "label_smoothing": 0.0,
  "orpo_lambda": 0.0,  # exclusive
  "num_generations": 2,
  "max_new_tokens": 1,
  "temperature": 0.0,  # exclusive
  "top_p": 0.0,  # exclusive
  "epsilon": 0.0,  # exclusive
  "num_iterations": 1,
  "seed": 0,
}
# Largest allowed value of whole-number settings: counts and sizes become int32 on the device
# (the step counter, the schedule, shapes); the seed seeds numpy and JAX as a uint32.
INT32_MAX = 2**31 - 1
MAXIMUM = {"seed": 2**32 - 1}
EXCLUSIVE = {
  "learning_rate",
  "max_grad_norm",
  "lora_alpha",
  "epochs",
  "eval_split",
  "memory_limit",
  "orpo_lambda",
  "temperature",
  "top_p",
  "epsilon",
}
# Numeric settings whose default is None (unset: decided from the data or the other settings).
OPTIONAL_NUMBERS = {
  "steps": int,
  "epochs": float,
  "seq_len": int,
  "eval_split": float,
  "loss_chunk": int,
  "memory_limit": float,
  "beta": float,
}
# The built-in default run (no --model): settings fit for its small model, under the user's.
DEFAULT_RUN = Path(__file__).parent / "configs" / "default-run.yaml"
# A --config file is a few lines of settings: past these it is no run config (and an error
# sentence must never format what a huge or alias-expanded value holds).
MAX_YAML_BYTES = 2**20
MAX_YAML_DEPTH = 8


@dataclasses.dataclass
class RunConfig:
  model: str | None = None  # HF checkpoint dir or hub id; None: the built-in default
  # Data: a file (.jsonl .json .parquet .csv .arrow), directory, glob, save_to_disk directory
  # or Hub dataset id, read through HF datasets (data.py); None: the bundled default dataset
  data: str | None = None
  data_config: str | None = None  # the Hub dataset's config (subset)
  data_split: str = "train"
  data_format: str | None = None  # None: detected from the columns (formats.py)
  data_columns: str | None = None  # e.g. "prompt=question,completion=answer"
  data_streaming: bool = False  # read, tokenize and pack a buffer at a time (needs --steps)
  long_examples: str = "truncate"  # examples longer than seq_len: truncate | drop
  out: str = "runs/default"
  mesh: str | None = None  # e.g. "2x4"; None: all visible devices data-parallel
  steps: int | None = None  # None: from epochs
  epochs: float | None = None  # None (and no steps): one epoch
  seed: int = 0
  # What is optimised: sft; on preference pairs (prompt, chosen, rejected) dpo | ipo | orpo;
  # or grpo, on rewards of the model's own completions of prompts
  method: str = "sft"
  # dpo/ipo: how far the policy may move from the reference (adapters off); grpo: the weight
  # of the KL penalty to it. None: DEFAULT_BETA of the method
  beta: float | None = None
  label_smoothing: float = 0.0  # dpo: probability that a pair's preference is flipped (cDPO)
  orpo_lambda: float = 0.1  # orpo: weight of the odds-ratio term beside the chosen NLL
  # grpo: reward functions MODULE:FUNCTION (or built-in names), comma-separated
  reward: str | None = None
  num_generations: int = 8  # grpo: completions sampled per prompt (the group)
  max_new_tokens: int = 256  # grpo: longest completion
  temperature: float = 1.0  # grpo: sampling temperature of the rollouts
  top_p: float = 1.0  # grpo: nucleus sampling of the rollouts
  epsilon: float = 0.2  # grpo: the policy ratio is clipped to [1 - epsilon, 1 + epsilon]
  num_iterations: int = 1  # grpo: optimizer steps per batch of rollouts
  # Optimisation
  learning_rate: float = 2e-4
  schedule: str = "cosine"  # cosine | linear | constant
  warmup_steps: int = 5
  weight_decay: float = 0.0
  max_grad_norm: float = 1.0
  # Batch: batch_size sequences per optimizer step, in grad_accum micro-batches.
  batch_size: int = 8
  grad_accum: int = 1
  seq_len: int | None = None  # None: the smallest multiple of 256 holding 99% of the examples
  train_on_prompt: bool = False
  packing: bool = True  # several examples per row (segment ids, positions restart)
  # Evaluation
  eval_data: str | None = None  # held-out examples, any source --data takes
  eval_data_split: str | None = None  # None: "test" when eval_data is data, else "train"
  eval_split: float | None = None  # hold out this fraction of data instead (seeded)
  eval_every: int = 0  # 0: only at the end (when eval_data is set)
  eval_prompts: str | None = None  # text file, one prompt per line, generated at each eval
  # Model and adapters
  quantization: str | None = "nf4"
  dtype: str = "bfloat16"  # float16: dynamic loss scaling; chosen on GPUs without bfloat16
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
  lora_rank_pattern: str | None = None  # e.g. "down_proj=64,layers.0-7=32" (lora.py keys)
  lora_alpha_pattern: str | None = None  # the same keys, alphas
  init_adapter: str | None = None  # PEFT adapter dir to continue training (sets the lora_*)
  skip_nonfinite: bool = False  # skip (count) steps with NaN/inf/zero loss instead of stopping
  # REMAT (what each keeps: models/decoder.py), or "auto": the fastest whose memory plan fits
  remat: str = "auto"
  # > 1: full, lean and offload keep only the input of every group of this many layers; a
  # group's backward recomputes its layers (long contexts, where layer inputs fill memory)
  remat_group: int = 1
  # How the layers run: "scan" (one compiled layer, looped), "unrolled" (each layer in the
  # program: no per-layer copies of what the backward reads, faster on a GPU, more memory and
  # compile time) or "auto" (unrolled where remat activations fits that way on one GPU)
  layer_loop: str = "auto"
  microbatches: int = 0  # pipeline micro-batches per step (mesh pipe > 1); 0: automatic
  shard_frozen: bool = False  # also split the frozen NF4 weights over data (FSDP-style)
  sequence_parallel: bool = False  # residual stream's tokens split over tensor between matmuls
  attention: str | None = None  # xla | fused | pallas; None: the fastest exact one here
  # NF4 linear layers: the Pallas kernel or XLA's dequantize-then-dot; None: where the kernel
  # measured faster on one Hopper GPU (at most 64 tokens a call; and 8B-wide SFT at 2,048-4,096
  # tokens a call where its operands fit: run.resolve.resolve_nf4_matmul)
  nf4_matmul: str | None = None
  # > 0: float32 logits for this many tokens per row at a time; 0: all at once; None: all at
  # once unless that does not fit (then AUTO_LOSS_CHUNK)
  loss_chunk: int | None = None
  memory_limit: float | None = None  # GiB per device the step may plan for; None: the device's
  mlp_chunk: int = 0  # > 0: the MLP runs this many tokens per row at a time (long contexts)
  # host: the input embedding table stays in host memory, each batch's rows gathered there
  embeddings: str = "device"
  # Output
  log_every: int = 1
  report_to: str = "tensorboard"  # trackers, comma-separated: tensorboard, wandb; or none
  save_every: int = 50
  keep_checkpoints: int = 2
  export: str | None = "merged"  # merged | peft | bnb4 | gguf | none, to OUT/export at the end
  gguf_type: str = "f16"  # with export gguf: f16 | bf16 | f32 | q8_0 | q5_1 | q5_0 | q4_1 | q4_0
  # merged, bnb4, gguf: the LoRA update added to the checkpoint's original weights (read again
  # from its files: the PEFT adapter's model) or to the NF4-dequantized ones it trained with
  merge_into: str = "original"
  push_to_hub: str | None = None  # ORG/NAME: upload OUT/export there at the end
  hub_private: bool = False

  @property
  def method_beta(self) -> float:
    """--beta, or the usual value of --method when unset (DEFAULT_BETA; 0 for sft/orpo)."""
    return DEFAULT_BETA.get(self.method, 0.0) if self.beta is None else self.beta

  @classmethod
  def from_yaml(cls, path: str | Path) -> "RunConfig":
    return cls.from_settings(cls.read_yaml(path))

  @staticmethod
  def read_yaml(path: str | Path) -> dict[str, Any]:
    """The settings a YAML file holds (a mapping of known names), or a RunConfigError."""
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
    _check_names(data, f"{path}: ")
    return data

  @classmethod
  def from_settings(cls, settings: dict[str, Any]) -> "RunConfig":
    """A run of these settings over the defaults; without a model, over the built-in default
    run's own settings (configs/default-run.yaml) first."""
    _check_names(settings)  # before ** (which takes only text keys)
    base = cls()
    if settings.get("model") is None:
      base = base.replace(**yaml.safe_load(DEFAULT_RUN.read_text()))
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
    naming the first setting of the wrong type or out of range."""
    values = {}
    for f in dataclasses.fields(self):
      values[f.name] = _check(f.name, getattr(self, f.name), getattr(RunConfig, f.name, None))
    return dataclasses.replace(self, **values)

  def to_yaml(self) -> str:
    data = dataclasses.asdict(self)
    data["lora_targets"] = list(self.lora_targets)
    return yaml.safe_dump(data, sort_keys=False)


NAMES = tuple(f.name for f in dataclasses.fields(RunConfig))


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


_REPR = reprlib.Repr(maxlevel=2, maxlist=4, maxtuple=4, maxdict=4, maxset=4, maxstring=50)


def shown(value: Any, limit: int = 60) -> str:
  """``repr(value)`` in at most ``limit`` characters, for an error sentence: a huge value
  (a long string, a list of lists YAML aliases made) is cut without formatting all of it."""
  if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 3 * limit:
    return f"a whole number of about {value.bit_length() * 3 // 10} digits"  # repr: 4,300 at most
  text = _REPR.repr(value)
  return text if len(text) <= limit else text[: limit - 3] + "..."


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


def _check(name: str, value: Any, default: Any) -> Any:
  flag = "--" + name.replace("_", "-")
  if name in ("quantization", "export") and value == "none":
    value = None
  choices = CHOICES.get(name)
  if choices is not None:
    if value not in choices:
      listed = ", ".join("none" if c is None else c for c in choices)
      raise RunConfigError(f"{flag} must be one of {listed}, got {shown(value)}.")
    return value
  if name == "lora_targets":
    if not value or not all(isinstance(t, str) and t for t in value):
      raise RunConfigError(
        f"{flag} must name at least one projection, e.g. q_proj,v_proj, got {shown(value)}."
      )
    return tuple(value)
  if isinstance(default, bool):
    if not isinstance(value, bool):
      raise RunConfigError(f"{name} must be true or false, got {shown(value)}.")
    return value
  if name in OPTIONAL_NUMBERS and value is None:
    return None
  if isinstance(default, int | float) or name in OPTIONAL_NUMBERS:
    kind = OPTIONAL_NUMBERS.get(name) or type(default)
    number = _number(value, kind)
    if number is None:
      noun = "a whole number" if kind is int else "a number"
      raise RunConfigError(f"{flag} must be {noun}, got {shown(value)}.")
    low = MINIMUM.get(name)
    if kind is int:
      high = MAXIMUM.get(name, INT32_MAX)
      if number > high or (name in MAXIMUM and number < low):
        raise RunConfigError(
          f"{flag} must be a whole number from {low} to {high}, got {shown(number)}."
        )
    if name == "eval_split" and not 0 < number < 0.5:
      raise RunConfigError(f"{flag} must be a fraction between 0 and 0.5, got {shown(number)}.")
    if low is not None and (number < low or (name in EXCLUSIVE and number <= low)):
      bound = f"greater than {low}" if name in EXCLUSIVE else f"at least {low}"
      raise RunConfigError(f"{flag} must be {bound}, got {shown(number)}.")
    if name == "top_p" and number > 1:
      raise RunConfigError(f"{flag} must be at most 1, got {shown(number)}.")
    if name == "label_smoothing" and number >= 0.5:
      raise RunConfigError(f"{flag} must be below 0.5, got {shown(number)}.")
    if name == "lora_dropout" and number >= 1:
      raise RunConfigError(f"{flag} must be below 1, got {shown(number)}.")
    return number
  # Strings and paths (model, data, out, mesh, eval files); None where optional.
  if value is None:
    if default is not None:
      raise RunConfigError(f"{flag} needs a value.")
    return None
  if isinstance(value, bool) or not isinstance(value, str | int):
    raise RunConfigError(f"{flag} must be text, got {shown(value)}.")
  return str(value)


def _number(value: Any, kind: type) -> int | float | None:
  if isinstance(value, bool):
    return None
  if isinstance(value, str):
    try:
      value = float(value) if kind is float else int(value.strip())
    except ValueError:
      return None
  if kind is int:
    return value if isinstance(value, int) else None
  if not isinstance(value, int | float) or not math.isfinite(value):
    return None
  return float(value)
