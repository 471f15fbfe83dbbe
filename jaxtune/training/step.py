"""The pure parts of training: optimizer, loss scaling, placement and the jitted steps.

``make_train_step`` builds one pure jitted function of (lora_state, opt_state, frozen_state,
batch, key); the adapters and optimizer state are donated so their buffers are updated in
place. The adapters and optimizer state are float32 whatever the compute dtype (the master
copy); with float16 compute the loss is scaled dynamically (``LossScale``) so small gradients
do not underflow, and a step whose scaled gradients overflow is skipped while the scale comes
down.
"""

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jaxtune.data.rows import IGNORE, Dataset
from jaxtune.errors import RunConfigError
from jaxtune.models.layers import Linear
from jaxtune.models.lora import iter_linears
from jaxtune.parallel import distributed, sharding
from jaxtune.parallel.runtime import DEFAULT, Runtime, free_device_bytes, operand_bytes
from jaxtune.run_config import RunConfig
from jaxtune.training import log as run_log
from jaxtune.training.objective import Objective, sft_objective
from pallas_kernels.nf4_matmul import training_operands


def optimizer_numbers(run: RunConfig) -> dict[str, np.generic]:
  """The optimizer's numbers as NumPy scalars: the training step takes them as its last
  argument, so that runs differing only in the learning rate, the step count, the warmup, the
  weight decay or the clipping norm share one compiled step (JAX's compilation cache and
  plan's step store). The schedule's kind stays in the program. ``run.steps`` resolved
  (session._steps)."""
  if run.steps is None:
    raise ValueError("run.steps is unset; resolve it from the data first (session._steps)")
  warmup = max(0, min(run.warmup_steps, run.steps - 1))
  return {
    "learning_rate": np.float32(run.learning_rate),
    "warmup": np.int32(warmup),
    "decay_steps": np.int32(max(1, run.steps - warmup)),
    "weight_decay": np.float32(run.weight_decay),
    "max_grad_norm": np.float32(run.max_grad_norm),
  }


def make_optimizer(
  run: RunConfig, numbers: dict[str, Any] | None = None
) -> tuple[optax.GradientTransformation, optax.Schedule]:
  """AdamW on the adapters, after clipping by the global norm, with the run's schedule (a
  linear warmup from lr / (warmup + 1), then ``run.schedule``'s decay): (transformation,
  schedule).
  ``numbers``: ``optimizer_numbers(run)`` (the default), or the training step's argument of
  that form (traced), so that no number of them is a constant of the step's program. (A
  weight decay of 0 is then added as 0 x the adapters, where optax skips a Python 0: the same
  values, one more elementwise pass over the adapters.)"""
  if run.schedule not in ("cosine", "linear", "constant"):
    raise RunConfigError(f"--schedule must be cosine, linear or constant, got {run.schedule!r}.")
  numbers = optimizer_numbers(run) if numbers is None else numbers
  schedule = functools.partial(_learning_rate, run.schedule, numbers, jnp)
  return optax.chain(
    optax.clip_by_global_norm(numbers["max_grad_norm"]),
    optax.adamw(schedule, weight_decay=numbers["weight_decay"]),
  ), schedule


def host_learning_rate(
  run: RunConfig, numbers: dict[str, np.generic] | None = None
) -> Callable[[int], float]:
  """The schedule's learning rate at a step, in NumPy (float32): for the rows and lines the
  loop writes, which must not queue work on the device behind the step just dispatched (a
  jnp schedule would, and reading it would wait for that step). ``numbers``:
  ``optimizer_numbers(run)`` (the default) where the caller has them."""
  numbers = optimizer_numbers(run) if numbers is None else numbers
  return lambda count: float(_learning_rate(run.schedule, numbers, np, np.int32(count)))


def _learning_rate(kind: str, numbers: dict[str, Any], xp: Any, count: Any) -> Any:
  """The learning rate at step ``count``: optax's join of linear_schedule(lr / (warmup + 1), lr,
  warmup) (step k of the warmup at lr (k + 1) / (warmup + 1)) and
  cosine_decay_schedule(lr, decay_steps), linear_schedule(lr, 0, decay_steps) or
  constant_schedule(lr), written out with the numbers as arrays (optax's schedules take Python
  numbers: they branch on them), in optax's operations and order (tests compare them), in
  float32 with ``xp`` jax.numpy or NumPy."""
  lr, warmup, decay = numbers["learning_rate"], numbers["warmup"], numbers["decay_steps"]
  f32 = lambda x: xp.asarray(x, xp.float32)  # noqa: E731  (jnp divides integers so)
  up = f32(xp.clip(count, 0, warmup))
  # From lr / (warmup + 1), not 0: the first step trains (HF's warmup spends it at 0).
  first = f32(lr) / f32(warmup + 1)
  warm = (first - lr) * (1 - up / f32(xp.maximum(warmup, 1))) + lr  # warmup 0: never taken
  t = count - warmup
  if kind == "cosine":
    t = f32(xp.minimum(t, decay))
    after = lr * ((1 - 0.0) * (0.5 * (1 + xp.cos(xp.pi * t / f32(decay)))) ** 1.0 + 0.0)
  elif kind == "linear":
    after = (lr - 0.0) * (1 - f32(xp.clip(t, 0, decay)) / f32(decay)) + 0.0
  else:
    after = xp.broadcast_to(lr, xp.shape(t))
  return xp.where(count < warmup, warm, after)


