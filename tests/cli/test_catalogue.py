"""The bad-input catalogue: what users get wrong, and the one sentence jaxtune answers with.

Every case runs a real entry point (``python -m jaxtune.train`` or ``jaxtune.export``'s
``main``, in this process; a few also as true subprocesses) and asserts: exit code 2, exactly
one ``error: ...`` line ending in a full stop, no traceback, and every file of the workspace
(model, data, run directories) byte for byte as before, with nothing new written.

README.md's troubleshooting table lists every case by its id (a test checks it). Errors of
the Python API (``jaxtune.from_pretrained``) are in tests/cli/test_loading_errors.py; a
checkpoint that will not restore, a full disk and signals are in tests/cli/test_faults.py.
"""

import hashlib
import json
import re
import shutil
import struct
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
from conftest import background_run, run_cli
from safetensors.numpy import load_file, save_file

from converters.synthetic import write_random_checkpoint
from jaxtune import export
from jaxtune.run import default_model
from jaxtune.run.default_model import DATASET
from jaxtune.run_config import RunConfig
from jaxtune.train import main as train_main

REPO = Path(__file__).resolve().parents[2]

TINY = {
  **default_model.CONFIG,  # its vocabulary matches the built-in tokenizer copied next to it
  "hidden_size": 64,
  "intermediate_size": 128,
  "num_hidden_layers": 2,
  "num_attention_heads": 4,
  "num_key_value_heads": 2,
  "head_dim": 16,
  "max_position_embeddings": 128,
}


def _write_tiny_model(out: Path) -> Path:
  src = default_model.ensure_default_checkpoint()
  write_random_checkpoint(out, TINY, seed=0, dtype="float32")
  for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
    shutil.copy2(src / name, out / name)
  return out


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
  return _write_tiny_model(tmp_path_factory.mktemp("catalogue") / "model")


class Work:
  """One case's workspace: a model dir, a good data file and room for run directories."""

  def __init__(self, root: Path, model: Path):
    self.root = root
    self.model = root / "model"
    shutil.copytree(model, self.model)
    self.data = root / "data.jsonl"
    self.data.write_text("\n".join(DATASET.read_text().splitlines()[:16]) + "\n")
    self.out = root / "run"

  def train_args(self, *extra: str) -> list[str]:
    args = ["--out", str(self.out), "--model", str(self.model), "--data", str(self.data)]
    return [*args, "--steps", "1", "--export", "none", *extra]

  def config(self, **changes) -> None:
    path = self.model / "config.json"
    cfg = json.loads(path.read_text())
    cfg.update(changes)
    path.write_text(json.dumps({k: v for k, v in cfg.items() if v is not None}))

  def file(self, name: str, text: str | bytes) -> Path:
    path = self.root / name
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return path

  def fake_run(self, **settings) -> Path:
    """A run directory as training leaves it (config.yaml, a checkpoint step dir)."""
    run = RunConfig(model=str(self.model), out=str(self.out)).replace(**settings)
    (self.out / "checkpoints" / "5").mkdir(parents=True)
    (self.out / "config.yaml").write_text(run.to_yaml())
    return self.out


@dataclass
class Case:
  id: str
  setup: Callable[[Work], list[str]]  # prepares the workspace, returns the argv
  match: str  # a regular expression the error sentence must contain
  entry: str = "train"  # or "export"
  env: dict = field(default_factory=dict)


_PAIR = '{"prompt": "What is 2 plus 2?", "chosen": " 4.", "rejected": " 5."}\n'


def _messages(*roles: str) -> str:
  return json.dumps({"messages": [{"role": r, "content": "hi there"} for r in roles]})


def _mkdir(path: Path) -> Path:
  path.mkdir()
  return path


def _roles_do_not_alternate(w: Work) -> list[str]:
  """A template that, like Llama 2's and Mistral's, refuses turns that do not alternate."""
  (w.model / "chat_template.jinja").write_text(
    "{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant') }}"
    "{% endif %}<|{{ m['role'] }}|>{{ m['content'] }}<|eos|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
  )
  rows = _messages("user", "assistant") + "\n" + _messages("user", "user", "assistant") + "\n"
  return w.train_args("--data", str(w.file("a.jsonl", rows)))


def _splits(w: Work, empty: str = "") -> Path:
  """A directory of data files named by split, as datasets reads them."""
  d = _mkdir(w.root / "splits")
  for split in ("train", "test"):
    (d / f"{split}.jsonl").write_text(
      "\n" if split == empty else _messages("user", "assistant") + "\n"
    )
  return d


def _configs(w: Work) -> Path:
  """A directory whose README names two configs (as a Hub dataset repository does)."""
  d = _mkdir(w.root / "configs")
  for name in ("first", "second"):
    (d / f"{name}.jsonl").write_text(_messages("user", "assistant") + "\n")
  (d / "README.md").write_text(
    "---\nconfigs:\n- config_name: first\n  data_files: first.jsonl\n"
    "- config_name: second\n  data_files: second.jsonl\n---\n"
  )
  return d


def _retype_first_weight(w: Work) -> list[str]:
  f = w.model / "model.safetensors"
  tensors = load_file(f)
  name = "model.layers.0.self_attn.q_proj.weight"
  tensors[name] = tensors[name].astype(np.int32)
  save_file(tensors, str(f))
  return w.train_args()


