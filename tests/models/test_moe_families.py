"""Qwen3-MoE, Mixtral and gpt-oss checkpoints against transformers, on tiny random models
(3 layers, hidden 64, 4 experts, top 2): fp32 logits, NF4 experts quantized per expert as
bitsandbytes would, cached greedy generation, the load-balancing loss, and the settings read
or refused from config.json.

Every expert weight, router, sink and bias is random and norm weights are perturbed, so a
swapped gate/up, a transposed expert or a missing bias shows; gpt-oss's sliding window (4) is
shorter than the sequences, its clamp (2.0) bites, and its rope is YaRN.
"""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from conftest import assert_lora_grads_match_peft, copy_peft_lora_into, max_rel_err, torch_logits
from flax import nnx

import jaxtune
from jaxtune.errors import ConfigError
from jaxtune.models.decoding import generate_ids
from jaxtune.models.experts import expert_linears
from pallas_kernels import nf4

FAMILIES = ["qwen3_moe", "mixtral", "gpt_oss"]
_COMMON = dict(
  vocab_size=256,
  hidden_size=64,
  num_hidden_layers=3,
  num_attention_heads=4,
  num_key_value_heads=2,
  head_dim=16,
  max_position_embeddings=256,
)


def moe_config(family: str, **overrides):
  """A tiny transformers config of ``family``."""
  import transformers as tf

  if family == "qwen3_moe":
    kw = dict(moe_intermediate_size=64, num_experts=4, num_experts_per_tok=2)
    return tf.Qwen3MoeConfig(**{**_COMMON, **kw, **overrides})
  if family == "mixtral":
    kw = dict(intermediate_size=64, num_local_experts=4, num_experts_per_tok=2)
    return tf.MixtralConfig(**{**_COMMON, **kw, **overrides})
  kw = dict(
    intermediate_size=64,
    num_local_experts=4,
    num_experts_per_tok=2,
    sliding_window=4,
    swiglu_limit=2.0,
  )
  return tf.GptOssConfig(**{**_COMMON, **kw, **overrides})


def write_moe(directory, family: str, seed: int = 0, **overrides):
  """(checkpoint directory, the transformers model saved there)."""
  from transformers import AutoModelForCausalLM

  torch.manual_seed(seed)
  cfg = moe_config(family, **overrides)
  model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").float().eval()
  g = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for name, p in model.named_parameters():
      if any(k in name for k in ("experts", "sinks", "router", "mlp.gate.", "moe.gate.")):
        p.copy_(torch.randn(p.shape, generator=g) * 0.2)  # initialised empty or zero
      if name.endswith("norm.weight") or name.endswith(".bias"):
        p.add_(0.3 * torch.randn(p.shape, generator=g))
  out = directory / f"{family}_{seed}"
  model.save_pretrained(out)
  return out, model


def _ids(seed=0, length=12):
  return np.random.default_rng(seed).integers(0, 256, (2, length))


@pytest.mark.parametrize("family", FAMILIES)
def test_fp32_logits_match_transformers(tmp_path, family):
  path, hf = write_moe(tmp_path, family)
  model = jaxtune.from_pretrained(path, quantization=None, dtype="float32")
  assert max_rel_err(model(jnp.asarray(_ids())), torch_logits(hf, _ids())) <= 1e-5


def test_the_family_switches_are_really_on(tmp_path):
  cfgs = {f: jaxtune.ModelConfig.from_hf(write_moe(tmp_path, f)[0]) for f in FAMILIES}
  q, m, g = cfgs["qwen3_moe"], cfgs["mixtral"], cfgs["gpt_oss"]
  assert (q.num_experts, q.num_experts_per_tok, q.moe_intermediate_size) == (4, 2, 64)
  assert q.router == "softmax_topk" and not q.norm_topk_prob and q.qk_norm
  assert m.norm_topk_prob and m.router == "softmax_topk" and not m.layer_types
  assert g.router == "topk_softmax" and g.router_bias and g.expert_bias and g.attention_sinks
  assert g.expert_activation == "swiglu_clamped" and g.swiglu_limit == 2.0 and g.norm_scale_f32
  assert g.qkv_bias and g.o_bias and g.sliding_window == 4 < _ids().shape[1]
  assert g.layer_types == ("sliding_attention", "full_attention", "sliding_attention")
  assert g.rope.kind == "yarn" and g.rope.factor == 32.0 and not g.rope.truncate


