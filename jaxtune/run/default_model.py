"""The built-in default: a small Llama-architecture HF checkpoint and a bundled chat dataset.

The checkpoint is written locally (config.json, model.safetensors, a byte-level BPE tokenizer
trained on the bundled data, with a chat template) so the default run goes through exactly
the converter, training and export path of a real checkpoint, offline.
"""

import json
import os
import shutil
import tempfile
from pathlib import Path

from converters.synthetic import write_random_checkpoint

DATASET = Path(__file__).parents[1] / "data_files" / "default.jsonl"
VERSION = "v2"

CONFIG = {
  "architectures": ["LlamaForCausalLM"],
  "model_type": "llama",
  "vocab_size": 512,
  "hidden_size": 256,
  "intermediate_size": 512,
  "num_hidden_layers": 4,
  "num_attention_heads": 8,
  "num_key_value_heads": 4,
  "head_dim": 32,
  "max_position_embeddings": 512,
  "rms_norm_eps": 1e-5,
  "rope_theta": 10000.0,
  "hidden_act": "silu",
  "tie_word_embeddings": False,
  "bos_token_id": 0,
  "eos_token_id": 1,
  "pad_token_id": 2,
}
SPECIAL = ["<|bos|>", "<|eos|>", "<|pad|>", "<|user|>", "<|assistant|>", "<|system|>"]
CHAT_TEMPLATE = (
  "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|eos|>{% endfor %}"
  "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def cache_dir() -> Path:
  root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
  return Path(root) / "jaxtune" / f"default-llama-{VERSION}"


def ensure_default_checkpoint(path: Path | None = None) -> Path:
  """Write the default checkpoint once (seeded, so every machine gets the same one).

  Written under a temporary name and renamed when complete, so processes that start at the
  same time (several processes of one run) never read a half-written checkpoint.
  """
  path = Path(path or cache_dir())
  if (path / "model.safetensors").is_file() and (path / "tokenizer.json").is_file():
    return path
  path.parent.mkdir(parents=True, exist_ok=True)
  tmp = Path(tempfile.mkdtemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent))
  try:
    _write_tokenizer(tmp)
    write_random_checkpoint(tmp, CONFIG, seed=0, dtype="float32")
    try:
      tmp.rename(path)
    except OSError:
      if not (path / "model.safetensors").is_file():  # not another process finishing first
        raise
  finally:
    if tmp.exists():
      shutil.rmtree(tmp)
  return path


def _write_tokenizer(out: Path) -> None:
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
  from transformers import PreTrainedTokenizerFast

  texts = []
  for line in DATASET.read_text().splitlines():
    for m in json.loads(line)["messages"]:
      texts.append(m["content"])
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(
    vocab_size=CONFIG["vocab_size"],
    special_tokens=SPECIAL,
    initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    show_progress=False,
  )
  tok.train_from_iterator(texts, trainer)
  fast = PreTrainedTokenizerFast(
    tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|eos|>", pad_token="<|pad|>"
  )
  fast.chat_template = CHAT_TEMPLATE
  fast.save_pretrained(out)
