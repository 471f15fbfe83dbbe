"""One training run end to end: check inputs, resolve the runtime, load, train, export.

Kept apart from train.py (argument parsing) so tests and scripts can call it directly.
Every input is checked before the model is loaded, and nothing is written to the run
directory until the model has loaded, so a bad input leaves no half-made run behind.
"""

import contextlib
import dataclasses
import math
import time
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any, NamedTuple

import jax
from flax import nnx

from converters import hub, model_card
from jaxtune.data import rows as data_lib
from jaxtune.data import streaming
from jaxtune.data import tokenize as data_tokenize
from jaxtune.errors import TrainingError, UserError
from jaxtune.hf import export
from jaxtune.hf.adapters import lora_settings
from jaxtune.hf.load import resolve_checkpoint
from jaxtune.models.config import ModelConfig
from jaxtune.models.decoding import generate
from jaxtune.models.lora import parse_pattern
from jaxtune.parallel import distributed
from jaxtune.parallel.runtime import NO_WORD_CODES, Decode
from jaxtune.run import checks, default_model, run_dir
from jaxtune.run import report as run_report
from jaxtune.run import resolve as resolver
from jaxtune.run.loading import build_model, load_tokenizer
from jaxtune.run_config import RunConfig
from jaxtune.training import checkpoint, objective, plan, preference, rewards, rl, step
from jaxtune.training import loop as trainer
from jaxtune.training.files import write_error


def say(line: str) -> None:
  """One line for the user, from process 0 only."""
  if jax.process_index() == 0:
    print(line, flush=True)


def make_sample_fn(
  prompts: list[str], tokenizer: Any, decode: Decode = NO_WORD_CODES
) -> Callable[[nnx.Module], list[tuple[str, str]]] | None:
  """model -> [(prompt, greedy completion)] for --eval-prompts, or None; ``decode``: how they
  generate (the run's ``Plan.decode``)."""
  if not prompts:
    return None
  chat = getattr(tokenizer, "chat_template", None) is not None

  def sample(model):
    texts = generate(model, tokenizer, prompts, max_new_tokens=64, chat=chat, decode=decode)
    return list(zip(prompts, texts, strict=True))

  return sample


def _load_data(run: RunConfig, tokenizer, positions: int, data: Any, eval_data: Any):
  """(training rows, held-out rows or None, report); ``data``/``eval_data`` stand for
  run.data/run.eval_data when given as objects (jaxtune.train); ``positions``: the longest
  row the model (and on CPUs, the laptop's cap) allows."""
  data = run.data or default_model.DATASET if data is None else data
  eval_data = run.eval_data if eval_data is None else eval_data
  if run.method == "grpo":  # prompts; completions come from the model as it trains
    prompts = rl.Prompts(
      data, tokenizer, seq_len=run.seq_len, max_new_tokens=run.max_new_tokens,
      max_positions=positions, config=run.data_config, split=run.data_split,
      columns=run.data_columns,
    )  # fmt: skip
    return prompts, None, prompts
  settings = data_tokenize.DataSettings(
    seq_len=run.seq_len,
    data_format=run.data_format,
    columns=run.data_columns,
    config=run.data_config,
    split=run.data_split,
    train_on_prompt=run.train_on_prompt,
    pack=run.packing,
    long_examples=run.long_examples,
    max_positions=positions,
    eval_split=run.eval_split or 0.0,
    seed=run.seed,
  )
  if run.data_streaming:
    dataset = streaming.StreamingDataset(data, tokenizer, settings)
    held_out, report = None, dataset.report
  else:
    dataset, held_out, report = data_tokenize.load(data, tokenizer, settings)
  checks.check_method_data(run, report.format, report.name)
  if eval_data is not None:
    # Held-out data is read as the training data is, at its sequence length; from the
    # "test" split when it is the training source itself, else from "train".
    split = run.eval_data_split or ("test" if eval_data == data else "train")
    held = dataclasses.replace(settings, seq_len=dataset.seq_len, split=split, eval_split=0.0)
    held_out, _, held_report = data_tokenize.load(eval_data, tokenizer, held)
    checks.check_method_data(run, held_report.format, held_report.name, "--eval-data")
  return dataset, held_out, report


