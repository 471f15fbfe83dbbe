"""The training loop: schedule, step, log, evaluate, checkpoint.

The step itself is pure and jitted (step.py); everything with side effects (logging,
checkpoints, signals, progress) lives here around it.
"""

import contextlib
import dataclasses
import signal
import sys
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
from jaxtune.parallel.runtime import Plan, Runtime
from jaxtune.run_config import RunConfig
from jaxtune.training import log as run_log
from jaxtune.training import plan, step
from jaxtune.training.host_rows import HostRows
from jaxtune.training.signals import Stopped, StopSignals  # noqa: F401 (train's, re-exported)

if TYPE_CHECKING:
  from jaxtune.training.checkpoint import Checkpoints


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


class _Loop:
  """The state the steps carry (adapters, optimizer state, key), the placed batches, and the
  rows read back from the device: what ``train``'s hooks around the jitted step share.

  Step i's figures are read (a wait for the device) after step i + 1 is dispatched, so the
  device goes from one step to the next without waiting on the host (``pending``). Steps that
  evaluate, save or end the run are read at once, before anything is made from them, and so
  is a step that a signal stops. GRPO's are too: its rollouts wait for the step on the device
  anyway, and its update_s is the step's own time. With several processes the stop check
  (distributed.any_process) waits for each step, so there the overlap is lost."""

  def __init__(self, model, dataset, run: RunConfig, plan_: Plan, checkpoints, loss_scale,
               objective, rollouts):  # fmt: skip
    runtime = plan_.runtime
    self.model, self.dataset, self.run, self.plan = model, dataset, run, plan_
    self.checkpoints, self.objective, self.rollouts = checkpoints, objective, rollouts
    self.graphdef, lora, frozen = step.place(model, runtime)
    self.rows = HostRows(frozen, runtime) if runtime.host_embeddings else None
    self.frozen = frozen if self.rows is None else self.rows.frozen
    if loss_scale is None and runtime.dtype == "float16":
      loss_scale = step.LossScale()
    self.loss_scale = loss_scale
    # The step's last argument, so that none of them is a constant of its program; on every
    # device of the mesh, as the key.
    numbers = step.optimizer_numbers(run)
    self.tx, _ = step.make_optimizer(run, numbers)
    self.learning_rate = step.host_learning_rate(run, numbers)  # rows: nothing queued on device
    self.numbers = jax.device_put(
      numbers, None if runtime.mesh is None else NamedSharding(runtime.mesh, PartitionSpec())
    )
    self.lora, self.opt_state, self.key, self.start, where = _start(
      lora, self.tx, runtime, loss_scale, checkpoints, run.seed, dataset, rollouts
    )
    replicated = runtime.sharding()
    self.out_shardings = (
      None if replicated is None else (where["lora"], where["opt_state"], replicated)
    )
    self.batch_at = runtime.sharding("accum", "batch", "length")
    self.eval_at = runtime.sharding("batch", "length")
    self.row_at = runtime.sharding("accum", "batch")  # per-row leaves (GRPO's advantages)
    # The next batch is assembled while the step runs, where batches are a function of the
    # step alone; a stream's position (saved in checkpoints) must not run ahead of the steps.
    self.prefetch = not hasattr(dataset, "state") and rollouts is None
    self.figures: dict = {}  # the last rollout's (GRPO)
    self.first = None  # the next step's batch, placed ahead of it
    self.step_fn = self.eval_step = None
    self.pending = None  # (i, m, tokens, t0, rolled, t_step) of a step dispatched, not read
    self.read_at = None  # when the last step's figures came back
    self.history: list[dict] = []
    self.counts = {"skipped_steps": 0, "overflow_steps": 0}
    self.saved = self.start

  def next_batch(self, i: int) -> dict[str, jax.Array]:
    """Step ``i``'s batch, placed; a rollout's figures (GRPO) go to ``figures``."""
    run = self.run
    if self.rollouts is not None:
      host, self.figures = self.rollouts(i, self.graphdef, self.lora, self.frozen)
    else:
      host = self.dataset.batch(i, run.batch_size, run.grad_accum, run.seed)
    host = context.zigzag_batch(host, self.plan.runtime.context, 2)
    return _place(host, self.batch_at, self.row_at, self.rows)

  def compile(self, announce) -> None:
    """The step compiled for the run's real first arguments, its remat and loss chunk chosen
    by their memory plan among the candidates resolve listed (plan.choose, which records the
    choice in the run's plan); then the held-out step, under the plan's eval runtime."""
    run = self.run
    if self.start < run.steps:
      self.first = self.next_batch(self.start)
      args = (self.lora, self.opt_state, self.frozen, self.first)
      key = jax.random.fold_in(self.key, self.start)
      self.step_fn, chosen = plan.choose(
        lambda rt: step.make_train_step(
          self.graphdef, self.tx, rt, self.loss_scale, self.out_shardings, self.objective, run=run
        ),
        (*args, key, self.numbers),
        self.plan,
        plan.device_budget(self.plan.runtime.memory_limit),
        logits_bytes=_logits_bytes(self.model, self.first, self.plan.runtime),
        floor=lambda rt: _floor(self.graphdef, *args, self.key, rt, self.objective),
        identity=_step_identity(
          self.graphdef, self.model, run, self.objective, self.loss_scale, self.out_shardings
        ),
      )
      if announce is not None:
        announce(chosen)
    elif announce is not None:
      announce(None)

  def dispatch(self, i: int):
    """Step ``i`` dispatched (its batch placed first where ``place_next`` has not); returns
    what ``read`` takes."""
    t0 = time.perf_counter()
    batch, self.first = self.first if self.first is not None else self.next_batch(i), None
    rolled, t_step = self.figures, time.perf_counter()
    key = jax.random.fold_in(self.key, i)
    self.lora, self.opt_state, m = self.step_fn(
      self.lora, self.opt_state, self.frozen, batch, key, self.numbers
    )
    return (i, m, int(np.prod(batch["input_ids"].shape)), t0, rolled, t_step)

  def place_next(self, i: int) -> None:
    """Step ``i + 1``'s batch, built on the host while step ``i`` runs (where batches are a
    function of the step alone)."""
    if self.prefetch and i + 1 < self.run.steps:
      self.first = self.next_batch(i + 1)

  def read(self, log, i, m, tokens, t0, rolled, t_step) -> dict:
    """Step ``i``'s row: its figures (waiting for them), a bad step counted or raised, logged."""
    # A step dispatched before the previous one was read starts when that one ends.
    row = _row(
      i, m, self.learning_rate, tokens, t0 if self.read_at is None else max(t0, self.read_at)
    )
    self.read_at = time.perf_counter()
    if self.rollouts is not None:
      row.update(rolled, update_s=self.read_at - t_step)
    _count_bad_step(row, m, self.run, self.loss_scale, self.counts)
    self.history.append(row)
    if (i + 1) % self.run.log_every == 0 or i + 1 == self.run.steps:
      log.train(row)
    return row

  def read_pending(self, log) -> None:
    if self.pending is not None:
      taken, self.pending = self.pending, None
      self.read(log, *taken)

  def evaluate(self, log, n: int, row: dict, eval_dataset, sample_fn) -> None:
    """Held-out figures and samples after step ``n``, logged and added to its ``row``."""
    metrics, samples = {}, []
    if eval_dataset is not None:
      if self.eval_step is None:
        self.eval_step = step.make_eval_step(self.graphdef, self.plan.eval, self.objective)
      metrics = step.evaluate(
        self.eval_step, self.lora, self.frozen, eval_dataset, self.run.batch_size,
        self.eval_at, self.eval_rows,
      )  # fmt: skip
    if sample_fn is not None:
      whole = self.frozen if self.rows is None else self.rows.restore(self.frozen)
      local = distributed.local_copy((self.lora, whole), self.plan.runtime.mesh)
      samples = sample_fn(nnx.merge(self.graphdef, *local)) if distributed.is_main() else []
    log.eval(n, metrics, samples)
    row.update(metrics)

  def eval_rows(self, host: dict) -> dict:
    """A held-out host batch [B, T] as the eval step takes it."""
    host = context.zigzag_batch(host, self.plan.runtime.context, 1)
    return host if self.rows is None else self.rows.add(host)

  def save(self, n: int) -> None:
    if self.checkpoints is not None and n != self.saved:
      data_state = self.dataset.state() if hasattr(self.dataset, "state") else None
      held = self.rollouts.state(n) if self.rollouts is not None else None
      state = {"lora": self.lora, "opt_state": self.opt_state, "key": self.key}
      self.checkpoints.save(n, state, data_state, held)
      self.saved = n

  def finish(self) -> nnx.Module:
    """The trained model: the adapters merged back with the frozen weights (the embedding
    table back on the devices), the run's copies of the kernels' codes dropped."""
    frozen = self.frozen if self.rows is None else self.rows.restore(self.frozen)
    trained = nnx.merge(self.graphdef, self.lora, frozen)
    step.drop_kernel_operands(trained)  # the run's copies of the codes (step.kernel_operands)
    return trained


