"""The command line: every flag documented, shipped configs parse, flags override YAML."""

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxtune
from jaxtune.errors import RunConfigError
from jaxtune.models import attention
from jaxtune.run_config import RunConfig
from jaxtune.train import build_parser, resolve_config

# Example run configs (the built-in default run's own settings, default-run.yaml, are apart).
CONFIGS = sorted(
  p
  for p in (Path(jaxtune.__file__).parent / "configs").glob("*.yaml")
  if p.name != "default-run.yaml"
)


def test_help_documents_every_setting():
  text = build_parser().format_help()
  for f in dataclasses.fields(RunConfig):
    assert "--" + f.name.replace("_", "-") in text, f.name
  for flag in ("--config", "--resume"):
    assert flag in text


def test_help_renders_before_jax_is_imported():
  """`python -m jaxtune.train --help` answers from argparse alone (JAX and the trainer are
  imported after parsing), and every help string renders: a bare % in one would make
  argparse paste its own action into the text, or fail."""
  import subprocess
  import sys

  code = (
    "import sys, contextlib, io\n"
    "from jaxtune.train import main\n"
    "buf = io.StringIO()\n"
    "with contextlib.redirect_stdout(buf), contextlib.suppress(SystemExit): main(['--help'])\n"
    "heavy = ('jax', 'jaxtune.run.session', 'jaxtune.training.loop')\n"
    "print(sorted(m for m in heavy if m in sys.modules))\n"
    "print(buf.getvalue())\n"
  )
  proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
  first, text = proc.stdout.split("\n", 1)
  assert first == "[]", first
  assert "--remat" in text and "~3% slower than full" in text
  for bad in ("%(", "{'", "'option_strings'"):
    assert bad not in text, bad


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_shipped_configs_parse(path):
  run = RunConfig.from_yaml(path)
  assert run.model and run.steps > 0 and run.batch_size % run.grad_accum == 0


def test_default_run_keeps_its_own_settings_and_real_models_get_real_defaults():
  toy, _ = resolve_config([])
  assert (toy.model, toy.steps, toy.learning_rate, toy.seq_len) == (None, 60, 2e-3, 128)
  mine, _ = resolve_config(["--learning-rate", "1e-3", "--epochs", "2"])
  assert (mine.learning_rate, mine.steps, mine.epochs, mine.seq_len) == (1e-3, 60, 2.0, 128)
  real, _ = resolve_config(["--model", "meta-llama/Llama-3.2-1B"])
  # LoRA's usual rate; seq-len and steps decided from the data (one epoch).
  assert (real.learning_rate, real.seq_len, real.steps, real.epochs) == (2e-4, None, None, None)


def test_flags_override_yaml(tmp_path):
  assert len(CONFIGS) >= 2
  run, resume = resolve_config(
    [
      "--config",
      str(CONFIGS[0]),
      "--steps",
      "7",
      "--lora-targets",
      "q_proj,v_proj",
      "--no-rslora",
      "--resume",
    ]
  )
  assert run.steps == 7 and run.lora_targets == ("q_proj", "v_proj") and resume
  assert run.model == RunConfig.from_yaml(CONFIGS[0]).model


def test_unknown_yaml_key_is_named(tmp_path):
  bad = tmp_path / "bad.yaml"
  bad.write_text("steps: 3\nlearning_rte: 0.1\n")
  with pytest.raises(
    RunConfigError, match="unknown setting 'learning_rte'; did you mean 'learning_rate'"
  ):
    RunConfig.from_yaml(bad)


def test_fused_attention_equals_xla_for_one_document_per_row():
  rng = np.random.default_rng(0)
  b, t, n, kv, h = 2, 24, 8, 2, 16
  q = jnp.asarray(rng.standard_normal((b, t, n, h)), jnp.float32)
  k = jnp.asarray(rng.standard_normal((b, t, kv, h)), jnp.float32)
  v = jnp.asarray(rng.standard_normal((b, t, kv, h)), jnp.float32)
  seg = np.ones((b, t), np.int32)
  seg[1, 17:] = 0  # right padding
  seg = jnp.asarray(seg)
  xla = attention.attention(q, k, v, segment_ids=seg, scale=0.25)
  # cuDNN's kernel needs a GPU; jax.nn's XLA version computes the same function.
  fused = jax.nn.dot_product_attention(q, k, v, scale=0.25, is_causal=True, implementation="xla")
  real = np.asarray(seg).astype(bool)  # outputs at padding positions are never used
  np.testing.assert_allclose(np.asarray(fused)[real], np.asarray(xla)[real], rtol=1e-5, atol=1e-5)
  assert jax.default_backend() == "cpu"


def test_a_real_model_on_cpus_alone_gets_a_laptops_batch_and_length():
  """On a machine without an accelerator (this one, with 8 CPU devices), a real model's run
  takes two rows a device and rows of at most 256 tokens where the user left them unset, and
  says so; what the user set stays; the built-in default run keeps its own settings."""
  from jaxtune.run import session

  run, note = session._cpu_defaults(RunConfig(model="org/name", batch_size=32).checked(), set())
  assert (run.batch_size, run.seq_len, session.cpu_seq_cap(run, note)) == (16, None, 256)
  assert note == " (CPU only: --batch-size 16, --seq-len at most 256; set them to override)"
  run, note = session._cpu_defaults(RunConfig(model="m", batch_size=32).checked(), {"batch_size"})
  assert run.batch_size == 32 and note == " (CPU only: --seq-len at most 256; set them to override)"
  mine = RunConfig(model="m", batch_size=64, seq_len=512).checked()
  assert session._cpu_defaults(mine, None) == (mine, "")  # differs from the defaults: given
  toy = RunConfig().checked()
  assert session._cpu_defaults(toy, set()) == (toy, "")
  grpo = RunConfig(model="m", method="grpo", reward="length").checked()
  assert "seq-len" not in session._cpu_defaults(grpo, set())[1]  # rows fit the completions


def test_the_python_apis_sentences_name_settings_as_keywords():
  from jaxtune.run.api import python_names

  assert python_names(
    "--resume: the checkpoints were trained with --batch-size 8; pass --allow-changes, or "
    "fix --no-such-flag and --lora-targets."
  ) == (
    "resume=True: the checkpoints were trained with batch_size 8; pass allow_changes=True, or "
    "fix --no-such-flag and lora_targets."
  )
  assert python_names("seq-len 256 and e--mesh") == "seq-len 256 and e--mesh"
