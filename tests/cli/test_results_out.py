"""Results out: the model card every export carries, file modes, the export command's default
format, and --push-to-hub against a stand-in for the Hub API (and offline)."""

import glob
import json
import os
import stat
import struct
import subprocess
import sys

import pytest
from conftest import background_run, command_line_env, compile_cache_env, run_cli

from converters import hub, model_card
from jaxtune.errors import ExportError
from jaxtune.export import main as export_main

# The run the tests below read, made from Python (jaxtune.train) in a process of its own
# beside the other tests: its umask 022, W&B in offline mode.
_TRAIN_FROM_PYTHON = """
import os, sys
import jaxtune
os.umask(0o022)
jaxtune.train(out=sys.argv[1], steps=3, eval_split=0.1, eval_prompts=sys.argv[2],
              report_to="tensorboard,wandb")
"""


@background_run("trained")
def _trained(directory, runs):
  """A short run of the built-in model with its merged export, reported to TensorBoard and to
  W&B in offline mode, with an eval generation: its run directory."""
  (directory / "prompts.txt").write_text("What is 2 plus 3?\n")
  env = command_line_env(dict(os.environ))
  env.update(WANDB_MODE="offline", WANDB_SILENT="true", WANDB_PROJECT="jaxtune-tests")
  argv = [sys.executable, "-c", _TRAIN_FROM_PYTHON, str(directory / "run")]
  proc = run_cli([*argv, str(directory / "prompts.txt")], env=compile_cache_env(env, "background"))
  assert proc.returncode == 0, proc.stderr[-3000:]
  return directory / "run"


@pytest.mark.slow
def test_every_export_has_a_model_card_with_metadata_and_results(trained):
  meta, body = model_card.read_card((trained / "export" / "README.md").read_text())
  config = (trained / "config.yaml").read_text()
  assert meta["library_name"] == "transformers" and meta["pipeline_tag"] == "text-generation"
  assert {"jaxtune", "lora", "qlora", "nf4"} <= set(meta["tags"])
  assert f"model: {meta['base_model']}" in config  # no Hub id here: the local checkpoint
  assert "datasets" not in meta and "license" not in meta  # a local file; no base card
  rows = [json.loads(x) for x in (trained / "metrics.jsonl").read_text().splitlines()]
  train = [r for r in rows if "loss" in r]
  evals = [r for r in rows if "eval_loss" in r]
  assert f"| final train loss | {train[-1]['loss']:.4f} |" in body
  assert f"| final eval loss | {evals[-1]['eval_loss']:.4f} |" in body
  assert "| steps | 3 |" in body and "cpu" in body.lower()
  assert "jaxtune.train(" in body  # the command, as given from Python


@pytest.mark.slow
def test_export_files_get_the_usual_modes(trained):
  export = trained / "export"
  assert stat.S_IMODE(export.stat().st_mode) == 0o755
  for path in export.iterdir():
    assert stat.S_IMODE(path.stat().st_mode) == 0o644, path


@pytest.mark.slow
def test_export_command_defaults_to_merged_with_a_card(trained, tmp_path, capsys):
  out = tmp_path / "again"
  assert export_main(["--checkpoint", str(trained), "--out", str(out)]) == 0
  assert (out / "model.safetensors").is_file() and "as merged" in capsys.readouterr().out
  meta, _ = model_card.read_card((out / "README.md").read_text())
  assert meta["library_name"] == "transformers"
  assert (
    export_main(["--checkpoint", str(trained), "--out", str(tmp_path / "p"), "--format", "peft"])
    == 0
  )
  meta, _ = model_card.read_card((tmp_path / "p" / "README.md").read_text())
  assert meta["library_name"] == "peft"


def test_hub_ids_and_license_are_found(tmp_path):
  assert model_card.base_hub_id("meta-llama/Llama-3.2-1B") == "meta-llama/Llama-3.2-1B"
  snapshot = "/cache/hub/models--Qwen--Qwen2.5-0.5B/snapshots/abc123"
  assert model_card.base_hub_id(None, snapshot) == "Qwen/Qwen2.5-0.5B"
  assert model_card.base_hub_id(str(tmp_path)) is None and model_card.base_hub_id("./x/y") is None
  (tmp_path / "README.md").write_text("---\nlicense: apache-2.0\ntags: [a]\n---\n# Base\n")
  assert model_card.base_license(tmp_path) == "apache-2.0"


