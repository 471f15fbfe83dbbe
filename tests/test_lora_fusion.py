"""LoRA's down-projection fused into the NF4 weight's dot equals the unfused path."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxtune
from jaxtune import layers, nf4, trainer
from pallas_kernels.nf4_matmul.lora import nf4_lora_matmul
from pallas_kernels.nf4_matmul.reference import dequantize_then_dot

SCALE = 1.7


def _unfused(x, codes, absmax, nested_absmax, offset, a, b):
  y = dequantize_then_dot(x, codes, absmax, nested_absmax, offset)
  return y + (SCALE * ((x @ a) @ b)).astype(y.dtype)


def _fused(x, codes, absmax, nested_absmax, offset, a, b):
  return nf4_lora_matmul(x, codes, absmax, nested_absmax, offset, a, b, SCALE)


def _rel(got, want) -> float:
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  return float(np.abs(got - want).max() / np.abs(want).max())


@pytest.mark.parametrize("dtype, tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 2e-2)])
def test_fused_op_matches_unfused_in_value_and_gradients(dtype, tol):
  rng = np.random.default_rng(0)
  k, n, r = 128, 192, 8
  q = nf4.quantize_linear(jnp.asarray(rng.standard_normal((n, k)), jnp.float32))
  x = jnp.asarray(rng.standard_normal((2, 5, k)), dtype)
  a = jnp.asarray(rng.standard_normal((k, r)) / np.sqrt(k), dtype)
  b = jnp.asarray(rng.standard_normal((r, n)), dtype)
  cot = jnp.asarray(rng.standard_normal((2, 5, n)), dtype)  # a dy that is not all ones

  def loss(f):
    return lambda x, a, b: jnp.sum((f(x, *q, a, b) * cot).astype(jnp.float32))

  got, want = _fused(x, *q, a, b), _unfused(x, *q, a, b)
  assert got.shape == (2, 5, n) and got.dtype == dtype
  assert _rel(got, want) < tol
  got_g = jax.jit(jax.grad(loss(_fused), argnums=(0, 1, 2)))(x, a, b)
  want_g = jax.grad(loss(_unfused), argnums=(0, 1, 2))(x, a, b)
  for name, g, w in zip("xab", got_g, want_g, strict=True):
    assert g.shape == w.shape and g.dtype == w.dtype, name
    assert _rel(g, w) < tol, name


def test_linear_fuses_only_without_dropout(monkeypatch):
  rng = np.random.default_rng(3)
  k, n, r = 128, 64, 4
  linear = layers.Linear(k, n, axes=("mlp", "embed"), quantized=True, rngs=nnx.Rngs(0))
  q = nf4.quantize_linear(jnp.asarray(rng.standard_normal((n, k)), jnp.float32))
  for name, value in zip(("codes", "absmax", "nested_absmax", "offset"), q, strict=True):
    getattr(linear, name)[...] = value
  linear.lora_a = nnx.LoRAParam(jnp.asarray(rng.standard_normal((k, r)), jnp.float32))
  linear.lora_b = nnx.LoRAParam(jnp.asarray(rng.standard_normal((r, n)), jnp.float32))
  linear.lora_scale, linear.lora_dropout = SCALE, 0.5
  calls = []
  monkeypatch.setattr(layers, "nf4_lora_matmul", lambda *a: calls.append(1) or nf4_lora_matmul(*a))
  x = jnp.asarray(rng.standard_normal((3, k)), jnp.float32)
  key = jax.random.key(0)
  for dropout_key, fused_calls in ((key, 0), (None, 1)):
    linear.fuse_lora = False
    want = linear(x, dropout_key)
    linear.fuse_lora = True
    got = linear(x, dropout_key)
    assert len(calls) == fused_calls
    assert _rel(got, want) < 1e-5
    calls.clear()


def test_model_loss_and_lora_gradients_equal_with_and_without_fusion(hf_llama_dir, monkeypatch):
  path, _ = hf_llama_dir(seed=5, num_hidden_layers=2)
  model = jaxtune.from_pretrained(path, quantization="nf4", dtype="float32")
  targets = ("q_proj", "v_proj", "down_proj", "lm_head")
  # Dropout is configured but no key is given (evaluation): the layers fuse.
  model = jaxtune.apply_lora(model, rank=4, alpha=8, seed=0, targets=targets, dropout=0.2)
  calls = []

  def counted(*args):
    calls.append(args[0].shape)
    return nf4_lora_matmul(*args)

  monkeypatch.setattr(layers, "nf4_lora_matmul", counted)
  rng = np.random.default_rng(1)
  ids = rng.integers(0, model.config.vocab_size, (2, 17)).astype(np.int32)
  batch = {"input_ids": ids[:, :-1], "labels": ids[:, 1:], "segment_ids": np.ones_like(ids[:, 1:])}

  def run(fuse):
    model.set_runtime(fuse_lora=fuse)
    graphdef, lora, frozen = nnx.split(model, nnx.LoRAParam, ...)
    lora = jax.tree.map(lambda v: v + 0.01, lora)  # B = 0 would hide the adapters' gradients
    f = lambda lora: trainer.loss_sums(graphdef, lora, frozen, batch, None)  # noqa: E731
    return jax.jit(jax.value_and_grad(f, has_aux=True))(lora)

  (ref, ref_n), ref_g = run(False)
  assert not calls
  (got, got_n), got_g = run(True)
  # The scanned stack traces its layer once: q_proj, v_proj, down_proj. lm_head is dense.
  assert len(calls) == 3
  assert int(got_n) == int(ref_n) > 0
  np.testing.assert_allclose(float(got), float(ref), rtol=1e-5)
  leaves, ref_leaves = jax.tree.leaves(got_g), jax.tree.leaves(ref_g)
  assert len(leaves) == 8
  for g, r in zip(leaves, ref_leaves, strict=True):
    assert np.abs(np.asarray(r)).max() > 0
    np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-4, atol=1e-6)
