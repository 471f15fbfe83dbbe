"""Preference objectives on pairs (--method dpo, ipo, orpo): the loss of each pair and the
numbers TRL logs beside it.

A row holds whole pairs: examples 2p and 2p + 1 of a row (segments 2p + 1 and 2p + 2) are a
pair's chosen and rejected sequences, prompt and response each, attention kept within each
(data.py packs them so). One forward gives every token's log-probability of its label; a
response's log-probability is the sum over its trained tokens (the prompt carries no label),
summed per segment.

The reference policy of DPO and IPO is the same network with its adapters off: the frozen
base. Its forward runs in the same step with every LoRA parameter zero (B = 0 makes each
adapter's term vanish exactly) and no gradient, so no second copy of the model exists.

With c, r the chosen and rejected log-probabilities, c0, r0 the reference's, n_c, n_r the
response lengths in tokens (as TRL 1.16 defines each loss):

  dpo   d = (c - c0) - (r - r0);  loss = -(1 - e) log s(beta d) - e log s(-beta d)
        (e = --label-smoothing: conservative DPO; 0 is the sigmoid loss)
  ipo   d = (c - c0) / n_c - (r - r0) / n_r;  loss = (d - 1 / (2 beta))^2
  orpo  a = c / n_c, b = r / n_r (mean log-probabilities), no reference;
        loss = -a - lambda log s((a - b) - (log(1 - e^a) - log(1 - e^b)))
        (the NLL term on the chosen response's tokens, as the ORPO paper has it; TRL's
        ORPOTrainer also counts the prompt's tokens there)

Rewards as TRL logs them: beta (c - c0) and beta (r - r0) (ORPO: lambda a and lambda b);
accuracy = the chosen reward above the rejected one; margin = their difference.
"""

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxtune.data.rows import IGNORE
from jaxtune.parallel.runtime import Runtime
from jaxtune.run_config import RunConfig
from jaxtune.training.log import FIGURES as METRICS  # per pair, summed (the step takes the means)
from jaxtune.training.losses import token_log_probs
from jaxtune.training.objective import Objective

PREFERENCE_METHODS = ("dpo", "ipo", "orpo")


@dataclasses.dataclass(frozen=True)
class Preference(Objective):
  """One preference objective; ``segments``: the most examples a row holds (static)."""

  method: str
  beta: float = 0.1
  label_smoothing: float = 0.0
  orpo_lambda: float = 0.1
  segments: int = 2

  @classmethod
  def from_run(cls, run: RunConfig, segments: int) -> "Preference":
    """The objective of ``run`` (--method dpo/ipo/orpo); ``segments``: Dataset.max_segments."""
    return cls(run.method, run.method_beta, run.label_smoothing, run.orpo_lambda, max(2, segments))

  @property
  def figures(self) -> dict[str, Any]:
    """The dtypes of what ``__call__`` returns beside the loss (Objective.figures)."""
    return {"tokens": jnp.int32, **dict.fromkeys(METRICS, jnp.float32)}

  @property
  def uses_reference(self) -> bool:
    return self.method in ("dpo", "ipo")

  def __call__(
    self,
    graphdef: Any,
    lora: nnx.State,
    frozen: nnx.State,
    batch: dict[str, jax.Array],
    key: jax.Array | None,
    runtime: Runtime,
  ) -> tuple[jax.Array, jax.Array, dict[str, jax.Array]]:
    """(sum of pair losses, number of pairs, {"tokens": response tokens, METRICS: sums})."""
    c, r, n_c, n_r, valid = self.pair_log_probs(graphdef, lora, frozen, batch, key, runtime)
    c0 = r0 = None
    if self.uses_reference:
      zero = jax.tree.map(jnp.zeros_like, lora)
      c0, r0, *_ = self.pair_log_probs(graphdef, zero, frozen, batch, None, runtime)
      c0, r0 = jax.lax.stop_gradient(c0), jax.lax.stop_gradient(r0)
    losses, reward_c, reward_r = self.pair_losses(c, r, c0, r0, n_c, n_r, valid)
    w = valid.astype(jnp.float32)
    figures = {
      "rewards_chosen": reward_c,
      "rewards_rejected": reward_r,
      "reward_accuracy": (reward_c > reward_r).astype(jnp.float32),
      "reward_margin": reward_c - reward_r,
      "logps_chosen": c,
      "logps_rejected": r,
    }
    aux = {k: jnp.sum(jax.lax.stop_gradient(v) * w) for k, v in figures.items()}
    aux["tokens"] = jnp.sum((n_c + n_r) * w).astype(jnp.int32)
    return jnp.sum(jnp.where(valid, losses, 0.0)), jnp.sum(valid).astype(jnp.int32), aux

  def pair_log_probs(
    self,
    graphdef: Any,
    lora: nnx.State,
    frozen: nnx.State,
    batch: dict[str, jax.Array],
    key: jax.Array | None,
    runtime: Runtime,
  ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array]:
    """Per pair slot [B, P] of each row: chosen and rejected log-probabilities, their
    response lengths, and whether the slot holds a pair."""
    model = nnx.merge(graphdef, lora, frozen)
    logp = token_log_probs(model, batch, key, runtime)  # [B, T]
    trained = (batch["labels"] != IGNORE).astype(jnp.float32)
    segments = batch["segment_ids"]
    s = self.segments + 1 + self.segments % 2  # segment 0 (padding), then whole pairs

    def per_segment(values):  # [B, T] -> [B, s]
      return jax.vmap(lambda v, g: jax.ops.segment_sum(v, g, num_segments=s))(values, segments)

    sums, counts = per_segment(logp)[:, 1:], per_segment(trained)[:, 1:]
    c, r, n_c, n_r = sums[:, 0::2], sums[:, 1::2], counts[:, 0::2], counts[:, 1::2]
    return c, r, n_c, n_r, (n_c > 0) & (n_r > 0)

  def pair_losses(
    self,
    c: jax.Array,
    r: jax.Array,
    c0: jax.Array | None,
    r0: jax.Array | None,
    n_c: jax.Array,
    n_r: jax.Array,
    valid: jax.Array,
  ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(loss, chosen reward, rejected reward) of each pair slot (module docstring); slots
    without a pair (``valid`` False) get finite values, so their zero weight has a finite
    gradient."""
    beta = self.beta
    safe_c, safe_r = jnp.maximum(n_c, 1.0), jnp.maximum(n_r, 1.0)
    if self.method == "dpo":
      d = (c - c0) - (r - r0)
      e = self.label_smoothing
      loss = -(1 - e) * jax.nn.log_sigmoid(beta * d) - e * jax.nn.log_sigmoid(-beta * d)
      return loss, beta * (c - c0), beta * (r - r0)
    if self.method == "ipo":
      d = (c - c0) / safe_c - (r - r0) / safe_r
      return (d - 1 / (2 * beta)) ** 2, beta * (c - c0), beta * (r - r0)
    if self.method == "orpo":
      a = jnp.where(valid, c / safe_c, -1.0)
      b = jnp.where(valid, r / safe_r, -1.0)
      log_odds = (a - b) - (log1mexp(a) - log1mexp(b))
      loss = -a - self.orpo_lambda * jax.nn.log_sigmoid(log_odds)
      return loss, self.orpo_lambda * a, self.orpo_lambda * b
    raise ValueError(f"unknown preference method {self.method!r}")


def log1mexp(x: jax.Array) -> jax.Array:
  """log(1 - e^x) for x < 0, accurate on both sides of -log 2."""
  return jnp.where(x < -0.6931471805599453, jnp.log1p(-jnp.exp(x)), jnp.log(-jnp.expm1(x)))
