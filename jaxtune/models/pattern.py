"""A decoder's layers as a pattern of block kinds (issue 54's layer-pattern decoder).

Families mix kinds of layers: Qwen3-MoE's dense and sparse MLP layers (``mlp_only_layers``,
``decoder_sparse_step``), Qwen3.5's linear and full attention, Gemma 4's layers of two head
sizes. A ``LayerPattern`` names each layer's kind; layers of one kind are stacked together
(their own leading ``layers`` axis), and the stack is run as a repeating ``period`` of kinds.
``slot`` maps a checkpoint's layer index to its kind and its index inside that kind's stack,
what the converter table's names need in both directions.

A model of one kind has one stack, indexed as the checkpoint is: ``slot(i)`` is (None, i).
"""

import dataclasses
import functools


@dataclasses.dataclass(frozen=True)
class LayerPattern:
  kinds: tuple[str, ...]  # each layer's kind, in the checkpoint's order

  def __post_init__(self):
    if not self.kinds:
      raise ValueError("a layer pattern needs at least one layer")

  @property
  def mixed(self) -> bool:
    """Layers of more than one kind (one stack per kind)."""
    return len(set(self.kinds)) > 1

  @functools.cached_property
  def names(self) -> tuple[str, ...]:
    """The kinds, in the order of their first layer."""
    return tuple(dict.fromkeys(self.kinds))

  @functools.cached_property
  def period(self) -> tuple[str, ...]:
    """The shortest run of kinds that, repeated, gives every layer (the whole stack when no
    shorter one does)."""
    n = len(self.kinds)
    sizes = (p for p in range(1, n + 1) if n % p == 0)
    return next(self.kinds[:p] for p in sizes if self.kinds == self.kinds[:p] * (n // p))

  @property
  def num_periods(self) -> int:
    return len(self.kinds) // len(self.period)

  def ids(self, kind: str) -> tuple[int, ...]:
    """The checkpoint's indices of the layers of ``kind``, in order."""
    return tuple(i for i, k in enumerate(self.kinds) if k == kind)

  def count(self, kind: str) -> int:
    """The layers of ``kind`` (its stack's length)."""
    return self.kinds.count(kind)

  def slot(self, layer: int) -> tuple[str | None, int]:
    """(kind, index in its stack) of checkpoint layer ``layer``; (None, layer) for a model of
    one kind."""
    if not 0 <= layer < len(self.kinds):
      raise IndexError(f"layer {layer} is outside the {len(self.kinds)} layers")
    if not self.mixed:
      return None, layer
    kind = self.kinds[layer]
    return kind, self.kinds[:layer].count(kind)

  def layer(self, kind: str | None, index: int) -> int:
    """The checkpoint's index of layer ``index`` of ``kind``'s stack (``slot``'s inverse)."""
    if kind is None:
      return index
    return self.ids(kind)[index]

  def in_period(self) -> tuple[tuple[str, int], ...]:
    """For each position of the period: (its kind, its index among the period's layers of
    that kind). Layer p * len(period) + m is layer p * (the period's count of its kind) +
    that index of its kind's stack."""
    seen: dict[str, int] = {}
    out = []
    for kind in self.period:
      out.append((kind, seen.get(kind, 0)))
      seen[kind] = seen.get(kind, 0) + 1
    return tuple(out)


def qwen3_moe_kinds(
  num_layers: int, num_experts: int, mlp_only_layers: tuple[int, ...], sparse_step: int
) -> tuple[str, ...]:
  """Qwen3-MoE's kinds as transformers' Qwen3MoeDecoderLayer chooses them: layer i is sparse
  when it is not in ``mlp_only_layers`` and (i + 1) is a multiple of ``decoder_sparse_step``
  (and the model has experts); else dense."""
  return tuple(
    "sparse"
    if i not in mlp_only_layers and num_experts > 0 and (i + 1) % sparse_step == 0
    else "dense"
    for i in range(num_layers)
  )


__all__ = ["LayerPattern", "qwen3_moe_kinds"]
