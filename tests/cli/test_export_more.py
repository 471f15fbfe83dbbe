"""Exports, continued: the merge into the original weights (the same model as the PEFT adapter),
one dtype in config.json, --push-to-hub without a network, damaged run files and symlinked
--out, exporting a checkpoint without a run, --help before JAX, gguf-py's chatter, and GGUF
exports killed or out of disk space."""

import errno
import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from conftest import run_cli
from safetensors.numpy import load_file
from test_catalogue import TINY, Work, _assert_one_sentence, _snapshot, _write_tiny_model

import jaxtune
from converters import model_card
from converters.synthetic import write_random_checkpoint
from jaxtune import export as export_cli
from jaxtune.errors import ExportError, UserError
from jaxtune.hf import export
from jaxtune.hf.write import merged_weight, model_tensors

REPO = Path(__file__).resolve().parents[2]


def _adapted(path: Path):
  """The checkpoint in NF4 with rank-4 LoRA on every projection, B random (not zero)."""
  model = jaxtune.apply_lora(jaxtune.from_pretrained(path, dtype="float32"), rank=4, alpha=8)
  rng = np.random.default_rng(1)
  for _, linear in jaxtune.models.lora.iter_linears(model):
    if linear.lora_b is not None:
      b = 0.05 * rng.standard_normal(linear.lora_b[...].shape)
      linear.lora_b[...] = jnp.asarray(b, jnp.float32)
  return model


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
  """test_catalogue's tiny checkpoint (float32, the built-in tokenizer)."""
  return _write_tiny_model(tmp_path_factory.mktemp("export") / "model")


@pytest.fixture(scope="module")
def adapted(tiny_model):
  return _adapted(tiny_model)


def _main(argv: list[str]) -> int:
  try:
    return export_cli.main(argv)
  except SystemExit as e:  # argparse
    return e.code


# 1. The merge into the original weights


@pytest.mark.slow
def test_merged_export_is_the_peft_adapter_merged_into_the_original_weights(
  adapted,
  tiny_model,
  tmp_path,
):
  from peft import PeftModel
  from transformers import AutoModelForCausalLM

  export.write(adapted, "merged", tmp_path / "merged", "float32")  # merge_into="original"
  export.write(adapted, "peft", tmp_path / "peft")
  base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
  peft_merged = PeftModel.from_pretrained(base, tmp_path / "peft").merge_and_unload()
  want = {k: v.detach().numpy() for k, v in peft_merged.state_dict().items()}
  got = load_file(tmp_path / "merged" / "model.safetensors")
  assert got.keys() == want.keys()
  for name, w in want.items():
    assert np.abs(got[name] - w).max() <= 1e-5 * np.abs(w).max(), name

  # merge_into="dequantized": today's export, the model as it computes (NF4 base), which is
  # far from the PEFT model.
  export.write(adapted, "merged", tmp_path / "deq", "float32", merge_into="dequantized")
  deq = load_file(tmp_path / "deq" / "model.safetensors")
  for name, _, layer, entry, node in model_tensors(adapted):
    if entry.kind == "linear":
      assert np.array_equal(deq[name], np.asarray(merged_weight(node, layer))), name
  q = "model.layers.0.self_attn.q_proj.weight"
  assert np.abs(deq[q] - want[q]).max() > 100 * 1e-5 * np.abs(want[q]).max()


def test_a_bnb_4bit_source_merges_into_its_dequantized_weights_and_says_so(tmp_path, capfd):
  src = write_random_checkpoint(tmp_path / "bnb", TINY, dtype="float32", bnb_4bit=True)
  model = _adapted(src)
  capfd.readouterr()
  export.write(model, "merged", tmp_path / "a", "float32")
  err = capfd.readouterr().err
  assert err == (
    "jaxtune: the source bnb is a bnb-4bit checkpoint, with no original weights: merged into "
    "its dequantized weights\n"
  )
  export.write(model, "merged", tmp_path / "b", "float32", merge_into="dequantized")
  assert capfd.readouterr().err == ""
  a, b = (load_file(tmp_path / d / "model.safetensors") for d in ("a", "b"))
  assert all(np.array_equal(a[k], b[k]) for k in b)
  assert "quantization_config" not in json.loads((tmp_path / "a" / "config.json").read_text())


def test_a_source_gone_since_loading_is_one_sentence_and_nothing_is_left(tiny_model, tmp_path):
  src = shutil.copytree(tiny_model, tmp_path / "model")
  model = _adapted(src)
  (src / "model.safetensors").unlink()
  with pytest.raises(ExportError) as info:
    export.write(model, "merged", tmp_path / "out")
  message = str(info.value)
  assert message.startswith(f"merging into the original weights reads {src} again, and no ")
  assert message.endswith("or merge into the dequantized weights (--merge-into dequantized).")
  assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]
  with pytest.raises(ExportError, match="--merge-into must be original or dequantized"):
    export.write(model, "merged", tmp_path / "out", merge_into="nf4")


