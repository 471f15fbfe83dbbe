"""The sparse MLP of a mixture-of-experts layer as Flax modules: the router and every expert's
gate, up and down projections, stacked [layers, experts, ...] (NF4 per expert, as
bitsandbytes quantizes each expert's Linear4bit, or dense), each with optional per-expert
LoRA. The computation itself is models/moe.py's.

Paths follow transformers' names where it has them (``mlp.experts.gate_proj`` as Qwen3-MoE
saves it, one tensor per expert); the router is ``mlp.router`` for every family (Qwen3-MoE
and Mixtral call it ``gate``: converters/table.py maps the names).
"""

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from jax.typing import DTypeLike

from jaxtune.errors import ConfigError
from jaxtune.models import moe
from jaxtune.models.config import ModelConfig
from jaxtune.models.layers import nf4_storage
from pallas_kernels import nf4

EXPERT_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
_AXES = {"gate_proj": ("mlp", "embed"), "up_proj": ("mlp", "embed"), "down_proj": ("embed", "mlp")}


class ExpertLinear(nnx.Module):
  """One projection of every expert: W [layers, experts, out, in] frozen (NF4 storage per
  expert, or a dense Param), an optional bias [layers, experts, out], and LoRA A [layers,
  experts, in, r], B [layers, experts, r, out] once apply_lora adds them."""

  def __init__(
    self,
    experts: int,
    in_features: int,
    out_features: int,
    *,
    axes: tuple[str, str],
    quantized: bool,
    layers: int,
    use_bias: bool = False,
    param_dtype: DTypeLike = jnp.float32,
    rngs: nnx.Rngs,
  ):
    self.experts = experts
    self.in_features = in_features
    self.out_features = out_features
    self.axes = axes
    self.layers = layers
    self.quantized = quantized
    lead, lead_axes = (layers, experts), ("layers", "experts")
    vaxes = (*lead_axes, *axes)
    if quantized:
      if in_features % nf4.BLOCKSIZE:
        raise ConfigError(
          f"NF4 needs the input size of an expert's projection to be a multiple of "
          f"{nf4.BLOCKSIZE}, got {in_features}; load this model with quantization=None."
        )
      shape = (*lead, out_features, in_features)
      self.codes, self.absmax, self.nested_absmax, self.offset = nf4_storage(shape, vaxes)
    else:
      std = in_features**-0.5
      shape = (*lead, out_features, in_features)
      weight = std * jax.random.truncated_normal(rngs.params(), -2.0, 2.0, shape, jnp.float32)
      self.weight = nnx.Param(weight.astype(param_dtype), axes=vaxes)
    if use_bias:
      self.bias = nnx.Param(jnp.zeros((*lead, out_features), param_dtype), axes=vaxes[:-1])
    else:
      self.bias = None
    self.lora_a = nnx.data(None)  # LoRAParam [layers, experts, in, r] once apply_lora runs
    self.lora_b = nnx.data(None)
    self.lora_scale = 0.0

  def frozen_arrays(self) -> tuple[jax.Array, ...]:
    """As stored: (codes, absmax, nested_absmax, offset) if NF4, else (weight,)."""
    if self.quantized:
      return tuple(v[...] for v in (self.codes, self.absmax, self.nested_absmax, self.offset))
    return (self.weight[...],)

  def dense_weight(self, dtype: DTypeLike, layer: int | None = None) -> jax.Array:
    """[experts, out, in] in ``dtype`` (dequantized per expert if NF4): one layer's, inside
    the layer scan or with ``layer``; [layers, experts, out, in] outside it without."""
    held = self.frozen_arrays()
    if layer is not None:
      held = tuple(x[layer] for x in held)
    return dense_experts(held, self.quantized, dtype)

  def lora(self) -> moe.ExpertLora | None:
    if self.lora_a is None:
      return None
    return moe.ExpertLora(self.lora_a[...], self.lora_b[...], self.lora_scale)


