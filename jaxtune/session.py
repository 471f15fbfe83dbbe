"""One training run end to end: check inputs, resolve the runtime, load, train, export.

Kept apart from train.py (argument parsing) so tests and scripts can call it directly.
Every input is checked before the model is loaded, and nothing is written to the run
directory until the model has loaded, so a bad input leaves no half-made run behind.
"""

import time
from collections.abc import Callable
from pathlib import Path
from types import EllipsisType
from typing import Any

import jax
from flax import nnx
from jax.sharding import Mesh

from converters import export
from converters.hf_in import from_pretrained, resolve_checkpoint
from jaxtune import checkpoint, checks, data, default_model, distributed, runtime, step, trainer
from jaxtune.config import ModelConfig
from jaxtune.decoding import generate
from jaxtune.errors import RunConfigError, TrainingError, UserError
from jaxtune.lora import apply_lora
from jaxtune.run_config import RunConfig


def say(line: str) -> None:
  """One line for the user, from process 0 only."""
  if jax.process_index() == 0:
    print(line, flush=True)


def load_tokenizer(ckpt: Path) -> Any:
  try:
    from transformers import AutoTokenizer  # optional: the hf extra
  except ImportError as e:
    raise UserError(
      "training needs transformers for the tokenizer: pip install 'jaxtune[hf]'."
    ) from e
  try:
    return AutoTokenizer.from_pretrained(str(ckpt))
  except (OSError, ValueError, TypeError) as e:
    raise UserError(
      f"cannot load a tokenizer from {ckpt} ({type(e).__name__}); the checkpoint needs its "
      "tokenizer files (tokenizer.json or tokenizer.model, tokenizer_config.json)."
    ) from e


def build_model(
  run: RunConfig, model_path: Path | str, mesh: Mesh | None = None, dtype: str | None = None
) -> nnx.Module:
  """The run's model: the checkpoint loaded as the run asks (in ``dtype``, default the run's),
  with its LoRA adapters added."""
  model = from_pretrained(
    model_path, quantization=run.quantization, dtype=dtype or run.dtype, mesh=mesh
  )
  return apply_lora(
    model,
    rank=run.lora_rank,
    alpha=run.lora_alpha,
    targets=run.lora_targets,
    dropout=run.lora_dropout,
    rslora=run.rslora,
    seed=run.seed,
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
  """(model, checkpoint dir) for generation: a trained run's model, or a plain checkpoint."""
  if run_dir:
    model, _ = load_trained(Path(run_dir), quantization, dtype)
    return model, Path(model.checkpoint_dir)
  ckpt = resolve_checkpoint(model_path)
  return from_pretrained(ckpt, quantization=quantization, dtype=dtype), ckpt


def make_sample_fn(
  prompts: list[str], tokenizer: Any
) -> Callable[[nnx.Module], list[tuple[str, str]]] | None:
  """model -> [(prompt, greedy completion)] for --eval-prompts, or None."""
  if not prompts:
    return None
  chat = getattr(tokenizer, "chat_template", None) is not None

  def sample(model):
    texts = generate(model, tokenizer, prompts, max_new_tokens=64, chat=chat)
    return list(zip(prompts, texts, strict=True))

  return sample


def _load_data(run: RunConfig, tokenizer):
  """(training rows, held-out rows or None)."""
  load = lambda path: data.load_jsonl(  # noqa: E731
    path, tokenizer, run.seq_len, run.train_on_prompt, run.packing
  )
  return load(run.data or default_model.DATASET), load(run.eval_data) if run.eval_data else None


def _write_config(run: RunConfig, out: Path) -> None:
  """OUT/config.yaml: the run config as it runs (written by process 0, atomically)."""
  if distributed.is_main():
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / "config.yaml.tmp"
    tmp.write_text(run.to_yaml())
    tmp.replace(out / "config.yaml")
  distributed.barrier("jaxtune run directory")


def run_training(run: RunConfig, resume: bool = False) -> Path:
  """Train as ``run`` says (``resume``: from OUT/checkpoints); returns OUT."""
  run = run.checked()
  out = Path(run.out)
  model_path = (
    resolve_checkpoint(run.model) if run.model else default_model.ensure_default_checkpoint()
  )
  checks.check_resume(run, out, model_path, resume)
  cfg = ModelConfig.from_hf(model_path)
  checks.check_targets(run, cfg)
  prompts = checks.read_eval_prompts(run)
  tokenizer = load_tokenizer(model_path)
  dataset, eval_dataset = _load_data(run, tokenizer)
  packed = dataset.packed or (eval_dataset is not None and eval_dataset.packed)
  rt = runtime.resolve(run, cfg, packed=packed)
  t_load = time.perf_counter()
  model = build_model(run, model_path, rt.mesh, dtype=rt.dtype)
  jax.block_until_ready(nnx.state(model))
  load_s = time.perf_counter() - t_load
  _write_config(run.replace(model=str(model_path), dtype=rt.dtype), out)
  say(
    f"jaxtune: {cfg.model_type} {cfg.num_layers} layers, {dataset.examples} examples in "
    f"{len(dataset)} rows of {run.seq_len} tokens ({dataset.packing_efficiency:.0%} tokens, "
    f"{'packed' if run.packing else 'not packed'}), "
    f"mesh {rt.mesh_shape} on {jax.device_count()} {jax.devices()[0].platform} device(s)"
    + (f" in {jax.process_count()} processes" if jax.process_count() > 1 else "")
    + f"; {rt.describe()}; loaded in {load_s:.1f}s"
  )
  ckpt_dir = out / "checkpoints"
  ckpts = checkpoint.Checkpoints(ckpt_dir, keep=run.keep_checkpoints)
  sample_fn = make_sample_fn(prompts, tokenizer)
  try:
    with trainer.StopSignals() as stop:
      model, _ = trainer.train(model, dataset, run, rt, ckpts, eval_dataset, sample_fn, stop)
  except TrainingError as e:
    reason = str(e).rstrip(".")
    raise TrainingError(f"{reason} (checkpoints saved before it are in {ckpt_dir}).") from e
  finally:
    ckpts.close()
  if run.export:
    model = distributed.local_model(model, rt.mesh)
    if distributed.is_main():
      export.write(model, run.export, out / "export", overwrite=True)
      say(f"jaxtune: exported {run.export} model to {out / 'export'}")
    distributed.barrier("jaxtune export")
  return out
