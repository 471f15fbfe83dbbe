"""LoRA: a separate pytree, zero-initialised B, and gradients equal to PEFT's."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
from conftest import assert_lora_grads_match_peft, copy_peft_lora_into, peft_with_random_adapters
from flax import nnx

import jaxtune
from jaxtune.errors import UserError
from jaxtune.models.lora import iter_linears

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _ids(seed=0):
  return np.random.default_rng(seed).integers(0, 256, (2, 24))


def _loss(model, ids):
  logits = model(ids[:, :-1])
  return optax.softmax_cross_entropy_with_integer_labels(logits, ids[:, 1:]).mean()


def test_split_yields_adapters_as_their_own_pytree(hf_llama_dir):
  path, _ = hf_llama_dir()
  model = jaxtune.apply_lora(jaxtune.from_pretrained(path), rank=4, targets=("q_proj", "v_proj"))
  _, lora, frozen = nnx.split(model, nnx.LoRAParam, ...)
  lora_paths = {p for p, _ in lora.flat_state()}
  assert len(lora_paths) == 4  # q and v, A and B each (stacked over layers)
  assert all(p[-1] in ("lora_a", "lora_b") for p in lora_paths)
  assert not any(p[-1].startswith("lora") for p, _ in frozen.flat_state())
  for p, v in lora.flat_state():
    assert v.get_value().dtype == jnp.float32
    if p[-1] == "lora_b":
      assert not np.any(np.asarray(v.get_value()))


def test_b_zero_leaves_output_unchanged(hf_llama_dir):
  path, _ = hf_llama_dir(seed=1)
  ids = jnp.asarray(_ids(1))
  base = jaxtune.from_pretrained(path, dtype="float32")
  before = base(ids)
  lora = jaxtune.apply_lora(base, rank=8, alpha=32, dropout=0.1, seed=3)
  # Adding an exact zero; only XLA's choice of fusion may move the last bit.
  np.testing.assert_allclose(np.asarray(lora(ids)), np.asarray(before), rtol=1e-6, atol=1e-6)
  # And a non-zero B does change it, so the adapters are really in the path.
  lora.layers.mlp.down_proj.lora_b[...] = jnp.ones_like(lora.layers.mlp.down_proj.lora_b[...])
  assert not np.allclose(np.asarray(lora(ids)), np.asarray(before))


@pytest.mark.slow
def test_gradient_touches_only_adapters(hf_llama_dir):
  path, _ = hf_llama_dir(seed=2)
  model = jaxtune.apply_lora(jaxtune.from_pretrained(path, dtype="float32"), rank=4)
  for _, linear in iter_linears(model):
    if linear.lora_b is not None:
      linear.lora_b[...] = 0.01 * jnp.ones_like(linear.lora_b[...])
  graphdef, lora, frozen = nnx.split(model, nnx.LoRAParam, ...)
  ids = jnp.asarray(_ids(2))

  def loss_of(lora_state, frozen_state):
    return _loss(nnx.merge(graphdef, lora_state, frozen_state), ids)

  grads = jax.jit(jax.grad(loss_of))(lora, frozen)
  norms = [float(jnp.abs(g).max()) for g in jax.tree.leaves(grads)]
  assert len(norms) == 2 * 7 and all(n > 0 for n in norms)
  # An optimizer over the LoRA pytree cannot reach anything else.
  tx = optax.adamw(1e-2)

  @jax.jit
  def update(grads, lora):
    updates, _ = tx.update(grads, tx.init(lora), lora)
    return optax.apply_updates(lora, updates)

  new_lora = update(grads, lora)
  assert jax.tree.structure(new_lora) == jax.tree.structure(lora)
  trained = nnx.merge(graphdef, new_lora, frozen)
  for (p, a), (_, b) in zip(
    nnx.state(trained, nnx.Not(nnx.LoRAParam)).flat_state(), frozen.flat_state(), strict=True
  ):
    np.testing.assert_array_equal(
      np.asarray(a.get_value()), np.asarray(b.get_value()), err_msg=str(p)
    )


@pytest.mark.parametrize(
  "rslora,rank_pattern", [(False, None), (True, None), (False, {"down_proj": 8, "q_proj": 2})]
)
def test_gradients_match_peft(hf_llama_dir, rslora, rank_pattern):

  path, hf = hf_llama_dir(seed=3)
  rank, alpha = 4, 12
  peft_model = peft_with_random_adapters(
    hf, rank, alpha, seed=0, use_rslora=rslora, rank_pattern=rank_pattern or {}
  )

  model = jaxtune.apply_lora(
    jaxtune.from_pretrained(path, quantization=None, dtype="float32"),
    rank=rank,
    alpha=alpha,
    rslora=rslora,
    rank_pattern=rank_pattern,
  )
  copy_peft_lora_into(model, peft_model)

  ids = _ids(3)
  out = peft_model(torch.from_numpy(ids[:, :-1]).long())
  torch_loss = torch.nn.functional.cross_entropy(
    out.logits.reshape(-1, out.logits.shape[-1]), torch.from_numpy(ids[:, 1:]).reshape(-1).long()
  )
  torch_loss.backward()

  graphdef, lora, frozen = nnx.split(model, nnx.LoRAParam, ...)
  loss, grads = jax.jit(
    jax.value_and_grad(lambda lo: _loss(nnx.merge(graphdef, lo, frozen), jnp.asarray(ids)))
  )(lora)
  np.testing.assert_allclose(float(loss), torch_loss.item(), rtol=1e-5)
  assert assert_lora_grads_match_peft(model, grads, peft_model) == 14


@pytest.mark.parametrize(
  "targets, rank_pattern, dropout",
  [
    (("gate_proj", "up_proj", "q_proj"), None, 0.0),
    (("gate_proj", "down_proj"), {"layers.1.gate_proj": 2}, 0.1),
  ],
  ids=["gate-and-up", "gate-alone-ranks-by-layer-dropout"],
)
@pytest.mark.slow
def test_folded_mlp_lora_equals_the_separate_products(
  hf_llama_dir, monkeypatch, targets, rank_pattern, dropout
):
  """NF4 gate/up fold their LoRA into the frozen product (layers.lora_inputs): the same loss
  and adapter gradients as adding each LoRA's own product."""
  from jaxtune.models import blocks
  from pallas_kernels.nf4_matmul import reference

  path, _ = hf_llama_dir(seed=5)
  model = jaxtune.apply_lora(
    jaxtune.from_pretrained(path, quantization="nf4", dtype="float32"),
    rank=4,
    alpha=8,
    targets=targets,
    rank_pattern=rank_pattern,
    dropout=dropout,
  )
  graphdef, lora, frozen = nnx.split(model, nnx.LoRAParam, ...)
  # B starts at zero; random adapters make the LoRA products count
  leaves, tree = jax.tree.flatten(lora)
  keys = jax.random.split(jax.random.key(2), len(leaves))
  lora = tree.unflatten(
    [0.3 * jax.random.normal(k, a.shape, a.dtype) for k, a in zip(keys, leaves, strict=True)]
  )
  ids = jnp.asarray(_ids(5))

  def value_and_grad():
    def loss(lo):
      m = nnx.merge(graphdef, lo, frozen)
      logits = m(ids[:, :-1], dropout_key=jax.random.key(7) if dropout else None)
      return optax.softmax_cross_entropy_with_integer_labels(logits, ids[:, 1:]).mean()

    return jax.jit(jax.value_and_grad(loss))(lora)

  folds = []
  real = reference.dequantize_then_dot_folded
  monkeypatch.setattr(
    reference, "dequantize_then_dot_folded", lambda *a: folds.append(1) or real(*a)
  )
  got, got_grads = value_and_grad()
  assert folds, "the MLP did not fold"
  monkeypatch.setattr(blocks, "lora_inputs", lambda x, layers, keys: [None] * len(layers))
  folded = len(folds)
  want, want_grads = value_and_grad()
  assert len(folds) == folded, "the separate products folded"
  np.testing.assert_allclose(float(got), float(want), rtol=1e-6)
  for g, w in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads), strict=True):
    np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-6)


def test_unknown_target_is_a_clear_error(hf_llama_dir):
  path, _ = hf_llama_dir()
  with pytest.raises(UserError, match=r"\['qkv_proj'\] are not linear layers"):
    jaxtune.apply_lora(jaxtune.from_pretrained(path), targets=("qkv_proj",))