def _sharded_without_a_shard(w: Work) -> list[str]:
  for f in w.model.glob("*.safetensors"):
    f.unlink()
  write_random_checkpoint(w.model, TINY, seed=0, dtype="float32", shard_bytes=100_000)
  sorted(w.model.glob("model-*.safetensors"))[-1].unlink()
  return w.train_args()


def _truncate(w: Work, keep: float) -> list[str]:
  f = w.model / "model.safetensors"
  data = f.read_bytes()
  f.write_bytes(data[: int(len(data) * keep)])
  return w.train_args()


def _remove(w: Work, *names: str) -> list[str]:
  for name in names:
    (w.model / name).unlink()
  return w.train_args()


def _link(w: Work, name: str, target: Path | None = None) -> bool:
  """OUT/name a symbolic link to a file outside OUT (which the case must leave as it was)."""
  if target is None:
    target = w.file("victim.txt", "a file of the user's, outside the run directory\n")
  w.out.mkdir(exist_ok=True)
  (w.out / name).symlink_to(target)
  return True


_HELD = []  # locks held by cases (released when the test process ends)


def _hold_lock(w: Work) -> bool:
  """Another run holding w.out (a lock of this process: the run under test opens its own)."""
  from jaxtune.run.run_dir import Lock

  _HELD.append(Lock(w.out, command="python -m jaxtune.train --out run").acquire())
  return True


def _edit_header(w: Work, change: Callable[[dict, list[str]], None]) -> list[str]:
  """model.safetensors with its JSON header changed in place by ``change(header, names)``
  (names: the tensors in the order of their bytes), the tensor data as it was."""
  f = w.model / "model.safetensors"
  raw = f.read_bytes()
  n = struct.unpack("<Q", raw[:8])[0]
  header = json.loads(raw[8 : 8 + n])
  names = sorted(
    (k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"]
  )
  change(header, names)
  text = json.dumps(header).encode()
  f.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n :])
  return w.train_args()


def _offsets_into_header(header: dict, names: list[str]) -> None:
  """The first tensor starts 64 bytes before the data: in the header's own JSON."""
  first = header[names[0]]
  first["data_offsets"] = [first["data_offsets"][0] - 64, first["data_offsets"][1] - 64]


def _overlapping_tensors(header: dict, names: list[str]) -> None:
  """The second tensor starts 4 bytes before the first ends."""
  first, second = header[names[0]], header[names[1]]
  size = second["data_offsets"][1] - second["data_offsets"][0]
  second["data_offsets"] = [first["data_offsets"][1] - 4, first["data_offsets"][1] - 4 + size]


def _weights_link_loop(w: Work) -> list[str]:
  f = w.model / "model.safetensors"
  f.unlink()
  f.symlink_to(f.name)
  return w.train_args()


def _run_without_checkpoints(w: Work) -> list[str]:
  w.out.mkdir()
  (w.out / "config.yaml").write_text(RunConfig(model=str(w.model)).to_yaml())
  return ["--checkpoint", str(w.out), "--format", "peft", "--out", str(w.root / "x")]


