"""A mixture of experts' tensors on the way out: merged into the checkpoint's own layout
(converters/table.py's expert kinds: one tensor per expert, or gpt-oss's fused experts) and as
PEFT's ``target_parameters`` adapters on transformers' fused experts.

jaxtune holds an adapter per expert on each of gate, up and down. PEFT adapts the fused
``gate_up_proj`` with one pair per expert; gate's and up's pairs of rank r are that one pair of
rank 2r exactly (A the two A's side by side, B block-diagonal; alpha doubled so the scale
stays alpha / r), in the columns the family fuses them in (gate's rows then up's; gpt-oss
interleaves them).
"""

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxtune.errors import ExportError

EXPERT_KINDS = ("expert", "experts_gate_up", "experts_t", "experts_gate_up_bias")
_GATE_UP = ("gate_proj", "up_proj")


def merged_experts(lin: Any, layer: int) -> jax.Array:
  """float32 [experts, out, in]: one layer's expert weights of ExpertLinear ``lin`` (NF4
  dequantized per expert) plus each expert's LoRA update."""
  frozen = tuple(x[layer] for x in lin.frozen_arrays())
  lora = ()
  if lin.lora_a is not None:
    lora = (lin.lora_a[...][layer], lin.lora_b[...][layer], jnp.float32(lin.lora_scale))
  return _merged(frozen, lora, lin.quantized)


@functools.partial(jax.jit, static_argnums=2)
def _merged(frozen: tuple, lora: tuple, quantized: bool) -> jax.Array:
  from jaxtune.models.experts import dense_experts

  w = dense_experts(frozen, quantized, jnp.float32)
  if lora:
    a, b, scale = lora  # [E, in, r], [E, r, out]
    w = w + scale * jnp.swapaxes(a @ b, -1, -2)
  return w


def _update(lin: Any, layer: int) -> jax.Array | None:
  """float32 [experts, out, in]: the LoRA update alone, or None without an adapter."""
  if lin.lora_a is None:
    return None
  a, b = lin.lora_a[...][layer], lin.lora_b[...][layer]
  return lin.lora_scale * jnp.swapaxes(a @ b, -1, -2).astype(jnp.float32)


def expert_tensors(
  kind: str, node: Any, layer: Any, name: str, source: Any
) -> dict[str, np.ndarray]:
  """The float32 tensor ``name`` of a mixture of experts as the checkpoint stores it.
  ``node``: the ExpertLinear (kinds "expert", "experts_t") or the experts' Dict (the fused
  kinds); ``layer``: (layer, expert) for "expert"; ``source``: the checkpoint's original
  weights to add the updates to (write.OriginalWeights), or None for the model's own."""
  if kind == "expert":
    layer, expert = layer
    if source is None:
      return {name: np.asarray(merged_experts(node, layer)[expert])}
    w = source.read(name, (node.out_features, node.in_features)).astype(np.float32)
    update = _update(node, layer)
    return {name: w if update is None else w + np.asarray(update[expert])}
  if kind == "experts_gate_up_bias":
    gate, up = (node[p].bias[...][layer] for p in _GATE_UP)
    if source is not None:
      return {name: source.read(name, (gate.shape[0], 2 * gate.shape[1])).astype(np.float32)}
    return {name: _interleave(np.asarray(gate, np.float32), np.asarray(up, np.float32))}
  if kind == "experts_t":  # [E, in, out]
    if source is None:
      return {name: np.asarray(merged_experts(node, layer)).transpose(0, 2, 1)}
    e, o, i = node.experts, node.out_features, node.in_features
    w = source.read(name, (e, i, o)).astype(np.float32)
    update = _update(node, layer)
    return {name: w if update is None else w + np.asarray(update).transpose(0, 2, 1)}
  # experts_gate_up: [E, in, 2 * out], gate in the even columns
  gate_lin, up_lin = (node[p] for p in _GATE_UP)
  if source is None:
    parts = [np.asarray(merged_experts(x, layer)).transpose(0, 2, 1) for x in (gate_lin, up_lin)]
    return {name: _interleave(*parts)}
  shape = (gate_lin.experts, gate_lin.in_features, 2 * gate_lin.out_features)
  w = source.read(name, shape).astype(np.float32)
  for col, lin in enumerate((gate_lin, up_lin)):
    update = _update(lin, layer)
    if update is not None:
      w[..., col::2] += np.asarray(update).transpose(0, 2, 1)
  return {name: w}


def _interleave(even: np.ndarray, odd: np.ndarray) -> np.ndarray:
  out = np.empty((*even.shape[:-1], 2 * even.shape[-1]), np.float32)
  out[..., 0::2], out[..., 1::2] = even, odd
  return out


