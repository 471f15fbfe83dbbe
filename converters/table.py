"""HF tensor names <-> jaxtune variables, one declarative table read in both directions.

An entry's ``hf`` template names a tensor of a transformers checkpoint; ``{layer}`` is a layer
index and ``{proj}`` one of the entry's projections. ``target`` is the module path inside the
jaxtune model (dots), with the same placeholders. ``kind`` says how values move:
  "linear": a Linear's frozen weight [out, in] (NF4-quantized on the way in when asked)
  "param":  a Param copied as is (norm weights, biases, embeddings)
Layouts are identical on both sides (weights stay [out, in]), so no transform is needed, except
for a mixture of experts' (``{expert}``: an expert index):
  "expert": one expert's projection [out, in], into the stacked [layers, experts, ...] one
  "experts_gate_up": gpt-oss's every expert's gate and up projections in one tensor
            [experts, in, 2 * out], input-major, gate in the even columns and up in the odd
  "experts_t": every expert's projection input-major [experts, in, out] (gpt-oss's down)
  "experts_gate_up_bias": [experts, 2 * out], gate's bias in the even columns, up's in the odd
  "mxfp4_gate_up_proj", "mxfp4_down_proj": gpt-oss's MXFP4 experts, each weight two tensors
            (``_blocks``, ``_scales``) dequantized together when both have come
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
    pattern = pattern.replace(r"\{expert\}", r"(?P<expert>\d+)")
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

_ATTENTION = tuple(e for e in DECODER if ".mlp." not in e.hf)
_EXPERTS = "layers.mlp.experts"
QWEN3_MOE = (
  *_ATTENTION,
  Entry("model.layers.{layer}.mlp.gate.weight", "layers.mlp.router.weight", "param"),
  Entry(
    "model.layers.{layer}.mlp.experts.{expert}.{proj}.weight",
    f"{_EXPERTS}.{{proj}}",
    "expert",
    MLP_PROJ,
  ),
)
_MIXTRAL_EXPERT = "model.layers.{layer}.block_sparse_moe.experts.{expert}"
MIXTRAL = (
  *_ATTENTION,
  Entry("model.layers.{layer}.block_sparse_moe.gate.weight", "layers.mlp.router.weight", "param"),
  *(
    Entry(f"{_MIXTRAL_EXPERT}.{w}.weight", target, "expert")
    for w, target in (
      ("w1", f"{_EXPERTS}.gate_proj"),
      ("w3", f"{_EXPERTS}.up_proj"),
      ("w2", f"{_EXPERTS}.down_proj"),
    )
  ),
)
GPT_OSS = (
  *_ATTENTION,
  Entry("model.layers.{layer}.self_attn.sinks", "layers.self_attn.sinks", "param"),
  Entry("model.layers.{layer}.mlp.router.weight", "layers.mlp.router.weight", "param"),
  Entry("model.layers.{layer}.mlp.router.bias", "layers.mlp.router.bias", "param"),
  Entry("model.layers.{layer}.mlp.experts.gate_up_proj", _EXPERTS, "experts_gate_up"),
  Entry("model.layers.{layer}.mlp.experts.gate_up_proj_bias", _EXPERTS, "experts_gate_up_bias"),
  Entry("model.layers.{layer}.mlp.experts.down_proj", f"{_EXPERTS}.down_proj", "experts_t"),
  Entry("model.layers.{layer}.mlp.experts.down_proj_bias", f"{_EXPERTS}.down_proj.bias", "param"),
  # The released checkpoints' experts in MXFP4 (pallas_kernels/mxfp4.py): [E, out, in / 32, 16]
  # codes and [E, out, in / 32] scales, gate and up rows interleaved; read only.
  *(
    Entry(f"model.layers.{{layer}}.mlp.experts.{proj}_{part}", target, f"mxfp4_{proj}")
    for proj, target in (("gate_up_proj", _EXPERTS), ("down_proj", f"{_EXPERTS}.down_proj"))
    for part in ("blocks", "scales")
  ),
)

TABLES = {
  **dict.fromkeys(("llama", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text"), DECODER),
  "qwen3_moe": QWEN3_MOE,
  "mixtral": MIXTRAL,
  "gpt_oss": GPT_OSS,
}

# Tensors some checkpoints carry that hold nothing a model needs (recomputed buffers).
IGNORED = re.compile(r".*rotary_emb\.inv_freq$")


@dataclasses.dataclass(frozen=True)
class Match:
  entry: Entry
  target: tuple[str, ...]  # module path in the jaxtune model
  layer: int | None
  expert: int | None = None


def match(table: tuple[Entry, ...], name: str) -> Match | None:
  for entry in table:
    m = entry.regex.match(name)
    if m:
      groups = m.groupdict()
      target = entry.target.replace("{proj}", groups.get("proj") or "")
      layer = int(groups["layer"]) if groups.get("layer") is not None else None
      expert = int(groups["expert"]) if groups.get("expert") is not None else None
      return Match(entry, tuple(target.split(".")), layer, expert)
  return None


def hf_names(
  table: tuple[Entry, ...], num_layers: int, num_experts: int = 0
) -> Iterator[tuple[str, tuple[str, ...], int | tuple[int, int] | None, Entry]]:
  """Every (hf name, target path, layer, entry) the table can produce, for export. ``layer``
  is (layer, expert) for one expert's tensor."""
  for entry in table:
    layers = range(num_layers) if "{layer}" in entry.hf else [None]
    experts = range(num_experts) if "{expert}" in entry.hf else [None]
    for layer in layers:
      for expert in experts:
        for proj in entry.projs or ("",):
          name = entry.hf.replace("{proj}", proj)
          if layer is not None:
            name = name.replace("{layer}", str(layer))
          if expert is not None:
            name = name.replace("{expert}", str(expert))
          target = tuple(entry.target.replace("{proj}", proj).split("."))
          yield name, target, layer if expert is None else (layer, expert), entry