@dataclasses.dataclass(frozen=True)
class LossScale:
  """Dynamic loss scaling for float16: halve on overflow, double after ``period`` good steps."""

  initial: float = 2.0**15
  factor: float = 2.0
  period: int = 2000
  minimum: float = 1.0
  maximum: float = 2.0**24

  def init(self) -> dict:
    return {"scale": jnp.float32(self.initial), "good_steps": jnp.int32(0)}

  def update(self, state: dict, overflow: jax.Array) -> dict:
    scale, good = state["scale"], state["good_steps"] + 1
    grow = ~overflow & (good >= self.period)
    lower = jnp.maximum(scale / self.factor, self.minimum)
    higher = jnp.minimum(scale * self.factor, self.maximum)
    return {
      "scale": jnp.where(overflow, lower, jnp.where(grow, higher, scale)),
      "good_steps": jnp.where(overflow | grow, 0, good).astype(jnp.int32),
    }


class Rollouts(Protocol):
  """Batches made from the current adapters instead of a dataset's (GRPO: rl.Rollouts)."""

  def __call__(
    self, step: int, graphdef: Any, lora: nnx.State, frozen: nnx.State
  ) -> tuple[dict, dict]:
    """(host batch, figures) for ``step``; the figures join the step's row."""
    ...

  def state(self, step: int) -> Any | None:
    """What a checkpoint after ``step`` keeps so that a resume trains on the same batches
    (None: nothing)."""
    ...

  def restore(self, saved: Any) -> None:
    """Take back what ``state`` kept, when a run resumes from that checkpoint."""
    ...


def make_train_step(
  graphdef: Any,
  tx: optax.GradientTransformation,
  runtime: Runtime,
  loss_scale: LossScale | None = None,
  out_shardings: Any = None,
  objective: Objective = sft_objective,
  run: RunConfig | None = None,
) -> Callable[..., tuple[nnx.State, optax.OptState, dict[str, jax.Array]]]:
  """The jitted step, computed as ``runtime`` says, minimising ``objective`` (default: SFT's
  cross-entropy; preference.Preference for DPO/IPO/ORPO, rl.GRPO). ``loss_scale``: dynamic
  loss scaling (float16); None: no scaling.

  With ``run``, the step takes a sixth argument, ``optimizer_numbers(run)`` or those of
  another run of the same schedule kind, and builds the optimizer from it
  (``make_optimizer(run, numbers)``, of which ``tx`` must be one): none of those numbers is a
  constant of the program. Without it, ``tx`` as it is.

  With ``loss_scale`` the optimizer state is ``{"tx": tx's state, "loss_scale": ...}``
  (``init_opt_state``), so the scale is saved and restored with it.
  A step is applied only when it is good: finite loss, not exactly 0, finite gradients.
  Otherwise the adapters and optimizer state stay as they were; ``metrics["scale_skip"]``
  says the step was skipped for loss scaling (an overflow the lowered scale will fix).
  """

  def train_step(lora, opt_state, frozen, batch, key, numbers=None):
    """batch leaves are [accum, micro, T]; the loss is normalised over all of them."""
    opt = tx if numbers is None else make_optimizer(run, numbers)[0]
    if loss_scale is not None:
      tx_state, scale_state = opt_state["tx"], opt_state["loss_scale"]
      scale = scale_state["scale"]
    else:
      tx_state, scale = opt_state, jnp.float32(1.0)

    def scaled_loss(lora_, mb, k):
      s, n, aux = objective(graphdef, lora_, frozen, mb, k, runtime)
      return s * scale, (s, n, aux)

    def micro(carry, xs):
      grads, loss_sum, count, figures = carry
      mb, k = xs
      (_, (l, n, aux)), g = jax.value_and_grad(scaled_loss, has_aux=True)(lora, mb, k)
      # flush each micro-batch's gradient into the running sum right away.
      grads = jax.tree.map(jnp.add, grads, g)
      figures = jax.tree.map(jnp.add, figures, aux)
      return (grads, loss_sum + l, count + n, figures), None

    accum = batch["input_ids"].shape[0]
    keys = jax.random.split(key, accum)
    zeros = jax.tree.map(jnp.zeros_like, lora)
    no_figures = {k: jnp.zeros((), dtype) for k, dtype in objective.figures.items()}
    (grads, loss_sum, count, figures), _ = jax.lax.scan(
      micro, (zeros, jnp.float32(0.0), jnp.int32(0), no_figures), (batch, keys)
    )
    denom = jnp.maximum(count, 1).astype(jnp.float32)
    grads = jax.tree.map(lambda g: g / (denom * scale), grads)
    loss, grad_norm = loss_sum / denom, optax.global_norm(grads)
    # A loss of exactly 0 means no labelled token, except for objectives where it is a
    # normal value (Objective.zero_loss_ok).
    loss_ok = jnp.isfinite(loss) & ((loss != 0) | objective.zero_loss_ok)
    overflow = ~jnp.isfinite(grad_norm)
    good = loss_ok & ~overflow
    updates, new_tx_state = opt.update(grads, tx_state, lora)
    new_lora = optax.apply_updates(lora, updates)
    keep = lambda new, old: jnp.where(good, new, old)  # noqa: E731
    new_lora = jax.tree.map(keep, new_lora, lora)
    new_opt_state = jax.tree.map(keep, new_tx_state, tx_state)
    metrics = {"loss": loss, "grad_norm": grad_norm, "good": good, **_figures(figures, count)}
    if loss_scale is not None:
      new_scale_state = loss_scale.update(scale_state, overflow)
      new_opt_state = {"tx": new_opt_state, "loss_scale": new_scale_state}
      metrics["scale_skip"] = loss_ok & overflow & (scale > loss_scale.minimum)
      metrics["loss_scale"] = new_scale_state["scale"]
    return new_lora, new_opt_state, metrics

  return jax.jit(train_step, donate_argnums=(0, 1), out_shardings=out_shardings)


