"""HF tensor names <-> jaxtune variables, one declarative table read in both directions.

An entry's ``hf`` template names a tensor of a transformers checkpoint; ``{layer}`` is a layer
index and ``{proj}`` one of the entry's projections. ``target`` is the module path inside the
jaxtune model (dots), with the same placeholders. ``kind`` says how values move:
  "linear": a Linear's frozen weight [out, in] (NF4-quantized on the way in when asked)
  "param":  a Param copied as is (norm weights, biases, embeddings)
Layouts are identical on both sides (weights stay [out, in]), so no transform is needed.
"""

import dataclasses
import re
from collections.abc import Iterator

ATTN_PROJ = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_PROJ = ("gate_proj", "up_proj", "down_proj")


@dataclasses.dataclass(frozen=True)
class Entry:
  hf: str
  target: str
  kind: str
  projs: tuple[str, ...] = ()

  @property
  def regex(self) -> re.Pattern:
    pattern = re.escape(self.hf).replace(r"\{layer\}", r"(?P<layer>\d+)")
    pattern = pattern.replace(r"\{proj\}", "(?P<proj>" + "|".join(self.projs) + ")")
    return re.compile(pattern + "$")


# One table for every family: an entry whose target a model lacks (q_norm on a Llama, say)
# is an error on the way in and skipped on the way out.
DECODER = (
  Entry("model.embed_tokens.weight", "embed_tokens.embedding", "param"),
  Entry("model.norm.weight", "norm.weight", "param"),
  Entry("lm_head.weight", "lm_head", "linear"),
  *(
    Entry(f"model.layers.{{layer}}.{norm}.weight", f"layers.{norm}.weight", "param")
    for norm in (
      "input_layernorm",
      "post_attention_layernorm",
      "pre_feedforward_layernorm",
      "post_feedforward_layernorm",
    )
  ),
  Entry(
    "model.layers.{layer}.self_attn.{proj}.weight", "layers.self_attn.{proj}", "linear", ATTN_PROJ
  ),
  Entry(
    "model.layers.{layer}.self_attn.{proj}.bias", "layers.self_attn.{proj}.bias", "param", ATTN_PROJ
  ),
  Entry(
    "model.layers.{layer}.self_attn.{proj}.weight",
    "layers.self_attn.{proj}.weight",
    "param",
    ("q_norm", "k_norm"),
  ),
  Entry("model.layers.{layer}.mlp.{proj}.weight", "layers.mlp.{proj}", "linear", MLP_PROJ),
  Entry("model.layers.{layer}.mlp.{proj}.bias", "layers.mlp.{proj}.bias", "param", MLP_PROJ),
)

TABLES = dict.fromkeys(("llama", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text"), DECODER)

# Tensors some checkpoints carry that hold nothing a model needs (recomputed buffers).
IGNORED = re.compile(r".*rotary_emb\.inv_freq$")


@dataclasses.dataclass(frozen=True)
class Match:
  entry: Entry
  target: tuple[str, ...]  # module path in the jaxtune model
  layer: int | None


def match(table: tuple[Entry, ...], name: str) -> Match | None:
  for entry in table:
    m = entry.regex.match(name)
    if m:
      groups = m.groupdict()
      target = entry.target.replace("{proj}", groups.get("proj") or "")
      layer = int(groups["layer"]) if groups.get("layer") is not None else None
      return Match(entry, tuple(target.split(".")), layer)
  return None


def hf_names(
  table: tuple[Entry, ...], num_layers: int
) -> Iterator[tuple[str, tuple[str, ...], int | None, Entry]]:
  """Every (hf name, target path, layer, entry) the table can produce, for export."""
  for entry in table:
    layers = range(num_layers) if "{layer}" in entry.hf else [None]
    projs = entry.projs or ("",)
    for layer in layers:
      for proj in projs:
        name = entry.hf.replace("{proj}", proj)
        if layer is not None:
          name = name.replace("{layer}", str(layer))
        target = tuple(entry.target.replace("{proj}", proj).split("."))
        yield name, target, layer, entry
