"""The training step and loop: schedule, step, log, checkpoint.

``train_step`` is one pure jitted function of (lora_state, opt_state, frozen_state, batch,
key); the adapters and optimizer state are donated so their buffers are updated in place.
Everything with side effects (logging, checkpoints, progress) lives in ``train`` around it.
"""

import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxtune import run_log, sharding
from jaxtune.data import IGNORE, Dataset
from jaxtune.run_config import RunConfig


def make_optimizer(run: RunConfig) -> tuple[optax.GradientTransformation, optax.Schedule]:
  warmup = max(0, min(run.warmup_steps, run.steps - 1))
  decay_steps = max(1, run.steps - warmup)
  if run.schedule == "cosine":
    decay = optax.cosine_decay_schedule(run.learning_rate, decay_steps)
  elif run.schedule == "linear":
    decay = optax.linear_schedule(run.learning_rate, 0.0, decay_steps)
  elif run.schedule == "constant":
    decay = optax.constant_schedule(run.learning_rate)
  else:
    raise ValueError(f"schedule must be cosine, linear or constant, got {run.schedule!r}.")
  schedule = optax.join_schedules(
    [optax.linear_schedule(0.0, run.learning_rate, warmup), decay], [warmup]
  )
  return optax.chain(
    optax.clip_by_global_norm(run.max_grad_norm),
    optax.adamw(schedule, weight_decay=run.weight_decay),
  ), schedule


def loss_sums(graphdef, lora, frozen, batch, key):
  """(sum of token losses, number of loss tokens) of one micro-batch."""
  model = nnx.merge(graphdef, lora, frozen)
  logits = model(batch["input_ids"], segment_ids=batch["segment_ids"], dropout_key=key)
  labels = batch["labels"]
  mask = labels != IGNORE
  ce = optax.softmax_cross_entropy_with_integer_labels(logits, jnp.where(mask, labels, 0))
  return jnp.sum(ce * mask), jnp.sum(mask)


class TrainingError(RuntimeError):
  """The run cannot go on (a non-finite or exactly-zero loss); the message says why."""


def make_train_step(graphdef, tx, skip_bad: bool = False):
  def train_step(lora, opt_state, frozen, batch, key):
    """batch leaves are [accum, micro, T]; the loss is normalised over all of them.

    With ``skip_bad``, a step whose loss is NaN, infinite or exactly 0 leaves the adapters
    and optimizer state as they were.
    """

    def micro(carry, xs):
      grads, loss_sum, count = carry
      mb, k = xs
      (l, n), g = jax.value_and_grad(loss_sums, argnums=1, has_aux=True)(
        graphdef, lora, frozen, mb, k
      )
      # flush each micro-batch's gradient into the running sum right away.
      grads = jax.tree.map(jnp.add, grads, g)
      return (grads, loss_sum + l, count + n), None

    accum = batch["input_ids"].shape[0]
    keys = jax.random.split(key, accum)
    zeros = jax.tree.map(jnp.zeros_like, lora)
    (grads, loss_sum, count), _ = jax.lax.scan(
      micro, (zeros, jnp.float32(0.0), jnp.int32(0)), (batch, keys)
    )
    denom = jnp.maximum(count, 1).astype(jnp.float32)
    grads = jax.tree.map(lambda g: g / denom, grads)
    updates, new_opt_state = tx.update(grads, opt_state, lora)
    new_lora = optax.apply_updates(lora, updates)
    loss, grad_norm = loss_sum / denom, optax.global_norm(grads)
    good = jnp.isfinite(loss) & jnp.isfinite(grad_norm) & (loss != 0)
    if skip_bad:
      keep = lambda new, old: jnp.where(good, new, old)  # noqa: E731
      new_lora = jax.tree.map(keep, new_lora, lora)
      new_opt_state = jax.tree.map(keep, new_opt_state, opt_state)
    metrics = {"loss": loss, "grad_norm": grad_norm, "tokens": count, "good": good}
    return new_lora, new_opt_state, metrics

  return jax.jit(train_step, donate_argnums=(0, 1))


def _bad_loss_message(loss: float, step: int) -> str:
  if loss == 0.0:
    cause = (
      "no token of the batch carries a label (all masked: check --train-on-prompt and the "
      "chat roles) or the adapters have collapsed"
    )
  else:
    cause = (
      "an overflow (lower --learning-rate, or use --dtype float32 where bfloat16/float16 overflows)"
    )
  return (
    f"the loss is {loss} at step {step}, most likely {cause}; pass --skip-nonfinite to skip "
    "such steps instead of stopping."
  )


def place(model, mesh: Mesh | None):
  """Split the model and put every piece on its sharding; returns (graphdef, lora, frozen)."""
  graphdef, lora, frozen = nnx.split(model, nnx.LoRAParam, ...)
  if mesh is not None:
    lora = jax.device_put(lora, sharding.state_shardings(lora, mesh))
    frozen = jax.device_put(frozen, sharding.state_shardings(frozen, mesh))
  return graphdef, lora, frozen


def batch_sharding(mesh: Mesh | None):
  if mesh is None:
    return None
  return NamedSharding(mesh, PartitionSpec(None, "data", None))


