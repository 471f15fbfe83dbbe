"""The training step and loop: schedule, step, log, checkpoint.

``train_step`` is one pure jitted function of (lora_state, opt_state, frozen_state, batch,
key); the adapters and optimizer state are donated so their buffers are updated in place.
Everything with side effects (logging, checkpoints, signals, progress) lives in ``train``
around it.

The adapters and optimizer state are float32 whatever the compute dtype (the master copy);
with float16 compute the loss is scaled dynamically (``LossScale``) so small gradients do not
underflow, and a step whose scaled gradients overflow is skipped while the scale comes down.
"""

import dataclasses
import os
import signal
import sys
import threading
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxtune import distributed, run_log, sharding
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


def loss_sums(graphdef, lora, frozen, batch, key, chunk: int = 0):
  """(sum of token losses, number of loss tokens) of one micro-batch.

  ``chunk`` > 0: the float32 logits exist ``chunk`` tokens per row at a time
  (``chunked_loss_sums``), trading one recomputation of the output layer for their memory.
  """
  model = nnx.merge(graphdef, lora, frozen)
  ids, segments, labels = batch["input_ids"], batch["segment_ids"], batch["labels"]
  positions = batch.get("positions")  # packed rows restart positions at each example
  if chunk:
    h = model.hidden_states(ids, positions, segments, dropout_key=key)
    v = model.config.vocab_size
    vocab = (model.logits_piece, v, VOCAB_PIECE) if v > LARGE_VOCAB else None
    with jax.named_scope("loss"):
      return chunked_loss_sums(model.logits_from_hidden, h, labels, chunk, vocab)
  logits = model(ids, positions, segments, dropout_key=key)
  with jax.named_scope("loss"):
    mask = labels != IGNORE
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, jnp.where(mask, labels, 0))
    return jnp.sum(ce * mask), jnp.sum(mask)


def _largest_divisor(n: int, most: int) -> int:
  return max(x for x in range(1, min(most, n) + 1) if n % x == 0)


# With --loss-chunk, vocabularies larger than this (Gemma's 256k) are also cut into pieces of
# at most VOCAB_PIECE entries (the largest divisor of V not above it).
LARGE_VOCAB = 200_000
VOCAB_PIECE = 32768