def _hf_expert_weight(hf, family: str, layer: int, name: str) -> np.ndarray:
  """transformers' in-memory expert weights [E, out, in] of projection ``name``."""
  experts = hf.model.layers[layer].mlp.experts
  if family == "gpt_oss":  # [E, in, out], gate and up interleaved
    if name == "down_proj":
      return experts.down_proj.detach().numpy().transpose(0, 2, 1)
    col = 0 if name == "gate_proj" else 1
    return experts.gate_up_proj[:, :, col::2].detach().numpy().transpose(0, 2, 1)
  if name == "down_proj":
    return experts.down_proj.detach().numpy()
  gate_up = experts.gate_up_proj.detach().numpy()  # [E, 2I, D]: gate rows, then up rows
  half = gate_up.shape[1] // 2
  return gate_up[:, :half] if name == "gate_proj" else gate_up[:, half:]


def _set_hf_expert_weight(hf, family: str, layer: int, name: str, w: np.ndarray) -> None:
  experts = hf.model.layers[layer].mlp.experts
  t = torch.from_numpy(np.ascontiguousarray(w))
  with torch.no_grad():
    if family == "gpt_oss":
      if name == "down_proj":
        experts.down_proj.copy_(t.transpose(1, 2))
      else:
        experts.gate_up_proj[:, :, 0 if name == "gate_proj" else 1 :: 2].copy_(t.transpose(1, 2))
    elif name == "down_proj":
      experts.down_proj.copy_(t)
    else:
      half = experts.gate_up_proj.shape[1] // 2
      rows = slice(0, half) if name == "gate_proj" else slice(half, None)
      experts.gate_up_proj[:, rows].copy_(t)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])  # Mixtral's is Qwen3-MoE's layout
def test_nf4_experts_are_quantized_per_expert_and_match_on_their_dequantized_weights(
  tmp_path, family
):
  """Each expert's codes are those bitsandbytes gives its own Linear4bit (nf4.quantize_experts
  holds that to bnb: tests/unit/test_nf4.py), and the model equals transformers holding the
  dequantized weights."""
  path, hf = write_moe(tmp_path, family, seed=1)
  model = jaxtune.from_pretrained(path, quantization="nf4", dtype="float32")
  found = 0
  for p, lin in expert_linears(model):
    for layer in range(lin.layers):
      want = nf4.quantize_experts(jnp.asarray(_hf_expert_weight(hf, family, layer, p[-1])))
      for got, expected in zip(lin.frozen_arrays(), want, strict=True):
        np.testing.assert_array_equal(np.asarray(got[layer]), np.asarray(expected))
      _set_hf_expert_weight(
        hf, family, layer, p[-1], np.asarray(lin.dense_weight(jnp.float32)[layer])
      )
      found += 1
  assert found == 3 * 3  # three projections in each of three layers
  for p, lin in jaxtune.models.lora.iter_linears(model):
    if lin.quantized:
      for layer in range(lin.layers):
        getattr(hf.model.layers[layer].self_attn, p[-1]).weight.data.copy_(
          torch.from_numpy(np.asarray(lin.dense_weight(jnp.float32, layer)))
        )
  assert max_rel_err(model(jnp.asarray(_ids(1))), torch_logits(hf, _ids(1))) <= 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_cached_greedy_generation_matches_transformers(tmp_path, family):
  path, hf = write_moe(tmp_path, family, seed=4)
  model = jaxtune.from_pretrained(path, quantization=None, dtype="float32")
  prompt = [5, 17, 99, 3, 42, 7]
  ours = generate_ids(model, [prompt], max_new_tokens=12)[0]
  with torch.no_grad():
    want = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)
  assert ours == want[0, len(prompt) :].tolist()
  assert len(set(ours)) > 2  # not a degenerate repeat that any bug would reproduce


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_load_balancing_loss_is_transformers_aux_loss(tmp_path, family):
  """Over every layer's router, padding left out (transformers' attention mask)."""
  path, hf = write_moe(tmp_path, family, seed=4)
  model = jaxtune.from_pretrained(path, quantization=None, dtype="float32")
  ids = _ids(4)
  mask = np.ones_like(ids)
  mask[1, 9:] = 0  # the second row's last tokens are padding
  with torch.no_grad():
    out = hf(
      torch.from_numpy(ids), attention_mask=torch.from_numpy(mask), output_router_logits=True
    )
  _, ours = model.hidden_and_balance(jnp.asarray(ids), segment_ids=jnp.asarray(mask))
  np.testing.assert_allclose(float(ours), float(out.aux_loss), rtol=1e-5)
  _, unmasked = model.hidden_and_balance(jnp.asarray(ids))
  assert abs(float(unmasked) - float(ours)) > 1e-4  # the padding was really left out


