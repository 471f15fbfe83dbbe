"""experiments/profile_kernels.py traces XLA kernels back to the model's named scopes: on the
compiled HLO of a tiny NF4 + LoRA train step every scope shows up, in both passes."""

import collections

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import jaxtune
from experiments.profile_kernels import SCOPES, kernel_key, scopes_by_kernel
from jaxtune.parallel import runtime
from jaxtune.training import losses


@pytest.mark.slow
def test_every_scope_is_found_in_both_passes(hf_llama_dir):
  ckpt, _ = hf_llama_dir(num_hidden_layers=2)
  model = jaxtune.from_pretrained(ckpt, quantization="nf4", dtype="float32")
  model = jaxtune.apply_lora(model, rank=4)
  rt = runtime.Runtime(remat="dots_no_batch")
  graphdef, lora, frozen = nnx.split(model, nnx.LoRAParam, ...)
  ids = jnp.zeros((2, 32), jnp.int32)
  batch = {"input_ids": ids, "labels": ids, "segment_ids": jnp.ones_like(ids)}
  grad = jax.jit(jax.grad(lambda l, f, b: losses.loss_sums(graphdef, l, f, b, None, rt)[0]))
  hlo = grad.lower(lora, frozen, batch).compile().as_text()
  found = collections.Counter(scopes_by_kernel(hlo).values())
  for scope in SCOPES:
    for phase in ("forward", "backward"):
      assert found[(scope, phase)] > 0, (scope, phase, found)
  assert found[("other", "forward")] > 0  # unscoped work (embedding, residual adds) stays apart


def test_kernel_key_matches_xla_kernel_names():
  assert kernel_key("loop_multiply_fusion.12") == "loop_multiply_fusion_12"
  assert kernel_key("input-reduce.3") == "input_reduce_3"
