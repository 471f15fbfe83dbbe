"""The training loop: schedule, step, log, evaluate, checkpoint.

The step itself is pure and jitted (step.py); everything with side effects (logging,
checkpoints, signals, progress) lives here around it.
"""

import contextlib
import dataclasses
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jaxtune.data.rows import Dataset
from jaxtune.data.streaming import StreamingDataset
from jaxtune.errors import TrainingError
from jaxtune.parallel import distributed
from jaxtune.parallel import ring_attention as context
from jaxtune.parallel.runtime import Runtime
from jaxtune.run_config import RunConfig
from jaxtune.training import log as run_log
from jaxtune.training import plan, step

if TYPE_CHECKING:
  from jaxtune.training.checkpoint import Checkpoints


class Stopped(Exception):
  """Training stopped on SIGTERM/SIGINT after saving a checkpoint at ``step``."""

  def __init__(self, signum: int, step: int, saved: bool):
    self.signum, self.step, self.saved = signum, step, saved
    super().__init__(f"stopped by {signal.Signals(signum).name} after step {step}")


def _bad_loss_message(loss: float, grad_norm: float, step: int) -> str:
  if loss == 0.0:
    cause = (
      "no token of the batch carries a label (all masked: check --train-on-prompt and the "
      "chat roles) or the adapters have collapsed"
    )
  elif np.isfinite(loss) and not np.isfinite(grad_norm):
    cause = (
      "an overflow of the gradients (use --dtype bfloat16 or float32, or lower --learning-rate)"
    )
    return (
      f"the gradients are {grad_norm} at step {step} (loss {loss:.4f}), most likely {cause}; "
      "pass --skip-nonfinite to skip such steps instead of stopping."
    )
  else:
    cause = (
      "an overflow (lower --learning-rate, or use --dtype float32 where bfloat16/float16 overflows)"
    )
  return (
    f"the loss is {loss} at step {step}, most likely {cause}; pass --skip-nonfinite to skip "
    "such steps instead of stopping."
  )


class StopSignals:
  """While active, SIGTERM/SIGINT ask the loop to save and stop after the current step.

  A second signal stops at once (the checkpoint on disk is then the last complete one:
  orbax renames a checkpoint into place only when it is fully written).
  """

  SIGNALS = (signal.SIGTERM, signal.SIGINT)

  def __init__(self):
    self.signum: int | None = None
    self.step: int | None = None  # the step in progress (dispatched), which the loop sets
    self._previous = {}

  def __enter__(self):
    if threading.current_thread() is threading.main_thread():
      for s in self.SIGNALS:
        self._previous[s] = signal.signal(s, self._handle)
    return self

  def __exit__(self, *exc):
    for s, handler in self._previous.items():
      signal.signal(s, handler)
    self._previous = {}

  def _handle(self, signum, frame):
    if self.signum is not None:
      signal.signal(signum, signal.SIG_DFL)
      os.kill(os.getpid(), signum)
      return
    self.signum = signum
    which = "the step in progress" if self.step is None else f"step {self.step}, in progress"
    print(
      f"\njaxtune: {signal.Signals(signum).name} received; saving a checkpoint after {which}, "
      "then stopping (send it again to stop at once).",
      file=sys.stderr,
      flush=True,
    )


def _start(lora, tx, runtime: Runtime, loss_scale, checkpoints, seed: int, dataset, rollouts):
  """(lora, opt_state, key, first step): fresh, or restored from the latest checkpoint (a
  streamed dataset then seeks to where it was; GRPO's rollouts take back the rollout the next
  steps train on). A fresh start and a resumed one give the step the same placement (no
  recompile)."""
  state = {"lora": lora, "opt_state": step.init_opt_state(tx, lora, loss_scale)}
  key, start = jax.random.key(seed), 0
  where = step.placements(state, runtime)
  if checkpoints is not None:
    restored = checkpoints.restore_latest({**state, "key": key})
    if restored is not None:
      saved, start = restored
      state, key = {k: saved[k] for k in state}, saved["key"]
      if hasattr(dataset, "seek"):
        if not saved.get("data"):
          raise TrainingError(
            f"checkpoint {start} holds no stream position (written without --data-streaming); "
            "resume without --data-streaming, or start a new --out."
          )
        dataset.seek(saved["data"])
      if saved.get("rollout") is not None and rollouts is not None:
        rollouts.restore(saved["rollout"])
  state = jax.device_put(state, where)
  if runtime.mesh is not None:
    # Typed keys cannot be device_put across processes; their raw data can.
    raw = jax.device_put(jax.random.key_data(key), NamedSharding(runtime.mesh, PartitionSpec()))
    key = jax.random.wrap_key_data(raw)
  return state["lora"], state["opt_state"], key, start, where