CASES = [
  # The model checkpoint
  Case(
    "model-missing",
    lambda w: w.train_args("--model", str(w.root / "nope")),
    r"checkpoint directory .*nope does not exist",
  ),
  Case(
    "model-empty-dir",
    lambda w: (w.root / "empty").mkdir() or w.train_args("--model", str(w.root / "empty")),
    r"no config\.json at .*empty",
  ),
  Case(
    "config-no-model-type",
    lambda w: w.config(model_type=None) or w.train_args(),
    r"model_type None is not supported; jaxtune supports llama",
  ),
  Case(
    "config-unsupported-architecture",
    lambda w: w.config(model_type="mamba") or w.train_args(),
    r"model_type 'mamba' is not supported",
  ),
  Case(
    "config-not-json",
    lambda w: (w.model / "config.json").write_text("{oops") and w.train_args(),
    r"config\.json is not valid JSON",
  ),
  Case(
    "config-missing-key",
    lambda w: w.config(hidden_size=None) or w.train_args(),
    r"config\.json lacks the key 'hidden_size'",
  ),
  Case(
    "config-heads-kv-heads",
    lambda w: w.config(num_attention_heads=3) or w.train_args(),
    r"num_attention_heads=3 is not a multiple of num_key_value_heads=2",
  ),
  Case(
    "config-not-an-object",
    lambda w: (w.model / "config.json").write_text("[]") and w.train_args(),
    r"config\.json holds a JSON list, not an object of settings",
  ),
  Case(
    "config-layers-absurd",
    lambda w: w.config(num_hidden_layers=10**9) or w.train_args(),
    r"num_hidden_layers in .*config\.json must be a whole number from 1 to 100000, got 1000000000",
  ),
  Case(
    "config-value-wrong-type",
    lambda w: w.config(num_attention_heads="4") or w.train_args(),
    r'num_attention_heads in .*config\.json must be a whole number >= 1, got "4"',
  ),
  Case(
    "config-rope-theta-negative",
    lambda w: w.config(rope_theta=-10000.0) or w.train_args(),
    r"rope_theta in .*config\.json must be a finite number > 0, got -10000\.0",
  ),
  Case(
    "config-hidden-not-multiple-of-heads",
    lambda w: w.config(hidden_size=66, head_dim=None) or w.train_args(),
    r"hidden_size=66 in .*config\.json is not a multiple of num_attention_heads=4, and it sets "
    r"no head_dim",
  ),
  Case(
    "config-model-too-large",
    lambda w: w.config(hidden_size=10**11) or w.train_args(),
    r"config\.json describes a model of \d(\.\d+)?e\+\d+ parameters .*, more than the 1e\+13 any "
    r"machine holds",
  ),
  Case(
    "weights-none",
    lambda w: _remove(w, "model.safetensors"),
    r"no \*\.safetensors files in .*; jaxtune reads safetensors checkpoints only",
  ),
  Case(
    "weights-shard-missing",
    _sharded_without_a_shard,
    r"lacks model-\d+\.safetensors listed in its index; the download is incomplete",
  ),
  Case(
    "weights-truncated",
    lambda w: _truncate(w, 0.6),
    r"model\.safetensors is truncated or corrupt",
  ),
  Case(
    "weights-garbage",
    lambda w: (w.model / "model.safetensors").write_bytes(b"\xff" * 64) and w.train_args(),
    r"model\.safetensors is truncated or corrupt",
  ),
  Case(
    "weights-offsets-into-header",
    lambda w: _edit_header(w, _offsets_into_header),
    r"model\.safetensors is truncated or corrupt \(tensor \S+ has the data_offsets "
    r"\[-64, \d+\], not two offsets >= 0\); re-download it",
  ),
  Case(
    "weights-tensors-overlap",
    lambda w: _edit_header(w, _overlapping_tensors),
    r"model\.safetensors is truncated or corrupt \(tensor \S+'s data_offsets \[\d+, \d+\] "
    r"overlap tensor \S+'s \[\d+, \d+\]\)",
  ),
  Case(
    "weights-unknown-dtype",
    lambda w: _edit_header(w, lambda header, names: header[names[0]].update(dtype="F8_E4M3")),
    r"model\.safetensors holds tensor \S+ in the dtype \"F8_E4M3\", which jaxtune does "
    r"not read \(it reads F32, F16, BF16",
  ),
  Case(
    "weights-not-a-file",
    lambda w: (
      _remove(w, "model.safetensors") and _mkdir(w.model / "model.safetensors") and w.train_args()
    ),
    r"cannot read .*model\.safetensors \(it is a directory\); replace it",
  ),
  Case(
    "weights-symlink-loop",
    _weights_link_loop,
    r"cannot read .*model\.safetensors \(Too many levels of symbolic links\)",
  ),
  Case(
    "tensor-wrong-shape",
    lambda w: w.config(intermediate_size=192) or w.train_args(),
    r"tensor model\.layers\.0\.mlp\.\w+_proj\.weight has shape \(\d+, \d+\), but config\.json "
    r"implies",
  ),
  Case(
    "tensor-wrong-dtype",
    _retype_first_weight,
    r"q_proj\.weight in model\.safetensors is stored as int32, but model weights are floating",
  ),
  Case(
    "tensor-missing",
    lambda w: w.config(num_hidden_layers=3) or w.train_args(),
    r"lacks weights for .*; the checkpoint is incomplete",
  ),
  Case(
    "tensor-extra-layer",
    lambda w: w.config(num_hidden_layers=1) or w.train_args(),
    r"is for layer 1, but config\.json says num_hidden_layers=1",
  ),
  Case(
    "tokenizer-missing",
    lambda w: _remove(w, "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"),
    r"cannot load a tokenizer from .*; the checkpoint needs its tokenizer files",
  ),
  Case(
    "tokenizer-empty-json",
    lambda w: (w.model / "tokenizer.json").write_text("{}") and w.train_args(),
    r"cannot load a tokenizer from .*model \(KeyError reading tokenizer\.json, "
    r"tokenizer_config\.json\); the files are damaged or incomplete",
  ),
  # The data
  Case(
    "data-missing",
    lambda w: w.train_args("--data", str(w.root / "nope.jsonl")),
    r"data file .*nope\.jsonl does not exist",
  ),
  Case(
    "data-empty",
    lambda w: w.train_args("--data", str(w.file("empty.jsonl", "\n\n"))),
    r"empty\.jsonl holds no examples; it is empty",
  ),
  Case(
    "data-directory-without-files",
    lambda w: w.train_args("--data", str(_mkdir(w.root / "nothing"))),
    r"the directory .*nothing holds no data files jaxtune reads",
  ),
  Case(
    "data-not-json",
    lambda w: w.train_args(
      "--data", str(w.file("bad.jsonl", _messages("user", "assistant") + "\n\n{oops\n"))
    ),
    r"bad\.jsonl:3 is not valid JSON",
  ),
  Case(
    "data-not-utf8",
    lambda w: w.train_args(
      "--data", str(w.file("latin.jsonl", '{"text": "caf\xe9"}\n'.encode("latin-1")))
    ),
    r"latin\.jsonl:1 is not UTF-8 text",
  ),
  Case(
    "data-lone-surrogate-in-text",
    lambda w: w.train_args("--data", str(w.file("s.jsonl", '{"text": "cut \\ud83d here"}\n'))),
    r"s\.jsonl:1 holds \\ud83d, half of a UTF-16 surrogate pair without its other half",
  ),
  Case(
    "data-lone-surrogate-in-chat",
    lambda w: w.train_args(
      "--data",
      str(
        w.file(
          "c.jsonl",
          _messages("user", "assistant")
          + '\n{"messages": [{"role": "user", "content": "\\udc00"}]}\n',
        )
      ),
    ),
    r"c\.jsonl:2 holds \\udc00, half of a UTF-16 surrogate pair",
  ),
  Case(
    "data-nested-too-deep",
    lambda w: w.train_args(
      "--data", str(w.file("d.jsonl", '{"text": "x", "y": ' + "[" * 5000 + "]" * 5000 + "}\n"))
    ),
    r"d\.jsonl:1 nests \[ and \{ more than 63 levels deep, more than datasets can hold",
  ),
  Case(
    "data-columns-match-no-format",
    lambda w: w.train_args("--data", str(w.file("p.jsonl", '{"question": "hi"}\n'))),
    r"p\.jsonl has the columns question, which match no format; jaxtune reads text \(text\); "
    r"messages \(messages\);.*map other names with --data-columns",
  ),
  Case(
    "method-needs-preference-data",
    lambda w: w.train_args("--method", "dpo"),
    r"--method dpo trains on preference pairs \(columns prompt, chosen, rejected\), but --data "
    r".*data\.jsonl is messages data",
  ),
  Case(
    "preference-data-needs-method",
    lambda w: w.train_args("--data", str(w.file("pairs.jsonl", _PAIR * 4))),
    r"pairs\.jsonl holds preference pairs \(chosen, rejected\); train on them with --method dpo",
  ),
  Case(
    "preference-row-missing-rejected",
    lambda w: w.train_args(
      "--method",
      "dpo",
      "--data",
      str(w.file("p.jsonl", _PAIR * 3 + '{"prompt": "a", "chosen": " b"}\n')),
    ),
    r"p\.jsonl: 1 of its 4 rows have no 'rejected' value \(the first: row 4\)",
  ),
  Case(
    "preference-no-pair-fits",
    lambda w: w.train_args(
      "--method",
      "dpo",
      "--seq-len",
      "16",
      "--data",
      str(
        w.file(
          "long.jsonl",
          json.dumps({"prompt": "word " * 40, "chosen": " a", "rejected": " b"}) + "\n",
        )
      ),
    ),
    r"no preference pair of .*long\.jsonl fits seq-len 16 with a response on both sides",
  ),
  Case(
    "beta-not-positive",
    lambda w: w.train_args("--method", "dpo", "--beta", "0"),
    r"--beta must be greater than 0 for --method dpo, got 0\.0",
  ),
  Case(
    "label-smoothing-too-large",
    lambda w: w.train_args("--method", "dpo", "--label-smoothing", "0.5"),
    r"--label-smoothing must be below 0\.5",
  ),
  Case(
    "preference-with-streaming",
    lambda w: w.train_args("--method", "ipo", "--data-streaming"),
    r"--method ipo reads its preference pairs whole; drop --data-streaming",
  ),
  Case(
    "grpo-needs-reward",
    lambda w: w.train_args("--method", "grpo"),
    r"--method grpo needs --reward: reward functions MODULE:FUNCTION",
  ),
  Case(
    "reward-cannot-be-imported",
    lambda w: w.train_args("--method", "grpo", "--reward", "no_such_rewards:correct"),
    r"--reward no_such_rewards:correct: module 'no_such_rewards' cannot be imported",
  ),
  Case(
    "reward-not-callable",
    lambda w: w.train_args("--method", "grpo", "--reward", "jaxtune.training.rewards:BUILT_IN"),
    r"--reward jaxtune\.training\.rewards:BUILT_IN: module 'jaxtune\.training\.rewards' has a "
    r"non-callable 'BUILT_IN'",
  ),
  Case(
    "grpo-with-host-embeddings",
    lambda w: w.train_args("--method", "grpo", "--reward", "final_answer", "--embeddings", "host"),
    r"--method grpo generates its rollouts on the devices, which needs the embedding table there",
  ),
  Case(
    "num-generations-below-two",
    lambda w: w.train_args(
      "--method", "grpo", "--reward", "final_answer", "--num-generations", "1"
    ),
    r"--num-generations must be at least 2, got 1",
  ),
  Case(
    "grpo-data-without-prompt",
    lambda w: w.train_args("--method", "grpo", "--reward", "final_answer"),
    r"--method grpo reads prompts from a 'prompt' column, but .*data\.jsonl has messages",
  ),
  Case(
    "grpo-prompts-leave-no-room",
    lambda w: w.train_args(
      "--method",
      "grpo",
      "--reward",
      "final_answer",
      "--seq-len",
      "64",
      "--max-new-tokens",
      "60",
      "--data",
      str(w.file("q.jsonl", json.dumps({"prompt": "word " * 30}) + "\n")),
    ),
    r"no prompt of .*q\.jsonl leaves room for --max-new-tokens 60 within --seq-len 64",
  ),
  Case(
    "data-mixed-formats",
    lambda w: w.train_args(
      "--data", str(w.file("mixed.jsonl", '{"text": "hi"}\n' + _messages("user", "assistant")))
    ),
    r"mixed\.jsonl mixes formats: of its 2 rows, 1 in format messages and 1 in format text",
  ),
  Case(
    "data-columns-missing",
    lambda w: w.train_args("--data-columns", "prompt=question"),
    r"--data-columns names question, which .*data\.jsonl does not have; its columns are messages",
  ),
  Case(
    "data-unknown-role",
    lambda w: w.train_args("--data", str(w.file("r.jsonl", _messages("user", "bot") + "\n"))),
    r"r\.jsonl row 1: message 2 has the unknown role 'bot'; use one of system, user, assistant",
  ),
  Case(
    "data-message-without-content",
    lambda w: w.train_args("--data", str(w.file("c.jsonl", '{"messages": [{"role": "user"}]}\n'))),
    r'c\.jsonl row 1: message 1 must be an object with "role" and "content"',
  ),
  Case(
    "data-roles-do-not-alternate",
    _roles_do_not_alternate,
    r"a\.jsonl row 2: the chat template rejects its messages \(roles user, user, assistant\): "
    r"Conversation roles must alternate",
  ),
  Case(
    "data-every-label-masked",
    lambda w: w.train_args("--data", str(w.file("m.jsonl", _messages("system", "user") + "\n"))),
    r"no example of .*m\.jsonl has a trained token within seq-len 128",
  ),
  Case(
    "data-hub-unreachable",
    lambda w: w.train_args("--data", "jaxtune-tests/no-such-dataset"),
    r"the Hub dataset jaxtune-tests/no-such-dataset cannot be reached",
    env={"HF_HUB_OFFLINE": "1"},
  ),
  Case(
    "data-split-missing",
    lambda w: w.train_args("--data", str(_splits(w)), "--data-split", "validation"),
    r"the directory .*splits has no split 'validation'; its splits are train, test; pass "
    r"--data-split NAME",
  ),
  Case(
    "data-config-missing",
    lambda w: w.train_args("--data", str(_configs(w)), "--data-config", "third"),
    r"the directory .*configs has no config 'third'; its configs are first, second; pass "
    r"--data-config NAME",
  ),
  Case(
    "data-split-empty",
    lambda w: w.train_args("--data", str(_splits(w, empty="train"))),
    r"the directory .*splits holds no examples in split 'train'",
  ),
  Case(
    "data-streaming-with-epochs",
    lambda w: [
      a for a in w.train_args("--data-streaming", "--epochs", "2") if a not in ("--steps", "1")
    ],
    r"--data-streaming cannot count --epochs",
  ),
  Case(
    "steps-and-epochs",
    lambda w: w.train_args("--epochs", "2"),
    r"pass --steps or --epochs, not both",
  ),
  Case(
    "eval-split-out-of-range",
    lambda w: w.train_args("--eval-split", "0.7"),
    r"--eval-split must be a fraction between 0 and 0\.5, got 0\.7",
  ),
  Case(
    "push-to-hub-without-export",
    lambda w: w.train_args("--push-to-hub", "me/model", "--export", "none"),
    r"--push-to-hub uploads the export; pass --export merged, peft, bnb4 or gguf too",
  ),
  Case(
    "push-to-hub-bad-repo-id",
    lambda w: w.train_args("--push-to-hub", "model", "--export", "merged"),
    r"--push-to-hub takes a repo id ORG/NAME, got 'model'",
  ),
  Case(
    "eval-data-missing",
    lambda w: w.train_args("--eval-data", str(w.root / "held_out.jsonl")),
    r"data file .*held_out\.jsonl does not exist",
  ),
  Case(
    "eval-prompts-without-eval-data",
    lambda w: w.train_args("--eval-prompts", str(w.file("prompts.txt", "hi\n"))),
    r"--eval-prompts runs at each evaluation; pass --eval-data FILE or --eval-split too",
  ),
  # Sequence length, batch and mesh
  Case(
    "seq-len-too-short",
    lambda w: w.train_args("--seq-len", "1"),
    r"--seq-len must be at least 2, got 1",
  ),
  Case(
    "seq-len-beyond-max-positions",
    lambda w: w.train_args("--seq-len", "256"),
    r"--seq-len 256 is longer than the 128 positions",
  ),
  Case(
    "batch-not-multiple-of-accum",
    lambda w: w.train_args("--batch-size", "8", "--grad-accum", "3"),
    r"--batch-size 8 must be a multiple of --grad-accum 3",
  ),
  Case(
    "mesh-product-not-device-count",
    lambda w: w.train_args("--mesh", "3x2"),
    r"--mesh 3x2 multiplies to 6 devices but JAX sees 8",
  ),
  Case(
    "mesh-more-than-devices",
    lambda w: w.train_args("--mesh", "4x4"),
    r"--mesh 4x4 asks for 16 devices but JAX sees 8",
  ),
  Case(
    "mesh-unreadable",
    lambda w: w.train_args("--mesh", "two"),
    r"cannot read --mesh two; write e\.g\. 8, 2x4",
  ),
  Case(
    "mesh-unknown-axis",
    lambda w: w.train_args("--mesh", "data=2,model=4"),
    r"unknown mesh axis 'model'",
  ),
  Case(
    "mesh-tensor-not-dividing-heads",
    lambda w: w.train_args("--mesh", "1x8"),
    r"tensor=8 does not divide the model's 4 attention heads and 2 key/value heads",
  ),
  Case(
    "mesh-pipe-not-dividing-layers",
    lambda w: w.train_args("--mesh", "1x1x8"),
    r"layers do not split into 8 equal pipeline stages",
  ),
  Case(
    "step-does-not-fit-device-memory",
    lambda w: w.train_args("--memory-limit", "0.000001"),
    r"the training step does not fit the 0.0 MiB of device memory \(--memory-limit\): the "
    r"leanest setting tried",
  ),
  Case(
    "mesh-pipe-with-fused-attention",
    lambda w: w.train_args("--mesh", "4x1x2", "--attention", "fused"),
    r"--attention fused \(cuDNN\) cannot run inside the pipeline yet",
  ),
  Case(
    "sequence-parallel-without-tensor",
    lambda w: w.train_args("--mesh", "8", "--sequence-parallel"),
    r"--sequence-parallel splits each row's tokens over the tensor axis, but --mesh 8 has "
    r"tensor=1",
  ),
  Case(
    "remat-group-not-dividing-layers",
    lambda w: w.train_args("--remat-group", "3"),
    r"--remat-group 3 does not divide the model's 2 layers; use 2, or drop --remat-group\.",
  ),
  Case(
    "mesh-context-with-pipe",
    lambda w: w.train_args("--mesh", "1x1x2x4"),
    r"--mesh 1x1x2x4 splits each sequence over context=4, which does not run with a pipe axis",
  ),
  Case(
    "mesh-context-not-dividing-seq-len",
    lambda w: w.train_args("--mesh", "data=2,context=4", "--seq-len", "100", "--batch-size", "2"),
    r"in 8 zigzag chunks, which --seq-len 100 does not divide into; make --seq-len a multiple "
    r"of 8",
  ),
  Case(
    "mesh-context-with-loss-chunk",
    lambda w: w.train_args("--mesh", "data=2,context=4", "--loss-chunk", "32"),
    r"--loss-chunk would gather each sequence back to cut it into pieces; drop --loss-chunk",
  ),
  Case(
    "mesh-context-with-fused-attention",
    lambda w: w.train_args("--mesh", "data=2,context=4", "--attention", "fused"),
    r"cuDNN's kernel \(--attention fused\) does not return",
  ),
  Case(
    "mesh-context-with-sequence-parallel",
    lambda w: w.train_args("--mesh", "tensor=2,context=4", "--sequence-parallel"),
    r"splits each sequence over context=4; drop --sequence-parallel",
  ),
  Case(
    "embeddings-host-with-tied-output",
    lambda w: w.config(tie_word_embeddings=True) or w.train_args("--embeddings", "host"),
    r"--embeddings host keeps the input embedding table off the devices, but this llama uses "
    r"the same table as its output layer \(tie_word_embeddings\), which runs on them; drop "
    r"--embeddings host\.",
  ),
  Case(
    "attention-fused-with-packing",
    lambda w: w.train_args("--attention", "fused"),
    r"--attention fused \(cuDNN, causal only\) would let packed examples attend to each other",
  ),
  Case(
    "mesh-data-not-dividing-batch",
    lambda w: w.train_args("--mesh", "8", "--batch-size", "4"),
    r"the batch of 4 sequences does not split over data=8",
  ),
  # LoRA and optimisation settings
  Case(
    "lora-rank-zero",
    lambda w: w.train_args("--lora-rank", "0"),
    r"--lora-rank must be at least 1, got 0",
  ),
  Case(
    "lora-rank-negative",
    lambda w: w.train_args("--lora-rank", "-4"),
    r"--lora-rank must be at least 1, got -4",
  ),
  Case(
    "lora-target-unknown",
    lambda w: w.train_args("--lora-targets", "q_proj,qkv_proj"),
    r"--lora-targets names qkv_proj, which is not a projection of this llama; choose from q_proj",
  ),
  Case(
    "lora-dropout-one",
    lambda w: w.train_args("--lora-dropout", "1"),
    r"--lora-dropout must be below 1",
  ),
  Case(
    "learning-rate-not-a-number",
    lambda w: w.train_args("--learning-rate", "fast"),
    r"argument --learning-rate: invalid float value: 'fast'; see python -m jaxtune\.train --help",
  ),
  Case(
    "learning-rate-not-a-number-in-yaml",
    lambda w: w.train_args("--config", str(w.file("c.yaml", "learning_rate: fast\n"))),
    r"--learning-rate must be a number, got 'fast'",
  ),
  Case(
    "learning-rate-negative",
    lambda w: w.train_args("--learning-rate", "-0.001"),
    r"--learning-rate must be greater than 0\.0, got -0\.001",
  ),
  Case("steps-zero", lambda w: w.train_args("--steps", "0"), r"--steps must be at least 1, got 0"),
  Case(
    "dtype-unknown",
    lambda w: w.train_args("--dtype", "float8"),
    r"--dtype must be one of bfloat16, float32, float16, got 'float8'",
  ),
  Case(
    "flag-unknown",
    lambda w: w.train_args("--batchsize", "4"),
    r"unrecognized arguments: --batchsize 4",
  ),
  Case(
    "yaml-unknown-setting",
    lambda w: w.train_args("--config", str(w.file("c.yaml", "learning_rte: 0.1\n"))),
    r"c\.yaml: unknown setting 'learning_rte'; did you mean 'learning_rate'\?",
  ),
  Case(
    "yaml-missing",
    lambda w: w.train_args("--config", str(w.root / "nope.yaml")),
    r"config file .*nope\.yaml does not exist",
  ),
  Case(
    "yaml-not-a-mapping",
    lambda w: w.train_args("--config", str(w.file("c.yaml", "- steps\n- 3\n"))),
    r"c\.yaml must hold a mapping of run settings",
  ),
  Case(
    "yaml-invalid",
    lambda w: w.train_args("--config", str(w.file("c.yaml", "steps: [3\n"))),
    r"c\.yaml is not valid YAML at line \d+",
  ),
  # Run directories, resuming and exporting
  Case(
    "out-holds-checkpoints",
    lambda w: w.fake_run() and w.train_args(),
    r"already holds checkpoints; pass --resume to continue, or a new --out",
  ),
  Case(
    "resume-without-checkpoint",
    lambda w: w.train_args("--resume"),
    r"--resume: .*checkpoints holds no checkpoint; start without --resume",
  ),
  Case(
    "resume-other-lora-rank",
    lambda w: (
      w.fake_run(lora_rank=8, data=str(w.data)) and w.train_args("--resume", "--lora-rank", "16")
    ),
    r"--resume: the checkpoints in .* were trained with lora_rank 8 \(now 16\).* pass "
    r"--allow-changes to continue with these",
  ),
  Case(
    "resume-other-model",
    lambda w: (
      w.fake_run(model=str(w.root / "other"), data=str(w.data)) and w.train_args("--resume")
    ),
    r"--resume: the checkpoints in .* were trained with model .*other \(now .*model\); resume",
  ),
  Case(
    "resume-other-seed-and-batch",
    lambda w: (
      w.fake_run(data=str(w.data), seq_len=64)
      and w.train_args("--resume", "--seed", "3", "--batch-size", "4", "--seq-len", "64")
    ),
    r"were trained with batch_size 8 \(now 4\), seed 0 \(now 3\); resume with the settings "
    r"in its config\.yaml, or pass --allow-changes",
  ),
  Case(
    "allow-changes-without-resume",
    lambda w: w.train_args("--allow-changes"),
    r"--allow-changes is for --resume; pass --resume too, or drop it",
  ),
  Case(
    "tokenizer-beyond-vocabulary",
    lambda w: w.config(vocab_size=200) or w.train_args(),
    r"the tokenizer of .*model has ids up to \d+, but the model's vocabulary \(vocab_size in "
    r"config\.json\) is 200: \d+ token\(s\) have no embedding; use the tokenizer",
  ),
  Case(
    "out-is-a-file",
    lambda w: w.train_args("--out", str(w.file("out.txt", "notes"))),
    r"--out .*out\.txt is a file; pass a directory",
  ),
  Case(
    "out-under-a-file",
    lambda w: w.train_args("--out", str(w.file("out.txt", "notes") / "run")),
    r"--out .*out\.txt/run is under .*out\.txt, which is a file; pass a directory",
  ),
  Case(
    "export-place-is-a-file",
    lambda w: _mkdir(w.out) and w.file("run/export", "notes") and w.train_args("--export", "peft"),
    r"run/export is a file, where the export is written; move it away or choose another --out",
  ),
  Case(
    "out-lock-is-a-symlink",
    lambda w: _link(w, ".jaxtune.lock") and w.train_args(),
    r"run/\.jaxtune\.lock is a symbolic link \(to .*victim\.txt\), and jaxtune writes only "
    r"inside --out, following no links there; remove the link, or choose another --out",
  ),
  Case(
    "out-metrics-is-a-symlink",
    lambda w: _link(w, "metrics.jsonl") and w.train_args(),
    r"run/metrics\.jsonl is a symbolic link \(to .*victim\.txt\)",
  ),
  Case(
    "out-checkpoints-is-a-symlink",
    lambda w: _link(w, "checkpoints", _mkdir(w.root / "elsewhere")) and w.train_args(),
    r"run/checkpoints is a symbolic link \(to .*elsewhere\)",
  ),
  Case(
    "out-in-use",
    lambda w: _hold_lock(w) and w.train_args(),
    r"run is in use by another run \(pid \d+ on .*\); wait for it to finish, or choose "
    r"another --out",
  ),
  Case(
    "export-into-non-empty-dir",
    lambda w: [
      "--checkpoint",
      str(w.fake_run()),
      "--format",
      "peft",
      "--out",
      str(w.file("keep.txt", "mine").parent),
    ],
    r"--out .* is not empty; pass --overwrite to replace it",
    entry="export",
  ),
  Case(
    "export-out-under-a-file",
    lambda w: ["--checkpoint", str(w.fake_run()), "--out", str(w.file("f.txt", "x") / "e")],
    r"--out .*f\.txt/e is under .*f\.txt, which is a file; pass a directory",
    entry="export",
  ),
  Case(
    "export-not-a-run",
    lambda w: ["--checkpoint", str(w.model), "--format", "merged", "--out", str(w.root / "x")],
    r"has no config\.yaml; pass the --out directory of a training run",
    entry="export",
  ),
  Case(
    "export-no-checkpoint",
    _run_without_checkpoints,
    r"checkpoints holds no checkpoint; train first",
    entry="export",
  ),
  Case(
    "export-unknown-format",
    lambda w: ["--checkpoint", str(w.out), "--format", "onnx", "--out", str(w.root / "x")],
    r"argument --format: invalid choice: 'onnx'",
    entry="export",
  ),
  Case(
    "export-unknown-gguf-type",
    lambda w: [
      *("--checkpoint", str(w.out), "--format", "gguf", "--gguf-type", "q3_k"),
      *("--out", str(w.root / "x")),
    ],
    r"--gguf-type must be one of f16, bf16, .*, got 'q3_k'",
    entry="export",
  ),
  # Launching several processes
  Case(
    "multiprocess-incomplete-env",
    lambda w: w.train_args(),
    r"JAXTUNE_COORDINATOR is set but JAXTUNE_NUM_PROCESSES is not",
    env={"JAXTUNE_COORDINATOR": "10.0.0.1:1234"},
  ),
  Case(
    "multiprocess-bad-process-id",
    lambda w: w.train_args(),
    r"process id 2 is outside 0\.\.1",
    env={"JAXTUNE_COORDINATOR": "h:1", "JAXTUNE_NUM_PROCESSES": "2", "JAXTUNE_PROCESS_ID": "2"},
  ),
]
BY_ID = {c.id: c for c in CASES}
MAINS = {"train": train_main, "export": export.main}


