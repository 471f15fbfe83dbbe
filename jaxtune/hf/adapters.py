"""A PEFT LoRA adapter directory -> a jaxtune model's adapters (``jaxtune.load_adapter``).

The directory is what ``peft``'s ``save_pretrained`` writes, or ``jaxtune.export_peft``:
adapter_config.json and adapter_model.safetensors. PEFT names each adapted projection by its
transformers name under ``base_model.model.`` and keeps one A [r, in] and one B [out, r] per
layer; jaxtune stacks the layers, A as [L, in, r] and B as [L, r, out]. Names go through the
one table the checkpoint loader reads (converters/table.py).

Everything about the adapter is checked (its settings, base model, names, ranks and shapes)
before the model is touched, so a refused adapter leaves the model as it was.
"""

import dataclasses
import json
import re
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import safe_open

from converters import table as tables
from converters.hub import hub_id
from converters.safetensors_read import iter_tensors
from jaxtune.errors import CheckpointError, ConfigError
from jaxtune.models.lora import LoraConfig, apply_lora, iter_linears
from jaxtune.run_config import INT32_MAX, shown

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
_PREFIX = "base_model.model."
# PEFT's file names drop the adapter's name ("default"); lm_head's own weight comes with it
# when lm_head is a target (PEFT saves "embedding layers" whole).
_TENSOR = re.compile(r"(?P<module>.+)\.(?:lora_(?P<ab>[AB])|(?P<base>base_layer))\.weight$")
# PEFT settings jaxtune has no counterpart for, with the value that means "not used".
_UNSUPPORTED = {
  "use_dora": "DoRA (use_dora)",
  "lora_bias": "trained LoRA biases (lora_bias)",
  "modules_to_save": "fully trained modules (modules_to_save)",
  "layers_to_transform": "adapters on some layers only (layers_to_transform)",
  "layer_replication": "replicated layers (layer_replication)",
  "trainable_token_indices": "trained token embeddings (trainable_token_indices)",
  "target_parameters": "adapters on parameters (target_parameters)",
  "fan_in_fan_out": "fan_in_fan_out weights",
}


@dataclasses.dataclass(frozen=True)
class AdapterConfig:
  """The LoRA settings of an adapter directory, as apply_lora takes them."""

  base: str | None  # base_model_name_or_path: a Hub id or a local directory
  rank: int
  alpha: float
  targets: tuple[str, ...]
  dropout: float
  rslora: bool
  rank_pattern: dict[str, int]  # PEFT's keys: suffixes (regexes) of module names
  alpha_pattern: dict[str, float]
  architecture: str | None  # the transformers class PEFT adapted, when recorded
  base_model_type: str | None = None  # config.json's model_type, where base is a local dir


def is_adapter_dir(path: str | Path) -> bool:
  return (Path(path) / CONFIG).is_file()