def train(
  model: nnx.Module,
  dataset: "Dataset | StreamingDataset",
  run: RunConfig,
  runtime: Runtime,
  checkpoints: "Checkpoints | None" = None,
  eval_dataset: Dataset | None = None,
  sample_fn: Callable[[nnx.Module], list[tuple[str, str]]] | None = None,
  stop: StopSignals | None = None,
  loss_scale: step.LossScale | None = None,
  previous_steps: int | None = None,
  announce: Callable[[plan.Plan | None], None] | None = None,
  objective: step.Objective = step.sft_objective,
  rollouts: step.Rollouts | None = None,
) -> tuple[nnx.Module, list[dict]]:
  """Run the loop under ``runtime``; returns (trained model, list of per-step metrics).

  With ``eval_dataset``, held-out loss every ``run.eval_every`` steps and at the end;
  ``sample_fn(model) -> [(prompt, text)]`` adds a few generations to each evaluation. A
  float16 ``runtime.dtype`` scales the loss dynamically (``loss_scale``, default
  ``LossScale()``). With ``stop``, a SIGTERM/SIGINT saves a checkpoint after the current step
  and raises ``Stopped``. ``previous_steps``: the length of the run being resumed, when known
  (the resume line then says how its schedule changed). ``announce(plan)`` is called once
  the step is compiled, before the first step (the start line); ``announce(None)`` when no
  step is left to train. ``objective``: what the step minimises (step.Objective; default
  SFT's cross-entropy, preference.Preference for DPO/IPO/ORPO); its figures join the rows.
  ``rollouts`` (step.Rollouts): batches made from the current adapters (GRPO, rl.Rollouts)
  instead of ``dataset``'s; their figures join the rows, their state the checkpoints.
  """
  graphdef, lora, frozen = step.place(model, runtime)
  rows = HostRows(frozen, runtime) if runtime.host_embeddings else None
  if rows is not None:
    frozen = rows.frozen
  if loss_scale is None and runtime.dtype == "float16":
    loss_scale = step.LossScale()
  # The step's last argument, so that none of them is a constant of its program; on every
  # device of the mesh, as the key.
  numbers = step.optimizer_numbers(run)
  tx, _ = step.make_optimizer(run, numbers)
  learning_rate = step.host_learning_rate(run, numbers)  # rows: nothing queued on the device
  numbers = jax.device_put(
    numbers, None if runtime.mesh is None else NamedSharding(runtime.mesh, PartitionSpec())
  )
  lora, opt_state, key, start, where = _start(
    lora, tx, runtime, loss_scale, checkpoints, run.seed, dataset, rollouts
  )
  if start and distributed.is_main():
    print(_resume_line(start, run, learning_rate, previous_steps), file=sys.stderr, flush=True)
  replicated = runtime.sharding()
  out_shardings = None if replicated is None else (where["lora"], where["opt_state"], replicated)
  batch_at = runtime.sharding("accum", "batch", "length")
  eval_at = runtime.sharding("batch", "length")
  row_at = runtime.sharding("accum", "batch")  # per-row leaves (GRPO's advantages)
  figures: dict = {}

  def next_batch(i: int) -> dict[str, jax.Array]:
    """Step ``i``'s batch, placed; a rollout's figures (GRPO) go to ``figures``."""
    nonlocal figures
    if rollouts is not None:
      host, figures = rollouts(i, graphdef, lora, frozen)
    else:
      host = dataset.batch(i, run.batch_size, run.grad_accum, run.seed)
    return _place(context.zigzag_batch(host, runtime.context, 2), batch_at, row_at, rows)

  def eval_rows(host: dict) -> dict:
    """A held-out host batch [B, T] as the eval step takes it."""
    host = context.zigzag_batch(host, runtime.context, 1)
    return host if rows is None else rows.add(host)

  first = None
  if start < run.steps:
    # The step compiled for the run's real first arguments, its remat and loss chunk chosen
    # by their memory plan where the settings leave a choice (plan.py).
    first = next_batch(start)
    step_fn, chosen = plan.choose(
      lambda rt: step.make_train_step(
        graphdef, tx, rt, loss_scale, out_shardings, objective, run=run
      ),
      (lora, opt_state, frozen, first, jax.random.fold_in(key, start), numbers),
      runtime,
      plan.device_budget(runtime.memory_limit),
      logits_bytes=_logits_bytes(model, first, runtime),
      floor=lambda rt: _floor(graphdef, lora, opt_state, frozen, first, key, rt, objective),
      identity=_step_identity(graphdef, model, run, objective, loss_scale, out_shardings),
    )
    runtime = chosen.runtime
    if announce is not None:
      announce(chosen)
  elif announce is not None:
    announce(None)
  eval_step = None
  if eval_dataset is not None:
    # A forward pass saves nothing for a backward one: the scan costs it nothing, and unrolled
    # (or in two scans keeping layers' activations) it would only compile longer (unless
    # --layer-loop unrolled asks for it).
    scan = run.layer_loop != "unrolled" or runtime.scan_layers
    looped = runtime.replace(kept_layers=0, scan_layers=scan)
    eval_step = step.make_eval_step(graphdef, looped, objective)
  history, counts = [], {"skipped_steps": 0, "overflow_steps": 0}
  # The next batch is assembled while the step runs, where batches are a function of the step
  # alone; a stream's position (saved in checkpoints) must not run ahead of the steps taken.
  prefetch = not hasattr(dataset, "state") and rollouts is None
  log = run_log.RunLog(
    Path(run.out),
    run.steps,
    enabled=distributed.is_main(),
    report_to=run.report_to,
    config={**dataclasses.asdict(run), "hardware": _hardware()},
  )
  saved = start

  def save(n):
    nonlocal saved
    if checkpoints is not None and n != saved:
      data_state = dataset.state() if hasattr(dataset, "state") else None
      held = rollouts.state(n) if rollouts is not None else None
      checkpoints.save(n, {"lora": lora, "opt_state": opt_state, "key": key}, data_state, held)
      saved = n

  # Step i's figures are read (a wait for the device) after step i + 1 is dispatched, so the
  # device goes from one step to the next without waiting on the host. Steps that evaluate,
  # save or end the run are read at once, before anything is made from them, and so is a step
  # that a signal stops. GRPO's are too: its rollouts wait for the step on the device anyway,
  # and its update_s is the step's own time. With several processes the stop check
  # (distributed.any_process) waits for each step, so there the overlap is lost.
  pending = None  # (i, m, tokens, t0, rolled, t_step) of a step dispatched but not yet read
  read_at = None  # when the last step's figures came back

  def read(i, m, tokens, t0, rolled, t_step) -> dict:
    """Step ``i``'s row: its figures (waiting for them), a bad step counted or raised, logged."""
    nonlocal read_at
    # A step dispatched before the previous one was read starts when that one ends.
    row = _row(i, m, learning_rate, tokens, t0 if read_at is None else max(t0, read_at))
    read_at = time.perf_counter()
    if rollouts is not None:
      row.update(rolled, update_s=read_at - t_step)
    _count_bad_step(row, m, run, loss_scale, counts)
    history.append(row)
    if (i + 1) % run.log_every == 0 or i + 1 == run.steps:
      log.train(row)
    return row

  def read_pending() -> None:
    nonlocal pending
    if pending is not None:
      taken, pending = pending, None
      read(*taken)

  try:
    for i in range(start, run.steps):
      if stop is not None and stop.signum is not None and i > start and jax.process_count() == 1:
        # A signal that came after the last check, before this step is dispatched: stop at
        # the step the message named. (Several processes agree once a step, below.)
        read_pending()
        save(i)
        raise Stopped(stop.signum, i, checkpoints is not None)
      t0 = time.perf_counter()
      batch, first = first if first is not None else next_batch(i), None
      rolled = figures
      t_step = time.perf_counter()
      lora, opt_state, m = step_fn(
        lora, opt_state, frozen, batch, jax.random.fold_in(key, i), numbers
      )
      if stop is not None:
        stop.step = i + 1
      if prefetch and i + 1 < run.steps:  # built on the host while the device runs step i
        first = next_batch(i + 1)
      read_pending()
      last = i + 1 == run.steps
      sampling_only = eval_step is None and rollouts is not None and sample_fn is not None
      due = last or (run.eval_every and (i + 1) % run.eval_every == 0)
      evaluating = (eval_step is not None or sampling_only) and due
      saving = checkpoints is not None and ((i + 1) % run.save_every == 0 or last)
      taken = (i, m, int(np.prod(batch["input_ids"].shape)), t0, rolled, t_step)
      if rollouts is None and not (last or evaluating or saving):
        pending = taken  # read while step i + 1 runs
      else:
        row = read(*taken)
        if evaluating:
          metrics = {}
          if eval_step is not None:
            metrics = step.evaluate(
              eval_step, lora, frozen, eval_dataset, run.batch_size, eval_at, eval_rows
            )
          samples = []
          if sample_fn is not None:
            whole = frozen if rows is None else rows.restore(frozen)
            local = distributed.local_copy((lora, whole), runtime.mesh)
            samples = sample_fn(nnx.merge(graphdef, *local)) if distributed.is_main() else []
          log.eval(i + 1, metrics, samples)
          row.update(metrics)
        if saving:
          save(i + 1)
      if stop is not None and not last and distributed.any_process(stop.signum is not None):
        read_pending()  # a bad step raises here, before its checkpoint
        save(i + 1)
        raise Stopped(stop.signum or signal.SIGTERM, i + 1, checkpoints is not None)
  except BaseException:
    with contextlib.suppress(Exception):  # the step before the failure's row, where readable
      read_pending()
    raise
  finally:
    log.close()
  if rows is not None:
    frozen = rows.restore(frozen)
  trained = nnx.merge(graphdef, lora, frozen)
  step.drop_kernel_operands(trained)  # the run's copies of the codes (step.kernel_operands)
  return trained, history


