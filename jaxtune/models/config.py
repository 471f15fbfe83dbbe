"""The architecture of a model, read from a Hugging Face ``config.json``.

Runtime choices (mesh, remat, kernels, batch) never live here; see ``jaxtune.train``'s
RunConfig. This dataclass is frozen so it can be a static argument of jitted functions.
"""

import dataclasses
import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from jaxtune.errors import ConfigError

if TYPE_CHECKING:
  from jaxtune.models import moe

SUPPORTED_MODEL_TYPES = (
  "llama",
  "qwen2",
  "qwen3",
  "gemma",
  "gemma2",
  "gemma3_text",
  "qwen3_moe",
  "mixtral",
  "gpt_oss",
)
MOE_MODEL_TYPES = ("qwen3_moe", "mixtral", "gpt_oss")
SLIDING, FULL = "sliding_attention", "full_attention"


@dataclasses.dataclass(frozen=True)
class RopeConfig:
  theta: float = 10000.0
  kind: str = "default"  # "default", "linear", "llama3" or "yarn"
  factor: float = 1.0
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  original_max_position_embeddings: int = 8192
  # yarn (rope.yarn_frequencies): the correction range's bounds, whether they are rounded,
  # and what scales cos and sin (None: computed from the factor and the mscales)
  beta_fast: float = 32.0
  beta_slow: float = 1.0
  truncate: bool = True
  attention_factor: float | None = None
  mscale: float | None = None
  mscale_all_dim: float | None = None


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
  # Mixture of experts (num_experts > 0: every layer's MLP is sparse, models/experts.py).
  num_experts: int = 0
  num_experts_per_tok: int = 0
  moe_intermediate_size: int = 0
  router: str = "softmax_topk"  # moe.ROUTERS
  norm_topk_prob: bool = True  # softmax_topk: the top k renormalised to sum to 1
  router_bias: bool = False  # gpt-oss
  expert_bias: bool = False  # gpt-oss: biases on every expert's projections
  expert_activation: str = "silu"  # moe.ACTIVATIONS
  swiglu_alpha: float = 1.702
  swiglu_limit: float = 7.0
  router_aux_loss_coef: float = 0.001  # the family's weight of the load-balancing loss
  attention_sinks: bool = False  # gpt-oss: a learned logit per head in the softmax
  norm_scale_f32: bool = False  # gpt-oss: RMSNorm multiplies by w in float32, then casts

  @property
  def attention_scale(self) -> float:
    return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

  @property
  def is_moe(self) -> bool:
    return self.num_experts > 0

  def routing(self) -> "moe.Routing":
    """The router's settings as models/moe.py takes them."""
    from jaxtune.models import moe

    return moe.Routing(self.num_experts, self.num_experts_per_tok, self.router, self.norm_topk_prob)

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
    """PyTorch-layout [out, in] shape of every projection of one layer, by HF name (of one
    expert, for a mixture of experts' MLP)."""
    d = self.hidden_size
    f = self.moe_intermediate_size if self.is_moe else self.intermediate_size
    return {
      "q_proj": (self.q_size, d),
      "k_proj": (self.kv_size, d),
      "v_proj": (self.kv_size, d),
      "o_proj": (d, self.q_size),
      "gate_proj": (f, d),
      "up_proj": (f, d),
      "down_proj": (d, f),
    }

  def linear_params(self) -> int:
    """The weights of every layer's projections (what NF4 stores as codes)."""
    shapes = self.linear_shapes()
    experts = max(self.num_experts, 1)
    return self.num_layers * sum(
      o * i * (experts if name in _MLP_NAMES else 1) for name, (o, i) in shapes.items()
    )

  def num_params(self) -> int:
    """All parameters of the unquantized model, counted as transformers counts them."""
    norms = 4 if self.sandwich_norms else 2
    per_layer = norms * self.hidden_size
    if self.qkv_bias:
      per_layer += self.q_size + 2 * self.kv_size
    if self.o_bias:
      per_layer += self.hidden_size
    if self.qk_norm:
      per_layer += 2 * self.head_dim
    if self.attention_sinks:
      per_layer += self.num_heads
    if self.is_moe:
      per_layer += self.num_experts * (self.hidden_size + self.router_bias)
      if self.expert_bias:
        per_layer += self.num_experts * (2 * self.moe_intermediate_size + self.hidden_size)
    embed = self.vocab_size * self.hidden_size
    head = 0 if self.tie_word_embeddings else embed
    return embed + head + self.linear_params() + self.num_layers * per_layer + self.hidden_size

  @classmethod
  def from_hf(cls, config: dict[str, Any] | str | Path) -> "ModelConfig":
    """Build from a HF config dict, a config.json path, or a checkpoint directory.

    Every value is checked for its type and range as it is read, and the whole for a size a
    machine can hold, before anything is allocated: a damaged or hostile config.json gets one
    sentence naming the file and the field.
    """
    return cls.read_hf(config)[0]

  @classmethod
  def read_hf(cls, config: dict[str, Any] | str | Path) -> tuple["ModelConfig", dict[str, Any]]:
    """(``from_hf``'s config, the HF settings it was read from): config.json read once for
    what else a loader needs of it (its quantization_config)."""
    source = "config.json"
    if not isinstance(config, dict):
      path = Path(config)
      if path.is_dir():
        path = path / "config.json"
      if not path.is_file():
        raise ConfigError(
          f"no config.json at {path}; point to a Hugging Face checkpoint directory."
        )
      source = str(path)
      try:
        config = json.loads(path.read_text())
      except OSError as e:
        raise ConfigError(
          f"cannot read {path} ({e.strerror or type(e).__name__}); make it a readable file."
        ) from e
      except ValueError as e:  # JSONDecodeError, or UnicodeDecodeError: not text
        raise ConfigError(f"{path} is not valid JSON ({e}); re-download the checkpoint.") from e
      if not isinstance(config, dict):
        raise ConfigError(
          f"{path} holds a JSON {_JSON_KINDS.get(type(config), 'number')}, not an object of "
          "settings; "
          "re-download the checkpoint."
        )
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
    cfg = cls(**_family_fields(_Fields(config, source, model_type)))
    if cfg.num_heads % cfg.num_kv_heads:
      raise ConfigError(
        f"num_attention_heads={cfg.num_heads} is not a multiple of "
        f"num_key_value_heads={cfg.num_kv_heads} ({source}); re-download the checkpoint."
      )
    if cfg.num_params() > MAX_PARAMS:
      raise ConfigError(
        f"{source} describes a model of {cfg.num_params():.3g} parameters "
        f"(num_hidden_layers={cfg.num_layers}, hidden_size={cfg.hidden_size}, "
        f"intermediate_size={cfg.intermediate_size}, vocab_size={cfg.vocab_size}), more than "
        f"the {MAX_PARAMS:.0e} any machine holds; the file is damaged, re-download it."
      )
    return cfg, config