def make_objective(
  run: RunConfig,
  dataset: data_lib.Dataset,
  eval_dataset: data_lib.Dataset | None,
  cfg: ModelConfig | None = None,
) -> step.Objective:
  """What the run minimises: SFT's cross-entropy (with a mixture of experts' load-balancing
  loss, ``cfg`` being one), GRPO's clipped objective, or the preference objective of
  --method, sized for the most examples a row of either dataset holds."""
  if run.method == "sft":
    if cfg is not None and cfg.is_moe:
      coef = run.router_aux_loss_coef
      return objective.SFT(cfg.router_aux_loss_coef if coef is None else coef)
    return step.sft_objective
  if run.method == "grpo":
    return rl.GRPO.from_run(run)
  segments = max(dataset.max_segments, eval_dataset.max_segments if eval_dataset else 0)
  return preference.Preference.from_run(run, segments)


def _steps(run: RunConfig, dataset) -> int:
  """--steps, or the steps of --epochs (default one) over the dataset's rows (GRPO: over its
  prompts, --num-iterations steps per rollout)."""
  if run.steps is not None:
    return run.steps
  steps = max(1, math.ceil((run.epochs or 1.0) * len(dataset) / run.batch_size))
  return steps * run.num_iterations if run.method == "grpo" else steps


def _write_config(run: RunConfig, out: Path) -> None:
  """OUT/config.yaml: the run config as it runs (written by process 0, atomically)."""
  if distributed.is_main():
    tmp = out / "config.yaml.tmp"
    try:
      tmp.write_text(run.to_yaml())
      tmp.replace(out / "config.yaml")
    except OSError as e:
      tmp.unlink(missing_ok=True)
      raise write_error(out / "config.yaml", e) from e
  distributed.barrier("jaxtune run directory")


def _setting_text(value: Any) -> str:
  """A setting as the command line spells it (None: none; a tuple: comma-separated)."""
  if value is None:
    return "none"
  if isinstance(value, tuple | list):
    return ",".join(map(str, value))
  return str(value)


def _check_resumed_data(
  ckpt_dir: Path, fingerprint: str, name: str, previous: checks.Resume, allow_changes: bool
) -> None:
  """--resume on data whose tokens differ from those the latest checkpoint trained on (a file
  changed in place, another tokenizer or format): refused, or with --allow-changes continued
  and listed among the changes."""
  ckpts = checkpoint.Checkpoints(ckpt_dir, read_only=True)
  try:
    saved = ckpts.saved_data_fingerprint()
  finally:
    ckpts.close()
  if saved is None or saved[1] == fingerprint:
    return
  if not allow_changes:
    raise UserError(
      f"--resume: the data {name} is not what checkpoint {saved[0]} in {ckpt_dir} trained on "
      "(its tokens differ: the file changed, or its tokenizer, format or layout did); resume "
      "with that data, or pass --allow-changes to continue on this data."
    )
  previous.changes["data content"] = (saved[1], fingerprint)


def _start_header(resume: bool, previous: checks.Resume, allow_changes: bool) -> str:
  """The comment atop this start's config-history file: when, and what changed."""
  when = time.strftime("%Y-%m-%d %H:%M:%S")
  if not resume:
    return f"started {when}"
  lines = [f"resumed {when}" + (" with --allow-changes" if allow_changes else "")]
  for key, (was, now) in previous.changes.items():
    lines.append(f"changed {key}: {was!r} -> {now!r}")
  return "\n".join(lines)


