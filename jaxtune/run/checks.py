"""The checks a run's inputs pass before anything is loaded or written.

Each raises a ``UserError`` (one sentence) naming what to change. The run-time layout's own
refusals (mesh, attention, pipeline, sequence parallelism) are in ``run.resolve``.
"""

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from jaxtune.errors import RunConfigError, UserError
from jaxtune.run_config import RunConfig

if TYPE_CHECKING:
  from jaxtune.models.config import ModelConfig


def has_checkpoints(ckpt_dir: Path) -> bool:
  """Whether a run's checkpoints/ holds a step (orbax names them by number)."""
  return ckpt_dir.is_dir() and any(p.name.isdigit() for p in ckpt_dir.iterdir())


# Settings a resumed run must share with the run that wrote its checkpoints (they decide the
# adapters' shapes, the examples and their order); --allow-changes lets them differ.
RESUME_KEYS = (
  "model", "quantization", "data", "data_config", "data_split", "data_format", "data_columns",
  "train_on_prompt", "packing", "long_examples", "eval_split", "lora_rank", "lora_alpha",
  "lora_targets", "lora_dropout", "rslora", "lora_rank_pattern", "lora_alpha_pattern",
  "train_router",
  "seq_len", "batch_size", "seed",
)  # fmt: skip


class Resume(NamedTuple):
  """What a resumed run continues: the settings it runs with (automatic ones taken from the
  saved run), the saved run's settings and the settings that differ from them."""

  run: RunConfig
  saved: RunConfig | None
  changes: dict[str, tuple[Any, Any]]  # name -> (saved, now)


def _shown(key: str, value: Any) -> str:
  if isinstance(value, tuple):
    return ",".join(map(str, value))
  if value is None and key == "data":
    return "the built-in dataset"
  return str(value)


def check_resume(
  run: RunConfig,
  out: Path,
  model_path: Path | None,
  resume: bool,
  allow_changes: bool = False,
) -> Resume:
  """--resume needs checkpoints and the settings that wrote them (see RESUME_KEYS); a new run
  must not write over checkpoints. A resumed run leaving --seq-len or --steps unset continues
  with the saved run's."""
  ckpt_dir = out / "checkpoints"
  has_ckpts = has_checkpoints(ckpt_dir)
  if not resume:
    if has_ckpts:
      raise UserError(
        f"{out} already holds checkpoints; pass --resume to continue, or a new --out."
      )
    return Resume(run, None, {})
  if not has_ckpts:
    raise UserError(f"--resume: {ckpt_dir} holds no checkpoint; start without --resume.")
  saved_yaml = out / "config.yaml"
  if not saved_yaml.is_file():
    return Resume(run, None, {})
  try:
    saved = RunConfig.from_yaml(saved_yaml).checked()
  except RunConfigError:
    return Resume(run, None, {})  # the checkpoint's own shapes are checked when it is restored
  if run.seq_len is None:
    run = run.replace(seq_len=saved.seq_len)
  if run.steps is None and run.epochs == saved.epochs:
    run = run.replace(steps=saved.steps)
  now = run.replace(model=str(model_path) if model_path else run.model)
  changes = {}
  for f in dataclasses.fields(RunConfig):
    a, b = getattr(saved, f.name), getattr(now, f.name)
    if f.name == "model" and a and b:
      a, b = str(Path(a).resolve()), str(Path(b).resolve())
    if f.name not in ("out", "dtype") and a != b:
      changes[f.name] = (a, b)
  refused = [k for k in RESUME_KEYS if k in changes]
  if refused and not allow_changes:
    listed = ", ".join(
      f"{k} {_shown(k, changes[k][0])} (now {_shown(k, changes[k][1])})" for k in refused
    )
    raise UserError(
      f"--resume: the checkpoints in {out} were trained with {listed}; resume with the "
      "settings in its config.yaml, or pass --allow-changes to continue with these."
    )
  return Resume(run, saved, changes)


def check_targets(run: RunConfig, cfg: "ModelConfig") -> None:
  """The run's adapters and export fit the model (before anything is loaded)."""
  from jaxtune.hf.gguf import ARCHITECTURES, refusal

  if run.export == "gguf" and cfg.model_type not in ARCHITECTURES:
    raise UserError(refusal(cfg.model_type))
  if run.train_router and not cfg.is_moe:
    raise UserError(
      f"--train-router trains a mixture of experts' routers, and this {cfg.model_type} has "
      "none; drop the flag."
    )
  known = (*cfg.linear_shapes(), "lm_head")
  unknown = [t for t in run.lora_targets if t not in known]
  if unknown:
    which = "which is not a projection" if len(unknown) == 1 else "which are not projections"
    raise UserError(
      f"--lora-targets names {','.join(unknown)}, {which} of this {cfg.model_type}; "
      f"choose from {','.join(known)}."
    )
  from jaxtune.models.lora import check_pattern, parse_pattern

  for flag, spec, kind in (
    ("--lora-rank-pattern", run.lora_rank_pattern, int),
    ("--lora-alpha-pattern", run.lora_alpha_pattern, float),
  ):
    try:
      check_pattern(parse_pattern(spec, kind), run.lora_targets, cfg.num_layers)
    except UserError as e:
      raise UserError(f"{flag}: {e}") from e
  if "lm_head" in run.lora_targets and cfg.tie_word_embeddings:
    raise UserError(
      f"--lora-targets names lm_head, but this {cfg.model_type} computes its output with its "
      "tied input embedding (tie_word_embeddings), so it has no lm_head layer to adapt; drop "
      "lm_head from --lora-targets."
    )


