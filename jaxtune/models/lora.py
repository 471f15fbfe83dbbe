"""LoRA adapters as ``nnx.LoRAParam`` on the target projections (HF names, as PEFT uses them).

lora_a [in, r] starts as PEFT's default (Kaiming-uniform, bound 1/sqrt(in)), lora_b [r, out]
as zeros, so a fresh adapter leaves the model's output unchanged. The scale is alpha / r, or
alpha / sqrt(r) with rsLoRA. The adapters are the only ``LoRAParam``s of a model, so
``nnx.split(model, nnx.LoRAParam, ...)`` yields them as their own pytree.

Ranks (and alphas) may differ by module and by layer (``rank_pattern``, ``alpha_pattern``;
keys below). Layers stay stacked and scanned: a projection whose layers differ gets A
[layers, in, R] and B [layers, R, out] at its largest rank R, and a constant mask turns off
the columns past each layer's rank (they start at zero and, masked, get no gradient), with a
scale per layer: the same function as separate ranks.

Pattern keys: ``down_proj`` (a projection in every layer), ``layers.3`` or ``layers.0-7``
(every projection of those layers), ``layers.0-7.down_proj`` (both); the most specific key
wins (layers and projection, then layers, then projection).
"""

import dataclasses
import math
import re
from collections.abc import Iterable, Iterator, Mapping

import jax
import jax.numpy as jnp
from flax import nnx

from jaxtune.errors import UserError
from jaxtune.models.layers import Linear, LoRAConstant

DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


# (Layer numbers of at most 9 digits: a longer one is no layer, and int() of one over 4,300
# digits would raise.)
_KEY = re.compile(
  r"(?:layers\.(?P<first>\d{1,9})(?:-(?P<last>\d{1,9}))?)?\.?(?P<name>[A-Za-z_]\w*)?$"
)
# Pattern values past this are no rank or alpha (and overflow int32 shapes).
_MAX_VALUE = 2**31 - 1


@dataclasses.dataclass(frozen=True)
class LoraConfig:
  rank: int
  alpha: float
  targets: tuple[str, ...]
  dropout: float = 0.0
  rslora: bool = False
  rank_pattern: tuple[tuple[str, int], ...] = ()
  alpha_pattern: tuple[tuple[str, float], ...] = ()
  train_router: bool = False  # a mixture of experts' routers train too (full weights)

  def rank_of(self, name: str, layer: int | None = None) -> int:
    """The rank of projection ``name`` (in ``layer``, for stacked layers)."""
    return int(_lookup(dict(self.rank_pattern), name, layer, self.rank))

  def alpha_of(self, name: str, layer: int | None = None) -> float:
    return float(_lookup(dict(self.alpha_pattern), name, layer, self.alpha))


def parse_pattern(spec: str | None, kind: type = int) -> dict[str, int | float]:
  """``--lora-rank-pattern down_proj=64,layers.0-7=32`` -> {"down_proj": 64, "layers.0-7": 32}."""
  out = {}
  for part in (spec or "").split(","):
    if not part.strip():
      continue
    key, _, value = part.partition("=")
    shown = repr(part.strip()[:60])
    try:
      number = kind(value)
    except ValueError:  # (also int() of a number over 4,300 digits)
      raise UserError(
        f"a LoRA pattern takes KEY=VALUE pairs separated by commas, e.g. "
        f"down_proj=64,layers.0-7=32; got {shown}."
      ) from None
    if not (math.isfinite(number) and abs(number) <= _MAX_VALUE):
      raise UserError(f"the LoRA pattern entry {shown} needs a finite value below 2**31.")
    out[key.strip()] = number
  return out


def _parse_key(key: str) -> tuple[range | None, str | None]:
  m = _KEY.match(key)
  if m is None or not key or (m["first"] is None and m["name"] is None):
    raise UserError(
      f"LoRA pattern key {key!r} is not one of NAME, layers.N, layers.N-M or layers.N-M.NAME "
      "(e.g. down_proj, layers.0-7, layers.0-7.down_proj)."
    )
  if key.startswith(".") or (m["first"] is not None and not key.startswith("layers.")):
    raise UserError(f"LoRA pattern key {key!r} is malformed; e.g. layers.0-7.down_proj.")
  layers = None
  if m["first"] is not None:
    first = int(m["first"])
    last = int(m["last"]) if m["last"] is not None else first
    if last < first:
      raise UserError(f"LoRA pattern key {key!r} has a layer range that ends before it starts.")
    layers = range(first, last + 1)
  return layers, m["name"]