def _needs_room(run: RunConfig, cfg: ModelConfig, resume: bool) -> dict:
  """What the run will write, in bytes, from its settings alone (before anything loads): its
  checkpoints (adapters and two Adam moments, all float32, stored at the largest rank; ``keep``
  of them, one for a resumed run, which has the others already) and the export."""
  shapes = {**cfg.linear_shapes(), "lm_head": (cfg.vocab_size, cfg.hidden_size)}
  rank = max([run.lora_rank, *parse_pattern(run.lora_rank_pattern).values()])
  experts = max(cfg.num_experts, 1)  # a mixture of experts' MLP: an adapter per expert
  per_layer = sum(
    rank * sum(shapes[t]) * (experts if t in ("gate_proj", "up_proj", "down_proj") else 1)
    for t in run.lora_targets
    if t != "lm_head"
  )
  lora = cfg.num_layers * per_layer
  if "lm_head" in run.lora_targets:
    lora += rank * sum(shapes["lm_head"])
  one = 3 * 4 * lora
  needs = {"checkpoints": one * (1 if resume else run.keep_checkpoints)}
  if run.export:
    needs["the export"] = export.estimated_bytes(run.export, cfg.num_params(), lora, run.gguf_type)
  return needs


class Trained(NamedTuple):
  """What a run leaves: its directory and the trained model (adapters applied, on this host)."""

  run_dir: Path
  model: nnx.Module


def run_training(
  run: RunConfig,
  resume: bool = False,
  data: Any = None,
  eval_data: Any = None,
  command: str | None = None,
  allow_changes: bool = False,
  given: Collection[str] | None = None,
) -> Trained:
  """Train as ``run`` says (``resume``: from OUT/checkpoints); returns (OUT, model).

  ``data``/``eval_data``: examples given as objects (a datasets.Dataset, an iterable of dicts)
  in place of run.data/run.eval_data. ``command``: how the run was started, for the model card.
  ``allow_changes``: resume even where the settings differ from the saved run's.
  ``given``: the settings the user gave (None: those that differ from RunConfig's defaults);
  on a CPU-only machine the others of CPU_DEFAULTS are the laptop's (said on the start line).
  One run at a time holds OUT (``run_dir.Lock``).
  """
  run, laptop = _cpu_defaults(run.checked(), given)
  checks.check_data_settings(run, given=data is not None)
  checks.check_export_settings(run)
  checks.check_report_to(run)
  if run.method == "grpo":
    rewards.load(run.reward)  # an unimportable reward is refused before anything is written
  out = Path(run.out)
  run_dir.check_place(out, run.export)
  model_path = (
    resolve_checkpoint(run.model) if run.model else default_model.ensure_default_checkpoint()
  )
  if run.init_adapter:  # its LoRA settings are the run's (checked, recorded in config.yaml)
    run = run.replace(**lora_settings(run.init_adapter, model_path))
  lock = run_dir.Lock(out, command) if distributed.is_main() else contextlib.nullcontext()
  with lock:
    if isinstance(lock, run_dir.Lock) and lock.took_over:
      say(f"jaxtune: took over {out} from a run that is no longer running ({lock.took_over})")
    previous = checks.check_resume(run, out, model_path, resume, allow_changes)
    return _run_locked(
      previous, resume, model_path, data, eval_data, command, allow_changes, laptop
    )


# A real model's settings on a machine without an accelerator, where the user set none of
# them: RunConfig's are sized for a GPU (SmolLM2-135M, 40 steps: a 35-minute first ETA on a
# laptop); these make a step a few seconds there (README, "Try it on a laptop"): two rows a
# device, and rows of at most CPU_SEQ_LEN tokens where the length is chosen from the data.
CPU_ROWS_PER_DEVICE, CPU_SEQ_LEN = 2, 256