def _figures(sums: dict[str, jax.Array], count: jax.Array) -> dict[str, jax.Array]:
  """An objective's figures as a step reports them: ``tokens`` as counted, the others as
  means over the ``count`` losses (pairs, for preference objectives)."""
  denom = jnp.maximum(count, 1).astype(jnp.float32)
  return {k: v if k == "tokens" else v / denom for k, v in sums.items()}


def init_opt_state(
  tx: optax.GradientTransformation, lora: nnx.State, loss_scale: LossScale | None = None
) -> optax.OptState:
  """The optimizer state the step takes: tx's, plus the loss scale when there is one."""
  state = tx.init(lora)
  return state if loss_scale is None else {"tx": state, "loss_scale": loss_scale.init()}


def fp32_master(lora: nnx.State) -> nnx.State:
  """The adapters as float32 (the optimizer's master copy), whatever they were built in."""
  return jax.tree.map(
    lambda x: x.astype(jnp.float32) if jnp.issubdtype(x.dtype, jnp.floating) else x, lora
  )


def place(model: nnx.Module, runtime: Runtime) -> tuple[Any, nnx.State, nnx.State]:
  """Split the model and put every piece on its sharding; returns (graphdef, lora, frozen).

  ``runtime.shard_frozen`` also splits the NF4 storage over ``data`` (gathered per layer in
  the scan). A run on the NF4 kernels on one device (``--nf4-matmul kernel``) gets their
  operands made once in its frozen state (``kernel_operands``); ``model`` keeps its own.
  """
  made = kernel_operands(model, runtime)
  try:
    graphdef, lora, frozen = nnx.split(model, nnx.LoRAParam, ...)
  finally:
    for linear, (scales, word, word_t) in made:
      linear.kernel_scales, linear.kernel_codes = nnx.data(scales), nnx.data(word)
      linear.kernel_codes_t = nnx.data(word_t)
  lora = fp32_master(lora)
  mesh = runtime.mesh
  if mesh is not None:
    lora = jax.device_put(lora, sharding.state_shardings(lora, mesh))
    frozen = jax.device_put(frozen, sharding.state_shardings(frozen, mesh, runtime.shard_frozen))
  return graphdef, lora, frozen


