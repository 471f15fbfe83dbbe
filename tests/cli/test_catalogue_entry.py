"""The bad-input catalogue, continued: what users get wrong where the settings enter (PEFT
adapters, --config files, whole numbers out of range, the generate command line).

The machinery is tests/cli/test_catalogue.py's (``Work``, ``Case``, the workspace snapshot and
the one-sentence check); README.md's troubleshooting table lists every case here by its id.
Each case fails before a model is loaded, except the prompt that does not fit the model's
positions (that needs the model's tokenizer).
"""

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file
from test_catalogue import (  # noqa: F401 (tiny_model: a fixture)
  MAINS,
  REPO,
  Case,
  Work,
  _assert_one_sentence,
  _snapshot,
  tiny_model,
)

from jaxtune.generate import main as generate_main

ENTRIES = {**MAINS, "generate": generate_main}


def _adapter(w: Work, base: Path | None = None, **changes) -> Path:
  """A PEFT adapter directory for w.model (its config as peft writes it, with ``changes``);
  the weights file is a stand-in: every case is refused by the config first."""
  d = w.root / "adapter"
  d.mkdir()
  config = {
    "peft_type": "LORA",
    "base_model_name_or_path": str(base or w.model),
    "r": 2,
    "lora_alpha": 4,
    "lora_dropout": 0.0,
    "target_modules": ["q_proj", "v_proj"],
    "use_rslora": False,
    "rank_pattern": {},
    "alpha_pattern": {},
    "bias": "none",
  }
  (d / "adapter_config.json").write_text(json.dumps({**config, **changes}))
  save_file({"stand_in": np.zeros(1, np.float32)}, str(d / "adapter_model.safetensors"))
  return d


def _init_adapter(w: Work, **changes) -> list[str]:
  return w.train_args("--init-adapter", str(_adapter(w, **changes)))


def _generate_adapter(w: Work, **changes) -> list[str]:
  return ["--adapter", str(_adapter(w, **changes)), "--prompt", "hi"]


def _broken_base(w: Work) -> Path:
  """A copy of the model whose config.json is not JSON (the adapter's base, not --model)."""
  base = w.root / "base"
  shutil.copytree(w.model, base)
  (base / "config.json").write_text("{oops")
  return base