def read_config(adapter_dir: str | Path) -> AdapterConfig:
  """The adapter's LoRA settings, or one error sentence saying why jaxtune cannot load it."""
  d = Path(adapter_dir)
  if not is_adapter_dir(d):
    raise CheckpointError(f"{d} is not a PEFT adapter directory (it has no {CONFIG}).")
  if not (d / WEIGHTS).is_file():
    raise CheckpointError(
      f"{d} has no {WEIGHTS}; jaxtune reads adapters saved as safetensors (PEFT's default)."
    )
  try:
    cfg = json.loads((d / CONFIG).read_text())
    if not isinstance(cfg, dict):
      raise ValueError("not a mapping")
  except ValueError as e:
    raise CheckpointError(f"{d / CONFIG} is not a valid adapter config ({e}).") from e
  peft_type = cfg.get("peft_type", "LORA")
  if peft_type != "LORA":
    kind = peft_type if isinstance(peft_type, str) else shown(peft_type)
    raise ConfigError(f"{d} holds a {kind[:40]} adapter; jaxtune loads LoRA adapters only.")
  for key, what in _UNSUPPORTED.items():
    if cfg.get(key) not in (None, False, [], {}):
      raise ConfigError(f"{d} uses {what}, which jaxtune's LoRA does not support.")
  if cfg.get("bias", "none") != "none":
    raise ConfigError(
      f"{d} trains biases (bias={shown(cfg['bias'])}), which jaxtune does not support."
    )
  path = d / CONFIG
  targets = cfg.get("target_modules")
  if isinstance(targets, list) and not all(isinstance(t, str) and t for t in targets):
    raise CheckpointError(_wrong(path, "target_modules", targets, "a list of module names"))
  if not isinstance(targets, list):  # a regex or "all-linear": read what the file adapts
    targets = sorted({_leaf(m) for m, ab in _tensor_modules(d) if ab})
  for key in ("r", "lora_alpha"):
    if key not in cfg:
      raise CheckpointError(
        f"{path} has no {key}; save the adapter again (peft's save_pretrained writes it)."
      )
  base = cfg.get("base_model_name_or_path") or None
  if base is not None and not isinstance(base, str):
    raise CheckpointError(_wrong(path, "base_model_name_or_path", base, "a Hub id or a path"))
  rslora = cfg.get("use_rslora") or False
  if not isinstance(rslora, bool):
    raise CheckpointError(_wrong(path, "use_rslora", rslora, "true or false"))
  mapping = cfg.get("auto_mapping") or {}
  return AdapterConfig(
    base=base,
    rank=_checked(path, "r", cfg["r"], _RANK),
    alpha=_checked(path, "lora_alpha", cfg["lora_alpha"], _ALPHA),
    targets=tuple(targets),
    dropout=_checked(path, "lora_dropout", cfg.get("lora_dropout") or 0.0, _DROPOUT),
    rslora=rslora,
    rank_pattern=_pattern(path, cfg, "rank_pattern", _RANK),
    alpha_pattern=_pattern(path, cfg, "alpha_pattern", _ALPHA),
    architecture=mapping.get("base_model_class") if isinstance(mapping, dict) else None,
    base_model_type=_base_model_type(d, base),
  )


# What each number of adapter_config.json must be: (test, what the sentence says, type).
_RANK = (lambda v: 1 <= v <= INT32_MAX, f"a whole number from 1 to {INT32_MAX}", int)
_ALPHA = (lambda v: v > 0, "a finite number greater than 0", float)
_DROPOUT = (lambda v: 0 <= v < 1, "a number from 0 to below 1", float)


def _json(value: Any) -> str:
  """A value of the JSON file as JSON writes it (null, "text"), cut short."""
  if isinstance(value, str):
    return json.dumps(value if len(value) <= 50 else value[:47] + "...")
  if (
    value is None
    or isinstance(value, bool | float)
    or (isinstance(value, int) and abs(value) < 10**50)
  ):
    return json.dumps(value)
  return shown(value)  # a list or mapping (or a huge number) in Python's spelling, cut short


def _wrong(path: Path, key: str, value: Any, want: str) -> str:
  return (
    f"{path} sets {key} to {_json(value)}, but it must be {want}; fix it, or save the adapter "
    "again."
  )


def _checked(path: Path, key: str, value: Any, rule: tuple) -> int | float:
  """``value`` of ``key`` as the rule's type, or the sentence saying what it must be (PEFT
  itself would fail later, or train with a string where a number belongs)."""
  ok, want, kind = rule
  number = value if isinstance(value, int | float) and not isinstance(value, bool) else None
  if kind is int and isinstance(number, float):
    number = int(number) if number.is_integer() else None  # (False for inf and nan)
  elif kind is float and number is not None:
    number = float(number) if abs(number) < 1e308 else None  # (False for nan; no overflow)
  if number is None or not ok(number):
    raise CheckpointError(_wrong(path, key, value, want))
  return number


def _pattern(path: Path, cfg: dict, key: str, rule: tuple) -> dict[str, int | float]:
  """PEFT's rank_pattern / alpha_pattern: regular expressions of module names -> values."""
  pattern = cfg.get(key) or {}
  if not isinstance(pattern, dict):
    raise CheckpointError(_wrong(path, key, pattern, 'a mapping such as {"down_proj": 8}'))
  out = {}
  for name, value in pattern.items():
    try:
      re.compile(name)
    except re.error as e:
      raise CheckpointError(
        f"{path} has the {key} key {_json(name)}, which is not a regular expression ({e}); "
        "fix it, or save the adapter again."
      ) from e
    out[name] = _checked(path, f"{key}[{_json(name)}]", value, rule)
  return out