def train(
  model: nnx.Module,
  dataset: "Dataset | StreamingDataset",
  run: RunConfig,
  plan_: Plan | Runtime,
  checkpoints: "Checkpoints | None" = None,
  eval_dataset: Dataset | None = None,
  sample_fn: Callable[[nnx.Module], list[tuple[str, str]]] | None = None,
  stop: StopSignals | None = None,
  loss_scale: step.LossScale | None = None,
  previous_steps: int | None = None,
  announce: Callable[[plan.MemoryPlan | None], None] | None = None,
  objective: step.Objective = step.sft_objective,
  rollouts: step.Rollouts | None = None,
) -> tuple[nnx.Module, list[dict]]:
  """Run the loop under ``plan_`` (run.resolve's Plan; a Runtime alone stands for a plan of
  it); returns (trained model, list of per-step metrics).

  With ``eval_dataset``, held-out loss every ``run.eval_every`` steps and at the end;
  ``sample_fn(model) -> [(prompt, text)]`` adds a few generations to each evaluation. A
  float16 dtype scales the loss dynamically (``loss_scale``, default ``LossScale()``). With
  ``stop``, a SIGTERM/SIGINT saves a checkpoint after the current step and raises
  ``Stopped``. ``previous_steps``: the length of the run being resumed, when known (the
  resume line then says how its schedule changed). ``announce(memory plan)`` is called once
  the step is compiled, before the first step (the start line); ``announce(None)`` when no
  step is left to train. ``objective``: what the step minimises (objective.Objective; default
  SFT's cross-entropy); its figures join the rows. ``rollouts`` (step.Rollouts): batches made
  from the current adapters (GRPO, rl.Rollouts) instead of ``dataset``'s; their figures join
  the rows, their state the checkpoints.
  """
  if not isinstance(plan_, Plan):
    plan_ = Plan(plan_, eval_scan=run.layer_loop != "unrolled")
  elif plan_.memory is not None:  # a plan trained with before: its decisions, chosen anew
    plan_ = dataclasses.replace(plan_, memory=None)
  loop = _Loop(model, dataset, run, plan_, checkpoints, loss_scale, objective, rollouts)
  if loop.start and distributed.is_main():
    print(_resume_line(loop.start, run, loop.learning_rate, previous_steps), file=sys.stderr,
          flush=True)  # fmt: skip
  loop.compile(announce)
  log = run_log.RunLog(
    Path(run.out), run.steps, enabled=distributed.is_main(), report_to=run.report_to,
    config={**dataclasses.asdict(run), "hardware": _hardware()},
  )  # fmt: skip
  saves = checkpoints is not None
  try:
    for i in range(loop.start, run.steps):
      if (
        stop is not None and stop.signum is not None and i > loop.start and jax.process_count() == 1
      ):
        # A signal that came after the last check, before this step is dispatched: stop at
        # the step the message named. (Several processes agree once a step, below.)
        loop.read_pending(log)
        loop.save(i)
        raise Stopped(stop.signum, i, saves)
      taken = loop.dispatch(i)
      if stop is not None:
        stop.step = i + 1  # a signal from here on names step i + 1, in progress
      loop.place_next(i)
      loop.read_pending(log)
      last = i + 1 == run.steps
      sampling_only = eval_dataset is None and rollouts is not None and sample_fn is not None
      due = last or (run.eval_every and (i + 1) % run.eval_every == 0)
      evaluating = (eval_dataset is not None or sampling_only) and due
      saving = saves and ((i + 1) % run.save_every == 0 or last)
      if rollouts is None and not (last or evaluating or saving):
        loop.pending = taken  # read while step i + 1 runs
      else:
        row = loop.read(log, *taken)
        if evaluating:
          loop.evaluate(log, i + 1, row, eval_dataset, sample_fn)
        if saving:
          loop.save(i + 1)
      if stop is not None and not last and distributed.any_process(stop.signum is not None):
        loop.read_pending(log)  # a bad step raises here, before its checkpoint
        loop.save(i + 1)
        raise Stopped(stop.signum or signal.SIGTERM, i + 1, saves)
  except BaseException:
    with contextlib.suppress(Exception):  # the step before the failure's row, where readable
      loop.read_pending(log)
    raise
  finally:
    log.close()
  return loop.finish(), loop.history


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