def _billion_laughs() -> str:
  lines = ['a: &a ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
  for prev, name in zip("abcdefgh", "bcdefghi", strict=True):
    lines.append(f"{name}: &{name} [{', '.join([f'*{prev}'] * 9)}]")
  return "\n".join([*lines, "steps: *i"]) + "\n"


def _generate(w: Work, *extra: str) -> list[str]:
  return ["--model", str(w.model), "--prompt", "hi", *extra]


CASES = [
  # PEFT adapters (--init-adapter, generate's --adapter): adapter_config.json's values
  Case(
    "adapter-dropout-not-a-number",
    lambda w: _init_adapter(w, lora_dropout="high"),
    r'adapter_config\.json sets lora_dropout to "high", but it must be a number from 0 to below '
    r"1; fix it, or save the adapter again",
  ),
  Case(
    "adapter-rank-pattern-not-a-number",
    lambda w: _generate_adapter(w, rank_pattern={"q_proj": "big"}),
    r'adapter_config\.json sets rank_pattern\["q_proj"\] to "big", but it must be a whole '
    r"number from 1 to 2147483647",
    entry="generate",
  ),
  Case(
    "adapter-alpha-pattern-not-a-number",
    lambda w: _init_adapter(w, alpha_pattern={"v_proj": [1]}),
    r'adapter_config\.json sets alpha_pattern\["v_proj"\] to \[1\], but it must be a finite '
    r"number greater than 0",
  ),
  Case(
    "adapter-rank-not-a-number",
    lambda w: _init_adapter(w, r="4"),
    r'adapter_config\.json sets r to "4", but it must be a whole number from 1 to 2147483647',
  ),
  Case(
    "adapter-alpha-null",
    lambda w: _generate_adapter(w, lora_alpha=None),
    r"adapter_config\.json sets lora_alpha to null, but it must be a finite number greater than 0",
    entry="generate",
  ),
  Case(
    "adapter-pattern-key-not-a-regex",
    lambda w: _init_adapter(w, rank_pattern={"(q_proj": 4}),
    r'adapter_config\.json has the rank_pattern key "\(q_proj", which is not a regular '
    r"expression \(missing \), unterminated subpattern",
  ),
  Case(
    "adapter-base-config-not-json",
    lambda w: w.train_args("--init-adapter", str(_adapter(w, base=_broken_base(w)))),
    r"adapter names the base model .*base, whose config\.json is not valid JSON \(Expecting "
    r"property name .*\); re-download that checkpoint, or set base_model_name_or_path",
  ),
  Case(
    "adapter-base-config-not-json-generate",
    lambda w: ["--adapter", str(_adapter(w, base=_broken_base(w))), "--prompt", "hi"],
    r"adapter names the base model .*base, whose config\.json is not valid JSON",
    entry="generate",
  ),
  # --config FILE.yaml
  Case(
    "yaml-not-text",
    lambda w: w.train_args("--config", str(w.file("c.yaml", b"\x89PNG\r\n\x1a\n\xff\x00"))),
    r"c\.yaml is not UTF-8 text \(byte 0 is 0x89\); pass a YAML file of run settings",
  ),
  Case(
    "yaml-key-not-text",
    lambda w: w.train_args("--config", str(w.file("c.yaml", "1: 2\nfoo: 3\n"))),
    r"c\.yaml: the key 1 is not a setting name; name settings in text",
  ),
  Case(
    "yaml-unknown-setting-nearest",
    lambda w: w.train_args("--config", str(w.file("c.yaml", "learning_rat: 0.1\nfoo: 1\n"))),
    r"c\.yaml: unknown setting 'learning_rat' \(and 1 more\); did you mean 'learning_rate'\? "
    r"\(the settings are the flags of python -m jaxtune\.train --help",
  ),
  Case(
    "yaml-alias",
    lambda w: w.train_args("--config", str(w.file("c.yaml", _billion_laughs()))),
    r"c\.yaml uses the YAML alias \*a at line 2; write the value out in full",
  ),
  Case(
    "yaml-nested-too-deep",
    lambda w: w.train_args("--config", str(w.file("c.yaml", "steps: " + "[" * 50 + "]" * 50))),
    r"c\.yaml nests lists and mappings more than 8 levels deep at line 1",
  ),
  Case(
    "yaml-too-large",
    lambda w: w.train_args("--config", str(w.file("c.yaml", "# " + "x" * 2**20 + "\n"))),
    r"c\.yaml is 1\.0 MiB, too large for a file of run settings \(at most 1\.0 MiB\)",
  ),
  Case(
    "yaml-number-too-long",
    lambda w: w.train_args("--config", str(w.file("c.yaml", "steps: 1" + "0" * 5000 + "\n"))),
    r"c\.yaml holds a value YAML cannot read \(Exceeds the limit \(4300 digits\)",
  ),
  Case(
    "yaml-value-huge",
    lambda w: w.train_args("--config", str(w.file("c.yaml", f"seed: {list(range(10**5))}\n"))),
    r"--seed must be a whole number, got \[0, 1, 2, 3, \.\.\.\]\.$",
  ),
  # Whole numbers out of range
  Case(
    "seed-negative",
    lambda w: w.train_args("--seed", "-1"),
    r"--seed must be a whole number from 0 to 4294967295, got -1",
  ),
  Case(
    "steps-beyond-int32",
    lambda w: w.train_args("--steps", "1" + "0" * 29),
    r"--steps must be a whole number from 1 to 2147483647, got 10{29}\.",
  ),
  Case(
    "batch-size-beyond-int32",
    lambda w: w.train_args("--batch-size", "2147483648"),
    r"--batch-size must be a whole number from 1 to 2147483647, got 2147483648",
  ),
  Case(
    "lora-pattern-value-not-finite",
    lambda w: w.train_args("--lora-alpha-pattern", "q_proj=nan"),
    r"--lora-alpha-pattern: the LoRA pattern entry 'q_proj=nan' needs a finite value below 2\*\*31",
  ),
  # python -m jaxtune.generate
  Case(
    "generate-flag-not-a-number",
    lambda w: _generate(w, "--temperature", "abc"),
    r"argument --temperature: invalid float value: 'abc'; see python -m jaxtune\.generate --help",
    entry="generate",
  ),
  Case(
    "generate-max-new-tokens-negative",
    lambda w: _generate(w, "--max-new-tokens", "-5"),
    r"--max-new-tokens must be from 1 to \d+, got -5",
    entry="generate",
  ),
  Case(
    "generate-top-p-zero",
    lambda w: _generate(w, "--top-p", "0"),
    r"--top-p must be in \(0, 1\] \(1: off\), got 0\.0",
    entry="generate",
  ),
  Case(
    "generate-seed-negative",
    lambda w: _generate(w, "--seed", "-1"),
    r"--seed must be a whole number from 0 to 4294967295, got -1",
    entry="generate",
  ),
  Case(
    "generate-prompt-beyond-positions",
    lambda w: [
      *("--model", str(w.model), "--prompt", "word " * 200),
      *("--quantization", "none", "--dtype", "float32"),
    ],
    r"a prompt of \d+ tokens and --max-new-tokens 128 need \d+ positions, more than the model's "
    r"128 \(max_position_embeddings\); shorten the prompt or lower --max-new-tokens",
    entry="generate",
  ),
]
BY_ID = {c.id: c for c in CASES}


def test_entries_are_documented():
  readme = (REPO / "README.md").read_text()
  section = readme[readme.index("## Troubleshooting") :]
  missing = [c.id for c in CASES if f"`{c.id}`" not in section]
  assert len(BY_ID) == len(CASES)
  assert not missing, f"README's troubleshooting table lacks {missing}"


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input(case, tiny_model, tmp_path, capsys, monkeypatch):  # noqa: F811
  work = Work(tmp_path, tiny_model)
  argv = case.setup(work)
  for k, v in case.env.items():
    monkeypatch.setenv(k, v)
  before = _snapshot(tmp_path)
  capsys.readouterr()
  t0 = time.perf_counter()
  try:
    code = ENTRIES[case.entry](argv)
  except SystemExit as e:  # argparse
    code = e.code
  seconds = time.perf_counter() - t0
  out, err = capsys.readouterr()
  assert code == 2, err
  _assert_one_sentence(err, case.match)
  assert _snapshot(tmp_path) == before
  assert seconds < 60  # a billion-laughs value is refused, never expanded or formatted


def test_generate_help_renders_before_jax_is_imported():
  """`python -m jaxtune.generate --help` answers from argparse alone, at once, and every help
  string renders (a bare % would make argparse paste its own formatting into the text)."""
  code = (
    "import sys, contextlib, io\n"
    "from jaxtune.generate import main\n"
    "buf = io.StringIO()\n"
    "with contextlib.redirect_stdout(buf), contextlib.suppress(SystemExit): main(['--help'])\n"
    "heavy = ('jax', 'jaxtune.run.session', 'jaxtune.models.decoding')\n"
    "print(sorted(m for m in heavy if m in sys.modules))\n"
  )
  proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
  assert proc.returncode == 0 and proc.stdout.strip() == "[]", proc.stdout + proc.stderr
  t0 = time.perf_counter()
  proc = subprocess.run(
    [sys.executable, "-m", "jaxtune.generate", "--help"], capture_output=True, text=True, cwd=REPO
  )
  seconds = time.perf_counter() - t0
  assert proc.returncode == 0 and proc.stderr == "", proc.stderr
  assert "--max-new-tokens" in proc.stdout and "in (0, 1]" in proc.stdout
  for bad in ("%(", "{'", "'option_strings'"):
    assert bad not in proc.stdout, bad
  assert seconds < 2, f"--help took {seconds:.1f} s"