_MLP_NAMES = ("gate_proj", "up_proj", "down_proj")
_DEFAULT_THETA = {"mixtral": 1e6, "gpt_oss": 150000.0}
MAX_LAYERS = 100_000
MAX_PARAMS = 10**13  # 25 times the largest open model; more means a damaged config.json
_INT32 = 2**31 - 1  # sizes used as int32 on the device (positions, window)
_REQUIRED = object()
_JSON_KINDS = {list: "list", str: "string", bool: "boolean", type(None): "null"}


class _Fields:
  """The values of a config.json (or of one of its objects, ``prefix``), each checked for its
  type and range as it is read; a wrong one raises one sentence naming the file and key."""

  def __init__(self, config: dict[str, Any], source: str, model_type: str, prefix: str = ""):
    self.config, self.source, self.model_type, self.prefix = config, source, model_type, prefix

  def has(self, key: str) -> bool:
    return self.config.get(key) is not None

  def raw(self, key: str, default: Any = None) -> Any:
    value = self.config.get(key)
    return default if value is None else value

  def count(self, key: str, default: Any = _REQUIRED, high: int | None = None) -> int:
    """A whole number >= 1 (and <= ``high``); null means absent, as transformers reads it."""
    value = self._get(key, default)
    if type(value) is not int or value < 1 or (high is not None and value > high):
      allowed = "a whole number >= 1" if high is None else f"a whole number from 1 to {high}"
      raise self.wrong(key, allowed, value)
    return value

  def number(self, key: str, default: Any = _REQUIRED, zero: bool = False) -> float | None:
    """A finite number > 0 (>= 0 with ``zero``); None where absent and ``default`` is None."""
    value = self._get(key, default)
    if value is None and default is None:
      return None
    ok = type(value) in (int, float) and math.isfinite(value) and (value > 0 or zero and value == 0)
    if not ok:
      raise self.wrong(key, f"a finite number {'>=' if zero else '>'} 0", value)
    return float(value)

  def flag(self, key: str, default: bool) -> bool:
    value = self._get(key, default)
    if type(value) is not bool:
      raise self.wrong(key, "true or false", value)
    return value

  def mapping(self, key: str) -> "_Fields":
    """A nested object (rope_scaling, ...); null or absent reads as empty."""
    value = self._get(key, {})
    if not isinstance(value, dict):
      raise self.wrong(key, "an object", value)
    return _Fields(value, self.source, self.model_type, f"{self.prefix}{key}.")

  def _get(self, key: str, default: Any) -> Any:
    if key not in self.config and default is _REQUIRED:
      raise ConfigError(
        f"{self.source} lacks the key {self.prefix + key!r} that a {self.model_type} needs."
      )
    value = self.config[key] if key in self.config else None
    return default if value is None and default is not _REQUIRED else value  # null: a wrong type

  def wrong(self, key: str, allowed: str, value: Any) -> ConfigError:
    shown = json.dumps(value)
    shown = shown if len(shown) <= 40 else shown[:37] + "..."
    return ConfigError(
      f"{self.prefix}{key} in {self.source} must be {allowed}, got {shown}; fix or "
      "re-download the file."
    )