def _snapshot(root: Path) -> dict:
  """Every path under root, files with their size and hash: what a case must not change."""
  return {
    str(p.relative_to(root)): (
      p.stat().st_size,
      hashlib.sha256(p.read_bytes()).hexdigest(),
    )
    if p.is_file()
    else "dir"
    for p in sorted(root.rglob("*"))
  }


def _assert_one_sentence(stderr: str, match: str) -> None:
  assert "Traceback" not in stderr, stderr
  errors = [line for line in stderr.splitlines() if line.startswith("error:")]
  assert len(errors) == 1, stderr
  sentence = errors[0]
  assert sentence.endswith("."), sentence
  assert not re.search(r"(?<!e\.g)\.\s+[A-Z]", sentence), sentence  # one sentence
  assert re.search(match, sentence), f"{match!r} not in {sentence!r}"


def test_catalogue_is_large_and_documented():
  assert len(CASES) >= 30 and len(BY_ID) == len(CASES)
  readme = (REPO / "README.md").read_text()
  section = readme[readme.index("## Troubleshooting") :]
  missing = [c.id for c in CASES if f"`{c.id}`" not in section]
  assert not missing, f"README's troubleshooting table lacks {missing}"


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input(case, tiny_model, tmp_path, capsys, monkeypatch):
  work = Work(tmp_path, tiny_model)
  argv = case.setup(work)
  for k, v in case.env.items():
    monkeypatch.setenv(k, v)
  before = _snapshot(tmp_path)
  capsys.readouterr()
  try:
    code = MAINS[case.entry](argv)
  except SystemExit as e:  # argparse
    code = e.code
  out, err = capsys.readouterr()
  assert code == 2, err
  _assert_one_sentence(err, case.match)
  assert _snapshot(tmp_path) == before


