"""One training run end to end: resolve inputs, load, shard, train, checkpoint, export.

Kept apart from train.py (argument parsing) so tests and scripts can call it directly.
"""

import logging
from pathlib import Path

import jax

from converters.hf_in import CheckpointError
from jaxtune.config import ConfigError
from jaxtune.data import DataError
from jaxtune.mesh import MeshError
from jaxtune.run_config import RunConfig

log = logging.getLogger("jaxtune")


class UserError(Exception):
  """Anything the user can fix; its message is one sentence saying how."""


def load_tokenizer(ckpt: Path):
  try:
    from transformers import AutoTokenizer
  except ImportError as e:
    raise UserError(
      "training needs transformers for the tokenizer: pip install 'jaxtune[hf]'."
    ) from e
  try:
    return AutoTokenizer.from_pretrained(str(ckpt))
  except (OSError, ValueError) as e:
    raise UserError(
      f"cannot load a tokenizer from {ckpt} ({e}); the checkpoint needs tokenizer files."
    ) from e


def build_model(run: RunConfig, model_path, mesh=None):
  """The run's model: the checkpoint loaded as the run asks, with its LoRA adapters added."""
  import jaxtune

  model = jaxtune.from_pretrained(
    model_path, quantization=run.quantization, dtype=run.dtype, mesh=mesh
  )
  return jaxtune.apply_lora(
    model,
    rank=run.lora_rank,
    alpha=run.lora_alpha,
    targets=run.lora_targets,
    dropout=run.lora_dropout,
    rslora=run.rslora,
    seed=run.seed,
  )


def load_trained(run_dir: Path, quantization=..., dtype: str | None = None):
  """A training run's model with its latest adapters restored; returns (model, step).

  ``quantization`` and ``dtype`` default to what the run trained with.
  """
  from jaxtune import checkpoint, trainer

  run_dir = Path(run_dir)
  if not (run_dir / "config.yaml").is_file():
    raise UserError(f"{run_dir} has no config.yaml; pass the --out directory of a training run.")
  run = RunConfig.from_yaml(run_dir / "config.yaml")
  if quantization is not ...:
    run = run.replace(quantization=quantization)
  if dtype is not None:
    run = run.replace(dtype=dtype)
  ckpts = checkpoint.Checkpoints(run_dir / "checkpoints", keep=run.keep_checkpoints)
  if ckpts.latest_step() is None:
    raise UserError(f"{run_dir}/checkpoints holds no checkpoint; train first.")
  try:
    model = build_model(run, run.model)
  except (CheckpointError, ConfigError) as e:
    raise UserError(str(e)) from e
  graphdef, lora, frozen = trainer.place(model, None)
  tx, _ = trainer.make_optimizer(run)
  lora, _, step, _ = ckpts.restore_latest(lora, tx.init(lora))
  return trainer.nnx.merge(graphdef, lora, frozen), step


def load_run_model(run_dir, model_path, quantization, dtype):
  """(model, checkpoint dir) for generation: a trained run's model, or a plain checkpoint."""
  import jaxtune
  from converters.hf_in import resolve_checkpoint

  if run_dir:
    model, _ = load_trained(Path(run_dir), quantization, dtype)
    return model, Path(model.checkpoint_dir)
  try:
    ckpt = resolve_checkpoint(model_path)
    return jaxtune.from_pretrained(ckpt, quantization=quantization, dtype=dtype), ckpt
  except (CheckpointError, ConfigError) as e:
    raise UserError(str(e)) from e


def make_sample_fn(run: RunConfig, tokenizer):
  """model -> [(prompt, greedy completion)] for --eval-prompts, or None."""
  if not run.eval_prompts:
    return None
  if not run.eval_data:
    raise UserError("--eval-prompts runs at each evaluation; pass --eval-data FILE too.")
  path = Path(run.eval_prompts)
  if not path.is_file():
    raise UserError(f"eval prompts file {path} does not exist.")
  prompts = [line.strip() for line in path.read_text().splitlines() if line.strip()]
  if not prompts:
    raise UserError(f"eval prompts file {path} holds no prompts (one per line).")
  from jaxtune.generate import generate

  chat = getattr(tokenizer, "chat_template", None) is not None

  def sample(model):
    texts = generate(model, tokenizer, prompts, max_new_tokens=64, chat=chat)
    return list(zip(prompts, texts, strict=True))

  return sample


def run_training(run: RunConfig, resume: bool = False) -> Path:
  import jaxtune
  from converters.hf_in import resolve_checkpoint
  from jaxtune import checkpoint, data, default_model, trainer
  from jaxtune import mesh as meshlib

  out = Path(run.out)
  ckpt_dir = out / "checkpoints"
  if ckpt_dir.exists() and any(ckpt_dir.iterdir()) and not resume:
    raise UserError(f"{out} already holds checkpoints; pass --resume to continue, or a new --out.")
  if run.batch_size % run.grad_accum:
    raise UserError(
      f"--batch-size {run.batch_size} must be a multiple of --grad-accum {run.grad_accum}."
    )
  try:
    mesh = meshlib.make_mesh(run.mesh)
    model_path = (
      resolve_checkpoint(run.model) if run.model else default_model.ensure_default_checkpoint()
    )
    cfg = jaxtune.ModelConfig.from_hf(model_path)
    meshlib.check_model_fits(
      mesh, cfg.num_heads, cfg.num_kv_heads, run.batch_size // run.grad_accum
    )
    tokenizer = load_tokenizer(model_path)
    dataset = data.load_jsonl(
      run.data or default_model.DATASET, tokenizer, run.seq_len, run.train_on_prompt
    )
    eval_dataset = None
    if run.eval_data:
      eval_dataset = data.load_jsonl(run.eval_data, tokenizer, run.seq_len, run.train_on_prompt)
    sample_fn = make_sample_fn(run, tokenizer)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.yaml").write_text(run.replace(model=str(model_path)).to_yaml())
    model = build_model(run, model_path, mesh)
  except (MeshError, CheckpointError, ConfigError, DataError, ValueError) as e:
    raise UserError(str(e)) from e
  print(
    f"jaxtune: {cfg.model_type} {cfg.num_layers} layers, {len(dataset)} examples, "
    f"mesh {dict(mesh.shape)} on {jax.device_count()} {jax.devices()[0].platform} device(s)"
  )
  ckpts = checkpoint.Checkpoints(ckpt_dir, keep=run.keep_checkpoints)
  try:
    model, _ = trainer.train(
      model, dataset, run, mesh if mesh.size > 1 else None, ckpts, eval_dataset, sample_fn
    )
  except trainer.TrainingError as e:
    raise UserError(f"{e} Checkpoints saved before it are in {ckpt_dir}.") from e
  if run.export:
    export_dir = out / "export"
    if run.export == "merged":
      jaxtune.export_merged(model, export_dir)
    else:
      jaxtune.export_peft(model, export_dir)
    print(f"jaxtune: exported {run.export} model to {export_dir}")
  return out