@pytest.mark.parametrize(
  ("family", "setting", "named"),
  [
    ("qwen3_moe", {"mlp_only_layers": [1]}, "mlp_only_layers"),
    ("qwen3_moe", {"decoder_sparse_step": 2}, "decoder_sparse_step"),
    ("mixtral", {"router_jitter_noise": 0.1}, "router_jitter_noise"),
    ("qwen3_moe", {"num_experts_per_tok": 9}, "num_experts_per_tok"),
    ("gpt_oss", {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4,
                 "original_max_position_embeddings": 64, "partial_rotary_factor": 0.5}},
     "partial_rotary_factor"),
  ],
)  # fmt: skip
def test_options_jaxtune_does_not_build_are_refused_by_name(tmp_path, family, setting, named):
  path, _ = write_moe(tmp_path, family)
  cfg = json.loads((path / "config.json").read_text())
  (path / "config.json").write_text(json.dumps({**cfg, **setting}))
  with pytest.raises(ConfigError, match=named):
    jaxtune.ModelConfig.from_hf(path)


def _next_token_grads_against_peft(model, peft_model, ids: np.ndarray):
  """jaxtune's gradients of the mean next-token loss of ``ids`` over its trainable
  parameters, after checking the loss equals ``peft_model``'s (whose .grad it fills)."""
  out = peft_model(torch.from_numpy(ids[:, :-1]).long())
  torch_loss = torch.nn.functional.cross_entropy(
    out.logits.reshape(-1, out.logits.shape[-1]), torch.from_numpy(ids[:, 1:]).reshape(-1).long()
  )
  torch_loss.backward()
  graphdef, lora, frozen = nnx.split(model, nnx.LoRAParam, ...)

  def loss(lo):
    logits = nnx.merge(graphdef, lo, frozen)(jnp.asarray(ids[:, :-1]))
    picked = jnp.take_along_axis(jax.nn.log_softmax(logits), jnp.asarray(ids[:, 1:])[..., None], -1)
    return -jnp.mean(picked)

  value, grads = jax.jit(jax.value_and_grad(loss))(lora)
  np.testing.assert_allclose(float(value), torch_loss.item(), rtol=1e-5)
  return grads


def _peft_experts(peft_model, layer: int) -> dict:
  """PEFT's two expert adapters of ``layer`` (target_parameters: gate_up_proj's wraps the
  experts, down_proj's wraps that)."""
  modules = dict(peft_model.named_modules())
  prefix = f"base_model.model.model.layers.{layer}.mlp.experts"
  return {"gate_up_proj": modules[prefix + ".base_layer"], "down_proj": modules[prefix]}


def _columns(family: str, peft_name: str, out: int) -> dict:
  """Which output columns of PEFT's adapter are each of jaxtune's projections': gpt-oss
  interleaves gate and up, the others put gate's rows first."""
  if peft_name == "down_proj":
    return {"down_proj": slice(None)}
  if family == "gpt_oss":
    return {"gate_proj": slice(0, None, 2), "up_proj": slice(1, None, 2)}
  return {"gate_proj": slice(0, out // 2), "up_proj": slice(out // 2, None)}


def _per_expert(weight: np.ndarray, rank: int, experts: int, which: str) -> np.ndarray:
  """PEFT's ParamWrapper factors as jaxtune holds them: A [E * r, in] -> [E, in, r] (expert
  e's rows e*r .. e*r + r - 1), B [out, r * E] -> [E, r, out] (expert e's columns e, e + E,
  ...)."""
  if which == "A":
    return weight.reshape(experts, rank, -1).transpose(0, 2, 1)
  return weight.reshape(weight.shape[0], rank, experts).transpose(2, 1, 0)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])  # Mixtral fuses as Qwen3-MoE does
