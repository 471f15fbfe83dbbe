"""The model card (README.md) every export carries, from what the run directory recorded.

Its metadata block (YAML between ``---`` lines, as the Hub reads it) names ``base_model`` (the
Hub id when known), ``library_name``, ``tags``, ``datasets`` (when a Hub dataset was used) and
the base model's ``license``; its body gives the training settings, steps, final train and eval
loss, tokens/s, hardware and the exact command. Everything comes from files the run wrote:
``config.yaml``, ``metrics.jsonl`` and ``run.json`` (``write_run_info``). A checkpoint exported
without a run gets a short card naming its base (``render_base``).
"""

import json
import platform
import statistics
from pathlib import Path
from typing import Any

import yaml

from converters.errors import UserError
from converters.hub import hub_id

RUN_INFO = "run.json"
LIBRARY = {"merged": "transformers", "bnb4": "transformers", "peft": "peft", "gguf": "gguf"}


def base_hub_id(given: str | None, path: str | Path | None = None) -> str | None:
  """The base model's Hub id: from the --model given, else from the checkpoint path."""
  for candidate in (given, path):
    found = hub_id(candidate) if candidate else None
    if found:
      return found
  return None


def base_license(checkpoint: str | Path | None) -> str | None:
  """The ``license`` in the base checkpoint's own model card, when it has one."""
  if not checkpoint:
    return None
  readme = Path(checkpoint) / "README.md"
  if not readme.is_file():
    return None
  meta = _front_matter(readme.read_text(errors="replace"))
  value = meta.get("license") if isinstance(meta, dict) else None
  return str(value) if value else None


def _front_matter(text: str) -> Any:
  if not text.startswith("---"):
    return {}
  end = text.find("\n---", 3)
  if end < 0:
    return {}
  try:
    return yaml.safe_load(text[3:end]) or {}
  except yaml.YAMLError:
    return {}


def read_card(text: str) -> tuple[dict, str]:
  """(metadata, body) of a model card."""
  meta = _front_matter(text)
  end = text.find("\n---", 3) if text.startswith("---") else -1
  return (meta if isinstance(meta, dict) else {}), (text[end + 4 :] if end >= 0 else text)


def write_run_info(
  run_dir: Path, command: str, model: str | None, data: str | None, hardware: str
) -> None:
  """``run.json``: what the card needs that config.yaml does not keep (the command, the model
  and data as given, the hardware)."""
  import jax

  info = {
    "command": command,
    "model": model,
    "data": data,
    "hardware": hardware,
    "jax": jax.__version__,
    "python": platform.python_version(),
  }
  tmp = Path(run_dir) / (RUN_INFO + ".tmp")
  tmp.write_text(json.dumps(info, indent=1) + "\n")
  tmp.replace(Path(run_dir) / RUN_INFO)


def _read_config(run_dir: Path) -> dict:
  path = run_dir / "config.yaml"
  if not path.is_file():
    raise UserError(f"{run_dir} has no config.yaml; pass the --out directory of a training run.")
  try:
    config = yaml.safe_load(path.read_text()) or {}
  except yaml.YAMLError as e:
    mark = getattr(e, "problem_mark", None)
    where = f" at line {mark.line + 1}" if mark is not None else ""
    raise UserError(f"{path} is not valid YAML{where}; fix the file.") from e
  if not isinstance(config, dict):
    raise UserError(f"{path} must hold a mapping of run settings (name: value lines).")
  # Settings under their sections (model: {model: ..., dtype: ...}, as runs write config.yaml)
  # or flat (older runs): no setting holds a mapping.
  return {
    k: v
    for key, value in config.items()
    for k, v in (value.items() if isinstance(value, dict) else [(key, value)])
  }


def _read_info(run_dir: Path) -> dict:
  path = run_dir / RUN_INFO
  if not path.is_file():
    return {}
  damaged = UserError(
    f"{path} is damaged (not a JSON object); delete it (the model card then lacks the command "
    "and the hardware) or restore it."
  )
  try:
    info = json.loads(path.read_text())
  except ValueError as e:  # JSONDecodeError, or not UTF-8
    raise damaged from e
  if not isinstance(info, dict):
    raise damaged
  return info


def read_metrics(path: Path) -> list[dict]:
  """The rows of a run's metrics.jsonl. A damaged last row is what a killed run leaves (half
  written): skipped; a damaged row before it is refused, naming its line."""
  if not path.is_file():
    return []
  text = path.read_text(errors="replace")
  lines = [(n, line) for n, line in enumerate(text.splitlines(), 1) if line.strip()]
  rows = []
  for i, (n, line) in enumerate(lines):
    try:
      row = json.loads(line)
    except ValueError:
      row = None
    if isinstance(row, dict):
      rows.append(row)
    elif i < len(lines) - 1:
      raise UserError(
        f"{path} line {n} is damaged (not a JSON object); delete that line or restore the file."
      )
  return rows