def _cpu_defaults(run: RunConfig, given: Collection[str] | None) -> tuple[RunConfig, str]:
  """(run, note for the start line): the CPU's batch, and its cap on the chosen seq-len
  (``run.seq_len`` None: ``cpu_seq_cap``), for what ``given`` leaves unset, when a real model
  trains on CPUs alone."""
  if run.model is None or jax.default_backend() != "cpu":
    return run, ""
  if given is None:
    given = {f.name for f in dataclasses.fields(run) if getattr(run, f.name) != f.default}
  notes = []
  batch = CPU_ROWS_PER_DEVICE * jax.device_count()
  if "batch_size" not in given and run.grad_accum == 1 and batch < run.batch_size:
    run = run.replace(batch_size=batch).checked()
    notes.append(f"--batch-size {batch}")
  if "seq_len" not in given and run.seq_len is None and run.method != "grpo":
    # (GRPO's rows are its prompts and --max-new-tokens: the completions' length decides)
    notes.append(f"--seq-len at most {CPU_SEQ_LEN}")
  if not notes:
    return run, ""
  return run, f" (CPU only: {', '.join(notes)}; set them to override)"


def cpu_seq_cap(run: RunConfig, laptop: str) -> int | None:
  """The cap _cpu_defaults noted on the chosen seq-len, or None."""
  return CPU_SEQ_LEN if "--seq-len at most" in laptop and run.seq_len is None else None