REAL_COMMAND_LINES = [
  "learning-rate-not-a-number",
  "mesh-product-not-device-count",
  "data-not-json",
  "export-into-non-empty-dir",
]


@background_run("real_command_lines")
def _real_command_lines(directory, runs) -> dict:
  """Each case of REAL_COMMAND_LINES run as a user runs it, a new process in a workspace of its
  own: {case id: (the finished process, the workspace's snapshot before, and after)}."""
  model = _write_tiny_model(directory / "tiny")
  results = {}
  for case_id in REAL_COMMAND_LINES:
    case = BY_ID[case_id]
    root = directory / case_id
    root.mkdir()
    argv = case.setup(Work(root, model))
    before = _snapshot(root)
    proc = run_cli([sys.executable, "-m", f"jaxtune.{case.entry}", *argv], timeout=300, cwd=REPO)
    results[case_id] = proc, before, _snapshot(root)
  return results


@pytest.mark.slow
@pytest.mark.parametrize("case_id", REAL_COMMAND_LINES)
def test_bad_input_from_a_real_command_line(case_id, real_command_lines):
  """The same, as a user runs it: a new process, whose stderr holds the one sentence only."""
  case = BY_ID[case_id]
  proc, before, after = real_command_lines[case_id]
  assert proc.returncode == 2, proc.stderr
  _assert_one_sentence(proc.stderr, case.match)
  assert proc.stderr.strip().startswith("error:")  # nothing but the sentence
  assert after == before