# 2. One dtype in config.json


def test_merged_config_names_one_dtype_and_transformers_loads_it_so(adapted, tmp_path):
  from transformers import AutoModelForCausalLM

  source = json.loads((Path(adapted.provenance.checkpoint_dir) / "config.json").read_text())
  out = export.write(adapted, "merged", tmp_path / "m", "bfloat16")
  config = json.loads((out / "config.json").read_text())
  assert config["dtype"] == config["torch_dtype"] == "bfloat16" != source["torch_dtype"]
  assert AutoModelForCausalLM.from_pretrained(out).dtype == torch.bfloat16


def test_a_base_config_with_its_own_dtype_gets_the_exports(tiny_model, tmp_path):
  src = shutil.copytree(tiny_model, tmp_path / "model")
  config = json.loads((src / "config.json").read_text())
  (src / "config.json").write_text(json.dumps({**config, "dtype": "float32"}))  # as HF 5 saves
  model = jaxtune.from_pretrained(src, dtype="float32")
  out = export.write(model, "merged", tmp_path / "m", "bfloat16")
  config = json.loads((out / "config.json").read_text())
  assert config["dtype"] == config["torch_dtype"] == "bfloat16"


# 3. --push-to-hub without a network, or refused

_PUSH = """
import os, sys, threading
from http.server import BaseHTTPRequestHandler, HTTPServer
if sys.argv[2] != "closed":
  class Refuse(BaseHTTPRequestHandler):
    def do_GET(self):
      self.send_response(int(sys.argv[2]))
      self.send_header("Content-Type", "application/json")
      self.end_headers()
      self.wfile.write(b'{"error": "Invalid credentials in Authorization header"}')
    do_POST = do_GET
    def log_message(self, *args):
      pass
  server = HTTPServer(("127.0.0.1", 0), Refuse)
  threading.Thread(target=server.serve_forever, daemon=True).start()
  os.environ["HF_ENDPOINT"] = f"http://127.0.0.1:{server.server_port}"
from converters import hub
try:
  hub.push(sys.argv[1], "me/tiny-llama")
except hub.ExportError as e:
  print(e)
"""


@pytest.mark.parametrize("answer", ["closed", "401", "403"])
def test_push_without_network_or_refused_is_one_sentence_keeping_the_export(tmp_path, answer):
  folder = tmp_path / "export"
  folder.mkdir()
  (folder / "model.safetensors").write_bytes(b"weights")
  env = {
    **os.environ,
    "HF_HOME": str(tmp_path / "hf-home"),
    "HF_TOKEN": "hf_stand_in",
    "HF_HUB_OFFLINE": "0",
    "HF_ENDPOINT": "http://127.0.0.1:9",  # nothing listens on the discard port
  }
  child = subprocess.run(
    [sys.executable, "-c", _PUSH, str(folder), answer],
    capture_output=True,
    text=True,
    env=env,
    cwd=REPO,
    timeout=120,
  )
  said = child.stdout.strip()
  assert child.returncode == 0 and "Traceback" not in child.stderr, child.stderr[-2000:]
  later = f"; the export is in {folder}; push it later with `hf upload me/tiny-llama {folder}`."
  if answer == "closed":
    _assert_one_sentence(
      f"error: {said}",
      r"^error: --push-to-hub could not reach the Hub at http://127\.0\.0\.1:9 to push "
      r"me/tiny-llama \(connection refused\)",
    )
  else:
    assert said.startswith(
      f"the Hub refused to push me/tiny-llama (HTTP {answer}: check that the token may write"
    ), said
  assert said.endswith(later), said
  assert (folder / "model.safetensors").read_bytes() == b"weights"


# 4. Damaged run files, symlinked --out


def test_damaged_run_files_are_one_sentence_and_a_half_written_last_metrics_row_is_skipped(
  tiny_model,
  tmp_path,
):
  run = Work(tmp_path, tiny_model).fake_run()
  metrics = run / "metrics.jsonl"
  rows = [{"step": 1, "loss": 2.5}, {"step": 2, "loss": 2.25}]
  metrics.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 3, "lo')
  assert "| final train loss | 2.2500 |" in model_card.render(run, "merged")
  metrics.write_text(json.dumps(rows[0]) + '\n{"step": 2, "lo\n' + json.dumps(rows[1]) + "\n")
  with pytest.raises(UserError, match=rf"^{metrics} line 2 is damaged \(not a JSON object\)"):
    model_card.render(run, "merged")
  metrics.write_text("".join(json.dumps(r) + "\n" for r in rows))
  (run / "run.json").write_text('{"command": "python -m jaxtune.train", "mod')
  with pytest.raises(UserError, match=rf"^{run / 'run.json'} is damaged \(not a JSON object\)"):
    model_card.render(run, "merged")


