"""A mixture of experts through the command line: a tiny gpt-oss checkpoint (sinks, sliding
layers, biased router and experts) trained under a 2x4 mesh, the load-balancing loss in the
metrics, the merged export read back by transformers with jaxtune's logits."""

import json
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import background_run, max_rel_err, run_cli, torch_logits

import jaxtune
from jaxtune.run import default_model

_WRITE = (  # in a process of its own: torch's seed is global, and this job runs in a thread
  "import sys, shutil, pathlib; sys.path[:0] = ['..', '../models']; "
  "from test_moe_families import write_moe; from jaxtune.run import default_model; "
  "d = pathlib.Path(sys.argv[1]); "
  "path, _ = write_moe(d, 'gpt_oss', seed=7, vocab_size=512, num_key_value_heads=4); "
  "[shutil.copy(f, path / f.name) for f in default_model.ensure_default_checkpoint().iterdir() "
  "if f.name.startswith('tokenizer') or f.name == 'chat_template.jinja']; print(path)"
)


@background_run("moe_cli_run")
def _moe_cli_run(directory, runs):
  """A tiny gpt-oss checkpoint written, then trained 2 steps by `python -m jaxtune.train`
  under --mesh 2x4 with a merged export. Returns (run directory, the finished process)."""
  made = run_cli([sys.executable, "-c", _WRITE, str(directory)], cwd=Path(__file__).parent)
  assert made.returncode == 0, made.stderr[-3000:]
  path = made.stdout.strip().splitlines()[-1]
  out = directory / "run"
  argv = [
    sys.executable, "-m", "jaxtune.train", "--model", path, "--data",
    str(default_model.DATASET), "--steps", "2", "--mesh", "2x4", "--out", str(out),
    "--export", "merged", "--seq-len", "64", "--batch-size", "4", "--dtype", "float32",
  ]  # fmt: skip
  return out, run_cli(argv)


@pytest.mark.slow
def test_gpt_oss_trains_under_a_mesh_and_its_export_reloads(moe_cli_run):
  import torch
  from transformers import AutoModelForCausalLM

  out, proc = moe_cli_run
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "gpt_oss 3 layers" in proc.stdout and "'tensor': 4" in proc.stdout, proc.stdout
  rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in rows] == [1, 2]
  assert all(np.isfinite(r["loss"]) and 1.0 < r["router_balance"] < 4.0 for r in rows)
  hf = AutoModelForCausalLM.from_pretrained(
    out / "export", dtype=torch.float32, attn_implementation="eager"
  ).eval()
  ours = jaxtune.from_pretrained(out / "export", quantization=None, dtype="float32")
  ids = np.random.default_rng(0).integers(0, 512, (2, 12))
  assert max_rel_err(ours(jnp.asarray(ids)), torch_logits(hf, ids)) <= 1e-5
