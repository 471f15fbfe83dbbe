"""A user's mistakes get one clear sentence, not a traceback from deep inside a library."""

import json
import shutil

import pytest

import jaxtune
from jaxtune import CheckpointError, ConfigError


def test_missing_directory(tmp_path):
  with pytest.raises(CheckpointError, match="does not exist"):
    jaxtune.from_pretrained(tmp_path / "nope")


def test_missing_config(tmp_path):
  (tmp_path / "model.safetensors").write_bytes(b"")
  with pytest.raises(ConfigError, match="no config.json"):
    jaxtune.from_pretrained(tmp_path)


def test_no_safetensors(hf_llama_dir):
  path, _ = hf_llama_dir()
  for f in path.glob("*.safetensors"):
    f.unlink()
  with pytest.raises(CheckpointError, match="no \\*.safetensors"):
    jaxtune.from_pretrained(path)


def test_unsupported_model_type(hf_llama_dir):
  path, _ = hf_llama_dir()
  cfg = json.loads((path / "config.json").read_text())
  cfg["model_type"] = "mamba"
  (path / "config.json").write_text(json.dumps(cfg))
  with pytest.raises(ConfigError, match="'mamba' is not supported; jaxtune supports llama"):
    jaxtune.from_pretrained(path)


def test_shape_mismatch_names_the_tensor(hf_llama_dir):
  path, _ = hf_llama_dir()
  cfg = json.loads((path / "config.json").read_text())
  cfg["intermediate_size"] = 256
  (path / "config.json").write_text(json.dumps(cfg))
  with pytest.raises(CheckpointError, match=r"mlp\.(gate|up|down)_proj\.weight has shape"):
    jaxtune.from_pretrained(path)


def test_fewer_layers_in_config_than_checkpoint(hf_llama_dir):
  path, _ = hf_llama_dir()
  cfg = json.loads((path / "config.json").read_text())
  cfg["num_hidden_layers"] = 2
  (path / "config.json").write_text(json.dumps(cfg))
  with pytest.raises(CheckpointError, match="is for layer 2"):
    jaxtune.from_pretrained(path)


def test_missing_tensor_is_named(hf_llama_dir):
  path, _ = hf_llama_dir()
  cfg = json.loads((path / "config.json").read_text())
  cfg["num_hidden_layers"] = 4
  (path / "config.json").write_text(json.dumps(cfg))
  with pytest.raises(CheckpointError, match="lacks weights for"):
    jaxtune.from_pretrained(path, quantization=None)


@pytest.mark.parametrize("keep", [0.5, 0.999])
def test_truncated_safetensors(hf_llama_dir, keep):
  path, _ = hf_llama_dir()
  f = next(path.glob("*.safetensors"))
  data = f.read_bytes()
  f.write_bytes(data[: int(len(data) * keep)])
  with pytest.raises(CheckpointError, match="truncated or corrupt"):
    jaxtune.from_pretrained(path)


def test_garbage_header(hf_llama_dir):
  path, _ = hf_llama_dir()
  f = next(path.glob("*.safetensors"))
  f.write_bytes(b"\xff" * 64)
  with pytest.raises(CheckpointError, match="truncated or corrupt"):
    jaxtune.from_pretrained(path)


def test_sharded_index_with_missing_file(hf_llama_dir):
  path, _ = hf_llama_dir(max_shard_size="100KB")
  victim = sorted(path.glob("*.safetensors"))[-1]
  shutil.move(victim, path.parent / "moved.safetensors")
  with pytest.raises(CheckpointError, match="download is incomplete"):
    jaxtune.from_pretrained(path)


def test_nonexistent_hub_id_offline(monkeypatch):
  monkeypatch.setenv("HF_HUB_OFFLINE", "1")
  with pytest.raises(CheckpointError, match="neither a local directory nor a reachable"):
    jaxtune.from_pretrained("no-such-org/no-such-model")