def _base_model_type(d: Path, base: str | None) -> str | None:
  """The model_type in the config.json of the adapter's base model, where that is a local
  directory (None for a Hub id), read now so that a damaged one is refused before a model
  loads."""
  config_json = Path(base or "") / "config.json"
  if not base or not config_json.is_file():
    return None
  try:
    config = json.loads(config_json.read_text())
  except (OSError, ValueError) as e:  # JSONDecodeError, or UnicodeDecodeError: not text
    what = (
      f"cannot be read ({e.strerror or type(e).__name__})"
      if isinstance(e, OSError)
      else f"is not valid JSON ({e})"
    )
    raise ConfigError(
      f"{d} names the base model {base}, whose config.json {what}; re-download that "
      f"checkpoint, or set base_model_name_or_path in its {CONFIG} to the base model's "
      "directory or Hub id."
    ) from e
  model_type = config.get("model_type") if isinstance(config, dict) else None
  return model_type if isinstance(model_type, str) else None


def lora_settings(adapter_dir: str | Path, model_path: str | Path | None = None) -> dict[str, Any]:
  """The run settings (RunConfig names) an adapter fixes, for continuing to train it; with
  ``model_path``, also refuses an adapter made for another base model."""
  cfg = read_config(adapter_dir)
  mcfg = None
  if model_path is not None:
    from jaxtune.models.config import ModelConfig

    _check_base(cfg, adapter_dir, hub_id(model_path), str(model_path))
    mcfg = ModelConfig.from_hf(model_path)  # (refused before the model loads, not after)
    _check_base_type(cfg, Path(adapter_dir), mcfg.model_type)
  settings = dict(
    lora_rank=cfg.rank,
    lora_alpha=cfg.alpha,
    lora_targets=cfg.targets,
    lora_dropout=cfg.dropout,
    rslora=cfg.rslora,
    lora_rank_pattern=None,
    lora_alpha_pattern=None,
  )
  if mcfg is not None and (cfg.rank_pattern or cfg.alpha_pattern):
    ranks, alphas = _patterns(cfg, mcfg)
    spec = lambda p: ",".join(f"{k}={v}" for k, v in p.items()) or None  # noqa: E731
    settings.update(lora_rank_pattern=spec(ranks), lora_alpha_pattern=spec(alphas))
  return settings


def _peft_value(pattern: dict[str, float], module: str, default: float) -> float:
  """A PEFT pattern's value for a module name: the first key that matches a suffix of it
  (PEFT's own rule, peft.utils.other.get_pattern_key)."""
  for key, value in pattern.items():
    if re.match(rf"(.*\.)?({key})$", module):
      return value
  return default


def _patterns(cfg: AdapterConfig, mcfg: Any) -> tuple[dict[str, int], dict[str, float]]:
  """PEFT's rank_pattern / alpha_pattern as jaxtune's (lora.py keys: ``proj`` where all its
  layers agree, else ``layers.N.proj``), for the adapted projections."""
  per = {"rank": {}, "alpha": {}}
  table = tables.TABLES[mcfg.model_type]
  for name, target, layer, entry in tables.hf_names(table, mcfg.num_layers):
    proj = target[-1]
    if entry.kind != "linear" or proj not in cfg.targets:
      continue
    module = name.removesuffix(".weight")
    per["rank"].setdefault(proj, {})[layer] = int(_peft_value(cfg.rank_pattern, module, cfg.rank))
    per["alpha"].setdefault(proj, {})[layer] = float(
      _peft_value(cfg.alpha_pattern, module, cfg.alpha)
    )
  out = []
  for kind, default in (("rank", cfg.rank), ("alpha", cfg.alpha)):
    pattern = {}
    for proj, values in per[kind].items():
      if len(set(values.values())) == 1:
        (value,) = set(values.values())
        if value != default:
          pattern[proj] = value
      else:
        pattern.update({f"layers.{x}.{proj}": v for x, v in values.items() if v != default})
    out.append(pattern)
  return out[0], out[1]