def dense_experts(frozen: tuple[jax.Array, ...], quantized: bool, dtype: DTypeLike) -> jax.Array:
  """[..., experts, out, in] in ``dtype`` from ``ExpertLinear.frozen_arrays`` (of one layer
  or of all): nf4.dequantize_experts per layer where NF4."""
  if not quantized:
    return frozen[0].astype(dtype)
  f = lambda *x: nf4.dequantize_experts(*x, dtype)  # noqa: E731
  return f(*frozen) if frozen[1].ndim == 3 else jax.vmap(f)(*frozen)  # absmax [E, out, in/64]


class Router(nnx.Module):
  """The router's frozen weight [layers, experts, hidden] (and bias [layers, experts],
  gpt-oss): each token's logit for each expert."""

  def __init__(self, cfg: ModelConfig, *, param_dtype: DTypeLike, rngs: nnx.Rngs):
    shape = (cfg.num_layers, cfg.num_experts, cfg.hidden_size)
    w = jax.random.normal(rngs.params(), shape, jnp.float32) * cfg.hidden_size**-0.5
    self.weight = nnx.Param(w.astype(param_dtype), axes=("layers", "experts", "embed"))
    if cfg.router_bias:
      self.bias = nnx.Param(jnp.zeros(shape[:2], param_dtype), axes=("layers", "experts"))
    else:
      self.bias = None

  def __call__(self, x: jax.Array) -> jax.Array:
    logits = x @ self.weight[...].astype(x.dtype).T
    return logits if self.bias is None else logits + self.bias[...].astype(x.dtype)


class SparseMLP(nnx.Module):
  """Every token through its top-k experts (models/moe.py), weighted and summed; built with a
  leading ``layers`` axis and run under the layer scan like the dense MLP."""

  def __init__(self, cfg: ModelConfig, *, quantized: bool, param_dtype: DTypeLike, rngs: nnx.Rngs):
    e, d, f = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    kw = dict(
      quantized=quantized,
      layers=cfg.num_layers,
      use_bias=cfg.expert_bias,
      param_dtype=param_dtype,
      rngs=rngs,
    )
    self.router = Router(cfg, param_dtype=param_dtype, rngs=rngs)
    self.experts = nnx.Dict(
      gate_proj=ExpertLinear(e, d, f, axes=_AXES["gate_proj"], **kw),
      up_proj=ExpertLinear(e, d, f, axes=_AXES["up_proj"], **kw),
      down_proj=ExpertLinear(e, f, d, axes=_AXES["down_proj"], **kw),
    )
    self.routing = cfg.routing()
    self.activation = moe.Activation(cfg.expert_activation, cfg.swiglu_alpha, cfg.swiglu_limit)

  def __call__(
    self, x: jax.Array, valid: jax.Array | None, impl: str = "ragged_dot"
  ) -> tuple[jax.Array, jax.Array]:
    """(output [B, T, D], router statistics [2, E] float32: each expert's assignments and its
    summed router probability over the ``valid`` [B, T] tokens, for the load-balancing loss
    over every layer, ``moe.balance_loss``)."""
    b, t, d = x.shape
    xs = x.reshape(b * t, d)
    logits = self.router(xs)
    weights, experts = moe.route(logits, self.routing)
    projections = [self.experts[name] for name in EXPERT_PROJECTIONS]
    gate, up, down = (jnp.swapaxes(p.dense_weight(x.dtype), -1, -2) for p in projections)
    biases = None
    if projections[0].bias is not None:
      biases = tuple(p.bias[...] for p in projections)
    lora = {
      name.removesuffix("_proj"): p.lora()
      for name, p in zip(EXPERT_PROJECTIONS, projections, strict=True)
      if p.lora_a is not None
    }
    y = moe.experts_mlp(xs, weights, experts, gate, up, down, self.activation, biases, impl, lora)
    y = checkpoint_name(y, "mlp_out_sparse")
    mask = None if valid is None else valid.reshape(-1)
    stats = moe.router_stats(logits, experts, self.routing.num_experts, mask)
    return y.reshape(b, t, d), stats


def expert_linears(model: nnx.Module) -> Sequence[tuple[tuple[str, ...], ExpertLinear]]:
  """(path, ExpertLinear) for every expert projection of the model."""
  return [
    (tuple(str(p) for p in path), node)
    for path, node in nnx.iter_graph(model)
    if isinstance(node, ExpertLinear)
  ]