class StandInHub:
  """Records what jaxtune asks of the Hub API (HfApi's methods it uses)."""

  def __init__(self):
    self.calls = []

  def whoami(self):
    return {"name": "me"}

  def create_repo(self, repo_id, private, repo_type, exist_ok):
    self.calls.append(("create_repo", repo_id, private, repo_type, exist_ok))
    return f"https://huggingface.co/{repo_id}"

  def upload_folder(self, repo_id, folder_path, repo_type, commit_message):
    files = sorted(os.listdir(folder_path))
    self.calls.append(("upload_folder", repo_id, repo_type, files))


@pytest.mark.slow
def test_push_to_hub_creates_the_repo_and_uploads_the_export(trained):
  api = StandInHub()
  url = hub.push(trained / "export", "me/tiny-llama", private=True, api=api)
  assert url == "https://huggingface.co/me/tiny-llama"
  assert api.calls[0] == ("create_repo", "me/tiny-llama", True, "model", True)
  name, repo, kind, files = api.calls[1]
  assert (name, repo, kind) == ("upload_folder", "me/tiny-llama", "model")
  assert {"README.md", "model.safetensors", "config.json"} <= set(files)


@pytest.mark.slow
def test_push_to_hub_offline_or_without_credentials_keeps_the_export(trained):
  export = trained / "export"
  code = f"""
from converters import hub
try:
  hub.push({str(export)!r}, "me/tiny-llama")
except hub.ExportError as e:
  print(e)
"""
  for env, why in (
    ({"HF_TOKEN": "hf_stand_in", "HF_HUB_OFFLINE": "1"}, "cannot reach the Hub"),
    ({"HF_HUB_OFFLINE": "1", "HF_TOKEN": ""}, "needs Hub credentials"),
  ):
    child = subprocess.run(
      [sys.executable, "-c", code],
      capture_output=True,
      text=True,
      env={**os.environ, "HF_HOME": str(trained / "hf-home"), **env},
      timeout=120,
    )
    said = child.stdout.strip()
    assert why in said and f"the export is in {export}" in said, child.stderr[-1000:]
    assert f"hf upload me/tiny-llama {export}" in said
  assert (export / "model.safetensors").is_file()
  with pytest.raises(ExportError, match="takes ORG/NAME"):
    hub.push(export, "no-slash", api=StandInHub())


def _wandb_records(path: str) -> list:
  """The records of an offline W&B run file (.wandb: a ':W&B' header, then 32 KiB blocks of
  records, each with a 7-byte header: checksum, length, kind 1 full / 2 first / 3 middle /
  4 last), parsed as W&B's own protobuf Record."""
  from wandb.proto import wandb_internal_pb2

  data = open(path, "rb").read()
  assert data[:4] == b":W&B"
  pos, block, out, part = 7, 32768, [], b""
  while pos + 7 <= len(data):
    left = block - pos % block
    if left < 7:
      pos += left
      continue
    _, n, kind = struct.unpack("<IHB", data[pos : pos + 7])
    if kind == 0:
      pos += left
      continue
    part += data[pos + 7 : pos + 7 + n]
    pos += 7 + n
    if kind in (1, 4):
      record = wandb_internal_pb2.Record()
      record.ParseFromString(part)
      out.append(record)
      part = b""
  return out


@pytest.mark.slow
def test_wandb_offline_run_logs_what_tensorboard_gets(trained):
  (path,) = glob.glob(str(trained / "wandb" / "offline-run-*" / "*.wandb"))
  records = _wandb_records(path)
  logged = {}
  for r in records:
    if r.WhichOneof("record_type") == "history":
      items = {i.key or "/".join(i.nested_key): i.value_json for i in r.history.item}
      logged.setdefault(int(items["_step"]), {}).update(items)
  rows = [json.loads(x) for x in (trained / "metrics.jsonl").read_text().splitlines()]
  for row in rows:
    if "loss" in row:
      assert float(logged[row["step"]]["train/loss"]) == pytest.approx(row["loss"])
      assert float(logged[row["step"]]["train/grad_norm"]) == pytest.approx(row["grad_norm"])
    if "eval_loss" in row:
      assert float(logged[row["step"]]["eval/loss"]) == pytest.approx(row["eval_loss"])
      assert json.loads(logged[row["step"]]["eval/generations/nrows"]) == 1
  (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
  config = {i.key: i.value_json for i in run.config.update}
  assert json.loads(config["learning_rate"]) == 2e-3 and "cpu" in config["hardware"].lower()
  assert (
    run.project == "jaxtune-tests" and (trained / "wandb-run-id").read_text().strip() == run.run_id
  )