def load_adapter(model: nnx.Module, adapter_dir: str | Path) -> nnx.Module:
  """Add the adapter of ``adapter_dir`` (PEFT's or jaxtune's export) to ``model``, a model
  fresh from ``from_pretrained``; returns the same model."""
  d = Path(adapter_dir)
  cfg = read_config(d)
  if model.lora_config is not None:
    raise ConfigError(
      "this model already has LoRA adapters; load the adapter into a model fresh from "
      "jaxtune.from_pretrained."
    )
  mcfg = model.config
  _check_base(cfg, d, model.provenance.hub_id, model.provenance.checkpoint_dir)
  _check_architecture(cfg, d, model)
  linears = {path[-1]: linear for path, linear in iter_linears(model)}
  unknown = [t for t in cfg.targets if t not in linears]
  if unknown:
    tied = mcfg.tie_word_embeddings and "lm_head" in unknown
    tied = " (this model's output layer is its tied input embedding)" if tied else ""
    raise ConfigError(
      f"{d} adapts {', '.join(unknown)}, which this {mcfg.model_type} model does not have as "
      f"linear layers{tied}; jaxtune adapts {', '.join(linears)}."
    )

  ranks, alphas = _patterns(cfg, mcfg)
  lora = LoraConfig(cfg.rank, cfg.alpha, cfg.targets, rank_pattern=tuple(ranks.items()))
  a, b, head_weight = _read_weights(cfg, lora, d, model, linears)
  apply_lora(
    model,
    rank=cfg.rank,
    alpha=cfg.alpha,
    targets=cfg.targets,
    dropout=cfg.dropout,
    rslora=cfg.rslora,
    rank_pattern=ranks,
    alpha_pattern=alphas,
  )
  for proj in cfg.targets:
    linears[proj].lora_a[...] = jnp.asarray(a[proj], jnp.float32)
    linears[proj].lora_b[...] = jnp.asarray(b[proj], jnp.float32)
  if head_weight is not None:
    head = linears["lm_head"]
    head.weight[...] = jnp.asarray(head_weight, head.weight[...].dtype)
  return model


def _read_weights(
  cfg: AdapterConfig, lora: LoraConfig, d: Path, model: nnx.Module, linears: dict
) -> tuple:
  """({proj: A [L, in, R] or [in, r]}, {proj: B [L, R, out] or [r, out]}, lm_head's weight
  when the file holds it), every name, rank and shape checked; layers of lower rank than the
  projection's largest R padded with zeros (lora.py masks those columns)."""
  mcfg = model.config
  table = tables.TABLES[mcfg.model_type]
  parts: dict[tuple[str, str], dict[int | None, np.ndarray]] = {}
  head_weight = None
  for name, _, tensor in iter_tensors([d / WEIGHTS]):
    m = _TENSOR.match(name)
    if m is None:
      raise ConfigError(f"{d} holds {name}, which is no LoRA A or B weight that jaxtune loads.")
    hf = m["module"].removeprefix(_PREFIX) + ".weight"
    found = tables.match(table, hf) if name.startswith(_PREFIX) else None
    if found is None or found.entry.kind != "linear":
      raise ConfigError(
        f"{d} holds {name}, which names no projection of a {mcfg.model_type} model; the "
        "adapter is for another architecture."
      )
    proj, layer = found.target[-1], found.layer
    if proj not in cfg.targets:
      raise ConfigError(f"{d} holds {name}, but its target_modules do not list {proj}.")
    if layer is not None and layer >= mcfg.num_layers:
      raise ConfigError(
        f"{d} holds {name} for layer {layer}, but this model has {mcfg.num_layers} layers; "
        "the adapter is for another model."
      )
    linear, value = linears[proj], np.asarray(tensor, np.float32)
    out, inp, r = linear.out_features, linear.in_features, lora.rank_of(proj, layer)
    if m["base"]:
      if proj != "lm_head":
        raise ConfigError(f"{d} holds {name}, a whole base weight jaxtune does not replace.")
      _check_shape(d, name, value.shape, (out, inp))
      head_weight = value  # PEFT saves lm_head whole and puts it in place on loading
      continue
    rank = value.shape[0] if m["ab"] == "A" else value.shape[-1]
    if value.ndim == 2 and rank != r:
      raise ConfigError(
        f"{d} holds {name} of rank {rank}, but its {CONFIG} gives {proj} rank {r}; the "
        "config and the weights disagree."
      )
    _check_shape(d, name, value.shape, (r, inp) if m["ab"] == "A" else (out, r))
    parts.setdefault((proj, m["ab"]), {})[layer] = value.T  # A: [in, r], B: [r, out]

  stacked = {"A": {}, "B": {}}
  for proj in cfg.targets:
    layers = [None] if linears[proj].layers is None else list(range(linears[proj].layers))
    for ab in ("A", "B"):
      got = parts.get((proj, ab), {})
      missing = [str(x) for x in layers if x not in got]
      if missing:
        which = "" if layers == [None] else f" of layer(s) {', '.join(missing)}"
        raise CheckpointError(
          f"{d} lacks the lora_{ab} weights of {proj}{which}; it is incomplete."
        )
      if layers == [None]:
        stacked[ab][proj] = got[None]
        continue
      top = max(lora.rank_of(proj, x) for x in layers)
      pad = lambda v, ab=ab, top=top: (  # noqa: E731
        np.pad(v, [(0, 0), (0, top - v.shape[1])])
        if ab == "A"
        else np.pad(v, [(0, top - v.shape[0]), (0, 0)])
      )
      stacked[ab][proj] = np.stack([pad(got[x]) for x in layers])
  return stacked["A"], stacked["B"], head_weight


