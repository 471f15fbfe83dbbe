"""Llama parity with transformers' own PyTorch implementation, on tiny random checkpoints."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from conftest import copy_dequantized_into, max_rel_err, torch_logits
from flax import nnx

import jaxtune
from jaxtune.errors import ExportError
from jaxtune.models.config import ModelConfig
from jaxtune.models.decoder import Decoder
from jaxtune.models.layers import Linear
from jaxtune.models.provenance import Provenance
from jaxtune.nf4_storage import NF4Storage
from jaxtune.parallel import runtime

LLAMA3_ROPE = {
  "rope_type": "llama3",
  "factor": 8.0,
  "low_freq_factor": 1.0,
  "high_freq_factor": 4.0,
  "original_max_position_embeddings": 16,
  "rope_theta": 500000.0,
}

VARIANTS = {
  "untied_gqa": dict(),
  "tied": dict(tie_word_embeddings=True),
  "llama3_rope": dict(rope_parameters=LLAMA3_ROPE),
  "mha_head_dim_64": dict(num_attention_heads=4, num_key_value_heads=4, head_dim=64),
  "mqa": dict(num_key_value_heads=1),
}


def _ids(batch=2, length=40, vocab=256, seed=0):
  return np.random.default_rng(seed).integers(0, vocab, (batch, length))


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_fp32_logits_match_transformers(hf_llama_dir, variant):
  path, hf = hf_llama_dir(seed=1, **VARIANTS[variant])
  model = jaxtune.from_pretrained(path, quantization=None, dtype="float32")
  ids = _ids()
  got = model(jnp.asarray(ids))
  assert max_rel_err(got, torch_logits(hf, ids)) <= 1e-5


def test_llama3_rope_scaling_is_applied(hf_llama_dir):
  """The llama3 variant must differ from plain rope, or the test above proves nothing."""
  path, _ = hf_llama_dir(seed=1, rope_parameters=LLAMA3_ROPE)
  cfg = ModelConfig.from_hf(path)
  assert cfg.rope.kind == "llama3" and cfg.rope.theta == 500000.0
  from jaxtune.models import rope

  plain = rope.inverse_frequencies(type(cfg.rope)(theta=cfg.rope.theta), cfg.head_dim)
  assert not np.allclose(plain, rope.inverse_frequencies(cfg.rope, cfg.head_dim))


def test_old_style_rope_scaling_config_parses():
  cfg = ModelConfig.from_hf(
    dict(
      model_type="llama",
      vocab_size=10,
      hidden_size=64,
      intermediate_size=128,
      num_hidden_layers=1,
      num_attention_heads=2,
      rope_theta=500000.0,
      rope_scaling={
        "type": "llama3",
        **{k: v for k, v in LLAMA3_ROPE.items() if k != "rope_theta"},
      },
    )
  )
  assert cfg.rope.kind == "llama3" and cfg.rope.theta == 500000.0 and cfg.head_dim == 32


def test_sharded_checkpoint_loads(hf_llama_dir):
  path, hf = hf_llama_dir(seed=2, max_shard_size="100KB")
  assert (path / "model.safetensors.index.json").is_file()
  model = jaxtune.from_pretrained(path, quantization=None, dtype="float32")
  ids = _ids(seed=2)
  assert max_rel_err(model(jnp.asarray(ids)), torch_logits(hf, ids)) <= 1e-5


@pytest.mark.slow
def test_nf4_logits_match_transformers_on_dequantized_weights(hf_llama_dir):
  path, hf = hf_llama_dir(seed=3)
  model = jaxtune.from_pretrained(path, quantization="nf4", dtype="float32")
  # Put jaxtune's dequantized weights (bit-identical to bitsandbytes', see test_nf4) into the
  # torch model, then both must compute the same function.
  count = copy_dequantized_into(model, hf)
  assert count == 7 * 3
  ids = _ids(seed=3)
  assert max_rel_err(model(jnp.asarray(ids)), torch_logits(hf, ids)) <= 1e-5


@pytest.mark.slow
def test_scanned_and_unscanned_layers_agree(hf_llama_dir):
  path, _ = hf_llama_dir(seed=4)
  model = jaxtune.from_pretrained(path, quantization="nf4", dtype="float32")
  ids = jnp.asarray(_ids(seed=4))
  scanned = model(ids)
  unscanned = model(ids, runtime=runtime.Runtime(scan_layers=False))
  np.testing.assert_allclose(np.asarray(unscanned), np.asarray(scanned), rtol=1e-5, atol=1e-5)


def test_every_parameter_has_logical_axes(hf_llama_dir):
  path, _ = hf_llama_dir(seed=5)
  model = jaxtune.apply_lora(jaxtune.from_pretrained(path), rank=4)
  names = {"layers", "embed", "heads", "kv_heads", "mlp", "vocab", None}
  for path_, var in nnx.state(model).flat_state():
    axes = var.get_metadata().get("axes")
    assert axes is not None and len(axes) == var.get_value().ndim, path_
    assert set(axes) <= names, (path_, axes)


def test_nf4_storage_is_not_a_param():
  cfg = ModelConfig.from_hf(
    dict(
      model_type="llama",
      vocab_size=64,
      hidden_size=64,
      intermediate_size=128,
      num_hidden_layers=2,
      num_attention_heads=2,
    )
  )
  model = Decoder(cfg, quantized=True, rngs=nnx.Rngs(0))
  params = nnx.state(model, nnx.Param)
  flat = [".".join(map(str, p)) for p, _ in params.flat_state()]
  assert flat and not any(p.endswith(("codes", "absmax", "offset")) for p in flat)
  assert nnx.state(model, NF4Storage).flat_state()


def _param_count(hf_config: dict) -> int:
  cfg = ModelConfig.from_hf(hf_config)
  abstract = nnx.eval_shape(lambda: Decoder(cfg, quantized=False, rngs=nnx.Rngs(0)))
  leaves = jax.tree.leaves(nnx.state(abstract, nnx.Param))
  return sum(int(np.prod(x.shape)) for x in leaves)


LLAMA_31_8B = dict(
  model_type="llama",
  vocab_size=128256,
  hidden_size=4096,
  intermediate_size=14336,
  num_hidden_layers=32,
  num_attention_heads=32,
  num_key_value_heads=8,
  rms_norm_eps=1e-5,
  rope_theta=500000.0,
  tie_word_embeddings=False,
  rope_scaling={
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
  },
)
LLAMA_32_1B = dict(
  LLAMA_31_8B,
  hidden_size=2048,
  intermediate_size=8192,
  num_hidden_layers=16,
  num_key_value_heads=8,
  head_dim=64,
  tie_word_embeddings=True,
)


def test_full_size_shapes_without_allocating():
  # Published parameter counts of meta-llama/Llama-3.1-8B and Llama-3.2-1B.
  assert _param_count(LLAMA_31_8B) == 8_030_261_248
  assert _param_count(LLAMA_32_1B) == 1_235_814_400
  cfg = ModelConfig.from_hf(LLAMA_31_8B)
  abstract = nnx.eval_shape(lambda: Decoder(cfg, quantized=True, rngs=nnx.Rngs(0)))
  codes = sum(
    int(np.prod(x.shape))
    for p, x in nnx.to_flat_state(nnx.state(abstract, NF4Storage))
    if p[-1] == "codes"
  )
  linear_params = cfg.num_layers * sum(o * i for o, i in cfg.linear_shapes().values())
  assert codes * 2 == linear_params  # two 4-bit codes per byte


def test_a_loaded_model_carries_its_provenance_and_exports_read_it(hf_llama_dir, tmp_path):
  """from_pretrained records where the weights came from as one static attribute, which
  split and merge keep (in the graphdef, not the state); the exports read it: pointed at
  another directory, the merged export copies that one's config and tokenizer files and PEFT
  names its Hub id as the base. A model built directly has the empty Provenance."""
  path, _ = hf_llama_dir()
  load = lambda: jaxtune.from_pretrained(path, quantization=None, dtype="float32")  # noqa: E731
  model, again = load(), load()
  assert model.provenance == Provenance(str(path), None)
  graphdef, state = nnx.split(model)
  assert graphdef == nnx.split(again)[0] and hash(graphdef) == hash(nnx.split(again)[0])
  assert nnx.merge(graphdef, state).provenance == model.provenance
  assert all(hasattr(leaf, "shape") for leaf in jax.tree.leaves(state))

  other = tmp_path / "other"
  other.mkdir()
  config = json.loads((path / "config.json").read_text())
  (other / "config.json").write_text(json.dumps({**config, "marker": "provenance"}))
  (other / "tokenizer_config.json").write_text("{}")
  model.provenance = Provenance(str(other), "tiny-org/elsewhere")
  merged = jaxtune.export_merged(model, tmp_path / "merged", dtype="float32")
  assert json.loads((merged / "config.json").read_text())["marker"] == "provenance"
  assert (merged / "tokenizer_config.json").is_file()
  peft = jaxtune.export_peft(jaxtune.apply_lora(model, rank=2), tmp_path / "peft")
  adapter_config = json.loads((peft / "adapter_config.json").read_text())
  assert adapter_config["base_model_name_or_path"] == "tiny-org/elsewhere"

  direct = Decoder(model.config, rngs=nnx.Rngs(0))
  assert direct.provenance == Provenance() and direct.lora_config is None
  with pytest.raises(ExportError, match="not loaded from a checkpoint"):
    jaxtune.export_merged(direct, tmp_path / "direct", merge_into="original")


def test_lm_head_stays_dense(hf_llama_dir):
  path, _ = hf_llama_dir(seed=6)
  model = jaxtune.from_pretrained(path)
  assert isinstance(model.lm_head, Linear) and not model.lm_head.quantized
  assert model.embed_tokens.embedding[...].dtype == jnp.bfloat16


def test_bf16_model_is_close_to_fp32(hf_llama_dir):
  path, hf = hf_llama_dir(seed=7)
  ids = _ids(seed=7)
  model = jaxtune.from_pretrained(path, quantization=None, dtype="bfloat16")
  assert max_rel_err(model(jnp.asarray(ids)), torch_logits(hf, ids)) < 5e-2
  _ = torch  # torch is the reference implementation here
