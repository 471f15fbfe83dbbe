"""A checkpoint's tokenizer.json -> GGUF tokenizer metadata, as llama.cpp's converter writes it.

Two kinds of BPE tokenizer.json are written:

- byte-level (Llama 3, Qwen, the built-in model): llama.cpp's ``gpt2`` tokenizer, with the
  tokens, their types, the merges and the name of the pre-tokenizer's split regex;
- SentencePiece-style, as transformers stores Llama 2's, Mistral's and Gemma's tokenizers
  (spaces written as "▁", characters outside the vocabulary as ``<0xNN>`` byte tokens):
  llama.cpp's ``llama`` tokenizer, with the tokens, their scores and types, and whether a
  space goes before the text (``add_space_prefix``; not for Gemma).

Both carry the special ids (bos, eos, unk, pad), add_bos/add_eos and the chat template, read
from tokenizer_config.json by gguf-py's SpecialVocab. Other tokenizers (WordPiece, Unigram,
...) are refused. Embedding rows past the tokenizer's last id get llama.cpp's unused
``[PAD<id>]`` tokens.
"""

import json
import logging
import re
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from converters.errors import ExportError

if TYPE_CHECKING:
  import gguf

log = logging.getLogger(__name__)

# The split regex of a byte-level BPE pre-tokenizer -> llama.cpp's name for it
# (tokenizer.ggml.pre), so llama.cpp splits text as the checkpoint's tokenizer does.
_LLAMA3_SPLIT = (
  r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
  r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PRE_TOKENIZERS = {
  _LLAMA3_SPLIT: "llama-bpe",
  _LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}"): "qwen2",
  None: "gpt-2",  # no Split: ByteLevel's own regex, GPT-2's
}
_SPACE = "\u2581"  # "▁", SentencePiece's space
_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")


def tokenizer_writer(src: Path, vocab_size: int) -> Callable[["gguf.GGUFWriter"], None]:
  """A function writing the checkpoint's tokenizer into the GGUF metadata, or an ExportError
  saying why it cannot be written."""
  path = src / "tokenizer.json"
  if not path.is_file():
    raise ExportError(
      f"GGUF export needs the checkpoint's tokenizer.json, and {src or 'the model'} has none."
    )
  spec = json.loads(path.read_text())
  model = spec.get("model") or {}
  if model.get("type") == "BPE" and "ByteLevel" in json.dumps(spec.get("pre_tokenizer")):
    write = _byte_level
  elif model.get("type") == "BPE" and model.get("byte_fallback") and _writes_spaces_as_mark(spec):
    write = _sentencepiece
  else:
    raise ExportError(
      "GGUF export writes BPE tokenizers, byte-level (Llama 3, Qwen and the like) or "
      "SentencePiece-style with byte fallback (Llama 2, Mistral, Gemma); this checkpoint's "
      f"tokenizer.json has a {model.get('type')} model{_unlike_either(spec)}."
    )
  added = {t["content"]: t for t in spec.get("added_tokens", [])}
  vocab = dict(model["vocab"]) | {content: t["id"] for content, t in added.items()}
  if max(vocab.values()) >= vocab_size:
    raise ExportError(
      f"the tokenizer has ids up to {max(vocab.values())}, past the model's vocab_size "
      f"{vocab_size}; GGUF needs one embedding row per token."
    )
  by_id = {i: token for token, i in vocab.items()}
  return write(spec, [by_id.get(i) for i in range(vocab_size)], added, src)


def _byte_level(spec: dict, tokens: list, added: dict, src: Path):
  import gguf

  types = []
  for i, token in enumerate(tokens):
    if token is None:  # embedding rows past the tokenizer, as llama.cpp names them
      tokens[i] = f"[PAD{i}]"
      types.append(gguf.TokenType.UNUSED)
    elif token in added:
      special = added[token].get("special", False)
      types.append(gguf.TokenType.CONTROL if special else gguf.TokenType.USER_DEFINED)
    else:
      types.append(gguf.TokenType.NORMAL)
  pre = _pre_tokenizer(spec.get("pre_tokenizer") or {})
  special = gguf.SpecialVocab(src, load_merges=True, n_vocab=len(tokens))

  def write(w: "gguf.GGUFWriter") -> None:
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    special.add_to_gguf(w, quiet=True)

  return write


