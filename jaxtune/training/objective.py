"""What a training step minimises (``Objective``), written once: the call the step makes on
each micro-batch and the attributes it reads. SFT's cross-entropy (``SFT``, here), the
preference objectives (preference.Preference: DPO, IPO, ORPO) and GRPO (rl.GRPO) implement it.
"""

import dataclasses
from typing import Any, ClassVar, Protocol

import jax
import jax.numpy as jnp
from flax import nnx

from jaxtune.parallel.runtime import DEFAULT, Runtime
from jaxtune.training.losses import balanced_loss_sums, loss_sums


class Objective(Protocol):
  """``objective(graphdef, lora, frozen, batch, key, runtime)`` on one micro-batch ->
  (sum of losses, how many they are, {"tokens": trained tokens, other figures: sums}); the
  step divides the loss and the figures by the count over the accumulated batch. ``key``: the
  dropout key (None in evaluation, and for a reference forward).

  Implementations subclass it, for the defaults below, as frozen dataclasses: their fields
  then name them in the step store's key (loop._step_identity)."""

  # A loss of exactly 0 means no labelled token (the step is skipped), except for objectives
  # where it is a normal value (GRPO: every group's rewards equal, so every advantage is 0).
  zero_loss_ok: ClassVar[bool] = False

  @property
  def figures(self) -> dict[str, Any]:
    """The dtypes of the figures ``__call__`` returns beside the loss ({"tokens": int32, ...})."""
    ...

  def __call__(
    self,
    graphdef: Any,
    lora: nnx.State,
    frozen: nnx.State,
    batch: dict[str, jax.Array],
    key: jax.Array | None,
    runtime: Runtime,
  ) -> tuple[jax.Array, jax.Array, dict[str, jax.Array]]:
    """(sum of losses, how many they are, figures' sums) of one micro-batch."""
    ...


@dataclasses.dataclass(frozen=True)
class SFT(Objective):
  """Next-token cross-entropy, averaged over trained tokens (losses.loss_sums).

  ``router_aux_loss_coef`` (a mixture of experts; None for other models): the load-balancing
  loss over the routers (Decoder.hidden_and_balance) is added with this weight, as
  transformers' MoE models add ``router_aux_loss_coef * aux_loss`` to the mean cross-entropy,
  and reported as the figure ``router_balance`` (its mean over the step's micro-batches,
  weighted by their trained tokens)."""

  router_aux_loss_coef: float | None = None

  @property
  def figures(self) -> dict[str, Any]:
    if self.router_aux_loss_coef is None:
      return {"tokens": jnp.int32}
    return {"tokens": jnp.int32, "router_balance": jnp.float32}

  def __call__(
    self,
    graphdef: Any,
    lora: nnx.State,
    frozen: nnx.State,
    batch: dict[str, jax.Array],
    key: jax.Array | None,
    runtime: Runtime = DEFAULT,
  ) -> tuple[jax.Array, jax.Array, dict[str, jax.Array]]:
    """(sum of token losses, trained tokens, {"tokens": trained tokens})."""
    if self.router_aux_loss_coef is None:
      s, n = loss_sums(graphdef, lora, frozen, batch, key, runtime)
      return s, n, {"tokens": n}
    s, n, balance = balanced_loss_sums(graphdef, lora, frozen, batch, key, runtime)
    weighted = balance * n.astype(jnp.float32)  # the step divides by all micro-batches' tokens
    total = s + self.router_aux_loss_coef * weighted
    return total, n, {"tokens": n, "router_balance": weighted}


sft_objective = SFT()  # the default objective (--method sft)