_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh"}


def _family_fields(c: _Fields) -> dict[str, Any]:
  model_type = c.model_type
  hidden = c.count("hidden_size")
  heads = c.count("num_attention_heads")
  layers = c.count("num_hidden_layers", high=MAX_LAYERS)
  if not c.has("head_dim") and hidden % heads:
    raise ConfigError(
      f"hidden_size={hidden} in {c.source} is not a multiple of num_attention_heads={heads}, "
      "and it sets no head_dim; fix or re-download the file."
    )
  gemma = model_type.startswith("gemma")
  act_name = c.raw("hidden_activation") or c.raw("hidden_act") or "silu"
  if gemma and act_name == "gelu":  # Gemma 1 configs say gelu but mean the tanh approximation
    act_name = "gelu_pytorch_tanh"
  if not isinstance(act_name, str) or act_name not in _ACTIVATIONS:
    raise ConfigError(
      f"hidden activation {act_name!r} in {c.source} is not supported for a {model_type}."
    )
  attention_bias = c.flag("attention_bias", False)
  fields = dict(
    model_type=model_type,
    vocab_size=c.count("vocab_size"),
    hidden_size=hidden,
    intermediate_size=c.count("intermediate_size"),
    num_layers=layers,
    num_heads=heads,
    num_kv_heads=c.count("num_key_value_heads", heads),
    head_dim=c.count("head_dim", hidden // heads),
    rms_norm_eps=c.number("rms_norm_eps", 1e-6, zero=True),
    max_position_embeddings=c.count("max_position_embeddings", 2048, high=_INT32),
    tie_word_embeddings=c.flag("tie_word_embeddings", gemma),
    hidden_act=_ACTIVATIONS[act_name],
    qkv_bias=attention_bias or model_type == "qwen2",
    o_bias=attention_bias,
    mlp_bias=c.flag("mlp_bias", False),
    qk_norm=model_type in ("qwen3", "gemma3_text"),
    norm_plus_one=gemma,
    embed_scale=gemma,
    sandwich_norms=model_type in ("gemma2", "gemma3_text"),
  )
  if model_type in MOE_MODEL_TYPES:
    fields.update(_moe_fields(c, layers))
  elif model_type.startswith("qwen") and c.flag("use_sliding_window", False):
    raise ConfigError(
      f"this {model_type} config enables use_sliding_window, which jaxtune does not support "
      "for Qwen; set it to false (the released Qwen checkpoints do)."
    )
  rope_params = c.mapping("rope_parameters")
  if model_type in ("gemma2", "gemma3_text"):
    pattern_key = "sliding_window_pattern"
    if not c.has(pattern_key) and c.has("_sliding_window_pattern"):
      pattern_key = "_sliding_window_pattern"
    pattern = c.count(pattern_key, 2, high=_INT32)
    default_types = [SLIDING if (i + 1) % pattern else FULL for i in range(layers)]
    layer_types = c.raw("layer_types") or default_types
    if (
      not isinstance(layer_types, list)
      or len(layer_types) != layers
      or not all(t in (SLIDING, FULL) for t in layer_types)
    ):
      raise c.wrong(
        "layer_types",
        f"a list of {FULL} or {SLIDING} for each of the {layers} layers",
        layer_types,
      )
    fields.update(
      query_pre_attn_scalar=c.number("query_pre_attn_scalar", fields["head_dim"]),
      attn_logit_softcap=c.number("attn_logit_softcapping", None),
      final_logit_softcap=c.number("final_logit_softcapping", None),
      layer_types=tuple(layer_types),
      sliding_window=c.count("sliding_window", high=_INT32),
    )
  if model_type == "gemma3_text" and rope_params.has(FULL):
    # transformers >= 5: one rope dict per layer type.
    fields["rope"] = _rope_from_hf(rope_params.mapping(FULL))
    fields["rope_local"] = _rope_from_hf(rope_params.mapping(SLIDING))
  elif model_type == "gemma3_text":
    fields["rope"] = _rope_from_hf(c)  # global layers: rope_theta and rope_scaling
    fields["rope_local"] = RopeConfig(theta=c.number("rope_local_base_freq", 10000.0))
  elif model_type == "gpt_oss" and not c.has("rope_parameters") and not c.has("rope_scaling"):
    fields["rope"] = RopeConfig(  # transformers' GptOssConfig default
      theta=c.number("rope_theta", 150000.0),
      kind="yarn",
      factor=32.0,
      original_max_position_embeddings=4096,
      truncate=False,
    )
  else:
    fields["rope"] = _rope_from_hf(c)
  return fields


def _moe_fields(c: _Fields, layers: int) -> dict[str, Any]:
  """A mixture of experts' settings (Qwen3-MoE, Mixtral, gpt-oss), each defaulted as
  transformers defaults it; an option jaxtune does not build refused by name."""
  model_type = c.model_type
  # Qwen3-MoE's own name is num_experts, the others' num_local_experts; transformers 5 writes
  # num_local_experts for all three (an attribute map), older checkpoints their own.
  experts_key = "num_local_experts" if c.has("num_local_experts") else "num_experts"
  defaults = {"qwen3_moe": (128, 8), "mixtral": (8, 2), "gpt_oss": (128, 4)}[model_type]
  experts = c.count(experts_key, defaults[0], high=1 << 20)
  top_k = c.count("num_experts_per_tok", defaults[1], high=experts)
  fields: dict[str, Any] = dict(
    num_experts=experts,
    num_experts_per_tok=top_k,
    router_aux_loss_coef=c.number("router_aux_loss_coef", 0.001, zero=True),
  )
  if model_type == "qwen3_moe":
    if c.raw("mlp_only_layers", []) != [] or c.count("decoder_sparse_step", 1) != 1:
      raise ConfigError(
        f"{c.source} mixes dense and sparse layers (mlp_only_layers "
        f"{json.dumps(c.raw('mlp_only_layers', []))[:40]}, decoder_sparse_step "
        f"{c.raw('decoder_sparse_step', 1)}); jaxtune builds Qwen3-MoE models whose every "
        "layer is sparse (the released ones: mlp_only_layers [] and decoder_sparse_step 1)."
      )
    fields.update(
      moe_intermediate_size=c.count("moe_intermediate_size", 768),
      norm_topk_prob=c.flag("norm_topk_prob", False),
      qk_norm=True,
    )
    if c.flag("use_sliding_window", False):  # every layer, as transformers' Qwen3-MoE does
      fields.update(
        layer_types=(SLIDING,) * layers, sliding_window=c.count("sliding_window", 4096, _INT32)
      )
  elif model_type == "mixtral":
    jitter = c.number("router_jitter_noise", 0.0, zero=True)
    if jitter:
      raise ConfigError(
        f"router_jitter_noise={jitter} in {c.source} is not supported (jaxtune's Mixtral "
        "routes without noise); set it to 0.0, as the released Mixtral checkpoints do."
      )
    fields.update(
      moe_intermediate_size=c.count("intermediate_size", 14336),
      norm_topk_prob=True,
      rms_norm_eps=c.number("rms_norm_eps", 1e-5, zero=True),
    )
    if c.has("sliding_window"):  # every layer, as transformers' Mixtral does
      window = c.count("sliding_window", high=_INT32)
      fields.update(layer_types=(SLIDING,) * layers, sliding_window=window)
  else:  # gpt_oss
    attention_bias = c.flag("attention_bias", True)
    default_types = [SLIDING if (i + 1) % 2 else FULL for i in range(layers)]
    layer_types = c.raw("layer_types") or default_types
    if (
      not isinstance(layer_types, list)
      or len(layer_types) != layers
      or not all(t in (SLIDING, FULL) for t in layer_types)
    ):
      raise c.wrong(
        "layer_types", f"a list of {FULL} or {SLIDING} for each of the {layers} layers", layer_types
      )
    fields.update(
      moe_intermediate_size=c.count("intermediate_size", 2880),
      router="topk_softmax",
      router_bias=True,
      expert_bias=True,
      expert_activation="swiglu_clamped",
      swiglu_alpha=c.number("swiglu_alpha", 1.702),
      swiglu_limit=c.number("swiglu_limit", 7.0),
      attention_sinks=True,
      norm_scale_f32=True,
      qkv_bias=attention_bias,
      o_bias=attention_bias,
      layer_types=tuple(layer_types),
      sliding_window=c.count("sliding_window", 128, high=_INT32),
      rms_norm_eps=c.number("rms_norm_eps", 1e-5, zero=True),
    )
  if SLIDING not in fields.get("layer_types", ()):
    fields.update(layer_types=(), sliding_window=None)
  return fields


def _rope_from_hf(c: _Fields) -> RopeConfig:
  # transformers >= 5 writes rope_parameters (theta inside); older checkpoints write
  # rope_theta at the top level and an optional rope_scaling dict ("type" or "rope_type").
  # Inside a per-layer-type dict (Gemma 3), ``c`` is that dict itself.
  if c.prefix:
    params = c
  else:
    name = "rope_parameters" if c.has("rope_parameters") else "rope_scaling"
    params = c.mapping(name)
    if name == "rope_parameters" and c.has("rope_scaling"):
      merged = {**c.mapping("rope_scaling").config, **params.config}
      params = _Fields(merged, c.source, c.model_type, params.prefix)
  default = _DEFAULT_THETA.get(c.model_type, 10000.0)  # transformers' config.default_theta
  theta = params.number("rope_theta", default if c.prefix else c.number("rope_theta", default))
  if params.number("partial_rotary_factor", 1.0) != 1.0:
    raise ConfigError(
      f"partial_rotary_factor={params.raw('partial_rotary_factor')} in {c.source} is not "
      f"supported for a {c.model_type}; jaxtune rotates the whole head dimension."
    )
  kind = params.raw("rope_type", params.raw("type", "default"))
  if kind == "default":
    return RopeConfig(theta=theta)
  if kind == "linear":
    return RopeConfig(theta=theta, kind="linear", factor=params.number("factor"))
  if kind == "llama3":
    return RopeConfig(
      theta=theta,
      kind="llama3",
      factor=params.number("factor"),
      low_freq_factor=params.number("low_freq_factor"),
      high_freq_factor=params.number("high_freq_factor"),
      original_max_position_embeddings=params.count(
        "original_max_position_embeddings", high=_INT32
      ),
    )
  if kind == "yarn":
    return RopeConfig(
      theta=theta,
      kind="yarn",
      factor=params.number("factor"),
      original_max_position_embeddings=params.count(
        "original_max_position_embeddings", high=_INT32
      ),
      beta_fast=params.number("beta_fast", 32.0),
      beta_slow=params.number("beta_slow", 1.0),
      truncate=params.flag("truncate", True),
      attention_factor=params.number("attention_factor", None),
      mscale=params.number("mscale", None, zero=True),
      mscale_all_dim=params.number("mscale_all_dim", None, zero=True),
    )
  raise ConfigError(
    f"rope scaling type {kind!r} in {c.source} is not supported; jaxtune supports default, "
    "linear, llama3 and yarn."
  )
