"""GGUF export: read back with gguf-py, loaded by transformers, against jaxtune's merged model.

Each family's tiny checkpoint carries the built-in byte-level BPE tokenizer (or a
SentencePiece-style one, as Gemma and Llama 2 have) and NF4 base weights with a LoRA whose B is
non-zero, so a file without the update (or with a wrong name, layout, norm convention or
permutation) gives other logits. transformers' GGUF loader has no
Gemma 1 ("gemma"), and reads neither head_dim for Qwen3 nor Gemma 2/3's softcaps, window,
query scale or per-layer rope from the metadata: those files are loaded with the checkpoint's
config.json (the weights still come from the GGUF), their metadata checked here with the
reader, and Gemma 1's tensors compared one by one with export_merged's.
"""

import json
import math
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from conftest import family_config
from safetensors.numpy import load_file

import jaxtune
from jaxtune.errors import ExportError
from jaxtune.hf import export
from jaxtune.hf.gguf import GGUF_TYPES, export_gguf, gguf_file_name
from jaxtune.run_config import CHOICES, RunConfig

gguf = pytest.importorskip("gguf")

VOCAB = 512  # the built-in tokenizer's
LOADS_IN_TRANSFORMERS = ["llama", "qwen2", "qwen3", "gemma2", "gemma3"]


def _hf_config(family, **overrides):
  """Fewer layers than test_families' (two: one sliding, one full for Gemma 3), the built-in
  tokenizer's vocabulary, no final softcap on Gemma 3."""
  own = dict(vocab_size=VOCAB, num_hidden_layers=2)
  if family == "gemma3":
    own.update(layer_types=["sliding_attention", "full_attention"], final_logit_softcapping=None)
  return family_config(family, **{**own, **overrides})


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
  from jaxtune.run.default_model import _write_tokenizer

  out = tmp_path_factory.mktemp("tokenizer")
  _write_tokenizer(out)
  return out


# A SentencePiece-style tokenizer as transformers stores Gemma's and Llama 2's: Gemma's first
# ids, the 256 byte tokens, BPE pieces trained on the built-in data, and a run of spaces that is
# an added token but not a special one (Gemma has such runs). Fewer tokens than VOCAB, so the
# last embedding rows have no token.
SP_SPECIAL = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
SP_BYTES = [f"<0x{b:02X}>" for b in range(256)]
SP_USER_DEFINED = "\u2581" * 4
SP_TEMPLATE = (
  "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m['role'] }}\n{{ m['content'] }}"
  "<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


def _write_sentencepiece_tokenizer(out, style):
  """style "gemma": spaces become "▁" in the normalizer and none goes first (Gemma's
  tokenizer.json); "llama": a Metaspace pre-tokenizer that puts one first (Llama 2's, Mistral's)."""
  from tokenizers import (
    AddedToken,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
  )
  from transformers import PreTrainedTokenizerFast

  from jaxtune.run.default_model import DATASET

  texts = [
    m["content"] for row in DATASET.read_text().splitlines() for m in json.loads(row)["messages"]
  ]
  pieces = Tokenizer(models.BPE())
  pieces.pre_tokenizer = pre_tokenizers.Metaspace("\u2581", prepend_scheme="always")
  pieces.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=220, show_progress=False))
  trained = json.loads(pieces.to_str())["model"]
  vocab = {t: i for i, t in enumerate(SP_SPECIAL + SP_BYTES)}
  for piece in sorted(trained["vocab"], key=trained["vocab"].get):
    vocab.setdefault(piece, len(vocab))
  vocab[SP_USER_DEFINED] = len(vocab)
  merges = [tuple(m) for m in trained["merges"]]
  tok = Tokenizer(
    models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True)
  )
  decode = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
  if style == "gemma":
    tok.normalizer = normalizers.Replace(" ", "\u2581")
    tok.pre_tokenizer = pre_tokenizers.Split(" ", "merged_with_previous")
  else:
    tok.pre_tokenizer = pre_tokenizers.Metaspace("\u2581", prepend_scheme="first", split=False)
    decode.append(decoders.Strip(" ", 1, 0))
  tok.decoder = decoders.Sequence(decode)
  tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SP_SPECIAL])
  tok.add_tokens([AddedToken(SP_USER_DEFINED, special=False, normalized=False)])
  tok.post_processor = processors.TemplateProcessing(
    single="<bos> $A", pair="<bos> $A <bos> $B", special_tokens=[("<bos>", vocab["<bos>"])]
  )
  fast = PreTrainedTokenizerFast(
    tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", unk_token="<unk>", pad_token="<pad>"
  )
  fast.chat_template = SP_TEMPLATE
  fast.save_pretrained(out)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, tokenizer_dir):
  """Factory: a tiny HF checkpoint of a family (norms perturbed), with a tokenizer: the
  built-in byte-level one ("bpe"), a SentencePiece-style one ("gemma" or "llama" style) or
  none."""
  made = {}

  def make(family, tokenizer="bpe", **overrides):
    from transformers import AutoModelForCausalLM

    key = (family, tokenizer, json.dumps(overrides, sort_keys=True))
    if key not in made:
      torch.manual_seed(0)
      hf = AutoModelForCausalLM.from_config(_hf_config(family, **overrides)).float().eval()
      with torch.no_grad():
        for name, p in hf.named_parameters():
          if name.endswith("norm.weight") or name.endswith(".bias"):
            p.add_(0.3 * torch.randn_like(p))
      out = tmp_path_factory.mktemp(family)
      hf.save_pretrained(out)
      if tokenizer == "bpe":
        for f in tokenizer_dir.iterdir():
          shutil.copy(f, out / f.name)
      elif tokenizer is not None:
        _write_sentencepiece_tokenizer(out, tokenizer)
      made[key] = out
    return made[key]

  return make


