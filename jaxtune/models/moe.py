"""A mixture of experts' MLP as functions of its arrays: the router (which experts each token
goes to, with what weight), dropless routing (every token's assignments sorted by expert,
each expert's rows through its own weights by one grouped product, the results weighted and
summed back per token) and the load-balancing loss.

The families differ only in their router (``Routing``) and their experts' activation
(``Activation``): Qwen3-MoE and Mixtral take the top k of the softmax over all experts
(Qwen3-MoE renormalises them where ``norm_topk_prob`` says, Mixtral always); gpt-oss takes
the top k router logits (its router has a bias) and a softmax over those k, and its experts
run a clamped SwiGLU with biases. Read from transformers' modeling code
(``Qwen3MoeTopKRouter``, ``MixtralTopKRouter``, ``GptOssTopKRouter``, ``GptOssExperts``).
"""

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from pallas_kernels.grouped_matmul import grouped_matmul

ROUTERS = ("softmax_topk", "topk_softmax")
ACTIVATIONS = ("silu", "gelu_tanh", "swiglu_clamped")


@dataclasses.dataclass(frozen=True)
class Routing:
  """``kind`` "softmax_topk": softmax over every expert's logit, then the top k
  (``normalize``: divided by their sum); "topk_softmax": the top k logits, then a softmax
  over those."""

  num_experts: int
  top_k: int
  kind: str = "softmax_topk"
  normalize: bool = True

  def __post_init__(self):
    if self.kind not in ROUTERS:
      raise ValueError(f"router kind must be one of {ROUTERS}, got {self.kind!r}")
    if not 1 <= self.top_k <= self.num_experts:
      raise ValueError(f"top_k must be 1 .. {self.num_experts} experts, got {self.top_k}")


class ExpertLora(NamedTuple):
  """One projection's adapters for every expert: a [E, in, r], b [E, r, out] (input-major, as
  the grouped product takes them), and the LoRA scale (alpha / r, or alpha / sqrt(r))."""

  a: jax.Array
  b: jax.Array
  scale: float


@dataclasses.dataclass(frozen=True)
class Activation:
  """The experts' gated activation: act(gate) * up for "silu" and "gelu_tanh";
  "swiglu_clamped" (gpt-oss): gate clamped above at ``limit``, up to [-limit, limit], then
  (up + 1) * gate * sigmoid(alpha * gate)."""

  kind: str = "silu"
  alpha: float = 1.702
  limit: float = 7.0

  def __post_init__(self):
    if self.kind not in ACTIVATIONS:
      raise ValueError(f"expert activation must be one of {ACTIVATIONS}, got {self.kind!r}")

  def __call__(self, gate: jax.Array, up: jax.Array) -> jax.Array:
    if self.kind == "silu":
      return jax.nn.silu(gate) * up
    if self.kind == "gelu_tanh":
      return jax.nn.gelu(gate, approximate=True) * up
    gate = jnp.minimum(gate, self.limit)
    up = jnp.clip(up, -self.limit, self.limit)
    return (up + 1) * (gate * jax.nn.sigmoid(gate * self.alpha))


def route(logits: jax.Array, routing: Routing) -> tuple[jax.Array, jax.Array]:
  """(weights [T, k] in the logits' dtype, experts [T, k] int32) of router ``logits`` [T, E];
  the softmax in float32, as transformers computes it."""
  if routing.kind == "softmax_topk":
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weights, experts = jax.lax.top_k(probs, routing.top_k)
    if routing.normalize:
      weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
  else:
    top, experts = jax.lax.top_k(logits, routing.top_k)
    weights = jax.nn.softmax(top.astype(jnp.float32), axis=-1)
  return weights.astype(logits.dtype), experts.astype(jnp.int32)


def sort_by_expert(experts: jax.Array, num_experts: int) -> tuple[jax.Array, jax.Array]:
  """(order [T * k]: the flat assignments sorted by expert, stably; group_sizes [E]: each
  expert's count). Assignment ``a`` is token ``a // k``'s choice ``a % k``."""
  flat = experts.reshape(-1)
  order = jnp.argsort(flat, stable=True)
  sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
  return order, sizes


