"""What each run setting may hold: the choices, the bounds of numbers, and the check of one
value (``checked_value``: the value as the run keeps it, or one ``RunConfigError``
sentence naming its flag)."""

import math
import reprlib
from typing import Any

from jaxtune.errors import RunConfigError

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
  "router_aux_loss_coef": 0.0,
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


_REPR = reprlib.Repr(maxlevel=2, maxlist=4, maxtuple=4, maxdict=4, maxset=4, maxstring=50)


def shown(value: Any, limit: int = 60) -> str:
  """``repr(value)`` in at most ``limit`` characters, for an error sentence: a huge value
  (a long string, a list of lists YAML aliases made) is cut without formatting all of it."""
  if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 3 * limit:
    return f"a whole number of about {value.bit_length() * 3 // 10} digits"  # repr: 4,300 at most
  text = _REPR.repr(value)
  return text if len(text) <= limit else text[: limit - 3] + "..."


def checked_value(name: str, value: Any, default: Any) -> Any:
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
