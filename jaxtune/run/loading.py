"""A model and its tokenizer from files, for a run and for the command lines that only read one
(export, generate): the run's model built as it asks (checkpoint, NF4, LoRA or --init-adapter),
a trained run's model with its latest adapters restored, a PEFT adapter's or a plain
checkpoint's model, and the tokenizer without importing AutoTokenizer where a plain class
does."""

import json
from pathlib import Path
from types import EllipsisType
from typing import Any

import jax
from flax import nnx
from jax.sharding import Mesh

from jaxtune.errors import RunConfigError, UserError
from jaxtune.hf.adapters import is_adapter_dir, load_adapter, read_config
from jaxtune.hf.load import from_pretrained, resolve_checkpoint
from jaxtune.models.config import ModelConfig
from jaxtune.models.lora import apply_lora, parse_pattern
from jaxtune.parallel import runtime
from jaxtune.run import checks
from jaxtune.run_config import RunConfig
from jaxtune.training import checkpoint, step


def load_tokenizer(ckpt: Path) -> Any:
  """The checkpoint's tokenizer, as transformers' AutoTokenizer gives it."""
  try:
    import transformers  # optional: the hf extra
  except ImportError as e:
    raise UserError(
      "training needs transformers for the tokenizer: pip install 'jaxtune[hf]'."
    ) from e
  direct = _tokenizer_by_class(ckpt)
  if direct is not None:
    return direct
  try:
    return transformers.AutoTokenizer.from_pretrained(str(ckpt))
  except Exception as e:  # a damaged file raises anything (KeyError, tokenizers' own Exception)
    names = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")
    present = [name for name in names if (ckpt / name).exists()]
    if not present:
      raise UserError(
        f"cannot load a tokenizer from {ckpt} ({type(e).__name__}); the checkpoint needs its "
        "tokenizer files (tokenizer.json or tokenizer.model, tokenizer_config.json)."
      ) from e
    raise UserError(
      f"cannot load a tokenizer from {ckpt} ({type(e).__name__} reading "
      f"{', '.join(present)}); the files are damaged or incomplete, re-download them."
    ) from e


# tokenizer_config.json's tokenizer_class values for which AutoTokenizer loads exactly that
# class from tokenizer.json (Llama 3's and jaxtune's own tokenizers); for model-specific names
# (LlamaTokenizer, Qwen2Tokenizer, ...) its choice depends on more, so it decides.
PLAIN_TOKENIZERS = ("PreTrainedTokenizerFast", "TokenizersBackend")


def _tokenizer_by_class(ckpt: Path) -> Any | None:
  """The tokenizer of a checkpoint whose tokenizer_config.json names a PLAIN_TOKENIZERS class,
  loaded without importing AutoTokenizer, which pulls in torch (5 s of a command line's start
  on a CPU, more with CUDA's torch); None where that does not apply (another class, remote
  code, anything failing): then AutoTokenizer decides, and reports damage
  (tests/unit/test_data.py compares the two)."""
  import transformers

  try:
    config = json.loads((ckpt / "tokenizer_config.json").read_text())
    name = config.get("tokenizer_class")
    if name not in PLAIN_TOKENIZERS or "auto_map" in config:
      return None
    if not (ckpt / "tokenizer.json").is_file():
      return None
    return getattr(transformers, name).from_pretrained(str(ckpt))
  except Exception:
    return None


def build_model(
  run: RunConfig,
  model_path: Path | str,
  mesh: Mesh | None = None,
  dtype: str | None = None,
  config_read: tuple[ModelConfig, dict] | None = None,
) -> nnx.Module:
  """The run's model: the checkpoint loaded as the run asks (in ``dtype``, default the run's),
  with its LoRA adapters added (fresh, or --init-adapter's). ``config_read``: as
  ``from_pretrained``'s."""
  model = from_pretrained(
    model_path, run.quantization, dtype or run.dtype, mesh, config_read=config_read
  )
  if run.init_adapter:
    return load_adapter(model, run.init_adapter)
  return apply_lora(
    model,
    rank=run.lora_rank,
    alpha=run.lora_alpha,
    targets=run.lora_targets,
    dropout=run.lora_dropout,
    rslora=run.rslora,
    seed=run.seed,
    rank_pattern=parse_pattern(run.lora_rank_pattern),
    alpha_pattern=parse_pattern(run.lora_alpha_pattern, float),
    train_router=run.train_router,
  )


def load_trained(
  run_dir: Path, quantization: str | None | EllipsisType = ..., dtype: str | None = None
) -> tuple[nnx.Module, int]:
  """A training run's model with its latest adapters restored; returns (model, step).

  ``quantization`` and ``dtype`` default to what the run trained with.
  """
  run_dir = Path(run_dir)
  if not (run_dir / "config.yaml").is_file():
    raise UserError(f"{run_dir} has no config.yaml; pass the --out directory of a training run.")
  try:
    run = RunConfig.from_yaml(run_dir / "config.yaml").checked()
  except RunConfigError as e:
    raise RunConfigError(f"{run_dir}/config.yaml: {e}") from e
  # float16 runs keep their loss scale in the optimizer state: restore it in that form.
  loss_scale = step.LossScale() if run.dtype == "float16" else None
  if not checks.has_checkpoints(run_dir / "checkpoints"):
    raise UserError(f"{run_dir}/checkpoints holds no checkpoint; train first.")
  quantization = run.quantization if quantization is ... else quantization
  model = build_model(run.replace(quantization=quantization), run.model, dtype=dtype)
  graphdef, lora, frozen = step.place(model, runtime.DEFAULT)
  tx, _ = step.make_optimizer(run)
  target = {
    "lora": lora,
    "opt_state": step.init_opt_state(tx, lora, loss_scale),
    "key": jax.random.key(0),
  }
  ckpts = checkpoint.Checkpoints(run_dir / "checkpoints", read_only=True)
  try:
    state, at = ckpts.restore_latest(target)
  finally:
    ckpts.close()
  return nnx.merge(graphdef, state["lora"], frozen), at


def load_run_model(
  run_dir: Path | str | None,
  model_path: Path | str | None,
  quantization: str | None,
  dtype: str,
) -> tuple[nnx.Module, Path]:
  """(model, checkpoint dir) for generation: a trained run's model, a PEFT adapter directory's
  (on ``model_path``, default the base it names), or a plain checkpoint."""
  if run_dir and is_adapter_dir(run_dir):
    base = model_path or read_config(run_dir).base
    if not base:
      raise UserError(f"{run_dir} does not name its base model; pass --model too.")
    ckpt = resolve_checkpoint(base)
    model = from_pretrained(ckpt, quantization=quantization, dtype=dtype)
    return load_adapter(model, run_dir), ckpt
  if run_dir:
    model, _ = load_trained(Path(run_dir), quantization, dtype)
    return model, Path(model.provenance.checkpoint_dir)
  ckpt = resolve_checkpoint(model_path)
  return from_pretrained(ckpt, quantization=quantization, dtype=dtype), ckpt
