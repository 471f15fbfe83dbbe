"""Settings that trade memory for speed or length: remat="activations" (the speed setting)
computes what full remat computes, keeping exactly the named activations a layer's backward
reads; remat="offload" lets the host pool grow past PJRT's default."""

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import LORA_TARGETS
from flax import nnx

import jaxtune
from jaxtune.parallel import mesh as meshlib
from jaxtune.parallel import runtime
from jaxtune.training import losses, step


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
  from conftest import build_hf_llama
  from test_train import SHAPE  # tensor=4 divides its heads; 2 layers make a pipe of 2

  hf = build_hf_llama(5, **SHAPE)
  out = tmp_path_factory.mktemp("speed") / "llama"
  hf.save_pretrained(out)
  return out


@pytest.fixture(scope="module")
def gemma3_checkpoint(tmp_path_factory):
  """Gemma 3: q/k norms and sandwich norms, whose backward reads the projections' outputs."""
  import torch
  from conftest import family_config
  from transformers import AutoModelForCausalLM

  torch.manual_seed(0)
  hf = AutoModelForCausalLM.from_config(family_config("gemma3")).float().eval()
  out = tmp_path_factory.mktemp("speed") / "gemma3"
  hf.save_pretrained(out)
  return out


@pytest.fixture(params=["llama", "gemma3"])
def checkpoint(request):
  return request.getfixturevalue(f"{'tiny' if request.param == 'llama' else 'gemma3'}_checkpoint")


def _batch(vocab, b=8, t=16, seed=3):
  rng = np.random.default_rng(seed)
  ids = rng.integers(0, vocab, (b, t + 1)).astype(np.int32)
  return {
    "input_ids": jnp.asarray(ids[:, :-1]),
    "labels": jnp.asarray(ids[:, 1:]),
    "segment_ids": jnp.ones((b, t), jnp.int32),
  }