@pytest.fixture(scope="module")
def trained(checkpoint):
  """Factory: the family's checkpoint in NF4 with rank-4 LoRA on every projection, B random."""
  made = {}

  def make(family, tokenizer="bpe"):
    if (family, tokenizer) not in made:
      path = checkpoint(family, tokenizer)
      model = jaxtune.from_pretrained(path, quantization="nf4", dtype="float32")
      model = jaxtune.apply_lora(model, rank=4, alpha=8)
      rng = np.random.default_rng(1)
      for _, linear in jaxtune.models.lora.iter_linears(model):
        if linear.lora_b is not None:
          b = 0.05 * rng.standard_normal(linear.lora_b[...].shape)
          linear.lora_b[...] = jnp.asarray(b, jnp.float32)
      made[family, tokenizer] = model
    return made[family, tokenizer]

  return make


def _ids(length=16):
  return np.random.default_rng(0).integers(0, VOCAB, (2, length))


def _field(reader, key):
  return reader.fields[key].contents()


def _expected_tensors(cfg, arch) -> dict[str, tuple[int, ...]]:
  """GGUF name -> shape in gguf-py's reader order (row size first), written out by hand."""
  d, f, q, kv, hd = cfg.hidden_size, cfg.intermediate_size, cfg.q_size, cfg.kv_size, cfg.head_dim
  out = {"token_embd.weight": (d, cfg.vocab_size), "output_norm.weight": (d,)}
  if not cfg.tie_word_embeddings:
    out["output.weight"] = (d, cfg.vocab_size)
  for i in range(cfg.num_layers):
    b = f"blk.{i}."
    out |= {
      b + "attn_norm.weight": (d,),
      b + "ffn_norm.weight": (d,),
      b + "attn_q.weight": (d, q),
      b + "attn_k.weight": (d, kv),
      b + "attn_v.weight": (d, kv),
      b + "attn_output.weight": (q, d),
      b + "ffn_gate.weight": (d, f),
      b + "ffn_up.weight": (d, f),
      b + "ffn_down.weight": (f, d),
    }
    if arch in ("gemma2", "gemma3"):
      out |= {b + "post_attention_norm.weight": (d,), b + "post_ffw_norm.weight": (d,)}
    if arch in ("qwen3", "gemma3"):
      out |= {b + "attn_q_norm.weight": (hd,), b + "attn_k_norm.weight": (hd,)}
    if arch == "qwen2":
      out |= {b + "attn_q.bias": (q,), b + "attn_k.bias": (kv,), b + "attn_v.bias": (kv,)}
  return out


