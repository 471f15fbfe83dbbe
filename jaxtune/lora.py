"""LoRA adapters as ``nnx.LoRAParam`` on the target projections (HF names, as PEFT uses them).

lora_a [in, r] starts as PEFT's default (Kaiming-uniform, bound 1/sqrt(in)), lora_b [r, out]
as zeros, so a fresh adapter leaves the model's output unchanged. The scale is alpha / r, or
alpha / sqrt(r) with rsLoRA. The adapters are the only ``LoRAParam``s of a model, so
``nnx.split(model, nnx.LoRAParam, ...)`` yields them as their own pytree.
"""

import dataclasses
import math
from collections.abc import Iterable, Iterator, Mapping

import jax
import jax.numpy as jnp
from flax import nnx

from jaxtune.errors import UserError
from jaxtune.layers import Linear

DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclasses.dataclass(frozen=True)
class LoraConfig:
  rank: int
  alpha: float
  targets: tuple[str, ...]
  dropout: float = 0.0
  rslora: bool = False
  rank_pattern: tuple[tuple[str, int], ...] = ()

  def rank_of(self, name: str) -> int:
    return dict(self.rank_pattern).get(name, self.rank)


def iter_linears(model: nnx.Module) -> Iterator[tuple[tuple[str, ...], Linear]]:
  """(path, Linear) for every linear layer of the model, path as a tuple of names."""
  for path, node in nnx.iter_graph(model):
    if isinstance(node, Linear):
      yield tuple(str(p) for p in path), node


def apply_lora(
  model: nnx.Module,
  rank: int = 16,
  alpha: float = 16,
  targets: Iterable[str] = DEFAULT_TARGETS,
  dropout: float = 0.0,
  rslora: bool = False,
  seed: int = 0,
  rank_pattern: Mapping[str, int] | None = None,
) -> nnx.Module:
  """Add LoRA A/B to every linear whose name is in ``targets``; returns the same model.

  ``rank_pattern`` overrides the rank per target name, e.g. ``{"down_proj": 64}``.
  """
  targets = tuple(targets)
  rank_pattern = dict(rank_pattern or {})
  found = {path[-1] for path, _ in iter_linears(model)}
  unknown = sorted((set(targets) | set(rank_pattern)) - found)
  if unknown:
    raise UserError(
      f"LoRA target(s) {unknown} are not linear layers of this model; choose from {sorted(found)}."
    )
  if not 0.0 <= dropout < 1.0:
    raise UserError(f"LoRA dropout must be in [0, 1), got {dropout}.")
  key = jax.random.key(seed)
  for i, (path, linear) in enumerate(iter_linears(model)):
    name = path[-1]
    if name not in targets:
      continue
    r = int(rank_pattern.get(name, rank))
    if r <= 0:
      raise UserError(f"LoRA rank must be positive, got {r} for {name}.")
    lead = () if linear.layers is None else (linear.layers,)
    lead_axes = () if linear.layers is None else ("layers",)
    out_axis, in_axis = linear.axes
    bound = 1.0 / math.sqrt(linear.in_features)
    a = jax.random.uniform(
      jax.random.fold_in(key, i), (*lead, linear.in_features, r), jnp.float32, -bound, bound
    )
    linear.lora_a = nnx.LoRAParam(a, axes=(*lead_axes, in_axis, None))
    linear.lora_b = nnx.LoRAParam(
      jnp.zeros((*lead, r, linear.out_features), jnp.float32), axes=(*lead_axes, None, out_axis)
    )
    linear.lora_scale = alpha / math.sqrt(r) if rslora else alpha / r
    linear.lora_dropout = float(dropout)
  model.lora_config = LoraConfig(
    rank, alpha, targets, float(dropout), rslora, tuple(sorted(rank_pattern.items()))
  )
  return model
