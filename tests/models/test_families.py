"""Qwen 2/3 and Gemma 1/2/3 (and Llama) against transformers, on tiny random models.

Norm weights and biases are perturbed so a wrong norm form or a missing bias shows; the
sequence is longer than the sliding window; query_pre_attn_scalar differs from head_dim; the
softcaps are small enough to bite.
"""

import json
import sys
import traceback
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from conftest import (
  GEMMA3_TYPES,
  background_run,
  copy_dequantized_into,
  family_config,
  max_rel_err,
  run_cli,
  torch_logits,
)

import jaxtune
from jaxtune.data.rows import Dataset
from jaxtune.run import resolve as resolver
from jaxtune.run_config import RunConfig
from jaxtune.training import loop as trainer

FAMILIES = ["llama", "qwen2", "qwen3", "gemma", "gemma2", "gemma3"]


def _write_family(directory: Path, family: str, seed: int = 0):
  """(checkpoint directory, the transformers model saved there): a tiny random ``family``."""
  from transformers import AutoModelForCausalLM

  torch.manual_seed(seed)
  cfg = family_config(family)
  model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").float().eval()
  with torch.no_grad():
    for name, p in model.named_parameters():
      if name.endswith("norm.weight") or name.endswith(".bias"):
        p.add_(0.3 * torch.randn_like(p))
  out = directory / f"{family}_{seed}"
  model.save_pretrained(out)
  return out, model


@pytest.fixture
def family_dir(tmp_path):
  return lambda family, seed=0: _write_family(tmp_path, family, seed)


def _ids(seed=0, length=24):
  return np.random.default_rng(seed).integers(0, 256, (2, length))


@pytest.mark.parametrize("family", FAMILIES)
def test_fp32_logits_match_transformers(family_dir, family):
  path, hf = family_dir(family)
  model = jaxtune.from_pretrained(path, quantization=None, dtype="float32")
  ids = _ids()
  assert max_rel_err(model(jnp.asarray(ids)), torch_logits(hf, ids)) <= 1e-5


def test_the_family_switches_are_really_on(family_dir):
  """Each feature the parity test relies on is configured, so the test is not vacuous."""
  cfgs = {f: jaxtune.ModelConfig.from_hf(family_dir(f)[0]) for f in FAMILIES}
  assert cfgs["qwen2"].qkv_bias and not cfgs["qwen2"].o_bias and cfgs["qwen2"].tie_word_embeddings
  assert cfgs["qwen3"].qk_norm and not cfgs["qwen3"].qkv_bias
  g1, g2, g3 = cfgs["gemma"], cfgs["gemma2"], cfgs["gemma3"]
  assert g1.norm_plus_one and g1.embed_scale and g1.hidden_act == "gelu_tanh" and g1.head_dim == 64
  assert g2.sandwich_norms and g2.attn_logit_softcap == 5.0 and g2.final_logit_softcap == 3.0
  assert g2.layer_types == ("sliding_attention", "full_attention") * 2 and g2.sliding_window == 8
  assert g2.attention_scale == 48**-0.5 != g2.head_dim**-0.5
  assert g3.qk_norm and g3.layer_types == tuple(GEMMA3_TYPES)
  assert g3.rope.kind == "linear" and g3.rope.theta == 1e6 and g3.rope_local.theta == 1e4
  assert _ids().shape[1] > g2.sliding_window


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_nf4_matches_transformers_on_dequantized_weights(family_dir, family):
  path, hf = family_dir(family, seed=1)
  model = jaxtune.from_pretrained(path, quantization="nf4", dtype="float32")
  assert copy_dequantized_into(model, hf) == 7 * 4
  ids = _ids(1)
  assert max_rel_err(model(jnp.asarray(ids)), torch_logits(hf, ids)) <= 1e-5


def _train_and_export(directory: Path, family: str) -> dict:
  """Three LoRA steps on an NF4 ``family`` model, exported merged in float32 and read back by
  transformers: the losses, and the relative error of its logits against the trained model's."""
  from transformers import AutoModelForCausalLM

  path, _ = _write_family(directory, family, seed=2)
  model = jaxtune.apply_lora(
    jaxtune.from_pretrained(path, quantization="nf4", dtype="float32"), rank=4, alpha=8
  )
  rng = np.random.default_rng(0)
  ids = rng.integers(0, 256, (8, 24)).astype(np.int32)
  data = Dataset.from_rows(ids, np.roll(ids, -1, axis=1))
  run = RunConfig(
    out=str(directory),
    steps=3,
    batch_size=4,
    learning_rate=1e-2,
    warmup_steps=0,
    dtype="float32",
    lora_rank=4,
  )
  one = resolver.resolve(run, model.config, devices=jax.devices()[:1])
  model, history = trainer.train(model, data, run, one)
  out = jaxtune.export_merged(model, directory / "merged", dtype="float32")
  hf = AutoModelForCausalLM.from_pretrained(
    out, torch_dtype=torch.float32, attn_implementation="eager"
  ).eval()
  test_ids = _ids(2)
  err = max_rel_err(torch_logits(hf, test_ids), model(jnp.asarray(test_ids)))
  return {"losses": [float(h["loss"]) for h in history], "rel_err": float(err)}


def _write_exports(directory: str, path: str) -> None:
  """Each family's result, or the traceback that stopped it (so each test reports its
  own), written after every family."""
  results = {}
  for family in FAMILIES:
    (Path(directory) / family).mkdir()
    try:
      results[family] = _train_and_export(Path(directory) / family, family)
    except Exception:
      results[family] = {"error": traceback.format_exc()}
    Path(path).write_text(json.dumps(results))


@background_run("family_exports")
def _family_exports(directory, runs):
  """Every family's training and export in a process of its own, beside the other tests
  (~14 s a family): {family: _train_and_export(...)}."""
  out = directory / "exports.json"
  code = (  # tests/ (conftest) beside this folder
    "import sys; sys.path.insert(0, '..'); "
    "import test_families as t; t._write_exports(sys.argv[1], sys.argv[2])"
  )
  argv = [sys.executable, "-c", code, str(directory), str(out)]
  proc = run_cli(argv, timeout=900, cwd=Path(__file__).parent)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return json.loads(out.read_text())


@pytest.mark.slow
@pytest.mark.late
@pytest.mark.parametrize("family", FAMILIES)
def test_lora_training_and_merged_export(family, family_exports):
  result = family_exports[family]
  assert "error" not in result, result["error"]
  assert result["losses"][-1] < result["losses"][0], result
  assert result["rel_err"] <= 1e-5, result