def check_pattern(pattern: Mapping[str, float], targets: Iterable[str], num_layers: int) -> None:
  """Every key well-formed, naming a target projection and layers the model has; every
  value positive."""
  for key, value in pattern.items():
    layers, name = _parse_key(key)
    if name is not None and name not in targets:
      raise UserError(f"pattern key {key!r} names {name}, which is not a LoRA target.")
    if layers is not None and layers.stop > num_layers:
      raise UserError(
        f"pattern key {key!r} names layer {layers.stop - 1}, but the model has {num_layers} "
        f"layers (0 to {num_layers - 1})."
      )
    if value <= 0:
      raise UserError(f"pattern key {key!r} has the value {value}; it must be positive.")


def _lookup(pattern: Mapping[str, float], name: str, layer: int | None, default: float) -> float:
  """The pattern's value for projection ``name`` in ``layer``: the most specific key wins."""
  best, rank = default, -1
  for key, value in pattern.items():
    layers, proj = _parse_key(key)
    if proj is not None and proj != name:
      continue
    if layers is not None and (layer is None or layer not in layers):
      continue
    specificity = (layers is not None) * 2 + (proj is not None)
    if specificity > rank:
      best, rank = value, specificity
  return best


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
  alpha_pattern: Mapping[str, float] | None = None,
  train_router: bool = False,
) -> nnx.Module:
  """Add LoRA A/B to every linear whose name is in ``targets``; returns the same model.

  ``rank_pattern`` / ``alpha_pattern`` override the rank / alpha by projection and layer,
  e.g. ``{"down_proj": 64, "layers.0-7": 32}`` (module docstring). ``train_router``: a
  mixture of experts' router weights (and biases) become trainable too, in float32.
  """
  targets = tuple(targets)
  rank_pattern = dict(rank_pattern or {})
  alpha_pattern = dict(alpha_pattern or {})
  from jaxtune.models.experts import expert_linears

  experts = expert_linears(model)
  found = {path[-1] for path, _ in (*iter_linears(model), *experts)}
  named = {_parse_key(k)[1] for k in (*rank_pattern, *alpha_pattern)} - {None}
  num_layers = model.config.num_layers
  for key in (*rank_pattern, *alpha_pattern):
    layers = _parse_key(key)[0]
    if layers is not None and layers.stop > num_layers:
      raise UserError(
        f"LoRA pattern key {key!r} names layer {layers.stop - 1}, but the model has "
        f"{num_layers} layers (0 to {num_layers - 1})."
      )
  unknown = sorted((set(targets) | named) - found)
  if unknown:
    raise UserError(
      f"LoRA target(s) {unknown} are not linear layers of this model; choose from {sorted(found)}."
    )
  if not 0.0 <= dropout < 1.0:
    raise UserError(f"LoRA dropout must be in [0, 1), got {dropout}.")
  config = LoraConfig(
    rank,
    alpha,
    targets,
    float(dropout),
    rslora,
    tuple(sorted(rank_pattern.items())),
    tuple(sorted(alpha_pattern.items())),
    train_router,
  )
  if train_router:
    _trainable_routers(model)
  key = jax.random.key(seed)
  _expert_lora(experts, config, jax.random.fold_in(key, 1 << 20))
  for i, (path, linear) in enumerate(iter_linears(model)):
    name = path[-1]
    if name not in targets:
      continue
    layers = [None] if linear.layers is None else list(range(linear.layers))
    ranks = [config.rank_of(name, layer) for layer in layers]
    alphas = [config.alpha_of(name, layer) for layer in layers]
    if min(ranks) <= 0:
      raise UserError(f"LoRA rank must be positive, got {min(ranks)} for {name}.")
    r = max(ranks)
    lead = () if linear.layers is None else (linear.layers,)
    lead_axes = () if linear.layers is None else ("layers",)
    out_axis, in_axis = linear.axes
    bound = 1.0 / math.sqrt(linear.in_features)
    a = jax.random.uniform(
      jax.random.fold_in(key, i), (*lead, linear.in_features, r), jnp.float32, -bound, bound
    )
    scales = [
      al / math.sqrt(rk) if rslora else al / rk for al, rk in zip(alphas, ranks, strict=True)
    ]
    if len(set(ranks)) > 1 or len(set(alphas)) > 1:
      mask = (jnp.arange(r)[None, :] < jnp.asarray(ranks)[:, None]).astype(jnp.float32)
      a = a * mask[:, None, :]  # the columns past a layer's rank start (and stay) at zero
      linear.lora_mask = LoRAConstant(mask, axes=("layers", None))
      scale = LoRAConstant(jnp.asarray(scales, jnp.float32), axes=("layers",))
      linear.lora_scale = nnx.data(scale)  # an array now, where a float stood
    else:
      linear.lora_scale = scales[0]
    linear.lora_a = nnx.LoRAParam(a, axes=(*lead_axes, in_axis, None))
    linear.lora_b = nnx.LoRAParam(
      jnp.zeros((*lead, r, linear.out_features), jnp.float32), axes=(*lead_axes, None, out_axis)
    )
    linear.lora_dropout = float(dropout)
  model.lora_config = config
  return model