def _leaf(module: str) -> str:
  return module.rsplit(".", 1)[-1]


def _tensor_modules(d: Path) -> list[tuple[str, str | None]]:
  """(module name, "A"/"B" or None) of every tensor in the adapter file, read from its header."""
  try:
    with safe_open(str(d / WEIGHTS), framework="numpy") as f:
      names = list(f.keys())
  except Exception as e:  # safetensors raises its own error types for a damaged header
    raise CheckpointError(f"{d / WEIGHTS} is not a readable safetensors file ({e}).") from e
  return [(m["module"], m["ab"]) for m in map(_TENSOR.match, names) if m]


def _check_base(cfg: AdapterConfig, d: Path, model_id: str | None, model_dir: str | None) -> None:
  """Refuse an adapter whose base model is known to differ (compared by Hub id, where both
  have one: local directories may hold the same model under any name)."""
  adapter_id = hub_id(cfg.base) if cfg.base else None
  if adapter_id and model_id and adapter_id.lower() != model_id.lower():
    raise ConfigError(
      f"{d} is an adapter for {adapter_id}, but the model loaded is {model_id} ({model_dir}); "
      f"load {adapter_id}, or use an adapter made for {model_id}."
    )


def _check_architecture(cfg: AdapterConfig, d: Path, model: nnx.Module) -> None:
  """Refuse an adapter whose recorded transformers class (PEFT records it when the task type
  is unset), or whose local base model's model_type, is not the model's."""
  config_json = model.provenance.file("config.json")
  if cfg.architecture is not None and config_json is not None and config_json.is_file():
    architectures = json.loads(config_json.read_text()).get("architectures") or []
    if architectures and cfg.architecture not in architectures:
      raise ConfigError(
        f"{d} is an adapter for a {cfg.architecture}, but the model is a "
        f"{', '.join(architectures)}; load the base model the adapter was made for."
      )
  _check_base_type(cfg, d, model.config.model_type)


def _check_base_type(cfg: AdapterConfig, d: Path, model_type: str) -> None:
  """Refuse an adapter whose local base model is of another model_type."""
  if cfg.base_model_type and cfg.base_model_type != model_type:
    raise ConfigError(
      f"{d} is an adapter for {cfg.base}, a {cfg.base_model_type} model, but the model is a "
      f"{model_type}; load the base model the adapter was made for."
    )


def _check_shape(d: Path, name: str, got: tuple, want: tuple) -> None:
  if tuple(got) != tuple(want):
    raise ConfigError(
      f"{d} holds {name} of shape {list(got)}, but this model needs {list(want)}; the adapter "
      "is for a model of another size."
    )


__all__ = ["AdapterConfig", "is_adapter_dir", "load_adapter", "lora_settings", "read_config"]