def make_eval_step(graphdef):
  """jitted (loss sum, token count) of one [B, T] batch, no gradient."""
  return jax.jit(lambda lora, frozen, batch: loss_sums(graphdef, lora, frozen, batch, None))


def evaluate(eval_step, lora, frozen, dataset: Dataset, batch_size: int, shard=None) -> dict:
  """Held-out loss and perplexity over every example of ``dataset`` (token-weighted)."""
  total, count = 0.0, 0
  n = len(dataset)
  for start in range(0, n, batch_size):
    idx = np.arange(start, start + batch_size) % n
    batch = {
      "input_ids": dataset.input_ids[idx],
      "labels": np.where(
        (np.arange(start, start + batch_size) < n)[:, None], dataset.labels[idx], IGNORE
      ),  # wrapped-around fill rows count nothing
      "segment_ids": dataset.segment_ids[idx],
    }
    if shard is not None:
      batch = {k: jax.device_put(v, shard) for k, v in batch.items()}
    s, c = eval_step(lora, frozen, batch)
    total, count = total + float(s), count + int(c)
  loss = total / max(count, 1)
  return {"eval_loss": loss, "eval_ppl": run_log.perplexity(loss), "eval_tokens": count}


def train(
  model,
  dataset: Dataset,
  run: RunConfig,
  mesh: Mesh | None,
  checkpoints=None,
  eval_dataset: Dataset | None = None,
  sample_fn=None,
):
  """Run the loop; returns (trained model, list of per-step metrics).

  With ``eval_dataset``, held-out loss every ``run.eval_every`` steps and at the end;
  ``sample_fn(model) -> [(prompt, text)]`` adds a few generations to each evaluation.
  """
  model.set_runtime(
    remat=run.remat,
    attention_impl=run.attention or model.default_attention(),
    activation_sharding=None if mesh is None else NamedSharding(mesh, PartitionSpec("data")),
  )
  graphdef, lora, frozen = place(model, mesh)
  tx, schedule = make_optimizer(run)
  opt_state = tx.init(lora)
  key = jax.random.key(run.seed)
  start = 0
  if checkpoints is not None:
    restored = checkpoints.restore_latest(lora, opt_state)
    if restored is not None:
      # Back onto the shardings a fresh start would use (scalars such as Adam's count
      # replicated), so the step sees the same placement either way.
      def like(fresh):
        if mesh is not None and fresh.ndim == 0:
          return NamedSharding(mesh, PartitionSpec())
        return fresh.sharding

      target = jax.tree.map(like, (lora, opt_state))
      lora, opt_state, start, key = restored
      lora, opt_state = jax.device_put((lora, opt_state), target)
      if mesh is not None:
        key = jax.device_put(key, NamedSharding(mesh, PartitionSpec()))
  step_fn = make_train_step(graphdef, tx, skip_bad=run.skip_nonfinite)
  skipped = 0
  eval_step = make_eval_step(graphdef) if eval_dataset is not None else None
  shard = batch_sharding(mesh)
  eval_shard = None if mesh is None else NamedSharding(mesh, PartitionSpec("data", None))
  history = []
  log = run_log.RunLog(Path(run.out), run.steps)
  try:
    for step in range(start, run.steps):
      t0 = time.perf_counter()
      host = dataset.batch(step, run.batch_size, run.grad_accum, run.seed)
      batch = {k: jax.device_put(v, shard) if shard else jnp.asarray(v) for k, v in host.items()}
      step_key = jax.random.fold_in(key, step)
      lora, opt_state, m = step_fn(lora, opt_state, frozen, batch, step_key)
      loss = float(m["loss"])  # waits for the step
      dt = time.perf_counter() - t0
      row = {
        "step": step + 1,
        "loss": loss,
        "lr": float(schedule(step)),
        "grad_norm": float(m["grad_norm"]),
        "tokens": int(m["tokens"]),
        "tokens_per_s": int(np.prod(host["input_ids"].shape)) / dt,
      }
      if not bool(m["good"]):
        if not run.skip_nonfinite:
          raise TrainingError(_bad_loss_message(loss, step + 1))
        skipped += 1
      if run.skip_nonfinite:
        row["skipped_steps"] = skipped
      history.append(row)
      last = step + 1 == run.steps
      if (step + 1) % run.log_every == 0 or last:
        log.train(row)
      if eval_step is not None and (last or (run.eval_every and (step + 1) % run.eval_every == 0)):
        metrics = evaluate(eval_step, lora, frozen, eval_dataset, run.batch_size, eval_shard)
        samples = sample_fn(nnx.merge(graphdef, lora, frozen)) if sample_fn else []
        log.eval(step + 1, metrics, samples)
        row.update(metrics)
      if checkpoints is not None and ((step + 1) % run.save_every == 0 or last):
        checkpoints.save(step + 1, lora, opt_state, key)
  finally:
    log.close()
    if checkpoints is not None:
      checkpoints.wait()  # a save in flight completes even when the run stops early
  return nnx.merge(graphdef, lora, frozen), history