def _trainable_routers(model: nnx.Module) -> None:
  """Every router's weight and bias as trainable parameters (LoRAParam: what the optimizer
  sees), in float32."""
  from jaxtune.models.experts import Router

  routers = [node for _, node in nnx.iter_graph(model) if isinstance(node, Router)]
  if not routers:
    raise UserError("train_router: this model has no mixture-of-experts routers to train.")
  for router in routers:
    for name in ("weight", "bias"):
      var = getattr(router, name)
      if var is not None:
        meta = var.get_metadata()
        axes = meta.get("axes")
        setattr(router, name, nnx.LoRAParam(var[...].astype(jnp.float32), axes=axes))


def _expert_lora(experts, config: LoraConfig, key: jax.Array) -> None:
  """A and B per expert on every targeted expert projection (as PEFT's target_parameters
  gives them: one pair per expert, A Kaiming-uniform with bound 1/sqrt(in), B zero)."""
  for i, (path, lin) in enumerate(experts):
    name = path[-1]
    if name not in config.targets:
      continue
    ranks = {config.rank_of(name, layer) for layer in range(lin.layers)}
    alphas = {config.alpha_of(name, layer) for layer in range(lin.layers)}
    if len(ranks) > 1 or len(alphas) > 1:
      raise UserError(
        f"--lora-rank-pattern/--lora-alpha-pattern give the experts' {name} different ranks "
        "or alphas by layer, which jaxtune does not build for expert projections yet; give "
        f"{name} one rank and alpha for every layer."
      )
    if config.dropout:
      raise UserError(
        f"LoRA dropout ({config.dropout}) cannot apply to the experts' {name} (as in PEFT, "
        "whose expert adapters refuse it too); set --lora-dropout 0 or leave the experts' "
        "projections out of --lora-targets."
      )
    (r,), (alpha,) = ranks, alphas
    if r <= 0:
      raise UserError(f"LoRA rank must be positive, got {r} for {name}.")
    lead = (lin.layers, lin.experts)
    bound = 1.0 / math.sqrt(lin.in_features)
    a = jax.random.uniform(
      jax.random.fold_in(key, i), (*lead, lin.in_features, r), jnp.float32, -bound, bound
    )
    out_axis, in_axis = lin.axes
    lin.lora_a = nnx.LoRAParam(a, axes=("layers", "experts", in_axis, None))
    b = jnp.zeros((*lead, r, lin.out_features), jnp.float32)
    lin.lora_b = nnx.LoRAParam(b, axes=("layers", "experts", None, out_axis))
    lin.lora_scale = alpha / math.sqrt(r) if config.rslora else alpha / r


def layer_scale(linear: Linear, layer: int | None) -> float:
  """The LoRA scale of ``linear`` (in ``layer``, when its layers are stacked)."""
  if isinstance(linear.lora_scale, LoRAConstant):
    return float(linear.lora_scale[...][layer])
  return float(linear.lora_scale)
