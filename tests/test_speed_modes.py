"""Settings that trade memory for speed compute what the default computes.

Decoder.dequantize="step" (every NF4 weight dequantized once per pass, before the layer scan):
the loss and LoRA gradients of per-layer dequantization, on one device and under data x
tensor, pipeline and shard_frozen meshes. remat="activations": the loss and gradients of full
remat, keeping exactly the named activations a layer's backward reads."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxtune
from jaxtune import mesh as meshlib
from jaxtune import trainer


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
  from conftest import build_hf_llama

  # 8 heads / 4 kv heads so that tensor=4 divides both; hidden 256 keeps NF4 blocks whole;
  # 2 layers so that a pipe of 2 has one layer per stage.
  hf = build_hf_llama(
    5,
    hidden_size=256,
    intermediate_size=512,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=32,
    num_hidden_layers=2,
  )
  out = tmp_path_factory.mktemp("dequantize") / "llama"
  hf.save_pretrained(out)
  return out


def _batch(vocab, b=8, t=16, seed=3):
  rng = np.random.default_rng(seed)
  ids = rng.integers(0, vocab, (b, t + 1)).astype(np.int32)
  return {
    "input_ids": jnp.asarray(ids[:, :-1]),
    "labels": jnp.asarray(ids[:, 1:]),
    "segment_ids": jnp.ones((b, t), jnp.int32),
  }


def _loss_and_grads(path, dequantize="layer", mesh_spec="1", shard_frozen=False, remat="full"):
  devices = jax.devices() if mesh_spec != "1" else jax.devices()[:1]
  mesh = meshlib.make_mesh(mesh_spec, devices)
  mesh = mesh if mesh.size > 1 else None
  model = jaxtune.from_pretrained(path, quantization="nf4", dtype="float32", mesh=mesh)
  model = jaxtune.apply_lora(model, rank=4, alpha=8, seed=0)
  # B = 0 would hide the adapters' gradients through the layers.
  nnx.update(model, jax.tree.map(lambda x: x + 0.01, nnx.state(model, nnx.LoRAParam)))
  spec = None
  if mesh is not None:
    from jax.sharding import NamedSharding

    from jaxtune import sharding

    spec = NamedSharding(mesh, sharding.residual_spec(mesh, 16))
  model.set_runtime(
    remat=remat, attention_impl="xla", dequantize=dequantize, activation_sharding=spec
  )
  graphdef, lora, frozen = trainer.place(model, mesh, shard_frozen)
  batch = _batch(model.config.vocab_size)
  fn = jax.jit(
    jax.value_and_grad(lambda lo, fr, b: trainer.loss_sums(graphdef, lo, fr, b, None), has_aux=True)
  )
  (loss, count), grads = fn(lora, frozen, batch)
  return float(loss), int(count), [np.asarray(g) for g in jax.tree.leaves(grads)]


def _assert_same(got, want, label, atol=1e-6):
  assert got[1] == want[1] > 0
  np.testing.assert_allclose(got[0], want[0], rtol=1e-5, err_msg=label)
  assert len(got[2]) == len(want[2]) > 0
  for g, w in zip(got[2], want[2], strict=True):
    assert np.abs(w).max() > 0, label  # a gradient that is all zeros would compare trivially
    np.testing.assert_allclose(g, w, rtol=1e-4, atol=atol, err_msg=label)


def test_step_dequantization_computes_what_per_layer_dequantization_does(tiny_checkpoint):
  ref = _loss_and_grads(tiny_checkpoint, "layer")
  for remat in ("full", "dots_no_batch"):
    _assert_same(_loss_and_grads(tiny_checkpoint, "step", remat=remat), ref, f"1 {remat}")
  # Under a mesh the all-reduces sum in another order: gradients agree to ~3e-6 absolute.
  for spec, shard_frozen in (("2x4", False), ("2x2x2", True)):
    got = _loss_and_grads(tiny_checkpoint, "step", spec, shard_frozen)
    _assert_same(got, ref, f"{spec} shard_frozen={shard_frozen}", atol=1e-5)


def test_step_dequantization_really_leaves_the_scan_without_nf4(tiny_checkpoint):
  """The mode is not a no-op: with "step" the layer scan's body holds no NF4 table lookup (the
  lookups all happen before it), with "layer" it does."""
  model = jaxtune.from_pretrained(tiny_checkpoint, quantization="nf4", dtype="float32")
  model = jaxtune.apply_lora(model, rank=4, alpha=8, seed=0)
  batch = _batch(model.config.vocab_size, b=2)

  def scan_bodies(dequantize):
    model.set_runtime(remat="full", attention_impl="xla", dequantize=dequantize)
    graphdef, lora, frozen = nnx.split(model, nnx.LoRAParam, ...)
    jaxpr = jax.make_jaxpr(
      jax.grad(lambda lo: trainer.loss_sums(graphdef, lo, frozen, batch, None)[0])
    )(lora)
    bodies = [e.params["jaxpr"] for e in jaxpr.jaxpr.eqns if e.primitive.name == "scan"]
    assert bodies, "no layer scan found"
    return [str(b) for b in bodies]

  def nf4_codes(text):  # the uint8 -> 4-bit code unpacking every dequantization does
    return text.count("shift_right_logical")

  assert all(nf4_codes(b) > 0 for b in scan_bodies("layer"))
  assert all(nf4_codes(b) == 0 for b in scan_bodies("step"))


def test_unknown_dequantize_mode_is_refused(tiny_checkpoint):
  model = jaxtune.from_pretrained(tiny_checkpoint, quantization="nf4", dtype="float32")
  with pytest.raises(ValueError, match="dequantize must be one of layer, step"):
    model.set_runtime(dequantize="once")


def test_activations_remat_trains_like_full_remat(tiny_checkpoint):
  ref = _loss_and_grads(tiny_checkpoint, remat="full")
  _assert_same(_loss_and_grads(tiny_checkpoint, remat="activations"), ref, "activations")


def test_activations_remat_keeps_what_the_backward_reads(tiny_checkpoint, capsys):
  """One layer under the policy saves its arguments and the named activations, nothing else
  (no unnamed matmul output, no NF4 weight dequantized in the forward)."""
  from jax.ad_checkpoint import print_saved_residuals

  from jaxtune.models.decoder import REMAT_POLICIES, SAVED_ACTIVATIONS

  model = jaxtune.from_pretrained(tiny_checkpoint, quantization="nf4", dtype="float32")
  model = jaxtune.apply_lora(model, rank=4, alpha=8, seed=0)
  model.set_runtime(attention_impl="xla")
  graphdef, lora, frozen = nnx.split(model.layers, nnx.LoRAParam, ...)
  lora, frozen = (jax.tree.map(lambda a: a[0], s) for s in (lora, frozen))  # layer 0
  b, t, cfg = 2, 16, model.config
  x = jax.random.normal(jax.random.key(0), (b, t, cfg.hidden_size))
  cos = sin = jnp.ones((b, t, cfg.head_dim))
  seg = jnp.ones((b, t), jnp.int32)

  def layer(lora, x):
    return nnx.merge(graphdef, lora, frozen)(x, cos, sin, seg, 0, None).sum()

  print_saved_residuals(jax.checkpoint(layer, policy=REMAT_POLICIES["activations"]), lora, x)
  lines = capsys.readouterr().out.splitlines()
  computed = [line for line in lines if "from the argument" not in line and "constant" not in line]
  names = {line.split("named '")[1].split("'")[0] for line in computed if "named '" in line}
  assert len(computed) == sum("named '" in line for line in computed) > 0, computed
  assert names <= set(SAVED_ACTIVATIONS)
  assert {"query", "key", "value", "attention_out", "residual_mid", "mlp_gate", "mlp_up"} <= names
  assert sum("named 'lora_a'" in line for line in computed) == 7  # one per projection