def experts_mlp(
  x: jax.Array,
  weights: jax.Array,
  experts: jax.Array,
  gate: jax.Array,
  up: jax.Array,
  down: jax.Array,
  activation: Activation = Activation(),
  biases: tuple[jax.Array, jax.Array, jax.Array] | None = None,
  impl: str = "ragged_dot",
  lora: dict[str, ExpertLora] | None = None,
) -> jax.Array:
  """sum over each token's k experts of weight * expert(x): x [T, D]; ``weights``,
  ``experts`` [T, k] (``route``); gate and up [E, D, I], down [E, I, D] (input-major, the
  grouped product's layout); ``biases`` (gate [E, I], up [E, I], down [E, D]) or None.
  Dropless: every assignment computed, none dropped for capacity. ``impl``: the grouped
  product's (pallas_kernels.grouped_matmul). ``lora``: per-expert adapters by projection
  ("gate", "up", "down"), each added as (x A_e) B_e times its scale by two more grouped
  products, never forming W + A B."""
  lora = lora or {}
  t, k = experts.shape
  order, sizes = sort_by_expert(experts, gate.shape[0])
  token = order // k
  rows = x[token]  # [T * k, D], sorted by expert
  g = _project(rows, gate, sizes, lora.get("gate"), impl)
  u = _project(rows, up, sizes, lora.get("up"), impl)
  which = experts.reshape(-1)[order]  # each sorted row's expert
  if biases is not None:
    g = g + biases[0][which].astype(g.dtype)
    u = u + biases[1][which].astype(u.dtype)
  h = activation(g, u)
  y = _project(h, down, sizes, lora.get("down"), impl)
  if biases is not None:
    y = y + biases[2][which].astype(y.dtype)
  y = y * weights.reshape(-1)[order][:, None].astype(y.dtype)
  return jax.ops.segment_sum(y, token, num_segments=t).astype(x.dtype)


def _project(rows, w, sizes, lora: "ExpertLora | None", impl: str) -> jax.Array:
  y = grouped_matmul(rows, w, sizes, impl=impl)
  if lora is not None:
    low = grouped_matmul(rows, lora.a.astype(rows.dtype), sizes, impl=impl)
    y = y + lora.scale * grouped_matmul(low, lora.b.astype(rows.dtype), sizes, impl=impl)
  return y


def load_balancing_loss(
  logits: jax.Array, routing: Routing, valid: jax.Array | None = None
) -> jax.Array:
  """The auxiliary loss that pushes a router towards using its experts evenly, as
  transformers' ``load_balancing_loss_func`` computes it: E * sum over experts of (its
  assignments per token) times (its mean router probability), over the tokens ``valid``
  [T] marks (None: all). ``logits`` [T, E], every layer's tokens stacked; float32."""
  _, experts = jax.lax.top_k(logits, routing.top_k)  # the softmax's top k
  rows = jnp.asarray(logits.shape[0]) if valid is None else jnp.sum(valid)
  return balance_loss(router_stats(logits, experts, routing.num_experts, valid), rows)


def router_stats(
  logits: jax.Array, experts: jax.Array, num_experts: int, valid: jax.Array | None = None
) -> jax.Array:
  """One layer's share of the load-balancing loss, summable over layers: [2, E] float32, each
  expert's assignments (over the top k) and its summed router probability, over the tokens
  ``valid`` [T] marks (None: all). ``logits`` [T, E], ``experts`` [T, k] (``route``)."""
  probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
  w = jnp.ones(probs.shape[:1], jnp.float32) if valid is None else valid.astype(jnp.float32)
  counts = jnp.sum(jax.nn.one_hot(experts, num_experts) * w[:, None, None], axis=(0, 1))
  return jnp.stack([counts, jnp.sum(probs * w[:, None], axis=0)])


def balance_loss(stats: jax.Array, rows: jax.Array) -> jax.Array:
  """``load_balancing_loss`` from the ``router_stats`` of every layer summed, ``rows`` the
  number of valid tokens times the layers: E * sum over experts of (assignments per row)
  times (mean probability)."""
  rows = jnp.maximum(rows.astype(jnp.float32), 1.0)
  return jnp.sum(stats[0] / rows * (stats[1] / rows)) * stats.shape[-1]
