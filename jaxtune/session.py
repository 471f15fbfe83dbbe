"""One training run end to end: resolve inputs, load, shard, train, checkpoint, export.

Kept apart from train.py (argument parsing) so tests and scripts can call it directly.
Every input is checked before the model is loaded, and nothing is written to the run
directory until the model has loaded, so a bad input leaves no half-made run behind.
"""

import logging
import time
from pathlib import Path

import jax
from flax import nnx

from converters.hf_in import CheckpointError
from jaxtune.config import ConfigError
from jaxtune.data import DataError
from jaxtune.mesh import MeshError
from jaxtune.run_config import RunConfig, RunConfigError

log = logging.getLogger("jaxtune")


class UserError(Exception):
  """Anything the user can fix; its message is one sentence saying how."""


def say(line: str) -> None:
  """One line for the user, from process 0 only."""
  if jax.process_index() == 0:
    print(line, flush=True)


def load_tokenizer(ckpt: Path):
  try:
    from transformers import AutoTokenizer
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


def compute_dtype(requested: str, devices) -> tuple[str, str | None]:
  """(dtype to train in, a line saying why it differs from ``requested``, or None).

  GPUs before compute capability 8.0 (V100, T4) have no bfloat16: train in float16 with
  dynamic loss scaling there.
  """
  if requested != "bfloat16":
    return requested, None
  for d in devices:
    cc = getattr(d, "compute_capability", None)
    if d.platform == "gpu" and cc is not None and float(cc) < 8.0:
      return "float16", (
        f"jaxtune: {d.device_kind} (compute capability {cc}) has no bfloat16; "
        "training in float16 with dynamic loss scaling."
      )
  return requested, None


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
  try:
    run = RunConfig.from_yaml(run_dir / "config.yaml").checked()
  except RunConfigError as e:
    raise UserError(f"{run_dir}/config.yaml: {e}") from e
  # float16 runs keep their loss scale in the optimizer state: restore it in that form.
  loss_scale = trainer.LossScale() if run.dtype == "float16" else None
  if quantization is not ...:
    run = run.replace(quantization=quantization)
  if dtype is not None:
    run = run.replace(dtype=dtype)
  if not has_checkpoints(run_dir / "checkpoints"):
    raise UserError(f"{run_dir}/checkpoints holds no checkpoint; train first.")
  try:
    model = build_model(run, run.model)
  except (CheckpointError, ConfigError) as e:
    raise UserError(str(e)) from e
  ckpts = checkpoint.Checkpoints(run_dir / "checkpoints", read_only=True)
  graphdef, lora, frozen = trainer.place(model, None)
  tx, _ = trainer.make_optimizer(run)
  opt_state = trainer.init_opt_state(tx, lora, loss_scale)
  target = {"lora": lora, "opt_state": opt_state, "key": jax.random.key(0)}
  try:
    state, step = ckpts.restore_latest(target)
  except checkpoint.RestoreError as e:
    raise UserError(str(e)) from e
  finally:
    ckpts.close()
  return trainer.nnx.merge(graphdef, state["lora"], frozen), step


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


def has_checkpoints(ckpt_dir: Path) -> bool:
  """Whether a run's checkpoints/ holds a step (orbax names them by number)."""
  return ckpt_dir.is_dir() and any(p.name.isdigit() for p in ckpt_dir.iterdir())


# Settings a resumed run must share with the run that wrote the checkpoints.
_RESUME_KEYS = ("model", "lora_rank", "lora_targets")


def check_resume(run: RunConfig, out: Path, model_path: Path | None, resume: bool) -> None:
  """--resume needs checkpoints; a new run must not write over them."""
  ckpt_dir = out / "checkpoints"
  has_ckpts = has_checkpoints(ckpt_dir)
  if not resume:
    if has_ckpts:
      raise UserError(
        f"{out} already holds checkpoints; pass --resume to continue, or a new --out."
      )
    return
  if not has_ckpts:
    raise UserError(f"--resume: {ckpt_dir} holds no checkpoint; start without --resume.")
  saved_yaml = out / "config.yaml"
  if not saved_yaml.is_file():
    return
  try:
    saved = RunConfig.from_yaml(saved_yaml).checked()
  except RunConfigError:
    return  # the checkpoint's own shapes are checked when it is restored
  now = run.replace(model=str(model_path))
  for key in _RESUME_KEYS:
    a, b = getattr(saved, key), getattr(now, key)
    if key == "model":
      a, b = str(Path(a).resolve()), str(Path(b).resolve())
    if a != b:
      shown = lambda v: ",".join(v) if isinstance(v, tuple) else v  # noqa: E731
      raise UserError(
        f"--resume: the checkpoints in {out} were trained with {key} {shown(a)}, not "
        f"{shown(b)}; resume with the same {key}, or start a new --out."
      )


def check_targets(run: RunConfig, cfg) -> None:
  known = (*cfg.linear_shapes(), "lm_head")
  unknown = [t for t in run.lora_targets if t not in known]
  if unknown:
    which = "which is not a projection" if len(unknown) == 1 else "which are not projections"
    raise UserError(
      f"--lora-targets names {','.join(unknown)}, {which} of this {cfg.model_type}; "
      f"choose from {','.join(known)}."
    )