def render(run_dir: str | Path, fmt: str) -> str:
  """The model card of an export in format ``fmt`` of the run in ``run_dir``; a run file that
  cannot be read is a UserError naming it."""
  run_dir = Path(run_dir)
  config = _read_config(run_dir)
  info = _read_info(run_dir)
  rows = read_metrics(run_dir / "metrics.jsonl")
  train = [r for r in rows if "loss" in r]
  evals = [r for r in rows if "eval_loss" in r]
  base = base_hub_id(info.get("model"), config.get("model"))
  dataset = hub_id(info["data"]) if info.get("data") else None  # an org/name that is no path
  quant = config.get("quantization")
  tags = ["jaxtune", "lora", "sft"] + (["qlora", "nf4"] if quant == "nf4" else [])
  if fmt == "peft" and base:
    tags.append(f"base_model:adapter:{base}")
  meta = {
    "base_model": base or config.get("model"),
    "library_name": LIBRARY.get(fmt, "transformers"),
    "tags": tags,
    "pipeline_tag": "text-generation",
  }
  if dataset:
    meta["datasets"] = [dataset]
  license_ = base_license(config.get("model"))
  if license_:
    meta["license"] = license_
  speeds = [r["tokens_per_s"] for r in train[1:] if "tokens_per_s" in r]  # not the compile
  settings = [
    ("base model", base or config.get("model")),
    ("data", info.get("data") or config.get("data") or "the built-in default dataset"),
    ("steps", train[-1]["step"] if train else config.get("steps")),
    ("batch size x seq-len", f"{config.get('batch_size')} x {config.get('seq_len')}"),
    ("learning rate", f"{config.get('learning_rate')} ({config.get('schedule')})"),
    (
      "LoRA",
      f"r={config.get('lora_rank')}, alpha={config.get('lora_alpha')}, "
      f"targets {', '.join(config.get('lora_targets') or [])}",
    ),
    ("frozen weights", "NF4 (QLoRA)" if quant == "nf4" else config.get("dtype")),
    ("final train loss", f"{train[-1]['loss']:.4f}" if train else "n/a"),
    ("final eval loss", f"{evals[-1]['eval_loss']:.4f}" if evals else "n/a"),
    ("tokens/s (median)", f"{statistics.median(speeds):,.0f}" if speeds else "n/a"),
    ("hardware", info.get("hardware", "n/a")),
  ]
  name = base.split("/")[-1] if base else "model"
  body = [
    f"# {name}, fine-tuned with jaxtune",
    "",
    f"A {_what(fmt)} of {base or 'a base model'} fine-tuned with "
    "jaxtune (LoRA adapters on a frozen" + (" NF4-quantized" if quant == "nf4" else "") + " base).",
    "",
    "## Training",
    "",
    "| setting | value |",
    "|---|---|",
    *[f"| {k} | {v} |" for k, v in settings],
    "",
    "Command:",
    "",
    "```",
    info.get("command", "(not recorded)"),
    "```",
    "",
  ]
  head = yaml.safe_dump(meta, sort_keys=False).strip()
  return f"---\n{head}\n---\n\n" + "\n".join(body)


def render_base(checkpoint: str | Path, given: str, fmt: str) -> str:
  """The model card of a checkpoint exported as ``fmt`` without training (``given``: the
  --model as given, a path or a Hub id)."""
  base = base_hub_id(given, checkpoint)
  meta = {
    "base_model": base or given,
    "library_name": LIBRARY.get(fmt, "transformers"),
    "tags": ["jaxtune"] + (["nf4"] if fmt == "bnb4" else []),
    "pipeline_tag": "text-generation",
  }
  license_ = base_license(checkpoint)
  if license_:
    meta["license"] = license_
  what = "safetensors checkpoint" if fmt == "merged" else _what(fmt)
  name = base.split("/")[-1] if base else Path(given).name or "model"
  body = [
    f"# {name}, exported with jaxtune",
    "",
    f"A {what} of {base or given}, not fine-tuned: the base model's own "
    "weights" + (", quantized to NF4." if fmt == "bnb4" else "."),
    "",
  ]
  head = yaml.safe_dump(meta, sort_keys=False).strip()
  return f"---\n{head}\n---\n\n" + "\n".join(body)


def _what(fmt: str) -> str:
  return {
    "merged": "merged checkpoint (adapters folded into the weights)",
    "bnb4": "bitsandbytes 4-bit checkpoint",
    "peft": "PEFT LoRA adapter",
    "gguf": "GGUF file for llama.cpp and Ollama",
  }.get(fmt, fmt)
