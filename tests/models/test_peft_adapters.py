"""PEFT adapters both ways: peft's into jaxtune (load_adapter, --init-adapter, generate's
--adapter), jaxtune's (lm_head included) into peft, the base model named by its Hub id, and
each adapter jaxtune must refuse."""

import json
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from conftest import build_hf_llama, max_rel_err, torch_logits

import jaxtune
from jaxtune.errors import CheckpointError, ConfigError, UserError
from jaxtune.hf.load import hub_id
from jaxtune.models.lora import iter_linears
from jaxtune.run import checks, default_model, loading
from jaxtune.run_config import RunConfig

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
IDS = np.random.default_rng(7).integers(0, 256, (2, 16))


def _randomize_peft(peft_model, seed=0):
  """Non-zero B (and A) everywhere, so the adapter changes the logits."""
  torch.manual_seed(seed)
  with torch.no_grad():
    for name, p in peft_model.named_parameters():
      if "lora_" in name:
        p.copy_(0.05 * torch.randn_like(p))


def _randomize(model, seed=0):
  rng = np.random.default_rng(seed)
  for _, linear in iter_linears(model):
    if linear.lora_b is not None:
      shape = linear.lora_b[...].shape
      linear.lora_b[...] = jnp.asarray(0.1 * rng.standard_normal(shape), jnp.float32)
  return model


def _dense(path):
  return jaxtune.from_pretrained(path, quantization=None, dtype="float32")


@pytest.fixture(scope="module")
def base(tmp_path_factory):
  """A tiny Llama checkpoint laid out as the Hub cache holds one (models--ORG--NAME/...)."""
  path = tmp_path_factory.mktemp("hub") / "models--tiny-org--tiny-llama" / "snapshots" / "abc123"
  build_hf_llama(41).save_pretrained(path)
  return path


@pytest.fixture(scope="module")
def peft_adapter(base, tmp_path_factory):
  """(adapter dir, logits) of an adapter made by peft on ``base``: all seven projections and
  lm_head, rsLoRA, down_proj at another rank, random non-zero weights."""
  from peft import LoraConfig, get_peft_model
  from transformers import LlamaForCausalLM

  hf = LlamaForCausalLM.from_pretrained(base, torch_dtype=torch.float32).eval()
  config = LoraConfig(
    r=4,
    lora_alpha=8,
    target_modules=[*TARGETS, "lm_head"],
    use_rslora=True,
    rank_pattern={"down_proj": 2},
    task_type="CAUSAL_LM",
  )
  peft_model = get_peft_model(hf, config).eval()
  _randomize_peft(peft_model)
  out = tmp_path_factory.mktemp("peft") / "adapter"
  peft_model.save_pretrained(out)
  return out, torch_logits(peft_model, IDS)


def test_peft_adapter_loads_with_peft_logits(base, peft_adapter):
  adapter, want = peft_adapter
  model = jaxtune.load_adapter(_dense(base), adapter)
  assert model.lora_config.rank_pattern == (("down_proj", 2),)
  assert model.layers.mlp.down_proj.lora_a[...].shape == (3, 192, 2)  # [L, in, r]
  assert max_rel_err(model(jnp.asarray(IDS)), want) <= 1e-5
  # The adapter matters: the base alone is far off.
  assert max_rel_err(_dense(base)(jnp.asarray(IDS)), want) > 1e-2


def test_jaxtune_adapter_with_lm_head_loads_in_peft(base, tmp_path):
  from peft import PeftModel
  from transformers import LlamaForCausalLM

  model = jaxtune.apply_lora(_dense(base), rank=4, alpha=8, targets=("q_proj", "lm_head"))
  ours = np.asarray(_randomize(model)(jnp.asarray(IDS)))
  out = jaxtune.export_peft(model, tmp_path / "adapter")
  config = json.loads((out / "adapter_config.json").read_text())
  assert config["base_model_name_or_path"] == "tiny-org/tiny-llama"  # not the cache path

  hf = LlamaForCausalLM.from_pretrained(base, torch_dtype=torch.float32).eval()
  peft_model = PeftModel.from_pretrained(hf, out).eval()
  head = peft_model.base_model.model.lm_head
  assert np.abs(head.lora_B["default"].weight.detach().numpy()).max() > 0  # lm_head loaded
  assert max_rel_err(torch_logits(peft_model, IDS), ours) <= 1e-5
  # And back into jaxtune.
  again = jaxtune.load_adapter(_dense(base), out)
  assert max_rel_err(again(jnp.asarray(IDS)), ours) <= 1e-6