def run_training(run: RunConfig, resume: bool = False) -> Path:
  import jaxtune
  from converters.hf_in import resolve_checkpoint
  from jaxtune import checkpoint, data, default_model, distributed, export, sharding, trainer
  from jaxtune import mesh as meshlib

  try:
    run = run.checked()
  except RunConfigError as e:
    raise UserError(str(e)) from e
  out = Path(run.out)
  if run.batch_size % run.grad_accum:
    raise UserError(
      f"--batch-size {run.batch_size} must be a multiple of --grad-accum {run.grad_accum}."
    )
  try:
    mesh = meshlib.make_mesh(run.mesh)
    model_path = (
      resolve_checkpoint(run.model) if run.model else default_model.ensure_default_checkpoint()
    )
    check_resume(run, out, model_path, resume)
    cfg = jaxtune.ModelConfig.from_hf(model_path)
    meshlib.check_model_fits(
      mesh, cfg.num_heads, cfg.num_kv_heads, run.batch_size // run.grad_accum, cfg.num_layers
    )
    if run.sequence_parallel and not sharding.can_split_sequence(mesh, run.seq_len):
      tp, pp = mesh.shape["tensor"], mesh.shape.get("pipe", 1)
      raise UserError(
        f"--sequence-parallel splits each row's tokens over the tensor axis, but --mesh "
        f"{run.mesh or jax.device_count()} has tensor={tp}, pipe={pp} for --seq-len "
        f"{run.seq_len}; use a tensor axis > 1 that divides --seq-len and no pipe axis, or "
        "drop the flag."
      )
    if run.seq_len > cfg.max_position_embeddings:
      raise UserError(
        f"--seq-len {run.seq_len} is longer than the {cfg.max_position_embeddings} positions "
        f"this {cfg.model_type} was trained for (max_position_embeddings); lower --seq-len."
      )
    check_targets(run, cfg)
    tokenizer = load_tokenizer(model_path)
    dataset = data.load_jsonl(
      run.data or default_model.DATASET, tokenizer, run.seq_len, run.train_on_prompt, run.packing
    )
    eval_dataset = None
    if run.eval_data:
      eval_dataset = data.load_jsonl(
        run.eval_data, tokenizer, run.seq_len, run.train_on_prompt, run.packing
      )
    sample_fn = make_sample_fn(run, tokenizer)
    dtype, why = compute_dtype(run.dtype, jax.local_devices())
    if why:
      say(why)
      run = run.replace(dtype=dtype)
    if mesh.shape.get("pipe", 1) > 1:
      from jaxtune import pipeline

      if run.attention in ("fused", "pallas"):
        kind = "cuDNN" if run.attention == "fused" else "the Mosaic GPU kernel"
        raise UserError(
          f"--attention {run.attention} ({kind}) cannot run inside the pipeline yet; use "
          "--attention xla with a pipe axis in --mesh."
        )
      plan = pipeline.plan(mesh, cfg.num_layers, run.batch_size // run.grad_accum, run.microbatches)
      say(
        f"pipeline: {plan.stages} stages of {plan.layers_per_stage} layers, "
        f"{plan.microbatches} micro-batches per step, expected bubble {plan.bubble:.0%}"
      )
    if run.attention == "fused" and (dataset.packed or (eval_dataset and eval_dataset.packed)):
      raise UserError(
        "--attention fused (cuDNN, causal only) would let packed examples attend to each other; "
        "use --attention pallas or xla, or --no-packing."
      )
    t_load = time.perf_counter()
    model = build_model(run, model_path, mesh)
    jax.block_until_ready(nnx.state(model))
    load_s = time.perf_counter() - t_load
  except (MeshError, CheckpointError, ConfigError, DataError, ValueError) as e:
    raise UserError(str(e)) from e
  if distributed.is_main():
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / "config.yaml.tmp"
    tmp.write_text(run.replace(model=str(model_path)).to_yaml())
    tmp.replace(out / "config.yaml")
  distributed.barrier("jaxtune run directory")
  # Resolved here so the start line can name it; trainer.train would pick the same.
  local = mesh if mesh.size > 1 else None
  run = run.replace(attention=trainer.resolve_attention(run, model, local, dataset, eval_dataset))
  say(
    f"jaxtune: {cfg.model_type} {cfg.num_layers} layers, {dataset.examples} examples in "
    f"{len(dataset)} rows of {run.seq_len} tokens ({dataset.packing_efficiency:.0%} tokens, "
    f"{'packed' if run.packing else 'not packed'}), "
    f"mesh {dict(mesh.shape)} on {jax.device_count()} {jax.devices()[0].platform} device(s)"
    + (f" in {jax.process_count()} processes" if jax.process_count() > 1 else "")
    + f"; attention {run.attention}, remat {run.remat}; loaded in {load_s:.1f}s"
  )
  ckpt_dir = out / "checkpoints"
  ckpts = checkpoint.Checkpoints(ckpt_dir, keep=run.keep_checkpoints)
  try:
    with trainer.StopSignals() as stop:
      model, _ = trainer.train(
        model,
        dataset,
        run,
        mesh if mesh.size > 1 else None,
        ckpts,
        eval_dataset,
        sample_fn,
        stop=stop,
      )
  except trainer.TrainingError as e:
    reason = str(e).rstrip(".")
    raise UserError(f"{reason} (checkpoints saved before it are in {ckpt_dir}).") from e
  except (checkpoint.SaveError, checkpoint.RestoreError) as e:
    raise UserError(str(e)) from e
  finally:
    ckpts.close()
  if run.export:
    model = export.local_model(model, mesh)
    if distributed.is_main():
      export.write(model, run.export, out / "export", overwrite=True)
      say(f"jaxtune: exported {run.export} model to {out / 'export'}")
    distributed.barrier("jaxtune export")
  return out