# HF name of each GGUF tensor (by its suffix after blk.N.), for the tensor-by-tensor check.
_HF_NAMES = {
  "attn_norm.weight": "input_layernorm.weight",
  "attn_q.weight": "self_attn.q_proj.weight",
  "attn_k.weight": "self_attn.k_proj.weight",
  "attn_v.weight": "self_attn.v_proj.weight",
  "attn_output.weight": "self_attn.o_proj.weight",
  "attn_q.bias": "self_attn.q_proj.bias",
  "attn_k.bias": "self_attn.k_proj.bias",
  "attn_v.bias": "self_attn.v_proj.bias",
  "attn_q_norm.weight": "self_attn.q_norm.weight",
  "attn_k_norm.weight": "self_attn.k_norm.weight",
  "ffn_gate.weight": "mlp.gate_proj.weight",
  "ffn_up.weight": "mlp.up_proj.weight",
  "ffn_down.weight": "mlp.down_proj.weight",
  "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}


def _hf_name(name, arch):
  if not name.startswith("blk."):
    return {
      "token_embd.weight": "model.embed_tokens.weight",
      "output_norm.weight": "model.norm.weight",
      "output.weight": "lm_head.weight",
    }[name]
  _, layer, rest = name.split(".", 2)
  sandwich = arch in ("gemma2", "gemma3")
  names = _HF_NAMES | {
    "ffn_norm.weight": "pre_feedforward_layernorm.weight"
    if sandwich
    else "post_attention_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
  }
  return f"model.layers.{layer}.{names[rest]}"


def _check_file(path, model, arch):
  """Names, shapes, types and metadata of the file against the model's config."""
  cfg = model.config
  reader = gguf.GGUFReader(path)
  got = {t.name: tuple(int(n) for n in t.shape) for t in reader.tensors}
  assert got == _expected_tensors(cfg, arch)
  assert _field(reader, "general.architecture") == arch
  for key, want in [
    ("block_count", cfg.num_layers),
    ("context_length", cfg.max_position_embeddings),
    ("embedding_length", cfg.hidden_size),
    ("feed_forward_length", cfg.intermediate_size),
    ("attention.head_count", cfg.num_heads),
    ("attention.head_count_kv", cfg.num_kv_heads),
    ("attention.key_length", cfg.head_dim),
    ("attention.value_length", cfg.head_dim),
  ]:
    assert _field(reader, f"{arch}.{key}") == want, key
  assert _field(reader, f"{arch}.attention.layer_norm_rms_epsilon") == pytest.approx(1e-6)
  assert _field(reader, f"{arch}.rope.freq_base") == cfg.rope.theta
  tokens = _field(reader, "tokenizer.ggml.tokens")
  assert len(tokens) == VOCAB and _field(reader, "tokenizer.ggml.model") == "gpt2"
  assert tokens[_field(reader, "tokenizer.ggml.bos_token_id")] == "<|bos|>"
  assert tokens[_field(reader, "tokenizer.ggml.eos_token_id")] == "<|eos|>"
  assert "<|assistant|>" in _field(reader, "tokenizer.chat_template")
  assert len(_field(reader, "tokenizer.ggml.merges")) > 100
  return reader


def _check_tensors(reader, model, arch, tmp_path, rtol):
  """Every tensor, dequantized and its transform undone, against export_merged's float32."""
  cfg = model.config
  merged = load_file(
    jaxtune.export_merged(model, tmp_path / "merged", dtype="float32") / "model.safetensors"
  )
  for t in reader.tensors:
    got = gguf.quants.dequantize(t.data, t.tensor_type).reshape(tuple(reversed(t.shape)))
    if arch.startswith("gemma") and t.name.endswith("norm.weight"):
      got = got - 1.0
    if arch == "llama" and (".attn_q." in t.name or ".attn_k." in t.name):
      heads = cfg.num_heads if ".attn_q." in t.name else cfg.num_kv_heads
      got = got.reshape(heads, -1, 2, *got.shape[1:]).swapaxes(1, 2).reshape(got.shape)
    want = merged[_hf_name(t.name, arch)]
    assert np.abs(got - want).max() <= rtol * np.abs(want).max(), t.name


def _transformers_logits(path, checkpoint_dir, with_config=True):
  from transformers import AutoConfig, AutoModelForCausalLM

  kw = {"config": AutoConfig.from_pretrained(checkpoint_dir)} if with_config else {}
  hf = AutoModelForCausalLM.from_pretrained(
    path.parent, gguf_file=path.name, dtype=torch.float32, attn_implementation="eager", **kw
  ).eval()
  with torch.no_grad():
    return hf(torch.from_numpy(_ids()).long()).logits.numpy()


def _rel(got, want):
  return float(np.abs(got - want).max() / np.abs(want).max())


@pytest.mark.slow
@pytest.mark.parametrize("family", LOADS_IN_TRANSFORMERS)
def test_f16_file_loads_in_transformers_with_the_merged_weights(
  family, trained, checkpoint, tmp_path
):
  model = trained(family)
  arch = family  # the tests name families as llama.cpp names architectures
  path = export_gguf(model, tmp_path, "f16")
  assert path == tmp_path / gguf_file_name("f16") == tmp_path / "model-f16.gguf"
  reader = _check_file(path, model, arch)
  _check_tensors(reader, model, arch, tmp_path, rtol=1e-3)
  want = np.asarray(model(jnp.asarray(_ids())))
  got = _transformers_logits(path, checkpoint(family))
  assert _rel(got, want) <= 5e-3
  # The LoRA update is large enough that a file without it would fail the check above.
  base = jaxtune.from_pretrained(checkpoint(family), quantization="nf4", dtype="float32")
  assert _rel(np.asarray(base(jnp.asarray(_ids()))), want) > 10 * 5e-3


@pytest.mark.slow
def test_family_metadata_llama_cpp_reads(trained, tmp_path):
  """Gemma 2/3's softcaps, window and rope; and a Llama that transformers configures from
  the GGUF metadata alone."""
  for family in ("gemma2", "gemma3"):
    cfg = trained(family).config
    reader = gguf.GGUFReader(export_gguf(trained(family), tmp_path / family, "f16"))
    arch = family
    assert _field(reader, f"{arch}.attention.sliding_window") == 8
    pattern = [t == "sliding_attention" for t in cfg.layer_types]
    assert _field(reader, f"{arch}.attention.sliding_window_pattern") == pattern
    if family == "gemma2":
      assert _field(reader, "gemma2.attn_logit_softcapping") == 5.0
      assert _field(reader, "gemma2.final_logit_softcapping") == 3.0
    else:
      assert _field(reader, "gemma3.rope.freq_base") == 1e6
      assert _field(reader, "gemma3.rope.freq_base_swa") == 1e4
      assert _field(reader, "gemma3.rope.scaling.type") == "linear"
      assert _field(reader, "gemma3.rope.scaling.factor") == 2.0
  llama = trained("llama")
  path = export_gguf(llama, tmp_path / "llama", "f16")
  got = _transformers_logits(path, None, with_config=False)
  assert _rel(got, np.asarray(llama(jnp.asarray(_ids())))) <= 5e-3


@pytest.mark.slow
def test_gemma_tensors_match_the_merged_export(trained, tmp_path):
  """transformers cannot load llama.cpp's "gemma": every tensor is checked instead."""
  model = trained("gemma")
  path = export_gguf(model, tmp_path, "f16")
  reader = _check_file(path, model, "gemma")
  _check_tensors(reader, model, "gemma", tmp_path, rtol=1e-3)
  norm = next(t for t in reader.tensors if t.name == "blk.0.attn_norm.weight")
  assert np.abs(np.asarray(norm.data) - 1).max() < 1.5  # stored as 1 + w, w near 0


@pytest.mark.slow
def test_tokenizer_round_trips_through_transformers(trained, checkpoint, tmp_path):
  """On a llama file: transformers rebuilds a qwen2 file's tokenizer with Qwen's own split
  regex whatever tokenizer.ggml.pre says, which is not the built-in tokenizer's."""
  from transformers import AutoTokenizer

  path = export_gguf(trained("llama"), tmp_path, "f16")
  assert _field(gguf.GGUFReader(path), "tokenizer.ggml.pre") == "gpt-2"
  from_gguf = AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
  original = AutoTokenizer.from_pretrained(checkpoint("llama"))
  text = "<|user|>Hello there, what's 12 + 30?<|eos|><|assistant|> It is 42."
  assert from_gguf(text).input_ids == original(text).input_ids


def _sentencepiece_expected(checkpoint_dir):
  """tokens, scores and types llama.cpp's converter writes, from the tokenizer.json."""
  spec = json.loads((checkpoint_dir / "tokenizer.json").read_text())
  by_id = {i: t for t, i in spec["model"]["vocab"].items()}
  made_at = {}
  for rank, (left, right) in enumerate(spec["model"]["merges"]):
    made_at.setdefault(left + right, rank)
  tokens, scores, types = [], [], []
  for i in range(VOCAB):
    token = by_id.get(i)
    if token is None:
      tokens.append(f"[PAD{i}]")
      types.append(gguf.TokenType.UNUSED)
    elif token == "<unk>":
      types.append(gguf.TokenType.UNKNOWN)
    elif token in SP_SPECIAL:
      types.append(gguf.TokenType.CONTROL)
    elif token in SP_BYTES:
      types.append(gguf.TokenType.BYTE)
    elif token == SP_USER_DEFINED:
      tokens.append("    ")  # llama.cpp matches these before its spaces become "▁"
      types.append(gguf.TokenType.USER_DEFINED)
    else:
      types.append(gguf.TokenType.NORMAL)
    if len(tokens) == i:
      tokens.append(token)
    scores.append(-1.0 - made_at[token] if token in made_at else 0.0)
  return tokens, scores, types


@pytest.mark.slow
@pytest.mark.parametrize(("family", "style"), [("gemma2", "gemma"), ("llama", "llama")])
def test_sentencepiece_tokenizer_is_written_as_llama_cpp_writes_it(
  family, style, trained, checkpoint, tmp_path
):
  """Gemma's and Llama 2's tokenizer.json (BPE with byte fallback, spaces as "▁") become
  llama.cpp's "llama" tokenizer; transformers builds the same tokenizer back from the file
  (on a llama file from the scores; on a Gemma file from the token order) and loads the
  model."""
  from transformers import AutoTokenizer

  model = trained(family, style)
  path = export_gguf(model, tmp_path, "f16")
  reader = gguf.GGUFReader(path)
  assert _field(reader, "tokenizer.ggml.model") == "llama"
  assert _field(reader, "tokenizer.ggml.pre") == "default"
  assert "tokenizer.ggml.merges" not in reader.fields
  tokens, scores, types = _sentencepiece_expected(checkpoint(family, style))
  assert _field(reader, "tokenizer.ggml.tokens") == tokens
  assert _field(reader, "tokenizer.ggml.scores") == scores
  assert _field(reader, "tokenizer.ggml.token_type") == types
  assert min(scores) < -100 and types.count(gguf.TokenType.UNUSED) > 0
  ids = {
    k: _field(reader, f"tokenizer.ggml.{k}_token_id") for k in ("bos", "eos", "unknown", "padding")
  }
  assert ids == {"bos": 2, "eos": 1, "unknown": 3, "padding": 0}
  assert _field(reader, "tokenizer.ggml.add_bos_token")
  assert _field(reader, "tokenizer.ggml.add_space_prefix") == (style == "llama")
  assert _field(reader, "tokenizer.chat_template") == SP_TEMPLATE

  from_gguf = AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
  original = AutoTokenizer.from_pretrained(checkpoint(family, style))
  # " reen 6?unt" comes out otherwise with the scores all equal or in reverse.
  text = "<start_of_turn>user\nWhat is 25 plus 27?  Ünï → 😀 reen 6?unt<end_of_turn>\n"
  want = original(text).input_ids
  assert want[0] == 2 and 3 not in want and any(6 <= i < 262 for i in want)  # bos, bytes
  assert from_gguf(text).input_ids == want
  got = _transformers_logits(path, checkpoint(family, style))
  assert _rel(got, np.asarray(model(jnp.asarray(_ids())))) <= 5e-3


def test_older_llama_2_tokenizer_json_is_written_the_same(checkpoint, tmp_path):
  """Older files (Llama 2's as first published) put the "▁" first and replace spaces in the
  normalizer, with no pre-tokenizer, and spell merges "a b": the same GGUF tokenizer."""
  from converters.gguf_vocab import tokenizer_writer

  newer = checkpoint("llama", "llama")
  older = tmp_path / "older"
  shutil.copytree(newer, older)
  spec = json.loads((newer / "tokenizer.json").read_text())
  spec["normalizer"] = {
    "type": "Sequence",
    "normalizers": [
      {"type": "Prepend", "prepend": "\u2581"},
      {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"},
    ],
  }
  spec["pre_tokenizer"] = None
  spec["model"]["merges"] = [" ".join(m) for m in spec["model"]["merges"]]
  (older / "tokenizer.json").write_text(json.dumps(spec))
  fields = []
  for src in (newer, older):
    writer = gguf.GGUFWriter(tmp_path / f"{src.name}.gguf", "llama")
    tokenizer_writer(src, VOCAB)(writer)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    reader = gguf.GGUFReader(tmp_path / f"{src.name}.gguf")
    fields.append({k: _field(reader, k) for k in reader.fields if k.startswith("tokenizer.")})
  assert fields[0] == fields[1]
  assert fields[1]["tokenizer.ggml.add_space_prefix"]
  assert min(fields[1]["tokenizer.ggml.scores"]) < -100


# Per tensor: at most half a step of the type's grid (bf16: 2^-9 of the value; q8_0: 1/254 of
# its block's largest value; q4_0: 1/8, as its 16 steps reach only 7/8 of the block's largest
# magnitude on the other sign), as a fraction of the tensor's largest value. The logits then
# drift further through the layers of a random model.
SMALLER = [
  ("bf16", "qwen2", 4e-3, 3e-2),
  ("q8_0", "gemma3", 4e-3, 6e-2),
  ("q4_0", "llama", 0.13, 0.3),
]


@pytest.mark.parametrize(("gguf_type", "family", "tensor_tol", "logits_tol"), SMALLER)
def test_smaller_types_stay_close(
  gguf_type, family, tensor_tol, logits_tol, trained, checkpoint, tmp_path
):
  model = trained(family)
  path = export_gguf(model, tmp_path, gguf_type)
  reader = gguf.GGUFReader(path)
  types = {t.name: t.tensor_type.name for t in reader.tensors}
  big = gguf_type.upper()
  for name, shape in _expected_tensors(model.config, family).items():
    low_bit_output = gguf_type == "q4_0" and name == "output.weight"
    want = "F32" if len(shape) == 1 else "Q8_0" if low_bit_output else big
    assert types[name] == want, name
  assert _field(reader, "general.file_type") == gguf.LlamaFileType[GGUF_TYPES[gguf_type][1]]
  _check_tensors(reader, model, family, tmp_path, rtol=tensor_tol)
  want = np.asarray(model(jnp.asarray(_ids())))
  assert _rel(_transformers_logits(path, checkpoint(family)), want) <= logits_tol


def test_llama3_rope_and_rows_that_do_not_split_into_blocks(checkpoint, tmp_path):
  """Llama 3's rope scaling is the rope_freqs tensor llama.cpp computes; a matrix whose rows
  do not fill q8_0's blocks of 32 is written as f16, the rest as q8_0."""
  scaling = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
  }
  path = checkpoint("llama", intermediate_size=200, rope_scaling=scaling, rope_theta=10000.0)
  model = jaxtune.from_pretrained(path, quantization=None, dtype="float32")
  reader = gguf.GGUFReader(export_gguf(model, tmp_path, "q8_0"))
  types = {t.name: t.tensor_type.name for t in reader.tensors}
  assert types["blk.0.ffn_down.weight"] == "F16" and types["blk.0.ffn_up.weight"] == "Q8_0"
  freqs = next(t for t in reader.tensors if t.name == "rope_freqs.weight")
  want = []  # llama.cpp's convert_hf_to_gguf.py, as written there
  for i in range(0, 32, 2):
    wavelen = 2 * math.pi * 10000.0 ** (i / 32)
    if wavelen < 64 / 4.0:
      want.append(1.0)
    elif wavelen > 64 / 1.0:
      want.append(8.0)
    else:
      smooth = (64 / wavelen - 1.0) / (4.0 - 1.0)
      want.append(1 / ((1 - smooth) / 8.0 + smooth))
  np.testing.assert_allclose(np.asarray(freqs.data), want, rtol=1e-5)
  assert len(set(want)) > 2  # all three regimes appear


@pytest.mark.slow
def test_refusals_come_before_anything_is_written(checkpoint, trained, tmp_path):
  model = trained("llama")
  with pytest.raises(ExportError, match="--gguf-type must be one of"):
    export.write(model, "gguf", tmp_path / "a", gguf_type="q3_k")
  narrow = jaxtune.from_pretrained(
    checkpoint("llama", hidden_size=48, intermediate_size=80, head_dim=12),
    quantization=None,
    dtype="float32",
  )
  with pytest.raises(ExportError, match="no projection"):
    export.write(narrow, "gguf", tmp_path / "b", gguf_type="q4_0")
  untokenized = jaxtune.from_pretrained(
    checkpoint("qwen3", tokenizer=None), quantization=None, dtype="float32"
  )
  with pytest.raises(ExportError, match="tokenizer.json"):
    export.write(untokenized, "gguf", tmp_path / "c")
  untied = jaxtune.from_pretrained(
    checkpoint("gemma2", tie_word_embeddings=False), quantization=None, dtype="float32"
  )
  with pytest.raises(ExportError, match="llama.cpp's gemma2 ties the output layer"):
    export.write(untied, "gguf", tmp_path / "e")
  assert sorted(p.name for p in tmp_path.iterdir()) == []
  out = export.write(model, "gguf", tmp_path / "d", gguf_type="q8_0")
  assert [p.name for p in out.iterdir()] == ["model-q8_0.gguf"]


def test_tokenizers_llama_cpp_cannot_rebuild_are_refused(tmp_path):
  """WordPiece (BERT), Unigram (T5) and SentencePiece-style BPE without byte fallback (whose
  unknown bytes llama.cpp would look up as <0xNN> tokens) are refused, saying which it is."""
  from tokenizers import Tokenizer, models, pre_tokenizers

  from converters.gguf_vocab import tokenizer_writer

  metaspace = pre_tokenizers.Metaspace("\u2581")
  kinds = {
    "a WordPiece model": (models.WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]"), None),
    "a Unigram model": (models.Unigram([("<unk>", 0.0), ("\u2581a", -1.0)], 0), metaspace),
    "no byte fallback": (models.BPE({"<unk>": 0, "\u2581": 1}, [], unk_token="<unk>"), metaspace),
  }
  for i, (says, (model, pre)) in enumerate(kinds.items()):
    tok = Tokenizer(model)
    if pre is not None:
      tok.pre_tokenizer = pre
    (tmp_path / str(i)).mkdir()
    tok.save(str(tmp_path / str(i) / "tokenizer.json"))
    with pytest.raises(ExportError, match=f"byte-level .* SentencePiece-style .* has {says}"):
      tokenizer_writer(tmp_path / str(i), VOCAB)


def test_run_config_checks_the_gguf_type():
  assert CHOICES["gguf_type"] == tuple(GGUF_TYPES)
  assert RunConfig(export="gguf", gguf_type="q4_0").checked().gguf_type == "q4_0"
  with pytest.raises(jaxtune.errors.RunConfigError, match="--gguf-type must be one of"):
    RunConfig(export="gguf", gguf_type="q2_k").checked()