def test_base_model_name_is_the_hub_id_when_known(base, tmp_path):
  assert hub_id(base) == "tiny-org/tiny-llama"
  assert hub_id("/x/hub/models--gpt2/snapshots/0123abc") == "gpt2"
  assert hub_id("meta-llama/Llama-3.2-1B") == "meta-llama/Llama-3.2-1B"
  plain = tmp_path / "plain"
  shutil.copytree(base, plain)
  assert hub_id(plain) is None
  model = jaxtune.apply_lora(_dense(plain), rank=2, targets=("q_proj",))
  config = json.loads(
    (jaxtune.export_peft(model, tmp_path / "a") / "adapter_config.json").read_text()
  )
  assert config["base_model_name_or_path"] == str(plain)  # no Hub id: the local directory


def _edited(adapter, tmp_path, config=None, tensors=None):
  """A copy of ``adapter`` with config keys replaced and tensors mapped (name, array) ->
  {name: array}."""
  from safetensors.numpy import load_file, save_file

  out = tmp_path / "edited"
  shutil.copytree(adapter, out)
  cfg = json.loads((out / "adapter_config.json").read_text())
  cfg.update(config or {})
  (out / "adapter_config.json").write_text(json.dumps(cfg))
  if tensors is not None:
    new = {}
    for name, value in load_file(out / "adapter_model.safetensors").items():
      new.update(tensors(name, value))
    save_file(new, str(out / "adapter_model.safetensors"))
  return out


def _rank_8(name, value):
  if "q_proj.lora_A" in name:
    return {name: np.concatenate([value, value])}
  if "q_proj.lora_B" in name:
    return {name: np.concatenate([value, value], axis=1)}
  return {name: value}


@pytest.mark.parametrize(
  "edit,error,match",
  [
    ({"config": {"base_model_name_or_path": "other-org/other-model"}}, ConfigError,
     r"adapter for other-org/other-model, but the model loaded is tiny-org/tiny-llama"),
    ({"config": {"auto_mapping": {"base_model_class": "Qwen2ForCausalLM"}}}, ConfigError,
     r"adapter for a Qwen2ForCausalLM, but the model is a LlamaForCausalLM"),
    ({"tensors": lambda n, v: {n.replace("model.layers", "transformer.h"): v}}, ConfigError,
     r"names no projection of a llama model; the adapter is for another architecture"),
    ({"config": {"target_modules": [*TARGETS, "c_attn"]}}, ConfigError,
     r"adapts c_attn, which this llama model does not have"),
    ({"config": {"r": 8}}, ConfigError, r"of rank 4, but its adapter_config.json gives \w+ rank 8"),
    ({"tensors": _rank_8}, ConfigError, r"of rank 8, but its adapter_config.json gives q_proj"),
    ({"tensors": lambda n, v: {} if "layers.2.mlp.down_proj.lora_B" in n else {n: v}},
     CheckpointError, r"lacks the lora_B weights of down_proj of layer\(s\) 2"),
    ({"config": {"use_dora": True}}, ConfigError, r"uses DoRA \(use_dora\)"),
    ({"config": {"peft_type": "IA3"}}, ConfigError, r"holds a IA3 adapter"),
  ],
)  # fmt: skip
def test_bad_adapters_are_one_sentence(base, peft_adapter, tmp_path, edit, error, match):
  adapter = _edited(peft_adapter[0], tmp_path, **edit)
  model = _dense(base)
  with pytest.raises(error, match=match):
    jaxtune.load_adapter(model, adapter)
  assert getattr(model, "lora_config", None) is None  # refused before the model changed