def peft_experts(model: Any) -> tuple[dict[str, np.ndarray], list[str], dict, dict]:
  """(adapter tensors, target_parameters, rank_pattern, alpha_pattern) of the model's expert
  adapters in PEFT's names and layout: per layer, ``mlp.experts.base_layer.lora_*`` for
  gate_up_proj (PEFT nests the wrappers in the experts' parameter order) and
  ``mlp.experts.lora_*`` for down_proj; just ``mlp.experts.lora_*`` where only one is
  adapted. A [E * r, in] (expert e's rows e*r ...), B [out, r * E] (expert e's columns e,
  e + E, ...)."""
  from jaxtune.models.experts import expert_linears

  cfg, lora_cfg = model.config, model.lora_config
  lins = {p[-1]: lin for p, lin in expert_linears(model) if lin.lora_a is not None}
  if not lins:
    return {}, [], {}, {}
  gpt_oss = cfg.model_type == "gpt_oss"
  fused = [p for p in _GATE_UP if p in lins]
  params = (["gate_up_proj"] if fused else []) + (["down_proj"] if "down_proj" in lins else [])
  ranks, alphas = {}, {}
  tensors = {}
  rank = lora_cfg.rank
  for layer in range(cfg.num_layers):
    for param in params:
      inner = param == "gate_up_proj" and len(params) == 2
      prefix = f"base_model.model.model.layers.{layer}.mlp.experts" + (
        ".base_layer" if inner else ""
      )
      if param == "down_proj":
        a, b = _factors(lins["down_proj"], layer)
      else:
        a, b = _fused_gate_up(lins, fused, layer, gpt_oss)
      r = a.shape[-1]
      if r != rank:  # gate and up together: rank 2r, alpha doubled, scale unchanged
        ranks[param] = r
        scale = lins[fused[0]].lora_scale
        alphas[param] = scale * (math.sqrt(r) if lora_cfg.rslora else r)
      e = a.shape[0]
      tensors[f"{prefix}.lora_A.weight"] = np.ascontiguousarray(
        a.transpose(0, 2, 1).reshape(e * r, -1)
      )
      tensors[f"{prefix}.lora_B.weight"] = np.ascontiguousarray(
        b.transpose(2, 1, 0).reshape(b.shape[-1], r * e)
      )
  return tensors, [f"mlp.experts.{p}" for p in params], ranks, alphas


def _factors(lin: Any, layer: int) -> tuple[np.ndarray, np.ndarray]:
  return (
    np.asarray(lin.lora_a[...][layer], np.float32),  # [E, in, r]
    np.asarray(lin.lora_b[...][layer], np.float32),  # [E, r, out]
  )


def _fused_gate_up(lins: dict, fused: list, layer: int, gpt_oss: bool):
  """gate's and up's pairs as one pair on the fused [2 * out] output: A [E, in, r_g + r_u],
  B [E, r_g + r_u, 2 * out] block-diagonal, in the family's column order."""
  pairs = {p: _factors(lins[p], layer) for p in fused}
  first = next(iter(pairs.values()))
  e, out = first[1].shape[0], first[1].shape[-1]
  if len({lins[p].lora_scale for p in fused}) > 1:
    raise ExportError("the experts' gate and up adapters have different scales; PEFT fuses them.")
  a = np.concatenate([pairs[p][0] for p in fused], axis=-1)
  b = np.zeros((e, a.shape[-1], 2 * out), np.float32)
  row = 0
  for p in fused:
    pb = pairs[p][1]
    cols = _cols(p, out, gpt_oss)
    b[:, row : row + pb.shape[1], cols] = pb
    row += pb.shape[1]
  return a, b


def _cols(proj: str, out: int, gpt_oss: bool) -> slice:
  first = proj == "gate_proj"
  if gpt_oss:
    return slice(0 if first else 1, None, 2)
  return slice(0, out) if first else slice(out, 2 * out)


def peft_routers(model: Any) -> tuple[dict[str, np.ndarray], list[str]]:
  """(tensors, modules_to_save) of trained routers (--train-router) as PEFT saves a module
  it keeps whole: ``mlp.gate`` (Qwen3-MoE, Mixtral) or ``mlp.router`` (gpt-oss) per layer."""
  cfg, lora_cfg = model.config, model.lora_config
  if not lora_cfg.train_router:
    return {}, []
  name = "router" if cfg.model_type == "gpt_oss" else "gate"
  router = model.layers.mlp.router
  tensors = {}
  for layer in range(cfg.num_layers):
    prefix = f"base_model.model.model.layers.{layer}.mlp.{name}"
    tensors[f"{prefix}.weight"] = np.asarray(router.weight[...][layer], np.float32)
    if router.bias is not None:
      tensors[f"{prefix}.bias"] = np.asarray(router.bias[...][layer], np.float32)
  return tensors, [name]
