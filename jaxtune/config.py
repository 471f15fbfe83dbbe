"""The architecture of a model, read from a Hugging Face ``config.json``.

Runtime choices (mesh, remat, kernels, batch) never live here; see ``jaxtune.train``'s
RunConfig. This dataclass is frozen so it can be a static argument of jitted functions.
"""

import dataclasses
import json
from pathlib import Path
from typing import Any

SUPPORTED_MODEL_TYPES = ("llama",)


class ConfigError(ValueError):
  """A config.json that jaxtune cannot turn into a model; the message says why."""


@dataclasses.dataclass(frozen=True)
class RopeConfig:
  theta: float = 10000.0
  kind: str = "default"  # "default" or "llama3"
  factor: float = 1.0
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  original_max_position_embeddings: int = 8192


@dataclasses.dataclass(frozen=True)
class ModelConfig:
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
  hidden_act: str = "silu"
  attention_bias: bool = False
  mlp_bias: bool = False

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
    per_layer = sum(o * i for o, i in self.linear_shapes().values()) + 2 * self.hidden_size
    if self.attention_bias:
      per_layer += self.q_size + 2 * self.kv_size + self.hidden_size
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
    try:
      hidden = int(config["hidden_size"])
      heads = int(config["num_attention_heads"])
      kv_heads = int(config.get("num_key_value_heads") or heads)
      head_dim = int(config.get("head_dim") or hidden // heads)
      cfg = cls(
        model_type=model_type,
        vocab_size=int(config["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(config["intermediate_size"]),
        num_layers=int(config["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        rope=_rope_from_hf(config),
        max_position_embeddings=int(config.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        hidden_act=config.get("hidden_act", "silu"),
        attention_bias=bool(config.get("attention_bias", False)),
        mlp_bias=bool(config.get("mlp_bias", False)),
      )
    except KeyError as e:
      raise ConfigError(
        f"config.json lacks the key {e.args[0]!r} that a {model_type} needs."
      ) from e
    if heads % kv_heads:
      raise ConfigError(
        f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}."
      )
    if cfg.hidden_act not in ("silu", "swish"):
      raise ConfigError(
        f"hidden_act {cfg.hidden_act!r} is not supported for {model_type}; expected silu."
      )
    return cfg


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
    f"rope scaling type {kind!r} is not supported; jaxtune supports default and llama3."
  )