def test_expert_lora_gradients_match_peft_target_parameters(tmp_path, family):
  """LoRA on attention and on every expert (PEFT's target_parameters on the fused experts:
  one A per expert for gate and up together, which jaxtune holds as gate's and up's A alike)
  gives PEFT's loss and gradients: A's gradient the sum of gate's and up's."""
  from peft import LoraConfig, get_peft_model

  from jaxtune.models.lora import iter_linears

  wide = {"moe_intermediate_size": 128} if family == "qwen3_moe" else {"intermediate_size": 128}
  path, hf = write_moe(tmp_path, family, seed=5, **wide)  # intermediate != hidden: no square
  rank, alpha = 4, 12
  peft_model = get_peft_model(
    hf,
    LoraConfig(
      r=rank,
      lora_alpha=alpha,
      target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
      target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
    ),
  )
  torch.manual_seed(0)
  with torch.no_grad():
    for name, p in peft_model.named_parameters():
      if "lora_" in name:
        p.copy_(0.05 * torch.randn_like(p))
  model = jaxtune.from_pretrained(path, quantization=None, dtype="float32")
  model = jaxtune.apply_lora(model, rank=rank, alpha=alpha)
  copy_peft_lora_into(model, peft_model)
  experts, lins = model.config.num_experts, {p[-1]: (p, x) for p, x in expert_linears(model)}
  for layer in range(model.config.num_layers):
    for name, wrapper in _peft_experts(peft_model, layer).items():
      a = _per_expert(wrapper.lora_A["default"].weight.detach().numpy(), rank, experts, "A")
      b = _per_expert(wrapper.lora_B["default"].weight.detach().numpy(), rank, experts, "B")
      for ours, cols in _columns(family, name, b.shape[-1]).items():
        lin = lins[ours][1]
        lin.lora_a[...] = lin.lora_a[...].at[layer].set(a)
        lin.lora_b[...] = lin.lora_b[...].at[layer].set(b[..., cols])

  ids = _ids(3)
  grads = _next_token_grads_against_peft(model, peft_model, ids)
  assert assert_lora_grads_match_peft(model, grads, peft_model) == 4 * 2
  assert sum(lin.lora_a is not None for _, lin in iter_linears(model)) == 4
  grad_of = dict(grads.flat_state())
  for layer in range(model.config.num_layers):
    for name, wrapper in _peft_experts(peft_model, layer).items():
      want_a = _per_expert(wrapper.lora_A["default"].weight.grad.numpy(), rank, experts, "A")
      want_b = _per_expert(wrapper.lora_B["default"].weight.grad.numpy(), rank, experts, "B")
      got_a = 0
      for ours, cols in _columns(family, name, want_b.shape[-1]).items():
        p = lins[ours][0]
        got_a = got_a + np.asarray(grad_of[(*p, "lora_a")].get_value())[layer]
        got_b = np.asarray(grad_of[(*p, "lora_b")].get_value())[layer]
        assert max_rel_err(got_b, want_b[..., cols]) <= 1e-5, (layer, ours)
      assert max_rel_err(got_a, want_a) <= 1e-5, (layer, name)


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_lora_training_and_exports_reload_in_transformers_and_peft(tmp_path, family):
  """Three steps of NF4 QLoRA on attention and every expert, the load-balancing loss in the
  metrics; the merged export (into the dequantized and into the original weights, in the
  checkpoint's own layout: per expert, or gpt-oss's fused experts) and the PEFT adapter
  (target_parameters) reload in transformers and peft with the trained model's logits."""
  from peft import PeftModel
  from transformers import AutoModelForCausalLM

  from jaxtune.data.rows import Dataset
  from jaxtune.run import resolve as resolver
  from jaxtune.run.session import make_objective
  from jaxtune.run_config import RunConfig
  from jaxtune.training import loop as trainer

  path, _ = write_moe(tmp_path, family, seed=2)
  model = jaxtune.from_pretrained(path, quantization="nf4", dtype="float32")
  model = jaxtune.apply_lora(model, rank=4, alpha=8)
  ids = np.random.default_rng(0).integers(0, 256, (8, 24)).astype(np.int32)
  data = Dataset.from_rows(ids, np.roll(ids, -1, axis=1))
  run = RunConfig(
    out=str(tmp_path), steps=3, batch_size=4, learning_rate=1e-2, warmup_steps=0,
    dtype="float32", lora_rank=4,
  )  # fmt: skip
  plan = resolver.resolve(run, model.config, devices=jax.devices()[:1])
  objective = make_objective(run, data, None, model.config)
  assert objective.router_aux_loss_coef == 0.001  # the family's default
  model, history = trainer.train(model, data, run, plan, objective=objective)
  assert history[-1]["loss"] < history[0]["loss"]
  assert all(1.0 < h["router_balance"] < 4.0 for h in history)  # E * sum p f: 1 when even

  test_ids = _ids(2)
  ours = model(jnp.asarray(test_ids))
  for merge_into in ("dequantized", "original"):
    jaxtune.export_merged(model, tmp_path / merge_into, dtype="float32", merge_into=merge_into)
  hf = AutoModelForCausalLM.from_pretrained(
    tmp_path / "dequantized", dtype=torch.float32, attn_implementation="eager"
  ).eval()
  assert max_rel_err(torch_logits(hf, test_ids), ours) <= 1e-5
  adapter = jaxtune.export_peft(model, tmp_path / "peft")
  config = json.loads((adapter / "adapter_config.json").read_text())
  assert config["target_parameters"] == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
  assert config["rank_pattern"] == {"gate_up_proj": 8}  # gate's and up's pairs side by side
  base = AutoModelForCausalLM.from_pretrained(
    path, dtype=torch.float32, attn_implementation="eager"
  )
  peft_model = PeftModel.from_pretrained(base.eval(), adapter).eval()
  merged = AutoModelForCausalLM.from_pretrained(
    tmp_path / "original", dtype=torch.float32, attn_implementation="eager"
  ).eval()
  # PEFT on the original weights is the merge into the original weights.
  assert max_rel_err(torch_logits(peft_model, test_ids), torch_logits(merged, test_ids)) <= 1e-5


