"""The architecture of a model, read from a Hugging Face ``config.json``.

Runtime choices (mesh, remat, kernels, batch) never live here; see ``jaxtune.train``'s
RunConfig. This dataclass is frozen so it can be a static argument of jitted functions.
"""

import dataclasses
import json
from pathlib import Path
from typing import Any

from jaxtune.errors import ConfigError

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text")
SLIDING, FULL = "sliding_attention", "full_attention"


@dataclasses.dataclass(frozen=True)
class RopeConfig:
  theta: float = 10000.0
  kind: str = "default"  # "default", "linear" or "llama3"
  factor: float = 1.0
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  original_max_position_embeddings: int = 8192


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """One decoder-only architecture; the family fields switch Qwen's and Gemma's differences."""

  model_type: str
  vocab_size: int
  hidden_size: int
  intermediate_size: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  rms_norm_eps: float = 1e-6
  rope: RopeConfig = RopeConfig()
  max_position_embeddings: int = 2048
  tie_word_embeddings: bool = False
  hidden_act: str = "silu"  # silu | gelu_tanh
  qkv_bias: bool = False  # bias on q/k/v (Qwen2; Llama's attention_bias)
  o_bias: bool = False  # bias on o_proj (Llama's attention_bias)
  mlp_bias: bool = False
  qk_norm: bool = False  # RMSNorm over head_dim on q and k (Qwen3, Gemma 3)
  norm_plus_one: bool = False  # RMSNorm scales by (1 + w) (Gemma)
  embed_scale: bool = False  # embeddings times sqrt(hidden) (Gemma)
  sandwich_norms: bool = False  # norms after attention and MLP too (Gemma 2, 3)
  query_pre_attn_scalar: float | None = None  # softmax scale 1/sqrt(this) (Gemma 2, 3)
  attn_logit_softcap: float | None = None  # cap * tanh(scores / cap) (Gemma 2)
  final_logit_softcap: float | None = None
  layer_types: tuple[str, ...] = ()  # per layer: full_attention | sliding_attention
  sliding_window: int | None = None
  rope_local: RopeConfig | None = None  # rope of sliding layers when it differs (Gemma 3)

  @property
  def attention_scale(self) -> float:
    return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

  @property
  def has_sliding_layers(self) -> bool:
    return SLIDING in self.layer_types

  @property
  def q_size(self) -> int:
    return self.num_heads * self.head_dim

  @property
  def kv_size(self) -> int:
    return self.num_kv_heads * self.head_dim

  def linear_shapes(self) -> dict[str, tuple[int, int]]:
    """PyTorch-layout [out, in] shape of every projection of one layer, by HF name."""
    d, f = self.hidden_size, self.intermediate_size
    return {
      "q_proj": (self.q_size, d),
      "k_proj": (self.kv_size, d),
      "v_proj": (self.kv_size, d),
      "o_proj": (d, self.q_size),
      "gate_proj": (f, d),
      "up_proj": (f, d),
      "down_proj": (d, f),
    }

  def num_params(self) -> int:
    """All parameters of the unquantized model, counted as transformers counts them."""
    norms = 4 if self.sandwich_norms else 2
    per_layer = sum(o * i for o, i in self.linear_shapes().values()) + norms * self.hidden_size
    if self.qkv_bias:
      per_layer += self.q_size + 2 * self.kv_size
    if self.o_bias:
      per_layer += self.hidden_size
    if self.qk_norm:
      per_layer += 2 * self.head_dim
    embed = self.vocab_size * self.hidden_size
    head = 0 if self.tie_word_embeddings else embed
    return embed + head + self.num_layers * per_layer + self.hidden_size

  @classmethod
  def from_hf(cls, config: dict[str, Any] | str | Path) -> "ModelConfig":
    """Build from a HF config dict, a config.json path, or a checkpoint directory."""
    if not isinstance(config, dict):
      path = Path(config)
      if path.is_dir():
        path = path / "config.json"
      if not path.is_file():
        raise ConfigError(
          f"no config.json at {path}; point to a Hugging Face checkpoint directory."
        )
      try:
        config = json.loads(path.read_text())
      except json.JSONDecodeError as e:
        raise ConfigError(f"{path} is not valid JSON ({e}); re-download the checkpoint.") from e
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
      raise ConfigError(
        f"model_type {model_type!r} is not supported; jaxtune supports "
        f"{', '.join(SUPPORTED_MODEL_TYPES)}."
      )
    if model_type == "gemma3" and "text_config" in config:
      raise ConfigError(
        "this is a multimodal Gemma 3 checkpoint; jaxtune fine-tunes Gemma 3 text models "
        "(model_type gemma3_text, e.g. google/gemma-3-1b-it)."
      )
    try:
      cfg = cls(**_family_fields(model_type, config))
    except KeyError as e:
      raise ConfigError(
        f"config.json lacks the key {e.args[0]!r} that a {model_type} needs."
      ) from e
    if cfg.num_heads % cfg.num_kv_heads:
      raise ConfigError(
        f"num_attention_heads={cfg.num_heads} is not a multiple of "
        f"num_key_value_heads={cfg.num_kv_heads}."
      )
    return cfg