def kernel_operands(model: nnx.Module, runtime: Runtime) -> list[tuple[Linear, tuple]]:
  """Give every NF4 linear layer the kernels' operands of a training run
  (``nf4_matmul.training_operands``: W's and W^T's codes in the word lookup's order and the
  bf16 scales) where the run forces the kernels (``nf4_matmul`` "kernel", or "interpret" in
  tests) on one device in bfloat16 (the kernels' dtype) and the copies, twice the codes'
  bytes and the scales, take at most half the free memory (of ``--memory-limit`` where set).
  Without them the kernels permute and transpose the codes on every call: at 4096 tokens of
  the 8B shapes 4-16% of their time (experiments/sweep_nf4_train.py); with them the 8B step
  (batch 2) ran 1.029x XLA's tokens/s in 6.2 GiB less at its peak (H100, session 30, the
  LoRA pair inside the forward kernel). ``--nf4-matmul`` unset resolves to "kernel" where
  that measured faster (``run.resolve.resolve_nf4_matmul``). All are made before any is
  given, so a failure leaves ``model`` as it was. Returns (layer, its operands before) for
  each layer given them."""
  forced = runtime.nf4_matmul in ("kernel", "interpret")
  if not forced or runtime.mesh is not None or runtime.dtype != "bfloat16":
    return []
  linears = [
    linear
    for _, linear in iter_linears(model)
    if linear.quantized and linear.in_features % 32 == 0 and linear.out_features % 32 == 0
  ]
  codes = sum(linear.codes[...].nbytes for linear in linears)
  need = operand_bytes(codes)
  free = free_device_bytes(runtime.memory_limit)  # None: no statistics (CPU)
  if free is not None and need > free // 2:
    return []
  operands = [_training_operands(*linear.frozen_arrays()) for linear in linears]
  made = []
  for linear, (word, word_t, scales) in zip(linears, operands, strict=True):
    made.append((linear, (linear.kernel_scales, linear.kernel_codes, linear.kernel_codes_t)))
    linear.kernel_codes, linear.kernel_codes_t = nnx.data(word), nnx.data(word_t)
    linear.kernel_scales = nnx.data(scales)
  return made


# One program per weight shape: its temporaries are one layer stack's, not each eager op's.
_training_operands = jax.jit(training_operands)


def drop_kernel_operands(model: nnx.Module) -> None:
  """Take ``kernel_operands``' arrays off the layers that have them (W^T's codes mark them)."""
  for _, linear in iter_linears(model):
    if linear.kernel_codes_t is not None:
      linear.kernel_scales, linear.kernel_codes = nnx.data(None), nnx.data(None)
      linear.kernel_codes_t = nnx.data(None)


def placements(tree: Any, runtime: Runtime) -> Any:
  """Where the step expects ``tree``: scalars replicated, the rest on their own sharding.

  Every call then sees the placement the previous one returned, so the step compiles once.
  """
  if runtime.mesh is None:
    return jax.tree.map(lambda _: jax.sharding.SingleDeviceSharding(jax.devices()[0]), tree)
  replicated = NamedSharding(runtime.mesh, PartitionSpec())
  return jax.tree.map(lambda x: replicated if x.ndim == 0 else x.sharding, tree)


def make_eval_step(
  graphdef: Any, runtime: Runtime = DEFAULT, objective: Objective = sft_objective
) -> Callable[..., tuple[jax.Array, jax.Array, dict[str, jax.Array]]]:
  """jitted (loss sum, count, figures' sums) of one [B, T] batch, no gradient."""
  return jax.jit(
    lambda lora, frozen, batch: objective(graphdef, lora, frozen, batch, None, runtime)
  )


def evaluate(
  eval_step: Callable[..., tuple[jax.Array, jax.Array]],
  lora: nnx.State,
  frozen: nnx.State,
  dataset: Dataset,
  batch_size: int,
  shard: NamedSharding | None = None,
  add_rows: Callable[[dict], dict] | None = None,
) -> dict:
  """Held-out loss and perplexity over every example of ``dataset`` (token-weighted; a
  preference objective: pair-weighted loss and its figures, e.g. eval_reward_accuracy).
  ``add_rows``: what a host batch goes through before placement (the embedding rows of
  ``--embeddings host``, the zigzag order of a context axis)."""
  total, count, figures = 0.0, 0, {}
  n = len(dataset)
  for start in range(0, n, batch_size):
    idx = np.arange(start, start + batch_size) % n
    batch = dataset.rows(idx)
    # Wrapped-around fill rows count nothing.
    batch["labels"][np.arange(start, start + batch_size) >= n] = IGNORE
    if add_rows is not None:
      batch = add_rows(batch)
    batch = {k: distributed.global_batch(v, shard) for k, v in batch.items()}
    s, c, aux = eval_step(lora, frozen, batch)
    total, count = total + float(s), count + int(c)
    for k, v in aux.items():
      figures[k] = figures.get(k, 0.0) + float(v)
  loss = total / max(count, 1)
  tokens = int(figures.pop("tokens", count))
  if getattr(dataset, "pairs", False):
    means = {f"eval_{k}": v / max(count, 1) for k, v in figures.items()}
    return {"eval_loss": loss, **means, "eval_pairs": count, "eval_tokens": tokens}
  return {"eval_loss": loss, "eval_ppl": run_log.perplexity(loss), "eval_tokens": tokens}
