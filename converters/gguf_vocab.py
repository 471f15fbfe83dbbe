"""A checkpoint's tokenizer.json -> GGUF tokenizer metadata, as llama.cpp's converter writes it.

Byte-level BPE tokenizers (Llama 3, Qwen, the built-in model) become llama.cpp's ``gpt2``
tokenizer: tokens, token types, merges, the pre-tokenizer's name, special ids and the chat
template.
"""

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from jaxtune.errors import ExportError

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


def tokenizer_writer(src: Path, vocab_size: int) -> Callable[["gguf.GGUFWriter"], None]:
  """A function writing the checkpoint's tokenizer into the GGUF metadata, or an ExportError
  saying why it cannot be written."""
  import gguf

  path = src / "tokenizer.json"
  if not path.is_file():
    raise ExportError(
      f"GGUF export needs the checkpoint's tokenizer.json, and {src or 'the model'} has none."
    )
  spec = json.loads(path.read_text())
  byte_level = "ByteLevel" in json.dumps(spec.get("pre_tokenizer"))
  if spec.get("model", {}).get("type") != "BPE" or not byte_level:
    raise ExportError(
      "GGUF export writes byte-level BPE tokenizers (Llama 3, Qwen and the like); this "
      "checkpoint's tokenizer.json is another kind (e.g. SentencePiece, as in Gemma)."
    )
  vocab = dict(spec["model"]["vocab"])
  added = {t["content"]: t for t in spec.get("added_tokens", [])}
  vocab.update({content: t["id"] for content, t in added.items()})
  if max(vocab.values()) >= vocab_size:
    raise ExportError(
      f"the tokenizer has ids up to {max(vocab.values())}, past the model's vocab_size "
      f"{vocab_size}; GGUF needs one embedding row per token."
    )
  by_id = {i: token for token, i in vocab.items()}
  tokens, types = [], []
  for i in range(vocab_size):
    token = by_id.get(i)
    if token is None:  # embedding rows past the tokenizer, as llama.cpp names them
      tokens.append(f"[PAD{i}]")
      types.append(gguf.TokenType.UNUSED)
    elif token in added:
      tokens.append(token)
      special = added[token].get("special", False)
      types.append(gguf.TokenType.CONTROL if special else gguf.TokenType.USER_DEFINED)
    else:
      tokens.append(token)
      types.append(gguf.TokenType.NORMAL)
  pre = _pre_tokenizer(spec.get("pre_tokenizer") or {})
  special = gguf.SpecialVocab(src, load_merges=True, n_vocab=vocab_size)

  def write(w: "gguf.GGUFWriter") -> None:
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    special.add_to_gguf(w, quiet=True)

  return write


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