_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh"}


def _family_fields(model_type: str, config: dict[str, Any]) -> dict[str, Any]:
  hidden = int(config["hidden_size"])
  heads = int(config["num_attention_heads"])
  layers = int(config["num_hidden_layers"])
  gemma = model_type.startswith("gemma")
  act_name = config.get("hidden_activation") or config.get("hidden_act") or "silu"
  if gemma and act_name == "gelu":  # Gemma 1 configs say gelu but mean the tanh approximation
    act_name = "gelu_pytorch_tanh"
  if act_name not in _ACTIVATIONS:
    raise ConfigError(f"hidden activation {act_name!r} of this {model_type} is not supported.")
  attention_bias = bool(config.get("attention_bias", False))
  fields = dict(
    model_type=model_type,
    vocab_size=int(config["vocab_size"]),
    hidden_size=hidden,
    intermediate_size=int(config["intermediate_size"]),
    num_layers=layers,
    num_heads=heads,
    num_kv_heads=int(config.get("num_key_value_heads") or heads),
    head_dim=int(config.get("head_dim") or hidden // heads),
    rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
    max_position_embeddings=int(config.get("max_position_embeddings", 2048)),
    tie_word_embeddings=bool(config.get("tie_word_embeddings", gemma)),
    hidden_act=_ACTIVATIONS[act_name],
    qkv_bias=attention_bias or model_type == "qwen2",
    o_bias=attention_bias,
    mlp_bias=bool(config.get("mlp_bias", False)),
    qk_norm=model_type in ("qwen3", "gemma3_text"),
    norm_plus_one=gemma,
    embed_scale=gemma,
    sandwich_norms=model_type in ("gemma2", "gemma3_text"),
  )
  if model_type.startswith("qwen") and config.get("use_sliding_window"):
    raise ConfigError(
      f"this {model_type} config enables use_sliding_window, which jaxtune does not support "
      "for Qwen; set it to false (the released Qwen checkpoints do)."
    )
  rope_params = config.get("rope_parameters") or {}
  if model_type in ("gemma2", "gemma3_text"):
    pattern = int(
      config.get("sliding_window_pattern") or config.get("_sliding_window_pattern") or 2
    )
    default_types = [SLIDING if (i + 1) % pattern else FULL for i in range(layers)]
    fields.update(
      query_pre_attn_scalar=float(config.get("query_pre_attn_scalar") or fields["head_dim"]),
      attn_logit_softcap=_optional_float(config.get("attn_logit_softcapping")),
      final_logit_softcap=_optional_float(config.get("final_logit_softcapping")),
      layer_types=tuple(config.get("layer_types") or default_types),
      sliding_window=int(config["sliding_window"]),
    )
  if model_type == "gemma3_text" and FULL in rope_params:
    # transformers >= 5: one rope dict per layer type.
    fields["rope"] = _rope_from_hf({"rope_parameters": rope_params[FULL]})
    fields["rope_local"] = _rope_from_hf({"rope_parameters": rope_params[SLIDING]})
  elif model_type == "gemma3_text":
    fields["rope"] = _rope_from_hf(config)  # global layers: rope_theta and rope_scaling
    fields["rope_local"] = RopeConfig(theta=float(config.get("rope_local_base_freq", 10000.0)))
  else:
    fields["rope"] = _rope_from_hf(config)
  return fields


def _optional_float(value) -> float | None:
  return None if value is None else float(value)


def _rope_from_hf(config: dict[str, Any]) -> RopeConfig:
  # transformers >= 5 writes rope_parameters (theta inside); older checkpoints write
  # rope_theta at the top level and an optional rope_scaling dict ("type" or "rope_type").
  params = dict(config.get("rope_parameters") or {})
  scaling = config.get("rope_scaling") or {}
  params = {**scaling, **params}
  theta = float(params.get("rope_theta", config.get("rope_theta", 10000.0)))
  kind = params.get("rope_type", params.get("type", "default"))
  if kind in (None, "default"):
    return RopeConfig(theta=theta)
  if kind == "linear":
    return RopeConfig(theta=theta, kind="linear", factor=float(params["factor"]))
  if kind == "llama3":
    return RopeConfig(
      theta=theta,
      kind="llama3",
      factor=float(params["factor"]),
      low_freq_factor=float(params["low_freq_factor"]),
      high_freq_factor=float(params["high_freq_factor"]),
      original_max_position_embeddings=int(params["original_max_position_embeddings"]),
    )
  raise ConfigError(
    f"rope scaling type {kind!r} is not supported; jaxtune supports default, linear and llama3."
  )