def _sentencepiece(spec: dict, tokens: list, added: dict, src: Path):
  """llama.cpp's SentencePiece tokenizer joins first the neighbours whose joined token scores
  highest, transformers' BPE the pair of lowest merge rank: a token scores minus one minus the
  rank of the first merge that makes it, below the 0 of tokens no merge makes (characters, and
  the byte and control tokens, as in SentencePiece's own files)."""
  import gguf

  _warn_unless_sentencepiece_steps(spec)
  model = spec["model"]
  ranks: dict[str, int] = {}
  for rank, merge in enumerate(model.get("merges") or []):
    left, right = merge.split(" ", 1) if isinstance(merge, str) else merge
    ranks.setdefault(left + right, rank)
  unk = model.get("unk_token")
  scores, types = [], []
  for i, token in enumerate(tokens):
    score, kind = 0.0, gguf.TokenType.NORMAL
    if token is None:
      tokens[i], kind = f"[PAD{i}]", gguf.TokenType.UNUSED
    elif token == unk:
      kind = gguf.TokenType.UNKNOWN
    elif _BYTE_TOKEN.fullmatch(token):
      kind = gguf.TokenType.BYTE
    elif token in added and (added[token].get("special") or _looks_special(token)):
      kind = gguf.TokenType.CONTROL
    elif token in added:
      # llama.cpp finds these in the text before its spaces become "▁", as its converter does.
      tokens[i], kind = token.replace(_SPACE, " "), gguf.TokenType.USER_DEFINED
    elif token in ranks:
      score = -1.0 - ranks[token]
    scores.append(score)
    types.append(kind)
  space_prefix = _adds_space_prefix(spec)
  special = gguf.SpecialVocab(src, load_merges=False, n_vocab=len(tokens))
  if unk is not None and unk in tokens:  # often in the model's vocab, not an added token
    special.special_token_ids.setdefault("unk", tokens.index(unk))

  def write(w: "gguf.GGUFWriter") -> None:
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_add_space_prefix(space_prefix)
    special.add_to_gguf(w, quiet=True)

  return write


def _steps(part: dict | None) -> list[dict]:
  """The steps of a normalizer or pre-tokenizer, a Sequence or a single one."""
  if not part:
    return []
  return part.get("pretokenizers") or part.get("normalizers") or [part]


def _writes_spaces_as_mark(spec: dict) -> bool:
  """Whether spaces become "▁" before the BPE model: a Metaspace pre-tokenizer (Llama 2 and
  Mistral in newer files) or a normalizer replacing them (Gemma; Llama 2 in older files)."""
  steps = _steps(spec.get("pre_tokenizer")) + _steps(spec.get("normalizer"))
  return any(
    s.get("type") == "Metaspace" or (s.get("type") == "Replace" and s.get("content") == _SPACE)
    for s in steps
  )


def _adds_space_prefix(spec: dict) -> bool:
  """Whether a "▁" goes before the text, as Llama 2's tokenizer does and Gemma's does not."""
  for step in _steps(spec.get("pre_tokenizer")):
    if step.get("type") == "Metaspace":
      default = "always" if step.get("add_prefix_space", True) else "never"
      return step.get("prepend_scheme", default) != "never"
  normalizer = _steps(spec.get("normalizer"))
  return any(s.get("type") == "Prepend" and s.get("prepend") == _SPACE for s in normalizer)


def _warn_unless_sentencepiece_steps(spec: dict) -> None:
  """llama.cpp's SentencePiece tokenizer only turns spaces into "▁" (and may put one first):
  a step beyond that (Unicode normalization, splitting digits, ...) it does not do."""
  known = {"Metaspace", "Prepend", "Replace"}
  other = [
    s.get("type")
    for s in _steps(spec.get("pre_tokenizer")) + _steps(spec.get("normalizer"))
    if s.get("type") not in known
    and not (s.get("type") == "Split" and s.get("pattern") == {"String": " "})  # Gemma's
  ]
  if other:
    log.warning(
      "GGUF export: llama.cpp's SentencePiece tokenizer has no %s step, which this tokenizer "
      "has; llama.cpp may split some text differently.",
      ", ".join(other),
    )


def _unlike_either(spec: dict) -> str:
  if spec.get("model", {}).get("type") != "BPE":
    return ""
  if _writes_spaces_as_mark(spec):
    return " that writes spaces as '▁' but has no byte fallback"
  return " that neither works on bytes nor writes spaces as '▁'"


def _looks_special(token: str) -> bool:
  """Added tokens that some checkpoints (Gemma's among them) do not mark special but that
  llama.cpp's converter makes control tokens all the same."""
  return (
    token in ("<pad>", "<mask>", "<2mass>", "[@BOS@]")
    or (token.startswith("<|") and token.endswith("|>"))
    or (token.startswith("<\uff5c") and token.endswith("\uff5c>"))
    or (token.startswith("<unused") and token.endswith(">"))
  )


def _pre_tokenizer(pre: dict) -> str:
  steps = pre.get("pretokenizers") or [pre]
  splits = [s["pattern"].get("Regex") for s in steps if s.get("type") == "Split"]
  gpt2_regex = any(s.get("type") == "ByteLevel" and s.get("use_regex", True) for s in steps)
  if gpt2_regex:
    key = None if not splits else "other"
  else:
    key = splits[0] if len(splits) == 1 else "other"
  if key not in _PRE_TOKENIZERS:
    log.warning(
      "GGUF export: this tokenizer's pre-tokenizer is not one llama.cpp names; writing "
      "'default', under which llama.cpp may split some text differently."
    )
    return "default"
  return _PRE_TOKENIZERS[key]