class HostRows:
  """``--embeddings host``: the input embedding table moved to host memory (its place in the
  frozen state holds an empty array on the devices, which the step never reads) and each
  batch's rows gathered from it there, as ``inputs_embeds``.

  The table's device buffer is freed: the model given to ``train`` no longer holds it (the
  model ``train`` returns does)."""

  def __init__(self, frozen: nnx.State, runtime: Runtime):
    table = frozen["embed_tokens"]["embedding"][...]
    self._sharding = table.sharding
    self.table = np.asarray(distributed.local_copy(table, runtime.mesh))
    mesh = runtime.mesh
    empty = np.zeros((0, table.shape[1]), table.dtype)
    where = NamedSharding(mesh, PartitionSpec()) if mesh is not None else self._sharding
    self.frozen = self._with(frozen, jax.device_put(empty, where))
    table.delete()

  def add(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The host batch with the embedding rows of its ``input_ids`` ([..., T] -> [..., T, D])."""
    return {**batch, "inputs_embeds": self.table[batch["input_ids"]]}

  def restore(self, frozen: nnx.State) -> nnx.State:
    """``frozen`` with the whole table back on the devices."""
    return self._with(frozen, distributed.global_batch(self.table, self._sharding))

  @staticmethod
  def _with(frozen: nnx.State, table: jax.Array) -> nnx.State:
    frozen = jax.tree.map(lambda x: x, frozen)  # new containers, the same arrays
    variable = frozen["embed_tokens"]["embedding"]
    frozen["embed_tokens"]["embedding"] = variable.replace(table)
    return frozen


def _floor(graphdef, lora, opt_state, frozen, batch, key, runtime: Runtime, objective) -> int:
  """A floor of the step's plan under ``runtime`` (plan.floor_bytes), traced for its first
  micro-batch."""
  micro = jax.tree.map(lambda x: x[0], batch)
  loss = lambda p: objective(graphdef, p, frozen, micro, key, runtime)[0]  # noqa: E731
  return plan.floor_bytes(loss, lora, (lora, opt_state, frozen, batch))


# Run settings that never reach the step's program (where data comes from, what is kept and
# reported, and the optimizer's numbers: the step's argument, step.optimizer_numbers); every
# other one is part of the step store's key (plan.choose's identity).
_NOT_IN_STEP = frozenset(
  "out data data_config data_split data_format data_columns data_streaming long_examples "
  "eval_data eval_data_split eval_every eval_prompts log_every report_to save_every "
  "keep_checkpoints export gguf_type push_to_hub hub_private "
  "steps epochs learning_rate warmup_steps weight_decay max_grad_norm".split()
)


def _step_identity(
  graphdef, model, run: RunConfig, objective, loss_scale, out_shardings
) -> str | None:
  """What decides the training step's program besides its arguments and runtime, as text:
  the step store's key (plan.choose). An objective is named by its fields (a dataclass) or,
  for a function of this package (whose source is in the key), its name; None (the step is
  not stored) for a function from elsewhere, whose code the key would not see."""
  settings = {k: v for k, v in dataclasses.asdict(run).items() if k not in _NOT_IN_STEP}
  if dataclasses.is_dataclass(objective):
    what = repr(objective)
  elif getattr(objective, "__module__", "").startswith("jaxtune."):
    what = f"{objective.__module__}.{objective.__qualname__}"
  else:
    return None
  text = repr((graphdef, model.config, settings, what, loss_scale, out_shardings))
  return None if " at 0x" in text else text  # an object named by its address: no stable key


def _logits_bytes(model: nnx.Module, batch: dict, runtime: Runtime) -> int:
  """The float32 logits of one micro-batch on one device (its rows' share of a context
  group's tokens)."""
  _, micro, length = batch["input_ids"].shape
  return micro * length * model.config.vocab_size * 4 // (runtime.size("data") * runtime.context)


def _place(host: dict, batch_at, row_at, rows=None) -> dict[str, jax.Array]:
  """A host batch placed as the step takes it: [accum, micro, T] leaves (with ``rows``, a
  HostRows, also their embedding rows [accum, micro, T, D]), [accum, micro] per-row ones."""
  if rows is not None:
    host = rows.add(host)
  return {
    k: distributed.global_batch(v, row_at if v.ndim == 2 else batch_at) for k, v in host.items()
  }


def _resume_line(start: int, run: RunConfig, learning_rate, previous_steps: int | None) -> str:
  """ "resuming from step N of M", and where the learning-rate schedule continues."""
  line = f"jaxtune: resuming from step {start} of {run.steps}"
  if start >= run.steps:
    return line + "; nothing left to train."
  lr = learning_rate(start)
  line += f"; the {run.schedule} schedule continues at learning rate {lr:.3g}"
  if previous_steps is not None and previous_steps != run.steps:
    before = step.host_learning_rate(run.replace(steps=previous_steps))
    line += (
      f" (the run was for {previous_steps} steps, where step {start + 1} had "
      f"{before(start):.3g}: the schedule now spans {run.steps} steps)"
    )
  return line + "."


def _hardware() -> str:
  return f"{jax.device_count()} x {jax.devices()[0].device_kind}"


# What a step returns beside its figures (the objective's, e.g. DPO's rewards).
_STEP_KEYS = ("loss", "grad_norm", "tokens", "good", "scale_skip", "loss_scale")


def _row(i: int, m: dict, learning_rate, tokens: int, t0: float) -> dict:
  loss = float(m["loss"])  # waits for the step
  return {
    "step": i + 1,
    "loss": loss,
    "lr": learning_rate(i),
    "grad_norm": float(m["grad_norm"]),
    "tokens": int(m["tokens"]),  # trained: those the loss is on
    "processed_tokens": tokens,  # every position of the batch, padding and prompts too
    "tokens_per_s": tokens / (time.perf_counter() - t0),  # processed
    **{k: float(v) for k, v in m.items() if k not in _STEP_KEYS},
  }


def _count_bad_step(row: dict, m: dict, run: RunConfig, loss_scale, counts: dict) -> None:
  """Stop on a bad step (or count it with --skip-nonfinite); count loss-scale overflows."""
  if loss_scale is not None and bool(m["scale_skip"]):
    counts["overflow_steps"] += 1
  elif not bool(m["good"]):
    if not run.skip_nonfinite:
      raise TrainingError(_bad_loss_message(row["loss"], row["grad_norm"], row["step"]))
    counts["skipped_steps"] += 1
  if run.skip_nonfinite:
    row["skipped_steps"] = counts["skipped_steps"]
  if loss_scale is not None:
    row["loss_scale"] = float(m["loss_scale"])
    row["overflow_steps"] = counts["overflow_steps"]