@pytest.mark.slow
def test_gpt_oss_mxfp4_experts_load_exactly(tmp_path):
  """A gpt-oss checkpoint as released (experts in MXFP4: ``*_blocks``, ``*_scales``,
  quantization_config mxfp4) equals transformers holding the same experts dequantized; with
  NF4, each expert quantized from those exact values."""
  from safetensors.numpy import load_file, save_file

  from pallas_kernels import mxfp4

  path, hf = write_moe(tmp_path, "gpt_oss", seed=8)
  tensors = load_file(str(path / "model.safetensors"))
  for layer in range(3):
    for proj in ("gate_up_proj", "down_proj"):
      name = f"model.layers.{layer}.mlp.experts.{proj}"
      w = tensors.pop(name).transpose(0, 2, 1)  # [E, in, out] -> [E, out, in], as stored
      blocks, scales = mxfp4.quantize(jnp.asarray(w))
      tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = np.asarray(blocks), np.asarray(scales)
      exact = np.asarray(mxfp4.dequantize(blocks, scales)).transpose(0, 2, 1)
      with torch.no_grad():
        getattr(hf.model.layers[layer].mlp.experts, proj).copy_(torch.from_numpy(exact))
  save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
  config = json.loads((path / "config.json").read_text())
  config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": None}
  (path / "config.json").write_text(json.dumps(config))

  model = jaxtune.from_pretrained(path, quantization=None, dtype="float32")
  assert max_rel_err(model(jnp.asarray(_ids(8))), torch_logits(hf, _ids(8))) <= 1e-5
  quantized = jaxtune.from_pretrained(path, quantization="nf4", dtype="float32")
  for p, lin in expert_linears(quantized):
    want = nf4.quantize_experts(jnp.asarray(_hf_expert_weight(hf, "gpt_oss", 1, p[-1])))
    np.testing.assert_array_equal(np.asarray(lin.codes[...][1]), np.asarray(want.codes))


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_trained_router_gradients_match_peft_modules_to_save_and_export(tmp_path, family):
  """--train-router: the routers' weights (and gpt-oss's biases) train beside the adapters,
  with the gradients of transformers + PEFT keeping the router whole (modules_to_save); the
  PEFT export saves them so, and reloads with jaxtune's logits."""
  from peft import LoraConfig, PeftModel, get_peft_model
  from transformers import AutoModelForCausalLM

  path, hf = write_moe(tmp_path, family, seed=9)
  router = "router" if family == "gpt_oss" else "gate"
  peft_model = get_peft_model(
    hf, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"], modules_to_save=[router])
  )
  model = jaxtune.from_pretrained(path, quantization=None, dtype="float32")
  model = jaxtune.apply_lora(model, rank=4, alpha=8, targets=["q_proj"], train_router=True)
  copy_peft_lora_into(model, peft_model)
  ids = _ids(9)
  grads = _next_token_grads_against_peft(model, peft_model, ids)
  grad_of = dict(grads.flat_state())
  modules = dict(peft_model.named_modules())
  fields = ("weight", "bias") if family == "gpt_oss" else ("weight",)
  for field in fields:
    got = np.asarray(grad_of[("layers", "mlp", "router", field)].get_value())
    for layer in range(3):
      saved = modules[f"base_model.model.model.layers.{layer}.mlp.{router}"]
      want = getattr(saved.modules_to_save["default"], field).grad.numpy()
      # (a sum over every token's routing probabilities: float32 rounding reaches ~2e-5)
      assert max_rel_err(got[layer], want) <= 5e-5, (field, layer)

  graphdef, lora, frozen = nnx.split(model, nnx.LoRAParam, ...)
  trained = nnx.merge(graphdef, jax.tree.map(lambda p, g: p - 0.5 * g, lora, grads), frozen)
  adapter = jaxtune.export_peft(trained, tmp_path / "peft")
  assert json.loads((adapter / "adapter_config.json").read_text())["modules_to_save"] == [router]
  base = AutoModelForCausalLM.from_pretrained(
    path, dtype=torch.float32, attn_implementation="eager"
  )
  reloaded = PeftModel.from_pretrained(base.eval(), adapter).eval()
  ours = trained(jnp.asarray(ids))
  assert max_rel_err(torch_logits(reloaded, ids), ours) <= 1e-5
  assert max_rel_err(ours, model(jnp.asarray(ids))) > 1e-3  # the update (routers, q_proj) shows