def test_export_command_with_a_damaged_run_json_changes_nothing(tiny_model, tmp_path, capsys):
  work = Work(tmp_path, tiny_model)
  run = work.fake_run()
  (run / "run.json").write_text("{")
  before = _snapshot(tmp_path)
  capsys.readouterr()
  assert _main(["--checkpoint", str(run), "--out", str(tmp_path / "e")]) == 2
  _assert_one_sentence(capsys.readouterr().err, r"run\.json is damaged \(not a JSON object\)")
  assert _snapshot(tmp_path) == before


def test_a_symlinked_out_is_refused_before_anything_is_written(
  adapted,
  tiny_model,
  tmp_path,
  capsys,
):
  target = tmp_path / "real"
  export.write(adapted, "peft", target)
  link = tmp_path / "link"
  link.symlink_to(target)
  before = _snapshot(tmp_path)
  with pytest.raises(ExportError, match=rf"^--out {link} is a symbolic link \(to {target}\);"):
    export.write(adapted, "peft", link, overwrite=True)
  assert _snapshot(tmp_path) == before
  model_dir = shutil.copytree(tiny_model, tmp_path / "model")
  before = _snapshot(tmp_path)
  capsys.readouterr()
  argv = ["--model", str(model_dir), "--format", "gguf", "--out", str(link), "--overwrite"]
  assert _main(argv) == 2
  _assert_one_sentence(capsys.readouterr().err, rf"--out {link} is a symbolic link")
  assert _snapshot(tmp_path) == before and os.readlink(link) == str(target)


def test_a_failed_replacement_leaves_no_temporaries(adapted, tmp_path, monkeypatch):
  out = tmp_path / "export"
  export.write(adapted, "peft", out)
  first = _snapshot(tmp_path)

  def interrupted(self, target):  # the new export's rename, interrupted
    if self.name.endswith(".tmp"):
      raise KeyboardInterrupt
    return real_rename(self, target)

  real_rename = Path.rename
  monkeypatch.setattr(Path, "rename", interrupted)
  with pytest.raises(KeyboardInterrupt):
    export.write(adapted, "peft", out, overwrite=True)
  monkeypatch.undo()
  assert _snapshot(tmp_path) == first  # the previous export back in place, nothing beside it


# 5. A checkpoint exported without a run


def test_a_checkpoint_exports_without_a_run(tiny_model, tmp_path, capsys):
  assert (
    _main(["--model", str(tiny_model), "--out", str(tmp_path / "m"), "--dtype", "float32"]) == 0
  )
  assert f"exported {tiny_model} as merged to" in capsys.readouterr().out
  got = load_file(tmp_path / "m" / "model.safetensors")
  want = load_file(tiny_model / "model.safetensors")
  assert got.keys() == want.keys() and all(np.array_equal(got[k], want[k]) for k in want)
  meta, body = model_card.read_card((tmp_path / "m" / "README.md").read_text())
  assert meta["base_model"] == str(tiny_model) and "not fine-tuned" in body

  assert _main(["--model", str(tiny_model), "--format", "gguf", "--out", str(tmp_path / "g")]) == 0
  assert sorted(p.name for p in (tmp_path / "g").iterdir()) == ["README.md", "model-f16.gguf"]
  meta, _ = model_card.read_card((tmp_path / "g" / "README.md").read_text())
  assert meta["library_name"] == "gguf"


@pytest.mark.parametrize(
  ("argv", "match"),
  [
    (["--model", "M", "--format", "peft"], r"--format peft writes a run's adapters, and --model "),
    (["--model", "M", "--checkpoint", "R"], r"argument --checkpoint: not allowed with argument"),
    ([], r"one of the arguments --checkpoint --model is required"),
    (["--checkpoint", "R", "--format", "peft", "--merge-into", "original"], r"merges nothing"),
  ],
  ids=["peft-without-a-run", "both", "neither", "peft-merge-into"],
)
def test_the_source_flags_are_checked_first(tiny_model, tmp_path, capsys, argv, match):
  named = {"M": str(tiny_model), "R": str(Work(tmp_path, tiny_model).fake_run())}
  before = _snapshot(tmp_path)
  capsys.readouterr()
  assert _main([named.get(a, a) for a in argv] + ["--out", str(tmp_path / "x")]) == 2
  _assert_one_sentence(capsys.readouterr().err, match)
  assert _snapshot(tmp_path) == before


# 6. --help before JAX