def test_adapter_for_another_model_size_is_refused(tmp_path):
  from peft import LoraConfig, get_peft_model

  small = tmp_path / "small"
  build_hf_llama(1).save_pretrained(small)
  wide = get_peft_model(
    build_hf_llama(1, intermediate_size=256), LoraConfig(r=2, target_modules=["down_proj"])
  )
  wide.save_pretrained(tmp_path / "wide")
  with pytest.raises(ConfigError, match=r"of shape \[2, 256\], but this model needs \[2, 192\]"):
    jaxtune.load_adapter(_dense(small), tmp_path / "wide")
  with pytest.raises(CheckpointError, match="is not a PEFT adapter directory"):
    jaxtune.load_adapter(_dense(small), tmp_path)


def test_lm_head_of_a_tied_model_is_refused_before_loading():
  from jaxtune.models.config import ModelConfig

  cfg = ModelConfig.from_hf({**default_model.CONFIG, "tie_word_embeddings": True})
  run = RunConfig(model="x", lora_targets=("q_proj", "lm_head"))
  with pytest.raises(UserError, match="has no lm_head layer to adapt; drop lm_head"):
    checks.check_targets(run, cfg)
  checks.check_targets(run.replace(lora_targets=("q_proj",)), cfg)


def test_generate_takes_a_peft_adapter_dir(base, peft_adapter):
  adapter, want = peft_adapter
  # The base model is the one the adapter names (here a local cache path).
  model, ckpt = loading.load_run_model(adapter, None, None, "float32")
  assert ckpt == base
  assert max_rel_err(model(jnp.asarray(IDS)), want) <= 1e-5


@pytest.mark.slow
def test_init_adapter_continues_training_it(tmp_path):
  ckpt = default_model.ensure_default_checkpoint(tmp_path / "ckpt")
  start = jaxtune.apply_lora(_dense(ckpt), rank=4, alpha=8, targets=("q_proj", "v_proj"))
  adapter = jaxtune.export_peft(_randomize(start, seed=3), tmp_path / "adapter")
  rows = [{"text": f"example {i} of some text to learn"} for i in range(8)]
  run_dir, model = jaxtune.train(
    model=str(ckpt),
    data=rows,
    out=str(tmp_path / "run"),
    init_adapter=str(adapter),
    steps=1,
    batch_size=8,
    seq_len=32,
    quantization=None,
    dtype="float32",
    learning_rate=1e-8,
    warmup_steps=0,
    export=None,
  )
  saved = RunConfig.from_yaml(run_dir / "config.yaml")
  assert (saved.lora_rank, saved.lora_targets) == (4, ("q_proj", "v_proj"))
  got = np.asarray(model.layers.self_attn.v_proj.lora_b[...])
  want = np.asarray(start.layers.self_attn.v_proj.lora_b[...])
  assert np.abs(want).max() > 0 and np.abs(got - want).max() < 1e-5  # started from it


# ---------------------------------------------------------------- ranks per layer

RANKS = {"down_proj": 6, "model.layers.1.self_attn.q_proj": 2}
ALPHAS = {"model.layers.2.self_attn.v_proj": 3}


def _loss_torch(model, ids):
  logits = model(torch.as_tensor(ids)).logits[:, :-1]
  labels = torch.as_tensor(ids)[:, 1:]
  return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


