"""Pre-quantized bitsandbytes 4-bit checkpoints, written by bitsandbytes itself through
transformers on the CPU: load without a bf16 round trip, dequantize bit-identically, and
round-trip through export."""

import json

import bitsandbytes.functional as bnbf
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from conftest import max_rel_err
from safetensors.numpy import load_file, save_file

import jaxtune
from jaxtune import CheckpointError
from jaxtune.models.lora import iter_linears
from pallas_kernels import nf4


@pytest.fixture
def bnb_dir(hf_llama_dir, tmp_path):
  from transformers import AutoModelForCausalLM, BitsAndBytesConfig

  path, fp = hf_llama_dir(seed=21)
  quant = BitsAndBytesConfig(
    load_in_4bit=True,
    bnb_4bit_quant_type="nf4",
    bnb_4bit_use_double_quant=True,
    bnb_4bit_compute_dtype=torch.float32,
  )
  model = AutoModelForCausalLM.from_pretrained(path, quantization_config=quant, device_map="cpu")
  model.save_pretrained(tmp_path / "bnb")
  model.fp32_reference = fp  # the same architecture in fp32, for logits on dequantized weights
  return tmp_path / "bnb", model


def _torch_name(path_, layer):
  return "model." + ".".join(path_).replace("layers.", f"layers.{layer}.", 1)


@pytest.mark.slow
def test_loads_bytes_as_stored_and_dequantizes_identically(bnb_dir):
  path, hf = bnb_dir
  stored = load_file(path / "model.safetensors")
  model = jaxtune.from_pretrained(path, quantization="nf4", dtype="float32")
  modules = dict(hf.named_modules())
  checked = 0
  for path_, linear in iter_linears(model):
    if not linear.quantized:
      continue
    for layer in range(linear.codes.shape[0]):
      key = _torch_name(path_, layer) + ".weight"
      np.testing.assert_array_equal(
        np.asarray(linear.codes[layer]).reshape(-1), stored[key].reshape(-1)
      )
      np.testing.assert_array_equal(
        np.asarray(linear.absmax[layer]).reshape(-1), stored[key + ".absmax"]
      )
      weight = modules[_torch_name(path_, layer)].weight
      expected = bnbf.dequantize_4bit(weight.data, weight.quant_state).numpy()
      got = nf4.dequantize_linear(
        linear.codes[layer],
        linear.absmax[layer],
        linear.nested_absmax[layer],
        linear.offset[layer],
        jnp.float32,
      )
      np.testing.assert_array_equal(np.asarray(got), expected)
      # transformers' fp32 Llama on bitsandbytes' own dequantized weights, for the logits below
      # (its 4-bit CPU forward itself rounds through lower precision, ~5e-3 apart).
      reference = dict(hf.fp32_reference.named_modules())[_torch_name(path_, layer)]
      with torch.no_grad():
        reference.weight.copy_(torch.from_numpy(expected))
      checked += 1
  assert checked == 7 * 3
  ids = np.random.default_rng(0).integers(0, 256, (2, 20))
  with torch.no_grad():
    want = hf.fp32_reference(torch.from_numpy(ids)).logits.numpy()
  assert max_rel_err(model(jnp.asarray(ids)), want) <= 1e-5


@pytest.mark.slow
def test_unquantized_load_of_a_bnb_checkpoint_dequantizes(bnb_dir):
  path, hf = bnb_dir
  dense = jaxtune.from_pretrained(path, quantization=None, dtype="float32")
  quantized = jaxtune.from_pretrained(path, quantization="nf4", dtype="float32")
  ids = jnp.asarray(np.random.default_rng(1).integers(0, 256, (2, 16)))
  np.testing.assert_allclose(
    np.asarray(dense(ids)), np.asarray(quantized(ids)), rtol=1e-5, atol=1e-5
  )