def chunked_loss_sums(head, h, labels, chunk: int, vocab=None):
  """Cross-entropy sums over hidden states [B, T, D] without the full [B, T, V] float32 logits.

  The sequence is cut into pieces of ``chunk`` tokens per row (the largest divisor of T not
  above it); a scan computes each piece's logits, loss and count, and remat makes the backward
  recompute them piece by piece, so at most [B, chunk, V] logits are alive in either pass. The
  batch axis stays whole, so its data sharding is untouched.

  ``vocab`` = (logits_piece, V, piece): the vocabulary too is walked in pieces,
  ``logits_piece(h, start, size)`` giving the logits of entries start .. start + size - 1,
  with an online log-sum-exp, so at most [B, chunk, piece] logits exist.
  """
  b, t, d = h.shape
  c = _largest_divisor(t, chunk)
  pieces = (h.reshape(b, t // c, c, d).swapaxes(0, 1), labels.reshape(b, t // c, c).swapaxes(0, 1))

  @jax.checkpoint
  def piece(h_c, labels_c):
    mask = labels_c != IGNORE
    safe = jnp.where(mask, labels_c, 0)
    if vocab is None:
      logits = head(h_c).astype(jnp.float32)  # [B, c, V]
      ce = optax.softmax_cross_entropy_with_integer_labels(logits, safe)
    else:
      ce = _vocab_pieces_ce(*vocab, h_c, safe)
    return jnp.sum(ce * mask), jnp.sum(mask)

  def step(carry, xs):
    total, count = piece(*xs)
    return (carry[0] + total, carry[1] + count), None

  zero = (jnp.zeros((), jnp.float32), jnp.zeros((), jnp.int32))
  return jax.lax.scan(step, zero, pieces)[0]


def _vocab_pieces_ce(logits_piece, v: int, most: int, h, labels):
  """Per-token cross-entropy [B, c] from vocabulary pieces: running max, running sum of
  exponentials and the label's logit, each piece's logits recomputed in the backward."""
  p = _largest_divisor(v, most)
  piece_logits = jax.checkpoint(lambda h, start: logits_piece(h, start, p).astype(jnp.float32))

  def step(carry, start):
    m, s, picked = carry
    z = piece_logits(h, start)  # [B, c, p]
    m_new = jnp.maximum(m, z.max(axis=-1))
    s = s * jnp.exp(m - m_new) + jnp.exp(z - m_new[..., None]).sum(axis=-1)
    inside = (labels >= start) & (labels < start + p)
    at = jnp.take_along_axis(z, jnp.clip(labels - start, 0, p - 1)[..., None], axis=-1)[..., 0]
    return (m_new, s, picked + jnp.where(inside, at, 0.0)), None

  init = (jnp.full(labels.shape, -1e30), jnp.zeros(labels.shape), jnp.zeros(labels.shape))
  (m, s, picked), _ = jax.lax.scan(step, init, jnp.arange(0, v, p, dtype=jnp.int32))
  return m + jnp.log(s) - picked


class TrainingError(RuntimeError):
  """The run cannot go on (a non-finite or exactly-zero loss); the message says why."""


class Stopped(Exception):
  """Training stopped on SIGTERM/SIGINT after saving a checkpoint at ``step``."""

  def __init__(self, signum: int, step: int, saved: bool):
    self.signum, self.step, self.saved = signum, step, saved
    super().__init__(f"stopped by {signal.Signals(signum).name} after step {step}")


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


def make_train_step(
  graphdef, tx, loss_scale: LossScale | None = None, out_shardings=None, loss_chunk: int = 0
):
  """The jitted step. ``loss_scale``: dynamic loss scaling (float16); None: no scaling.

  With ``loss_scale`` the optimizer state is ``{"tx": tx's state, "loss_scale": ...}``
  (``init_opt_state``), so the scale is saved and restored with it.
  A step is applied only when it is good: finite loss, not exactly 0, finite gradients.
  Otherwise the adapters and optimizer state stay as they were; ``metrics["scale_skip"]``
  says the step was skipped for loss scaling (an overflow the lowered scale will fix).
  """

  def train_step(lora, opt_state, frozen, batch, key):
    """batch leaves are [accum, micro, T]; the loss is normalised over all of them."""
    if loss_scale is not None:
      tx_state, scale_state = opt_state["tx"], opt_state["loss_scale"]
      scale = scale_state["scale"]
    else:
      tx_state, scale = opt_state, jnp.float32(1.0)

    def scaled_loss(lora_, mb, k):
      s, n = loss_sums(graphdef, lora_, frozen, mb, k, loss_chunk)
      return s * scale, (s, n)

    def micro(carry, xs):
      grads, loss_sum, count = carry
      mb, k = xs
      (_, (l, n)), g = jax.value_and_grad(scaled_loss, has_aux=True)(lora, mb, k)
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
    grads = jax.tree.map(lambda g: g / (denom * scale), grads)
    loss, grad_norm = loss_sum / denom, optax.global_norm(grads)
    loss_ok = jnp.isfinite(loss) & (loss != 0)
    overflow = ~jnp.isfinite(grad_norm)
    good = loss_ok & ~overflow
    updates, new_tx_state = tx.update(grads, tx_state, lora)
    new_lora = optax.apply_updates(lora, updates)
    keep = lambda new, old: jnp.where(good, new, old)  # noqa: E731
    new_lora = jax.tree.map(keep, new_lora, lora)
    new_opt_state = jax.tree.map(keep, new_tx_state, tx_state)
    metrics = {"loss": loss, "grad_norm": grad_norm, "tokens": count, "good": good}
    if loss_scale is not None:
      new_scale_state = loss_scale.update(scale_state, overflow)
      new_opt_state = {"tx": new_opt_state, "loss_scale": new_scale_state}
      metrics["scale_skip"] = loss_ok & overflow & (scale > loss_scale.minimum)
      metrics["loss_scale"] = new_scale_state["scale"]
    return new_lora, new_opt_state, metrics

  return jax.jit(train_step, donate_argnums=(0, 1), out_shardings=out_shardings)


def init_opt_state(tx, lora, loss_scale: LossScale | None = None):
  """The optimizer state the step takes: tx's, plus the loss scale when there is one."""
  state = tx.init(lora)
  return state if loss_scale is None else {"tx": state, "loss_scale": loss_scale.init()}


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


def fp32_master(lora):
  """The adapters as float32 (the optimizer's master copy), whatever they were built in."""
  return jax.tree.map(
    lambda x: x.astype(jnp.float32) if jnp.issubdtype(x.dtype, jnp.floating) else x, lora
  )


def default_attention(model, mesh: Mesh | None, packed: bool = False) -> str:
  """The model's default, except under a pipeline: neither cuDNN's fused attention (fails to
  partition, seen on 2 H200s) nor the Pallas kernel runs inside the pipeline's shard_map yet,
  so "xla" there."""
  if mesh is not None and mesh.shape.get("pipe", 1) > 1:
    return "xla"
  return model.default_attention(packed)


def resolve_attention(run, model, mesh, dataset, eval_dataset=None) -> str:
  """--attention, or the default for this model, mesh and data. Held-out rows go through the
  same attention, so packed rows there count too."""
  packed = dataset.packed or (eval_dataset is not None and eval_dataset.packed)
  return run.attention or default_attention(model, mesh, packed)


def place(model, mesh: Mesh | None, shard_frozen: bool = False):
  """Split the model and put every piece on its sharding; returns (graphdef, lora, frozen).

  ``shard_frozen`` also splits the NF4 storage over ``data`` (gathered per layer in the scan).
  """
  graphdef, lora, frozen = nnx.split(model, nnx.LoRAParam, ...)
  lora = fp32_master(lora)
  if mesh is not None:
    lora = jax.device_put(lora, sharding.state_shardings(lora, mesh))
    frozen = jax.device_put(frozen, sharding.state_shardings(frozen, mesh, shard_frozen))
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
      "positions": dataset.positions[idx],
    }
    batch = {k: distributed.global_batch(v, shard) for k, v in batch.items()}
    s, c = eval_step(lora, frozen, batch)
    total, count = total + float(s), count + int(c)
  loss = total / max(count, 1)
  return {"eval_loss": loss, "eval_ppl": run_log.perplexity(loss), "eval_tokens": count}


class StopSignals:
  """While active, SIGTERM/SIGINT ask the loop to save and stop after the current step.

  A second signal stops at once (the checkpoint on disk is then the last complete one:
  orbax renames a checkpoint into place only when it is fully written).
  """

  SIGNALS = (signal.SIGTERM, signal.SIGINT)

  def __init__(self):
    self.signum: int | None = None
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
    print(
      f"\njaxtune: {signal.Signals(signum).name} received; saving a checkpoint after this step, "
      "then stopping (send it again to stop at once).",
      file=sys.stderr,
      flush=True,
    )


def _placements(tree, mesh: Mesh | None):
  """Where the step expects ``tree``: scalars replicated, the rest on their own sharding.

  Every call then sees the placement the previous one returned, so the step compiles once.
  """
  if mesh is None:
    return jax.tree.map(lambda _: jax.sharding.SingleDeviceSharding(jax.devices()[0]), tree)
  replicated = NamedSharding(mesh, PartitionSpec())
  return jax.tree.map(lambda x: replicated if x.ndim == 0 else x.sharding, tree)


def train(
  model,
  dataset: Dataset,
  run: RunConfig,
  mesh: Mesh | None,
  checkpoints=None,
  eval_dataset: Dataset | None = None,
  sample_fn=None,
  loss_scale: LossScale | None = None,
  stop: StopSignals | None = None,
):
  """Run the loop; returns (trained model, list of per-step metrics).

  With ``eval_dataset``, held-out loss every ``run.eval_every`` steps and at the end;
  ``sample_fn(model) -> [(prompt, text)]`` adds a few generations to each evaluation.
  ``loss_scale`` defaults to dynamic scaling when ``run.dtype`` is float16. With ``stop``,
  a SIGTERM/SIGINT saves a checkpoint after the current step and raises ``Stopped``.
  """
  model.set_runtime(
    remat=run.remat,
    attention_impl=resolve_attention(run, model, mesh, dataset, eval_dataset),
    activation_sharding=None
    if mesh is None
    else NamedSharding(
      mesh, sharding.residual_spec(mesh, dataset.input_ids.shape[1], run.sequence_parallel)
    ),
    microbatches=run.microbatches,
    nf4_matmul=run.nf4_matmul or "auto",
    mlp_chunk=run.mlp_chunk,
  )
  graphdef, lora, frozen = place(model, mesh, run.shard_frozen)
  if loss_scale is None and run.dtype == "float16":
    loss_scale = LossScale()
  tx, schedule = make_optimizer(run)
  train_state = {"lora": lora, "opt_state": init_opt_state(tx, lora, loss_scale)}
  key = jax.random.key(run.seed)
  placements = _placements(train_state, mesh)
  start = 0
  if checkpoints is not None:
    restored = checkpoints.restore_latest({**train_state, "key": key})
    if restored is not None:
      state, start = restored
      train_state, key = {k: state[k] for k in train_state}, state["key"]
  # A fresh start and a resumed one give the step the same placement (no recompile).
  train_state = jax.device_put(train_state, placements)
  if mesh is not None:
    # Typed keys cannot be device_put across processes; their raw data can.
    raw = jax.device_put(jax.random.key_data(key), NamedSharding(mesh, PartitionSpec()))
    key = jax.random.wrap_key_data(raw)
  lora, opt_state = train_state["lora"], train_state["opt_state"]
  out_shardings = None
  if mesh is not None:
    replicated = NamedSharding(mesh, PartitionSpec())
    out_shardings = (placements["lora"], placements["opt_state"], replicated)
  step_fn = make_train_step(graphdef, tx, loss_scale, out_shardings, run.loss_chunk)
  skipped = overflows = 0
  eval_step = make_eval_step(graphdef) if eval_dataset is not None else None
  shard = batch_sharding(mesh)
  eval_shard = None if mesh is None else NamedSharding(mesh, PartitionSpec("data", None))
  history = []
  log = run_log.RunLog(Path(run.out), run.steps, enabled=distributed.is_main())
  saved_step = start

  def save(step):
    nonlocal saved_step
    if checkpoints is not None and step != saved_step:
      checkpoints.save(step, {"lora": lora, "opt_state": opt_state, "key": key})
      saved_step = step

  try:
    for step in range(start, run.steps):
      t0 = time.perf_counter()
      host = dataset.batch(step, run.batch_size, run.grad_accum, run.seed)
      batch = {k: distributed.global_batch(v, shard) for k, v in host.items()}
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
      if loss_scale is not None and bool(m["scale_skip"]):
        overflows += 1
      elif not bool(m["good"]):
        if not run.skip_nonfinite:
          raise TrainingError(_bad_loss_message(loss, row["grad_norm"], step + 1))
        skipped += 1
      if run.skip_nonfinite:
        row["skipped_steps"] = skipped
      if loss_scale is not None:
        row["loss_scale"] = float(m["loss_scale"])
        row["overflow_steps"] = overflows
      history.append(row)
      last = step + 1 == run.steps
      if (step + 1) % run.log_every == 0 or last:
        log.train(row)
      if eval_step is not None and (last or (run.eval_every and (step + 1) % run.eval_every == 0)):
        metrics = evaluate(eval_step, lora, frozen, eval_dataset, run.batch_size, eval_shard)
        samples = []
        if sample_fn is not None:
          local = distributed.local_copy((lora, frozen), mesh)
          samples = sample_fn(nnx.merge(graphdef, *local)) if distributed.is_main() else []
        log.eval(step + 1, metrics, samples)
        row.update(metrics)
      if (step + 1) % run.save_every == 0 or last:
        save(step + 1)
      if stop is not None and not last and distributed.any_process(stop.signum is not None):
        save(step + 1)
        raise Stopped(stop.signum or signal.SIGTERM, step + 1, checkpoints is not None)
  finally:
    log.close()
  return nnx.merge(graphdef, lora, frozen), history
