"""Mixture-of-experts MLPs (jaxtune.models.moe) against transformers' own blocks in float32:
Qwen3-MoE (softmax, top k, renormalised or not), Mixtral (renormalised always) and gpt-oss
(router bias, top k logits then softmax, clamped SwiGLU with expert biases); and the
load-balancing loss against transformers' load_balancing_loss_func."""

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from conftest import max_rel_err

from jaxtune.models import moe


def _perturbed(module, seed):
  """Every parameter random (the experts are initialised empty), so a swapped or
  transposed tensor shows."""
  g = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for p in module.parameters():
      p.copy_(torch.randn(p.shape, generator=g) * 0.5)
  return module


def _np(t):
  return t.detach().numpy()


def _inputs(seed, tokens=13, hidden=64):
  return torch.randn((1, tokens, hidden), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_qwen3_moe_block_matches_transformers(norm_topk_prob):
  from transformers import Qwen3MoeConfig
  from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

  cfg = Qwen3MoeConfig(
    hidden_size=64, moe_intermediate_size=24, num_experts=4, num_experts_per_tok=2,
    norm_topk_prob=norm_topk_prob,
  )  # fmt: skip
  block = _perturbed(Qwen3MoeSparseMoeBlock(cfg), 1)
  x = _inputs(2)
  want = _np(block(x))[0]
  gate_up, down = _np(block.experts.gate_up_proj), _np(block.experts.down_proj)  # [E, 2I, D]
  i = cfg.moe_intermediate_size
  routing = moe.Routing(4, 2, "softmax_topk", normalize=norm_topk_prob)
  xs = jnp.asarray(_np(x)[0])
  weights, experts = moe.route(xs @ _np(block.gate.weight).T, routing)
  got = moe.experts_mlp(
    xs, weights, experts,
    gate_up[:, :i].transpose(0, 2, 1), gate_up[:, i:].transpose(0, 2, 1),
    down.transpose(0, 2, 1),
  )  # fmt: skip
  assert max_rel_err(got, want) <= 2e-6  # float32 sums of values up to ~60: scale-relative
  assert len(set(np.asarray(experts).reshape(-1).tolist())) > 1  # more than one expert ran


def test_mixtral_block_matches_transformers():
  from transformers import MixtralConfig
  from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

  cfg = MixtralConfig(hidden_size=64, intermediate_size=24, num_local_experts=4,
                      num_experts_per_tok=2)  # fmt: skip
  block = _perturbed(MixtralSparseMoeBlock(cfg), 3).eval()
  x = _inputs(4)
  want = _np(block(x))[0]
  gate_up, down = _np(block.experts.gate_up_proj), _np(block.experts.down_proj)
  xs = jnp.asarray(_np(x)[0])
  weights, experts = moe.route(xs @ _np(block.gate.weight).T, moe.Routing(4, 2))
  got = moe.experts_mlp(
    xs, weights, experts,
    gate_up[:, :24].transpose(0, 2, 1), gate_up[:, 24:].transpose(0, 2, 1),
    down.transpose(0, 2, 1),
  )  # fmt: skip
  assert max_rel_err(got, want) <= 2e-6  # float32 sums of values up to ~60: scale-relative


def test_gpt_oss_mlp_matches_transformers():
  from transformers import GptOssConfig
  from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

  cfg = GptOssConfig(hidden_size=64, intermediate_size=24, num_local_experts=4,
                     num_experts_per_tok=2)  # fmt: skip
  mlp = _perturbed(GptOssMLP(cfg), 5)
  x = _inputs(6) * 3  # large enough that the clamps at swiglu_limit take effect
  out = mlp(x)
  want = _np(out[0] if isinstance(out, tuple) else out)[0]
  e = mlp.experts
  gate_up, gate_up_bias = _np(e.gate_up_proj), _np(e.gate_up_proj_bias)  # [E, D, 2I], mixed
  xs = jnp.asarray(_np(x)[0])
  routing = moe.Routing(4, 2, "topk_softmax")
  logits = xs @ _np(mlp.router.weight).T + _np(mlp.router.bias)
  weights, experts = moe.route(logits, routing)
  act = moe.Activation("swiglu_clamped", alpha=cfg.swiglu_alpha, limit=cfg.swiglu_limit)
  got = moe.experts_mlp(
    xs, weights, experts, gate_up[..., ::2], gate_up[..., 1::2], _np(e.down_proj), act,
    biases=(gate_up_bias[:, ::2], gate_up_bias[:, 1::2], _np(e.down_proj_bias)),
  )  # fmt: skip
  assert max_rel_err(got, want) <= 2e-6  # float32 sums of values up to ~60: scale-relative
  chosen = np.asarray(experts)
  gate = np.einsum("td,tkdi->tki", np.asarray(xs), gate_up[chosen][..., ::2])
  assert (gate + gate_up_bias[chosen][..., ::2]).max() > cfg.swiglu_limit  # the clamp ran


def test_load_balancing_loss_matches_transformers():
  from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

  g = torch.Generator().manual_seed(7)
  layers = [torch.randn((10, 4), generator=g) for _ in range(3)]
  mask = torch.tensor([[1] * 7 + [0] * 3])  # one row of 10 tokens, 3 of them padding
  routing = moe.Routing(4, 2)
  stacked = jnp.asarray(np.concatenate([_np(t) for t in layers]))
  want = float(load_balancing_loss_func(tuple(layers), 4, 2))
  np.testing.assert_allclose(moe.load_balancing_loss(stacked, routing), want, rtol=1e-6)
  want = float(load_balancing_loss_func(tuple(layers), 4, 2, attention_mask=mask))
  valid = jnp.tile(jnp.asarray(_np(mask)[0]), 3)
  np.testing.assert_allclose(moe.load_balancing_loss(stacked, routing, valid), want, rtol=1e-6)


@pytest.mark.slow
def test_lora_on_experts_equals_the_merged_weights_with_their_gradients():
  """(x A_e) B_e added per expert by grouped products equals the experts with W_e + s A_e B_e
  merged, in value and in the gradients of A and B; an expert no token chose gets none."""
  import jax

  rng = np.random.default_rng(8)
  t, d, i, e, r = 11, 64, 24, 4, 3
  x = jnp.asarray(rng.standard_normal((t, d)), jnp.float32)
  w = {n: jnp.asarray(rng.standard_normal(s) * 0.3, jnp.float32)
       for n, s in (("gate", (e, d, i)), ("up", (e, d, i)), ("down", (e, i, d)))}  # fmt: skip
  logits = jnp.asarray(rng.standard_normal((t, e)), jnp.float32).at[:, 3].set(-1e9)  # 3 unused
  weights, experts = moe.route(logits, moe.Routing(e, 2))
  shapes = {"gate": (d, i), "up": (d, i), "down": (i, d)}
  ab = {n: (jnp.asarray(rng.standard_normal((e, k, r)) * 0.3, jnp.float32),
            jnp.asarray(rng.standard_normal((e, r, m)) * 0.3, jnp.float32))
        for n, (k, m) in shapes.items()}  # fmt: skip
  scale = 0.5
  probe = jnp.asarray(rng.standard_normal((t, d)), jnp.float32)

  def adapted(ab):
    lora = {n: moe.ExpertLora(a, b, scale) for n, (a, b) in ab.items()}
    y = moe.experts_mlp(x, weights, experts, w["gate"], w["up"], w["down"], lora=lora)
    return jnp.sum(jnp.tanh(y) * probe)

  def merged(ab):
    m = {n: w[n] + scale * jnp.einsum("ekr,erm->ekm", a, b) for n, (a, b) in ab.items()}
    y = moe.experts_mlp(x, weights, experts, m["gate"], m["up"], m["down"], impl="reference")
    return jnp.sum(jnp.tanh(y) * probe)

  np.testing.assert_allclose(adapted(ab), merged(ab), rtol=1e-5)
  got, want = jax.grad(adapted)(ab), jax.grad(merged)(ab)
  for n in ab:
    for g1, g2 in zip(got[n], want[n], strict=True):
      np.testing.assert_allclose(g1, g2, rtol=1e-4, atol=1e-5)
      assert not np.any(np.asarray(g1[3])) and np.any(np.asarray(g1[:3]))