@pytest.mark.slow
def test_per_layer_ranks_give_peft_loss_and_gradients(base, tmp_path):
  """A peft adapter with ranks and alphas per module and per layer: jaxtune (layers stacked,
  columns past each layer's rank masked) computes PEFT's loss and gradients."""
  import jax
  from flax import nnx
  from peft import LoraConfig, get_peft_model
  from transformers import LlamaForCausalLM

  hf = LlamaForCausalLM.from_pretrained(base, torch_dtype=torch.float32).eval()
  config = LoraConfig(
    r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"],
    rank_pattern=RANKS, alpha_pattern=ALPHAS, task_type="CAUSAL_LM",
  )  # fmt: skip
  peft_model = get_peft_model(hf, config)
  _randomize_peft(peft_model, seed=3)
  peft_model.save_pretrained(tmp_path / "adapter")
  loss = _loss_torch(peft_model, IDS)
  loss.backward()

  model = jaxtune.load_adapter(_dense(base), tmp_path / "adapter")
  q = model.layers.self_attn.q_proj
  assert q.lora_a[...].shape == (3, 128, 4) and np.asarray(q.lora_mask[...]).sum(1).tolist() == [
    4,
    2,
    4,
  ]
  graphdef, lora, rest = nnx.split(model, nnx.LoRAParam, ...)

  def jax_loss(lora):
    logits = nnx.merge(graphdef, lora, rest)(jnp.asarray(IDS))[:, :-1]
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), -1)
    return -jnp.mean(jnp.take_along_axis(logp, jnp.asarray(IDS)[:, 1:, None], -1))

  value, grads = jax.jit(jax.value_and_grad(jax_loss))(lora)
  assert float(value) == pytest.approx(float(loss), rel=1e-5)
  where = {"q_proj": "self_attn", "v_proj": "self_attn", "down_proj": "mlp"}
  for proj, parent in where.items():
    g = grads["layers"][parent][proj]
    for layer in range(3):
      mod = peft_model.base_model.model.model.layers[layer]
      mod = getattr(getattr(mod, parent), proj)
      want_a = mod.lora_A["default"].weight.grad.numpy()  # [r, in]
      want_b = mod.lora_B["default"].weight.grad.numpy()  # [out, r]
      r = want_a.shape[0]
      got_a, got_b = np.asarray(g["lora_a"][...][layer]), np.asarray(g["lora_b"][...][layer])
      np.testing.assert_allclose(got_a[:, :r].T, want_a, rtol=1e-4, atol=1e-6)
      np.testing.assert_allclose(got_b[:r].T, want_b, rtol=1e-4, atol=1e-6)
      assert not got_a[:, r:].any() and not got_b[r:].any()  # masked: no gradient


def test_jaxtune_per_layer_ranks_load_in_peft(base, tmp_path):
  from peft import PeftModel
  from transformers import LlamaForCausalLM

  model = jaxtune.apply_lora(
    _dense(base), rank=4, alpha=8, targets=("q_proj", "down_proj", "lm_head"),
    rank_pattern={"down_proj": 6, "layers.1": 2, "lm_head": 3},
    alpha_pattern={"layers.2.q_proj": 2},
  )  # fmt: skip
  ours = np.asarray(_randomize(model)(jnp.asarray(IDS)))
  out = jaxtune.export_peft(model, tmp_path / "adapter")
  config = json.loads((out / "adapter_config.json").read_text())
  assert config["rank_pattern"] == {
    "model.layers.1.self_attn.q_proj": 2,
    "model.layers.0.mlp.down_proj": 6,
    "model.layers.1.mlp.down_proj": 2,  # layers.1 is more specific than down_proj
    "model.layers.2.mlp.down_proj": 6,
    "lm_head": 3,
  }
  assert config["alpha_pattern"] == {"model.layers.2.self_attn.q_proj": 2.0}
  hf = LlamaForCausalLM.from_pretrained(base, torch_dtype=torch.float32).eval()
  peft_model = PeftModel.from_pretrained(hf, out).eval()
  assert max_rel_err(torch_logits(peft_model, IDS), ours) <= 1e-5
  again = jaxtune.load_adapter(_dense(base), out)
  assert max_rel_err(again(jnp.asarray(IDS)), ours) <= 1e-6


@pytest.mark.slow
def test_training_with_ranks_per_layer_keeps_the_masked_columns_off(tmp_path):
  run_dir, model = jaxtune.train(
    out=str(tmp_path / "run"), steps=2, export="peft", lora_rank_pattern="layers.1=2,down_proj=8"
  )
  down, q = model.layers.mlp.down_proj, model.layers.self_attn.q_proj
  assert down.lora_a[...].shape[-1] == 8 and q.lora_a[...].shape[-1] == 16
  a, b = np.asarray(q.lora_a[...]), np.asarray(q.lora_b[...])
  assert not a[1, :, 2:].any() and not b[1, 2:].any() and b[1, :2].any()  # trained, masked
  config = json.loads((run_dir / "export" / "adapter_config.json").read_text())
  assert config["rank_pattern"]["model.layers.1.self_attn.q_proj"] == 2
  assert config["rank_pattern"]["model.layers.0.mlp.down_proj"] == 8
  # From Python the sentence names the setting as the keyword it was given by.
  with pytest.raises(UserError, match="^lora_rank_pattern: pattern key 'layers.9' names layer 9"):
    jaxtune.train(out=str(tmp_path / "bad"), steps=1, lora_rank_pattern="layers.9=4")