def _run_locked(
  previous: checks.Resume,
  resume: bool,
  model_path: Path,
  data: Any,
  eval_data: Any,
  command: str | None,
  allow_changes: bool,
  laptop: str = "",
) -> Trained:
  t_start = time.perf_counter()
  run, out = previous.run, Path(previous.run.out)
  read = ModelConfig.read_hf(model_path)  # config.json, read once for the run
  cfg = read[0]
  checks.check_targets(run, cfg)
  if distributed.is_main():
    run_dir.check_room(out, _needs_room(run, cfg, resume))
  has_eval = eval_data is not None or bool(run.eval_split) or run.method == "grpo"
  prompts = checks.read_eval_prompts(run, has_eval=has_eval)
  grpo = run.method == "grpo"
  # GRPO's step trains on batch-size prompts x num-generations rows.
  per_step = run.batch_size * run.num_generations if grpo else run.batch_size
  resolver.check(run.replace(batch_size=per_step), cfg)  # before the data: no tokenizing
  tokenizer = load_tokenizer(model_path)
  checks.check_vocabulary(tokenizer, cfg, model_path)
  positions = min(cfg.max_position_embeddings, cpu_seq_cap(run, laptop) or 1 << 62)
  dataset, eval_dataset, report = _load_data(run, tokenizer, positions, data, eval_data)
  # (A stream has none: its position is checked where it seeks.)
  fingerprint = dataset.fingerprint() if hasattr(dataset, "fingerprint") else None
  if resume and fingerprint is not None:
    _check_resumed_data(out / "checkpoints", fingerprint, report.name, previous, allow_changes)
  run = run.replace(seq_len=dataset.seq_len, steps=_steps(run, dataset))
  packed = getattr(dataset, "packed", False) or (eval_dataset is not None and eval_dataset.packed)
  summary = resolver.DataSummary(packed=packed)
  the_plan = resolver.resolve(run.replace(batch_size=per_step), cfg, summary)
  rt = the_plan.runtime
  t_load = time.perf_counter()
  model = build_model(run, model_path, rt.mesh, dtype=rt.dtype, config_read=read)
  jax.block_until_ready(nnx.state(model))
  load_s = time.perf_counter() - t_load
  recorded = run.replace(model=str(model_path), dtype=rt.dtype)

  def record_start() -> None:
    """config.yaml, the config history and the run's info: written once the step compiled
    and fits (a refusal there, such as a plan that does not fit, leaves OUT as it was: a
    resumed run's config.yaml still describes its checkpoints)."""
    _write_config(recorded, out)
    if distributed.is_main():
      header = _start_header(resume, previous, allow_changes)
      run_dir.record_start(out, recorded.to_yaml(), header)
      hardware = f"{jax.device_count()} x {jax.devices()[0].device_kind}"
      given = run.data if data is None else f"a {type(data).__name__} given from Python"
      model_card.write_run_info(out, command or _python_command(run), run.model, given, hardware)

  if previous.changes and resume:
    changed = ", ".join(
      f"{k} {_setting_text(v[0])} -> {_setting_text(v[1])}" for k, v in previous.changes.items()
    )
    say(f"jaxtune: resuming with changed settings: {changed}")
  say(f"jaxtune: {report.line()}")
  rows = "" if run.data_streaming else f"{len(dataset)} rows of {run.seq_len} tokens, "
  epochs = (
    "" if run.data_streaming else f" ({run.steps * run.batch_size / len(dataset):.2g} epochs)"
  )
  fill = (
    f"{run.batch_size} prompts x {run.num_generations} completions of up to "
    f"{run.max_new_tokens} tokens a step (rows of {run.seq_len}), "
    if grpo
    else f"{rows}{dataset.packing_efficiency:.0%} tokens "
    f"({'packed' if run.packing else 'not packed'}), "
  )
  if grpo:
    epochs = f" ({run.steps * run.batch_size / run.num_iterations / len(dataset):.2g} epochs)"
  shape = (
    f"jaxtune: {cfg.model_type} {cfg.num_layers} layers, {fill}"
    f"{run.steps} steps{epochs}, "
    + (f"{run_report.method(run)}, " if run.method != "sft" else "")
    + f"mesh {rt.mesh_shape} on {jax.device_count()} {jax.devices()[0].platform} device(s)"
    + laptop
    + (f" in {jax.process_count()} processes" if jax.process_count() > 1 else "")
  )

  def announce(chosen: plan.MemoryPlan | None) -> None:
    """The start line, once the step is compiled: the settings it runs with and their plan."""
    record_start()
    if chosen is None:
      say(f"{shape}; {rt.describe()}; loaded in {load_s:.1f}s")
      return
    cached = " (from the compilation cache)" if chosen.from_cache else ""
    say(
      f"{shape}; {chosen.runtime.describe(chosen.note())}; loaded in {load_s:.1f}s, "
      f"compiled in {chosen.compile_s:.1f}s{cached}"
    )

  ckpt_dir = out / "checkpoints"
  ckpts = checkpoint.Checkpoints(ckpt_dir, keep=run.keep_checkpoints, data_fingerprint=fingerprint)
  sample_fn = make_sample_fn(prompts, tokenizer, the_plan.decode)
  was_steps = previous.saved.steps if previous.saved is not None else None
  try:
    with trainer.StopSignals() as stop:
      model, history = trainer.train(
        model,
        dataset,
        run,
        the_plan,
        ckpts,
        eval_dataset,
        sample_fn,
        stop,
        previous_steps=was_steps,
        announce=announce,
        objective=make_objective(run, dataset, eval_dataset, cfg),
        rollouts=rl.Rollouts(dataset, tokenizer, run, rt, the_plan.decode) if grpo else None,
      )
  except TrainingError as e:
    reason = str(e).rstrip(".")
    raise TrainingError(f"{reason} (checkpoints saved before it are in {ckpt_dir}).") from e
  finally:
    ckpts.close()
  model = distributed.local_model(model, rt.mesh)
  if run.export:
    if distributed.is_main():
      card = model_card.render(out, run.export)
      export.write(
        model,
        run.export,
        out / "export",
        overwrite=True,
        gguf_type=run.gguf_type,
        card=card,
        merge_into=run.merge_into,
      )
      say(f"jaxtune: exported {run.export} model to {out / 'export'}")
      if run.push_to_hub:
        url = hub.push(out / "export", run.push_to_hub, private=run.hub_private)
        say(f"jaxtune: pushed the export to {url}")
    distributed.barrier("jaxtune export")
  say(run_report.summary(history, t_start, out, run))
  return Trained(out, model)


def _python_command(run: RunConfig) -> str:
  changed = {
    k: v for k, v in dataclasses.asdict(run).items() if v != getattr(RunConfig(), k) and k != "out"
  }
  return f"jaxtune.train({changed!r})"