def test_help_renders_every_flag_without_importing_jax():
  child = subprocess.run(
    [sys.executable, "-m", "jaxtune.export", "--help"],
    capture_output=True,
    text=True,
    cwd=REPO,
    timeout=120,
  )
  assert child.returncode == 0, child.stderr
  for flag in ("--checkpoint", "--model", "--merge-into", "--gguf-type", "--no-compile-cache"):
    assert flag in child.stdout
  assert "%(" not in child.stdout and "{'" not in child.stdout
  code = """
import sys
from jaxtune.export import parser
try:
  parser().parse_args(["--help"])
except SystemExit:
  pass
light = ("converters", "converters.errors")  # the UserError hierarchy: imports nothing
print(sorted(m for m in sys.modules if m.split(".")[0] in ("jax", "flax", "converters")
             and m not in light))
"""
  child = subprocess.run(
    [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120
  )
  said = child.stdout.strip().splitlines()[-1]  # after the help text
  assert child.returncode == 0 and said == "[]", child.stdout + child.stderr


def test_the_command_lines_choices_are_the_converters():
  from jaxtune.hf.gguf import GGUF_TYPES

  assert export_cli.FORMATS == export.FORMATS
  assert export_cli.GGUF_TYPES == tuple(GGUF_TYPES)


# 7. gguf-py's chatter


def test_gguf_export_keeps_gguf_py_warnings_off_the_terminal(tiny_model, tmp_path, caplog):
  import gguf

  src = shutil.copytree(tiny_model, tmp_path / "model")
  spec = json.loads((src / "tokenizer.json").read_text())
  a, b = ({"Sequence": {"id": s, "type_id": 0}} for s in "AB")
  spec["post_processor"] = {  # a separator gguf-py does not know, as Llama 3's and SmolLM2's
    "type": "TemplateProcessing",
    "single": [a],
    "pair": [a, {"SpecialToken": {"id": "<|user|>", "type_id": 0}}, b],
    "special_tokens": {"<|user|>": {"id": "<|user|>", "ids": [3], "tokens": ["<|user|>"]}},
  }
  (src / "tokenizer.json").write_text(json.dumps(spec))
  with caplog.at_level(logging.WARNING):
    gguf.SpecialVocab(src, load_merges=True)
  assert "Unknown separator token '<|user|>'" in caplog.text  # gguf-py does say it
  caplog.clear()
  model = jaxtune.from_pretrained(src, dtype="float32")
  with caplog.at_level(logging.WARNING):
    export.write(model, "gguf", tmp_path / "g")
  assert not [r for r in caplog.records if r.name.startswith("gguf")], caplog.text
  assert logging.getLogger("gguf").level == logging.NOTSET  # as it was


# 8. GGUF exports killed or out of disk space


def test_disk_full_during_a_gguf_export_keeps_the_previous_one(adapted, tmp_path, monkeypatch):
  import gguf

  out = tmp_path / "export"
  export.write(adapted, "gguf", out)
  before = _snapshot(tmp_path)
  real = gguf.GGUFWriter.write_tensor_data
  written = []

  def fills_the_disk(self, tensor, *args, **kwargs):
    if written:
      raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    written.append(tensor.nbytes)
    return real(self, tensor, *args, **kwargs)

  monkeypatch.setattr(gguf.GGUFWriter, "write_tensor_data", fills_the_disk)
  with pytest.raises(ExportError) as info:
    export.write(adapted, "gguf", out, overwrite=True, gguf_type="f16")
  assert str(info.value) == (
    f"writing the export to {out} failed (the disk is full); nothing was changed there: free "
    "some space or choose another --out."
  )
  assert written and _snapshot(tmp_path) == before


# Killed by SIGKILL while writing its second tensor's data.
_KILLED = """
import os, signal, sys
import gguf
from jaxtune.export import main
real = gguf.GGUFWriter.write_tensor_data
count = []
def dies(self, *args, **kwargs):
  count.append(1)
  if len(count) == 2:
    os.kill(os.getpid(), signal.SIGKILL)
  return real(self, *args, **kwargs)
gguf.GGUFWriter.write_tensor_data = dies
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_a_killed_gguf_export_run_again_leaves_nothing_and_the_same_bytes(
  tiny_model,
  tmp_path,
):
  out = tmp_path / "exports" / "g"
  argv = ["--model", str(tiny_model), "--format", "gguf", "--gguf-type", "q8_0", "--out"]
  proc = run_cli([sys.executable, "-c", _KILLED, *argv, str(out)], cwd=REPO, timeout=600)
  assert proc.returncode == -9, proc.stderr[-2000:]
  (left,) = (tmp_path / "exports").iterdir()  # the killed export's temporary directory
  assert left.name.startswith(".g.") and left.name.endswith(".tmp")
  assert _main([*argv, str(out)]) == 0
  assert sorted(p.name for p in (tmp_path / "exports").iterdir()) == ["g"]
  assert _main([*argv, str(tmp_path / "again")]) == 0
  for name in ("model-q8_0.gguf", "README.md"):
    assert (out / name).read_bytes() == (tmp_path / "again" / name).read_bytes(), name