@functools.cache  # the full-remat reference is shared by tests
def _loss_and_grads(path, remat, mesh_spec="1", shard_frozen=False):
  devices = jax.devices() if mesh_spec != "1" else jax.devices()[:1]
  mesh = meshlib.make_mesh(mesh_spec, devices)
  mesh = mesh if mesh.size > 1 else None
  model = jaxtune.from_pretrained(path, quantization="nf4", dtype="float32", mesh=mesh)
  model = jaxtune.apply_lora(model, rank=4, alpha=8, seed=0)
  # B = 0 would hide the adapters' gradients through the layers.
  nnx.update(model, jax.tree.map(lambda x: x + 0.01, nnx.state(model, nnx.LoRAParam)))
  rt = runtime.Runtime(mesh=mesh, remat=remat, attention="xla", shard_frozen=shard_frozen)
  graphdef, lora, frozen = step.place(model, rt)
  batch = _batch(model.config.vocab_size)
  fn = jax.jit(
    jax.value_and_grad(
      lambda lo, fr, b: losses.loss_sums(graphdef, lo, fr, b, None, rt), has_aux=True
    )
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


@pytest.mark.slow
def test_activations_remat_trains_like_full_remat(checkpoint):
  ref = _loss_and_grads(checkpoint, "full")
  # Saved and recomputed values fuse differently in float32: a few 1e-6 absolute apart.
  _assert_same(_loss_and_grads(checkpoint, "activations"), ref, "activations", atol=1e-5)


@pytest.mark.slow
def test_activations_remat_under_a_mesh_trains_like_one_device(tiny_checkpoint):
  ref = _loss_and_grads(tiny_checkpoint, "full")
  # The all-reduces sum in another order: gradients agree to a few 1e-6 absolute.
  _assert_same(_loss_and_grads(tiny_checkpoint, "activations", "2x4"), ref, "2x4", atol=1e-5)


@pytest.mark.slow
def test_activations_remat_keeps_what_the_backward_reads(checkpoint, capsys):
  """One layer under the policy saves its arguments and the named activations, nothing else
  (no unnamed matmul output, no NF4 weight dequantized in the forward)."""
  from jax.ad_checkpoint import print_saved_residuals

  from jaxtune.models.decoder import REMAT_POLICIES, SAVED_ACTIVATIONS

  model = jaxtune.from_pretrained(checkpoint, quantization="nf4", dtype="float32")
  model = jaxtune.apply_lora(model, rank=4, alpha=8, seed=0)
  graphdef, lora, frozen = nnx.split(model.layers, nnx.LoRAParam, ...)
  lora, frozen = (jax.tree.map(lambda a: a[0], s) for s in (lora, frozen))  # layer 0
  b, t, cfg = 2, 16, model.config
  x = jax.random.normal(jax.random.key(0), (b, t, cfg.hidden_size))
  cos = sin = jnp.ones((b, t, cfg.head_dim))
  seg = jnp.ones((b, t), jnp.int32)

  def layer(lora, x):
    return nnx.merge(graphdef, lora, frozen)(x, cos, sin, seg, 0, None, runtime.DEFAULT).sum()

  print_saved_residuals(jax.checkpoint(layer, policy=REMAT_POLICIES["activations"]), lora, x)
  lines = capsys.readouterr().out.splitlines()
  computed = [line for line in lines if "from the argument" not in line and "constant" not in line]
  names = {line.split("named '")[1].split("'")[0] for line in computed if "named '" in line}
  assert len(computed) == sum("named '" in line for line in computed) > 0, computed
  assert names <= set(SAVED_ACTIVATIONS)
  assert {"query", "key", "value", "attention_out", "residual_mid", "mlp_gate", "mlp_up"} <= names
  if cfg.qk_norm:  # Gemma 3
    assert {"query_projected", "key_projected", "attention_projected", "mlp_out"} <= names
  assert sum("named 'lora_a'" in line for line in computed) == 7  # one per projection


class _TracedKernel:
  """Stands in for the flash kernel's module where only tracing matters (the interpreter's
  callbacks cannot be differentiated under remat): outputs of the kernel's shapes."""

  @staticmethod
  def forward(q, k, v, *_):
    lse = jnp.sum(q.astype(jnp.float32), -1).transpose(0, 2, 1)  # [B, N, T]
    return q * jnp.mean(k) * jnp.mean(v), lse


@pytest.mark.parametrize("attention", ["xla", "flash_xla", "interpret"])
def test_the_attention_output_is_kept_once(tmp_path, attention, capsys, monkeypatch):
  """The flash kernel (and cuDNN) keep their output themselves: attention.attention names it
  only where the op does not, since a second name would make a second value the layer scan
  saves a second time."""
  from conftest import build_hf_llama
  from jax.ad_checkpoint import print_saved_residuals

  from jaxtune.models.decoder import REMAT_POLICIES
  from pallas_kernels.flash_attention import ops

  monkeypatch.setattr(ops, "_kernels", lambda: (_TracedKernel, None))

  heads = dict(num_attention_heads=2, num_key_value_heads=1, head_dim=64)  # the kernel's
  hf = build_hf_llama(7, hidden_size=128, intermediate_size=256, num_hidden_layers=1, **heads)
  hf.save_pretrained(tmp_path)
  model = jaxtune.from_pretrained(tmp_path, quantization="nf4", dtype="bfloat16")
  model = jaxtune.apply_lora(model, rank=4, alpha=8, seed=0)
  graphdef, lora, frozen = nnx.split(model.layers, nnx.LoRAParam, ...)
  lora, frozen = (jax.tree.map(lambda a: a[0], s) for s in (lora, frozen))  # layer 0
  b, t, cfg = 2, 128, model.config  # a multiple of the kernel's blocks: no padding
  x = jax.random.normal(jax.random.key(0), (b, t, cfg.hidden_size), jnp.bfloat16)
  cos = sin = jnp.ones((b, t, cfg.head_dim), jnp.bfloat16)
  seg = jnp.ones((b, t), jnp.int32)
  rt = runtime.Runtime(dtype="bfloat16", attention=attention)

  def layer(lora, x):
    return nnx.merge(graphdef, lora, frozen)(x, cos, sin, seg, 0, None, rt).sum()

  print_saved_residuals(jax.checkpoint(layer, policy=REMAT_POLICIES["activations"]), lora, x)
  lines = capsys.readouterr().out.splitlines()
  outs = [line for line in lines if "named 'attention_out'" in line]
  assert len(outs) == 1, lines
  assert f"[{b},{t},{cfg.num_heads},{cfg.head_dim}]" in outs[0]


def test_offload_lets_the_pinned_host_pool_use_most_of_the_machine():
  from jaxtune.run_config import RunConfig
  from jaxtune.train import HOST_LIMIT_VAR, allow_host_memory_for_offload

  env = {}
  allow_host_memory_for_offload(RunConfig(remat="full"), env)
  assert env == {}  # nothing kept on the host: PJRT's default stays
  allow_host_memory_for_offload(RunConfig(remat="offload"), env)
  total_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
  assert int(env[HOST_LIMIT_VAR]) == max(64, int(0.9 * total_gib))
  env = {HOST_LIMIT_VAR: "20"}
  allow_host_memory_for_offload(RunConfig(remat="offload"), env)
  assert env == {HOST_LIMIT_VAR: "20"}  # the user's own limit wins


def test_the_command_line_gives_jax_most_of_each_gpu_unless_told_otherwise():
  from jaxtune.train import MEMORY_FRACTION_VAR, claim_device_memory

  env = {}
  claim_device_memory(env)
  assert env == {MEMORY_FRACTION_VAR: "0.95"}  # JAX's own default is 0.75
  for chosen in ({MEMORY_FRACTION_VAR: "0.5"}, {"XLA_PYTHON_CLIENT_ALLOCATOR": "platform"}):
    env = dict(chosen)
    claim_device_memory(env)
    assert env == chosen  # the user's choice wins


def test_runs_forced_onto_the_kernels_get_their_operands_made_once(tiny_checkpoint):
  """Under --nf4-matmul kernel (here its interpreter) in bfloat16 the frozen state holds the
  NF4 kernels' operands made once for every layer (W^T's codes in word order among them);
  under dispatch, xla or float32 none; the model keeps none, and a trained model merged from
  that state is given none back."""
  from pallas_kernels.nf4_matmul import reference

  model = jaxtune.from_pretrained(tiny_checkpoint, quantization="nf4", dtype="bfloat16")

  def made(nf4_matmul, dtype="bfloat16"):
    rt = runtime.Runtime(nf4_matmul=nf4_matmul, dtype=dtype)
    graphdef, lora, frozen = step.place(model, rt)
    flat = {p: v for p, v in nnx.to_flat_state(frozen) if p[-1] == "kernel_codes_t"}
    return sorted(p[-2] for p in flat), flat, (graphdef, lora, frozen)

  names, flat, placed = made("interpret")
  assert names == sorted(LORA_TARGETS)
  q = model.layers.self_attn.q_proj
  want = reference.word_bytes(reference.transposed_codes(q.codes[...]))
  got = next(v for p, v in flat.items() if p[-2] == "q_proj")
  np.testing.assert_array_equal(np.asarray(got[...]), np.asarray(want))
  assert made("few-tokens")[0] == [] and made("xla")[0] == []
  assert made("interpret", "float32")[0] == []  # the kernels take bfloat16 only
  assert all(lin.kernel_codes_t is None for _, lin in jaxtune.models.lora.iter_linears(model))
  trained = nnx.merge(*placed)
  assert trained.layers.self_attn.q_proj.kernel_codes_t is not None
  step.drop_kernel_operands(trained)
  assert all(lin.kernel_codes_t is None for _, lin in jaxtune.models.lora.iter_linears(trained))