def test_export_bnb4_round_trips(bnb_dir, tmp_path):
  from transformers import AutoModelForCausalLM

  path, hf = bnb_dir
  model = jaxtune.from_pretrained(path, quantization="nf4", dtype="float32")
  out = jaxtune.export_bnb4(model, tmp_path / "again", dtype="float32")
  before, after = load_file(path / "model.safetensors"), load_file(out / "model.safetensors")
  assert before.keys() == after.keys()
  for k in before:
    if k.endswith("bitsandbytes__nf4"):
      assert json.loads(bytes(after[k])) == json.loads(bytes(before[k])), k
    else:
      np.testing.assert_array_equal(after[k], before[k], err_msg=k)
  config = json.loads((out / "config.json").read_text())["quantization_config"]
  assert config["bnb_4bit_quant_type"] == "nf4" and config["bnb_4bit_use_double_quant"]
  reloaded = AutoModelForCausalLM.from_pretrained(out, device_map="cpu")
  ids = torch.from_numpy(np.random.default_rng(2).integers(0, 256, (2, 12)))
  with torch.no_grad():
    np.testing.assert_allclose(
      reloaded(ids).logits.float().numpy(), hf(ids).logits.float().numpy(), rtol=1e-5, atol=1e-5
    )


@pytest.mark.slow
def test_export_bnb4_merges_trained_adapters(bnb_dir, tmp_path):
  path, _ = bnb_dir
  model = jaxtune.apply_lora(jaxtune.from_pretrained(path, dtype="float32"), rank=4)
  model.layers.mlp.down_proj.lora_b[...] = 0.05 * jnp.ones_like(
    model.layers.mlp.down_proj.lora_b[...]
  )
  out = jaxtune.export_bnb4(model, tmp_path / "merged4", dtype="float32")
  again = jaxtune.from_pretrained(out, dtype="float32")
  ids = jnp.asarray(np.random.default_rng(3).integers(0, 256, (2, 12)))
  want = np.asarray(model(ids))
  # The merged down_proj is re-quantized, so the export is within NF4 error of the trained
  # model (not exact), and far from the base model it started as.
  base = jaxtune.from_pretrained(path, dtype="float32")
  to_trained = max_rel_err(again(ids), want)
  assert to_trained < 0.05
  assert to_trained < 0.25 * max_rel_err(again(ids), base(ids))


def test_incomplete_4bit_tensor_is_named(bnb_dir, tmp_path):
  path, _ = bnb_dir
  tensors = load_file(path / "model.safetensors")
  del tensors["model.layers.1.mlp.up_proj.weight.nested_absmax"]
  save_file(tensors, str(path / "model.safetensors"))
  with pytest.raises(CheckpointError, match=r"model.layers.1.mlp.up_proj.weight lacks"):
    jaxtune.from_pretrained(path)


def test_eight_bit_is_refused(bnb_dir):
  path, _ = bnb_dir
  config = json.loads((path / "config.json").read_text())
  config["quantization_config"].update(load_in_4bit=False, load_in_8bit=True, _load_in_8bit=True)
  (path / "config.json").write_text(json.dumps(config))
  with pytest.raises(CheckpointError, match="8-bit bitsandbytes checkpoints are not supported"):
    jaxtune.from_pretrained(path)


@pytest.mark.slow
def test_a_random_bnb_checkpoint_written_in_place_reads_in_transformers_and_jaxtune(tmp_path):
  """converters.synthetic's bnb_4bit layout (the benchmarks' 70B checkpoints): bitsandbytes
  dequantizes each projection to NF4 values times 0.05, and jaxtune holds the same bytes."""
  from transformers import AutoModelForCausalLM

  from converters.synthetic import write_random_checkpoint
  from pallas_kernels.nf4_maps import NF4_CODE

  cfg = {
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 128,
    "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "vocab_size": 96, "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
  }  # fmt: skip
  write_random_checkpoint(tmp_path, cfg, bnb_4bit=True, dtype="float32")
  hf = AutoModelForCausalLM.from_pretrained(str(tmp_path), device_map="cpu")
  w = hf.model.layers[1].mlp.down_proj.weight
  theirs = bnbf.dequantize_4bit(w.data, w.quant_state).float().numpy()
  assert theirs.shape == (128, 256)
  scale = theirs / 0.05
  np.testing.assert_allclose(np.sort(np.unique(np.round(scale, 4))), np.round(NF4_CODE, 4))
  model = jaxtune.from_pretrained(tmp_path, dtype="float32")
  lin = model.layers.mlp.down_proj
  ours = np.asarray(
    nf4.dequantize_linear(
      lin.codes[...][1], lin.absmax[...][1], lin.nested_absmax[...][1], lin.offset[...][1],
      jnp.float32,
    )
  )  # fmt: skip
  np.testing.assert_array_equal(ours, theirs)