def check_data_settings(run: RunConfig, given: bool = False) -> None:
  """Data settings that cannot go together (``given``: the examples came as an object)."""
  if run.steps is not None and run.epochs is not None:
    raise UserError(f"pass --steps or --epochs, not both (got {run.steps} and {run.epochs}).")
  if run.eval_split and run.eval_data:
    raise UserError("pass --eval-data or --eval-split, not both.")
  if run.data_streaming:
    if run.epochs is not None:
      raise UserError(
        "--data-streaming cannot count --epochs (a stream's length is unknown); pass --steps."
      )
    if run.steps is None:
      raise UserError("--data-streaming needs --steps (a stream's length is unknown).")
    if run.eval_split:
      raise UserError(
        "--eval-split needs the whole dataset, which --data-streaming does not read; pass "
        "--eval-data instead."
      )
  if run.method in ("dpo", "ipo") and run.beta is not None and run.beta <= 0:
    raise UserError(f"--beta must be greater than 0 for --method {run.method}, got {run.beta}.")
  if run.method == "grpo":
    if not run.reward:
      raise UserError(
        "--method grpo needs --reward: reward functions MODULE:FUNCTION (or the built-in "
        "final_answer, think_format, length_penalty), comma-separated."
      )
    if run.eval_data or run.eval_split:
      raise UserError(
        "--method grpo evaluates by sampling --eval-prompts at --eval-every; drop --eval-data "
        "and --eval-split."
      )
    if run.embeddings == "host":
      raise UserError(
        "--method grpo generates its rollouts on the devices, which needs the embedding table "
        "there; drop --embeddings host."
      )
  elif run.reward:
    raise UserError(f"--reward scores generations of --method grpo, not --method {run.method}.")
  if run.method != "sft":
    if run.data_streaming:
      raise UserError(
        f"--method {run.method} reads its preference pairs whole; drop --data-streaming."
      )
    if run.train_on_prompt:
      raise UserError(
        f"--method {run.method} scores the responses of each pair; drop --train-on-prompt."
      )
  if run.data_columns and given is False and run.data is None:
    raise UserError("--data-columns maps the columns of --data; pass --data too.")


def check_method_data(run: RunConfig, report_format: str, name: str, what: str = "--data") -> None:
  """Preference methods need preference pairs and SFT needs no pairs (one sentence each)."""
  from jaxtune.data.formats import PAIRED

  paired = report_format in PAIRED
  if run.method != "sft" and not paired:
    raise UserError(
      f"--method {run.method} trains on preference pairs (columns prompt, chosen, rejected), "
      f"but {what} {name} is {report_format} data; pass preference data, or --method sft."
    )
  if run.method == "sft" and paired:
    raise UserError(
      f"{what} {name} holds preference pairs (chosen, rejected); train on them with "
      "--method dpo, ipo or orpo."
    )


def check_export_settings(run: RunConfig) -> None:
  """--push-to-hub needs an export and a repo id of the form ORG/NAME."""
  if not run.push_to_hub:
    return
  if run.export is None:
    raise UserError(
      "--push-to-hub uploads the export; pass --export merged, peft, bnb4 or gguf too."
    )
  parts = run.push_to_hub.split("/")
  if len(parts) != 2 or not all(parts):
    raise UserError(f"--push-to-hub takes a repo id ORG/NAME, got {run.push_to_hub!r}.")


def check_report_to(run: RunConfig) -> None:
  """--report-to names known trackers, and the ones asked for are installed."""
  from jaxtune.training.log import TRACKERS, trackers

  names = trackers(run.report_to)
  unknown = [n for n in names if n not in TRACKERS]
  if unknown or (not names and run.report_to.strip() != "none"):
    raise UserError(
      f"--report-to takes tensorboard, wandb (comma-separated) or none, got {run.report_to!r}."
    )
  if "wandb" in names:
    try:
      import wandb  # noqa: F401
    except ImportError as e:
      raise UserError(
        "--report-to wandb needs the wandb client: pip install 'jaxtune[wandb]'."
      ) from e


def read_eval_prompts(run: RunConfig, has_eval: bool = False) -> list[str]:
  """--eval-prompts' prompts, one per line ([] when not asked for)."""
  if not run.eval_prompts:
    return []
  if not (run.eval_data or has_eval):
    raise UserError(
      "--eval-prompts runs at each evaluation; pass --eval-data FILE or --eval-split too."
    )
  path = Path(run.eval_prompts)
  if not path.is_file():
    raise UserError(f"eval prompts file {path} does not exist.")
  prompts = [line.strip() for line in path.read_text().splitlines() if line.strip()]
  if not prompts:
    raise UserError(f"eval prompts file {path} holds no prompts (one per line).")
  return prompts


def check_vocabulary(tokenizer: Any, cfg: "ModelConfig", model_path: Path) -> None:
  """The tokenizer's ids must all be rows of the model's embedding: an id past the end trains
  to NaN (out-of-range gathers), which would then look like an overflow."""
  vocab = tokenizer.get_vocab()
  top = max(vocab.values(), default=-1)
  if top >= cfg.vocab_size:
    beyond = sum(1 for i in vocab.values() if i >= cfg.vocab_size)
    raise UserError(
      f"the tokenizer of {model_path} has ids up to {top}, but the model's vocabulary "
      f"(vocab_size in config.json) is {cfg.vocab_size}: {beyond} token(s) have no embedding; "
      "use the tokenizer that belongs to this checkpoint."
    )