@pytest.mark.slow
def test_bnb_4bit_experts_keep_their_bytes(tmp_path):
  """A ``*-bnb-4bit`` Qwen3-MoE (every expert its own Linear4bit, as transformers 4 saved
  them) loads with each expert's NF4 bytes as stored."""
  from safetensors.numpy import load_file, save_file

  from converters import bnb

  path, _ = write_moe(tmp_path, "qwen3_moe", seed=10)
  tensors = load_file(str(path / "model.safetensors"))
  stored = {}
  for name in [n for n in tensors if ".experts." in n or ".self_attn." in n and "norm" not in n]:
    w = tensors.pop(name)
    q = nf4.quantize(jnp.asarray(w))
    stored[name] = q
    packed = bnb.pack(q, w.shape, "float32")
    tensors.update({name if k == "weight" else name + k: v for k, v in packed.items()})
  save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
  config = json.loads((path / "config.json").read_text())
  config["quantization_config"] = {
    "quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4",
    "bnb_4bit_use_double_quant": True,
  }  # fmt: skip
  (path / "config.json").write_text(json.dumps(config))
  model = jaxtune.from_pretrained(path, quantization="nf4", dtype="float32")
  lins = {p[-1]: lin for p, lin in expert_linears(model)}
  want = stored["model.layers.2.mlp.experts.3.down_proj.weight"]
  got = lins["down_proj"].codes[...][2, 3]
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want.codes).reshape(got.shape))


@pytest.mark.slow
def test_the_tiled_grouped_products_give_the_same_model_and_are_chosen_on_gpus(tmp_path):
  """Runtime.grouped_matmul "tiles" (what resolve picks on a GPU, where ragged_dot is slow)
  computes the model ragged_dot does, gradients included; CPUs keep ragged_dot."""
  import types

  from jaxtune.parallel.runtime import DEFAULT
  from jaxtune.run.choices import resolve_grouped_matmul

  path, _ = write_moe(tmp_path, "gpt_oss", seed=11)
  model = jaxtune.apply_lora(jaxtune.from_pretrained(path, quantization=None, dtype="float32"))
  rng = np.random.default_rng(11)
  for _, lin in [*jaxtune.models.lora.iter_linears(model), *expert_linears(model)]:
    if lin.lora_b is not None:  # every adapter live, so every gradient is
      lin.lora_b[...] = jnp.asarray(0.1 * rng.standard_normal(lin.lora_b[...].shape), jnp.float32)
  graphdef, lora, frozen = nnx.split(model, nnx.LoRAParam, ...)
  ids = jnp.asarray(_ids(11))
  tiles = dataclasses.replace(DEFAULT, grouped_matmul="tiles")

  def loss(lo, runtime):
    return jnp.sum(nnx.merge(graphdef, lo, frozen)(ids, runtime=runtime) ** 2) * 1e-4

  (a, ga), (b, gb) = (jax.value_and_grad(loss)(lora, rt) for rt in (DEFAULT, tiles))
  np.testing.assert_allclose(float(a), float(b), rtol=1e-5)
  for x, y in zip(jax.tree.leaves(ga), jax.tree.leaves(gb), strict=True):
    assert max_rel_err(y, x) <= 1e-5
  cfg = model.config
  assert resolve_grouped_matmul(cfg, types.SimpleNamespace(platform="gpu")) == "tiles"
  assert resolve_grouped_matmul(cfg, jax.devices()[0]) == "ragged_dot"
